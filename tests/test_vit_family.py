"""timm's ViT family: exact at full rank against float64, saved and reloaded by timm; the table in
docs/post_hoc.md lists what ``benchmarks/vit_family.py`` covers, within bounds; refusals are one line, before any
work, with the model untouched and nothing written; a conversion failing half way puts the model back."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import timm
import torch
from timm.optim import create_optimizer_v2

import collab_vit
import vit_family
from collab_vit.cli import main as cli_main
from collab_vit.conversion.calibration import candidates
from collab_vit.conversion import reparam
from collab_vit.conversion.weights import convert, fit
from numerics import U32, assert_within

POST_HOC = Path(__file__).parents[1] / "docs" / "post_hoc.md"

pytestmark = pytest.mark.usefixtures("one_thread")


def doc_block() -> str:
    text = POST_HOC.read_text()
    return text.split(f"<!-- {vit_family.MARKER}:start -->")[1].split(f"<!-- {vit_family.MARKER}:end -->")[0]


def table_rows(block: str, first_header: str) -> list[list[str]]:
    """Cells of the markdown table whose header starts with ``| first_header |`` (header and rule dropped)."""
    lines = block.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return rows


def test_doc_table_lists_what_the_command_covers_within_bounds() -> None:
    block = doc_block()
    rows = table_rows(block, "architecture")
    assert [(r[0], r[1].strip("`")) for r in rows] == [(label, name) for label, (name, _) in vit_family.CASES.items()]
    assert len({name for name, _ in vit_family.CASES.values()}) >= 8
    for label, _, full, bound, *_ in rows:
        figure = float(full.split(" ")[0])
        k = int(re.search(r"k = (\d+)", bound).group(1))
        name, kwargs = vit_family.CASES[label]
        assert k == vit_family.chain(vit_family.create(name, kwargs)), label  # the bound the command states
        assert figure <= k * U32, f"{label}: {figure} above {k} u"
    refused = table_rows(block, "refused")
    assert [r[0] for r in refused] == list(vit_family.REFUSED)
    assert all(r[2] == vit_family.refusal(r[0]) for r in refused)  # the reason the code gives today


@pytest.mark.parametrize("label", list(vit_family.CASES))
def test_exact_at_full_rank_and_reloaded_by_timm(label: str) -> None:
    exact = vit_family.full_rank(label)
    assert_within(exact.got, exact.ref, exact.k, what=label)
    assert vit_family.reload_check(exact.converted) == "bit-identical"  # every design that converts
    assert bool(exact.kept) == ("SigLIP" in label)
    if "BEiT" in label:  # the relative position bias carried over: without it the logits differ
        for block in exact.converted.blocks:
            block.attn.relative_position_bias_table = None
        assert vit_family.max_error(vit_family.logits(exact.converted, vit_family.images()), exact.ref) > 1e-3
    if "EVA" in label:  # EVA's blocks pass rope=None; a rope given to a layer converted without one is refused
        with pytest.raises(ValueError, match="without rotary embeddings"):
            exact.converted.blocks[0].attn(torch.randn(1, 17, 64), rope=torch.zeros(16, 32))


def no_decay_names(model: torch.nn.Module) -> set[str]:
    optimizer = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05)
    ids = {id(p) for group in optimizer.param_groups if group["weight_decay"] == 0 for p in group["params"]}
    return {name for name, p in model.named_parameters() if id(p) in ids}


@pytest.mark.parametrize("label", ["SigLIP image tower (attention-pool head)", "DINOv2 with registers",
                                   "BEiT (relative position bias, layer scale)",
                                   "EVA, separate q/k/v projections, scale norm"])
@pytest.mark.parametrize("calibrated", [False, True])
def test_mixing_out_of_decay_for_the_family(label: str, calibrated: bool) -> None:
    name, kwargs = vit_family.CASES[label]
    model = vit_family.create(name, kwargs)
    options = dict(calibration=vit_family.images(4)) if calibrated else {}
    collab_vit.reparametrize(model, key_dim=32, progress=False, **options)
    names = no_decay_names(model)
    assert {f"blocks.{i}.attn.mixing" for i in range(2)} <= names
    assert not any(n.endswith(("query.weight", "key.weight", "content_bias.weight")) for n in names)


def snapshot(model: torch.nn.Module) -> tuple:
    return (type(model), [(n, type(m)) for n, m in model.named_modules()],
            {k: v.clone() for k, v in model.state_dict().items()})


def assert_untouched(model: torch.nn.Module, before: tuple) -> None:
    cls, modules, state = before
    assert type(model) is cls and [(n, type(m)) for n, m in model.named_modules()] == modules
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)


REFUSALS = {  # refused label -> what the one line must say
    "ViT with qk_norm": "blocks.0.attn (Attention): qk_norm",
    "ResNet-18 (no attention)": "ResNet has no timm Attention layer",
    "EVA-01 with qk_norm": "blocks.0.attn (EvaAttention): qk_norm normalises",
}


@pytest.mark.parametrize("label", list(REFUSALS))
def test_refusals_before_any_work(label: str, monkeypatch) -> None:
    name, kwargs = vit_family.REFUSED[label]
    model = vit_family.create(name, kwargs)
    before = snapshot(model)
    fitted = []
    for module in (reparam, convert, candidates):
        monkeypatch.setattr(module, "fit_attention", lambda *a, **k: fitted.append(a))
    with pytest.raises(ValueError) as error:
        collab_vit.reparametrize(model, key_dim=16, progress=False)
    assert REFUSALS[label] in str(error.value) and "\n" not in str(error.value)
    assert fitted == []  # refused before the first layer
    assert_untouched(model, before)


def test_a_conversion_failing_half_way_puts_the_model_back(monkeypatch) -> None:
    model = vit_family.create(*vit_family.CASES["DINOv2 with registers"])
    before = snapshot(model)
    real, calls = reparam.fit_attention, []

    def second_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory (planted)")
        return real(*args, **kwargs)

    for module in (reparam, convert, candidates):
        monkeypatch.setattr(module, "fit_attention", second_fails)
    for options in ({}, dict(calibration=vit_family.images(4), effort="fast")):
        calls.clear()
        with pytest.raises(RuntimeError, match="planted"):
            collab_vit.reparametrize(model, key_dim=16, progress=False, **options)
        assert len(calls) == 2
        assert_untouched(model, before)


@pytest.mark.parametrize("label", list(REFUSALS))
def test_convert_cli_refuses_before_downloading_or_writing(label: str, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(timm.models._builder, "load_pretrained",
                        lambda *a, **k: pytest.fail("downloaded weights of a model it refuses"))
    name, kwargs = vit_family.REFUSED[label]
    flags = ["--model-kwargs", *(f"{k}={v}" for k, v in {**vit_family.SMALL, **kwargs}.items())] if kwargs else []
    for out in (tmp_path / "x.safetensors", tmp_path / "folder"):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["convert", "--model", name, *flags, "--key-dim", "16", "--out", str(out)])
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and "error: " in err and "\n" not in err
        assert REFUSALS[label] in err
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def siglip_file(tmp_path_factory) -> tuple[Path, list[str]]:
    """SigLIP-style weights written as a plain state dict, and the --model-kwargs describing them."""
    name, kwargs = vit_family.CASES["SigLIP image tower (attention-pool head)"]
    path = tmp_path_factory.mktemp("weights") / "siglip.pth"
    torch.save(vit_family.create(name, kwargs).state_dict(), path)
    return path, [f"{k}={v}" for k, v in vit_family.SMALL.items()]


def in_memory(key_dim: int) -> torch.nn.Module:
    model = vit_family.create(*vit_family.CASES["SigLIP image tower (attention-pool head)"])
    collab_vit.reparametrize(model, key_dim=key_dim, progress=False)
    return model


def test_convert_cli_any_timm_model_to_a_folder_and_a_file(siglip_file, tmp_path: Path) -> None:
    path, flags = siglip_file
    name = "vit_base_patch16_siglip_224"
    base = ["convert", "--model", name, "--checkpoint", str(path), "--model-kwargs", *flags,
            "--key-dim", "24"]
    assert cli_main(base + ["--out", str(tmp_path / "folder")]) == 0
    assert sorted(p.name for p in (tmp_path / "folder").iterdir()) == ["config.json", "conversion.json",
                                                                       "model.safetensors"]
    report = json.loads((tmp_path / "folder" / "conversion.json").read_text())
    assert [layer["key_dim"] for layer in report["layers"]] == [24, 24] and "attn_pool" in report["kept"]
    expected = in_memory(24)
    x = vit_family.images(3, seed=2)
    again = timm.create_model(f"local-dir:{tmp_path / 'folder'}", pretrained=True).eval()
    assert torch.equal(vit_family.logits(again, x), vit_family.logits(expected, x))

    assert cli_main(base + ["--out", str(tmp_path / "m.safetensors")]) == 0
    from collab_vit.weights_io import read_weights
    state, meta = read_weights(str(tmp_path / "m.safetensors"))
    assert meta["model_name"] == "collab_vit_converted" and meta["model_kwargs"]["source_model"] == name
    assert [layer["key_dim"] for layer in meta["model_kwargs"]["collaborative_layers"].values()] == [24, 24]
    rebuilt = timm.create_model(meta["model_name"], **meta["model_kwargs"]).eval()
    rebuilt.load_state_dict(state)
    assert torch.equal(vit_family.logits(rebuilt, x), vit_family.logits(expected, x))
    assert json.loads((tmp_path / "m.json").read_text())["kept"] == report["kept"]
    from_file = timm.create_model("collab_vit_converted", pretrained=True,  # the file alone, as docs/post_hoc.md says
                                  pretrained_cfg_overlay=dict(file=str(tmp_path / "m.safetensors"))).eval()
    assert torch.equal(vit_family.logits(from_file, x), vit_family.logits(expected, x))
    assert tuple(from_file.pretrained_cfg["input_size"]) == (3, 32, 32)

    from collab_vit.training.eval_cli import parse_args, run
    from tinyrun import make_image_folder
    data = make_image_folder(tmp_path / "data", classes=10, train_per_class=1, val_per_class=1, size=32)
    results = [run(parse_args(["--checkpoint", str(tmp_path / out), "--data-dir", str(data), "--workers", "0"]))
               for out in ("m.safetensors", "folder")]  # eval.py takes both, and scores them alike
    assert results[0]["model"] == results[1]["model"] == "collab_vit_converted"
    assert results[0]["top1"] == results[1]["top1"] and results[0]["data_config"] == results[1]["data_config"]


def test_convert_cli_bad_out_is_one_line(siglip_file, tmp_path: Path, capsys) -> None:
    path, flags = siglip_file
    (tmp_path / "taken").write_text("not a folder")
    for out, message in ((tmp_path / "x.pth", "must be a .safetensors file or a folder"),
                         (tmp_path / "taken", "exists and is not a folder")):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["convert", "--model", "vit_base_patch16_siglip_224", "--checkpoint", str(path),
                      "--model-kwargs", *flags, "--key-dim", "24", "--out", str(out)])
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and message in err and "\n" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_one_layer_with_qk_norm_is_refused_before_decomposing(monkeypatch) -> None:
    from timm.layers import Attention

    monkeypatch.setattr(fit, "tucker_decompose", lambda *a, **k: pytest.fail("decomposed a refused layer"))
    with pytest.raises(ValueError, match="cannot convert this Attention: qk_norm"):
        collab_vit.reparametrize_attention(Attention(32, 4, qk_norm=True, norm_layer=torch.nn.LayerNorm), 8)


def test_beit_attention_rewritten_as_timm_attention_is_the_same_function() -> None:
    """forms.from_beit: fused qkv bias [q_bias, 0, v_bias] plus the relative position bias, float64 against BEiT's
    own layer (both explicit and SDPA), with and without a shared bias."""
    from collab_vit.conversion.weights.forms import from_beit
    from numerics import attention_chain

    model = vit_family.create("beit_base_patch16_224", {}).double()
    beit = model.blocks[0].attn
    ours = from_beit(beit)
    x = torch.randn(2, 17, 64, dtype=torch.float64)
    shared = torch.randn(1, 4, 17, 17, dtype=torch.float64)
    for fused in (False, True):
        beit.fused_attn = ours.fused_attn = fused
        for bias in (None, shared):
            with torch.no_grad():
                assert_within(ours(x, shared_rel_pos_bias=bias), beit(x, shared_rel_pos_bias=bias),
                              attention_chain(64, 64, 17), torch.float64, what=f"fused={fused}")


@pytest.mark.parametrize("label", ["BEiT (relative position bias, layer scale)", "DeiT distilled (distillation token)"])
def test_convert_cli_writes_any_design_that_converts(label: str, tmp_path: Path) -> None:
    """Designs version 0.2 could not write (BEiT, the distilled DeiT): ``collab-vit convert`` writes
    the folder and the file, recorded as their source; both reload to the in-memory conversion, bit for bit."""
    name, kwargs = vit_family.CASES[label]
    source = vit_family.create(name, kwargs)
    torch.save(source.state_dict(), tmp_path / "source.pth")
    flags = ["--model-kwargs", *(f"{k}={v}" for k, v in {**vit_family.SMALL, **kwargs}.items())]
    base = ["convert", "--model", name, "--checkpoint", str(tmp_path / "source.pth"), *flags, "--key-dim", "16"]
    assert cli_main(base + ["--out", str(tmp_path / "folder")]) == 0
    assert cli_main(base + ["--out", str(tmp_path / "m.safetensors")]) == 0
    collab_vit.reparametrize(source, key_dim=16, progress=False)
    x = vit_family.images(3, seed=2)
    config = json.loads((tmp_path / "folder" / "config.json").read_text())
    assert config["architecture"] == "collab_vit_converted" and config["model_args"]["source_model"] == name
    from_folder = timm.create_model(f"local-dir:{tmp_path / 'folder'}", pretrained=True).eval()
    from_file = timm.create_model("collab_vit_converted", pretrained=True,
                                  pretrained_cfg_overlay=dict(file=str(tmp_path / "m.safetensors"))).eval()
    for again in (from_folder, from_file):
        assert torch.equal(vit_family.logits(again, x), vit_family.logits(source, x))


def test_spectrum_of_beit_and_eva_layers_reads_their_timm_form() -> None:
    """``collab-vit analyze`` (``layer_spectra``) on BEiT and EVA with separate q/k/v: the model is not changed."""
    from collab_vit.conversion.files.spectrum import layer_spectra

    for label in ("BEiT (relative position bias, layer scale)", "EVA, separate q/k/v projections, scale norm"):
        model = vit_family.create(*vit_family.CASES[label])
        before = snapshot(model)
        assert len(layer_spectra(model)) == 2
        assert_untouched(model, before)


class PlainSubclass(timm.layers.Attention):
    """A subclass that keeps timm's forward: converted like timm's Attention."""


class OwnForward(timm.layers.Attention):
    def forward(self, x, attn_mask=None, is_causal=False):
        return super().forward(x, attn_mask, is_causal) * 2


def test_attention_subclasses_and_differential_attention() -> None:
    for layer, expected in ((PlainSubclass, None), (OwnForward, "OwnForward subclasses timm's Attention with its own "
                                                                "forward"), ("diff", "differential attention")):
        model = vit_family.create("vit_tiny_patch16_224", dict(attn_layer=layer))
        if expected is None:
            reference = copy.deepcopy(model).double()
            collab_vit.reparametrize(model, progress=False)
            x = vit_family.images()
            assert_within(vit_family.logits(model, x), vit_family.logits(reference, x.double()),
                          vit_family.chain(reference))
            continue
        before = snapshot(model)
        with pytest.raises(ValueError, match=expected):
            collab_vit.reparametrize(model, key_dim=16, progress=False)
        assert_untouched(model, before)
