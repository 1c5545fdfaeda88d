"""What the CUDA route hands SDPA: query/key widths a multiple of 8 under bfloat16 and float16 for every
layer class, so CUDA's fused kernels take the call (an unaligned width under 16-bit inputs silently falls to the math
kernel, which builds every head's N x N weights); the collaborative layers' shared keys stay one stride-0 view.

The CPU kernels accept what CUDA's refuse, so outputs alone would pass without the padding: the call is intercepted
on the ``meta`` device, which takes the non-CPU route of ``dispatch`` (as CUDA does) and runs no kernel. On the CPU,
the padded route equals the unpadded explicit one against a float64 reference (tolerances from ``numerics``)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers.pos_embed_sincos import RotaryEmbeddingCat

import vit_family
from collab_vit import CollaborativeAttention, ConcatAttention
from collab_vit.layers import dispatch
from collab_vit.layers.rotary import CollaborativeAttentionRope, CollaborativeEvaAttention
from numerics import assert_within, attention_chain

pytestmark = pytest.mark.usefixtures("one_thread")

DIM, HEADS, GRID = 64, 4, (3, 4)  # head dim 16; 12 patch tokens and a class token
KEY_DIMS = (12, 20, 36)  # none a multiple of 8; each divisible by the heads (concat) and even (rotary)
LAYERS = {
    "collab": lambda key_dim, **dd: CollaborativeAttention(DIM, HEADS, key_dim=key_dim, qkv_bias=True, **dd),
    "collab no bias": lambda key_dim, **dd: CollaborativeAttention(DIM, HEADS, key_dim=key_dim, **dd),
    "concat": lambda key_dim, **dd: ConcatAttention(DIM, HEADS, key_dim=key_dim, qkv_bias=True, **dd),
    "rope": lambda key_dim, **dd: CollaborativeAttentionRope(DIM, HEADS, key_dim=key_dim, mixing_init="random", **dd),
    "eva": lambda key_dim, **dd: CollaborativeEvaAttention(DIM, HEADS, key_dim=key_dim, norm_layer=nn.LayerNorm,
                                                           rotate_half=True, mixing_init="random", **dd),
}
SHARED_KEYS = {"collab", "collab no bias", "rope", "eva"}


def rope_kwargs(name: str, device: str, dtype: torch.dtype) -> dict:
    """``rope=`` for a rotary layer (timm's axial rope of the 3 x 4 grid, in the layer's layout), else nothing."""
    if name not in ("rope", "eva"):
        return {}
    rope = RotaryEmbeddingCat(DIM // HEADS, in_pixels=False, temperature=10., feat_shape=list(GRID),
                              rotate_half=name == "eva").get_embed()
    return {"rope": rope.to(device, dtype)}


def sdpa_calls(monkeypatch) -> list[tuple[torch.Tensor, ...]]:
    """The (q, k, v) of each ``F.scaled_dot_product_attention`` call the package makes (the list fills as it runs)."""
    calls, real = [], F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        calls.append((q, k, v))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(dispatch.F, "scaled_dot_product_attention", spy)
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("key_dim", KEY_DIMS)
@pytest.mark.parametrize("name", list(LAYERS))
def test_the_cuda_route_hands_sdpa_aligned_widths(name: str, key_dim: int, dtype: torch.dtype, monkeypatch) -> None:
    layer = LAYERS[name](key_dim, device="meta", dtype=dtype).train()
    calls = sdpa_calls(monkeypatch)
    x = torch.empty(2, 1 + GRID[0] * GRID[1], DIM, device="meta", dtype=dtype, requires_grad=True)
    layer(x, **rope_kwargs(name, "meta", dtype)).sum().backward()
    assert len(calls) == 1, f"{name}: SDPA called {len(calls)} times"
    q, k, v = calls[0]
    assert q.shape[-1] == k.shape[-1] and q.shape[-1] % 8 == 0, f"{name} k{key_dim}: q/k width {q.shape[-1]}"
    assert v.shape == (2, HEADS, x.shape[1], DIM // HEADS)
    assert {q.dtype, k.dtype, v.dtype} == {dtype}
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1  # the fused kernels' last-dim contiguity
    if name in SHARED_KEYS:  # one (B, N, W) tensor expanded over the heads, not Nh copies
        assert k.stride(1) == 0, f"{name}: shared keys copied, strides {k.stride()}"


def outputs_and_grads(layer: nn.Module, x: torch.Tensor, kwargs: dict) -> list[torch.Tensor]:
    """Output, input gradient and every parameter gradient of one training step (fixed output weights)."""
    x = x.clone().requires_grad_(True)
    out = layer(x, **kwargs)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    (out * weights).sum().backward()
    return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("key_dim", KEY_DIMS)
@pytest.mark.parametrize("name", list(LAYERS))
def test_padded_route_equals_the_explicit_one(name: str, key_dim: int) -> None:
    """The SDPA route with its padding (float32, CPU) against the unpadded explicit route in float64: output and
    gradients within ``numerics``' bound of one attention layer (plus the rotation for the rotary layers)."""
    torch.manual_seed(key_dim)
    layer = LAYERS[name](key_dim).train()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, DIM ** -0.5)
    explicit = copy.deepcopy(layer).double()
    layer.fused_attn, explicit.fused_attn = True, False
    x = torch.randn(2, 1 + GRID[0] * GRID[1], DIM)
    got = outputs_and_grads(layer, x, rope_kwargs(name, "cpu", torch.float32))
    ref = outputs_and_grads(explicit, x.double(), rope_kwargs(name, "cpu", torch.float64))
    k = attention_chain(DIM, key_dim, x.shape[1], x.shape[0]) + 2 * vit_family.ROPE_CHAIN + 2 * DIM  # + EVA's norm
    for i, (a, b) in enumerate(zip(got, ref)):
        assert_within(a, b, k, what=f"{name} k{key_dim} result {i}")


@pytest.mark.parametrize("name", ["rope", "eva"])
def test_padded_rotary_layer_scripts(name: str) -> None:
    """The padding keeps the rotary layers scriptable (TorchScript reads no module-level constant): the scripted
    layer computes what the eager one does."""
    layer = LAYERS[name](20).eval()
    x, kwargs = torch.randn(2, 1 + GRID[0] * GRID[1], DIM), rope_kwargs(name, "cpu", torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.script is deprecated; timm still offers it
        scripted = torch.jit.script(layer)
    with torch.no_grad():
        assert torch.equal(scripted(x, **kwargs), layer(x, **kwargs))
