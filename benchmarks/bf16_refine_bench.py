"""The blockwise refinement's two costs on DeiT-B in float32 and under bfloat16 autocast, on this machine.

    python benchmarks/bf16_refine_bench.py              # DeiT-B, key dim 384, CPU, 2 threads

Times, per image, the pass that reads every layer's tokens and ``Recipe.samples`` output sensitivities
(``blockwise.layer_inputs``, 16 images), and one refinement step of the last layer (``blockwise.refine_blocks``,
batch 64, 4 steps, minus a zero-step run), each with autocast off and on (bfloat16), twice for the steps. The
recipe runs both in float32; this measures what bfloat16 units (AVX512-BF16, AMX) would save. Random weights and
images (the cost does not depend on them); take the numbers on a quiet machine.
"""
from __future__ import annotations

import copy
import platform
import time

import timm
import torch

from collab_vit.conversion.blockwise import layer_inputs, refine_blocks
from collab_vit.conversion.recipe import Recipe
from collab_vit.conversion.reparam import convert_model, timm_attention_layers


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    source = timm.create_model("deit_base_patch16_224").eval()
    images = torch.randn(16, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    originals = [attn for _, attn in timm_attention_layers(source)]
    print(f"deit_base_patch16_224, key dim 384; {platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    calls = None
    for amp in (False, True):
        with torch.autocast("cpu", torch.bfloat16, enabled=amp):
            layer_inputs(source, originals, images[:4], 4, Recipe.samples, 0)  # warm-up
            seconds, calls = timed(lambda: layer_inputs(source, originals, images, 16, Recipe.samples, 0))
        print(f"{'bfloat16' if amp else 'float32'}: tokens and {Recipe.samples} sensitivities "
              f"{seconds / images.shape[0]:.3f} s per image", flush=True)
    model = copy.deepcopy(source)
    convert_model(model, 384, "tucker", None, "fast", 0, False, Recipe())
    layer = [m for m in model.modules() if type(m).__name__ == "CollaborativeAttention"][-1]
    last = calls[-1]
    many = [(last[0].float().repeat(4, 1, 1), *last[1:3], last[3].float().repeat(4, 1, 1, 1))]  # 64 images
    for amp in (False, True, False, True):
        with torch.autocast("cpu", torch.bfloat16, enabled=amp):
            steps, _ = timed(lambda: refine_blocks(originals[-1:], [copy.deepcopy(layer)], many, 4, progress=False))
            none, _ = timed(lambda: refine_blocks(originals[-1:], [copy.deepcopy(layer)], many, 0, progress=False))
        print(f"{'bfloat16' if amp else 'float32'}: one layer's refinement step {(steps - none) / 4:.3f} s "
              "(batch 64)", flush=True)


if __name__ == "__main__":
    main()
