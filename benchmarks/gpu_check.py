"""GPU check of the attention layers: correctness against float64, what SDPA receives, the kernel each case runs, the
shared keys' layout, the routes, a compiled training step, throughput, and its own coverage; Markdown out, exit 1 on
any failure.

    PYTHONPATH=. python benchmarks/gpu_check.py                      # CUDA: meant for 5 minutes (never run on one yet)
    PYTHONPATH=. python benchmarks/gpu_check.py --quick              # fewer parts (the report says which)
    PYTHONPATH=. python benchmarks/gpu_check.py --out gpu_check.md   # also write the report to a file
    PYTHONPATH=. python benchmarks/gpu_check.py --tiny --device cpu  # the smoke mode the test suite runs

Layers: every attention layer class of ``collab_vit.layers`` (``gpu_coverage.LAYERS``: standard, content-bias-free,
causal, concat, axial RoPE-ViT and DINOv3-style rotary, BEiT relative position, EVA's call) at key dims 48, 64, 100,
192, 384 and 768 and 197, 577 and 1025 tokens (``gpu_numerics.shapes``).

1. Correctness: outputs and gradients (input and every parameter), training and eval, float32 and bfloat16 / float16
   autocast, against the float64 written-out route with derived bounds (``gpu_numerics``).
2. What SDPA receives on the CUDA route: q/k widths aligned for the fused kernels, shared keys a stride-0 view.
3. Kernels: the attention ops and CUDA kernels the profiler records (``math`` is torch's unfused SDPA kernel,
   ``explicit`` a written-out softmax: on CUDA either is a FAIL, a silent fallback). Any warning of the package too.
4. Shared keys at 577 tokens as SDPA's stride-0 view and as a contiguous copy: errors, step time, memory held.
5. Routes: each route of ``CollaborativeAttention`` forced on one layer (``sdpa``, the CUDA default; ``sdpa`` with
   the saved-tensor hook of the removed ``sdpa-pinned`` path; the CPU ``core``; ``explicit``): time, memory held
   for backward, error against ``explicit``; timm's ``Attention`` for scale.
6. One compiled training step (inductor, bfloat16) of a collaborative DeiT against eager.
7. Whole models at bfloat16 autocast, batch 256 (``--batch``): timm's ``deit_base_patch16_224`` against collab
   k768/384/192 and concat k384/192, inference and training step, img/s and peak memory.
8. Coverage: every layer class has a case and every row of ``collab_vit/layers/dispatch.py``'s tables runs what it
   names (``gpu_coverage``); a missing one is a FAIL.

``--quick`` drops 1025 tokens, the routes section and the concat models of the throughput section, and compiles
DeiT-S instead of DeiT-B. Imports only torch, timm and this package (``collab_vit``).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import statistics
import sys
import time
import warnings
from contextlib import ExitStack
from pathlib import Path
from typing import Callable, Optional
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, when not installed

import timm  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from timm.layers import Attention  # noqa: E402

import collab_vit  # noqa: E402,F401  (registers the models)
from collab_vit.layers import dispatch  # noqa: E402
from collab_vit.layers.dispatch import Path as Route  # noqa: E402
from collab_vit.layers.sdpa_layout import folded_layout, head_queries, shared_keys  # noqa: E402
from gpu_coverage import LAYERS, coverage_section  # noqa: E402  (benchmarks/, beside this file)
from gpu_numerics import (FORWARD_STEPS, Shapes, autocast, correctness_section, layouts_section,  # noqa: E402
                          rel_error, rounding_tolerance, sdpa_args_section, shapes)
from measure import timed  # noqa: E402

BASELINE = "deit_base_patch16_224"
MODELS = [BASELINE, "collab_deit_base_patch16_224_k192", "collab_deit_base_patch16_224_k384",
          "collab_deit_base_patch16_224_k768", "concat_deit_base_patch16_224_k384", "concat_deit_base_patch16_224_k192"]
TARGETS = {"collab_deit_base_patch16_224_k192": (1.0, 1.05), "collab_deit_base_patch16_224_k384": (0.9, 1.05)}
KERNEL_CLASSES = (  # (label, substrings of profiler op / kernel names)
    ("memory-efficient", ("_efficient_attention", "fmha_cutlass", "fmha_")),
    ("flash", ("_flash_attention", "flash_fwd", "flash_bwd")),
    ("cudnn", ("_cudnn_attention", "cudnn_generated_fort_native_sdpa")),
    ("math", ("_scaled_dot_product_attention_math",)),
    ("CPU core", ("CollaborativeCore",)),
    ("explicit softmax", ("aten::_softmax", "softmax_warp", "SoftMaxForward", "cunn_SoftMax")),
)


def attention_kernels(step: Callable[[], None], device: torch.device) -> tuple[list[str], list[str]]:
    """Kernel classes and the distinct attention-related names the profiler records during ``step``."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    names = {event.name for event in prof.events()}
    classes, shown = [], set()
    for label, needles in KERNEL_CLASSES:
        hits = sorted(n for n in names if any(needle in n for needle in needles))
        if hits:
            classes.append(label)
            shown.update(h if len(h) <= 60 else h[:57] + "..." for h in hits)
    return classes, sorted(shown)


def kernel_cases(s: Shapes, tiny: bool) -> list[tuple[str, nn.Module, dict, int]]:
    """(name, layer, forward keywords, tokens) of the kernels section: timm's ``Attention`` for scale, then every layer
    case at every key dim it takes (tiny: every other) and length."""
    first = next(iter(s.lengths))
    cases = [("timm Attention", Attention(s.dim, s.heads, qkv_bias=True), {}, first)]
    for case in LAYERS:
        key_dims = s.key_dims_of(case)
        for key_dim in key_dims[::2] if tiny and len(key_dims) > 1 else key_dims:
            for tokens in s.lengths:
                layer = case.build(s.dim, s.heads, key_dim, tokens)
                cases.append((f"{case.label} k{key_dim}", layer, case.inputs(s.dim, s.heads, tokens,
                                                                                torch.device("cpu"), torch.float32),
                              tokens))
    return cases


def kernels_section(device: torch.device, s: Shapes, tiny: bool, report: list[str], failures: list[str]) -> None:
    """The kernels each layer runs: bfloat16 training at every length; bfloat16 inference and float32 training at
    the first. On CUDA a package layer on ``math`` or ``explicit softmax`` is a silent fallback: a FAIL."""
    first = next(iter(s.lengths))
    report += ["## Kernels", "",
               f"Profiler op and kernel names per layer (dim {s.dim}, {s.heads} heads, batch 2). A package layer on "
               "`math` or `explicit softmax` on CUDA would be a silent fallback.", "",
               "| layer | tokens | mode | kernel classes | names |", "|---|---:|---|---|---|"]
    for name, layer, kwargs, tokens in kernel_cases(s, tiny):
        layer = layer.to(device)
        kwargs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in kwargs.items()}
        x = torch.randn(2, tokens, s.dim, device=device, requires_grad=True)
        modes = [("bf16 train", torch.bfloat16, True)]
        if tokens == first:
            modes += [("bf16 infer", torch.bfloat16, False), ("fp32 train", None, True)]
        for mode, amp, train in modes:
            def step() -> None:
                with autocast(device, amp):
                    if train:
                        layer.train()(x, **kwargs).float().sum().backward()
                    else:
                        with torch.inference_mode():
                            layer.eval()(x, **kwargs)
            step()  # warm-up outside the profile
            classes, names = attention_kernels(step, device)
            report.append(f"| {name} | {tokens} | {mode} | {', '.join(classes) or '-'} | "
                          f"{'<br>'.join(names) or '-'} |")
            if device.type == "cuda" and name != "timm Attention" and {"math", "explicit softmax"} & set(classes):
                failures.append(f"kernels: {name} {tokens} tokens {mode} ran {classes}")
    report.append("")


def held_bytes(layer: nn.Module, x: torch.Tensor, amp: Optional[torch.dtype], kwargs: Optional[dict] = None) -> int:
    """Bytes the allocator holds after one training forward beyond what it held before: what backward keeps."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with autocast(x.device, amp):
        out = layer(x, **(kwargs or {}))
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before - out.untyped_storage().nbytes()
    del out
    return held


class _Recompute:
    """Placeholder autograd stores instead of the per-head queries."""


def recomputing_folded_sdpa(q: torch.Tensor, mixing: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            content: Optional[torch.Tensor], scale: float, attn_mask: Optional[torch.Tensor],
                            is_causal: bool, dropout_p: float) -> torch.Tensor:
    """The ``sdpa`` route with the saved-tensor hook of the removed ``sdpa-pinned`` path (commit c2a1b61): autograd
    stores the shared ``q'`` and ``m'`` instead of the Nh x larger per-head queries and backward recomputes them."""
    q_ext, m_ext, k_ext = folded_layout(q, mixing, k, content)
    q2 = head_queries(q_ext, m_ext)
    key, shared = (q2.data_ptr(), tuple(q2.shape), q2.stride()), (q_ext.detach(), m_ext.detach())

    def pack(t: torch.Tensor) -> object:
        return _Recompute if (t.data_ptr(), tuple(t.shape), t.stride()) == key else t

    def unpack(packed: object) -> torch.Tensor:
        return head_queries(*shared) if packed is _Recompute else packed

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return dispatch.fused_attend(q2, shared_keys(k_ext, m_ext.shape[0]), v, scale, attn_mask, is_causal,
                                      dropout_p)


ROUTES = {  # label: (route forced in dispatch.select_path, replacement of dispatch.folded_sdpa or None)
    "sdpa (CUDA default)": (Route.SDPA, None),
    "sdpa + recompute hook": (Route.SDPA, recomputing_folded_sdpa),
    "core (CPU default)": (Route.CORE, None),
    "explicit": (Route.EXPLICIT, None),
}


def forced_route(label: str):
    """A context in which every ``CollaborativeAttention`` call takes the route ``label`` of ``ROUTES``."""
    path, folded = ROUTES[label]
    stack = ExitStack()
    stack.enter_context(mock.patch.object(dispatch, "select_path", lambda *args: path))
    if folded is not None:
        stack.enter_context(mock.patch.object(dispatch, "folded_sdpa", folded))
    return stack


def time_route(layer: nn.Module, x: torch.Tensor, repeats: int) -> tuple[torch.Tensor, float, float, str]:
    """bf16 output, forward ms, training-step ms and (CUDA) MiB held for backward of ``layer`` on ``x``."""
    def forward() -> torch.Tensor:
        with autocast(x.device, torch.bfloat16), torch.no_grad():
            return layer(x)

    def train() -> None:
        with autocast(x.device, torch.bfloat16):
            out = layer(x)
        out.float().sum().backward()

    out = forward().float()
    train()
    fwd = statistics.median(timed(forward, x.device) for _ in range(repeats)) * 1e3
    step = statistics.median(timed(train, x.device) for _ in range(repeats)) * 1e3
    held = f"{held_bytes(layer, x, torch.bfloat16) / 2**20:.1f}" if x.device.type == "cuda" else "-"
    layer.zero_grad(set_to_none=True)
    return out, fwd, step, held


def routes_section(device: torch.device, s: Shapes, tiny: bool, repeats: int, report: list[str],
                   failures: list[str]) -> None:
    """Every route of ``CollaborativeAttention`` on this device, forced: bf16 forward / training-step time and, on
    CUDA, the memory held for backward; timm's ``Attention`` for scale. The evidence for ``dispatch``'s table."""
    tokens = next(iter(s.lengths))
    batch = 2 if tiny else 64
    bound = rounding_tolerance(torch.bfloat16, 2 * FORWARD_STEPS)  # two bf16 computations, each within 8 roundings
    report += ["## Routes (one layer, each route forced)", "",
               f"Batch {batch}, {tokens} tokens, dim {s.dim}, {s.heads} heads, bf16 autocast; median of {repeats} "
               "after one warm-up. Held: allocator bytes after a training forward (CUDA only). Error: the output's "
               f"relative Frobenius error against the explicit route (bound {bound:.3g}).",
               "", "| layer | route | forward ms | train step ms | held MiB | error vs explicit |",
               "|---|---|---:|---:|---:|---:|"]
    x = torch.randn(batch, tokens, s.dim, device=device, requires_grad=True)
    _, fwd, step, held = time_route(Attention(s.dim, s.heads, qkv_bias=True).to(device).train(), x, repeats)
    report.append(f"| timm Attention | - | {fwd:.2f} | {step:.2f} | {held} | - |")
    for key_dim in s.key_dims[::2] if tiny else s.key_dims:
        layer = LAYERS[0].build(s.dim, s.heads, key_dim, tokens).to(device)
        results = {}
        for label in ROUTES:
            with forced_route(label):
                results[label] = time_route(layer, x, repeats)
        for label, (out, fwd, step, held) in results.items():
            error = rel_error(out, results["explicit"][0])
            report.append(f"| collab k{key_dim} | {label} | {fwd:.2f} | {step:.2f} | {held} | {error:.2e} |")
            if error > bound:
                failures.append(f"routes: collab k{key_dim} {label} differs from explicit by {error:.2e}")
    report.append("")


def step_timer(repeats: int) -> Callable[[nn.Module, torch.Tensor, Optional[torch.dtype], dict], str]:
    """``timed_step`` of ``gpu_numerics.layouts_section``: on CUDA the median training-step ms of ``repeats`` and
    the MiB held for backward, as "ms / MiB"; elsewhere "-"."""
    def timed_step(layer: nn.Module, x: torch.Tensor, amp: Optional[torch.dtype], kwargs: dict) -> str:
        if x.device.type != "cuda":
            return "-"
        x = x.detach().requires_grad_(True)

        def train() -> None:
            with autocast(x.device, amp):
                out = layer(x, **kwargs)
            out.float().sum().backward()

        train()
        ms = statistics.median(timed(train, x.device) for _ in range(repeats)) * 1e3
        held = held_bytes(layer, x, amp, kwargs) / 2 ** 20
        layer.zero_grad(set_to_none=True)
        return f"{ms:.2f} / {held:.1f}"
    return timed_step


def compiled_section(device: torch.device, tiny: bool, quick: bool, repeats: int, report: list[str],
                     failures: list[str]) -> None:
    """One training step of a collaborative DeiT under ``torch.compile`` (inductor on CUDA; the tiny CPU mode uses
    ``aot_eager``: inductor's C++ build of even a tiny model takes minutes on a small CPU), bfloat16 autocast: compile
    time, step time against eager, the first loss against eager's (same weights and batch), the SDPA kernels."""
    name, batch, kwargs = (("collab_deit_tiny_patch16_224_k48", 2, dict(img_size=32, patch_size=8, depth=2)) if tiny
                           else ("collab_deit_small_patch16_224_k96", 64, {}) if quick
                           else ("collab_deit_base_patch16_224_k192", 64, {}))
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    torch.manual_seed(0)
    eager = timm.create_model(name, **kwargs).to(device).train()
    size = kwargs.get("img_size", 224)
    images = torch.randn(batch, 3, size, size, device=device)
    targets = torch.randint(0, eager.num_classes, (batch,), device=device)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend=backend)
    losses, times = {}, {}
    for label, net in (("eager", eager), ("compiled", compiled)):
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)

        def step() -> torch.Tensor:
            with autocast(device, torch.bfloat16):
                loss = nn.functional.cross_entropy(net(images), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach().float()

        started = time.perf_counter()
        losses[label] = step().item()
        times[label + " first"] = time.perf_counter() - started
        times[label] = statistics.median(timed(step, device) for _ in range(repeats)) * 1e3

    def compiled_pass() -> None:
        with autocast(device, torch.bfloat16):  # the compiled graph's dtype: no recompilation
            loss = nn.functional.cross_entropy(compiled(images), targets)
        loss.backward()

    classes, _ = attention_kernels(compiled_pass, device)
    bound = rounding_tolerance(torch.bfloat16, 2 * FORWARD_STEPS * len(eager.blocks))
    error = abs(losses["compiled"] - losses["eager"]) / abs(losses["eager"])
    fused = {"memory-efficient", "flash", "cudnn"} & set(classes)  # inductor may decompose a math fallback: ask
    ok = error <= bound and not (device.type == "cuda" and ({"math", "explicit softmax"} & set(classes) or not fused))
    report += ["## Compiled training step", "",
               f"`{name}`, batch {batch}, bfloat16 autocast, AdamW; `torch.compile(backend='{backend}')`.", "",
               "| first step s (eager / compiled) | step ms (eager / compiled) | first loss (eager / compiled) | "
               "relative difference (bound) | compiled kernels | within |", "|---|---|---|---|---|---|",
               f"| {times['eager first']:.2f} / {times['compiled first']:.2f} | {times['eager']:.1f} / "
               f"{times['compiled']:.1f} | {losses['eager']:.5f} / {losses['compiled']:.5f} | {error:.2e} "
               f"({bound:.2e}) | {', '.join(classes) or '-'} | {'yes' if ok else '**NO**'} |", ""]
    if not ok:
        failures.append(f"compiled step: loss differs by {error:.2e} or kernels {classes}")


def measure_model(name: str, device: torch.device, batch: int, warmup: int, repeats: int,
                  model_kwargs: dict) -> dict[str, float]:
    torch.manual_seed(0)
    model = timm.create_model(name, **model_kwargs).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    size = model.pretrained_cfg["input_size"][-1] if not model_kwargs else model_kwargs["img_size"]
    images = torch.randn(batch, 3, size, size, device=device)
    targets = torch.randint(0, model.num_classes, (batch,), device=device)
    def infer() -> None:
        model.eval()
        with torch.inference_mode(), autocast(device, torch.bfloat16):
            model(images)

    def train() -> None:
        model.train()
        with autocast(device, torch.bfloat16):
            loss = nn.functional.cross_entropy(model(images), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        infer()
        train()
    peak = 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        train()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    infer_s = statistics.median(timed(infer, device) for _ in range(repeats))
    train_s = statistics.median(timed(train, device) for _ in range(repeats))
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"infer": batch / infer_s, "train": batch / train_s, "peak": peak}


def throughput_section(device: torch.device, tiny: bool, quick: bool, batch: int, warmup: int, repeats: int,
                       report: list[str], failures: list[str]) -> None:
    kwargs = dict(img_size=32, patch_size=8, depth=2) if tiny else {}
    names = [BASELINE.replace("base", "tiny"), "collab_deit_tiny_patch16_224_k48",
             "concat_deit_tiny_patch16_224_k48"] if tiny else [m for m in MODELS if not (quick and "concat" in m)]
    report += ["## Throughput and peak memory (bf16 autocast)", "",
               f"Batch {batch}{', tiny models (32 px, patch 8, depth 2)' if tiny else ', 224 px'}; median of "
               f"{repeats} after {warmup} warm-up; training step = forward, backward, AdamW. The baseline runs "
               "first and again last (drift).", "",
               "| model | infer img/s | infer ratio | train img/s | train ratio | peak MiB | peak ratio |",
               "|---|---:|---:|---:|---:|---:|---:|"]
    results = {name: measure_model(name, device, batch, warmup, repeats, kwargs) for name in names}
    again = measure_model(names[0], device, batch, warmup, repeats, kwargs)
    base = results[names[0]]
    for name, r in list(results.items()) + [(names[0] + " (again)", again)]:
        peak = f"{r['peak'] / 2**20:.0f} | {r['peak'] / base['peak']:.3f}" if base["peak"] else "- | -"
        report.append(f"| `{name}` | {r['infer']:.1f} | {r['infer'] / base['infer']:.3f} | {r['train']:.1f} | "
                      f"{r['train'] / base['train']:.3f} | {peak} |")
    if not tiny:
        report += ["", "Targets: training step collab/timm >= 1.0 at k192 and >= 0.9 at k384; peak memory "
                   "<= 1.05x timm at both.", ""]
        for name, (speed, memory) in TARGETS.items():
            r = results[name]
            met = r["train"] / base["train"] >= speed and r["peak"] / base["peak"] <= memory
            report.append(f"- `{name}`: train ratio {r['train'] / base['train']:.3f} (>= {speed}), peak ratio "
                          f"{r['peak'] / base['peak']:.3f} (<= {memory}): {'met' if met else '**missed**'}")
    report.append("")


QUICK_DROPS = "1025 tokens, the routes section, the concat models' throughput; DeiT-S compiled instead of DeiT-B"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and models (the test suite's mode)")
    parser.add_argument("--quick", action="store_true", help=f"drop parts: {QUICK_DROPS}")
    parser.add_argument("--batch", type=int, default=None, help="whole-model batch (default 256; tiny: 2)")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="also write the Markdown report here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; run with --device cpu --tiny for the CPU smoke mode", file=sys.stderr)
        return 2
    batch = args.batch or (2 if args.tiny else 256)
    warmup = args.warmup if args.warmup is not None else (0 if args.tiny else 3)
    repeats = args.repeats if args.repeats is not None else (1 if args.tiny else 10)
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    report = [f"# GPU check of collab-vit's attention ({datetime.date.today().isoformat()})", "",
              f"{machine}, torch {torch.__version__}, timm {timm.__version__}; command: "
              f"`python benchmarks/gpu_check.py {' '.join(argv if argv is not None else sys.argv[1:])}`", ""]
    if args.quick:
        report += [f"`--quick` dropped: {QUICK_DROPS}.", ""]
    s = shapes(args.tiny, args.quick)
    failures: list[str] = []
    started = time.time()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        correctness_section(device, s, report, failures)
        sdpa_args_section(device, s, report, failures)
        kernels_section(device, s, args.tiny, report, failures)
        layouts_section(device, s, report, failures, step_timer(repeats))
        if not args.quick:
            routes_section(device, s, args.tiny, repeats, report, failures)
        compiled_section(device, args.tiny, args.quick, repeats, report, failures)
        if not args.skip_throughput:
            throughput_section(device, args.tiny, args.quick, batch, warmup, repeats, report, failures)
        coverage_section(device, report, failures)
    layer_warnings = sorted({str(w.message) for w in caught if str(w.message).startswith("collab_vit")})
    failures += [f"warning: {message}" for message in layer_warnings]
    report += ["## Verdict", "", f"Wall time {time.time() - started:.0f} s.", ""]
    report += [f"- FAIL {failure}" for failure in failures] or ["- all checks passed"]
    text = "\n".join(report) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
