"""Every file and folder the package writes has the mode the umask gives (files 0666 & ~umask, folders 0777 & ~umask),
whatever the writer library does with its temp files (safetensors' ``save_file`` replaces the file it is given;
``mkstemp`` / ``mkdtemp`` make 0600 / 0700): one test per writer, under umask 022 and 077."""
from __future__ import annotations

import gzip
import os

import pytest
import timm
import torch

from collab_vit.cli import main as cli_main
from collab_vit.training.checkpoint import save_checkpoint
from collab_vit.training.config import build_config
from collab_vit.training.datasets import FILES, SIZES, ensure_digits, prepare_fashion_mnist
from collab_vit.training.trainer import train
from collab_vit.weights_io import export_safetensors
from tinyrun import tiny_data, tiny_overrides  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

KWARGS = dict(img_size=16, patch_size=4, depth=2, embed_dim=24, num_heads=3, num_classes=3)


@pytest.fixture(params=[0o022, 0o077], ids=['umask022', 'umask077'])
def umask(request):
    before = os.umask(request.param)
    yield request.param
    os.umask(before)


def modes(root, mask: int) -> dict:
    """Every path under ``root`` (``root`` too) whose mode is not the umask's: {relative path: oct mode}."""
    wrong = {}
    for path in [str(root)] + [os.path.join(d, n) for d, dirs, files in os.walk(root) for n in dirs + files]:
        want = (0o777 if os.path.isdir(path) else 0o666) & ~mask
        have = os.stat(path).st_mode & 0o777
        if have != want:
            wrong[os.path.relpath(path, root)] = f'{have:o} (want {want:o})'
    return wrong


def source_file(folder) -> str:
    torch.manual_seed(0)
    path = folder / 'source.safetensors'
    export_safetensors(timm.create_model('deit_tiny_patch16_224', **KWARGS).state_dict(), str(path),
                       'deit_tiny_patch16_224', KWARGS)
    return str(path)


def test_training_run_files(umask, tiny_data, tmp_path):  # noqa: F811
    """train.py's run folder: config.yaml, log.jsonl, last/best/epoch checkpoints, model.safetensors (the issue's
    0600 export), model_ema.safetensors."""
    out = tmp_path / 'run'
    train(build_config(None, tiny_overrides(tiny_data, str(out), epochs=1, checkpoint_every=1, model_ema=True)))
    assert {'model.safetensors', 'last.pth', 'config.yaml', 'log.jsonl'} <= set(os.listdir(out))
    assert modes(out, umask) == {}


def test_checkpoint_and_export(umask, tmp_path):
    save_checkpoint({'w': torch.ones(3)}, str(tmp_path / 'out' / 'last.pth'))
    export_safetensors({'w': torch.ones(3)}, str(tmp_path / 'out' / 'model.safetensors'), 'm', {})
    assert modes(tmp_path / 'out', umask) == {}


@pytest.mark.parametrize('out', ['k6.safetensors', 'k6'])
def test_convert_file_and_folder(umask, out, tmp_path):
    source = source_file(tmp_path)
    target = tmp_path / 'converted' / out
    target.parent.mkdir()  # convert writes into a folder that exists (a missing one is refused)
    assert cli_main(['convert', '--checkpoint', source, '--key-dim', '6', '--out', str(target)]) == 0
    assert modes(tmp_path / 'converted', umask) == {}


def test_save_pretrained(umask, tmp_path):
    import collab_vit
    model = timm.create_model('collab_deit_tiny_patch16_224', key_dim=12, **KWARGS)
    collab_vit.save_pretrained(model, str(tmp_path / 'hub' / 'm'))
    assert sorted(os.listdir(tmp_path / 'hub' / 'm')) == ['config.json', 'model.safetensors']
    assert modes(tmp_path / 'hub', umask) == {}


def test_spectrum_plot(umask, tmp_path):
    assert cli_main(['analyze', '--checkpoint', source_file(tmp_path), '--out', str(tmp_path / 'plots')]) == 0
    assert sorted(os.listdir(tmp_path / 'plots')) == ['spectrum.md', 'spectrum.png']
    assert modes(tmp_path / 'plots', umask) == {}


def test_data_preparation(umask, tmp_path):
    """The digits (a staged folder renamed into place) and Fashion-MNIST's files (prepare-data)."""
    ensure_digits(str(tmp_path / 'data' / 'digits'), size=8)
    source = tmp_path / 'idx'
    source.mkdir()
    for name in FILES:
        with gzip.open(source / f'{name}.gz', 'wb', compresslevel=1) as f:
            f.write(b'\0' * SIZES[name])
    prepare_fashion_mnist(str(tmp_path / 'data' / 'fm'), str(source))
    assert modes(tmp_path / 'data', umask) == {}
