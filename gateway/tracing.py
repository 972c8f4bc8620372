"""Traces (OpenTelemetry): one trace per workflow, spans per task and per engine call, built from
what the proxy, the KV mover and the workflow service already see.

Span tree (names as exported):

    workflow {id}                    API workflows: POST to end (none for hint-mode workflows)
      task {id}                      from ready (think time over) to done
        chat {model}                 the gateway's handling of the task's call (SERVER)
          buffer wait                admitted to the planner until dispatched
          placement                  the planner's decision: engine, cost, runners-up
          kv transfer | warm-up      a KV move whose origin is this call's prompt
          engine call                one attempt at an engine (CLIENT; its context is the
            time to first token      `traceparent` the engine receives)
            decode

A plain call without workflow hints is a trace of its own rooted at `chat {model}`.

Trace ids: an API workflow's trace is the POST's (when it carries a W3C `traceparent`, the
workflow span is its child), else derived from the workflow id. A hint-mode workflow's trace id
is always derived from its id (`workflow_trace_id`), so every call of it, on any replica, lands
in one trace; each call is a root `task {id}` span there, and a client `traceparent` from another
trace becomes a span link. A call whose `traceparent` is already in the workflow's trace (the
workflow service's own task calls) is that span's child.

The planner stays sans-IO: it hands its decision (`Dispatch`, with `runners_up`) to the proxy,
which reports it here with wall-clock times.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from itertools import islice
from typing import Any
from urllib.parse import urlparse

from aiohttp import web
from opentelemetry import trace as otel
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.config import TracingSettings
from gateway.errors import GatewayError, InvalidRequest
from planner.actions import Dispatch, Transfer, Warm
from planner.cost import PlacementCost

TRACEPARENT = "traceparent"
WORKFLOW_ATTR = "kvgate.workflow.id"
MAX_ATTR_CHARS = 1024
"""A span's name, a string attribute or a status description is cut to this many characters,
and a list attribute to `MAX_ATTR_ITEMS` items: what a client sends (a model name, a `user`,
a join's parents) ends up in spans, which the memory store keeps and exporters send in
batches a collector caps (4 MiB by gRPC's default)."""
MAX_ATTR_ITEMS = 256


def _bounded(value: Any) -> Any:
    if isinstance(value, str):
        return value[:MAX_ATTR_CHARS]
    if isinstance(value, list | tuple):
        return tuple(_bounded(v) for v in value[:MAX_ATTR_ITEMS])
    return value
_PROPAGATOR = TraceContextTextMapPropagator()
_FORCED_TRACE_ID: ContextVar[int | None] = ContextVar("kvgate_forced_trace_id", default=None)

Attrs = dict[str, Any]


def workflow_trace_id(workflow_id: str) -> int:
    """The trace id of a workflow whose trace nobody else chose: the same on every replica."""
    digest = hashlib.sha256(f"kvgate-workflow:{workflow_id}".encode()).digest()
    return int.from_bytes(digest[:16], "big") or 1


def trace_hex(trace_id: int) -> str:
    """A trace id as W3C writes it (32 hex digits)."""
    return f"{trace_id:032x}"


class _WorkflowIds(RandomIdGenerator):
    """Random ids, except a root span started under `_forced` gets the trace id given there."""

    def generate_trace_id(self) -> int:
        forced = _FORCED_TRACE_ID.get()
        return forced if forced is not None else super().generate_trace_id()


@contextlib.contextmanager
def _forced(trace_id: int | None) -> Iterator[None]:
    token = _FORCED_TRACE_ID.set(trace_id)
    try:
        yield
    finally:
        _FORCED_TRACE_ID.reset(token)


def _ns(epoch_s: float) -> int:
    return int(epoch_s * 1e9)


# -- the memory store -----------------------------------------------------------------------------


def _by_start(spans: Sequence[ReadableSpan]) -> list[Attrs]:
    return sorted((span_json(s) for s in spans), key=lambda s: (s["start_s"], s["end_s"]))


def span_json(span: ReadableSpan) -> Attrs:
    """One finished span as the gateway serves it."""
    ctx = span.context
    assert ctx is not None
    start = (span.start_time or 0) / 1e9
    end = (span.end_time or span.start_time or 0) / 1e9
    return {
        "name": span.name,
        "trace_id": trace_hex(ctx.trace_id),
        "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{span.parent.span_id:016x}" if span.parent is not None else None,
        "kind": span.kind.name.lower(),
        "start_s": start,
        "end_s": end,
        "duration_s": round(end - start, 9),
        "attributes": {k: list(v) if isinstance(v, tuple) else v
                       for k, v in (span.attributes or {}).items()},
        "status": {"code": span.status.status_code.name.lower(),
                   "description": span.status.description},
        "events": [{"name": e.name, "time_s": e.timestamp / 1e9,
                    "attributes": dict(e.attributes or {})} for e in span.events],
        "links": [{"trace_id": trace_hex(li.context.trace_id),
                   "span_id": f"{li.context.span_id:016x}"} for li in span.links],
    }


TRACE_SINCE_KEY = web.RequestKey("kvgate.trace_since_ns", int)
"""On a `/v1/workflows/{id}/trace` request: when the workflow's record was made (ns), set where
the caller's right to read it was checked."""


class MemoryStore(SpanExporter):
    """The last `max_traces` traces (least recently active dropped first), each its latest
    `max_spans` spans (older ones dropped and counted), for `GET /v1/traces`."""

    def __init__(self, max_traces: int, max_spans: int, max_total: int | None = None) -> None:
        self.max_traces = max_traces
        self.max_spans = max_spans
        self.max_total = max_total if max_total is not None else max_traces * max_spans
        """Spans kept in all: past it, the least recently active traces go first."""
        self._total = 0
        self._traces: OrderedDict[int, deque[ReadableSpan]] = OrderedDict()
        self._dropped: dict[int, int] = {}
        self._workflow_of: dict[int, str] = {}
        """The first workflow a trace's spans named (what the operator's listing shows)."""
        self._named: dict[int, set[str]] = {}
        """Every workflow a kept trace's spans name."""
        self._traces_of: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Keep the spans (called as each span ends)."""
        with self._lock:
            for span in spans:
                assert span.context is not None
                tid = span.context.trace_id
                kept = self._traces.get(tid)
                if kept is None:
                    kept = self._traces[tid] = deque(maxlen=self.max_spans)
                    while len(self._traces) > self.max_traces:
                        self._evict(next(iter(self._traces)))
                else:
                    self._traces.move_to_end(tid)
                if len(kept) == kept.maxlen:
                    self._dropped[tid] = self._dropped.get(tid, 0) + 1
                else:
                    self._total += 1
                kept.append(span)
                while self._total > self.max_total and len(self._traces) > 1:
                    oldest = next(iter(self._traces))
                    self._evict(oldest if oldest != tid else next(islice(self._traces, 1, 2)))
                workflow = (span.attributes or {}).get(WORKFLOW_ATTR)
                if isinstance(workflow, str):
                    self._workflow_of.setdefault(tid, workflow)
                    named = self._named.setdefault(tid, set())
                    if workflow not in named:
                        named.add(workflow)
                        self._traces_of.setdefault(workflow, []).append(tid)
                        if len(named) > 2 * len(kept) + 16:
                            self._unname(tid, kept)
        return SpanExportResult.SUCCESS

    def _unname(self, tid: int, kept: deque[ReadableSpan]) -> None:
        """Forget the workflows none of the trace's kept spans name any more: API workflows
        submitted under one client `traceparent` share a trace, whose spans are capped while
        the names it had seen grew with every workflow (100,000 of them: 29 MB)."""
        still = {w for s in kept if isinstance(w := (s.attributes or {}).get(WORKFLOW_ATTR), str)}
        named = self._named[tid]
        for workflow in named - still:
            ids = self._traces_of.get(workflow, [])
            if tid in ids:
                ids.remove(tid)
            if not ids:
                self._traces_of.pop(workflow, None)
        self._named[tid] = named & still

    def _evict(self, tid: int) -> None:
        self._total -= len(self._traces.pop(tid))
        self._dropped.pop(tid, None)
        self._workflow_of.pop(tid, None)
        for workflow in self._named.pop(tid, ()):
            ids = self._traces_of.get(workflow, [])
            if tid in ids:
                ids.remove(tid)
            if not ids:
                self._traces_of.pop(workflow, None)

    def shutdown(self) -> None:
        """Nothing to release."""

    def summaries(self, limit: int) -> list[Attrs]:
        """The most recently active traces first."""
        with self._lock:
            items = [(tid, list(spans), self._workflow_of.get(tid), self._dropped.get(tid, 0))
                     for tid, spans in list(self._traces.items())[-limit:]]
        return [self._summary(*item) for item in reversed(items)]

    def spans(self, trace_id: int) -> list[Attrs] | None:
        """A trace's spans by start time; None if it is not kept."""
        with self._lock:
            spans = list(self._traces.get(trace_id) or ())
        if not spans:
            return None
        return _by_start(spans)

    def dropped(self, trace_id: int) -> int:
        """Spans of a kept trace dropped for its cap (the oldest first)."""
        with self._lock:
            return self._dropped.get(trace_id, 0)

    def workflow_spans(self, workflow_id: str, since_ns: int | None = None
                       ) -> tuple[int, list[Attrs], int] | None:
        """The spans of one workflow (None if none is kept): those that name it and the spans
        under them, never another's, though a client's `traceparent` may put other calls in
        the same trace. With the first such trace's id and the spans its traces dropped.
        `since_ns`: only the spans naming it that ended since (the workflow's record was made
        then; a hint-mode id used before, by a workflow whose record expired, names its
        spans too)."""
        with self._lock:
            ids = list(self._traces_of.get(workflow_id, ()))
            traces = [list(self._traces.get(tid) or ()) for tid in ids]
            dropped = sum(self._dropped.get(tid, 0) for tid in ids)
        mine: list[ReadableSpan] = []
        for spans in traces:
            children: dict[int, list[ReadableSpan]] = {}
            todo: list[ReadableSpan] = []
            for s in spans:
                named = (s.attributes or {}).get(WORKFLOW_ATTR)
                if named == workflow_id:
                    if since_ns is None or (s.end_time or 0) >= since_ns:
                        todo.append(s)
                elif named is None and s.parent is not None:
                    children.setdefault(s.parent.span_id, []).append(s)
            while todo:
                s = todo.pop()
                mine.append(s)
                assert s.context is not None
                todo.extend(children.pop(s.context.span_id, ()))
        if not mine:
            return None
        return ids[0], _by_start(mine), dropped

    def workflow_of(self, trace_id: int) -> str | None:
        """The workflow a kept trace belongs to (the first its spans named), if any."""
        with self._lock:
            return self._workflow_of.get(trace_id)

    @staticmethod
    def _summary(tid: int, spans: list[ReadableSpan], workflow: str | None, dropped: int
                 ) -> Attrs:
        ids = {s.context.span_id for s in spans if s.context is not None}
        roots = [s for s in spans if s.parent is None or s.parent.span_id not in ids]
        root = min(roots or spans, key=lambda s: s.start_time or 0)
        start = min(s.start_time or 0 for s in spans) / 1e9
        end = max(s.end_time or 0 for s in spans) / 1e9
        return {"trace_id": trace_hex(tid), "workflow_id": workflow,
                "root": root.name, "start_s": start, "duration_s": round(end - start, 9),
                "spans": len(spans), "dropped_spans": dropped}


class _StoreProcessor(SpanProcessor):
    """Hands each ended span to the memory store at once (SimpleSpanProcessor's per-span
    context switch is not needed: the store does no I/O that could be traced)."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store

    def on_end(self, span: ReadableSpan) -> None:
        """Keep the span if it was sampled."""
        if span.context is not None and span.context.trace_flags.sampled:
            self.store.export((span,))


# -- per call -------------------------------------------------------------------------------------


class _FinishedLater(otel.NonRecordingSpan):
    """A span of a proxied call (the call, an engine attempt): ids now, so children and the
    engine's `traceparent` can point at it, and made a finished span once it ends, without the
    SDK's live-span bookkeeping."""

    def __init__(self, tracing: Tracing, name: str, parent: otel.SpanContext | None,
                 kind: otel.SpanKind, start_ns: int, attributes: Attrs) -> None:
        sampled = parent is None or not parent.is_valid or parent.trace_flags.sampled
        if parent is not None and parent.is_valid:
            trace_id, state = parent.trace_id, parent.trace_state
        else:
            trace_id, state = tracing.new_trace_id(), otel.TraceState()
        super().__init__(otel.SpanContext(
            trace_id, tracing.new_span_id(), is_remote=False,
            trace_flags=otel.TraceFlags(otel.TraceFlags.SAMPLED if sampled else 0),
            trace_state=state))
        self._tracing = tracing
        self._name = name
        self._parent = parent if parent is not None and parent.is_valid else None
        self._kind = kind
        self._start_ns = start_ns
        self._attributes = attributes
        self._status = otel.Status(otel.StatusCode.UNSET)
        self._ended = False

    def is_recording(self) -> bool:
        return not self._ended

    def set_attribute(self, key: str, value: Any) -> None:
        if not self._ended:
            self._attributes[key] = value

    def set_status(self, status: Any, description: str | None = None) -> None:
        if not self._ended:
            self._status = status

    def end(self, end_time: int | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        self._tracing.finished(self._name, self.get_span_context(), self._parent, self._kind,
                               self._start_ns, end_time or time.time_ns(), self._attributes,
                               self._status)


class EngineCallTrace:
    """One attempt at an engine: its span, and the first-token and decode spans under it."""

    def __init__(self, tracing: Tracing, span: otel.Span, call: CallTrace) -> None:
        self.tracing = tracing
        self.span = span
        self.call = call
        self.started_ns = time.time_ns()
        self.first_token_ns: int | None = None

    def inject(self, headers: Any) -> None:
        """Set `traceparent` (and `tracestate`) to this span's context on the engine request."""
        _PROPAGATOR.inject(headers, context=otel.set_span_in_context(self.span))

    def first_token(self) -> None:
        """The engine's first streamed chunk arrived."""
        if self.first_token_ns is None:
            self.first_token_ns = time.time_ns()

    def end(self, status: int, output_tokens: int | None, error: str | None,
            answer: bytes | None = None, end_ns: int | None = None) -> None:
        """The attempt is over (at `end_ns`, default now): `status` is the engine's HTTP status
        (0: none), `answer` the answer's body when it came whole (its `usage` is read)."""
        now = end_ns if end_ns is not None else time.time_ns()
        usage = usage_of(answer)
        if usage is not None:
            self.call.usage = usage
        elif output_tokens is not None:
            self.call.usage = {"completion_tokens": output_tokens}
        if self.first_token_ns is not None:
            parent = self.span.get_span_context()
            self.tracing.leaf("time to first token", parent, self.started_ns, self.first_token_ns)
            self.tracing.leaf("decode", parent, self.first_token_ns, now,
                              {"gen_ai.usage.output_tokens": output_tokens}
                              if output_tokens is not None else None)
        span = self.span
        if status:
            span.set_attribute("http.response.status_code", status)
        span.set_attribute("kvgate.streamed", self.first_token_ns is not None)
        if error is not None:
            span.set_status(otel.Status(otel.StatusCode.ERROR, error))
        span.end(now)


class CallTrace:
    """The spans of one proxied call; the proxy reports each stage to it."""

    def __init__(self, tracing: Tracing, span: otel.Span, task_span: otel.Span | None,
                 request_id: str) -> None:
        self.tracing = tracing
        self.span = span
        self.task_span = task_span
        """Hint-mode calls: the `task` span the call span sits under (ended with it)."""
        self.request_id = request_id
        self.context = otel.set_span_in_context(span)
        self.usage: Mapping[str, Any] | None = None
        """Token counts of the answer (the engine's `usage`, or the streamed tokens)."""
        self._stages: list[tuple[str, int, int, tuple[Dispatch, str] | None]] = []
        """Buffer waits and placements, made into spans once the call is over (they are
        known before the engine is called; building them then would delay it)."""

    @property
    def enabled(self) -> bool:
        """Spans are recorded (the no-op call says False)."""
        return True

    def buffer_wait(self, start_ns: int, end_ns: int) -> None:
        """The call waited in the planner's buffer from `start_ns` until it was dispatched."""
        self._stages.append(("buffer wait", start_ns, end_ns, None))

    def placement(self, d: Dispatch, policy: str, start_ns: int, end_ns: int) -> None:
        """The planner placed the call: the choice, its estimate and the runners-up."""
        self._stages.append(("placement", start_ns, end_ns, (d, policy)))

    def _emit_stages(self) -> None:
        parent = self.span.get_span_context()
        for name, start_ns, end_ns, placed in self._stages:
            attrs = _placement_attrs(*placed) if placed is not None else None
            self.tracing.leaf(name, parent, start_ns, end_ns, attrs)
        self._stages.clear()

    def engine_call(self, engine: str, url: str, attempt: int) -> EngineCallTrace | None:
        """Start one attempt at `engine`."""
        self.span.set_attribute("kvgate.engine", engine)
        if self.task_span is not None:
            self.task_span.set_attribute("kvgate.engine", engine)
        parsed = urlparse(url)
        span = _FinishedLater(
            self.tracing, "engine call", self.span.get_span_context(), otel.SpanKind.CLIENT,
            time.time_ns(), {"kvgate.engine": engine, "kvgate.attempt": attempt,
                             "server.address": parsed.hostname or "",
                             "server.port": parsed.port or 0})
        return EngineCallTrace(self.tracing, span, self)

    def end(self, status: int, error: str | None = None, end_ns: int | None = None) -> None:
        """The call is over (at `end_ns`, default now) with `status` (the client's answer; 0:
        none). The caller forgets the call in `Tracing.forget_call` when it ends (this may run
        later: `gateway/later.py`)."""
        self._emit_stages()
        span = self.span
        usage = self.usage
        if status:
            span.set_attribute("http.response.status_code", status)
        # A hint-mode call's task span carries what a workflow-API task's does.
        spans = (span,) if self.task_span is None else (span, self.task_span)
        if usage:
            for key, attr in (("prompt_tokens", "gen_ai.usage.input_tokens"),
                              ("completion_tokens", "gen_ai.usage.output_tokens")):
                if isinstance(usage.get(key), int):
                    for s in spans:
                        s.set_attribute(attr, usage[key])
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            if isinstance(cached, int):
                for s in spans:
                    s.set_attribute("gen_ai.usage.cache_read.input_tokens", cached)
        failed = error is not None or status >= 400
        if self.task_span is not None:
            self.task_span.set_attribute("kvgate.task.state", "cancelled" if status == 499
                                         else "failed" if failed else "done")
        if failed:
            span.set_status(otel.Status(otel.StatusCode.ERROR, error or f"HTTP {status}"))
        now = end_ns if end_ns is not None else time.time_ns()
        span.end(now)
        if self.task_span is not None:
            if failed:
                self.task_span.set_status(otel.Status(
                    otel.StatusCode.ERROR, _bounded(error or f"HTTP {status}")))
            self.task_span.end(now)


class NoCall:
    """What the proxy holds when tracing is off: every report does nothing."""

    enabled = False

    def buffer_wait(self, start_ns: int, end_ns: int) -> None:
        """Nothing to record."""

    def placement(self, d: Dispatch, policy: str, start_ns: int, end_ns: int) -> None:
        """Nothing to record."""

    def engine_call(self, engine: str, url: str, attempt: int) -> EngineCallTrace | None:
        """No span: the client's own `traceparent` goes to the engine untouched."""
        return None

    def end(self, status: int, error: str | None = None, end_ns: int | None = None) -> None:
        """Nothing to record."""


NO_CALL = NoCall()


def _placement_attrs(d: Dispatch, policy: str) -> Attrs:
    """A placement span's attributes: the choice, its estimate and the runners-up."""
    attrs: Attrs = {"kvgate.engine": d.engine, "kvgate.policy": policy,
                    "kvgate.placement.cached_tokens": d.cached_tokens}
    if d.cost is not None:
        attrs.update(_cost_attrs("kvgate.placement", d.cost))
    if d.runners_up:
        attrs["kvgate.placement.runner_up.engines"] = [c.engine for c in d.runners_up]
        attrs["kvgate.placement.runner_up.costs_s"] = [round(c.score, 6) for c in d.runners_up]
        attrs["kvgate.placement.runner_up.ttft_s"] = [round(c.ttft_s, 6) for c in d.runners_up]
    if d.priority is not None:
        attrs["kvgate.priority"] = d.priority
    return attrs


def _cost_attrs(prefix: str, cost: PlacementCost) -> Attrs:
    attrs: Attrs = {f"{prefix}.cost_s": round(cost.score, 6),
                    f"{prefix}.ttft_s": round(cost.ttft_s, 6),
                    f"{prefix}.queue_s": round(cost.queue_s, 6),
                    f"{prefix}.prefill_s": round(cost.prefill_s, 6),
                    f"{prefix}.transfer_s": round(cost.transfer_s, 6),
                    f"{prefix}.decode_s": round(cost.decode_s, 6)}
    if cost.transfer_from is not None:
        attrs[f"{prefix}.transfer_from"] = cost.transfer_from
    return attrs


class MoveTrace:
    """The span of one KV move (a transfer or a warm-up)."""

    def __init__(self, span: otel.Span | None) -> None:
        self.span = span

    def headers(self) -> dict[str, str]:
        """The `traceparent` the move's engine requests carry (none when tracing is off)."""
        headers: dict[str, str] = {}
        if self.span is not None:
            _PROPAGATOR.inject(headers, context=otel.set_span_in_context(self.span))
        return headers

    def end(self, error: str | None) -> None:
        """The move is over; `error` if it failed."""
        if self.span is None:
            return
        self.span.set_attribute("kvgate.move.outcome", "failed" if error else "done")
        if error is not None:
            self.span.set_status(otel.Status(otel.StatusCode.ERROR, _bounded(error)))
        self.span.end()


# -- the tracer -----------------------------------------------------------------------------------


class Tracing:
    """The gateway's tracer provider, exporters and memory store, and the span bookkeeping of
    calls in flight and workflows running here."""

    def __init__(self, settings: TracingSettings) -> None:
        self.settings = settings
        self.enabled = settings.enabled
        self.store: MemoryStore | None = None
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": settings.service_name}),
            id_generator=_WorkflowIds(),
            span_limits=SpanLimits(max_attribute_length=MAX_ATTR_CHARS))
        self._processors: list[SpanProcessor] = []
        """What the provider hands each ended span to (leaf spans go to them directly)."""
        if self.enabled:
            self._add_exporters(settings)
        self.tracer = self.provider.get_tracer("kvgate")
        self._scope = InstrumentationScope("kvgate")
        self._ids = RandomIdGenerator()
        self._calls: dict[str, Context] = {}
        """Calls in flight by request id: their span's context (KV moves hang under it)."""
        self._workflows: dict[str, tuple[otel.Span, Context]] = {}
        self._tasks: dict[tuple[str, str], otel.Span] = {}
        self.flush_pending: Callable[[], None] = lambda: None
        """Hands over the calls' deferred spans (`gateway/later.py`): run before the kept traces
        are read and before a task or workflow span ends, so a reader or an exporter never sees
        a parent without the calls under it."""

    @classmethod
    def off(cls) -> Tracing:
        """Tracing that records nothing."""
        return cls(TracingSettings(exporter=["none"]))

    def _add_exporters(self, s: TracingSettings) -> None:
        delay_ms = s.batch_delay_s * 1000
        for name in s.exporter:
            if name == "memory":
                self.store = MemoryStore(s.max_traces, s.max_spans_per_trace, s.max_spans)
                self._add_processor(_StoreProcessor(self.store))
                continue
            exporter: SpanExporter
            if name == "console":
                exporter = ConsoleSpanExporter()
            elif name == "otlp-http":
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter as HttpExporter,
                )

                exporter = HttpExporter(endpoint=otlp_http_url(s.endpoint),
                                        headers=dict(s.headers), timeout=5)
            else:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                    OTLPSpanExporter as GrpcExporter,
                )

                url = urlparse(s.endpoint or "http://127.0.0.1:4317")
                exporter = GrpcExporter(endpoint=grpc_target(url.geturl()),
                                        insecure=url.scheme == "http",
                                        headers=dict(s.headers), timeout=5)
            self._add_processor(BatchSpanProcessor(exporter, schedule_delay_millis=delay_ms))

    def _add_processor(self, processor: SpanProcessor) -> None:
        self.provider.add_span_processor(processor)
        self._processors.append(processor)

    def new_span_id(self) -> int:
        """A random span id."""
        return self._ids.generate_span_id()

    def new_trace_id(self) -> int:
        """A random trace id."""
        return self._ids.generate_trace_id()

    def leaf(self, name: str, parent: otel.SpanContext, start_ns: int, end_ns: int,
             attributes: Attrs | None = None) -> None:
        """A span known whole when it is made (a stage, a time to first token), under `parent`."""
        if parent.trace_flags.sampled and self._processors:
            ctx = otel.SpanContext(parent.trace_id, self.new_span_id(), is_remote=False,
                                   trace_flags=parent.trace_flags,
                                   trace_state=parent.trace_state)
            self.finished(name, ctx, parent, otel.SpanKind.INTERNAL, start_ns, end_ns,
                          attributes or {}, otel.Status(otel.StatusCode.UNSET))

    def finished(self, name: str, ctx: otel.SpanContext, parent: otel.SpanContext | None,
                 kind: otel.SpanKind, start_ns: int, end_ns: int, attributes: Attrs,
                 status: otel.Status) -> None:
        """Hand a finished span to the processors, as the SDK does when a span ends: the spans
        of proxied calls are made this way (through the tracer, starting and ending them cost
        about a fifth of a call's CPU in the gateway)."""
        if not ctx.trace_flags.sampled or not self._processors:
            return
        attrs = {k: _bounded(v) for k, v in attributes.items()}
        if status.description is not None and len(status.description) > MAX_ATTR_CHARS:
            status = otel.Status(status.status_code, status.description[:MAX_ATTR_CHARS])
        span = ReadableSpan(name[:MAX_ATTR_CHARS], ctx, parent, self.provider.resource, attrs,
                            kind=kind, status=status, instrumentation_scope=self._scope,
                            start_time=start_ns, end_time=end_ns)
        for processor in self._processors:
            processor.on_end(span)

    def shutdown(self) -> None:
        """End what is still open and send what is buffered (blocking: run it in a thread)."""
        for task_span in self._tasks.values():
            task_span.end()
        self._tasks.clear()
        for span, _ in self._workflows.values():
            span.end()
        self._workflows.clear()
        self.provider.shutdown()

    # -- calls ----------------------------------------------------------------------------------

    def call(self, headers: Mapping[str, str], route: str, request_id: str, model: str,
             attrs: Attrs, workflow: str | None, task: str | None, after: Sequence[str],
             arrived_ns: int) -> CallTrace | NoCall:
        """Start the spans of one proxied call (see the module docstring for where it goes)."""
        if not self.enabled:
            return NO_CALL
        client = _PROPAGATOR.extract(headers) if TRACEPARENT in headers else None
        client_sc = otel.get_current_span(client).get_span_context() if client else None
        parent = client if client is not None else Context()
        task_span = None
        if workflow is not None:
            trace_id = self.trace_id_of(workflow)
            if client_sc is None or not client_sc.is_valid or client_sc.trace_id != trace_id:
                links = [otel.Link(client_sc)] if client_sc is not None and client_sc.is_valid \
                    else []
                with _forced(trace_id):
                    task_span = self.tracer.start_span(
                        f"task {task}", Context(), links=links,
                        start_time=arrived_ns,
                        attributes={WORKFLOW_ATTR: workflow, "kvgate.task.id": task or "",
                                    "kvgate.task.after": _bounded(after),
                                    "kvgate.workflow.source": "hints"})
                parent = otel.set_span_in_context(task_span)
        operation = "chat" if route.endswith("/chat/completions") else "text_completion"
        span = _FinishedLater(
            self, f"{operation} {model}", otel.get_current_span(parent).get_span_context(),
            otel.SpanKind.SERVER, arrived_ns,
            {"gen_ai.operation.name": operation, "gen_ai.request.model": model,
             "kvgate.request.id": request_id, "url.path": route, "http.request.method": "POST",
             **attrs})
        call = CallTrace(self, span, task_span, request_id)
        self._calls[request_id] = call.context
        return call

    def forget_call(self, request_id: str) -> None:
        """The call is over: KV moves it starts later no longer hang under it."""
        self._calls.pop(request_id, None)

    def move(self, move: Transfer | Warm, workflow: str | None = None) -> MoveTrace:
        """Start the span of a KV move: under its origin call's span while that is in flight,
        else in the origin's `workflow`'s trace (under its root when it runs here)."""
        if not self.enabled:
            return MoveTrace(None)
        parent = self._calls.get(move.origin)
        forced = None
        if parent is None:
            running = self._workflows.get(workflow) if workflow is not None else None
            if running is not None:
                parent = running[1]
            elif workflow is not None:
                forced = workflow_trace_id(workflow)
        attrs: Attrs = {"kvgate.move.id": move.move_id, "kvgate.move.reason": move.reason,
                        "kvgate.move.tokens": move.tokens, "kvgate.move.origin": move.origin}
        if isinstance(move, Transfer):
            attrs |= {"kvgate.move.source": move.source,
                      "kvgate.move.destination": move.destination,
                      "kvgate.move.bytes": move.num_bytes}
            name = "kv transfer"
        else:
            attrs["kvgate.move.destination"] = move.engine
            name = "warm-up"
        if workflow is not None:
            attrs[WORKFLOW_ATTR] = workflow
        with _forced(forced):
            return MoveTrace(self.tracer.start_span(name, parent or Context(), attributes=attrs))

    # -- workflows ------------------------------------------------------------------------------

    def trace_id_of(self, workflow: str) -> int:
        """The trace a workflow's spans go to: its root span's if it runs here, else derived
        from its id."""
        running = self._workflows.get(workflow)
        if running is not None:
            return running[0].get_span_context().trace_id
        return workflow_trace_id(workflow)

    def workflow_started(self, workflow: str, headers: Mapping[str, str], attrs: Attrs,
                         start_s: float) -> str | None:
        """Start an API workflow's root span (under the submitter's `traceparent` if it sent
        one); its trace id, or None when tracing is off."""
        if not self.enabled:
            return None
        client = _PROPAGATOR.extract(headers) if TRACEPARENT in headers else None
        client_ok = client is not None and otel.get_current_span(client).get_span_context(
        ).is_valid
        with _forced(None if client_ok else workflow_trace_id(workflow)):
            span = self.tracer.start_span(
                f"workflow {workflow}", client if client_ok else Context(),
                kind=otel.SpanKind.SERVER, start_time=_ns(start_s),
                attributes={WORKFLOW_ATTR: workflow, "kvgate.workflow.source": "api",
                            **attrs})
        self._workflows[workflow] = (span, otel.set_span_in_context(span))
        return trace_hex(span.get_span_context().trace_id)

    def task_changed(self, workflow: str, task: str, record: Mapping[str, Any]) -> None:
        """An API workflow's task record changed: its span starts when it runs and ends when
        it is over (a task skipped or cancelled before it ran has none)."""
        running = self._workflows.get(workflow)
        if running is None:
            return
        key = (workflow, task)
        state = record.get("state")
        span = self._tasks.get(key)
        if span is None and state == "running":
            start = record.get("ready_s") or record.get("dispatched_s")
            self._tasks[key] = self.tracer.start_span(
                f"task {task}", running[1],
                start_time=_ns(start) if isinstance(start, float) else None,
                attributes={WORKFLOW_ATTR: workflow, "kvgate.task.id": task,
                            "kvgate.task.after": _bounded(record.get("after") or ())})
        elif span is not None and state in ("done", "failed", "cancelled", "skipped"):
            self.flush_pending()
            del self._tasks[key]
            span.set_attribute("kvgate.task.state", str(state))
            for field, attr in (("engine", "kvgate.engine"),
                                ("prompt_tokens", "gen_ai.usage.input_tokens"),
                                ("output_tokens", "gen_ai.usage.output_tokens"),
                                ("cached_tokens", "gen_ai.usage.cache_read.input_tokens")):
                if record.get(field) is not None:
                    span.set_attribute(attr, record[field])
            if state != "done":
                span.set_status(otel.Status(otel.StatusCode.ERROR,
                                            _bounded(str(record.get("error") or state))))
            end = record.get("finished_s")
            span.end(_ns(end) if isinstance(end, float) else None)

    def task_headers(self, workflow: str, task: str) -> dict[str, str]:
        """The `traceparent` an API workflow's task call carries (its task span's context)."""
        span = self._tasks.get((workflow, task))
        if span is None:
            return {}
        headers: dict[str, str] = {}
        _PROPAGATOR.inject(headers, context=otel.set_span_in_context(span))
        return headers

    def workflow_ended(self, workflow: str, record: Mapping[str, Any]) -> None:
        """An API workflow is over (or its driver stopped): end its root span."""
        running = self._workflows.pop(workflow, None)
        if running is None:
            return
        self.flush_pending()
        for key in [k for k in self._tasks if k[0] == workflow]:
            self._tasks.pop(key).end()
        span = running[0]
        state = str(record.get("state"))
        span.set_attribute("kvgate.workflow.state", state)
        if state != "done":
            span.set_status(otel.Status(otel.StatusCode.ERROR, f"workflow {state}"))
        end = record.get("finished_s")
        span.end(_ns(end) if isinstance(end, float) else None)

    # -- the endpoints --------------------------------------------------------------------------

    def routes(self, app: web.Application) -> None:
        """`GET /v1/traces`, `/v1/traces/{trace_id}`, `/v1/workflows/{id}/trace`."""
        app.router.add_get("/v1/traces", self.handle_list)
        app.router.add_get("/v1/traces/{trace_id}", self.handle_trace)
        app.router.add_get("/v1/workflows/{id}/trace", self.handle_workflow_trace)

    def _kept(self) -> MemoryStore:
        self.flush_pending()
        if self.store is None:
            raise TracesNotKept(
                "this gateway keeps no traces: tracing.exporter is "
                f"{','.join(self.settings.exporter)}; add 'memory' to keep them here")
        return self.store

    async def handle_list(self, request: web.Request) -> web.Response:
        """The most recently active traces: id, workflow id, root span, start, duration,
        span count (`?limit=`, default 100)."""
        store = self._kept()
        raw = request.query.get("limit", "100")
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 9) or int(raw) < 1:
            raise InvalidRequest(f"limit must be a positive integer, got {raw!r}", param="limit")
        return web.json_response({"traces": store.summaries(int(raw))})

    async def handle_trace(self, request: web.Request) -> web.Response:
        """One trace's spans."""
        store = self._kept()
        raw = request.match_info["trace_id"].lower()
        if len(raw) != 32 or any(c not in "0123456789abcdef" for c in raw):
            raise InvalidRequest(f"a trace id is 32 hex digits, got {raw!r}", param="trace_id")
        spans = store.spans(int(raw, 16))
        if spans is None:
            raise TraceNotFound(f"trace {raw} is not kept here (spans appear as they end; "
                                f"the store keeps the last {store.max_traces} traces)")
        return web.json_response({"trace_id": raw, "workflow_id": store.workflow_of(int(raw, 16)),
                                  "spans": spans, "dropped_spans": store.dropped(int(raw, 16))})

    async def handle_workflow_trace(self, request: web.Request) -> web.Response:
        """The spans of a workflow kept by this gateway: those that name it and the spans under
        them (a call in the same trace by a client's `traceparent`, another tenant's
        included, is not the workflow's)."""
        store = self._kept()
        workflow = request.match_info["id"]
        found = store.workflow_spans(workflow, request.get(TRACE_SINCE_KEY))
        if found is None:
            raise TraceNotFound(
                f"no spans of workflow {workflow!r} are kept here (spans appear as they end, "
                "on the replica that handled them)")
        tid, spans, dropped = found
        return web.json_response({"trace_id": trace_hex(tid), "workflow_id": workflow,
                                  "spans": spans, "dropped_spans": dropped})


def otlp_http_url(endpoint: str | None) -> str:
    """The OTLP/HTTP traces URL: a bare `http://HOST:PORT` gets the standard `/v1/traces`."""
    if endpoint is None:
        return "http://127.0.0.1:4318/v1/traces"
    if urlparse(endpoint).path in ("", "/"):
        return endpoint.rstrip("/") + "/v1/traces"
    return endpoint


_USAGE_KEY = b'"usage":'
_DECODER = json.JSONDecoder()


def _closes_object(text: str) -> bool:
    """Whether `text` is one JSON object and nothing else."""
    doc, end = _DECODER.raw_decode(text)
    return isinstance(doc, dict) and end == len(text)


def grpc_target(endpoint: str) -> str:
    """The `host:port` a gRPC channel dials for an OTLP endpoint URL (port 4317 when it names
    none; an IPv6 host in brackets, as gRPC reads it)."""
    url = urlparse(endpoint)
    if url.port is not None:
        return url.netloc.rsplit("@", 1)[-1]
    host = url.hostname or "127.0.0.1"
    return f"[{host}]:4317" if ":" in host else f"{host}:4317"


def usage_of(answer: bytes | None) -> Mapping[str, Any] | None:
    """The `usage` object of a whole JSON answer, if it has one.

    OpenAI-style answers (vLLM's among them) write `usage` after `choices`, so the object is
    read from its key's last occurrence without decoding the whole answer. (Inside a JSON
    string a quote is escaped, so `"usage":` there is always a key.) What follows its value
    must close exactly the top-level object, else the key was a nested object's and the whole
    answer is parsed.
    """
    if not answer:
        return None
    at = answer.rfind(_USAGE_KEY)
    if at > 0:
        with contextlib.suppress(ValueError, UnicodeDecodeError):
            tail = answer[at + len(_USAGE_KEY):].decode()
            usage, end = _DECODER.raw_decode(tail, len(tail) - len(tail.lstrip()))
            rest = tail[end:].strip()
            if isinstance(usage, dict) and (rest == "}" or (
                    rest.startswith(",") and _closes_object("{" + rest[1:]))):
                return usage
    with contextlib.suppress(ValueError, TypeError):
        doc = json.loads(answer)
        usage = doc.get("usage") if isinstance(doc, dict) else None
        return usage if isinstance(usage, dict) else None
    return None


class TraceNotFound(GatewayError):
    """No kept trace with that id (or for that workflow)."""

    status = 404
    err_type = "invalid_request_error"
    code = "trace_not_found"


class TracesNotKept(GatewayError):
    """The memory store is not among the configured exporters."""

    status = 404
    err_type = "invalid_request_error"
    code = "traces_not_kept"
