"""Layer-wise refinement (conversion/refine.py: ``attention-kl``, ``logit-mse``): the logits it matches, what it
moves, determinism, the guard, the source-token pass it uses, refusals; bf16 capture; prefix-token weighting."""
from __future__ import annotations

import copy

import pytest
import timm
import torch
from timm.layers import Attention

import collab_vit
from collab_vit.conversion.capture import block_tokens, source_tokens
from collab_vit.conversion.refine import attention_logits, layer_loss
from collab_vit.conversion.reparam import timm_attention_layers
from collab_vit.layers.attention import CollaborativeAttention
from numerics import assert_within, vit_chain
from test_calibration import images, tiny_deit

pytestmark = pytest.mark.usefixtures("one_thread")

def test_logits_of_the_exact_layer_are_the_source_logits_up_to_row_constants() -> None:
    """Float32 logits of both layers vs the float64 reference; centred along each row they agree (the key bias
    only adds row constants), so both layer-wise losses are zero up to round-off for the exact conversion."""
    torch.manual_seed(0)
    attn = Attention(12, 3, qkv_bias=True).double().eval()
    with torch.no_grad():
        attn.qkv.bias.normal_(0, 0.5)
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    with torch.no_grad():
        ref = attention_logits(attn, x)
        ref_centred = ref - ref.mean(-1, keepdim=True)
        got64 = attention_logits(CollaborativeAttention.from_attention(attn).eval(), x)
        got = attention_logits(CollaborativeAttention.from_attention(attn.float()).eval(), x.float())
    chain = 12 + 12 + 7  # the projections, the logits' dot product, the row mean
    assert_within(got - got.mean(-1, keepdim=True), ref_centred.float(), chain, what="centred logits")
    assert_within(got64 - got64.mean(-1, keepdim=True), ref_centred, chain, torch.float64, what="float64")
    assert float(layer_loss(got64, ref, "logit-mse")) < 1e-28
    assert float(layer_loss(got64, ref, "attention-kl")) < 1e-28
    assert float(layer_loss(got64 + torch.randn_like(got64), ref, "logit-mse")) > 1e-2  # the loss can fail


def test_source_pass_of_block_tokens_is_source_tokens() -> None:
    """The block-by-block pass over the source (for the layer-wise losses) sees the tokens the hooks see."""
    model = tiny_deit()
    layers = timm_attention_layers(model)
    x = images(10)
    moments, held, _ = source_tokens(model, layers, x, 6, 4)
    seen = []
    held_blocks, _ = block_tokens(model, layers, x, 6, 4, lambda i, m, inputs: seen.append((m, inputs)),
                                  sequential=False)
    for (m, inputs), ref_m, h, hb in zip(seen, moments, held, held_blocks):
        assert inputs.shape == (6, 17, 24)
        assert torch.equal(h, hb)
        assert torch.equal(m.query, ref_m.query) and torch.equal(m.key, ref_m.key)


@pytest.mark.parametrize("loss", ["attention-kl", "logit-mse"])
@pytest.mark.parametrize("capture", ["source", "sequential"])
def test_layerwise_refinement_lowers_its_loss_deterministically(loss: str, capture: str) -> None:
    runs = []
    for _ in range(2):
        model = tiny_deit()
        reports = collab_vit.reparametrize_layers(model, 3, calibration=images(24), capture=capture, refine_steps=20,
                                                  refine_lr=1e-2, refine_loss=loss, batch_size=8, progress=False)
        runs.append((model, reports))
    (a, ra), (b, _) = runs
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    refine = ra.summary["refine"]
    assert refine["loss"] == loss and refine["per_layer"] and len(refine["loss_after"]) == 2
    assert all(after < before for before, after in zip(refine["loss_before"], refine["loss_after"]))
    assert not any(refine["kept_start"])
    closed = tiny_deit()
    collab_vit.reparametrize_layers(closed, 3, calibration=images(24), capture=capture, batch_size=8, progress=False)
    if capture == "source":  # sequential: later layers see other tokens, so their closed form differs too
        for name, value in a.state_dict().items():
            moved = not torch.equal(value, closed.state_dict()[name])
            assert moved == any(part in name for part in (".query.", ".key.", ".mixing")), name
    # the report's output error is the closed form's; the refined one is beside it
    assert [r.output_error for r in ra][0] == pytest.approx(
        collab_vit.reparametrize_layers(tiny_deit(), 3, calibration=images(24), capture=capture, batch_size=8,
                                        progress=False)[0].output_error, rel=1e-6)
    assert all(r.refined_output_error is not None for r in ra)


def test_layerwise_refinement_that_makes_its_loss_worse_is_undone() -> None:
    model, closed = tiny_deit(), tiny_deit()
    reports = collab_vit.reparametrize_layers(model, 3, calibration=images(16), refine_steps=3, refine_lr=10.0,
                                              refine_loss="attention-kl", batch_size=8, progress=False)
    collab_vit.reparametrize_layers(closed, 3, calibration=images(16), batch_size=8, progress=False)
    assert all(reports.summary["refine"]["kept_start"])
    assert all(torch.equal(x, y) for x, y in zip(model.state_dict().values(), closed.state_dict().values()))


def test_bad_refine_loss_and_unsupported_layers() -> None:
    with pytest.raises(ValueError, match="refine_loss must be one of"):
        collab_vit.reparametrize_layers(tiny_deit(), 3, calibration=images(8), refine_steps=2, refine_loss="kl",
                                        progress=False)
    torch.manual_seed(0)
    beit = timm.create_model("beit_base_patch16_224", img_size=16, patch_size=4, depth=1, embed_dim=24, num_heads=3,
                             num_classes=4).eval()
    before = [p.clone() for p in beit.state_dict().values()]
    with pytest.raises(ValueError, match="needs timm Attention layers .*; blocks.0.attn is RelPosAttention"):
        collab_vit.reparametrize_layers(beit, 3, calibration=images(8), refine_steps=2, refine_loss="logit-mse",
                                        progress=False)
    assert all(torch.equal(x, y) for x, y in zip(before, beit.state_dict().values()))


@pytest.mark.parametrize("capture", ["source", "sequential"])
def test_amp_capture_keeps_the_tokens_within_bfloat16_round_off(capture: str) -> None:
    """``amp=True`` captures in bfloat16 autocast: the held-out tokens the report uses stay float32 and within the
    bfloat16 bound of a ViT forward (``vit_chain``) of the float64 tokens."""
    model = tiny_deit()
    layers = timm_attention_layers(model)
    x = images(10)
    _, ref, _ = source_tokens(model.double(), layers, x.double(), 6, 4)
    model.float()
    reports = collab_vit.reparametrize_layers(copy.deepcopy(model), 3, calibration=x, holdout=4, capture=capture,
                                              amp=True, progress=False)
    assert reports.summary["amp"] is True
    with torch.autocast("cpu", torch.bfloat16):
        _, held, _ = source_tokens(model, layers, x, 6, 4)
    bound = vit_chain(24, 2, 17, 3 * 4 * 4)
    for got, want in zip(held, ref):
        assert got.dtype == torch.float32
        assert_within(got, want.float(), bound, torch.bfloat16, what="bf16-captured tokens")


def test_prefix_weight_counts_the_class_token_w_times_on_the_query_side() -> None:
    """The weighted moments against their dense float64 definition; the key side is untouched; ``balanced`` is
    patches / prefix tokens; bad weights are one-line errors."""
    from collab_vit.conversion.calibration import TokenMoments
    x = torch.randn(3, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    plain, moments = TokenMoments(4), TokenMoments(4, prefix_tokens=1)
    plain.update(x)
    moments.update(x)
    flat, cls = x.reshape(-1, 4), x[:, 0]
    assert_within(moments.weighted_query(7.0), flat.T @ flat + 6.0 * cls.T @ cls, 2 * 15, torch.float64,
                  what="weighted query")
    assert torch.equal(moments.weighted_query(1.0), plain.query) and torch.equal(moments.key, plain.key)
    reports = collab_vit.reparametrize_layers(tiny_deit(), 3, calibration=images(8), prefix_weight="balanced",
                                              progress=False)
    assert reports.summary["prefix_weight"] == 16.0 and reports.summary["prefix_tokens"] == 1
    # energy thresholds read the unweighted whitened spectrum (the weighted one is the class token's)
    dims = [[r.key_dim for r in collab_vit.reparametrize_layers(tiny_deit(), 0.9, calibration=images(8),
                                                                  prefix_weight=w, progress=False)] for w in (1.0, 50.0)]
    assert dims[0] == dims[1]
    for bad in (0.0, -1.0, float("inf"), "x", True):
        with pytest.raises(ValueError, match="prefix_weight must be a positive finite number or 'balanced'"):
            collab_vit.reparametrize_layers(tiny_deit(), 3, calibration=images(8), prefix_weight=bad, progress=False)
