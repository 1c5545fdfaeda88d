"""One function picks the route (``dispatch.select_path``); the tables in ``dispatch``'s docstring say the same: the
layer runs the route the first names on every device this machine has, and each forward and backward implementation
the second names runs under its condition and no other. fx-traced models script and run (timm's fx test)."""
from __future__ import annotations

import copy
import itertools
import re

import pytest
import timm
import torch
from timm.layers import create_feature_extractor, get_graph_node_names, set_scriptable

from collab_vit import CollaborativeAttention
from collab_vit.layers import dispatch
from collab_vit.layers.dispatch import Path, select_path
from gpu_coverage import (IMPLEMENTATION_HEADER, ROUTE_HEADER, ROUTE_IMPLEMENTATIONS, SCENARIOS,
                          implementation_rows, table_rows)
from numerics import assert_within, vit_chain

HEADER = ROUTE_HEADER
DEVICES = {"CPU": ["cpu"], "CUDA, other": ["cuda", "mps", "xpu"], "any": ["cpu", "cuda", "mps"]}
DROPOUTS = {"0": [0.], "> 0": [0.1], "any": [0., 0.1]}
CAPTURES = {"no": [False], "yes": [True], "any": [False, True]}
IMPLEMENTATIONS = ROUTE_IMPLEMENTATIONS  # route -> the dispatch function that runs it


def row_calls(row: list[str]) -> list[tuple[str, bool, float, bool]]:
    """Every (device type, fused, dropout, capturing) a table row covers."""
    device, fused, dropout, capture, _ = row
    return [(device_type, fused == "True", p, capturing) for device_type in DEVICES[device]
            for p in DROPOUTS[dropout] for capturing in CAPTURES[capture]]


def row_path(row: list[str]) -> Path:
    return Path(re.match(r"`([\w-]+)`", row[-1]).group(1))


def test_table_is_select_path() -> None:
    rows = table_rows(HEADER)
    assert len(rows) >= 4
    covered = set()
    for row in rows:
        for call in row_calls(row):
            assert select_path(*call) == row_path(row), row
        covered.add(row_path(row))
    assert covered == set(Path)


def available_devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def spy_implementations(monkeypatch) -> list[Path]:
    """Record which implementation each call of the layer runs (the list returned fills as the layer runs)."""
    calls: list[Path] = []

    def spy(path: Path, implementation):
        def call(*args):
            calls.append(path)
            return implementation(*args)
        return call

    for path, name in IMPLEMENTATIONS.items():
        monkeypatch.setattr(dispatch, name, spy(path, getattr(dispatch, name)))
    return calls


@pytest.mark.parametrize("device", available_devices())
def test_layer_runs_the_tables_path(device: str, monkeypatch) -> None:
    """Each eager row for this device: the layer, in that mode, calls that implementation and no other."""
    calls = spy_implementations(monkeypatch)
    checked = 0
    for row in table_rows(HEADER):
        for (device_type, fused, p, capturing), training in itertools.product(row_calls(row), (True, False)):
            if device_type != device or capturing or (p > 0 and not training):
                continue  # dropout is off in eval
            layer = CollaborativeAttention(48, 3, key_dim=20, qkv_bias=True, attn_drop=p).to(device).train(training)
            layer.fused_attn = fused
            calls.clear()
            with torch.set_grad_enabled(training):
                layer(torch.randn(2, 9, 48, device=device))
            assert calls == [row_path(row)], row
            checked += 1
    assert checked >= 2


def test_fx_traced_model_scripts_and_matches_eager() -> None:
    """timm's ``test_model_forward_fx_torchscript`` on our model: fx trace (timm's tracer settings), then
    ``torch.jit.script``; the scripted graph used to call the eager-only core and raise."""
    torch.manual_seed(0)
    with set_scriptable(True):
        model = timm.create_model("collab_deit_tiny_patch16_224_k48", depth=2, img_size=32, patch_size=8).eval()
    _, eval_nodes = get_graph_node_names(model)
    scripted = torch.jit.script(create_feature_extractor(model, return_nodes=[eval_nodes[-1]]))
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        (out,) = scripted(x).values()
        expected = copy.deepcopy(model).double()(x.double())
        assert_within(out, expected, vit_chain(model.embed_dim, 2, 17, 3 * 8 * 8, 48))


@pytest.mark.parametrize("device", available_devices())
def test_traced_layer_runs_the_capture_route(device: str, monkeypatch) -> None:
    """``torch.jit.trace`` (what the TorchScript ONNX exporter runs) takes the table's graph-capture row, never the
    autograd Function ``core`` (a Python call in the trace; the ONNX exporter dropped its output)."""
    calls = spy_implementations(monkeypatch)
    layer = CollaborativeAttention(48, 3, key_dim=20, qkv_bias=True).to(device).eval()
    x = torch.randn(2, 9, 48, device=device)
    with torch.no_grad():
        traced = torch.jit.trace(layer, x, check_trace=False)  # the check would rerun it eagerly
    assert calls == [select_path(device, True, 0., True)] and Path.CORE not in calls
    assert not [n for n in traced.inlined_graph.nodes() if n.kind() == "prim::PythonOp"]


def test_every_implementation_runs_under_its_condition() -> None:
    """For each row of the implementations table, a call meeting its condition runs exactly the implementations the
    row names among those the table names for that pass (none for torch's own backward): ``gpu_coverage``'s cases,
    the ones the GPU check runs (the non-CPU route on ``meta`` here)."""
    rows = table_rows(IMPLEMENTATION_HEADER)
    assert {(kind, route.strip("`"), p, condition) for kind, route, p, condition, _ in rows} == set(SCENARIOS)
    results = implementation_rows(torch.device("cpu"))
    assert [row for row, ran, ok in results if ok is False] == []
    assert sum(ok is True for *_, ok in results) >= len(rows) - 1  # the CPU flash row needs torch's CPU flash op


def test_plain_fx_trace_keeps_the_route_a_leaf() -> None:
    """``torch.fx.symbolic_trace`` (no timm tracer) records ``collaborative_attend`` as one call, chosen when the
    graph runs, and the traced layer computes what the layer does."""
    torch.manual_seed(0)
    layer = CollaborativeAttention(48, 3, key_dim=20, qkv_bias=True).eval()
    traced = torch.fx.symbolic_trace(layer)
    targets = [node.target for node in traced.graph.nodes if node.op == "call_function"]
    assert dispatch.collaborative_attend in targets
    x = torch.randn(2, 9, 48)
    with torch.no_grad():
        assert torch.equal(traced(x), layer(x))
