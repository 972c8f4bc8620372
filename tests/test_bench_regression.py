"""Seeded bench reports do not drift: speed work on the harness must leave every number as it was.

`data/claude_code_replay_report.json` was written by the harness before its hot paths were
optimised (commit 1584ea3), with the command in `REPLAY`. A run today must reproduce every field
recorded there; fields added to the report since are not compared. The baselines' entries are
the 1584ea3 originals; `kvgate`'s was re-recorded when the planner (batch release, DAG
priorities, sibling-aware cost) replaced its per-request routing, a change of behaviour made on
purpose.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from kvgate.bench.options import BenchOptions
from kvgate.bench.runner import run_bench
from kvgate.bench.workloads import TRACES

RECORDED = Path(__file__).parent / "data" / "claude_code_replay_report.json"

REPLAY = dict(workload="claude-code", workflows=2, workload_args={"think_scale": "0"},
              profile="h200-qwen3-32b", engines=2,
              policies=["kvgate", "round-robin", "sglang-like"])
"""`kvgate bench --workload claude-code --workflows 2 --workload-arg think_scale=0 --profile
h200-qwen3-32b --engines 2 --policy kvgate,round-robin,sglang-like`: two long sessions with
sub-agents, clipped to a 40k context on a KV pool small enough to evict, under a policy with
speculative index entries, one without and one that reads prompt text."""


def _recorded_fields(recorded: Any, actual: Any) -> Any:
    """`actual` cut down to the keys `recorded` has, at every level."""
    if isinstance(recorded, dict) and isinstance(actual, dict):
        return {k: _recorded_fields(v, actual.get(k)) for k, v in recorded.items()}
    return actual


@pytest.mark.skipif(not TRACES.exists(), reason="../shared/traces is not beside the checkout")
def test_claude_code_replay_report_matches_the_recorded_one() -> None:
    report = run_bench(BenchOptions(progress=False, **REPLAY),  # type: ignore[arg-type]
                       out=io.StringIO())
    recorded = json.loads(RECORDED.read_text())
    # Through JSON, as the recording was, so floats and tuples compare exactly as written.
    actual = json.loads(json.dumps(report))
    assert _recorded_fields(recorded, actual) == recorded
