"""Calibration statistics for data-aware re-parametrisation (docs/math.md, "Data-aware conversion").

The logits of head i on the tokens of one image are ``x_n T_i x_m^T`` (section 3.3, plus the exact content bias).
Their squared error under ``T_i -> T~_i``, summed over images, with the key side centred within each image (softmax
ignores what is constant along a row), is approximated by ``tr(E_i^T S E_i C)`` with ``S`` the uncentred second
moment of the tokens (query side) and ``C`` their within-image centred covariance (key side), pooled over images.
With ``S + lam I = Lq Lq^T`` and ``C + lam' I = Lk Lk^T`` that is ``||Lq^T E_i Lk||_F^2``: the weight-only
decomposition of the whitened factors ``(Lq^T Wq_i, Lk^T Wk_i)``, mapped back by ``Lq^{-T}``, ``Lk^{-T}``.

:class:`TokenMoments` streams both D x D moments batch by batch (float64 accumulators); :func:`whitener` adds the
ridge.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor

from ...checks import positive_real
from .decompose import Decomposition, canonical_form, energy_spectrum, relative_error

__all__ = ["DEFAULT_RIDGE", "TokenMoments", "Whitening", "whitener", "whitening", "whitened_decomposition",
           "whitened_spectrum"]

# Ridge added to each moment, relative to its mean eigenvalue (trace / D). It makes every moment invertible (fewer
# tokens than D, constant features, fp16 weights), and it bounds how far a direction the calibration tokens never
# visit may be neglected: it is weighted as if it held 1 % of an average direction's energy.
DEFAULT_RIDGE = 1e-2


class TokenMoments:
    """Streamed D x D moments of the tokens one attention layer sees (docs/math.md, "Data-aware conversion").

    ``query``: ``sum_t x_t x_t^T`` over every token of every image (uncentred: the query side of the logits).
    ``key``: ``sum_b sum_m (x_m - mean_b)(x_m - mean_b)^T`` with ``mean_b`` the mean token of image b (the key side:
    softmax ignores terms constant along a row). ``prefix``: ``query``'s part from the first ``prefix_tokens`` tokens
    of every image (class token, registers), for ``weighted_query``. Each batch is multiplied in its own dtype (at least float32) and
    added to float64 accumulators, so float64 tokens give float64 moments whatever the batch sizes.
    """

    def __init__(self, dim: int, prefix_tokens: int = 0) -> None:
        self.dim = dim
        self.prefix_tokens = prefix_tokens  # the first tokens of every image (class, registers): ``prefix`` below
        self.query = torch.zeros(dim, dim, dtype=torch.float64)
        self.prefix = torch.zeros(dim, dim, dtype=torch.float64)
        self.key = torch.zeros(dim, dim, dtype=torch.float64)
        self.tokens = 0
        self.images = 0

    @classmethod
    def of(cls, tokens: Tensor) -> "TokenMoments":
        """The moments of one (B, N, D) token tensor."""
        check_tokens(tokens)
        moments = cls(tokens.shape[-1])
        moments.update(tokens)
        return moments

    def weighted_query(self, prefix_weight: float = 1.0) -> Tensor:
        """``query`` with the prefix tokens' rows counted ``prefix_weight`` times (docs/math.md, query weights)."""
        weight = positive_real(prefix_weight, "prefix_weight")
        return self.query if weight == 1.0 else self.query + (weight - 1.0) * self.prefix

    @torch.no_grad()
    def update(self, tokens: Tensor) -> None:
        """Add a (B, N, D) batch of tokens (B images of N tokens)."""
        check_tokens(tokens, self.dim)
        x = tokens.detach()
        if x.dtype not in (torch.float32, torch.float64):
            x = x.float()
        flat = x.reshape(-1, self.dim)
        centred = (x - x.mean(dim=1, keepdim=True)).reshape(-1, self.dim)
        self.query += (flat.T @ flat).to(device="cpu", dtype=torch.float64)
        if self.prefix_tokens:
            prefix = x[:, :self.prefix_tokens].reshape(-1, self.dim)
            self.prefix += (prefix.T @ prefix).to(device="cpu", dtype=torch.float64)
        self.key += (centred.T @ centred).to(device="cpu", dtype=torch.float64)
        self.tokens += flat.shape[0]
        self.images += x.shape[0]


def prefix_weight_for(weight: Union[float, str], prefix_tokens: int, patches: Optional[int]) -> float:
    """``"balanced"``: the prefix tokens' queries weigh as much as all the patch tokens' (``patches / prefix``)."""
    if weight != "balanced":
        return positive_real(weight, "prefix_weight", " or 'balanced'")
    if patches is None:
        raise ValueError("prefix_weight='balanced' needs a ViT with patch_embed.num_patches; give a number")
    return patches / prefix_tokens if prefix_tokens else 1.0


def check_tokens(tokens: object, dim: Optional[int] = None) -> None:
    """A (B, N, D) floating tensor of finite tokens, else a one-line ``ValueError``."""
    if not isinstance(tokens, Tensor) or tokens.dim() != 3 or not tokens.is_floating_point():
        raise ValueError(f"calibration tokens must be a floating (B, N, D) tensor, got "
                         f"{getattr(tokens, 'shape', type(tokens).__name__)}")
    if dim is not None and tokens.shape[-1] != dim:
        raise ValueError(f"calibration tokens have D={tokens.shape[-1]}, the layer has D={dim}")
    if tokens.shape[0] == 0 or tokens.shape[1] == 0:
        raise ValueError(f"calibration tokens are empty: shape {tuple(tokens.shape)}")
    if not bool(torch.isfinite(tokens).all()):
        raise ValueError("calibration tokens contain NaN or infinite values")


@dataclass
class Whitening:
    """``root @ root.T = moment / count + lam I`` and ``inverse_t = root^{-T}``, both (D, D) float64."""

    root: Tensor
    inverse_t: Tensor
    ridge: float  # lam, absolute


def whitener(moment: Tensor, count: int, ridge: float = DEFAULT_RIDGE) -> Whitening:
    """Symmetric square root of ``moment / count + lam I`` with ``lam = ridge * trace / D`` (1 for a zero moment).

    ``eigh`` gives ``V diag(e) V^T``; the eigenvalues are clamped at ``lam`` (their exact lower bound) against
    round-off, so ``root = V diag(sqrt e)`` and ``root^{-T} = V diag(1 / sqrt e)`` are finite for any finite moment.
    """
    positive_real(ridge, "ridge")
    s = moment.to(torch.float64) / max(count, 1)
    s = (s + s.T) / 2
    d = s.shape[0]
    mean_eig = float(s.diagonal().sum()) / d
    lam = ridge * mean_eig if mean_eig > 0 else 1.0
    e, v = torch.linalg.eigh(s + lam * torch.eye(d, dtype=torch.float64))
    root = e.clamp_min(lam).sqrt()
    return Whitening(v * root, v / root, lam)


def whitening(moments: TokenMoments, ridge: float = DEFAULT_RIDGE, prefix_weight: float = 1.0
              ) -> tuple[Whitening, Whitening]:
    """(query side, key side) whitenings of one layer's moments (query side with the prefix tokens weighted)."""
    if moments.tokens == 0:
        raise ValueError("no calibration tokens were seen")
    return (whitener(moments.weighted_query(prefix_weight), moments.tokens, ridge),
            whitener(moments.key, moments.tokens, ridge))


def _whitened_factors(wq: Tensor, wk: Tensor, sides: tuple[Whitening, Whitening]) -> tuple[Tensor, Tensor]:
    """``(Lq^T wq_i, Lk^T wk_i)``: the per-head factors of ``Lq^T T_i Lk`` (float64)."""
    wq, wk = wq.to(torch.float64), wk.to(torch.float64)
    return sides[0].root.T @ wq, sides[1].root.T @ wk


def whitened_spectrum(wq: Tensor, wk: Tensor, sides: tuple[Whitening, Whitening]) -> Tensor:
    """Normalised cumulative query-side energy of the whitened tensor ``Lq^T T_i Lk`` (the logits on the tokens)."""
    return energy_spectrum(*_whitened_factors(wq, wk, sides))[0]


def whitened_decomposition(wq: Tensor, wk: Tensor, rank: int, sides: tuple[Whitening, Whitening], decompose,
                           **options) -> tuple[Decomposition, float]:
    """``decompose`` run on the whitened factors, mapped back; and the relative error in the whitened space.

    The returned ``Decomposition`` is in weight space (``relative_error`` is ``||T - T~|| / ||T||``, float64) and in
    the canonical form of ``decompose.canonical_form`` (balanced query/key columns): mapping back changes no logit.
    The second value is ``||Lq^T (T - T~) Lk|| / ||Lq^T T Lk||``, the pooled relative logit error (ridge included).
    """
    a, b = _whitened_factors(wq, wk, sides)
    fit = decompose(a, b, rank, **options)
    query = sides[0].inverse_t @ fit.query.to(torch.float64)
    key = sides[1].inverse_t @ fit.key.to(torch.float64)
    query, key, mixing = canonical_form(query, key, fit.mixing.to(torch.float64))
    out = wq.dtype
    query, key, mixing = query.to(out), key.to(out), mixing.to(out)
    return Decomposition(query, key, mixing, relative_error(wq, wk, query, key, mixing), fit.iterations), \
        fit.relative_error
