"""The numerical sections of ``gpu_check.py``: every layer case (``gpu_coverage.LAYERS``) against a float64 reference
of its written-out route, train and eval, float32 and bfloat16 / float16 autocast; what the non-CPU route hands SDPA
(widths, strides, dtypes); the shared keys as a stride-0 view against a contiguous copy.

Tolerances are derived, not fitted: a relative Frobenius error within ``rounding_tolerance(dtype, steps)`` (the
roundings of the compute dtype along the longest chain) plus ``rounding_tolerance(float32, chain)`` (float32
accumulation over the reduction lengths, ``tests/numerics.py``'s model: input projections ``dim``, logits ``key_dim``,
softmax and weights x values ``tokens``, output projection ``dim``; gradients twice that plus ``batch x tokens``).
"""
from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional
from unittest import mock

import torch
import torch.nn as nn

from collab_vit.layers import dispatch
from collab_vit.layers.dispatch import Path as Route
from gpu_coverage import LAYERS, SHARED_KEYS, LayerCase, call_sdpa_args  # noqa: E402  (beside this file)
from vit_family import ROPE_CHAIN  # noqa: E402

FORWARD_STEPS = 8  # input, projection, mixing, mixed queries, logits, weights, weights x values, output projection


@dataclass(frozen=True)
class Shapes:
    """The check's layer shapes: token dim, heads, sequence lengths with their batch, key dims."""

    dim: int
    heads: int
    lengths: dict  # tokens -> batch
    key_dims: tuple

    def key_dims_of(self, case: LayerCase) -> list[int]:
        """The key dims a case runs at: those it takes; a standard layer at full width only."""
        if not case.reduced:
            return [self.dim]
        return [k for k in self.key_dims if case.fits(self.dim, self.heads, k)]


def shapes(tiny: bool, quick: bool) -> Shapes:
    """ViT-B at 224, 384 and 512 px (197, 577 = 1 mod 32, 1025 tokens; ``--quick`` drops 1025); tiny: head dim 16,
    key dims on both sides of the CPU core's flash branch."""
    if tiny:
        return Shapes(48, 3, {9: 2, 17: 2}, (8, 30, 96))
    lengths = {197: 8, 577: 4} if quick else {197: 8, 577: 4, 1025: 2}
    return Shapes(768, 12, lengths, (48, 64, 100, 192, 384, 768))


def rounding_tolerance(dtype: torch.dtype, steps: int) -> float:
    """Relative error bound of a computation in ``dtype``: ``steps`` roundings of unit roundoff ``u = eps / 2``.

    Each rounding perturbs a value by at most ``u`` relative; through well-conditioned steps (linear maps; softmax of
    logits of order one) the first-order errors add.
    """
    return steps * torch.finfo(dtype).eps / 2


def bounds(case: LayerCase, dtype: torch.dtype, dim: int, key_dim: int, tokens: int,
           batch: int) -> tuple[float, float]:
    """(output, gradient) bounds of one case against float64 (module docstring); a rotary layer adds its rotation's
    ``ROPE_CHAIN`` roundings, a scale norm one more reduction over ``dim``."""
    extra = ROPE_CHAIN if case.extra in ("axial", "dinov3") else 0
    chain = 2 * dim + key_dim + tokens + (dim if "norm_layer" in case.kwargs else 0)
    output = rounding_tolerance(dtype, FORWARD_STEPS + extra) + rounding_tolerance(torch.float32, chain)
    grads = (rounding_tolerance(dtype, 2 * (FORWARD_STEPS + extra))
             + rounding_tolerance(torch.float32, 2 * chain + batch * tokens))
    return output, grads


def autocast(device: torch.device, dtype: Optional[torch.dtype]):
    """``torch.autocast`` to ``dtype`` on the device, or nothing for full precision."""
    return nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def outputs_and_grads(layer: nn.Module, x: torch.Tensor, amp: Optional[torch.dtype], kwargs: dict,
                      train: bool = True) -> list[torch.Tensor]:
    """Output, then (``train``) input gradient and every parameter gradient of one step (fixed output weights);
    eval: the output under ``inference_mode``."""
    layer = copy.deepcopy(layer).train(train)
    if not train:
        with torch.inference_mode(), autocast(x.device, amp):
            return [layer(x, **kwargs).clone()]
    x = x.clone().requires_grad_(True)
    with autocast(x.device, amp):
        out = layer(x, **kwargs)
    # fixed random output weights (a ramp would sum to about zero over the rows: every bias gradient a cancellation)
    wide = torch.promote_types(out.dtype, torch.float32)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(x.device, wide)
    (out.to(wide) * weights).sum().backward()
    return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]


def reference(layer: nn.Module, x: torch.Tensor, case: LayerCase, dim: int, heads: int) -> list[torch.Tensor]:
    """The float64 written-out route (``fused_attn`` off) on the same weights and inputs."""
    explicit = copy.deepcopy(layer).double()
    explicit.fused_attn = False
    tokens = x.shape[1]
    return outputs_and_grads(explicit, x.double(), None, case.inputs(dim, heads, tokens, x.device, torch.float64))


def precisions(device: torch.device) -> list[Optional[torch.dtype]]:
    """float32 (no autocast), bfloat16 and float16 autocast."""
    return [None, torch.bfloat16, torch.float16]


def correctness_section(device: torch.device, s: Shapes, report: list[str], failures: list[str]) -> None:
    """Every layer case at every length and key dim: train (output and every gradient) and eval (output), each
    precision, against the float64 written-out route."""
    report += ["## Correctness against float64", "",
               f"Each layer ({s.dim} dim, {s.heads} heads, random weights) against its written-out route in float64 on "
               f"the same device: relative Frobenius error of the output and of the worst gradient (input and every "
               f"parameter), training step and eval; bound = roundings of the compute dtype + float32 accumulation "
               f"(`gpu_numerics` docstring). Tokens (batch): {', '.join(f'{n} ({b})' for n, b in s.lengths.items())}.",
               "", "| layer | tokens | key dim | precision | train output | worst gradient | eval output | bounds | "
                   "within |", "|---|---:|---:|---|---:|---:|---:|---|---|"]
    for case in LAYERS:
        for tokens, batch in s.lengths.items():
            for key_dim in s.key_dims_of(case):
                layer = case.build(s.dim, s.heads, key_dim, tokens).to(device)
                x = torch.randn(batch, tokens, s.dim, device=device)
                ref = reference(layer, x, case, s.dim, s.heads)
                for amp in precisions(device):
                    kwargs = case.inputs(s.dim, s.heads, tokens, device, torch.float32)
                    got = outputs_and_grads(layer, x, amp, kwargs)
                    evaluated = outputs_and_grads(layer, x, amp, kwargs, train=False)[0]
                    errors = [rel_error(a, b) for a, b in zip(got, ref)]
                    eval_error = rel_error(evaluated, ref[0])
                    out_bound, grad_bound = bounds(case, amp or torch.float32, s.dim, key_dim, tokens, batch)
                    ok = errors[0] <= out_bound and eval_error <= out_bound and max(errors[1:]) <= grad_bound
                    name = "float32" if amp is None else f"{str(amp)[6:]} autocast"
                    report.append(f"| {case.label} | {tokens} | {key_dim} | {name} | {errors[0]:.2e} | "
                                  f"{max(errors[1:]):.2e} | {eval_error:.2e} | {out_bound:.2e} / {grad_bound:.2e} | "
                                  f"{'yes' if ok else '**NO**'} |")
                    if not ok:
                        failures.append(f"correctness: {case.label}, {tokens} tokens, key dim {key_dim}, {name}")
    report.append("")


def sdpa_args_section(device: torch.device, s: Shapes, report: list[str], failures: list[str]) -> None:
    """What the non-CPU route hands SDPA (on CUDA under autocast; on a machine without one the ``meta`` device in
    the dtype: the same route, no kernel): q/k widths equal and a multiple of 8 (16-bit) or 4 (float32), every last
    dim contiguous, the compute dtype, shared keys one stride-0 view. Otherwise CUDA takes the math kernel."""
    where = device if device.type == "cuda" else torch.device("meta")
    tokens = next(iter(s.lengths))
    report += ["## What SDPA receives on the CUDA route", "",
               f"On `{where.type}`, {tokens} tokens, batch 2, training step. Widths q/k/v; `k` strides; a 16-bit "
               "q/k width off a multiple of 8 (4 in float32) or a copied shared key is a FAIL.", "",
               "| layer | key dim | dtype | q/k/v widths | k strides | within |", "|---|---:|---|---|---|---|"]
    for case in LAYERS:
        for key_dim in s.key_dims_of(case):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                layer = case.build(s.dim, s.heads, key_dim, tokens)
                on_meta = where.type == "meta"
                layer = layer.to(where, dtype if on_meta else torch.float32)
                x = torch.randn(2, tokens, s.dim, device=where, dtype=dtype if on_meta else torch.float32,
                                requires_grad=True)
                kwargs = case.inputs(s.dim, s.heads, tokens, where, x.dtype)

                def step() -> None:
                    with autocast(where, None if on_meta or dtype == torch.float32 else dtype):
                        out = layer(x, **kwargs)
                    out.float().sum().backward()

                calls = call_sdpa_args(step)
                align = 4 if dtype == torch.float32 else 8
                ok = len(calls) == 1
                if ok:
                    q, k, v = calls[0]
                    ok = (q.shape[-1] == k.shape[-1] and q.shape[-1] % align == 0 and v.shape[-1] % align == 0
                          and {q.dtype, k.dtype, v.dtype} == {dtype} and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
                          and (k.stride(1) == 0 or not issubclass(case.cls, SHARED_KEYS) or not case.reduced))
                    widths, strides = f"{q.shape[-1]}/{k.shape[-1]}/{v.shape[-1]}", str(tuple(k.stride()))
                else:
                    widths, strides = f"{len(calls)} SDPA calls", "-"
                report.append(f"| {case.label} | {key_dim} | {str(dtype)[6:]} | {widths} | {strides} | "
                              f"{'yes' if ok else '**NO**'} |")
                if not ok:
                    failures.append(f"sdpa arguments: {case.label} k{key_dim} {dtype}: {widths}, k strides {strides}")
    report.append("")


def contiguous_keys():
    """A context in which SDPA receives the shared keys as a contiguous copy instead of the stride-0 view."""
    real = torch.nn.functional.scaled_dot_product_attention

    def copied(q, k, v, **kwargs):
        return real(q, k.contiguous() if k.stride(1) == 0 else k, v, **kwargs)

    return mock.patch.object(dispatch.F, "scaled_dot_product_attention", copied)


def layouts_section(device: torch.device, s: Shapes, report: list[str], failures: list[str],
                    timed_step) -> None:
    """The shared keys as SDPA's stride-0 view and as a contiguous copy, at the second length (577 tokens: 1 mod
    32, where a memory-efficient kernel was reported wrong with stride-0 keys): both against float64 under bfloat16
    and float16 autocast; on CUDA training-step time and memory held for backward (``timed_step``)."""
    tokens = list(s.lengths)[1]
    report += ["## Shared keys: stride-0 view against a contiguous copy", "",
               f"{tokens} tokens, batch {s.lengths[tokens]}; error of output / worst gradient against float64; ms and MiB held "
               "for backward (CUDA) of one training step.", "",
               "| layer | key dim | precision | stride-0 error | contiguous error | stride-0 ms / MiB | "
               "contiguous ms / MiB | within |", "|---|---:|---|---|---|---|---|---|"]
    forced = nullcontext() if device.type == "cuda" else mock.patch.object(dispatch, "select_path",
                                                                           lambda *args: Route.SDPA)
    with forced:  # the CPU's default route is the core: the smoke mode forces SDPA (whose CPU padding copies k)
        layouts_rows(device, s, tokens, report, failures, timed_step)
    report.append("")


def layouts_rows(device: torch.device, s: Shapes, tokens: int, report: list[str], failures: list[str],
                 timed_step) -> None:
    """The rows of ``layouts_section``: each shared-key layer case and key dim, bfloat16 and float16."""
    batch = s.lengths[tokens]
    for case in (c for c in LAYERS if issubclass(c.cls, SHARED_KEYS) and c.reduced and not c.call):
        for key_dim in s.key_dims_of(case):
            layer = case.build(s.dim, s.heads, key_dim, tokens).to(device)
            x = torch.randn(batch, tokens, s.dim, device=device)
            ref = reference(layer, x, case, s.dim, s.heads)
            kwargs = case.inputs(s.dim, s.heads, tokens, device, torch.float32)
            for amp in (torch.bfloat16, torch.float16):
                cells, ok = [], True
                out_bound, grad_bound = bounds(case, amp, s.dim, key_dim, tokens, batch)
                for layout in (nullcontext, contiguous_keys):
                    with layout():
                        errors = [rel_error(a, b) for a, b in zip(outputs_and_grads(layer, x, amp, kwargs), ref)]
                        speed = timed_step(layer, x, amp, kwargs)
                    ok = ok and errors[0] <= out_bound and max(errors[1:]) <= grad_bound
                    cells += [f"{errors[0]:.2e} / {max(errors[1:]):.2e}", speed]
                report.append(f"| {case.label} | {key_dim} | {str(amp)[6:]} | {cells[0]} | {cells[2]} | {cells[1]} | "
                              f"{cells[3]} | {'yes' if ok else '**NO**'} |")
                if not ok:
                    failures.append(f"layouts: {case.label} k{key_dim} {amp} at {tokens} tokens")
