"""Throughput and memory of collaborative vs standard DeiT, measured side by side (issue: performance).

Models are interleaved within each repeat so that machine drift hits all alike; each figure is the median over
repeats after warm-up. Training memory is measured as the bytes autograd saves for backward (saved-tensor hooks,
deduplicated by storage), which is what grows with the mixed queries; on CUDA the allocator's peak is reported too.
"""
from __future__ import annotations

import platform
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import timm
import torch
import torch.nn as nn
from timm.layers import Attention

from collab_vit import CollaborativeAttention, ConcatAttention

BASELINE = "deit_base_patch16_224"
MODELS = [BASELINE, "collab_deit_base_patch16_224_k768", "collab_deit_base_patch16_224_k384",
          "collab_deit_base_patch16_224_k192", "concat_deit_base_patch16_224_k384",
          "concat_deit_base_patch16_224_k192"]
# Six DeiT-Bs training side by side (weights, AdamW states, activations) outgrow 24 GiB of CPU memory: models are
# measured in pairs, each interleaved with its own copy of the baseline, and ratios use the pair's baseline.
# Each group runs in its own process, so that all of its memory is returned before the next group starts.
MODEL_GROUPS = [[BASELINE, name] for name in MODELS[1:]]


def block_macs(tokens: int, dim: int = 768, heads: int = 12, key_dim: Optional[int] = None,
               collaborative: bool = False, mlp_ratio: float = 4.0) -> int:
    """Multiply-adds of one ViT block (docs/math.md, cost model); key_dim None is standard attention."""
    key_dim = dim if key_dim is None else key_dim
    qk_proj = 2 * tokens * dim * key_dim
    v_proj = out_proj = tokens * dim * dim
    logits = heads * tokens ** 2 * key_dim if collaborative else tokens ** 2 * key_dim
    content_bias = tokens * dim * heads if collaborative else 0
    attn_values = tokens ** 2 * dim
    mlp = 2 * tokens * dim * int(dim * mlp_ratio)
    return qk_proj + v_proj + out_proj + logits + content_bias + attn_values + mlp


def model_macs(name: str, tokens: int = 197) -> int:
    """Analytic multiply-adds of the 12 DeiT-B blocks of ``name`` (patch embedding and head are equal for all)."""
    key_dim = None if name == BASELINE else int(name.rsplit("_k", 1)[1])
    return 12 * block_macs(tokens, key_dim=key_dim, collaborative=name.startswith("collab"))


@dataclass
class Measurement:
    name: str
    infer_times: list[float] = field(default_factory=list)
    train_times: list[float] = field(default_factory=list)
    saved_bytes: int = 0
    cuda_peak_bytes: int = 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], None], device: torch.device) -> float:
    """Seconds of one call of ``fn`` (CUDA events on a GPU, wall clock on the CPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3
    start_time = time.perf_counter()
    fn()
    return time.perf_counter() - start_time


def saved_activation_bytes(step: Callable[[], None]) -> int:
    """Bytes of distinct storages autograd saves for backward during ``step`` (forward only)."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(storages.values())


class Runner:
    """Holds one model, its optimizer and inputs; exposes one inference pass and one training step."""

    def __init__(self, model: nn.Module, batch: int, tokens_hw: int, device: torch.device,
                 amp_dtype: Optional[torch.dtype]) -> None:
        self.model = model.to(device)
        self.device = device
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        self.images = torch.randn(batch, 3, tokens_hw, tokens_hw, device=device)
        self.targets = torch.randint(0, 1000, (batch,), device=device)
        self.autocast = (lambda: torch.autocast(device.type, dtype=amp_dtype)) if amp_dtype else nullcontext

    def infer(self) -> None:
        self.model.eval()
        with torch.inference_mode(), self.autocast():
            self.model(self.images)

    def forward_loss(self) -> torch.Tensor:
        self.model.train()
        with self.autocast():
            return nn.functional.cross_entropy(self.model(self.images), self.targets)

    def train_step(self) -> None:
        self.forward_loss().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # no model keeps gradients while the others run


def measure_models(names: list[str], batch: int, device: torch.device, amp_dtype: Optional[torch.dtype],
                   warmup: int, repeats: int, train: bool = True,
                   progress: Callable[[Iterator], Iterator] = iter) -> dict[str, Measurement]:
    torch.manual_seed(0)
    runners = {n: Runner(timm.create_model(n), batch, 224, device, amp_dtype) for n in names}
    results = {n: Measurement(n) for n in names}
    for name, runner in runners.items():
        if train:
            results[name].saved_bytes = saved_activation_bytes(runner.forward_loss)
        for _ in range(warmup):
            runner.infer()
            if train:
                runner.train_step()
        if device.type == "cuda" and train:
            torch.cuda.reset_peak_memory_stats(device)
            runner.train_step()
            results[name].cuda_peak_bytes = torch.cuda.max_memory_allocated(device)
    for _ in progress(range(repeats)):
        for name, runner in runners.items():
            results[name].infer_times.append(timed(runner.infer, device))
            if train:
                results[name].train_times.append(timed(runner.train_step, device))
        _sync(device)
    return results


def attention_layers(dim: int = 768, heads: int = 12) -> dict[str, nn.Module]:
    """The attention layer alone: timm's, collaborative at 768/384/192, concatenate at 384/192."""
    layers: dict[str, nn.Module] = {"timm Attention": Attention(dim, heads, qkv_bias=True)}
    for key_dim in (768, 384, 192):
        layers[f"collab k{key_dim}"] = CollaborativeAttention(dim, heads, key_dim=key_dim, qkv_bias=True)
    for key_dim in (384, 192):
        layers[f"concat k{key_dim}"] = ConcatAttention(dim, heads, key_dim=key_dim, qkv_bias=True)
    return layers


def measure_layers(tokens: int, batch: int, device: torch.device, amp_dtype: Optional[torch.dtype],
                   warmup: int, repeats: int) -> dict[str, float]:
    """Median seconds of one forward of each attention layer on (batch, tokens, 768)."""
    torch.manual_seed(0)
    layers = {n: layer.to(device).eval() for n, layer in attention_layers().items()}
    x = torch.randn(batch, tokens, 768, device=device)
    autocast = (lambda: torch.autocast(device.type, dtype=amp_dtype)) if amp_dtype else nullcontext
    times: dict[str, list[float]] = {n: [] for n in layers}

    def run(layer: nn.Module) -> Callable[[], None]:
        def call() -> None:
            with torch.inference_mode(), autocast():
                layer(x)
        return call

    for layer in layers.values():
        for _ in range(warmup):
            run(layer)()
    for _ in range(repeats):
        for name, layer in layers.items():
            times[name].append(timed(run(layer), device))
    return {n: statistics.median(t) for n, t in times.items()}


def machine_description(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, timm {timm.__version__}"
    return (f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
            f"torch {torch.__version__}, timm {timm.__version__}")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def render_model_table(groups: list[dict[str, Measurement]], batch: int, title: str) -> str:
    """Markdown: img/s, ratios to timm's DeiT-B of the same group, analytic limit (MAC ratio), saved activations."""
    peak = bool(groups[0][BASELINE].cuda_peak_bytes)
    lines = [f"#### {title}", "",
             "| model | infer img/s | infer ratio | train img/s | train ratio | analytic limit | "
             "saved activations (MiB) | memory ratio |" + (" CUDA peak (MiB) | peak ratio |" if peak else ""),
             "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if peak else "")]
    for index, results in enumerate(groups):
        base = results[BASELINE]
        base_infer, base_train = batch / _median(base.infer_times), batch / _median(base.train_times)
        for name, m in results.items():
            if name == BASELINE and index > 0:
                continue
            infer, train = batch / _median(m.infer_times), batch / _median(m.train_times)
            limit = model_macs(BASELINE) / model_macs(name)
            row = (f"| `{name}` | {infer:.1f} | {infer / base_infer:.3f} | {train:.1f} | {train / base_train:.3f} | "
                   f"{limit:.3f} | {m.saved_bytes / 2**20:.0f} | {m.saved_bytes / base.saved_bytes:.3f} |")
            if peak:
                row += f" {m.cuda_peak_bytes / 2**20:.0f} | {m.cuda_peak_bytes / base.cuda_peak_bytes:.3f} |"
            lines.append(row)
    return "\n".join(lines)


def render_layer_table(layer_times: dict[int, dict[str, float]], batch: int) -> str:
    """Markdown: attention layer alone, forward ms and ratio (speed-up) to timm's Attention, per token count."""
    token_counts = sorted(layer_times)
    header = "| layer | " + " | ".join(f"{t} tokens: ms | speed ratio" for t in token_counts) + " |"
    lines = ["#### Attention layer alone (forward, batch %d, dim 768, 12 heads)" % batch, "", header,
             "|---|" + "---:|---:|" * len(token_counts)]
    for name in layer_times[token_counts[0]]:
        cells = []
        for t in token_counts:
            ms = layer_times[t][name] * 1e3
            cells.append(f"{ms:.2f} | {layer_times[t]['timm Attention'] / layer_times[t][name]:.3f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def replace_marked_block(doc: Path, marker: str, text: str) -> None:
    """Replace what stands between ``<!-- marker:start -->`` and ``<!-- marker:end -->`` in a Markdown file."""
    content = doc.read_text()
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    if start not in content or end not in content:
        raise ValueError(f"{doc} has no {marker} block")
    head, rest = content.split(start, 1)
    doc.write_text(f"{head}{start}\n{text.strip()}\n{end}{rest.split(end, 1)[1]}")
