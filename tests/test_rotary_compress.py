"""Compression of rotary attention per frequency (RESULTS.md, "Rotary models"; conversion/weights/rotary_fit.py): at
full rank the fit is the exact conversion; below, the error is what the fit predicts, non-increasing in the key dim and
never above keeping each head's strongest pairs at equal q/k parameters; the calibrated recipe runs its candidates on
rotary layers and keeps weight-only unless another is better on held-out images; a compressed model reloads
bit-identically from its hub folder."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Optional

import pytest
import torch
import torch.nn as nn
from timm.layers import AttentionRope
from timm.layers.pos_embed_sincos import RotaryEmbeddingCat
from torch import Tensor

import collab_vit
import vit_family
from collab_vit.conversion.weights import rotary, rotary_fit
from test_rotary import convert_rope_to_folder

pytestmark = pytest.mark.usefixtures("one_thread")

DIM, HEADS, GRID = 32, 4, (3, 4)  # head dim 8: four pairs, two frequencies per axis


def source(half: bool, bias: bool, seed: int = 0) -> AttentionRope:
    torch.manual_seed(seed)
    layer = AttentionRope(DIM, HEADS, qkv_bias=bias, num_prefix_tokens=1, rotate_half=half)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            param.normal_(0, 0.5 if "bias" in name else 0.2)
    return layer.eval()


def call(half: bool) -> tuple[torch.Tensor, dict]:
    rope = RotaryEmbeddingCat(DIM // HEADS, in_pixels=False, temperature=10., feat_shape=list(GRID),
                              rotate_half=half).get_embed()
    return torch.randn(2, 1 + GRID[0] * GRID[1], DIM, generator=torch.Generator().manual_seed(1)), {"rope": rope}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def selection_error(attn: nn.Module, pairs_per_head: int, score: Optional[Tensor] = None) -> float:
    """The tensor error of the baseline: each head keeps its ``pairs_per_head`` pairs of largest ``score`` (P, H)
    (default ``||Wq pair|| ||Wk pair||`` = ``||T_ip||``) and drops the rest."""
    energy = rotary_fit.frequencies(attn).energy  # (P, H)
    top = (energy if score is None else score).argsort(dim=0, descending=True, stable=True)[:pairs_per_head]
    kept = energy.gather(0, top).sum()
    return float(((energy.sum() - kept) / energy.sum()).sqrt())


@pytest.mark.parametrize("half", [False, True], ids=["interleaved", "half"])
@pytest.mark.parametrize("bias", [False, True], ids=["no bias", "bias"])
def test_full_rank_fit_is_the_exact_conversion(half: bool, bias: bool) -> None:
    attn = source(half, bias)
    freqs = rotary_fit.frequencies(attn)
    fitted = rotary_fit.plan(freqs)
    assert fitted.ranks[-1] == [HEADS] * (DIM // HEADS // 2) and fitted.relative_error[-1] < 1e-12
    layer = rotary_fit.compressed_layer(attn, freqs, fitted.fits, fitted.ranks[-1])
    x, kwargs = call(half)
    assert relative(layer(x, **kwargs), rotary.rotary_layer(attn)(x, **kwargs)) < 1e-5
    assert relative(layer(x, **kwargs), attn(x, **kwargs)) < 1e-5


@pytest.mark.parametrize("half", [False, True], ids=["interleaved", "half"])
@pytest.mark.parametrize("bias", [False, True], ids=["no bias", "bias"])
def test_error_non_increasing_in_key_dim_and_as_fitted(half: bool, bias: bool) -> None:
    """Every even key dim: the built layer's tensor error (dense, float64) is the fit's, and it never grows with the
    key dim; the layer's output error follows."""
    attn = source(half, bias)
    errors = []
    for key_dim in range(2, DIM + 1, 2):
        fitted = rotary_fit.fit_rotary(attn, key_dim)
        assert fitted.layer.key_dim == key_dim and fitted.layer.pair_freq.numel() == key_dim // 2
        assert rotary_fit.layer_error(attn, fitted.layer) == pytest.approx(fitted.tensor_error, abs=1e-6)
        errors.append(fitted.tensor_error)
    assert all(b <= a + 1e-9 for a, b in zip(errors, errors[1:])) and errors[-1] == 0.0 and errors[0] < 1
    x, kwargs = call(half)
    ref = attn(x, **kwargs)
    outputs = [relative(rotary_fit.fit_rotary(attn, k).layer(x, **kwargs), ref) for k in (4, 16, DIM - 2)]
    assert outputs[0] > outputs[1] > outputs[2] > 0


@pytest.mark.parametrize("seed", range(4))
def test_weight_only_never_worse_than_each_head_keeping_its_strongest_pairs(seed: int) -> None:
    """At equal q/k parameters (key dim = heads x 2 x pairs kept per head) on random weights, with heads whose
    scales differ (where the allocation across frequencies matters)."""
    attn = source(half=bool(seed % 2), bias=bool(seed // 2), seed=seed)
    with torch.no_grad():  # heads and pairs of unequal strength
        attn.qkv.weight.mul_(torch.rand(3 * DIM, 1, generator=torch.Generator().manual_seed(seed)) * 2)
    for kept in range(1, DIM // HEADS // 2):
        fitted = rotary_fit.fit_rotary(attn, 2 * HEADS * kept)
        assert fitted.tensor_error <= selection_error(attn, kept) + 1e-9
        assert fitted.tensor_error < selection_error(attn, kept) - 1e-6  # and strictly better on these weights


def test_compressed_model_through_reparametrize_and_its_hub_folder(tmp_path: Path) -> None:
    source_model, again = convert_rope_to_folder(tmp_path, 16)
    converted = collab_vit.reparametrize(copy.deepcopy(source_model), 16, progress=False)
    x = vit_family.images(3, seed=2)
    assert torch.equal(vit_family.logits(again, x), vit_family.logits(converted, x))
    assert not torch.equal(again.blocks[0].attn.pair_freq, torch.arange(8) % 8)  # the fitted frequencies came back
    assert 0 < relative(vit_family.logits(converted, x), vit_family.logits(source_model, x)) < 1


def test_calibrated_recipe_on_rotary_layers() -> None:
    """The candidates run (weight-only, whitened, the refinement of the better), the chosen one is never worse than
    weight-only on the held-out images, and the model holds exactly the chosen candidate."""
    name, kwargs = vit_family.ROTARY["EVA-02 (fused qkv, q/v biases)"]
    model = vit_family.create(name, kwargs)
    images = vit_family.images(24, seed=3)
    recipe = collab_vit.conversion.calibration.recipe.Recipe(refine_steps=6, batch_size=8, holdout=8)
    converted = copy.deepcopy(model)
    report = collab_vit.conversion.reparam.convert_model(converted, 16, images, "default", 0, False, recipe)
    summary = report.summary
    kl = summary["candidates"]
    better = min(("weight", "whitened", "select"), key=lambda start: kl[start])
    assert set(kl) == {"weight", "whitened", "select", f"{better}+blocks"}
    if summary["chosen"].endswith("+blocks"):
        assert summary["refine"]["steps"] == 6
    assert kl["weight"] != kl["whitened"]  # the whitened start is a different fit
    assert summary["held_out_kl"] <= summary["weight_only_kl"]
    assert summary["candidate_key_dims"]["weight"] == [16, 16]
    assert all(type(b.attn).__name__ == "CollaborativeEvaAttention" and b.attn.key_dim == 16 for b in converted.blocks)
    assert all(r.output_error > 0 and r.error_tokens == "8 held-out calibration images" for r in report)
    weight_only = collab_vit.reparametrize(copy.deepcopy(model), 16, progress=False)
    if summary["chosen"] == "weight":
        assert torch.equal(converted(images), weight_only(images))
    else:
        assert not torch.equal(converted(images), weight_only(images))


def test_selection_is_a_candidate_of_the_calibrated_recipe() -> None:
    """The selection candidate (RESULTS.md, "Compressed: calibration at 3/4 and 1/2 of the q/k dims"): each head keeping
    its strongest pairs (``selection_layer``) is measured beside the fits; pinned, the model holds exactly that layer
    (its pairs and the source's frequencies), exact at full rank."""
    name, kwargs = vit_family.ROTARY["RoPE-ViT axial"]
    model = vit_family.create(name, kwargs)
    images = vit_family.images(24, seed=3)
    recipe = collab_vit.conversion.calibration.recipe.Recipe(holdout=8, candidates=("select",))
    converted = copy.deepcopy(model)
    report = collab_vit.conversion.reparam.convert_model(converted, 8, images, "fast", 0, False, recipe)
    assert report.summary["chosen"] == "select" and report.summary["candidate_key_dims"]["select"] == [8, 8]
    by_hand = selected(model, 8)  # ranked under each layer's rope
    x = vit_family.images(3, seed=5)
    assert torch.equal(converted(x), by_hand(x))
    attn = model.blocks[0].attn
    rope = layer_ropes(model, [("blocks.0.attn", attn)], x)[0]
    score = rotary_fit.frequencies(attn).logit_energy(rotary_fit.rope_row_mean(attn, rope))
    assert report[0].tensor_error == pytest.approx(selection_error(attn, 1, score), rel=1e-5)  # 1 pair/head
    full = rotary_fit.selection_fit(model.blocks[0].attn, rotary_fit.full_rank(model.blocks[0].attn))
    assert full.tensor_error < 1e-6


def test_a_candidate_equal_to_one_measured_is_not_measured_again(monkeypatch) -> None:
    """At full rank every candidate of a rotary layer is the one exact layer (weight-only, whitened and the selection):
    the recipe scores that model once on the held-out images and each candidate carries its scores."""
    from collab_vit.conversion.calibration import recipe as recipe_module

    name, kwargs = vit_family.ROTARY["RoPE-ViT axial"]
    model = vit_family.create(name, kwargs)
    images = vit_family.images(24, seed=3)
    passes = []
    scored = recipe_module.per_image_scores
    monkeypatch.setattr(recipe_module, "per_image_scores", lambda *a: passes.append(1) or scored(*a))
    converted = copy.deepcopy(model)
    key_dim = rotary_fit.full_rank(model.blocks[0].attn)
    report = collab_vit.conversion.reparam.convert_model(converted, key_dim, images, "fast", 0, False,
                                                         recipe_module.Recipe(holdout=8))
    kl = report.summary["candidates"]
    assert set(kl) == {"weight", "whitened", "select"} and kl["select"] == kl["weight"] == kl["whitened"]
    assert len(passes) == 1 and report.summary["chosen"] == "weight"
    exact = collab_vit.reparametrize(copy.deepcopy(model), None, progress=False)
    x = vit_family.images(3, seed=5)
    assert torch.equal(converted(x), exact(x))


def test_allocations_selection_counts_and_optimal_tensor_error() -> None:
    """``selection_ranks`` at ``K = k H`` counts the heads whose ``k`` strongest pairs hold each frequency, and grows
    by one pair at a time; the ``"optimal"`` allocation never has a larger summed tensor error."""
    attn = source(half=False, bias=True, seed=5)
    freqs = rotary_fit.frequencies(attn)
    ranks = rotary_fit.selection_ranks(freqs.energy)
    assert all(sum(r) == k and all(0 <= x <= HEADS for x in r) for k, r in enumerate(ranks))
    assert all(sum(abs(a - b) for a, b in zip(r, s)) == 1 for r, s in zip(ranks, ranks[1:]))
    for kept in (1, 2, 3):
        top = freqs.energy.argsort(dim=0, descending=True)[:kept]
        assert ranks[kept * HEADS] == [int((top == p).sum()) for p in range(freqs.u.shape[0])]
    by_selection, optimal = rotary_fit.plan(freqs), rotary_fit.plan(freqs, allocation="optimal")
    assert bool((optimal.relative_error <= by_selection.relative_error + 1e-12).all())
    assert bool((optimal.relative_error < by_selection.relative_error - 1e-6).any())
    with pytest.raises(ValueError, match=r"^allocation must be one of \('selection', 'optimal'\), got 'dp'$"):
        rotary_fit.plan(freqs, allocation="dp")


def layer_ropes(model: nn.Module, layers: list, images: torch.Tensor) -> list:
    """The rope each layer is called with on the first of ``images``."""
    return [call[1].get("rope") for call in rotary.layer_calls(model, layers, images[:1])]


def fitted(model: nn.Module, key_dim: int) -> nn.Module:
    """A copy of ``model`` with every layer's per-frequency fit at ``key_dim``."""
    by_hand = copy.deepcopy(model)
    for block in by_hand.blocks:
        block.attn = rotary_fit.fit_rotary(block.attn, key_dim).layer
    return by_hand


def selected(model: nn.Module, key_dim: int) -> nn.Module:
    """A copy of ``model`` whose heads each keep their strongest pairs under the rope each layer is called with."""
    layers = collab_vit.conversion.reparam.timm_attention_layers(model)
    ropes = layer_ropes(model, layers, vit_family.images(1, seed=0))
    by_hand = copy.deepcopy(model)
    for block, rope in zip(by_hand.blocks, ropes):
        block.attn = rotary_fit.selection_layer(block.attn, key_dim, rope)
    return by_hand


def test_weight_only_is_the_per_frequency_fit_at_every_key_dim(tmp_path: Path) -> None:
    """At every key dim below full rank the weight-only conversion is the per-frequency fit, not each head keeping
    its strongest pairs (``selection_layer``, ranked under each layer's rope: RESULTS.md "The rotary weight-only
    rule"); the calibrated recipe's weight-only candidate is the weight-only conversion."""
    name, kwargs = vit_family.ROTARY["RoPE-ViT axial"]
    model = vit_family.create(name, kwargs)
    full = rotary_fit.full_rank(model.blocks[0].attn)
    x, images = vit_family.images(3, seed=5), vit_family.images(24, seed=3)
    for key_dim in (full // 2, 3 * full // 4, full // 4):
        converted = collab_vit.reparametrize(copy.deepcopy(model), key_dim, progress=False)
        by_hand = fitted(model, key_dim)
        assert torch.equal(converted(x), by_hand(x)) and not torch.equal(converted(x), selected(model, key_dim)(x))
        recipe = collab_vit.conversion.calibration.recipe.Recipe(holdout=8, candidates=("weight",))
        pinned = copy.deepcopy(model)
        collab_vit.conversion.reparam.convert_model(pinned, key_dim, images, "fast", 0, False, recipe)
        assert torch.equal(pinned(x), converted(x))
    source, again = convert_rope_to_folder(tmp_path, full // 2)  # through ``collab-vit convert`` and timm's reload
    by_hand = fitted(source, full // 2)
    assert torch.equal(vit_family.logits(again, x), vit_family.logits(by_hand, x))


def planted_low_frequency_key_bias() -> tuple[AttentionRope, torch.Tensor]:
    """Two heads of 4 pairs on a 4 x 4 grid (temperature 1000: pairs 1 and 3 turn by at most 0.02 rad a step, so
    their rotated key bias is nearly constant along a softmax row). Head 0: pair 0 with weights of norm 0.5 and no
    bias; pair 1 with weights of norm 0.3 and a key bias of 3 (``||[W | b]||`` ranks it first); the rest small."""
    torch.manual_seed(0)
    attn = AttentionRope(16, 2, qkv_bias=True, num_prefix_tokens=1)
    with torch.no_grad():
        attn.qkv.weight.normal_(0, 0.01)
        attn.qkv.bias.zero_()
        for rows, norm in (([0, 1], 0.5), ([16, 17], 0.5), ([2, 3], 0.3), ([18, 19], 0.3)):
            w = torch.randn(2, 16)
            attn.qkv.weight[rows] = norm * w / w.norm()
        attn.qkv.bias[18] = 3.0
    rope = RotaryEmbeddingCat(8, in_pixels=False, temperature=1000., feat_shape=[4, 4]).get_embed()
    return attn.eval(), rope


def centred_logit_change(layer: nn.Module, reference: nn.Module, x: torch.Tensor, rope: torch.Tensor) -> Tensor:
    """Per head, ``||logits - reference logits||`` with each softmax row's mean removed (it cancels)."""
    with torch.no_grad():
        change = layer.logits(x, rope) - reference.logits(x, rope)
    return (change - change.mean(-1, keepdim=True)).pow(2).sum((0, 2, 3)).sqrt()


def test_selection_keeps_the_pair_that_gives_the_logits_most() -> None:
    """The selection's ranking (RESULTS.md, "The rotary weight-only rule"): a pair whose appended-bias norm
    ``||[Wq | bq]|| ||[Wk | bk]||`` is largest but whose key bias barely turns along a row (low frequency) changes the
    logits less than a bias-free pair of smaller norm; the selection ranks by ``logit_energy`` under the layer's rope
    and keeps the pair the layer's logits on random tokens say, where the ranking by the appended-bias norm keeps the
    other."""
    attn, rope = planted_low_frequency_key_bias()
    x = torch.randn(8, 17, 16, generator=torch.Generator().manual_seed(2))
    exact = rotary.rotary_layer(attn)
    dropped = []
    for pair in range(4):  # head 0 without pair p (shared pair r = p): what it gave the logits
        without = copy.deepcopy(exact)
        with torch.no_grad():
            without.mixing[0, 2 * pair:2 * pair + 2] = 0
        dropped.append(float(centred_logit_change(without, exact, x, rope)[0]))
    freqs = rotary_fit.frequencies(attn)
    assert int(freqs.energy[:, 0].argmax()) == 1 and max(range(4), key=dropped.__getitem__) == 0
    row_mean = rotary_fit.rope_row_mean(attn, rope)
    assert int(freqs.logit_energy(row_mean)[:, 0].argmax()) == 0 and float(row_mean[1]) > 0.99
    new = rotary_fit.selection_layer(attn, 4, rope)  # one pair per head
    old = rotary_fit.strongest_pairs(attn, 4, freqs.energy)
    assert int(new.pair_freq[0]) == 0 and int(old.pair_freq[0]) == 1  # head 0's kept pair
    assert centred_logit_change(new, exact, x, rope)[0] < 0.7 * centred_logit_change(old, exact, x, rope)[0]
    assert torch.equal(freqs.logit_energy(None), freqs.energy)  # no rope known: every term varies along a row
    assert torch.equal(rotary_fit.frequencies(source(False, False)).logit_energy(row_mean),
                       rotary_fit.frequencies(source(False, False)).energy)  # no biases: the same ranking
