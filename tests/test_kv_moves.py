"""Moving KV: the engine model's two NixlConnector legs, the link model, the planner's
Transfer / Warm actions and its waiting requests, prefetch, and the virtual driver's moves."""

from __future__ import annotations

import pytest

from adapters.sim.link import LinkModel
from adapters.sim.model import (
    BlockStored,
    EngineConfig,
    EngineModel,
    RemotePrefill,
    RequestStatus,
    SimRequest,
)
from kvgate.bench.options import BenchOptions
from kvgate.bench.runner import prepare
from kvgate.bench.virtual import RunResult, VirtualRun
from kvindex.index import EngineMatch
from planner.actions import Dispatch, Transfer, Warm
from planner.core import Call, Planner, RequestState, make_planner
from planner.events import (
    Cancelled,
    EngineJoined,
    EngineLeft,
    Finished,
    FirstToken,
    TaskSpec,
    TransferDone,
    TransferFailed,
    WorkflowOver,
    WorkflowSubmitted,
)
from planner.hints import RequestHints
from planner.policy import NoEngineAvailable, Placement, PolicyContext, RouteRequest
from planner.profiles import get_profile
from planner.replication import StaticDemand
from planner.segments import from_token_runs
from planner.transfer import NAMED_LINKS, Pull, TransferLink, parse_link

PROFILE = get_profile("h100-llama3-8b")


def engine(num_blocks: int = 256) -> EngineModel:
    cfg = EngineConfig(block_size=16, num_blocks=num_blocks, max_num_batched_tokens=8192,
                       max_num_seqs=64, max_model_len=4096, eos_token_id=3, kv_lease_s=30.0)
    return EngineModel(cfg, PROFILE, sampler=lambda req: 100)


def run(e: EngineModel, now: float = 0.0) -> float:
    while e.has_work():
        now += e.step(now).duration
    return now


PROMPT = list(range(1000, 1160))  # 160 tokens: 10 blocks of 16


# -- the engine model's legs -------------------------------------------------------------------


def test_producer_keeps_exported_blocks_until_released() -> None:
    src = engine()
    req = SimRequest("p", PROMPT, max_tokens=1, arrival_time=0.0, ignore_eos=True,
                     remote_decode=True)
    src.add_request(req)
    run(src)
    # The prompt's 10 blocks (its one output token was sampled, never computed into KV).
    assert len(req.exported_block_ids) == 10
    assert src.pool.num_free == src.pool.num_blocks - 10
    assert src.release_export("p")
    assert src.pool.num_free == src.pool.num_blocks


def test_exported_blocks_are_freed_when_the_lease_runs_out() -> None:
    src = engine()
    src.add_request(SimRequest("p", PROMPT, max_tokens=1, arrival_time=0.0, ignore_eos=True,
                               remote_decode=True))
    end = run(src)
    src.expire_exports(end + 29.0)
    assert "p" in src.exports
    src.expire_exports(end + 30.0)
    assert not src.exports and src.pool.num_free == src.pool.num_blocks


def test_consumer_waits_for_remote_kv_then_computes_only_the_last_token() -> None:
    dst = engine()
    req = SimRequest("c", PROMPT, max_tokens=1, arrival_time=0.0, ignore_eos=True,
                     remote_prefill=RemotePrefill("src", "p", tuple(range(10))))
    dst.add_request(req)
    out = dst.step(0.0)
    assert out.num_scheduled_tokens == 0
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KVS and dst.num_waiting == 1
    (pull,) = dst.drain_pulls()
    assert (pull.num_blocks, pull.num_tokens, pull.remote_engine_id) == (10, 160, "src")
    dst.finish_remote_load("c", ok=True)
    stored = [e for e in dst.pool.drain_events() if isinstance(e, BlockStored)]
    assert sum(len(e.block_hashes) for e in stored) == 9  # 159 tokens loaded as computed
    step = dst.step(1.0)
    assert step.num_scheduled_tokens == 1
    assert dst.stats.external_prefix_cache_hits == 160 and dst.stats.kv_pulled_blocks == 10
    run(dst, 2.0)
    later = SimRequest("again", [*PROMPT, 7, 8], max_tokens=1, arrival_time=3.0,
                       ignore_eos=True)
    dst.add_request(later)
    run(dst, 3.0)
    assert later.num_cached_tokens == 160  # the imported prefix is in the local cache


def test_a_failed_load_recomputes_the_prompt() -> None:
    dst = engine()
    req = SimRequest("c", PROMPT, max_tokens=1, arrival_time=0.0, ignore_eos=True,
                     remote_prefill=RemotePrefill("src", "p", tuple(range(10))))
    dst.add_request(req)
    dst.step(0.0)
    dst.finish_remote_load("c", ok=False)
    assert dst.step(1.0).num_scheduled_tokens == 160
    assert dst.stats.external_prefix_cache_hits == 0


def test_consumer_pulls_only_what_its_local_cache_lacks() -> None:
    dst = engine()
    dst.add_request(SimRequest("warm", [*PROMPT[:64], 1], max_tokens=1, arrival_time=0.0,
                               ignore_eos=True))
    run(dst)
    dst.add_request(SimRequest("c", PROMPT, max_tokens=1, arrival_time=1.0, ignore_eos=True,
                               remote_prefill=RemotePrefill("src", "p", tuple(range(10)))))
    dst.step(1.0)
    (pull,) = dst.drain_pulls()
    assert pull.num_blocks == 6 and pull.num_tokens == 96
    assert pull.remote_block_ids == tuple(range(4, 10))


# -- the link ------------------------------------------------------------------------------------


def test_transfers_sharing_a_nic_take_turns_and_others_run_in_parallel() -> None:
    link = LinkModel(TransferLink(1e9, 0.0))
    assert link.schedule("a", "b", 10**9, 0.0) == pytest.approx(1.0)
    assert link.schedule("a", "c", 10**9, 0.0) == pytest.approx(2.0)
    assert link.schedule("d", "e", 10**9, 0.0) == pytest.approx(1.0)
    assert link.bytes_moved == 3 * 10**9


def test_links_parse_by_name_or_bandwidth_and_name_a_bad_value() -> None:
    assert parse_link("rdma") == NAMED_LINKS["rdma"]
    assert parse_link("25").bandwidth_bytes_s == 25e9
    assert not parse_link("none").enabled
    with pytest.raises(ValueError, match="'fast'"):
        parse_link("fast")
    with pytest.raises(ValueError, match="positive"):
        parse_link("-3")


# -- the planner ---------------------------------------------------------------------------------


class PullFrom:
    """A test policy: always place on `engine`, pulling from `source`."""

    name = "pull-from"
    speculative_entries = False
    moves_kv = True

    def __init__(self, engine: str, source: str | None) -> None:
        self.engine, self.source = engine, source

    def choose(self, request: RouteRequest, engines: object, now: float) -> Placement:
        pull = Pull(self.source, 4096) if self.source else None
        return Placement(self.engine, pull=pull)

    def on_dispatch(self, request: object, placement: object, now: float) -> None:
        pass

    def on_first_token(self, request_id: str, engine: str, now: float) -> None:
        pass

    def on_finish(self, request_id: str, engine: str, now: float, output_tokens: int = 0
                  ) -> None:
        pass


def pulling_planner(link: TransferLink = NAMED_LINKS["rdma"]) -> Planner:
    p = Planner(PullFrom("b", "a"), profile_of=lambda _: PROFILE, link=link)  # type: ignore[arg-type]
    for e in ("a", "b"):
        p.on_event(EngineJoined(e, healthy=True, models=frozenset({"m"})), 0.0)
    return p


def long_call(rid: str = "r") -> Call:
    return Call(RouteRequest(rid, "m", prompt_tokens=4200, block_keys=tuple(range(262)),
                             matches={"a": EngineMatch("a", 262, 262, 262.0)}))


def test_a_pull_is_sent_first_and_the_request_only_once_it_is_done() -> None:
    p = pulling_planner()
    p.admit(long_call(), 0.0)
    (move,) = p.release(0.0)
    assert isinstance(move, Transfer)
    assert (move.source, move.destination, move.reason, move.origin) == ("a", "b", "pull", "r")
    assert move.tokens == 4096 and move.num_bytes == 4096 * PROFILE.kv_bytes_per_token
    assert p.state("r") is RequestState.AWAITING_KV
    assert {v.name: v.in_flight for v in p.views()}["b"] == 1
    p.on_event(TransferDone(move.move_id), 0.5)
    assert p.pending
    (d,) = p.release(0.5)
    assert isinstance(d, Dispatch) and d.engine == "b" and d.cached_tokens == 4096
    assert p.state("r") is RequestState.DISPATCHED


def test_a_failed_move_sends_its_waiting_requests_to_recompute() -> None:
    p = pulling_planner()
    p.admit(long_call(), 0.0)
    (move,) = p.release(0.0)
    p.on_event(TransferFailed(move.move_id, "lease expired"), 0.2)
    (d,) = p.release(0.2)
    assert isinstance(d, Dispatch) and d.engine == "b"
    assert p.moves.stats.failed == 1
    # Nothing arrived: the dispatch and the ledger count the whole prompt as computed there.
    assert (d.cached_tokens, d.kv_move) == (0, None)
    assert {v.name: v.queued_prefill_tokens for v in p.views()}["b"] == 4200


def test_a_move_from_or_to_an_engine_that_left_is_over_at_once() -> None:
    # Its waiters go now (placed on the engine that left: to be sent elsewhere by the driver),
    # not at the move's deadline, and the NICs it booked are free again.
    for gone in ("a", "b"):
        p = pulling_planner()
        p.admit(long_call(), 0.0)
        (move,) = p.release(0.0)
        assert isinstance(move, Transfer) and p.moves.nic_wait(0.0)
        p.on_event(EngineLeft(gone), 0.1)
        assert p.pending and len(p.moves) == 0 and p.moves.stats.failed == 1
        (d,) = p.release(0.1)
        assert isinstance(d, Dispatch) and d.engine == "b"
        assert p.moves.nic_wait(0.1) == {}
        p.on_event(TransferDone(move.move_id), 0.5)  # its end, reported late, changes nothing
        assert p.release(0.5) == []


def test_a_late_move_is_given_up_at_its_deadline() -> None:
    p = pulling_planner()
    p.admit(long_call(), 0.0)
    (move,) = p.release(0.0)
    deadline = p.next_wakeup()
    assert deadline is not None and deadline > 0
    assert p.release(deadline - 0.01) == []
    (d,) = p.release(deadline)
    assert isinstance(d, Dispatch) and p.moves.stats.late == 1
    assert (d.cached_tokens, d.kv_move) == (0, None)  # it computes the prefix
    p.on_event(TransferDone(move.move_id), deadline + 1)
    assert p.release(deadline + 1) == []  # nothing sent twice


def test_a_request_cancelled_while_awaiting_kv_is_never_sent() -> None:
    p = pulling_planner()
    p.admit(long_call(), 0.0)
    (move,) = p.release(0.0)
    p.on_event(Cancelled("r"), 0.1)
    assert not p.knows("r")
    assert {v.name: v.in_flight for v in p.views()}["b"] == 0
    p.on_event(TransferDone(move.move_id), 0.2)
    assert p.release(0.2) == []


class FinishCounting(PullFrom):
    """PullFrom that counts what it was told had finished."""

    def __init__(self, engine: str, source: str | None) -> None:
        super().__init__(engine, source)
        self.finished: list[str] = []

    def on_finish(self, request_id: str, engine: str, now: float, output_tokens: int = 0
                  ) -> None:
        self.finished.append(request_id)


def test_a_request_cancelled_while_awaiting_kv_leaves_nothing_of_its_placement() -> None:
    # Its sibling group and the policy's own count of its placement go with it.
    policy = FinishCounting("b", "a")
    p = Planner(policy, profile_of=lambda _: PROFILE, link=NAMED_LINKS["rdma"],  # type: ignore[arg-type]
                siblings=True)
    for e in ("a", "b"):
        p.on_event(EngineJoined(e, healthy=True, models=frozenset({"m"})), 0.0)
    call = long_call()
    p.admit(Call(call.route, hints=RequestHints(workflow="w", task="t")), 0.0)
    (pull,) = p.release(0.0)
    assert isinstance(pull, Transfer)
    assert {v.name: v.grouped for v in p.views()}["b"] == 1
    p.on_event(Cancelled("r"), 0.1)
    assert {v.name: (v.in_flight, v.grouped) for v in p.views()}["b"] == (0, 0)
    assert policy.finished == ["r"]


class Refusing(PullFrom):
    """Finds no engine for any call."""

    def choose(self, request: RouteRequest, engines: object, now: float) -> Placement:
        raise NoEngineAvailable(request.model, "every engine is down")


def test_a_rejected_call_is_forgotten_whole() -> None:
    p = Planner(Refusing("b", None), profile_of=lambda _: PROFILE)  # type: ignore[arg-type]
    p.on_event(EngineJoined("b", healthy=True, models=frozenset({"m"})), 0.0)
    for i in range(3):
        p.admit(Call(RouteRequest(f"r{i}", "m")), 0.0)
    assert [type(a).__name__ for a in p.release(0.0)] == ["Reject"] * 3
    assert not p._order and not p._requests


def test_no_link_means_no_pull() -> None:
    p = pulling_planner(TransferLink())
    p.admit(long_call(), 0.0)
    (d,) = p.release(0.0)
    assert isinstance(d, Dispatch) and d.engine == "b" and d.cached_tokens == 0


def fanout_parent(p: Planner, shared: bool = True) -> None:
    p.on_event(WorkflowSubmitted("w", (
        TaskSpec("plan"), TaskSpec("r0", ("plan",)), TaskSpec("r1", ("plan",)),
        TaskSpec("r2", ("plan",)), TaskSpec("join", ("r0", "r1", "r2")))), 0.0)
    admit_plan(p, shared)


def admit_plan(p: Planner, shared: bool = True) -> None:
    """Workflow w's plan: a 256-token static prompt, a 3,840-token context, its question."""
    parts = [("static", 256), ("shared" if shared else "transient", 3840), ("transient", 64)]
    route = RouteRequest("w/plan", "m", prompt_tokens=4160, block_keys=tuple(range(260)),
                         max_tokens=128)
    p.admit(Call(route, hints=RequestHints(workflow="w", task="plan"),
                 segments=from_token_runs(parts, 16)), 0.0)


def kvgate_planner(link: TransferLink, name: str = "kvgate") -> Planner:
    ctx = PolicyContext(profiles={}, default_profile=PROFILE, block_size=16, link=link)
    p = make_planner(name, ctx, engine_block_size=lambda _: 16)
    for e in ("a", "b", "c", "d"):
        p.on_event(EngineJoined(e, healthy=True, models=frozenset({"m"})), 0.0)
    return p


def test_a_fanout_parent_prefetches_its_context_to_where_its_children_will_run() -> None:
    p = kvgate_planner(NAMED_LINKS["rdma"])
    fanout_parent(p)
    (d,) = p.release(0.0)
    assert isinstance(d, Dispatch)
    p.on_event(FirstToken("w/plan"), 0.5)
    moves = [a for a in p.release(0.5) if isinstance(a, Transfer)]
    assert moves and all(m.reason == "prefetch" and m.source == d.engine for m in moves)
    assert {m.destination for m in moves} <= {"a", "b", "c", "d"} - {d.engine}
    assert all(m.block_keys == tuple(range(259)) for m in moves)


def test_without_a_link_prefetch_warms_up_instead() -> None:
    p = kvgate_planner(TransferLink())
    fanout_parent(p)
    p.release(0.0)
    p.on_event(FirstToken("w/plan"), 0.5)
    warms = p.release(0.5)
    assert warms and all(isinstance(w, Warm) and w.reason == "prefetch" for w in warms)


@pytest.mark.parametrize("name,shared", [("kvgate-no-prefetch", True), ("kvgate", False)])
def test_no_prefetch_for_the_ablation_or_a_parent_without_shared_context(
        name: str, shared: bool) -> None:
    p = kvgate_planner(NAMED_LINKS["rdma"], name)
    fanout_parent(p, shared=shared)
    p.release(0.0)
    p.on_event(FirstToken("w/plan"), 0.5)
    assert p.release(0.5) == []


def sub_agent_fanout(p: Planner) -> None:
    """plan (agent kind A, a shared context) -> three sub-agents of kind B -> a join of kind A
    (it extends the plan's prompt, not the sub-agents')."""
    p.on_event(WorkflowSubmitted("w", (
        TaskSpec("plan", static_segment="A"),
        *(TaskSpec(f"r{i}", ("plan",), static_segment="B") for i in range(3)),
        TaskSpec("join", ("plan", "r0", "r1", "r2"), static_segment="A"))), 0.0)
    admit_plan(p)


def sub_agent(p: Planner, i: int, now: float) -> Dispatch:
    keys = (*range(5000, 5016), 6000 + i)
    route = RouteRequest(f"w/r{i}", "m", prompt_tokens=len(keys) * 16, block_keys=keys,
                         max_tokens=64)
    p.admit(Call(route, hints=RequestHints(workflow="w", task=f"r{i}", after=("plan",)),
                 segments=from_token_runs([("static", 256), ("transient", 16)], 16)), now)
    (d,) = [a for a in p.release(now) if isinstance(a, Dispatch)]
    return d


def test_sub_agents_of_another_kind_get_no_copy_of_the_parents_context() -> None:
    p = kvgate_planner(NAMED_LINKS["rdma"])
    sub_agent_fanout(p)
    p.release(0.0)
    p.on_event(FirstToken("w/plan"), 0.5)
    assert p.release(0.5) == []  # they do not read it


def test_a_join_extending_the_parent_gets_its_prompt_once_every_parent_answers() -> None:
    p = kvgate_planner(NAMED_LINKS["rdma"])
    sub_agent_fanout(p)
    (plan,) = p.release(0.0)
    assert isinstance(plan, Dispatch)
    p.on_event(FirstToken("w/plan"), 0.5)
    p.release(0.5)
    p.on_event(Finished("w/plan", 128), 2.0)
    for i in range(3):
        sub_agent(p, i, 2.0)
    p.on_event(FirstToken("w/r0"), 2.1)
    p.on_event(FirstToken("w/r1"), 2.1)
    assert [a for a in p.release(2.1) if isinstance(a, Transfer)] == []  # r2 still to answer
    p.on_event(FirstToken("w/r2"), 2.2)
    # The plan's engine learned from the plan's pace here (128 tokens in 1.5 s) that it decodes
    # slower than its profile says, so the join is planned on another engine: a copy.
    (m,) = [a for a in p.release(2.2) if isinstance(a, Transfer)]
    assert (m.reason, m.source, m.origin) == ("prefetch", plan.engine, "w/plan")
    assert m.block_keys == tuple(range(259)) and m.destination != plan.engine
    p.on_event(FirstToken("w/r2"), 2.3)  # once only
    assert [a for a in p.release(2.3) if isinstance(a, Transfer)] == []


def test_a_join_prefetch_goes_where_the_join_would_run_if_the_plan_engine_is_busy() -> None:
    """With the plan's engine loaded by other work, the join is planned elsewhere: a copy."""
    p = kvgate_planner(NAMED_LINKS["rdma"])
    sub_agent_fanout(p)
    (plan,) = p.release(0.0)
    assert isinstance(plan, Dispatch)
    p.on_event(FirstToken("w/plan"), 0.5)
    p.on_event(Finished("w/plan", 128), 2.0)
    for j in range(24):  # unrelated long calls pinned to the plan's engine
        route = RouteRequest(f"x{j}", "m", prompt_tokens=8000,
                             block_keys=tuple(range(10**5 + 600 * j, 10**5 + 600 * j + 500)),
                             max_tokens=512)
        others = frozenset({"a", "b", "c", "d"} - {plan.engine})
        p.admit(Call(route, exclude=others), 2.0)
    p.release(2.0)
    for i in range(3):
        sub_agent(p, i, 2.0)
        p.on_event(FirstToken(f"w/r{i}"), 2.1)
    (m,) = [a for a in p.release(2.1) if isinstance(a, Transfer)]
    assert (m.reason, m.source, m.destination != plan.engine) == ("prefetch", plan.engine, True)


def test_virtual_join_prefetch_copies_a_finished_parents_prompt() -> None:
    """The driver still knows a finished parent's prompt: the join's copy succeeds."""
    o = BenchOptions(workload="fanout", workload_args={
        "context_tokens": "16000", "width": "4", "worker_types": "1",
        "worker_static_tokens": "600"}, profile="h100x4-llama3-70b", rate=0.2,
        workflows=4, engines=4, link="rdma", progress=False)
    prepared = prepare(o)
    run = VirtualRun("kvgate", prepared.workflows, prepared.load, o.engine_profile(),
                     o.engines, prepared.builder, link=o.transfer_link())
    result = run.run()
    assert not any(w.failed or w.finished_s is None for w in result.workflows)
    stats = run.planner.moves.stats
    assert stats.started.get("transfer:prefetch", 0) > 0
    assert stats.done == sum(stats.started.values())  # none failed: origins were found
    reduces = [r for r in result.requests if r.task == "reduce"]
    assert all(r.cached_tokens >= 16000 for r in reduces)


# -- the virtual driver --------------------------------------------------------------------------


def long_fanout(link: str) -> tuple[BenchOptions, object]:
    o = BenchOptions(workload="fanout", workload_args={
        "context_tokens": "16000", "width": "4"}, profile="h100x4-llama3-70b", rate=0.2,
        workflows=4, engines=4, link=link, progress=False)
    return o, prepare(o)


def run_policy(policy: str, link: str) -> tuple[RunResult, Planner]:
    o, prepared = long_fanout(link)
    run = VirtualRun(policy, prepared.workflows, prepared.load,  # type: ignore[attr-defined]
                     o.engine_profile(), o.engines, prepared.builder,  # type: ignore[attr-defined]
                     link=o.transfer_link())
    result = run.run()
    assert not any(w.failed or w.finished_s is None for w in result.workflows)
    return result, run.planner


def test_virtual_prefetch_copies_the_context_children_then_find_local() -> None:
    result, planner = run_policy("kvgate", "rdma")
    assert planner.moves.stats.started.get("transfer:prefetch", 0) > 0
    assert planner.moves.stats.done == sum(planner.moves.stats.started.values())
    assert result.transferred_bytes > 0
    research = [r for r in result.requests if r.task.startswith("research")]
    assert research and all(r.cached_tokens >= 16000 for r in research)
    assert len({r.engine for r in research}) > 1


def test_virtual_ablation_and_baselines_prefetch_nothing() -> None:
    _, planner = run_policy("kvgate-no-prefetch", "rdma")
    assert "transfer:prefetch" not in planner.moves.stats.started
    result, planner = run_policy("dynamo-like", "rdma")
    assert result.transferred_bytes == 0  # a baseline whose peer moves no KV never moves any


def test_virtual_run_without_a_link_moves_nothing() -> None:
    result, _ = run_policy("kvgate", "none")
    assert result.transferred_bytes == 0


# -- replication ---------------------------------------------------------------------------------


STATIC_BLOCKS = PROFILE.max_num_batched_tokens // 16
"""A static segment of one full prefill step: the shortest replication copies."""


def segment_keys(system: int, blocks: int = STATIC_BLOCKS) -> tuple[int, ...]:
    return tuple(range(system * 1000, system * 1000 + blocks))


def static_call(rid: str, system: int, holders: tuple[str, ...] = ("a",),
                workflow: str | None = None, blocks: int = STATIC_BLOCKS) -> Call:
    """A call whose prompt opens with static segment `system` (`blocks` blocks), held by
    `holders`; task `rid` of `workflow` if one is named."""
    keys = (*segment_keys(system, blocks), 10**6 + int(rid[1:]))
    matches = {h: EngineMatch(h, blocks, blocks, float(blocks)) for h in holders}
    route = RouteRequest(rid, "m", prompt_tokens=len(keys) * 16, block_keys=keys,
                         matches=matches, max_tokens=16)
    hints = RequestHints(workflow=workflow, task=rid if workflow else None)
    return Call(route, hints=hints,
                segments=from_token_runs([("static", blocks * 16), ("transient", 16)], 16))


def replicas_started(p: Planner, now: float) -> list[Transfer]:
    return [a for a in p.release(now) if isinstance(a, Transfer) and a.reason == "replicate"]


def replicating_planner(link: TransferLink = NAMED_LINKS["rdma"]) -> Planner:
    """Placement always on engine a without pulls, so only replication moves KV."""
    p = Planner(PullFrom("a", None), profile_of=lambda _: PROFILE,  # type: ignore[arg-type]
                link=link, replicate=True)
    for e in ("a", "b", "c", "d"):
        p.on_event(EngineJoined(e, healthy=True, models=frozenset({"m"})), 0.0)
    return p


def test_a_segment_every_call_needs_is_copied_to_every_engine() -> None:
    p = replicating_planner()
    destinations = []
    for i in range(12):
        p.admit(static_call(f"r{i}", 1), float(i))
        moves = replicas_started(p, float(i))
        assert all(m.source == "a" and m.block_keys == segment_keys(1) for m in moves)
        destinations += [m.destination for m in moves]
    assert sorted(destinations) == ["b", "c", "d"]  # one copy each, none twice


def test_a_failed_replica_copy_is_not_tried_again_between_those_engines_at_once() -> None:
    # Each try runs the producer leg, whose exported blocks stay pinned for the lease.
    from planner.core import REPLICATE_BACKOFF_S

    p = replicating_planner()
    tries: list[tuple[str, str]] = []
    t = 0.0
    for i in range(40):
        t = 0.01 * i
        p.admit(static_call(f"r{i}", 1), t)
        for m in replicas_started(p, t):
            tries.append((m.source, m.destination))
            p.on_event(TransferFailed(m.move_id, "the consumer leg failed"), t)
    assert sorted(tries) == [("a", "b"), ("a", "c"), ("a", "d")]  # one try per pair
    # Once the pause is over, demand that still calls for copies gets them tried again.
    again: list[tuple[str, str]] = []
    for i in range(40):
        now = t + REPLICATE_BACKOFF_S + 0.01 * i
        p.admit(static_call(f"r{100 + i}", 1), now)
        again += [(m.source, m.destination) for m in replicas_started(p, now)]
    assert again and set(again) <= {("a", "b"), ("a", "c"), ("a", "d")}


def test_a_segment_shorter_than_a_prefill_step_is_not_copied() -> None:
    p = replicating_planner()
    assert STATIC_BLOCKS > 32  # still long enough to count as demand
    for i in range(12):
        p.admit(static_call(f"r{i}", 1, blocks=STATIC_BLOCKS - 1), float(i))
        assert replicas_started(p, float(i)) == []
    assert p.static_demand.replicas(segment_keys(1, STATIC_BLOCKS - 1), 4, 11.0) == 4


def test_two_segments_with_equal_demand_get_half_the_pool_each() -> None:
    p = replicating_planner()
    copies: dict[int, set[str]] = {1: {"a"}, 2: {"b"}}
    for i in range(16):
        system = 1 + i % 2
        p.admit(static_call(f"r{i}", system, holders=("a",) if system == 1 else ("b",)), i)
        for m in replicas_started(p, float(i)):
            copies[system].add(m.destination)
    assert len(copies[1]) == 2 and len(copies[2]) == 2


def test_few_calls_are_not_yet_a_share_of_demand() -> None:
    p = replicating_planner()
    for i in range(7):
        p.admit(static_call(f"r{i}", 1), float(i))
        assert replicas_started(p, float(i)) == []


def test_a_submitted_dag_announces_its_demand_before_its_calls_arrive() -> None:
    """Eight calls of segment 1 make it the whole demand so far; a workflow announcing twelve
    tasks of segment 2 makes segment 2 most of it: its first call already has it copied,
    where counting only admitted calls would keep it on its one holder."""
    def run(announce: bool) -> list[Transfer]:
        p = replicating_planner()
        for i in range(8):
            p.admit(static_call(f"r{i}", 1), float(i))
            p.release(float(i))
        tasks = tuple(TaskSpec(f"r{100 + j}", static_segment="system-2" if announce else "")
                      for j in range(12))
        p.on_event(WorkflowSubmitted("wf", tasks), 8.0)
        p.admit(static_call("r100", 2, holders=("b",), workflow="wf"), 8.0)
        return replicas_started(p, 8.0)

    moves = run(announce=True)
    assert [(m.source, m.block_keys) for m in moves] == [("b", segment_keys(2))]
    assert run(announce=False) == []


def test_only_tasks_that_do_not_extend_a_parent_of_their_kind_announce_demand() -> None:
    """A child opening with its parent's static segment is placed by the parent's context;
    sub-agents of another kind need their own segment where they will run."""
    p = replicating_planner()
    p.on_event(WorkflowSubmitted("wf", (
        TaskSpec("r1", static_segment="A"),
        *(TaskSpec(f"r{2 + j}", after=("r1",), static_segment="B") for j in range(4)),
        TaskSpec("r9", after=("r1", "r2"), static_segment="A"))), 0.0)
    p.admit(static_call("r1", 1, workflow="wf"), 0.0)
    p.admit(static_call("r2", 2, holders=("b",), workflow="wf"), 0.0)
    assert p.static_demand.expected(segment_keys(1)) == 0  # r9 extends r1
    assert p.static_demand.expected(segment_keys(2)) == 3
    p.on_event(WorkflowOver("wf"), 1.0)
    assert p.static_demand.expected(segment_keys(2)) == 0


def test_announced_demand_ends_with_its_calls_or_its_workflow() -> None:
    demand = StaticDemand()
    keys = segment_keys(2)
    demand.expect("wf", {"s": 3})
    demand.expect("wf2", {"s": 2})
    demand.admitted("wf", "s", keys)
    assert demand.expected(keys) == 4  # bound to its keys by the admitted call
    demand.forget("wf2")
    assert demand.expected(keys) == 2
    demand.admitted("wf", "s", keys)
    demand.admitted("wf", "s", keys)
    demand.admitted("wf", "s", keys)  # more calls than announced: nothing goes negative
    assert demand.expected(keys) == 0
    demand.observe(keys, 0.0)
    assert demand.replicas(keys, 4, 0.0) == 1  # one call seen, none ahead: not yet a share


def test_segments_no_call_asks_for_any_more_are_forgotten() -> None:
    # Every distinct static prompt (a personalised or dated system prompt) stayed named for
    # good: 80,000 finished workflows held 80,000 names.
    demand = StaticDemand(window_s=10.0)
    for i in range(200):
        keys = segment_keys(1000 + i)
        demand.expect(f"wf{i}", {f"s{i}": 2})
        demand.admitted(f"wf{i}", f"s{i}", keys)
        demand.observe(keys, float(i))
        demand.forget(f"wf{i}")  # its second call never came
    kept = segment_keys(5000)
    demand.expect("live", {"live": 3})
    demand.admitted("live", "live", kept)  # announced calls still to come: kept
    demand.observe(kept, 199.0)
    assert demand.replicas(segment_keys(1199), 4, 205.0) >= 1  # still in the window
    demand.replicas(kept, 4, 500.0)  # the window has passed every call
    assert len(demand._name_of) == 1 and demand.expected(kept) == 2


@pytest.mark.parametrize("name,link", [("kvgate-no-replicate", NAMED_LINKS["rdma"]),
                                       ("kvgate", TransferLink())])
def test_no_replication_for_the_ablation_or_without_a_link(name: str, link: TransferLink
                                                            ) -> None:
    p = kvgate_planner(link, name)
    for i in range(12):
        p.admit(static_call(f"r{i}", 1), float(i))
        assert replicas_started(p, float(i)) == []


def test_without_a_link_prefetch_plans_children_where_a_recompute_would_pay() -> None:
    """A 32k-token context on a 70B profile, its holder running only the parent: with a link
    the children are spread (a copy is cheap), without one a warm-up recomputes the context,
    so the plan keeps them with the holder rather than warming every engine up."""
    from planner.policies.kvgate import KvgatePolicy
    from planner.policy import EngineView

    big = get_profile("h100x4-llama3-70b")
    blocks = 2000
    parent = RouteRequest("p", "m", prompt_tokens=blocks * 16, block_keys=tuple(range(blocks)),
                          max_tokens=256, matches={"a": EngineMatch("a", blocks, blocks,
                                                                    float(blocks))})
    views = [EngineView(n, True, frozenset({"m"}), in_flight=1 if n == "a" else 0,
                        active_blocks=blocks if n == "a" else 0, block_size=16)
             for n in ("a", "b", "c", "d")]

    def plan(link: TransferLink) -> list[str]:
        policy = KvgatePolicy(PolicyContext(default_profile=big, link=link))
        return policy.plan_prefetch(parent, 4, views, 0.0, holder="a")

    assert set(plan(NAMED_LINKS["rdma"])) > {"a"}
    assert plan(parse_link("none")) == ["a"] * 4


def test_kvgate_moves_kv_ahead_of_need_only_and_kvgate_pulls_also_on_placement() -> None:
    """A 24k-token prompt held by a busy engine, an idle one beside it, an RDMA link: the
    `kvgate-pulls` variant pulls the prompt to the idle engine as it places the request;
    `kvgate` prices no pull (it queues behind the holder here) and moves KV only ahead of need
    (prefetch, replication)."""
    from planner.policy import EngineView

    big = get_profile("h100x4-llama3-70b")
    blocks = 1500
    request = RouteRequest("r", "m", prompt_tokens=blocks * 16, block_keys=tuple(range(blocks)),
                           max_tokens=64, matches={"a": EngineMatch("a", blocks, blocks,
                                                                    float(blocks))})
    views = [EngineView("a", True, frozenset({"m"}), in_flight=12, active_blocks=12 * blocks,
                        queued_prefill_tokens=6 * 8192, block_size=16),
             EngineView("b", True, frozenset({"m"}), block_size=16)]

    def placement(name: str) -> Placement:
        ctx = PolicyContext(default_profile=big, link=NAMED_LINKS["rdma"])
        return make_planner(name, ctx, engine_block_size=lambda _: 16).policy.choose(
            request, views, 0.0)

    pulled = placement("kvgate-pulls")
    assert (pulled.engine, pulled.pull) == ("b", Pull("a", blocks * 16 - 16, "pull"))
    plain = placement("kvgate")
    assert plain.pull is None and plain.cost is not None and plain.cost.transfer_s == 0.0


def test_a_move_past_its_deadline_is_not_offered_as_arriving() -> None:
    """A prefetch whose end is never reported (a hung transfer leg) is given up at its
    deadline: a call placed later does not wait for it, nor is booked as finding the prefix
    there (it was dispatched at once with the whole prefix counted as cached)."""
    p = kvgate_planner(NAMED_LINKS["rdma"])
    fanout_parent(p)
    (d,) = p.release(0.0)
    p.on_event(FirstToken("w/plan"), 0.5)
    moves = [a for a in p.release(0.5) if isinstance(a, Transfer)]
    record = p.moves.get(moves[0].move_id)
    assert record is not None
    late = record.deadline() + 5.0
    route = RouteRequest("w/r0", "m", prompt_tokens=4560,
                         block_keys=tuple(range(259)) + tuple(range(10**6, 10**6 + 26)),
                         matches={d.engine: EngineMatch(d.engine, 259, 259, 259.0)},
                         max_tokens=128)
    assert not p.moves.arriving(route.block_keys, late)
    p.admit(Call(route, hints=RequestHints(workflow="w", task="r0", after=("plan",))), late)
    sent = [a for a in p.release(late) if isinstance(a, Dispatch)]
    assert p.state("w/r0") is RequestState.DISPATCHED
    assert [(a.kv_move, a.cached_tokens) for a in sent if a.engine == moves[0].destination] \
        in ([], [(None, 0)])
