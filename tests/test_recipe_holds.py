"""experiments/recipe_holds.py (issue 34): its snapshots are the package's recipe to the bit, and its
leave-one-source-out choice never looks at the source it reports."""
import copy
import json
import os
import sys
from statistics import fmean

import pytest
import torch

from test_data_aware_experiment import tiny_source
from test_experiments import ROOT, run, tiny_fashion_mnist  # noqa: F401  (the fixture)

sys.path.insert(0, os.path.join(ROOT, 'experiments'))
import recipe_holds  # noqa: E402
from recipe_holds import Setting, leave_one_out  # noqa: E402

pytestmark = pytest.mark.timeout(900)

GRID = ['--key-dims', '4', '--images', '24', '--holdouts', '6', '--views', 'plain', 'crop:2', '--lrs', '1e-3',
        '--passes', '8', '16']


def test_leave_one_out_never_uses_the_source_it_reports() -> None:
    """Source a alone favours setting x by far; the others favour y: a's figures come from y, and each other
    source's from the setting best on the rest; the default (all sources) is the best mean overall."""
    x, y = Setting(32, 'plain', 1e-3, 80), Setting(32, 'crop', 1e-3, 80)
    table = {('a', 8): {x: 2.0, y: -0.1}, ('b', 8): {x: -0.2, y: 0.3}, ('c', 8): {x: -0.1, y: 0.2}}
    chosen = leave_one_out(table)
    assert chosen['a'] == y and chosen['b'] == x and chosen['c'] == x and chosen['all'] == x
    table[('a', 8)][x] = 0.0  # a no longer favours x: now y everywhere
    assert set(leave_one_out(table).values()) == {y}


def test_replay_refuses_a_guard_that_ranks_the_starts_the_other_way() -> None:
    """A row's refined start is the one its grid ranked first (``ranked_on``: the images as they are since issue 40,
    their views before): a guard scoring the other field replays it only where that field ranks the starts alike."""
    starts = {'weight': {'held': [0.3, 0.3], 'held_views': [0.1, 0.1], 'top1': 80.0},
              'whitened': {'held': [0.2, 0.2], 'held_views': [0.2, 0.2], 'top1': 81.0}}
    snap = {'passes': 8, 'held': [0.1, 0.1], 'held_views': [0.05, 0.05], 'kl_fit': 0.1, 'top1': 82.0}
    new = {'starts': starts, 'snapshots': [snap], 'kl_before': 0.2, 'refined_from': 'whitened', 'ranked_on': 'held'}
    old = {**new, 'refined_from': 'weight'}
    del old['ranked_on']  # rows before issue 40 ranked the starts on their views
    plain, views = Setting(2, 'plain', 1e-3, 8, 1, 0.95), Setting(2, 'plain', 1e-3, 8, 8, 0.95)
    assert recipe_holds.refined_start(new, 'held') == 'whitened' and recipe_holds.replay(new, views) is None
    assert recipe_holds.refined_start(old, 'held_views') == 'weight' and recipe_holds.replay(old, plain) is None
    assert recipe_holds.replay(new, plain) == ('whitened+refine', 82.0)
    assert recipe_holds.replay(old, views) == ('weight+refine', 82.0)


def copy_rows(results, name: str, other: str) -> None:
    """A second source for a leave-one-source-out choice: ``name``'s grid rows under another name."""
    (results / other).mkdir()
    for path in (results / name).glob('*.json'):
        text = path.read_text().replace(f'"source": "{name}"', f'"source": "{other}"')
        (results / other / path.name).write_text(text)


def sharp_source(tmp_path, depth: int = 1) -> str:
    """The experiments' tiny random source (``depth`` blocks) with weights large enough that its outputs are far from
    uniform (the KLs the recipe compares are then well above round-off)."""
    from safetensors.torch import load_file, save_file
    path = tiny_source(tmp_path, depth)
    weights = load_file(str(path))
    generator = torch.Generator().manual_seed(0)
    for name in (*(f'blocks.{b}.attn.qkv.weight' for b in range(depth)), 'head.weight'):
        weights[name] = torch.randn(weights[name].shape, generator=generator)
    from safetensors import safe_open
    with safe_open(str(path), 'pt') as f:
        metadata = f.metadata()
    save_file(weights, str(path), metadata)
    return path


def test_the_grid_replays_the_package_and_chooses(tiny_fashion_mnist, tmp_path):  # noqa: F811
    source, results = sharp_source(tmp_path), tmp_path / 'results'
    run('recipe_holds.py', 'grid', '--source', source, '--name', 'a', '--data-dir', tiny_fashion_mnist,
        '--results', results, *GRID)
    copy_rows(results, 'a', 'b')
    row = json.loads((results / 'a' / 'k4_h6_cropx2_lr0.001.json').read_text())
    assert row['fit'] == 18 and [s['steps'] for s in row['snapshots']] == [3, 5]
    assert len(row['snapshots'][0]['held']) == 6
    out = run('recipe_holds.py', 'choose', '--results', results)
    loso = (results / 'loso.md').read_text()
    main_table = loso.split('## ')[0]
    assert 'Chosen on all sources' in loso and main_table.count('| a | ') == 1 and main_table.count('| b | ') == 1
    assert '## What the guard kept' in loso and '## Each constant alone' in loso
    assert '## Views at equal steps' in out and (results / 'loso.png').stat().st_size > 10_000

    # the snapshot at 16 passes is what the package's recipe (its whole-model refinement pinned) returns with that
    # many steps, to the bit: the guard scores
    # the held-out images as they are ('held'); the per-view score ('held_views') is the grid's own measurement
    from collab_vit.conversion.files import load_source
    from collab_vit.conversion.recipe import Recipe
    from collab_vit.conversion.reparam import convert_model
    from data_aware import test_set, top1

    model, _, _, meta = load_source(None, str(source))
    images = recipe_holds.calibration_images(recipe_holds.calibration_loader(
        'torch/fashion_mnist', str(tiny_fashion_mnist), 'train', 24, model, meta.get('data_config'), 0), (1, 28, 28))
    test = test_set(str(tiny_fashion_mnist), model, meta)
    torch.set_num_threads(1)
    snap = row['snapshots'][1]
    assert row['ranked_on'] == 'held' and len(snap['held_views']) == 6 and snap['held_views'] != snap['held']
    converted = copy.deepcopy(model)
    pinned = ('weight', 'whitened', f"{row['refined_from']}+refine")  # the whole-model refinement the grid measures
    report = convert_model(converted, 4, 'tucker', images, 'default', 0, False,
                           Recipe(holdout=6, views=2, augment='crop', refine_steps=5, candidates=pinned))
    kept = recipe_holds.replay(row, Setting(6, 'crop:2', 1e-3, 16, 1, Recipe().confidence))
    assert report.summary['candidates'] == {name: fmean(entry['held']) for name, entry in
                                            [*row['starts'].items(), (f"{row['refined_from']}+refine", snap)]}
    assert report.summary['chosen'] == kept[0] and top1(converted, *test) == kept[1]
    assert recipe_holds.refined_start(row, 'held') == row['refined_from']  # the grid refined the package's start
