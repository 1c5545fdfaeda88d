"""Configs: every shipped YAML loads and builds its model; unknown keys fail with a suggestion; overrides are typed."""
import glob
import os

import pytest
import torch

from collab_vit.training.build import build_model as create_model
from collab_vit.training.config import ConfigError, build_config, save_config
from collab_vit.training.config import parse_overrides, parse_train_args
from timm.optim import create_optimizer_v2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, 'configs', '*.yaml')))
TINY = {'depth': 1, 'patch_size': 16}  # shrink every model to one block at 32 px for a fast build


def test_configs_exist():
    names = {os.path.basename(p) for p in CONFIGS}
    expected = {'_base_deit.yaml', 'quickstart.yaml', 'finetune_converted.yaml', 'deit_base.yaml',
                'deit_small.yaml', 'deit_tiny.yaml', 'deit_base_concat_k384.yaml', 'deit_base_concat_k192.yaml'}
    expected |= {f'deit_base_collab_k{k}.yaml' for k in (768, 384, 192)}
    expected |= {f'deit_small_collab_k{k}.yaml' for k in (384, 192, 96)}
    expected |= {f'deit_tiny_collab_k{k}.yaml' for k in (192, 96, 48)}
    assert expected <= names, sorted(expected - names)


@pytest.mark.parametrize('path', CONFIGS, ids=os.path.basename)
def test_config_loads_and_model_builds(path):
    cfg = build_config(path)
    kwargs = {**cfg.model_kwargs, **TINY}
    model = create_model(cfg.model, num_classes=10, img_size=32, drop_path=cfg.drop_path, model_kwargs=kwargs)
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10)


def test_base_recipe_values():
    cfg = build_config(os.path.join(ROOT, 'configs', 'deit_base_collab_k384.yaml'))
    assert (cfg.lr, cfg.weight_decay, cfg.opt_eps, cfg.warmup_epochs, cfg.warmup_lr, cfg.min_lr) == \
        (5e-4, 0.05, 1e-8, 5, 1e-6, 1e-5)
    assert (cfg.mixup, cfg.cutmix, cfg.mixup_switch_prob, cfg.smoothing, cfg.reprob) == (0.8, 1.0, 0.5, 0.1, 0.25)
    assert (cfg.aa, cfg.repeated_aug, cfg.model_ema_decay, cfg.crop_pct) == ('rand-m9-mstd0.5-inc1', 3, 0.99996, 0.875)


def test_misspelt_key_in_yaml(tmp_path):
    path = tmp_path / 'bad.yaml'
    path.write_text(f'base: {os.path.join(ROOT, "configs", "_base_deit.yaml")}\nwarmup_epoch: 3\n')
    with pytest.raises(ConfigError, match=r"unknown config key 'warmup_epoch'.*did you mean 'warmup_epochs'"):
        build_config(str(path))


def test_misspelt_key_as_flag():
    with pytest.raises(ConfigError, match=r"unknown config key 'wieght_decay'.*did you mean 'weight_decay'"):
        parse_train_args(['-c', os.path.join(ROOT, 'configs', 'quickstart.yaml'), '--wieght-decay', '0.1'])


def test_misspelt_flag_cli_message(tmp_path):
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, os.path.join(ROOT, 'train.py'), '-c', 'configs/quickstart.yaml',
                           '--bach-size', '8'], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "'bach_size'" in lines[0] and "did you mean 'batch_size'" in lines[0], proc.stderr


def test_overrides_are_typed_and_merge(tmp_path):
    o = parse_overrides(['--lr', '1e-3', '--epochs=7', '--resume', '--model-kwargs', 'key_dim=96', '--aa', '',
                         '--scale', '0.5', '1.0', '--log-wandb', 'false'])
    cfg = build_config(os.path.join(ROOT, 'configs', 'quickstart.yaml'), o)
    assert cfg.lr == 1e-3 and cfg.epochs == 7 and cfg.resume is True and cfg.log_wandb is False
    assert cfg.scale == (0.5, 1.0) and cfg.aa == ''
    assert cfg.model_kwargs['key_dim'] == 96 and cfg.model_kwargs['depth'] == 4  # merged with the YAML's dict
    with pytest.raises(ConfigError, match="bad value 'many' for 'epochs'"):
        build_config(None, {'epochs': 'many'})


def test_base_inheritance_and_saved_config_roundtrip(tmp_path):
    child = tmp_path / 'child.yaml'
    child.write_text(f'base: {os.path.relpath(os.path.join(ROOT, "configs", "quickstart.yaml"), tmp_path)}\n'
                     'epochs: 3\nmodel_kwargs: {key_dim: 24}\n')
    cfg = build_config(str(child))
    assert cfg.epochs == 3 and cfg.num_classes == 10 and cfg.model_kwargs['key_dim'] == 24
    save_config(cfg, str(tmp_path / 'config.yaml'))
    assert build_config(str(tmp_path / 'config.yaml')) == cfg


def test_no_weight_decay_groups():
    model = create_model('collab_deit_tiny_patch16_224', 10, 32, 0.0, {'key_dim': 24, 'patch_size': 8, 'depth': 1,
                                                                        'embed_dim': 48, 'num_heads': 3})
    assert model.blocks[0].attn.mixing.ndim == 2  # a matrix: the 1-D rule alone would decay it
    for layer_decay in (None, 0.75):  # timm's own optimizer factory, with and without layer-wise lr decay
        groups = create_optimizer_v2(model, 'adamw', lr=1e-3, weight_decay=0.05, layer_decay=layer_decay).param_groups
        no_decay = {id(p) for g in groups if g['weight_decay'] == 0 for p in g['params']}
        names = {n for n, p in model.named_parameters() if id(p) in no_decay}
        assert {'pos_embed', 'cls_token', 'blocks.0.attn.mixing', 'blocks.0.norm1.weight', 'head.bias'} <= names
        assert 'blocks.0.attn.query.weight' not in names and 'head.weight' not in names


@pytest.mark.parametrize('command', [['train.py'], ['eval.py'], ['-m', 'collab_vit.cli']])
def test_help_exits_zero_and_lists_options(command):
    import subprocess
    import sys
    result = subprocess.run([sys.executable, *command, '--help'], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith('usage:') and not result.stderr
    if command == ['train.py']:
        from collab_vit.training.config import FIELDS
        for key in FIELDS:  # every key, with its default, in its group
            assert '--' + key.replace('_', '-') in result.stdout
        for group in ('model:', 'data:', 'augmentation:', 'optimizer:', 'scheduler:', 'EMA:'):
            assert group in result.stdout


def test_every_key_has_help_in_one_group():
    from collab_vit.training.config import FIELDS
    from collab_vit.training.config import GROUPS
    keys = [k for group in GROUPS.values() for k in group]
    assert sorted(keys) == sorted(FIELDS) and len(keys) == len(set(keys))


def test_timm_spellings_and_no_flags():
    ours = parse_overrides(['--num-workers', '3', '--accum-steps', '2', '--repeated-aug', '0', '--pin-memory', 'false',
                            '--checkpoint', 'w.pth', '--batch-size', '16', '--persistent-workers', 'false'])
    timm_style = parse_overrides(['-j', '3', '--grad-accum-steps', '2', '--aug-repeats', '0', '--no-pin-mem',
                                  '--initial-checkpoint', 'w.pth', '-b', '16', '--no-persistent-workers'])
    assert build_config(None, ours) == build_config(None, timm_style)
    assert parse_overrides(['--model_kwargs', 'key_dim=8', '--no-model-ema']) == {'model_kwargs': {'key_dim': 8},
                                                                                   'model_ema': 'false'}
    with pytest.raises(ConfigError, match="unknown config key 'workerz'.*'num_workers'"):
        parse_overrides(['--workerz', '2'])
