"""experiments/data_aware.py runs end to end on a tiny setting (a random-weight source, 8 calibration images), so
it cannot rot: every per-run JSON, the tables and the plot it promises are written."""
import json

import pytest
import timm
import torch

from collab_vit.weights_io import export_safetensors
from test_experiments import run, tiny_fashion_mnist  # noqa: F401  (the fixture: 200 train / 100 test images)

pytestmark = pytest.mark.timeout(900)


def tiny_source(tmp_path, depth: int = 1) -> str:
    """A random-weight DeiT of ``depth`` blocks at 28 px, exported as the experiments read their sources."""
    kwargs = dict(img_size=28, patch_size=7, in_chans=1, depth=depth, embed_dim=16, num_heads=2, num_classes=10)
    torch.manual_seed(0)
    source = tmp_path / ('source.safetensors' if depth == 1 else f'source_d{depth}.safetensors')
    export_safetensors(timm.create_model('deit_tiny_patch16_224', **kwargs).state_dict(), str(source),
                       'deit_tiny_patch16_224', kwargs,
                       {'data_config': {'input_size': [1, 28, 28], 'mean': [0.286], 'std': [0.353], 'crop_pct': 1.0,
                                        'interpolation': 'bicubic', 'crop_mode': 'center'}})
    return source


def test_data_aware_experiment(tiny_fashion_mnist, tmp_path):  # noqa: F811
    source = tiny_source(tmp_path)
    results = tmp_path / 'results'
    run('data_aware.py', '--source', source, '--data-dir', tiny_fashion_mnist, '--results', results, '--key-dims',
        '4', '--images', '8', '--refine-steps', '2')
    names = ['weight_k4', 'recipe-fast_k4_n8', 'recipe_k4_n8', 'data_k4_n8', 'cut_k4', 'cut-white_k4_n8']
    for name in names:
        row = json.loads((results / f'{name}.json').read_text())
        assert row['key_dims'] == [4] and 0 <= row['top1'] <= 100 and row['output_error'] > 0
    recipe = json.loads((results / 'recipe_k4_n8.json').read_text())['summary']
    assert len(recipe['candidates']) == 3 and recipe['held_out_kl'] <= recipe['weight_only_kl']
    assert recipe['refine_steps'] == 2
    assert (results / 'table.md').read_text().count('| 4 |') == len(names) + 2  # the cells, then two summary rows
    assert (results / 'top1_vs_key_dim.png').stat().st_size > 10_000


def test_class_token_diagnostic(tiny_fashion_mnist, tmp_path):  # noqa: F811
    """experiments/data_aware_class_token.py: per-layer class-token / patch errors and the weighting probe."""
    source = tiny_source(tmp_path)
    out = tmp_path / 'class_token.json'
    run('data_aware_class_token.py', '--source', source, '--data-dir', tiny_fashion_mnist, '--out', out,
        '--weights', '1', '10')
    result = json.loads(out.read_text())
    assert [r['layer'] for r in result['errors_key_dim_4']['data']] == ['blocks.0.attn']
    assert all(r['class_token'] > 0 and r['patches'] > 0 for v in ('weight', 'data')
               for r in result['errors_key_dim_4'][v])
    assert [(r['class_weight'], r['key_dim']) for r in result['class_weight_probe']] == [(1, 8), (1, 4), (10, 8), (10, 4)]
