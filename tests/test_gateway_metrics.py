"""The gateway's `/metrics` describe real traffic: placements by reason, the planner's wait,
per-engine load and prefix-cache counters, and replicas of hot static segments.

Real processes on 127.0.0.1: two `kvgate sim` engines publishing KV events to a `kvgate serve`
gateway (bind mode); `/metrics` is read with prometheus_client's own text parser.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvgate.procs import Child, free_port, spawn, wait_healthy
from tests.conftest import MODEL

SYSTEM = ("You are the planning agent. Break the user's request into steps, call the tools "
          "you are given, check every result twice and report what you could not verify. ") * 8

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    """Every sample on `url/metrics`, keyed by name and sorted labels."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def series(samples: Samples, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


def wait_for(condition: Callable[[], Any], what: str, timeout: float = 20.0,
             seen: Callable[[], Any] | None = None) -> None:
    """Poll `condition` until it holds; on a timeout, say what `seen` read last."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    last = f" (last seen: {seen()!r})" if seen is not None else ""
    raise AssertionError(f"timed out waiting for {what}{last}")


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None
         ) -> tuple[int, dict[str, Any], dict[str, str]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.status, json.loads(r.read()), dict(r.headers)


def agent_call(question: str, max_tokens: int = 2) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": max_tokens, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}


class Pool:
    """Two simulated engines and a gateway that ingests their KV events.

    As in a real deployment, each engine also binds a replay socket: PUB/SUB drops what an
    engine publishes before the gateway's subscription reaches it, and the first call may come
    that early; the gateway recovers those events by replay (kvgate.gateway.kv_events)."""

    def __init__(self, tmp: Path) -> None:
        events = free_port()
        self.sims = []
        replays = []
        for i in range(2):
            port, replay = free_port(), free_port()
            child = spawn(f"metrics-sim-{i}", [
                "sim", "--host", "127.0.0.1", "--port", str(port), "--model", MODEL,
                "--seed", str(i), "--kv-events", f"tcp://127.0.0.1:{events}",
                "--kv-replay", f"tcp://127.0.0.1:{replay}",
                "--enable-prompt-tokens-details"], f"http://127.0.0.1:{port}", tmp)
            self.sims.append(child)
            replays.append(f"tcp://127.0.0.1:{replay}")
        port = free_port()
        config = {"host": "127.0.0.1", "port": port, "policy": "kvgate",
                  "engines": [{"url": s.url, "name": f"sim-{i}", "kv_replay": replays[i]}
                              for i, s in enumerate(self.sims)],
                  "kv_events_bind": f"tcp://127.0.0.1:{events}",
                  "scrape_interval_s": 0.2, "health_interval_s": 0.2}
        path = tmp / "metrics-gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        self.gateway = spawn("metrics-gateway", ["serve", "--config", str(path)],
                             f"http://127.0.0.1:{port}", tmp)
        try:
            for c in [*self.sims, self.gateway]:
                wait_healthy(c)
        except BaseException:
            self.stop()  # nothing outlives a failed start
            raise

    def stop(self) -> None:
        for c in [self.gateway, *self.sims]:
            c.stop()


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    p = Pool(tmp_path_factory.mktemp("metrics"))
    yield p
    p.stop()


@pytest.fixture(scope="module")
def served(pool: Pool) -> dict[str, Any]:
    """Six calls of one hint-mode workflow sharing the system prompt, sent one after another:
    the first lands wherever load says, the rest where the prompt is cached."""
    engines = []
    for i in range(6):
        status, _, headers = post(f"{pool.gateway.url}/v1/chat/completions",
                                  agent_call(f"Question {i}: what changed in release {i}?"),
                                  {"x-kvgate-workflow": "metrics-wf", "x-kvgate-task": f"t{i}"})
        assert status == 200
        engines.append(headers["x-kvgate-engine"])
    return {"calls": 6, "engines": engines}


def test_every_placement_is_counted_once_by_its_reason(pool: Pool,
                                                       served: dict[str, Any]) -> None:
    s = scrape(pool.gateway.url)
    by_reason = {dict(labels)["reason"]: v
                 for labels, v in series(s, "kvgate_placements_total").items()}
    assert sum(v for r, v in by_reason.items() if r != "rejected") == served["calls"]
    assert by_reason.get("load", 0) >= 1  # the first call: nothing cached anywhere
    assert by_reason.get("prefix_hit", 0) >= 1  # later ones: the system prompt is cached
    assert set(by_reason) <= {"load", "prefix_hit", "pull", "disaggregate", "prefetch",
                              "replicate", "pace", "rejected"}


def test_planner_wait_is_observed_for_every_placed_request(pool: Pool,
                                                           served: dict[str, Any]) -> None:
    s = scrape(pool.gateway.url)
    assert value(s, "kvgate_planner_wait_seconds_count") == served["calls"]
    assert value(s, "kvgate_planner_wait_seconds_bucket", le="+Inf") == served["calls"]
    total = value(s, "kvgate_planner_wait_seconds_sum")
    assert total is not None and total >= 0


def test_engine_prefix_cache_counters_match_what_the_engines_report(
    pool: Pool, served: dict[str, Any]
) -> None:
    def engine_counters(sim: Child) -> tuple[float | None, float | None]:
        s = scrape(sim.url)  # summed over vLLM's `engine` label values, as the pool does
        return (sum(series(s, "vllm:prefix_cache_queries_total").values()),
                sum(series(s, "vllm:prefix_cache_hits_total").values()))

    def reexported(i: int) -> tuple[float | None, float | None]:
        s = scrape(pool.gateway.url)
        return (value(s, "kvgate_engine_prefix_cache_queries_total", engine=f"sim-{i}"),
                value(s, "kvgate_engine_prefix_cache_hits_total", engine=f"sim-{i}"))

    for i, sim in enumerate(pool.sims):
        wait_for(lambda i=i, sim=sim: reexported(i) == engine_counters(sim),  # type: ignore[misc]
                 f"the gateway's copy of sim-{i}'s prefix-cache counters")
    hits = sum(reexported(i)[1] or 0 for i in range(2))
    assert hits > 0  # repeats of one system prompt hit the cache


def test_engine_load_gauges_follow_a_request_in_flight(pool: Pool,
                                                       served: dict[str, Any]) -> None:
    body = {**agent_call("Write a very long essay.", max_tokens=4000), "stream": True,
            "ignore_eos": True}
    req = urllib.request.Request(f"{pool.gateway.url}/v1/chat/completions",
                                 data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        engine = r.headers["x-kvgate-engine"]
        r.readline()  # the first event: the request is decoding at the engine

        def running() -> bool:
            s = scrape(pool.gateway.url)
            return (value(s, "kvgate_engine_running", engine=engine) == 1
                    and value(s, "kvgate_engine_in_flight", engine=engine) == 1)

        wait_for(running, f"{engine} running the request, as scraped")
        s = scrape(pool.gateway.url)
        usage = value(s, "kvgate_engine_kv_usage", engine=engine)
        assert usage is not None and 0 < usage <= 1
        assert value(s, "kvgate_engine_waiting", engine=engine) == 0
        assert value(s, "kvgate_engine_prefilling", engine=engine) == 0
    wait_for(lambda: value(scrape(pool.gateway.url), "kvgate_engine_running",
                           engine=engine) == 0, "the aborted request to leave the engine")


def test_static_segment_replicas_count_the_engines_that_hold_it(
    pool: Pool, served: dict[str, Any]
) -> None:
    def segments() -> dict[str, dict[str, float]]:
        s = scrape(pool.gateway.url)
        out: dict[str, dict[str, float]] = {}
        for what in ("replicas", "calls", "blocks"):
            for labels, v in series(s, f"kvgate_static_segment_{what}").items():
                out.setdefault(dict(labels)["segment"], {})[what] = v
        return out

    # Where the calls went holds the prompt: usually one engine (the later calls follow the
    # cache), two when a loaded machine delays the first call's KV events past the second.
    holders = len(set(served["engines"]))
    wait_for(lambda: [seg["replicas"] for seg in segments().values()] == [float(holders)],
             "the engines the calls went to to hold the system prompt", seen=segments)
    (seg,) = segments().values()
    assert seg["calls"] == served["calls"]
    assert seg["blocks"] * 16 <= len(SYSTEM)  # full blocks of the system prompt alone
    if holders == len(pool.sims):
        return
    # The other engine computes the same system prompt (a call straight to it): two replicas.
    holder = served["engines"][0]
    other = next(s for i, s in enumerate(pool.sims) if f"sim-{i}" != holder)
    status, _, _ = post(f"{other.url}/v1/chat/completions", agent_call("Elsewhere."))
    assert status == 200
    wait_for(lambda: [seg["replicas"] for seg in segments().values()] == [2.0],
             "both engines to hold the system prompt", seen=segments)



def test_a_request_no_engine_can_take_is_counted_as_rejected(pool: Pool,
                                                             served: dict[str, Any]) -> None:
    def rejected() -> float:
        return value(scrape(pool.gateway.url), "kvgate_placements_total",
                     reason="rejected") or 0.0

    before = rejected()
    body = {"model": "no-such-model", "max_tokens": 1,
            "messages": [{"role": "user", "content": "Hello?"}]}
    req = urllib.request.Request(f"{pool.gateway.url}/v1/chat/completions",
                                 data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 404
    assert rejected() == before + 1


def test_a_removed_engine_leaves_no_series_even_when_its_calls_end_later() -> None:
    from prometheus_client import generate_latest

    from gateway.metrics import GatewayMetrics

    m = GatewayMetrics()
    for engine in ("gone", "kept"):
        m._child(m.in_flight, engine).inc()  # a call in flight there
        m.count(m.retries, engine)
        m.count(m.upstream_errors, engine, "mid-stream")
        m.healthy.labels(engine).set(1)
    m.forget_engine("gone")
    m.finished("gone")  # the call in flight at the removed engine ends afterwards
    m.finished("kept")
    # A call placed there before it left is counted afterwards (dispatched, retried
    # elsewhere): its series do not come back.
    from planner.actions import Dispatch

    m.dispatched(Dispatch("late", "gone", 0), 10, (), 0.0)
    m.count(m.retries, "gone")
    text = generate_latest(m.registry).decode()
    assert 'engine="gone"' not in text
    assert 'kvgate_engine_in_flight{engine="kept"} 0.0' in text
    assert 'kvgate_upstream_errors_total{engine="kept",kind="mid-stream"} 1.0' in text
    m.engine_joined("gone")  # back under the name: counted again
    m.count(m.retries, "gone")
    assert 'kvgate_retries_total{engine="gone"} 1.0' in generate_latest(m.registry).decode()


def test_a_call_counted_before_its_engine_left_and_came_back_leaves_the_new_gauge_alone() -> None:
    from gateway.metrics import GatewayMetrics
    from planner.actions import Dispatch

    m = GatewayMetrics()

    def in_flight() -> float | None:
        return m.registry.get_sample_value("kvgate_engine_in_flight", {"engine": "e"})

    m.dispatched(Dispatch("old", "e", 0), 100, (), 0.0)
    m.forget_engine("e")  # removed (DELETE /admin/engines/e) with the call still there
    m.engine_joined("e")  # and added back
    m.dispatched(Dispatch("new", "e", 0), 100, (), 1.0)
    m.finished("e", "old")  # it took the new gauge to 0, then to -1 once "new" ended
    assert in_flight() == 1.0
    m.finished("e", "new")
    assert in_flight() == 0.0
    # A dispatch counted late (the metrics are written after the call goes out), once the
    # engine had left: its end must not come off the gauge of the engine back under the name.
    m.forget_engine("e")
    m.dispatched(Dispatch("late", "e", 0), 100, (), 2.0)
    m.engine_joined("e")
    m.dispatched(Dispatch("newer", "e", 0), 100, (), 3.0)
    m.finished("e", "late")
    assert in_flight() == 1.0
