"""A goodput probe stops once it can no longer meet its SLO (`virtual.GiveUp`); the virtual
driver skips the scrape ticks of idle time, and the run is the same run."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path

import pytest

from kvgate.bench.goodput import Goodput, GoodputPoint, search_goodput
from kvgate.bench.options import BenchOptions
from kvgate.bench.report import format_goodput, summarise
from kvgate.bench.runner import Prepared, prepare, probe_goodput, run_bench
from kvgate.bench.virtual import GiveUp, Load, RunResult, VirtualRun, poisson_arrivals

OPTIONS = BenchOptions(workload="fanout", workflows=12, engines=2, progress=False,
                       workload_args={"width": "4", "static_tokens": "800"},
                       policies=["round-robin"])


@pytest.fixture(scope="module")
def prepared() -> Prepared:
    return prepare(OPTIONS)


def run(prepared: Prepared, rate: float, give_up: GiveUp | None) -> RunResult:
    load = Load(arrivals=poisson_arrivals(prepared.workflows, rate, 0))
    return VirtualRun("round-robin", prepared.workflows, load, OPTIONS.engine_profile(),
                      OPTIONS.engines, prepared.builder, give_up=give_up).run()


def test_an_overloaded_run_stops_early_with_a_floor_below_its_real_mean_jct(
        prepared: Prepared) -> None:
    bound = prepared.bound
    whole = run(prepared, 50.0, None)
    real = summarise(whole)["jct_mean_s"]
    assert whole.cut_short_jct_mean_s is None
    limit = (bound.jct_mean_s + real) / 2  # missed by the whole run
    cut = run(prepared, 50.0, GiveUp(bound.jct_s, limit))
    floor = cut.cut_short_jct_mean_s
    assert floor is not None
    assert limit < floor <= real
    # It stopped before the end: some workflow was still running or yet to finish.
    assert any(w.finished_s is None for w in cut.workflows)


def test_a_run_within_its_limit_is_the_same_run(prepared: Prepared) -> None:
    bound = prepared.bound
    whole = run(prepared, 0.5, None)
    real = summarise(whole)["jct_mean_s"]
    kept = run(prepared, 0.5, GiveUp(bound.jct_s, real * 1.01))
    assert kept.cut_short_jct_mean_s is None
    assert summarise(kept) == summarise(whole)


def test_a_search_finds_the_same_goodput_and_marks_the_probes_it_cut(tmp_path: Path) -> None:
    options = BenchOptions(workload="fanout", workflows=20, engines=2, progress=False,
                           workload_args={"width": "6", "static_tokens": "800"},
                           policies=["round-robin"], goodput=True, goodput_precision=0.05,
                           slo_jct=1.2)
    prepared = prepare(options)

    def search(give_up: bool) -> Goodput:
        return search_goodput(
            lambda rate: probe_goodput(options, prepared, "round-robin", rate, give_up), 1.0,
            slo=1.2, precision=0.05)

    cut, whole = search(True), search(False)
    assert cut.rate == whole.rate > 0
    assert [p.rate for p in cut.points] == [p.rate for p in whole.points]
    assert any(p.cut_short for p in cut.points)
    for c, w in zip(cut.points, whole.points, strict=True):
        assert not w.cut_short
        if c.cut_short:  # a floor under the whole probe's JCT, above the SLO
            assert 1.2 < c.x_bound <= w.x_bound and c.jct_mean_s <= w.jct_mean_s
        else:
            assert c == w
    # The bench's own search (its start rate and burst cap) cuts probes too, says so, and
    # draws them (as floors) in the goodput plot.
    plot = tmp_path / "run.png"
    g = run_bench(replace(options, plot_out=str(plot)),
                  out=io.StringIO())["goodput"]["round-robin"]
    assert (tmp_path / "run-goodput.png").stat().st_size > 0
    assert g["rate"] > 0 and any(p["cut_short"] for p in g["points"])
    assert all(p["x_bound"] > 1.2 for p in g["points"] if p["cut_short"])


def test_a_floor_is_no_plateau() -> None:
    # Halving below a cut probe goes on even when the floor reads as flat as the lower rate's
    # excess: the cut probe's real excess may be far larger.
    def probe(rate: float) -> GoodputPoint:
        if rate >= 0.5:
            return GoodputPoint(rate, 1.8, 1.8, 0, cut_short=True)
        x = 1.2 if rate < 0.2 else 1.79
        return GoodputPoint(rate, x, x, 0)

    g = search_goodput(probe, 1.0, precision=0.05)
    assert g.rate > 0
    without_floors = search_goodput(
        lambda r: GoodputPoint(r, *(2 * [probe(r).x_bound]), 0), 1.0, precision=0.05)
    assert without_floors.rate == 0.0  # the plateau rule stops that search at 0.25/s


def test_a_search_that_met_no_rate_prints_a_cut_probe_as_a_floor() -> None:
    point = GoodputPoint(0.5, 9.0, 1.8, 0, cut_short=True)
    report = {"goodput": {"slo_jct_x_bound": 1.5, "kvgate": Goodput(0.0, (point,)).as_json()}}
    assert "kvgate: no rate tried met the SLO (at 0.5/s: >= 1.800 x bound" in (
        format_goodput(report))
    whole = GoodputPoint(0.5, 9.0, 1.8, 0)
    report["goodput"]["kvgate"] = Goodput(0.0, (whole,)).as_json()
    assert "(at 0.5/s: 1.800 x bound" in format_goodput(report)


# -- idle time: the virtual driver skips scrape ticks that could change nothing ------------


def counted_run(prepared: Prepared, policy: str, rate: float, give_up: GiveUp | None,
        every_tick: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[RunResult, int]:
    """The run and how many scrapes it made; `every_tick`: scrape at every tick of the clock
    (what the driver did before it skipped any, `VirtualRun._next_scrape`)."""
    scrapes = 0
    original = VirtualRun._scrape

    def counted(self: VirtualRun) -> None:
        nonlocal scrapes
        scrapes += 1
        original(self)

    with monkeypatch.context() as m:
        m.setattr(VirtualRun, "_scrape", counted)
        if every_tick:
            m.setattr(VirtualRun, "_next_scrape", lambda self, t: t + self.scrape_s)
        load = Load(arrivals=poisson_arrivals(prepared.workflows, rate, 0))
        result = VirtualRun(policy, prepared.workflows, load, OPTIONS.engine_profile(),
                            OPTIONS.engines, prepared.builder, give_up=give_up).run()
    return result, scrapes


@pytest.mark.parametrize("policy", ["kvgate", "round-robin", "dynamo-like"])
@pytest.mark.parametrize("rate", [0.002, 3.0])
@pytest.mark.parametrize("give_up", [False, True])
def test_skipped_ticks_change_nothing_and_idle_time_costs_no_scrapes(
        prepared: Prepared, policy: str, rate: float, give_up: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    limit = GiveUp(prepared.bound.jct_s, 1e9) if give_up else None
    every, every_n = counted_run(prepared, policy, rate, limit, True, monkeypatch)
    skipped, skipped_n = counted_run(prepared, policy, rate, limit, False, monkeypatch)
    assert summarise(skipped) == summarise(every)
    assert skipped.requests == every.requests
    assert skipped.workflows == every.workflows
    if rate < 1:
        # About 500 s between arrivals, a tick every 0.5 s: most ticks find the pool idle.
        assert every_n > 3000
        assert skipped_n < every_n / 10
    else:
        assert skipped_n <= every_n
