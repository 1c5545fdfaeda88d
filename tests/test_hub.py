"""``collab_vit.save_pretrained``: timm's hub folder, reloaded by plain ``timm.create_model("local-dir:...")`` with
bit-identical outputs; the mixing matrices out of weight decay whatever the model class; refusals write nothing."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import load_file
from timm.models import _hub
from timm.optim import create_optimizer_v2

import collab_vit
from collab_vit import CollaborativeAttention
from collab_vit.layers.weight_decay import CollabVisionTransformer
from collab_vit.training.eval_cli import main as eval_main
from collab_vit.training.model_factory import load_weights

TINY = dict(img_size=32, patch_size=8, depth=2, num_classes=7)


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """Random non-zero biases and layer scales (timm's init would hide a lost bias or scale)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("bias", "gamma")):
                param.normal_(0, 0.2)
    return model.eval()


def converted(name: str, **kwargs) -> torch.nn.Module:
    """A timm model (no pretrained weights) converted at full rank."""
    torch.manual_seed(0)
    return collab_vit.reparametrize(perturbed(timm.create_model(name, **TINY, **kwargs)), progress=False)


def reloaded(path: Path) -> torch.nn.Module:
    return timm.create_model(f"local-dir:{path}", pretrained=True).eval()


def assert_same_outputs(a: torch.nn.Module, b: torch.nn.Module) -> None:
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(a(x), b(x))


CASES = {  # model, the architecture the folder must name
    "registered, per-layer key dims": (
        lambda: perturbed(timm.create_model("collab_deit_tiny_patch16_224", key_dim=[48, 96], **TINY)),
        "collab_deit_tiny_patch16_224"),
    "timm DeiT converted": (lambda: converted("deit_tiny_patch16_224"), "collab_deit_tiny_patch16_224"),
    "DeiT-III style (layer scale, no class-token position)": (
        lambda: converted("deit3_small_patch16_224", no_embed_class=True), "collab_vit_generic"),
    "registers, average pool, no class token": (
        lambda: converted("vit_small_patch16_224", reg_tokens=2, class_token=False, global_pool="avg"),
        "collab_vit_generic"),
    "CLIP style (pre-norm, eps 1e-5)": (lambda: converted("vit_base_patch16_clip_224", embed_dim=64, num_heads=4),
                                        "collab_vit_generic"),
    "cut attention": (lambda: perturbed(timm.create_model("concat_deit_tiny_patch16_224_k48", **TINY)),
                      "concat_deit_tiny_patch16_224_k48"),
}


@pytest.mark.parametrize("case", CASES)
def test_local_dir_round_trip_is_bit_identical(case: str, tmp_path: Path) -> None:
    make, architecture = CASES[case]
    model = make()
    assert collab_vit.save_pretrained(model, str(tmp_path / "m")) == architecture
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architecture"] == architecture and (tmp_path / "m" / "model.safetensors").is_file()
    key_dims = [b.attn.key_dim for b in model.blocks]
    assert config["model_args"]["key_dim"] in (key_dims, key_dims[0])
    assert config["pretrained_cfg"]["crop_pct"] == model.pretrained_cfg["crop_pct"]  # the source's evaluation
    again = reloaded(tmp_path / "m")
    assert type(again) is CollabVisionTransformer
    assert [b.attn.key_dim for b in again.blocks] == key_dims
    assert_same_outputs(model, again)


def test_data_config_is_saved_and_reloaded(tmp_path: Path) -> None:
    model = converted("deit_tiny_patch16_224")
    pipeline = dict(crop_pct=0.95, interpolation="bilinear", mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    collab_vit.save_pretrained(model, str(tmp_path / "m"), data_config=pipeline)
    cfg = reloaded(tmp_path / "m").pretrained_cfg  # JSON: tuples come back as lists, as in timm's own folders
    assert {k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items() if k in pipeline} == pipeline
    assert tuple(cfg["input_size"]) == (3, 32, 32)
    assert model.pretrained_cfg["crop_pct"] == 0.9  # the model's own cfg is left as it was


def no_decay_names(model: torch.nn.Module) -> set[str]:
    optimizer = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05)
    ids = {id(p) for group in optimizer.param_groups if group["weight_decay"] == 0 for p in group["params"]}
    return {name for name, p in model.named_parameters() if id(p) in ids}


def test_mixing_out_of_decay_for_any_converted_model(tmp_path: Path) -> None:
    """A plain timm ViT converted in place, and its reload: mixing not decayed; the content bias (a projection
    weight, ``layers/weight_decay.py``) and the shared query/key projections decayed."""
    model = converted("vit_small_patch16_224", reg_tokens=1)
    collab_vit.save_pretrained(model, str(tmp_path / "m"))
    for candidate in (model, reloaded(tmp_path / "m")):
        names = no_decay_names(candidate)
        assert {f"blocks.{i}.attn.mixing" for i in range(2)} <= names
        assert not any(n.endswith(("content_bias.weight", "query.weight", "key.weight")) for n in names)


def test_layers_swapped_by_hand() -> None:
    model = perturbed(timm.create_model("deit_tiny_patch16_224", **TINY))
    for block in model.blocks:
        block.attn = CollaborativeAttention.from_attention(block.attn)
    assert not {"blocks.0.attn.mixing"} <= no_decay_names(model)  # timm alone decays the 2-D mixing
    assert {"blocks.0.attn.mixing", "blocks.1.attn.mixing"} <= no_decay_names(
        collab_vit.exclude_mixing_from_decay(model))
    assert type(model) is CollabVisionTransformer


def test_refusals_write_nothing(tmp_path: Path) -> None:
    plain = perturbed(timm.create_model("deit_tiny_patch16_224", **TINY))
    with pytest.raises(ValueError, match="every block's attention collaborative") as error:
        collab_vit.save_pretrained(plain, str(tmp_path / "a"))
    assert "\n" not in str(error.value) and not (tmp_path / "a").exists()
    odd = converted("deit_tiny_patch16_224")
    odd.norm.eps = 1e-2  # the final norm unlike the blocks': no keyword of timm's ViT says so
    with pytest.raises(ValueError, match="computes other outputs"):
        collab_vit.save_pretrained(odd, str(tmp_path / "b"))
    assert not (tmp_path / "b").exists() and list(tmp_path.iterdir()) == []


def test_train_checkpoint_takes_the_folder(tmp_path: Path) -> None:
    """``train.py --checkpoint DIR`` (``load_weights``) loads the folder's weights into the named model."""
    model = perturbed(timm.create_model("collab_deit_tiny_patch16_224_k48", **TINY))
    collab_vit.save_pretrained(model, str(tmp_path / "m"))
    fresh = timm.create_model("collab_deit_tiny_patch16_224_k48", **TINY).eval()
    meta = load_weights(fresh, str(tmp_path / "m"))
    assert meta["model_name"] == "collab_deit_tiny_patch16_224_k48"
    assert_same_outputs(model, fresh)


class OfflineHub:
    """Stands in for ``huggingface_hub.HfApi`` in timm's ``push_to_hf_hub``: keeps a copy of the uploaded folder."""
    uploaded: dict = {}

    def __init__(self, **kwargs) -> None:
        pass

    def create_repo(self, repo_id: str, **kwargs):
        return type("RepoUrl", (), {"repo_id": repo_id})()

    def file_exists(self, **kwargs) -> bool:
        return True  # a model card exists: timm writes none

    def upload_folder(self, repo_id: str, folder_path: str, **kwargs) -> str:
        OfflineHub.uploaded = {p.name: p.read_bytes() for p in Path(folder_path).iterdir()}
        return f"https://huggingface.co/{repo_id}"


def test_push_to_hf_hub_publishes_the_saved_folder(tmp_path: Path, monkeypatch) -> None:
    """``collab_vit.push_to_hf_hub`` uploads what ``save_pretrained`` writes (the hub itself is offline here)."""
    monkeypatch.setattr(_hub, "HfApi", OfflineHub)
    model = converted("vit_small_patch16_224", reg_tokens=1)
    collab_vit.save_pretrained(model, str(tmp_path / "m"))
    collab_vit.push_to_hf_hub(model, "user/model")
    assert set(OfflineHub.uploaded) == {"config.json", "model.safetensors"}
    assert json.loads(OfflineHub.uploaded["config.json"]) == json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "pushed.safetensors").write_bytes(OfflineHub.uploaded["model.safetensors"])
    pushed, saved = load_file(str(tmp_path / "pushed.safetensors")), load_file(str(tmp_path / "m" / "model.safetensors"))
    assert pushed.keys() == saved.keys() and all(torch.equal(pushed[k], saved[k]) for k in saved)


def test_eval_of_a_folder_without_config_is_one_line(tmp_path: Path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    assert eval_main(["--checkpoint", str(tmp_path / "empty"), "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "without config.json" in err and "\n" not in err


def test_model_name_local_dir_builds_the_folders_architecture(tmp_path: Path) -> None:
    """``train.py --model local-dir:DIR --checkpoint DIR``: the architecture from the folder, then its weights."""
    from collab_vit.training.errors import ConfigError
    from collab_vit.training.model_factory import build_model

    model = converted("vit_small_patch16_224", reg_tokens=1)
    collab_vit.save_pretrained(model, str(tmp_path / "m"))
    fresh = build_model(f"local-dir:{tmp_path / 'm'}", 7, 32).eval()
    load_weights(fresh, str(tmp_path / "m"))
    assert_same_outputs(model, fresh)
    with pytest.raises(ConfigError, match="unknown model"):
        build_model("no/such/folder", 7)
