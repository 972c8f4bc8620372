"""The simulated engine's `--scheduling-policy`, checked against vLLM 0.32.0's v1 scheduler.

The expected behaviour is read from vLLM 0.32.0 (`vllm/v1/core/sched/scheduler.py`,
`Scheduler.schedule`; `vllm/v1/core/sched/request_queue.py`; `Request.__lt__` in
`vllm/v1/request.py`; `_get_priority` in `vllm/entrypoints/generate/base/serving.py`):
the waiting queue is FIFO under fcfs and (priority, arrival_time, request_id) under priority;
when a running request needs a KV block, fcfs preempts the last admitted request and puts it at
the queue's front, priority preempts the worst (priority, arrival_time) running request (even one
already scheduled in the step) and queues it at its rank; admission never preempts; a non-zero
`priority` under fcfs is accepted and ignored.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from adapters.sim.model import BlockRemoved, BlockStored, EngineConfig, EngineModel, SimRequest
from kvgate.procs import Child
from planner.profiles import get_profile

PROFILE = get_profile("h100-llama3-8b")
EOS = 3


def make_engine(priority: bool, num_blocks: int = 1024, block_size: int = 16,
                max_num_seqs: int = 64, budget: int = 8192) -> EngineModel:
    cfg = EngineConfig(block_size=block_size, num_blocks=num_blocks,
                       max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                       max_model_len=32768, eos_token_id=EOS, priority_scheduling=priority)
    return EngineModel(cfg, PROFILE, sampler=lambda req: 100 + len(req.output_token_ids))


def request(rid: str, length: int, priority: int = 0, arrival: float = 0.0,
            max_tokens: int = 8) -> SimRequest:
    # Distinct prompts per request id, so the prefix cache never links two requests.
    base = 1000 * (1 + sum(map(ord, rid)))
    return SimRequest(rid, list(range(base, base + length)), max_tokens=max_tokens,
                      arrival_time=arrival, priority=priority, ignore_eos=True)


def ids(reqs: Any) -> list[str]:
    return [r.request_id for r in reqs]


def scheduled_ids(engine: EngineModel, now: float) -> list[str]:
    return [o.request_id for o in engine.step(now).outputs]


# -- the waiting queue ------------------------------------------------------------------------


def test_priority_orders_the_queue_by_priority_then_arrival_then_id() -> None:
    engine = make_engine(priority=True)
    for rid, prio, arrival in [("a", 5, 0.0), ("b", 0, 1.0), ("c", 0, 0.5), ("d", -2, 3.0),
                               ("f", 0, 1.0), ("e", 0, 1.0), ("g", 5, 0.0)]:
        engine.add_request(request(rid, 8, prio, arrival))
    assert ids(engine.waiting) == ["d", "c", "b", "e", "f", "a", "g"]


def test_priority_admits_in_rank_order_when_seats_are_scarce() -> None:
    engine = make_engine(priority=True, max_num_seqs=1)
    engine.add_request(request("late-low", 8, priority=3, arrival=0.0, max_tokens=1))
    engine.add_request(request("early-high", 8, priority=-1, arrival=1.0, max_tokens=1))
    engine.add_request(request("mid", 8, priority=0, arrival=2.0, max_tokens=1))
    order = [scheduled_ids(engine, float(t)) for t in range(3)]
    assert order == [["early-high"], ["mid"], ["late-low"]]


def test_fcfs_ignores_priority() -> None:
    engine = make_engine(priority=False, max_num_seqs=1)
    engine.add_request(request("first", 8, priority=9, arrival=0.0, max_tokens=1))
    engine.add_request(request("second", 8, priority=-9, arrival=1.0, max_tokens=1))
    assert ids(engine.waiting) == ["first", "second"]
    assert [scheduled_ids(engine, float(t)) for t in range(2)] == [["first"], ["second"]]


# -- preemption -------------------------------------------------------------------------------


def three_running_then_full(priority: bool) -> EngineModel:
    """r1 (priority 5) runs first; r2 (0) and r3 (1) join; then all three fill the 6-block pool
    and every one needs a third block at its next token. A waiting w (priority 3) arrived after
    r1 and has no seat (max_num_seqs 3)."""
    engine = make_engine(priority, num_blocks=6, block_size=4, max_num_seqs=3)
    engine.add_request(request("r1", 7, priority=5, arrival=0.0))
    assert scheduled_ids(engine, 0.0) == ["r1"]
    engine.add_request(request("r2", 7, priority=0, arrival=1.0))
    engine.add_request(request("r3", 7, priority=1, arrival=2.0))
    engine.add_request(request("w", 7, priority=3, arrival=3.0))
    assert scheduled_ids(engine, 1.0) == ["r1", "r2", "r3"]
    assert ids(engine.running) == ["r1", "r2", "r3"]
    assert engine.pool.num_free == 0
    return engine


def test_priority_preempts_the_worst_ranked_running_request() -> None:
    engine = three_running_then_full(priority=True)
    # r1 needs a block: the victim is the worst (priority, arrival), r1 itself. vLLM then stops
    # scanning the running requests, so r2 and r3 do not run in this step.
    out = engine.step(2.0)
    assert out.outputs == []
    assert ids(engine.running) == ["r2", "r3"]
    assert engine.requests["r1"].num_preemptions == 1
    # Back at its rank: behind w (priority 3), not at the front.
    assert ids(engine.waiting) == ["w", "r1"]
    # Next step r2 and r3 decode within their blocks, and w, ranked ahead of r1, takes the two
    # blocks r1 freed.
    assert scheduled_ids(engine, 3.0) == ["r2", "r3", "w"]
    assert ids(engine.waiting) == ["r1"]


def test_fcfs_preempts_the_last_admitted_and_requeues_it_first() -> None:
    engine = three_running_then_full(priority=False)
    # r1 needs a block: the victim is the last admitted, r3; r1 and r2 run on.
    assert scheduled_ids(engine, 2.0) == ["r1", "r2"]
    assert ids(engine.running) == ["r1", "r2"]
    assert engine.requests["r3"].num_preemptions == 1
    assert ids(engine.waiting) == ["r3", "w"]


def test_priority_victim_already_scheduled_in_the_step_is_taken_back() -> None:
    """low (priority 5, admitted first) decodes within its blocks and is scheduled; high
    (priority 0) then needs a block: vLLM preempts low although it was scheduled this step."""
    for priority, ran, victim in [(True, ["high"], "low"), (False, ["low"], "high")]:
        engine = make_engine(priority, num_blocks=4, block_size=4)
        engine.add_request(request("low", 5, priority=5, arrival=0.0))
        assert scheduled_ids(engine, 0.0) == ["low"]
        engine.add_request(request("high", 7, priority=0, arrival=1.0))
        assert scheduled_ids(engine, 1.0) == ["low", "high"]
        assert scheduled_ids(engine, 2.0) == ["low", "high"]
        out = engine.step(3.0)
        assert [o.request_id for o in out.outputs] == ran, priority
        assert engine.requests[victim].num_preemptions == 1
        assert ids(engine.waiting) == [victim]
        # The taken-back request's token is not counted in the step it no longer runs in.
        assert out.num_scheduled_tokens == 1


def test_priority_victim_budget_is_returned_to_the_step() -> None:
    """Budget 3, 4 blocks of 4. At step 5 low (priority 5) decodes within its 2 blocks and is
    scheduled first (budget left 2); high (priority 0) needs a second block and none is free, so
    low is preempted and its token returns to the budget (vLLM's `token_budget += restored`).
    high then takes one token and one of low's blocks, and mid, prefilling, gets the 2 tokens its
    prompt still needs, so it emits its first token in this step; without the returned token it
    would get 1."""
    engine = make_engine(True, num_blocks=4, block_size=4, budget=3)
    arrivals = {0: request("low", 1, priority=5, arrival=0.0, max_tokens=6),
                1: request("high", 1, priority=0, arrival=1.0, max_tokens=6),
                2: request("mid", 5, priority=1, arrival=2.0, max_tokens=6)}
    for t in range(5):
        if t in arrivals:
            engine.add_request(arrivals[t])
        engine.step(float(t))
    assert [(r.request_id, r.num_computed_tokens, len(r.blocks)) for r in engine.running] == [
        ("low", 5, 2), ("high", 4, 1), ("mid", 3, 1)]
    assert engine.pool.num_free == 0
    out = engine.step(5.0)
    assert [o.request_id for o in out.outputs] == ["high", "mid"]
    assert out.num_scheduled_tokens == 3
    assert ids(engine.waiting) == ["low"]
    assert engine.stats.num_preemptions == 1


def test_a_better_priority_arrival_never_preempts() -> None:
    # No seat: max_num_seqs 1 is held by a worse-ranked request.
    engine = make_engine(True, max_num_seqs=1)
    engine.add_request(request("low", 8, priority=9, arrival=0.0, max_tokens=4))
    engine.step(0.0)
    engine.add_request(request("urgent", 8, priority=-9, arrival=1.0, max_tokens=4))
    for t in range(3):
        assert scheduled_ids(engine, 1.0 + t) == ["low"]
    assert engine.stats.num_preemptions == 0
    assert scheduled_ids(engine, 5.0) == ["urgent"]
    # No KV: the pool is full with a worse-ranked request that still fits its own next tokens.
    engine = make_engine(True, num_blocks=3, block_size=4)
    engine.add_request(request("low", 9, priority=9, arrival=0.0, max_tokens=3))
    engine.step(0.0)
    engine.add_request(request("urgent", 4, priority=-9, arrival=1.0, max_tokens=1))
    assert scheduled_ids(engine, 1.0) == ["low"]
    assert ids(engine.waiting) == ["urgent"]
    assert engine.stats.num_preemptions == 0


@settings(max_examples=30, deadline=None)
@given(
    reqs=st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 120), st.integers(1, 12),
                  st.integers(-2, 2), st.integers(0, 3)),
        min_size=1,
        max_size=12,
    ),
    num_blocks=st.integers(min_value=16, max_value=48),
)
def test_priority_pool_invariants_hold_for_any_workload(
    reqs: list[tuple[int, int, int, int, int]], num_blocks: int
) -> None:
    """Preemption by rank (victims taken back out of a step included) never leaks a block,
    never double-frees one, keeps the KV events a faithful account, and finishes everything."""
    engine = make_engine(True, num_blocks=num_blocks, block_size=16, budget=256)
    counter = itertools.count()
    pending = sorted(((arrive, i, fam, n, mt, prio) for i, (fam, n, mt, prio, arrive)
                      in enumerate(reqs)), reverse=True)
    live: Counter[int] = Counter()
    now = 0.0
    for step in range(10000):
        while pending and pending[-1][0] <= step:
            _, _, fam, n, mt, prio = pending.pop()
            rid = f"r{next(counter)}"
            engine.add_request(SimRequest(rid, [fam * 10000 + t for t in range(n)],
                                          max_tokens=mt, arrival_time=now, priority=prio,
                                          ignore_eos=True))
        if not engine.has_work() and not pending:
            break
        out = engine.step(now)
        now += out.duration
        for e in out.kv_events:
            if isinstance(e, BlockStored):
                live.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    assert live[h] > 0
                    live[h] -= 1
        referenced = sum(1 for b in engine.pool.blocks if b.ref_cnt > 0)
        assert referenced + engine.pool.num_free == engine.pool.num_blocks
        assert sum(len(r.blocks) for r in engine.running) >= referenced
        keys = [r.priority_key for r in engine.waiting]
        assert keys == sorted(keys)
    assert not engine.has_work()
    assert engine.pool.num_free == engine.pool.num_blocks
    cached = Counter(b.block_hash for b in engine.pool.blocks if b.block_hash is not None)
    assert +live == cached


# -- the HTTP server --------------------------------------------------------------------------


def profile_file(tmp_path: Path) -> str:
    """cpu-tiny with one seat, so a request queues behind another."""
    path = tmp_path / "one-seat.yaml"
    # A 50 ms step keeps the seat's holder busy for minutes: it leaves only when aborted.
    path.write_text("base: cpu-tiny\nname: one-seat\nmax_num_seqs: 1\nstep_overhead_s: 0.05\n")
    return str(path)


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
         ) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_for_waiting(child: Child, n: int) -> None:
    """Poll the engine's `vllm:num_requests_waiting` until it reaches `n` (at most 600 polls)."""
    for _ in range(600):
        with urllib.request.urlopen(f"{child.url}/metrics", timeout=10) as r:
            text = r.read().decode()
        values = [s.value for f in text_string_to_metric_families(text)
                  if f.name == "vllm:num_requests_waiting" for s in f.samples]
        if values and values[0] >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"never saw {n} waiting requests")


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_server_orders_queued_requests_by_priority(
    policy: str, tmp_path: Path, spawn_sim: Callable[..., Child]
) -> None:
    """One seat, held by a streamed request; two more queue. Under priority the one with the
    better `X-Vllm-Priority` header (its body says worse) runs first once the seat frees; under
    fcfs the first to arrive does, and neither non-zero priority is an error."""
    sim = spawn_sim("--scheduling-policy", policy, "--profile-file", profile_file(tmp_path))
    client = openai.OpenAI(base_url=f"{sim.url}/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    holder = client.completions.create(model=model, prompt="hold the seat", max_tokens=4000,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(holder))
    finished: list[str] = []
    lock = threading.Lock()

    def run(name: str, priority: int, headers: dict[str, str]) -> None:
        out = client.completions.create(model=model, prompt=f"queued {name}", max_tokens=2,
                                        extra_body={"priority": priority, "ignore_eos": True},
                                        extra_headers=headers)
        assert out.choices[0].finish_reason == "length"
        with lock:
            finished.append(name)

    first = threading.Thread(target=run, args=("first", 2, {}))
    first.start()
    wait_for_waiting(sim, 1)
    second = threading.Thread(target=run, args=("second", 7, {"X-Vllm-Priority": "-1"}))
    second.start()
    wait_for_waiting(sim, 2)
    holder.close()  # the client goes away: the engine aborts the holder and frees the seat
    first.join(60)
    second.join(60)
    assert finished == (["second", "first"] if policy == "priority" else ["first", "second"])


def test_server_rejects_a_priority_outside_int64_like_vllm(
    spawn_sim: Callable[..., Child],
) -> None:
    sim = spawn_sim("--scheduling-policy", "priority")
    url = f"{sim.url}/v1/completions"
    model = json.loads(urllib.request.urlopen(f"{sim.url}/v1/models", timeout=10).read())
    name = model["data"][0]["id"]
    status, body = post(url, {"model": name, "prompt": "x", "max_tokens": 1,
                              "priority": 2**63})
    assert status == 400
    assert body["error"]["param"] == "body.priority"
    assert body["error"]["type"] == "Bad Request"
    assert "less than or equal to 9223372036854775807" in body["error"]["message"]
    status, body = post(url, {"model": name, "prompt": "x", "max_tokens": 1, "priority": "high"})
    assert status == 400
    assert "priority" in body["error"]["message"]
    # A header that is not an integer is ignored, as vLLM's `_get_priority` does.
    status, body = post(url, {"model": name, "prompt": "x", "max_tokens": 1, "priority": -4},
                        {"X-Vllm-Priority": "soon"})
    assert status == 200, body
