"""One behavioural suite for both workflow stores (memory and a real redis-server), plus what
only Redis does: two store objects (two replicas) see each other's workflows, events and cancels.
Hint-mode bookkeeping of `WorkflowService` runs on the memory store."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.config import WorkflowSettings
from gateway.workflow_store import (
    START,
    MemoryWorkflowStore,
    RedisWorkflowStore,
    WorkflowStore,
)
from gateway.workflows import (
    LoopbackExecutor,
    WorkflowNotCancellable,
    WorkflowService,
    task_record,
)


def fresh_namespace() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[WorkflowStore]:
    backend: WorkflowStore
    if request.param == "memory":
        backend = MemoryWorkflowStore()
    else:
        backend = RedisWorkflowStore.from_url(request.getfixturevalue("redis_url"),
                                              fresh_namespace())
    yield backend
    await backend.close()


def meta(wf_id: str = "wf-1", **changes: Any) -> dict[str, Any]:
    return {"id": wf_id, "source": "api", "model": "m", "tenant": None, "state": "running",
            "created_s": 1.0, "finished_s": None, "replica": "r1", **changes}


async def test_a_created_workflow_reads_back_as_one_snapshot(store: WorkflowStore) -> None:
    assert await store.create(meta(), {"a": task_record([]), "b": task_record(["a"])})
    snap = await store.get("wf-1")
    assert snap == {**meta(), "tasks": {"a": task_record([]), "b": task_record(["a"])}}


async def test_an_id_in_use_is_not_created_again(store: WorkflowStore) -> None:
    assert await store.create(meta(), {"a": task_record([])})
    assert not await store.create(meta(model="other"), {"z": task_record([])})
    snap = await store.get("wf-1")
    assert snap is not None and snap["model"] == "m" and list(snap["tasks"]) == ["a"]


async def test_an_unknown_workflow_reads_as_none(store: WorkflowStore) -> None:
    assert await store.get("nope") is None
    assert await store.head("nope") is None
    assert await store.events("nope") == []


async def test_a_workflows_head_is_its_own_fields_without_the_task_records(
        store: WorkflowStore) -> None:
    assert await store.create(meta(), {"a": task_record([])})
    assert await store.update("wf-1", workflow={**meta(), "state": "done"})
    assert await store.head("wf-1") == {**meta(), "state": "done"}


async def test_an_update_replaces_only_the_tasks_it_names(store: WorkflowStore) -> None:
    await store.create(meta(), {"a": task_record([]), "b": task_record(["a"])})
    done = {**task_record([]), "state": "done", "output": "hi"}
    await store.update("wf-1", workflow=meta(state="done"), tasks={"a": done})
    snap = await store.get("wf-1")
    assert snap is not None
    assert snap["state"] == "done"
    assert snap["tasks"] == {"a": done, "b": task_record(["a"])}


async def test_events_replay_from_the_start_and_after_an_id(store: WorkflowStore) -> None:
    await store.create(meta(), {})
    await store.update("wf-1", events=[{"n": 1}, {"n": 2}])
    await store.update("wf-1", events=[{"n": 3}])
    everything = await store.events("wf-1", START)
    assert [e for _, e in everything] == [{"n": 1}, {"n": 2}, {"n": 3}]
    after_first = await store.events("wf-1", everything[0][0])
    assert [e for _, e in after_first] == [{"n": 2}, {"n": 3}]
    assert await store.events("wf-1", everything[-1][0]) == []


async def test_a_waiting_reader_gets_an_event_appended_meanwhile(store: WorkflowStore) -> None:
    await store.create(meta(), {})
    await store.update("wf-1", events=[{"n": 1}])
    (first_id, _), = await store.events("wf-1")
    reader = asyncio.create_task(store.events("wf-1", first_id, wait_s=30))
    await asyncio.sleep(0.05)
    assert not reader.done()
    await store.update("wf-1", events=[{"n": 2}])
    assert [e for _, e in await asyncio.wait_for(reader, 30)] == [{"n": 2}]


async def test_a_quiet_wait_past_the_clients_read_timeout_is_no_error(redis_url: str) -> None:
    # redis-py reads with a 5 s timeout by default: a longer XREAD BLOCK tripped it, and the
    # gateway's /events ended every quiet stream after 5 s with "store unreachable".
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_url, socket_timeout=1.0)
    store = RedisWorkflowStore(client, fresh_namespace())
    try:
        await store.create(meta(), {})
        assert await store.events("wf-1", wait_s=2.5) == []
    finally:
        await client.aclose()


async def test_a_workflow_expires_after_its_ttl(store: WorkflowStore) -> None:
    await store.create(meta(), {"a": task_record([])})
    await store.update("wf-1", events=[{"n": 1}], ttl_s=0.1)
    for _ in range(200):
        if await store.get("wf-1") is None:
            break
        await asyncio.sleep(0.05)
    assert await store.get("wf-1") is None
    assert await store.events("wf-1") == []


async def test_a_cancel_request_reaches_the_listener(store: WorkflowStore) -> None:
    requests = store.cancel_requests()
    listening = asyncio.ensure_future(anext(requests))
    await asyncio.sleep(0.1)  # the Redis subscription is in place
    await store.request_cancel("wf-7")
    assert await asyncio.wait_for(listening, 30) == "wf-7"
    await requests.aclose()  # type: ignore[attr-defined]


async def test_a_cancel_request_stays_with_the_workflow(store: WorkflowStore) -> None:
    # A message alone reached no one when the workflow's replica had died or was between
    # subscriptions; the request is kept where a later driver reads it.
    assert await store.create(meta("wf-1"), {"a": task_record([])})
    assert await store.create(meta("wf-2"), {"a": task_record([])})
    await store.request_cancel("wf-2")
    await store.request_cancel("gone")  # no workflow: nothing is made of it
    assert await store.cancel_requested(["wf-1", "wf-2", "gone"]) == ["wf-2"]
    assert await store.get("gone") is None
    snap = await store.get("wf-2")
    assert snap is not None and snap["state"] == "running"  # the snapshot reads as before


# -- Redis: replicas share everything ---------------------------------------------------------


async def test_a_second_replica_reads_and_follows_a_workflow(redis_url: str) -> None:
    ns = fresh_namespace()
    a = RedisWorkflowStore.from_url(redis_url, ns)
    b = RedisWorkflowStore.from_url(redis_url, ns)
    try:
        await a.create(meta(), {"t": task_record([])})
        assert not await b.create(meta(), {})
        follower = asyncio.create_task(b.events("wf-1", START, wait_s=30))
        await a.update("wf-1", workflow=meta(state="done"), events=[{"type": "workflow"}])
        assert [e for _, e in await asyncio.wait_for(follower, 30)] == [{"type": "workflow"}]
        snap = await b.get("wf-1")
        assert snap is not None and snap["state"] == "done"
    finally:
        await a.close()
        await b.close()


async def test_a_cancel_asked_on_one_replica_reaches_another(redis_url: str) -> None:
    ns = fresh_namespace()
    runner = RedisWorkflowStore.from_url(redis_url, ns)
    other = RedisWorkflowStore.from_url(redis_url, ns)
    try:
        requests = runner.cancel_requests()
        listening = asyncio.ensure_future(anext(requests))
        await asyncio.sleep(0.1)
        await other.request_cancel("wf-9")
        assert await asyncio.wait_for(listening, 30) == "wf-9"
        await requests.aclose()  # type: ignore[attr-defined]
    finally:
        await runner.close()
        await other.close()


# -- hint mode ----------------------------------------------------------------------------------


@pytest.fixture
async def service() -> AsyncIterator[WorkflowService]:
    # The executor is never called: hint-mode calls are the client's own.
    svc = WorkflowService(WorkflowSettings(), MemoryWorkflowStore(),
                          LoopbackExecutor("http://127.0.0.1:9", 1.0, 1.0), replica="r1")
    yield svc
    await svc.stop()


async def test_hinted_calls_build_a_workflow_readable_like_any_other(
    service: WorkflowService,
) -> None:
    await service.hinted_task_started("agent-1", "plan", [], "req-1", "m", "acme")
    await service.hinted_task_dispatched("agent-1", "plan", "e1")
    running = await service.snapshot("agent-1")
    assert (running["source"], running["state"], running["tenant"]) == ("hints", "running",
                                                                        "acme")
    assert running["tasks"]["plan"]["state"] == "running"
    await service.hinted_task_finished("agent-1", "plan", prompt_tokens=100, output_tokens=7,
                                       cached_tokens=64, output="ok")
    await service.hinted_task_started("agent-1", "act", ["plan"], "req-2", "m")
    await service.hinted_task_dispatched("agent-1", "act", "e2")
    await service.hinted_task_finished("agent-1", "act", error="HTTP 500: engine died")
    snap = await service.snapshot("agent-1")
    assert snap["state"] == "failed"
    plan, act = snap["tasks"]["plan"], snap["tasks"]["act"]
    assert (plan["state"], plan["engine"], plan["cached_tokens"], plan["output"]) == (
        "done", "e1", 64, "ok")
    assert (act["state"], act["after"], act["engine"], act["error"]) == (
        "failed", ["plan"], "e2", "HTTP 500: engine died")
    assert snap["finished_s"] == act["finished_s"]
    states = [(e["task"], e["state"]) for _, e in await service.store.events("agent-1")]
    assert states == [("plan", "ready"), ("plan", "running"), ("plan", "done"),
                      ("act", "ready"), ("act", "running"), ("act", "failed")]


async def test_a_task_sent_again_while_in_flight_is_recorded_by_its_latest_call(
    service: WorkflowService,
) -> None:
    # A client retrying a call it gave up on, while the first is still at an engine; the
    # retry may even reuse the first call's request id once that call's handler is over.
    await service.hinted_task_started("agent-3", "plan", [], "req-a", "m", attempt="first")
    await service.hinted_task_dispatched("agent-3", "plan", "e1", attempt="first")
    await service.hinted_task_started("agent-3", "plan", [], "req-a", "m", attempt="retry")
    await service.hinted_task_dispatched("agent-3", "plan", "e2", attempt="retry")
    await service.hinted_first_token("agent-3", "plan", attempt="first")
    await service.hinted_task_finished("agent-3", "plan", output="stale", attempt="first")
    plan = (await service.snapshot("agent-3"))["tasks"]["plan"]
    assert (plan["state"], plan["engine"], plan["first_token_s"]) == ("running", "e2", None)
    await service.hinted_task_finished("agent-3", "plan", output="fresh", attempt="retry")
    plan = (await service.snapshot("agent-3"))["tasks"]["plan"]
    assert (plan["state"], plan["output"]) == ("done", "fresh")


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_a_long_hint_mode_workflow_keeps_its_latest_task_records(
        backend: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    import gateway.workflows as workflows

    monkeypatch.setattr(workflows, "MAX_HINT_TASKS", 3)
    store: WorkflowStore = (MemoryWorkflowStore() if backend == "memory" else
                            RedisWorkflowStore.from_url(request.getfixturevalue("redis_url"),
                                                        fresh_namespace()))
    svc = WorkflowService(WorkflowSettings(), store,
                          LoopbackExecutor("http://127.0.0.1:9", 1.0, 1.0), replica="r1")
    try:
        for i in range(5):
            await svc.hinted_task_started("long", f"t{i}", [f"t{i - 1}"] if i else [],
                                          f"r{i}", "m")
            await svc.hinted_task_finished("long", f"t{i}", output=f"answer {i}")
        await svc.hinted_task_started("long", "t4", ["t3"], "r5", "m")  # sent again: no drop
        snap = await svc.snapshot("long")
        assert sorted(snap["tasks"]) == ["t2", "t3", "t4"]
        assert not any(w == "long" and t in ("t0", "t1") for w, t in svc._hint_tasks)
    finally:
        await svc.stop()
        await store.close()


async def test_a_hint_workflow_cannot_be_cancelled_from_the_api(
    service: WorkflowService,
) -> None:
    await service.hinted_task_started("agent-2", "t", [], "r", "m")
    with pytest.raises(WorkflowNotCancellable, match="driven by its client"):
        await service.cancel("agent-2")


# -- listing recent workflows -------------------------------------------------------------------


async def test_recent_lists_the_newest_first_up_to_the_limit(store: WorkflowStore) -> None:
    for i, created in enumerate([5.0, 1.0, 9.0, 3.0]):
        await store.create(meta(f"wf-{i}", created_s=created), {"a": task_record([])})
    listed = await store.recent(3)
    assert [w["id"] for w in listed] == ["wf-2", "wf-0", "wf-3"]
    assert [w["id"] for w in await store.recent(10)] == ["wf-2", "wf-0", "wf-3", "wf-1"]


async def test_recent_with_a_filter_reads_on_until_the_limit_is_found(
        store: WorkflowStore) -> None:
    # One tenant's older workflows behind forty newer ones of another: all found.
    for i in range(40):
        await store.create(meta(f"busy-{i}", tenant="busy", created_s=100.0 + i),
                           {"a": task_record([])})
    for i in range(3):
        await store.create(meta(f"quiet-{i}", tenant="quiet", created_s=float(i)),
                           {"a": task_record([])})
    listed = await store.recent(2, lambda w: w.get("tenant") == "quiet")
    assert [w["id"] for w in listed] == ["quiet-2", "quiet-1"]
    assert len(await store.recent(50, lambda w: w.get("tenant") == "quiet")) == 3


async def test_recent_shows_current_task_records_without_their_outputs(
        store: WorkflowStore) -> None:
    await store.create(meta(), {"a": task_record([]), "b": task_record(["a"])})
    done = {**task_record([]), "state": "done", "engine": "e1", "output": "a long answer"}
    await store.update("wf-1", workflow=meta(state="done", finished_s=2.0), tasks={"a": done})
    (listed,) = await store.recent(5)
    assert listed["state"] == "done" and listed["finished_s"] == 2.0
    assert listed["tasks"]["a"] == {k: v for k, v in done.items() if k != "output"}
    assert listed["tasks"]["b"]["state"] == "blocked"
    assert all("output" not in t for t in listed["tasks"].values())


async def test_recent_leaves_out_expired_workflows(store: WorkflowStore) -> None:
    await store.create(meta("old", created_s=1.0), {})
    await store.create(meta("new", created_s=2.0), {})
    await store.update("old", events=[{"n": 1}], ttl_s=0.1)
    for _ in range(200):
        if await store.get("old") is None:
            break
        await asyncio.sleep(0.05)
    assert [w["id"] for w in await store.recent(10)] == ["new"]


async def test_the_redis_index_drops_expired_ids_and_is_shared_by_replicas(
        redis_url: str) -> None:
    ns = fresh_namespace()
    a = RedisWorkflowStore.from_url(redis_url, ns)
    b = RedisWorkflowStore.from_url(redis_url, ns)
    try:
        for i in range(40):
            await a.create(meta(f"wf-{i:02d}", created_s=float(i)), {})
        # Every other one expires; a listing pages past the gaps and removes them.
        for i in range(0, 40, 2):
            await a.update(f"wf-{i:02d}", ttl_s=0.05)
        await asyncio.sleep(0.3)
        listed = await b.recent(15)
        assert [w["id"] for w in listed] == [f"wf-{i:02d}" for i in range(39, 9, -2)]
        assert [w["id"] for w in await b.recent(100)] == [f"wf-{i:02d}"
                                                          for i in range(39, 0, -2)]
        assert await a.r.zcard(f"{ns}:wf:index") == 20
    finally:
        await a.close()
        await b.close()


async def test_the_redis_index_keeps_only_the_newest_ids(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gateway.workflow_store.INDEX_LIMIT", 5)
    store = RedisWorkflowStore.from_url(redis_url, fresh_namespace())
    try:
        for i in range(8):
            await store.create(meta(f"wf-{i}", created_s=float(i)), {})
        assert [w["id"] for w in await store.recent(50)] == [f"wf-{i}" for i in range(7, 2, -1)]
        # Snapshots past the bound stay readable by id.
        assert await store.get("wf-0") is not None
    finally:
        await store.close()


async def test_hint_mode_times_are_when_the_proxy_saw_them(service: WorkflowService) -> None:
    # The proxy's writes of one call queue behind each other (a slow store): each carries the
    # time its event happened, not the time its write ran.
    await service.hinted_task_started("agent-5", "plan", [], "req-5", "m")
    await service.hinted_task_dispatched("agent-5", "plan", "e1", at=100.0)
    await service.hinted_first_token("agent-5", "plan", at=100.25)
    await service.hinted_task_finished("agent-5", "plan", prompt_tokens=10, output_tokens=2,
                                       output="ok", at=101.5)
    task = (await service.snapshot("agent-5"))["tasks"]["plan"]
    assert (task["dispatched_s"], task["first_token_s"], task["finished_s"]) == (
        100.0, 100.25, 101.5)


async def test_a_listing_shows_no_cache_hits_where_no_engine_reported_them(
        service: WorkflowService) -> None:
    # vLLM reports cached tokens only with --enable-prompt-tokens-details: unknown is not 0 %.
    await service.hinted_task_started("agent-9", "plan", [], "req-9", "m")
    await service.hinted_task_finished("agent-9", "plan", prompt_tokens=100, output_tokens=7,
                                       cached_tokens=None, output="ok")
    (listed,) = await service.recent(10)
    assert (listed["prompt_tokens"], listed["cached_tokens"]) == (100, None)


async def test_a_listing_summarises_each_workflow_and_derives_hint_mode_state(
        service: WorkflowService) -> None:
    await service.hinted_task_started("agent-2", "plan", [], "req-1", "m")
    await service.hinted_task_dispatched("agent-2", "plan", "e1")
    await service.hinted_task_finished("agent-2", "plan", prompt_tokens=100, output_tokens=7,
                                       cached_tokens=64, output="ok")
    await service.hinted_task_started("agent-2", "act", ["plan"], "req-2", "m")
    await service.hinted_task_dispatched("agent-2", "act", "e2")
    (running,) = await service.recent(10)
    assert running["state"] == "running" and running["finished_s"] is None
    assert (running["id"], running["source"], running["model"]) == ("agent-2", "hints", "m")
    assert (running["tasks"], running["task_states"]) == (2, {"done": 1, "running": 1})
    assert running["engines"] == ["e1", "e2"]
    assert (running["prompt_tokens"], running["cached_tokens"]) == (100, 64)
    await service.hinted_task_finished("agent-2", "act", prompt_tokens=50, cached_tokens=0,
                                       output="fine")
    (done,) = await service.recent(10)
    assert done["state"] == "done" and done["finished_s"] is not None
    assert done["task_states"] == {"done": 2} and done["prompt_tokens"] == 150


# -- leases: which replica drives a workflow --------------------------------------------------


async def test_a_lease_is_held_by_one_replica_until_it_lapses_or_is_given_up(
    store: WorkflowStore,
) -> None:
    await store.create(meta(), {"a": task_record([])})
    await store.save_resume("wf-1", {"spec": {"tasks": []}, "headers": {}})
    assert await store.resume_document("wf-1") == {"spec": {"tasks": []}, "headers": {}}
    assert await store.orphans() == ["wf-1"]
    assert await store.claim("wf-1", "r1/x", 0.3)
    assert await store.claim("wf-1", "r1/x", 0.3)  # its own: renewed
    assert not await store.claim("wf-1", "r2/y", 0.3)
    assert await store.orphans() == []
    assert await store.renew("r1/x", ["wf-1"], 0.3) == []
    assert await store.renew("r2/y", ["wf-1"], 0.3) == ["wf-1"]
    await asyncio.sleep(0.45)  # lapsed
    assert await store.orphans() == ["wf-1"]
    assert await store.claim("wf-1", "r2/y", 5.0)
    assert await store.renew("r1/x", ["wf-1"], 5.0) == ["wf-1"]
    await store.release("r1/x", ["wf-1"])  # not its lease: nothing happens
    assert await store.orphans() == []
    await store.release("r2/y", ["wf-1"])
    assert await store.orphans() == ["wf-1"]


async def test_a_workflow_over_is_no_longer_listed_as_running(store: WorkflowStore) -> None:
    await store.create(meta(), {"a": task_record([])})
    await store.save_resume("wf-1", {"spec": {}})
    await store.update("wf-1", workflow=meta(state="done"), ttl_s=60)
    assert await store.orphans() == []
    assert await store.resume_document("wf-1") is None


async def test_a_release_is_announced_to_the_other_replicas(store: WorkflowStore) -> None:
    await store.create(meta(), {"a": task_record([])})
    await store.save_resume("wf-1", {"spec": {}})
    assert await store.claim("wf-1", "r1/x", 5.0)
    heard: list[str] = []

    async def listen() -> None:
        async for wf in store.handoffs():
            heard.append(wf)
            return

    listener = asyncio.create_task(listen())
    await asyncio.sleep(0.1)  # subscribed
    await store.release("r1/x", ["wf-1"])
    await asyncio.wait_for(listener, 5.0)
    assert heard == ["wf-1"]


async def test_a_write_fenced_by_a_lease_lands_only_while_the_lease_is_held(
    store: WorkflowStore,
) -> None:
    await store.create(meta(), {"a": task_record([])})
    await store.save_resume("wf-1", {"spec": {}})
    assert await store.claim("wf-1", "r1/x", 5.0)
    ran = {**task_record([]), "state": "running"}
    assert await store.update("wf-1", tasks={"a": ran}, events=[{"n": 1}], owner="r1/x")
    assert not await store.update("wf-1", tasks={"a": {**ran, "state": "done"}},
                                  events=[{"n": 2}], owner="r2/y")
    snap = await store.get("wf-1")
    assert snap is not None and snap["tasks"]["a"]["state"] == "running"
    assert [e for _, e in await store.events("wf-1")] == [{"n": 1}]
    # The holder's last write ends the workflow: lease, running entry and resume document go.
    assert await store.update("wf-1", workflow=meta(state="done"), events=[{"n": 3}],
                              ttl_s=60, owner="r1/x")
    assert await store.orphans() == [] and await store.resume_document("wf-1") is None
    assert await store.claim("wf-1", "r2/y", 5.0)  # nobody holds it any more


async def test_a_long_stream_keeps_its_latest_events_and_their_ids(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import gateway.workflow_store as ws

    monkeypatch.setattr(ws, "MAX_EVENTS", 5)
    store = ws.MemoryWorkflowStore()
    await store.create(meta("hints-1"), {})
    for i in range(8):
        await store.update("hints-1", events=[{"type": "task", "n": i}])
    events = await store.events("hints-1")
    assert [(eid, ev["n"]) for eid, ev in events] == [
        ("4", 3), ("5", 4), ("6", 5), ("7", 6), ("8", 7)]
    assert [eid for eid, _ in await store.events("hints-1", "6")] == ["7", "8"]
    assert [eid for eid, _ in await store.events("hints-1", "1")] == ["4", "5", "6", "7", "8"]


async def test_a_replicas_heartbeat_says_it_is_alive_until_it_runs_out(
        store: WorkflowStore) -> None:
    assert await store.alive(["a/1", "b/2"]) == set()
    await store.heartbeat("a/1", 0.3)
    await store.heartbeat("b/2", 30.0)
    assert await store.alive(["a/1", "b/2", "c/3"]) == {"a/1", "b/2"}
    await asyncio.sleep(0.5)
    assert await store.alive(["a/1", "b/2"]) == {"b/2"}
    assert await store.alive([]) == set()


def test_a_hint_mode_workflow_reads_as_its_latest_call_ended() -> None:
    from gateway.workflows import hint_state

    def rec(state: str, finished: float) -> dict[str, Any]:
        return {**task_record([]), "state": state, "finished_s": finished}

    snap = {"id": "w", "source": "hints", "tasks": {"a": rec("done", 1.0)}}
    assert hint_state(snap)["state"] == "done"
    snap["tasks"]["b"] = rec("failed", 2.0)
    assert hint_state(snap)["state"] == "failed"
    # The agent went on after the failed call: recovered, as its latest call says.
    snap["tasks"]["c"] = rec("done", 3.0)
    assert hint_state(snap)["state"] == "done" and hint_state(snap)["finished_s"] == 3.0


def test_an_answer_the_engine_aborted_is_a_failed_task_not_its_output() -> None:
    from gateway.workflows import TaskOutcome

    # vLLM ends an aborted stream with finish_reason "abort", then [DONE]: its partial text
    # used to be the task's output, spliced into its children's prompts.
    def answer(reason: str) -> TaskOutcome:
        return TaskOutcome(200, response={"choices": [{
            "message": {"role": "assistant", "content": "The answer is"},
            "finish_reason": reason}]})

    assert answer("stop").ok and answer("length").ok
    assert not answer("abort").ok and not answer("error").ok
    assert answer("abort").finish_reason == "abort"


class _NoExecutor:
    async def execute(self, body: Any, headers: Any) -> Any:
        raise RuntimeError("no task runs here")


async def test_a_stopping_replicas_open_hint_calls_are_not_lost_and_a_dead_ones_come_first(
        redis_url: str) -> None:
    # A replica that stops still answers its calls in flight (aiohttp waits for them): its
    # heartbeat went with its leases, and another replica read them as lost meanwhile. And a
    # lost call's end was when it was read, so it outranked the agent's later calls.
    ns = fresh_namespace()
    lease = 0.6
    settings = WorkflowSettings(store="redis", redis_url=redis_url, lease_s=lease)

    def service(name: str) -> WorkflowService:
        return WorkflowService(settings, RedisWorkflowStore.from_url(redis_url, ns),
                               _NoExecutor(), replica=name)  # type: ignore[arg-type]

    a, b, c = service("a"), service("b"), service("c")
    for s in (a, b, c):
        await s.start()
    try:
        await a.hinted_task_started("agent1", "t1", [], "rid1", "m", attempt="x1")
        await a.hinted_task_dispatched("agent1", "t1", "e0", attempt="x1")
        await a.stop_runs()  # the server's on_shutdown: its calls in flight still run
        await asyncio.sleep(lease + 0.3)
        assert (await b.snapshot("agent1"))["tasks"]["t1"]["state"] == "running"
        await a.hinted_task_finished("agent1", "t1", output="ok", output_tokens=5,
                                     attempt="x1")
        assert (await b.snapshot("agent1"))["state"] == "done"
        # c dies with t1 of agent2 open; the agent goes on through b, and t2 succeeds.
        await c.hinted_task_started("agent2", "t1", [], "r1", "m", attempt="y1")
        await c.hinted_task_dispatched("agent2", "t1", "e0", attempt="y1")
        assert c._heart is not None
        c._heart.cancel()
        await asyncio.sleep(lease + 0.3)
        await b.hinted_task_started("agent2", "t2", ["t1"], "r2", "m", attempt="y2")
        await b.hinted_task_finished("agent2", "t2", output="ok", attempt="y2")
        snap = await b.snapshot("agent2")
        assert snap["tasks"]["t1"]["state"] == "failed"
        assert snap["state"] == "done"  # its latest call, t2, succeeded
    finally:
        for s in (a, b, c):
            await s.stop()
