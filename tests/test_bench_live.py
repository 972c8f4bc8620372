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
