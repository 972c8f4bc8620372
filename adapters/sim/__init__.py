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

from adapters.sim_native import (
    NATIVE_MODES,
    NATIVE_MODULES,
    NativeUnavailable,
    native_built,
    native_dir,
    native_key,
    native_root,
    use_native,
)

__all__ = ["NATIVE_MODES", "NATIVE_MODULES", "NativeUnavailable", "native_built", "native_dir",
           "native_key", "native_path", "native_root"]

native_path: str | None = use_native(__path__, __name__)
"""The directory the compiled modules were loaded from, or None when they run as Python."""
