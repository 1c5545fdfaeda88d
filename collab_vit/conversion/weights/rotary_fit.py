"""Compression of rotary attention per frequency (docs/math.md, "Rotary attention, compressed").

Read pair ``p`` of head ``i`` as a complex number: its query is ``x' u_ip`` and its key ``x' v_ip`` with
``u_ip = Wq[first] + i Wq[second]`` (the source's two rows of the pair, ``x' = [x; 1]`` when the layer has q/k
biases). It adds ``Re(x_n'^T T_ip x_m' e^{i(theta_p(n) - theta_p(m))})`` to the logit, ``T_ip = u_ip conj(v_ip)^T``.
For one frequency ``p`` (a source pair index: one angle per axis and band) the heads give the complex tensor
``X_p[i] = T_ip`` of ``H`` rank-1 slices; ``R_p`` shared pairs of frequency ``p`` with a complex mixing per head give
``X~_p[i] = sum_r mu_ir a_r conj(b_r)^T``: a complex CP of ``X_p`` of rank ``R_p`` (the paper's tensor decomposition
per frequency). It is fitted by complex ALS on the compressed core (``U = Qu Ru``, ``conj V = Qv Rv``, an
``H x H x H`` core: orthonormal ``Qu, Qv`` keep every error), started from (1) the ``R`` slices of largest norm
(``||T_ip|| = ||u_ip|| ||v_ip||``, MHA2MLA's 2-norm score) and (2) the rank ``R - 1`` fit with one zero column; the
better is kept, so the error is non-increasing in ``R`` and never above keeping the ``R`` strongest heads.

The layer's ``key_dim / 2`` shared pairs are spread over the frequencies as "each head keeps its strongest pairs"
spreads them by ``||T_ip||`` (``R_p`` = the number of heads that keep ``p``; ``selection_ranks``), and each
frequency's fit at ``R_p`` starts from exactly that selection, so the fit contains it and never has a larger tensor
error at equal q/k parameters. Its top-1 is another matter: the calibrated recipe's ``"select"`` candidate
(``selection_fit``) has each head keep the pairs that give its logits most under the layer's rope
(``Frequencies.logit_energy``: a rotated key bias of a low frequency is nearly constant along a softmax row and
cancels, which ``||T_ip||`` counts in full); as the weight-only conversion it lost to the fit at every share of the
q/k dims measured (RESULTS.md "The rotary weight-only rule"), so the weight-only conversion is the fit. The allocation that minimises the summed tensor error (dynamic
programming, ``allocation="optimal"``) has a lower tensor error and lost accuracy (RESULTS.md, rotary): the tensor
error weighs every frequency's form alike, the logits do not; the calibrated recipe's whitened candidate, whose
error stands for the logits' on the calibration tokens, takes the optimal allocation of its whitened error.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

from ...layers.construction import full_rank
from ...layers.rotary import pair_angles
import torch
import torch.nn as nn
from torch import Tensor

from .whitening import Whitening
from .fit import LayerFit
from .rotary import is_rotary, projections, rotary_layer, rotary_like, \
    shared_order

MAX_ITER, TOL = 100, 1e-10  # ALS sweeps per start; stop when the squared error improves by less (relative)


@dataclass
class Frequencies:
    """A rotary layer's complex factors: ``u``, ``conj_v`` (P, H, D') with ``P = dh / 2`` frequencies, ``D' = D + 1``
    with q/k biases (the last entry)."""

    u: Tensor
    conj_v: Tensor
    bias: bool

    @property
    def energy(self) -> Tensor:
        """``||T_ip||^2`` (P, H): the tensor error's weights (``layer_error``, the per-frequency fit)."""
        return (self.u.abs() ** 2).sum(-1) * (self.conj_v.abs() ** 2).sum(-1)

    def logit_energy(self, row_mean: Optional[Tensor] = None) -> Tensor:
        """What pair ``p`` of head ``i`` gives the logits (P, H): ``E_n Var_m`` of its term along a softmax row for
        tokens of zero mean and unit second moment per entry, ``(||Wq_ip||^2 + |bq_ip|^2) (||Wk_ip||^2 + (1 -
        |c_p|^2) |bk_ip|^2)`` (docs/math.md, "The selection's ranking"): the rotated key bias ``bk_ip e^{i
        theta_p(m)}`` has the row mean ``bk_ip c_p``, ``c_p`` the mean of ``e^{i theta_p(m)}`` over the row's keys,
        which cancels in the softmax (``row_mean``: ``|c_p|^2`` (P,), ``rope_row_mean``). None (no rope known):
        ``c_p = 0``, which is ``energy``."""
        if not self.bias or row_mean is None:
            return self.energy
        key = (self.conj_v[..., :-1].abs() ** 2).sum(-1) + (1 - row_mean.to(torch.float64)).unsqueeze(1) * \
            self.conj_v[..., -1].abs() ** 2
        return (self.u.abs() ** 2).sum(-1) * key


def complex_pairs(weight: Tensor, bias: Optional[Tensor], order: Tensor, heads: int) -> Tensor:
    """``(P, H, D')`` complex rows ``W[first] + i W[second]`` of every head's pairs (bias appended)."""
    w = weight.detach().to(torch.float64)
    if bias is not None:
        w = torch.cat([w, bias.detach().to(torch.float64).unsqueeze(1)], dim=1)
    pairs = w[order].reshape(heads, -1, 2, w.shape[1])
    return torch.complex(pairs[:, :, 0], pairs[:, :, 1]).transpose(0, 1)


def frequencies(attn: nn.Module) -> Frequencies:
    """The complex factors of ``attn`` (module docstring), float64."""
    wq, wk, _, bq, bk, _ = projections(attn)
    order = shared_order(attn.num_heads, attn.head_dim, bool(getattr(attn, "rotate_half", False))).to(wq.device)
    u = complex_pairs(wq.cpu(), None if bq is None else bq.cpu(), order.cpu(), attn.num_heads)
    v = complex_pairs(wk.cpu(), None if bk is None else bk.cpu(), order.cpu(), attn.num_heads)
    return Frequencies(u, v.conj(), bq is not None)


def whitened(freqs: Frequencies, sides: tuple[Whitening, Whitening], inverse: bool = False) -> Frequencies:
    """The factors with their token part mapped by ``Lq^T`` / ``Lk^T`` (``inverse``: by ``Lq^{-T}``, ``Lk^{-T}``);
    a bias entry is left as it is."""
    def side(x: Tensor, w: Whitening) -> Tensor:
        m = (w.inverse_t if inverse else w.root.T).to(torch.complex128)
        d = m.shape[0]
        return torch.cat([x[..., :d] @ m.T, x[..., d:]], dim=-1)
    return Frequencies(side(freqs.u, sides[0]), side(freqs.conj_v, sides[1]), freqs.bias)


@dataclass
class CP:
    """``X[i] ~ sum_r mixing[i, r] query[:, r] key[:, r]^T`` (complex; ``key`` is ``conj(b)``) and its squared error."""

    mixing: Tensor
    query: Tensor
    key: Tensor
    error: float


def als(core: Tensor, m: Tensor, a: Tensor, c: Tensor, max_iter: int = MAX_ITER, tol: float = TOL
        ) -> tuple[Tensor, Tensor, Tensor, float]:
    """Complex CP-ALS of ``core`` (H, J, K) from ``(m, a, c)``: each step the exact least-squares update of one factor
    (``N G^{-1}``, ``G`` the Hadamard product of the other two Gram matrices), so the error never increases."""
    total = float((core.abs() ** 2).sum())
    previous = residual(core, m, a, c)
    for _ in range(max_iter):
        m = solve(torch.einsum("ijk,jr,kr->ir", core, a.conj(), c.conj()), gram(a) * gram(c))
        a = solve(torch.einsum("ijk,ir,kr->jr", core, m.conj(), c.conj()), gram(m) * gram(c))
        c = solve(torch.einsum("ijk,ir,jr->kr", core, m.conj(), a.conj()), gram(m) * gram(a))
        error = residual(core, m, a, c)
        if previous - error <= tol * total:
            previous = min(previous, error)
            break
        previous = error
    return m, a, c, previous


def gram(x: Tensor) -> Tensor:
    return x.T @ x.conj()


def solve(n: Tensor, g: Tensor) -> Tensor:
    """``n g^{-1}`` by least squares (a zero column of a start stays harmless)."""
    return torch.linalg.lstsq(g.T, n.T).solution.T


def residual(core: Tensor, m: Tensor, a: Tensor, c: Tensor) -> float:
    return float(((core - torch.einsum("ir,jr,kr->ijk", m, a, c)).abs() ** 2).sum())


def fit_frequency(u: Tensor, conj_v: Tensor, max_iter: int = MAX_ITER) -> list[CP]:
    """The nested fits of one frequency (``u``, ``conj_v``: (H, D')) at ranks ``0..H`` (module docstring)."""
    heads = u.shape[0]
    qu, ru = torch.linalg.qr(u.T)
    qv, rv = torch.linalg.qr(conj_v.T)
    core = torch.einsum("ji,ki->ijk", ru, rv)  # X[i] = Qu ru[:, i] rv[:, i]^T Qv^T
    norms = (u.abs() ** 2).sum(-1) * (conj_v.abs() ** 2).sum(-1)
    strongest = torch.argsort(norms, descending=True, stable=True)
    zeros = lambda rows: torch.zeros(rows, 0, dtype=core.dtype)  # noqa: E731
    fits = [CP(zeros(heads), zeros(u.shape[1]), zeros(conj_v.shape[1]), float(norms.sum()))]
    previous = (zeros(heads), zeros(ru.shape[0]), zeros(rv.shape[0]))
    for rank in range(1, heads + 1):
        kept = strongest[:rank]
        selection = (torch.eye(heads, dtype=core.dtype)[:, kept], ru[:, kept], rv[:, kept])
        best = min((als(core, *start, max_iter=max_iter) for start in (selection, grown(core, *previous))),
                   key=lambda r: r[3])
        previous = best[:3]
        fits.append(CP(best[0], qu @ best[1], qv @ best[2], best[3]))
    return fits


def grown(core: Tensor, m: Tensor, a: Tensor, c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A rank ``R - 1`` fit with one more column: the best rank-1 form of its largest residual slice (error lower by
    that slice's top squared singular value)."""
    rest = core - torch.einsum("ir,jr,kr->ijk", m, a, c)
    worst = int((rest.abs() ** 2).sum((1, 2)).argmax())
    left, values, right = torch.linalg.svd(rest[worst])
    column = torch.zeros(core.shape[0], 1, dtype=core.dtype)
    column[worst] = 1
    return (torch.cat([m, column], 1), torch.cat([a, (left[:, 0] * values[0]).unsqueeze(1)], 1),
            torch.cat([c, right[0].unsqueeze(1)], 1))


def selection_slots(energy: Tensor) -> list[tuple[int, int]]:
    """Every ``(p, i)`` in the order "each head keeps its strongest pairs" keeps them: by the pair's rank within its
    head, then by its score (the first ``k H`` are each head's ``k`` strongest). ``energy``: the scores (P, H),
    ``||T_ip||^2`` for the per-frequency fit's allocation, ``Frequencies.logit_energy`` for the selection."""
    order = energy.argsort(dim=0, descending=True, stable=True)  # (P, H): head i's j-th strongest pair
    slots = sorted((j, -float(energy[order[j, i], i]), int(order[j, i]), i) for j in range(energy.shape[0])
                   for i in range(energy.shape[1]))
    return [(p, i) for _, _, p, i in slots]


def selection_ranks(energy: Tensor) -> list[list[int]]:
    """For every total ``K = 0..P H`` the ranks per frequency of the first ``K`` ``selection_slots``: ``R_p`` = the
    number of heads that keep ``p``."""
    ranks = [[0] * energy.shape[0]]
    for p, _ in selection_slots(energy):
        ranks.append(list(ranks[-1]))
        ranks[-1][p] += 1
    return ranks


def allocate_pairs(errors: Tensor) -> list[list[int]]:
    """For every total ``K = 0..P H`` the ranks per frequency that minimise the summed error (``errors``: (P, H+1),
    non-increasing rows), by dynamic programming over the frequencies."""
    table = errors.tolist()
    best, choice = list(table[0]), [[r] for r in range(len(table[0]))]
    for row in table[1:]:
        size = len(best) + len(row) - 1
        new, picks = [float("inf")] * size, [[]] * size
        for total in range(size):
            for r in range(max(0, total - len(best) + 1), min(len(row), total + 1)):
                value = best[total - r] + row[r]
                if value < new[total]:
                    new[total], picks[total] = value, choice[total - r] + [r]
        best, choice = new, picks
    return choice


@dataclass
class RotaryPlan:
    """One layer's per-frequency fits and, for every number of shared pairs, the ranks and the relative error."""

    fits: list[list[CP]]
    ranks: list[list[int]]
    relative_error: Tensor  # (P H + 1,): sqrt(summed squared error / energy) at 0..P H shared pairs
    seconds: float

    def spectrum(self) -> Tensor:
        """Normalised cumulative energy at ``1..P H`` shared pairs (``collab-vit analyze``'s rotary spectra)."""
        return (1 - self.relative_error[1:] ** 2).clamp(0, 1)


ALLOCATIONS = ("selection", "optimal")


def plan(freqs: Frequencies, max_iter: int = MAX_ITER, allocation: str = "selection") -> RotaryPlan:
    """Fit every frequency at every rank and allocate the pairs: ``"selection"`` (the default, ``selection_ranks``)
    or ``"optimal"`` for the summed tensor error (``allocate_pairs``; lower tensor error, lower accuracy: RESULTS.md,
    rotary)."""
    if allocation not in ALLOCATIONS:
        raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {allocation!r}")
    began = time.perf_counter()
    fits = [fit_frequency(freqs.u[p], freqs.conj_v[p], max_iter) for p in range(freqs.u.shape[0])]
    errors = torch.tensor([[f.error for f in group] for group in fits], dtype=torch.float64)
    ranks = selection_ranks(freqs.energy) if allocation == "selection" else allocate_pairs(errors)
    summed = torch.tensor([float(sum(errors[p, r] for p, r in enumerate(rs))) for rs in ranks], dtype=torch.float64)
    energy = float(freqs.energy.sum())
    relative = (summed.clamp_min(0) / max(energy, 1e-300)).sqrt()
    return RotaryPlan(fits, ranks, relative, time.perf_counter() - began)


def balanced(fit: CP, r: int) -> tuple[Tensor, Tensor, Tensor]:
    """Column ``r`` of ``fit`` as ``(mu, a, conj b)`` with ``max |mu| = 1`` and ``||a|| = ||b||`` (same form)."""
    a, c, m = fit.query[:, r], fit.key[:, r], fit.mixing[:, r]
    na, nc = a.norm().clamp_min(1e-300), c.norm().clamp_min(1e-300)
    m = m * na * nc
    scale = m.abs().max().clamp_min(1e-300)
    return m / scale, a / na * scale.sqrt(), c / nc * scale.sqrt()


def compressed_layer(attn: nn.Module, freqs: Frequencies, fits: list[list[CP]], ranks: Sequence[int],
                     sides: Optional[tuple[Whitening, Whitening]] = None) -> nn.Module:
    """The collaborative rotary layer of ``attn`` with ``ranks[p]`` shared pairs of frequency ``p`` from ``fits``
    (fitted on the factors whitened by ``sides``, mapped back here); values and the rest as at full rank."""
    key_dim = 2 * sum(ranks)
    layer = rotary_layer(attn)
    small = rotary_like(attn, key_dim)
    columns = [(p, *balanced(fits[p][rank], r)) for p, rank in enumerate(ranks) for r in range(rank)]
    mixing, query, key = (torch.stack([c[i] for c in columns], dim=1) for i in (1, 2, 3))
    if sides is not None:
        back = whitened(Frequencies(query.T, key.T, freqs.bias), sides, inverse=True)
        query, key = back.u.T, back.conj_v.T
    d = attn.proj.out_features
    dtype = small.query.weight.dtype
    with torch.no_grad():
        for shared, factor in ((small.query, query), (small.key, key.conj())):
            rows = torch.stack([factor.real, factor.imag], dim=-1).reshape(d + freqs.bias, -1).T  # (D~k, D')
            shared.weight.copy_(rows[:, :d].to(dtype))
            if freqs.bias:
                shared.bias.copy_(rows[:, d].to(dtype))
        small.mixing.copy_(torch.stack([mixing.real, mixing.imag], dim=-1).reshape(attn.num_heads, -1).to(dtype))
        small.pair_freq.copy_(torch.tensor([c[0] for c in columns], dtype=torch.long))
        small.value.load_state_dict(layer.value.state_dict())
        small.proj.load_state_dict(layer.proj.state_dict())
    return small


def rope_row_mean(attn: nn.Module, rope: Optional[Tensor]) -> Optional[Tensor]:
    """``|c_p|^2`` (P,) for the rope tensor ``attn`` is called with: ``c_p`` the mean of ``e^{i theta_p(m)}`` over a
    softmax row's keys (prefix tokens at angle 0; per-sample ropes: ``|c_p|^2`` averaged); None without a rope."""
    if rope is None:
        return None
    pairs = attn.head_dim // 2
    sin, cos = pair_angles(rope, torch.arange(pairs, device=rope.device), bool(getattr(attn, "rotate_half", False)),
                           attn.head_dim)
    sin, cos = sin[..., 0::2].to(torch.float64), cos[..., 0::2].to(torch.float64)  # (N', P), interleaved copies
    prefix = attn.num_prefix_tokens
    c = torch.complex(cos.sum(-2) + prefix, sin.sum(-2)) / (sin.shape[-2] + prefix)
    return (c.abs() ** 2).reshape(-1, pairs).mean(0).cpu()


def selection_layer(attn: nn.Module, key_dim: int, rope: Optional[Tensor] = None) -> nn.Module:
    """Each head keeps its ``key_dim / (2 heads)`` pairs that give its logits most
    (``Frequencies.logit_energy`` under ``rope``, the rope tensor the layer is called with; None: ``||T_ip||``)."""
    freqs = frequencies(attn)
    return strongest_pairs(attn, key_dim, freqs.logit_energy(rope_row_mean(attn, rope)))


def strongest_pairs(attn: nn.Module, key_dim: int, score: Tensor) -> nn.Module:
    """Each head keeps its ``key_dim / (2 heads)`` pairs of largest ``score`` (P, H) (fewer pairs than heads: the
    strongest heads keep one; :func:`selection_slots`): the exact layer's shared pairs ``r = i dh/2 + p`` of the
    kept ``(i, p)`` (mixing ``e_i``), the others dropped. The baseline RESULTS.md compares rotary conversions with."""
    exact = rotary_layer(attn)
    kept = sorted(i * score.shape[0] + p for p, i in selection_slots(score)[:key_dim // 2])
    dims = torch.tensor([d for r in kept for d in (2 * r, 2 * r + 1)], dtype=torch.long)
    small = rotary_like(attn, dims.numel())
    with torch.no_grad():
        for new, old in ((small.query, exact.query), (small.key, exact.key)):
            new.weight.copy_(old.weight[dims])
            if old.bias is not None:
                new.bias.copy_(old.bias[dims])
        small.mixing.copy_(exact.mixing[:, dims])
        small.pair_freq.copy_(exact.pair_freq[torch.tensor(kept, dtype=torch.long)])
        small.value.load_state_dict(exact.value.state_dict())
        small.proj.load_state_dict(exact.proj.state_dict())
    return small


def selection_fit(attn: nn.Module, key_dim: int, rope: Optional[Tensor] = None) -> LayerFit:
    """:func:`selection_layer` as the recipe's ``"select"`` start (exact at full rank, as every start)."""
    began = time.perf_counter()
    layer = rotary_layer(attn, key_dim) if key_dim >= full_rank(attn) else selection_layer(attn, key_dim, rope)
    return LayerFit(layer, key_dim, layer_error(attn, layer), None, time.perf_counter() - began)


def layer_error(attn: nn.Module, layer: nn.Module) -> float:
    """``sqrt(sum_ip ||T_ip - T~_ip||^2 / sum_ip ||T_ip||^2)`` of a rotary layer (e.g. refined) against its source."""
    freqs = frequencies(attn)
    order = torch.arange(layer.key_dim)
    a = complex_pairs(layer.query.weight, layer.query.bias, order, 1)[:, 0]  # (D~k/2, D')
    conj_b = complex_pairs(layer.key.weight, layer.key.bias, order, 1)[:, 0].conj()
    mu = layer.mixing.detach().to(torch.float64)
    mu = torch.complex(mu[:, 0::2], mu[:, 1::2])  # (H, D~k/2)
    error = 0.0
    for p in range(freqs.u.shape[0]):
        shared = (layer.pair_freq == p).cpu()
        target = torch.einsum("id,ie->ide", freqs.u[p], freqs.conj_v[p])
        approx = torch.einsum("ir,rd,re->ide", mu[:, shared], a[shared], conj_b[shared])
        error += float(((target - approx).abs() ** 2).sum())
    return (error / max(float(freqs.energy.sum()), 1e-300)) ** 0.5


def allocation_for(sides: object) -> str:
    """Weight-only: the selection's allocation; whitened by the tokens: the optimal one for the whitened error (which
    stands for the logit error on those tokens, where the weights' Frobenius error does not: RESULTS.md, rotary)."""
    return "selection" if sides is None else "optimal"


def fit_rotary(attn: nn.Module, key_dim: int, sides: Optional[tuple[Whitening, Whitening]] = None,
               max_iter: int = MAX_ITER) -> LayerFit:
    """``attn`` at ``key_dim``: exact at full rank or above, else the per-frequency fit (of the whitened factors when
    ``sides``, ``allocation_for``); the tensor error of the weights (and of the whitened factors)."""
    began = time.perf_counter()
    full = full_rank(attn)
    if key_dim >= full:
        return LayerFit(rotary_layer(attn, key_dim), key_dim, 0.0, None if sides is None else 0.0,
                        time.perf_counter() - began)
    freqs = frequencies(attn)
    fitted = plan(freqs if sides is None else whitened(freqs, sides), max_iter, allocation_for(sides))
    layer = compressed_layer(attn, freqs, fitted.fits, fitted.ranks[key_dim // 2], sides)
    white = None if sides is None else float(fitted.relative_error[key_dim // 2])
    return LayerFit(layer, key_dim, layer_error(attn, layer), white, time.perf_counter() - began)


def only_rotary(model: nn.Module, layers: list[tuple[str, nn.Module]]) -> None:
    """A one-line refusal for a model with standard attention beside its rotary layers."""
    standard = [name for name, attn in layers if not is_rotary(attn, model)]
    if standard:
        raise ValueError(f"{standard[0]} is standard attention beside rotary layers: converting both is not covered")
