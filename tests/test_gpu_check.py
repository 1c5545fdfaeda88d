"""The GPU check script's CPU smoke mode runs in the suite, so that the script cannot rot before a GPU runs it."""
from __future__ import annotations

from pathlib import Path

import gpu_check


def test_gpu_check_tiny_cpu_mode(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.md"
    assert gpu_check.main(["--device", "cpu", "--tiny", "--out", str(out)]) == 0
    report = out.read_text()
    for section in ("## Correctness", "## Kernels", "## Throughput and peak memory (bf16 autocast)", "## Verdict"):
        assert section in report
    assert "- all checks passed" in report and "**NO**" not in report
    assert "| collab k8 | bf16 train | flash, CPU core |" in report  # the profiler sees the core and its flash forward
    assert "`collab_deit_tiny_patch16_224_k48`" in report


def test_gpu_check_without_cuda_says_so(capsys, monkeypatch) -> None:
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err
