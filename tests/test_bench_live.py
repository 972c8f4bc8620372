"""`kvgate bench --mode live`: real gateway, real sglang-router, real simulated engine servers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def run_live(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "live.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvgate.cli", "bench", "--mode", "live", "--profile", "cpu-tiny",
         "--engines", "4", "--workload", "fanout", "--workflows", "2", "--concurrency", "2",
         "--workload-arg", "width=3", "--workload-arg", "static_tokens=500",
         "--workload-arg", "research_tokens=24", "--workload-arg", "plan_tokens=16",
         "--workload-arg", "reduce_tokens=16", "--json", str(out), "--no-progress", *extra],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


def test_live_run_compares_kvgate_with_the_real_sglang_router(tmp_path: Path) -> None:
    report = run_live(tmp_path, "--policy", "kvgate,sglang-router,round-robin")
    assert report["mode"] == "live"
    assert list(report["results"]) == ["kvgate", "sglang-router", "round-robin"]
    for name, r in report["results"].items():
        assert r["failed"] == 0, name
        assert r["workflows"] == 2 and r["requests"] == 2 * (3 + 2), name
        # Every task after the first shares the static prefix the engines report as cached.
        assert r["prefix_hit_ratio"] > 0.2, name
        assert report["lower_bound"]["jct_mean_s"] <= r["jct_mean_s"], name
    # kvgate's gateway names the engine of each request; the peer's router does not.
    assert sum(report["results"]["kvgate"]["requests_per_engine"]) == 10


def test_fidelity_reports_virtual_and_live_side_by_side(tmp_path: Path) -> None:
    report = run_live(tmp_path, "--policy", "kvgate", "--fidelity")
    f = report["fidelity"]["kvgate"]
    assert f["jct_mean_virtual_s"] > 0 and f["jct_mean_live_s"] > 0
    assert f["jct_mean_diff"] == (f["jct_mean_live_s"] - f["jct_mean_virtual_s"]) / \
        f["jct_mean_virtual_s"]


SMALL_FANOUT = ["--workload", "fanout", "--workflows", "2", "--concurrency", "2",
                "--workload-arg", "width=3", "--workload-arg", "static_tokens=500",
                "--workload-arg", "research_tokens=24", "--workload-arg", "plan_tokens=16",
                "--workload-arg", "reduce_tokens=16"]


def test_live_run_on_engines_already_up_resets_their_caches_between_policies(
    tmp_path: Path,
) -> None:
    import yaml

    from kvgate.procs import free_port, start_sim

    events = f"tcp://127.0.0.1:{free_port()}"
    sims = [start_sim(f"up-{i}", tmp_path, ["--model", "tiny-test", "--seed", str(i),
                                            "--profile", "cpu-tiny", "--kv-events", events,
                                            "--enable-prompt-tokens-details"])
            for i in range(2)]
    try:
        config = tmp_path / "gateway.yaml"
        config.write_text(yaml.safe_dump({"kv_events_bind": events,
                                          "engines": [{"url": s.url} for s in sims]}))
        out = tmp_path / "up.json"
        proc = subprocess.run(
            [sys.executable, "-m", "kvgate.cli", "bench", "--mode", "live", "--profile",
             "cpu-tiny", "--engine-config", str(config), "--policy", "kvgate,round-robin",
             *SMALL_FANOUT, "--json", str(out), "--no-progress"],
            capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        report = json.loads(out.read_text())
    finally:
        for s in sims:
            s.stop()
    assert report["engines"] == 2
    for name, r in report["results"].items():
        assert r["failed"] == 0 and r["requests"] == 2 * (3 + 2), name
        assert r["prefix_hit_ratio"] > 0.2, name
        # Each policy found the caches cold: it computed the shared static prompt itself (the
        # second would have found every prompt cached had the caches been left warm).
        assert r["recomputed_prompt_tokens"] >= 500, name


def test_engines_without_a_cache_reset_are_refused_with_what_to_do(tmp_path: Path) -> None:
    from kvgate.procs import start_gateway, start_sim

    sim = start_sim("no-reset-sim", tmp_path, ["--model", "tiny-test"])
    # A gateway answers /v1/models like an engine but has no POST /reset_prefix_cache.
    gateway = start_gateway([sim.url], tmp_path)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kvgate.cli", "bench", "--mode", "live", "--profile",
             "cpu-tiny", "--engine-urls", gateway.url, "--policy", "round-robin",
             *SMALL_FANOUT, "--no-progress"], capture_output=True, text=True, timeout=120)
    finally:
        gateway.stop()
        sim.stop()
    assert proc.returncode == 2
    assert "has no POST /reset_prefix_cache" in proc.stderr
    assert "VLLM_SERVER_DEV_MODE=1" in proc.stderr and "Traceback" not in proc.stderr


def test_live_calls_carry_their_place_in_the_dag_as_hint_headers() -> None:
    """The live client sends what an SDK-built agent sends, so a kvgate gateway knows the DAG
    (which task expects children: the trigger for prefetch) as the virtual planner does."""
    from kvgate.bench.live import dag_headers
    from kvgate.bench.options import BenchOptions
    from kvgate.bench.runner import prepare

    o = BenchOptions(workload="fanout", workload_args={"width": "3"}, workflows=1,
                     progress=False)
    (wf,) = prepare(o).workflows
    assert [(t.id, t.after) for t in wf.tasks] == [
        ("plan", ()), *((f"research{i}", ("plan",)) for i in range(3)),
        ("reduce", ("plan", "research0", "research1", "research2"))]
    headers = {t.id: dag_headers(wf, t) for t in wf.tasks}
    common = {"x-session-id": wf.id, "X-KVGate-Workflow": wf.id}
    # Four calls wait for the plan: its three researchers and the reduce.
    assert headers["plan"] == {**common, "X-KVGate-Task": "plan",
                               "X-KVGate-Expect-Children": "4"}
    for i in range(3):
        assert headers[f"research{i}"] == {**common, "X-KVGate-Task": f"research{i}",
                                           "X-KVGate-After": "plan",
                                           "X-KVGate-Expect-Children": "1"}
    assert headers["reduce"] == {**common, "X-KVGate-Task": "reduce",
                                 "X-KVGate-After": "plan,research0,research1,research2"}
