"""Tests for collab_vit.conversion.weights.decompose (small sizes: Nh=4, D=32, dh=8)."""

from __future__ import annotations

import pytest
import tensorly as tl
import torch
from tensorly.decomposition import parafac

from collab_vit.conversion.weights import decompose as dec
import reference_decompose as reference
from numerics import assert_within

NH, D, DH = 4, 32, 8
N = NH * DH


pytestmark = pytest.mark.usefixtures("one_thread")


def reconstruct(res: dec.Decomposition) -> torch.Tensor:
    return torch.einsum("dr,ir,er->ide", res.query, res.mixing, res.key)


def dense_rel_err(wq, wk, query, key, mixing) -> float:
    t = dec.dense_tensor(wq.double(), wk.double())
    approx = torch.einsum("dr,ir,er->ide", query.double(), mixing.double(), key.double())
    return float((t - approx).norm() / t.norm())


def random_factors(seed=0, nh=NH, d=D, dh=DH, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(nh, d, dh, generator=g, dtype=dtype), torch.randn(nh, d, dh, generator=g, dtype=dtype)


def planted_cp(r: int, seed: int = 0):
    """Per-head factors of an exact, identifiable rank-r CP tensor (r <= dh, dense mixing)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(D, r, generator=g, dtype=torch.float64)
    k = torch.randn(D, r, generator=g, dtype=torch.float64)
    wq, wk = torch.zeros(NH, D, DH, dtype=torch.float64), torch.zeros(NH, D, DH, dtype=torch.float64)
    for i in range(NH):
        m = torch.randn(r, generator=g, dtype=torch.float64)
        p = torch.randn(r, DH, generator=g, dtype=torch.float64)  # full row rank: p @ pinv(p) = I
        wq[i] = q * m @ p
        wk[i] = k @ torch.linalg.pinv(p).T
    return wq, wk


def structured(seed=0, noise=1e-3):
    """Heads sharing a decaying query/key basis, plus noise."""
    g = torch.Generator().manual_seed(seed)
    spectrum = torch.exp(-torch.arange(D, dtype=torch.float64) / 6)

    def side():
        basis, _ = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))
        w = (basis * spectrum) @ torch.randn(NH, D, DH, generator=g, dtype=torch.float64)
        return w + noise * torch.randn(NH, D, DH, generator=g, dtype=torch.float64)

    return side(), side()


METHODS = [reference.cp_decompose, dec.tucker_decompose]


def test_split_qkv_heads_matches_timm_layout():
    w = torch.randn(3 * D, D)
    wq, wk = dec.split_qkv_heads(w, NH)
    assert wq.shape == wk.shape == (NH, D, DH)
    for i in range(NH):
        assert torch.equal(wq[i], w[i * DH : (i + 1) * DH].T)
        assert torch.equal(wk[i], w[D + i * DH : D + (i + 1) * DH].T)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("rank", [N, N + 5])
def test_exact_at_full_rank(method, rank):
    wq, wk = random_factors()
    res = method(wq, wk, rank)
    assert res.query.shape == (D, rank) and res.key.shape == (D, rank) and res.mixing.shape == (NH, rank)
    assert res.relative_error < 1e-10 and res.iterations == 0
    # float64, one sum of ``rank`` products per entry (and the dense tensor's own sum of N)
    assert_within(reconstruct(res), dec.dense_tensor(wq, wk), rank + N, torch.float64)
    assert dense_rel_err(wq, wk, res.query, res.key, res.mixing) < 1e-13


def test_exact_decomposition_is_concatenation():
    wq, wk = random_factors()
    res = dec.exact_decomposition(wq, wk, N + 3)
    torch.testing.assert_close(res.query[:, :N], torch.cat(list(wq), 1), rtol=0, atol=0)
    assert not res.query[:, N:].any() and not res.key[:, N:].any() and not res.mixing[:, N:].any()
    assert torch.equal(res.mixing[:, :N], torch.eye(NH, dtype=wq.dtype).repeat_interleave(DH, 1))
    with pytest.raises(ValueError, match="rank"):
        dec.exact_decomposition(wq, wk, N - 1)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("rank", [DH, DH + 1, DH + 4, 2 * DH, N - 1])
def test_planted_cp_recovered(method, rank):
    """A planted rank-r CP is recovered to ~eps at every key_dim >= r (key_dim >= Nh*dh is exact by construction)."""
    wq, wk = planted_cp(DH)
    res = method(wq, wk, rank, max_iter=1000, tol=1e-10)
    assert res.relative_error < 1e-8 and res.iterations <= 1000
    assert dense_rel_err(wq, wk, res.query, res.key, res.mixing) < 1e-8


@pytest.mark.parametrize("method", METHODS)
def test_error_decreases_with_rank(method):
    wq, wk = structured()
    errors = [method(wq, wk, r).relative_error for r in (2, 4, 8, 12, 16, 24, N)]
    assert all(b <= a for a, b in zip(errors, errors[1:])), errors
    assert errors[0] > 0.05 and errors[-1] < 1e-10


@pytest.mark.parametrize("seed", [0, 2])
def test_tucker_close_to_cp_where_subspaces_bind(seed):
    """Few heads, R near Nh*dh: the Tucker subspaces alone leave tucker 0.015-0.025 behind cp here."""
    wq, wk = random_factors(seed=seed, nh=2, d=64, dh=8)
    assert dec.tucker_decompose(wq, wk, 12).relative_error <= reference.cp_decompose(wq, wk, 12).relative_error + 5e-3


@pytest.mark.parametrize("scale", [1.0, 1e-7, 1e-11])
def test_relative_error_matches_dense(scale):
    wq, wk = random_factors()
    exact = dec.exact_decomposition(wq, wk, N)
    g = torch.Generator().manual_seed(1)
    q = exact.query + scale * torch.randn(D, N, generator=g, dtype=torch.float64)
    k = exact.key + scale * torch.randn(D, N, generator=g, dtype=torch.float64)
    m = exact.mixing + scale * torch.randn(NH, N, generator=g, dtype=torch.float64)
    ours, dense = dec.relative_error(wq, wk, q, k, m), dense_rel_err(wq, wk, q, k, m)
    assert ours == pytest.approx(dense, rel=1e-6)


def test_reconstruction_agrees_with_tensorly():
    wq, wk = structured()
    res = reference.cp_decompose(wq, wk, 10)
    tl.set_backend("pytorch")
    ones = torch.ones(10, dtype=torch.float64)
    ref = tl.cp_to_tensor((ones, [res.mixing, res.query, res.key]))
    assert_within(reconstruct(res), ref, 2 * 10, torch.float64)  # two orders of the same 10-term sums
    t = dec.dense_tensor(wq, wk)
    assert float((t - ref).norm() / t.norm()) == pytest.approx(res.relative_error, rel=1e-9)


def test_cp_no_worse_than_tensorly_parafac():
    wq, wk = random_factors(seed=3, d=16, dh=4)
    rank = 8
    tl.set_backend("pytorch")
    t = dec.dense_tensor(wq, wk)
    weights, (m, q, k) = parafac(t, rank, init="random", tol=1e-6, random_state=0)
    ref = dec.relative_error(wq, wk, q * weights, k, m)
    assert ref == pytest.approx(float((t - tl.cp_to_tensor((weights, [m, q, k]))).norm() / t.norm()), rel=1e-9)
    ours = reference.cp_decompose(wq, wk, rank).relative_error
    assert ours <= ref + 0.01, (ours, ref)


@pytest.mark.parametrize("method", METHODS)
def test_deterministic(method):
    wq, wk = structured()
    seed = {"seed": 5} if method is reference.cp_decompose else {}  # tucker is deterministic: no seed
    a, b = method(wq, wk, 10, **seed), method(wq, wk, 10, **seed)
    for x, y in [(a.query, b.query), (a.key, b.key), (a.mixing, b.mixing)]:
        assert torch.equal(x, y)
    assert a.relative_error == b.relative_error and a.iterations == b.iterations


def test_random_init_seeded():
    wq, wk = structured()
    a = reference.cp_decompose(wq, wk, 10, init="random", seed=1, max_iter=5)
    b = reference.cp_decompose(wq, wk, 10, init="random", seed=1, max_iter=5)
    c = reference.cp_decompose(wq, wk, 10, init="random", seed=2, max_iter=5)
    assert torch.equal(a.query, b.query) and torch.equal(a.mixing, b.mixing)
    assert not torch.equal(a.query, c.query)


@pytest.mark.parametrize("method", METHODS + [dec.exact_decomposition])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float64])
def test_output_dtype_follows_input(method, in_dtype):
    wq, wk = structured()
    wq, wk = wq.to(in_dtype), wk.to(in_dtype)
    res = method(wq, wk, N if method is dec.exact_decomposition else 12)
    assert res.query.dtype == res.key.dtype == res.mixing.dtype == in_dtype
    assert res.relative_error == pytest.approx(dense_rel_err(wq, wk, res.query, res.key, res.mixing), rel=1e-6)


def test_float32_compute_is_close_to_float64():
    wq, wk = structured()
    e64 = reference.cp_decompose(wq, wk, 12).relative_error
    e32 = reference.cp_decompose(wq, wk, 12, dtype=torch.float32).relative_error
    # relative errors (dimensionless, ~0.3 here) of two ALS runs that each stop at the same tolerance: the float32
    # run's rounding (u = 6e-8 per step, amplified by the conditioning of the ALS solves) moves where it stops
    assert abs(e32 - e64) < 1e-3


def test_zero_iterations_returns_start():
    wq, wk = structured()
    res = reference.cp_decompose(wq, wk, 12, max_iter=0)
    assert res.iterations == 0 and res.relative_error < 1


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda wq, wk: reference.cp_decompose(wq, wk, 0), "rank"),
        (lambda wq, wk: reference.cp_decompose(wq, wk, 2.0), "rank"),
        (lambda wq, wk: dec.tucker_decompose(wq, wk, -3), "rank"),
        (lambda wq, wk: reference.cp_decompose(wq, wk, True), "rank"),
        (lambda wq, wk: reference.cp_decompose(wq[0], wk[0], 4), "wq"),
        (lambda wq, wk: reference.cp_decompose(wq, wk[:, :, :4], 4), "wk"),
        (lambda wq, wk: dec.tucker_decompose(wq, wk[:2], 4), "wk"),
        (lambda wq, wk: reference.cp_decompose(wq, wk, 4, tol=0), "tol"),
        (lambda wq, wk: dec.tucker_decompose(wq, wk, 4, tol=-1e-3), "tol"),
        (lambda wq, wk: reference.cp_decompose(wq, wk, 4, max_iter=-1), "max_iter"),
        (lambda wq, wk: dec.tucker_decompose(wq, wk, 4, max_iter=1.5), "max_iter"),
        (lambda wq, wk: reference.cp_decompose(wq, wk, 4, init="hosvd"), "init"),
        (lambda wq, wk: reference.cp_decompose(wq, wk, 4, dtype=torch.int64), "dtype"),
        (lambda wq, wk: dec.relative_error(wq, wk, torch.zeros(D, 3), torch.zeros(D, 3), torch.zeros(NH, 4)), "mixing"),
        (
            lambda wq, wk: dec.relative_error(wq, wk, torch.zeros(D, 3), torch.zeros(D + 1, 3), torch.zeros(NH, 3)),
            "key",
        ),
        (lambda wq, wk: dec.split_qkv_heads(torch.zeros(3 * D, D), 5), "num_heads"),
        (lambda wq, wk: dec.split_qkv_heads(torch.zeros(2 * D, D), 4), "qkv_weight"),
        (lambda wq, wk: dec.rank_for_energy(torch.ones(3), 0.0), "threshold"),
        (lambda wq, wk: dec.rank_for_energy(torch.ones(3), 1.5), "threshold"),
        (lambda wq, wk: dec.rank_for_energy(torch.ones(3), float("nan")), "threshold"),
    ],
)
def test_bad_arguments(call, name):
    wq, wk = random_factors()
    with pytest.raises(ValueError, match=name):
        call(wq, wk)


def test_energy_spectrum_and_rank():
    wq, wk = planted_cp(DH)
    eq, ek = dec.energy_spectrum(wq, wk)
    assert eq.shape == ek.shape == (min(D, N),)
    assert torch.all(eq[1:] >= eq[:-1]) and eq[-1] == pytest.approx(1.0)
    assert dec.rank_for_energy(eq, 1.0) == DH and dec.rank_for_energy(ek, 1.0) == DH
    # 1 - E(r) is the energy lost by projecting the query mode on its top-r subspace
    wq, wk = structured()
    eq, _ = dec.energy_spectrum(wq, wk)
    t = dec.dense_tensor(wq, wk)
    u = torch.linalg.svd(torch.cat(list(t), 1))[0][:, :5]
    lost = float((t - u @ u.T @ t).norm() ** 2 / t.norm() ** 2)
    assert 1 - float(eq[4]) == pytest.approx(lost, rel=1e-9)
    r = dec.rank_for_energy(eq, 0.9)
    assert eq[r - 1] >= 0.9 and (r == 1 or eq[r - 2] < 0.9)
    assert dec.rank_for_energy(torch.tensor([0.5, 0.8, 1.0]), 0.8) == 2


def test_parafac_is_tensorly_parafac_on_the_dense_tensor():
    """method="parafac" is the paper's procedure: tensorly's parafac on the dense tensor, random init, seeded."""
    wq, wk = structured()
    rank = 10
    tl.set_backend("numpy")
    res = reference.parafac_decompose(wq, wk, rank, seed=3, max_iter=50, tol=1e-8)
    assert tl.get_backend() == "numpy"  # the caller's backend is restored
    tl.set_backend("pytorch")
    weights, (m, q, k) = parafac(dec.dense_tensor(wq, wk), rank, init="random", tol=1e-8, n_iter_max=50,
                                 random_state=3)
    # the same rank-10 sums, ours after rescaling each component (a few multiplications per term)
    assert_within(reconstruct(res), tl.cp_to_tensor((weights, [m, q, k])), 4 * rank, torch.float64)
    # the same tensor, with balanced factors: every component's query and key columns have equal norms, its
    # largest mixing entry is +1 (tensorly's own scaling is arbitrary and fine-tunes badly)
    assert_within(res.query.norm(dim=0), res.key.norm(dim=0), 2 * D, torch.float64)  # norms: sums of D squares
    assert torch.all(res.mixing.max(0).values == 1)
    t = dec.dense_tensor(wq, wk)
    assert res.relative_error == pytest.approx(float((t - reconstruct(res)).norm() / t.norm()), rel=1e-9)
    assert 0 < res.iterations <= 50


def test_parafac_exact_at_full_rank_and_no_better_than_ours():
    wq, wk = structured()
    assert reference.parafac_decompose(wq, wk, NH * DH).relative_error < 1e-12
    ours = dec.tucker_decompose(wq, wk, 6).relative_error
    ref = reference.parafac_decompose(wq, wk, 6).relative_error
    assert ours <= ref + 1e-3, (ours, ref)
