"""The workflow API: `POST /v1/workflows` runs a task DAG, `GET` reads it, `/events` follows it
(SSE), `DELETE` cancels it; and the record of hint-mode workflows built from annotated calls.

A submitted workflow is driven by one coroutine that owns its `DagRun` (planner/dag.py, the one
DAG runtime): think times become asyncio timers, each ready task's chat body is rendered from the
spec (`planner.workflow.render_task`) and sent through a `TaskExecutor` — by default the
gateway's own `/v1/chat/completions`, so every task is placed by the planner like any call, with
`X-KVGate-Workflow/Task/After` hints. Every task transition is written to the `WorkflowStore`
(snapshot + event), so a replica sharing the store can read and follow the workflow too.
Cancelling aborts the task requests in flight: closing their connection makes the gateway close
its engine connection, and vLLM aborts a request whose client went away.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import aiohttp
import redis.exceptions
from aiohttp import web

from gateway.config import WorkflowSettings
from gateway.errors import GatewayError, InvalidRequest
from gateway.proxy import ENGINE_HEADER, ExpectHandler, read_json
from gateway.tenants import Tenant, caller, salt_label
from gateway.tracing import TRACEPARENT, Tracing, trace_hex, workflow_trace_id
from gateway.workflow_store import START, Json, WorkflowStore
from planner.dag import TERMINAL, DagNode, DagRun, TaskState, Wakeup
from planner.events import Event, WorkflowOver, WorkflowSubmitted
from planner.hints import (
    AFTER_HEADER,
    BODY_FIELD,
    DEADLINE_HEADER,
    MAX_AFTER_HEADER,
    PRIORITY_HEADER,
    TASK_HEADER,
    WORKFLOW_HEADER,
    names_a_store_key,
)
from planner.workflow import (
    Workflow,
    WorkflowError,
    call_size_floors,
    dependencies,
    load_workflow,
    render_task,
    runnable_problems,
    task_specs,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

STORE_READ_S = 5.0
"""How long a call waits to read a workflow's owner from the store (tenants configured)."""
PERSIST_RETRIES_S = (0.1, 0.3, 1.0, 2.0)
"""Waits before writing a workflow's state again when the store failed (about 3.4 s in all,
within a lease's default 10 s)."""
SSE_KEEPALIVE_S = 15.0
"""A comment line this often on a quiet event stream (keeps proxies from timing it out)."""

CANCEL_WAIT_S = 10.0
"""How long DELETE waits for the cancel to land (here or on the replica running it)."""

MAX_RESUMES = 5
"""A workflow taken over more often than this after its replica was lost fails instead
(whatever stops its replicas would stop the next one too). Hand-offs of a replica that stopped
on purpose (a rolling deploy) do not count: seven steps of a rollout failed a long workflow."""

MAX_HINT_TASKS = 1000
"""Task records a hint-mode workflow keeps (its latest calls'; the oldest are deleted)."""
_HINT_CACHE = 10_000
"""Hint-mode workflow ids remembered per replica (whether the store holds them as hints)."""

LIST_DEFAULT = 50
LIST_MAX = 500
"""`GET /v1/workflows?limit=`: how many workflows a listing holds unless told, and at most."""
EVENT_ID = re.compile(r"[0-9]{1,19}(-[0-9]{1,19})?")
"""An event id as the stores give them (the memory store's counter, a Redis stream entry's id)."""


class WorkflowNotFound(GatewayError):
    """No workflow with that id (never existed, or expired)."""

    status = 404
    err_type = "invalid_request_error"
    code = "workflow_not_found"


class WorkflowStoreUnavailable(GatewayError):
    """The workflow store could not be read (Redis away or slow)."""

    status = 503
    err_type = "server_error"
    code = "workflow_store_unavailable"


MIN_DEADLINE_S = 0.001
"""What a task's call carries as its deadline once its workflow's has passed (the soonest)."""

STORE_ERRORS: tuple[type[BaseException], ...] = (redis.exceptions.RedisError, OSError,
                                                 TimeoutError)
"""What a store that cannot be reached raises: Redis's errors, a socket's, a timeout."""


@contextlib.contextmanager
def store_unavailable(doing: str) -> Iterator[None]:
    """Turn the store's failures while `doing` into a 503 (WorkflowStoreUnavailable) that
    says so, rather than an internal error."""
    try:
        yield
    except STORE_ERRORS as e:
        raise WorkflowStoreUnavailable(
            f"the workflow store could not be reached ({type(e).__name__}) to {doing}; "
            "try again") from None


class WorkflowNotCancellable(GatewayError):
    """The workflow is over already, or its client drives it (hint mode)."""

    status = 409
    err_type = "invalid_request_error"
    code = "workflow_not_cancellable"


# -- executing one task ---------------------------------------------------------------------------


BROKEN_FINISH = frozenset({"abort", "error"})
"""`finish_reason`s of an answer cut short: its text is not the task's output."""


@dataclass(frozen=True)
class TaskOutcome:
    """What one task's request came back with."""

    status: int
    """HTTP status (0: no response at all)."""
    response: Json | None = None
    """The parsed chat completion, when the call succeeded."""
    error: str | None = None
    engine: str | None = None
    """The engine that served it (the gateway's `x-kvgate-engine` header)."""
    cached_tokens: int | None = None
    """`usage.prompt_tokens_details.cached_tokens`, when the engine reports it."""

    @property
    def ok(self) -> bool:
        """The call succeeded with a JSON answer the engine did not end as aborted or failed
        (vLLM ends an aborted stream with `finish_reason: "abort"`, then `[DONE]`)."""
        return (self.error is None and self.response is not None and 200 <= self.status < 300
                and self.finish_reason not in BROKEN_FINISH)

    @property
    def finish_reason(self) -> Any:
        """`choices[0].finish_reason` of the answer (None where it has none)."""
        choices = (self.response or {}).get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            return choices[0].get("finish_reason")
        return None

    @property
    def output(self) -> str:
        """The answer's text (its tool calls as JSON when it has no text)."""
        assert self.response is not None
        message = _message(self.response) or {}
        content = message.get("content")
        if isinstance(content, str) and content:
            return content
        calls = message.get("tool_calls")
        return json.dumps(calls) if calls else ""

    def usage(self, key: str) -> int | None:
        """A `usage` figure of the answer (prompt_tokens, completion_tokens), if reported."""
        usage = (self.response or {}).get("usage")
        value = usage.get(key) if isinstance(usage, dict) else None
        return value if isinstance(value, int) else None


def _message(doc: Json) -> Json | None:
    """A chat completion's `choices[0].message`, or None where the answer has none."""
    choices = doc.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    message = choices[0].get("message")
    return message if isinstance(message, dict) else None


class TaskExecutor(Protocol):
    """Sends one task's chat body somewhere that answers it."""

    async def execute(self, body: dict[str, Any], headers: Mapping[str, str]) -> TaskOutcome:
        """Run the call; failures come back as an outcome, never raised."""
        ...


class LoopbackExecutor:
    """Sends tasks to the gateway's own `/v1/chat/completions` (one session, no pool limit)."""

    def __init__(self, base_url: str, connect_timeout_s: float, request_timeout_s: float) -> None:
        self.url = f"{base_url.rstrip('/')}/v1/chat/completions"
        self.timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s,
                                             sock_read=request_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def execute(self, body: dict[str, Any], headers: Mapping[str, str]) -> TaskOutcome:
        """POST the body, streamed (so the planner hears of the first token when the engine
        has the prompt, as it does for any streamed call, and can copy a parent's context to
        its children's engines while the parent decodes), and put the answer back together;
        the task's request is aborted if this is cancelled."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), timeout=self.timeout)
        streamed = {**body, "stream": True,
                    "stream_options": {**(body.get("stream_options") or {}),
                                       "include_usage": True}}
        answer = _StreamedAnswer()
        try:
            async with self._session.post(self.url, json=streamed,
                                          headers=dict(headers)) as resp:
                engine = resp.headers.get(ENGINE_HEADER)
                status = resp.status
                if resp.content_type != "text/event-stream":
                    raw = await resp.read()
                else:
                    raw = b""
                    async for line in resp.content:
                        answer.feed(line)
        except (TimeoutError, aiohttp.ClientError, ValueError) as e:
            # ValueError: a stream line over aiohttp's line limit (no engine sends one).
            return TaskOutcome(0, error=f"request failed: {type(e).__name__}: {e}")
        if raw or not 200 <= status < 300:
            try:
                doc = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                doc = None
            if 200 <= status < 300 and isinstance(doc, dict):
                return _outcome(status, doc, engine)
            return TaskOutcome(status, error=_error_text(status, doc, raw), engine=engine)
        if answer.error is not None:
            return TaskOutcome(status, error=answer.error, engine=engine)
        if not answer.done:
            return TaskOutcome(status, error="the engine's stream ended before its last event",
                               engine=engine)
        return _outcome(status, answer.completion(), engine)

    async def close(self) -> None:
        """Close the session."""
        if self._session is not None:
            await self._session.close()


def _outcome(status: int, doc: Json, engine: str | None) -> TaskOutcome:
    if _message(doc) is None:
        # A 2xx that is no chat completion (a broken engine or proxy): the task fails.
        return TaskOutcome(status, error="the engine's answer has no choices[0].message: "
                           + json.dumps(doc)[:300], engine=engine)
    usage = doc.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return TaskOutcome(status, doc, engine=engine,
                       cached_tokens=cached if isinstance(cached, int) else None)


class _StreamedAnswer:
    """A streamed chat completion put back together as the non-streamed one: the text, tool
    calls (their argument pieces joined by index), finish reason and usage."""

    def __init__(self) -> None:
        self.first: Json | None = None
        self.content: list[str] = []
        self.tool_calls: dict[int, Json] = {}
        self.finish_reason: str | None = None
        self.usage: Json | None = None
        self.error: str | None = None
        self.done = False

    def feed(self, line: bytes) -> None:
        """One line of the SSE stream."""
        if not line.startswith(b"data:"):
            return
        data = line[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return
        try:
            event = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError):
            self.error = f"unreadable stream event: {data[:200].decode(errors='replace')}"
            return
        if not isinstance(event, dict):
            return
        if isinstance(event.get("error"), dict):
            self.error = f"stream error: {event['error'].get('message')}"
            return
        if self.first is None:
            self.first = event
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            if isinstance(delta.get("content"), str):
                self.content.append(delta["content"])
            for call in delta.get("tool_calls") or ():
                slot = self.tool_calls.setdefault(
                    int(call.get("index", 0)),
                    {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                if call.get("id"):
                    slot["id"] = call["id"]
                fn = call.get("function") or {}
                slot["function"]["name"] += fn.get("name") or ""
                slot["function"]["arguments"] += fn.get("arguments") or ""
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def completion(self) -> Json:
        """The `chat.completion` object the non-streamed call would have answered."""
        first = self.first or {}
        message: Json = {"role": "assistant", "content": "".join(self.content)}
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        doc: Json = {"id": first.get("id"), "object": "chat.completion",
                     "created": first.get("created"), "model": first.get("model"),
                     "choices": [{"index": 0, "message": message,
                                  "finish_reason": self.finish_reason}]}
        if self.usage is not None:
            doc["usage"] = self.usage
        return doc


def _error_text(status: int, doc: Any, raw: bytes) -> str:
    message = None
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        message = doc["error"].get("message")
    if not isinstance(message, str):
        message = raw[:300].decode(errors="replace") or "(empty body)"
    return f"HTTP {status}: {message}"


def loopback_url(host: str, port: int) -> str:
    """Where this gateway answers itself (a wildcard bind address means localhost)."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


# -- one submitted workflow -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Wake:
    task: str


@dataclass(frozen=True)
class _Done:
    task: str
    outcome: TaskOutcome


@dataclass(frozen=True)
class _Note:
    """Facts about a running task that the proxy saw (engine, first token): no transition."""

    task: str
    fields: Json


@dataclass(frozen=True)
class _Cancel:
    pass


@dataclass(frozen=True)
class _Abandon:
    """Stop driving the workflow without ending it (another replica goes on with it)."""


@dataclass(frozen=True)
class _MoveNote:
    """A KV move the task's prompt was the origin of ended (listed in its record)."""

    task: str
    move: Json


_Message = _Wake | _Done | _Note | _MoveNote | _Cancel | _Abandon


@dataclass
class _Run:
    spec: Workflow
    dag: DagRun
    workflow: Json
    tasks: dict[str, Json]
    headers: dict[str, str]
    inbox: asyncio.Queue[_Message] = field(default_factory=asyncio.Queue)
    outputs: dict[str, str] = field(default_factory=dict)
    inflight: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    timers: dict[str, asyncio.TimerHandle] = field(default_factory=dict)
    over: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: bool = False
    abandoned: bool = False
    resumed: bool = False
    """Taken over from another replica: every task record is written at its first step."""
    resume_doc: Json | None = None
    """What a replica needs to go on with it (`WorkflowStore.save_resume`), kept here too so
    that records the store lost (a Redis restart without persistence) can be written again."""

    @property
    def id(self) -> str:
        return str(self.workflow["id"])


@dataclass
class _Changes:
    """What one step of a run changed: task records to write, events to append."""

    tasks: set[str] = field(default_factory=set)
    events: list[Json] = field(default_factory=list)


def task_record(after: Sequence[str], state: TaskState = TaskState.BLOCKED) -> Json:
    """A task's snapshot record before anything happened to it."""
    return {"state": state.value, "after": list(after), "engine": None, "request_id": None,
            "ready_s": None, "dispatched_s": None, "first_token_s": None, "finished_s": None,
            "prompt_tokens": None, "cached_tokens": None, "output_tokens": None,
            "output": None, "error": None}


def task_event(workflow_id: str, task: str, record: Mapping[str, Any]) -> Json:
    """The event for a task's transition: the task's record as it is now."""
    return {"type": "task", "workflow": workflow_id, "task": task, **record}


def workflow_event(workflow: Mapping[str, Any]) -> Json:
    """The last event of a workflow: how it ended."""
    return {"type": "workflow", "workflow": workflow["id"], "state": workflow["state"],
            "finished_s": workflow["finished_s"]}


def workflow_summary(snapshot: Json) -> Json:
    """A workflow as `GET /v1/workflows` lists it: its own fields, how many tasks are in each
    state, the engines its tasks ran on, and its prompt and cached token totals."""
    tasks = snapshot["tasks"].values()
    states: dict[str, int] = {}
    for t in tasks:
        states[t["state"]] = states.get(t["state"], 0) + 1
    return {**{k: v for k, v in snapshot.items() if k != "tasks"},
            "tasks": len(snapshot["tasks"]), "task_states": states,
            "engines": sorted({t["engine"] for t in tasks if t.get("engine")}),
            "prompt_tokens": sum(t.get("prompt_tokens") or 0 for t in tasks),
            # None when no task's engine reported it (vLLM reports cached tokens only with
            # --enable-prompt-tokens-details): unknown, not a cache that never hits.
            "cached_tokens": (None if all(t.get("cached_tokens") is None for t in tasks)
                              else sum(t.get("cached_tokens") or 0 for t in tasks))}


def hint_state(snapshot: Json) -> Json:
    """A hint-mode workflow's state from its tasks: running while a call is open, then done
    (failed if its latest call failed: an agent that went on after a failed call recovered
    from it) until the next call arrives."""
    tasks = snapshot["tasks"].values()
    terminal = {s.value for s in TERMINAL}
    if not tasks or any(t["state"] not in terminal for t in tasks):
        return {**snapshot, "state": "running", "finished_s": None}
    last = max(tasks, key=lambda t: t["finished_s"] or 0.0)
    failed = last["state"] == TaskState.FAILED.value
    return {**snapshot, "state": "failed" if failed else "done",
            "finished_s": last["finished_s"] or 0.0}


class WorkflowService:
    """Runs submitted workflows, serves `/v1/workflows`, and records hint-mode calls."""

    def __init__(
        self,
        settings: WorkflowSettings,
        store: WorkflowStore,
        executor: TaskExecutor,
        replica: str,
        known_models: Callable[[], list[str]] = list,
        clock: Callable[[], float] = time.time,
        notify: Callable[[Event], None] = lambda _: None,
        tracing: Tracing | None = None,
        call_limit: int | None = None,
    ) -> None:
        self.settings = settings
        self.call_limit = call_limit
        """The largest call body the gateway takes (`max_body_bytes`): no task's may be larger."""
        self.store = store
        self.executor = executor
        self.replica = replica
        self.known_models = known_models
        """Models the pool serves now (empty: unknown, so the model is not checked)."""
        self.clock = clock
        """Wall-clock epoch seconds: the store's timestamps are compared across replicas."""
        self.notify = notify
        """Where the planner hears of whole DAGs (`WorkflowSubmitted`, `WorkflowOver`), for its
        priorities."""
        self.tracing = tracing or Tracing.off()
        """Spans of the workflows run here (root, tasks), and the trace ids of hint-mode ones."""
        self._runs: dict[str, _Run] = {}
        self._drivers: set[asyncio.Task[None]] = set()
        self._hint_workflows: dict[str, tuple[bool, Any, float]] = {}
        """Per workflow id a hint-mode call named: whether it is a hint-mode workflow, its
        tenant, and when that was read."""
        self._hint_tasks: dict[tuple[str, str], Json] = {}
        self._hint_order: dict[str, dict[str, None]] = {}
        """Per hint-mode workflow (the latest _HINT_CACHE), its tasks in the order they came."""
        self._hint_attempts: dict[tuple[str, str], str | None] = {}
        """The token of each open hint-mode task's latest call."""
        self._listener: asyncio.Task[None] | None = None
        self.instance = f"{replica}/{uuid.uuid4().hex[:12]}"
        """This process among the replicas: what its workflow leases name."""
        self._leaser: asyncio.Task[None] | None = None
        self._heart: asyncio.Task[None] | None = None
        self._taker: asyncio.Task[None] | None = None
        self._handoff_listener: asyncio.Task[None] | None = None
        self._scan_now = asyncio.Event()
        self._stopping = asyncio.Event()
        """Set when the server stops: event streams end (their clients resume elsewhere)."""

    def routes(self, app: web.Application, expect: ExpectHandler | None = None) -> None:
        """Register the workflow API (`expect`: how a submission's `Expect: 100-continue` is
        answered)."""
        app.router.add_post("/v1/workflows", self.handle_create, expect_handler=expect)
        app.router.add_get("/v1/workflows", self.handle_list)
        app.router.add_get("/v1/workflows/{id}", self.handle_get)
        app.router.add_get("/v1/workflows/{id}/events", self.handle_events)
        app.router.add_delete("/v1/workflows/{id}", self.handle_delete)

    async def start(self) -> None:
        """Listen for cancels other replicas ask for; with a shared store, keep the leases of
        the workflows driven here and take over those no replica drives."""
        self._listener = asyncio.create_task(self._listen_for_cancels())
        if self.store.shared:
            try:
                await self.store.heartbeat(self.instance, self.settings.lease_s)
            except STORE_ERRORS as e:
                log.warning("workflow store: no heartbeat yet (%r); retried shortly", e)
            self._heart = asyncio.create_task(self._beat())
            self._leaser = asyncio.create_task(self._keep_leases())
            self._taker = asyncio.create_task(self._take_over())
            self._handoff_listener = asyncio.create_task(self._listen_for_handoffs())

    async def stop_runs(self) -> None:
        """Stop the workflows running here (the server calls this before it waits for the
        requests in flight, of which their task calls are some). With a shared store they are
        handed over: their calls in flight aborted, their leases given up, and another
        replica goes on from the tasks done. Otherwise they are cancelled. Event streams end
        at once, without a final event, so their clients reconnect (to another replica) with
        the last id they read: left open they kept the server from stopping for two minutes
        (aiohttp's shutdown timeout, twice)."""
        self._stopping.set()
        for task in (self._leaser, self._taker, self._handoff_listener):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._leaser = self._taker = self._handoff_listener = None
        runs = list(self._runs.values())
        for run in runs:
            run.inbox.put_nowait(_Abandon() if self.store.shared else _Cancel())
        if self._drivers:
            await asyncio.wait(self._drivers, timeout=CANCEL_WAIT_S)
        if self.store.shared and runs:
            for run in runs:  # given over on purpose: not a loss `MAX_RESUMES` counts
                run.workflow["handed_off"] = int(run.workflow.get("handed_off") or 0) + 1
                with contextlib.suppress(Exception):
                    await self.store.update(run.id, workflow=run.workflow, owner=self._owner)
            with contextlib.suppress(Exception):
                await self.store.release(self.instance, [run.id for run in runs])

    async def stop(self) -> None:
        """`stop_runs`, then release the store and the executor."""
        await self.stop_runs()
        if self._heart is not None:
            self._heart.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heart
            self._heart = None
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listener
        close = getattr(self.executor, "close", None)
        if close is not None:
            await close()
        await self.store.close()

    # -- the API ------------------------------------------------------------------------------

    async def submit(self, document: Any, headers: Mapping[str, str] | None = None,
                     trace_headers: Mapping[str, str] | None = None,
                     salted: bool = False) -> Json:
        """Validate a workflow spec, store it, start running it; its first snapshot.
        `headers` (e.g. Authorization) go with every task's request; `trace_headers` (the
        submitter's `traceparent`) parent the workflow's trace. `salted` (no tenants
        configured): the spec's `tenant` is its client's own `cache_salt`, which the record
        shows only as a label (`salt_label`)."""
        spec = self.validate(document)
        now = self.clock()
        wf_id = f"{spec.id or 'wf'}-{uuid.uuid4().hex[:16]}"
        trace_id = self.tracing.workflow_started(
            wf_id, trace_headers or {}, {"gen_ai.request.model": spec.model,
                                         "kvgate.workflow.tasks": len(spec.tasks)}, now)
        shown = spec.tenant if spec.tenant is None or not salted else salt_label(spec.tenant)
        workflow: Json = {"id": wf_id, "source": "api", "model": spec.model,
                          "tenant": shown, "state": "running", "created_s": now,
                          "finished_s": None, "replica": self.replica, "trace_id": trace_id}
        tasks = {t.id: task_record(dependencies(t)) for t in spec.tasks}
        nodes = [DagNode(t.id, dependencies(t), t.think_time_s) for t in spec.tasks]
        run = _Run(spec, DagRun(wf_id, nodes), workflow, tasks, dict(headers or {}))
        created = False
        try:
            if self.store.shared:
                await self.store.claim(wf_id, self.instance, self.settings.lease_s)
            if not await self.store.create(workflow, tasks):
                raise RuntimeError(f"workflow id {wf_id} collided")  # 64 random bits: never
            created = True
            if self.store.shared:
                run.resume_doc = {"spec": document, "headers": run.headers,
                                  "trace": dict(trace_headers or {})}
                await self.store.save_resume(wf_id, run.resume_doc)
        except BaseException as e:  # the store's errors, or the client gone: it does not run
            self.tracing.workflow_ended(wf_id, {**workflow, "state": "failed"})
            if created:
                # Stored but not started: said so, so that no replica takes it over later.
                failed = {**workflow, "state": "failed", "finished_s": self.clock(),
                          "error": "the workflow could not be stored whole; it was not started"}
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.store.update(
                        wf_id, workflow=failed, events=[workflow_event(failed)],
                        ttl_s=self.settings.ttl_s))
            if not isinstance(e, Exception):
                raise
            raise WorkflowStoreUnavailable(
                f"the workflow could not be stored ({type(e).__name__}: {e}); it was not "
                "started") from None
        self._runs[wf_id] = run
        self.notify(WorkflowSubmitted(wf_id, task_specs(spec, spec.tenant or "")))
        snapshot = {**workflow, "tasks": json.loads(json.dumps(tasks))}
        self._launch(run, None)
        return snapshot

    def _launch(self, run: _Run, first: list[Wakeup] | None) -> None:
        driver = asyncio.create_task(self._drive(run, first))
        self._drivers.add(driver)
        driver.add_done_callback(self._drivers.discard)

    async def resume(self, workflow_id: str) -> bool:
        """Go on with a workflow another replica was driving (this one holds its lease now):
        the tasks its snapshot records done keep their outputs, failed ones stay failed, and
        every other task starts over. False if there was nothing to go on with."""
        snap = await self.store.get(workflow_id)
        doc = await self.store.resume_document(workflow_id)
        if (snap is None or doc is None or snap.get("state") != "running"
                or workflow_id in self._runs):
            return False
        now = self.clock()
        workflow = {k: v for k, v in snap.items() if k != "tasks"}
        resumed = int(workflow.get("resumed") or 0) + 1
        workflow.update(replica=self.replica, resumed=resumed)
        recorded: dict[str, Json] = snap.get("tasks") or {}
        if (await self.store.cancel_requested([workflow_id])
                or any(r.get("state") == TaskState.CANCELLED.value for r in recorded.values())):
            # Its cancel was asked for (its replica died before it could act, or ended it
            # without the final write): it ends cancelled here, not run again.
            await self._end_undriven(workflow, recorded, TaskState.CANCELLED, now)
            return False
        try:
            lost = resumed - int(workflow.get("handed_off") or 0)
            if lost > MAX_RESUMES:
                raise InvalidRequest(f"taken over {lost - 1} times after its replica was "
                                     f"lost; the limit is {MAX_RESUMES}")
            spec = self.validate(doc.get("spec"))
            done = {t: str(r.get("output") or "") for t, r in recorded.items()
                    if r.get("state") == TaskState.DONE.value}
            failed = {t: str(r.get("error") or "failed") for t, r in recorded.items()
                      if r.get("state") == TaskState.FAILED.value}
            nodes = [DagNode(t.id, dependencies(t), t.think_time_s) for t in spec.tasks]
            dag = DagRun(workflow_id, nodes)
            first = dag.restore(done, failed, now)
        except (GatewayError, ValueError, KeyError) as e:
            error = f"cannot go on with it: {e}"
            log.warning("workflow %s: %s", workflow_id, error)
            await self._end_undriven(workflow, recorded, TaskState.FAILED, now, error=error)
            return False
        tasks = {t.id: (recorded[t.id] if dag.state(t.id) in TERMINAL and t.id in recorded
                        else task_record(dependencies(t))) for t in spec.tasks}
        run = _Run(spec, dag, workflow, tasks, dict(doc.get("headers") or {}), resumed=True,
                   resume_doc=doc)
        run.outputs = dict(done)
        self.tracing.workflow_started(
            workflow_id, dict(doc.get("trace") or {}),
            {"gen_ai.request.model": spec.model, "kvgate.workflow.tasks": len(spec.tasks),
             "kvgate.workflow.resumed": resumed}, float(workflow.get("created_s") or now))
        self._runs[workflow_id] = run
        self.notify(WorkflowSubmitted(workflow_id, task_specs(spec, spec.tenant or "")))
        log.info("workflow %s: taken over (%d of %d tasks done)", workflow_id, len(done),
                 len(spec.tasks))
        self._launch(run, first)
        return True

    async def _end_undriven(self, workflow: Json, tasks: Mapping[str, Json], end: TaskState,
                            now: float, **fields: Any) -> None:
        """End a workflow that no replica drives (this one holds its lease): its tasks not
        over end `end` (failed or cancelled), and so does the workflow, with `fields`."""
        terminal = {s.value for s in TERMINAL}
        changed = {t: {**r, "state": end.value, "finished_s": now, **fields}
                   for t, r in tasks.items() if r.get("state") not in terminal}
        wf_id = str(workflow["id"])
        workflow = {**workflow, "state": end.value, "finished_s": now, **fields}
        events = [task_event(wf_id, t, r) for t, r in changed.items()]
        await self.store.update(wf_id, workflow=workflow, tasks=changed,
                                events=[*events, workflow_event(workflow)],
                                ttl_s=self.settings.ttl_s, owner=self._owner)

    async def _beat(self) -> None:
        """Every third of the lease: this replica is alive, so the hint-mode calls it has open
        are not lost (`_settle_lost`). A task of its own that runs until the server is gone
        (`stop`): while it stops, the calls still in flight are answered, and must not read
        as lost meanwhile."""
        lease = self.settings.lease_s
        while True:
            await asyncio.sleep(lease / 3)
            try:
                await self.store.heartbeat(self.instance, lease)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("workflow store heartbeat: %r; retrying", e)

    async def _keep_leases(self) -> None:
        """Every third of the lease: renew the leases of the workflows driven here (one lost
        to another replica stops here), and act on cancels asked for while the announcement
        missed this replica. A task of its own, so that taking over many workflows at once
        (`_take_over`, whose checks of a large spec take a while) never lets them lapse."""
        lease = self.settings.lease_s
        while True:
            await asyncio.sleep(lease / 3)
            try:
                mine = [wf for wf, run in self._runs.items() if not run.abandoned]
                for wf in await self.store.renew(self.instance, mine, lease):
                    run = self._runs.get(wf)
                    if run is not None and not await self._recover(run):
                        log.warning("workflow %s: its lease passed to another replica; "
                                    "stopping here", wf)
                        run.inbox.put_nowait(_Abandon())
                # A cancel asked for while this replica's subscription was away.
                for wf in await self.store.cancel_requested(mine):
                    run = self._runs.get(wf)
                    if run is not None and not run.dag.over:
                        run.inbox.put_nowait(_Cancel())
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("workflow leases: %r; retrying", e)

    async def _take_over(self) -> None:
        """Every third of the lease, and at once when a stopping replica hands workflows
        over: take over the workflows nobody drives."""
        lease = self.settings.lease_s
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._scan_now.wait(), lease / 3)
            self._scan_now.clear()
            try:
                for wf in await self.store.orphans():
                    if wf in self._runs or not await self.store.claim(wf, self.instance, lease):
                        continue
                    if not await self.resume(wf):
                        await self.store.release(self.instance, [wf])
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("workflow leases: %r; retrying", e)

    async def _listen_for_handoffs(self) -> None:
        while True:
            try:
                async for _ in self.store.handoffs():
                    self._scan_now.set()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("workflow hand-off listener lost its subscription (%r); "
                            "retrying", e)
                await asyncio.sleep(1.0)

    def validate(self, document: Any) -> Workflow:
        """The spec, or InvalidRequest naming every problem (size, DAG, live-run limits)."""
        limit = self.settings.max_tasks
        tasks = document.get("tasks") if isinstance(document, dict) else None
        if isinstance(tasks, list) and len(tasks) > limit:
            raise InvalidRequest(f"the workflow has {len(tasks)} tasks; the limit is {limit} "
                                 "(workflows.max_tasks)", param="tasks")
        try:
            spec = load_workflow(document)
        except WorkflowError as e:
            raise InvalidRequest(f"invalid workflow: {e}") from None
        problems = runnable_problems(spec)
        if self.call_limit is not None:
            # Segments are sent whole in every call that uses them: a spec under its own limit
            # may make calls over the gateway's, each then refused with a 413.
            for task, size in call_size_floors(spec).items():
                if size > self.call_limit:
                    problems.append(f"task {task!r}'s call would be at least {size} bytes "
                                    f"(its segments and messages, before any parent's output);"
                                    f" the gateway takes calls of at most {self.call_limit} "
                                    "bytes (max_body_bytes)")
                    break
        if problems:
            raise InvalidRequest("invalid workflow: " + "; ".join(problems))
        models = self.known_models()
        if models and spec.model not in models:
            raise InvalidRequest(f"invalid workflow: model {spec.model!r} is not served; "
                                 f"available: {', '.join(models)}", param="model")
        return spec

    async def snapshot(self, workflow_id: str, viewer: Tenant | None = None) -> Json:
        """The workflow's current snapshot, or WorkflowNotFound (also when `viewer`, with
        tenants configured, is another tenant than its owner)."""
        with store_unavailable("read the workflow"):
            snap = (None if names_a_store_key(workflow_id)
                    else await self.store.get(workflow_id))
        if snap is None or (viewer is not None and not viewer.may_see(snap.get("tenant"))):
            raise WorkflowNotFound(f"no workflow {workflow_id!r} (unknown or expired)")
        if snap.get("source") != "hints":
            return snap
        with store_unavailable("read the workflow"):
            await self._settle_lost([snap])
        return hint_state(snap)

    async def recent(self, limit: int, viewer: Tenant | None = None) -> list[Json]:
        """Summaries of the newest `limit` workflows (see `workflow_summary`), newest first
        (`viewer`'s own, with tenants configured)."""
        with store_unavailable("list the workflows"):
            snaps = await self.store.recent(
                limit, None if viewer is None else lambda w: viewer.may_see(w.get("tenant")))
            await self._settle_lost(snaps)
        return [workflow_summary(hint_state(s) if s.get("source") == "hints" else s)
                for s in snaps]

    async def _settle_lost(self, snaps: Sequence[Json]) -> None:
        """Hint-mode calls left open by a replica that is gone (it crashed, or lost the store,
        mid-call: nothing else would ever end them) are failed, in `snaps` and in the store.
        They used to keep their workflow running until it expired (`ttl_s`), and a client's
        `wait` with it."""
        if not self.store.shared:
            return
        terminal = {s.value for s in TERMINAL}
        open_at: dict[str, list[tuple[Json, str, Json]]] = {}
        for snap in snaps:
            if snap.get("source") != "hints":
                continue
            for task, rec in snap["tasks"].items():
                where = rec.get("instance")
                if rec.get("state") not in terminal and where and where != self.instance:
                    open_at.setdefault(where, []).append((snap, task, rec))
        if not open_at:
            return
        alive = await self.store.alive(open_at)
        for where, calls in open_at.items():
            if where in alive:
                continue
            for snap, task, rec in calls:
                # Still the same open call in the store (its replica may have answered it
                # meanwhile, or the agent sent the task again)?
                now = await self.store.get(snap["id"])
                current = (now or {}).get("tasks", {}).get(task)
                if (current is None or current.get("state") in terminal
                        or current.get("request_id") != rec.get("request_id")):
                    if current is not None:
                        snap["tasks"][task] = current
                    continue
                # Its end is not known: it is placed when it was sent, so an agent's later
                # calls stay its latest.
                rec.update(state=TaskState.FAILED.value,
                           finished_s=rec.get("dispatched_s") or rec.get("ready_s")
                           or self.clock(),
                           error=f"lost: the gateway replica that took the call ({where}) "
                                 "stopped before it was answered")
                log.warning("workflow %s, task %s: %s", snap["id"], task, rec["error"])
                await self.store.update(snap["id"], tasks={task: rec},
                                        events=[task_event(snap["id"], task, rec)],
                                        ttl_s=self.settings.ttl_s)

    async def cancel(self, workflow_id: str, viewer: Tenant | None = None
                     ) -> tuple[Json, bool]:
        """Cancel a running workflow; its snapshot, and whether the cancel has landed yet."""
        if viewer is not None:
            await self.snapshot(workflow_id, viewer)  # another tenant's: 404
        run = self._runs.get(workflow_id)
        if run is not None and not run.dag.over:
            run.inbox.put_nowait(_Cancel())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(run.over.wait(), CANCEL_WAIT_S)
            if not run.over.is_set():
                return await self.snapshot(workflow_id), False
        snap = await self.snapshot(workflow_id)
        if run is not None and snap["state"] == "cancelled":
            return snap, True
        if snap["source"] == "hints":
            raise WorkflowNotCancellable(f"workflow {workflow_id!r} is driven by its client "
                                         "(hint mode); there is nothing to cancel here")
        if snap["state"] != "running":
            raise WorkflowNotCancellable(f"workflow {workflow_id!r} is already {snap['state']}")
        if (self.store.shared and workflow_id not in self._runs
                and await self.store.claim(workflow_id, self.instance, self.settings.lease_s)):
            # Nobody drives it now: its replica is gone, or has just ended it (its last write
            # gives up the lease), so read it again before ending it here.
            snap = await self.snapshot(workflow_id)
            if snap["state"] != "running":
                await self.store.release(self.instance, [workflow_id])
                raise WorkflowNotCancellable(f"workflow {workflow_id!r} is already "
                                             f"{snap['state']}")
            await self._end_undriven({k: v for k, v in snap.items() if k != "tasks"},
                                     snap.get("tasks") or {}, TaskState.CANCELLED,
                                     self.clock())
            return await self.snapshot(workflow_id), True
        await self.store.request_cancel(workflow_id)
        deadline = time.monotonic() + CANCEL_WAIT_S
        while time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            snap = await self.snapshot(workflow_id)
            if snap["state"] != "running":
                return snap, True
        return snap, False

    async def handle_create(self, request: web.Request) -> web.Response:
        """POST /v1/workflows: 201 with the new workflow's snapshot and its Location."""
        _, body = await read_json(request, self.settings.max_body_bytes)
        forward = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        trace = {k.lower(): v for k, v in request.headers.items()
                 if k.lower() in (TRACEPARENT, "tracestate")}
        for name, value in (*forward.items(), *trace.items()):
            if not value.isascii():  # it goes with every task's call
                raise InvalidRequest(f"header {name} must be ASCII", param=name)
        viewer = caller(request)
        if viewer is not None and isinstance(body, dict):
            if body.get("tenant") not in (None, viewer.name):
                raise InvalidRequest(f"`tenant` is set by your key (to {viewer.name!r}); "
                                     f"leave it out", param="tenant")
            body = {**body, "tenant": viewer.name}
        snap = await self.submit(body, forward, trace, salted=viewer is None)
        return web.json_response(snap, status=201, headers={
            "Location": f"/v1/workflows/{urllib.parse.quote(snap['id'], safe='')}"})

    async def handle_list(self, request: web.Request) -> web.Response:
        """GET /v1/workflows[?limit=N]: the newest workflows first, as summaries."""
        raw = request.query.get("limit")
        limit = LIST_DEFAULT
        if raw is not None:
            if not (raw.isascii() and raw.isdigit() and len(raw) <= 9) \
                    or not 1 <= int(raw) <= LIST_MAX:
                raise InvalidRequest(f"limit must be an integer from 1 to {LIST_MAX}, "
                                     f"got {raw!r}", param="limit")
            limit = int(raw)
        return web.json_response({"object": "list",
                                  "data": await self.recent(limit, caller(request))})

    async def handle_get(self, request: web.Request) -> web.Response:
        """GET /v1/workflows/{id}: the snapshot."""
        return web.json_response(await self.snapshot(request.match_info["id"],
                                                     caller(request)))

    async def handle_delete(self, request: web.Request) -> web.Response:
        """DELETE /v1/workflows/{id}: cancel; 200 once cancelled, 202 if still landing."""
        with store_unavailable("cancel the workflow"):
            snap, landed = await self.cancel(request.match_info["id"], caller(request))
        return web.json_response(snap, status=200 if landed else 202)

    async def handle_events(self, request: web.Request) -> web.StreamResponse:
        """GET /v1/workflows/{id}/events: every event from the start (or after `Last-Event-ID`),
        then new ones as they happen; ends after the workflow's final event."""
        wf_id = request.match_info["id"]
        first = await self.snapshot(wf_id, caller(request))  # 404 before the stream starts
        # An id names another workflow once its record expires (a hint-mode id is anyone's
        # to use then, another tenant's too): the stream follows only the one it began with.
        same = (first.get("created_s"), first.get("tenant"))
        last = request.headers.get("Last-Event-ID") or START
        if not EVENT_ID.fullmatch(last):
            raise InvalidRequest(f"Last-Event-ID must be an event id this stream sent (digits, "
                                 f"or digits-digits), got {last[:40]!r}", param="Last-Event-ID")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        quiet_since = time.monotonic()
        try:
            while not self._stopping.is_set():
                try:
                    waited = await self._unless_stopping(
                        self.store.events(wf_id, last, wait_s=SSE_KEEPALIVE_S))
                    if waited is None:
                        break  # the server is stopping: the client resumes elsewhere
                    batch = waited
                    # The workflow's own fields, not its task records (up to a thousand,
                    # outputs included), for every batch.
                    snap = await self.store.head(wf_id)
                    if snap is None or (snap.get("created_s"), snap.get("tenant")) != same:
                        break  # expired while we waited, or the id names another workflow
                    if not batch and snap.get("source") == "api" \
                            and snap.get("state") != "running":
                        # Over, and its final event already read (a client resuming at or
                        # after it): what the store appended with the final state, then the
                        # end. (A hint-mode workflow is never over: its next call goes on.)
                        batch = await self.store.events(wf_id, last)
                except STORE_ERRORS as e:
                    # Mid-stream there is no status to give: an error event, then the end.
                    # The client reconnects with the last id it read (`Last-Event-ID`).
                    error = {"type": "error", "error": {
                        "message": f"the workflow store could not be reached "
                                   f"({type(e).__name__}); reconnect with Last-Event-ID",
                        "code": WorkflowStoreUnavailable.code}}
                    await resp.write(f"data: {json.dumps(error)}\n\n".encode())
                    break
                for event_id, event in batch:
                    data = json.dumps(event, separators=(",", ":"))
                    await resp.write(f"id: {event_id}\ndata: {data}\n\n".encode())
                    last = event_id
                    if event["type"] == "workflow":
                        await resp.write_eof()
                        return resp
                if batch:
                    quiet_since = time.monotonic()
                elif snap.get("source") == "api" and snap.get("state") != "running":
                    break
                elif time.monotonic() - quiet_since >= SSE_KEEPALIVE_S * 0.9:
                    await resp.write(b": keep-alive\n\n")
                    quiet_since = time.monotonic()
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client stopped reading: its stream ends here, as it wished
        return resp

    async def _unless_stopping(self, read: Awaitable[T]) -> T | None:
        """`read`'s result, or None (with `read` cancelled) if the server begins to stop
        first."""
        job = asyncio.ensure_future(read)
        stop = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait((job, stop), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            job.cancel()
            stop.cancel()
            raise
        stop.cancel()
        if job.done():
            return job.result()
        job.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await job
        return None

    # -- running ------------------------------------------------------------------------------

    async def _drive(self, run: _Run, first: list[Wakeup] | None = None) -> None:
        """Carry the workflow from start (or, taken over, from `first`) to end: one message at
        a time, each step persisted (snapshot and events together) before the next."""
        try:
            changes = _Changes()
            if run.resumed:
                changes.tasks.update(run.tasks)
            self._think(run, run.dag.start(self.clock()) if first is None else first, changes)
            await self._persist(run, changes)
            while not run.dag.over and not run.abandoned:
                msg = await run.inbox.get()
                changes = _Changes()
                self._step(run, msg, changes)
                if changes.tasks or changes.events:
                    await self._persist(run, changes)
                if (isinstance(msg, _Cancel) or run.abandoned) and run.inflight:
                    # Their connections close now, so the engines abort the requests.
                    await asyncio.gather(*run.inflight.values(), return_exceptions=True)
            if run.abandoned:
                return
            wf = run.workflow
            if run.cancelled:
                wf["state"] = "cancelled"
            else:
                wf["state"] = "failed" if run.dag.failed else "done"
            wf["finished_s"] = self.clock()
            await self._write(run, workflow=wf, events=[workflow_event(wf)],
                              ttl_s=self.settings.ttl_s)
        except Exception as e:
            # Its state could not be written (the store is away past every retry), or a bug:
            # its calls are aborted, and with a shared store its lease lapses and another
            # replica goes on from what was written. With the memory store nobody would: it
            # ends failed here, so that no workflow reads `running` for ever.
            log.exception("workflow %s: its driver failed", run.id)
            for job in run.inflight.values():
                job.cancel()
            if not self.store.shared:
                run.workflow = {**run.workflow, "state": "failed"}
                with contextlib.suppress(Exception):
                    await self._end_undriven(run.workflow, run.tasks, TaskState.FAILED,
                                             self.clock(),
                                             error=f"the gateway failed to run it: {e!r}")
        finally:
            for handle in run.timers.values():
                handle.cancel()
            self._runs.pop(run.id, None)
            self.tracing.workflow_ended(run.id, {**run.workflow, "state": "handed over"}
                                        if run.abandoned else run.workflow)
            self.notify(WorkflowOver(run.id))
            run.over.set()

    def _step(self, run: _Run, msg: _Message, changes: _Changes) -> None:
        now = self.clock()
        dag = run.dag
        match msg:
            case _Wake(task=task):
                run.timers.pop(task, None)
                if dag.state(task) is not TaskState.THINKING:
                    return  # cancelled while it thought
                dag.wake(task, now)
                self._record(run, task, changes, ready_s=now)
                dag.dispatched(task, now)
                self._record(run, task, changes, dispatched_s=now,
                             request_id=f"{run.id}/{task}")
                job = asyncio.create_task(self._execute(run, task))
                run.inflight[task] = job
            case _Done(task=task, outcome=outcome):
                run.inflight.pop(task, None)
                if dag.state(task) is not TaskState.RUNNING:
                    return
                if outcome.ok:
                    text = outcome.output
                    run.outputs[task] = text
                    wakeups = dag.finished(task, now, text)
                    self._record(run, task, changes, finished_s=now, output=text,
                                 engine=outcome.engine or run.tasks[task]["engine"],
                                 prompt_tokens=outcome.usage("prompt_tokens"),
                                 output_tokens=outcome.usage("completion_tokens"),
                                 cached_tokens=outcome.cached_tokens)
                    self._think(run, wakeups, changes)
                else:
                    error = outcome.error or (
                        f"the engine ended the call with finish_reason {outcome.finish_reason!r}"
                        if outcome.finish_reason in BROKEN_FINISH else f"HTTP {outcome.status}")
                    skipped = dag.fail(task, now, error)
                    self._record(run, task, changes, finished_s=now, error=error,
                                 engine=outcome.engine or run.tasks[task]["engine"])
                    for s in skipped:
                        self._record(run, s, changes, finished_s=now, error=dag.tasks[s].error)
            case _Note(task=task, fields=fields):
                if task in run.tasks and dag.state(task) is TaskState.RUNNING:
                    run.tasks[task].update(fields)
                    changes.tasks.add(task)
            case _MoveNote(task=task, move=move):
                if task in run.tasks:
                    run.tasks[task].setdefault("kv_moves", []).append(move)
                    changes.tasks.add(task)
            case _Abandon():
                self._abandon(run)
            case _Cancel():
                if dag.over:
                    return
                run.cancelled = True
                open_tasks = [t for t in run.tasks if dag.state(t) not in TERMINAL]
                dag.cancel(now)
                for t in open_tasks:
                    self._record(run, t, changes, finished_s=now)
                for t in list(run.timers):
                    run.timers.pop(t).cancel()
                for job in run.inflight.values():
                    job.cancel()

    def _think(self, run: _Run, wakeups: list[Wakeup], changes: _Changes) -> None:
        """Tasks whose dependencies are done start their think time (a timer each)."""
        loop = asyncio.get_running_loop()
        now = self.clock()
        for w in wakeups:
            self._record(run, w.task, changes)
            run.timers[w.task] = loop.call_later(max(0.0, w.at - now), run.inbox.put_nowait,
                                                 _Wake(w.task))

    def _record(self, run: _Run, task: str, changes: _Changes, **fields: Any) -> None:
        """The task's record follows its DAG state (plus `fields`); one event per call."""
        rec = run.tasks[task]
        rec.update(fields)
        rec["state"] = run.dag.state(task).value
        self.tracing.task_changed(run.id, task, rec)
        changes.tasks.add(task)
        changes.events.append(task_event(run.id, task, rec))

    async def _persist(self, run: _Run, changes: _Changes) -> None:
        await self._write(run, workflow=run.workflow,
                          tasks={t: run.tasks[t] for t in changes.tasks}, events=changes.events)

    async def _write(self, run: _Run, **update: Any) -> None:
        """Write the run's state (`WorkflowStore.update`), fenced by its lease, again after
        each of PERSIST_RETRIES_S when the store fails; a refused write means another replica
        has taken the workflow over."""
        for delay in (*PERSIST_RETRIES_S, None):
            try:
                written = await self.store.update(run.id, owner=self._owner, **update)
                break
            except Exception as e:  # the store's errors: a Redis blip, a failover
                if delay is None:
                    raise
                log.warning("workflow %s: its state could not be written (%r); again in "
                            "%.1f s", run.id, e, delay)
                await asyncio.sleep(delay)
        if not written and await self._recover(run):
            written = await self.store.update(run.id, owner=self._owner, **update)
        if not written:
            self._lost(run)

    async def _recover(self, run: _Run) -> bool:
        """A write of the run was refused, or its lease was not renewed, because the store no
        longer has the workflow at all (Redis restarted without persistence, or lost its
        data): write it again from this replica's state and go on, rather than stop driving
        a workflow no replica could then take over. False if the store still has it (another
        replica took it over) or it could not be written again."""
        if not self.store.shared or run.resume_doc is None or run.abandoned:
            return False
        try:
            if await self.store.get(run.id) is not None:
                return False
            if not await self.store.claim(run.id, self.instance, self.settings.lease_s):
                return False
            if not await self.store.create(run.workflow, run.tasks):
                # Written again a moment ago (the lease renewal and a write both found it
                # gone): recovered if this replica holds it.
                return not await self.store.renew(self.instance, [run.id],
                                                  self.settings.lease_s)
            await self.store.save_resume(run.id, run.resume_doc)
        except Exception as e:  # the store away again: the usual loss
            log.warning("workflow %s: could not write it again (%r)", run.id, e)
            return False
        log.warning("workflow %s: the store had lost it (a Redis restart?); written again "
                    "from this replica's state, it goes on", run.id)
        return True

    @property
    def _owner(self) -> str | None:
        """What fences this replica's writes to the workflows it drives (shared store)."""
        return self.instance if self.store.shared else None

    def _abandon(self, run: _Run) -> None:
        """Stop driving the run: its timers stop and its calls in flight are aborted."""
        run.abandoned = True
        for t in list(run.timers):
            run.timers.pop(t).cancel()
        for job in run.inflight.values():
            job.cancel()

    def _lost(self, run: _Run) -> None:
        """A write was refused: another replica took the workflow over (this one's lease
        lapsed, e.g. while it stalled). It goes on there; here it stops."""
        if not run.abandoned:
            log.warning("workflow %s: another replica has taken it over; stopping here", run.id)
            self._abandon(run)

    async def _execute(self, run: _Run, task: str) -> None:
        spec = run.spec
        try:
            body = render_task(spec, task, run.outputs, self.call_limit)
        except WorkflowError as e:
            # Its parents' outputs made the call larger than the gateway takes: the task fails
            # (its dependents are skipped) before the body is built.
            run.inbox.put_nowait(_Done(task, TaskOutcome(0, error=str(e))))
            return
        parents = dependencies(spec.task(task))
        after = ",".join(parents)
        headers = {**run.headers, WORKFLOW_HEADER: run.id, TASK_HEADER: task,
                   "x-request-id": f"{run.id}/{task}", **self.tracing.task_headers(run.id, task)}
        priority = spec.task(task).priority
        if priority:
            headers[PRIORITY_HEADER] = str(priority)
        if spec.deadline_s is not None:
            # The workflow's deadline as what is left of it when this task's call goes out.
            left = spec.deadline_s - (self.clock() - float(run.workflow["created_s"]))
            headers[DEADLINE_HEADER] = repr(max(left, MIN_DEADLINE_S))
        if len(after) > MAX_AFTER_HEADER:
            # A wide join's parents overflow a header (aiohttp takes 8,190 bytes): the body's
            # `kvgate` field says the same, and is stripped before the engine sees it.
            body[BODY_FIELD] = {"after": list(parents)}
        elif after:
            headers[AFTER_HEADER] = after
        try:
            outcome = await self.executor.execute(body, headers)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # an executor bug must fail the task, not hang the workflow
            log.exception("workflow %s, task %s: executor raised", run.id, task)
            outcome = TaskOutcome(0, error=f"executor failed: {type(e).__name__}: {e}")
        run.inbox.put_nowait(_Done(task, outcome))

    async def _listen_for_cancels(self) -> None:
        while True:
            try:
                async for wf_id in self.store.cancel_requests():
                    run = self._runs.get(wf_id)
                    if run is not None:
                        run.inbox.put_nowait(_Cancel())
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("workflow cancel listener lost its subscription (%r); retrying", e)
                await asyncio.sleep(1.0)

    # -- hint mode: called by the proxy for calls that name a workflow --------------------------

    async def check_owner(self, workflow: str, tenant: str) -> None:
        """With tenants configured, before a call naming `workflow` goes anywhere: it must be
        `tenant`'s or not exist yet (WorkflowNotFound otherwise; WorkflowStoreUnavailable
        when the store cannot say)."""
        run = self._runs.get(workflow)
        if run is not None:
            owner = run.workflow.get("tenant")
        else:
            known = self._known_hint(workflow)
            if known is not None:
                owner = known[1]
            else:
                try:
                    snap = await asyncio.wait_for(self.store.get(workflow), STORE_READ_S)
                except Exception as e:  # TimeoutError, the store's own errors
                    raise WorkflowStoreUnavailable(
                        f"the workflow store could not be read ({type(e).__name__}): a call "
                        "naming a workflow needs it, to check the workflow is yours") from None
                if snap is None:
                    return  # new: its first call makes it the caller's
                owner = snap.get("tenant")
        if owner != tenant:
            raise WorkflowNotFound(f"no workflow {workflow!r} of yours")

    async def hinted_task_started(self, workflow: str, task: str, after: Sequence[str],
                                  request_id: str, model: str, tenant: str | None = None,
                                  attempt: str | None = None, owned: bool = False) -> None:
        """A call naming `workflow`/`task` arrived. For a workflow of the API (its own task
        calls) this is a no-op; otherwise the call becomes a task of a hint-mode workflow,
        created on its first call. `attempt`: a token unique to this call, which its later
        news carries (see `_hint_attempt`). `owned` (tenants configured): the workflow must
        be `tenant`'s, else WorkflowNotFound."""
        run = self._runs.get(workflow)
        if run is not None:
            if owned and run.workflow.get("tenant") != tenant:
                raise WorkflowNotFound(f"no workflow {workflow!r} of yours")
            return
        hints, owner = await self._is_hint_workflow(workflow, model, tenant)
        if owned and owner != tenant:
            raise WorkflowNotFound(f"no workflow {workflow!r} of yours")
        if not hints:
            return
        rec = task_record(after, TaskState.READY)
        rec.update(request_id=request_id, ready_s=self.clock(), instance=self.instance)
        self._hint_attempts[(workflow, task)] = attempt
        try:
            await self._hint_write(workflow, task, rec)
        except BaseException:
            # Not recorded: nothing of the call will be (the proxy goes on without it).
            if self._hint_attempts.get((workflow, task)) == attempt:
                self._hint_attempts.pop((workflow, task), None)
                self._hint_tasks.pop((workflow, task), None)
            raise

    def _hint_attempt(self, workflow: str, task: str, attempt: str | None) -> Json | None:
        """The task's open record, if the call `attempt` is its latest: a client that sends
        the same task again while the first call is in flight (a retry after a timeout) makes
        the new call the task's, and the older one's news is dropped. Matched by a token of
        the call's own, not its request id, which a retry may reuse once the first call's
        handler is over and its last news still on the way."""
        rec = self._hint_tasks.get((workflow, task))
        if rec is None or (attempt is not None
                           and self._hint_attempts.get((workflow, task)) != attempt):
            return None
        return rec

    async def hinted_task_dispatched(self, workflow: str, task: str, engine: str,
                                     attempt: str | None = None, at: float | None = None
                                     ) -> None:
        """The call was sent to `engine` (`at`, on `clock`; by default now)."""
        now = self.clock() if at is None else at
        run = self._runs.get(workflow)
        if run is not None:
            run.inbox.put_nowait(_Note(task, {"engine": engine, "dispatched_s": now}))
            return
        rec = self._hint_attempt(workflow, task, attempt)
        if rec is not None:
            rec.update(state=TaskState.RUNNING.value, engine=engine, dispatched_s=now)
            await self._hint_write(workflow, task, rec)

    async def note_move(self, workflow: str, task: str, move: Json) -> None:
        """A KV move whose origin was this task's prompt ended: its record lists it, with
        when it started and ended (`started_s` from its `seconds`, and `ended_s`, on the clock
        of the tasks' own times)."""
        now = self.clock()
        move = {**move, "started_s": now - float(move.get("seconds") or 0.0), "ended_s": now}
        run = self._runs.get(workflow)
        if run is not None:
            run.inbox.put_nowait(_MoveNote(task, move))
            return
        rec = self._hint_tasks.get((workflow, task))
        if rec is not None:
            rec.setdefault("kv_moves", []).append(move)
            await self._hint_write(workflow, task, rec, event=False)

    async def hinted_first_token(self, workflow: str, task: str,
                                 attempt: str | None = None, at: float | None = None) -> None:
        """The engine started answering the call (a streamed first chunk), `at` (epoch s;
        default now: the proxy passes when it saw it, as its writes may queue)."""
        now = self.clock() if at is None else at
        run = self._runs.get(workflow)
        if run is not None:
            run.inbox.put_nowait(_Note(task, {"first_token_s": now}))
            return
        rec = self._hint_attempt(workflow, task, attempt)
        if rec is not None:
            rec["first_token_s"] = now
            await self._hint_write(workflow, task, rec, event=False)

    async def hinted_task_finished(
        self, workflow: str, task: str, *, prompt_tokens: int | None = None,
        output_tokens: int | None = None, cached_tokens: int | None = None,
        output: str | None = None, error: str | None = None, cancelled: bool = False,
        attempt: str | None = None, at: float | None = None,
    ) -> None:
        """The call ended (`at`, epoch s; default now): answered, or failed with `error`, or
        `cancelled` (its client went away; `error` says when). `attempt`: the call's token,
        when another may have taken its task over."""
        if workflow in self._runs:
            return
        rec = self._hint_attempt(workflow, task, attempt)
        if rec is None:
            return
        del self._hint_tasks[(workflow, task)]
        state = (TaskState.DONE if error is None else
                 TaskState.CANCELLED if cancelled else TaskState.FAILED)
        rec.update(state=state.value, finished_s=self.clock() if at is None else at,
                   prompt_tokens=prompt_tokens,
                   output_tokens=output_tokens, cached_tokens=cached_tokens, output=output,
                   error=error)
        await self._hint_write(workflow, task, rec)

    def _known_hint(self, workflow: str) -> tuple[bool, Any] | None:
        """What the cache says of `workflow` (hint mode?, tenant) while fresh: it is re-read
        now and then, as an idle hint-mode workflow expires from the store."""
        known = self._hint_workflows.get(workflow)
        if known is None or time.monotonic() - known[2] >= self.settings.ttl_s / 2:
            return None
        return known[0], known[1]

    async def _is_hint_workflow(self, workflow: str, model: str, tenant: str | None
                                ) -> tuple[bool, Any]:
        """Whether `workflow` is a hint-mode one (made now if it is new), and its tenant."""
        known = self._known_hint(workflow)
        if known is not None:
            return known
        meta: Json = {"id": workflow, "source": "hints", "model": model, "tenant": tenant,
                      "state": "running", "created_s": self.clock(), "finished_s": None,
                      "replica": self.replica,
                      "trace_id": trace_hex(workflow_trace_id(workflow))
                      if self.tracing.enabled else None}
        owner: Any = tenant
        if await self.store.create(meta, {}):
            hints = True
        else:
            snap = await self.store.get(workflow)
            hints = snap is not None and snap.get("source") == "hints"
            owner = snap.get("tenant") if snap is not None else tenant
        self._hint_workflows.pop(workflow, None)
        if len(self._hint_workflows) >= _HINT_CACHE:
            self._hint_workflows.pop(next(iter(self._hint_workflows)))
        self._hint_workflows[workflow] = (hints, owner, time.monotonic())
        return hints, owner

    async def _hint_write(self, workflow: str, task: str, rec: Json, event: bool = True) -> None:
        if rec["state"] in {s.value for s in TERMINAL}:
            self._hint_tasks.pop((workflow, task), None)
            self._hint_attempts.pop((workflow, task), None)
        else:
            self._hint_tasks[(workflow, task)] = rec
        # A hint-mode workflow keeps the records of its latest MAX_HINT_TASKS tasks (as this
        # replica saw them arrive): its client may call for weeks.
        order = self._hint_order.pop(workflow, None) or {}
        self._hint_order[workflow] = order
        if len(self._hint_order) > _HINT_CACHE:
            del self._hint_order[next(iter(self._hint_order))]
        drop: list[str] = []
        if task not in order:
            order[task] = None
            while len(order) > MAX_HINT_TASKS:
                old = next(iter(order))
                del order[old]
                drop.append(old)
                self._hint_tasks.pop((workflow, old), None)
                self._hint_attempts.pop((workflow, old), None)
        # Hint-mode workflows never say they are over: they expire ttl_s after their last call.
        await self.store.update(workflow, tasks={task: rec},
                                events=[task_event(workflow, task, rec)] if event else (),
                                ttl_s=self.settings.ttl_s, drop_tasks=drop)
