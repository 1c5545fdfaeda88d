"""What ``gpu_check.py`` runs, and that it runs everything: the package's attention layer classes, each built at the
check's shapes with its inputs (rope, relative position bias), and every row of the two tables in
``collab_vit/layers/dispatch.py``, each run under its condition with the implementations it names recorded.

A layer class of ``collab_vit.layers`` without a case in ``LAYERS``, a table row without a case in ``SCENARIOS`` (or
one whose implementations do not run) is a failure of the check: its ``--tiny --device cpu`` mode, which the suite
runs, then fails. Rows of the non-CPU route run on CUDA, or on the ``meta`` device where there is none (the same route,
no kernel). Imports only torch, timm and ``collab_vit``.
"""
from __future__ import annotations

import importlib
import inspect
import math
import pkgutil
import re
import warnings
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Callable, Optional
from unittest import mock

import torch
import torch.nn as nn
from timm.layers.pos_embed_sincos import RotaryEmbeddingCat, RotaryEmbeddingDinoV3
from timm.models.beit import Attention as BeitAttention

import collab_vit.layers
from collab_vit import CollaborativeAttention, ConcatAttention
from collab_vit.layers import attention_core, dispatch
from collab_vit.layers.dispatch import Path as Route
from collab_vit.layers.forms import (CollaborativeEvaFormAttention, CollaborativeRelPosAttention, EvaFormAttention,
                                     RelPosAttention)
from collab_vit.layers.rotary import CollaborativeAttentionRope, CollaborativeEvaAttention


def grid(patches: int) -> tuple[int, int]:
    """The most nearly square ``rows x cols == patches`` (the patch grid of a sequence)."""
    rows = next(r for r in range(math.isqrt(patches), 0, -1) if patches % r == 0)
    return rows, patches // rows


@dataclass(frozen=True)
class LayerCase:
    """One layer of the check: its class, keywords, the inputs its forward takes beyond the tokens, and its prefix
    tokens (class token, registers: the rest of a sequence is the patch grid)."""

    label: str
    cls: type
    kwargs: dict = field(default_factory=dict)
    extra: Optional[str] = None  # "axial" / "dinov3" rope, "relpos" bias table, None
    prefix: int = 1
    reduced: bool = True  # takes key_dim (else the standard layer at full width only)
    call: dict = field(default_factory=dict)  # forward keywords (is_causal)

    def fits(self, dim: int, heads: int, key_dim: int) -> bool:
        """Whether the layer takes this key dim (concat: a multiple of the heads; rotary: even; standard: full)."""
        if not self.reduced:
            return key_dim == dim
        if self.cls is ConcatAttention:
            return key_dim % heads == 0
        return key_dim % 2 == 0 or self.extra not in ("axial", "dinov3")

    def build(self, dim: int, heads: int, key_dim: int, tokens: int, seed: int = 0) -> nn.Module:
        """The layer with random weights of logits of order one (as trained), on the CPU, in training mode."""
        torch.manual_seed(seed)
        kwargs = dict(self.kwargs, **({"key_dim": key_dim} if self.reduced else {}))
        if self.cls in (CollaborativeAttention, CollaborativeEvaFormAttention, CollaborativeRelPosAttention):
            kwargs.setdefault("mixing_init", "random")
        layer = self.cls(dim, heads, **kwargs)
        if self.extra == "relpos":
            layer.adopt_rel_pos(BeitAttention(dim, heads, qkv_bias=True, window_size=grid(tokens - self.prefix)))
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0, dim ** -0.5)
        return layer.train()

    def inputs(self, dim: int, heads: int, tokens: int, device: torch.device, dtype: torch.dtype) -> dict:
        """The forward's keywords beyond the tokens: the rope of the patch grid, the call's own keywords."""
        kwargs = dict(self.call)
        shape = list(grid(tokens - self.prefix))
        if self.extra == "axial":
            kwargs["rope"] = RotaryEmbeddingCat(dim // heads, in_pixels=False, feat_shape=shape).get_embed()
        elif self.extra == "dinov3":
            kwargs["rope"] = RotaryEmbeddingDinoV3(dim // heads, feat_shape=shape).get_embed()
        return {k: v.to(device, dtype) if torch.is_tensor(v) else v for k, v in kwargs.items()}


LAYERS = [  # every attention layer class of collab_vit.layers (package_layer_classes) has one case at least
    LayerCase("collab", CollaborativeAttention, {"qkv_bias": True}),
    LayerCase("collab no bias", CollaborativeAttention),
    LayerCase("collab causal", CollaborativeAttention, {"qkv_bias": True}, call={"is_causal": True}),
    LayerCase("concat", ConcatAttention, {"qkv_bias": True}),
    LayerCase("rope axial", CollaborativeAttentionRope, {"qkv_bias": True}, "axial"),
    LayerCase("rope dinov3", CollaborativeEvaAttention,
              {"rotate_half": True, "num_prefix_tokens": 5, "norm_layer": nn.LayerNorm}, "dinov3", prefix=5),
    LayerCase("collab relpos", CollaborativeRelPosAttention, {"qkv_bias": True}, "relpos"),
    LayerCase("collab eva form", CollaborativeEvaFormAttention, {"qkv_bias": True}),
    LayerCase("relpos", RelPosAttention, {"qkv_bias": True}, "relpos", reduced=False),
    LayerCase("eva form", EvaFormAttention, {"qkv_bias": True}, reduced=False),
]
SHARED_KEYS = (CollaborativeAttention,)  # classes whose keys are one tensor shared by all heads (stride-0 view)


def package_layer_classes() -> set[type]:
    """Every attention layer class written in ``collab_vit.layers``: an ``nn.Module`` with a forward and timm's
    ``fused_attn`` switch (declared on it or a base), defined in one of its modules. Classes built by
    ``attention_class`` / ``per_block_attention_class`` (they carry ``reduced_by``'s ``__reduce_ex__``) are their base
    with a key dim fixed: the base's case covers them."""
    found = set()
    for info in pkgutil.iter_modules(collab_vit.layers.__path__):
        module = importlib.import_module(f"collab_vit.layers.{info.name}")
        for obj in vars(module).values():
            if (inspect.isclass(obj) and issubclass(obj, nn.Module) and obj.__module__ == module.__name__
                    and obj.forward is not nn.Module.forward and "__reduce_ex__" not in vars(obj)
                    and any("fused_attn" in vars(c).get("__annotations__", {}) for c in obj.__mro__)):
                found.add(obj)
    return found


def missing_layer_classes() -> list[str]:
    """The package's layer classes without a case in ``LAYERS`` (a failure of the check)."""
    return sorted(cls.__name__ for cls in package_layer_classes() - {case.cls for case in LAYERS})


ROUTE_HEADER = "| device | fused_attn | attention dropout | graph capture | route |"
IMPLEMENTATION_HEADER = "| layer | route | pass | condition | implementation |"
ROUTE_IMPLEMENTATIONS = {Route.CORE: "core_attend", Route.SDPA: "folded_sdpa", Route.EXPLICIT: "explicit_collaborative"}
SCENARIOS = {  # (layer, route, pass, condition) of each implementation row: how a call meets it (dim 48, 3 heads)
    ("collab", "core", "forward", "CPU, `CPU_FLASH`, `flash_pays`"): {"key_dim": 20},  # 20 <= 2 * head dim 16
    ("collab", "core", "forward", "otherwise"): {"key_dim": 40},
    ("collab", "core", "backward", "no `create_graph`"): {},
    ("collab", "core", "backward", "`create_graph=True`"): {"create_graph": True},
    ("collab", "sdpa", "forward", "any"): {"device": "non-CPU"},
    ("collab", "sdpa", "backward", "any"): {"device": "non-CPU"},
    ("collab", "explicit", "forward", "any"): {"fused": False},
    ("collab", "explicit", "backward", "any"): {"fused": False},
    ("concat", "sdpa", "forward", "`fused_attn`"): {"device": "non-CPU"},
    ("concat", "sdpa", "backward", "`fused_attn`"): {"device": "non-CPU"},
    ("concat", "explicit", "forward", "not `fused_attn`"): {"fused": False},
    ("concat", "explicit", "backward", "not `fused_attn`"): {"fused": False},
}
ROUTE_DEVICES = {"CPU": "cpu", "CUDA, other": "non-CPU", "any": "cpu"}


def table_rows(header: str) -> list[list[str]]:
    """The cells of each row of the table under ``header`` in ``dispatch``'s docstring."""
    lines = dispatch.__doc__.splitlines()
    rows = []
    for line in lines[lines.index(header) + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def named(cell: str) -> set[str]:
    """The implementations a cell names (in backticks; no module: ``dispatch``)."""
    return set(re.findall(r"`([\w.]+)`", cell))


def spied(names: set[str], calls: list[str]) -> ExitStack:
    """A context recording in ``calls`` each call of the named implementations, wherever it is looked up from (its
    home module, and ``dispatch`` where it imported it)."""
    stack = ExitStack()
    for name in sorted(names):
        *path, attr = (["dispatch"] if "." not in name else []) + name.split(".")
        owner = {"dispatch": dispatch, "attention_core": attention_core}[path[0]]
        for part in path[1:]:
            owner = getattr(owner, part)
        original = getattr(owner, attr)

        def call(*args, _name=name, _original=original):
            calls.append(_name)
            return _original(*args)

        stack.enter_context(mock.patch.object(owner, attr, staticmethod(call) if isinstance(owner, type) else call))
        if owner is not dispatch and getattr(dispatch, attr, None) is original:
            stack.enter_context(mock.patch.object(dispatch, attr, call))
    return stack


def scenario_device(cell: str, device: torch.device) -> torch.device:
    """The device a case runs on: the CPU, or the non-CPU route's (CUDA when checked there, else ``meta``)."""
    if cell != "non-CPU":
        return torch.device("cpu")
    return device if device.type == "cuda" else torch.device("meta")


def run_passes(layer: nn.Module, device: torch.device, calls: list[str], create_graph: bool = False,
               capture: bool = False) -> dict[str, list[str]]:
    """The implementations a training forward and the input gradient ran (or a ``torch.jit.trace``: ``capture``)."""
    x = torch.randn(2, 9, 48, device=device, requires_grad=not capture)
    calls.clear()
    if capture:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch.jit.trace is deprecated; ONNX export still runs it
            torch.jit.trace(layer.eval(), x, check_trace=False)
        return {"forward": list(calls), "backward": []}
    y = layer.train()(x)
    ran = {"forward": list(calls)}
    calls.clear()
    torch.autograd.grad(y.square().sum(), x, create_graph=create_graph)
    ran["backward"] = list(calls)
    return ran


def route_rows(device: torch.device) -> list[tuple[str, str, bool]]:
    """Each row of the route table run once under its conditions: (row, what ran, whether it is the row's route)."""
    results, calls = [], []
    with spied(set(ROUTE_IMPLEMENTATIONS.values()), calls):
        for row in table_rows(ROUTE_HEADER):
            where, fused, dropout, capture, route = row
            run_on = scenario_device(ROUTE_DEVICES.get(where, "?"), device)
            p = 0.1 if dropout == "> 0" else 0.
            torch.manual_seed(0)
            layer = CollaborativeAttention(48, 3, key_dim=20, qkv_bias=True, attn_drop=p, device=run_on)
            layer.fused_attn = fused == "True"
            ran = run_passes(layer, run_on, calls, capture=capture == "yes")["forward"]
            expected = ROUTE_IMPLEMENTATIONS[Route(re.match(r"`(\w+)`", route).group(1))]
            results.append((" | ".join(row), f"{run_on.type}: {', '.join(ran) or '-'}", ran == [expected]))
    return results


def implementation_rows(device: torch.device) -> list[tuple[str, str, Optional[bool]]]:
    """Each row of the implementations table run under its condition: (row, what ran, whether exactly the row's
    implementations ran among those the table names for that pass; None where this torch cannot meet it)."""
    rows = table_rows(IMPLEMENTATION_HEADER)
    by_pass = {kind: set().union(*(named(r[4]) for r in rows if r[2] == kind)) for kind in ("forward", "backward")}
    results, calls = [], []
    with spied(by_pass["forward"] | by_pass["backward"], calls):
        for row in rows:
            layer_kind, route, kind, condition, implementation = row
            key = (layer_kind, route.strip("`"), kind, condition)
            if key not in SCENARIOS:
                results.append((" | ".join(row), "no case in gpu_coverage.SCENARIOS", False))
                continue
            if "CPU_FLASH" in condition and not attention_core.CPU_FLASH:
                results.append((" | ".join(row), "this torch has no CPU flash op", None))
                continue
            scenario = SCENARIOS[key]
            run_on = scenario_device(scenario.get("device", "cpu"), device)
            torch.manual_seed(0)
            if layer_kind == "collab":
                layer = CollaborativeAttention(48, 3, key_dim=scenario.get("key_dim", 20), qkv_bias=True,
                                               device=run_on)
            else:
                layer = ConcatAttention(48, 3, key_dim=24, qkv_bias=True, device=run_on)
            layer.fused_attn = scenario.get("fused", True)
            ran = set(run_passes(layer, run_on, calls, create_graph=scenario.get("create_graph", False))[kind])
            results.append((" | ".join(row), f"{run_on.type}: {', '.join(sorted(ran)) or '-'}",
                            ran & by_pass[kind] == named(implementation)))
    return results


def coverage_section(device: torch.device, report: list[str], failures: list[str]) -> None:
    """Every layer class has a case; every row of ``dispatch``'s tables runs what it says (module docstring)."""
    report += ["## Coverage: layer classes and the dispatch tables", "",
               f"Layer classes of `collab_vit.layers` checked: {', '.join(sorted({c.cls.__name__ for c in LAYERS}))}.",
               ""]
    for name in missing_layer_classes():
        failures.append(f"coverage: layer class {name} has no case in gpu_coverage.LAYERS")
    report += ["| table row | ran | as the row says |", "|---|---|---|"]
    for row, ran, ok in route_rows(device) + implementation_rows(device):
        report.append(f"| {row} | {ran} | {'n/a' if ok is None else 'yes' if ok else '**NO**'} |")
        if ok is False:
            failures.append(f"coverage: dispatch row '{row}' ran {ran}")
    report.append("")


def call_sdpa_args(step: Callable[[], None]) -> list[tuple[torch.Tensor, ...]]:
    """The (q, k, v) of each ``F.scaled_dot_product_attention`` call ``step`` makes through the package."""
    seen, real = [], torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((q, k, v))
        return real(q, k, v, **kwargs)

    with mock.patch.object(dispatch.F, "scaled_dot_product_attention", spy):
        step()
    return seen
