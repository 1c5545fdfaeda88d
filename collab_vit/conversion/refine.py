"""Label-free refinement of converted layers: match what the source model computes on the calibration images.

Only the collaborative query/key projections and mixing (``W~q, W~k, M``, eq. 5) of the converted layers are
trained (with ``values=True`` in ``model-kl`` also their value and output projections); content bias and
everything outside attention stay fixed. Three losses
(``REFINE_LOSSES``), no labels:

* ``model-kl`` (end to end, all layers at once): ``KL(softmax(source logits) || softmax(converted logits))`` of the
  model's outputs, averaged over images (``refine_logits``).
* ``attention-kl`` (layer by layer, right after each layer's fit, on the tokens it sees): the KL of every head's
  attention probabilities, source layer vs converted layer, averaged over heads and query tokens (``refine_layer``).
* ``logit-mse`` (layer by layer): the exact within-image logit objective of docs/math.md, i.e. the squared error of
  every head's logits centred along each query row (softmax ignores row constants), relative to the source's.

Adam on random minibatches drawn from a seeded generator, so a run is deterministic given its seed on one device.
The mean loss over all fitting images is evaluated before and after; if the steps made it worse (seen where the
closed form is already close, e.g. key dim D/4 on Fashion-MNIST: RESULTS.md), the starting weights are restored.
"""
from __future__ import annotations

import numbers
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import Attention
from torch import Tensor
from tqdm import tqdm

from ..layers.attention import CollaborativeAttention
from ..layers.forms import collaborative_logits

REFINE_LOSSES = ("model-kl", "attention-kl", "logit-mse")


@dataclass
class RefineResult:
    steps: int
    seconds: float
    first_loss: float
    last_loss: float
    kl_before: float  # mean loss (KL for the KL losses) over all the fitting images, before the steps
    kl_after: float  # and after them
    kept_start: bool  # the steps made the mean loss worse: the starting weights were restored
    losses: list[float] = field(default_factory=list)


def check_steps(steps: object) -> int:
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
        raise ValueError(f"refine_steps must be an int >= 0, got {steps!r}")
    return int(steps)


def check_loss(loss: object) -> str:
    if loss not in REFINE_LOSSES:
        raise ValueError(f"refine_loss must be one of {REFINE_LOSSES}, got {loss!r}")
    return str(loss)


def check_layerwise(layers: list[tuple[str, nn.Module]], loss: str) -> None:
    """The layer-wise losses recompute the logits (``attention_logits``): timm's own ``Attention`` forward only."""
    for name, attn in layers:
        if not (isinstance(attn, Attention) and type(attn).forward is Attention.forward):
            raise ValueError(f"refine_loss={loss!r} needs timm Attention layers (timm's forward: no relative position "
                             f"bias); {name} is {type(attn).__name__} (use refine_loss='model-kl')")


def _refine(params: list[nn.Parameter], batch_loss: Callable[[Tensor], Tensor], full_loss: Callable[[], float],
            count: int, steps: int, lr: float, batch_size: int, seed: int, progress: bool, desc: str,
            lines: int = 10) -> RefineResult:
    """Adam on ``params``: ``steps`` minibatches of ``batch_size`` indices in ``range(count)`` (seeded), the guard."""
    steps = check_steps(steps)
    if not isinstance(lr, numbers.Real) or not lr > 0:
        raise ValueError(f"refine_lr must be a positive number, got {lr!r}")
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(params, lr=lr)
    losses: list[float] = []
    start = time.perf_counter()
    before = full_loss()
    start_weights = [p.detach().clone() for p in params]
    terminal = progress and sys.stderr.isatty()  # a tqdm bar on a terminal, plain lines in a log file
    every = max(1, steps // lines) if lines else steps + 1
    for step in tqdm(range(steps), desc=desc, disable=not terminal, leave=lines > 1):
        index = torch.randperm(count, generator=generator)[:batch_size]
        loss = batch_loss(index)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if progress and not terminal and ((step + 1) % every == 0 or step + 1 == steps):
            print(f"{desc} step {step + 1}/{steps}: loss {losses[-1]:.3g}", file=sys.stderr, flush=True)
    after = full_loss()
    if after > before:
        with torch.no_grad():
            for p, start_weight in zip(params, start_weights):
                p.copy_(start_weight)
    seconds = time.perf_counter() - start
    return RefineResult(steps, seconds, losses[0] if losses else float("nan"),
                        losses[-1] if losses else float("nan"), before, after, after > before, losses)


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


@torch.no_grad()
def mean_kl(model: nn.Module, images: Tensor, target: Tensor, batch_size: int) -> float:
    """``KL(source || model)`` averaged over ``images`` (``target``: the source's log-probabilities)."""
    device = next(model.parameters()).device
    total = 0.0
    for start in range(0, images.shape[0], batch_size):
        logits = model(images[start:start + batch_size].to(device))
        total += float(F.kl_div(F.log_softmax(logits.float(), dim=-1), target[start:start + batch_size].to(device),
                                log_target=True, reduction="sum"))
    return total / images.shape[0]


def refine_logits(model: nn.Module, layers: list[CollaborativeAttention], images: Tensor, targets: Tensor,
                  steps: int, lr: float = 1e-3, batch_size: int = 64, seed: int = 0,
                  progress: bool = True, values: bool = False) -> RefineResult:
    """``steps`` Adam steps on the ``W~q, W~k, M`` of ``layers`` so that ``model(images)`` matches ``targets`` (KL).

    ``values``: the layers' value and output projections (weights and biases) are refined too. ``model`` runs in
    eval mode (no dropout); the other parameters get no gradient and are left unchanged. Returns the loss of every
    step (the minibatch's, before its update).
    """
    params = [p for layer in layers for p in (layer.query.weight, layer.key.weight, layer.mixing)]
    if values:
        params += [p for layer in layers for part in (layer.value, layer.proj) for p in part.parameters()]
    device = params[0].device
    target = F.log_softmax(targets.float(), dim=-1)

    def batch_loss(index: Tensor) -> Tensor:
        logits = model(images[index].to(device))
        return F.kl_div(F.log_softmax(logits.float(), dim=-1), target[index].to(device), log_target=True,
                        reduction="batchmean")

    with _Trainable([model], params):
        return _refine(params, batch_loss, lambda: mean_kl(model, images, target, batch_size), images.shape[0],
                       steps, lr, batch_size, seed, progress, "refine (KL to the source logits)")


def attention_logits(attn: nn.Module, x: Tensor) -> Tensor:
    """Every head's attention logits ``(B, Nh, N, N)``, scale included, of a timm ``Attention`` (fused ``qkv``) or a
    ``CollaborativeAttention`` (eq. 5: ``(x W~q) diag(m_i) (x W~k)^T + c_i . x_m``, times ``1 / sqrt(dh)``)."""
    if isinstance(attn, CollaborativeAttention):
        content = attn.content_bias(x) if attn.content_bias is not None else None
        return collaborative_logits(attn.q_norm(attn.query(x)), attn.mixing, attn.k_norm(attn.key(x)), content,
                                    attn.scale)
    B, N, _ = x.shape
    qkv = attn.qkv(x).reshape(B, N, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    q, k = attn.q_norm(qkv[0]), attn.k_norm(qkv[1])
    return (q @ k.transpose(-2, -1)) * attn.scale


def _loss_parts(logits: Tensor, reference: Tensor, loss: str) -> tuple[Tensor, Tensor]:
    """Numerator and denominator of ``layer_loss`` (sums, so that minibatches add up exactly)."""
    if loss == "attention-kl":
        rows = logits.shape[0] * logits.shape[1] * logits.shape[2]
        kl = F.kl_div(F.log_softmax(logits.float(), -1), F.log_softmax(reference.float(), -1), log_target=True,
                      reduction="sum")
        return kl, kl.new_tensor(float(rows))
    diff = logits - reference
    diff = diff - diff.mean(-1, keepdim=True)
    ref = reference - reference.mean(-1, keepdim=True)
    return diff.square().sum(), ref.square().sum()


def _ratio(num: Tensor, den: Tensor) -> Tensor:
    return num / den.clamp_min(torch.finfo(den.dtype).tiny)


def layer_loss(logits: Tensor, reference: Tensor, loss: str) -> Tensor:
    """``attention-kl``: mean over images, heads and query rows of ``KL(softmax(reference) || softmax(logits))``;
    ``logit-mse``: ``||centre(logits - reference)||^2 / ||centre(reference)||^2``, rows centred over the keys."""
    return _ratio(*_loss_parts(logits, reference, loss))


def refine_layer(layer: CollaborativeAttention, source: nn.Module, inputs: Tensor, norm: nn.Module, steps: int,
                 loss: str = "attention-kl", lr: float = 1e-3, batch_size: int = 64, seed: int = 0,
                 progress: bool = True, name: str = "") -> RefineResult:
    """``steps`` Adam steps on ``layer``'s ``W~q, W~k, M`` so that its logits match ``source``'s (``layer_loss``) on
    the tokens ``norm(inputs)`` (``inputs``: the block inputs of the fitting images, ``(B, N, D)``)."""
    check_loss(loss)
    if loss == "model-kl":
        raise ValueError("refine_layer takes a layer-wise loss ('attention-kl' or 'logit-mse')")
    params = [layer.query.weight, layer.key.weight, layer.mixing]
    device = params[0].device

    def parts(index: Tensor) -> tuple[Tensor, Tensor]:
        with torch.no_grad():
            x = norm(inputs[index].to(device))
            reference = attention_logits(source, x)
        return _loss_parts(attention_logits(layer, x), reference, loss)

    def batch_loss(index: Tensor) -> Tensor:
        return _ratio(*parts(index))

    @torch.no_grad()
    def full_loss() -> float:
        num = den = 0.0
        for index in torch.arange(inputs.shape[0]).split(batch_size):
            n, d = parts(index)
            num, den = num + float(n), den + float(d)
        return num / max(den, torch.finfo(torch.float32).tiny)

    with _Trainable([layer, source, norm], params):
        return _refine(params, batch_loss, full_loss, inputs.shape[0], steps, lr, batch_size, seed, progress,
                       f"refine {name} ({loss})".replace("  ", " "), lines=1)
