"""Bad input to train.py / eval.py / collab-vit: one line naming the problem, a non-zero exit, no traceback, and no
file written, added or overwritten (docs/faults.md lists each case and its message)."""
import copy
import json
import os
import subprocess
import sys

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file

import collab_vit
from collab_vit.cli import main as cli_main
from collab_vit.training.config import build_config
from collab_vit.training.eval_cli import main as eval_main
from collab_vit.training.trainer import main as train_main, train

from tinyrun import ROOT, TINY_KWARGS, TINY_MODEL, make_image_folder, tiny_overrides, to_flags
from test_faults import listing

SOURCE_DEIT = dict(img_size=32, patch_size=8, depth=2, embed_dim=48, num_heads=3, num_classes=3)


class Evil:
    """A pickle payload: unpickling it creates the directory ``path`` (it must never run)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


@pytest.fixture(scope='module')
def files(tmp_path_factory):
    """Data, a finished tiny run, and the bad files the tests feed in (written once)."""
    tmp = tmp_path_factory.mktemp('bad_input')
    data = make_image_folder(tmp / 'data')
    run = tmp / 'run'
    train(build_config(None, tiny_overrides(data, str(run), epochs=1, model_ema=True, model_ema_decay=0.5)))
    good = (run / 'last.pth').read_bytes()
    (tmp / 'truncated.pth').write_bytes(good[:len(good) // 2])
    weights = (run / 'model.safetensors').read_bytes()
    (tmp / 'truncated.safetensors').write_bytes(weights[:len(weights) // 2])
    torch.save({'model': load_file(run / 'model.safetensors'), 'args': Evil(tmp / 'PWNED')}, tmp / 'evil.pth')
    return {'tmp': tmp, 'data': data, 'run': run}


def expect_error(entry, argv, capsys, watched, code=2) -> str:
    """Run ``entry(argv)``; assert the exit code, one stderr line without a traceback, and that nothing under
    ``watched`` changed. Returns the message (without ``error: ``)."""
    before = listing(watched)
    assert entry([str(a) for a in argv]) == code
    err = capsys.readouterr().err.split('\r')[-1].strip()  # after eval's progress bar, which erases itself
    assert err.startswith('error: ') and '\n' not in err and 'Traceback' not in err, err
    assert listing(watched) == before, 'files were written'
    return err[len('error: '):]


def train_flags(data, output, **extra):
    return to_flags(tiny_overrides(data, str(output), **extra))


# ---- config -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('yaml_text, message', [
    ('epochs: ten', "bad value 'ten' for 'epochs'"),
    ('lr: true', "bad value True for 'lr'"),
    ('batch_size: 2.5', "bad value 2.5 for 'batch_size'"),
    ('model: [a, b]', "bad value ['a', 'b'] for 'model'"),
    ('model_kwargs: 5', "bad value 5 for 'model_kwargs'"),
    ('epochs: 0', "bad value 0 for 'epochs' in"),
    ('model_kwargs: {key_dim: 0}', "bad value 0 for 'model_kwargs.key_dim'"),
    ('model_kwargs: {key_dim: 1.5}', "bad value 1.5 for 'model_kwargs.key_dim'"),
    ('model_kwargs: {key_dim: [8, -8]}', "bad value [8, -8] for 'model_kwargs.key_dim'"),
    ('epochs: [unclosed', 'cannot parse config file'),
])
def test_bad_config_values(files, tmp_path, capsys, yaml_text, message):
    config = tmp_path / 'bad.yaml'
    config.write_text(yaml_text + '\n')
    err = expect_error(train_main, ['-c', config, '--data-dir', files['data'], '--output', tmp_path / 'out'], capsys,
                       tmp_path)
    assert message in err and str(config) in err


@pytest.mark.parametrize('flags, message', [
    (['--epochs', 'true'], "bad value True for 'epochs' in command-line flags (expected int)"),
    ({'model_kwargs': {**TINY_KWARGS, 'key_dim': [8, 8, 8]}},
     f"bad model_kwargs for '{TINY_MODEL}': key_dim list has 3 entries but the model has 2 blocks"),
    ({'model_kwargs': {**TINY_KWARGS, 'key_dimm': 8}}, f"model '{TINY_MODEL}' does not take the keyword 'key_dimm'"),
    (['--model', 'collab_deit_tiny_patch16_244'],
     "unknown model 'collab_deit_tiny_patch16_244'; did you mean 'collab_deit_tiny_patch16_224'?"),
    (['--num-classes', '5'], 'num_classes is 5 but'),
])
def test_bad_flags(files, tmp_path, capsys, flags, message):
    extra = flags if isinstance(flags, dict) else {}
    flags = [] if isinstance(flags, dict) else flags
    err = expect_error(train_main, train_flags(files['data'], tmp_path / 'out', **extra) + flags, capsys, tmp_path)
    assert message in err, err


def test_missing_config_file(tmp_path, capsys):
    err = expect_error(train_main, ['-c', tmp_path / 'nope.yaml'], capsys, tmp_path)
    assert err == f'config file not found: {tmp_path / "nope.yaml"}'


# ---- data -------------------------------------------------------------------------------------------------------

def test_missing_and_empty_data_dir(tmp_path, capsys):
    err = expect_error(train_main, train_flags(tmp_path / 'none', tmp_path / 'out'), capsys, tmp_path)
    assert err == f'data directory not found: {tmp_path / "none"}'
    (tmp_path / 'empty' / 'train').mkdir(parents=True)
    err = expect_error(train_main, train_flags(tmp_path / 'empty', tmp_path / 'out'), capsys, tmp_path)
    assert err == f'no images found in data directory: {tmp_path / "empty" / "train"}'


def test_missing_val_split(tmp_path, capsys):
    data = make_image_folder(tmp_path / 'data', train_per_class=1, val_per_class=1)
    os.rename(tmp_path / 'data' / 'val', tmp_path / 'data' / 'elsewhere')
    err = expect_error(train_main, train_flags(data, tmp_path / 'out'), capsys, tmp_path)
    assert err == f"data directory {data} has no 'validation' split folder (looked for val, valid, validation, eval, " \
                  f"evaluation; found train)"


def test_class_folders_differ(tmp_path, capsys):
    data = make_image_folder(tmp_path / 'data', train_per_class=1, val_per_class=1)
    os.rename(tmp_path / 'data' / 'val' / 'class_2', tmp_path / 'data' / 'val' / 'class_9')
    err = expect_error(train_main, train_flags(data, tmp_path / 'out'), capsys, tmp_path)
    assert err == f'class folders differ between the train and val splits of {data} (only in train: class_2; ' \
                  f'only in val: class_9)'


def damage_images(data):
    """One truncated PNG in train/class_1 and one file that is not an image at all in val/class_0."""
    truncated = os.path.join(data, 'train', 'class_1', '3.png')
    raw = open(truncated, 'rb').read()
    open(truncated, 'wb').write(raw[:len(raw) // 2])
    not_image = os.path.join(data, 'val', 'class_0', '1.png')
    open(not_image, 'w').write('not an image')
    return truncated, not_image


def test_bad_image_names_the_file(tmp_path, capsys):
    data = make_image_folder(tmp_path / 'data')
    truncated, _ = damage_images(data)
    out = tmp_path / 'out'
    err = expect_error(train_main, train_flags(data, out), capsys, tmp_path / 'data')
    assert err.startswith(f'cannot read image {truncated}: ') and err.endswith(
        '(set skip_bad_images: true to skip unreadable images)'), err
    assert sorted(os.listdir(out)) == ['config.yaml']  # the run had started: no checkpoint, nothing else
    bad_eval = expect_error(eval_main, ['--data-dir', data, '--model', TINY_MODEL, '--img-size', '32',
                                        '--num-classes', '3', '--model-kwargs', *[f'{k}={v}' for k, v in
                                                                                  TINY_KWARGS.items()],
                                        '--workers', '0'], capsys, tmp_path)
    assert bad_eval.startswith(f'cannot read image {os.path.join(data, "val", "class_0", "1.png")}: cannot identify')


def test_bad_images_skipped_and_counted_when_asked(tmp_path, capsys):
    data = make_image_folder(tmp_path / 'data')
    truncated, not_image = damage_images(data)
    out = tmp_path / 'out'
    assert train_main(train_flags(data, out, epochs=2, skip_bad_images=True)) == 0
    captured = capsys.readouterr()
    assert f'warning: skipped unreadable image {truncated}: ' in captured.err
    assert f'warning: skipped unreadable image {not_image}: ' in captured.err
    assert captured.out.count('warning: skipped 1 unreadable train and 1 val image(s) so far (skip_bad_images)') == 1
    log = [json.loads(x) for x in open(out / 'log.jsonl')]
    assert log[0]['bad_images_skipped'] == 2 and log[1]['bad_images_skipped'] == 2  # distinct files


# ---- checkpoints and weights ----------------------------------------------------------------------------------

def test_truncated_checkpoints(files, tmp_path, capsys):
    tmp, data = files['tmp'], files['data']
    err = expect_error(train_main, train_flags(data, tmp_path / 'out', checkpoint=tmp / 'truncated.pth'), capsys,
                       tmp_path)
    assert err.startswith(f'cannot read {tmp / "truncated.pth"}: truncated or not a torch checkpoint ('), err
    err = expect_error(eval_main, ['--checkpoint', tmp / 'truncated.safetensors', '--data-dir', data], capsys, tmp)
    assert err.startswith(f'cannot read {tmp / "truncated.safetensors"}: truncated or not a safetensors file'), err
    run = tmp_path / 'run'  # a run whose last.pth was cut short by something outside the trainer (a full disk)
    run.mkdir()
    (run / 'last.pth').write_bytes((tmp / 'truncated.pth').read_bytes())
    err = expect_error(train_main, train_flags(data, run) + ['--resume'], capsys, tmp_path)
    assert err.startswith(f'cannot read {run / "last.pth"}: truncated or not a torch checkpoint'), err


def test_checkpoint_of_another_key_dim_or_architecture(files, tmp_path, capsys):
    tmp, data = files['tmp'], files['data']
    weights = files['run'] / 'model.safetensors'
    err = expect_error(train_main, train_flags(data, tmp_path / 'out', checkpoint=weights,
                                               model_kwargs={**TINY_KWARGS, 'key_dim': 12}), capsys, tmp_path)
    assert err.startswith(f'weights in {weights} do not fit the model: shape mismatch: blocks.0.attn.mixing (3, 24) '
                          f'in file vs (3, 12) in model, blocks.0.attn.query.weight (24, 48) in file vs (12, 48) in '
                          f'model, blocks.0.attn.key.weight (24, 48) in file vs (12, 48) in model'), err
    err = expect_error(eval_main, ['--checkpoint', weights, '--data-dir', data, '--model',
                                   'concat_deit_tiny_patch16_224', '--img-size', '32', '--num-classes', '3', '--model-kwargs',
                                   *[f'{k}={v}' for k, v in TINY_KWARGS.items()]], capsys, tmp)
    assert err == f'weights in {weights} do not fit the model: missing: blocks.0.attn.qkv.weight, ' \
                  f'blocks.0.attn.qkv.bias, blocks.1.attn.qkv.weight, blocks.1.attn.qkv.bias; unexpected: ' \
                  f'blocks.0.attn.content_bias.weight, blocks.0.attn.key.weight, blocks.0.attn.mixing, ' \
                  f'blocks.0.attn.query.weight, blocks.0.attn.value.bias, blocks.0.attn.value.weight (+6 more)'


@pytest.mark.parametrize('where', ['train --checkpoint', 'train --resume', 'eval.py', 'collab-vit convert',
                                   'timm.create_model pretrained'])
def test_pickle_that_runs_code_is_never_loaded(files, tmp_path, capsys, where):
    """weights_only everywhere, including the torch.load that timm's load_pretrained does for a local file."""
    tmp, data = files['tmp'], files['data']
    evil = tmp / 'evil.pth'
    if where == 'train --checkpoint':
        err = expect_error(train_main, train_flags(data, tmp_path / 'out', checkpoint=evil), capsys, tmp_path)
    elif where == 'train --resume':
        (tmp_path / 'run').mkdir()
        (tmp_path / 'run' / 'last.pth').write_bytes(evil.read_bytes())
        err = expect_error(train_main, train_flags(data, tmp_path / 'run') + ['--resume'], capsys, tmp_path)
        evil = tmp_path / 'run' / 'last.pth'
    elif where == 'eval.py':
        err = expect_error(eval_main, ['--checkpoint', evil, '--data-dir', data, '--model', TINY_MODEL], capsys, tmp)
    elif where == 'collab-vit convert':
        with pytest.raises(SystemExit) as exit_info:
            cli_main(['convert', '--model', 'deit_tiny_patch16_224', '--checkpoint', str(evil), '--key-dim', '24',
                      '--out', str(tmp_path / 'x.safetensors')])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.count('\n') == 1 and 'its pickle would call posix.mkdir on load' in err and 'nothing in it was run' \
            in err
        assert not (tmp_path / 'x.safetensors').exists()
    else:
        with pytest.raises(RuntimeError, match='weights_only=True blocked loading this checkpoint'):
            timm.create_model('collab_deit_tiny_patch16_224', pretrained=True,
                              pretrained_cfg_overlay=dict(file=str(evil)))
    if where not in ('collab-vit convert', 'timm.create_model pretrained'):
        assert err == f'refusing to load {evil}: its pickle would call posix.mkdir on load (torch.load ' \
                      f'weights_only=True); nothing in it was run'
    assert not (tmp / 'PWNED').exists(), 'the pickle ran'


def test_output_dir_holding_another_run(files, tmp_path, capsys):
    data, run = files['data'], files['run']
    err = expect_error(train_main, train_flags(data, run), capsys, run)  # no --resume: results are kept
    assert err == f'run directory {run} already holds results (last.pth); pass --resume to continue it or ' \
                  f'--output NEW_DIR'
    other = {**TINY_KWARGS, 'key_dim': 12}
    err = expect_error(train_main, train_flags(data, run, model_kwargs=other) + ['--resume'], capsys, run)
    assert err == f"{run / 'last.pth'} is from another run (model_kwargs: {dict(TINY_KWARGS)!r} there, {other!r} " \
                  f"now): resume it with its own config, or choose another --output"
    started = tmp_path / 'started'  # another run that died before its first checkpoint
    started.mkdir()
    (started / 'config.yaml').write_text((run / 'config.yaml').read_text())
    err = expect_error(train_main, train_flags(data, started, model_kwargs=other), capsys, tmp_path)
    assert err.startswith(f'output directory {started} holds another run (model_kwargs: ')
    mine = tmp_path / 'photos'
    mine.mkdir()
    (mine / 'holiday.jpg').write_bytes(b'\xff\xd8')
    err = expect_error(train_main, train_flags(data, mine), capsys, tmp_path)
    assert err == f'output directory {mine} holds files that are not from a run (holiday.jpg): choose an empty or ' \
                  f'new --output'


@pytest.mark.parametrize('metadata, message', [
    ({'model_name': 'collab_deit_huge_patch16_224'}, "unknown model 'collab_deit_huge_patch16_224'; did you mean"),
    ({'model_name': TINY_MODEL, 'model_kwargs': json.dumps({**TINY_KWARGS, 'keydim': 24})},
     f"model '{TINY_MODEL}' does not take the keyword 'keydim' (model_kwargs)"),
    ({'model_name': TINY_MODEL, 'model_kwargs': '{key_dim: 24'}, "metadata 'model_kwargs' of"),
])
def test_safetensors_metadata_naming_unknown_model_or_keyword(files, tmp_path, capsys, metadata, message):
    path = tmp_path / 'odd.safetensors'
    save_file(load_file(files['run'] / 'model.safetensors'), path, metadata=metadata)
    err = expect_error(eval_main, ['--checkpoint', path, '--data-dir', files['data']], capsys, tmp_path)
    assert message in err and str(path) in err, err


def test_cli_processes_print_one_line(files, tmp_path):
    """The same through real processes: train.py and eval.py exit 2 with one line and no traceback."""
    tmp = files['tmp']
    cases = [['train.py', *train_flags(files['data'], tmp_path / 'out', model_kwargs={**TINY_KWARGS, 'key_dim': 0})],
             ['eval.py', '--checkpoint', str(tmp / 'evil.pth'), '--data-dir', files['data'], '--model', TINY_MODEL]]
    for argv in cases:
        proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env={**os.environ, 'PYTHONPATH': ROOT})
        assert proc.returncode == 2 and proc.stderr.count('\n') == 1 and proc.stderr.startswith('error: '), proc.stderr
    assert sorted(os.listdir(tmp_path)) == [] and not (tmp / 'PWNED').exists()


# ---- a standard DeiT .pth as start weights of a collaborative model (converted on load) -------------------------

def test_standard_deit_checkpoint_converted_like_pretrained(tmp_path, monkeypatch):
    """--checkpoint deit.pth with a collab_* model converts the qkv weights exactly as pretrained=True does."""
    monkeypatch.setenv('TORCH_HOME', str(tmp_path / 'torch_home'))
    torch.manual_seed(0)
    source = timm.create_model('deit_tiny_patch16_224', **SOURCE_DEIT)
    with torch.no_grad():
        for name, p in source.named_parameters():
            if 'attn.qkv' in name:
                p.normal_(0, 0.3)
    deit = tmp_path / 'deit_tiny.pth'
    torch.save({'model': source.state_dict()}, deit)  # DeiT's release layout
    expected = collab_vit.reparametrize(copy.deepcopy(source), key_dim=24).state_dict()

    data = make_image_folder(tmp_path / 'data', train_per_class=4, val_per_class=2)
    frozen = dict(lr=0.0, warmup_lr=0.0, min_lr=0.0, epochs=1, model_ema=False, checkpoint=str(deit))
    train(build_config(None, tiny_overrides(data, str(tmp_path / 'ft'), **frozen)))
    got = load_file(tmp_path / 'ft' / 'model.safetensors')
    assert got.keys() == expected.keys()
    for key in got:
        assert torch.equal(got[key], expected[key]), key

    results = tmp_path / 'eval.json'
    kwargs = [f'{k}={v}' for k, v in TINY_KWARGS.items()]
    # the .pth alone is evaluated as timm evaluates DeiT weights (crop 0.9); the export records train.py's 0.875
    assert eval_main(['--model', TINY_MODEL, '--model-kwargs', *kwargs, '--img-size', '32', '--checkpoint', str(deit),
                      '--crop-pct', '0.875', '--data-dir', data, '--workers', '0', '--output', str(results)]) == 0
    reference = tmp_path / 'reference.json'
    assert eval_main(['--checkpoint', str(tmp_path / 'ft' / 'model.safetensors'), '--data-dir', data, '--workers',
                      '0', '--output', str(reference)]) == 0
    a, b = json.loads(results.read_text()), json.loads(reference.read_text())
    assert a['data_config'] == b['data_config']
    assert a['top1'] == b['top1'] and a['loss'] == pytest.approx(b['loss'], rel=1e-6)
