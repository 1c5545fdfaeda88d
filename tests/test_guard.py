"""The calibrated conversion's guard (``conversion/calibration/guard.py``): a candidate replaces the weight-only fit
only when its per-image gain on the held-out images is resolved by a seeded bootstrap interval; the held-out draw and
the verdict are reproducible by seed."""
from __future__ import annotations

import copy

import pytest
import torch

import collab_vit
from collab_vit.conversion.calibration import recipe
from collab_vit.conversion.calibration.guard import RESAMPLES, held_out_split, judge
from test_calibration import convert, images, tiny_deit

pytestmark = pytest.mark.usefixtures("one_thread")


def kls(n: int, mean_gain: float, spread: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-image KLs of weight-only and of a candidate whose gain is ``mean_gain`` give or take ``spread``."""
    g = torch.Generator().manual_seed(seed)
    weight = 0.5 + torch.rand(n, generator=g, dtype=torch.float64)
    noise = torch.randn(n, generator=g, dtype=torch.float64)
    gains = mean_gain + spread * (noise - noise.mean()) / noise.std()
    return weight, weight - gains


def test_a_consistent_win_is_kept() -> None:
    weight, candidate = kls(32, 0.05, 0.01)
    verdict = judge("whitened+refine", weight, candidate, 0.95, seed=0)
    assert verdict.kept and verdict.low > 0 and verdict.low < verdict.gain < verdict.high
    assert verdict.gain == pytest.approx(0.05)


def test_a_win_inside_the_noise_is_refused() -> None:
    """A mean gain of a tenth of the per-image spread on 32 images: positive, so the old rule (strictly lower mean
    KL) took it; the interval straddles zero, so the guard returns the weight-only fit."""
    weight, candidate = kls(32, 0.01, 0.1)
    assert candidate.mean() < weight.mean()  # what the old rule went by
    verdict = judge("whitened", weight, candidate, 0.95, seed=0)
    assert not verdict.kept and verdict.low < 0 < verdict.high


def test_the_interval_is_reproducible_and_narrows_with_confidence() -> None:
    weight, candidate = kls(16, 0.02, 0.05)
    a, b = judge("x", weight, candidate, 0.95, 3), judge("x", weight, candidate, 0.95, 3)
    assert a == b
    wide, narrow = judge("x", weight, candidate, 0.99, 3), judge("x", weight, candidate, 0.5, 3)
    assert wide.low <= a.low <= narrow.low and narrow.high <= a.high <= wide.high
    assert RESAMPLES >= 1000


def test_one_held_out_image_is_its_own_interval() -> None:
    verdict = judge("x", torch.tensor([0.3], dtype=torch.float64), torch.tensor([0.1], dtype=torch.float64), 0.95, 0)
    assert verdict.kept and verdict.low == verdict.high == pytest.approx(0.2)


def test_held_out_draw_is_by_seed() -> None:
    assert torch.equal(held_out_split(40, 0), held_out_split(40, 0))
    assert not torch.equal(held_out_split(40, 0), held_out_split(40, 1))
    assert sorted(held_out_split(40, 5).tolist()) == list(range(40))


def test_the_recipe_reports_the_guard_and_returns_weight_only_when_it_refuses(monkeypatch) -> None:
    """End to end: the report carries the verdict; with the interval made to straddle zero the weight-only fit is
    returned bit for bit even though another candidate had the lower mean KL."""
    model = tiny_deit()
    x = images(24)
    report = convert(copy.deepcopy(model), 3, x, "fast", holdout=8)
    s = report.summary
    if s["chosen"] != "weight":
        assert s["guard"]["kept"] and s["guard"]["low"] > 0 and s["guard"]["candidate"] == s["chosen"]
    refused = recipe.Verdict("any", 1.0, -1.0, 2.0, 0.95, False)
    monkeypatch.setattr(recipe, "judge", lambda *args: refused)
    guarded = copy.deepcopy(model)
    s = convert(guarded, 3, x, "fast", holdout=8).summary
    assert min(s["candidates"].values()) < s["candidates"]["weight"]  # another candidate was better on the mean
    assert s["chosen"] == "weight" and s["guard"]["kept"] is False
    weight_only = collab_vit.reparametrize(copy.deepcopy(model), 3, progress=False)
    assert all(torch.equal(v, weight_only.state_dict()[k]) for k, v in guarded.state_dict().items())


def candidate(name: str, held: torch.Tensor) -> recipe.Candidate:
    return recipe.Candidate(name, [], float(held.mean()), held=held)


def test_the_kept_candidate_is_the_best_resolved_one() -> None:
    """A candidate with the lowest mean KL whose win is inside the noise loses to one whose (smaller) win is
    resolved; with no resolved win the weight-only fit is kept; without the weight-only fit (pinned candidates) the
    lowest mean KL."""
    weight, noisy = kls(32, 0.03, 0.3)
    other, shifted = kls(32, 0.02, 0.005, seed=1)
    steady = weight - (other - shifted)  # on the same images: a gain of 0.02 +- 0.005 over weight-only
    pool = [candidate("weight", weight), candidate("whitened+refine", noisy), candidate("whitened", steady)]
    assert pool[1].held_kl < pool[2].held_kl < pool[0].held_kl
    kept, verdicts = recipe.choose(pool, 0.95, seed=0)
    assert kept.name == "whitened" and verdicts["whitened"].kept and not verdicts["whitened+refine"].kept
    kept, verdicts = recipe.choose(pool[:2], 0.95, seed=0)
    assert kept.name == "weight" and set(verdicts) == {"whitened+refine"}
    kept, verdicts = recipe.choose(pool[1:], 0.95, seed=0)
    assert kept.name == "whitened+refine" and verdicts == {}
