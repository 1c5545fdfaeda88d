"""The cache of weights converted on load: keyed by everything it holds and is made from, written once per cache."""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pytest
import timm
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import collab_vit
from collab_vit.conversion.files import pretrained
from collab_vit.conversion.files.pretrained import cache_key

SMALL = dict(img_size=32, patch_size=8, depth=2, embed_dim=48, num_heads=3)
KEY_DIM = 24  # below the full 48: a real (lossy) decomposition, so a wrong entry cannot pass for a right one

pytestmark = pytest.mark.usefixtures("one_thread")


def write_source(path: Path, change: str = "") -> str:
    """A 'pretrained' DeiT (DeiT's .pth layout), optionally with one attention tensor changed."""
    torch.manual_seed(0)
    state = timm.create_model("deit_tiny_patch16_224", **SMALL).state_dict()
    if change:
        noise = torch.randn(state[change].shape, generator=torch.Generator().manual_seed(1))
        state[change] = state[change] + 0.5 * noise
    torch.save({"model": state}, path)
    return str(path)


def load_collab(source: str) -> torch.nn.Module:
    return timm.create_model("collab_deit_tiny_patch16_224", pretrained=True, key_dim=KEY_DIM,
                             pretrained_cfg_overlay=dict(file=source), **SMALL)


def in_memory(source: str) -> torch.nn.Module:
    model = timm.create_model("deit_tiny_patch16_224", pretrained=True, pretrained_cfg_overlay=dict(file=source),
                              **SMALL)
    return collab_vit.reparametrize(model, key_dim=KEY_DIM)


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def count_conversions(monkeypatch) -> list:
    calls = []
    original = pretrained.convert_attention_state
    monkeypatch.setattr(pretrained, "convert_attention_state", lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


def test_sources_differing_in_biases_or_projection_do_not_share_an_entry(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    calls = count_conversions(monkeypatch)
    sources = [write_source(tmp_path / "base.pth"),
               write_source(tmp_path / "qkv_bias.pth", "blocks.0.attn.qkv.bias"),  # content bias and value bias
               write_source(tmp_path / "proj.pth", "blocks.1.attn.proj.weight")]
    for source in sources:
        assert_same_weights(load_collab(source), in_memory(source))
    entries = sorted((tmp_path / "torch_home").rglob("*.safetensors"))
    assert len(entries) == 3 and len(calls) == 3
    assert_same_weights(load_collab(sources[1]), in_memory(sources[1]))  # read from its own entry
    assert len(calls) == 3 and sorted((tmp_path / "torch_home").rglob("*.safetensors")) == entries


def test_key_covers_options_target_and_versions(monkeypatch) -> None:
    torch.manual_seed(0)
    model = timm.create_model("collab_deit_tiny_patch16_224", key_dim=KEY_DIM, **SMALL)
    state = timm.create_model("deit_tiny_patch16_224", **SMALL).state_dict()
    base = cache_key(state, model, {})[0]
    assert cache_key(state, model, {"seed": 1, "tol": 1e-6})[0] == base  # a default; tucker takes no seed
    others = [cache_key(state, model, {"dtype": torch.float32})[0],
              cache_key(state, model, {"max_iter": 5})[0],
              cache_key(state, timm.create_model("collab_deit_tiny_patch16_224", key_dim=12, **SMALL), {})[0],
              cache_key({**state, "blocks.1.attn.proj.bias": state["blocks.1.attn.proj.bias"].double()}, model,
                        {})[0]]
    monkeypatch.setattr(collab_vit._version, "__version__", "0.0.0-other")
    others.append(cache_key(state, model, {})[0])
    assert len(set(others + [base])) == len(others) + 1


def _create_on_two_processes(rank: int, tmp: str, sources: dict) -> None:
    """One of two processes: create the model from ``sources["independent"]`` without a process group (the two
    start together through files), then from ``sources["group"]`` in a gloo group without the file lock; count
    conversions in files."""
    os.environ["TORCH_HOME"] = os.path.join(tmp, "torch_home")
    torch.set_num_threads(1)
    original = pretrained.convert_attention_state
    case = {}

    def counted(*args, **kwargs):
        with open(os.path.join(tmp, f"conversions_{case['name']}"), "a") as f:
            f.write(f"{rank}\n")
        time.sleep(1.0)  # long enough for the other process to look for the entry meanwhile
        return original(*args, **kwargs)

    pretrained.convert_attention_state = counted
    for name in ("independent", "group"):
        case["name"] = name
        if name == "group":  # the barrier alone, as on a filesystem without file locks
            pretrained._entry_lock = lambda path: contextlib.nullcontext()
            dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
            dist.barrier()
        else:
            Path(tmp, f"ready{rank}").touch()
            while not all(Path(tmp, f"ready{r}").exists() for r in range(2)):
                time.sleep(0.01)
        torch.save(load_collab(sources[name]).state_dict(), os.path.join(tmp, f"{name}_rank{rank}.pth"))
    dist.destroy_process_group()


def test_two_processes_convert_once(tmp_path) -> None:
    """Two processes load the same source: without a process group (the entry's file lock) and in a gloo group
    (rank 0 converts, the other waits at a barrier); one conversion each time, identical weights."""
    sources = {"independent": write_source(tmp_path / "a.pth"),
               "group": write_source(tmp_path / "b.pth", "blocks.0.attn.qkv.weight")}
    mp.spawn(_create_on_two_processes, args=(str(tmp_path), sources), nprocs=2, join=True)
    assert len(list((tmp_path / "torch_home").rglob("*.safetensors"))) == 2
    for name, source in sources.items():
        assert len((tmp_path / f"conversions_{name}").read_text().split()) == 1, name
        expected = in_memory(source).state_dict()
        for rank in range(2):
            state = torch.load(tmp_path / f"{name}_rank{rank}.pth")
            assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in expected)
