"""``collab_vit.save_pretrained``: timm's hub folder, reloaded by plain ``timm.create_model("local-dir:...")`` with
bit-identical outputs for every design that converts (a converted model recorded as its source: timm name,
arguments, each layer's class and key dim); folders written by version 0.2 still load; loading unpickles nothing;
the mixing matrices out of weight decay whatever the model class; refusals write nothing."""
from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import load_file
from timm.models import VisionTransformer, _hub, vision_transformer
from timm.optim import create_optimizer_v2

import collab_vit
from collab_vit import CollaborativeAttention
from collab_vit.layers.weight_decay import CollabVisionTransformer
from collab_vit.training.eval_cli import main as eval_main
from collab_vit.training.build import load_weights
from numerics import U32, assert_stored_within, vit_chain

TINY = dict(img_size=32, patch_size=8, depth=2, num_classes=7)
DATA = Path(__file__).parent / "data"

pytestmark = pytest.mark.usefixtures("one_thread")


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """Random non-zero biases and layer scales (timm's init would hide a lost bias or scale)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("bias", "gamma")):
                param.normal_(0, 0.2)
    return model.eval()


def converted(name: str, key_dim=None, **kwargs) -> torch.nn.Module:
    """A timm model (no pretrained weights) converted at ``key_dim`` (default: full rank)."""
    torch.manual_seed(0)
    return collab_vit.reparametrize(perturbed(timm.create_model(name, **TINY, **kwargs)), key_dim, progress=False)


def reloaded(path: Path) -> torch.nn.Module:
    return timm.create_model(f"local-dir:{path}", pretrained=True).eval()


def assert_same_outputs(a: torch.nn.Module, b: torch.nn.Module) -> None:
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(a(x), b(x))


SMALL = dict(embed_dim=64, num_heads=4)
CONVERTED = "collab_vit_converted"
CASES = {  # model, the architecture the folder must name
    "registered, per-layer key dims": (
        lambda: perturbed(timm.create_model("collab_deit_tiny_patch16_224", key_dim=[48, 96],
                                            conversion_options=dict(dtype=torch.float64), **TINY)),
        "collab_deit_tiny_patch16_224"),  # how standard weights would convert on load: not recorded
    "timm DeiT converted": (lambda: converted("deit_tiny_patch16_224", key_dim=[32, 48], **SMALL),
                            "collab_deit_tiny_patch16_224"),
    "DeiT-III style (layer scale, no class-token position)": (
        lambda: converted("deit3_small_patch16_224", no_embed_class=True, **SMALL), CONVERTED),
    "ViT, class token and registers": (lambda: converted("vit_small_patch16_224", reg_tokens=2, **SMALL), CONVERTED),
    "registers, average pool, no class token": (
        lambda: converted("vit_small_patch16_224", key_dim=32, reg_tokens=2, class_token=False, global_pool="avg",
                          **SMALL), CONVERTED),
    "CLIP style (pre-norm, eps 1e-5)": (lambda: converted("vit_base_patch16_clip_224", **SMALL), CONVERTED),
    "distilled DeiT (distillation token)": (
        lambda: converted("deit_tiny_distilled_patch16_224", key_dim=[16, 48], **SMALL), CONVERTED),
    "BEiT (relative position bias)": (lambda: converted("beit_base_patch16_224", key_dim=[16, 48], **SMALL),
                                      CONVERTED),
    "EVA without rope (fused qkv, q/v biases)": (
        lambda: converted("eva_giant_patch14_224", key_dim=32, qkv_bias=True, embed_dim=96, num_heads=4), CONVERTED),
    "EVA without rope (separate q/k/v, scale norm)": (
        lambda: converted("eva_giant_patch14_224", qkv_fused=False, scale_attn_inner=True, **SMALL), CONVERTED),
    "parallel blocks (two attentions per block)": (
        lambda: converted("vit_small_patch16_18x2_224", key_dim=[16, 24, 32, 48], **SMALL), CONVERTED),
    "cut attention": (lambda: perturbed(timm.create_model("concat_deit_tiny_patch16_224_k48", **TINY)),
                      "concat_deit_tiny_patch16_224_k48"),
    "registered rotary ViT, the grid": (
        lambda: perturbed(timm.create_model("collab_vit_small_patch16_rope_224_k96", **TINY)),
        "collab_vit_small_patch16_rope_224_k96"),
    "registered rotary ViT with APE, key_dim keyword": (
        lambda: perturbed(timm.create_model("collab_vit_small_patch16_rope_ape_224", key_dim=32, mixing_init="random",
                                            **TINY, **SMALL)), "collab_vit_small_patch16_rope_ape_224"),
}


def key_dims(model: torch.nn.Module) -> dict[str, int]:
    return {name: m.key_dim for name, m in model.named_modules() if hasattr(m, "key_dim")}


@pytest.mark.parametrize("case", CASES)
def test_local_dir_round_trip_is_bit_identical(case: str, tmp_path: Path) -> None:
    make, architecture = CASES[case]
    model = make()
    assert collab_vit.save_pretrained(model, str(tmp_path / "m")) == architecture
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architecture"] == architecture
    args = config["model_args"]
    if architecture == CONVERTED:  # the source's name and arguments, each layer's class and key dim
        assert args["source_model"] == model.pretrained_cfg["architecture"]
        recorded = {k: tuple(v) if isinstance(v, list) else v for k, v in args.items()}
        assert recorded["img_size"] == (32, 32) and recorded["num_classes"] == 7
        assert {k: v for k, v in model._model_args.items() if k != "img_size"}.items() <= recorded.items()
        assert args["collaborative_layers"] == {
            name: {"layer": type(m).__name__, "key_dim": m.key_dim} for name, m in model.named_modules()
            if isinstance(m, CollaborativeAttention)}
    else:
        assert args["key_dim"] in (list(key_dims(model).values()), next(iter(key_dims(model).values())))
    assert config["pretrained_cfg"]["crop_pct"] == model.pretrained_cfg["crop_pct"]  # the source's evaluation
    again = reloaded(tmp_path / "m")
    assert type(again) is type(model)
    assert key_dims(again) == key_dims(model)
    assert_same_outputs(model, again)


V02_CHAIN = vit_chain(32, 2, 6, 3 * 8 * 8, key_dim=24)  # write_hub_v0.2.py: embed 32, depth 2, 4 patches + class +
# register token, patch 8 x 8 x 3, key dims 16 and 24 (the longer bounds both)


def check_v02_folder(expected: dict[str, torch.Tensor], tmp_path: Path) -> None:
    """Today's logits of the 0.2 folder against those it gave when it was written (on another CPU: within the
    derived bound, ``numerics.assert_stored_within``); saved again and reloaded, bit-identical to today's (the same
    process computes both)."""
    model = reloaded(DATA / "hub_v0.2")
    assert list(key_dims(model).values()) == [16, 24]
    with torch.no_grad():
        today = model(expected["input"])
    assert_stored_within(today, expected["logits"], V02_CHAIN, "logits of the 0.2 folder")
    assert collab_vit.save_pretrained(model, str(tmp_path / "again")) == "collab_vit_generic"
    with torch.no_grad():
        assert torch.equal(reloaded(tmp_path / "again")(expected["input"]), today)


def test_folder_written_by_version_0_2_still_loads(tmp_path: Path) -> None:
    """``tests/data/hub_v0.2``: a converted ViT (registers, layer scale, key dims 16 and 24) saved by version 0.2
    (``collab_vit_generic`` and ``VisionTransformer`` keywords; ``tests/data/write_hub_v0.2.py``), with the logits
    it gave on a fixed input when it was written; saved again, it keeps its format."""
    assert json.loads((DATA / "hub_v0.2" / "config.json").read_text())["architecture"] == "collab_vit_generic"
    check_v02_folder(load_file(str(DATA / "hub_v0.2_expected.safetensors")), tmp_path)


@pytest.mark.parametrize("shift, passes", [("1.5e-8", True), ("4u", True), ("3bounds", False)])
def test_stored_logits_tolerate_rounding_not_errors(shift: str, passes: bool, tmp_path: Path) -> None:
    """The stored logits moved by a cross-CPU rounding difference (a few units of float32 roundoff; 1.5e-8 was seen
    between two x86 CPUs) still pass; moved beyond the derived bound, the check fails."""
    expected = load_file(str(DATA / "hub_v0.2_expected.safetensors"))
    logits = expected["logits"]
    scale = float(logits.abs().max())
    size = {"1.5e-8": 1.5e-8, "4u": 4 * U32 * scale, "3bounds": 3 * 2 * V02_CHAIN * U32 * scale}[shift]
    sign = torch.where(torch.arange(logits.numel()).reshape(logits.shape) % 2 == 0, 1.0, -1.0)
    expected["logits"] = logits + sign * size
    if passes:
        check_v02_folder(expected, tmp_path)
    else:
        with pytest.raises(AssertionError, match="exceeds the bound"):
            check_v02_folder(expected, tmp_path)


def test_loading_unpickles_nothing_and_refuses_odd_records(tmp_path: Path, monkeypatch) -> None:
    """A folder is ``config.json`` (JSON) and ``model.safetensors``: reloading it never calls ``torch.load`` or
    pickle; a record naming anything but a timm model, or a layer its source does not become, is one line."""
    model = converted("beit_base_patch16_224", key_dim=16, **SMALL)
    collab_vit.save_pretrained(model, str(tmp_path / "m"))
    for module, name in ((torch, "load"), (pickle, "load"), (pickle, "loads")):
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("unpickled while loading a folder"))
    assert_same_outputs(model, reloaded(tmp_path / "m"))
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    layers = config["model_args"]["collaborative_layers"]
    for key, value, message in (
            ("source_model", "hf-hub:someone/model", "needs source_model"),
            ("source_model", "collab_vit_converted", "needs source_model"),
            ("collaborative_layers", {**layers, "blocks.0.attn": {"layer": "CollaborativeAttention", "key_dim": 16}},
             "the record makes blocks.0.attn a CollaborativeAttention"),
            ("collaborative_layers", {"blocks.0.attn": layers["blocks.0.attn"]}, "the record names")):
        folder = tmp_path / f"tampered_{len(list(tmp_path.iterdir()))}"
        shutil.copytree(tmp_path / "m", folder)
        (folder / "config.json").write_text(json.dumps({**config, "model_args": {**config["model_args"], key: value}}))
        with pytest.raises(ValueError, match=message) as error:
            reloaded(folder)
        assert "\n" not in str(error.value)


def test_source_given_or_read_from_the_model(tmp_path: Path) -> None:
    """Without ``source=``, the model's own record (the architecture of its ``pretrained_cfg`` and the arguments
    ``timm.create_model`` noted); where that is not enough, one line and nothing written; ``source=`` then saves."""
    kwargs = dict(TINY, **SMALL, reg_tokens=1)
    torch.manual_seed(0)
    by_function = collab_vit.reparametrize(perturbed(vision_transformer.vit_tiny_patch16_224(**kwargs)), 32,
                                           progress=False)  # built without timm.create_model: no arguments noted
    torch.manual_seed(0)
    by_hand = collab_vit.reparametrize(perturbed(VisionTransformer(**kwargs)), 32, progress=False)  # no cfg at all
    for model, message in ((by_function, "cannot rebuild this"), (by_hand, "does not say which timm model")):
        with pytest.raises(ValueError, match=message) as error:
            collab_vit.save_pretrained(model, str(tmp_path / "refused"))
        assert "\n" not in str(error.value) and "source=" in str(error.value)
        assert not (tmp_path / "refused").exists()
        with pytest.raises(ValueError, match="its weights differ at"):  # a source that is not the model's (width)
            collab_vit.save_pretrained(model, str(tmp_path / "refused"), source=("vit_tiny_patch16_224", TINY))
        assert not (tmp_path / "refused").exists()
        folder = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
        assert collab_vit.save_pretrained(model, str(folder), source=("vit_tiny_patch16_224", kwargs)) == CONVERTED
        assert_same_outputs(model, reloaded(folder))


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
    model = converted("vit_small_patch16_224", reg_tokens=1, **SMALL)
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
    model = converted("vit_small_patch16_224", reg_tokens=1, **SMALL)
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
    from collab_vit.training.build import build_model
    from collab_vit.training.config import ConfigError

    model = converted("vit_small_patch16_224", reg_tokens=1, **SMALL)
    collab_vit.save_pretrained(model, str(tmp_path / "m"))
    fresh = build_model(f"local-dir:{tmp_path / 'm'}", 7, 32).eval()
    load_weights(fresh, str(tmp_path / "m"))
    assert_same_outputs(model, fresh)
    with pytest.raises(ConfigError, match="unknown model"):
        build_model("no/such/folder", 7)


def pretrained_cfg_of(folder: Path) -> tuple[dict, dict]:
    config = json.loads((folder / "config.json").read_text())
    return config["pretrained_cfg"], config["provenance"]


def test_convert_of_a_checkpoint_records_its_provenance_and_no_tag(tmp_path: Path) -> None:
    """``collab-vit convert --checkpoint mine.pth`` (a timm architecture, the user's weights): the folder records the
    source, "checkpoint mine.pth" and the pipeline of timm's cfg, never the tag of timm's weights (nor their
    license); a convert of one of this package's exports records the pipeline as the checkpoint's record."""
    from collab_vit.cli import main as cli_main
    from collab_vit.conversion.files.commands import weights_origin
    from collab_vit.weights_io import export_safetensors

    kwargs = dict(TINY, **SMALL)
    source = perturbed(timm.create_model("vit_small_patch16_224", **kwargs))
    torch.save(source.state_dict(), tmp_path / "mine.pth")
    flags = ["--key-dim", "8", "--model-kwargs", *[f"{k}={v}" for k, v in kwargs.items()]]
    assert cli_main(["convert", "--model", "vit_small_patch16_224", "--checkpoint", str(tmp_path / "mine.pth"),
                     "--out", str(tmp_path / "m"), *flags]) == 0
    cfg, record = pretrained_cfg_of(tmp_path / "m")
    assert not {"tag", "license"} & cfg.keys() and cfg["mean"] == [0.5] * 3  # timm's pipeline for the architecture
    assert record == {"source_model": "vit_small_patch16_224", "source_args": {**kwargs, "img_size": [32, 32],
                                                                                "in_chans": 3, "global_pool": "token"},
                      "weights": "checkpoint mine.pth",
                      "data_config": "timm's cfg for vit_small_patch16_224.augreg_in21k_ft_in1k"}
    assert key_dims(reloaded(tmp_path / "m")) == {"blocks.0.attn": 8, "blocks.1.attn": 8}
    assert weights_origin(source, None) == "vit_small_patch16_224.augreg_in21k_ft_in1k"  # what a download records
    pipeline = dict(input_size=[3, 32, 32], crop_pct=1.0, interpolation="bilinear", mean=[0.5] * 3, std=[0.25] * 3)
    export_safetensors(source.state_dict(), str(tmp_path / "run.safetensors"), "vit_small_patch16_224", kwargs,
                       {"data_config": pipeline})
    assert cli_main(["convert", "--checkpoint", str(tmp_path / "run.safetensors"), "--out", str(tmp_path / "r"),
                     "--key-dim", "8"]) == 0
    cfg, record = pretrained_cfg_of(tmp_path / "r")
    assert (record["weights"], record["data_config"]) == ("checkpoint run.safetensors", "the checkpoint's record")
    assert "tag" not in cfg and cfg["crop_pct"] == 1.0 and cfg["std"] == [0.25] * 3


def test_python_api_records_a_tag_only_for_timms_weights(tmp_path: Path) -> None:
    """``save_pretrained`` without ``weights=``: "not stated" and no tag; ``weights`` naming the tag of the model's
    cfg (timm's weights for it) keeps it; another name does not; the round trip stays bit-identical."""
    model = converted("deit_tiny_patch16_224", key_dim=32, **SMALL)
    for folder, weights in (("none", None), ("timm", "deit_tiny_patch16_224.fb_in1k"), ("other", "my run")):
        collab_vit.save_pretrained(model, str(tmp_path / folder), **({"weights": weights} if weights else {}))
        assert_same_outputs(model, reloaded(tmp_path / folder))
    for folder, weights, tag in (("none", "not stated", None), ("timm", "deit_tiny_patch16_224.fb_in1k", "fb_in1k"),
                                 ("other", "my run", None)):
        cfg, record = pretrained_cfg_of(tmp_path / folder)
        assert (record["weights"], cfg.get("tag"), cfg.get("license")) == (weights, tag, tag and "apache-2.0")
        assert record["source_model"] == "deit_tiny_patch16_224" and record["source_args"]["embed_dim"] == 64
        assert record["data_config"] == "timm's cfg for deit_tiny_patch16_224.fb_in1k"
    collab_vit.save_pretrained(model, str(tmp_path / "given"), data_config=dict(crop_pct=0.5))
    assert pretrained_cfg_of(tmp_path / "given")[1]["data_config"] == "data_config given to save_pretrained"
