"""Pretrained weights for collaborative models: converted files and timm's DeiT weights converted on load.

``timm.create_model("collab_deit_base_patch16_224", pretrained=True, key_dim=384)`` fetches timm's DeiT-B weights
exactly as timm does, then ``collab_filter_fn`` re-parametrises each attention layer (section 3.3) and caches the
result under ``<torch hub dir>/checkpoints/collab_vit/``. A cache entry is keyed by everything it is made from (see
:func:`cache_key`): every source tensor of the attention layers (values, biases, output projection included), the
model's heads and key dims per block, the method, the decomposition options (defaults filled in), and the versions
of collab-vit and torch.

One conversion per cache: processes sharing the cache directory take an exclusive file lock on the entry (the first
converts and writes, the others wait and read its file); with a ``torch.distributed`` process group, the first
process of each node (``LOCAL_RANK`` 0, else rank 0) converts while the others wait at a barrier, so every rank must
create the model (as DDP training does). A file written by ``collab-vit convert`` already holds collaborative
weights and its key dims in its metadata.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import load_file
from timm.layers import Attention
from timm.models.vision_transformer import checkpoint_filter_fn

from ... import _version
from ...layers.attention import CollaborativeAttention
from ...weights_io import atomic_write, safetensors_writer
from ..weights.convert import convert_layer
from ..weights.decompose import tucker_decompose

METHOD = "tucker"  # the decomposition, named in a cache entry's key and file name (entries stay valid)
CACHE_FORMAT = 2  # what a cache entry holds and how it is keyed; 1 was keyed by the qkv weights only

_conversion: ContextVar[dict[str, Any]] = ContextVar("collab_vit_conversion", default={})


@contextmanager
def conversion(**options: Any) -> Iterator[None]:
    """Use the Tucker decomposition's ``options`` (``seed, max_iter, tol, dtype``) when ``collab_filter_fn`` converts
    standard weights in this block."""
    token = _conversion.set(dict(options))
    try:
        yield
    finally:
        _conversion.reset(token)


def converted_file_kwargs(path: Optional[str]) -> dict[str, Any]:
    """``model_kwargs`` recorded in a converted ``.safetensors`` file's metadata ({} for any other file)."""
    if not path or not str(path).endswith(".safetensors") or not os.path.isfile(path):
        return {}
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    return json.loads(metadata.get("model_kwargs", "{}"))


def cache_dir() -> Path:
    return Path(torch.hub.get_dir()) / "checkpoints" / "collab_vit"


def decomposition_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` the Tucker decomposition takes, with its defaults filled in (so that passing a default, or a seed,
    which it does not take, changes no cache key)."""
    parameters = inspect.signature(tucker_decompose).parameters.values()
    defaults = {p.name: p.default for p in parameters if p.kind is p.KEYWORD_ONLY and p.default is not p.empty}
    return {**defaults, **{k: v for k, v in options.items() if k != "seed" or k in defaults}}


def cache_key(state_dict: dict[str, torch.Tensor], model: nn.Module, options: dict[str, Any]
              ) -> tuple[str, dict[str, Any]]:
    """The digest naming a cache entry, and its non-tensor part (stored in the entry's metadata).

    The digest covers each source tensor the cached part derives from (every ``*.attn.*`` entry: name, dtype, shape,
    bytes), the target layers (heads and key dim per block), the decomposition ("tucker") and its options with defaults
    filled in, ``CACHE_FORMAT`` and the collab-vit and torch versions.
    """
    described = {
        "format": CACHE_FORMAT, "collab_vit": _version.__version__, "torch": torch.__version__, "method": METHOD,
        "options": decomposition_options(options),
        "blocks": [[getattr(b.attn, "num_heads", None), getattr(b.attn, "key_dim", None)] for b in model.blocks],
    }
    digest = hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode())
    for name in sorted(k for k in state_dict if ".attn." in k):
        tensor = state_dict[name].detach().cpu().contiguous()
        digest.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest(), described


def _cache_path(digest: str) -> Path:
    return cache_dir() / f"{digest[:32]}_{METHOD}.safetensors"


@contextmanager
def _entry_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``<path>.lock`` (``fcntl.flock``: one holder among the processes that share the
    directory, on other nodes too where the filesystem supports it); without file locks, no lock."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    with open(f"{path}.lock", "a") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            locked = True
        except OSError:  # a filesystem without flock: atomic writes still keep every entry whole
            locked = False
        try:
            yield
        finally:
            if locked:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _converts_first() -> bool:
    """In a process group: whether this process converts while the others wait (the first one of its node, as the
    torch hub dir may be node-local: ``LOCAL_RANK`` 0 under torchrun, else global rank 0)."""
    local_rank = os.environ.get("LOCAL_RANK")
    return int(local_rank) == 0 if local_rank is not None else dist.get_rank() == 0


def load_or_convert(path: Path, convert: Callable[[], dict[str, torch.Tensor]],
                    metadata: dict[str, str]) -> dict[str, torch.Tensor]:
    """The cache entry at ``path``, or ``convert()`` written there: once per cache (see the module docstring).

    Under the entry's lock a process reads the entry if it is there, else converts and writes it. In a process
    group the converting processes go first and the others pass a barrier after them (any process that then finds
    no entry, e.g. on another node with its own hub dir, converts under the lock in turn).
    """
    group = dist.is_available() and dist.is_initialized()
    first = group and _converts_first()
    if group and not first:
        dist.barrier()
    try:
        with _entry_lock(path):
            if path.is_file():
                return load_file(str(path))
            part = convert()
            atomic_write(str(path), safetensors_writer(part, metadata))
            return part
    finally:
        if first:
            dist.barrier()  # also when converting failed: the others then try themselves instead of hanging


def convert_attention_state(state_dict: dict[str, torch.Tensor], model: nn.Module, **options: Any) -> dict[str, Any]:
    """Replace every standard ``blocks.N.attn.*`` entry by the collaborative layer at the model's key dims
    (decomposition ``options``: ``seed, max_iter, tol, dtype``)."""
    converted = dict(state_dict)
    for index, block in enumerate(model.blocks):
        target = block.attn
        prefix = f"blocks.{index}.attn."
        if not isinstance(target, CollaborativeAttention) or prefix + "qkv.weight" not in state_dict:
            continue
        dim = state_dict[prefix + "qkv.weight"].shape[1]
        attn = Attention(dim, target.num_heads, qkv_bias=prefix + "qkv.bias" in state_dict)
        attn.load_state_dict({k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)})
        layer = convert_layer(attn, target.key_dim, **decomposition_options(options)).layer
        for key in [k for k in converted if k.startswith(prefix)]:
            del converted[key]
        converted.update({prefix + k: v for k, v in layer.state_dict().items()})
    return converted


def collab_filter_fn(state_dict: dict[str, Any], model: nn.Module) -> dict[str, torch.Tensor]:
    """timm's ViT checkpoint filter, then (for standard-attention weights) conversion to the model's key dims,
    read from or written to the cache."""
    state_dict = checkpoint_filter_fn(state_dict, model)
    if not any(k.endswith("attn.qkv.weight") for k in state_dict):
        return state_dict
    options = _conversion.get()
    digest, described = cache_key(state_dict, model, options)

    def convert() -> dict[str, torch.Tensor]:
        converted = convert_attention_state(state_dict, model, **options)
        return {k: v.contiguous() for k, v in converted.items() if ".attn." in k}

    metadata = {"method": METHOD, "key": json.dumps(described, sort_keys=True, default=str)}
    attention_part = load_or_convert(_cache_path(digest), convert, metadata)
    return {k: v for k, v in state_dict.items() if ".attn." not in k} | attention_part
