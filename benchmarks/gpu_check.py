"""GPU check of the attention layers: correctness, the SDPA kernel each case runs, the routes, throughput; Markdown out.

    PYTHONPATH=. python benchmarks/gpu_check.py                      # CUDA, about 3 to 5 minutes on one GPU
    PYTHONPATH=. python benchmarks/gpu_check.py --out gpu_check.md   # also write the report to a file
    PYTHONPATH=. python benchmarks/gpu_check.py --tiny --device cpu  # seconds: the mode the test suite runs

1. Correctness: ``CollaborativeAttention`` outputs and gradients (input and every parameter) against its explicit
   path in float32 on the same device (max error / max |reference| <= 1e-4), and under bfloat16 / float16 autocast
   against the float32 explicit path (relative Frobenius error within ``rounding_tolerance``).
2. Kernels: the attention ops and CUDA kernels the profiler records for each layer (training step and inference);
   ``math`` is torch's unfused SDPA kernel, ``explicit`` a written-out softmax (on CUDA either is a FAIL: a silent
   fallback). Any warning of the package is reported.
3. Routes: each route of ``CollaborativeAttention`` forced on one layer (``sdpa``, the CUDA default; ``sdpa`` with
   the saved-tensor hook of the removed ``sdpa-pinned`` path; the CPU ``core``; ``explicit``): forward and training
   step time, memory held for backward (allocator bytes after forward) and error against ``explicit``; timm's
   ``Attention`` for scale. What the table in ``collab_vit/layers/dispatch.py`` should follow on a GPU.
4. Whole models at bfloat16 autocast, batch 256 (``--batch``): timm's ``deit_base_patch16_224`` against collab
   k768/384/192 and concat k384/192, inference and training step (forward, backward, AdamW), img/s and peak memory.

Imports only torch, timm and this package (``collab_vit``), so it runs on a machine with just those installed.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import statistics
import sys
import time
import warnings
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import Callable, Optional
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, when not installed

import timm  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from timm.layers import Attention  # noqa: E402

import collab_vit  # noqa: E402,F401  (registers the models)
from collab_vit import CollaborativeAttention, ConcatAttention  # noqa: E402
from collab_vit.layers import dispatch  # noqa: E402
from collab_vit.layers.dispatch import Path as Route  # noqa: E402
from collab_vit.layers.sdpa_layout import folded_layout, head_queries, shared_keys  # noqa: E402
from measure import timed  # noqa: E402  (benchmarks/measure.py, beside this file)

BASELINE = "deit_base_patch16_224"
MODELS = [BASELINE, "collab_deit_base_patch16_224_k192", "collab_deit_base_patch16_224_k384",
          "collab_deit_base_patch16_224_k768", "concat_deit_base_patch16_224_k384", "concat_deit_base_patch16_224_k192"]
TARGETS = {"collab_deit_base_patch16_224_k192": (1.0, 1.05), "collab_deit_base_patch16_224_k384": (0.9, 1.05)}
FP32_TOL = 1e-4


def rounding_tolerance(dtype: torch.dtype, steps: int) -> float:
    """Relative error bound of a computation in ``dtype``: ``steps`` roundings of unit roundoff ``u = eps / 2``.

    Each rounding perturbs a value by at most ``u`` relative; through well-conditioned steps (linear maps; softmax of
    logits of order one) the first-order errors add. The forward has 8 roundings on its longest chain (input,
    projection, mixing, mixed queries, logits, weights, weights x values, output projection), a gradient twice that.
    """
    return steps * torch.finfo(dtype).eps / 2


def autocast(device: torch.device, dtype: Optional[torch.dtype]):
    """``torch.autocast`` to ``dtype`` on the device, or nothing for full precision."""
    return nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def outputs_and_grads(layer: nn.Module, x: torch.Tensor, amp: Optional[torch.dtype], **kwargs) -> list[torch.Tensor]:
    """Output, input gradient and every parameter gradient of one training step (fixed output weights)."""
    layer = copy.deepcopy(layer).train()
    x = x.clone().requires_grad_(True)
    with autocast(x.device, amp):
        out = layer(x, **kwargs)
    weights = torch.linspace(-1, 1, out.numel(), device=x.device).reshape(out.shape)
    (out.float() * weights).sum().backward()
    return [out.detach().float(), x.grad.float()] + [p.grad.float() for p in layer.parameters()]


def layer_shapes(tiny: bool) -> tuple[int, int, int, int, list[int]]:
    """dim, heads, tokens, batch, and key dims below / equal to / above the head dim, one not a multiple of 8."""
    if tiny:  # head dim 16: the CPU core's flash branch (8, 30) and its grouped-matmul branch (96)
        return 48, 3, 9, 2, [8, 30, 96]
    return 768, 12, 197, 8, [48, 64, 100, 192, 384, 768]


def random_layer(dim: int, heads: int, key_dim: int, qkv_bias: bool, device: torch.device) -> CollaborativeAttention:
    torch.manual_seed(key_dim)
    layer = CollaborativeAttention(dim, heads, key_dim=key_dim, qkv_bias=qkv_bias, mixing_init="random")
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, dim ** -0.5)  # logits of order one, as in a trained layer
    return layer.to(device)


def correctness_section(device: torch.device, tiny: bool, report: list[str], failures: list[str]) -> None:
    dim, heads, tokens, batch, key_dims = layer_shapes(tiny)
    precisions = [None, torch.bfloat16] + ([torch.float16] if device.type == "cuda" else [])
    report += ["## Correctness", "",
               f"`CollaborativeAttention({dim}, {heads}, key_dim)`, batch {batch}, {tokens} tokens, training step. "
               f"float32: max error / max |ref| of fused vs explicit path (<= {FP32_TOL:g}); 16-bit autocast: "
               f"relative Frobenius error vs the float32 explicit path, forward and worst gradient "
               f"(bounds: bfloat16 {rounding_tolerance(torch.bfloat16, 8):.3g} / "
               f"{rounding_tolerance(torch.bfloat16, 16):.3g}, float16 {rounding_tolerance(torch.float16, 8):.3g} / "
               f"{rounding_tolerance(torch.float16, 16):.3g}).", "",
               "| key dim | content bias | mask | precision | output error | worst gradient error | within |",
               "|---:|---|---|---|---:|---:|---|"]
    for key_dim in key_dims:
        for qkv_bias, causal in ((True, False), (False, False), (True, True)):
            layer = random_layer(dim, heads, key_dim, qkv_bias, device)
            explicit = copy.deepcopy(layer)
            explicit.fused_attn = False
            x = torch.randn(batch, tokens, dim, device=device)
            kwargs = {"is_causal": causal}
            reference = outputs_and_grads(explicit, x, None, **kwargs)
            for amp in precisions:
                got = outputs_and_grads(layer, x, amp, **kwargs)
                if amp is None:
                    errors = [max_error(a, b) for a, b in zip(got, reference)]
                    ok = max(errors) <= FP32_TOL
                else:
                    errors = [rel_error(a, b) for a, b in zip(got, reference)]
                    ok = (errors[0] <= rounding_tolerance(amp, 8) and max(errors[1:]) <= rounding_tolerance(amp, 16))
                name = "float32" if amp is None else f"{str(amp)[6:]} autocast"
                report.append(f"| {key_dim} | {'yes' if qkv_bias else 'no'} | {'causal' if causal else 'none'} | "
                              f"{name} | {errors[0]:.2e} | {max(errors[1:]):.2e} | {'yes' if ok else '**NO**'} |")
                if not ok:
                    failures.append(f"correctness: key dim {key_dim}, {name}, bias {qkv_bias}, causal {causal}")
    report.append("")


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


def kernel_layers(tiny: bool) -> dict[str, nn.Module]:
    dim, heads, _, _, key_dims = layer_shapes(tiny)
    layers: dict[str, nn.Module] = {"timm Attention": Attention(dim, heads, qkv_bias=True)}
    for key_dim in key_dims[::2] if tiny else key_dims:
        layers[f"collab k{key_dim}"] = CollaborativeAttention(dim, heads, key_dim=key_dim, qkv_bias=True)
    layers[f"collab k{key_dims[-1]} no bias"] = CollaborativeAttention(dim, heads, key_dim=key_dims[-1])
    for key_dim in ((heads * 4,) if tiny else (384, 192)):
        layers[f"concat k{key_dim}"] = ConcatAttention(dim, heads, key_dim=key_dim, qkv_bias=True)
    return layers


def kernels_section(device: torch.device, tiny: bool, report: list[str], failures: list[str]) -> None:
    dim, heads, tokens, batch, _ = layer_shapes(tiny)
    modes = [("bf16 train", torch.bfloat16, True), ("bf16 infer", torch.bfloat16, False),
             ("fp32 train", None, True)]
    report += ["## Kernels", "",
               f"Profiler op and kernel names per layer (batch {batch}, {tokens} tokens, dim {dim}, {heads} heads). "
               "A collaborative or concat layer on `math` or `explicit softmax` would be a silent fallback.", "",
               "| layer | mode | kernel classes | names |", "|---|---|---|---|"]
    x = torch.randn(batch, tokens, dim, device=device, requires_grad=True)
    for name, layer in kernel_layers(tiny).items():
        layer = layer.to(device)
        for mode, amp, train in modes:
            def step() -> None:
                with autocast(device, amp):
                    if train:
                        layer.train()(x).float().sum().backward()
                    else:
                        with torch.inference_mode():
                            layer.eval()(x)
            step()  # warm-up outside the profile
            classes, names = attention_kernels(step, device)
            report.append(f"| {name} | {mode} | {', '.join(classes) or '-'} | {'<br>'.join(names) or '-'} |")
            if name != "timm Attention" and ({"math", "explicit softmax"} & set(classes)):
                failures.append(f"kernels: {name} {mode} ran {classes}")
    report.append("")


def held_bytes(layer: nn.Module, x: torch.Tensor, amp: Optional[torch.dtype]) -> int:
    """Bytes the allocator holds after one training forward beyond what it held before: what backward keeps."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with autocast(x.device, amp):
        out = layer(x)
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


def routes_section(device: torch.device, tiny: bool, repeats: int, report: list[str], failures: list[str]) -> None:
    """Every route of ``CollaborativeAttention`` on this device, forced: bf16 forward / training-step time and, on
    CUDA, the memory held for backward; timm's ``Attention`` for scale. The evidence for ``dispatch``'s table."""
    dim, heads, tokens, _, key_dims = layer_shapes(tiny)
    batch = 2 if tiny else 64
    report += ["## Routes (one layer, each route forced)", "",
               f"Batch {batch}, {tokens} tokens, dim {dim}, {heads} heads, bf16 autocast; median of {repeats} after "
               "one warm-up. Held: allocator bytes after a training forward (CUDA only). Error: the output's "
               f"relative Frobenius error against the explicit route (bound {rounding_tolerance(torch.bfloat16, 8):.3g}).",
               "", "| layer | route | forward ms | train step ms | held MiB | error vs explicit |",
               "|---|---|---:|---:|---:|---:|"]
    x = torch.randn(batch, tokens, dim, device=device, requires_grad=True)
    _, fwd, step, held = time_route(Attention(dim, heads, qkv_bias=True).to(device).train(), x, repeats)
    report.append(f"| timm Attention | - | {fwd:.2f} | {step:.2f} | {held} | - |")
    for key_dim in key_dims[::2] if tiny else key_dims:
        layer = random_layer(dim, heads, key_dim, True, device).train()
        results = {}
        for label in ROUTES:
            with forced_route(label):
                results[label] = time_route(layer, x, repeats)
        for label, (out, fwd, step, held) in results.items():
            error = rel_error(out, results["explicit"][0])
            report.append(f"| collab k{key_dim} | {label} | {fwd:.2f} | {step:.2f} | {held} | {error:.2e} |")
            if error > rounding_tolerance(torch.bfloat16, 8):
                failures.append(f"routes: collab k{key_dim} {label} differs from explicit by {error:.2e}")
    report.append("")


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


def throughput_section(device: torch.device, tiny: bool, batch: int, warmup: int, repeats: int, report: list[str],
                       failures: list[str]) -> None:
    kwargs = dict(img_size=32, patch_size=8, depth=2) if tiny else {}
    names = [BASELINE.replace("base", "tiny"), "collab_deit_tiny_patch16_224_k48",
             "concat_deit_tiny_patch16_224_k48"] if tiny else MODELS
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
        report += ["", "Targets (issue 13): training step collab/timm >= 1.0 at k192 and >= 0.9 at k384; peak memory "
                   "<= 1.05x timm at both.", ""]
        for name, (speed, memory) in TARGETS.items():
            r = results[name]
            met = r["train"] / base["train"] >= speed and r["peak"] / base["peak"] <= memory
            report.append(f"- `{name}`: train ratio {r['train'] / base['train']:.3f} (>= {speed}), peak ratio "
                          f"{r['peak'] / base['peak']:.3f} (<= {memory}): {'met' if met else '**missed**'}")
    report.append("")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and models (seconds; the test suite's mode)")
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
    failures: list[str] = []
    started = time.time()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        correctness_section(device, args.tiny, report, failures)
        kernels_section(device, args.tiny, report, failures)
        routes_section(device, args.tiny, repeats, report, failures)
        if not args.skip_throughput:
            throughput_section(device, args.tiny, batch, warmup, repeats, report, failures)
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
