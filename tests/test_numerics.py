"""The derived float32 bounds (``numerics.py``) still catch a planted error, once per kind of check."""
from __future__ import annotations

import copy

import pytest
import timm
import torch

import collab_vit
from collab_vit import CollaborativeAttention
from collab_vit.layers.attention_core import CollaborativeCore
from numerics import assert_all_within, assert_within, attention_chain, vit_chain
from test_attention import float64_call, random_timm_attention
from test_fast_path import DIM, HEADS, TOKENS, assert_paths_match_reference, outputs_and_grads, random_layer


def planted(layer: torch.nn.Module, kind: str) -> torch.nn.Module:
    """A copy with one mixing entry off by 1e-3 relative, or without its content bias (the query bias's part)."""
    bad = copy.deepcopy(layer)
    with torch.no_grad():
        if kind == "mixing":
            bad.mixing[0, 0] *= 1 + 1e-3
        else:
            bad.content_bias.weight.zero_()
    return bad


@pytest.mark.parametrize("key_dim", [6, 96])
@pytest.mark.parametrize("kind", ["mixing", "content bias"])
def test_layer_bound_catches_planted_error(key_dim: int, kind: str) -> None:
    """Outputs and gradients of a layer (test_fast_path's check) against the float64 reference of the intact layer."""
    layer = random_layer(CollaborativeAttention, key_dim)
    x = torch.randn(2, TOKENS, DIM)
    assert_paths_match_reference(layer, key_dim, x, outputs_and_grads(layer, x, fused=True))  # intact: passes
    with pytest.raises(AssertionError, match="exceeds the bound"):
        assert_paths_match_reference(layer, key_dim, x, outputs_and_grads(planted(layer, kind), x, fused=True))


@pytest.mark.parametrize("kind", ["mixing", "content bias"])
def test_conversion_bound_catches_planted_error(kind: str) -> None:
    """A converted layer's forward (test_attention's check) against timm's Attention in float64."""
    attn = random_timm_attention()
    collab = CollaborativeAttention.from_attention(attn)
    x = torch.randn(4, 11, DIM)
    expected = float64_call(attn, x)
    with torch.no_grad():
        assert_within(collab(x), expected, attention_chain(DIM, DIM, 11))
        with pytest.raises(AssertionError, match="exceeds the bound"):
            assert_within(planted(collab, kind)(x), expected, attention_chain(DIM, DIM, 11))


def test_core_bound_catches_planted_error() -> None:
    """The core's gradients (test_fast_path's check) with one mixing entry off by 1e-3 relative."""
    torch.manual_seed(3)
    key_dim = 16
    q, k, mixing, v = torch.randn(3, TOKENS, key_dim), torch.randn(3, TOKENS, key_dim), torch.randn(HEADS, key_dim), \
        torch.randn(3, HEADS, TOKENS, 16)
    grad_out = torch.randn(3, HEADS, TOKENS, 16)
    bound = 2 * (key_dim + 2 * TOKENS) + 16 + 3 * TOKENS * HEADS

    def results(m: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
        inputs = [t.detach().to(dtype).requires_grad_(True) for t in (q, m, k, v)]
        out = CollaborativeCore.apply(*inputs, None, 0.25)
        return [out.detach(), *torch.autograd.grad(out, inputs, grad_out.to(dtype))]

    expected = results(mixing, torch.float64)
    assert_all_within(results(mixing, torch.float32), expected, bound)
    bad = mixing.clone()
    bad[0, 0] *= 1 + 1e-3
    with pytest.raises(AssertionError, match="exceeds the bound"):
        assert_all_within(results(bad, torch.float32), expected, bound)


@pytest.mark.parametrize("kind", ["mixing", "content bias"])
def test_model_bound_catches_planted_error(kind: str) -> None:
    """Logits of a converted ViT (test_models' / test_reparam's check), 3 blocks, against the float64 source. The
    model bound sums the reduction lengths of every block, so the mixing entry is planted in every layer."""
    torch.manual_seed(0)
    source = timm.create_model("deit_tiny_patch16_224", img_size=32, patch_size=8, depth=3, embed_dim=48,
                               num_heads=3, num_classes=5).eval()
    with torch.no_grad():
        for name, p in source.named_parameters():
            if "attn.qkv" in name:
                p.normal_(0, 0.3)
    converted = collab_vit.reparametrize(copy.deepcopy(source))
    x = torch.randn(3, 3, 32, 32)
    bound = vit_chain(48, 3, 17, 3 * 8 * 8)
    with torch.no_grad():
        expected = copy.deepcopy(source).double()(x.double())
        assert_within(converted(x), expected, bound)
        bad = copy.deepcopy(converted)
        for block in bad.blocks:
            if kind == "mixing":
                block.attn.mixing *= 1 + 1e-3  # every entry of every layer: 1e-3 relative
            else:
                block.attn.content_bias.weight.zero_()
        with pytest.raises(AssertionError, match="exceeds the bound"):
            assert_within(bad(x), expected, bound)


def test_float64_bound_catches_planted_error() -> None:
    """The float64 form of the check (double backward, folded layout): a 1e-9 relative error exceeds it."""
    torch.manual_seed(0)
    a, b = torch.randn(5, 30, dtype=torch.float64), torch.randn(30, 7, dtype=torch.float64)
    exact = a @ b
    assert_within(exact, exact.clone(), 30, torch.float64)
    with pytest.raises(AssertionError, match="exceeds the bound"):
        assert_within(exact * (1 + 1e-9), exact, 30, torch.float64)
