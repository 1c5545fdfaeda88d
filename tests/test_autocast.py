"""Mixed precision: ``CollaborativeAttention`` under CPU bfloat16 autocast and with 16-bit weights, every path,
against the float32 explicit path; and no ``heads x N x key_dim`` tensor promoted to float32 on the way.

Tolerance, from the format's unit roundoff ``u = eps / 2`` (bfloat16: 2^-8, float16: 2^-11): each rounding perturbs a
value by at most ``u`` relative, and through well-conditioned steps (linear maps; softmax of logits of order one, which
``random_layer`` gives) first-order errors add. The longest forward chain has 8 roundings (input, projection, mixing
vector, mixed query, logit, weight, weight x value, output projection): relative (Frobenius) error <= 8u. A gradient
runs that chain back once more: <= 16u. For scale (key dim 30): dropping the content bias gives an output error
of 0.17 and dropping the causal mask 0.76, against the bound 8u = 0.031.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from collab_vit import CollaborativeAttention, ConcatAttention
from collab_vit.layers import dispatch
from collab_vit.layers.attention_core import core_forward
from collab_vit.layers.dispatch import Path
from numerics import assert_within

DIM, HEADS, TOKENS = 48, 3, 9  # head dim 16
KEY_DIMS = [8, 16, 30, 96]  # below, equal to, above the head dim; 30 is not a multiple of 8; 96: the core's bmm branch
FORWARD_STEPS, GRADIENT_STEPS = 8, 16


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def random_layer(key_dim: int, qkv_bias: bool) -> CollaborativeAttention:
    torch.manual_seed(key_dim)
    layer = CollaborativeAttention(DIM, HEADS, key_dim=key_dim, qkv_bias=qkv_bias, mixing_init="random")
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, DIM ** -0.5)  # logits of order one
    return layer


def mask_kwargs(kind: str) -> dict:
    torch.manual_seed(5)
    if kind == "causal":
        return {"is_causal": True}
    if kind == "bool":
        return {"attn_mask": (torch.rand(2, HEADS, TOKENS, TOKENS) > 0.3) | torch.eye(TOKENS, dtype=torch.bool)}
    if kind == "float":
        return {"attn_mask": torch.randn(2, 1, TOKENS, TOKENS)}
    return {}


def outputs_and_grads(layer: torch.nn.Module, x: torch.Tensor, amp: bool, **kwargs) -> list[torch.Tensor]:
    """Output, then gradients of the input, a float mask and every parameter (fixed output weights)."""
    layer = copy.deepcopy(layer).train()
    x = x.clone().requires_grad_(True)
    mask = kwargs.get("attn_mask")
    if mask is not None and mask.is_floating_point():
        kwargs["attn_mask"] = mask = mask.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        out = layer(x, **kwargs)
    (out.float() * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    mask_grad = [mask.grad] if mask is not None and mask.is_floating_point() else []
    return [out.detach(), x.grad] + mask_grad + [p.grad for p in layer.parameters()]


def explicit_reference(layer: torch.nn.Module, x: torch.Tensor, **kwargs) -> list[torch.Tensor]:
    explicit = copy.deepcopy(layer).float()
    explicit.fused_attn = False
    return outputs_and_grads(explicit, x.float(), False, **kwargs)


def assert_within_rounding(got: list[torch.Tensor], reference: list[torch.Tensor], dtype: torch.dtype) -> None:
    assert len(got) == len(reference)
    u = unit_roundoff(dtype)
    assert rel_error(got[0], reference[0]) <= FORWARD_STEPS * u, "output"
    for index, (a, b) in enumerate(zip(got[1:], reference[1:])):
        assert rel_error(a, b) <= GRADIENT_STEPS * u, f"gradient {index}"


@pytest.mark.parametrize("path", [Path.CORE, Path.SDPA, Path.EXPLICIT])
@pytest.mark.parametrize("key_dim", KEY_DIMS)
@pytest.mark.parametrize("qkv_bias", [True, False])
@pytest.mark.parametrize("mask", ["none", "causal", "bool", "float"])
def test_autocast_matches_float32_explicit(path: Path, key_dim: int, qkv_bias: bool, mask: str, monkeypatch) -> None:
    layer = random_layer(key_dim, qkv_bias)
    x = torch.randn(2, TOKENS, DIM)
    reference = explicit_reference(layer, x, **mask_kwargs(mask))
    monkeypatch.setattr(dispatch, "select_path", lambda *args: path)
    got = outputs_and_grads(layer, x, True, **mask_kwargs(mask))
    assert got[0].dtype == torch.bfloat16  # autocast's compute dtype reaches the output projection
    assert_within_rounding(got, reference, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("key_dim", [8, 30, 96])
def test_16bit_weights_match_float32_explicit(dtype: torch.dtype, key_dim: int) -> None:
    """A model cast to 16 bits (no autocast) runs the CPU core; outputs and gradients in that dtype."""
    layer = random_layer(key_dim, True)
    x = torch.randn(2, TOKENS, DIM)
    reference = explicit_reference(layer, x, is_causal=True)
    got = outputs_and_grads(layer.to(dtype), x.to(dtype), False, is_causal=True)
    assert all(t.dtype == dtype for t in got)
    assert_within_rounding(got, reference, dtype)


@pytest.mark.parametrize("key_dim", [12, 48])
def test_concat_under_autocast_matches_float32(key_dim: int) -> None:
    torch.manual_seed(0)
    layer = ConcatAttention(DIM, HEADS, key_dim=key_dim, qkv_bias=True)
    x = torch.randn(2, TOKENS, DIM)
    for kind in ("none", "float"):
        reference = explicit_reference(layer, x, **mask_kwargs(kind))
        assert_within_rounding(outputs_and_grads(layer, x, True, **mask_kwargs(kind)), reference, torch.bfloat16)


class CreatedTensors(TorchDispatchMode):
    """Records the shape and dtype of every tensor an aten op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.created: list[tuple[str, tuple, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.created.append((str(func), tuple(t.shape), t.dtype))
        return out


@pytest.mark.parametrize("path", [Path.CORE, Path.SDPA, Path.EXPLICIT])
@pytest.mark.parametrize("key_dim", [20, 96])  # folded widths 24 and 104: none equals the head dim 16 or N
def test_no_per_head_query_tensor_in_float32(path: Path, key_dim: int, monkeypatch) -> None:
    """Under bfloat16 autocast, forward and backward create no float32 (b, heads, N, e) tensor of a query/key width
    e: the mixed queries stay in bfloat16 (the mixing matrix is cast, not the queries). Float32 attention weights
    (e = N), per-head values or outputs (e = head dim, the size of the layer's output) and row statistics (e = 1)
    are the softmax statistics and accumulations the layer keeps in float32."""
    layer = random_layer(key_dim, True).train()
    monkeypatch.setattr(dispatch, "select_path", lambda *args: path)
    x = torch.randn(2, TOKENS, DIM, requires_grad=True)
    recorder = CreatedTensors()
    with recorder:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(x, is_causal=True)
        out.float().sum().backward()
    promoted = [(op, shape) for op, shape, dtype in recorder.created
                if dtype == torch.float32 and len(shape) == 4 and shape[1:3] == (HEADS, TOKENS)
                and shape[3] not in (TOKENS, DIM // HEADS, 1)]
    assert not promoted
    assert any(dtype == torch.bfloat16 and len(shape) == 4 and shape[1] == HEADS
               for _, shape, dtype in recorder.created)  # the recorder does see the per-head tensors


@pytest.mark.parametrize("key_dim", [8, 96])  # the core's flash and grouped-matmul forwards
def test_core_softmax_statistics_are_float32(key_dim: int) -> None:
    torch.manual_seed(0)
    q, k = torch.randn(2, TOKENS, key_dim, dtype=torch.bfloat16), torch.randn(2, TOKENS, key_dim, dtype=torch.bfloat16)
    v = torch.randn(2, HEADS, TOKENS, 16, dtype=torch.bfloat16)
    mixing = torch.randn(HEADS, key_dim)  # a float32 parameter, as under autocast
    out, lse = core_forward(q, mixing, k, v, 0.25, None)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    logits = (q.float().unsqueeze(1) * mixing.bfloat16().float().unsqueeze(1) * 0.25) @ k.float().unsqueeze(1).mT
    # the mixed queries and products in bfloat16: the logits, hence the row lse, within 8u of their scale
    assert_within(lse, logits.logsumexp(-1), FORWARD_STEPS, torch.bfloat16)


def test_issue_example_runs_under_autocast() -> None:
    """The report of the issue: key dims 48 and 192 of a (96, 3) layer raised under CPU bfloat16 autocast."""
    for key_dim in (48, 192):
        layer = CollaborativeAttention(96, 3, key_dim=key_dim, qkv_bias=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(torch.randn(2, 17, 96))
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
