"""Attention core and one attention layer, collaborative vs timm, CPU fp32 (results in attention_notes.md).

Core (B=16, Nh=12, N=197, value head dim 64, additive (B, Nh, 1, N) mask as the content bias makes it): forward and
forward+backward of ``CollaborativeCore`` vs the previous path (SDPA on padded head dims under a recompute hook) vs
SDPA's math kernel vs timm's 64/64 SDPA, and the bytes autograd saves. Layer: one train step (forward+backward) of
``CollaborativeAttention`` (new and previous path) vs timm's ``Attention``. Short runs: median of ``--repeats``.

    PYTHONPATH=. python benchmarks/attention_core_bench.py --repeats 5
    PYTHONPATH=. python benchmarks/attention_core_bench.py --choices --repeats 5   # the CPU heuristics' choices

``--choices`` times both sides of each CPU heuristic (``flash_pays``, ``CHUNK_BYTES``) at the sizes
where it decides, so a threshold can be checked on another CPU
(attention_notes.md, "The CPU heuristics on a 2-core AMD EPYC").
"""
import argparse
import statistics
import time
from contextlib import nullcontext
from typing import Callable, Optional
from unittest import mock

import torch
import torch.nn.functional as F
from timm.layers import Attention
from torch.nn.attention import SDPBackend, sdpa_kernel

from collab_vit import CollaborativeAttention
from collab_vit.layers import attention_core, dispatch
from collab_vit.layers.attention_core import CollaborativeCore, equal_head_dims
from measure import saved_activation_bytes

B, H, N, D = 16, 12, 197, 64


def median_ms(fn: Callable[[], None], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def saved_mib(step: Callable[[], object], hidden: bool) -> str:
    """MiB autograd saves; the previous path's own saved-tensor hook hides what SDPA saves from ours ("hidden")."""
    return "hidden" if hidden else f"{saved_activation_bytes(step) / 2**20:.1f}"


def math_sdpa(q, mixing, k, v, mask, scale):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q.unsqueeze(1) * mixing.unsqueeze(1), k.unsqueeze(1).expand(-1, H, -1, -1),
                                              v, attn_mask=mask, scale=scale)


# The path before CollaborativeCore (removed from the package), kept here to compare against.
def sdpa_recomputing(q: torch.Tensor, mixing: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     attn_mask: Optional[torch.Tensor], is_causal: bool, dropout_p: float) -> torch.Tensor:
    """SDPA on the mixed queries (eq. 5) under a saved-tensor hook: any device, dropout too.

    SDPA saves its inputs for backward; the hook stores a recipe for the mixed queries (Nh x the shared ones) and any
    padded copies instead, and recomputes them (one multiply or pad) in backward.
    """
    shared, weights, keys, values = q.detach(), mixing.detach(), k.detach(), v.detach()

    def inputs(q_shared: torch.Tensor, m: torch.Tensor, k_shared: torch.Tensor, v_heads: torch.Tensor):
        mixed = q_shared.unsqueeze(1) * m.unsqueeze(1)  # (B, Nh, N, D~k), eq. 5
        k_heads = k_shared.unsqueeze(1).expand(-1, m.shape[0], -1, -1)
        return equal_head_dims(mixed, k_heads, v_heads) if mixed.device.type == "cpu" else (mixed, k_heads, v_heads)

    q_in, k_in, v_in = inputs(q, mixing, k, v)
    recipes = {(t.data_ptr(), t.shape): i for i, t in enumerate((q_in, k_in, v_in)) if t.data_ptr() != v.data_ptr()}

    def pack(tensor: torch.Tensor):
        index = recipes.get((tensor.data_ptr(), tensor.shape))
        return tensor if index is None else index

    def unpack(packed):
        return inputs(shared, weights, keys, values)[packed] if isinstance(packed, int) else packed

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = F.scaled_dot_product_attention(
            q_in, k_in, v_in, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
    return out[..., :v.shape[-1]]


CORES = {
    "new (CollaborativeCore)": lambda q, m, k, v, mask, s: CollaborativeCore.apply(q, m, k, v, mask, s),
    "previous (padded SDPA, hook)": lambda q, m, k, v, mask, s: sdpa_recomputing(q, m, k, v, s, mask, False, 0.),
    "SDPA math kernel": math_sdpa,
}


def core_rows(key_dim: int, repeats: int) -> list[str]:
    torch.manual_seed(0)
    q, k = torch.randn(B, N, key_dim, requires_grad=True), torch.randn(B, N, key_dim, requires_grad=True)
    mixing, mask = torch.randn(H, key_dim, requires_grad=True), torch.randn(B, H, 1, N, requires_grad=True)
    v = torch.randn(B, H, N, D, requires_grad=True)
    rows = []
    for name, core in CORES.items():
        def forward() -> None:
            with torch.no_grad():
                core(q, mixing, k, v, mask, 0.125)

        def train() -> None:
            core(q, mixing, k, v, mask, 0.125).sum().backward()

        rows.append(f"| {key_dim} | {name} | {median_ms(forward, repeats):.1f} | {median_ms(train, repeats):.1f} | "
                    f"{saved_mib(lambda: core(q, mixing, k, v, mask, 0.125), name.startswith('previous'))} |")
    return rows


def timm_core_row(repeats: int) -> str:
    q, k, v = (torch.randn(B, H, N, D, requires_grad=True) for _ in range(3))

    def forward() -> None:
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v)

    def train() -> None:
        F.scaled_dot_product_attention(q, k, v).sum().backward()

    saved = saved_activation_bytes(lambda: F.scaled_dot_product_attention(q, k, v)) / 2**20
    return f"| 64 (timm) | SDPA flash | {median_ms(forward, repeats):.1f} | {median_ms(train, repeats):.1f} | {saved:.1f} |"


def layer_rows(repeats: int) -> list[str]:
    torch.manual_seed(0)
    x = torch.randn(B, N, 768)
    layers = {"timm Attention": (Attention(768, H, qkv_bias=True), False)}
    for key_dim in (768, 384, 192):
        layer = CollaborativeAttention(768, H, key_dim=key_dim, qkv_bias=True)
        layers[f"collab k{key_dim} new"] = (layer, False)
        layers[f"collab k{key_dim} previous"] = (layer, True)
    rows = []
    for name, (layer, previous) in layers.items():
        patch = mock.patch.object(dispatch, "CollaborativeCore", PreviousCore) if previous else nullcontext()
        with patch:
            def train() -> None:
                layer(x).sum().backward()

            def infer() -> None:
                with torch.no_grad():
                    layer(x)

            rows.append(f"| {name} | {median_ms(infer, repeats):.1f} | {median_ms(train, repeats):.1f} | "
                        f"{saved_mib(lambda: layer(x), previous)} |")
    return rows


class PreviousCore:
    """Stands in for ``CollaborativeCore`` in ``dispatch.core_attend``: the path before it."""

    @staticmethod
    def apply(q, mixing, k, v, mask, scale):
        return sdpa_recomputing(q, mixing, k, v, scale, mask, False, 0.)


def forced_ms(module, heuristic: str, fn: Callable[[], object], repeats: int) -> dict[bool, float]:
    """Median ms of ``fn`` without gradients with ``module.heuristic`` forced to True and to False."""
    times = {}
    for choice in (True, False):
        with mock.patch.object(module, heuristic, lambda *_, c=choice: c), torch.no_grad():
            times[choice] = median_ms(fn, repeats)
    return times


def flash_choice_rows(repeats: int) -> list[str]:
    """``flash_pays``: the core's forward with CPU flash (padded) forced on vs off, per key dim."""
    torch.manual_seed(0)
    rows = []
    for key_dim in (64, 128, 192, 256, 384, 768):
        q, k = torch.randn(B, N, key_dim), torch.randn(B, N, key_dim)
        mixing, mask, v = torch.randn(H, key_dim), torch.randn(B, H, 1, N), torch.randn(B, H, N, D)
        times = forced_ms(attention_core, "flash_pays",
                          lambda: CollaborativeCore.apply(q, mixing, k, v, mask, 0.125), repeats)
        rows.append(f"| {key_dim} | {times[True]:.1f} | {times[False]:.1f} | "
                    f"{'flash' if attention_core.flash_pays(key_dim, D) else 'grouped bmm'} |")
    return rows


def chunk_choice_rows(repeats: int) -> list[str]:
    """``CHUNK_BYTES``: one k192 layer's forward and train step at several chunk sizes (whole batch = no chunks)."""
    torch.manual_seed(0)
    x, layer = torch.randn(B, N, 768), CollaborativeAttention(768, H, key_dim=192, qkv_bias=True)
    rows = []
    for label, size in (("2 MB", 2 << 20), ("4 MB (default)", 4 << 20), ("8 MB", 8 << 20), ("32 MB", 32 << 20),
                        ("whole batch", 1 << 40)):
        with mock.patch.object(attention_core, "CHUNK_BYTES", size):
            def infer() -> None:
                with torch.no_grad():
                    layer(x)
            rows.append(f"| {label} | {median_ms(infer, repeats):.1f} | "
                        f"{median_ms(lambda: layer(x).sum().backward(), repeats):.1f} |")
    return rows


def print_choices(repeats: int) -> None:
    print("flash_pays (core forward, B=16, Nh=12, N=197, v 64)\n\n| D~k | flash ms | grouped bmm ms | chosen |\n"
          "|---:|---:|---:|---|")
    print("\n".join(flash_choice_rows(repeats)), flush=True)
    print("\nCHUNK_BYTES (k192 layer, dim 768)\n\n| chunk | forward ms | train step ms |\n|---|---:|---:|")
    print("\n".join(chunk_choice_rows(repeats)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--key-dims", type=int, nargs="+", default=[768, 384, 192])
    parser.add_argument("--skip-layers", action="store_true")
    parser.add_argument("--choices", action="store_true", help="time both sides of each CPU heuristic instead")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    if args.choices:
        print_choices(args.repeats)
        return
    print("| key dim | core | forward ms | fwd+bwd ms | saved MiB |\n|---:|---|---:|---:|---:|")
    for key_dim in args.key_dims:
        print("\n".join(core_rows(key_dim, args.repeats)), flush=True)
    print(timm_core_row(args.repeats), flush=True)
    if not args.skip_layers:
        print("\n| layer (B=16, N=197, dim 768) | forward ms | train step ms | saved MiB |\n|---|---:|---:|---:|")
        print("\n".join(layer_rows(args.repeats)), flush=True)


if __name__ == "__main__":
    main()
