"""`kvgate native build|status`: the engine model compiled with mypyc, for faster benchmarks.

A virtual benchmark spends about two fifths of its time in the simulated engine's block pool
(`adapters/sim/model.py`), one Python operation per 16-token block of 100k-token prompts.
mypyc compiles that module, unchanged, to a C extension (about 15 s here). The build goes to
`adapters.sim_native.native_dir()`, keyed by the source's digest, and `import adapters.sim.model`
loads it from there while the key matches (`KVGATE_NATIVE`, see `adapters.sim`). Nothing is
written into the source tree, and an edited source is never shadowed by an old build.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import adapters.sim_native as sim

__all__ = ["NativeBuildError", "build", "status"]

_PACKAGES = ("adapters", "planner", "kvindex", "gateway", "kvgate")
"""Top-level packages mypy may need to resolve the compiled module's imports."""

_SETUP = """\
import sys
from setuptools import setup
from mypyc.build import mypycify

target, lib, temp = sys.argv[1:4]
modules = sys.argv[4:]
setup(
    name="kvgate-native",
    ext_modules=mypycify(modules, opt_level="3", target_dir=target),
    script_args=["build_ext", "--build-lib", lib, "--build-temp", temp],
)
"""


class NativeBuildError(RuntimeError):
    """The compiled engine model could not be built; the message says why."""


def _source_root() -> Path:
    """The directory holding the top-level packages (the checkout, or site-packages)."""
    return Path(sim.__file__).resolve().parent.parent


def status() -> str:
    """One line: whether a build for the current source exists and whether it is in use."""
    directory = sim.native_dir()
    mode = sim.native_mode()
    built = sim.native_built(directory)
    try:
        import adapters.sim
    except sim.NativeUnavailable as e:
        return str(e)
    if adapters.sim.native_path:
        return f"compiled engine model in use (KVGATE_NATIVE={mode}): {adapters.sim.native_path}"
    if built:
        return f"compiled engine model built but not in use (KVGATE_NATIVE={mode}): {directory}"
    return f"no compiled engine model for this source (would be {directory}); `kvgate native build`"


def build(force: bool = False, quiet: bool = False) -> Path:
    """Compile the engine model for the current source unless already built; its directory."""
    directory = sim.native_dir()
    if sim.native_built(directory) and not force:
        if not quiet:
            print(f"already built for this source: {directory}")
        return directory
    try:
        import mypyc  # noqa: F401
        import setuptools  # noqa: F401
    except ImportError as e:
        raise NativeBuildError(
            f"cannot build the compiled engine model: {e.name} is not installed "
            "(pip install -e '.[dev]' brings mypy, which includes mypyc)") from None
    key_dir = directory.parent.parent
    key_dir.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvgate-native-", dir=key_dir.parent) as tmp_name:
        tmp = Path(tmp_name)
        src = tmp / "src"
        src.mkdir()
        root = _source_root()
        for package in _PACKAGES:
            if (root / package).is_dir():
                (src / package).symlink_to(root / package, target_is_directory=True)
        (tmp / "setup_native.py").write_text(_SETUP)
        modules = [f"adapters/sim/{name}.py" for name in sim.NATIVE_MODULES]
        command = [sys.executable, str(tmp / "setup_native.py"), str(tmp / "c"),
                   str(tmp / "lib"), str(tmp / "build"), *modules]
        done = subprocess.run(command, cwd=src, capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-25:])
            raise NativeBuildError(f"mypyc failed (exit {done.returncode}):\n{tail}")
        built = tmp / "lib" / "adapters" / "sim"
        if not sim.native_built(built):
            raise NativeBuildError(f"mypyc reported success but {built} lacks the modules")
        staged = tmp / "staged"
        (staged / "adapters").mkdir(parents=True)
        shutil.copytree(built, staged / "adapters" / "sim")
        if sim.native_built(directory) and not force:
            pass  # another build finished first: keep it (a process may be loading from it)
        else:
            if key_dir.exists():
                shutil.rmtree(key_dir)
            try:
                os.replace(staged, key_dir)
            except OSError:
                if not sim.native_built(directory):  # lost a race to another build: keep it
                    raise
    if not quiet:
        print(f"compiled {', '.join(modules)} in {time.monotonic() - started:.1f} s: {directory}")
    return directory
