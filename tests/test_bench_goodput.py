"""Goodput at an SLO (kvgate/bench/goodput.py) and compute utilisation in bench reports."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvgate.bench.goodput import GoodputPoint, isolation_rate, search_goodput
from kvgate.bench.options import BenchOptions
from kvgate.bench.runner import run_bench


def linear_probe(threshold: float, calls: list[float]) -> Any:
    """A system whose JCT/bound grows linearly with rate and crosses 1.5 at `threshold`."""

    def probe(rate: float) -> GoodputPoint:
        calls.append(rate)
        x = 1.0 + 0.5 * rate / threshold
        return GoodputPoint(rate, x, x, 0)

    return probe


@pytest.mark.parametrize("start", [0.01, 1.0, 37.0])
def test_search_brackets_then_bisects_to_the_precision(start: float) -> None:
    calls: list[float] = []
    g = search_goodput(linear_probe(2.0, calls), start, slo=1.5, precision=0.05,
                       max_probes=40)
    assert g.rate <= 2.0
    failing_above = min(p.rate for p in g.points if not p.meets(1.5))
    assert failing_above > 2.0
    assert failing_above - g.rate <= 0.05 * g.rate
    assert [p.rate for p in g.points] == sorted(set(calls))


def test_search_is_deterministic_and_bounded_in_probes() -> None:
    a = search_goodput(linear_probe(3.0, []), 1.0, max_probes=6)
    b = search_goodput(linear_probe(3.0, []), 1.0, max_probes=6)
    assert a == b and len(a.points) <= 6


def test_no_rate_meeting_the_slo_gives_zero() -> None:
    def never(rate: float) -> GoodputPoint:
        return GoodputPoint(rate, 2.0 + 10 * rate, 2.0 + 10 * rate, 0)

    g = search_goodput(never, 1.0, max_probes=5)
    assert g.rate == 0.0 and len(g.points) == 5


def test_halving_stops_once_lower_load_no_longer_shortens_jct() -> None:
    calls: list[float] = []

    def saturated(rate: float) -> GoodputPoint:
        calls.append(rate)
        x = 1.8 + 0.01 * rate
        return GoodputPoint(rate, x, x, 0)

    # Each halving cuts the excess (0.88 at 8/s) by 4.5%, 2.4%, 1.2%, then 0.6% < 1%: stop.
    g = search_goodput(saturated, 8.0, slo=1.5, precision=0.05)
    assert g.rate == 0.0
    assert calls == [8.0, 4.0, 2.0, 1.0, 0.5]


def test_halving_goes_on_past_a_flat_stretch_while_workflows_overlap() -> None:
    """An excess that stays flat between 0.2 and 0.1 workflows/s and falls below (a run whose
    workflows still overlap there) is followed down to where the SLO holds: the plateau stop
    applies only at or below `plateau_below`, and a coarse precision does not make it coarse."""
    def knee(rate: float) -> GoodputPoint:
        x = 1.575 + 0.003 * (rate - 0.1) if rate >= 0.1 else 1.3 + 2.75 * rate
        return GoodputPoint(rate, x, x, 0)

    g = search_goodput(knee, 0.4, slo=1.5, precision=0.1, plateau_below=isolation_rate(19.2))
    assert 0.05 <= g.rate < 0.1
    # Without the floor, the flat stretch ends the search.
    assert search_goodput(knee, 0.4, slo=1.5, precision=0.1).rate == 0.0


def test_halving_goes_on_while_it_still_shortens_jct() -> None:
    # Light-load JCT falls ever more slowly towards 1.008 x bound; an SLO of 1.01 holds at last.
    g = search_goodput(lambda r: GoodputPoint(r, 1.0, 1.008 + 0.1 * r, 0), 1.0, slo=1.01,
                       precision=0.05, max_probes=40)
    assert 0.0 < g.rate <= 0.02


def test_doubling_stops_past_the_burst_rate() -> None:
    g = search_goodput(lambda r: GoodputPoint(r, 1.0, 1.0, 0), 1.0, max_rate=10.0)
    assert g.rate == 16.0
    assert [p.rate for p in g.points] == [1.0, 2.0, 4.0, 8.0, 16.0]


def test_a_failed_workflow_fails_the_slo_whatever_the_jct() -> None:
    assert not GoodputPoint(1.0, 1.0, 1.0, failed=1).meets(1.5)


def small(**kw: object) -> dict[str, Any]:
    options = BenchOptions(workload="fanout", workflows=8, engines=2, progress=False,
                           workload_args={"width": "3", "static_tokens": "500"},
                           **kw)  # type: ignore[arg-type]
    return run_bench(options, out=io.StringIO())


def test_goodput_section_has_the_contract_shape_and_repeats_exactly(tmp_path: Path) -> None:
    plot = tmp_path / "run.png"
    first = small(policies=["round-robin", "least-loaded"], goodput=True, slo_jct=1.5,
                  plot_out=str(plot))
    again = small(policies=["round-robin", "least-loaded"], goodput=True, slo_jct=1.5)
    section = first["goodput"]
    assert section == again["goodput"]
    assert section["slo_jct_x_bound"] == 1.5
    for policy in ("round-robin", "least-loaded"):
        g = section[policy]
        assert g["rate"] > 0
        rates = [p["rate"] for p in g["points"]]
        assert rates == sorted(rates)
        assert set(g["points"][0]) == {"rate", "jct_mean_s", "x_bound", "failed", "cut_short"}
        passing = next(p for p in g["points"] if p["rate"] == g["rate"])
        assert passing["x_bound"] <= 1.5 and passing["failed"] == 0
    assert plot.exists() and (tmp_path / "run-goodput.png").stat().st_size > 0


def test_compute_utilisation_is_a_fraction_that_grows_with_load() -> None:
    light = small(policies=["round-robin"], rate=0.05)["results"]["round-robin"]
    heavy = small(policies=["round-robin"], concurrency=8)["results"]["round-robin"]
    assert 0 < light["compute_utilisation"] < heavy["compute_utilisation"] < 1


@pytest.mark.parametrize("args, message", [
    (["--slo-jct", "2"], "--slo-jct sets the goodput SLO"),
    (["--goodput", "--slo-jct", "0"], "--slo-jct must be a number above 1"),
    (["--goodput", "--slo-jct", "nan"], "--slo-jct must be a number above 1"),
    (["--goodput", "--mode", "live"], "--goodput searches rates in virtual time"),
    (["--goodput", "--goodput-precision", "2"], "--goodput-precision must be between"),
    (["--slo-bound-profile", "h100-llama3-8b"], "--slo-bound-profile sets the goodput SLO's"),
    (["--goodput", "--slo-bound-profile", "tpu-giant"],
     "--slo-bound-profile: unknown engine profile 'tpu-giant'"),
    (["--goodput", "--slo-bound-profile", "/nonexistent/p.yaml"], "--slo-bound-profile: "),
])
def test_goodput_option_errors_name_the_option_and_exit_2(args: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvgate.cli", "bench", "--workload", "fanout",
                           "--no-progress", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_slo_bound_profile_holds_a_what_if_to_another_profiles_jct_in_seconds() -> None:
    # Engines with free prefill, held to the real profile's bound: the section names it, each
    # probe's x is its JCT over that bound, and the figure is the one the SLO scaled by the
    # two bounds' ratio gives (the search brackets by the engines' own bound either way).
    what_if = Path(__file__).resolve().parent.parent / (
        "configs/profiles/h100-llama3-8b-free-prefill.yaml")
    real = small(policies=["round-robin"], rate=1.0)["lower_bound"]["jct_mean_s"]
    free = small(policies=["round-robin"], rate=1.0, profile_file=str(what_if))
    assert free["lower_bound"]["jct_mean_s"] < real
    held = small(policies=["round-robin"], profile_file=str(what_if), goodput=True,
                 goodput_precision=0.1, slo_bound_profile="h100-llama3-8b")["goodput"]
    assert held["slo_bound_profile"] == "h100-llama3-8b"
    assert held["slo_bound_jct_mean_s"] == pytest.approx(real)
    for p in held["round-robin"]["points"]:
        assert p["x_bound"] == pytest.approx(p["jct_mean_s"] / real)
    scaled = small(policies=["round-robin"], profile_file=str(what_if), goodput=True,
                   goodput_precision=0.1,
                   slo_jct=1.5 * real / free["lower_bound"]["jct_mean_s"])["goodput"]
    assert held["round-robin"]["rate"] == scaled["round-robin"]["rate"]
    # Held to its own (smaller) bound the same engines meet the SLO at no higher a rate.
    own = small(policies=["round-robin"], profile_file=str(what_if), goodput=True,
                goodput_precision=0.1)["goodput"]
    assert "slo_bound_profile" not in own
    assert own["round-robin"]["rate"] <= held["round-robin"]["rate"]


def test_search_in_a_run_meets_the_slo_and_the_lowest_failing_rate_above_does_not() -> None:
    options = BenchOptions(workload="fanout", workflows=10, engines=2, progress=False,
                           profile="cpu-tiny", workload_args={"width": "4"},
                           policies=["round-robin"], goodput=True, slo_jct=1.3,
                           goodput_precision=0.1)
    out = io.StringIO()
    g = run_bench(options, out=out)["goodput"]["round-robin"]
    passing = next(p for p in g["points"] if p["rate"] == g["rate"])
    failing = min((p for p in g["points"] if p["rate"] > g["rate"]), key=lambda p: p["rate"])
    assert passing["x_bound"] <= 1.3 and passing["failed"] == 0
    assert failing["x_bound"] > 1.3 or failing["failed"] > 0
    assert failing["rate"] - g["rate"] <= 0.1 * g["rate"]
    assert "arrive as one burst" not in out.getvalue()


def test_too_few_workflows_to_load_the_pool_are_reported_as_a_burst() -> None:
    out = io.StringIO()
    options = BenchOptions(workload="fanout", workflows=4, engines=2, progress=False,
                           workload_args={"width": "3", "static_tokens": "500"},
                           policies=["round-robin"], goodput=True)
    g = run_bench(options, out=out)["goodput"]["round-robin"]
    assert all(p["x_bound"] <= 1.5 for p in g["points"])
    assert len(g["points"]) < 14
    assert "round-robin: every rate tried met the SLO" in out.getvalue()
