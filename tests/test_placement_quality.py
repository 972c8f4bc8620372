"""Issue 3's bar: under `kvgate`, engines' own prefix-hit ratio is within 10% of one engine with
an infinite cache, while no engine gets more than 1.5x the mean load; round-robin for contrast."""

from __future__ import annotations

from pathlib import Path

from kvgate.benchmarks.placement import run_ideal, run_policy

ENGINES, AGENTS, TURNS, OUTPUT = 4, 8, 4, 12


def test_kvgate_hits_near_the_ideal_with_balanced_load(tmp_path: Path) -> None:
    ideal = run_ideal(AGENTS, TURNS, OUTPUT, tmp_path)
    kvgate = run_policy("kvgate", ENGINES, AGENTS, TURNS, OUTPUT, tmp_path)
    round_robin = run_policy("round-robin", ENGINES, AGENTS, TURNS, OUTPUT, tmp_path)
    assert ideal.hit_ratio > 0.5
    assert kvgate.hit_ratio >= 0.9 * ideal.hit_ratio
    assert kvgate.max_over_mean <= 1.5
    assert sum(kvgate.requests_per_engine) == AGENTS * TURNS
    # The contrast: spreading the same agents blindly recomputes their prefixes.
    assert round_robin.hit_ratio < kvgate.hit_ratio
