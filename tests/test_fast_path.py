"""The fast paths (SDPA, padded head dims, recomputed mixed queries, ``CollaborativeCore``) equal the explicit path."""
from __future__ import annotations

import copy

import pytest
import torch

from collab_vit import CollaborativeAttention, ConcatAttention
from collab_vit.layers import attention_core
from collab_vit.layers.attention_core import CollaborativeCore, batch_chunks
from measure import saved_activation_bytes

DIM, HEADS, TOKENS = 48, 3, 9  # head dim 16


def outputs_and_grads(layer: torch.nn.Module, x: torch.Tensor, fused: bool, **kwargs) -> list[torch.Tensor]:
    layer = copy.deepcopy(layer).train()
    layer.fused_attn = fused
    x = x.clone().requires_grad_(True)
    mask = kwargs.get("attn_mask")
    if mask is not None and mask.is_floating_point():
        kwargs["attn_mask"] = mask = mask.clone().requires_grad_(True)
    out = layer(x, **kwargs)
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    mask_grad = [mask.grad] if mask is not None and mask.is_floating_point() else []
    return [out.detach(), x.grad] + mask_grad + [p.grad for p in layer.parameters()]


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


def layer_mask(kind: str, batch: int = 2) -> dict:
    """Keyword arguments for a layer call: no mask, causal, a 4-D bool mask (keep where True) or an additive mask."""
    torch.manual_seed(2)
    if kind == "causal":
        return {"is_causal": True}
    if kind == "bool":
        keep = torch.rand(batch, HEADS, TOKENS, TOKENS) > 0.3
        return {"attn_mask": keep | torch.eye(TOKENS, dtype=torch.bool)}  # no row fully masked
    if kind == "float":
        return {"attn_mask": torch.randn(batch, 1, TOKENS, TOKENS)}
    return {}


@pytest.mark.parametrize("key_dim", [6, 16, 30, 48, 96])
@pytest.mark.parametrize("qkv_bias", [True, False])
@pytest.mark.parametrize("mask", ["none", "causal", "bool", "float"])
def test_collaborative_masks_match_explicit(key_dim: int, qkv_bias: bool, mask: str) -> None:
    """Outputs and gradients of every parameter, the input and a float mask; with and without the content bias."""
    torch.manual_seed(0)
    layer = CollaborativeAttention(DIM, HEADS, key_dim=key_dim, qkv_bias=qkv_bias)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(2, TOKENS, DIM)
    kwargs = layer_mask(mask)
    fast, explicit = outputs_and_grads(layer, x, True, **kwargs), outputs_and_grads(layer, x, False, **kwargs)
    assert len(fast) == len(explicit)
    for a, b in zip(fast, explicit):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("key_dim", [6, 16, 48])  # flash forward (padded q/k, equal dims) and explicit forward
@pytest.mark.parametrize("mask_shape", [None, (TOKENS, TOKENS), (3, HEADS, 1, TOKENS), (1, HEADS, TOKENS, TOKENS),
                                        (3, 1, TOKENS, TOKENS)])
@pytest.mark.parametrize("chunk_bytes", [None, 1, 2000])  # one chunk; one sample per chunk; chunks of 2, 2 and 1
def test_core_gradients_match_autograd(key_dim: int, mask_shape: tuple, chunk_bytes: int, monkeypatch) -> None:
    """``CollaborativeCore`` against autograd through eq. 5 written out, for masks of any broadcastable shape and
    however the batch is split into chunks."""
    if chunk_bytes is not None:
        monkeypatch.setattr(attention_core, "CHUNK_BYTES", chunk_bytes)
    torch.manual_seed(3)
    q, k = torch.randn(3, TOKENS, key_dim), torch.randn(3, TOKENS, key_dim)
    mixing, v = torch.randn(HEADS, key_dim), torch.randn(3, HEADS, TOKENS, 16)
    mask = None if mask_shape is None else torch.randn(mask_shape)
    inputs = [t.requires_grad_(True) for t in (q, mixing, k, v, mask) if t is not None]
    grad_out = torch.randn(3, HEADS, TOKENS, 16)

    def reference() -> torch.Tensor:
        logits = (q.unsqueeze(1) * mixing.unsqueeze(1)) @ k.unsqueeze(1).transpose(-2, -1) * 0.25
        return (logits if mask is None else logits + mask).softmax(-1) @ v

    results = []
    for out in (CollaborativeCore.apply(q, mixing, k, v, mask, 0.25), reference()):
        results.append([out.detach(), *torch.autograd.grad(out, inputs, grad_out)])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("key_dim", [12, 48, 96])  # per-head q/k dims 4, 16, 32 vs value head dim 16
def test_concat_fast_path_matches_explicit(key_dim: int) -> None:
    layer = random_layer(ConcatAttention, key_dim)
    x = torch.randn(2, TOKENS, DIM)
    for a, b in zip(outputs_and_grads(layer, x, fused=True), outputs_and_grads(layer, x, fused=False)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cls, key_dim", [(ConcatAttention, 9), (ConcatAttention, 12), (ConcatAttention, 144),
                                          (CollaborativeAttention, 6), (CollaborativeAttention, 96)])
def test_inference_matches_explicit(cls: type, key_dim: int) -> None:
    """Without gradients the fused layers pad for flash or take the explicit product, by the head-dim ratio."""
    layer = random_layer(cls, key_dim).eval()
    x = torch.randn(2, TOKENS, DIM)
    with torch.no_grad():
        fast, explicit = layer(x), copy.deepcopy(layer).requires_grad_(False)
        explicit.fused_attn = False
        torch.testing.assert_close(fast, explicit(x), rtol=1e-4, atol=1e-5)


def test_mixed_queries_are_not_stored_for_backward() -> None:
    """Autograd keeps the shared (B, N, D~k) queries, not the Nh x larger mixed ones."""
    layer = random_layer(CollaborativeAttention, 96).train()
    x = torch.randn(4, TOKENS, DIM)
    stored = saved_activation_bytes(lambda: layer(x))
    mixed_bytes = 4 * HEADS * TOKENS * 96 * 4
    layer.fused_attn = False  # the explicit path stores the (scaled) mixed queries
    assert saved_activation_bytes(lambda: layer(x)) >= stored + mixed_bytes


@pytest.mark.parametrize("key_dim", [6, 96])
def test_attention_weights_are_not_stored_for_backward(key_dim: int) -> None:
    """No (B, Nh, N, N) tensor and no (B, Nh, N, D~k) tensor is saved: only the small ones of ``CollaborativeCore``."""
    layer = random_layer(CollaborativeAttention, key_dim).train()
    shapes = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(torch.randn(4, TOKENS, DIM))  # (a causal mask plus the content bias is itself (B, Nh, N, N))
    assert (4, TOKENS, key_dim) in shapes  # the shared queries
    assert not [s for s in shapes if s[-2:] == (TOKENS, TOKENS) or s == (4, HEADS, TOKENS, key_dim)]


def test_batch_chunks_cover_the_batch_once() -> None:
    chunks = batch_chunks(16, 12, 197, 197)  # DeiT-B at batch 16: 1.86 MB of weights per sample
    assert [(c.start, c.stop) for c in chunks] == [(i, i + 2) for i in range(0, 16, 2)]
    assert batch_chunks(3, 3, 9, 9)[0] == slice(0, 3)  # small inputs: one chunk
