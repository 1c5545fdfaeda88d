"""The fast path (SDPA, padded head dims, recomputed mixed queries) equals the explicit path, values and gradients."""
from __future__ import annotations

import copy

import pytest
import torch

from collab_vit import CollaborativeAttention, ConcatAttention
from collab_vit.benchmark import saved_activation_bytes

DIM, HEADS, TOKENS = 48, 3, 9  # head dim 16


def outputs_and_grads(layer: torch.nn.Module, x: torch.Tensor, fused: bool, **kwargs) -> list[torch.Tensor]:
    layer = copy.deepcopy(layer).train()
    layer.fused_attn = fused
    x = x.clone().requires_grad_(True)
    out = layer(x, **kwargs)
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]


def random_layer(cls: type, key_dim: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = cls(DIM, HEADS, key_dim=key_dim, qkv_bias=True)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer


@pytest.mark.parametrize("key_dim", [6, 16, 30, 48, 96])  # below, equal to and above the head dim (16)
@pytest.mark.parametrize("causal", [False, True])
def test_collaborative_fast_path_matches_explicit(key_dim: int, causal: bool) -> None:
    layer = random_layer(CollaborativeAttention, key_dim)
    x = torch.randn(2, TOKENS, DIM)
    fast = outputs_and_grads(layer, x, fused=True, is_causal=causal)
    explicit = outputs_and_grads(layer, x, fused=False, is_causal=causal)
    for a, b in zip(fast, explicit):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("key_dim", [12, 48, 96])  # per-head q/k dims 4, 16, 32 vs value head dim 16
def test_concat_fast_path_matches_explicit(key_dim: int) -> None:
    layer = random_layer(ConcatAttention, key_dim)
    x = torch.randn(2, TOKENS, DIM)
    for a, b in zip(outputs_and_grads(layer, x, fused=True), outputs_and_grads(layer, x, fused=False)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_mixed_queries_are_not_stored_for_backward() -> None:
    """Autograd keeps the shared (B, N, D~k) queries, not the Nh x larger mixed ones."""
    layer = random_layer(CollaborativeAttention, 96).train()
    x = torch.randn(4, TOKENS, DIM)
    stored = saved_activation_bytes(lambda: layer(x))
    mixed_bytes = 4 * HEADS * TOKENS * 96 * 4
    layer.fused_attn = False  # the explicit path stores the (scaled) mixed queries
    assert saved_activation_bytes(lambda: layer(x)) >= stored + mixed_bytes
