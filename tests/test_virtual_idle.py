"""The virtual driver skips scrape ticks that could change nothing (`VirtualRun._next_scrape`):
the idle time between workflows at a low arrival rate costs no scrape per tick, and the run is
the same run tick by tick."""

from __future__ import annotations

import pytest

from kvgate.bench.options import BenchOptions
from kvgate.bench.report import summarise
from kvgate.bench.runner import Prepared, prepare
from kvgate.bench.virtual import GiveUp, Load, RunResult, VirtualRun, poisson_arrivals

OPTIONS = BenchOptions(workload="fanout", workflows=6, engines=2, progress=False,
                       workload_args={"width": "4", "static_tokens": "800"},
                       policies=["kvgate"])


@pytest.fixture(scope="module")
def prepared() -> Prepared:
    return prepare(OPTIONS)


def run(prepared: Prepared, policy: str, rate: float, give_up: GiveUp | None,
        every_tick: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[RunResult, int]:
    """The run and how many scrapes it made; `every_tick`: scrape at every tick of the clock
    (what the driver did before it skipped any)."""
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


@pytest.mark.parametrize("policy", ["kvgate", "round-robin"])
@pytest.mark.parametrize("rate", [0.002, 3.0])
@pytest.mark.parametrize("give_up", [False, True])
def test_skipped_ticks_change_nothing_and_idle_time_costs_no_scrapes(
        prepared: Prepared, policy: str, rate: float, give_up: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    limit = GiveUp(prepared.bound.jct_s, 1e9) if give_up else None
    every, every_n = run(prepared, policy, rate, limit, True, monkeypatch)
    skipped, skipped_n = run(prepared, policy, rate, limit, False, monkeypatch)
    assert summarise(skipped) == summarise(every)
    assert skipped.requests == every.requests
    assert skipped.workflows == every.workflows
    if rate < 1:
        # About 500 s between arrivals, a tick every 0.5 s: most ticks find the pool idle.
        assert every_n > 3000
        assert skipped_n < every_n / 10
    else:
        assert skipped_n <= every_n
