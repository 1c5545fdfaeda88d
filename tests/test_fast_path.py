"""The fast routes (``CollaborativeCore`` with and without CPU flash, the folded SDPA layout, padded head dims) equal
the explicit route, to second order; what they store for backward."""
from __future__ import annotations

import copy
import types

import pytest
import torch

from collab_vit import CollaborativeAttention, ConcatAttention
from collab_vit.layers import attention_core, dispatch
from collab_vit.layers.attention_core import CollaborativeCore, batch_chunks
from collab_vit.layers.dispatch import Path
from collab_vit.layers.sdpa_layout import folded_layout, head_queries, shared_keys
from measure import saved_activation_bytes
from numerics import assert_all_within, assert_within, attention_chain, float64_kwargs

DIM, HEADS, TOKENS = 48, 3, 9  # head dim 16
BATCH = 2


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


def reference(layer: torch.nn.Module, x: torch.Tensor, **kwargs) -> list[torch.Tensor]:
    """``outputs_and_grads`` of the explicit path in float64, on the same weights and inputs: the reference."""
    return outputs_and_grads(copy.deepcopy(layer).double(), x.double(), False, **float64_kwargs(kwargs))


def assert_paths_match_reference(layer: torch.nn.Module, key_dim: int, x: torch.Tensor, *paths: list[torch.Tensor],
                                 **kwargs) -> None:
    """Every path's output and gradients within the layer's float32 bound (``numerics.attention_chain``, forward
    and backward) of the float64 reference."""
    expected = reference(layer, x, **kwargs)
    bound = attention_chain(DIM, max(key_dim, DIM // HEADS), TOKENS, batch=x.shape[0])
    for got in paths:
        assert_all_within(got, expected, bound)


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
    assert_paths_match_reference(layer, key_dim, x, fast, explicit, is_causal=causal)


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
    assert_paths_match_reference(layer, key_dim, x, fast, explicit, **kwargs)


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

    def eq5(q, mixing, k, v, mask=None) -> torch.Tensor:
        logits = (q.unsqueeze(1) * mixing.unsqueeze(1)) @ k.unsqueeze(1).transpose(-2, -1) * 0.25
        return (logits if mask is None else logits + mask).softmax(-1) @ v

    out = CollaborativeCore.apply(q, mixing, k, v, mask, 0.25)
    got = [out.detach(), *torch.autograd.grad(out, inputs, grad_out)]
    inputs64 = [t.detach().double().requires_grad_(True) for t in inputs]
    out64 = eq5(*inputs64)
    expected = [out64.detach(), *torch.autograd.grad(out64, inputs64, grad_out.double())]
    # logits (key_dim), row sum and weights x values (tokens), then back: dS v^T (16), dS k (tokens), and the sums
    # of the mixing and mask gradients over the batch's rows (3 samples x tokens x heads at most)
    assert_all_within(got, expected, 2 * (key_dim + 2 * TOKENS) + 16 + 3 * TOKENS * HEADS)


@pytest.mark.parametrize("key_dim", [12, 48, 96])  # per-head q/k dims 4, 16, 32 vs value head dim 16
def test_concat_fast_path_matches_explicit(key_dim: int) -> None:
    layer = random_layer(ConcatAttention, key_dim)
    x = torch.randn(2, TOKENS, DIM)
    assert_paths_match_reference(layer, key_dim, x, outputs_and_grads(layer, x, fused=True),
                                 outputs_and_grads(layer, x, fused=False))


@pytest.mark.parametrize("cls, key_dim", [(ConcatAttention, 9), (ConcatAttention, 12), (ConcatAttention, 144),
                                          (CollaborativeAttention, 6), (CollaborativeAttention, 96)])
def test_inference_matches_explicit(cls: type, key_dim: int) -> None:
    """Without gradients the fused layers pad for flash or take the explicit product, by the head-dim ratio."""
    layer = random_layer(cls, key_dim).eval()
    x = torch.randn(2, TOKENS, DIM)
    with torch.no_grad():
        fast, explicit = layer(x), copy.deepcopy(layer).requires_grad_(False)
        explicit.fused_attn = False
        expected = explicit.double()(x.double())
        assert_within(fast, expected, attention_chain(DIM, max(key_dim, DIM // HEADS), TOKENS))


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


@pytest.mark.parametrize("key_dim", [6, 48])  # the core's flash and grouped-matmul forwards (head dim 16)
@pytest.mark.parametrize("mask", ["none", "float"])
def test_double_backward_matches_explicit(key_dim: int, mask: str) -> None:
    """Second order through ``CollaborativeCore`` (benchmarks/attention_notes.md, "Second order"): in float64,
    ``grad(grad(y, x, create_graph=True).pow(2).sum(), (x, mask, parameters))`` equals the explicit path's."""
    torch.manual_seed(0)
    layer = CollaborativeAttention(DIM, HEADS, key_dim=key_dim, qkv_bias=True).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(2, TOKENS, DIM, dtype=torch.float64)
    results = []
    for fused in (True, False):
        layer_copy = copy.deepcopy(layer)
        layer_copy.fused_attn = fused
        kwargs = layer_mask(mask)
        inputs = [x.clone().requires_grad_(True)]
        if "attn_mask" in kwargs:
            kwargs["attn_mask"] = kwargs["attn_mask"].double().requires_grad_(True)
            inputs.append(kwargs["attn_mask"])
        y = layer_copy(inputs[0], **kwargs).pow(2).sum()
        (first,) = torch.autograd.grad(y, inputs[0], create_graph=True)
        second = torch.autograd.grad(first.pow(2).sum(), inputs + list(layer_copy.parameters()))
        results.append([first, *second])
    # float64 both; second order runs the layer's chain three times (forward, backward, backward of backward)
    assert_all_within(results[0], results[1], 3 * attention_chain(DIM, key_dim, TOKENS, batch=2), torch.float64)


@pytest.mark.parametrize("key_dim", [6, 13, 30, 48])
@pytest.mark.parametrize("with_content", [True, False])
def test_folded_layout_is_eq5(key_dim: int, with_content: bool) -> None:
    """``(q' diag(m'_i)) . k'`` of the folded layout is ``(q diag(m_i)) . k + c_i . x``, at widths padded to 8."""
    torch.manual_seed(1)
    q, k = torch.randn(2, TOKENS, key_dim, dtype=torch.float64), torch.randn(2, TOKENS, key_dim, dtype=torch.float64)
    mixing = torch.randn(HEADS, key_dim, dtype=torch.float64)
    content = torch.randn(2, TOKENS, HEADS, dtype=torch.float64)
    q_ext, m_ext, k_ext = folded_layout(q, mixing, k, content if with_content else None)
    width = q_ext.shape[-1]
    assert width % 8 == 0 and width - (key_dim + HEADS * with_content) < 8
    assert m_ext.shape == (HEADS, width) and k_ext.shape == (2, TOKENS, width)
    folded = head_queries(q_ext, m_ext) @ shared_keys(k_ext, HEADS).transpose(-2, -1)
    expected = (q.unsqueeze(1) * mixing.unsqueeze(1)) @ k.unsqueeze(1).transpose(-2, -1)
    if with_content:
        expected = expected + content.transpose(1, 2).unsqueeze(2)
    assert_within(folded, expected, width, torch.float64)  # one product of length width (the padded dims add 0)


def force_path(monkeypatch, path: Path) -> None:
    monkeypatch.setattr(dispatch, "select_path", lambda *args: path)


@pytest.mark.parametrize("key_dim", [6, 30, 96])
@pytest.mark.parametrize("mask", ["none", "causal", "bool", "float"])
def test_folded_sdpa_matches_explicit(key_dim: int, mask: str, monkeypatch) -> None:
    """The ``sdpa`` path (folded layout through SDPA) against the explicit path: outputs and every gradient."""
    layer = random_layer(CollaborativeAttention, key_dim)
    x = torch.randn(2, TOKENS, DIM)
    explicit = outputs_and_grads(layer, x, fused=False, **layer_mask(mask))
    force_path(monkeypatch, Path.SDPA)
    folded = outputs_and_grads(layer, x, fused=True, **layer_mask(mask))
    assert_paths_match_reference(layer, key_dim, x, folded, explicit, **layer_mask(mask))


def test_cpu_flash_feature_check(monkeypatch) -> None:
    """The newest torch has the private CPU flash op (so the suite's other tests run the core's flash forward); a
    torch without it, or with an older signature (no ``attn_mask``), is told apart."""
    assert attention_core.has_cpu_flash() and attention_core.CPU_FLASH
    monkeypatch.setattr(torch.ops, "aten", types.SimpleNamespace())
    assert not attention_core.has_cpu_flash()
    old = types.SimpleNamespace(default=types.SimpleNamespace(_schema="aten::_scaled_dot_product_flash_attention_for"
                                                              "_cpu(Tensor query, Tensor key, Tensor value)"))
    monkeypatch.setattr(torch.ops, "aten", types.SimpleNamespace(_scaled_dot_product_flash_attention_for_cpu=old))
    assert not attention_core.has_cpu_flash()


@pytest.mark.parametrize("key_dim", [6, 16])  # where the core's forward takes CPU flash when the op exists
@pytest.mark.parametrize("mask", ["none", "causal", "float"])
def test_core_without_cpu_flash_matches_reference(key_dim: int, mask: str, monkeypatch) -> None:
    """A torch without the private op (the feature check forced off): the grouped matmuls run instead, with the
    same outputs and gradients."""
    flash_calls = []
    original = attention_core.flash_forward
    monkeypatch.setattr(attention_core, "flash_forward", lambda *a: flash_calls.append(1) or original(*a))
    layer = random_layer(CollaborativeAttention, key_dim)
    x = torch.randn(2, TOKENS, DIM)
    with_flash = outputs_and_grads(layer, x, True, **layer_mask(mask))
    assert flash_calls, "the flash forward did not run with the op present"
    flash_calls.clear()
    monkeypatch.setattr(attention_core, "CPU_FLASH", False)
    without = outputs_and_grads(layer, x, True, **layer_mask(mask))
    assert not flash_calls
    assert_paths_match_reference(layer, key_dim, x, with_flash, without, **layer_mask(mask))
