"""Post-hoc re-parametrisation (section 3.3): exactness, compression, determinism, files, pretrained tags, errors."""
from __future__ import annotations

import copy
import json

import pytest
import timm
import torch

import collab_vit
from collab_vit import CollaborativeAttention
from collab_vit.cli import main as cli_main
from collab_vit.training.eval_cli import parse_args as evaluate_args, run as evaluate_run
from collab_vit.weights_io import read_weights
from numerics import U32, assert_within, attention_chain, vit_chain
from tinyrun import make_image_folder
from reference_decompose import decomposed_by


def convert(model, key_dim=None, method: str = "tucker", seed: int = 0, progress: bool = False):
    """The public entry with its report (Tucker); the references the tests compare against (the paper's ``parafac``,
    ``cp``) in Tucker's place (``reference_decompose.decomposed_by``)."""
    with decomposed_by(method):
        return collab_vit.reparametrize(model, key_dim, seed=seed, progress=progress, return_report=True)[1]

SMALL = dict(img_size=32, patch_size=8, depth=3, embed_dim=48, num_heads=3, num_classes=5)


pytestmark = pytest.mark.usefixtures("one_thread")


def small_deit(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = timm.create_model("deit_tiny_patch16_224", **SMALL).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "attn.qkv" in name:
                p.normal_(0, 0.3)
    return model


def logits(model: torch.nn.Module, seed: int = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model.eval()(x.to(dtype))


# float32 bounds of a SMALL model (17 tokens, patch inputs 3 x 8 x 8) and of one of its layers (numerics.py)
FULL_RANK_BOUND = vit_chain(48, 3, 17, 3 * 8 * 8, 60)
LAYER_BOUND = attention_chain(48, 60, 17)


@pytest.mark.parametrize("method", ["tucker", "cp", "parafac"])
@pytest.mark.parametrize("key_dim", [48, 60])
def test_exact_at_full_rank(method: str, key_dim: int) -> None:
    reference = small_deit()
    reports = convert(converted := copy.deepcopy(reference), key_dim, method, progress=False)
    assert_within(logits(converted), logits(copy.deepcopy(reference).double(), dtype=torch.float64), FULL_RANK_BOUND)
    # output_error compares two float32 layers (each within the layer's bound of exact), normwise
    assert all(r.tensor_error == 0 and r.output_error < 2 * LAYER_BOUND * U32 for r in reports)


@pytest.mark.parametrize("method", ["tucker", "cp", "parafac"])
def test_compression_error_decreases_with_key_dim(method: str) -> None:
    errors = []
    for key_dim in (8, 16, 32):
        reports = convert(model := small_deit(), key_dim, method, progress=False)
        assert all(isinstance(b.attn, CollaborativeAttention) and b.attn.key_dim == key_dim for b in model.blocks)
        errors.append(max(r.tensor_error for r in reports))
    assert errors[0] > errors[1] > errors[2] > 0


def test_compressed_layer_keeps_values_and_biases_exact() -> None:
    model = small_deit()
    reference = copy.deepcopy(model.blocks[0].attn)
    convert(model, 16, "tucker", progress=False)
    layer = model.blocks[0].attn
    exact = CollaborativeAttention.from_attention(reference)
    assert layer.key_dim == 16
    for part in ("value", "content_bias", "proj"):
        for a, b in zip(getattr(layer, part).parameters(), getattr(exact, part).parameters()):
            assert torch.equal(a, b)


def test_same_seed_same_result() -> None:
    a, b = small_deit(), small_deit()
    convert(a, 12, "cp", seed=3, progress=False)
    convert(b, 12, "cp", seed=3, progress=False)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_list_key_dims() -> None:
    reports = convert(model := small_deit(), [8, 16, 48], "tucker", progress=False)
    assert [b.attn.key_dim for b in model.blocks] == [8, 16, 48] == [r.key_dim for r in reports]


@pytest.mark.parametrize("bad, message", [
    (0, "key_dim must be a positive integer"), (-4, "key_dim must be a positive integer"),
    ([8, 8], "2 entries but the model has 3"), (1.5, "key_dim must be an int, a list of ints"),
    ("16", "key_dim must be"),
])
def test_bad_key_dims(bad: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        convert(small_deit(), bad, progress=False)


def test_old_names() -> None:
    """``reparametrize_layers`` (deprecated) and the ``convert`` alias are gone."""
    assert not hasattr(collab_vit, "reparametrize_layers")
    assert not hasattr(collab_vit.reparam, "convert") and not hasattr(collab_vit.reparam, "reparametrize_layers")


def test_bad_model() -> None:
    with pytest.raises(ValueError, match="has no timm Attention"):
        convert(torch.nn.Sequential(torch.nn.Linear(3, 3)), 8, progress=False)


@pytest.fixture(scope="module")
def deit_tiny_file(tmp_path_factory) -> str:
    """A 'pretrained' timm DeiT-Ti written as DeiT's own .pth layout (hub downloads are not available here)."""
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224")
    path = tmp_path_factory.mktemp("weights") / "deit_tiny.pth"
    torch.save({"model": model.state_dict()}, path)
    return str(path)


def test_convert_cli_file_round_trip(deit_tiny_file: str, tmp_path) -> None:
    out = tmp_path / "tiny_k96.safetensors"
    assert cli_main(["convert", "--model", "deit_tiny_patch16_224", "--checkpoint", deit_tiny_file,
                     "--key-dim", "96", "--out", str(out)]) == 0
    sidecar = json.loads(out.with_suffix(".json").read_text())
    assert sidecar["model_name"] == "collab_deit_tiny_patch16_224" and sidecar["model_kwargs"]["key_dim"] == [96] * 12
    assert len(sidecar["layers"]) == 12 and all(0 < layer["tensor_error"] < 1 for layer in sidecar["layers"])

    source = timm.create_model("deit_tiny_patch16_224", pretrained=True,
                               pretrained_cfg_overlay=dict(file=deit_tiny_file))
    in_memory = collab_vit.reparametrize(source, key_dim=96)
    loaded = timm.create_model("collab_deit_tiny_patch16_224", pretrained=True,
                               pretrained_cfg_overlay=dict(file=str(out)))  # key dims read from the file
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        assert torch.equal(loaded.eval()(x), in_memory.eval()(x))

    # eval.py takes the converted file without restating the model or its key dims
    data = make_image_folder(tmp_path / "data", classes=3, train_per_class=1, val_per_class=2)
    results = evaluate_run(evaluate_args(["--checkpoint", str(out), "--data-dir", str(data), "--workers", "0"]))
    assert results["model"] == "collab_deit_tiny_patch16_224" and results["num_samples"] == 6
    assert results["num_params"] == sum(p.numel() for p in in_memory.parameters())


def test_pretrained_tag_converts_on_load_and_caches(deit_tiny_file: str, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    kwargs = dict(pretrained=True, key_dim=64, pretrained_cfg_overlay=dict(file=deit_tiny_file))
    first = timm.create_model("collab_deit_tiny_patch16_224", **kwargs)
    cached = list((tmp_path / "torch_home").rglob("*.safetensors"))
    assert len(cached) == 1 and "collab_vit" in str(cached[0]) and cached[0].name.endswith("_tucker.safetensors")
    second = timm.create_model("collab_deit_tiny_patch16_224", **kwargs)
    source = timm.create_model("deit_tiny_patch16_224", pretrained=True,
                               pretrained_cfg_overlay=dict(file=deit_tiny_file))
    convert(expected := source, 64, "tucker")
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        reference = expected.eval()(x)
        assert torch.equal(first.eval()(x), reference) and torch.equal(second.eval()(x), reference)


def test_cli_errors_are_one_line(capsys, tmp_path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["convert", "--model", "vit_base_patch16_224", "--model-kwargs", "qk_norm=true", "--key-dim", "96",
                  "--out", str(tmp_path / "x.safetensors")])
    assert exit_info.value.code == 2 and not (tmp_path / "x.safetensors").exists()
    err = capsys.readouterr().err
    assert "cannot convert blocks.0.attn (Attention): qk_norm" in err and len(err.strip().splitlines()) == 1


def test_convert_and_analyze_a_file_this_package_wrote(tmp_path) -> None:
    """A training export records its model: convert / analyze need no --model, and keep its sizes and data config."""
    from collab_vit.weights_io import export_safetensors, read_weights

    kwargs = dict(img_size=28, patch_size=4, in_chans=1, depth=2, embed_dim=32, num_heads=4, num_classes=10)
    torch.manual_seed(0)
    source = timm.create_model("deit_tiny_patch16_224", **kwargs).eval()
    data_config = {"input_size": [1, 28, 28], "mean": [0.286], "std": [0.353], "crop_pct": 1.0,
                   "interpolation": "bicubic", "crop_mode": "center"}
    trained = tmp_path / "model.safetensors"
    export_safetensors(source.state_dict(), str(trained), "deit_tiny_patch16_224", kwargs, {"data_config": data_config})

    out = tmp_path / "k8.safetensors"
    assert cli_main(["convert", "--checkpoint", str(trained), "--key-dim", "8", "--out", str(out)]) == 0
    _, meta = read_weights(str(out))
    assert meta["model_name"] == "collab_deit_tiny_patch16_224"
    assert meta["model_kwargs"] == {**kwargs, "key_dim": [8, 8]} and meta["data_config"] == data_config
    loaded = timm.create_model("collab_deit_tiny_patch16_224", pretrained=True,
                               pretrained_cfg_overlay=dict(file=str(out)), **kwargs)
    expected = collab_vit.reparametrize(copy.deepcopy(source), key_dim=8)
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        assert torch.equal(loaded.eval()(x), expected.eval()(x))

    assert cli_main(["analyze", "--checkpoint", str(trained), "--out", str(tmp_path / "s")]) == 0
    assert (tmp_path / "s" / "spectrum.png").stat().st_size > 0
    assert "suggested key_dim" in (tmp_path / "s" / "spectrum.md").read_text()
    with pytest.raises(SystemExit):
        cli_main(["convert", "--model", "deit_base_patch16_224", "--checkpoint", str(trained), "--key-dim", "8",
                  "--out", str(tmp_path / "x.safetensors")])  # the file says deit_tiny: refused, nothing written
    assert not (tmp_path / "x.safetensors").exists()


def test_convert_cli_model_kwargs_describe_the_source(tmp_path, capsys) -> None:
    """--model-kwargs: a small DeiT (another size, depth, class count) converts and rebuilds from the file alone."""
    source = small_deit()
    path = tmp_path / "small.pth"
    torch.save(source.state_dict(), path)
    out = tmp_path / "small_k16.safetensors"
    flags = [f"{k}={v}" for k, v in SMALL.items()]
    assert cli_main(["convert", "--model", "deit_tiny_patch16_224", "--checkpoint", str(path), "--model-kwargs",
                     *flags, "--key-dim", "16", "--out", str(out)]) == 0
    sidecar = json.loads(out.with_suffix(".json").read_text())
    assert sidecar["model_kwargs"] == {**SMALL, "key_dim": [16] * 3} and sidecar["method"] == "tucker"
    convert(expected := copy.deepcopy(source), 16, progress=False)
    data = make_image_folder(tmp_path / "data", classes=5, train_per_class=1, val_per_class=1, size=32)
    results = evaluate_run(evaluate_args(["--checkpoint", str(out), "--data-dir", str(data), "--workers", "0"]))
    assert results["num_params"] == sum(p.numel() for p in expected.parameters())
    state, meta = read_weights(str(out))
    assert torch.equal(state["head.weight"], source.head.weight)  # the file's 5-class head, not a new one
    loaded = timm.create_model(meta["model_name"], **meta["model_kwargs"])
    loaded.load_state_dict(state)
    assert torch.equal(logits(loaded), logits(expected))

    capsys.readouterr()
    for bad, message in ((["depth"], "expected key=value pairs"), (["no_such_kwarg=1"], "do not fit")):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["convert", "--model", "deit_tiny_patch16_224", "--checkpoint", str(path), "--model-kwargs",
                      *bad, "--key-dim", "16", "--out", str(tmp_path / "bad.safetensors")])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "bad.safetensors").exists()
