"""Tests for collab_vit.conversion.files.spectrum: the section 3.1 redundancy spectrum on tiny timm ViTs
(D = 48, Nh = 3, dh = 16)."""

from __future__ import annotations

import pytest

from collab_vit.conversion.reparam import timm_attention_layers
import timm
import torch
from torch import nn

import collab_vit  # noqa: F401  (registers collab_deit_* with timm)
from collab_vit.conversion.files import spectrum as analysis
from numerics import assert_within

D, NH = 48, 3
DH = D // NH
RANKS = (5, 9)  # planted rank of the concatenated query projections, per block


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_vit() -> nn.Module:
    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=len(RANKS), embed_dim=D,
                             num_heads=NH)


@pytest.fixture(scope="module")
def planted() -> nn.Module:
    """Block b: query rows of head i are ``(U_b A_i)^T`` with U_b of rank RANKS[b]; keys are full rank."""
    model = tiny_vit()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for block, r in zip(model.blocks, RANKS):
            basis = torch.linalg.qr(torch.randn(D, r, generator=g, dtype=torch.float64)).Q
            heads = [basis @ torch.randn(r, DH, generator=g, dtype=torch.float64) for _ in range(NH)]
            w = block.attn.qkv.weight
            w[:D] = torch.cat([h.T for h in heads]).to(w.dtype)
            w[D:] = torch.randn(2 * D, D, generator=g, dtype=torch.float64).to(w.dtype) / D**0.5
    return model


def dense_cumulative_energy(qkv_weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Straight from the definition: SVD of the concatenation over heads of Wq_i Wk_i^T (D x Nh*D)."""
    w = qkv_weight.detach().double()
    d = w.shape[1]
    dh = d // num_heads
    t = torch.cat([w[i * dh:(i + 1) * dh].T @ w[d + i * dh:d + (i + 1) * dh] for i in range(num_heads)], dim=1)
    e = torch.linalg.svd(t).S.square()
    return e.cumsum(0) / e.sum()


def test_attention_layers_names(planted):
    names = [name for name, _ in timm_attention_layers(planted)]
    assert names == [f"blocks.{b}.attn" for b in range(len(RANKS))]


def test_planted_rank(planted):
    spectra = analysis.layer_spectra(planted)
    assert [s.name for s in spectra] == ["blocks.0.attn", "blocks.1.attn"]
    for s, r in zip(spectra, RANKS):
        e = s.cumulative_energy
        assert e.dtype == torch.float64 and e.dim() == 1 and e.numel() == min(D, NH * DH) == s.total_dims
        assert bool((e[1:] >= e[:-1]).all())
        assert float(e[-1]) == pytest.approx(1.0, abs=1e-15)
        assert float(e[r - 1]) == pytest.approx(1.0, abs=1e-12)  # all the energy is in r dims
        assert float(e[r - 2]) < 0.999  # and not in fewer
        assert s.dims_needed[0.99] == r
        assert s.dims_needed[0.90] <= s.dims_needed[0.95] <= s.dims_needed[0.99]


def test_spectrum_matches_dense_svd(planted):
    random_model = tiny_vit()  # timm's init, full rank
    double_model = tiny_vit().double()
    with torch.no_grad():  # float64 weights that a float32 round trip would change by ~1e-8
        for block in double_model.blocks:
            block.attn.qkv.weight.copy_(torch.randn(3 * D, D, generator=torch.Generator().manual_seed(1),
                                                    dtype=torch.float64))
    for model in (planted, random_model, double_model):
        spectra = analysis.layer_spectra(model)
        for s, (_, attn) in zip(spectra, timm_attention_layers(model), strict=True):
            ref = dense_cumulative_energy(attn.qkv.weight, attn.num_heads)[: s.total_dims]
            # cumulative energies (max 1) from two float64 SVDs, each backward stable: singular values within
            # ~D u of the largest, squaring doubles that, the running sum over at most D dims adds D u
            assert_within(s.cumulative_energy, ref, 4 * D, torch.float64)


def test_query_side_not_key_side(planted):
    """The keys are full rank: the key-side spectrum would need far more dims than the planted query rank."""
    from collab_vit.conversion.weights.decompose import energy_spectrum, rank_for_energy, split_qkv_heads

    s = analysis.layer_spectra(planted)[0]
    _, key_energy = energy_spectrum(*split_qkv_heads(planted.blocks[0].attn.qkv.weight.double(), NH))
    assert rank_for_energy(key_energy, 0.99) > 2 * RANKS[0] >= s.dims_needed[0.99]


def test_layer_spectra_leaves_model_unchanged(planted):
    before = {k: v.clone() for k, v in planted.state_dict().items()}
    analysis.layer_spectra(planted)
    after = planted.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())


def spectrum(name: str, dims: tuple[int, int, int], total: int = 10) -> analysis.LayerSpectrum:
    return analysis.LayerSpectrum(name, torch.linspace(0.1, 1.0, total, dtype=torch.float64),
                                  dict(zip(analysis.THRESHOLDS, dims)))


def test_suggest_key_dim():
    spectra = [spectrum("a", (3, 4, 7)), spectrum("b", (5, 6, 6)), spectrum("c", (1, 2, 3))]
    assert analysis.suggest_key_dim(spectra) == 6
    assert analysis.suggest_key_dim(spectra, 0.90) == 5
    assert analysis.suggest_key_dim(spectra, 0.99) == 7
    assert analysis.suggest_key_dim(spectra, 0.99, multiple_of=4) == 8
    assert analysis.suggest_key_dim(spectra, 0.95, multiple_of=3) == 6
    assert analysis.suggest_key_dim(spectra, 0.95, multiple_of=5) == 10
    # thresholds not stored in dims_needed come from the energy itself: linspace(0.1, 1, 10)[r-1] = r / 10
    assert analysis.suggest_key_dim(spectra, 0.5) == 5
    assert analysis.suggest_key_dim(spectra, 1.0) == 10


@pytest.mark.parametrize("threshold", [0.0, -0.1, 1.0001, 2, float("nan"), True, "0.9"])
def test_suggest_key_dim_rejects_bad_threshold(threshold):
    with pytest.raises(ValueError, match="threshold"):
        analysis.suggest_key_dim([spectrum("a", (3, 4, 7))], threshold)


@pytest.mark.parametrize("multiple_of", [0, -8, 2.0, True])
def test_suggest_key_dim_rejects_bad_multiple(multiple_of):
    with pytest.raises(ValueError, match="multiple_of"):
        analysis.suggest_key_dim([spectrum("a", (3, 4, 7))], 0.9, multiple_of)


def test_no_attention_raises():
    with pytest.raises(ValueError, match="Linear"):
        timm_attention_layers(nn.Linear(4, 4))
    collab = timm.create_model("collab_deit_tiny_patch16_224", img_size=32, patch_size=8, depth=1)
    with pytest.raises(ValueError, match="already collaborative"):
        analysis.layer_spectra(collab)


def test_subclass_of_attention_keeping_its_forward_is_read_one_with_its_own_refused():
    class Custom(timm.layers.Attention):
        pass

    class OwnForward(timm.layers.Attention):
        def forward(self, x, attn_mask=None):
            return super().forward(x, attn_mask) * 2

    model = nn.Sequential(Custom(D, NH), timm.layers.Attention(D, NH))
    assert [name for name, _ in timm_attention_layers(model)] == ["0", "1"]
    with pytest.raises(ValueError, match="its own forward"):
        timm_attention_layers(nn.Sequential(OwnForward(D, NH), timm.layers.Attention(D, NH)))


def test_format_spectrum_table():
    table = analysis.format_spectrum_table([spectrum("blocks.0.attn", (3, 4, 7)), spectrum("blocks.1.attn", (5, 6, 6))])
    lines = table.strip().splitlines()
    assert lines[0] == "| layer | dims for 90 % | dims for 95 % | dims for 99 % | total dims |"
    assert lines[2] == "| blocks.0.attn | 3 | 4 | 7 | 10 |"
    assert lines[3] == "| blocks.1.attn | 5 | 6 | 6 | 10 |"
    assert len(lines) == 4


@pytest.mark.parametrize("depth", [2, 6])  # legend (few layers) and colorbar (many)
def test_plot_spectra_writes_png(tmp_path, depth):
    spectra = [spectrum(f"blocks.{i}.attn", (i + 1, i + 2, i + 3)) for i in range(depth)]
    out = tmp_path / "sub" / "spectrum.png"
    assert analysis.plot_spectra(spectra, out, title="tiny") == out
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000
    assert [p.name for p in out.parent.iterdir()] == ["spectrum.png"]


def test_plot_spectra_failure_leaves_no_temp_file(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    def boom(self, *args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(Figure, "savefig", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        analysis.plot_spectra([spectrum("a", (3, 4, 7))], tmp_path / "x.png")
    assert list(tmp_path.iterdir()) == []
