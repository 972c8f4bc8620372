"""The microbenchmarks measure what they claim (small sizes; figures are not asserted)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvgate.benchmarks.index import bench_ingest, bench_lookup
from kvgate.benchmarks.proxy import (
    DIRECT,
    FLOOR,
    KVGATE,
    NON_STREAMED,
    SGLANG,
    STREAMED,
    Samples,
    bench_proxy,
    measure,
    paired_added_p50_ms,
    report_errors,
    sglang_router_version,
)
from kvgate.cli import main
from kvgate.procs import free_port


def test_ingest_benchmark_counts_every_stored_and_evicted_block() -> None:
    result = bench_ingest(batches=50, blocks_per_event=8)
    assert result["blocks_stored"] == 50 * 8
    assert result["blocks_removed"] == (50 - 20) * 8
    assert result["blocks_per_s"] > 0 and result["ingestor_bytes_per_engine_block"] > 0


def test_lookup_benchmark_matches_an_8k_prompt_against_the_built_index() -> None:
    result = bench_lookup(blocks=2048, engines=8, iterations=3)
    assert 7000 < result["prompt_tokens"] < 9000
    assert result["prompt_blocks"] == result["prompt_tokens"] // 16
    assert result["indexed_keys"] >= 2048 + result["prompt_blocks"] - 8
    assert result["match"]["p50_us"] > 0 and result["index_bytes_per_key"] > 0


@pytest.fixture(scope="module")
def proxy_report() -> dict[str, Any]:
    """One short side-by-side run: every target, both modes, a few requests each."""
    return bench_proxy(concurrency=1, rounds=2, repeats=3)


def test_proxy_benchmark_measures_every_target_streamed_and_not(
    proxy_report: dict[str, Any],
) -> None:
    expected = [DIRECT, KVGATE, FLOOR] + ([SGLANG] if sglang_router_version() else [])
    assert report_errors(proxy_report) == []
    assert list(proxy_report["modes"]) == [NON_STREAMED, STREAMED]
    assert proxy_report["load_average_1m"]["after"] >= 0
    for mode in proxy_report["modes"].values():
        assert list(mode["targets"]) == expected
        for target in mode["targets"].values():
            assert target["requests"] == proxy_report["requests_per_target_and_mode"] == 6
            for metric in ("ttft", "e2e"):
                assert 0 < target[metric]["p50_ms"] <= target[metric]["p99_ms"]
            assert target["ttft"]["p50_ms"] <= target["e2e"]["p99_ms"]
            assert target["process_cpu_ms_per_request"] >= 0


def test_proxy_benchmark_reports_added_latency_and_the_ratio_to_sglang_router(
    proxy_report: dict[str, Any],
) -> None:
    for mode in proxy_report["modes"].values():
        targets = mode["targets"]
        assert "added" not in targets[DIRECT]
        kvgate_added = targets[KVGATE]["added"]
        assert kvgate_added["e2e_p50_ms"] == pytest.approx(
            targets[KVGATE]["e2e"]["p50_ms"] - targets[DIRECT]["e2e"]["p50_ms"])
        assert kvgate_added["e2e_p50_paired_ms"] is not None
        floor_added = targets[FLOOR]["added"]
        if SGLANG in targets:
            sglang_p50 = targets[SGLANG]["added"]["e2e_p50_ms"]
            for name, added in (("kvgate", kvgate_added), ("floor", floor_added)):
                expected = added["e2e_p50_ms"] / sglang_p50 if sglang_p50 > 0 else None
                assert mode[f"ratio_{name}_over_sglang"]["e2e_p50_ms"] == (
                    pytest.approx(expected) if expected is not None else None)
        else:
            assert "ratio_kvgate_over_sglang" not in mode


def test_proxy_benchmark_uses_the_real_sglang_router_when_installed(
    proxy_report: dict[str, Any],
) -> None:
    version = sglang_router_version()
    if version is None:
        assert "not installed" in proxy_report["sglang_router"]
    else:
        assert proxy_report["sglang_router"].startswith(f"sglang-router {version}")


def test_paired_added_latency_cancels_drift_between_rounds() -> None:
    # The machine slows down by 10 ms from round to round; the gateway always adds 1 ms.
    direct = Samples(round_p50=[0.002, 0.012, 0.022])
    gateway = Samples(round_p50=[0.003, 0.013, 0.023])
    assert paired_added_p50_ms(gateway, direct) == pytest.approx(1.0)


def test_proxy_benchmark_counts_failed_requests_and_names_the_target() -> None:
    refused = f"http://127.0.0.1:{free_port()}"
    samples = asyncio.run(measure({KVGATE: refused}, (STREAMED,), concurrency=1, rounds=1,
                                  repeats=2))
    failed = samples[STREAMED][KVGATE]
    assert failed.errors == 2 and failed.e2e == []
    assert failed.first_error is not None and "Connect" in failed.first_error


def test_proxy_benchmark_errors_are_listed_per_mode_and_target() -> None:
    report = {"modes": {STREAMED: {"targets": {
        DIRECT: {"errors": 0, "first_error": None},
        SGLANG: {"errors": 3, "first_error": "HTTP 502: bad gateway"}}}}}
    assert report_errors(report) == [
        f"{STREAMED} via {SGLANG}: 3 failed requests, first: HTTP 502: bad gateway"]


def test_proxy_microbench_rejects_a_zero_count_with_exit_code_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["microbench", "proxy", "--rounds", "0"]) == 2
    assert "--rounds must be at least 1" in capsys.readouterr().err


def test_proxy_benchmark_sends_an_agents_call_with_its_tools() -> None:
    """`--prompt agent`: every target answers the long system prompt and 24 tools (the
    gateways key and match it), each call its own question."""
    from kvgate.benchmarks.proxy import _body

    body = _body(3, False, "agent")
    assert len(body["tools"]) == 24 and body["messages"][0]["role"] == "system"
    question = body["messages"][-1]["content"]
    assert question != _body(4, False, "agent")["messages"][-1]["content"]
    assert question != _body(3, False, "agent", call=1)["messages"][-1]["content"]
    report = bench_proxy(concurrency=1, rounds=1, repeats=2, stream="off", prompt="agent")
    assert report["prompt"] == "agent" and report_errors(report) == []
    for target in report["modes"][NON_STREAMED]["targets"].values():
        assert target["requests"] == 2


def test_proxy_microbench_rejects_an_unknown_prompt() -> None:
    from kvgate.benchmarks.proxy import ProxyBenchError

    with pytest.raises(ProxyBenchError, match="--prompt must be one of short, agent"):
        bench_proxy(prompt="long")
