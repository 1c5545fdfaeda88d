"""The experiment scripts run end to end on a tiny setting (a few hundred images, one epoch, one block) so they
cannot rot: every per-run JSON, table and plot they promise is written."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tinyrun import ROOT, tiny_fashion_mnist  # noqa: F401  (tiny_fashion_mnist is a fixture)

pytestmark = pytest.mark.timeout(900)


def run(script, *args, timeout=600):
    env = {**os.environ, 'PYTHONPATH': ROOT, 'OMP_NUM_THREADS': '1'}
    proc = subprocess.run([sys.executable, f'experiments/{script}', *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


TINY_TRAIN = ['--epochs', '1', '--batch-size', '50', '--model-kwargs', 'depth=1', '--cpu-threads', '1']


def test_from_scratch_grid(tiny_fashion_mnist, tmp_path):
    results = tmp_path / 'results'
    out = run('from_scratch.py', '--seeds', '0', '--variants', 'standard', 'collab_k16', 'concat_k16',
              '--results', results, '--runs', tmp_path / 'runs', '--data-dir', tiny_fashion_mnist,
              '--train-flags', *TINY_TRAIN)
    records = [json.loads((results / f'{v}-s0.json').read_text()) for v in ('standard', 'collab_k16', 'concat_k16')]
    for record in records:
        assert record['seed'] == 0 and 0 <= record['top1'] <= 100 and record['epochs'] == 1
        assert record['params'] > record['qk_params'] > 0 and record['seconds'] > 0
        assert record['command'].startswith('python train.py -c configs/fmnist/')
    assert records[1]['qk_params'] < records[0]['qk_params']  # key dim 16 instead of 64
    table = (results / 'table.md').read_text()
    assert table.count('\n') == 5 and '| collaborative | 16 | concatenate |' in table and '± 0.00' in table
    assert (results / 'top1_vs_key_dim.png').stat().st_size > 10_000 and 'top1_vs_key_dim.png' in out
    mixing = (results / 'mixing.md').read_text()
    assert mixing.count('\n') == 3 and '| 16 | concatenate | 4 | 1.00 → ' in mixing  # one collaborative cell
    # a finished grid is not run again
    assert '3 already done, 0 to run' in run('from_scratch.py', '--seeds', '0', '--variants', 'standard',
                                             'collab_k16', 'concat_k16', '--results', results, '--runs',
                                             tmp_path / 'runs', '--data-dir', tiny_fashion_mnist)


def test_post_hoc_and_redundancy(tiny_fashion_mnist, tmp_path):
    results, runs = tmp_path / 'post_hoc', tmp_path / 'runs'
    run('post_hoc.py', '--key-dims', '8', '12', '--finetune', 'tucker_k8', '--results',
        results, '--runs', runs, '--data-dir', tiny_fashion_mnist, '--source-flags', ' '.join(TINY_TRAIN),
        '--finetune-flags', '--batch-size 50 --cpu-threads 1')
    for name in ('tucker_k8', 'tucker_k12'):
        row = json.loads((results / f'{name}.json').read_text())
        assert len(row['key_dims']) == 1 and row['decomposition_seconds'] >= 0
        assert 0 <= row['top1_converted'] <= 100 and 0 < row['tensor_error'] < 1
        assert (0 <= row['top1_finetuned'] <= 100) if name == 'tucker_k8' else row['top1_finetuned'] is None
    assert json.loads((results / 'tucker_k8.json').read_text())['key_dims'] == [8]
    assert (results / 'table.md').read_text().count('| tucker |') == 2
    assert (results / 'top1_vs_key_dim.png').stat().st_size > 10_000

    red = tmp_path / 'redundancy'
    run('redundancy.py', '--trained', runs / 'source' / 'model.safetensors', '--results', red)
    for name in ('trained', 'init'):
        layers = json.loads((red / f'{name}.json').read_text())['layers']
        assert len(layers) == 1 and layers[0]['cumulative_energy'][-1] == pytest.approx(1.0)
        assert set(layers[0]['dims_needed']) == {'0.90', '0.95', '0.99'}
    assert (red / 'spectrum_trained_vs_init.png').stat().st_size > 10_000 and 'At initialisation' in \
        (red / 'table.md').read_text()


def test_mixing_stats() -> None:
    """Own-block share and participation ratio: 1 and Dk/Nh for the concatenate init, 1/Nh and Dk for a head that
    spreads evenly over all shared dims."""
    import torch
    sys.path.insert(0, os.path.join(ROOT, 'experiments'))
    from from_scratch import mixing_stats
    concatenate = torch.kron(torch.eye(4), torch.ones(1, 4))  # (4 heads, 16 shared dims), head h owns dims 4h..4h+3
    assert mixing_stats(concatenate) == (1.0, 4.0)
    assert mixing_stats(torch.full((4, 16), -0.3)) == (0.25, 16.0)
    own, used = mixing_stats(concatenate + 0.5 * torch.roll(concatenate, 4, dims=1))  # a quarter of it elsewhere
    assert abs(own - 0.8) < 1e-12 and 4.0 < used < 8.0


def test_logit_scale_diagnostic(tiny_fashion_mnist, tmp_path):
    """The rescaled start weights are the trainer's own initialisation with only the mixing matrices scaled (by
    sqrt(D / D~k) = 2 at D = 64, D~k = 16), and the cell trains from them and lands in the table."""
    import torch
    import timm
    from safetensors.torch import load_file
    import collab_vit  # noqa: F401
    results, runs = tmp_path / 'results', tmp_path / 'runs'
    out = run('logit_scale.py', '--seeds', '0', '--results', results, '--runs', runs, '--grid', tmp_path / 'none',
              '--data-dir', tiny_fashion_mnist, '--train-flags', '--epochs', '1', '--batch-size', '50')
    record = json.loads((results / 'collab_k16_rescaled-s0.json').read_text())
    assert record['mixing_factor'] == 2.0 and record['epochs'] == 1 and '--checkpoint' in record['command']
    assert '| 16 | collaborative, concatenate init, mixing rescaled |' in out
    start = load_file(runs / 'starts' / 'collab_k16-s0.safetensors')
    torch.manual_seed(0)
    init = timm.create_model('collab_deit_tiny_patch16_224', num_classes=10, img_size=28, in_chans=1, patch_size=4,
                             embed_dim=64, depth=4, num_heads=4, key_dim=16).state_dict()
    assert start.keys() == init.keys()
    for key, value in init.items():
        torch.testing.assert_close(start[key], 2 * value if key.endswith('.mixing') else value, rtol=0, atol=0)


def test_rotary_post_hoc(tiny_fashion_mnist, tmp_path):
    """experiments/rotary_post_hoc.py on rope_long.yaml's model at its init: every variant's cell, the table, the
    plot, the methods table and the energy shares (trained = init here, so the two columns agree)."""
    import torch
    from collab_vit.training.build import build_model
    from collab_vit.training.config import build_config

    cfg = build_config(os.path.join(ROOT, 'configs', 'fmnist', 'rope_long.yaml'))
    torch.manual_seed(1)
    model = build_model(cfg.model, cfg.num_classes, cfg.img_size, 0.0, {**cfg.model_kwargs, 'in_chans': 1})
    torch.save(model.state_dict(), tmp_path / 'source.pth')
    results = tmp_path / 'rotary'
    run('rotary_post_hoc.py', '--source', tmp_path / 'source.pth', '--data-dir', tiny_fashion_mnist, '--results',
        results, '--key-dims', '16', '--images', '40')
    for variant in ('select', 'uniform', 'optimal', 'weight', 'recipe'):
        row = json.loads((results / f'{variant}_k16.json').read_text())
        assert row['key_dims'] == [16] * 4 and 0 <= row['top1'] <= 100 and 0 < row['tensor_error'] < 1
    assert json.loads((results / 'recipe_k16.json').read_text())['summary']['images_fit'] == 30
    weight, select = (json.loads((results / f'{v}_k16.json').read_text()) for v in ('weight', 'select'))
    assert weight['tensor_error'] <= select['tensor_error']
    assert (results / 'table.md').read_text().count('| 16 |') == 2
    assert 'tensorly parafac' in (results / 'methods.md').read_text()
    assert all((results / png).stat().st_size > 10_000 for png in ('top1_vs_key_dim.png', 'energy.png'))
    # item 4's table over sources: the recipe against the selection, paired over the test images
    last = run('rotary_post_hoc.py', '--selection-table', results).splitlines()[-1]
    recipe = json.loads((results / 'recipe_k16.json').read_text())
    cells = [c.strip() for c in last.strip('|').split('|')]
    assert cells[:2] == ['rotary', '16'] and cells[4].endswith(f"({recipe['summary']['chosen']})")
    for cell, (entry, against) in zip([cells[2], cells[5]], [(select['top1'], select['top1_source']),
                                                             (recipe['top1'], select['top1'])]):
        change, half = map(float, cell.split(' ± '))
        assert abs(change - (entry - against)) <= 0.005 + 1e-9 and half > 0 or entry == against


def test_fixed_compute_table_from_the_committed_grids(tmp_path):
    """experiments/fixed_compute.py on the committed grids (results/fixed_compute): one row per source, key dim,
    images, passes and precision, the old default paired with itself at zero, the plot written; the new default's
    rows there, and its choice left out source by source."""
    import shutil

    results = tmp_path / "fixed_compute"
    shutil.copytree(Path(ROOT) / "results" / "fixed_compute", results, ignore=shutil.ignore_patterns("*.png", "*.md"))
    proc = subprocess.run([sys.executable, str(Path(ROOT) / "experiments" / "fixed_compute.py"), "--results", str(results)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    grids = [json.loads(p.read_text()) for p in results.glob("*/k*.json")]
    rows = [line for line in (results / "table.md").read_text().splitlines()[2:]]
    assert len(rows) == sum(len(g["snapshots"]) for g in grids) and (results / "compute.png").stat().st_size > 0
    old = [g for g in grids if g["images"] == 2048 and not g.get("bf16")]
    assert sum("| 2048 x 16, float32 |" in r and r.endswith("| +0.00 ± 0.00 |") for r in rows) == len(old)
    from collab_vit.conversion.calibration.recipe import DEFAULT_IMAGES, PASSES

    assert sum(f"| {DEFAULT_IMAGES} x {PASSES['default']}, " in r for r in rows) >= 2
    choice = (results / "choice.md").read_text()
    sources = {g["source"].split("-n")[0] for g in grids}
    assert all(f"| {s} |" in choice for s in sources) == (len(sources) > 1)
    # the choice with the lr fixed at the package's and free, each scored on the sources it left out
    from collab_vit.conversion.calibration.recipe import REFINE_LR
    assert f"| {REFINE_LR:g} | {DEFAULT_IMAGES} x {PASSES['default']}, bfloat16 |" in choice and "| free |" in choice


def test_rotary_ranking(tiny_fashion_mnist, tmp_path):
    """experiments/rotary_ranking.py (RESULTS.md, "The rotary weight-only rule") on two inits of rope_long.yaml's model:
    each variant's cell with its per-image outcomes, the table with paired intervals and the rule chosen leaving each
    source out."""
    import torch
    from collab_vit.training.build import build_model
    from collab_vit.training.config import build_config

    cfg = build_config(os.path.join(ROOT, 'configs', 'fmnist', 'rope_long.yaml'))
    results = tmp_path / 'ranking'
    for seed in (1, 2):
        torch.manual_seed(seed)
        model = build_model(cfg.model, cfg.num_classes, cfg.img_size, 0.0, {**cfg.model_kwargs, 'in_chans': 1})
        torch.save(model.state_dict(), tmp_path / f'source{seed}.pth')
        run('rotary_ranking.py', 'grid', '--source', tmp_path / f'source{seed}.pth', '--name', f's{seed}',
            '--data-dir', tiny_fashion_mnist, '--results', results, '--key-dims', '48', '16', '--images', '8')
        for variant in ('fit', 'norm', 'weights', 'logit', 'data'):
            row = json.loads((results / f's{seed}' / f'{variant}_k48.json').read_text())
            assert row['test_images'] == 100 and 0 <= row['top1'] <= 100 and len(row['right']) == 26  # 100 bits
    out = run('rotary_ranking.py', 'choose', '--results', results)
    assert out.count('| s1 |') == 3 and out.count('| s2 |') == 3  # two q/k dims and the rule, each source
    rule = json.loads((results / 'rule.json').read_text())
    assert set(rule['left_out']) == {'s1', 's2'} and rule['all'] in (0.25, 0.75, 1.0)
    assert (results / 'table.md').read_text() == out
