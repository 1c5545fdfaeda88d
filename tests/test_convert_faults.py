"""``collab-vit convert`` under bad input and faults: one line, a non-zero exit, no traceback, and no output that
timm would load as a model (nothing written, or the earlier output as it was; other files untouched)."""
from __future__ import annotations

import os
import re
import signal

import pytest
import timm
import torch

from collab_vit import weights_io
from collab_vit.conversion.calibration import state
from collab_vit.cli import main as cli_main
from collab_vit.training import data as training_data
from collab_vit.weights_io import export_safetensors, read_weights
from faultfs import listing
from tinyrun import make_image_folder

pytestmark = pytest.mark.usefixtures("one_thread")

KWARGS = dict(img_size=16, patch_size=4, depth=2, embed_dim=24, num_heads=3, num_classes=3)  # full rank 24


@pytest.fixture
def work(tmp_path):
    """A folder with a tiny source file and a tiny ImageFolder of PNGs; the test's outputs go into ``out/``."""
    torch.manual_seed(0)
    model = timm.create_model('deit_tiny_patch16_224', **KWARGS).eval()
    pipeline = {'input_size': [3, 16, 16], 'mean': [0.5] * 3, 'std': [0.25] * 3, 'crop_pct': 1.0,
                'interpolation': 'bicubic', 'crop_mode': 'center'}
    export_safetensors(model.state_dict(), str(tmp_path / 'source.safetensors'), 'deit_tiny_patch16_224', KWARGS,
                       {'data_config': pipeline})
    make_image_folder(tmp_path / 'data', classes=2, train_per_class=4, val_per_class=1, size=16)
    (tmp_path / 'out').mkdir()
    return tmp_path


def convert(work, *flags: str) -> list:
    return ['convert', '--checkpoint', str(work / 'source.safetensors'), *flags]


def one_line(capsys, args: list, code: int) -> str:
    """Run the CLI, expecting exit ``code`` and one line on stderr besides tqdm's progress bars."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        cli_main(args)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines()
             if line.strip() and '%|' not in line and not re.search(r': \d+/\d+, \d+ s, ETA ', line)]
    assert exit_info.value.code == code and len(lines) == 1 and 'Traceback' not in err, err
    return lines[0]


@pytest.mark.parametrize('key_dim, message', [
    ('0', 'key_dim must be a positive integer, got 0'),
    ('-3', 'key_dim must be a positive integer, got -3'),
    ('25', '--key-dim 25 is beyond the full rank 24 of blocks.0.attn (num_heads x head_dim)'),
    ('8,30', '--key-dim 30 is beyond the full rank 24 of blocks.1.attn'),
])
def test_bad_key_dim(work, capsys, key_dim, message):
    line = one_line(capsys, convert(work, '--key-dim', key_dim, '--out', str(work / 'out' / 'k.safetensors')), 2)
    assert message in line, line
    assert listing(work / 'out') == {}


def test_empty_or_unreadable_calibration_folder(work, capsys, monkeypatch):
    out = work / 'out' / 'k.safetensors'
    (work / 'empty' / 'train').mkdir(parents=True)
    line = one_line(capsys, convert(work, '--key-dim', '6', '--out', str(out), '--calibration-data-dir',
                                    str(work / 'empty')), 2)
    assert f'no images found in data directory: {work / "empty" / "train"}' in line, line
    # a folder the user may not read (tests run as root, whom permissions do not stop: the kernel's answer is
    # injected at os.scandir, which os.walk and timm's folder reader use)
    real_scandir = os.scandir

    def scandir(path='.'):
        if str(path).startswith(str(work / 'data' / 'train')):
            raise PermissionError(13, 'Permission denied', str(path))
        return real_scandir(path)
    monkeypatch.setattr(os, 'scandir', scandir)
    line = one_line(capsys, convert(work, '--key-dim', '6', '--out', str(out), '--calibration-data-dir',
                                    str(work / 'data')), 2)
    assert f'cannot read data directory {work / "data" / "train"}: Permission denied' in line, line
    assert listing(work / 'out') == {}


def test_corrupt_image_among_good_ones_stops_naming_it(work, capsys):
    """Decision: the conversion stops, naming the file (skipping it would change the seeded draw of calibration
    images that the output records)."""
    bad = work / 'data' / 'train' / 'class_1' / 'broken.png'
    bad.write_bytes(b'\x89PNG\r\n\x1a\n' + b'\0' * 40)
    line = one_line(capsys, convert(work, '--key-dim', '6', '--out', str(work / 'out' / 'k.safetensors'),
                                    '--calibration-data-dir', str(work / 'data'), '--calibration-images', '9'), 2)
    assert f'cannot read image {bad}: ' in line and 'remove or replace it' in line, line
    assert listing(work / 'out') == {}


def test_out_folder_holding_other_files_is_refused(work, capsys):
    """Decision: a non-empty --out folder that is not an earlier output of this package is refused before any work;
    its files stay as they were. An earlier output is replaced whole."""
    folder = work / 'out' / 'photos'
    folder.mkdir()
    (folder / 'holiday.jpg').write_bytes(b'jpeg')
    (folder / 'config.json').write_text('{"mine": 1}')
    before = listing(work / 'out')
    line = one_line(capsys, convert(work, '--key-dim', '6', '--out', str(folder)), 2)
    assert f'{folder} holds files that are not an earlier output (holiday.jpg): choose an empty or new' in line, line
    assert listing(work / 'out') == before
    earlier = work / 'out' / 'k'
    assert cli_main(convert(work, '--key-dim', '8', '--out', str(earlier))) == 0
    assert cli_main(convert(work, '--key-dim', '6', '--out', str(earlier))) == 0  # replaced
    assert sorted(os.listdir(earlier)) == ['config.json', 'conversion.json', 'model.safetensors']
    assert read_weights(str(earlier))[1]['model_kwargs']['key_dim'] in (6, [6, 6])
    assert not [f for f in os.listdir(work / 'out') if f.startswith('.')]


@pytest.mark.parametrize('signum, code, at, out', [
    (signal.SIGINT, 130, 'calibration', 'k.safetensors'),
    (signal.SIGTERM, 143, 'calibration', 'k'),
    (signal.SIGTERM, 143, 'write', 'k'),
    (signal.SIGINT, 130, 'write', 'k.safetensors'),
])
def test_signal_during_a_calibrated_conversion(work, capsys, monkeypatch, signum, code, at, out):
    """SIGINT / SIGTERM while the calibration images are read, or while the output is written: exit 130 / 143, one
    line, nothing timm would load (no file, no folder, no temp or staging folder); an earlier output is kept."""
    earlier = work / 'out' / 'earlier'
    assert cli_main(convert(work, '--key-dim', '8', '--out', str(earlier))) == 0
    before, handler = listing(work / 'out'), signal.getsignal(signal.SIGTERM)
    calls = [0]

    def deliver() -> None:
        calls[0] += 1
        if calls[0] == 3:
            os.kill(os.getpid(), signum)
    if at == 'calibration':
        real_getitem = training_data.CheckedImageDataset.__getitem__

        def getitem(self, index):
            deliver()
            return real_getitem(self, index)
        monkeypatch.setattr(training_data.CheckedImageDataset, '__getitem__', getitem)
    else:
        real_commit, real_state_write = weights_io._RecordingFile.commit, state.atomic_write
        in_state = [False]

        def state_write(*args):  # the refinement's own state (``<out>.partial``) is not the output
            in_state[0] = True
            try:
                return real_state_write(*args)
            finally:
                in_state[0] = False

        def commit(self):
            if not in_state[0]:
                calls[0] = 2  # the output's first file's commit
                deliver()
            return real_commit(self)
        monkeypatch.setattr(weights_io._RecordingFile, 'commit', commit)
        monkeypatch.setattr(state, 'atomic_write', state_write)
    line = one_line(capsys, convert(work, '--key-dim', '6', '--out', str(work / 'out' / out),
                                    '--calibration-data-dir', str(work / 'data'), '--calibration-images', '8'), code)
    assert line == f'collab-vit convert: {"interrupted (SIGINT)" if code == 130 else "terminated (SIGTERM)"}', line
    after = listing(work / 'out')
    kept = {path for path in after if f'{out}.partial' in path}  # the refinement's committed layers: a rerun resumes
    assert {path: v for path, v in after.items() if path not in kept} == before
    assert not [path for path in kept if path.endswith('.bin')]  # its scratch files are gone
    assert signal.getsignal(signal.SIGTERM) == handler  # put back
