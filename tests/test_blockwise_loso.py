"""experiments/blockwise_loso.py (RESULTS.md, "The constants"): its snapshots are the package's default recipe to the
bit, its replay of the guard keeps what the package keeps, and its leave-one-source-out choice never looks at the source
it reports."""
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
import blockwise_loso  # noqa: E402
from blockwise_loso import Setting, leave_one_out  # noqa: E402

pytestmark = pytest.mark.timeout(900)


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


def test_leave_one_out_never_uses_the_source_it_reports() -> None:
    """Source a alone favours setting x by far; the others favour y: a's figures come from y, the others' from x."""
    x, y = Setting(1e-3, 16), Setting(3e-3, 8)
    table = {('a', 4): {x: 2.0, y: -0.1}, ('b', 4): {x: -0.2, y: 0.3}, ('c', 4): {x: -0.1, y: 0.2}}
    chosen = leave_one_out(table)
    assert chosen['a'] == y and chosen['b'] == x and chosen['c'] == x and chosen['all'] == x
    table[('a', 4)][x] = 0.0
    assert set(leave_one_out(table).values()) == {y}


def test_the_grid_replays_the_package_and_chooses(tiny_fashion_mnist, tmp_path):  # noqa: F811
    source, results = sharp_source(tmp_path), tmp_path / 'results'
    run('blockwise_loso.py', 'grid', '--source', source, '--name', 'a', '--data-dir', tiny_fashion_mnist,
        '--results', results, '--images', '24', '--lrs', '1e-3', '--passes', '4', '8', '16', '--threads', '1',
        '--holdouts', '6', '2')
    copy_rows(results, 'a', 'b')
    row = json.loads((results / 'a' / 'k1_lr0.001_held6.json').read_text())  # 6: the package's count for 24
    assert row['fit'] == 18 and [s['steps'] for s in row['snapshots']] == [2, 3, 5]
    fewer = json.loads((results / 'a' / 'k1_lr0.001_held2.json').read_text())
    assert fewer['fit'] == 22 and len(fewer['starts']['weight']['held']) == 2
    out = run('blockwise_loso.py', 'choose', '--results', results)
    main_table, alone = out.split('## ')[:2]
    assert main_table.count('| a | ') == 2 and main_table.count('| b | ') == 2
    assert alone.count('| holdout | ') == 2  # both counts measured on every cell, each varied alone
    # the pre-registered check reads each source under the package's default alone: 16 passes, 6 of 24 held out
    from collab_vit.conversion.calibration.recipe import Recipe
    checked = run('blockwise_loso.py', 'check', '--results', results)
    default = f'| lr 0.001, 16 passes, confidence {Recipe().confidence:g}, 6 held out |'
    assert checked.count('| a | ') == 2 and checked.count(default) == 4
    assert (results / 'loso.png').stat().st_size > 10_000

    # the snapshot at 4 passes is what the package's default recipe returns with that many steps, to the bit: every
    # candidate's held-out KL, the candidate kept, and its predictions on the test images
    from collab_vit.conversion.files.commands import load_source
    from collab_vit.conversion.reparam import convert_model
    from data_aware import test_set

    model, _, _, meta = load_source(None, str(source))
    images = blockwise_loso.calibration_images(blockwise_loso.calibration_loader(
        'torch/fashion_mnist', str(tiny_fashion_mnist), 'train', 24, model, meta.get('data_config'), 0), (1, 28, 28))
    test = test_set(str(tiny_fashion_mnist), model, meta)
    torch.set_num_threads(1)
    snap = row['snapshots'][0]
    converted = copy.deepcopy(model)
    report = convert_model(converted, 1, images, 'default', 0, False, Recipe(refine_steps=snap['steps']))
    refined = f"{row['refined_from']}+blocks"
    assert report.summary['candidates'] == {name: fmean(entry['held']) for name, entry in
                                            [*row['starts'].items(), (refined, snap)]}
    kept, entry = blockwise_loso.kept(row, Setting(1e-3, 4, Recipe().confidence))
    assert report.summary['chosen'] == kept
    assert blockwise_loso.packed(blockwise_loso.predictions(converted, test)) == {
        'top1': entry['top1'], 'right': entry['right']}
    change, half = blockwise_loso.paired(row, entry)
    assert change == pytest.approx(entry['top1'] - row['source_top1']) and half > 0


def test_the_package_default_is_the_choice_on_all_sources() -> None:
    """The frozen default (lr, passes, the guard's confidence and held-out count at 2048 images) is the setting the
    committed grids of results/blockwise_loso choose on all ten sources: a changed constant, or a grid that chooses
    otherwise, fails here."""
    rows = blockwise_loso.load_rows(blockwise_loso.ROOT / 'results' / 'blockwise_loso')
    assert len({r['source'] for r in rows}) >= 10 and {r['images'] for r in rows} == {2048}
    chosen = leave_one_out(blockwise_loso.outcomes(rows))
    assert blockwise_loso.package_default() == chosen['all']


def test_the_whole_block_target_is_the_attention_target_where_the_mlp_adds_nothing() -> None:
    """experiments/whole_block.py (RESULTS.md, "At a fixed compute: the default"): with every block's MLP output zero, a
    block's output error is its attention layer's and the sensitivities to both are the same (the chain rule), so the
    whole-block loss of each layer equals the package's attention loss (float64: the two differ by the rounding of a few
    hundred operations, far below 1e-9 relative), the refinement lowers it, and with the MLP the two objectives differ
    beyond rounding."""
    import timm
    from collab_vit.conversion.calibration.blockwise import mean_loss, source_outputs
    from collab_vit.conversion.calibration.recipe import Recipe, RecipeRun
    from collab_vit.conversion.reparam import timm_attention_layers
    from whole_block import BlockRun

    torch.manual_seed(0)
    base = timm.create_model('deit_tiny_patch16_224', img_size=28, patch_size=7, in_chans=1, depth=2, embed_dim=16,
                             num_heads=2, num_classes=10).double().eval()
    images = torch.randn(12, 1, 28, 28, dtype=torch.float64)

    def first_losses(model, kind):
        run = kind(model, timm_attention_layers(model), images, Recipe(holdout=4, batch_size=4), 0)
        start = run.fit_start('weight', [4, 4])
        calls = run.cached_calls(every_layer=True)
        sources = getattr(run, 'source_blocks', run.originals)
        units = run.units(start.fits) if kind is BlockRun else [f.layer for f in start.fits]
        losses = [mean_loss(u, c, source_outputs(s, c, 4, torch.device('cpu')), 4, torch.device('cpu'))
                  for u, s, c in zip(units, sources, calls)]
        refined = run.blockwise(start, 3)
        run.finish(refined)
        return losses, refined.refine

    silent = copy.deepcopy(base)
    for block in silent.blocks:
        torch.nn.init.zeros_(block.mlp.fc2.weight), torch.nn.init.zeros_(block.mlp.fc2.bias)
    attention, _ = first_losses(copy.deepcopy(silent), RecipeRun)
    block, refine = first_losses(copy.deepcopy(silent), BlockRun)
    assert refine['target'] == 'block' and refine['loss_after'] < refine['loss_before']
    assert all(a > 0 for a in attention) and block == pytest.approx(attention, rel=1e-9)
    attention, _ = first_losses(copy.deepcopy(base), RecipeRun)
    block, _ = first_losses(copy.deepcopy(base), BlockRun)
    assert block != pytest.approx(attention, rel=1e-9)  # the MLP's curvature: beyond rounding


def test_the_grid_refines_the_whole_block(tiny_fashion_mnist, tmp_path):  # noqa: F811
    """``grid --target block``: its rows say the target, its snapshots are measured like the package's."""
    source, results = sharp_source(tmp_path, depth=2), tmp_path / 'results'
    run('blockwise_loso.py', 'grid', '--source', source, '--name', 'a-block', '--data-dir', tiny_fashion_mnist,
        '--results', results, '--images', '24', '--lrs', '1e-3', '--passes', '2', '4', '--threads', '1',
        '--target', 'block')
    row = json.loads((results / 'a-block' / 'k1_lr0.001_held6.json').read_text())
    assert row['target'] == 'block' and [s['steps'] for s in row['snapshots']] == [1, 2]
    assert all(0 <= s['top1'] <= 100 and len(s['held']) == 6 for s in row['snapshots'])


def test_the_block_step_cost(tmp_path):
    """``whole_block.py cost``: one step against the attention output and against the block's, timed and written."""
    out = tmp_path / 'block_step.json'
    run('whole_block.py', 'cost', '--model', 'deit_tiny_patch16_224', '--steps', '1', '--bf16', '0', '--out', out)
    row = json.loads(out.read_text())
    assert row['model'] == 'deit_tiny_patch16_224' and row['bf16'] is False and row['threads'] == 1
    assert set(row['seconds']) == {'attention', 'block'}
    assert row['ratio'] == row['seconds']['block'] / row['seconds']['attention']
