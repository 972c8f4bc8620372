"""Third-party tools the tests drive as their users run them, each in its own venv.

A tool such as guidellm brings dependencies (torch, transformers, datasets) that must not
enter the project's venv, so it gets a venv of its own under ``~/.cache/kvgate/tools/``,
built once per pinned requirement set and reused by later runs (the marker file names the
set; a changed pin rebuilds it). The build uses the vLLM venv's machinery: a file lock a
concurrent build waits on, and logged steps whose failure ends with the log's tail.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvgate.vllm_engines import _file_lock, _run_logged, cache_root

READY = ".kvgate-tool-ready"


def tool_venv(name: str, steps: Sequence[Sequence[str]], timeout_s: float = 900.0) -> Path:
    """The venv `name`, built by running each of `steps` (pip install arguments) in order.

    Steps run in order so an earlier one can pin what a later one would otherwise pull (the
    CPU build of torch on this machine, before a package that only asks for "torch").
    """
    venv = cache_root() / "tools" / name
    wanted = "\n".join(" ".join(step) for step in steps)
    if _ready(venv, wanted):
        return venv
    with _file_lock(venv.parent / f"{name}.lock", timeout_s):
        if _ready(venv, wanted):
            return venv
        if venv.exists():
            shutil.rmtree(venv)
        log = venv.parent / f"{name}-install.log"
        deadline = time.monotonic() + timeout_s

        def left() -> float:
            return max(deadline - time.monotonic(), 1.0)

        _run_logged([sys.executable, "-m", "venv", str(venv)], log, left(), "python -m venv")
        python = str(venv / "bin" / "python")
        for step in steps:
            _run_logged([python, "-m", "pip", "install", "-q", *step], log, left(),
                        f"pip install {' '.join(step)}")
        (venv / READY).write_text(wanted)
    return venv


def _ready(venv: Path, wanted: str) -> bool:
    try:
        return (venv / READY).read_text() == wanted and (venv / "bin" / "python").exists()
    except OSError:
        return False
