"""eval.py reproduces the top-1 recorded during training from every checkpoint format, on 1 and 2 processes."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from collab_vit.training.eval_cli import main as eval_main

from tinyrun import ROOT, TINY_KWARGS, TINY_MODEL, make_image_folder, tiny_overrides, to_flags
from tinyrun import tiny_fashion_mnist  # noqa: F401  (the fixture)


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    """A tiny model trained for 2 epochs by ``train.py`` on an ImageFolder with 15 val images (odd: DDP pads)."""
    tmp = tmp_path_factory.mktemp('eval')
    data = make_image_folder(tmp / 'data', val_per_class=5, seed=1)
    out = tmp / 'run'
    flags = to_flags(tiny_overrides(data, str(out), model_ema=True, model_ema_decay=0.5, mixup=0.0, cutmix=0.0))
    proc = subprocess.run([sys.executable, 'train.py', *flags], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'top-1' in proc.stdout and TINY_MODEL in proc.stdout  # epoch lines and the final table
    log = [json.loads(line) for line in open(out / 'log.jsonl')]
    return data, out, log[-1]


def _eval(tmp_path, *args):
    res = tmp_path / 'results.json'
    assert eval_main([*args, '--workers', '0', '--batch-size', '4', '--cpu-threads', '1', '--output', str(res)]) == 0
    return json.loads(res.read_text())


def test_eval_training_checkpoint(trained, tmp_path):
    data, out, last = trained
    r = _eval(tmp_path, '--checkpoint', str(out / 'last.pth'), '--data-dir', data)
    assert r['num_samples'] == 15 and r['model'] == TINY_MODEL
    assert r['top1'] == last['top1'] and r['top5'] == last['top5']
    assert r['loss'] == pytest.approx(last['val_loss'], rel=1e-5)


def test_no_top5_for_five_classes_or_fewer(trained, tmp_path, capsys):
    """3 classes: every label is among the top 5, so eval.py neither prints nor records a top-5 (it printed 100.00)."""
    data, out, last = trained
    capsys.readouterr()
    r = _eval(tmp_path, '--checkpoint', str(out / 'model.safetensors'), '--data-dir', data)
    printed = capsys.readouterr().out
    assert r['top5'] is None and last['top5'] is None and 'top-1' in printed and 'top-5' not in printed, printed


def test_eval_ema_weights(trained, tmp_path):
    data, out, last = trained
    r = _eval(tmp_path, '--checkpoint', str(out / 'last.pth'), '--use-ema', '--data-dir', data)
    assert r['top1'] == last['ema_top1']


def test_eval_safetensors_export(trained, tmp_path):
    data, out, last = trained
    with safe_open(str(out / 'model.safetensors'), framework='pt') as f:
        meta = f.metadata()
    assert meta['model_name'] == TINY_MODEL
    assert json.loads(meta['model_kwargs']) == {**TINY_KWARGS, 'img_size': 32, 'num_classes': 3}
    r = _eval(tmp_path, '--checkpoint', str(out / 'model.safetensors'), '--data-dir', data)  # no --model needed
    assert r['top1'] == last['top1']


def test_eval_plain_timm_pth(trained, tmp_path):
    data, out, last = trained
    plain = tmp_path / 'plain.pth'
    torch.save({'model': load_file(str(out / 'model.safetensors'))}, plain)  # DeiT's release format
    kwargs = [f'{k}={v}' for k, v in TINY_KWARGS.items()]
    r = _eval(tmp_path, '--model', TINY_MODEL, '--model-kwargs', *kwargs, '--img-size', '32', '--checkpoint',
              str(plain), '--data-dir', data)
    assert r['top1'] == last['top1']


def test_eval_torchrun_two_processes(trained, tmp_path):
    data, out, last = trained
    res = tmp_path / 'ddp.json'
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    proc = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                           'eval.py', '--checkpoint', str(out / 'last.pth'), '--data-dir', data, '--workers', '0',
                           '--batch-size', '4', '--output', str(res)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(res.read_text())
    assert r['num_samples'] == 15 and r['top1'] == last['top1']  # padding of the 15 images is not counted


def test_eval_missing_checkpoint(trained, tmp_path, capsys):
    data, _, _ = trained
    assert eval_main(['--checkpoint', str(tmp_path / 'none.pth'), '--data-dir', data]) == 2
    assert f'checkpoint not found: {tmp_path / "none.pth"}' in capsys.readouterr().err


def test_labels_outside_the_models_classes_are_one_line(trained, tmp_path):
    """A 3-class model scored on a 5-class folder: one line naming how many labels its head cannot score, exit 2,
    no --output (before: a traceback from the cross-entropy)."""
    _, out, _ = trained
    data = make_image_folder(tmp_path / 'five', classes=5, train_per_class=1, val_per_class=2)
    res = tmp_path / 'results.json'
    proc = subprocess.run([sys.executable, 'eval.py', '--checkpoint', str(out / 'last.pth'), '--data-dir', data,
                           '--workers', '0', '--cpu-threads', '1', '--output', str(res)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: 4 of 10 labels are outside the model's 3 classes (0-2): the data is not what its head was trained for"]
    assert not res.exists()


def test_grayscale_images_feed_an_rgb_model_as_timm_folders_do(tiny_fashion_mnist, tmp_path):  # noqa: F811
    """A three-channel model on ``torch/fashion_mnist`` (grayscale): ``collab-vit convert`` calibrates on it and
    ``eval.py`` scores it, each image converted to RGB as timm's ``ImageDataset`` converts a folder's images: the same
    top-1 and loss as the same images stored as grayscale PNGs in a folder (before: a traceback, a 1-channel image
    normalised with 3 means)."""
    import numpy as np
    from PIL import Image
    from torchvision.datasets import FashionMNIST

    out = tmp_path / 'k8.safetensors'
    convert = subprocess.run(
        [sys.executable, '-m', 'collab_vit.cli', 'convert', '--model', 'deit_tiny_patch16_224', '--checkpoint', 'none',
         '--model-kwargs', 'num_classes=10', 'img_size=32', 'patch_size=8', 'depth=1', '--key-dim', '8', '--out',
         str(out), '--calibration-dataset', 'torch/fashion_mnist', '--calibration-data-dir', str(tiny_fashion_mnist),
         '--calibration-images', '16', '--effort', 'fast'], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert convert.returncode == 0 and out.exists(), convert.stderr[-2000:]
    folder = tmp_path / 'png'
    test = FashionMNIST(str(tiny_fashion_mnist), train=False)
    for i, (image, label) in enumerate(test):
        (folder / 'val' / f'class_{label}').mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.asarray(image)).save(folder / 'val' / f'class_{label}' / f'{i:03d}.png')
    results = []
    for flags in (['--dataset', 'torch/fashion_mnist', '--data-dir', str(tiny_fashion_mnist)],
                  ['--data-dir', str(folder)]):
        res = tmp_path / f'{len(results)}.json'
        proc = subprocess.run([sys.executable, 'eval.py', '--checkpoint', str(out), *flags, '--workers', '0',
                               '--cpu-threads', '1', '--output', str(res)], cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        results.append(json.loads(res.read_text()))
    assert results[0]['num_samples'] == results[1]['num_samples'] == 100
    assert results[0]['top1'] == results[1]['top1']
    assert results[0]['loss'] == pytest.approx(results[1]['loss'], rel=1e-6)
