"""Tensor decompositions that turn standard multi-head attention into collaborative attention.

Paper: Cordonnier, Loukas, Jaggi, "Multi-Head Attention: Collaborate Instead of Concatenate" (arXiv 2006.16362).

Section 3.3 stacks the per-head bilinear forms of a standard layer into a 3-way tensor ``T`` of shape
``(Nh, D, D)``, ``T[i] = Wq_i Wk_i^T``, and reads a collaborative layer off a rank-``R`` CP decomposition

    T[i] ~ sum_r M[i, r] * outer(W~q[:, r], W~k[:, r]) = W~q diag(M[i]) W~k^T,

with shared projections ``W~q, W~k`` (``D x R``) and mixing matrix ``M`` (``Nh x R``). It is exact for
``R >= Nh * dh`` (the "concatenate" construction). Notation: ``wq``, ``wk`` hold the per-head factors,
shape ``(Nh, D, dh)``, so that ``T[i] = wq[i] @ wk[i].T``.

The tensor is never formed: every slice is a product of two ``D x dh`` matrices, so all ALS contractions
(MTTKRP, Gram matrices, mode projections) cost ``O(Nh * D * dh * R)`` and use a handful of GEMMs with the
concatenated factors ``Wq = [wq_0 .. wq_{Nh-1}]`` (``D x Nh*dh``). ``dense_tensor`` exists for tests only.

The route (``tucker_decompose``, ending in a ``Decomposition``) is compress-then-decompose: ``Uq, Uk`` span the leading ``R``-dim query / key subspaces,
  the core ``G[i] = Uq^T T[i] Uk`` (kept factored as ``(Uq^T wq_i)(Uk^T wk_i)^T``) gets a rank-``R`` CP,
  and ``W~q = Uq A``, ``W~k = Uk B``, ``M = C``; the last 5 sweeps run on the full factored tensor.

It starts from the better of a head-wise SVD start and a GEVD (Jennrich) start of the Tucker core (the latter
recovers a planted CP of any rank ``r <= R`` to ~eps, zero-padding the ``R - r`` spare components), use Bro's
line search after each sweep, and with the default float64 run their sweeps in float32 until the relative
error drops below 1e-2. The error of the result is always re-evaluated in float64 on the returned factors.

Measurements (times, errors and the choices above: float32 sweeps, line search, final full-space sweeps, one
thread on shared machines) are in ``benchmarks/decompose_notes.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ...checks import fraction, nonnegative_int, positive_int, positive_real
from ...layers.construction import concatenate_factors, split_qkv_heads

__all__ = [
    "Decomposition",
    "split_qkv_heads",
    "dense_tensor",
    "exact_decomposition",
    "tucker_decompose",
    "relative_error",
    "energy_spectrum",
    "rank_for_energy",
    "canonical_form",
]

# Below this relative error the Gram-matrix formula ||T||^2 - 2<T,T~> + ||T~||^2 has lost most of its
# digits to cancellation (its floor is ~sqrt(eps) ~ 1e-8 in float64), so the residual is re-evaluated
# slice by slice from QR factors (floor ~eps).
_STABLE_BELOW = 1e-4

# Above this relative error ALS sweeps run in float32 (see _mixed_als).
_COARSE = 1e-2

# tucker_decompose ends with this many CP-ALS sweeps on the full (factored) tensor, which let the factors leave
# the Tucker subspaces (their effect on the benchmark layer: benchmarks/decompose_notes.md).
_REFINE_SWEEPS = 5


@dataclass
class Decomposition:
    """Rank-R CP form of the stacked bilinear forms: ``T[i] ~ query @ diag(mixing[i]) @ key.T``.

    Attributes:
        query: Shared query projection W~q, shape (D, R).
        key: Shared key projection W~k, shape (D, R).
        mixing: Mixing matrix M, shape (Nh, R).
        relative_error: ``||T - T~||_F / ||T||_F`` of the returned factors, computed without forming T.
        iterations: ALS iterations run (0 for the exact construction).
    """

    query: Tensor
    key: Tensor
    mixing: Tensor
    relative_error: float
    iterations: int


# ---------------------------------------------------------------------------------------------------------------
# argument checks


def _check_factors(wq: Tensor, wk: Tensor) -> None:
    if not isinstance(wq, Tensor) or not isinstance(wk, Tensor):
        raise ValueError("wq and wk must be torch tensors")
    if wq.dim() != 3:
        raise ValueError(f"wq must be 3-D (Nh, D, dh), got shape {tuple(wq.shape)}")
    if wk.shape != wq.shape:
        raise ValueError(f"wk shape {tuple(wk.shape)} does not match wq shape {tuple(wq.shape)}")
    if not wq.is_floating_point() or not wk.is_floating_point():
        raise ValueError(f"wq and wk must be floating point, got {wq.dtype} and {wk.dtype}")
    if wq.numel() == 0:
        raise ValueError(f"wq must be non-empty, got shape {tuple(wq.shape)}")


def _check_rank(rank: int) -> None:
    positive_int(rank, "rank")


def _check_als_args(max_iter: int, tol: float, dtype: torch.dtype) -> None:
    nonnegative_int(max_iter, "max_iter")
    positive_real(tol, "tol")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating point torch.dtype, got {dtype!r}")


# ---------------------------------------------------------------------------------------------------------------
# small helpers


def dense_tensor(wq: Tensor, wk: Tensor) -> Tensor:
    """The dense (Nh, D, D) tensor ``T[i] = wq[i] @ wk[i].T`` (section 3.3). For tests and references only."""
    _check_factors(wq, wk)
    return wq @ wk.transpose(1, 2)


def _concat(w: Tensor) -> Tensor:
    """(Nh, D, dh) -> (D, Nh*dh), heads side by side: the concatenated projection of section 3.1."""
    nh, d, dh = w.shape
    return w.permute(1, 0, 2).reshape(d, nh * dh)


def _unfolding_factor(wa: Tensor, wb: Tensor) -> Tensor:
    """A (D, Nh*min(D,dh)) matrix with the left singular vectors/values of the unfolding ``[T_0 .. T_{Nh-1}]``.

    With ``wb_i = O_i R_i`` (QR), ``T_i = wa_i R_i^T O_i^T`` and ``O_i`` has orthonormal columns, so the
    unfolding and ``[wa_i R_i^T]_i`` share left singular vectors and singular values.
    """
    r = torch.linalg.qr(wb, mode="r").R  # (Nh, min(D, dh), dh)
    return _concat(wa @ r.transpose(1, 2))


def _leading_subspace(wa: Tensor, wb: Tensor, rank: int) -> tuple[Tensor, int]:
    """Orthonormal (D, min(rank, D, Nh*dh)) basis of the leading mode subspace of T (truncated HOSVD).

    From ``eigh`` of ``F F^T`` (F from ``_unfolding_factor``), about twice as fast as an SVD of F. Also returns
    the number of basis vectors that are numerically non-null (eigenvalue above ``100 D eps`` times the largest).
    """
    f = _unfolding_factor(wa, wb)
    n = min(f.shape)
    ev, vec = torch.linalg.eigh(f @ f.T)
    ev, vec = ev.flip(0)[:n], vec.flip(1)[:, :n]
    keep = int((ev > ev[0] * 100 * f.shape[0] * torch.finfo(ev.dtype).eps).sum()) if ev[0] > 0 else 0
    r = min(rank, n)
    return vec[:, :r], min(r, keep)

def _total_normsq(wq: Tensor, wk: Tensor) -> Tensor:
    """||T||_F^2 = sum_i tr((wq_i^T wq_i)(wk_i^T wk_i))."""
    gq = wq.transpose(1, 2) @ wq
    gk = wk.transpose(1, 2) @ wk
    return (gq * gk).sum()


# ---------------------------------------------------------------------------------------------------------------
# error


def _stable_residual_normsq(wq: Tensor, wk: Tensor, query: Tensor, key: Tensor, mixing: Tensor) -> Tensor:
    """sum_i ||wq_i wk_i^T - Q diag(M_i) K^T||_F^2 from per-slice QR factors; accurate to ~eps relative.

    Slice residual ``E_i = [wq_i, Q diag(M_i)] [wk_i, -K]^T``; with R-factors ``Ra, Rb`` of the two
    ``D x (dh + s_i)`` blocks (``s_i`` = support of ``M_i``), ``||E_i|| = ||Ra Rb^T||``. Cost O(Nh D (dh + R)^2).
    """
    total = wq.new_zeros(())
    for i in range(wq.shape[0]):
        idx = mixing[i].nonzero().flatten()
        a = torch.cat([wq[i], query[:, idx] * mixing[i, idx]], dim=1)
        b = torch.cat([wk[i], -key[:, idx]], dim=1)
        ra = torch.linalg.qr(a, mode="r").R
        rb = torch.linalg.qr(b, mode="r").R
        total = total + (ra @ rb.T).square().sum()
    return total


def _relative_error(
    wq: Tensor,
    wk: Tensor,
    query: Tensor,
    key: Tensor,
    mixing: Tensor,
    normsq: float,
    inner: Tensor | None = None,
    grams: tuple[Tensor, Tensor] | None = None,
    outside: float = 0.0,
) -> float:
    """Relative error from Gram matrices, falling back to the stable slice-wise residual when it is small.

    ``||T~||^2 = sum((Q^T Q) * (K^T K) * (M^T M))`` and
    ``<T, T~> = sum_{i,r} M[i,r] (wq_i^T Q)[:, r] . (wk_i^T K)[:, r]``.
    ``normsq`` is ``||T||^2`` of the full tensor. When ``wq, wk`` are the factors of a Tucker core, ``outside`` is
    the energy the core misses, ``||T||^2 - ||G||^2``: then ``||T - T~||^2 = outside + ||G - G~||^2`` and the
    Gram formula with the full ``normsq`` needs no change.
    """
    if normsq <= 0:
        return 0.0 if not bool(mixing.any()) else math.inf
    if inner is None:
        nh, _, dh = wq.shape
        pq = (_concat(wq).T @ query).reshape(nh, dh, -1)
        pk = (_concat(wk).T @ key).reshape(nh, dh, -1)
        inner = (mixing * (pq * pk).sum(1)).sum()
    gq, gk = grams if grams is not None else (query.T @ query, key.T @ key)
    approx = (gq * gk * (mixing.T @ mixing)).sum()
    err2 = (normsq - 2 * float(inner) + float(approx)) / normsq
    if err2 < _STABLE_BELOW**2:
        err2 = (outside + float(_stable_residual_normsq(wq, wk, query, key, mixing))) / normsq
    return math.sqrt(max(err2, 0.0))

@torch.no_grad()
def relative_error(wq: Tensor, wk: Tensor, query: Tensor, key: Tensor, mixing: Tensor) -> float:
    """``||T - T~||_F / ||T||_F`` for ``T~[i] = query @ diag(mixing[i]) @ key.T``, without forming T (float64).

    Uses ``||T||^2``, ``<T, T~>`` and ``||T~||^2`` from small Gram matrices (O(Nh D dh R)); when the result is
    below 1e-4, where that formula loses its digits to cancellation, it is recomputed from per-slice QR factors.
    """
    _check_factors(wq, wk)
    nh, d, _ = wq.shape
    if query.dim() != 2 or query.shape[0] != d or key.shape != query.shape:
        raise ValueError(f"query and key must both have shape (D={d}, R), got {tuple(query.shape)}, {tuple(key.shape)}")
    if mixing.shape != (nh, query.shape[1]):
        raise ValueError(f"mixing must have shape (Nh={nh}, R={query.shape[1]}), got {tuple(mixing.shape)}")
    f64 = dict(dtype=torch.float64)
    wq, wk = wq.to(**f64), wk.to(**f64)
    return _relative_error(wq, wk, query.to(**f64), key.to(**f64), mixing.to(**f64), _total_normsq(wq, wk))


# ---------------------------------------------------------------------------------------------------------------
# exact construction


@torch.no_grad()
def exact_decomposition(wq: Tensor, wk: Tensor, rank: int) -> Decomposition:
    """The "concatenate" construction, exact for ``rank >= Nh * dh`` (section 3.3).

    ``W~q = [wq_0 .. wq_{Nh-1}]``, ``W~k`` likewise, ``M[i]`` the indicator of head i's ``dh`` columns; columns
    beyond ``Nh * dh`` are zero.
    """
    _check_factors(wq, wk)
    _check_rank(rank)
    nh, _, dh = wq.shape
    if rank < nh * dh:
        raise ValueError(f"rank must be >= Nh*dh = {nh * dh} for the exact construction, got {rank}")
    query, key, mixing = concatenate_factors(wq, wk, rank)
    err = relative_error(wq, wk, query, key, mixing)
    return Decomposition(query, key, mixing, err, 0)


# ---------------------------------------------------------------------------------------------------------------
# CP-ALS on the factored tensor


def _solve_sym(rhs: Tensor, gram: Tensor, ridge: float) -> Tensor:
    """``rhs @ inv(gram + ridge * mean(diag) * I)`` for a symmetric PSD ``gram`` (the ALS normal equations)."""
    lam = ridge * gram.diagonal().mean().clamp_min(torch.finfo(gram.dtype).tiny)
    g = gram + lam * torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    chol, info = torch.linalg.cholesky_ex(g)
    if int(info) == 0:
        return torch.cholesky_solve(rhs.T, chol).T
    return rhs @ torch.linalg.pinv(g, hermitian=True)


def _normalise_columns(x: Tensor) -> Tensor:
    return x / x.norm(dim=0).clamp_min(torch.finfo(x.dtype).tiny)


def _als(
    wq: Tensor,
    wk: Tensor,
    query: Tensor,
    key: Tensor,
    max_iter: int,
    tol: float,
    normsq: float,
    outside: float = 0.0,
    *,
    stop_below: float | None = None,
) -> tuple[Tensor, Tensor, Tensor, int, float]:
    """CP-ALS on ``T[i] = wq_i wk_i^T`` from a start (query, key); returns (query, key, mixing, iterations, error).

    Mode updates solve the normal equations of section 3.3's CP objective with the MTTKRPs computed from
    the factors, e.g. for the query factor ``sum_i wq_i ((wk_i^T K) * M_i) [(M^T M) * (K^T K)]^{-1}``: four
    ``(Nh*dh) x P x R`` GEMMs per sweep (``P`` = rows of ``wq``). Each sweep is followed by Bro's line search.
    ``normsq`` and ``outside`` are as in ``_relative_error`` (errors are those of the full tensor). Stops when
    the relative change of the error falls below ``tol``, when the error is at most ``stop_below`` (default
    ``eps ** 0.75`` of the dtype, 1.8e-12 in float64: an exact fit, whose error changes are rounding noise that
    would never meet ``tol``), or after ``max_iter`` sweeps.
    """
    nh, _, dh = wq.shape
    rank = query.shape[1]
    if stop_below is None:
        stop_below = torch.finfo(wq.dtype).eps ** 0.75
    if normsq <= 0:
        return query, key, query.new_zeros(nh, rank), 0, 0.0
    ridge = 100 * torch.finfo(wq.dtype).eps
    cq, ck = _concat(wq), _concat(wk)

    def fit(query, key, pq, pk, gq, gk):  # mixing by least squares, and the error it leaves
        mttkrp = (pq * pk).sum(1)
        mixing = _solve_sym(mttkrp, gq * gk, ridge)
        return mixing, _relative_error(wq, wk, query, key, mixing, normsq, (mixing * mttkrp).sum(), (gq, gk), outside)

    query, key = _normalise_columns(query), _normalise_columns(key)
    pq = (cq.T @ query).reshape(nh, dh, rank)
    pk = (ck.T @ key).reshape(nh, dh, rank)
    gq, gk = query.T @ query, key.T @ key
    mixing, err = fit(query, key, pq, pk, gq, gk)
    if err <= stop_below:
        return query, key, mixing, 0, err

    it, rejected = 0, 0
    for it in range(1, max_iter + 1):
        q_prev, k_prev, pq_prev, pk_prev = query, key, pq, pk
        gm = mixing.T @ mixing
        query = _normalise_columns(_solve_sym(cq @ (pk * mixing[:, None, :]).reshape(nh * dh, rank), gm * gk, ridge))
        pq = (cq.T @ query).reshape(nh, dh, rank)
        gq = query.T @ query
        key = _normalise_columns(_solve_sym(ck @ (pq * mixing[:, None, :]).reshape(nh * dh, rank), gm * gq, ridge))
        pk = (ck.T @ key).reshape(nh, dh, rank)
        gk = key.T @ key
        prev = err
        mixing, err = fit(query, key, pq, pk, gq, gk)
        if it > 1:
            # Line search (Bro 1998): jump along the last sweep's step, keep the jump if it fits better. The
            # projections pq, pk are linear in the factors, so the jump costs no GEMM with the head factors.
            step = it ** (1.0 / (3 + rejected)) - 1
            q_x, k_x = query + step * (query - q_prev), key + step * (key - k_prev)
            pq_x, pk_x = pq + step * (pq - pq_prev), pk + step * (pk - pk_prev)
            gq_x, gk_x = q_x.T @ q_x, k_x.T @ k_x
            m_x, err_x = fit(q_x, k_x, pq_x, pk_x, gq_x, gk_x)
            if err_x < err:
                query, key, pq, pk, gq, gk, mixing, err = q_x, k_x, pq_x, pk_x, gq_x, gk_x, m_x, err_x
            else:
                rejected += 1
        if err <= stop_below or abs(prev - err) <= tol * prev:
            break
    return query, key, mixing, it, err


def _mixed_als(
    wq: Tensor, wk: Tensor, query: Tensor, key: Tensor, max_iter: int, tol: float, normsq: float, outside: float = 0.0
) -> tuple[Tensor, Tensor, Tensor, int, float]:
    """``_als`` in float32 while the fit is coarse (error above ``_COARSE``), then in the dtype of ``wq``.

    Float32 sweeps cost about half as much and, at errors of 1e-2 and above, end within ~1e-4 of the float64
    path's error (benchmarks/decompose_notes.md); near an exact fit the float64 sweeps take over, so
    exact CPs are still recovered to ~eps. The float32 Gram-formula error is only trusted down to ~1e-2 for the
    same reason (cancellation), which is where the hand-over happens.
    """
    done = 0
    if wq.dtype == torch.float64 and max_iter > 0:
        f32 = torch.float32
        query, key, _, done, _ = _als(
            wq.to(f32), wk.to(f32), query.to(f32), key.to(f32), max_iter, tol, normsq, outside, stop_below=_COARSE
        )
        query, key = query.to(wq.dtype), key.to(wq.dtype)
    query, key, mixing, it, err = _als(wq, wk, query, key, max_iter - done, tol, normsq, outside)
    return query, key, mixing, done + it, err

def _finalise(query: Tensor, key: Tensor, mixing: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Canonical scaling and order: each mixing column has max-abs entry +1, ``||W~q[:, r]|| = ||W~k[:, r]||``,
    components sorted by decreasing weight ``||q_r|| ||k_r|| max|m_r|`` (zero components last)."""
    nq, nk = query.norm(dim=0), key.norm(dim=0)
    piv = mixing.gather(0, mixing.abs().argmax(0, keepdim=True)).squeeze(0)
    weight = nq * nk * piv.abs()
    live = weight > 0
    safe = torch.where(live, piv, torch.ones_like(piv))
    scale = torch.where(live, weight.sqrt(), torch.zeros_like(weight))
    tiny = torch.finfo(query.dtype).tiny
    query = query / nq.clamp_min(tiny) * scale * safe.sign()
    key = key / nk.clamp_min(tiny) * scale
    mixing = torch.where(live, mixing / safe, torch.zeros_like(mixing))
    order = torch.argsort(weight, descending=True, stable=True)
    return query[:, order], key[:, order], mixing[:, order]


canonical_form = _finalise  # public name: the data-aware route re-balances its mapped-back factors with it


def _headwise_start(wq: Tensor, wk: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """The best rank-R CP with one-hot mixing: the R largest singular triplets over all slices T_i."""
    oq, rq = torch.linalg.qr(wq)
    ok, rk = torch.linalg.qr(wk)
    u, s, vh = torch.linalg.svd(rq @ rk.transpose(1, 2))
    uq, vk = oq @ u, ok @ vh.transpose(1, 2)  # (Nh, D, c) singular vectors of each slice
    c = s.shape[1]
    top = torch.argsort(s.flatten(), descending=True, stable=True)[:rank]
    head, j = top // c, top % c
    root = s[head, j].sqrt()
    query, key = uq[head, :, j].T * root, vk[head, :, j].T * root
    if rank > top.numel():  # more components than slice singular triplets: pad with zero columns
        query = torch.cat([query, query.new_zeros(query.shape[0], rank - top.numel())], 1)
        key = torch.cat([key, key.new_zeros(key.shape[0], rank - top.numel())], 1)
    return query, key


def _gevd_start(wa: Tensor, wb: Tensor, rank: int, p: int) -> tuple[Tensor, Tensor] | None:
    """Simultaneous-diagonalisation (GEVD, Jennrich) start from the leading ``p x p`` block of a Tucker core.

    ``wa, wb`` are core factors (Nh, P, dh) whose first ``p`` rows span the numerically non-null part. With two
    head-mode combinations ``S1 = A D1 B^T``, ``S2 = A D2 B^T`` of the block, ``S2 S1^{-1} = A (D2/D1) A^{-1}``
    gives ``A`` and then ``A^{-1} S1 = D1 B^T`` gives ``B`` (one eigenproblem, no pairing of two eigenvector
    sets), exact when the core has CP rank ``p``. The ``p`` components are
    returned as (P, rank) factors, zero beyond row ``p`` and column ``p``; ALS grows the zero columns when they
    help. Returns None if not applicable.
    """
    nh, big_p, _ = wa.shape
    if nh < 2 or p > rank or p < 1:
        return None
    g = wa[:, :p] @ wb[:, :p].transpose(1, 2)
    w = torch.randn(nh, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(g)  # Jennrich
    s1, s2 = torch.einsum("i,ide->de", w[:, 0], g), torch.einsum("i,ide->de", w[:, 1], g)
    try:
        a = torch.linalg.eig(torch.linalg.solve(s1.T, s2.T).T)[1].real
        b = torch.linalg.solve(a, s1).T  # B = (A^{-1} S1)^T up to column scales, paired column by column with A
    except RuntimeError:  # singular S1 or A
        return None
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return None
    qa, kb = wa.new_zeros(big_p, rank), wb.new_zeros(big_p, rank)
    qa[:p, :p], kb[:p, :p] = a, b
    return qa, kb


def _core(wq: Tensor, wk: Tensor, rank: int) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """Tucker compression: ``(Uq, Uk, Uq^T wq, Uk^T wk, p)`` with ``p`` the numerical rank of the block kept."""
    uq, pq = _leading_subspace(wq, wk, rank)
    uk, pk = _leading_subspace(wk, wq, rank)
    return uq, uk, uq.T @ wq, uk.T @ wk, min(pq, pk)


def _pick(wq: Tensor, wk: Tensor, starts: list, normsq: float, outside: float = 0.0) -> tuple[Tensor, Tensor]:
    """The start with the smallest error once the mixing is solved for."""
    starts = [s for s in starts if s is not None]
    return min(starts, key=lambda s: _als(wq, wk, s[0], s[1], 0, 1.0, normsq, outside)[4])

def _result(
    wq: Tensor, wk: Tensor, query: Tensor, key: Tensor, mixing: Tensor, iterations: int, out_dtype: torch.dtype
) -> Decomposition:
    query, key, mixing = (x.to(out_dtype) for x in _finalise(query, key, mixing))
    return Decomposition(query, key, mixing, relative_error(wq, wk, query, key, mixing), iterations)


@torch.no_grad()
def tucker_decompose(
    wq: Tensor,
    wk: Tensor,
    rank: int,
    *,
    max_iter: int = 100,
    tol: float = 1e-6,
    dtype: torch.dtype = torch.float64,
) -> Decomposition:
    """Compress-then-decompose: Tucker ``(Nh, R, R)`` then a rank-``R`` CP of the core (section 3.3).

    ``Uq, Uk`` are the leading ``R`` left singular vectors of the query- and key-mode unfoldings of T (computed
    from the factors), the core ``G[i] = Uq^T T[i] Uk = (Uq^T wq_i)(Uk^T wk_i)^T`` stays factored, its CP
    ``(A, B, C)`` comes from an ALS in R dims (``_mixed_als``), and ``W~q = Uq A``, ``W~k = Uk B``,
    ``M = C``. The last ``min(5, max_iter // 2)`` of the ``max_iter`` sweeps run on the full factored tensor
    (CP-ALS there), so the factors may leave the Tucker subspaces; when the head-wise start of the full
    tensor fits better than the core's CP, those sweeps also run from it and the better result is kept. A core
    sweep costs about half a full one at ``R = D / 2`` (the GEMMs are ``Nh*dh x R x R`` instead of
    ``Nh*dh x D x R``). The start is the better of the head-wise SVD start and the GEVD start of the core.
    ``max_iter``: ALS sweeps at most; ``tol``: stop when the relative error changes by less between sweeps;
    ``dtype``: of the sweeps (float64: float32 sweeps while the error is above 1e-2). No seed: deterministic.
    """
    _check_factors(wq, wk)
    _check_rank(rank)
    _check_als_args(max_iter, tol, dtype)
    nh, _, dh = wq.shape
    if rank >= nh * dh:
        return exact_decomposition(wq, wk, rank)
    a, b = wq.to(dtype), wk.to(dtype)
    normsq = float(_total_normsq(a, b))
    uq, uk, ca, cb, p = _core(a, b, rank)  # core factors (Nh, R', dh): G[i] = ca[i] cb[i]^T
    outside = max(normsq - float(_total_normsq(ca, cb)), 0.0)
    q0, k0 = _pick(ca, cb, [_headwise_start(ca, cb, rank), _gevd_start(ca, cb, rank, p)], normsq, outside)
    refine = min(_REFINE_SWEEPS, max_iter // 2)
    core_q, core_k, _, it, _ = _mixed_als(ca, cb, q0, k0, max_iter - refine, tol, normsq, outside)
    # The Tucker subspaces can hold the CP back (seen where R is close to Nh*dh): when the full tensor's head-wise
    # start fits better than the core's CP, the full-space sweeps run from both and the better result is kept.
    starts = [(uq @ core_q, uk @ core_k)]
    head = _headwise_start(a, b, rank)
    if _pick(a, b, [starts[0], head], normsq) is head:
        starts.append(head)
    fits = [_mixed_als(a, b, q, k, refine, tol, normsq) for q, k in starts]
    query, key, mixing, it_full, _ = min(fits, key=lambda fit: fit[4])
    return _result(wq, wk, query, key, mixing, it + it_full, wq.dtype)


# ---------------------------------------------------------------------------------------------------------------
# spectrum (section 3.1)


@torch.no_grad()
def energy_spectrum(wq: Tensor, wk: Tensor) -> tuple[Tensor, Tensor]:
    """Normalised cumulative energy of the query-side and key-side spectra of the layer (section 3.1).

    Section 3.1 shows that the heads' concatenated key/query projections are low rank. We take the spectra of
    the query- and key-mode unfoldings of T, i.e. of the concatenated products ``[wq_0 wk_0^T .. ]`` and
    ``[wk_0 wq_0^T .. ]``, rather than of the raw concatenations ``[wq_0 .. ]``: they span the same column
    space, but only the products are invariant to ``wq_i -> wq_i A_i, wk_i -> wk_i A_i^{-T}``, which leaves the
    attention logits unchanged, and ``1 - E(R)`` is exactly the fraction of ``||T||^2`` lost by projecting that
    mode onto its top-R subspace (what ``tucker_decompose`` does). Energy is the squared singular value.

    Returns:
        ``(query_energy, key_energy)``: float64, non-decreasing, length ``min(D, Nh*dh)``, last entry 1 (all
        ones for a zero tensor).
    """
    _check_factors(wq, wk)
    a, b = wq.to(torch.float64), wk.to(torch.float64)

    def cumulative(x: Tensor) -> Tensor:
        e = torch.linalg.svdvals(x).square()[: min(x.shape)]
        total = e.sum()
        return torch.ones_like(e) if total <= 0 else (e.cumsum(0) / total).clamp_max(1.0)

    return cumulative(_unfolding_factor(a, b)), cumulative(_unfolding_factor(b, a))


def rank_for_energy(cumulative_energy: Tensor, threshold: float) -> int:
    """Smallest r with ``cumulative_energy[r - 1] >= threshold`` (1e-12 slack for rounding).

    Args:
        cumulative_energy: 1-D non-decreasing normalised cumulative energy, e.g. from ``energy_spectrum``.
        threshold: Energy fraction in (0, 1].
    """
    fraction(threshold, "threshold")
    if not isinstance(cumulative_energy, Tensor) or cumulative_energy.dim() != 1 or cumulative_energy.numel() == 0:
        raise ValueError("cumulative_energy must be a non-empty 1-D tensor")
    below = int((cumulative_energy.double() < threshold - 1e-12).sum())
    return min(below + 1, cumulative_energy.numel())
