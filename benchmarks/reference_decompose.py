"""The references the package's Tucker route (``collab_vit.conversion.weights.decompose.tucker_decompose``) is
checked and timed against (section 3.3): CP-ALS on the full factored tensor, and the paper's own procedure (tensorly's
``parafac`` on the dense tensor). Tests and benchmarks only: every conversion of the package runs Tucker (CP measured
slower on DeiT-B, ``benchmarks/reparam.md``).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator
from unittest import mock

import torch
from torch import Tensor

from collab_vit.conversion.weights import fit

from collab_vit.conversion.weights.decompose import (Decomposition, _check_als_args, _check_factors, _check_rank,
                                                     _core, _finalise, _gevd_start, _headwise_start, _mixed_als,
                                                     _pick, _result, _total_normsq, dense_tensor,
                                                     exact_decomposition, relative_error)


def _random_start(wq: Tensor, wk: Tensor, rank: int, seed: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    d = wq.shape[1]
    q = torch.randn(d, rank, generator=gen, dtype=torch.float64)
    k = torch.randn(d, rank, generator=gen, dtype=torch.float64)
    return q.to(wq), k.to(wk)



@torch.no_grad()
def cp_decompose(
    wq: Tensor,
    wk: Tensor,
    rank: int,
    *,
    max_iter: int = 100,
    tol: float = 1e-6,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    init: str = "svd",
) -> Decomposition:
    """Rank-``rank`` CP decomposition of ``T[i] = wq[i] wk[i]^T`` by ALS (section 3.3), never forming T.

    Args:
        wq: Per-head query factors, shape (Nh, D, dh).
        wk: Per-head key factors, same shape.
        rank: Collaborative key/query dim ``D~k``. ``rank >= Nh*dh`` returns ``exact_decomposition``.
        max_iter: Maximum ALS sweeps.
        tol: Stop when the relative change of the relative error between sweeps is below ``tol``.
        seed: Seed of the random start (``init="random"``).
        dtype: Compute dtype; the factors are returned in the dtype of ``wq``. With float64 the sweeps run in
            float32 while the relative error is above 1e-2 (half the cost at the same fit,
            ``benchmarks/decompose_notes.md``) and in float64 below it.
        init: ``"svd"``: the better (after solving for the mixing) of the head-wise start (the ``rank`` largest
            singular triplets over all slices ``T_i``, one-hot mixing) and the GEVD start of the Tucker core,
            which recovers an exact CP of rank <= ``rank``. ``"random"``: Gaussian query/key. The mixing is then
            solved by least squares.

    Returns:
        The decomposition; ``relative_error`` is that of the returned (cast) factors.
    """
    _check_factors(wq, wk)
    _check_rank(rank)
    _check_als_args(max_iter, tol, dtype)
    if init not in ("svd", "random"):
        raise ValueError(f"init must be 'svd' or 'random', got {init!r}")
    nh, _, dh = wq.shape
    if rank >= nh * dh:
        return exact_decomposition(wq, wk, rank)
    a, b = wq.to(dtype), wk.to(dtype)
    normsq = float(_total_normsq(a, b))
    if init == "svd":
        uq, uk, ca, cb, p = _core(a, b, rank)
        starts = [_headwise_start(a, b, rank)]
        gevd = _gevd_start(ca, cb, rank, p)
        if gevd is not None:
            starts.append((uq @ gevd[0], uk @ gevd[1]))
        q0, k0 = _pick(a, b, starts, normsq)
    else:
        q0, k0 = _random_start(a, b, rank, seed)
    query, key, mixing, it, _ = _mixed_als(a, b, q0, k0, max_iter, tol, normsq)
    return _result(wq, wk, query, key, mixing, it, wq.dtype)


@torch.no_grad()
def parafac_decompose(
    wq: Tensor,
    wk: Tensor,
    rank: int,
    *,
    max_iter: int = 100,
    tol: float = 1e-6,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> Decomposition:
    """The paper's own procedure (section 3.3), the reference for ``cp_decompose`` and ``tucker_decompose``.

    Forms the dense tensor ``T[i] = wq[i] wk[i]^T`` (Nh x D x D) and runs tensorly's ``parafac(T, rank,
    init="random", tol=tol, n_iter_max=max_iter, random_state=seed)`` (CP-ALS from a random start) with the pytorch
    backend in ``dtype``. The CP weights tensorly returns are folded into the mixing matrix (the paper's code drops
    them; they are 1 unless tensorly normalises), and the components are scaled and ordered as ``cp_decompose``'s
    (same tensor, balanced factors). Memory and time grow with ``Nh * D^2 * rank``, far beyond
    ``tucker_decompose``'s (timings: ``benchmarks/reparam.md``, ``benchmarks/decompose_notes.md``).
    """
    import tensorly as tl
    from tensorly.decomposition import parafac

    _check_factors(wq, wk)
    _check_rank(rank)
    _check_als_args(max_iter, tol, dtype)
    nh, _, dh = wq.shape
    if rank >= nh * dh:
        return exact_decomposition(wq, wk, rank)
    previous = tl.get_backend()
    tl.set_backend("pytorch")
    try:
        dense = dense_tensor(wq.to(dtype), wk.to(dtype))
        (weights, (mixing, query, key)), errors = parafac(
            dense, rank, init="random", tol=tol, n_iter_max=max_iter, random_state=seed, return_errors=True)
    finally:
        tl.set_backend(previous)
    # tensorly leaves each component's scale spread arbitrarily over its three factors (measured on a trained layer:
    # query entries ~8, mixing ~6e-4), which the layer computes the same but AdamW fine-tunes badly (an update of
    # ~lr per step is huge next to 6e-4): rescale as cp/tucker do. The tensor, and so the layer, are unchanged.
    query, key, mixing = _finalise(query, key, mixing * weights)
    out = wq.dtype
    query, key, mixing = query.to(out), key.to(out), mixing.to(out)
    return Decomposition(query, key, mixing, relative_error(wq, wk, query, key, mixing), len(errors))


REFERENCES = {"cp": cp_decompose, "parafac": parafac_decompose}


@contextmanager
def decomposed_by(method: str) -> Iterator[None]:
    """Every conversion in this block (in this process) decomposes by ``method``: "tucker" (the package's), "cp" or
    "parafac" in its place (``fit.tucker_decompose`` patched)."""
    if method == "tucker":
        yield
        return
    with mock.patch.object(fit, "tucker_decompose", REFERENCES[method]):
        yield
