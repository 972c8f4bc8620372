"""Where the compiled engine model lives and whether `adapters.sim` loads it (see that
package's docstring): apart from the package, so that `kvgate native build` and `status` work
whatever `KVGATE_NATIVE` says, a build or none."""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
import sysconfig
import warnings
from pathlib import Path

NATIVE_MODULES = ("model",)
"""Modules of `adapters.sim` that `kvgate native build` compiles."""

NATIVE_MODES = ("auto", "on", "off")

SIM_DIR = Path(__file__).resolve().parent / "sim"
"""The `adapters.sim` package's directory, whose modules are compiled."""


def native_root() -> Path:
    """Where builds live: `$KVGATE_NATIVE_DIR` or `~/.cache/kvgate/native`."""
    configured = os.environ.get("KVGATE_NATIVE_DIR")
    return Path(configured or "~/.cache/kvgate/native").expanduser()


def native_key(package_dir: Path | None = None) -> str:
    """Digest of the compiled modules' sources (in `package_dir`, by default `adapters/sim`)
    and the interpreter's ABI tag."""
    digest = hashlib.sha256()
    abi = f"{sys.implementation.cache_tag} {sysconfig.get_config_var('EXT_SUFFIX')}"
    digest.update(abi.encode())
    here = package_dir or SIM_DIR
    for name in NATIVE_MODULES:
        digest.update(name.encode() + b"\0" + (here / f"{name}.py").read_bytes())
    return digest.hexdigest()[:20]


def native_dir() -> Path:
    """This package's directory inside the build for the current sources."""
    return native_root() / native_key() / "adapters" / "sim"


def native_built(directory: Path) -> bool:
    """Whether `directory` holds every compiled module."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return all((directory / f"{name}{suffix}").is_file() for name in NATIVE_MODULES)


class NativeUnavailable(ImportError):
    """`KVGATE_NATIVE` asks for what cannot be had (an unknown mode, `on` without a build
    that loads); the message says what to do."""


def native_mode() -> str:
    """`KVGATE_NATIVE`, checked: auto, on or off."""
    mode = os.environ.get("KVGATE_NATIVE", "auto").strip().lower() or "auto"
    if mode not in NATIVE_MODES:
        raise NativeUnavailable(
            f"KVGATE_NATIVE must be one of {', '.join(NATIVE_MODES)}, not {mode!r}")
    return mode


def use_native(package_path: list[str], package: str) -> str | None:
    """Put the build for the current source in front of `package_path` (the `adapters.sim`
    package's `__path__`) as `KVGATE_NATIVE` says; the build's directory, or None."""
    mode = native_mode()
    if mode == "off":
        return None
    directory = native_dir()
    if not native_built(directory):
        if mode == "on":
            raise NativeUnavailable(
                f"KVGATE_NATIVE=on but no compiled engine model for this source in {directory}; "
                "run `kvgate native build` (needs the dev extra: mypy)")
        return None
    package_path.insert(0, str(directory))
    try:
        importlib.import_module(f"{package}.model")
    except ImportError as e:
        package_path.remove(str(directory))
        for name in NATIVE_MODULES:
            sys.modules.pop(f"{package}.{name}", None)
            sys.modules.pop(f"{package}.{name}__mypyc", None)
        if mode == "on":
            raise NativeUnavailable(
                f"KVGATE_NATIVE=on but the compiled engine model in {directory} does not load "
                f"({e}); `kvgate native build --force` rebuilds it") from None
        # A build that does not load (a broken copy, a missing library) must not stop a run
        # that did not ask for it: fall back to the source, and say so.
        warnings.warn(f"the compiled engine model in {directory} does not load ({e}); "
                      "running the Python source (`kvgate native build --force` rebuilds it)",
                      RuntimeWarning, stacklevel=2)
        return None
    return str(directory)
