"""`kvgate vllm-pool`'s argument checks, which fail before any engine starts (exit 2, the
problem named), and its one restart of an engine that hangs at start-up. The pool itself is
exercised by tests/vllm_tier/test_real_nixl.py."""

from __future__ import annotations

import functools
import io
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gateway.config import GatewayConfig
from kvgate.vllm_engines import Engine, EngineNotHealthy, EngineStartError
from kvgate.vllm_pool import PoolError, parse_cores


def test_cores_parse_lists_and_ranges_within_the_allowed_set() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    assert parse_cores(None) == allowed
    first = allowed[0]
    assert parse_cores(f"{first},{first}") == [first]
    assert parse_cores(f"{first}-{first}") == [first]
    with pytest.raises(PoolError, match="not a core number"):
        parse_cores("one")
    with pytest.raises(PoolError, match="not available"):
        parse_cores("4096")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvgate.cli", "vllm-pool", *args],
                          capture_output=True, text=True, timeout=60)


def test_bad_arguments_exit_2_naming_the_problem() -> None:
    done = run("--engines", "0")
    assert done.returncode == 2 and "--engines must be at least 1" in done.stderr
    done = run("--cores", "4096")
    assert done.returncode == 2 and "--cores: 4096 not available" in done.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        done = run("--serve", str(s.getsockname()[1]))
    assert done.returncode == 2 and "is not free" in done.stderr


def sleeping_engine(name: str, served: str, port: int | None, tmp_path: Path) -> Engine:
    """A stand-in for a started vLLM engine: a real process that sleeps."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            start_new_session=True)
    return Engine(name, served, f"http://127.0.0.1:{port}", port or 0, proc,
                  tmp_path / f"{name}.log")


def no_setup(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The pool's venv, model and CPU checks, skipped."""
    import kvgate.vllm_pool as vp

    monkeypatch.setattr(vp, "ensure_vllm_venv", lambda: tmp_path)
    monkeypatch.setattr(vp, "ensure_tiny_model", lambda: tmp_path)
    monkeypatch.setattr(vp, "cpu_capability", lambda venv: "AVX512")


def test_an_engine_that_never_gets_healthy_is_started_once_more(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A vLLM engine that hangs at start-up cannot be made on demand, so `start_engine` is
    replaced here: its first start reports the hang `wait_healthy` raises, the next one gives
    a real (sleeping) process. Another kind of failure, or a second hang, is not retried."""
    import kvgate.vllm_pool as vp

    starts: list[tuple[str, int | None]] = []

    def start_engine(model_dir: Path, log_dir: Path, *, name: str, port: int | None,
                     health_timeout: float, fail: list[str], **kw: Any) -> Engine:
        starts.append((name, port))
        if fail:
            error = fail.pop(0).format(name=name, t=health_timeout)
            raise (EngineNotHealthy if "not healthy" in error else EngineStartError)(error)
        return sleeping_engine(name, kw["served_model_name"], port, tmp_path)

    no_setup(monkeypatch, tmp_path)
    hang = "vLLM engine {name} not healthy after {t:.0f}s; log x"
    died = "vLLM engine {name} exited with code 1 during startup; log x"

    def run(fail: list[str]) -> str:
        starts.clear()
        monkeypatch.setattr(vp, "start_engine", functools.partial(start_engine, fail=fail))
        out = io.StringIO()
        pool = vp.VllmPool(vp.PoolOptions(engines=1, run_dir=tmp_path, health_timeout=5), out)
        try:
            pool.start()
        finally:
            pool.stop()
        return out.getvalue()

    said = run([hang])
    assert "engine-0 not healthy after 5 s (attempt 1); starting it again" in said
    assert "pool ready" in said
    assert len(starts) == 2 and starts[0] == starts[1]  # the same name and port again
    with pytest.raises(EngineStartError, match="exited with code 1"):
        run([died])
    assert len(starts) == 1
    with pytest.raises(EngineStartError, match="not healthy after 5s"):
        run([hang, hang])
    assert len(starts) == 2


def started_pool(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                 **options: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A two-engine pool started with `options` on stand-in engines: what each engine was
    started with (`start_engine`'s keywords) and the gateway config it prints."""
    import kvgate.vllm_pool as vp

    seen: list[dict[str, Any]] = []

    def start_engine(model_dir: Path, log_dir: Path, *, name: str, port: int | None,
                     **kw: Any) -> Engine:
        seen.append(kw)
        return sleeping_engine(name, kw["served_model_name"], port, tmp_path)

    no_setup(monkeypatch, tmp_path)
    monkeypatch.setattr(vp, "start_engine", start_engine)
    pool = vp.VllmPool(vp.PoolOptions(engines=2, run_dir=tmp_path, **options), io.StringIO())
    try:
        pool.start()
        return seen, pool.gateway_config(8000)
    finally:
        pool.stop()


def test_engine_pace_starts_the_plugin_and_the_matching_policy(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`--engine-pace`: every engine gets `--scheduler-cls` and the plugin's directory on its
    PYTHONPATH (the same helpers the real tier starts its engine with), and its gateway entry
    `scheduler: kvgate-pace`; without it neither."""
    for pace in (True, False):
        seen, config = started_pool(monkeypatch, tmp_path, engine_pace=pace)
        assert len(seen) == 2
        for kw in seen:
            args, env = kw["extra_args"], kw["extra_env"] or {}
            if pace:
                at = args.index("--scheduler-cls")
                module, _, cls = args[at + 1].partition(".")
                plugin = Path(env["PYTHONPATH"]) / f"{module}.py"
                assert f"class {cls}(" in plugin.read_text()
            else:
                assert "--scheduler-cls" not in args and "PYTHONPATH" not in env
        assert config["policy"] == "kvgate"
        assert [e.get("scheduler") for e in config["engines"]] == (
            ["kvgate-pace"] * 2 if pace else [None] * 2)
        GatewayConfig.model_validate({**config, "tokenizer": None})  # a config serve takes


def test_engine_priority_runs_vllms_priority_scheduling_and_says_so(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`--engine-priority`: every engine gets `--scheduling-policy priority` and its gateway
    entry `scheduling_policy: priority` (so the proxy sends the planner's rank as vLLM's
    `priority`); without it neither."""
    for priority in (True, False):
        seen, config = started_pool(monkeypatch, tmp_path, engine_pace=True,
                                    engine_priority=priority)
        assert len(seen) == 2
        for kw in seen:
            args = list(kw["extra_args"])
            has = any(args[i:i + 2] == ["--scheduling-policy", "priority"]
                      for i in range(len(args)))
            assert has is priority
            assert "--scheduler-cls" in args  # beside the pacing scheduler
        entries = GatewayConfig.model_validate({**config, "tokenizer": None}).engines
        assert [e.scheduling_policy for e in entries] == (
            ["priority"] * 2 if priority else ["fcfs"] * 2)
