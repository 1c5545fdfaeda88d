"""Every write survives a full disk: a one-line error naming the path and the lack of space, a non-zero exit, the
previous file as it was (it still loads), no temp file or half folder left behind.

Each case runs on a real full disk (a filled tmpfs; skipped where mounting is impossible, saying so) and with an
``OSError(ENOSPC)`` / ``OSError(EDQUOT)`` injected at the write (``faultfs.disk_full_after``)."""
from __future__ import annotations

import contextlib
import gzip
import json
import os
import re

import pytest
import timm
import torch

from collab_vit.cli import main as cli_main
from collab_vit.training.checkpoint import load_checkpoint, save_checkpoint
from collab_vit.training.config import build_config, save_config
from collab_vit.training.datasets import FILES, SIZES, ensure_digits
from collab_vit.training.runlog import RunLogger
from collab_vit.weights_io import WriteError, export_safetensors, read_weights
from faultfs import disk_full_after, fill, listing, small_tmpfs
from tinyrun import make_image_folder, tiny_data, tiny_overrides, to_flags  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

KWARGS = dict(img_size=16, patch_size=4, depth=2, embed_dim=24, num_heads=3, num_classes=3)
REASON = {'tmpfs': 'no space left on device', 'ENOSPC': 'no space left on device', 'EDQUOT': 'disk quota exceeded'}


class Disk:
    """A folder on the disk under test; ``full()`` makes it full for the block."""

    def __init__(self, folder, kind: str) -> None:
        self.folder, self.kind, self.reason = folder, kind, REASON[kind]
        folder.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def full(self):
        if self.kind == 'tmpfs':
            fill(self.folder, leave=0)
            try:
                yield
            finally:
                os.remove(self.folder / '.filler')
        else:
            import errno
            with disk_full_after(0, getattr(errno, self.kind), self.folder):
                yield


@pytest.fixture(params=list(REASON))
def disk(request, tmp_path):
    if request.param == 'tmpfs':
        with small_tmpfs(tmp_path / 'fs', '1m') as folder:
            yield Disk(folder, 'tmpfs')
    else:
        yield Disk(tmp_path / 'fs', request.param)


def source_file(folder) -> str:
    torch.manual_seed(0)
    model = timm.create_model('deit_tiny_patch16_224', **KWARGS).eval()
    path = folder / 'source.safetensors'
    export_safetensors(model.state_dict(), str(path), 'deit_tiny_patch16_224', KWARGS,
                       {'data_config': {'input_size': [3, 16, 16], 'mean': [0.5] * 3, 'std': [0.25] * 3,
                                        'crop_pct': 1.0, 'interpolation': 'bicubic', 'crop_mode': 'center'}})
    return str(path)


def one_line_error(capsys, code: int, expected_code: int, path) -> str:
    """The one line on stderr besides the progress (tqdm's bars, or the plain lines of ``console.Lines`` where
    stderr is not a terminal)."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines()
             if line.strip() and '%|' not in line and not re.search(r': \d+/\d+, \d+ s, ETA ', line)]
    assert code == expected_code and len(lines) == 1 and 'Traceback' not in err, err
    assert str(os.path.abspath(path)) in lines[0], err
    return lines[0]


def test_checkpoint_on_a_full_disk(disk):
    """The issue's case: torch.save reports a full disk as ``RuntimeError: ... unexpected pos``; here it is one line
    naming the path, and the previous checkpoint loads."""
    path = disk.folder / 'last.pth'
    save_checkpoint({'w': torch.ones(3)}, str(path))
    with disk.full(), pytest.raises(WriteError) as error:
        save_checkpoint({'w': torch.zeros(1 << 18)}, str(path))
    assert str(error.value).startswith(f'{disk.reason} writing {path}'), error.value
    assert torch.equal(load_checkpoint(path)['w'], torch.ones(3))
    assert sorted(os.listdir(disk.folder)) == ['last.pth']


@pytest.mark.parametrize('writer', ['safetensors', 'config', 'log'])
def test_training_files_on_a_full_disk(disk, writer, tmp_path):
    """The export, config.yaml and log.jsonl: the previous file is as it was (log: no half line appended)."""
    target = disk.folder / {'safetensors': 'model.safetensors', 'config': 'config.yaml', 'log': 'log.jsonl'}[writer]
    cfg = build_config(None, tiny_overrides(str(tmp_path), str(disk.folder)))
    logger = RunLogger(str(disk.folder), True, {})

    def write(size: int) -> None:
        if writer == 'safetensors':
            export_safetensors({'w': torch.zeros(size)}, str(target), 'm', {})
        elif writer == 'config':
            cfg.experiment = 'x' * size
            save_config(cfg, str(target))
        else:
            logger.log_epoch({'epoch': 0, 'train_loss': 1.0, 'lr': 0.1, 'img_per_s': 1.0, 'epoch_time': 1.0,
                              'note': 'x' * size})
    write(3)
    before = listing(disk.folder)
    with disk.full(), pytest.raises(WriteError, match=f'^{disk.reason} writing {target}'):
        write(1 << 18)
    assert listing(disk.folder) == before


@pytest.mark.parametrize('out', ['k6.safetensors', 'k6'])
def test_convert_on_a_full_disk(disk, out, tmp_path, capsys):
    """``collab-vit convert``: a file with its sidecar, or a hub folder, written all or none."""
    source = source_file(tmp_path)
    target = disk.folder / out
    assert cli_main(['convert', '--checkpoint', source, '--key-dim', '8', '--out', str(target)]) == 0
    before = listing(disk.folder)
    capsys.readouterr()
    with disk.full(), pytest.raises(SystemExit) as exit_info:
        cli_main(['convert', '--checkpoint', source, '--key-dim', '6', '--out', str(target)])
    err = one_line_error(capsys, exit_info.value.code, 1, target)
    assert disk.reason in err
    assert listing(disk.folder) == before  # the earlier output as it was, no temp file or staging folder
    assert read_weights(str(target))[1]['model_kwargs']['key_dim'] in (8, [8, 8])  # the earlier output loads


def test_analyze_plot_on_a_full_disk(disk, tmp_path, capsys):
    source = source_file(tmp_path)
    out = disk.folder / 'spectrum'
    with disk.full(), pytest.raises(SystemExit) as exit_info:
        cli_main(['analyze', '--checkpoint', source, '--out', str(out)])
    assert disk.reason in one_line_error(capsys, exit_info.value.code, 1, out)
    assert listing(disk.folder) == {}


def test_eval_output_on_a_full_disk(disk, tmp_path, capsys):
    from collab_vit.training.eval_cli import main as eval_main
    data = make_image_folder(tmp_path / 'data', classes=3, train_per_class=1, val_per_class=2, size=16)
    output = disk.folder / 'results.json'
    output.write_text('{"previous": true}')
    with disk.full():
        code = eval_main(['--checkpoint', source_file(tmp_path), '--data-dir', data, '--output', str(output),
                          '--workers', '0', '--device', 'cpu'])
    assert disk.reason in one_line_error(capsys, code, 1, output)
    assert json.loads(output.read_text()) == {'previous': True} and os.listdir(disk.folder) == ['results.json']


def test_data_preparation_on_a_full_disk(disk, tmp_path, capsys):
    """The digits (a staged folder) and ``collab-vit prepare-data`` (Fashion-MNIST's files): nothing left behind."""
    if disk.kind != 'tmpfs':  # PIL writes the PNGs through its own files: inject at its save
        from PIL import Image

        def no_space(*args, **kwargs):
            raise OSError(getattr(__import__('errno'), disk.kind), 'injected')
        patch = pytest.MonkeyPatch()
        patch.setattr(Image.Image, 'save', no_space)
    else:
        patch = None
    try:
        with disk.full(), pytest.raises(WriteError, match=f'^{disk.reason} writing {disk.folder / "digits"}$'):
            ensure_digits(str(disk.folder / 'digits'), size=8)
    finally:
        if patch is not None:
            patch.undo()
    assert listing(disk.folder) == {}
    source = tmp_path / 'idx'
    source.mkdir()
    for name in FILES:
        with gzip.open(source / f'{name}.gz', 'wb', compresslevel=1) as f:
            f.write(b'\0' * SIZES[name])
    with disk.full(), pytest.raises(SystemExit) as exit_info:
        cli_main(['prepare-data', 'fashion_mnist', '--root', str(disk.folder / 'fm'), '--source', str(source)])
    err = one_line_error(capsys, exit_info.value.code, 1, disk.folder / 'fm' / 'FashionMNIST' / 'raw' / FILES[0])
    assert disk.reason in err and listing(disk.folder) == {}


def test_train_py_on_a_full_disk(tmp_path, tiny_data, capsys):
    """The issue's case with a tiny model: train.py's output on a tmpfs with room for the first epoch's files only.
    Exit 1, one line naming last.pth and the lack of space; the epoch-0 checkpoint loads; no temp file."""
    from collab_vit.training.trainer import main as train_main
    overrides = tiny_overrides(tiny_data, '', epochs=3)
    run = tmp_path / 'probe'  # how much the first epoch writes, on a plain disk
    assert train_main(to_flags({**overrides, 'output': str(run), 'epochs': 1})) == 0
    first = sum(os.path.getsize(run / f) for f in os.listdir(run))
    size = (first + os.path.getsize(run / 'last.pth') // 2) // 4096 * 4096
    with small_tmpfs(tmp_path / 'fs', str(size)) as folder:
        out = folder / 'run'
        capsys.readouterr()
        code = train_main(to_flags({**overrides, 'output': str(out)}))
        err = one_line_error(capsys, code, 1, out / 'last.pth')
        assert err == f'error: no space left on device writing {out}/last.pth (the previous file is kept)', err
        assert load_checkpoint(out / 'last.pth')['epoch'] == 0
        assert not [f for f in os.listdir(out) if f.startswith('.')]
