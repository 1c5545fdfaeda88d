"""The calibrated recipe's parts: eq. 5's logits (``CollaborativeAttention.logits``), bf16 capture and prefix-token
weighting."""
from __future__ import annotations

import copy

import pytest
import torch
from timm.layers import Attention

from collab_vit.conversion.calibration.capture import source_tokens
from collab_vit.conversion.reparam import timm_attention_layers
from collab_vit.layers.attention import CollaborativeAttention
from numerics import assert_within, vit_chain
from test_calibration import convert, images, tiny_deit

pytestmark = pytest.mark.usefixtures("one_thread")


def test_collaborative_logits_of_the_exact_layer_are_the_source_logits_up_to_row_constants() -> None:
    """Float32 eq. 5 logits of the exact collaborative layer vs timm's float64 ``q k^T * scale``; centred along each
    row they agree (the key bias only adds row constants); a perturbed layer does not."""
    torch.manual_seed(0)
    attn = Attention(12, 3, qkv_bias=True).double().eval()
    with torch.no_grad():
        attn.qkv.bias.normal_(0, 0.5)
    x = torch.randn(2, 7, 12, dtype=torch.float64)

    with torch.no_grad():
        q, k, _ = attn.qkv(x).reshape(2, 7, 3, 3, 4).permute(2, 0, 3, 1, 4)
        ref = q @ k.transpose(-2, -1) * attn.scale
        ref_centred = ref - ref.mean(-1, keepdim=True)
        layer = CollaborativeAttention.from_attention(attn).eval()
        layer.mixing.add_(0.1)
        off = layer.logits(x)
        got = CollaborativeAttention.from_attention(attn.float()).eval().logits(x.float())
    chain = 12 + 12 + 7  # the projections, the logits' dot product, the row mean
    assert_within(got - got.mean(-1, keepdim=True), ref_centred.float(), chain, what="centred logits")
    assert float((off - off.mean(-1, keepdim=True) - ref_centred).abs().max()) > 1e-2  # the check can fail


def test_amp_capture_keeps_the_tokens_within_bfloat16_round_off() -> None:
    """``amp=True`` (an experiment's setting; the device's rule sets it on CUDA only) captures in bfloat16 autocast:
    the held-out tokens the report uses stay float32 and within the
    bfloat16 bound of a ViT forward (``vit_chain``) of the float64 tokens."""
    model = tiny_deit()
    layers = timm_attention_layers(model)
    x = images(10)
    _, ref, _, _ = source_tokens(model.double(), layers, x.double(), 6, 4)
    model.float()
    reports = convert(copy.deepcopy(model), 3, x, "fast", holdout=4, amp=True)
    assert reports.summary["amp"] is True
    with torch.autocast("cpu", torch.bfloat16):
        _, held, _, _ = source_tokens(model, layers, x, 6, 4)
    bound = vit_chain(24, 2, 17, 3 * 4 * 4)
    for got, want in zip(held, ref):
        assert got.dtype == torch.float32
        assert_within(got, want.float(), bound, torch.bfloat16, what="bf16-captured tokens")


def test_prefix_weight_counts_the_class_token_w_times_on_the_query_side() -> None:
    """The weighted moments against their dense float64 definition; the key side is untouched; ``balanced`` is
    patches / prefix tokens; bad weights are one-line errors."""
    from collab_vit.conversion.weights.whitening import TokenMoments
    x = torch.randn(3, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    plain, moments = TokenMoments(4), TokenMoments(4, prefix_tokens=1)
    plain.update(x)
    moments.update(x)
    flat, cls = x.reshape(-1, 4), x[:, 0]
    assert_within(moments.weighted_query(7.0), flat.T @ flat + 6.0 * cls.T @ cls, 2 * 15, torch.float64,
                  what="weighted query")
    assert torch.equal(moments.weighted_query(1.0), plain.query) and torch.equal(moments.key, plain.key)
    reports = convert(tiny_deit(), 3, images(8), "fast")  # the default rule: "balanced"
    assert reports.summary["prefix_weight"] == 16.0  # 16 patches / 1 class token
    for bad in (0.0, -1.0, float("inf"), "x", True):
        with pytest.raises(ValueError, match="prefix_weight must be a positive finite number or 'balanced'"):
            convert(tiny_deit(), 3, images(8), "fast", prefix_weight=bad)
