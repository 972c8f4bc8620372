"""The SDK: `@workflow`/`@task` put the right hints on the calls made inside them (checked on
the wire, at a real local HTTP server), and against a real gateway and simulated engines the
workflow shows up with those tasks; a static DAG is submitted whole and followed."""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx2
import openai
import pytest
from aiohttp import web

from kvgate.procs import Child, free_port
from kvgate.sdk import (
    Client,
    Dag,
    InvalidWorkflow,
    WorkflowNotCancellable,
    WorkflowNotFound,
    WorkflowTimeout,
    add_hints,
    current_task,
    current_workflow,
    hints,
    instrument,
    start_call,
    task,
    user,
    workflow,
)
from tests.conftest import MODEL


class Recorder:
    """A real HTTP server answering chat completions; it keeps every request's headers."""

    def __init__(self) -> None:
        self.calls: list[dict[str, str]] = []
        self.bodies: list[dict[str, Any]] = []
        self.fail_first = 0
        self.release = asyncio.Event()
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.calls.append({k.lower(): v for k, v in request.headers.items()})
        self.bodies.append(body)
        if self.fail_first > 0:
            self.fail_first -= 1
            return web.json_response({"error": {"message": "busy"}}, status=503)
        delay = float(body.get("metadata", {}).get("delay", 0))
        await asyncio.sleep(delay)
        if body.get("stream"):
            return await self._stream(request, body)
        return web.json_response({
            "id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    async def _stream(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        """A streamed answer of two chunks; with `metadata.hold` the second waits for
        `self.release`."""
        answer = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await answer.prepare(request)
        for n, word in enumerate(("o", "k")):
            if n == 1 and body.get("metadata", {}).get("hold"):
                await self.release.wait()
            chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0,
                     "model": body["model"], "choices": [
                         {"index": 0, "delta": {"content": word}, "finish_reason": None}]}
            await answer.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await answer.write(b"data: [DONE]\n\n")
        await answer.write_eof()
        return answer

    async def start(self) -> Recorder:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def hints(self) -> list[tuple[str | None, str | None, str | None]]:
        """(workflow, task, after) of each call, in arrival order."""
        return [(c.get("x-kvgate-workflow"), c.get("x-kvgate-task"), c.get("x-kvgate-after"))
                for c in self.calls]

    def after(self) -> dict[str, list[str]]:
        """Each call's task id and its parents (sorted)."""
        out = {}
        for c in self.calls:
            parents = c.get("x-kvgate-after")
            out[c["x-kvgate-task"]] = sorted(parents.split(",")) if parents else []
        return out


@pytest.fixture
async def recorder() -> AsyncIterator[Recorder]:
    rec = await Recorder().start()
    yield rec
    await rec.stop()


@pytest.fixture
async def kv(recorder: Recorder) -> AsyncIterator[Client]:
    client = Client(recorder.url)
    yield client
    await client.aclose()


async def chat(client: Client, delay: float = 0.0) -> str:
    r = await client.openai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        metadata={"delay": str(delay)})
    return str(r.choices[0].message.content)


# -- hints on the wire ----------------------------------------------------------------------------


async def test_calls_outside_a_workflow_carry_no_hints(kv: Client, recorder: Recorder) -> None:
    @task
    async def step() -> str:
        return await chat(kv)

    await chat(kv)
    await step()
    assert recorder.hints() == [(None, None, None), (None, None, None)]


async def test_a_workflow_method_runs_with_its_instance(kv: Client, recorder: Recorder) -> None:
    class Agent:
        def __init__(self, label: str) -> None:
            self.label = label

        @workflow("agent")
        async def solve(self, suffix: str) -> str:
            await chat(kv)
            return self.label + suffix

    agent = Agent("a")
    assert inspect.iscoroutinefunction(agent.solve) and inspect.iscoroutinefunction(Agent.solve)
    assert list(inspect.signature(agent.solve).parameters) == ["suffix"]
    assert await agent.solve("1") == "a1"
    result = await agent.solve.run("2")
    assert result.value == "a2" and result.id.startswith("agent-")
    assert (await Agent.solve.run(Agent("b"), "3")).value == "b3"
    workflows = [wf for wf, _, _ in recorder.hints()]
    assert len(workflows) == 3 and workflows[1] == result.id and len(set(workflows)) == 3


async def test_a_streamed_call_is_a_parent_once_its_answer_has_ended(
    kv: Client, recorder: Recorder
) -> None:
    @workflow("stream")
    async def agent() -> None:
        await chat(kv)
        stream = await kv.openai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            stream=True, metadata={"hold": "1"})
        pieces = [await stream.__anext__()]
        # Work started while the answer streams does not extend it.
        await asyncio.create_task(chat(kv))
        recorder.release.set()
        pieces += [piece async for piece in stream]
        assert "".join(p.choices[0].delta.content or "" for p in pieces) == "ok"
        await chat(kv)

    await agent()
    assert recorder.after() == {"call-1": [], "call-2": ["call-1"], "call-3": ["call-1"],
                                "call-4": ["call-2", "call-3"]}


async def test_a_streamed_call_read_in_part_is_a_parent_once_closed(
    kv: Client, recorder: Recorder
) -> None:
    @workflow("stream")
    async def agent() -> None:
        stream = await kv.openai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            stream=True)
        await stream.__anext__()
        await stream.close()  # enough read: the caller goes on from what it has
        await chat(kv)

    await agent()
    assert recorder.after() == {"call-1": [], "call-2": ["call-1"]}


async def test_sequential_tasks_chain_and_ids_count_per_name(kv: Client,
                                                             recorder: Recorder) -> None:
    @task("think")
    async def think() -> str:
        return await chat(kv)

    @workflow("react")
    async def loop() -> str | None:
        for _ in range(3):
            await think()
        return current_workflow()

    wf_id = await loop()
    assert wf_id is not None and re.fullmatch(r"react-[0-9a-f]{8}", wf_id)
    assert recorder.hints() == [(wf_id, "think-1", None), (wf_id, "think-2", "think-1"),
                                (wf_id, "think-3", "think-2")]


async def test_gathered_tasks_are_a_fan_out_and_the_next_task_joins_them(
    kv: Client, recorder: Recorder
) -> None:
    @task
    async def ask(delay: float = 0.0) -> str:
        return await chat(kv, delay)

    @workflow
    async def research() -> None:
        await ask()
        await asyncio.gather(ask(0.05), ask(0.0), ask(0.02))
        await ask()

    result = await research.run()
    assert result.id.startswith("research-")
    assert recorder.after() == {"ask-1": [], "ask-2": ["ask-1"], "ask-3": ["ask-1"],
                                "ask-4": ["ask-1"], "ask-5": ["ask-2", "ask-3", "ask-4"]}


WIDE = "a-research-step-with-a-long-descriptive-name-for-a-wide-join"
"""A task name long enough that 40 siblings' ids overflow a header's worth (2,048 characters)."""


async def test_a_join_too_wide_for_a_header_sends_its_parents_in_the_body(
    kv: Client, recorder: Recorder
) -> None:
    @task(WIDE)
    async def step() -> str:
        return await chat(kv)

    @workflow
    async def wide() -> None:
        await asyncio.gather(*(step() for _ in range(40)))
        async with task("join"):
            await kv.openai.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                extra_body={"kvgate": {"priority": 3}})

    await wide.run()
    siblings = sorted(f"{WIDE}-{i}" for i in range(1, 41))
    assert len(",".join(siblings)) > 2048
    join = recorder.calls[-1]
    assert join["x-kvgate-task"] == "join-1" and "x-kvgate-after" not in join
    # The parents join what the caller put in the body's `kvgate` field.
    assert recorder.bodies[-1]["kvgate"]["priority"] == 3
    assert sorted(recorder.bodies[-1]["kvgate"]["after"]) == siblings
    assert all("kvgate" not in b for b in recorder.bodies[:-1])


async def test_a_join_after_more_siblings_than_a_call_may_name_names_the_latest(
    kv: Client, recorder: Recorder
) -> None:
    from planner.hints import MAX_AFTER

    @task("w")
    async def step() -> str:
        return await chat(kv)

    @workflow
    async def wider() -> None:
        await asyncio.gather(*(step() for _ in range(MAX_AFTER + 1)))
        async with task("join"):
            await chat(kv)

    # It used to fail the agent's own call: the gateway refuses more than MAX_AFTER parents.
    await wider.run()
    after = recorder.bodies[-1]["kvgate"]["after"]
    assert len(after) == MAX_AFTER and len(set(after)) == MAX_AFTER


async def test_a_sibling_that_starts_late_does_not_extend_a_finished_sibling(
    kv: Client, recorder: Recorder
) -> None:
    @task
    async def ask() -> str:
        return await chat(kv)

    async def branch(wait: float) -> str:
        await asyncio.sleep(wait)  # e.g. a slow tool before the branch's first call
        return await ask()

    async with workflow("late"):
        await ask()
        await asyncio.gather(branch(0.0), branch(0.3))
        await ask()
    assert recorder.after() == {"ask-1": [], "ask-2": ["ask-1"], "ask-3": ["ask-1"],
                                "ask-4": ["ask-2", "ask-3"]}


async def test_a_branch_never_extends_a_sibling_branch_however_late_it_starts_a_task(
    kv: Client, recorder: Recorder
) -> None:
    """Work started later inside one branch (a `wait_for`, which makes an asyncio task, or a
    nested `gather`) sees what its branch saw, not the sibling branches' finished work."""
    @task
    async def research() -> str:
        return await chat(kv)

    @task
    async def plan() -> str:
        return await chat(kv)

    limit = asyncio.Semaphore(2)

    async def bounded() -> str:
        async with limit:
            return await asyncio.wait_for(research(), 30)

    async def nested() -> None:
        await asyncio.sleep(0.2)  # the other branches' research is over by now
        await asyncio.gather(research(), research())

    async with workflow("bounded"):
        await plan()
        await asyncio.gather(*(bounded() for _ in range(4)), nested())
        await plan()
    after = recorder.after()
    assert all(after[f"research-{i}"] == ["plan-1"] for i in range(1, 7)), after
    assert after["plan-2"] == [f"research-{i}" for i in range(1, 7)]


async def test_a_second_fan_out_extends_the_first(kv: Client, recorder: Recorder) -> None:
    @task
    async def ask() -> str:
        return await chat(kv)

    async with workflow("rounds"):
        await asyncio.gather(ask(), ask())
        await asyncio.gather(ask(), ask())
        await ask()
    assert recorder.after() == {"ask-1": [], "ask-2": [], "ask-3": ["ask-1", "ask-2"],
                                "ask-4": ["ask-1", "ask-2"], "ask-5": ["ask-3", "ask-4"]}


async def test_a_task_group_is_a_fan_out_too(kv: Client, recorder: Recorder) -> None:
    @task
    async def ask() -> str:
        return await chat(kv)

    async with workflow("group"):
        await ask()
        async with asyncio.TaskGroup() as tg:
            for _ in range(3):
                tg.create_task(ask())
        await ask()
    assert recorder.after()["ask-5"] == ["ask-2", "ask-3", "ask-4"]
    assert {recorder.after()[f"ask-{i}"][0] for i in (2, 3, 4)} == {"ask-1"}


async def test_calls_in_one_task_chain_under_numbered_ids(kv: Client,
                                                          recorder: Recorder) -> None:
    @task
    async def agent() -> None:
        assert current_task() == "agent-1"
        for _ in range(3):
            await chat(kv)

    async with workflow("multi"):
        await agent()
        await chat(kv)  # outside any task
    assert recorder.after() == {"agent-1": [], "agent-1.2": ["agent-1"],
                                "agent-1.3": ["agent-1.2"], "call-1": ["agent-1.3"]}


async def test_a_task_inside_a_task_extends_its_call_and_the_task_ends_with_it(
    kv: Client, recorder: Recorder
) -> None:
    @task
    async def worker() -> str:
        return await chat(kv)

    @task
    async def lead() -> None:
        await chat(kv)
        await asyncio.gather(worker(), worker())
        await chat(kv)

    @task
    async def after_lead() -> str:
        return await chat(kv)

    async with workflow("nested"):
        await lead()
        await after_lead()
    assert recorder.after() == {"lead-1": [], "worker-1": ["lead-1"], "worker-2": ["lead-1"],
                                "lead-1.2": ["worker-1", "worker-2"],
                                "after_lead-1": ["lead-1.2"]}


async def test_a_task_without_calls_passes_its_parents_through(kv: Client,
                                                              recorder: Recorder) -> None:
    @task
    async def ask() -> str:
        return await chat(kv)

    @task
    async def tool() -> int:
        await asyncio.sleep(0)
        return 42

    async with workflow("tools"):
        await ask()
        await tool()
        await ask()
    assert recorder.after() == {"ask-1": [], "ask-2": ["ask-1"]}


async def test_expect_children_is_sent_for_a_task_and_in_a_hints_block(
    kv: Client, recorder: Recorder
) -> None:
    @task(expect_children=3)
    async def plan() -> str:
        return await chat(kv)

    async with workflow("fan"):
        await plan()
        with hints(expect_children=2):
            await chat(kv)
        await chat(kv)
    sent = [c.get("x-kvgate-expect-children") for c in recorder.calls]
    assert sent == ["3", "2", None]


async def test_priority_and_deadline_go_with_the_calls_of_a_hints_block(
    kv: Client, recorder: Recorder
) -> None:
    async with workflow("urgent"):
        with hints(priority=-1, deadline_s=2.5):
            await chat(kv)
        await chat(kv)
    sent = [(c.get("x-kvgate-priority"), c.get("x-kvgate-deadline")) for c in recorder.calls]
    assert sent == [("-1", "2.5"), (None, None)]
    with pytest.raises(ValueError, match="deadline_s must be a positive"):
        hints(deadline_s=0)
    with pytest.raises(ValueError, match="priority must be an integer"):
        hints(priority=1.5)  # type: ignore[arg-type]


async def test_a_retried_call_keeps_its_id(recorder: Recorder) -> None:
    recorder.fail_first = 1
    client = openai.AsyncOpenAI(base_url=f"{recorder.url}/v1", api_key="-", max_retries=1,
                                http_client=add_hints(httpx2.AsyncClient()))
    async with workflow("retry", id="retry-1"):
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                     "content": "x"}])
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                     "content": "y"}])
    await client.close()
    assert recorder.hints() == [("retry-1", "call-1", None), ("retry-1", "call-1", None),
                                ("retry-1", "call-2", "call-1")]


async def test_a_failed_call_is_nobodys_parent(recorder: Recorder) -> None:
    recorder.fail_first = 1
    client = instrument(openai.AsyncOpenAI(base_url=f"{recorder.url}/v1", api_key="-",
                                           max_retries=0))
    async with workflow("fail", id="fail-1"):
        with pytest.raises(openai.APIStatusError):
            await client.chat.completions.create(model=MODEL, messages=[])
        await client.chat.completions.create(model=MODEL, messages=[])
    await client.close()
    assert recorder.hints() == [("fail-1", "call-1", None), ("fail-1", "call-2", None)]


async def test_hints_the_caller_set_are_left_alone(kv: Client, recorder: Recorder) -> None:
    async with workflow("own"):
        await kv.openai.chat.completions.create(
            model=MODEL, messages=[], extra_headers={"X-KVGate-Workflow": "mine",
                                                     "X-KVGate-Task": "t"})
    assert recorder.hints() == [("mine", "t", None)]


async def test_a_callers_own_task_or_hint_wins_over_the_sdks(kv: Client,
                                                             recorder: Recorder) -> None:
    async with workflow("own") as wf:
        with hints(priority=3):
            await kv.openai.chat.completions.create(
                model=MODEL, messages=[], extra_headers={"X-KVGate-Task": "mine"})
            await kv.openai.chat.completions.create(
                model=MODEL, messages=[], extra_headers={"X-KVGate-Priority": "-5"})
            await kv.openai.chat.completions.create(
                model=MODEL, messages=[], extra_body={"kvgate": {"workflow": "other-wf"}})
    first, second, third = recorder.calls
    assert first.get("x-kvgate-task") == "mine" and "x-kvgate-workflow" not in first
    assert second["x-kvgate-priority"] == "-5" and second["x-kvgate-workflow"] == wf.id
    assert "x-kvgate-workflow" not in third and "x-kvgate-task" not in third


async def test_hints_outside_a_workflow_still_go_with_the_calls(kv: Client,
                                                                recorder: Recorder) -> None:
    with hints(priority=-1, deadline_s=2.5):
        await chat(kv)
    (sent,) = recorder.calls
    assert sent["x-kvgate-priority"] == "-1" and sent["x-kvgate-deadline"] == "2.5"
    assert "x-kvgate-workflow" not in sent


async def test_a_failed_workflow_says_which_run_it_was(kv: Client, recorder: Recorder) -> None:
    @workflow
    async def crashes() -> None:
        await chat(kv)
        raise RuntimeError("tool crashed")

    with pytest.raises(RuntimeError) as failed:
        await crashes.run()
    (sent,) = recorder.calls
    assert f"in kvgate workflow {sent['x-kvgate-workflow']}" in failed.value.__notes__


def test_names_the_gateway_could_not_carry_or_that_collide_are_refused() -> None:
    with pytest.raises(ValueError, match="printable ASCII"):
        task("résumé")
    with pytest.raises(ValueError, match="surrounding spaces"):
        workflow(" my flow")
    with pytest.raises(ValueError, match="reserved"):
        @task
        async def call() -> None:
            return None


def test_a_synchronous_client_is_refused_rather_than_left_without_hints() -> None:
    import httpx

    with pytest.raises(TypeError, match="synchronous"):
        add_hints(httpx.Client())
    with pytest.raises(TypeError, match="synchronous"):
        instrument(openai.OpenAI(api_key="x", base_url="http://127.0.0.1:9/v1"))


async def test_concurrent_workflows_keep_their_own_context(kv: Client,
                                                           recorder: Recorder) -> None:
    @task
    async def ask(delay: float) -> str:
        return await chat(kv, delay)

    @workflow("w")
    async def run(delay: float) -> str | None:
        await ask(delay)
        await ask(delay)
        return current_workflow()

    a, b = await asyncio.gather(run(0.03), run(0.0))
    assert a != b
    by_wf: dict[str | None, list[tuple[str | None, str | None]]] = {}
    for wf, t, after in recorder.hints():
        by_wf.setdefault(wf, []).append((t, after))
    assert by_wf == {a: [("ask-1", None), ("ask-2", "ask-1")],
                     b: [("ask-1", None), ("ask-2", "ask-1")]}


async def test_a_task_block_and_a_fixed_workflow_id(kv: Client, recorder: Recorder) -> None:
    @workflow("fixed", id="fixed-7")
    async def run() -> str | None:
        async with task("step") as task_id:
            assert task_id == current_task() == "step-1"
            await chat(kv)
        assert current_task() is None
        return current_workflow()

    result = await run.run()
    assert result.id == result.value == "fixed-7"
    assert recorder.hints() == [("fixed-7", "step-1", None)]


async def test_a_legacy_httpx_client_gets_the_hints_too(recorder: Recorder) -> None:
    import httpx

    client = openai.AsyncOpenAI(base_url=f"{recorder.url}/v1", api_key="-",
                                http_client=add_hints(httpx.AsyncClient()))
    async with workflow("legacy", id="legacy-1"), task("t"):
        await client.chat.completions.create(model=MODEL, messages=[])
    await client.close()
    assert recorder.hints() == [("legacy-1", "t-1", None)]


async def test_another_http_client_sends_the_hints_of_start_call(recorder: Recorder) -> None:
    body = {"model": MODEL, "messages": []}
    async with aiohttp.ClientSession() as session, workflow("raw", id="raw-1"):
        for _ in range(2):
            call = start_call()
            assert call is not None
            async with session.post(f"{recorder.url}/v1/chat/completions", json=body,
                                    headers=call.headers) as resp:
                assert resp.status == 200
            call.finished()
    assert start_call() is None
    assert recorder.hints() == [("raw-1", "call-1", None), ("raw-1", "call-2", "call-1")]


class _CountingUnits(dict[int, Any]):
    """A scope's units, counting the lookups the search for parents makes."""

    reads = 0

    def __getitem__(self, key: int) -> Any:
        _CountingUnits.reads += 1
        return super().__getitem__(key)


async def test_the_parents_of_a_call_after_wide_fan_outs_cost_about_one_fan_out() -> None:
    # Each round's 60 tasks extend the 60 of the round before: testing each unit against
    # every later sibling's parents made one call's search cubic in the width (a third round
    # of 200 took 35 s); the walk now takes each shared parent set once.
    from kvgate.sdk.context import _here

    async def ask(i: int) -> int:
        call = start_call()
        assert call is not None
        await asyncio.sleep(0)
        call.finished()
        return i

    async with workflow("wide", id="wide-1"):
        here = _here()
        assert here is not None
        scope = here[0]
        scope.units = _CountingUnits(scope.units)
        for _ in range(3):
            await asyncio.gather(*(task("w")(ask)(i) for i in range(60)))
        _CountingUnits.reads = 0
        call = start_call()
        assert call is not None
        assert len(call.after) == 60
        assert _CountingUnits.reads <= 4 * 60


async def test_objects_with_an_async_call_and_partials_are_decorated_by_their_names(
        recorder: Recorder) -> None:
    client = instrument(openai.AsyncOpenAI(base_url=f"{recorder.url}/v1", api_key="k"))

    class Researcher:
        async def __call__(self, topic: str) -> str:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": topic}])
            return topic

    async def ask(prefix: str, topic: str) -> str:
        return await Researcher()(prefix + topic)

    out = await workflow(task(functools.partial(ask, "on ")))("rivers")
    assert out == "on rivers"
    (wf, call, _), = recorder.hints()
    assert wf.startswith("ask-") and call == "ask-1"
    assert await workflow(Researcher())("lakes") == "lakes"
    assert recorder.hints()[-1][0].startswith("Researcher-")
    with pytest.raises(TypeError, match="<lambda> is not one"):
        task(lambda: 1)
    for reserved in ("running", "index", "w:ev", "w:lease", ".", ".."):
        with pytest.raises(ValueError, match="reserved"):
            workflow("x", id=reserved)


async def test_events_resume_after_the_stream_breaks_off_and_take_long_events() -> None:
    # The gateway ends a stream with an error event when its store is away for a moment, for
    # the client to resume with Last-Event-ID; a task's output can be a line of megabytes.
    asked: list[str | None] = []
    long_output = "x" * 2_000_000

    async def events(request: web.Request) -> web.StreamResponse:
        asked.append(request.headers.get("Last-Event-ID"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        if len(asked) != 2:
            await resp.prepare(request)
        if len(asked) == 1:
            for n in (1, 2):
                await resp.write(f'id: {n}\ndata: {{"type": "task", "n": {n}}}\n\n'.encode())
            await resp.write(b'data: {"type": "error", "error": {"message": "store away", '
                             b'"code": "workflow_store_unavailable"}}\n\n')
        elif len(asked) == 2:
            # The store still away: the reconnect's snapshot read is a 503, tried again.
            return web.json_response({"error": {
                "message": "the workflow store could not be reached", "type": "server_error",
                "param": None, "code": "workflow_store_unavailable"}}, status=503)
        elif len(asked) == 3:
            await resp.write(b": keep-alive\n\n")  # and the connection drops
        else:
            task = json.dumps({"type": "task", "n": 3, "output": long_output})
            await resp.write(f"id: 3\ndata: {task}\n\n".encode())
            await resp.write(b'id: 4\ndata: {"type": "workflow", "state": "done"}\n\n')
        return resp

    app = web.Application()
    app.router.add_get("/v1/workflows/{id}/events", events)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    client = Client(f"http://127.0.0.1:{port}")
    try:
        got = [e async for e in client.events("wf-1")]
    finally:
        await client.aclose()
        await runner.cleanup()
    assert asked == [None, "2", "2", "2"]
    assert [(e["event_id"], e.get("n")) for e in got] == [("1", 1), ("2", 2), ("3", 3),
                                                         ("4", None)]
    assert got[2]["output"] == long_output and got[-1]["type"] == "workflow"


async def test_a_chain_of_tasks_each_starting_the_next_keeps_none_of_them_alive() -> None:
    import gc

    # The task factory a workflow installs stays on its loop; it recorded each task's
    # creator itself, so a self-rescheduling loop kept every finished link alive.
    async with workflow("once"):
        pass
    links = 3_000
    over = asyncio.Event()
    alive: list[int] = []

    async def link(n: int) -> None:
        if n == links:
            gc.collect()
            alive.append(sum(1 for o in gc.get_objects()
                             if isinstance(o, asyncio.Task) and o.done()))
            over.set()
            return
        asyncio.get_running_loop().create_task(link(n + 1))

    asyncio.get_running_loop().create_task(link(0))
    await over.wait()
    assert alive[0] < 50, alive


def test_a_negative_expect_children_is_refused() -> None:
    with pytest.raises(ValueError, match="expect_children"):
        task("t", expect_children=-1)
    with pytest.raises(ValueError, match="expect_children"):
        hints(expect_children=-1)


def test_hints_the_gateway_would_refuse_are_refused_where_they_are_set() -> None:
    # Each would otherwise be a 400 on every call made in the block.
    task("t", expect_children=5000)  # the gateway prepares for its first 1,000
    with pytest.raises(ValueError, match="expect_children must be an integer from 0 to"):
        task("t", expect_children=10**12)
    with pytest.raises(ValueError, match="priority must be an integer from -1000000"):
        hints(priority=10**7)
    for deadline in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="deadline_s must be a positive, finite"):
            hints(deadline_s=deadline)
    # A task id travels in comma-separated X-KVGate-After lists.
    for name in ("fetch,rank", " fetch", "f" * 201):
        with pytest.raises(ValueError, match="without commas or surrounding spaces"):
            task(name)


def test_decorating_a_plain_function_is_a_type_error() -> None:
    def plain() -> None:
        pass

    with pytest.raises(TypeError, match="async functions"):
        task(plain)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="async functions"):
        workflow("x")(plain)  # type: ignore[arg-type]


# -- static DAGs, locally -------------------------------------------------------------------------


def test_a_dag_builds_the_workflow_spec() -> None:
    dag = Dag("survey", model=MODEL)
    sys = dag.segment("sys", "You are a researcher.")
    plan = dag.task("plan", [sys, user("Plan it.")], max_tokens=8)
    w = dag.task("w0", [sys, plan.output(role="user")], temperature=0.5)
    dag.task("reduce", [sys, w.output()], after=[plan])
    doc = dag.to_dict()
    assert doc["tasks"][1] == {"id": "w0", "messages": [
        {"segment": "sys"}, {"output_of": "plan", "role": "user"}],
        "params": {"temperature": 0.5}}
    assert doc["tasks"][2]["after"] == ["plan"]
    assert dag.problems() == []
    # The spec's own task fields are fields, not OpenAI `params` (where they did nothing).
    dag.task("exact", [user("Go.")], output_tokens=40, priority=-2)
    assert dag.to_dict()["tasks"][3] == {"id": "exact", "messages": [
        {"role": "user", "content": "Go."}], "output_tokens": 40, "priority": -2}
    assert dag.problems() == []


def test_a_dag_reports_what_the_gateway_would_reject() -> None:
    dag = Dag("bad", model=MODEL)
    dag.task("a", [user("x")], after=["b"])
    dag.task("b", [user("y")], after=["a"])
    assert any("cycle" in p for p in dag.problems())
    with pytest.raises(ValueError, match="already defined"):
        dag.task("a", [user("z")])


# -- against a real gateway and simulated engines --------------------------------------------------


@pytest.fixture
async def gw(gateway: Child) -> AsyncIterator[Client]:
    client = Client(gateway.url, api_key="test-key")
    yield client
    await client.aclose()


async def test_a_fan_out_workflow_shows_up_at_the_gateway_with_its_parents(
    gw: Client, sims: list[Child]
) -> None:
    @task
    async def ask(text: str) -> str:
        r = await gw.openai.chat.completions.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": text}])
        return str(r.choices[0].message.content)

    @workflow("survey")
    async def survey() -> str:
        plan = await ask("Plan three questions.")
        notes = await asyncio.gather(*(ask(f"{plan} #{i}") for i in range(3)))
        return await ask(" ".join(notes))

    result = await survey.run()
    snap = await gw.wait(result.id, timeout_s=30)
    assert snap.source == "hints" and snap.state == "done"
    after = {t: sorted(r["after"]) for t, r in snap.tasks.items()}
    assert after == {"ask-1": [], "ask-2": ["ask-1"], "ask-3": ["ask-1"], "ask-4": ["ask-1"],
                     "ask-5": ["ask-2", "ask-3", "ask-4"]}
    engines = {s.url.removeprefix("http://") for s in sims}
    assert all(r["engine"] in engines and r["state"] == "done" for r in snap.tasks.values())


async def test_a_join_too_wide_for_a_header_reaches_the_gateway_whole(gw: Client) -> None:
    # 140 parents: 8,991 characters, past what aiohttp takes in a header field (8,190 bytes).
    @task(WIDE)
    async def step(i: int) -> str:
        r = await gw.openai.chat.completions.create(
            model=MODEL, max_tokens=1, messages=[{"role": "user", "content": f"part {i}"}])
        return str(r.choices[0].message.content)

    @workflow("wide")
    async def wide() -> None:
        await asyncio.gather(*(step(i) for i in range(140)))
        await step(140)

    result = await wide.run()
    snap = await gw.wait(result.id, timeout_s=60)
    assert snap.state == "done"
    parents = sorted(f"{WIDE}-{i}" for i in range(1, 141))
    assert len(",".join(parents)) > 8190
    assert sorted(snap.tasks[f"{WIDE}-141"]["after"]) == parents


CONTEXT = "The survey covers caching, batching, routing and scheduling of agent calls. " * 6


def shared_blocks(segments: str | None) -> int:
    """The `shared=N` of the gateway's `x-kvgate-segments` answer header."""
    assert segments is not None
    return int(dict(part.split("=") for part in segments.split(","))["shared"])


async def fan_out_segments(gw: Client, expect_children: int | None) -> tuple[str, list[str]]:
    """A plan call and three gathered children extending its context: the gateway's
    `x-kvgate-segments` header of each."""
    async def call(messages: list[dict[str, str]]) -> tuple[str, str]:
        raw = await gw.openai.chat.completions.with_raw_response.create(
            model=MODEL, max_tokens=4, messages=messages)
        return raw.headers["x-kvgate-segments"], str(raw.parse().choices[0].message.content)

    async with workflow("segments"):
        async with task("plan", expect_children=expect_children):
            plan_segments, answer = await call([{"role": "user", "content": CONTEXT}])

        @task
        async def child(i: int) -> str:
            segments, _ = await call([{"role": "user", "content": CONTEXT},
                                      {"role": "assistant", "content": answer},
                                      {"role": "user", "content": f"Part {i}."}])
            return segments

        children = await asyncio.gather(*(child(i) for i in range(3)))
    return plan_segments, list(children)


async def test_the_gateway_sees_gathered_siblings_share_their_parents_context(
    gw: Client
) -> None:
    _, children = await fan_out_segments(gw, None)
    # The first sibling to arrive looks like a chain; the others show the fan-out.
    assert sum(shared_blocks(s) > 0 for s in children) >= 2


async def test_expect_children_marks_the_parents_context_shared_before_children_arrive(
    gw: Client
) -> None:
    plan, children = await fan_out_segments(gw, 3)
    assert shared_blocks(plan) > 0
    assert all(shared_blocks(s) > 0 for s in children)


async def test_a_static_dag_is_submitted_whole_and_followed_to_its_end(gw: Client) -> None:
    dag = Dag("static", model=MODEL)
    sys = dag.segment("sys", "You are a researcher. " * 10)
    plan = dag.task("plan", [sys, user("Plan it.")], max_tokens=4)
    workers = [dag.task(f"w{i}", [sys, plan.output(role="user")], max_tokens=4)
               for i in range(2)]
    dag.task("reduce", [sys, *(w.output() for w in workers)], max_tokens=4)
    first = await gw.submit(dag)
    assert first.id.startswith("static-") and first.source == "api"
    events = [e async for e in gw.events(first.id)]
    assert events[-1] == {"type": "workflow", "workflow": first.id, "state": "done",
                          "finished_s": events[-1]["finished_s"],
                          "event_id": events[-1]["event_id"]}
    assert {e["task"] for e in events if e["type"] == "task"} == {"plan", "w0", "w1", "reduce"}
    resumed = [e async for e in gw.events(first.id, last_event_id=events[-3]["event_id"])]
    assert resumed == events[-2:]
    snap = await gw.wait(first.id, timeout_s=30)
    assert snap.state == "done"
    assert snap.tasks["reduce"]["after"] == ["w0", "w1"]
    assert all(r["engine"] for r in snap.tasks.values())
    with pytest.raises(WorkflowNotCancellable, match="already done"):
        await gw.cancel(first.id)


async def test_gateway_errors_become_typed_exceptions_with_its_message(gw: Client) -> None:
    bad = Dag("bad", model=MODEL)
    bad.task("a", [user("x")], after=["nope"])
    with pytest.raises(InvalidWorkflow, match="unknown task 'nope'") as e:
        await gw.submit(bad)
    assert e.value.status == 400
    with pytest.raises(WorkflowNotFound, match="no workflow 'missing-1'"):
        await gw.get("missing-1")
    # An id is escaped into the path: `#` once cut it short (this asked for 'missing').
    with pytest.raises(WorkflowNotFound, match="no workflow 'missing#2'"):
        await gw.get("missing#2")
    with pytest.raises(InvalidWorkflow, match="not served"):
        await gw.submit({"model": "no-such-model", "tasks": [
            {"id": "a", "messages": [{"role": "user", "content": "x"}]}]})


async def test_waiting_past_the_timeout_raises(gw: Client) -> None:
    dag = Dag("waits", model=MODEL)
    dag.task("a", [user("x")], max_tokens=4, think_time_s=30)
    first = await gw.submit(dag)
    with pytest.raises(WorkflowTimeout, match="still running"):
        await gw.wait(first.id, timeout_s=0.3)
    await gw.cancel(first.id)


async def test_a_running_static_dag_can_be_cancelled(gw: Client) -> None:
    dag = Dag("slow", model=MODEL)
    dag.task("a", [user("x")], max_tokens=4, think_time_s=30)
    first = await gw.submit(dag)
    snap = await gw.cancel(first.id)
    assert snap.state == "cancelled" and snap.tasks["a"]["state"] == "cancelled"
