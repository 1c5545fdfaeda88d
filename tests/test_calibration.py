"""Data-aware re-parametrisation (docs/math.md, "Data-aware conversion"): the whitened objective, exactness,
planted anisotropic tokens, singular moments, calibration inputs, the recipe and its guard, refinement, bad inputs."""
from __future__ import annotations

import copy
import functools

import pytest
import timm
import torch
from timm.layers import Attention

import collab_vit
from collab_vit.conversion.calibration.capture import calibration_images
from collab_vit.conversion.weights.whitening import TokenMoments, whitener, whitening
from collab_vit.conversion.weights.decompose import split_qkv_heads
from collab_vit.conversion.weights.fit import fit_attention as fit_sides
from collab_vit.conversion.calibration.guard import held_out_split
from collab_vit.conversion.calibration import candidates as candidates_module
from reference_decompose import decomposed_by
from collab_vit.conversion.calibration.recipe import Recipe
from collab_vit.conversion.reparam import convert_model, reparametrize_attention


def fit_attention(attn: Attention, key_dim: int, method: str = "tucker", tokens=None, ridge: float = 1e-2):
    """One layer fitted weight-only, or to ``tokens`` (their whitening, every token alike)."""
    sides = None if tokens is None else whitening(TokenMoments.of(tokens), ridge)
    with decomposed_by(method):
        return fit_sides(attn, key_dim, sides)


def convert(model, key_dim, calibration, effort: str = "default", **recipe):
    """The calibrated conversion with inside options (``Recipe``); returns the report."""
    return convert_model(model, key_dim, calibration, effort, 0, False, Recipe(**recipe))


CLOSED = dict(candidates=("whitened",), prefix_weight=1.0)  # the whitened closed form alone

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(img_size=16, patch_size=4, depth=2, embed_dim=24, num_heads=3, num_classes=4)
F64 = torch.float64


def tiny_deit(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = timm.create_model("deit_tiny_patch16_224", **TINY).eval().to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "attn.qkv" in name:
                p.normal_(0, 0.3)
    return model


def images(n: int, seed: int = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def held_out_last(ordered: torch.Tensor, held: int, seed: int = 0) -> torch.Tensor:
    """``ordered`` rearranged so that the recipe's seeded draw (``guard.held_out_split``) holds out its last ``held``
    images and fits the others in their order."""
    order = held_out_split(ordered.shape[0], seed)
    arranged = torch.empty_like(ordered)
    arranged[order] = ordered
    return arranged


def layer(dim: int = 12, heads: int = 3, seed: int = 0, dtype: torch.dtype = F64) -> Attention:
    torch.manual_seed(seed)
    attn = Attention(dim, heads, qkv_bias=True).to(dtype).eval()
    with torch.no_grad():
        attn.qkv.weight.normal_(0, 0.5)
        attn.qkv.bias.normal_(0, 0.5)
    return attn


def anisotropic_tokens(b: int, n: int, d: int, seed: int) -> torch.Tensor:
    """Tokens living mostly in a fixed random 3-dim subspace (scale 3) plus small isotropic noise (scale 0.05)."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(99), dtype=F64))[0][:, :3]
    main = torch.randn(b, n, 3, generator=g, dtype=F64) @ basis.T * 3
    return main + 0.05 * torch.randn(b, n, d, generator=g, dtype=F64)


def bilinear(attn: Attention, new) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head (T_i) of the timm layer and (W~q diag(m_i) W~k^T) of the collaborative one, float64."""
    wq, wk = split_qkv_heads(attn.qkv.weight.detach().to(F64), attn.num_heads)
    t = wq @ wk.transpose(1, 2)
    q, k, m = new.query.weight.detach().to(F64).T, new.key.weight.detach().to(F64).T, new.mixing.detach().to(F64)
    return t, torch.einsum("dr,ir,er->ide", q, m, k)


def pooled_objective(tokens: torch.Tensor, forms: torch.Tensor) -> float:
    """Dense reference: sum_i sum over ALL query tokens n and ALL key tokens m (pooled over images) of
    (x_n F_i (x_m - mean of m's image))^2, per token pair normalised as the moments are (1 / tokens^2)."""
    x = tokens.reshape(-1, tokens.shape[-1])
    centred = (tokens - tokens.mean(1, keepdim=True)).reshape(-1, tokens.shape[-1])
    logits = torch.einsum("nd,ide,me->inm", x, forms, centred)
    return float(logits.square().sum()) / x.shape[0] ** 2


def test_moments_are_the_dense_definitions() -> None:
    tokens = torch.randn(4, 5, 6, dtype=F64)
    moments = TokenMoments(6)
    moments.update(tokens[:1])
    moments.update(tokens[1:])
    flat = tokens.reshape(-1, 6)
    centred = (tokens - tokens.mean(1, keepdim=True)).reshape(-1, 6)
    # float64 sums of 20 products: 64 x 2**-53 of the largest entry covers the summation order
    tol = 64 * 2**-53 * float(flat.abs().max()) ** 2 * 20
    assert (moments.query - flat.T @ flat).abs().max() <= tol
    assert (moments.key - centred.T @ centred).abs().max() <= tol
    assert moments.tokens == 20 and moments.images == 4


@pytest.mark.parametrize("method", ["tucker", "cp"])
def test_whitened_route_equals_the_dense_reference_objective(method: str) -> None:
    """The reported whitened error is the pooled logit error of the returned layer on the calibration tokens."""
    attn = layer()
    tokens = torch.randn(6, 9, 12, dtype=F64, generator=torch.Generator().manual_seed(3)) * torch.linspace(0.2, 3, 12,
                                                                                                            dtype=F64)
    fit = fit_attention(attn, 4, method, tokens, ridge=1e-12)  # 54 tokens > D: the ridge is negligible (1e-12)
    t, approx = bilinear(attn, fit.layer)
    reference = (pooled_objective(tokens, t - approx) / pooled_objective(tokens, t)) ** 0.5
    # both sides float64; the ALS result itself is ~1e-1 off T, so only round-off of sums over 54^2 pairs differs
    assert abs(fit.whitened_error - reference) <= 1e-9 * reference
    weight_only = fit_attention(attn, 4, method)
    _, approx_w = bilinear(attn, weight_only.layer)
    assert pooled_objective(tokens, t - approx) < pooled_objective(tokens, t - approx_w)


def test_exact_at_full_rank_with_calibration() -> None:
    reference = tiny_deit(dtype=F64)
    converted = copy.deepcopy(reference)
    reports = convert(converted, 24, images(6, dtype=F64), "default")
    x = images(3, seed=5, dtype=F64)
    with torch.no_grad():
        expected, actual = reference(x), converted(x)
    # float64 end to end; the concatenate construction only reorders sums of length D = 24
    assert (actual - expected).abs().max() <= 1e3 * 2**-53 * expected.abs().max()
    assert reports.summary["chosen"] == "weight" and all(r.tensor_error == 0 for r in reports)  # ties: weight-only


def test_calibrated_beats_weight_only_on_held_out_planted_tokens() -> None:
    attn = layer(dim=16, heads=4, seed=2)
    fit_tokens, held = anisotropic_tokens(16, 10, 16, seed=0), anisotropic_tokens(8, 10, 16, seed=1)
    calibrated = reparametrize_attention(attn, 4, calibration=fit_tokens)
    weight_only = reparametrize_attention(attn, 4)
    with torch.no_grad():
        ref = attn(held)
        err_cal = float((calibrated(held) - ref).norm() / ref.norm())
        err_w = float((weight_only(held) - ref).norm() / ref.norm())
    assert err_cal < 0.5 * err_w, (err_cal, err_w)
    t, approx = bilinear(attn, calibrated)
    _, approx_w = bilinear(attn, weight_only)
    assert pooled_objective(held, t - approx) < 0.25 * pooled_objective(held, t - approx_w)


@pytest.mark.parametrize("case", ["fewer tokens than D", "constant features", "zero tokens", "fp16 weights"])
def test_singular_moments_give_finite_layers(case: str) -> None:
    attn = layer(dim=16, heads=4, dtype=torch.float16 if case == "fp16 weights" else F64)
    tokens = torch.randn(1, 3, 16, dtype=F64)  # 3 tokens, D = 16: both moments have rank <= 3
    if case == "constant features":
        tokens = torch.randn(4, 8, 16, dtype=F64)
        tokens[..., 5:] = 1.5
    elif case == "zero tokens":
        tokens = torch.zeros(2, 4, 16, dtype=F64)
    elif case == "fp16 weights":
        tokens = tokens.half()
    fit = fit_attention(attn, 4, "tucker", tokens)
    assert all(bool(torch.isfinite(p).all()) for p in fit.layer.parameters())
    assert fit.tensor_error == fit.tensor_error and fit.whitened_error == fit.whitened_error  # not NaN
    with torch.no_grad():
        x = torch.randn(2, 5, 16, dtype=attn.qkv.weight.dtype)
        assert bool(torch.isfinite(fit.layer(x)).all())
    moments = TokenMoments.of(tokens)
    side = whitener(moments.query, moments.tokens)
    assert side.ridge > 0 and bool(torch.isfinite(side.inverse_t).all())


def test_dataloader_and_tensor_give_the_same_layer(monkeypatch) -> None:
    """Batches of 4 (a loader of (images, labels)) or of 3 (images only) vs the whole tensor: the moments agree to
    float64 round-off, and so does the layer (max_iter=0: the float64 start, no float32 ALS sweeps)."""
    model = tiny_deit(dtype=F64)
    x = images(10, dtype=F64)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.zeros(10)), batch_size=4)
    results = []
    monkeypatch.setattr(candidates_module, "fit_attention", functools.partial(fit_sides, max_iter=0))
    for calibration in (x, loader, list(x.split(3))):
        converted = copy.deepcopy(model)
        convert(converted, 6, calibration, holdout=2, batch_size=5, **CLOSED)
        results.append(converted)
    probe = images(2, seed=7, dtype=F64)
    with torch.no_grad():
        logits = [m(probe) for m in results]
    for other in logits[1:]:
        assert (other - logits[0]).abs().max() <= 1e-10 * logits[0].abs().max()  # eigh/QR on round-off-level noise
    assert calibration_images(loader, (3, 16, 16)).shape[0] == 10


def test_refinement_is_deterministic_and_moves_only_queries_keys_mixing() -> None:
    runs = []
    for _ in range(2):
        model = tiny_deit()
        reports = convert(model, 3, images(16), candidates=("whitened+blocks",), prefix_weight=1.0, refine_steps=8,
                          refine_lr=1e-2, batch_size=8)
        runs.append((model, reports))
    (a, ra), (b, _) = runs
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    closed = tiny_deit()  # the same closed form (same batches of moments), without the refinement
    convert(closed, 3, images(16), batch_size=8, **CLOSED)
    for name, value in a.state_dict().items():
        moved = not torch.equal(value, closed.state_dict()[name])
        assert moved == any(part in name for part in (".query.", ".key.", ".mixing")), name
    assert ra.summary["refine"]["steps"] == 8 and ra.summary["chosen"] == "whitened+blocks"


@pytest.mark.parametrize("bad, message", [
    (torch.randn(4, 1, 16, 16), "have 1 channels, the model takes 3"),
    (torch.randn(4, 3, 20, 16), "are 20x16 px, the model takes 16x16"),
    (torch.full((4, 3, 16, 16), float("nan")), "contain NaN"),
    (torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.empty(0, 3, 16, 16)), batch_size=2), "empty"),
    ([], "empty"),
    (3, "must be an image tensor or an iterable"),
])
def test_bad_calibration_images(bad: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        collab_vit.reparametrize(tiny_deit(), 6, calibration=bad, progress=False)


def test_bad_calibration_options() -> None:
    with pytest.raises(ValueError, match="effort must be one of"):
        collab_vit.reparametrize(tiny_deit(), 6, calibration=images(4), effort="max", progress=False)
    with pytest.raises(ValueError, match="effort must be one of"):  # both starts refined: measured no better, removed
        collab_vit.reparametrize(tiny_deit(), 6, calibration=images(4), effort="both", progress=False)
    with pytest.raises(ValueError, match="the whole-model '.refine' was removed"):
        convert(tiny_deit(), 6, images(4), candidates=("whitened+refine",))
    with pytest.raises(ValueError, match="ridge must be a positive"):
        convert(tiny_deit(), 6, images(4), ridge=0.0)
    with pytest.raises(ValueError, match="holdout must be"):
        convert(tiny_deit(), 6, images(4), holdout=4)


@pytest.mark.parametrize("key_dim", [4, [4, 5]])
def test_never_worse_than_weight_only_on_held_out_images(key_dim) -> None:
    """The guard: a closed form worse than weight-only on the held-out images (here: fitted to one image repeated,
    the class token that the head reads weighted 1e-6) is not returned; the weight-only conversion is, bit for bit,
    at one key dim or one per layer."""
    model = tiny_deit(2)
    with torch.no_grad():
        model.head.weight.mul_(6)
    one = images(1, seed=10).repeat(24, 1, 1, 1)
    calibration = held_out_last(torch.cat([one, images(8, seed=4)]), 8)  # those 8 are held out
    guarded = copy.deepcopy(model)
    reports = convert(guarded, key_dim, calibration, "fast", holdout=8, prefix_weight=1e-6, ridge=1e-8)
    kl, dims = reports.summary["candidates"], reports.summary["candidate_key_dims"]
    assert kl["whitened"] > 2 * kl["weight"], kl  # the case: the closed form is worse on the held-out images
    assert reports.summary["chosen"] == "weight" and reports.summary["gain_over_weight_only"] == 0
    assert dims["weight"] == dims["whitened"] == (key_dim if isinstance(key_dim, list) else [key_dim] * 2)
    weight_only = collab_vit.reparametrize(copy.deepcopy(model), key_dim, progress=False)
    assert all(torch.equal(v, weight_only.state_dict()[k]) for k, v in guarded.state_dict().items())


@pytest.mark.parametrize("effort", ["fast", "default"])
def test_default_recipe_reports_its_candidates(effort: str) -> None:
    """``calibration=`` alone: the candidates of ``effort`` measured on the held-out images, the best kept, its KL
    never above weight-only's; the default's blockwise refinement takes 8 passes over the fitting images per
    layer."""
    model, report = collab_vit.reparametrize(tiny_deit(), 3, calibration=images(16), effort=effort, progress=False,
                                             return_report=True)
    s = report.summary
    expected = {"fast": 2, "default": 3}[effort]
    assert len(s["candidates"]) == expected and {"weight", "whitened"} <= set(s["candidates"])
    assert s["held_out_kl"] == s["candidates"][s["chosen"]] <= s["weight_only_kl"]
    assert s["chosen"] == "weight" or s["verdicts"][s["chosen"]]["kept"]
    assert s["images_fit"] == 12 and s["images_held_out"] == 4
    assert s["refine_steps"] == {"fast": 0, "default": 2}[effort]  # ceil(8 x 12 / 64)
    better = min(("weight", "whitened"), key=s["candidates"].get)
    assert effort == "fast" or set(s["candidates"]) == {"weight", "whitened", f"{better}+blocks"}
    assert s["amp"] is False  # the device's rule: bfloat16 capture on CUDA only
    assert all(isinstance(m, collab_vit.CollaborativeAttention) for m in (b.attn for b in model.blocks))


def test_a_pinned_refinement_takes_its_passes_whatever_the_effort(monkeypatch) -> None:
    """Pinned, the blockwise refinement takes the default's 8 passes over the 12 fitting images per layer (2 steps) under
    either effort."""
    from collab_vit.conversion.calibration.recipe import RecipeRun
    taken = []
    original = RecipeRun.blockwise
    monkeypatch.setattr(RecipeRun, "blockwise", lambda self, base, steps, *a, **k:
                        taken.append(steps) or original(self, base, steps, *a, **k))
    for effort in ("fast", "default"):
        report = convert(tiny_deit(), 3, images(16), effort, candidates=("weight", "weight+blocks"))
        assert set(report.summary["candidates"]) == {"weight", "weight+blocks"}
    assert taken == [2, 2]
