"""The calibrated conversion: candidates measured on held-out calibration images, never worse than weight-only.

With calibration images the conversion holds part of them out (a quarter, 1 to 256, drawn by the seed), fits the
others, and measures every candidate on the held-out images as they are (as the model evaluates them): per
held-out image, the score of the conversion's objective (``objective.py``: ``KL(softmax(source logits) ||
softmax(converted logits))`` for a classifier; for a model whose output is features, ``1 - cosine`` of the converted
features to the source's, ``objective.FEATURE_OBJECTIVE``). Candidates (RESULTS.md (b): each wins somewhere): the
weight-only fit; the whitened closed form with the class token weighted by the ``"balanced"`` rule (docs/math.md, "Query
weights"); on rotary layers also each head keeping its strongest pairs (``rotary_fit.selection_fit``); and, by
``effort``, the better of them refined layer by layer (``blockwise.py``: each layer's output error in the Fisher form
of the objective, on the tokens of the converted layers before it, with the source's sensitivities read in one pass;
it replaced a whole-model refinement that was measured against it and removed: RESULTS_HISTORY.md, "Blockwise
refinement"). The weight-only fit is always measured and kept unless another candidate is better beyond what the
held-out images resolve (``guard.py``: a seeded bootstrap interval of the per-image gain); of the resolved candidates
the best is kept, so the result is never worse than weight-only on the held-out images. The held-out split and the
guard's constants were chosen by leave-one-source-out on ten trained sources (RESULTS.md (b), "The constants").
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
from timm.layers import Attention
from torch import Tensor

from ... import console
from ...checks import is_integer, positive_int
from ...layers.construction import replace_submodule
from ..weights.whitening import DEFAULT_RIDGE, prefix_weight_for
from .capture import Pending, model_outputs, prefix_tokens, source_tokens, tensor_bytes
from ..weights.fit import LayerFit
from .candidates import STARTS, Starts
from .guard import Verdict, held_out_split, judge, per_image_scores
from .objective import has_features, objective_for
from . import state
from .blockwise import (GRAPH_BYTES, bf16_parts, check_space, converted_calls, footprint, layer_inputs, refine_blocks,
                        resident_bytes, saved_per_image)

# effort: the refinement of the better start ("" none; "blocks": blockwise.py, each layer on its own in the Fisher form
# of the objective). The blockwise refinement was as good or better than the whole-model refinement on two sources
# at about a twentieth of its compute; that one ("thorough") won one cell and was removed, as was refining both
# starts (RESULTS_HISTORY.md, "Blockwise refinement").
# "full": the default before the fixed-compute choice (2048 images, 16 passes: about 4 times the default's compute, a
# GPU job on DeiT-B); the default is the recipe at DeiT-B's fixed compute on a CPU (RESULTS.md (b), "At a fixed
# compute").
EFFORTS: dict[str, str] = {"fast": "", "default": "blocks", "full": "blocks"}
# each effort's blockwise passes over the fitting images (steps per layer = passes x images / batch)
PASSES: dict[str, int] = {"default": 8, "full": 16}
DEFAULT_IMAGES = 768  # calibration images the command draws by default (fast and default; ``IMAGES``)
IMAGES: dict[str, int] = {"fast": DEFAULT_IMAGES, "default": DEFAULT_IMAGES, "full": 2048}
MAX_HOLDOUT = 256  # the guard's held-out images at most (RESULTS.md (b), "The constants"; 64 before)


def check_effort(effort: object) -> str:
    if effort not in EFFORTS:
        raise ValueError(f"effort must be one of {tuple(EFFORTS)}, got {effort!r}")
    return str(effort)


# the recipe's measured constants (RESULTS.md (b)); ``Recipe`` gathers them so that an experiment or a test can vary
# one: no public entry (``reparametrize``, ``collab-vit convert``) takes a Recipe
PREFIX_WEIGHT = "balanced"  # the whitened start's class-token weight: the "balanced" rule (docs/math.md)
REFINE_LR = 1e-3  # the blockwise refinement's Adam lr (RESULTS.md (b), "The constants"; at the default's 768
# images 2e-3 and 4e-3 gained less on the sources left out: RESULTS.md (b), "At a fixed compute")
BATCH_SIZE = 64
SAMPLES = 4  # classes drawn per image for the blockwise refinement's Fisher form (blockwise.py); 2 and 8 at the
# same DeiT-B compute gave less top-1 (RESULTS.md (b), "At a fixed compute")
CONFIDENCE = 0.9  # of the guard's interval: a candidate beats weight-only beyond it (guard.py)


def autocast_on(device: torch.device) -> bool:
    """The device's rule: the forward passes that capture the tokens run in bfloat16 autocast on CUDA only."""
    return device.type == "cuda"


def bf16_native(device: torch.device) -> bool:
    """The device's rule for the refinement's costly parts (``blockwise.bf16_parts``): bfloat16 autocast where the
    device multiplies bfloat16 natively (CUDA with bfloat16; a CPU with AVX512-BF16 or AMX), float32 elsewhere
    (RESULTS.md (b), "At a fixed compute": its effect on top-1 and on DeiT-B's time)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        cpu = torch.cpu
        return any(bool(getattr(cpu, name, lambda: False)()) for name in
                   ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return False


@dataclass
class Recipe:
    """The calibrated conversion's constants (module constants above), for experiments and tests to vary."""

    ridge: float = DEFAULT_RIDGE
    prefix_weight: object = PREFIX_WEIGHT  # of the whitened start: a number, or the "balanced" rule
    refine_steps: Optional[int] = None  # None: from effort and the number of images
    refine_lr: float = REFINE_LR
    batch_size: int = BATCH_SIZE
    amp: Optional[bool] = None  # bfloat16 autocast of the capture; None: the device's rule (``autocast_on``)
    bf16: Optional[bool] = None  # bfloat16 autocast of the sensitivity pass and the steps; None: ``bf16_native``
    holdout: Optional[int] = None  # held-out images; None: a quarter, 1 to 256 (drawn by the seed: guard.py)
    samples: int = SAMPLES
    confidence: float = CONFIDENCE
    candidates: Optional[Sequence[str]] = None  # pin them (e.g. ("whitened+blocks",)); None: from effort

    def __post_init__(self) -> None:
        positive_int(self.samples, "samples")
        kinds = {f"+{kind}" for kind in EFFORTS.values() if kind}
        for name in self.candidates or ():
            if "+" in name and name[name.index("+"):] not in kinds:
                raise ValueError(f"candidate {name!r}: the refinements are {sorted(kinds)} (the whole-model "
                                 f"'+refine' was removed: RESULTS.md (b))")


def split(n: int, holdout: Optional[int]) -> int:
    """Fitting images out of ``n`` (the rest is held out): a quarter held out by default, 1 to 256 (RESULTS.md (b),
    "The constants": chosen leave-one-source-out at 2048 images)."""
    if holdout is None:
        holdout = min(max(1, n // 4), MAX_HOLDOUT) if n >= 2 else 0
    if not is_integer(holdout) or not 0 <= holdout < n:
        raise ValueError(f"holdout must be an integer in [0, {n}) for {n} calibration images, got {holdout!r}")
    return n - holdout


def refine_steps(recipe: Recipe, effort: str, fit: int) -> int:
    """Steps of each layer's refinement at ``effort`` (``PASSES``): ``recipe.refine_steps`` where set, else its passes
    over the ``fit`` images."""
    if recipe.refine_steps is not None:
        return recipe.refine_steps
    return math.ceil(PASSES[effort] * fit / recipe.batch_size)


def candidate_names(effort: str, ranked: Sequence[str]) -> list[str]:
    """The refined candidate of ``effort``: the best start (``ranked``: best first) with its refinement."""
    kind = EFFORTS[effort]
    return [f"{ranked[0]}+{kind}"] if kind else []


def copies(fits: list[LayerFit]) -> list[LayerFit]:
    """``fits`` with their layers copied (a refinement trains the copies; the start stays as it was)."""
    out = [copy.copy(f) for f in fits]
    for f in out:
        f.layer = copy.deepcopy(f.layer)
    return out


def same_layers(a: list[LayerFit], b: list[LayerFit]) -> bool:
    """Whether two candidates' layers are the same modules with equal settings, parameters and buffers (so equal
    outputs)."""
    def settings(m: nn.Module) -> list[dict]:
        return [{k: v for k, v in vars(s).items() if not k.startswith("_") and isinstance(v, (int, float, str, tuple))}
                for s in m.modules()]

    def same(x: nn.Module, y: nn.Module) -> bool:
        tx, ty = [*x.named_parameters(), *x.named_buffers()], [*y.named_parameters(), *y.named_buffers()]
        return type(x) is type(y) and settings(x) == settings(y) and [n for n, _ in tx] == [n for n, _ in ty] and all(
            t.shape == u.shape and torch.equal(t, u) for (_, t), (_, u) in zip(tx, ty))

    return len(a) == len(b) and all(same(x.layer, y.layer) for x, y in zip(a, b))


@dataclass
class Candidate:
    name: str
    fits: list[LayerFit]
    held_kl: float = math.nan  # the mean held-out score of the conversion's objective (``objective.py``)
    refine: Optional[dict] = None
    held: Optional[Tensor] = None  # the per-image held-out score
    cosine: Optional[float] = None  # of a feature model: the mean held-out cosine to the source's features


@dataclass
class SourceData:
    """What the source model gives the recipe before any layer is swapped (``RecipeRun``)."""

    fit: int  # fitting images: the first ones of the seeded order (the rest is held out)
    inputs: Tensor  # the refinement's inputs: the fitting images
    held_out: int  # held-out images (0: one image, measured on the image it was fitted on)
    held_inputs: Tensor  # the held-out images, as they are
    held_target: Tensor  # the source's outputs on ``held_inputs`` (float32 at least: ``objective.scores``' targets)
    moments: list  # the fitting images' token moments, per layer
    held_tokens: list  # the held-out images' tokens, per layer
    peak: int  # bytes of the held-out tokens
    seconds: float


def capture(model: nn.Module, layers: list[tuple[str, nn.Module]], images: Tensor, recipe: Recipe, seed: int,
            show: bool = False) -> SourceData:
    """Split ``images`` (held out: by the seed), capture the layers' tokens and the source's outputs (in bfloat16
    autocast where ``amp_of`` says so; the objective's targets at full precision)."""
    n = images.shape[0]
    fit = split(n, recipe.holdout)
    images = images[held_out_split(n, seed)]
    start = time.perf_counter()
    device = next(model.parameters()).device
    amp = amp_of(recipe, device)
    with torch.autocast(device.type, torch.bfloat16, enabled=amp):
        moments, held, peak, outputs = source_tokens(model, layers, images, fit, recipe.batch_size, show)
    if amp:  # the tokens were captured in bfloat16; the objective's targets are taken at full precision
        outputs = model_outputs(model, images, recipe.batch_size)
    held_images, held_outputs = (images[fit:], outputs[fit:]) if fit < n else (images, outputs)
    return SourceData(fit, images[:fit], n - fit, held_images, held_outputs.float(),
                      moments, held, peak, time.perf_counter() - start)


def amp_of(recipe: Recipe, device: torch.device) -> bool:
    """``recipe.amp`` where an experiment set it, else the device's rule (``autocast_on``)."""
    return autocast_on(device) if recipe.amp is None else bool(recipe.amp)


def bf16_of(recipe: Recipe, model: nn.Module) -> bool:
    """Whether the refinement's costly parts run in bfloat16 for ``model``: only for a float32 model (float64 ones stay
    exact), then ``recipe.bf16`` where an experiment set it, else the device's rule (``bf16_native``)."""
    first = next(model.parameters())
    if first.dtype != torch.float32:
        return False
    return bf16_native(first.device) if recipe.bf16 is None else bool(recipe.bf16)


def computed_on(device: torch.device) -> dict[str, str]:
    """What the numbers of a run depend on beside its inputs, for the resume key (``state.py``): the device's type and
    model (another GPU runs other kernels) and torch's version."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return {"device": device.type, "model": name, "torch": torch.__version__}


class RecipeRun:
    """One calibrated conversion under way: the source's data (``capture``: the seed draws the held-out images), and
    how candidates are fitted (``candidates.Starts``: standard or ``rotary`` layers), refined (seeded), installed in
    ``model`` and measured on the held-out images. ``calibrated`` drives it; the experiments drive it step by step."""

    def __init__(self, model: nn.Module, layers: list[tuple[str, nn.Module]], images: Tensor, recipe: Recipe,
                 seed: int = 0, rotary: bool = False, progress: bool = False) -> None:
        self.model, self.layers, self.recipe, self.seed = model, layers, recipe, seed
        self.originals = [attn for _, attn in layers]
        self.bf16 = bf16_of(recipe, model)
        self.objective = objective_for(model)  # what the candidates are scored and refined on (``objective.py``)
        self.store = state.Store(state.fingerprint(model, images, {**recipe.__dict__, "bf16": self.bf16,
                                                                   "objective": self.objective}, seed,
                                                   "rotary" if rotary else "standard",
                                                   computed_on(next(model.parameters()).device)))
        try:
            with self.store.use():
                self.source = capture(model, layers, images, recipe, seed, progress)
        except BaseException:
            self.store.close()
            raise
        patches = getattr(getattr(model, "patch_embed", None), "num_patches", None)
        weight = recipe.prefix_weight
        if weight == "balanced" and patches is None:
            weight = 1.0  # the rule needs the patch count; without it every token counts alike
        self.prefix_weight = prefix_weight_for(weight, prefix_tokens(model), patches)
        self.starts = Starts(rotary, recipe.ridge, self.prefix_weight)
        self.progress, self.bar = progress, None  # progress bars
        self.calls: Optional[list] = None  # the blockwise refinement's cached tokens and sensitivities
        self.read_at: list[nn.Module] = self.originals  # the modules whose inputs and output sensitivities those are
        # (the attention layers; experiments/whole_block.py: their blocks)
        self.ropes = self.starts.ropes(model, layers, images)  # each layer's (rotary; None: standard)
        self.measured: list[Candidate] = []  # every candidate scored so far (``measure``)

    def install(self, fits: list[LayerFit]) -> None:
        for (name, _), fitted in zip(self.layers, fits):
            replace_submodule(self.model, name, fitted.layer.eval())

    def measure(self, candidate: Candidate) -> Candidate:
        """``candidate`` installed and scored on the held-out images as they are: the objective's score of each image
        (``self.objective``), and the mean over the images (of a feature model also the mean cosine). A candidate whose
        layers are those of one measured before (rotary layers at full rank: the weight-only fit and the selection are
        the exact layer) takes its scores, not another pass."""
        self.install(candidate.fits)
        twin = next((c for c in self.measured if same_layers(c.fits, candidate.fits)), None)
        if twin is not None:
            candidate.held, candidate.cosine = twin.held, twin.cosine
        else:
            report = ("cosine",) if has_features(self.model) else ()
            held = per_image_scores(self.model, self.source.held_inputs, self.source.held_target,
                                    self.recipe.batch_size, (self.objective, *report))
            candidate.held = held[0]
            candidate.cosine = float(1 - held[1].mean()) if report else None
        candidate.held_kl = float(candidate.held.mean())
        self.measured.append(candidate)
        return candidate

    def fit_start(self, name: str, dims: list[int]) -> Candidate:
        """The closed-form candidate ``name`` (``Starts.names``) at ``dims``, measured."""
        fits = []
        for (_, attn), rank, moments, rope in zip(self.layers, dims, self.source.moments, self.ropes):
            fits.append(self.starts.fit(name, attn, rank, moments, rope))
            if self.bar is not None:
                self.bar.update()
        return self.measure(Candidate(name, fits))

    def tensor_errors(self, fits: list[LayerFit]) -> None:
        """Each refined fit's tensor error against its source layer."""
        for (_, attn), f in zip(self.layers, fits):
            f.tensor_error = self.starts.tensor_error(attn, f.layer)

    def cached_calls(self, every_layer: bool = False) -> list:
        """The source layers' sensitivities on the refinement's inputs and the first layer's tokens (the others are
        read from the converted model: ``converted_calls``; ``every_layer``: every layer's, for experiments), by
        ``blockwise.layer_inputs``, read on the first call with the source's layers swapped back in."""
        if self.calls is None or (every_layer and self.calls[-1][0] is None):
            self.calls = None  # not held twice
            for (name, _), original in zip(self.layers, self.originals):
                replace_submodule(self.model, name, original)
            with self.store.use(), bf16_parts(self.bf16):
                self.calls = layer_inputs(self.model, self.read_at, self.source.inputs, self.recipe.batch_size,
                                          self.recipe.samples, self.seed, None if every_layer else 1, self.progress)
        return self.calls

    def blockwise(self, base: Candidate, steps: int, on_step: Optional[Callable[[nn.Module, int, int], None]] = None
                  ) -> Candidate:
        """``base`` refined layer by layer (``blockwise.refine_blocks``: each layer's output error in the Fisher form
        of the objective (the source's output KL for a classifier), with the source's sensitivities on the refinement's
        inputs, read once, on the tokens the layers refined before it give: ``converted_calls``), a copy, measured;
        ``on_step(layer, l, step)`` after each step of layer ``l`` (the experiments' snapshots)."""
        calls = self.cached_calls()
        fits = copies(base.fits)
        self.install(fits)
        r = self.recipe
        layers = [f.layer for f in fits]
        if self.store.refining(state.fingerprint(layers, steps)) and self.progress:
            print(f"resuming: {len(self.store.state['layers'])} of {len(layers)} layers refined by a stopped run of "
                  f"this command ({self.store.folder})", flush=True)
        with self.store.use(), bf16_parts(self.bf16):
            result = refine_blocks(self.originals, layers,
                                   converted_calls(self.model, layers, calls, self.source.inputs, r.batch_size),
                                   steps, r.refine_lr, r.batch_size, self.seed, self.progress,
                                   on_step and (lambda index, step: on_step(layers[index], index, step)))
        self.tensor_errors(fits)
        return self.measure(Candidate(f"{base.name}+blocks", fits, refine={
            "steps": result.steps, "lr": r.refine_lr, "seconds": result.seconds, "samples": r.samples,
            "bf16": self.bf16,
            "loss_before": result.kl_before, "loss_after": result.kl_after, "kept_start": result.kept_start}))

    def finish(self, best: Candidate) -> None:
        """``best`` installed for good; the source layers back in eval mode; the store's scratch files removed."""
        self.install(best.fits)
        for original in self.originals:
            original.eval()
        self.store.close()


# the parts' seconds per image in forward passes of the source (``Plan.seconds``), measured end to end on DeiT-B on
# a 2-core CPU (benchmarks/data_aware_bench.md, bfloat16 parts): the capture 1 and each held-out measure 1 (a float32
# forward); the converted tokens, the source layer's outputs and the mean losses of every layer 3.4 (float32); in
# forwards of the parts' precision (bfloat16 where ``bf16_native``), the sensitivity pass 1 + 1.4 per class drawn and
# a pass of every layer's steps 1.9
COST = {"capture": 1.0, "sensitivity": 1.0, "per_class": 1.4, "step": 1.9, "replay": 3.4}


@dataclass
class Plan:
    """What a calibrated conversion will hold and take, known before its first image (``plan``)."""

    images: int
    fit: int
    passes: float  # of each layer's refinement over the fitting images (0: none)
    disk: int  # bytes of the state folder's files and the output at most (``blockwise.Footprint``)
    memory: int  # bytes held in memory: the process, the images, the sensitivity pass's graph, the converted copy
    seconds: float  # projected on this machine, the closed-form fits aside
    device: str

    def line(self) -> str:
        refine = f", each layer refined in {self.passes:g} passes" if self.passes else ""
        disk = f", {self.disk / 2**30:.1f} GiB on disk beside the output"
        return (f"calibrated conversion: {self.images} images ({self.fit} fitted, {self.images - self.fit} held out)"
                f"{refine}; holds {self.memory / 2**30:.1f} GiB in memory{disk}; about {self.seconds / 60:.0f} min "
                f"on this {self.device} beside the closed-form fits")


def plan(model: nn.Module, layers: list[tuple[str, nn.Module]], images: Tensor, recipe: Recipe, steps: int,
         starts: int, count: Optional[int] = None) -> Plan:
    """The conversion's ``Plan`` for ``count`` images (default: all of ``images``, of which the first few are read:
    ``capture.peek``) and ``steps`` refinement steps per layer (``starts`` closed forms measured): its disk and
    memory checked against the host's before any work (a refusal names how many calibration images would fit) and
    its time projected from one timed forward pass (``COST``)."""
    count = images.shape[0] if count is None else count
    files = footprint(model, [a for _, a in layers], images[:1], recipe.samples, steps)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    # the sensitivity pass's graph and twice as much again for its backward's gradients and the allocator's slack,
    # beside the process as it is now (the source model in it) and the converted copy (DeiT-B: with twice the graph
    # the estimate was 0.8 GiB below the measured peak, RESULTS.md "DeiT-B conversion cost")
    fixed = resident_bytes() + weights + 3 * min(GRAPH_BYTES, saved_per_image(model, images[:2]) * recipe.batch_size)

    def needs(m: int, refined: bool = steps > 0) -> tuple[int, int]:  # the images twice (uint8 pixels or floats, as
        fit = split(m, recipe.holdout)  # read): the caller's and ``capture``'s copy in the split's order
        return files.bytes(fit, m - fit, refined), 2 * m * tensor_bytes(images[0]) + fixed

    def fits(m: int, free: int, available: int, refined: bool = steps > 0) -> bool:
        try:
            disk, memory = needs(m, refined)
        except ValueError:  # a holdout of at least ``m``
            return False
        return disk <= free and memory <= available

    def advice(free: int, available: int) -> str:  # each count named is checked as the run checks it
        most = next((m for m in range(count - 1, 1, -1) if fits(m, free, available)), None)
        fast = "--effort fast" if steps and fits(count, free, available, False) else ""
        if most is not None:
            return f"use at most {most} calibration images (--calibration-images {most})" + (f" or {fast}" * bool(fast))
        return (f"too little for two images: use {fast}" if fast else "too little for two calibration images: make "
                "room, or convert weight-only (without --calibration-data-dir)")


    disk, memory = needs(count)
    check_space(disk, memory, advice=advice)
    n, fit = count, split(count, recipe.holdout)
    passes = steps * recipe.batch_size / fit if steps else 0.0
    device = next(model.parameters()).device
    forward, parts = timed_forward(model, images[:8].to(device), bf16_of(recipe, model))
    c = COST
    seconds = forward * (n * c["capture"] + (n - fit or n) * (starts + 1) + (fit * c["replay"] if steps else 0))
    seconds += parts * fit * (c["sensitivity"] + c["per_class"] * recipe.samples + c["step"] * passes) if steps else 0
    return Plan(n, fit, passes, disk, memory, seconds, device.type.upper())


@torch.no_grad()
def timed_forward(model: nn.Module, batch: Tensor, bf16: bool) -> tuple[float, float]:
    """Seconds per image of one warm forward pass of ``model`` on ``batch``: at full precision, and in the precision
    of the refinement's costly parts (bfloat16 autocast where ``bf16``)."""
    def seconds(enabled: bool) -> float:
        with torch.autocast(batch.device.type, torch.bfloat16, enabled=enabled):
            model(batch)  # warm: the first pass allocates
            start = time.perf_counter()
            model(batch)
        return (time.perf_counter() - start) / batch.shape[0]

    full = seconds(False)
    return full, seconds(True) if bf16 else full


def choose(pool: Sequence[Candidate], confidence: float, seed: int) -> tuple[Candidate, dict[str, Verdict]]:
    """The candidate kept and the guard's verdict on every other one (``guard.judge`` against the weight-only fit):
    of the candidates whose held-out gain over the weight-only fit is resolved, the one with the lowest held-out score;
    the weight-only fit where none is. Without the weight-only fit in ``pool`` (pinned candidates) there is nothing
    to judge against: the lowest held-out score."""
    reference = next((c for c in pool if c.name == "weight"), None)
    if reference is None:
        return min(pool, key=lambda c: c.held_kl), {}
    verdicts = {c.name: judge(c.name, reference.held, c.held, confidence, seed) for c in pool if c is not reference}
    resolved = [c for c in pool if c is not reference and verdicts[c.name].kept]
    return (min(resolved, key=lambda c: c.held_kl) if resolved else reference), verdicts


def calibrated(model: nn.Module, layers: list[tuple[str, Attention]], dims: list[int], images: Pending, effort: str,
               seed: int, progress: bool, recipe: Recipe, rotary: bool = False
               ) -> tuple[list[LayerFit], list[Optional[tuple[Tensor, dict]]], dict]:
    """Fit, refine and measure the candidates at ``dims`` (one key dim per layer: ``dims.layer_dims``); swap the one
    ``choose`` keeps into ``model``; the cost line (``plan``) is printed before ``images`` are read whole (from their
    count and first few: ``capture.peek``). Returns its fits, every layer's call on the held-out images (its tokens
    and keywords, a rotary layer's rope: the report's output errors, on the images the guard holds out) and a summary
    (key dims, candidates, held-out KL, the guard's verdicts, which won, by how much)."""
    pinned = list(recipe.candidates) if recipe.candidates is not None else None
    kinds = {c.split("+")[1] for c in pinned if "+" in c} if pinned is not None else {EFFORTS[effort]} - {""}
    fit = split(images.count, recipe.holdout)
    steps = {kind: refine_steps(recipe, effort if effort in PASSES else "default", fit) for kind in kinds}
    planned = plan(model, layers, images.first, recipe, steps.get("blocks", 0), len(STARTS) + rotary,
                   images.count)  # refused if too big
    if progress:
        print(planned.line(), flush=True)
    run = RecipeRun(model, layers, images.read(), recipe, seed, rotary, progress)
    try:
        return run_candidates(run, dims, effort, steps, pinned)
    except BaseException:  # the scratch files go; the committed layers stay for the same command run again
        run.store.close()
        raise


def run_candidates(run: RecipeRun, dims: list[int], effort: str, steps: dict[str, int],
                   pinned: Optional[list[str]]) -> tuple[list[LayerFit], list[Optional[tuple[Tensor, dict]]], dict]:
    """``calibrated``'s candidates fitted, refined, measured and chosen on ``run``."""
    layers, recipe, seed = run.layers, run.recipe, run.seed
    starts = [s for s in run.starts.names if pinned is None or any(c.split("+")[0] == s for c in pinned)]
    run.bar = console.progress(len(layers) * len(starts), "closed-form candidates (layers)", run.progress)
    with torch.autocast(next(run.model.parameters()).device.type, enabled=False):  # fits, refinement and measures
        found = {name: run.fit_start(name, dims) for name in starts}  # at full precision
        run.bar.close()
        ranked = sorted(starts, key=lambda s: found[s].held_kl)
        refined = [c for c in pinned if "+" in c] if pinned is not None else (
            candidate_names(effort, ranked) if any(steps.values()) else [])
        for name in refined:
            start, kind = name.split("+")
            found[name] = run.blockwise(found[start], steps[kind])
    best, verdicts = choose([found[c] for c in pinned] if pinned is not None else list(found.values()),
                            recipe.confidence, seed)
    run.finish(best)
    held = [None if t is None else (t, {} if rope is None else {"rope": rope})
            for t, rope in zip(run.source.held_tokens, run.ropes)]
    return best.fits, held, summarize(run, found, best, verdicts, effort,
                                                              steps[refined[0].split("+")[1]] if refined else 0)


def summarize(run: RecipeRun, found: dict[str, Candidate], best: Candidate, verdicts: dict[str, Verdict],
              effort: str, steps: int) -> dict:
    """The report's summary of a calibrated conversion (``ConversionReport.summary``): ``objective`` names the
    held-out score (``objective.py``) that ``candidates``, ``held_out_kl`` and ``weight_only_kl`` hold (the KL for a
    classifier); of a feature model also the mean held-out cosine to the source's features of the candidate kept and
    of the weight-only fit. ``guard``: the verdict on the candidate kept, or, where the weight-only fit was kept, on
    the candidate with the lowest held-out score."""
    source, recipe, reference = run.source, run.recipe, found.get("weight")
    summary = {
        "images_fit": source.fit, "images_held_out": source.held_out,
        "measured_on": "held-out images as the model evaluates them" if source.held_out
        else "the fitting images (one image)",
        "effort": effort, "candidate_key_dims": {c.name: [f.key_dim for f in c.fits] for c in found.values()},
        "prefix_weight": run.prefix_weight, "ridge": recipe.ridge,
        "amp": amp_of(recipe, next(run.model.parameters()).device), "bf16": run.bf16,
        "refine_images": source.inputs.shape[0],
        "peak_token_bytes": source.peak, "capture_seconds": source.seconds, "refine_steps": steps,
        "candidates": {c.name: c.held_kl for c in found.values()}, "chosen": best.name,
        "held_out_kl": best.held_kl,
        "weight_only_kl": None if reference is None else reference.held_kl,
        "gain_over_weight_only": None if reference is None else reference.held_kl - best.held_kl,
        "objective": run.objective,
    }
    if best.cosine is not None:
        summary["held_out_cosine"] = best.cosine
        summary["weight_only_cosine"] = None if reference is None else reference.cosine
    shown = best.name if best.name in verdicts else min(verdicts, key=lambda c: found[c].held_kl, default=None)
    if shown is not None and (shown == best.name or found[shown].held_kl < best.held_kl):
        summary["guard"] = verdicts[shown].as_dict()
    if verdicts:
        summary["verdicts"] = {name: v.as_dict() for name, v in verdicts.items()}
    if best.refine is not None:
        summary["refine"] = best.refine
    return summary
