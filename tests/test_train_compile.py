"""``train.py --torchcompile [BACKEND]``: timm's spelling and default (the flag alone is ``inductor``), a
YAML key as every flag; the model compiled after its EMA as timm's train.py does, so checkpoints, the EMA and the
exported weights keep plain parameter names and a run resumes without compiling.

The training run uses the ``aot_eager`` backend: inductor compiles the same tiny model on this 2-core machine in
about 150 s (C++ code generation), aot_eager in seconds; the order of compile, EMA and checkpoints is the same."""
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from collab_vit.training.build import build_model
from collab_vit.training.checkpoint import load_checkpoint
from collab_vit.training.config import ConfigError, build_config, parse_flags
from collab_vit.training.trainer import train

from tinyrun import ROOT, TINY_KWARGS, TINY_MODEL, tiny_data, tiny_overrides, to_flags  # noqa: F401  (a fixture)


def test_flag_alone_is_inductor_as_in_timm(tmp_path):
    assert parse_flags(['--torchcompile'])[1] == {'torchcompile': 'inductor'}
    assert parse_flags(['--torchcompile', 'aot_eager', '--epochs', '3'])[1] == {'torchcompile': 'aot_eager',
                                                                                 'epochs': 3}
    assert parse_flags(['--torchcompile', '--epochs', '3'])[1] == {'torchcompile': 'inductor', 'epochs': 3}
    assert build_config().torchcompile == ''  # eager unless asked
    config = tmp_path / 'c.yaml'
    config.write_text('torchcompile: aot_eager\n')
    assert build_config(str(config)).torchcompile == 'aot_eager'


def test_unknown_backend_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^bad value 'inductr' for 'torchcompile' in overrides \(expected a "
                                          r"torch.compile backend: .*inductor.*\)$"):
        build_config(None, {'torchcompile': 'inductr'})


def test_compiled_run_resumes_eagerly_with_plain_names(tiny_data, tmp_path):
    """train.py --torchcompile aot_eager for one epoch (a subprocess), then the same run resumed without compiling:
    the checkpoint's model, EMA and optimizer load as they are, and every saved or exported name is the model's own."""
    out = tmp_path / 'run'
    flags = to_flags(tiny_overrides(tiny_data, str(out), stop_after=1, model_ema=True, model_ema_decay=0.9))
    proc = subprocess.run([sys.executable, 'train.py', *flags, '--torchcompile', 'aot_eager'], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, 'PYTHONPATH': ROOT, 'OMP_NUM_THREADS': '1'})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'torch.compile (backend aot_eager)' in proc.stdout + proc.stderr
    plain = set(build_model(TINY_MODEL, 3, 32, 0.0, TINY_KWARGS).state_dict())
    ckpt = load_checkpoint(out / 'last.pth')
    assert ckpt['config']['torchcompile'] == 'aot_eager' and ckpt['epoch'] == 0
    assert set(ckpt['model']) == set(ckpt['model_ema']) == plain

    train(build_config(None, tiny_overrides(tiny_data, str(out), resume=True, model_ema=True, model_ema_decay=0.9)))
    final = load_checkpoint(out / 'last.pth')
    assert final['epoch'] == 1 and final['config']['torchcompile'] == '' and set(final['model']) == plain
    for name in ('model.safetensors', 'model_ema.safetensors'):
        assert set(load_file(out / name)) == plain, name
    assert not any(torch.equal(ckpt['model'][k], final['model'][k]) for k in ('head.weight', 'cls_token'))
