"""Models holding any layer class the package makes pickle and reload: ``pickle``, ``torch.save(model)`` /
``torch.load(weights_only=False)`` in this process and in a fresh one (where a class made on the fly does not exist
until the load makes it), with bit-identical outputs."""
from __future__ import annotations

import copy
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch

import collab_vit

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = dict(img_size=32, patch_size=8, depth=2, num_classes=5)
SMALL = dict(embed_dim=64, num_heads=4, **TINY)


def models() -> dict[str, torch.nn.Module]:
    """One model per layer class: fixed key dim, one per block, converted (a BEiT form and timm's Attention), cut,
    the registered rotary ones (timm's Eva with the collaborative rotary layer)."""
    torch.manual_seed(0)
    return {
        "fixed": timm.create_model("collab_deit_tiny_patch16_224_k48", **TINY),
        "per block": timm.create_model("collab_deit_tiny_patch16_224", key_dim=[48, 96], **TINY),
        "random mixing": timm.create_model("collab_deit_tiny_patch16_224", key_dim=24, mixing_init="random", **TINY),
        "converted ViT": collab_vit.reparametrize(timm.create_model("vit_small_patch16_224", **SMALL), 32,
                                                  progress=False),
        "converted BEiT": collab_vit.reparametrize(timm.create_model("beit_base_patch16_224", **SMALL), [16, 48],
                                                   progress=False),
        "concatenate": timm.create_model("concat_deit_tiny_patch16_224_k48", **TINY),
        "rotary grid": timm.create_model("collab_vit_small_patch16_rope_224_k96", **TINY),
        "rotary, random mixing": timm.create_model("collab_vit_small_patch16_rope_ape_224", key_dim=32,
                                                   mixing_init="random", **SMALL),
    }


def outputs(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(x)


def test_pickle_and_torch_save_round_trip(tmp_path: Path) -> None:
    x = torch.randn(2, 3, 32, 32)
    for name, model in models().items():
        expected = outputs(model, x)
        classes = [type(m).__name__ for m in model.modules()]
        for again in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
            assert torch.equal(outputs(again, x), expected), name
            assert [type(m).__name__ for m in again.modules()] == classes, name
        torch.save(model, tmp_path / "model.pt")
        assert torch.equal(outputs(torch.load(tmp_path / "model.pt", weights_only=False), x), expected), name


FRESH = """
import sys, torch
torch.set_num_threads(1)
saved = torch.load(sys.argv[1], weights_only=False)
for name, model in saved["models"].items():
    with torch.no_grad():
        assert torch.equal(model.eval()(saved["input"]), saved["outputs"][name]), name
    print(name, type(model.blocks[0].attn).__name__)
"""


def test_a_fresh_process_loads_every_layer_class(tmp_path: Path) -> None:
    """No ``import collab_vit`` before the load: unpickling makes the classes itself."""
    x = torch.randn(2, 3, 32, 32)
    built = models()
    torch.save({"models": built, "input": x, "outputs": {n: outputs(m, x) for n, m in built.items()}},
               tmp_path / "all.pt")
    result = subprocess.run([sys.executable, "-c", FRESH, str(tmp_path / "all.pt")], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr.strip().splitlines()[-1:]
    lines = result.stdout.splitlines()
    assert len(lines) == len(built) and "per block CollaborativeAttentionPerBlock" in lines
