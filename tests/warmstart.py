"""Start a command line in a new process without paying its third-party imports each time.

A user's ``collab-vit`` / ``eval.py`` / ``train.py`` spends about 5 s of a 2-core CPU importing torch, torchvision
and timm before its first line runs (timm pulls in torch's compiler and wandb); a suite that runs every command on
every model family would spend most of its time there. :func:`run` starts each command in a process forked from a
server that has imported those three packages and nothing of ours (``multiprocessing``'s forkserver with them
preloaded; no tensor op has run there, so no thread pool is forked). The child then does what the shell does: it
sets the environment and working folder, points stdout and stderr at files, and runs the script file itself
(``.venv/bin/collab-vit``, ``eval.py``, ``train.py`` or ``python -c CODE``) as ``__main__`` with the command's
``argv``; the exit code is the script's. ``collab_vit`` is imported afresh by each child, as by a user's process.

Variables of the environment that the preloaded packages read as they are imported (``HF_ENDPOINT``,
``HF_HUB_OFFLINE``, ...) are the server's, not the command's (``OMP_NUM_THREADS`` is applied, as torch would at its
start): a test that sets one starts its command cold. What this cannot show, the suite shows with cold starts
elsewhere (``subprocess`` from a new interpreter): that the installed entry point exists and starts
(``tests/test_every_command.py`` runs its refusals cold), and every fault test of ``tests/test_bad_input.py`` /
``tests/test_faults.py``.
"""
from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

PRELOAD = ["torch", "torchvision", "timm"]
_context: Optional[multiprocessing.context.BaseContext] = None


@dataclass
class Done:
    args: list[str]
    code: int
    out: str
    err: str
    seconds: float = 0.0
    cwd: str = ""

    def why(self) -> str:
        return f"{' '.join(self.args)}\nexit {self.code}\nstdout: {self.out[-1500:]}\nstderr: {self.err[-1500:]}"


def _child(args: list[str], cwd: str, env: dict[str, str], out: str, err: str, status: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    if env.get("OMP_NUM_THREADS", "").isdigit():  # read by the OpenMP runtime when torch was loaded, in the server
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.stdin = open(os.devnull)
    code = 0
    try:
        if args[1] == "-c":  # python -c CODE ARGS...
            sys.argv = ["-c", *args[3:]]
            exec(compile(args[2], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = args[1:]
            sys.path.insert(0, str(Path(args[1]).resolve().parent))
            runpy.run_path(args[1], run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:  # as the interpreter reports an uncaught exception
        import traceback

        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # as the interpreter does at exit
    sys.stdout.flush()
    sys.stderr.flush()
    with open(status, "w") as f:  # the exit code as the command left it (``run``)
        f.write(str(code))
    os._exit(code)


def context() -> multiprocessing.context.BaseContext:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def run(args: list[str], cwd: Path, env: Optional[dict[str, str]] = None, timeout: float = 600) -> Done:
    """``args`` = [python, SCRIPT, ARG...] or [python, "-c", CODE, ARG...] run as described above; stdout, stderr
    and the exit code as ``subprocess.run`` would give them."""
    logs = Path(tempfile.mkdtemp(prefix="warmstart."))
    out, err, status = logs / "stdout", logs / "stderr", logs / "status"
    began = time.perf_counter()
    process = context().Process(target=_child, args=(list(args), str(cwd), dict(env or os.environ), str(out), str(err),
                                                     str(status)))
    process.start()
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join()
    try:
        read = lambda path: path.read_text() if path.exists() else ""  # noqa: E731
        # the child's own word first: the forkserver reports 255 where it lost the child's status (CPython's
        # popen_forkserver, "perhaps the forkserver process itself got killed"), seen once in a full suite run
        code = int(read(status)) if read(status) else process.exitcode if process.exitcode is not None else -9
        return Done(list(args), code, read(out), read(err), time.perf_counter() - began)
    finally:
        shutil.rmtree(logs, ignore_errors=True)
