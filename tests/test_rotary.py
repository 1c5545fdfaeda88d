"""Rotary attention (RESULTS.md, "Rotary models"): the collaborative rotary layer computes the logits of timm's
``AttentionRope`` / ``EvaAttention`` (both rope layouts, prefix tokens unrotated, q/k biases in the shared projections,
both routes); every rotary family timm registers converts exactly at full rank and reloads bit-identically from its hub
folder; odd key dims, mixed rope and qk_norm are refused in one line with the model untouched (compression:
test_rotary_compress.py)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import AttentionRope
from timm.layers.pos_embed_sincos import RotaryEmbeddingCat
from timm.models.eva import EvaAttention

import collab_vit
import vit_family
from collab_vit.cli import main as cli_main
from collab_vit.conversion.weights import rotary, rotary_fit
from collab_vit.layers.rotary import CollaborativeAttentionRope, CollaborativeEvaAttention, pair_angles, rotate
from numerics import U32, assert_within, attention_chain, max_error
from test_vit_family import doc_block, table_rows

pytestmark = pytest.mark.usefixtures("one_thread")

DIM, HEADS, GRID = 32, 4, (3, 4)  # head dim 8: two frequencies per axis
KINDS = ("AttentionRope", "EvaAttention", "EvaAttention, separate q/k/v")


def source_layer(kind: str, half: bool, prefix: int, bias: bool) -> nn.Module:
    """A timm rotary layer with random weights and (``bias``) random non-zero q/k/v biases, in eval mode."""
    torch.manual_seed(0)
    if kind == "AttentionRope":
        layer = AttentionRope(DIM, HEADS, qkv_bias=bias, num_prefix_tokens=prefix, rotate_half=half)
    else:
        layer = EvaAttention(DIM, HEADS, qkv_bias=bias, qkv_fused="separate" not in kind, num_prefix_tokens=prefix,
                             rotate_half=half, norm_layer=nn.LayerNorm, scale_norm=True)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            param.normal_(0, 0.5 if "bias" in name else 0.2)
    return layer.eval()


def rope_of(half: bool) -> torch.Tensor:
    """timm's axial rope tensor (sin | cos, (12, 2 dh)) for a 3 x 4 grid, in the layout ``half`` names."""
    return RotaryEmbeddingCat(DIM // HEADS, in_pixels=False, temperature=10., feat_shape=list(GRID),
                              rotate_half=half).get_embed()


def tokens(prefix: int, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, prefix + GRID[0] * GRID[1], DIM, generator=torch.Generator().manual_seed(1))


def layer_chain(layer: nn.Module, n: int) -> int:
    """``k`` of one rotary layer's output (``numerics.attention_chain``, the rotation, EVA's scale norm)."""
    return attention_chain(DIM, DIM, n) + vit_family.ROPE_CHAIN + (0 if isinstance(layer.norm, nn.Identity) else DIM)


def timm_logits(source: nn.Module, x: torch.Tensor, rope: torch.Tensor, monkeypatch) -> torch.Tensor:
    """The logits timm's own layer forms: its rotated per-head q, k as it hands them to SDPA."""
    seen, real = {}, F.scaled_dot_product_attention

    def capture(q, k, v, **kwargs):
        seen["logits"] = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        return real(q, k, v, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(F, "scaled_dot_product_attention", capture)
        source.fused_attn = True
        source(x, rope=rope)
    return seen["logits"]


def complex_logits(source: nn.Module, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """docs/math.md's form: ``sum_p Re(q_ip(n) conj(k_ip(m)) e^{i(theta_p(n) - theta_p(m))}) / sqrt(dh)``, pair ``p``
    = dims ``(2p, 2p+1)`` (interleaved) or ``(p, p + dh/2)`` (half), prefix tokens at angle 0."""
    wq, wk, _, bq, bk, _ = rotary.projections(source)
    dh, pairs = source.head_dim, source.head_dim // 2
    first = torch.arange(pairs) if source.rotate_half else 2 * torch.arange(pairs)
    second = first + (pairs if source.rotate_half else 1)
    sin, cos = rope.chunk(2, -1)
    phase = torch.cat([torch.ones(source.num_prefix_tokens, pairs, dtype=torch.complex128),
                       torch.complex(cos[:, first], sin[:, first])])  # e^{i theta_p(t)}, (N, pairs)

    def pairs_of(w: torch.Tensor, b) -> torch.Tensor:
        y = (x @ w.T + (0 if b is None else b)).view(*x.shape[:2], source.num_heads, dh)
        return torch.complex(y[..., first], y[..., second]) * phase[:, None]

    q, k = pairs_of(wq, bq), pairs_of(wk, bk)
    return torch.einsum("bnhp,bmhp->bhnm", q, k.conj()).real * dh ** -0.5


@pytest.mark.parametrize("half", [False, True], ids=["interleaved", "half"])
@pytest.mark.parametrize("kind", KINDS)
def test_logits_are_timm_s_and_the_complex_form(kind: str, half: bool, monkeypatch) -> None:
    source = source_layer(kind, half, prefix=2, bias=True).double()
    x, rope = tokens(2).double(), rope_of(half).double()
    reference = timm_logits(source, x, rope, monkeypatch)
    assert_within(complex_logits(source, x, rope), reference, 4 * DIM, torch.float64, what="the documented form")
    converted = rotary.rotary_layer(source_layer(kind, half, prefix=2, bias=True))
    got = converted.logits(x.float(), rope.float())
    assert_within(got, reference, DIM + DIM + vit_family.ROPE_CHAIN, what="the collaborative layer's logits")


@pytest.mark.parametrize("fused", [True, False], ids=["sdpa", "explicit"])
@pytest.mark.parametrize("bias", [True, False], ids=["biases", "no-bias"])
@pytest.mark.parametrize("prefix", [0, 1, 5])
@pytest.mark.parametrize("half", [False, True], ids=["interleaved", "half"])
@pytest.mark.parametrize("kind", KINDS)
def test_layer_exact_at_full_rank(kind: str, half: bool, prefix: int, bias: bool, fused: bool) -> None:
    source = source_layer(kind, half, prefix, bias)
    layer = rotary.rotary_layer(source)
    assert type(layer) is (CollaborativeAttentionRope if kind == "AttentionRope" else CollaborativeEvaAttention)
    layer.fused_attn = fused
    x, rope = tokens(prefix), rope_of(half)
    with torch.no_grad():
        ref = copy.deepcopy(source).double()(x.double(), rope=rope.double())
        assert_within(layer(x, rope=rope), ref, layer_chain(layer, x.shape[1]), what=f"{kind}, {prefix} prefix")
        assert max_error(source(x, rope=None), source(x, rope=rope)) > 1e-2  # the rope matters here


def test_layout_prefix_and_biases_are_each_needed() -> None:
    """The exact layer read in the other layout, rotating the prefix tokens, or without its shared q/k biases is off:
    each carries something. Under rope even a key bias counts (it does not cancel along a softmax row)."""
    source = source_layer("AttentionRope", half=False, prefix=2, bias=True)
    x, rope = tokens(2), rope_of(False)
    with torch.no_grad():
        ref = source(x, rope=rope)
        for change in ("rotate_half", "num_prefix_tokens", "query.bias", "key.bias"):
            layer = rotary.rotary_layer(source)
            if change == "rotate_half":
                layer.rotate_half = True
            elif change == "num_prefix_tokens":
                layer.num_prefix_tokens = 0
                rope_all = torch.cat([rope[5:7], rope])  # a rope (non-zero angles) for the prefix tokens too
                assert max_error(layer(x, rope=rope_all), ref) > 1e-3, change
                continue
            else:
                layer.get_parameter(change).zero_()
            assert max_error(layer(x, rope=rope), ref) > 1e-3, change
        source.qkv.bias[DIM:2 * DIM] = 0  # the source's key bias alone
        assert max_error(source(x, rope=rope), ref) > 1e-3


def test_prefix_tokens_see_the_unrotated_form() -> None:
    """Logits among prefix tokens are those without rope; the rotated patch tokens' are not."""
    layer = rotary.rotary_layer(source_layer("EvaAttention", half=True, prefix=5, bias=True))
    x = tokens(5)
    with torch.no_grad():
        rotated, plain = layer.logits(x, rope_of(True)), layer.logits(x, None)
    assert torch.equal(rotated[..., :5, :5], plain[..., :5, :5])
    assert max_error(rotated[..., 5:, 5:], plain[..., 5:, 5:]) > 1e-2


def rope_1d(positions: torch.Tensor, half: bool = False) -> torch.Tensor:
    """A 1-D rope tensor: pair ``p`` at angle ``positions * 10^-p/2`` (either layout)."""
    freqs = 10. ** (-torch.arange(DIM // HEADS // 2) / 2)
    angles = positions[:, None].double() * freqs
    spread = (lambda t: torch.cat([t, t], -1)) if half else (lambda t: t.repeat_interleave(2, -1))
    return torch.cat([spread(angles.sin()), spread(angles.cos())], -1).float()


def test_complex_mixing_keeps_relative_positions_real_per_dim_does_not() -> None:
    """docs/math.md: a complex mixing (rotation-scaling per pair) commutes with the position rotation, so shifting
    every position leaves the logits as they are; a real mixing with its own value per shared dim does not commute,
    and the same shift changes its logits (why the mixing is complex per pair, not real per dim)."""
    layer = CollaborativeAttentionRope(DIM, HEADS, qkv_bias=True, num_prefix_tokens=0, mixing_init="random")
    x, where = tokens(0), torch.arange(12)
    with torch.no_grad():
        assert_within(layer.logits(x, rope_1d(where + 7)), layer.logits(x, rope_1d(where)), 4 * DIM)
        real = torch.randn(HEADS, DIM, generator=torch.Generator().manual_seed(2))

        def per_dim(rope: torch.Tensor) -> torch.Tensor:
            sin, cos = pair_angles(rope, layer.pair_freq, False, layer.head_dim)
            q, k = rotate(layer.query(x), sin, cos, 0), rotate(layer.key(x), sin, cos, 0)
            return torch.einsum("bnd,hd,bmd->bhnm", q, real, k)

        assert max_error(per_dim(rope_1d(where + 7)), per_dim(rope_1d(where))) > 1e-2
        sin, cos = pair_angles(rope_1d(where), layer.pair_freq, False, layer.head_dim)
        q, k = (torch.view_as_complex(rotate(f(x), sin, cos, 0).double().view(2, 12, -1, 2).contiguous())
                for f in (layer.query, layer.key))
        mu = torch.view_as_complex(layer.mixing.double().view(HEADS, -1, 2).contiguous())  # m[i, 2r] + i m[i, 2r+1]
        form = torch.einsum("hr,bnr,bmr->bhnm", mu, q, k.conj()).real * layer.scale
        assert_within(layer.logits(x, rope_1d(where)), form, 4 * DIM, what="Re(mu q~ conj(k~)) / sqrt(dh)")


def test_gated_layer_exact() -> None:
    source = AttentionRope(DIM, HEADS, gated=True, num_prefix_tokens=1).eval()
    x, rope = tokens(1), rope_of(False)
    with torch.no_grad():
        ref = copy.deepcopy(source).double()(x.double(), rope=rope.double())
        layer = rotary.rotary_layer(source)
        assert_within(layer(x, rope=rope), ref, layer_chain(layer, x.shape[1]) + DIM)  # + the gate's projection
        layer.gate = None
        assert max_error(layer(x, rope=rope), ref) > 1e-2


@pytest.mark.parametrize("name, timm_class", [("vit_small_patch16_rope_224", "AttentionRope"),
                                              ("eva02_tiny_patch14_224", "EvaAttention")])
def test_drop_in_for_timm_s_rotary_layers(name: str, timm_class: str, monkeypatch) -> None:
    """timm's EVA blocks build the collaborative layers with the keywords they pass their own, and call them with
    ``(x, rope=..., attn_mask=..., is_causal=...)``."""
    ours = CollaborativeAttentionRope if timm_class == "AttentionRope" else CollaborativeEvaAttention
    monkeypatch.setattr(timm.models.eva, timm_class, ours)
    model = timm.create_model(name, **vit_family.SMALL).eval()
    assert all(type(block.attn) is ours for block in model.blocks)
    with torch.no_grad():
        out = model(vit_family.images(2))
    assert out.shape == (2, 10) and torch.isfinite(out).all()


def test_layer_refusals_are_one_line() -> None:
    layer = CollaborativeAttentionRope(DIM, HEADS)
    for rope, what in ((torch.zeros(HEADS, 12, 2 * DIM // HEADS), "one embedding per head"),
                       (torch.zeros(12, DIM), "the layer's heads need 2 x 8")):
        with pytest.raises(ValueError, match=what) as error:
            layer(tokens(1), rope=rope)
        assert "\n" not in str(error.value)
    for kwargs, what in ((dict(qk_norm=True, norm_layer=nn.LayerNorm), "qk_norm"), (dict(num_kv_heads=2), "grouped"),
                         (dict(key_dim=31), "even key_dim"), (dict(dim_out=16), "dim outputs")):
        with pytest.raises(ValueError, match=what):
            CollaborativeAttentionRope(DIM, HEADS, **kwargs)
    with pytest.raises(TypeError, match="collab_vit.reparametrize"):
        CollaborativeAttentionRope.from_attention(AttentionRope(DIM, HEADS))


@pytest.mark.parametrize("label", list(vit_family.ROTARY))
def test_family_exact_at_full_rank_and_reloaded_by_timm(label: str) -> None:
    exact = vit_family.full_rank(label)
    assert_within(exact.got, exact.ref, exact.k, what=label)  # against the float64 source
    source = vit_family.create(*vit_family.ROTARY[label])
    assert_within(exact.got, vit_family.logits(source, vit_family.images()), 2 * exact.k, what=f"{label}, float32")
    layers = [m for m in exact.converted.modules() if isinstance(m, (AttentionRope, EvaAttention))]
    assert layers == [] and isinstance(exact.converted.blocks[1].attn, CollaborativeAttentionRope)
    assert {f"blocks.{i}.attn.mixing" for i in range(2)} <= exact.converted.no_weight_decay()
    assert vit_family.reload_check(exact.converted) == "bit-identical"
    exact.converted.rope = None  # the converted layers carry the model's rope: without it the logits are off
    assert max_error(vit_family.logits(exact.converted, vit_family.images()), exact.ref) > 1e-3


def test_doc_table_lists_the_rotary_families_within_bounds() -> None:
    rows = table_rows(doc_block(), "rotary architecture")
    assert [(r[0], r[1].strip("`")) for r in rows] == [(label, name) for label, (name, _) in vit_family.ROTARY.items()]
    for label, _, layout, prefix, full, bound, vs32, reload in rows:
        k = int(bound.split("k = ")[1].rstrip(")"))
        source = vit_family.create(*vit_family.ROTARY[label])
        assert k == vit_family.chain(source) and float(full.split(" ")[0]) <= k * U32, label
        assert float(vs32) <= 2 * k * U32 and reload == "bit-identical", label
        assert layout == ("half" if "DINOv3" in label else "interleaved") and int(prefix) == source.num_prefix_tokens


def snapshot(model: nn.Module) -> tuple:
    return [(n, type(m)) for n, m in model.named_modules()], {k: v.clone() for k, v in model.state_dict().items()}


REFUSALS = {  # label -> (timm name, keywords over vit_family.SMALL, key_dim, what the one line says)
    "mixed rope": ("vit_small_patch16_rope_mixed_224", {}, None,
                   "cannot convert blocks.0.attn (AttentionRope): mixed rope (RotaryEmbeddingMixed) learns its "
                   "frequencies per head"),
    "qk_norm, RoPE-ViT": ("vit_small_patch16_rope_224", dict(qk_norm=True), None,
                          "cannot convert blocks.0.attn (AttentionRope): qk_norm normalises"),
    "qk_norm, EVA-02": ("eva02_tiny_patch14_224", dict(qk_norm=True), None,
                        "cannot convert blocks.0.attn (EvaAttention): qk_norm normalises"),
    "an odd key dim": ("vit_small_patch16_rope_224", {}, 65, "rotary attention needs an even key_dim (pairs of dims), "
                                                             "got 65 for blocks.0.attn"),
    "an odd key dim below full rank": ("vit_small_patch16_dinov3", {}, 31, "rotary attention needs an even key_dim "
                                                                           "(pairs of dims), got 31"),
    "a string key dim": ("eva02_tiny_patch14_224", {}, "budget=0.25", "key_dim must be an int, a list of ints"),
}


@pytest.mark.parametrize("label", list(REFUSALS))
def test_refusals_one_line_model_untouched(label: str, monkeypatch) -> None:
    name, kwargs, key_dim, message = REFUSALS[label]
    model = vit_family.create(name, kwargs)
    before = snapshot(model)
    monkeypatch.setattr(rotary_fit, "fit_rotary", lambda *a, **k: pytest.fail("built a layer of a refused model"))
    with pytest.raises(ValueError) as error:
        collab_vit.reparametrize(model, key_dim, progress=False)
    assert message in str(error.value) and "\n" not in str(error.value)
    modules, state = snapshot(model)
    assert modules == before[0] and state.keys() == before[1].keys()
    assert all(torch.equal(state[k], before[1][k]) for k in state)


def test_spectrum_of_rotary_attention_is_per_frequency() -> None:
    """Section 3.1 under rope: each frequency's share of its heads' joint energy in its first 1, 2, 3 shared pairs
    is ``1 - error / energy`` of the per-frequency fit at that rank, recomputed here from the fit itself; the
    spectrum counts pairs (two dims each) and ends at full rank; calibration images are refused in one line."""
    from collab_vit.conversion.weights import rotary_fit
    from collab_vit.conversion.files.spectrum import layer_spectra, suggest_key_dim

    model = vit_family.create(*vit_family.ROTARY["EVA-02, separate q/k/v, scale norm"])
    spectra = layer_spectra(model)
    for spectrum, block in zip(spectra, model.blocks):
        freqs = rotary_fit.frequencies(block.attn)
        energy = freqs.energy.sum(1)
        for p in range(freqs.u.shape[0]):
            fits = rotary_fit.fit_frequency(freqs.u[p], freqs.conj_v[p])
            want = torch.tensor([1 - fits[r].error / float(energy[p]) for r in (1, 2, 3)], dtype=torch.float64)
            assert torch.allclose(spectrum.pair_shares[p], want, rtol=0, atol=1e-12)
            strongest = freqs.energy[p].sort(descending=True).values.cumsum(0)[:3] / energy[p]
            assert (spectrum.pair_shares[p] >= strongest - 1e-9).all()  # never below keeping the strongest heads
        full = block.attn.num_heads * block.attn.head_dim
        assert (spectrum.pair_shares.diff(dim=1) >= 0).all() and spectrum.total_dims == full
        assert spectrum.cumulative_energy[-1] == pytest.approx(1.0, abs=1e-12)
        assert all(d % 2 == 0 for d in spectrum.dims_needed.values())
    assert suggest_key_dim(spectra, 1.0) == full
    with pytest.raises(ValueError, match=r"^the whitened spectrum of rotary attention"):
        layer_spectra(model, torch.randn(2, 3, 32, 32))


ROPE_FLAGS = ["--model", vit_family.ROTARY["RoPE-ViT axial"][0], "--model-kwargs",
              *(f"{k}={v}" for k, v in vit_family.SMALL.items())]


def convert_rope_to_folder(tmp_path: Path, key_dim: int) -> tuple[nn.Module, nn.Module]:
    """A random-weight RoPE-ViT converted by ``collab-vit convert`` at ``key_dim`` into a hub folder (every layer
    recorded as a rotary collaborative layer at that key dim): the source, and the folder as timm reloads it."""
    source = vit_family.create(*vit_family.ROTARY["RoPE-ViT axial"])
    torch.save(source.state_dict(), tmp_path / "rope.pth")
    assert cli_main(["convert", *ROPE_FLAGS, "--checkpoint", str(tmp_path / "rope.pth"), "--key-dim", str(key_dim),
                     "--out", str(tmp_path / "folder")]) == 0
    record = json.loads((tmp_path / "folder" / "config.json").read_text())["model_args"]["collaborative_layers"]
    assert record == {f"blocks.{i}.attn": {"layer": "CollaborativeAttentionRope", "key_dim": key_dim}
                      for i in range(2)}
    return source, timm.create_model(f"local-dir:{tmp_path / 'folder'}", pretrained=True).eval()


def test_convert_cli_rotary_full_rank_and_refusal(tmp_path: Path, capsys, monkeypatch) -> None:
    """``collab-vit convert`` converts a RoPE-ViT's weights exactly into a hub folder timm reloads (the outputs of the
    in-memory conversion, bit for bit), and refuses an odd key dim before loading any weights."""
    source, again = convert_rope_to_folder(tmp_path, 64)
    x = vit_family.images(3, seed=2)
    assert torch.equal(vit_family.logits(again, x), vit_family.logits(collab_vit.reparametrize(source, progress=False),
                                                                      x))
    monkeypatch.setattr(timm.models._builder, "load_pretrained", lambda *a, **k: pytest.fail("loaded weights"))
    capsys.readouterr()  # the conversion's progress bar (one per layer: rotary conversions show it too)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["convert", *ROPE_FLAGS, "--key-dim", "15", "--out", str(tmp_path / "small")])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "rotary attention needs an even key_dim" in err and "\n" not in err
    assert not (tmp_path / "small").exists()


def test_analyze_refuses_calibrated_rotary_spectra_before_reading_images(tmp_path: Path, capsys) -> None:
    """The refusal comes before any calibration image is read: here the folder holds none, which the read would name."""
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["analyze", *ROPE_FLAGS, "--checkpoint", "none", "--calibration-data-dir", str(tmp_path / "nothing"),
                  "--out", str(tmp_path / "spectrum")])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in err
    assert "the whitened spectrum of rotary attention" in err and not (tmp_path / "spectrum").exists()
