"""Augmented views of the calibration images (``conversion/views.py``) and what the recipe does with them: seeded,
the images themselves first, the refinement trained on every view with the source's outputs as targets."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from collab_vit.conversion import recipe as recipe_module
from collab_vit.conversion.views import KINDS, augmented_views
from test_calibration import convert, images, tiny_deit

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_views_are_seeded_and_start_with_the_images(kind: str) -> None:
    """The first N views are the images bit for bit, the others new ones; the same seed gives the same views
    whatever the global random state, another seed other views; the global state is left as it was."""
    x = images(6)
    torch.manual_seed(123)
    a = augmented_views(x, 3, kind, seed=5)
    state = torch.get_rng_state()
    torch.manual_seed(999)
    b = augmented_views(x, 3, kind, seed=5)
    torch.manual_seed(123)
    assert torch.equal(torch.get_rng_state(), state)  # the views did not draw from the global generator
    assert a.shape == (18, 3, 16, 16) and torch.equal(a, b) and torch.equal(a[:6], x)
    assert not torch.equal(a, augmented_views(x, 3, kind, seed=6))
    for v in (a[6:12], a[12:]):
        assert all(not torch.equal(v[i], x[i]) for i in range(6))
    assert augmented_views(x, 1, kind, seed=5) is x


def test_a_light_view_is_a_crop_of_its_image_resized_back() -> None:
    """A planted image, constant along its rows, stays constant along its rows in every light view (crops, resizing
    and flips move rows but never mix them across), and its values stay within the image's range."""
    ramp = torch.linspace(-1, 1, 16).view(1, 1, 16, 1).expand(4, 3, 16, 16).contiguous()
    views = augmented_views(ramp, 5, "light", seed=0)[4:]
    assert torch.allclose(views, views[..., :1].expand_as(views), atol=1e-6)
    assert float(views.min()) >= -1 - 1e-6 and float(views.max()) <= 1 + 1e-6


def test_cutmix_views_paste_another_image() -> None:
    """Images that are each one constant: a cutmix view holds its own value and, where the box landed, another
    image's (light crops of a constant image are that constant)."""
    x = torch.arange(8, dtype=torch.float32).view(8, 1, 1, 1).expand(8, 3, 16, 16).contiguous()
    views = augmented_views(x, 2, "cutmix", seed=0)[8:]
    values = [set(torch.unique(v).tolist()) for v in views]
    assert all(values[i] <= set(range(8)) for i in range(8))
    assert sum(len(v) == 2 and i in v for i, v in enumerate(values)) >= 4  # most views carry a box of another


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_view_counts_are_one_line_errors(bad: object) -> None:
    with pytest.raises(ValueError, match="views must be a positive integer"):
        augmented_views(images(2), bad, "light", 0)
    with pytest.raises(ValueError, match="views must be one of"):
        augmented_views(images(2), 2, "rotate", 0)


def test_the_refinement_trains_on_every_view_with_the_source_outputs_as_targets(monkeypatch) -> None:
    """With ``views=3`` the refinement sees 3 x the fitting images, the images themselves first, each with the
    source model's output on it; the result is reproducible by seed and differs from the images alone."""
    model, x = tiny_deit(), images(20)
    seen = {}
    real = recipe_module.refine_logits

    def spy(net, layers, inputs, targets, *args, **kwargs):
        seen["inputs"], seen["targets"] = inputs.clone(), targets.clone()
        return real(net, layers, inputs, targets, *args, **kwargs)

    monkeypatch.setattr(recipe_module, "refine_logits", spy)
    first = copy.deepcopy(model)
    report = convert(first, 3, x, holdout=4, views=3, augment="crop", refine_steps=4, batch_size=8,
                     candidates=("weight+refine",))
    fit = report.summary["images_fit"]
    assert fit == 16 and seen["inputs"].shape[0] == 48 and report.summary["refine_images"] == 48
    order = torch.randperm(20, generator=torch.Generator().manual_seed(0))
    assert torch.equal(seen["inputs"][:fit], x[order][:fit])
    with torch.no_grad():
        assert torch.allclose(seen["targets"], model(seen["inputs"]), atol=1e-6)
    again = copy.deepcopy(model)
    torch.manual_seed(77)
    convert(again, 3, x, holdout=4, views=3, augment="crop", refine_steps=4, batch_size=8,
            candidates=("weight+refine",))
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in first.state_dict().items())
    plain = copy.deepcopy(model)
    convert(plain, 3, x, holdout=4, views=1, refine_steps=4, batch_size=8, candidates=("weight+refine",))
    assert not all(torch.equal(v, plain.state_dict()[k]) for k, v in first.state_dict().items())
    probe = images(4, seed=9)
    assert not torch.equal(F.softmax(first(probe), -1), F.softmax(plain(probe), -1))


def test_the_guard_scores_each_held_out_image_as_it_is(monkeypatch) -> None:
    """The refinement trains on 3 views of each fitting image, but every candidate is scored on the held-out images
    as they are (as the model evaluates them): its per-image score is ``KL(source || candidate)`` on each held-out
    image, recomputed here by hand with the candidate installed, and the guard's verdicts are ``guard.judge`` on
    those per-image scores."""
    from collab_vit.conversion.guard import held_out_split, judge
    model, x = tiny_deit(), images(20)
    held = x[held_out_split(20, 0)][16:]
    with torch.no_grad():
        source = F.log_softmax(model(held), -1)
    by_hand, seen = {}, {}
    real_measure, real_refine = recipe_module.RecipeRun.measure, recipe_module.refine_logits

    def measure(run, candidate):
        scored = real_measure(run, candidate)
        with torch.no_grad():  # the candidate is installed in run.model
            mine = F.log_softmax(run.model(held), -1)
        by_hand[candidate.name] = (source.exp() * (source - mine)).sum(-1).double()
        assert scored.held.shape == (4,)
        assert torch.allclose(scored.held, by_hand[candidate.name], rtol=1e-5, atol=1e-9)
        return scored

    def refine(net, layers, inputs, *args, **kwargs):
        seen["inputs"] = inputs.shape[0]
        return real_refine(net, layers, inputs, *args, **kwargs)

    monkeypatch.setattr(recipe_module.RecipeRun, "measure", measure)
    monkeypatch.setattr(recipe_module, "refine_logits", refine)
    report = convert(copy.deepcopy(model), 3, x, holdout=4, views=3, augment="crop", refine_steps=4, batch_size=8,
                     candidates=("weight", "whitened", "whitened+refine"))
    s = report.summary
    assert seen["inputs"] == 16 * 3 == s["refine_images"]  # the refinement still sees the views
    assert set(by_hand) == set(s["candidates"]) and len(by_hand) == 3
    assert s["measured_on"] == "held-out images as the model evaluates them"
    for name, kl in by_hand.items():
        assert s["candidates"][name] == pytest.approx(float(kl.mean()), rel=1e-5)
        if name != "weight":
            verdict = judge(name, by_hand["weight"], kl, recipe_module.Recipe().confidence, 0)
            assert s["verdicts"][name]["kept"] == verdict.kept
            for key in ("gain", "low", "high"):
                assert s["verdicts"][name][key] == pytest.approx(getattr(verdict, key), rel=1e-4, abs=1e-9)


@pytest.mark.parametrize("effort, pinned, scored", [("fast", None, 20), ("default", ("whitened",), 20),
                                                    ("default", None, 20),
                                                    ("default", ("weight+refine",), 20 + 16 * 2)])
def test_the_fitting_views_are_drawn_only_for_a_refinement(monkeypatch, effort, pinned, scored) -> None:
    """Without a whole-model refinement (``effort="fast"``, the default's blockwise one, or pinned candidates without
    one) the source scores the images only: the fitting images' views feed the whole-model refinement alone (on DeiT-B
    they are 7 x 192 forward passes) and the held-out images get none. The candidates' figures are the same whatever
    the views' count and kind."""
    model, x = tiny_deit(), images(20)
    counted = []
    real = recipe_module.model_outputs

    def spy(net, inputs, *args, **kwargs):
        counted.append(inputs.shape[0])
        return real(net, inputs, *args, **kwargs)

    monkeypatch.setattr(recipe_module, "model_outputs", spy)
    report = convert(copy.deepcopy(model), 3, x, effort, holdout=4, views=3, augment="crop", refine_steps=None,
                     candidates=pinned)
    assert sum(counted) + 20 == scored  # + the images themselves, scored while their tokens are captured
    if effort == "fast":
        full = convert(copy.deepcopy(model), 3, x, effort, holdout=4, views=1, augment="light")
        assert report.summary["candidates"] == full.summary["candidates"]


@pytest.mark.parametrize("bad", [dict(views=0), dict(views=1.5), dict(augment="rotate")])
def test_a_fast_conversion_still_refuses_bad_view_settings(bad: dict) -> None:
    """The fast effort draws no fitting views, yet a bad setting is a one-line error, not silently ignored."""
    with pytest.raises(ValueError, match="views"):
        convert(tiny_deit(), 3, images(8), "fast", **bad)


def test_the_guard_has_no_views_to_set() -> None:
    """``Recipe.held_views`` is gone: the held-out images are scored as they are, and the old option is refused."""
    from collab_vit.conversion.recipe import Recipe
    with pytest.raises(TypeError, match="held_views"):
        Recipe(held_views=8)
