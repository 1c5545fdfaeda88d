"""The training loop at cluster scale: accumulation over short windows, host syncs per epoch, resume invariants,
EMA and evaluation under DDP (2 gloo processes)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from collab_vit.training.checkpoint import load_checkpoint, save_checkpoint
from collab_vit.training.config import build_config
from collab_vit.training.distributed import DistInfo
from collab_vit.training.engine import StepParts, train_one_epoch
from collab_vit.training.trainer import main, train

from synccount import by_phase, install
from test_preemption import stop_at_update_checks
from tinyrun import ROOT, make_image_folder, tiny_data, tiny_overrides, to_flags  # noqa: F401  (tiny_data: fixture)

ENV = {**os.environ, 'PYTHONPATH': ROOT, 'OMP_NUM_THREADS': '1'}


class GradRecorder(torch.optim.SGD):
    """lr 0 (the weights never move, so every window's gradient is taken at the same point); records each step's
    gradients."""

    def __init__(self, params):
        super().__init__(params, lr=0.0)
        self.grads = []

    def step(self, closure=None):
        self.grads.append([p.grad.clone() for p in self.param_groups[0]['params']])


def test_accumulation_window_gradients_equal_one_large_batch():
    """5 batches of 3, accum_steps 2: windows of 2, 2 and 1 batches; each update's gradient is that of one batch
    holding the window's samples (float64; before, the short last window's gradient came out halved)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)).double()
    batches = [(torch.randn(3, 6, dtype=torch.float64), torch.randint(0, 4, (3,))) for _ in range(5)]
    optimizer = GradRecorder(model.parameters())
    parts = StepParts(optimizer=optimizer, loss_fn=torch.nn.CrossEntropyLoss(), dist_info=DistInfo(),
                      accum_steps=2, progress=False)
    result = train_one_epoch(model, batches, parts, epoch=0, num_updates=0)
    assert result.num_updates == 3 and result.batches == 5 and len(optimizer.grads) == 3
    for window, got in zip(([0, 1], [2, 3], [4]), optimizer.grads):
        model.zero_grad()
        x = torch.cat([batches[i][0] for i in window])
        y = torch.cat([batches[i][1] for i in window])
        torch.nn.functional.cross_entropy(model(x), y).backward()
        for g, p in zip(got, model.parameters()):
            ref = p.grad
            # float64: a few roundings of sums over <= 6 samples; 64 x 2**-53 x max|ref| is far below a 2x error
            assert (g - ref).abs().max() <= 64 * 2 ** -53 * ref.abs().max(), (window, (g - ref).abs().max())


# ---- host syncs ---------------------------------------------------------------------------------------------------

def expected_loop_syncs(updates_per_epoch: int, log_interval: int, distributed: bool) -> int:
    """Reads of one training pass: every log_interval updates and at its last update; each is one ``.tolist()``
    (and, distributed, one all-reduce)."""
    reads = len({u for u in range(1, updates_per_epoch + 1) if u % log_interval == 0} | {updates_per_epoch})
    return reads * (2 if distributed else 1)


def test_one_process_syncs_per_log_interval_not_per_batch(tiny_data, tmp_path, monkeypatch):
    """6 batches and updates per epoch, log_interval 4: 2 reads per training pass (update 4 and the last), 1 per
    evaluation (model and EMA), 1 per weight check (model and EMA) before the checkpoint."""
    counts = install(monkeypatch)
    train(build_config(None, tiny_overrides(tiny_data, str(tmp_path / 'run'), epochs=2, log_interval=4,
                                            model_ema=True)))
    totals, detail = by_phase(counts)
    assert counts[('epochs', 'train')] == 2
    assert totals['train'] == 2 * expected_loop_syncs(6, 4, False), detail
    assert totals['evaluate'] == 2 * 2 and totals['save'] == 2 * 2, detail


def test_skip_nonfinite_is_the_one_per_batch_check(tiny_data, tmp_path, monkeypatch):
    """skip_nonfinite_loss: true (opt-in) reads every loss: 6 more reads per pass, as its note says."""
    counts = install(monkeypatch)
    train(build_config(None, tiny_overrides(tiny_data, str(tmp_path / 'run'), epochs=1, log_interval=4,
                                            model_ema=False, skip_nonfinite_loss=True)))
    totals, detail = by_phase(counts)
    assert totals['train'] == expected_loop_syncs(6, 4, False) + 6, detail


def test_nonfinite_loss_found_at_the_read_names_its_first_update(tiny_data, tmp_path, monkeypatch, capsys):
    """A NaN loss at update 9 (epoch 1, batch 3), read only at the epoch's last update (log_interval 50): the run
    stops naming update 9, and last.pth (epoch 0) stays as it was."""
    from test_faults import nan_loss_at
    out = tmp_path / 'run'
    no_mix = dict(mixup=0.0, cutmix=0.0, smoothing=0.0, epochs=2, model_ema=True, log_interval=50)
    train(build_config(None, tiny_overrides(tiny_data, str(out), stop_after=1, **no_mix)))
    before = (out / 'last.pth').read_bytes()
    nan_loss_at(monkeypatch, {3})  # the 3rd loss of the resumed invocation: epoch 1, batch 3
    assert main(to_flags(tiny_overrides(tiny_data, str(out), **no_mix)) + ['--resume']) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith('error: non-finite loss (nan) at epoch 1, update 9 (batch 3 of 6 in this pass): training '
                          f'stopped; {out / "last.pth"} (epoch 0) is kept as it was'), err
    assert (out / 'last.pth').read_bytes() == before and not (out / 'model.safetensors').exists()


# ---- resume invariants ----------------------------------------------------------------------------------------

def test_mid_epoch_resume_with_another_batch_size_refuses(tiny_data, tmp_path, monkeypatch, capsys):
    out = tmp_path / 'run'
    stop_at_update_checks(monkeypatch, 2)
    stopped = train(build_config(None, tiny_overrides(tiny_data, str(out), epochs=2, model_ema=False)))
    assert stopped['batches_done'] == 2
    monkeypatch.undo()
    assert load_checkpoint(out / 'last.pth')['geometry'] == {'batch_size': 4, 'world_size': 1, 'accum_steps': 1}
    before = {f: (out / f).read_bytes() for f in os.listdir(out) if os.path.isfile(out / f)}
    flags = to_flags(tiny_overrides(tiny_data, str(out), epochs=2, model_ema=False, batch_size=2,
                                    accum_steps=2)) + ['--resume']
    assert main(flags) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f'error: {out / "last.pth"} was stopped inside epoch 0 (after batch 2) with other values '
                   f'(batch_size 4 there, 2 now; accum_steps 1 there, 2 now): that epoch can only continue exactly '
                   f'with the values it was written with; resume with those'), err
    assert {f: (out / f).read_bytes() for f in os.listdir(out) if os.path.isfile(out / f)} == before


def test_checkpoint_without_geometry_resumes_with_one_warning(tiny_data, tmp_path, capsys):
    out = tmp_path / 'run'
    train(build_config(None, tiny_overrides(tiny_data, str(out), epochs=2, stop_after=1, model_ema=False)))
    ckpt = load_checkpoint(out / 'last.pth')
    del ckpt['geometry']  # as written before this change
    save_checkpoint(ckpt, str(out / 'last.pth'))
    capsys.readouterr()
    summary = train(build_config(None, tiny_overrides(tiny_data, str(out), epochs=2, model_ema=False, resume=True)))
    assert summary['top1'] is not None
    warnings = [line for line in capsys.readouterr().out.splitlines() if 'before checkpoints recorded' in line]
    assert len(warnings) == 1 and 'batch_size 4, world_size 1, accum_steps 1' in warnings[0], warnings


# ---- two gloo processes ---------------------------------------------------------------------------------------

RANK_SCRIPT = '''import json, os, sys
sys.path.insert(0, os.path.join({root!r}, 'tests'))
from synccount import by_phase, install
from collab_vit.training.config import parse_train_args
from collab_vit.training import trainer
start = {{}}
assemble = trainer.assemble
def recording_assemble(*args, **kwargs):  # the weights each rank's model and EMA start from
    run = assemble(*args, **kwargs)
    start['model'] = trainer.state_dict_sha256(run.model.module.state_dict())
    start['ema'] = trainer.state_dict_sha256(run.step.model_ema.module.state_dict())
    return run
trainer.assemble = recording_assemble
if os.environ.get('STOP_RANK') == os.environ['RANK']:  # this rank alone asks to stop at its STOP_AT-th update
    from collab_vit.training.stop import StopRequest
    calls, reason = [0], StopRequest.reason
    def asking(self):
        calls[0] += 1
        return 'TEST' if calls[0] == int(os.environ['STOP_AT']) else reason(self)
    StopRequest.reason = asking
counts = install()
summary = trainer.train(parse_train_args(sys.argv[2:]))
totals, detail = by_phase(counts)
out = {{'summary': summary, 'totals': totals, 'detail': detail, 'epochs': counts[('epochs', 'train')],
        'start': start}}
open(os.path.join(sys.argv[1], 'rank%s.json' % os.environ['RANK']), 'w').write(json.dumps(out))
'''


# 24 train images, 2 ranks, batch 2: 6 batches and updates per rank and epoch; EMA decay 0.9
DDP_OVERRIDES = dict(epochs=2, stop_after=1, batch_size=2, lr_base_batch=4, log_interval=4, model_ema=True,
                     model_ema_decay=0.9, repeated_aug=0, mixup=0.0, cutmix=0.0, seed=5)


def torchrun(script_dir, out, data, overrides, env=None):
    """RANK_SCRIPT on 2 gloo processes; returns the ranks' JSON."""
    script = script_dir / 'rank.py'
    script.write_text(RANK_SCRIPT.format(root=ROOT))
    proc = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                           str(script), str(script_dir), *to_flags(tiny_overrides(data, str(out), **overrides))],
                          cwd=ROOT, env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((script_dir / f'rank{r}.json').read_text()) for r in (0, 1)]


@pytest.fixture(scope='module')
def ddp_run(tmp_path_factory):
    """One 2-process gloo run (9 val images: the shards are 5 + 4, the sampler pads one): epoch 0 of 2, then a
    stop (stop_after), so last.pth holds epoch 0's weights and EMA."""
    root = tmp_path_factory.mktemp('ddp')
    data = make_image_folder(root / 'data', classes=3, train_per_class=8, val_per_class=3)
    out = root / 'run'
    ranks = torchrun(root, out, data, DDP_OVERRIDES)
    return {'data': data, 'out': out, 'ranks': ranks, 'overrides': DDP_OVERRIDES,
            'epoch0': load_checkpoint(out / 'last.pth'), 'root': root}


def test_two_processes_sync_per_log_interval(ddp_run):
    for rank in ddp_run['ranks']:
        totals, detail = rank['totals'], rank['detail']
        assert rank['epochs'] == 1
        assert totals['train'] == expected_loop_syncs(6, 4, True), detail  # 2 reads, each all-reduce + tolist
        assert totals['evaluate'] == 2 * 2, detail  # model and EMA: one all-reduce and one read each
        assert totals['save'] == 2 + 1, detail  # weight checks of model and EMA, the RNG-state gather


def test_two_processes_ema_starts_from_the_broadcast_weights(ddp_run):
    """Every rank's EMA is built from the weights DDP broadcast from rank 0 (before, each rank's own seed's)."""
    starts = [r['start'] for r in ddp_run['ranks']]
    assert len({s['model'] for s in starts} | {s['ema'] for s in starts}) == 1, starts


def test_two_processes_ema_metrics_are_the_exported_emas(ddp_run):
    """The EMA's top-1 / loss logged under DDP (reduced over 2 ranks) are those of the checkpointed EMA evaluated
    alone."""
    from collab_vit.training.data import build_dataset, build_eval_loader
    from collab_vit.training.distributed import DistInfo
    from collab_vit.training.build import build_model
    from collab_vit.training.engine import evaluate
    record = json.loads((ddp_run['out'] / 'log.jsonl').read_text().splitlines()[0])
    assert record['val_samples'] == 9  # every val image once (the sampler's padding dropped)
    ckpt = ddp_run['epoch0']
    kwargs = {k: v for k, v in ckpt['model_kwargs'].items() if k not in ('img_size', 'num_classes')}
    model = build_model(ckpt['model_name'], 3, 32, 0.0, kwargs)
    model.load_state_dict(ckpt['model_ema'])
    val = build_dataset('', ddp_run['data'], 'validation', False)
    loader = build_eval_loader(val, ckpt['data_config'], 4, 0, DistInfo(), pin_memory=False)
    alone = evaluate(model, loader, DistInfo(), len(val))
    assert alone['num_samples'] == 9 and record['ema_top1'] == alone['top1']
    # float32 forward passes over other batch compositions, then float64 sums: 2**-24 x a few hundred roundings
    assert abs(record['ema_val_loss'] - alone['loss']) <= 1e-5 * alone['loss'], (record['ema_val_loss'], alone)


def test_end_of_epoch_resume_on_another_world_size(ddp_run, tmp_path):
    """The 2-process run resumed on 1 process at its epoch end: it finishes, with the lr, schedule position and
    update count of a 1-process run at that epoch (the lr follows the new global batch)."""
    out = ddp_run['out']
    overrides = dict(ddp_run['overrides'], stop_after=0)
    summary = train(build_config(None, tiny_overrides(ddp_run['data'], str(out), resume=True, **overrides)))
    assert summary['top1'] is not None
    fresh = tmp_path / 'fresh'
    train(build_config(None, tiny_overrides(ddp_run['data'], str(fresh), **overrides)))
    resumed_log = [json.loads(x) for x in (out / 'log.jsonl').read_text().splitlines()]
    fresh_log = [json.loads(x) for x in (fresh / 'log.jsonl').read_text().splitlines()]
    assert [r['epoch'] for r in resumed_log] == [0, 1]
    assert resumed_log[0]['step'] == 6 and resumed_log[1]['step'] == fresh_log[1]['step'] == 24
    assert resumed_log[1]['lr'] == fresh_log[1]['lr']
    assert load_checkpoint(out / 'last.pth')['geometry']['world_size'] == 1


def test_two_processes_agree_on_a_stop_at_the_next_read(ddp_run, tmp_path):
    """Rank 1 alone asks to stop at its update 2; both ranks stop together at update 4 (log_interval 4, the first
    read), and the mid-epoch checkpoint says so."""
    out = tmp_path / 'run'
    ranks = torchrun(tmp_path, out, ddp_run['data'], dict(DDP_OVERRIDES, stop_after=0),
                     env={'STOP_RANK': '1', 'STOP_AT': '2'})
    assert [r['summary'] for r in ranks] == [{'stopped_at_epoch': 0, 'batches_done': 4, 'step': 4,
                                              'output': str(out)}] * 2
    ckpt = load_checkpoint(out / 'last.pth')
    assert ckpt['batches_done'] == 4 and ckpt['step'] == 4 and len(ckpt['rng_at_stop']) == 2
