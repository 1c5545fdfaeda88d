"""Registered collaborative rotary ViTs (RESULTS.md, "Rotary models"): timm's RoPE-ViTs with the collaborative rotary
layer, the paper's grid by name, and ``train.py`` training one with the Fashion-MNIST recipe."""
from __future__ import annotations

import copy
import os

import pytest
import timm
import torch
from timm.layers import AttentionRope

import collab_vit
from collab_vit import CollaborativeAttentionRope
from collab_vit.models_rope import ROPE_GRID, ROPE_MODELS
from collab_vit.training.checkpoint import load_checkpoint
from collab_vit.training.config import build_config
from collab_vit.training.trainer import train
from tinyrun import ROOT, tiny_fashion_mnist  # noqa: F401  (tiny_fashion_mnist is a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = dict(img_size=32, patch_size=8, depth=2, embed_dim=64, num_heads=4, num_classes=5)


@pytest.mark.parametrize("variant", ["rope", "rope_ape"])
def test_full_rank_is_timm_s_rope_vit(variant: str) -> None:
    """At key dim D with the concatenate init, the registered model is timm's RoPE-ViT: the weights of timm's model,
    converted exactly, load into it by name and give timm's logits bit for bit (same rope, blocks, head)."""
    torch.manual_seed(0)
    source = timm.create_model(f"vit_small_patch16_{variant}_224", **TINY).eval()
    with torch.no_grad():
        for param in source.parameters():
            param.normal_(0, 0.1)  # non-zero biases and layer scales: a lost one shows
    converted = collab_vit.reparametrize(copy.deepcopy(source), progress=False)
    ours = timm.create_model(f"collab_vit_small_patch16_{variant}_224", **TINY).eval()
    assert not any(isinstance(m, AttentionRope) for m in ours.modules())
    assert all(type(block.attn).__mro__[1] is CollaborativeAttentionRope for block in ours.blocks)
    ours.load_state_dict(converted.state_dict(), strict=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(ours(x), source(x))
    assert (ours.pos_embed is None) == (variant == "rope")


def test_grid_names_fix_the_key_dim() -> None:
    """Each registered name builds (meta device) with its key dim in every block, its own cfg (DeiT's crop), the
    mixing out of weight decay; the grid's key dim cannot be changed by keyword."""
    grid = {name: k for size, dims in ROPE_GRID.items() for k in dims
            for name in [f"collab_vit_{size}_patch16_rope_224_k{k}"]}
    assert set(grid) < set(ROPE_MODELS) == set(timm.list_models("collab_vit_*rope*")) and len(ROPE_MODELS) == 10
    for name in ROPE_MODELS:
        model = timm.create_model(name, device="meta")
        dims = {block.attn.key_dim for block in model.blocks}
        assert dims == {grid.get(name, model.embed_dim)}, name
        assert model.pretrained_cfg["architecture"] == name and model.pretrained_cfg["crop_pct"] == 0.875
        assert {f"blocks.{i}.attn.mixing" for i in range(12)} <= model.no_weight_decay()
    with pytest.raises(ValueError, match="fixes key_dim=96; use collab_vit_small_patch16_rope_224 for key_dim=48"):
        timm.create_model("collab_vit_small_patch16_rope_224_k96", key_dim=48, device="meta")


def test_keywords_and_refusals() -> None:
    """``key_dim`` and ``mixing_init`` by keyword; an odd key dim, mixed rope or qk_norm: one line each."""
    model = timm.create_model("collab_vit_small_patch16_rope_ape_224", key_dim=24, mixing_init="random", **TINY)
    assert {(block.attn.key_dim, block.attn.mixing_init) for block in model.blocks} == {(24, "random")}
    for kwargs, message in [(dict(key_dim=23), "rotary attention needs an even key_dim"),
                            (dict(rope_type="mixed"), "is axial rope"), (dict(qk_norm=True), "is axial rope")]:
        with pytest.raises(ValueError, match=message) as error:
            timm.create_model("collab_vit_small_patch16_rope_224", **kwargs, **TINY)
        assert "\n" not in str(error.value)
    from timm.models import eva
    assert eva.AttentionRope is AttentionRope  # timm's module as it was, after a refused build too


def test_train_py_trains_the_rope_config(tiny_fashion_mnist, tmp_path) -> None:  # noqa: F811
    """Two updates of ``configs/fmnist/rope_collab_k16.yaml`` (200 images, batch 100): the rotary model trains, its
    mixing moves, and the exported file rebuilds it by name with identical outputs."""
    cfg = build_config(os.path.join(ROOT, "configs", "fmnist", "rope_collab_k16.yaml"),
                       dict(data_dir=str(tiny_fashion_mnist), output=str(tmp_path / "run"), epochs=1, batch_size=100,
                            lr_base_batch=100, progress=False))
    summary = train(cfg)
    assert summary["model"] == "collab_vit_small_patch16_rope_224" and summary["key_dim"] == 16
    assert 0 <= summary["top1"] <= 100
    checkpoint = load_checkpoint(tmp_path / "run" / "last.pth")
    assert checkpoint["step"] == 2
    mixing = checkpoint["model"]["blocks.0.attn.mixing"]
    assert mixing.shape == (4, 16) and not torch.equal(mixing, CollaborativeAttentionRope(64, 4, key_dim=16).mixing)
    path = str(tmp_path / "run" / "model.safetensors")
    again = timm.create_model("collab_vit_small_patch16_rope_224", pretrained=True,
                              pretrained_cfg_overlay=dict(file=path)).eval()
    assert again.blocks[0].attn.key_dim == 16 and again.patch_embed.img_size == (28, 28)
    x = torch.randn(2, 1, 28, 28)
    trained = timm.create_model("collab_vit_small_patch16_rope_224", **cfg.model_kwargs, img_size=28, in_chans=1,
                                num_classes=10).eval()
    trained.load_state_dict(checkpoint["model"])
    with torch.no_grad():
        assert torch.equal(again(x), trained(x))
