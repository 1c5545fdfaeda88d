"""Faults during training: kill -9 at any point then resume, elastic restarts, non-finite losses, the EMA's device,
and the digits writer that must never write into a user's folder (docs/faults.md lists what the user sees)."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from collab_vit.training.build import ema_evaluable
from collab_vit.training.checkpoint import load_checkpoint
from collab_vit.training.config import DataError, build_config
from collab_vit.training.datasets import DIGITS_MARKER, ensure_digits
from collab_vit.training.trainer import main, train

from test_train import RNG_HEAVY
from tinyrun import ROOT, make_image_folder, tiny_data, tiny_overrides, to_flags  # noqa: F401  (tiny_data: fixture)

FAULTRUN = os.path.join(ROOT, 'tests', 'faultrun.py')
ENV = {**os.environ, 'PYTHONPATH': ROOT, 'OMP_NUM_THREADS': '1'}


def listing(root) -> dict:
    """Every file under ``root`` with its size and modification time (to show that nothing changed)."""
    out = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            st = os.stat(path)
            out[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns)
    return out


def killed_run(flags, kill_at: str) -> subprocess.CompletedProcess:
    """train.py (through tests/faultrun.py) SIGKILLed at ``kill_at``; asserts it really died by SIGKILL."""
    proc = subprocess.run([sys.executable, FAULTRUN, *flags], cwd=ROOT, env={**ENV, 'KILL_AT': kill_at},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, f'not killed at {kill_at}: rc {proc.returncode}\n{proc.stderr[-2000:]}'
    return proc


def assert_checkpoints_load(out) -> dict:
    """Every .pth in the run directory loads (none is corrupt or half-written); returns {name: epoch}."""
    return {f: load_checkpoint(os.path.join(out, f))['epoch'] for f in sorted(os.listdir(out)) if f.endswith('.pth')}


def temp_files(out) -> list:
    return [f for f in os.listdir(out) if f.endswith('.tmp')]


def test_kill9_anywhere_then_resume_equals_uninterrupted(tiny_data, tmp_path):
    """kill -9 mid-epoch, inside a checkpoint write (before its rename) and between the writes of an epoch's end;
    each --resume succeeds and the final weights, EMA, best.pth and log equal an uninterrupted run's."""
    recipe = dict(RNG_HEAVY, epochs=4)  # 6 batches, 3 updates per epoch; epoch_0001/0003.pth kept
    full = train(build_config(None, tiny_overrides(tiny_data, str(tmp_path / 'full'), **recipe)))
    out = tmp_path / 'crash'
    flags = to_flags(tiny_overrides(tiny_data, str(out), **recipe))

    killed_run(flags, 'update:5')  # update 5 = the middle of epoch 1
    assert assert_checkpoints_load(out) == {'last.pth': 0, 'best.pth': 0}
    killed_run(flags + ['--resume'], 'write:last.pth:2')  # epoch 1 committed, killed writing epoch 2's last.pth
    assert temp_files(out), 'the kill was not inside the write'
    assert assert_checkpoints_load(out)['last.pth'] == 1
    killed_run(flags + ['--resume'], 'after:last.pth:1')  # epoch 2 committed; best.pth and log record not yet
    assert assert_checkpoints_load(out)['last.pth'] == 2
    assert [json.loads(x)['epoch'] for x in open(out / 'log.jsonl')] == [0, 1]

    resumed = train(build_config(None, tiny_overrides(tiny_data, str(out), resume=True, **recipe)))
    assert resumed['weights_sha256'] == full['weights_sha256'] and resumed['top1'] == full['top1']
    for name in ('model.safetensors', 'model_ema.safetensors'):
        a, b = load_file(tmp_path / 'full' / name), load_file(out / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert not temp_files(out)
    assert assert_checkpoints_load(out) == assert_checkpoints_load(tmp_path / 'full')
    ref_best, best = load_checkpoint(tmp_path / 'full' / 'best.pth'), load_checkpoint(out / 'best.pth')
    assert all(torch.equal(ref_best['model'][k], best['model'][k]) for k in ref_best['model'])
    ref_log = [json.loads(x) for x in open(tmp_path / 'full' / 'log.jsonl')]
    log = [json.loads(x) for x in open(out / 'log.jsonl')]
    assert [r['epoch'] for r in log] == [0, 1, 2, 3]
    assert [(r['top1'], r['train_loss']) for r in log] == [(r['top1'], r['train_loss']) for r in ref_log]


@pytest.mark.parametrize('at', ['update:4', 'write:last.pth:1'])
def test_ctrl_c_is_one_line_and_leaves_whole_files(tiny_data, tmp_path, at):
    """Ctrl-C (SIGINT) mid-epoch or inside a checkpoint write: exit 130, one line on stderr, no traceback, no temp
    file, every checkpoint present loads, and --auto-resume finishes the run."""
    out = tmp_path / 'run'
    flags = to_flags(tiny_overrides(tiny_data, str(out), **RNG_HEAVY))
    proc = subprocess.run([sys.executable, FAULTRUN, *flags], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**ENV, 'KILL_AT': at, 'KILL_SIGNAL': 'SIGINT'})
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        'error: interrupted (SIGINT); the checkpoints written so far are whole: continue with --auto-resume'], proc.stderr
    assert not temp_files(out)
    assert_checkpoints_load(out)
    assert main([*flags, '--auto-resume', 'true']) == 0


def test_eval_ctrl_c_is_one_line(monkeypatch, capsys):
    from collab_vit.training import eval_cli

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(eval_cli, 'run', interrupted)
    monkeypatch.setattr(eval_cli, 'parse_args', lambda argv: None)
    assert eval_cli.main([]) == 130
    assert capsys.readouterr().err == 'error: interrupted (SIGINT); no --output was written\n'


def test_elastic_restart_with_auto_resume(tiny_data, tmp_path):
    """torchrun --max-restarts=2, rank 1 SIGKILLed mid-run in the first attempt: the group restarts with the same
    command line, --auto-resume finds last.pth, and the run finishes with the weights of an uninterrupted run."""
    overrides = dict(epochs=3, model_ema=True, model_ema_decay=0.9, mixup=0.8, cutmix=1.0, repeated_aug=3,
                     deterministic=True, seed=2)
    reference = tmp_path / 'reference'
    ref = train(build_config(None, tiny_overrides(tiny_data, str(reference), **overrides)))
    assert ref['top1'] is not None

    def torchrun(out, extra_env):
        flags = to_flags(tiny_overrides(tiny_data, str(out), **overrides)) + ['--auto-resume']
        return subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                               '--max-restarts=2', '--monitor-interval=0.2', FAULTRUN, *flags], cwd=ROOT,
                              env={**ENV, **extra_env}, capture_output=True, text=True, timeout=300)

    out = tmp_path / 'elastic'
    # 12 images per rank and epoch (repeated augmentation), batch 4: 3 updates per epoch; update 5 is in epoch 1
    proc = torchrun(out, {'KILL_AT': 'update:5', 'KILL_RANK': '1', 'KILL_ATTEMPT': '0'})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'resumed' in proc.stdout and 'at epoch 1' in proc.stdout, proc.stdout[-2000:]
    assert 'exitcode: -9' in proc.stderr, proc.stderr[-2000:]  # torchrun saw the SIGKILL and restarted the group
    ckpt = load_checkpoint(out / 'last.pth')
    assert ckpt['epoch'] == 2 and len(ckpt['rng']) == 2
    assert [json.loads(x)['epoch'] for x in open(out / 'log.jsonl')] == [0, 1, 2]

    straight = tmp_path / 'straight'
    proc = torchrun(straight, {})
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = load_file(straight / 'model.safetensors'), load_file(out / 'model.safetensors')
    assert all(torch.equal(a[k], b[k]) for k in a), 'the restarted run ended with other weights'


def test_auto_resume_starts_then_resumes(tiny_data, tmp_path):
    out = str(tmp_path / 'run')
    first = train(build_config(None, tiny_overrides(tiny_data, out, epochs=2, stop_after=1, auto_resume=True)))
    assert first['stopped_at_epoch'] == 0
    second = train(build_config(None, tiny_overrides(tiny_data, out, epochs=2, auto_resume=True)))
    assert second['top1'] is not None and load_checkpoint(os.path.join(out, 'last.pth'))['epoch'] == 1


def test_resume_wins_over_auto_resume(tiny_data, tmp_path, capsys):
    """Both flags (e.g. --auto-resume in a Slurm job's arguments, whose requeue adds --resume): --resume's rule,
    last.pth must exist."""
    flags = to_flags(tiny_overrides(tiny_data, str(tmp_path / 'run'))) + ['--resume', '--auto-resume']
    assert main(flags) == 2
    err = capsys.readouterr().err.strip()
    assert err == f'error: --resume: no last.pth in run directory {tmp_path / "run"} (use --auto-resume to start ' \
                  f'when there is none)'
    assert not (tmp_path / 'run').exists()


# ---- non-finite losses and weights ----------------------------------------------------------------------------

def test_diverging_run_stops_and_keeps_last_good_checkpoint(tiny_data, tmp_path, capsys):
    """lr 1e30 after a warm-up epoch at 1e-3 (SGD): NaN in epoch 1; the run stops naming the step, last.pth of
    epoch 0 is untouched and nothing is exported."""
    out = tmp_path / 'run'
    flags = to_flags(tiny_overrides(tiny_data, str(out), opt='sgd', lr=1e30, warmup_lr=1e-3, warmup_epochs=1,
                                    epochs=3, model_ema=True))
    assert main(flags) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith('error: non-finite loss (nan) at epoch 1, update ') and '\n' not in err, err
    assert f'{out / "last.pth"} (epoch 0) is kept as it was' in err
    assert load_checkpoint(out / 'last.pth')['epoch'] == 0
    assert not (out / 'model.safetensors').exists() and not (out / 'model_ema.safetensors').exists()
    state = load_checkpoint(out / 'last.pth')
    assert all(torch.isfinite(v).all() for v in state['model'].values() if v.is_floating_point())


def test_diverging_run_with_skips_stops_after_too_many_in_a_row(tiny_data, tmp_path, capsys):
    out = tmp_path / 'run'
    flags = to_flags(tiny_overrides(tiny_data, str(out), opt='sgd', lr=1e30, warmup_lr=1e-3, warmup_epochs=1,
                                    epochs=3, skip_nonfinite_loss=True, max_nonfinite_skips=2))
    assert main(flags) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith('error: 3 batches in a row with a non-finite loss, the last at epoch 1') and \
        '(max_nonfinite_skips 2)' in err, err
    assert load_checkpoint(out / 'last.pth')['epoch'] == 0 and not (out / 'model.safetensors').exists()


def nan_loss_at(monkeypatch, calls_to_poison):
    """Make torch's CrossEntropyLoss (the training loss without mixup and smoothing) return NaN at these calls."""
    original = torch.nn.CrossEntropyLoss.forward
    count = {'n': 0}

    def forward(self, logits, target):
        count['n'] += 1
        loss = original(self, logits, target)
        return loss * float('nan') if count['n'] in calls_to_poison else loss
    monkeypatch.setattr(torch.nn.CrossEntropyLoss, 'forward', forward)


def test_skip_nonfinite_loss_counts_and_continues(tiny_data, tmp_path, monkeypatch):
    no_mix = dict(mixup=0.0, cutmix=0.0, smoothing=0.0, epochs=2, model_ema=False)
    nan_loss_at(monkeypatch, {3, 4})
    out = tmp_path / 'skip'
    summary = train(build_config(None, tiny_overrides(tiny_data, str(out), skip_nonfinite_loss=True, **no_mix)))
    log = [json.loads(x) for x in open(out / 'log.jsonl')]
    assert log[0]['nonfinite_skipped'] == 2 and 'nonfinite_skipped' not in log[1]
    assert log[0]['step'] == 4 and log[1]['step'] == 10  # 6 batches per epoch, 2 updates skipped
    weights = load_file(out / 'model.safetensors')
    assert summary['top1'] is not None and all(torch.isfinite(v).all() for v in weights.values())


def test_nonfinite_weights_are_never_saved(tiny_data, tmp_path, monkeypatch, capsys):
    """Weights that turn NaN at the last update of an epoch (a finite loss until then) are not checkpointed."""
    train(build_config(None, tiny_overrides(tiny_data, str(tmp_path / 'run'), epochs=3, stop_after=1)))
    before = (tmp_path / 'run' / 'last.pth').read_bytes()
    original = torch.optim.AdamW.step
    count = {'n': 0}

    def step(self, *args, **kwargs):
        count['n'] += 1
        result = original(self, *args, **kwargs)
        if count['n'] == 6:  # the last update of epoch 1
            with torch.no_grad():
                self.param_groups[0]['params'][0].fill_(float('nan'))
        return result
    monkeypatch.setattr(torch.optim.AdamW, 'step', step)
    flags = to_flags(tiny_overrides(tiny_data, str(tmp_path / 'run'), epochs=3)) + ['--resume']
    assert main(flags) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith('error: non-finite weights (') and 'after epoch 1: not saved' in err, err
    assert (tmp_path / 'run' / 'last.pth').read_bytes() == before
    assert not (tmp_path / 'run' / 'model.safetensors').exists()


# ---- model_ema_force_cpu ----------------------------------------------------------------------------------------

def test_ema_on_another_device_is_not_evaluated():
    """timm's train.py does not evaluate an EMA kept on the CPU (model_ema_force_cpu) beside a GPU model; the
    trainer decides this by comparing devices, so the decision is testable without a GPU."""
    from timm.utils import ModelEmaV3
    ema = ModelEmaV3(torch.nn.Linear(2, 2), device='cpu')
    assert ema_evaluable(ema, torch.device('cpu'))
    assert not ema_evaluable(ema, torch.device('cuda', 0))
    assert not ema_evaluable(None, torch.device('cpu'))


def test_force_cpu_ema_still_exported(tiny_data, tmp_path):
    out = tmp_path / 'run'
    train(build_config(None, tiny_overrides(tiny_data, str(out), epochs=1, model_ema=True, model_ema_force_cpu=True)))
    record = json.loads(open(out / 'log.jsonl').read())
    assert 'ema_top1' in record  # on the CPU the EMA shares the model's device: evaluated
    assert (out / 'model_ema.safetensors').exists()


# ---- the quickstart's digits writer ---------------------------------------------------------------------------

def test_digits_never_written_into_a_users_folder(tmp_path, capsys):
    """Defect: `train.py -c configs/quickstart.yaml --data-dir my_folder` wrote ten class folders into my_folder."""
    mine = make_image_folder(tmp_path / 'my_folder', classes=3, train_per_class=2, val_per_class=1)
    before = listing(mine)
    code = main(['-c', os.path.join(ROOT, 'configs', 'quickstart.yaml'), '--data-dir', mine,
                 '--output', str(tmp_path / 'run')])
    err = capsys.readouterr().err.strip()
    assert code == 2 and '\n' not in err
    assert err.startswith(f"error: data directory {mine} is not empty and is not this package's digits set")
    assert listing(mine) == before and not (tmp_path / 'run').exists()
    assert sorted(os.listdir(tmp_path)) == ['my_folder']  # no staging folder left either


def test_digits_written_once_into_a_new_or_empty_folder(tmp_path):
    (tmp_path / 'empty').mkdir()
    for root in (tmp_path / 'new' / 'digits', tmp_path / 'empty'):
        ensure_digits(str(root), size=8)
        assert (root / DIGITS_MARKER).is_file()
        assert sorted(os.listdir(root / 'train')) == [str(d) for d in range(10)]
        assert sum(len(files) for _, _, files in os.walk(root)) == 1797 + 1
        before = listing(root)
        ensure_digits(str(root), size=8)  # complete: nothing rewritten
        assert listing(root) == before
    assert sorted(os.listdir(tmp_path)) == ['empty', 'new']
    with pytest.raises(DataError, match='is a file'):
        (tmp_path / 'file').write_text('x')
        ensure_digits(str(tmp_path / 'file'))



def test_written_files_follow_the_umask(tmp_path):
    """atomic_write and the digits writer stage through mkstemp/mkdtemp (0600/0700); the results must get the
    permissions a plain open/makedirs gives, so that a group can read a run's checkpoints."""
    from collab_vit.weights_io import atomic_write, current_umask
    mask = current_umask()
    atomic_write(str(tmp_path / 'a.txt'), lambda f: f.write(b'x'))
    assert (tmp_path / 'a.txt').stat().st_mode & 0o777 == 0o666 & ~mask
    ensure_digits(str(tmp_path / 'digits'), size=8)
    assert (tmp_path / 'digits').stat().st_mode & 0o777 == 0o777 & ~mask
