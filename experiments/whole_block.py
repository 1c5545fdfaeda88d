"""Refining against the whole block's output instead of the attention layer's, at a fixed compute (RESULTS.md, "At a
fixed compute: the default").

The package refines each converted attention layer on its own output error, weighed by the source's sensitivities
of the log-probabilities to that output (``blockwise.py``: the Fisher form of the output KL). ``BlockRun`` refines
the same weights (the layer's ``W~q, W~k, M``, eq. 5) against the error of the *enclosing block's* output (attention,
MLP and both residual branches) with the sensitivities to the block's output: to first order in the layer's error
the two objectives are the same (the chain rule through the block), so they differ by the MLP's curvature, and a
block step costs the MLP's forward and backward too. ``blockwise_loso.py grid --target block`` runs it as the package
runs its refinement; ``cost`` times one step of each on DeiT-B (the fixed-compute price of a block step):

    python experiments/whole_block.py cost                  # results/fixed_compute/block_step.json
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.nn as nn
from torch import Tensor

from collab_vit import console
from collab_vit.conversion.calibration import state
from collab_vit.conversion.calibration.blockwise import (Call, bf16_parts, enclosing, inputs_at, refine_blocks,
                                                         refine_layer, replay)
from collab_vit.conversion.calibration.recipe import Candidate, RecipeRun, copies


@functools.cache
def viewed(kind: type) -> type:
    """``kind`` (a block class) exposing its attention's ``query``, ``key`` and ``mixing`` as the refinement reads
    them (``refine_layer``)."""
    return type(f"Block{kind.__name__}", (kind,), {
        "query": property(lambda s: s.attn.query), "key": property(lambda s: s.attn.key),
        "mixing": property(lambda s: s.attn.mixing)})


def unit(block: nn.Module, layer: nn.Module) -> nn.Module:
    """``block`` (shallow: its modules shared) with ``layer`` as its attention (``viewed``)."""
    out = copy.copy(block)
    out._modules = {**block._modules, "attn": layer}
    out.__class__ = viewed(type(block))
    return out


class BlockRun(RecipeRun):
    """``RecipeRun`` whose blockwise refinement fits each block's output (module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.blocks = [enclosing(self.model, attn) for attn in self.originals]  # the model's, holding its layers
        self.source_blocks = [unit(b, attn) for b, attn in zip(self.blocks, self.originals)]
        self.read_at = self.blocks  # ``cached_calls``: the blocks' inputs and the sensitivities to their outputs

    def units(self, fits: list) -> list[nn.Module]:
        """The converted layers of ``fits``, each inside its block (what the refinement and its losses call)."""
        return [unit(b, f.layer) for b, f in zip(self.blocks, fits)]

    def blockwise(self, base: Candidate, steps: int, on_step: Optional[Callable[[nn.Module, int, int], None]] = None
                  ) -> Candidate:
        calls = self.cached_calls()
        fits = copies(base.fits)
        self.install(fits)
        r, units = self.recipe, self.units(fits)
        self.store.refining(state.fingerprint([f.layer for f in fits], steps, "block"))  # no other run's layers
        with self.store.use(), bf16_parts(self.bf16):
            result = refine_blocks(self.source_blocks, units, block_calls(self.blocks, calls, self.model,
                                                                          self.source.inputs, r.batch_size),
                                   steps, r.refine_lr, r.batch_size, self.seed, self.progress,
                                   on_step and (lambda index, step: on_step(units[index], index, step)))
        self.tensor_errors(fits)
        return self.measure(Candidate(f"{base.name}+blocks", fits, refine={
            "steps": result.steps, "lr": r.refine_lr, "seconds": result.seconds, "samples": r.samples,
            "bf16": self.bf16, "target": "block", "loss_before": result.kl_before, "loss_after": result.kl_after,
            "kept_start": result.kept_start}))


def block_calls(blocks: list[nn.Module], calls: list[Call], model: nn.Module, images: Tensor, batch_size: int
                ) -> Iterator[Call]:
    """``calls`` with each block's inputs read from the converted model when the refinement asks for them: the first
    block's from a stopped pass, each next one's as the block before's outputs on its inputs (``replay``, its layer
    refined by then)."""
    carried: Optional[tuple] = None
    for index, call in enumerate(calls):
        if index == 0:
            carried = inputs_at(model, blocks[0], images, batch_size, "carried-0")
            yield call
            continue
        assert carried is not None
        carried = (replay(blocks[index - 1], carried, batch_size, name=f"carried-{index % 2}"), *carried[1:])
        yield (carried[0], *call[1:])


def step_seconds(model_name: str, steps: int, bf16: bool) -> dict[str, float]:
    """Seconds of one refinement step (batch 64) on the middle layer of ``model_name`` (random weights, key dim D/2):
    against its attention output and against its block's output."""
    import timm

    from collab_vit.conversion.reparam import timm_attention_layers
    from collab_vit.conversion.weights.fit import fit_attention

    model = timm.create_model(model_name, pretrained=False).eval()
    name, attn = timm_attention_layers(model)[len(model.blocks) // 2]
    block = enclosing(model, attn)
    x = torch.randn(64, 197, attn.num_heads * attn.head_dim)
    out = {}
    for target in ("attention", "block"):
        layer = fit_attention(attn, attn.num_heads * attn.head_dim // 2).layer
        source, converted = (attn, layer) if target == "attention" else (unit(block, attn), unit(block, layer))
        with torch.no_grad():
            grads = torch.randn(64, 4, 197, x.shape[-1])
        call, bar = (x, (), {}, grads), console.progress(steps, "", False)

        def timed(count: int) -> float:
            start = time.perf_counter()
            refine_layer(source, converted, call, count, (1e-3, 64, 0), None, bar)
            return time.perf_counter() - start

        with bf16_parts(bf16):
            timed(1)  # warm
            out[target] = (timed(steps) - timed(0)) / steps  # less the loss passes around the steps
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["cost"])
    p.add_argument("--model", default="deit_base_patch16_224")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--bf16", type=int, choices=(0, 1), default=1)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results" / "fixed_compute"
                   / "block_step.json")
    args = p.parse_args()
    seconds = step_seconds(args.model, args.steps, bool(args.bf16))
    row = {"model": args.model, "bf16": bool(args.bf16), "threads": torch.get_num_threads(), "seconds": seconds,
           "ratio": seconds["block"] / seconds["attention"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(row, indent=1) + "\n")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
