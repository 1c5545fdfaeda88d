"""One calibrated ``collab-vit convert`` per output: a second run on the same ``--out`` while the first one runs is
refused in one line naming the first (its pid and host, and the lock file), exit 2, and leaves the first one's state
folder as it was; the first ends with the weights of an uninterrupted run. Runs interleaved on one ``--out`` with
another seed, each killed mid-refinement (``kill -9``: the kernel drops the lock with the process), end, when the
first command runs again, with the first command's uninterrupted weights."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest
from safetensors.torch import load_file

import warmstart
from test_resume import KILLED, convert

# the command, paused as its second layer's refinement starts (the first one committed): it writes its pid into
# PAUSED and waits for the file GO
PAUSED = """
import os, sys, time
from pathlib import Path
from collab_vit.conversion.calibration import blockwise
real, started = blockwise.refine_layer, []

def pausing(*args, **kwargs):
    if started:
        Path(os.environ["PAUSED"] + ".tmp").write_text(str(os.getpid()))
        os.replace(os.environ["PAUSED"] + ".tmp", os.environ["PAUSED"])
        while not Path(os.environ["GO"]).exists():
            time.sleep(0.05)
    started.append(1)
    return real(*args, **kwargs)

blockwise.refine_layer = pausing
from collab_vit.cli import main
main(sys.argv[1:])
"""


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The folder holding the data, the source and ``whole.safetensors``: the seed-0 command run uninterrupted."""
    folder = tmp_path_factory.mktemp("lock")
    whole = convert(folder, folder / "whole.safetensors")
    assert whole.code == 0, whole.why()
    return folder


def same_weights(a: Path, b: Path) -> bool:
    first, second = load_file(str(a)), load_file(str(b))
    return first.keys() == second.keys() and all(first[k].equal(second[k]) for k in first)


def snapshot(folder: Path) -> dict[str, tuple[int, str]]:
    """Each file of ``folder``: its modification time and a hash of its bytes."""
    return {p.name: (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest()) for p in folder.iterdir()}


@contextlib.contextmanager
def paused(tmp: Path, out: Path, monkeypatch, *extra: str) -> Iterator[tuple[Future, int]]:
    """The command on ``out`` (``extra``: more flags) started in the background and paused after its first refined
    layer was committed: the block runs then, given the run and its pid; the run goes on when the block ends."""
    pid, go = tmp / f"{out.name}.pid", tmp / f"{out.name}.go"
    monkeypatch.setenv("PAUSED", str(pid))
    monkeypatch.setenv("GO", str(go))
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(convert, tmp, out, *extra, code=PAUSED)
        try:
            deadline = time.monotonic() + 300
            while not pid.exists() and not run.done() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert pid.exists(), run.result().why() if run.done() else "the first run never paused"
            yield run, int(pid.read_text())
        finally:
            go.touch()


def test_a_second_run_on_the_same_output_is_refused_while_the_first_runs(uninterrupted, monkeypatch) -> None:
    tmp = uninterrupted
    out, partial = tmp / "busy.safetensors", tmp / "busy.safetensors.partial"
    with paused(tmp, out, monkeypatch) as (first, pid):
        assert list(json.loads((partial / "state.json").read_text())["layers"]) == ["0"]
        before = snapshot(partial)
        second = convert(tmp, out)
        assert snapshot(partial) == before  # nothing read into, cleared or removed
    lines = [line for line in second.err.splitlines() if line.strip()]
    assert second.code == 2 and len(lines) == 1 and "Traceback" not in second.err, second.why()
    assert lines[0] == (f"collab-vit convert: error: another conversion to {out} is running (pid {pid} on host "
                        f"{socket.gethostname()}; its lock: {partial / 'lock'}): wait for it to end, or choose "
                        f"another --out"), lines[0]
    assert second.out == ""  # refused before any work: no cost line
    assert first.result().code == 0, first.result().why()
    assert same_weights(tmp / "whole.safetensors", out) and not partial.exists()


def test_runs_interleaved_with_another_seed_end_with_the_first_commands_weights(uninterrupted, monkeypatch) -> None:
    """The replay of runs interleaved on one --out: --seed 1 started while --seed 0 refines (refused), --seed 0 killed
    mid-refinement, --seed 1 run and killed mid-refinement (it clears the seed-0 state, holding the lock), then the
    --seed 0 command again: the uninterrupted seed-0 weights, not resumed from seed 1's layers."""
    tmp = uninterrupted
    out, partial = tmp / "k6.safetensors", tmp / "k6.safetensors.partial"
    with paused(tmp, out, monkeypatch, "--seed", "0") as (first, pid):
        key = json.loads((partial / "state.json").read_text())["key"]
        beside = convert(tmp, out, "--seed", "1", code=KILLED)
        assert beside.code == 2 and "another conversion to" in beside.err, beside.why()
        os.kill(pid, signal.SIGKILL)
        assert first.result().code == -9, first.result().why()
    later = convert(tmp, out, "--seed", "1", code=KILLED)
    assert later.code == -9, later.why()
    state = json.loads((partial / "state.json").read_text())
    assert list(state["layers"]) == ["0"] and state["key"] != key and not out.exists()
    again = convert(tmp, out, "--seed", "0")
    assert again.code == 0 and "resuming" not in again.out, again.why()  # seed 1's state is not resumed from
    assert same_weights(tmp / "whole.safetensors", out) and not partial.exists()
    summary = [json.loads(p.with_suffix(".json").read_text())["calibration"] for p in (tmp / "whole.safetensors", out)]
    assert summary[0]["candidates"] == summary[1]["candidates"] and summary[0]["chosen"] == summary[1]["chosen"]


def test_a_weight_only_run_leaves_a_running_conversions_state_alone(uninterrupted, monkeypatch) -> None:
    """The weight-only conversion keeps no state and takes no lock; finishing, it removes a stopped run's state
    folder only where no run holds it."""
    tmp = uninterrupted
    out, partial = tmp / "shared.safetensors", tmp / "shared.safetensors.partial"
    with paused(tmp, out, monkeypatch) as (first, _):
        before = snapshot(partial)
        plain = _weight_only(tmp, out)
        assert plain.code == 0, plain.why()
        assert snapshot(partial) == before
    assert first.result().code == 0, first.result().why()
    assert not partial.exists()
    killed = convert(tmp, out, code=KILLED)  # a stopped run's folder, then a weight-only run: removed
    assert killed.code == -9 and partial.exists(), killed.why()
    assert _weight_only(tmp, out).code == 0 and not partial.exists()


def _weight_only(tmp: Path, out: Path) -> warmstart.Done:
    """``collab-vit convert`` of the test source without calibration images."""
    args = ["convert", "--checkpoint", str(tmp / "source_c3_s16.safetensors"), "--key-dim", "6", "--out", str(out)]
    return warmstart.run([sys.executable, str(Path(sys.executable).parent / "collab-vit"), *args], tmp,
                         {**os.environ, "OMP_NUM_THREADS": "1"})
