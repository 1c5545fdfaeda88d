"""Training: exact resume, 2-process DDP on CPU, data-dir errors, atomic checkpoints, run-dir guard."""
import json
import os
import subprocess
import sys

import pytest
import torch

from collab_vit.training.checkpoint import load_checkpoint, save_checkpoint
from collab_vit.weights_io import atomic_write
from collab_vit.training.config import ConfigError, build_config
from collab_vit.training.data import DataError, build_dataset
from collab_vit.training.trainer import train

from tinyrun import ROOT, tiny_data, tiny_overrides, to_flags  # noqa: F401  (tiny_data is a fixture)

# every RNG consumer on: RandAugment, random erasing, mixup/cutmix, drop path; plus accumulation, clipping, EMA
RNG_HEAVY = dict(aa='rand-m9-mstd0.5-inc1', reprob=0.25, mixup=0.8, cutmix=1.0, drop_path=0.1, accum_steps=2,
                 clip_grad=1.0, model_ema=True, model_ema_decay=0.9, epochs=3, deterministic=True, seed=3,
                 checkpoint_every=2)


def test_resume_is_exact(tiny_data, tmp_path):
    full = train(build_config(None, tiny_overrides(tiny_data, str(tmp_path / 'full'), **RNG_HEAVY)))
    stopped = train(build_config(None, tiny_overrides(tiny_data, str(tmp_path / 'split'), stop_after=1, **RNG_HEAVY)))
    assert stopped == {'stopped_at_epoch': 0, 'batches_done': 0, 'step': 3, 'output': str(tmp_path / 'split')}
    assert not os.path.exists(tmp_path / 'split' / 'model.safetensors')
    resumed = train(build_config(None, tiny_overrides(tiny_data, str(tmp_path / 'split'), resume=True, **RNG_HEAVY)))
    a, b = load_checkpoint(tmp_path / 'full' / 'last.pth'), load_checkpoint(tmp_path / 'split' / 'last.pth')
    assert a['epoch'] == b['epoch'] == 2 and a['step'] == b['step'] > 0
    for part in ('model', 'model_ema'):
        assert a[part].keys() == b[part].keys()
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), f'{part}.{k} differs after resume'
    for sa, sb in zip(a['optimizer']['state'].values(), b['optimizer']['state'].values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert full['weights_sha256'] == resumed['weights_sha256'] and full['top1'] == resumed['top1']
    files = set(os.listdir(tmp_path / 'full'))
    assert {'config.yaml', 'log.jsonl', 'last.pth', 'best.pth', 'epoch_0001.pth', 'model.safetensors'} <= files
    assert 'epoch_0000.pth' not in files and 'epoch_0002.pth' not in files
    assert load_checkpoint(tmp_path / 'full' / 'best.pth')['epoch'] == full['best_epoch']
    # the resumed run appended to the same epoch log
    lines = [json.loads(x) for x in open(tmp_path / 'split' / 'log.jsonl')]
    assert [r['epoch'] for r in lines] == [0, 1, 2]


def test_ddp_two_processes_agree(tiny_data, tmp_path):
    out = tmp_path / 'ddp'
    script = tmp_path / 'run_rank.py'
    script.write_text(
        'import json, os, sys\n'
        'from collab_vit.training.config import parse_train_args\n'
        'from collab_vit.training.trainer import train\n'
        's = train(parse_train_args(sys.argv[2:]))\n'
        'open(os.path.join(sys.argv[1], "rank%s.json" % os.environ["RANK"]), "w").write(json.dumps(s))\n')
    flags = to_flags(tiny_overrides(tiny_data, str(out), epochs=2, mixup=0.8, cutmix=1.0, repeated_aug=3,
                                    model_ema=True))
    env = {**os.environ, 'PYTHONPATH': ROOT, 'OMP_NUM_THREADS': '1'}
    proc = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                           str(script), str(tmp_path), *flags], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f'rank{r}.json').read_text()) for r in (0, 1))
    assert r0['weights_sha256'] == r1['weights_sha256']
    assert r0['top1'] == r1['top1']  # metrics are reduced across ranks
    ckpt = load_checkpoint(out / 'last.pth')
    assert len(ckpt['rng']) == 2 and ckpt['step'] == 6  # RepeatAugSampler: 12 of 24x3 per rank, batch 4, 2 epochs
    assert ckpt['config']['batch_size'] == 4


def test_missing_data_dir(tmp_path):
    with pytest.raises(DataError, match=f'data directory not found: {tmp_path / "nope"}'):
        build_dataset('', str(tmp_path / 'nope'), 'train', True)


def test_empty_data_dir(tmp_path):
    (tmp_path / 'train' / 'class_0').mkdir(parents=True)
    with pytest.raises(DataError, match=f'no images found in data directory: {tmp_path / "train"}'):
        build_dataset('', str(tmp_path), 'train', True)


def test_missing_data_dir_cli(tmp_path):
    proc = subprocess.run([sys.executable, 'train.py', '-c', 'configs/quickstart.yaml', '--dataset', '',
                           '--data-dir', str(tmp_path / 'missing'), '--output', str(tmp_path / 'run')],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f'error: data directory not found: {tmp_path / "missing"}'


def test_run_dir_not_overwritten(tiny_data, tmp_path):
    out = tmp_path / 'run'
    out.mkdir()
    (out / 'last.pth').write_bytes(b'previous results')
    with pytest.raises(ConfigError, match=f'run directory {out} already holds results'):
        train(build_config(None, tiny_overrides(tiny_data, str(out))))
    assert (out / 'last.pth').read_bytes() == b'previous results'


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / 'last.pth'
    save_checkpoint({'w': torch.ones(3)}, str(path))

    def broken_save(obj, f, *args, **kwargs):
        f.write(b'partial')
        raise OSError('disk full')

    monkeypatch.setattr(torch, 'save', broken_save)
    with pytest.raises(OSError, match='disk full'):
        save_checkpoint({'w': torch.zeros(3)}, str(path))
    assert torch.equal(load_checkpoint(path)['w'], torch.ones(3))  # the previous version is intact
    assert sorted(os.listdir(tmp_path)) == ['last.pth']  # and no temp file is left behind
    with pytest.raises(OSError):
        save_checkpoint({'w': torch.zeros(3)}, str(tmp_path / 'new.pth'))
    assert not (tmp_path / 'new.pth').exists()


def test_atomic_write_replaces(tmp_path):
    path = tmp_path / 'a.txt'
    for text in ('one', 'two'):
        atomic_write(str(path), lambda f, t=text: f.write(t.encode()))
    assert path.read_text() == 'two' and os.listdir(tmp_path) == ['a.txt']


def test_randaugment_posterize_zero_bits():
    """DeiT's RandAugment asks for 0-bit posterize at magnitude 10; with Pillow >= 13 that must not crash."""
    import numpy as np
    from PIL import Image
    from timm.data.auto_augment import rand_augment_transform

    import collab_vit.training.data  # noqa: F401  (applies the patch)
    op = rand_augment_transform('rand-n1-m10-inc1', {}).ops
    post = next(o for o in op if o.name == 'PosterizeIncreasing')
    post.prob, post.magnitude_std = 1.0, 0.0
    img = Image.fromarray(np.full((8, 8, 3), 200, dtype=np.uint8))
    assert np.asarray(post(img)).max() == 0


def test_wandb_offline_without_key(tiny_data, tmp_path, monkeypatch):
    monkeypatch.delenv('WANDB_API_KEY', raising=False)
    monkeypatch.delenv('WANDB_MODE', raising=False)
    summary = train(build_config(None, tiny_overrides(tiny_data, str(tmp_path / 'wb'), epochs=1, log_wandb=True)))
    assert summary['top1'] is not None
    assert any(d.startswith('offline-run-') for d in os.listdir(tmp_path / 'wb' / 'wandb'))


def test_wandb_failure_does_not_fail_run(tiny_data, tmp_path, monkeypatch, capsys):
    import wandb

    def broken_init(*args, **kwargs):
        raise TimeoutError('no network')

    monkeypatch.setattr(wandb, 'init', broken_init)
    summary = train(build_config(None, tiny_overrides(tiny_data, str(tmp_path / 'wb'), epochs=1, log_wandb=True)))
    assert summary['top1'] is not None
    assert 'warning: wandb disabled (TimeoutError: no network)' in capsys.readouterr().err


def test_tar_split(tiny_data, tmp_path):
    import tarfile
    for split in ('train', 'val'):
        with tarfile.open(tmp_path / f'{split}.tar', 'w') as tar:
            tar.add(os.path.join(tiny_data, split), arcname='.')
    ds = build_dataset('', str(tmp_path), 'val.tar', False)
    assert len(ds) == 12 and ds[0][1] in (0, 1, 2)


def test_finetune_from_checkpoint_loads_weights(tiny_data, tmp_path):
    """``checkpoint:`` initialises the model (here with lr 0 the weights must come out unchanged)."""
    from safetensors.torch import load_file
    first = tiny_overrides(tiny_data, str(tmp_path / 'pre'), epochs=1, model_ema=False)
    train(build_config(None, first))
    frozen = dict(lr=0.0, warmup_lr=0.0, min_lr=0.0, epochs=1, model_ema=False,
                  checkpoint=str(tmp_path / 'pre' / 'model.safetensors'))
    train(build_config(None, tiny_overrides(tiny_data, str(tmp_path / 'ft'), **frozen)))
    a, b = load_file(tmp_path / 'pre' / 'model.safetensors'), load_file(tmp_path / 'ft' / 'model.safetensors')
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_progress_in_a_log_file_is_plain_lines(tiny_data, tmp_path):
    """stdout/stderr to a file (a Slurm job, `train.py > log`): one line per log_interval updates, no bar."""
    flags = to_flags(tiny_overrides(tiny_data, str(tmp_path / 'run'), epochs=1, progress=True, log_interval=2))
    log = tmp_path / 'train.log'
    with open(log, 'w') as f:
        proc = subprocess.run([sys.executable, 'train.py', *flags], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, 'PYTHONPATH': ROOT, 'OMP_NUM_THREADS': '1'}, timeout=300)
    text = log.read_text()
    assert proc.returncode == 0, text[-2000:]
    assert '\r' not in text and 'it/s' not in text  # no tqdm bar
    progress = [line for line in text.splitlines() if line.startswith('epoch 0 [')]
    assert [line.split(']')[0] for line in progress] == ['epoch 0 [2/6', 'epoch 0 [4/6', 'epoch 0 [6/6']
    assert all(' loss ' in line and ' img/s' in line for line in progress)
