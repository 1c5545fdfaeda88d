"""Blockwise refinement: each converted layer trained on its own output, first to last, on the converted model's tokens.

One pass of the source over the fitting images records what every attention layer receives (its tokens and its
other arguments, e.g. the rope of a rotary model) and, for ``samples`` draws per image, the sensitivity of the
conversion's objective to that layer's output (``layer_inputs``; ``objective.py``: for a classifier, of the
log-probability of a class drawn from the source's own prediction; for a feature model, of the features along a
Gaussian direction). Each converted layer's ``W~q, W~k, M`` (eq. 5) are then trained alone, first layer first, Adam
on seeded minibatches, on ``sum_images mean_draws (g . (y~ - y))^2``: the Fisher form of the objective (the output KL
of a classifier) that the layer's output error causes, twice it to second order (``y``: the source layer's output;
the plain ``||y~ - y||^2 / ||y||^2`` measured far worse and was removed, and the enclosing block's output, the same
to first order at 1.9 times a step's cost, gained less at the same compute: RESULTS.md (b)). Both layers read the tokens
the model gives that layer with the layers before it converted and refined (``converted_calls``: carried block to
block), so a layer learns on the inputs it will get;
on the source's tokens it recovered less of the drop (RESULTS.md (b)). A step costs one attention layer's forward and
backward on the minibatch, not the whole model's (a whole-model refinement); the sensitivities and the first layer's
tokens are held in memory-mapped files of the conversion's state folder (``state.py``: ``(samples x layers + 1) x
images x tokens x D`` floats, and ``WORKING`` token tensors of all the images while a layer is refined:
``cache_bytes`` estimates them from one image; ``Footprint`` counts them with every other file the conversion writes,
checked against the free disk before the recipe starts), so the
process holds the model and a batch whatever the number of images; the sensitivity pass's batch is cut so that its
autograd graph stays within ``GRAPH_BYTES``. Each refined layer is committed to the state folder, and a run of the
same key resumes after the last one committed. A layer whose mean loss over all the images
rose keeps its starting weights.
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.nn as nn
from torch import Tensor

from ... import console
from ...checks import nonnegative_int, positive_int, positive_real
from ...layers.construction import parent_module
from . import state
from .capture import _kept
from .objective import directions, objective_for

PARAMS = ("query.weight", "key.weight", "mixing")  # what the refinement trains of a layer (eq. 5), and commits
WORKING = 4  # token tensors of all the images beside the cache while a layer is refined: the inputs of the block before
# it and of its own (two buffers swapped block to block), the layer's tokens, the source layer's outputs on them
# (``converted_calls``, ``refine_blocks``); like the cache, in the store's files (``state.py``), not in memory
Call = tuple[Optional[Tensor], tuple, dict, Tensor]  # one layer's tokens (images, N, D; None where not held), the
# other arguments of its calls, and the output sensitivities (images, S, N, D) of ``layer_inputs(samples=S)``


GRAPH_BYTES = 2 ** 29  # the sensitivity pass's autograd graph at most: its batch is cut to fit (DeiT-B: 4 images)
_BF16: ContextVar[bool] = ContextVar("bf16_parts", default=False)


@contextmanager
def bf16_parts(enabled: bool) -> Iterator[None]:
    """Inside: the sensitivity pass and the refinement's steps run in bfloat16 autocast (``enabled``); the tokens, the
    source layers' outputs and the mean losses that decide whether a layer keeps its start stay at full precision."""
    token = _BF16.set(bool(enabled))
    try:
        yield
    finally:
        _BF16.reset(token)


def _autocast(device: torch.device) -> torch.autocast:
    """``bf16_parts``' autocast, without its cache of cast weights: inside an enclosing autocast region (the recipe
    runs in one) that cache outlives the step, and the next step's forward would use the weights before the update."""
    return torch.autocast(device.type, torch.bfloat16, enabled=_BF16.get(), cache_enabled=False)


@dataclass
class RefineResult:
    steps: int
    seconds: float
    first_loss: float
    last_loss: float
    kl_before: float  # mean KL over all the refinement's images, before the steps
    kl_after: float  # and after them
    kept_start: bool  # the steps made the mean loss worse: the starting weights were restored
    losses: list[float] = field(default_factory=list)


class _Trainable:
    """Only ``params`` get gradients inside the block; flags and train/eval mode are put back after it."""

    def __init__(self, modules: list[nn.Module], params: list[nn.Parameter]) -> None:
        self.modules, self.params = modules, params

    def __enter__(self) -> None:
        self.flags = {p: p.requires_grad for m in self.modules for p in m.parameters()}
        self.modes = [m.training for m in self.modules]
        for m in self.modules:
            m.eval()
            for p in m.parameters():
                p.requires_grad_(False)
        for p in self.params:
            p.requires_grad_(True)

    def __exit__(self, *exc: object) -> None:
        for p, flag in self.flags.items():
            p.requires_grad_(flag)
        for m, mode in zip(self.modules, self.modes):
            m.train(mode)


def saved_per_image(model: nn.Module, images: Tensor) -> int:
    """Bytes one image's forward saves for backward: two images' minus one's, measured (the weights do not count)."""
    def saved(count: int) -> int:
        total = [0]

        def pack(t: Tensor) -> Tensor:
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.enable_grad():
            model(images[:count].to(next(model.parameters()).device))
        return total[0]

    return max(saved(2) - saved(1), 1) if images.shape[0] >= 2 else saved(1)


def graph_batch(model: nn.Module, images: Tensor, batch_size: int) -> int:
    """Images per forward and backward of the sensitivity pass: as many as ``GRAPH_BYTES`` holds, ``batch_size`` at
    most."""
    return max(1, min(batch_size, GRAPH_BYTES // saved_per_image(model, images)))


@torch.no_grad()
def probe(model: nn.Module, layers: list[nn.Module], image: Tensor) -> tuple[list[tuple], list[torch.Size],
                                                                              list[torch.Size]]:
    """Each layer's other call arguments (the same for every batch), and one image's token and output shapes."""
    rest: list[tuple] = []
    shapes: list[torch.Size] = []
    outs: list[torch.Size] = []
    def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
        rest.append((args[1:], dict(kwargs)))
        shapes.append(args[0].shape[1:])

    handles = [layer.register_forward_pre_hook(record, with_kwargs=True) for layer in layers]
    handles += [layer.register_forward_hook(lambda m, a, out: outs.append(out.shape[1:]) and None) for layer in layers]
    try:
        model(image.to(next(model.parameters()).device))
    finally:
        for handle in handles:
            handle.remove()
    return rest, shapes, outs


def layer_inputs(model: nn.Module, layers: list[nn.Module], images: Tensor, batch_size: int, samples: int,
                 seed: int = 0, kept: Optional[int] = None, show: bool = False) -> list[Call]:
    """What each of ``layers`` (modules of ``model``) receives on ``images``: the tokens of every image (float32 at
    least; of the first ``kept`` layers only, None for the others: the refinement reads those from the converted
    model, ``converted_calls``) and the first call's other arguments (the same for every batch of images of one
    size), and each layer's output sensitivities ``g_s`` for ``samples`` draws (seeded; ``objective.directions`` of
    ``objective_for(model)``: for a classifier ``g_s = d log p(c_s | x) / d y``, ``c_s`` drawn from the model's own
    prediction): ``E_s[(g_s . dy)^2]`` is the Fisher quadratic form of the objective (the output KL of a classifier)
    that a change ``dy`` of that layer's output causes, to second order (``relative_loss``). Held in the active
    store's files (``state.allocate``); a store that finished them for its key gives them back without a pass.
    ``show``: a progress bar over the images."""
    samples = positive_int(samples, "samples")
    n = images.shape[0]
    rest, shapes, outs = probe(model, layers, images[:1])
    dtype = torch.promote_types(images.dtype, torch.float32)
    names = [f"tokens-{i}" if kept is None or i < kept else None for i in range(len(layers))]
    store = state.active()
    if store is not None:
        found = [store.kept(f"sensitivities-{i}", (n, samples, *o), dtype) for i, o in enumerate(outs)]
        held = [store.kept(name, (n, *shape), dtype) if name else None for name, shape in zip(names, shapes)]
        if all(t is not None for t in found) and all(t is not None for t, name in zip(held, names) if name):
            return [(t, *r, g) for t, r, g in zip(held, rest, found)]
    tokens = [state.allocate(name, (n, *shape), dtype) if name else None for name, shape in zip(names, shapes)]
    grads = [state.allocate(f"sensitivities-{i}", (n, samples, *o), dtype) for i, o in enumerate(outs)]
    outputs: list[Tensor] = []
    at = [0]
    generator = torch.Generator().manual_seed(seed)
    objective = objective_for(model)  # what the sensitivities weigh (``objective.py``)
    last = max((i for i, t in enumerate(tokens) if t is not None), default=None)
    separate = _BF16.get() and last is not None  # under ``bf16_parts`` the tokens come from a pass of their own
    mode = ["both"]  # this pass records the tokens and stops after the last ("tokens"), or does not ("sensitivities")

    def hook(index: int):
        def record(module: nn.Module, args: tuple) -> None:
            if tokens[index] is not None and mode[0] != "sensitivities":
                tokens[index][at[0]:at[0] + args[0].shape[0]] = args[0].detach()
            if mode[0] == "tokens" and index == last:
                raise _Reached
        return record

    handles = [layer.register_forward_pre_hook(hook(i)) for i, layer in enumerate(layers)]
    handles += [layer.register_forward_hook(lambda m, a, out: outputs.append(out)) for layer in layers]
    bar = console.progress(n, "tokens and sensitivities (images)", show)
    try:
        device = next(model.parameters()).device
        for chunk in images.split(graph_batch(model, images, batch_size)):
            bar.update(chunk.shape[0])
            if separate:  # the tokens at full precision, the pass stopped at the last layer whose are kept
                mode[0] = "tokens"
                with torch.no_grad():
                    try:
                        model(chunk.to(device))
                    except _Reached:
                        pass
                mode[0] = "sensitivities"
            outputs.clear()
            with torch.enable_grad(), _autocast(device):
                logits = model(chunk.to(device))
            for sample, drawn in enumerate(sensitivities(logits, outputs, samples, generator, objective)):
                for target, g in zip(grads, drawn):
                    target[at[0]:at[0] + chunk.shape[0], sample] = g
            at[0] += chunk.shape[0]
    finally:
        bar.close()
        for handle in handles:
            handle.remove()
    if store is not None:
        for name in [*filter(None, names), *(f"sensitivities-{i}" for i in range(len(layers)))]:
            store.done(name)
    return [(t, *r, g) for t, r, g in zip(tokens, rest, grads)]


def available_bytes() -> int:
    """The host memory available now (Linux: ``MemAvailable``; elsewhere unknown: no limit)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 2 ** 62


def resident_bytes(pid: int | str = "self") -> int:
    """Process ``pid``'s resident memory now, ``RssAnon + RssShmem``: the page cache of files it maps (the state's
    files) is not its own (Linux; elsewhere 0)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return sum(int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssShmem"))
    except (OSError, KeyError, ValueError):
        return 0


def token_bytes(model: nn.Module, layers: list[nn.Module], image: Tensor) -> list[int]:
    """The bytes of one image's tokens of each of ``layers`` as the store holds them (``layer_inputs``: in the images'
    dtype, float32 at least), from the one hooked pass that reads their shapes (``probe``; ``image``: one image)."""
    shapes = probe(model, layers, image)[1]
    size = torch.promote_types(image.dtype, torch.float32).itemsize
    return [math.prod(shape) * size for shape in shapes]


def cache_bytes(model: nn.Module, layers: list[nn.Module], image: Tensor, images: int, samples: int,
                kept: Optional[int] = None) -> int:
    """The bytes the blockwise refinement's store holds (on disk: ``state.py``) for ``images`` images, ``samples``
    classes and the tokens of the first ``kept`` layers: each layer's tokens of ``image`` (``token_bytes``),
    ``samples`` times and once more for the layers whose tokens are held (``layer_inputs``), and ``WORKING`` times the
    largest (a layer's refinement), ``images`` times."""
    sizes = token_bytes(model, layers, image)
    return (sum(sizes) * samples + sum(sizes[:kept]) + WORKING * max(sizes)) * images


STATE_BYTES = (1024, 128, 26)  # state.json at most: its keys and file names, then per layer its summary and one loss
# per step (a float's longest repr, 24 characters, with its separator)
LOCK_BYTES = 256  # the lock file: its holder's pid and host


@dataclass(frozen=True)
class Footprint:
    """Every file a calibrated conversion writes beside its output, by its bytes per image or fixed (``footprint``):
    what ``plan`` checks against the free disk before the first image. Each file takes whole blocks."""

    tokens: list[int]  # one image's tokens of each layer (``token_bytes``)
    samples: int  # classes drawn per image: the sensitivities of each layer
    fixed: list[int]  # the lock and the state (twice: it is replaced by a copy written beside it)
    layers: list[int]  # each refined layer's committed weights (``state.expect_output``)
    output: list[int]  # the output's files (``state.expect_output``)
    block: int  # the file system's allocation unit (``state.block_bytes``)

    def bytes(self, fit: int, held: int, refined: bool) -> int:
        """The most that the state folder and the output hold at once for ``fit`` fitting and ``held`` held-out
        images: the store at its fullest (the held-out tokens, ``capture``; with ``refined`` the refinement's files,
        ``layer_inputs`` and ``WORKING``, and its committed layers), or the output written beside the committed
        layers once the store's files are gone (``Store.close``)."""
        store = self.fixed + [held * t for t in self.tokens]
        if refined:
            store += [fit * t for t in (self.tokens[0], *(self.samples * t for t in self.tokens))]
            store += [fit * max(self.tokens)] * WORKING + self.layers
        end = self.fixed[:2] + (self.layers if refined else []) + self.output
        return max(self.on_disk(store), self.on_disk(end))

    def on_disk(self, sizes: Iterable[int]) -> int:
        return sum(-(-size // self.block) * self.block for size in sizes)


def footprint(model: nn.Module, layers: list[nn.Module], image: Tensor, samples: int, steps: int) -> Footprint:
    """The ``Footprint`` of a calibrated conversion of ``model`` (``layers``: its attention layers) with ``samples``
    classes per image and ``steps`` refinement steps per layer, from one forward pass of ``image``."""
    state_json = STATE_BYTES[0] + len(layers) * (STATE_BYTES[1] + STATE_BYTES[2] * steps)
    output, weights = state.output_bytes()  # without them (no output): each layer's at most its source layer's
    weights = weights or [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers]
    return Footprint(token_bytes(model, layers, image), samples, [LOCK_BYTES, state_json, state_json], weights,
                     output, state.block_bytes())


def check_space(disk: float, memory: float, advice: Callable[[int, int], str]) -> None:
    """A one-line ``MemoryError`` before any work where the files of the state folder and the output (``disk``
    bytes: ``Footprint.bytes``) would not fit on the disk of the state folder, or what the conversion holds in memory
    (``memory`` bytes) in the host's; ``advice(free disk, available memory)``: what to do instead."""
    free, available = state.disk_free(), available_bytes()
    if disk > free:
        raise MemoryError(f"the calibrated conversion writes {size(disk)} beside the output (tokens, sensitivities "
                          f"and the output); {size(free)} is free there: {advice(free, available)}")
    if memory > available:
        raise MemoryError(f"the calibrated conversion holds {memory / 2**30:.1f} GiB in memory for these images; "
                          f"{available / 2**30:.1f} GiB is available: {advice(free, available)}")


def size(count: float) -> str:
    """``count`` bytes in GiB, or in MiB below one GiB."""
    return f"{count / 2**30:.1f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"


def sensitivities(outputs: Tensor, layers: list[Tensor], samples: int, generator: torch.Generator, objective: str
                  ) -> Iterator[list[Tensor]]:
    """The sensitivities ``g_s`` of every layer output ``y`` in ``layers`` (B, N, D each) for ``samples`` draws per
    image (``objective.directions``: classes drawn from ``softmax(outputs)`` for ``"kl"``, ``g = d log p(c) / dy``;
    Gaussian directions in feature space for a feature objective): for each draw in turn, one (B, N, D) tensor per
    layer output, on the CPU, float32 at least (one draw's at a time in memory)."""
    drawn = directions(outputs, samples, generator, objective)
    for s, picked in enumerate(drawn):  # images are independent: one backward per draw
        yield [_kept(g.detach()) for g in torch.autograd.grad(picked, layers, retain_graph=s + 1 < samples)]


def relative_loss(layer: nn.Module, call: Call, target: Tensor, index: Tensor, device: torch.device) -> Tensor:
    """Over the images ``index``, the Fisher form ``sum_n mean_s (g_ns . dy_n)^2`` of the layer's output error
    ``dy = layer(tokens) - target`` (``layer_inputs``): ``dy`` weighed by its effect on the model's output."""
    x, args, kwargs, weights = call
    delta = layer(x[index].to(device), *args, **kwargs).to(target.dtype) - target[index].to(device)
    with torch.autocast(device.type, enabled=False):  # the error's projections at full precision (``bf16_parts``)
        return torch.einsum("bsnd,bnd->bs", weights[index].to(device, delta.dtype), delta).pow(2).mean(1).sum()


@torch.no_grad()
def mean_loss(layer: nn.Module, call: Call, target: Tensor, batch_size: int, device: torch.device) -> float:
    """``relative_loss`` summed over all the images, batch by batch."""
    return sum(float(relative_loss(layer, call, target, torch.arange(s, min(s + batch_size, call[0].shape[0])),
                                   device)) for s in range(0, call[0].shape[0], batch_size))


def filled(n: int, batch_size: int, part: Callable[[slice], Tensor], name: Optional[str] = None) -> Tensor:
    """``part(batch)`` for the batches of ``n`` items, written into one tensor allocated at the first batch (no
    second copy of all of them, as ``torch.cat`` of the parts would make): the active store's file ``name``
    (``state.allocate``), in memory without a name."""
    out: Optional[Tensor] = None
    for s in range(0, n, batch_size):
        piece = part(slice(s, min(s + batch_size, n)))
        if out is None:
            out = state.allocate(name, (n, *piece.shape[1:]), piece.dtype)
        out[s:s + piece.shape[0]] = piece
    assert out is not None, "no items"
    return out


@torch.no_grad()
def source_outputs(source: nn.Module, call: Call, batch_size: int, device: torch.device) -> Tensor:
    x, args, kwargs, _ = call
    return filled(x.shape[0], batch_size, lambda b: _kept(source(x[b].to(device), *args, **kwargs)), "targets")


class _Reached(Exception):
    """Stops a forward pass at the layer whose input was read (``tokens_at``)."""


@torch.no_grad()
def inputs_at(model: nn.Module, module: nn.Module, images: Tensor, batch_size: int, name: Optional[str] = None
              ) -> tuple[Tensor, tuple, dict]:
    """What ``module`` (of ``model``) receives on ``images`` from the model as it is now, batch by batch, each forward
    pass stopped there: its first argument (on the CPU, float32 at least) and the first call's other arguments."""
    seen: list[Tensor] = []
    rest: list[tuple[tuple, dict]] = []

    def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
        seen.append(_kept(args[0].detach()))
        rest.append((args[1:], dict(kwargs)))
        raise _Reached

    def part(batch: slice) -> Tensor:
        try:
            model(images[batch].to(device))
        except _Reached:
            pass
        return seen.pop()

    handle = module.register_forward_pre_hook(record, with_kwargs=True)
    device = next(model.parameters()).device
    try:
        return filled(images.shape[0], batch_size, part, name), *rest[0]
    finally:
        handle.remove()


def tokens_at(model: nn.Module, layer: nn.Module, images: Tensor, batch_size: int) -> Tensor:
    """What ``layer`` receives on ``images`` from the model as it is now (``inputs_at``'s tokens)."""
    return inputs_at(model, layer, images, batch_size, "tokens")[0]


@torch.no_grad()
def replay(block: nn.Module, inputs: tuple[Tensor, tuple, dict], batch_size: int,
           stop: Optional[nn.Module] = None, name: Optional[str] = None) -> Tensor:
    """``block`` called on ``inputs`` (``inputs_at``'s) batch by batch: its outputs, or with ``stop`` (a module inside
    it) what ``stop`` receives (on the CPU, float32 at least)."""
    x, args, kwargs = inputs
    device = next(block.parameters()).device
    seen: list[Tensor] = []

    def record(module: nn.Module, args: tuple) -> None:
        seen.append(_kept(args[0].detach()))
        raise _Reached

    def part(batch: slice) -> Tensor:
        try:
            seen.append(_kept(block(x[batch].to(device), *args, **kwargs)))
        except _Reached:
            pass
        return seen.pop()

    handle = None if stop is None else stop.register_forward_pre_hook(record)
    try:
        return filled(x.shape[0], batch_size, part, name)
    finally:
        if handle is not None:
            handle.remove()


def enclosing(model: nn.Module, layer: nn.Module) -> nn.Module:
    """The module holding ``layer`` (its parent in ``model``: a transformer block)."""
    return parent_module(model, next(n for n, m in model.named_modules() if m is layer))[0]


def converted_calls(model: nn.Module, layers: list[nn.Module], calls: list[Call], images: Tensor, batch_size: int
                    ) -> Iterator[Call]:
    """``calls`` (the source's: ``layer_inputs``) with each layer's tokens read from ``model`` (``layers`` installed
    in it) when the refinement asks for that layer's, after the layers before it were refined (the first layer's:
    the source's). The sensitivities stay the source's.

    The tokens are what a forward pass of the model stopped at the layer gives (``tokens_at``), computed block by
    block: the inputs of the block holding layer ``l`` are the outputs of the one holding layer ``l - 1`` on its own
    inputs (``replay``), so each image crosses each block once in all instead of about ``L / 2`` model passes. Where
    the model does more between two blocks than hand one's output to the next (checked on the first batch against a
    stopped pass, to the bit), the rest are read by stopped passes."""
    blocks = [enclosing(model, layer) for layer in layers]
    carried: Optional[tuple[Tensor, tuple, dict]] = None  # the inputs of blocks[index - 1], all images
    for index, (layer, call) in enumerate(zip(layers, calls)):
        if index == 0:
            yield call
            carried = inputs_at(model, blocks[0], images, batch_size, "carried-0")
            continue
        if carried is not None:
            reference = inputs_at(model, blocks[index], images[:batch_size], batch_size)
            outputs = replay(blocks[index - 1], carried, batch_size, name=f"carried-{index % 2}")
            same = torch.equal(outputs[:batch_size], reference[0])
            carried = (outputs, *reference[1:]) if same else None
            del outputs  # held once, as ``carried``; the yielded tokens are not held here (``WORKING``)
        yield (replay(blocks[index], carried, batch_size, stop=layer, name="tokens") if carried is not None
               else tokens_at(model, layer, images, batch_size), *call[1:])


def refine_blocks(sources: list[nn.Module], layers: list[nn.Module], calls: Iterable[Call], steps: int,
                  lr: float = 1e-3,
                  batch_size: int = 64, seed: int = 0, progress: bool = True,
                  on_step: Optional[Callable[[int, int], None]] = None) -> RefineResult:
    """``steps`` Adam steps per layer on each converted layer's ``W~q, W~k, M`` so that ``layers[l](tokens)`` matches
    ``sources[l](tokens)`` on ``calls`` (``layer_inputs`` or ``converted_calls``, read one layer at a time; module
    docstring). Each layer draws its
    minibatches from its own generator (``seed + l``), so a run of fewer steps is a prefix of a longer one, layer by
    layer; ``on_step(l, step)`` is called after each step. Returns the summed per-layer losses (before and after:
    over all the images; per step: the minibatch's)."""
    steps = nonnegative_int(steps, "refine_steps")
    lr = positive_real(lr, "refine_lr")
    before = after = 0.0
    losses = [0.0] * steps
    kept = False
    start = time.perf_counter()
    calls = iter(calls)
    store = state.active()
    for number, (source, layer) in enumerate(zip(sources, layers)):
        call = next(calls)  # the layer before's tokens and outputs already let go (``WORKING``)
        bar = console.progress(steps, f"refine layer {number + 1}/{len(layers)} (its output)", progress)
        params = [layer.query.weight, layer.key.weight, layer.mixing]
        done = store.layer(number) if store is not None else None
        if done is not None:  # committed by a run of the same key that stopped later: its weights, not its steps
            weights, info = done
            with torch.no_grad():
                for name, p in zip(PARAMS, params):
                    p.copy_(weights[name])
            bar.update(steps)
        else:
            info = refine_layer(source, layer, call, steps, (lr, batch_size, seed + number),
                                on_step and (lambda step: on_step(number, step)), bar)
            if store is not None:
                store.commit(number, dict(zip(PARAMS, params)), info)
        del call
        bar.close()
        before, after, kept = before + info["first"], after + info["last"], kept or info["kept"]
        losses = [a + b for a, b in zip(losses, info["losses"])]
    return RefineResult(steps, time.perf_counter() - start, losses[0] if steps else float("nan"),
                        losses[-1] if steps else float("nan"), before, after, kept, losses)


def refine_layer(source: nn.Module, layer: nn.Module, call: Call, steps: int, settings: tuple[float, int, int],
                 on_step: Optional[Callable[[int], None]], bar: Any) -> dict:
    """``steps`` Adam steps (``settings``: lr, batch size, the seed of its minibatches) on one layer's ``W~q, W~k, M``
    (``refine_blocks``); its starting weights put back where the mean loss rose. Returns its mean losses before and
    after, whether it kept its start, and each step's minibatch loss."""
    lr, batch_size, seed = settings
    generator = torch.Generator().manual_seed(seed)
    params = [layer.query.weight, layer.key.weight, layer.mixing]
    device = params[0].device
    losses = []
    with _Trainable([source, layer], params):
        target = source_outputs(source, call, batch_size, device)
        if device.type != "cpu":  # the layer's working set (tokens, outputs, sensitivities) on the device
            call, target = (call[0].to(device), *call[1:3], call[3].to(device)), target.to(device)
        first = mean_loss(layer, call, target, batch_size, device)
        start_weights = [p.detach().clone() for p in params]
        optimizer = torch.optim.Adam(params, lr=lr)
        for step in range(steps):
            index = torch.randperm(call[0].shape[0], generator=generator)[:batch_size]
            with _autocast(device):
                loss = relative_loss(layer, call, target, index, device)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            bar.update()
            if on_step is not None:
                on_step(step + 1)
        last = mean_loss(layer, call, target, batch_size, device)
        kept = last > first
        if kept:
            last = first
            with torch.no_grad():
                for p, weight in zip(params, start_weights):
                    p.copy_(weight)
    return {"first": first, "last": last, "kept": kept, "losses": losses}
