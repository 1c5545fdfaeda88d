"""experiments/blockwise_sequential.py (issue 40): on a one-layer source, refining on the converted model's tokens is
the package's blockwise refinement to the bit (the first layer's tokens are the source's, the same seed and target);
on two layers it runs end to end and writes its rows and table."""
import json

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file

from collab_vit.weights_io import export_safetensors
from test_experiments import run, tiny_fashion_mnist  # noqa: F401  (the fixture)
from test_recipe_holds import sharp_source

pytestmark = pytest.mark.timeout(900)


def two_layer_source(tmp_path) -> str:
    """A random 2-block DeiT at 28 px with large attention and head weights (outputs far from uniform)."""
    kwargs = dict(img_size=28, patch_size=7, in_chans=1, depth=2, embed_dim=16, num_heads=2, num_classes=10)
    torch.manual_seed(0)
    path = str(tmp_path / 'two.safetensors')
    export_safetensors(timm.create_model('deit_tiny_patch16_224', **kwargs).state_dict(), path,
                       'deit_tiny_patch16_224', kwargs,
                       {'data_config': {'input_size': [1, 28, 28], 'mean': [0.286], 'std': [0.353], 'crop_pct': 1.0,
                                        'interpolation': 'bicubic', 'crop_mode': 'center'}})
    weights = load_file(path)
    generator = torch.Generator().manual_seed(0)
    for name in ('blocks.0.attn.qkv.weight', 'blocks.1.attn.qkv.weight', 'head.weight'):
        weights[name] = torch.randn(weights[name].shape, generator=generator)
    from safetensors import safe_open
    with safe_open(path, 'pt') as f:
        metadata = f.metadata()
    save_file(weights, path, metadata)
    return path


def grid(source, name, data, results):
    run('blockwise_sequential.py', '--source', source, '--name', name, '--data-dir', data, '--results', results,
        '--images', '24', '--threads', '1')
    return [json.loads((results / name / f'k{k}.json').read_text()) for k in (2, 1)]


def test_one_layer_is_the_package_and_two_layers_run(tiny_fashion_mnist, tmp_path):  # noqa: F811
    results = tmp_path / 'results'
    for row in grid(sharp_source(tmp_path), 'one', tiny_fashion_mnist, results):
        assert row['steps'] > 0 and row['refined_from'] in row['starts']
        for variant in ('sequential', 'local'):
            assert row[variant]['alone'] == row['blocks']['alone']
            assert row[variant]['held_kl'] == row['blocks']['held_kl']
    rows = grid(two_layer_source(tmp_path), 'two', tiny_fashion_mnist, results)
    assert all(0 <= r[v]['alone']['top1'] <= 100 and r[v]['seconds'] > 0 for r in rows for v in ('sequential', 'local'))
    table = run('blockwise_sequential.py', '--table', '--results', results)
    assert table.count('| one | ') == 2 and table.count('| two | ') == 2
    assert (results / 'table.md').read_text() == table.rstrip('\n') + '\n'
