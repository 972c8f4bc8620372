"""A workflow outlives the replica that runs it: real gateway processes sharing one real
redis-server, in front of real simulated engines. A replica that dies (SIGKILL) or stops
(SIGTERM, as in a rolling deploy) leaves its workflows to another replica, which goes on from
the tasks already done; nothing a finished task produced is computed again."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import WorkflowSettings
from gateway.workflow_store import MemoryWorkflowStore, RedisWorkflowStore
from gateway.workflows import (
    MAX_RESUMES,
    TaskOutcome,
    WorkflowNotCancellable,
    WorkflowService,
    WorkflowStoreUnavailable,
    task_record,
)
from kvgate.procs import Child, free_port, spawn, start_sim, wait_healthy
from planner.hints import TASK_HEADER
from tests.conftest import MODEL
from tests.test_workflow_api import call, engine_figures, read, sse, submit, wait_for

LEASE_S = 1.5


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("workflow-takeover")


@pytest.fixture(scope="module")
def engines(logs: Path) -> Iterator[list[Child]]:
    children = [start_sim(f"takeover-sim-{i}", logs, ["--model", MODEL, "--seed", str(i)])
                for i in range(2)]
    yield children
    for c in children:
        c.stop()



def start_replica(name: str, engines: list[Child], redis_url: str, logs: Path,
                  lease_s: float = LEASE_S) -> Child:
    port = free_port()
    config = {"host": "127.0.0.1", "port": port, "policy": "least-loaded",
              "engines": [{"url": e.url} for e in engines],
              "workflows": {"store": "redis", "redis_url": redis_url, "replica": name,
                            "lease_s": lease_s}}
    path = logs / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    child = spawn(name, ["serve", "--config", str(path)], f"http://127.0.0.1:{port}", logs)
    wait_healthy(child)
    return child


@contextlib.contextmanager
def two_replicas(engines: list[Child], redis_url: str, logs: Path,
                 lease_s: float = LEASE_S) -> Iterator[tuple[Child, Child]]:
    """Replicas A and B sharing the store, both stopped after the block."""
    a = start_replica("replica-a", engines, redis_url, logs, lease_s=lease_s)
    b = start_replica("replica-b", engines, redis_url, logs, lease_s=lease_s)
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()


def chain() -> dict[str, Any]:
    """first (quick) -> slow (long enough to be cut off) -> last, which reads both."""
    return {"id": "chain", "model": MODEL, "tasks": [
        {"id": "first", "output_tokens": 8,
         "messages": [{"role": "user", "content": "Name a topic."}]},
        {"id": "slow", "after": ["first"], "output_tokens": 600,
         "messages": [{"role": "user", "content": "Write about it at length."},
                      {"output_of": "first", "role": "user"}]},
        {"id": "last", "after": ["slow"], "output_tokens": 8,
         "messages": [{"output_of": "first", "role": "user"},
                      {"output_of": "slow", "role": "user"}]},
    ]}


def running_on_engines(engines: list[Child]) -> float:
    return sum(engine_figures(e)["running"] for e in engines)


def cut_off_mid_workflow(a: Child, b: Child, engines: list[Child], crash: bool
                         ) -> tuple[str, dict[str, Any]]:
    """Submit the chain to A, let `first` finish and `slow` start, then kill or stop A;
    the snapshot B reads at that moment."""
    wf = submit(a, chain())["id"]
    wait_for(lambda: read(b, wf)["tasks"]["slow"]["state"] == "running")
    before = read(b, wf)
    assert before["tasks"]["first"]["state"] == "done"
    if crash:
        a.kill()
    else:
        a.stop()
    return wf, before


def orphaned(engines: list[Child], redis_url: str, logs: Path) -> str:
    """A workflow whose replica died (SIGKILL) while its `slow` task ran, and no other replica."""
    a = start_replica("replica-a", engines, redis_url, logs)
    try:
        wf = str(submit(a, chain())["id"])
        wait_for(lambda: read(a, wf)["tasks"]["slow"]["state"] == "running")
    finally:
        a.kill()
    return wf


def assert_finished_by(b: Child, wf: str, before: dict[str, Any]) -> dict[str, Any]:
    wait_for(lambda: read(b, wf)["state"] != "running", timeout_s=90)
    snap = read(b, wf)
    assert snap["state"] == "done", snap
    assert snap["replica"] == "replica-b" and snap["resumed"] == 1
    tasks = snap["tasks"]
    assert {t: r["state"] for t, r in tasks.items()} == {t: "done" for t in tasks}
    # The task done before the cut was not run again: same output, same timings.
    assert tasks["first"] == before["tasks"]["first"]
    # The cut-off task ran again from the start, on B's watch, after the cut.
    assert tasks["slow"]["dispatched_s"] > before["tasks"]["slow"]["dispatched_s"]
    assert tasks["slow"]["output_tokens"] == 600
    # Its event stream, read from B, ends with the workflow's final event.
    events = sse(f"{b.url}/v1/workflows/{wf}/events")
    assert events[-1]["type"] == "workflow" and events[-1]["state"] == "done"
    return snap


def test_a_crashed_replicas_workflow_is_finished_by_another_from_the_tasks_done(
    engines: list[Child], redis_url: str, logs: Path,
) -> None:
    with two_replicas(engines, redis_url, logs) as (a, b):
        wf, before = cut_off_mid_workflow(a, b, engines, crash=True)
        # B goes on once A's lease has lapsed; the engine aborted A's request meanwhile.
        assert_finished_by(b, wf, before)
        wait_for(lambda: running_on_engines(engines) == 0)


def test_a_stopping_replica_hands_its_workflow_over_at_once(
    engines: list[Child], redis_url: str, logs: Path,
) -> None:
    # A lease far longer than the test: B can only have gone on because A handed it over.
    with two_replicas(engines, redis_url, logs, lease_s=120.0) as (a, b):
        wf, before = cut_off_mid_workflow(a, b, engines, crash=False)
        assert a.proc.returncode == 0, a.log_tail()
        wait_for(lambda: read(b, wf)["replica"] == "replica-b", timeout_s=30)
        assert_finished_by(b, wf, before)


def test_a_stopping_replica_ends_its_event_streams_and_they_resume_on_another(
    engines: list[Child], redis_url: str, logs: Path,
) -> None:
    import threading
    import urllib.request

    # An open stream (an SDK's `wait`, a timeline page) used to keep the stopping replica up
    # for two minutes: aiohttp's shutdown timeout, twice, then a SIGKILL in a rolling deploy.
    with two_replicas(engines, redis_url, logs, lease_s=120.0) as (a, b):
        spec = chain()
        spec["tasks"][2]["think_time_s"] = 300  # the workflow outlasts the test
        wf = submit(a, spec)["id"]
        wait_for(lambda: read(b, wf)["tasks"]["slow"]["state"] == "running")
        seen: list[tuple[str, dict[str, Any]]] = []
        ended = threading.Event()

        def follow() -> None:
            with urllib.request.urlopen(f"{a.url}/v1/workflows/{wf}/events", timeout=300) as r:
                event_id = ""
                for line in r:
                    if line.startswith(b"id: "):
                        event_id = line[4:].decode().strip()
                    elif line.startswith(b"data: "):
                        seen.append((event_id, json.loads(line[6:])))
            ended.set()

        threading.Thread(target=follow, daemon=True).start()
        wait_for(lambda: len(seen) > 0)
        started = time.monotonic()
        a.stop(timeout=60)
        assert time.monotonic() - started < 15, a.log_tail()
        assert a.proc.returncode == 0, a.log_tail()
        assert ended.wait(10)
        # Ended without the workflow's final event: it goes on at B, where the client resumes.
        assert all(e["type"] != "workflow" for _, e in seen)
        wait_for(lambda: read(b, wf)["replica"] == "replica-b", timeout_s=30)
        assert call("DELETE", f"{b.url}/v1/workflows/{wf}")[0] == 200
        request = urllib.request.Request(f"{b.url}/v1/workflows/{wf}/events",
                                         headers={"Last-Event-ID": seen[-1][0]})
        with urllib.request.urlopen(request, timeout=60) as r:
            rest = [json.loads(line[6:]) for line in r if line.startswith(b"data: ")]
        assert rest[-1]["type"] == "workflow" and rest[-1]["state"] == "cancelled"


def test_a_hint_mode_call_its_replica_died_with_is_failed_and_the_next_one_counts(
    engines: list[Child], redis_url: str, logs: Path,
) -> None:
    import threading

    # Nothing else would ever end such a call's record: its workflow read `running` until it
    # expired (an hour by default), and a client's `wait` with it.
    wf = f"agent-{uuid.uuid4().hex[:8]}"

    def ask(gw: Child, task: str, tokens: int) -> None:
        with contextlib.suppress(Exception):
            call("POST", f"{gw.url}/v1/chat/completions", {
                "model": MODEL, "max_tokens": tokens, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Plan the trip."}]},
                headers={"X-KVGate-Workflow": wf, "X-KVGate-Task": task})

    with two_replicas(engines, redis_url, logs) as (a, b):
        ask(a, "first", 2)
        threading.Thread(target=ask, args=(a, "long", 100_000), daemon=True).start()
        wait_for(lambda: read(b, wf)["tasks"].get("long", {}).get("state") == "running")
        a.kill()
        wait_for(lambda: read(b, wf)["state"] != "running", timeout_s=4 * LEASE_S + 10)
        snap = read(b, wf)
        assert snap["state"] == "failed"
        long = snap["tasks"]["long"]
        assert long["state"] == "failed" and "stopped before it was answered" in long["error"]
        # Written so: a reader that never checks (an export from Redis) sees it too.
        events = sse_until(f"{b.url}/v1/workflows/{wf}/events", "long", "failed")
        assert events
        # The agent goes on: its workflow is done again once its next call is.
        ask(b, "retry", 2)
        assert read(b, wf)["state"] == "done"


def sse_until(url: str, task: str, state: str) -> list[dict[str, Any]]:
    """A hint-mode workflow's events up to `task`'s event with `state` (its stream never
    ends by itself)."""
    import urllib.request

    seen = []
    with urllib.request.urlopen(url, timeout=30) as r:
        for line in r:
            if line.startswith(b"data: "):
                event = json.loads(line[6:])
                seen.append(event)
                if event.get("task") == task and event.get("state") == state:
                    return seen
    return []


def test_a_workflow_with_no_replica_left_waits_for_the_next_one(
    engines: list[Child], redis_url: str, logs: Path,
) -> None:
    wf = orphaned(engines, redis_url, logs)
    time.sleep(2 * LEASE_S)
    b = start_replica("replica-b", engines, redis_url, logs)
    try:
        wait_for(lambda: read(b, wf)["state"] == "done", timeout_s=90)
        assert read(b, wf)["tasks"]["first"]["state"] == "done"
    finally:
        b.stop()


def test_deleting_a_workflow_whose_replica_died_cancels_it_at_once(
    engines: list[Child], redis_url: str, logs: Path,
) -> None:
    wf = orphaned(engines, redis_url, logs)
    time.sleep(1.5 * LEASE_S)
    # No replica runs it now; one that starts would take it over, unless it is cancelled.
    # Its first look for such workflows comes a third of its (long) lease after it starts.
    c = start_replica("replica-c", engines, redis_url, logs, lease_s=120.0)
    try:
        status, _, snap = call("DELETE", f"{c.url}/v1/workflows/{wf}")
        assert status == 200, snap
        assert snap["state"] == "cancelled"
        assert {t: r["state"] for t, r in snap["tasks"].items()} == {
            "first": "done", "slow": "cancelled", "last": "cancelled"}
        status, _, again = call("DELETE", f"{c.url}/v1/workflows/{wf}")
        assert status == 409, again
    finally:
        c.stop()


# -- going on from a snapshot (in process, the memory store) --------------------------------


class Recorder:
    """An executor that answers every task at once and keeps the bodies it was sent."""

    def __init__(self) -> None:
        self.bodies: dict[str, dict[str, Any]] = {}

    async def execute(self, body: dict[str, Any], headers: Mapping[str, str]) -> TaskOutcome:
        task = headers[TASK_HEADER]
        self.bodies[task] = body
        return TaskOutcome(200, {"choices": [{"message": {"content": f"<{task} answer>"}}],
                                 "usage": {"prompt_tokens": 5, "completion_tokens": 3}})


async def left_behind(store: MemoryWorkflowStore, tasks: dict[str, dict[str, Any]],
                      **workflow: Any) -> str:
    """A workflow as a replica that died left it in the store."""
    spec = chain()
    wf = "chain-left"
    doc = {"id": wf, "source": "api", "model": MODEL, "tenant": None, "state": "running",
           "created_s": 1.0, "finished_s": None, "replica": "gone", **workflow}
    records = {t["id"]: task_record(t.get("after", [])) for t in spec["tasks"]}
    for t, fields in tasks.items():
        records[t].update(fields)
    await store.create(doc, records)
    await store.save_resume(wf, {"spec": spec, "headers": {"authorization": "Bearer k"}})
    return wf


async def resumed(store: MemoryWorkflowStore, executor: Recorder, wf: str) -> dict[str, Any]:
    service = WorkflowService(WorkflowSettings(), store, executor, replica="here")
    try:
        assert await store.claim(wf, service.instance, 10.0)
        await service.resume(wf)
        for _ in range(200):
            snap = await service.snapshot(wf)
            if snap["state"] != "running":
                return snap
            await asyncio.sleep(0.01)
        raise AssertionError("the workflow did not end")
    finally:
        await service.stop()


async def test_going_on_runs_only_what_was_not_done_with_the_outputs_recorded() -> None:
    store, executor = MemoryWorkflowStore(), Recorder()
    first = {"state": "done", "output": "QUANTUM CATS", "finished_s": 2.0, "engine": "e1"}
    wf = await left_behind(store, {"first": first,
                                   "slow": {"state": "running", "engine": "e2"}})
    snap = await resumed(store, executor, wf)
    assert snap["state"] == "done" and snap["replica"] == "here" and snap["resumed"] == 1
    assert sorted(executor.bodies) == ["last", "slow"]  # `first` is not run again
    assert snap["tasks"]["first"] == {**task_record([]), **first}
    # The outputs recorded before the takeover reach the tasks that read them.
    assert "QUANTUM CATS" in json.dumps(executor.bodies["slow"]["messages"])
    assert "<slow answer>" in json.dumps(executor.bodies["last"]["messages"])
    assert snap["tasks"]["slow"]["engine"] is None  # the dead replica's attempt is gone


async def test_a_workflow_taken_over_too_often_fails_naming_why() -> None:
    store, executor = MemoryWorkflowStore(), Recorder()
    wf = await left_behind(store, {}, resumed=MAX_RESUMES)
    snap = await resumed(store, executor, wf)
    assert snap["state"] == "failed" and executor.bodies == {}
    assert f"taken over {MAX_RESUMES} times" in snap["error"]
    assert {r["state"] for r in snap["tasks"].values()} == {"failed"}


async def test_hand_offs_of_replicas_that_stopped_on_purpose_do_not_count_as_losses() -> None:
    # A rolling deploy hands a long workflow over at each step: seven steps failed it.
    store, executor = MemoryWorkflowStore(), Recorder()
    wf = await left_behind(store, {}, resumed=MAX_RESUMES + 2, handed_off=MAX_RESUMES + 1)
    snap = await resumed(store, executor, wf)
    assert snap["state"] == "done" and snap["resumed"] == MAX_RESUMES + 3


async def test_a_replica_that_stops_counts_its_hand_off(redis_url: str) -> None:
    store = RedisWorkflowStore.from_url(redis_url, f"t{uuid.uuid4().hex[:12]}")
    gate = Gate("slow")
    service = WorkflowService(WorkflowSettings(store="redis", redis_url=redis_url), store, gate,
                              replica="a")
    try:
        wf = (await service.submit(chain()))["id"]
        await asyncio.wait_for(gate.reached.wait(), 10)  # a task is in flight
        await service.stop_runs()
        snap = await store.get(wf)
        assert snap is not None and snap["state"] == "running" and snap["handed_off"] == 1
        assert await store.orphans() == [wf]  # given up, for another replica to take
    finally:
        gate.release.set()
        await service.stop()


async def test_a_cancel_asked_for_while_no_replica_drove_the_workflow_ends_it_on_takeover(
) -> None:
    # The DELETE was answered 202 and its message went to no one (the replica had died):
    # the replica that took the workflow over ran it to the end. Cancelled tasks recorded
    # by a replica that died before its last write were run again too.
    for asked, tasks in ((True, {}), (False, {"first": {"state": "cancelled"}})):
        store, executor = MemoryWorkflowStore(), Recorder()
        wf = await left_behind(store, tasks)
        if asked:
            await store.request_cancel(wf)
        snap = await resumed(store, executor, wf)
        assert snap["state"] == "cancelled" and executor.bodies == {}, (asked, snap)
        assert {r["state"] for r in snap["tasks"].values()} == {"cancelled"}


async def test_a_record_no_run_could_leave_fails_the_workflow_naming_the_task() -> None:
    store, executor = MemoryWorkflowStore(), Recorder()
    wf = await left_behind(store, {"slow": {"state": "done", "output": "x"}})
    snap = await resumed(store, executor, wf)
    assert snap["state"] == "failed" and executor.bodies == {}
    assert "'slow' is recorded over but a task it runs after is not done" in snap["error"]


class Gate(Recorder):
    """A Recorder that holds the answer of one task until told to let it through."""

    def __init__(self, task: str) -> None:
        super().__init__()
        self.task, self.reached, self.release = task, asyncio.Event(), asyncio.Event()

    async def execute(self, body: dict[str, Any], headers: Mapping[str, str]) -> TaskOutcome:
        if headers[TASK_HEADER] == self.task:
            self.reached.set()
            await self.release.wait()
        return await super().execute(body, headers)


async def test_a_replica_whose_lease_was_taken_over_writes_nothing_more(
    redis_url: str,
) -> None:
    """A replica that stalled past its lease (another one took the workflow over) finds its
    next write refused and stops driving the workflow, instead of overwriting the new owner's."""
    store = RedisWorkflowStore.from_url(redis_url, f"t{uuid.uuid4().hex[:12]}")
    gate = Gate("slow")
    stalled = WorkflowService(WorkflowSettings(store="redis", redis_url=redis_url,
                                               lease_s=0.2), store, gate, replica="a")
    try:
        wf = (await stalled.submit(chain()))["id"]
        await asyncio.wait_for(gate.reached.wait(), 10)
        await asyncio.sleep(0.3)  # its lease lapses: nothing renews it (the service is not
        assert await store.claim(wf, "b/new-owner", 60.0)  # started), and b takes it over
        gate.release.set()
        for _ in range(200):
            if wf not in stalled._runs:
                break
            await asyncio.sleep(0.01)
        snap = await store.get(wf)
        assert snap is not None and snap["state"] == "running"
        assert snap["tasks"]["slow"]["state"] == "running"  # its answer was not written
        assert "slow" in gate.bodies and "last" not in gate.bodies
    finally:
        await stalled.stop()


async def test_a_slow_takeover_does_not_let_the_replicas_own_leases_lapse(
    redis_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Leases were renewed once per pass and the pass then took over every orphan, one after
    # another: taking over many large specs outlasted the lease, and the replica lost (and
    # aborted) its own workflows.
    store = RedisWorkflowStore.from_url(redis_url, f"t{uuid.uuid4().hex[:12]}")
    gate = Gate("slow")
    service = WorkflowService(WorkflowSettings(store="redis", redis_url=redis_url,
                                               lease_s=0.3), store, gate, replica="a")
    taking = asyncio.Event()

    async def slow_resume(workflow_id: str) -> bool:
        taking.set()
        await asyncio.sleep(1.5)  # five leases' worth of checking a large spec
        return False

    try:
        mine = (await service.submit(chain()))["id"]
        await asyncio.wait_for(gate.reached.wait(), 10)
        orphan = await left_behind(store, {})  # no lease: the next pass takes it over
        monkeypatch.setattr(service, "resume", slow_resume)
        await service.start()
        await asyncio.wait_for(taking.wait(), 10)
        await asyncio.sleep(1.0)  # the takeover is under way, for over three leases
        assert not await store.claim(mine, "b/other", 60.0)  # still this replica's
        assert orphan != mine
    finally:
        gate.release.set()
        await service.stop()


async def test_a_workflow_the_store_lost_is_written_again_and_goes_on(redis_url: str) -> None:
    # Redis restarted without persistence (the shipped k8s Redis keeps nothing on disk): the
    # lease and the records are gone. The replica read that as its lease passed to another
    # and stopped; no replica could take the workflow over, and it was lost.
    ns = f"t{uuid.uuid4().hex[:12]}"
    store = RedisWorkflowStore.from_url(redis_url, ns)
    gate = Gate("slow")
    service = WorkflowService(WorkflowSettings(store="redis", redis_url=redis_url,
                                               lease_s=0.3), store, gate, replica="a")
    try:
        await service.start()
        wf = (await service.submit(chain()))["id"]
        await asyncio.wait_for(gate.reached.wait(), 10)
        keys = [k async for k in store.r.scan_iter(f"{ns}:*")]
        await store.r.delete(*keys)  # everything of this namespace, as a restart would
        await asyncio.sleep(0.5)  # a lease renewal finds it gone, and writes it again
        snap = await store.get(wf)
        assert snap is not None and snap["state"] == "running"
        assert snap["tasks"]["first"]["state"] == "done"  # this replica's records
        gate.release.set()
        for _ in range(300):
            snap = await store.get(wf)
            if snap is not None and snap["state"] != "running":
                break
            await asyncio.sleep(0.02)
        assert snap is not None and snap["state"] == "done", snap
        assert {r["state"] for r in snap["tasks"].values()} == {"done"}
        assert sorted(gate.bodies) == ["first", "last", "slow"]  # none run twice
    finally:
        gate.release.set()
        await service.stop()


class StaleRead(RedisWorkflowStore):
    """A store whose next `get` runs `hook` before it returns what it read (the reader acts
    on a snapshot another replica has since changed)."""

    hook: Any = None

    async def get(self, workflow_id: str) -> Any:
        snap = await super().get(workflow_id)
        hook, self.hook = self.hook, None
        if hook is not None:
            await hook()
        return snap


async def test_a_delete_that_read_a_workflow_just_before_it_ended_leaves_it_done(
    redis_url: str,
) -> None:
    ns = f"t{uuid.uuid4().hex[:12]}"
    gate = Gate("last")
    driver = WorkflowService(WorkflowSettings(store="redis", redis_url=redis_url),
                             RedisWorkflowStore.from_url(redis_url, ns), gate, replica="a")
    stale = StaleRead.from_url(redis_url, ns)
    other = WorkflowService(WorkflowSettings(store="redis", redis_url=redis_url), stale,
                            Recorder(), replica="b")
    try:
        wf = (await driver.submit(chain()))["id"]
        await asyncio.wait_for(gate.reached.wait(), 10)

        async def the_driver_ends_it() -> None:
            gate.release.set()
            for _ in range(500):
                if wf not in driver._runs:
                    return
                await asyncio.sleep(0.01)

        stale.hook = the_driver_ends_it
        with pytest.raises(WorkflowNotCancellable, match="already done"):
            await other.cancel(wf)
        snap = await driver.snapshot(wf)
        assert snap["state"] == "done"
        assert snap["tasks"]["last"]["output"] == "<last answer>"
        events = [e["state"] for _, e in await stale.events(wf) if e["type"] == "workflow"]
        assert events == ["done"]
    finally:
        await driver.stop()
        await other.stop()


class Blinking(MemoryWorkflowStore):
    """A store whose writes fail while `down` is above 0 (each failure counts one down)."""

    down = 0

    async def update(self, *args: Any, **kwargs: Any) -> bool:
        if self.down > 0:
            self.down -= 1
            raise ConnectionError("the store is away")
        return await super().update(*args, **kwargs)


async def test_a_store_blip_is_written_through_and_the_workflow_goes_on() -> None:
    store, gate = Blinking(), Gate("slow")
    service = WorkflowService(WorkflowSettings(), store, gate, replica="a")
    try:
        wf = (await service.submit(chain()))["id"]
        await asyncio.wait_for(gate.reached.wait(), 10)
        store.down = 2  # the next two writes fail, the third lands
        gate.release.set()
        await asyncio.wait_for(service._runs[wf].over.wait(), 10)
        snap = await service.snapshot(wf)
        assert snap["state"] == "done"
        assert sorted(gate.bodies) == ["first", "last", "slow"]
    finally:
        await service.stop()


async def test_a_store_away_for_good_aborts_the_workflows_calls_in_flight() -> None:
    store, gate = Blinking(), Gate("quick")
    aborted = asyncio.Event()

    async def held(body: dict[str, Any], headers: Mapping[str, str]) -> TaskOutcome:
        if headers[TASK_HEADER] == "held":
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                aborted.set()
                raise
        return await Gate.execute(gate, body, headers)

    gate.execute = held  # type: ignore[method-assign]
    service = WorkflowService(WorkflowSettings(), store, gate, replica="a")
    spec = {"id": "pair", "model": MODEL, "tasks": [
        {"id": t, "output_tokens": 8, "messages": [{"role": "user", "content": t}]}
        for t in ("quick", "held")]}
    try:
        await service.submit(spec)
        await asyncio.wait_for(gate.reached.wait(), 10)
        # `quick` ends while `held` runs, and the write of its end never lands.
        store.down = 100
        gate.release.set()
        await asyncio.wait_for(aborted.wait(), 10)
    finally:
        store.down = 0
        await service.stop()


async def test_a_hint_mode_call_the_store_cannot_record_leaves_nothing_behind() -> None:
    store = Blinking()
    service = WorkflowService(WorkflowSettings(), store, Recorder(), replica="a")
    try:
        await service.hinted_task_started("agent", "t0", (), "r0", MODEL, attempt="x0")
        store.down = 1
        with pytest.raises(ConnectionError):
            await service.hinted_task_started("agent", "t1", ("t0",), "r1", MODEL,
                                              attempt="x1")
        assert ("agent", "t1") not in service._hint_tasks
        assert ("agent", "t1") not in service._hint_attempts
        assert ("agent", "t0") in service._hint_tasks  # the recorded one stays open
    finally:
        await service.stop()


async def test_a_workflow_the_store_cannot_take_is_a_503_and_leaves_no_span_open() -> None:
    class Refusing(MemoryWorkflowStore):
        async def create(self, *args: Any, **kwargs: Any) -> bool:
            raise ConnectionError("the store is away")

    from gateway.config import TracingSettings
    from gateway.tracing import Tracing

    service = WorkflowService(WorkflowSettings(), Refusing(), Recorder(), replica="a",
                              tracing=Tracing(TracingSettings()))
    try:
        with pytest.raises(WorkflowStoreUnavailable, match="could not be stored"):
            await service.submit(chain())
        assert not service._runs and not service.tracing._workflows
    finally:
        await service.stop()


async def test_a_workflow_stored_but_not_whole_reads_failed_and_is_never_taken_over() -> None:
    class HalfWay(MemoryWorkflowStore):
        shared = True

        async def save_resume(self, workflow_id: str, document: Any) -> None:
            raise ConnectionError("the store went away halfway")

    store = HalfWay()
    service = WorkflowService(WorkflowSettings(), store, Recorder(), replica="a")
    try:
        with pytest.raises(WorkflowStoreUnavailable, match="could not be stored"):
            await service.submit(chain())
        [wf] = [w["id"] for w in await store.recent(10)]
        snap = await store.get(wf)
        assert snap is not None and snap["state"] == "failed"
        assert await store.orphans() == []
    finally:
        await service.stop()


async def test_the_write_that_ends_a_workflow_is_tried_again_too() -> None:
    class FinalBlink(MemoryWorkflowStore):
        failed = False

        async def update(self, *args: Any, **kwargs: Any) -> bool:
            if kwargs.get("ttl_s") is not None and not self.failed:
                self.failed = True
                raise ConnectionError("a blip as the workflow ends")
            return await super().update(*args, **kwargs)

    store = FinalBlink()
    service = WorkflowService(WorkflowSettings(), store, Recorder(), replica="a")
    try:
        wf = (await service.submit(chain()))["id"]
        await asyncio.wait_for(service._runs[wf].over.wait(), 10)
        snap = await service.snapshot(wf)
        assert store.failed and snap["state"] == "done" and snap["finished_s"] is not None
    finally:
        await service.stop()


async def test_a_driver_that_fails_ends_its_workflow_failed_with_the_memory_store() -> None:
    """Nobody takes a workflow over from the memory store: one whose driver fails (a bug, here
    one step made to raise) ends failed, its open tasks with it, rather than reading
    `running` for ever."""
    service = WorkflowService(WorkflowSettings(), MemoryWorkflowStore(), Recorder(),
                              replica="a")
    real = service._step

    def step(run: Any, msg: Any, changes: Any) -> None:
        if getattr(msg, "task", None) == "slow" and type(msg).__name__ == "_Done":
            raise RuntimeError("a bug in a step")
        real(run, msg, changes)

    service._step = step  # type: ignore[method-assign]
    try:
        wf = (await service.submit(chain()))["id"]
        await asyncio.wait_for(service._runs[wf].over.wait(), 10)
        snap = await service.snapshot(wf)
        assert snap["state"] == "failed" and "a bug in a step" in snap["error"]
        states = {t: r["state"] for t, r in snap["tasks"].items()}
        assert states == {"first": "done", "slow": "failed", "last": "failed"}
    finally:
        await service.stop()


async def test_an_answer_that_is_no_chat_completion_fails_its_task() -> None:
    from gateway.workflows import _outcome

    for doc in ({"choices": ["oops"]}, {"choices": []}, {"choices": [{"message": "x"}]},
                {"object": "chat.completion"}):
        outcome = _outcome(200, doc, "e1")
        assert not outcome.ok and outcome.error is not None
        assert "no choices[0].message" in outcome.error
    odd_usage = _outcome(200, {"choices": [{"message": {"content": "hi"}}], "usage": [1]}, None)
    assert odd_usage.ok and odd_usage.output == "hi" and odd_usage.usage("prompt_tokens") is None


async def test_a_tasks_priority_and_the_workflows_deadline_go_with_its_call() -> None:
    """A task's `priority` and what is left of the workflow's `deadline_s` are sent as the
    call's hints (`X-KVGate-Priority`, `X-KVGate-Deadline`), which rank it in the buffer and
    at engines that schedule by priority."""
    from planner.hints import DEADLINE_HEADER, PRIORITY_HEADER

    class Headers(Recorder):
        def __init__(self) -> None:
            super().__init__()
            self.headers: dict[str, Mapping[str, str]] = {}

        async def execute(self, body: dict[str, Any], headers: Mapping[str, str]
                          ) -> TaskOutcome:
            self.headers[headers[TASK_HEADER]] = dict(headers)
            return await super().execute(body, headers)

    executor = Headers()
    service = WorkflowService(WorkflowSettings(), MemoryWorkflowStore(), executor, replica="a")
    spec = {**chain(), "deadline_s": 30}
    spec["tasks"][0]["priority"] = 5
    try:
        wf = (await service.submit(spec))["id"]
        await asyncio.wait_for(service._runs[wf].over.wait(), 10)
    finally:
        await service.stop()
    first, last = executor.headers["first"], executor.headers["last"]
    assert first[PRIORITY_HEADER] == "5" and PRIORITY_HEADER not in last
    assert 0 < float(last[DEADLINE_HEADER]) <= float(first[DEADLINE_HEADER]) <= 30
