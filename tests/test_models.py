"""Registered models: exact conversion of timm's DeiTs, training-readiness, compile/script, errors."""
from __future__ import annotations

import copy

import pytest
import timm
import torch

import collab_vit
from collab_vit import CollaborativeAttention, ConcatAttention
from collab_vit.models import COLLAB_MODELS, CONCAT_MODELS, GENERIC_MODEL
from collab_vit.models_rope import ROPE_MODELS
from numerics import assert_within, vit_chain

TINY = dict(img_size=32, patch_size=8, num_classes=7)  # small inputs keep the suite fast


def tiny_chain(model: torch.nn.Module, key_dim: int) -> int:
    """The float32 bound of a ``TINY`` model's logits (``numerics.vit_chain``): 32 px, patch 8: 17 tokens."""
    return vit_chain(model.embed_dim, len(model.blocks), 17, 3 * 8 * 8, key_dim)


def perturbed_deit(name: str) -> torch.nn.Module:
    """A timm DeiT with random non-zero biases (timm zero-inits them, which would hide a wrong content bias)."""
    torch.manual_seed(0)
    model = timm.create_model(name).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("bias"):
                param.normal_(0, 0.2)
    return model


@pytest.mark.parametrize("size", ["tiny", "small", "base"])
def test_converted_deit_reproduces_timm_logits(size: str) -> None:
    reference = perturbed_deit(f"deit_{size}_patch16_224")
    converted = collab_vit.reparametrize(copy.deepcopy(reference))
    assert all(isinstance(b.attn, CollaborativeAttention) for b in converted.blocks)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        expected = copy.deepcopy(reference).double()(x.double())  # timm's DeiT in float64
        fused = converted(x)
        for block in converted.blocks:
            block.attn.fused_attn = False
        explicit = converted(x)
    bound = vit_chain(reference.embed_dim, len(reference.blocks), 197, 3 * 16 * 16)
    assert_within(fused, expected, bound, what="fused")
    assert_within(explicit, expected, bound, what="explicit")


def test_reparametrize_errors() -> None:
    model = timm.create_model("deit_tiny_patch16_224", **TINY)
    with pytest.raises(ValueError, match="key_dim must be a positive integer"):
        collab_vit.reparametrize(model, key_dim=0)
    with pytest.raises(ValueError, match="already collaborative or cut attention"):
        collab_vit.reparametrize(timm.create_model("collab_deit_tiny_patch16_224", **TINY))


def test_registry_lists_every_model() -> None:
    assert set(timm.list_models("*collab*")) == set(COLLAB_MODELS) | set(ROPE_MODELS) | {GENERIC_MODEL,
                                                                                       "collab_vit_converted"}
    assert set(timm.list_models("concat_*")) == set(CONCAT_MODELS)
    assert len(COLLAB_MODELS) == 12 and len(CONCAT_MODELS) == 9


@pytest.mark.parametrize("name, layer_type, key_dim", [
    ("collab_deit_base_patch16_224", CollaborativeAttention, 768),
    ("collab_deit_base_patch16_224_k192", CollaborativeAttention, 192),
    ("collab_deit_small_patch16_224_k96", CollaborativeAttention, 96),
    ("collab_deit_tiny_patch16_224_k48", CollaborativeAttention, 48),
    ("concat_deit_base_patch16_224_k384", ConcatAttention, 384),
    ("concat_deit_tiny_patch16_224_k48", ConcatAttention, 48),
])
def test_named_variants_fix_key_dim(name: str, layer_type: type, key_dim: int) -> None:
    model = timm.create_model(name, img_size=32, num_classes=3)
    assert all(isinstance(b.attn, layer_type) and b.attn.key_dim == key_dim for b in model.blocks)
    assert model.default_cfg["input_size"] == (3, 224, 224) and model.default_cfg["interpolation"] == "bicubic"


def test_create_model_keywords() -> None:
    model = timm.create_model("collab_deit_base_patch16_224", key_dim=100, num_classes=5, img_size=64,
                              drop_path_rate=0.1, mixing_init="random")
    assert model.num_classes == 5 and model.patch_embed.img_size == (64, 64)
    assert model.blocks[-1].drop_path1.drop_prob == pytest.approx(0.1)
    assert model.blocks[0].attn.key_dim == 100 and model.blocks[0].attn.mixing_init == "random"
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 5)


@pytest.mark.parametrize("bad", [0, -1, 2.5, "384"])
def test_invalid_key_dim_in_create_model(bad: object) -> None:
    with pytest.raises(ValueError, match="key_dim must be a positive integer"):
        timm.create_model("collab_deit_tiny_patch16_224", key_dim=bad)


def test_named_variant_rejects_other_key_dim() -> None:
    with pytest.raises(ValueError, match="fixes key_dim=192"):
        timm.create_model("collab_deit_base_patch16_224_k192", key_dim=384)
    with pytest.raises(ValueError, match="divisible by num_heads"):
        timm.create_model("concat_deit_base_patch16_224_k384", key_dim=384, embed_dim=768, num_heads=7)


def test_unknown_model_name_gives_timm_error() -> None:
    with pytest.raises(RuntimeError, match="Unknown model"):
        timm.create_model("collab_deit_huge_patch16_224")


@pytest.mark.parametrize("name", ["collab_deit_tiny_patch16_224_k48", "concat_deit_tiny_patch16_224_k48"])
def test_gradients_reach_every_parameter(name: str) -> None:
    model = timm.create_model(name, **TINY).train()
    model(torch.randn(2, 3, 32, 32)).logsumexp(-1).mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, f"no gradient for {missing}"


def test_state_dict_round_trip() -> None:
    torch.manual_seed(0)
    source = timm.create_model("collab_deit_tiny_patch16_224", key_dim=40, mixing_init="random", **TINY).eval()
    target = timm.create_model("collab_deit_tiny_patch16_224", key_dim=40, **TINY).eval()
    target.load_state_dict(source.state_dict())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(source(x), target(x))
    assert "blocks.0.attn.mixing" in source.state_dict() and "blocks.0.attn.content_bias.weight" in source.state_dict()


@pytest.mark.parametrize("name", ["collab_deit_tiny_patch16_224_k48", "concat_deit_tiny_patch16_224_k48"])
def test_torchscript(name: str) -> None:
    model = timm.create_model(name, depth=2, **TINY).eval()
    scripted = torch.jit.script(model)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert_within(scripted(x), copy.deepcopy(model).double()(x.double()), tiny_chain(model, 48))


def test_torch_compile_fullgraph() -> None:
    torch.manual_seed(0)
    model = timm.create_model("collab_deit_tiny_patch16_224_k48", depth=2, **TINY).eval()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # fullgraph: any graph break fails
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert_within(compiled(x), copy.deepcopy(model).double()(x.double()), tiny_chain(model, 48))


def test_each_model_has_its_own_register_function_and_deit_eval_crop() -> None:
    """One ``def <name>`` per variant (grep / go-to-definition find it), and one crop_pct: the recipe's evaluation."""
    import inspect

    from collab_vit import models
    from collab_vit.training.config import TrainConfig

    source = inspect.getsource(models)
    for name in COLLAB_MODELS + CONCAT_MODELS + [GENERIC_MODEL]:
        assert f"\ndef {name}(" in source
        assert timm.create_model(name, device="meta").pretrained_cfg["crop_pct"] == TrainConfig().crop_pct == 0.875
