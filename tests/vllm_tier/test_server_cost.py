"""`kvgate microbench server-cost` against the tier's real engine: what a cached prompt-only
request costs vLLM beyond its step, read beside the engine's own prefill and end-to-end times."""

from __future__ import annotations

from kvgate.benchmarks.server_cost import format_report, measure
from tests.vllm_tier.conftest import RealEngine


def test_the_server_cost_probe_reads_the_engines_own_times(real_engine: RealEngine) -> None:
    # A seed of its own: the probe's prompts share no first block with another module's.
    report = measure(real_engine.engine.url, real_engine.served, lengths=(256, 3072),
                     repeats=4, seed=9)
    assert [r["prompt_tokens"] for r in report["rows"]] == [256, 3072]
    for row in report["rows"]:
        prefill, e2e = row["engine_prefill_s"], row["engine_e2e_s"]
        assert prefill is not None and e2e is not None
        # Scheduled-to-first-token within arrival-to-answer within the client's round trip.
        assert 0 < prefill <= e2e <= row["latency_mean_s"]
        assert row["server_s"] == row["latency_mean_s"] - prefill
    assert report["fit"] is not None
    assert "fit: request_overhead_s" in format_report(report)
