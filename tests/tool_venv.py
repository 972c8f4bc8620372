"""Third-party tools the tests drive as their users run them, each in its own venv.

A tool such as guidellm brings dependencies (torch, transformers, datasets) that must not
enter the project's venv, so it gets a venv of its own under ``~/.cache/kvgate/tools/``,
built once per pinned requirement set and reused by later runs (the marker file names the
set; a changed pin rebuilds it). A concurrent build waits on a file lock.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvgate.vllm_engines import cache_root

READY = ".kvgate-tool-ready"


class ToolSetupError(RuntimeError):
    """The tool's venv could not be built; the message ends with the install log's tail."""


def tool_venv(name: str, steps: Sequence[Sequence[str]], timeout_s: float = 900.0) -> Path:
    """The venv `name`, built by running each of `steps` (pip install arguments) in order.

    Steps run in order so an earlier one can pin what a later one would otherwise pull (the
    CPU build of torch on this machine, before a package that only asks for "torch").
    """
    venv = cache_root() / "tools" / name
    wanted = "\n".join(" ".join(step) for step in steps)
    python = venv / "bin" / "python"
    if _ready(venv, wanted):
        return venv
    venv.parent.mkdir(parents=True, exist_ok=True)
    with (venv.parent / f"{name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if _ready(venv, wanted):
                return venv
            if venv.exists():
                shutil.rmtree(venv)
            log = venv.parent / f"{name}-install.log"
            deadline = time.monotonic() + timeout_s
            _run([sys.executable, "-m", "venv", str(venv)], log, deadline)
            for step in steps:
                _run([str(python), "-m", "pip", "install", "-q", *step], log, deadline)
            (venv / READY).write_text(wanted)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return venv


def _ready(venv: Path, wanted: str) -> bool:
    try:
        return (venv / READY).read_text() == wanted and (venv / "bin" / "python").exists()
    except OSError:
        return False


def _run(cmd: list[str], log: Path, deadline: float) -> None:
    left = deadline - time.monotonic()
    with log.open("ab") as out:
        out.write(f"\n$ {' '.join(cmd)}\n".encode())
        out.flush()
        try:
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, timeout=max(left, 1.0),
                                check=False).returncode
        except subprocess.TimeoutExpired:
            rc = None
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        what = "timed out" if rc is None else f"failed (exit {rc})"
        raise ToolSetupError(f"{' '.join(cmd[:4])} ... {what}; log {log}:\n{tail}")
