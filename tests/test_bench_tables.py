"""Markdown tables from bench reports (kvgate/bench/tables.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgate.bench.tables import goodput_table, main, results_table


def report(goodput: bool = False) -> dict[str, object]:
    result = {"jct_mean_s": 3.0, "jct_p99_s": 4.0, "ttft_p50_s": 0.1, "ttft_p90_s": 0.2,
              "output_tokens_per_s": 100.0, "prefix_hit_ratio": 0.5, "failed": 0,
              "compute_utilisation": 0.25, "gateway_wait_p50_s": 0.0}
    out: dict[str, object] = {
        "workload": "fanout", "profile": "p", "engines": 2, "seed": 0, "mode": "virtual",
        "load": {"rate": 1.5, "concurrency": None, "workflows": 10},
        "lower_bound": {"jct_mean_s": 2.0, "makespan_s": 9.0},
        "results": {"kvgate": result, "round-robin": {**result, "jct_mean_s": 4.0}},
    }
    if goodput:
        out["goodput"] = {"slo_jct_x_bound": 1.5,
                          "kvgate": {"rate": 2.0, "points": [{"rate": 1.0}, {"rate": 2.0},
                                                             {"rate": 2.1}]},
                          "round-robin": {"rate": 1.0, "points": [{"rate": 0.5}, {"rate": 1.0}]},
                          "session": {"rate": 0.0, "points": [{"rate": 0.5}]}}
    return out


def test_results_rows_read_as_multiples_of_the_bound() -> None:
    text = results_table(report())
    assert "| kvgate | 3.00 | 1.50 |" in text
    assert "| round-robin | 4.00 | 2.00 |" in text
    assert "25.0%" in text and "Poisson 1.5 workflows/s" in text


def test_goodput_rows_give_the_ratio_to_the_best_other_policy() -> None:
    assert goodput_table(report()) is None
    text = goodput_table(report(goodput=True))
    assert text is not None
    assert "| kvgate | 2.000 | 2.00x | 3 |" in text
    assert "| round-robin | >= 1.000 (all arrived at once) | 0.50x | 2 |" in text
    assert "| session | none met | 0.00x | 1 |" in text


def test_main_prints_every_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report(goodput=True)))
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "**fanout**" in out and "Goodput" in out
    assert main([]) == 2


def test_kvgate_variants_are_compared_with_the_baselines_not_each_other() -> None:
    from kvgate.bench.report import rivals

    names = ["kvgate", "kvgate-no-batch", "dynamo-like", "least-loaded"]
    assert rivals("kvgate", names) == ["dynamo-like", "least-loaded"]
    assert rivals("kvgate-no-batch", names) == ["dynamo-like", "least-loaded"]
    assert rivals("dynamo-like", names) == ["kvgate", "kvgate-no-batch", "least-loaded"]
