"""The microbenchmarks measure what they claim (small sizes; figures are not asserted)."""

from __future__ import annotations

from kvgate.benchmarks.index import bench_ingest, bench_lookup


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
