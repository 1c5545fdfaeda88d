"""The GPU check script's CPU smoke mode runs in the suite, so that the script cannot rot before a GPU runs it; its
coverage part fails when a layer class or a row of the dispatch tables has no case."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import gpu_check
import gpu_coverage
from collab_vit.layers import attention, dispatch
from collab_vit.layers.attention import CollaborativeAttention
from collab_vit.layers.rotary import CollaborativeEvaAttention

pytestmark = pytest.mark.usefixtures("one_thread")


def test_gpu_check_tiny_cpu_mode(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.md"
    assert gpu_check.main(["--device", "cpu", "--tiny", "--out", str(out)]) == 0
    report = out.read_text()
    for section in ("## Correctness against float64", "## What SDPA receives on the CUDA route", "## Kernels",
                    "## Shared keys: stride-0 view against a contiguous copy", "## Routes (one layer, each route forced)",
                    "## Compiled training step", "## Throughput and peak memory (bf16 autocast)",
                    "## Coverage: layer classes and the dispatch tables", "## Verdict"):
        assert section in report
    assert "- all checks passed" in report and "**NO**" not in report
    assert "| collab k8 | 9 | bf16 train | flash, CPU core |" in report  # the profiler sees the core and its flash
    assert "`collab_deit_tiny_patch16_224_k48`" in report
    for case in gpu_coverage.LAYERS:  # every layer case in the float64 comparison, at both lengths
        assert f"| {case.label} | 9 |" in report and f"| {case.label} | 17 |" in report
    assert "| rope axial | 30 | bfloat16 | 32/32/16 | (" in report  # aligned on the CUDA route (meta here)


def coverage_failures() -> list[str]:
    failures: list[str] = []
    gpu_coverage.coverage_section(torch.device("cpu"), [], failures)
    return failures


def test_coverage_passes_as_the_package_is() -> None:
    assert coverage_failures() == []


def test_a_layer_class_without_a_case_fails(monkeypatch) -> None:
    monkeypatch.setattr(gpu_coverage, "LAYERS", [c for c in gpu_coverage.LAYERS if c.cls is not CollaborativeEvaAttention])
    assert coverage_failures() == ["coverage: layer class CollaborativeEvaAttention has no case in gpu_coverage.LAYERS"]
    monkeypatch.undo()

    class NewAttention(CollaborativeAttention):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x)

    NewAttention.__module__ = attention.__name__
    monkeypatch.setattr(attention, "NewAttention", NewAttention, raising=False)
    assert coverage_failures() == ["coverage: layer class NewAttention has no case in gpu_coverage.LAYERS"]


def test_a_dispatch_row_without_its_case_fails(monkeypatch) -> None:
    """A row added to either table, or a case removed, fails the check; so does a row the code does not follow."""
    new_row = "| collab | `core` | forward | on Tuesdays | `attention_core.grouped_forward` |\n"
    anchor = "| collab | `core` | backward | no `create_graph` |"
    monkeypatch.setattr(dispatch, "__doc__", dispatch.__doc__.replace(anchor, new_row + anchor))
    assert [f for f in coverage_failures() if "on Tuesdays" in f]
    monkeypatch.undo()
    key = ("concat", "explicit", "backward", "not `fused_attn`")
    monkeypatch.delitem(gpu_coverage.SCENARIOS, key)
    assert [f for f in coverage_failures() if "not `fused_attn`" in f and "no case" in f]
    monkeypatch.undo()
    wrong = dispatch.__doc__.replace("| CPU | True | 0 | no | `core` |", "| CPU | True | 0 | no | `explicit` |")
    monkeypatch.setattr(dispatch, "__doc__", wrong)
    assert coverage_failures() == ["coverage: dispatch row 'CPU | True | 0 | no | `explicit`' ran cpu: core_attend"]


def test_gpu_check_without_cuda_says_so(capsys, monkeypatch) -> None:
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err
