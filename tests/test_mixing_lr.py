"""``mixing_lr_scale`` (issue 21): the mixing matrices' lr multiplier through timm's param-group ``lr_scale``."""
import subprocess
import sys

import pytest
import timm
import torch
from timm.scheduler import create_scheduler_v2

import collab_vit  # noqa: F401  (registers the models)
from collab_vit.training.checkpoint import load_checkpoint
from collab_vit.training.config import ConfigError, build_config
from collab_vit.training.build import build_optimizer
from collab_vit.training.trainer import train
from tinyrun import ROOT, tiny_data, tiny_overrides  # noqa: F401  (tiny_data is a fixture)


def tiny_model() -> torch.nn.Module:
    return timm.create_model('collab_deit_tiny_patch16_224', num_classes=3, img_size=32, patch_size=8, depth=2,
                             embed_dim=48, num_heads=3, key_dim=12)


def group_of(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, dict]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: g for g in optimizer.param_groups for p in g['params']}


@pytest.mark.parametrize('layer_decay', [None, 0.75])
def test_mixing_groups_get_the_multiplier_and_nothing_else_changes(layer_decay):
    model = tiny_model()
    base = group_of(build_optimizer(model, 'adamw', 1e-3, 0.05, 0.9, layer_decay), model)
    scaled = group_of(build_optimizer(model, 'adamw', 1e-3, 0.05, 0.9, layer_decay, mixing_lr_scale=30.0), model)
    assert base.keys() == scaled.keys() == {n for n, _ in model.named_parameters()}
    for name in base:
        before, after = base[name].get('lr_scale', 1.0), scaled[name].get('lr_scale', 1.0)
        assert after == pytest.approx(30.0 * before if name.endswith('.mixing') else before), name
        assert scaled[name]['weight_decay'] == base[name]['weight_decay'], name  # mixing stays undecayed
    assert scaled['blocks.0.attn.mixing']['weight_decay'] == 0


def test_schedulers_apply_the_multiplier():
    """timm's scheduler sets each group's lr to the schedule's value times its lr_scale."""
    model = tiny_model()
    optimizer = build_optimizer(model, 'adamw', 1e-3, 0.05, 0.9, None, mixing_lr_scale=50.0)
    scheduler, _ = create_scheduler_v2(optimizer, sched='cosine', num_epochs=4, warmup_epochs=0, min_lr=0.0)
    scheduler.step(1)
    groups = group_of(optimizer, model)
    assert groups['blocks.1.attn.mixing']['lr'] == pytest.approx(50.0 * groups['blocks.1.attn.query.weight']['lr'])


def test_bad_value_is_a_config_error(tiny_data, tmp_path):
    with pytest.raises(ConfigError, match='mixing_lr_scale'):
        build_config(None, tiny_overrides(tiny_data, str(tmp_path / 'x'), mixing_lr_scale=0.0))
    result = subprocess.run([sys.executable, 'train.py', '--mixing-lr-scale', '-1', '--data-dir', tiny_data,
                             '--output', str(tmp_path / 'y')], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and 'mixing_lr_scale' in result.stderr and 'Traceback' not in result.stderr
    assert not (tmp_path / 'y').exists()


def test_run_with_the_multiplier_resumes_exactly(tiny_data, tmp_path):
    opts = dict(mixing_lr_scale=20.0, epochs=2, deterministic=True, seed=1)
    full = train(build_config(None, tiny_overrides(tiny_data, str(tmp_path / 'full'), **opts)))
    train(build_config(None, tiny_overrides(tiny_data, str(tmp_path / 'split'), stop_after=1, **opts)))
    resumed = train(build_config(None, tiny_overrides(tiny_data, str(tmp_path / 'split'), resume=True, **opts)))
    assert full['weights_sha256'] == resumed['weights_sha256']
    ckpt = load_checkpoint(tmp_path / 'full' / 'last.pth')
    assert sorted({g.get('lr_scale', 1.0) for g in ckpt['optimizer']['param_groups']}) == [1.0, 20.0]
