"""Stop requests (signal or STOP file) checkpoint mid-epoch; resuming continues exactly as if never stopped."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from collab_vit.training.checkpoint import load_checkpoint
from collab_vit.training.config import build_config
from collab_vit.training.stop import STOP_FILE, StopRequest
from collab_vit.training.data import SkipFirstSampler
from collab_vit.training.trainer import train

from test_train import RNG_HEAVY
from tinyrun import ROOT, tiny_data, tiny_overrides, to_flags  # noqa: F401  (tiny_data is a fixture)


def stop_at_update_checks(monkeypatch, *check_numbers: int) -> None:
    """Make the n-th call of StopRequest.reason (one per optimizer update, counted per train() call) ask to stop."""
    original = StopRequest.reason
    calls = {'n': 0}

    def reason(self):
        calls['n'] += 1
        return 'TEST' if calls['n'] in check_numbers else original(self)

    monkeypatch.setattr(StopRequest, 'reason', reason)

    def reset():
        calls['n'] = 0
    return reset


def assert_same_training_state(a, b) -> None:
    assert a['epoch'] == b['epoch'] and a['step'] == b['step'] and a['batches_done'] == b['batches_done'] == 0
    for part in ('model', 'model_ema'):
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), f'{part}.{k} differs after a mid-epoch resume'
    for sa, sb in zip(a['optimizer']['state'].values(), b['optimizer']['state'].values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a['scheduler'] == b['scheduler']


def test_mid_epoch_stop_and_resume_is_exact(tiny_data, tmp_path, monkeypatch):
    """6 batches / 3 updates per epoch (accum 2): stop after update 5 = epoch 1, batch 4; resume; compare."""
    full = train(build_config(None, tiny_overrides(tiny_data, str(tmp_path / 'full'), **RNG_HEAVY)))
    out = str(tmp_path / 'split')
    stop_at_update_checks(monkeypatch, 5)
    stopped = train(build_config(None, tiny_overrides(tiny_data, out, **RNG_HEAVY)))
    assert stopped == {'stopped_at_epoch': 1, 'batches_done': 4, 'step': 5, 'output': out}
    ckpt = load_checkpoint(os.path.join(out, 'last.pth'))
    assert ckpt['epoch'] == 0 and ckpt['batches_done'] == 4 and len(ckpt['rng_at_stop']) == 1
    assert not os.path.exists(os.path.join(out, 'model.safetensors'))
    monkeypatch.undo()
    resumed = train(build_config(None, tiny_overrides(tiny_data, out, resume=True, **RNG_HEAVY)))
    assert_same_training_state(load_checkpoint(tmp_path / 'full' / 'last.pth'), load_checkpoint(os.path.join(out, 'last.pth')))
    assert full['weights_sha256'] == resumed['weights_sha256'] and full['top1'] == resumed['top1']


def test_repeated_stops_continue_to_the_end(tiny_data, tmp_path, monkeypatch):
    """Stopped four times (at the first update of each invocation: three mid-epoch, one at an epoch end), the run
    still ends exactly where an uninterrupted one does."""
    full = train(build_config(None, tiny_overrides(tiny_data, str(tmp_path / 'full'), **RNG_HEAVY)))
    out = str(tmp_path / 'split')
    reset = stop_at_update_checks(monkeypatch, 1)
    results = [train(build_config(None, tiny_overrides(tiny_data, out, **RNG_HEAVY)))]
    for _ in range(3):
        reset()
        results.append(train(build_config(None, tiny_overrides(tiny_data, out, resume=True, **RNG_HEAVY))))
    # 2 batches per update, 6 per epoch: batch 6 of epoch 0 is an epoch boundary (checkpointed after evaluation)
    assert [(r['stopped_at_epoch'], r['batches_done']) for r in results] == [(0, 2), (0, 4), (0, 0), (1, 2)]
    monkeypatch.undo()
    final = train(build_config(None, tiny_overrides(tiny_data, out, resume=True, **RNG_HEAVY)))
    assert_same_training_state(load_checkpoint(tmp_path / 'full' / 'last.pth'), load_checkpoint(os.path.join(out, 'last.pth')))
    assert full['weights_sha256'] == final['weights_sha256']


def test_stop_file_is_agreed_and_removed(tmp_path):
    request = StopRequest(str(tmp_path), is_main=True, signals=())
    assert not request.requested()
    (tmp_path / STOP_FILE).touch()
    assert request.reason() == STOP_FILE and request.requested()
    request.agree(True)  # what the training loop does after its all-reduce
    assert request.decided == STOP_FILE and request.pending is None
    request.acknowledge()
    assert not (tmp_path / STOP_FILE).exists() and request.reason() is None
    (tmp_path / STOP_FILE).touch()
    assert StopRequest(str(tmp_path), is_main=False, signals=()).reason() is None  # only rank 0 looks at the file


def test_signals_set_the_request(tmp_path):
    before = signal.getsignal(signal.SIGUSR1)
    request = StopRequest(str(tmp_path), is_main=True, signals=(signal.SIGUSR1,))
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)  # a repeated signal (slurmstepd and torchrun both send one) is harmless
        assert request.reason() == 'SIGUSR1'
    finally:
        request.restore_handlers()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_skip_first_sampler_keeps_the_order():
    torch.manual_seed(0)
    full = list(torch.utils.data.RandomSampler(range(10)))
    torch.manual_seed(0)
    skipper = SkipFirstSampler(torch.utils.data.RandomSampler(range(10)), skip=4)
    assert len(skipper) == 6 and list(skipper) == full[4:]


def test_sigterm_to_train_py_checkpoints_and_exits_cleanly(tiny_data, tmp_path):
    """A real process, a real signal: train.py saves last.pth with its position and exits 0; --resume finishes."""
    out = tmp_path / 'run'
    flags = to_flags(tiny_overrides(tiny_data, str(out), epochs=200, warmup_epochs=1))
    env = {**os.environ, 'PYTHONPATH': ROOT, 'OMP_NUM_THREADS': '1'}
    proc = subprocess.Popen([sys.executable, 'train.py', *flags], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while not (out / 'log.jsonl').exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-2000:]
    assert 'stop requested (SIGTERM)' in output or 'stopping after epoch' in output, output[-2000:]
    ckpt = load_checkpoint(out / 'last.pth')
    assert 0 <= ckpt['epoch'] < 199 and not (out / 'model.safetensors').exists()
    resumed = subprocess.run([sys.executable, 'train.py', *flags, '--resume', '--epochs', str(ckpt['epoch'] + 2)],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert (out / 'model.safetensors').exists()


if __name__ == '__main__':
    sys.exit(pytest.main([__file__, '-q']))
