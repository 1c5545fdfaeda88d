"""experiments/blockwise_sequential.py (RESULTS_HISTORY.md, "Blockwise refinement"): on a one-layer source, refining on
the converted model's tokens is the package's blockwise refinement to the bit (the first layer's tokens are the
source's, the same seed and target); on two layers it runs end to end and writes its rows and table."""
import json

import pytest

from test_experiments import run, tiny_fashion_mnist  # noqa: F401  (the fixture)
from test_blockwise_loso import sharp_source

pytestmark = pytest.mark.timeout(900)


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
    rows = grid(sharp_source(tmp_path, depth=2), 'two', tiny_fashion_mnist, results)
    assert all(0 <= r[v]['alone']['top1'] <= 100 and r[v]['seconds'] > 0 for r in rows for v in ('sequential', 'local'))
    table = run('blockwise_sequential.py', '--table', '--results', results)
    assert table.count('| one | ') == 2 and table.count('| two | ') == 2
    assert (results / 'table.md').read_text() == table.rstrip('\n') + '\n'


def test_the_package_refinement_is_the_experiments_local_one():
    """On two layers the package's blockwise refinement (each layer on the tokens the refined layers before it give)
    is the experiment's own ``local`` refinement to the bit (held-out KL and every weight), and differs from the
    refinement on the source's tokens it replaced."""
    import copy
    import os
    import sys

    import timm
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'experiments'))
    import blockwise_sequential as experiment
    from collab_vit.conversion.calibration.recipe import Recipe, RecipeRun
    from collab_vit.conversion.reparam import timm_attention_layers

    torch.manual_seed(0)
    model = timm.create_model('deit_tiny_patch16_224', img_size=32, patch_size=8, depth=2, embed_dim=64, num_heads=4,
                              num_classes=10).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))  # logits that depend on the attention
    run = RecipeRun(model, timm_attention_layers(model), torch.randn(48, 3, 32, 32), Recipe(holdout=16))
    base = run.fit_start('weight', [8] * len(run.layers))
    package = run.blockwise(base, 6)
    weights = [copy.deepcopy(f.layer.state_dict()) for f in package.fits]
    local = experiment.sequential(run, base, 6, compensate=False)
    source_tokens = experiment.on_source_tokens(run, base, 6)
    assert package.held_kl == local.held_kl != source_tokens.held_kl
    for before, fitted in zip(weights, local.fits):
        assert all(torch.equal(v, fitted.layer.state_dict()[k]) for k, v in before.items())
