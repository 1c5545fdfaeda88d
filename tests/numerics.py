"""Tolerances from error analysis, not from one machine.

A float32 result is compared with a float64 reference of the same computation on the same inputs:

    max |got - ref|  <=  k * u * max |ref|,        u = 2^-24 (float32's unit roundoff)

per tensor (each output and each gradient on its own scale). ``k`` is the sum of the reduction lengths along the
chain of products that made the result: a dot product of length n, however the BLAS of a given CPU blocks or orders
it, is within ``gamma_n ~ n u`` of the exact value relative to the sum of its absolute terms (Higham, *Accuracy and
Stability of Numerical Algorithms*, sec. 3.1), and first-order errors of successive steps add. With the tests'
well-scaled random weights the absolute sums are of the order of the largest entry, so the bound holds on any CPU
with a margin (the typical error grows like sqrt(n) u, not n u), while a planted error of 1e-3 relative in one
weight entry, or a dropped bias term, exceeds it (``tests/test_numerics.py`` shows one planted error per kind of
check). Where no float64 reference exists, two float32 paths are each within the bound of the reference, so they are
within twice the bound of each other.
"""
from __future__ import annotations

import os

import torch

U32 = torch.finfo(torch.float32).eps / 2


def unit_roundoff(dtype: torch.dtype) -> float:
    """``eps / 2`` of the format: float32 2^-24, bfloat16 2^-8, float16 2^-11, float64 2^-53."""
    return torch.finfo(dtype).eps / 2


def max_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |got - ref| / max |ref|`` in float64 (0 where both are all zero)."""
    got, ref = got.detach().double(), ref.detach().double()
    diff, scale = (got - ref).abs().max(), ref.abs().max()
    if scale == 0:
        return float("inf") if diff > 0 else 0.0
    return float(diff / scale)


def assert_within(got: torch.Tensor, ref: torch.Tensor, k: float, dtype: torch.dtype = torch.float32,
                  what: str = "") -> None:
    """``max |got - ref| <= k * u(dtype) * max |ref|``, with a message giving the error in units of ``u``."""
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} vs reference {tuple(ref.shape)}"
    u = unit_roundoff(dtype)
    err = max_error(got, ref)
    if os.environ.get("NUMERICS_LOG"):  # margins of every check, for benchmarks/tolerance_margins.md
        with open(os.environ["NUMERICS_LOG"], "a") as log:
            log.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?').split(' ')[0]}\t{what}\t{err / u:.2f}\t{k}\n")
    assert err <= k * u, f"{what}: max error {err / u:.1f} u x max|ref| exceeds the bound {k:g} u"


def assert_all_within(got: list[torch.Tensor], ref: list[torch.Tensor], k: float,
                      dtype: torch.dtype = torch.float32) -> None:
    """``assert_within`` for each pair of a list of results (an output, then its gradients)."""
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert_within(a, b, k, dtype, what=f"result {i}")


def assert_stored_within(got: torch.Tensor, stored: torch.Tensor, k: float, what: str = "") -> None:
    """A float32 result against the same computation stored by another machine (a file in ``tests/data/``): each is
    within ``k u`` of the exact value relative to its scale, whatever CPU and BLAS computed it, so the two are within
    ``2 k u`` of each other. Bit equality holds only on the CPU that wrote the file."""
    assert_within(got, stored, 2 * k, what=what or "against the stored result")


def float64_kwargs(kwargs: dict) -> dict:
    """A layer call's keyword arguments with every floating-point tensor (an additive mask) in float64."""
    return {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kwargs.items()}


def attention_chain(dim: int, key_dim: int, tokens: int, batch: int | None = None) -> int:
    """Reduction lengths of one attention layer: the input projections (``dim``), the logits (``key_dim``), the
    softmax's row sum and weights x values (``tokens``), the output projection (``dim``). With ``batch`` the
    gradients too: the chain once more backwards, plus the weight gradients' sums over ``batch x tokens``."""
    forward = 2 * dim + key_dim + tokens
    return forward if batch is None else 2 * forward + batch * tokens


def vit_chain(dim: int, depth: int, tokens: int, patch_inputs: int, key_dim: int | None = None,
              mlp_ratio: float = 4.0) -> int:
    """Reduction lengths of a ViT forward to its logits: patch embedding (channels x patch^2), per block one
    attention (``attention_chain``) and the MLP (``dim`` then ``mlp_ratio * dim``) and two norms (``dim`` each),
    the final norm and the head (``dim`` each)."""
    block = attention_chain(dim, dim if key_dim is None else key_dim, tokens) + dim + int(mlp_ratio * dim) + 2 * dim
    return patch_inputs + depth * block + 2 * dim
