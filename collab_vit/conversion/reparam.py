"""Swap the timm ``Attention`` layers of a model for collaborative ones (paper section 3.3).

At ``key_dim >= heads x head_dim`` the swap is exact (concatenate construction). Below, the per-head bilinear forms
``T[i] = Wq_i Wk_i^T`` get a rank-``key_dim`` Tucker or CP decomposition (``collab_vit.decompose``); the query bias
stays exact through the content bias ``c_i = Wk_i bq_i`` and the key bias is dropped (constant along softmax rows).
"""
from __future__ import annotations

import numbers
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Callable, Iterator, Optional, Sequence, Union

import torch
import torch.nn as nn
from timm.layers import Attention
from tqdm import tqdm

from ..layers.attention import CollaborativeAttention, check_key_dim
from ..layers.weight_decay import exclude_mixing_from_decay
from .decompose import (Decomposition, cp_decompose, energy_spectrum, parafac_decompose, rank_for_energy,
                        split_qkv_heads, tucker_decompose)

# "tucker" and "cp" never form the dense tensor; "parafac" is the paper's procedure (tensorly on the dense tensor).
METHODS: dict[str, Callable[..., Decomposition]] = {"tucker": tucker_decompose, "cp": cp_decompose,
                                                    "parafac": parafac_decompose}
KeyDimSpec = Union[None, int, float, Sequence[int]]


@dataclass
class LayerReport:
    """What the swap of one attention layer did."""

    name: str
    key_dim: int
    tensor_error: float  # ||T - T~|| / ||T|| of the bilinear forms
    output_error: float  # ||attn~(x) - attn(x)|| / ||attn(x)|| on the probe tokens
    seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


def timm_attention_layers(model: nn.Module) -> list[tuple[str, Attention]]:
    """Every layer of exact type timm ``Attention``; a one-line ``ValueError`` if there is none."""
    layers = [(name, module) for name, module in model.named_modules() if type(module) is Attention]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no timm Attention layer to re-parametrise")
    return layers


def resolve_key_dims(spec: KeyDimSpec, layers: list[tuple[str, Attention]]) -> list[int]:
    """One key dim per layer from an int (all layers), a list (one per layer) or an energy threshold in (0, 1].

    A threshold keeps, per layer, the fewest dims holding that fraction of the query-side energy (section 3.1).
    ``None`` means full rank (exact).
    """
    full = [attn.num_heads * attn.head_dim for _, attn in layers]
    if spec is None:
        return full
    if isinstance(spec, bool):
        raise ValueError(f"key_dim must be a positive integer, a list or a threshold in (0, 1], got {spec!r}")
    if isinstance(spec, numbers.Integral):
        return [check_key_dim(int(spec))] * len(layers)
    if isinstance(spec, numbers.Real):
        if not 0 < spec <= 1:
            raise ValueError(f"an energy threshold key_dim must be in (0, 1], got {spec!r}")
        return [rank_for_energy(energy_spectrum(*split_qkv_heads(a.qkv.weight.detach(), a.num_heads))[0], spec)
                for _, a in layers]
    if isinstance(spec, (list, tuple)):
        if len(spec) != len(layers):
            raise ValueError(f"key_dim list has {len(spec)} entries but the model has {len(layers)} attention layers")
        return [check_key_dim(k) for k in spec]
    raise ValueError(f"key_dim must be a positive integer, a list or a threshold in (0, 1], got {spec!r}")


def compressed_from_attention(attn: Attention, decomposition: Decomposition) -> CollaborativeAttention:
    """Collaborative layer with ``W~q, W~k, M`` from ``decomposition``; values, projection and biases exact."""
    key_dim = decomposition.query.shape[1]
    layer = CollaborativeAttention.from_attention(attn)  # exact at full rank: values, content bias, output
    compressed = CollaborativeAttention(
        layer.value.in_features, layer.num_heads, key_dim=key_dim, qkv_bias=layer.content_bias is not None,
        proj_bias=layer.proj.bias is not None, attn_drop=layer.attn_drop.p, proj_drop=layer.proj_drop.p,
        device=attn.qkv.weight.device, dtype=attn.qkv.weight.dtype,
    )
    for part in ("value", "content_bias", "norm", "proj", "attn_drop", "proj_drop"):
        setattr(compressed, part, getattr(layer, part))
    dtype = attn.qkv.weight.dtype
    with torch.no_grad():
        compressed.query.weight.copy_(decomposition.query.T.to(dtype))
        compressed.key.weight.copy_(decomposition.key.T.to(dtype))
        compressed.mixing.copy_(decomposition.mixing.to(dtype))
    compressed.fused_attn = attn.fused_attn
    return compressed.train(attn.training)


def collaborative_layer(attn: Attention, key_dim: int, method: str = "tucker", **options) -> tuple[
        CollaborativeAttention, float]:
    """The collaborative layer replacing ``attn`` at ``key_dim`` and the relative error of its bilinear forms.

    Exact (error 0) at ``key_dim >= heads x head_dim``; else a ``method`` decomposition with ``options``
    (``seed, max_iter, tol, dtype``).
    """
    if key_dim >= attn.num_heads * attn.head_dim:
        return CollaborativeAttention.from_attention(attn, key_dim=key_dim), 0.0
    wq, wk = split_qkv_heads(attn.qkv.weight.detach().cpu(), attn.num_heads)
    with single_thread():
        decomposition = METHODS[method](wq, wk, key_dim, **options)
    return compressed_from_attention(attn, decomposition), decomposition.relative_error


@contextmanager
def single_thread() -> Iterator[None]:
    """Run the decomposition on one thread: its matrices are small (D x key_dim), and measured on 2 shared cores
    one thread took 38 s for DeiT-B's 12 layers where two took 256 s (decompose.py docstring)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def probe_input_size(model: nn.Module) -> tuple[int, int, int]:
    """(channels, height, width) the model takes: its patch embedding's, else its pretrained cfg's, else 224 px."""
    patch_embed = getattr(model, "patch_embed", None)
    if patch_embed is not None and getattr(patch_embed, "img_size", None):
        return (patch_embed.proj.in_channels, *patch_embed.img_size)
    return tuple(getattr(model, "pretrained_cfg", {}).get("input_size", (3, 224, 224)))


def _capture_inputs(model: nn.Module, layers: list[tuple[str, Attention]], probe: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tokens each attention layer sees when the original model runs on ``probe`` images."""
    seen: dict[str, torch.Tensor] = {}
    was_training = model.training
    model.eval()
    hooks = [attn.register_forward_pre_hook(lambda m, args, name=name: seen.__setitem__(name, args[0].detach()))
             for name, attn in layers]
    try:
        with torch.no_grad():
            model(probe)
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    return seen


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def reparametrize_layers(
        model: nn.Module,
        key_dim: KeyDimSpec = None,
        method: str = "tucker",
        seed: int = 0,
        max_iter: int = 100,
        tol: float = 1e-6,
        dtype: torch.dtype = torch.float64,
        probe: Optional[torch.Tensor] = None,
        progress: bool = True,
) -> list[LayerReport]:
    """Swap every timm ``Attention`` of ``model`` in place; return one ``LayerReport`` per layer.

    Args:
        key_dim: int for every layer, a list (one per layer), an energy threshold in (0, 1], or None (exact).
        method: ``"tucker"`` (compress, then CP of the core), ``"cp"`` (ALS on the full factored tensor) or
            ``"parafac"`` (the paper's procedure: tensorly's CP-ALS on the dense tensor, random start).
        seed, max_iter, tol, dtype: passed to the decomposition (deterministic given the seed).
        probe: images for the attention-output error (default: 2 random images at the model's input size).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {tuple(METHODS)}, got {method!r}")
    layers = timm_attention_layers(model)
    key_dims = resolve_key_dims(key_dim, layers)
    if probe is None:
        probe = torch.randn(2, *probe_input_size(model), generator=torch.Generator().manual_seed(seed))
    device = next(model.parameters()).device
    inputs = _capture_inputs(model, layers, probe.to(device))
    reports = []
    for (name, attn), rank in zip(tqdm(layers, desc=f"{method} re-parametrisation", disable=not progress), key_dims):
        was_training, start = attn.training, time.perf_counter()
        layer, tensor_error = collaborative_layer(attn, rank, method, seed=seed, max_iter=max_iter, tol=tol,
                                                  dtype=dtype)
        seconds = time.perf_counter() - start
        with torch.no_grad():
            output_error = _relative(layer.eval()(inputs[name]), attn.eval()(inputs[name]))
        layer.train(was_training)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer)
        reports.append(LayerReport(name, rank, tensor_error, output_error, seconds))
    exclude_mixing_from_decay(model)  # timm's create_optimizer_v2 keeps the mixing matrices out of decay
    return reports


def reparametrize(model: nn.Module, key_dim: KeyDimSpec = None, method: str = "tucker", seed: int = 0,
                  **options) -> nn.Module:
    """Replace every timm ``Attention`` in ``model`` (in place) by a ``CollaborativeAttention``; return ``model``.

    Exact with ``key_dim=None`` or ``key_dim >= heads x head_dim``; otherwise a rank-``key_dim`` ``method``
    decomposition (see ``reparametrize_layers`` for the options and for the per-layer report).
    """
    reparametrize_layers(model, key_dim, method, seed, **options)
    return model


convert = reparametrize_layers  # the name before 0.2
