"""The simulated vLLM engine: a sans-IO engine model and a server speaking vLLM's protocols.

The engine model (`adapters.sim.model`) may run compiled: `kvgate native build` compiles that
one module with mypyc (the same source, type-checked, turned into a C extension) into
`~/.cache/kvgate/native/<key>/`, where `<key>` is a digest of the module's source and the
interpreter's ABI. Importing this package puts a build whose key matches the source in front of
the package's search path, so `import adapters.sim.model` loads it; a build of any other
source is never used. `KVGATE_NATIVE` chooses: `auto` (the default: the build if there is one
and it loads, else the source with a warning), `off` (always the Python source), `on` (the
build, or an ImportError saying how to make it).
`KVGATE_NATIVE_DIR` moves the builds' directory. Results are the same either way (a test
compares seeded reports); the build only runs faster.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
import sysconfig
import warnings
from pathlib import Path

NATIVE_MODULES = ("model",)
"""Modules of this package that `kvgate native build` compiles."""

NATIVE_MODES = ("auto", "on", "off")

native_path: str | None = None
"""The directory the compiled modules were loaded from, or None when they run as Python."""


def native_root() -> Path:
    """Where builds live: `$KVGATE_NATIVE_DIR` or `~/.cache/kvgate/native`."""
    configured = os.environ.get("KVGATE_NATIVE_DIR")
    return Path(configured or "~/.cache/kvgate/native").expanduser()


def native_key(package_dir: Path | None = None) -> str:
    """Digest of the compiled modules' sources (in `package_dir`, by default this package's)
    and the interpreter's ABI tag."""
    digest = hashlib.sha256()
    abi = f"{sys.implementation.cache_tag} {sysconfig.get_config_var('EXT_SUFFIX')}"
    digest.update(abi.encode())
    here = package_dir or Path(__file__).parent
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


def _use_native() -> str | None:
    mode = os.environ.get("KVGATE_NATIVE", "auto").strip().lower() or "auto"
    if mode not in NATIVE_MODES:
        raise ImportError(f"KVGATE_NATIVE must be one of {', '.join(NATIVE_MODES)}, not {mode!r}")
    if mode == "off":
        return None
    directory = native_dir()
    if not native_built(directory):
        if mode == "on":
            raise ImportError(
                f"KVGATE_NATIVE=on but no compiled engine model for this source in {directory}; "
                "run `kvgate native build` (needs the dev extra: mypy)")
        return None
    __path__.insert(0, str(directory))
    if mode == "auto":
        # A build that does not load (a broken copy, a missing library) must not stop a run
        # that did not ask for it: fall back to the source, and say so.
        try:
            importlib.import_module(f"{__name__}.model")
        except ImportError as e:
            __path__.remove(str(directory))
            for name in NATIVE_MODULES:
                sys.modules.pop(f"{__name__}.{name}", None)
                sys.modules.pop(f"{__name__}.{name}__mypyc", None)
            warnings.warn(f"the compiled engine model in {directory} does not load ({e}); "
                          "running the Python source (`kvgate native build --force` rebuilds it)",
                          RuntimeWarning, stacklevel=2)
            return None
    return str(directory)


native_path = _use_native()
