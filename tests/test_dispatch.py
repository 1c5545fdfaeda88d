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

from collab_vit import CollaborativeAttention, ConcatAttention
from collab_vit.layers import attention_core, dispatch
from collab_vit.layers.dispatch import Path, select_path
from numerics import assert_within, vit_chain

HEADER = "| device | fused_attn | attention dropout | graph capture | route |"
IMPLEMENTATIONS = {Path.CORE: "core_attend", Path.SDPA: "folded_sdpa", Path.EXPLICIT: "explicit_collaborative"}
DEVICES = {"CPU": ["cpu"], "CUDA, other": ["cuda", "mps", "xpu"], "any": ["cpu", "cuda", "mps"]}
DROPOUTS = {"0": [0.], "> 0": [0.1], "any": [0., 0.1]}
CAPTURES = {"no": [False], "yes": [True], "any": [False, True]}


def table_rows(header: str = HEADER) -> list[list[str]]:
    """The cells of each row of the docstring table under ``header``."""
    lines = dispatch.__doc__.splitlines()
    start = lines.index(header) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def row_calls(row: list[str]) -> list[tuple[str, bool, float, bool]]:
    """Every (device type, fused, dropout, capturing) a table row covers."""
    device, fused, dropout, capture, _ = row
    return [(device_type, fused == "True", p, capturing) for device_type in DEVICES[device]
            for p in DROPOUTS[dropout] for capturing in CAPTURES[capture]]


def row_path(row: list[str]) -> Path:
    return Path(re.match(r"`([\w-]+)`", row[-1]).group(1))


def test_table_is_select_path() -> None:
    rows = table_rows()
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
    for row in table_rows():
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


IMPLEMENTATION_HEADER = "| layer | route | pass | condition | implementation |"
SCENARIOS = {  # (layer, route, pass, condition) of each row: how a call meets that condition (dim 48, 3 heads)
    ("collab", "core", "forward", "CPU, `CPU_FLASH`, `flash_pays`"): {"key_dim": 20},  # 20 <= 2 * head dim 16
    ("collab", "core", "forward", "otherwise"): {"key_dim": 40},
    ("collab", "core", "backward", "no `create_graph`"): {},
    ("collab", "core", "backward", "`create_graph=True`"): {"create_graph": True},
    ("collab", "sdpa", "forward", "any"): {"path": Path.SDPA},
    ("collab", "sdpa", "backward", "any"): {"path": Path.SDPA},
    ("collab", "explicit", "forward", "any"): {"fused": False},
    ("collab", "explicit", "backward", "any"): {"fused": False},
    ("concat", "sdpa", "forward", "`fused_attn`"): {},
    ("concat", "sdpa", "backward", "`fused_attn`"): {},
    ("concat", "explicit", "forward", "not `fused_attn`"): {"fused": False},
    ("concat", "explicit", "backward", "not `fused_attn`"): {"fused": False},
}


def named(cell: str) -> set[str]:
    """The implementations a cell names (in backticks; no module: ``dispatch``)."""
    return set(re.findall(r"`([\w.]+)`", cell))


def spy_named(monkeypatch, names: set[str]) -> list[str]:
    """Record each call of the named implementations, wherever it is looked up from (home module and ``dispatch``)."""
    calls: list[str] = []
    for name in names:
        *path, attr = (["dispatch"] if "." not in name else []) + name.split(".")
        owner = {"dispatch": dispatch, "attention_core": attention_core}[path[0]]
        for part in path[1:]:
            owner = getattr(owner, part)
        original = getattr(owner, attr)

        def call(*args, _name=name, _original=original):
            calls.append(_name)
            return _original(*args)

        monkeypatch.setattr(owner, attr, staticmethod(call) if isinstance(owner, type) else call)
        if owner is not dispatch and getattr(dispatch, attr, None) is original:
            monkeypatch.setattr(dispatch, attr, call)
    return calls


def run_scenario(layer_kind: str, scenario: dict, calls: list[str], monkeypatch) -> dict[str, set[str]]:
    """The implementations one call ran, by pass: a training forward, then the input gradient."""
    torch.manual_seed(0)
    if layer_kind == "collab":
        layer = CollaborativeAttention(48, 3, key_dim=scenario.get("key_dim", 20), qkv_bias=True)
    else:
        layer = ConcatAttention(48, 3, key_dim=24, qkv_bias=True)
    layer.fused_attn = scenario.get("fused", True)
    x = torch.randn(2, 9, 48, requires_grad=True)
    with monkeypatch.context() as patch:
        if "path" in scenario:
            patch.setattr(dispatch, "select_path", lambda *args: scenario["path"])
        calls.clear()
        y = layer.train()(x)
        ran = {"forward": set(calls)}
        calls.clear()
        torch.autograd.grad(y.square().sum(), x, create_graph=scenario.get("create_graph", False))
        ran["backward"] = set(calls)
    return ran


def test_every_implementation_runs_under_its_condition(monkeypatch) -> None:
    """CPU: for each row of the implementations table, a call meeting its condition runs exactly the implementations
    the row names among those the table names for that pass (none for torch's own backward)."""
    rows = [[layer_kind, route.strip("`"), *rest] for layer_kind, route, *rest in table_rows(IMPLEMENTATION_HEADER)]
    assert {tuple(row[:4]) for row in rows} == set(SCENARIOS)
    by_pass = {kind: set().union(*(named(row[4]) for row in rows if row[2] == kind)) for kind in ("forward", "backward")}
    calls = spy_named(monkeypatch, by_pass["forward"] | by_pass["backward"])
    checked = 0
    for layer_kind, route, kind, condition, implementation in rows:
        if "CPU_FLASH" in condition and not attention_core.CPU_FLASH:
            continue  # this torch lacks the CPU flash op: the condition cannot hold
        ran = run_scenario(layer_kind, SCENARIOS[(layer_kind, route, kind, condition)], calls, monkeypatch)
        assert ran[kind] & by_pass[kind] == named(implementation), (layer_kind, route, kind, condition)
        checked += 1
    assert checked >= len(rows) - 1


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
