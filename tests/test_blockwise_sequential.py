"""experiments/blockwise_sequential.py (issue 40): on a one-layer source, refining on the converted model's tokens is
the package's blockwise refinement to the bit (the first layer's tokens are the source's, the same seed and target);
on two layers it runs end to end and writes its rows and table."""
import json

import pytest

from test_experiments import run, tiny_fashion_mnist  # noqa: F401  (the fixture)
from test_recipe_holds import sharp_source

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
