"""Traces end to end: a real `kvgate serve` in front of real `kvgate sim` engines exports its spans
to real OTLP receivers in the test (an aiohttp OTLP/HTTP endpoint and a grpcio OTLP/gRPC server,
both decoding the protobuf), and serves its memory store at /v1/traces. A recording proxy in front
of each sim shows the `traceparent` engines receive."""

from __future__ import annotations

import gzip
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import openai
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from gateway.config import ConfigError, parse_config
from gateway.tracing import Tracing, trace_hex, workflow_trace_id
from kvgate.procs import Child, free_port, wait_healthy
from tests.conftest import MODEL, ThreadedServer

SESSION = web.AppKey("session", aiohttp.ClientSession)
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
SYSTEM = "You are a careful researcher who cites sources. " * 8


# -- receivers ------------------------------------------------------------------------------------


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def decode(request: trace_service_pb2.ExportTraceServiceRequest) -> list[dict[str, Any]]:
    """The spans of an OTLP export, flattened to dicts with hex ids."""
    spans = []
    for rs in request.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append({
                    "name": s.name, "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                    "parent_span_id": s.parent_span_id.hex() or None,
                    "start_ns": s.start_time_unix_nano, "end_ns": s.end_time_unix_nano,
                    "attributes": {kv.key: _value(kv.value) for kv in s.attributes},
                    "links": [(li.trace_id.hex(), li.span_id.hex()) for li in s.links],
                    "status": s.status.code, "resource": resource})
    return spans


class Received:
    """Spans a receiver decoded, shared with the test thread."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def add(self, spans: list[dict[str, Any]]) -> None:
        with self.lock:
            self.spans.extend(spans)

    def wait_for(self, ready: Callable[[list[dict[str, Any]]], bool],
                 timeout: float = 15.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                spans = list(self.spans)
            if ready(spans):
                return spans
            time.sleep(0.05)
        raise AssertionError(f"spans never arrived; have {[s['name'] for s in spans]}")


def otlp_http_app(received: Received) -> web.Application:
    async def export(request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        raw = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            raw = gzip.decompress(raw)
        msg = trace_service_pb2.ExportTraceServiceRequest()
        msg.ParseFromString(raw)
        received.add(decode(msg))
        reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=reply, content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", export)
    return app


class GrpcTraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, received: Received) -> None:
        self.received = received

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,
               context: grpc.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        self.received.add(decode(request))
        return trace_service_pb2.ExportTraceServiceResponse()


def recording_proxy(target: str, seen: list[dict[str, str]]) -> web.Application:
    """Forwards everything to `target` (a sim), streaming answers; records the headers of each
    completion request."""
    async def forward(request: web.Request) -> web.StreamResponse:
        if request.path.startswith("/v1/") and request.method == "POST":
            seen.append({k.lower(): v for k, v in request.headers.items()})
        session: aiohttp.ClientSession = request.app[SESSION]
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in ("host", "content-length", "transfer-encoding")}
        async with session.request(request.method, target + request.path_qs,
                                   data=await request.read(), headers=headers) as up:
            resp = web.StreamResponse(status=up.status, headers={
                "Content-Type": up.headers.get("Content-Type", "application/json")})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    async def open_session(app: web.Application) -> None:
        app[SESSION] = aiohttp.ClientSession(auto_decompress=False)

    async def close_session(app: web.Application) -> None:
        await app[SESSION].close()

    app = web.Application()
    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture
def otlp_http(threaded_server: Callable[[web.Application], ThreadedServer]
              ) -> tuple[Received, str]:
    received = Received()
    server = threaded_server(otlp_http_app(received))
    return received, server.url


@pytest.fixture
def otlp_grpc() -> Iterator[tuple[Received, str]]:
    received = Received()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(GrpcTraceService(received),
                                                              server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield received, f"http://127.0.0.1:{port}"
    server.stop(0)


@pytest.fixture
def engines(sims: list[Child], threaded_server: Callable[[web.Application], ThreadedServer]
            ) -> tuple[list[str], list[list[dict[str, str]]]]:
    """The shared sims, each behind a recording proxy: their URLs, and the headers each got."""
    seen: list[list[dict[str, str]]] = [[], []]
    urls = [threaded_server(recording_proxy(s.url, seen[i])).url for i, s in enumerate(sims)]
    return urls, seen


def start(spawn_gateway: Callable[[dict[str, Any]], Child], urls: list[str],
          tracing: dict[str, Any], **extra: Any) -> Child:
    child = spawn_gateway({"engines": [{"url": u} for u in urls], "tracing": tracing, **extra})
    wait_healthy(child)
    return child


def get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_done(gateway: Child, wf_id: str, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, snap = get(f"{gateway.url}/v1/workflows/{wf_id}")
        if snap["state"] != "running":
            return dict(snap)
        time.sleep(0.05)
    raise AssertionError(f"workflow {wf_id} still running")


def children(spans: list[dict[str, Any]], parent: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in spans if s["parent_span_id"] == parent["span_id"]]


def one(spans: list[dict[str, Any]], name: str) -> dict[str, Any]:
    found = [s for s in spans if s["name"] == name]
    assert len(found) == 1, f"{name}: {[s['name'] for s in spans]}"
    return found[0]


FANOUT = {
    "id": "survey", "model": MODEL,
    "segments": {"sys": {"kind": "static", "content": SYSTEM}},
    "tasks": [
        {"id": "plan", "output_tokens": 8,
         "messages": [{"segment": "sys"}, {"role": "user", "content": "Plan it."}]},
        {"id": "w0", "after": ["plan"], "output_tokens": 8,
         "messages": [{"segment": "sys"}, {"output_of": "plan", "role": "user"}]},
        {"id": "w1", "after": ["plan"], "output_tokens": 8,
         "messages": [{"segment": "sys"}, {"output_of": "plan", "role": "user"},
                      {"role": "user", "content": "The other half."}]},
    ]}


# -- OTLP -----------------------------------------------------------------------------------------


def test_a_workflow_is_one_trace_at_an_otlp_http_receiver(
        otlp_http: tuple[Received, str], engines: tuple[list[str], list[list[dict[str, str]]]],
        spawn_gateway: Callable[[dict[str, Any]], Child]) -> None:
    received, endpoint = otlp_http
    urls, seen = engines
    gw = start(spawn_gateway, urls, {"exporter": "otlp-http", "endpoint": endpoint,
                                     "service_name": "kvgate-test", "batch_delay_s": 0.1})
    status, snap = post(f"{gw.url}/v1/workflows", FANOUT, {"traceparent": CLIENT_TRACEPARENT})
    assert status == 201, snap
    assert snap["trace_id"] == CLIENT_TRACE
    wf_id = snap["id"]
    assert wait_done(gw, wf_id)["state"] == "done"

    spans = received.wait_for(lambda ss: any(s["name"] == f"workflow {wf_id}" for s in ss))
    assert {s["trace_id"] for s in spans} == {CLIENT_TRACE}
    assert {s["resource"]["service.name"] for s in spans} == {"kvgate-test"}
    root = one(spans, f"workflow {wf_id}")
    assert root["parent_span_id"] == CLIENT_SPAN
    assert root["attributes"]["kvgate.workflow.state"] == "done"
    tasks = children(spans, root)
    assert sorted(t["name"] for t in tasks) == ["task plan", "task w0", "task w1"]
    for task in tasks:
        (call,) = children(spans, task)
        assert call["name"] == f"chat {MODEL}"
        assert call["attributes"]["gen_ai.request.model"] == MODEL
        assert call["attributes"]["kvgate.workflow.id"] == wf_id
        assert call["attributes"]["gen_ai.usage.output_tokens"] == 8
        stages = {s["name"]: s for s in children(spans, call)}
        assert {"buffer wait", "placement", "engine call"} <= set(stages)
        placement = stages["placement"]["attributes"]
        # The kvgate policy estimates every engine: the choice and the runner-up, with costs.
        assert placement["kvgate.engine"] in {u.removeprefix("http://") for u in urls}
        assert placement["kvgate.placement.cost_s"] > 0
        assert len(placement["kvgate.placement.runner_up.engines"]) == 1
        assert placement["kvgate.placement.runner_up.engines"][0] != placement["kvgate.engine"]
        assert len(placement["kvgate.placement.runner_up.costs_s"]) == 1
        assert stages["engine call"]["attributes"]["http.response.status_code"] == 200
        assert task["attributes"]["kvgate.engine"] == placement["kvgate.engine"]
    # Each engine request carried its engine-call span (or its KV move's) as the W3C parent.
    engine_calls = {s["span_id"] for s in spans if s["name"] == "engine call"}
    moves = {s["span_id"] for s in spans if s["name"] in ("kv transfer", "warm-up")}
    sent = [h["traceparent"] for hs in seen for h in hs]
    assert {tp.split("-")[1] for tp in sent} == {CLIENT_TRACE}
    assert engine_calls <= {tp.split("-")[2] for tp in sent} <= engine_calls | moves
    assert len(engine_calls) == 3


def test_spans_reach_an_otlp_grpc_receiver(
        otlp_grpc: tuple[Received, str], engines: tuple[list[str], list[list[dict[str, str]]]],
        spawn_gateway: Callable[[dict[str, Any]], Child]) -> None:
    received, endpoint = otlp_grpc
    urls, _ = engines
    gw = start(spawn_gateway, urls, {"exporter": "otlp-grpc", "endpoint": endpoint,
                                     "batch_delay_s": 0.1})
    status, _ = post(f"{gw.url}/v1/chat/completions",
                     {"model": MODEL, "max_tokens": 4,
                      "messages": [{"role": "user", "content": "hello"}]},
                     {"traceparent": CLIENT_TRACEPARENT})
    assert status == 200
    spans = received.wait_for(lambda ss: any(s["name"] == f"chat {MODEL}" for s in ss))
    call = one(spans, f"chat {MODEL}")
    # A plain call joins the client's trace under the client's span.
    assert (call["trace_id"], call["parent_span_id"]) == (CLIENT_TRACE, CLIENT_SPAN)


# -- hint mode, streaming, traceparent ------------------------------------------------------------


def test_hint_mode_calls_share_the_workflow_trace_and_link_the_clients(
        engines: tuple[list[str], list[list[dict[str, str]]]],
        spawn_gateway: Callable[[dict[str, Any]], Child]) -> None:
    urls, seen = engines
    gw = start(spawn_gateway, urls, {"exporter": "memory"})
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="-")
    workflow = f"job-{time.time_ns()}"
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Plan it."}]
    for task, after, traceparent in (("plan", "", CLIENT_TRACEPARENT),
                                     ("worker", "plan", None)):
        headers = {"X-KVGate-Workflow": workflow, "X-KVGate-Task": task}
        if after:
            headers["X-KVGate-After"] = after
        if traceparent:
            headers["traceparent"] = traceparent
        # The worker asks for the stream's usage: its task span carries the prompt's tokens.
        options = {"include_usage": True} if task == "worker" else None
        stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6,
                                                stream=True, extra_headers=headers,
                                                stream_options=options)  # type: ignore[arg-type]
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    expected = trace_hex(workflow_trace_id(workflow))
    _, snap = get(f"{gw.url}/v1/workflows/{workflow}")
    assert snap["trace_id"] == expected
    status, doc = get(f"{gw.url}/v1/workflows/{workflow}/trace")
    assert status == 200 and doc["trace_id"] == expected
    spans = doc["spans"]
    assert {s["trace_id"] for s in spans} == {expected}
    tasks = [s for s in spans if s["parent_span_id"] is None]
    assert sorted(t["name"] for t in tasks) == ["task plan", "task worker"]
    plan = one(tasks, "task plan")
    # The client's own trace is linked, not joined: the workflow keeps one trace.
    assert plan["links"] == [{"trace_id": CLIENT_TRACE, "span_id": CLIENT_SPAN}]
    assert one(tasks, "task worker")["attributes"]["kvgate.task.after"] == ["plan"]
    # From the stream's usage event (it was read from a whole answer only).
    assert one(tasks, "task worker")["attributes"]["gen_ai.usage.input_tokens"] > 10
    assert "gen_ai.usage.input_tokens" not in plan["attributes"]
    for task in tasks:
        # What a workflow-API task's span carries, a hint-mode one's carries too.
        assert task["attributes"]["kvgate.task.state"] == "done"
        assert 1 <= task["attributes"]["gen_ai.usage.output_tokens"] <= 6
        (call,) = children(spans, task)
        stages = {s["name"]: s for s in children(spans, call)}
        assert {"buffer wait", "placement", "engine call"} <= set(stages)
        engine_call = stages["engine call"]
        assert engine_call["attributes"]["kvgate.streamed"] is True
        ttft, decode = (one(children(spans, engine_call), n)
                        for n in ("time to first token", "decode"))
        assert engine_call["start_s"] <= ttft["start_s"] <= ttft["end_s"] <= decode["start_s"]
        assert decode["end_s"] <= engine_call["end_s"] + 1e-6
        assert 1 <= decode["attributes"]["gen_ai.usage.output_tokens"] <= 6
        assert stages["buffer wait"]["start_s"] >= call["start_s"]
    sent = [h["traceparent"] for hs in seen for h in hs]
    assert {tp.split("-")[1] for tp in sent} == {expected}
    assert {s["span_id"] for s in spans if s["name"] == "engine call"} <= {
        tp.split("-")[2] for tp in sent}


def test_a_hint_mode_workflow_has_one_trace_on_every_replica(
        engines: tuple[list[str], list[list[dict[str, str]]]],
        spawn_gateway: Callable[[dict[str, Any]], Child]) -> None:
    urls, _ = engines
    replicas = [spawn_gateway({"engines": [{"url": u} for u in urls]}) for _ in range(2)]
    for gw in replicas:
        wait_healthy(gw)
    workflow = f"agent-{time.time_ns()}"
    for gw, task in zip(replicas, ("plan", "act"), strict=True):
        status, _ = post(f"{gw.url}/v1/chat/completions",
                         {"model": MODEL, "max_tokens": 2,
                          "messages": [{"role": "user", "content": f"{task} it"}]},
                         {"X-KVGate-Workflow": workflow, "X-KVGate-Task": task})
        assert status == 200
    traces = [get(f"{gw.url}/v1/workflows/{workflow}/trace")[1] for gw in replicas]
    assert {t["trace_id"] for t in traces} == {trace_hex(workflow_trace_id(workflow))}
    assert [[s["name"] for s in t["spans"] if s["parent_span_id"] is None] for t in traces] == [
        ["task plan"], ["task act"]]


def test_without_tracing_the_clients_traceparent_reaches_the_engine_untouched(
        engines: tuple[list[str], list[list[dict[str, str]]]],
        spawn_gateway: Callable[[dict[str, Any]], Child]) -> None:
    urls, seen = engines
    gw = start(spawn_gateway, urls, {"exporter": "none"})
    status, _ = post(f"{gw.url}/v1/chat/completions",
                     {"model": MODEL, "max_tokens": 2,
                      "messages": [{"role": "user", "content": "hi"}]},
                     {"traceparent": CLIENT_TRACEPARENT, "x-request-id": "untraced"})
    assert status == 200
    assert [h["traceparent"] for hs in seen for h in hs
            if h.get("x-request-id") == "untraced"] == [CLIENT_TRACEPARENT]
    status, doc = get(f"{gw.url}/v1/traces")
    assert status == 404 and doc["error"]["code"] == "traces_not_kept"


# -- the memory store's endpoints -----------------------------------------------------------------


def test_the_memory_store_serves_recent_traces_and_names_bad_ids(
        engines: tuple[list[str], list[list[dict[str, str]]]],
        spawn_gateway: Callable[[dict[str, Any]], Child]) -> None:
    urls, _ = engines
    gw = start(spawn_gateway, urls, {"max_traces": 2}, policy="round-robin")
    for i in range(3):
        status, _ = post(f"{gw.url}/v1/chat/completions",
                         {"model": MODEL, "max_tokens": 2,
                          "messages": [{"role": "user", "content": f"call {i}"}]},
                         {"x-request-id": f"call-{i}"})
        assert status == 200
    status, doc = get(f"{gw.url}/v1/traces")
    assert status == 200
    listed = doc["traces"]
    assert len(listed) == 2  # max_traces: the oldest went first
    assert all(t["root"] == f"chat {MODEL}" and t["workflow_id"] is None for t in listed)
    status, trace = get(f"{gw.url}/v1/traces/{listed[0]['trace_id']}")
    assert status == 200
    call = one(trace["spans"], f"chat {MODEL}")
    assert call["attributes"]["kvgate.request.id"] == "call-2"
    placement = one(trace["spans"], "placement")
    # round-robin estimates nothing: no cost, no runners-up.
    assert "kvgate.placement.cost_s" not in placement["attributes"]
    assert "kvgate.placement.runner_up.engines" not in placement["attributes"]
    assert get(f"{gw.url}/v1/traces/{'0' * 32}")[1]["error"]["code"] == "trace_not_found"
    status, err = get(f"{gw.url}/v1/traces/not-hex")
    assert status == 400 and "32 hex digits" in err["error"]["message"]
    status, err = get(f"{gw.url}/v1/traces?limit=zero")
    assert status == 400 and err["error"]["param"] == "limit"
    status, err = get(f"{gw.url}/v1/workflows/nobody/trace")
    assert status == 404 and "nobody" in err["error"]["message"]


def test_what_a_client_sends_is_cut_to_size_in_spans(
        engines: tuple[list[str], list[list[dict[str, str]]]],
        spawn_gateway: Callable[[dict[str, Any]], Child]) -> None:
    urls, _ = engines
    gw = start(spawn_gateway, urls, {}, policy="round-robin")
    status, _ = post(f"{gw.url}/v1/chat/completions",
                     {"model": "m" * 100_000, "messages": [{"role": "user", "content": "hi"}]},
                     {"x-request-id": "huge-model"})
    assert status == 404
    status, _ = post(f"{gw.url}/v1/chat/completions",
                     {"model": MODEL, "max_tokens": 2, "user": "u" * 100_000,
                      "messages": [{"role": "user", "content": "hi"}]},
                     {"x-request-id": "huge-user"})
    assert status == 200
    status, doc = get(f"{gw.url}/v1/traces")
    assert status == 200 and len(doc["traces"]) == 2
    for listed in doc["traces"]:
        status, trace = get(f"{gw.url}/v1/traces/{listed['trace_id']}")
        assert status == 200
        for span in trace["spans"]:
            assert len(span["name"]) <= 1024
            for value in span["attributes"].values():
                assert len(value if isinstance(value, str | list) else ()) <= 1024
            assert len(span["status"]["description"] or "") <= 1024
    assert "m" * 1000 in json.dumps(doc)  # cut, not dropped


# -- in-process ----------------------------------------------------------------------------------


def test_the_memory_store_drops_the_least_recently_active_trace() -> None:
    from opentelemetry import trace as otel

    tracing = Tracing(parse_config({"engines": [{"url": "http://127.0.0.1:1"}],
                                    "tracing": {"max_traces": 2}}).tracing)
    tracer = tracing.tracer
    a = tracer.start_span("a")
    a.end()
    tracer.start_span("b").end()
    # A span of a's trace ends: a is the more recently active, so b goes when c arrives.
    tracer.start_span("a child", otel.set_span_in_context(a)).end()
    tracer.start_span("c").end()
    assert tracing.store is not None
    assert [t["root"] for t in tracing.store.summaries(10)] == ["c", "a"]


def test_the_memory_store_keeps_at_most_its_span_budget_in_all() -> None:
    from opentelemetry import trace as otel

    # 1,000 traces of 10,000 spans each were allowed: about 12 GB of spans.
    tracing = Tracing(parse_config({"engines": [{"url": "http://127.0.0.1:1"}],
                                    "tracing": {"max_spans": 10}}).tracing)
    roots = []
    for name in ("a", "b", "c"):
        root = tracing.tracer.start_span(name)
        ctx = otel.set_span_in_context(root)
        for i in range(3):
            tracing.tracer.start_span(f"{name}{i}", ctx).end()
        root.end()
        roots.append(root)
    assert tracing.store is not None
    # 12 spans asked, 10 kept: the least recently active trace (a) went whole.
    assert [t["root"] for t in tracing.store.summaries(10)] == ["c", "b"]
    assert sum(t["spans"] for t in tracing.store.summaries(10)) == 8
    assert tracing.store.spans(roots[0].get_span_context().trace_id) is None


def test_a_trace_many_workflows_share_forgets_those_it_keeps_no_span_of() -> None:
    from opentelemetry import trace as otel

    # API workflows submitted under one client traceparent share a trace: its spans were
    # capped, but the workflow names it had seen grew with every one.
    tracing = Tracing(parse_config({"engines": [{"url": "http://127.0.0.1:1"}],
                                    "tracing": {"max_spans_per_trace": 3}}).tracing)
    root = tracing.tracer.start_span("client")
    ctx = otel.set_span_in_context(root)
    for i in range(500):
        tracing.tracer.start_span(f"task {i}", ctx,
                                  attributes={"kvgate.workflow.id": f"wf-{i}"}).end()
    store = tracing.store
    assert store is not None
    assert len(store._traces_of) < 30  # it was 500
    assert store.workflow_spans("wf-499") is not None  # the latest are still found
    assert store.workflow_spans("wf-3") is None


def test_a_full_trace_keeps_its_latest_spans_and_counts_the_dropped() -> None:
    """A hint-mode workflow that runs for weeks is one trace: past its cap the oldest spans
    go, so its latest calls stay visible, and the listing says how many went."""
    from opentelemetry import trace as otel

    tracing = Tracing(parse_config({"engines": [{"url": "http://127.0.0.1:1"}],
                                    "tracing": {"max_spans_per_trace": 3}}).tracing)
    root = tracing.tracer.start_span("root", attributes={"kvgate.workflow.id": "w"})
    ctx = otel.set_span_in_context(root)
    for i in range(5):
        tracing.tracer.start_span(f"call {i}", ctx).end()
    assert tracing.store is not None
    (summary,) = tracing.store.summaries(10)
    assert summary["spans"] == 3 and summary["dropped_spans"] == 2
    tid = root.get_span_context().trace_id
    assert [s["name"] for s in tracing.store.spans(tid) or ()] == ["call 2", "call 3", "call 4"]
    assert tracing.store.dropped(tid) == 2


def test_shutting_down_ends_the_task_spans_still_open() -> None:
    tracing = Tracing(parse_config({"engines": [{"url": "http://127.0.0.1:1"}]}).tracing)
    tracing.workflow_started("wf", {}, {}, time.time())
    tracing.task_changed("wf", "t", {"state": "running", "ready_s": time.time()})
    tracing.shutdown()
    assert tracing.store is not None
    (summary,) = tracing.store.summaries(10)
    tid = int(summary["trace_id"], 16)
    assert sorted(s["name"] for s in tracing.store.spans(tid) or ()) == ["task t", "workflow wf"]


@pytest.mark.parametrize(("tracing", "problem"), [
    ({"exporter": "jaeger"}, "tracing.exporter"),
    ({"exporter": ["none", "memory"]}, "'none' turns tracing off"),
    ({"exporter": "otlp-http,otlp-grpc"}, "choose one of otlp-http and otlp-grpc"),
    ({"endpoint": "localhost:4318"}, "tracing.endpoint"),
    ({"max_traces": 0}, "tracing.max_traces"),
    ({"sample": 1}, "tracing.sample"),
])
def test_bad_tracing_config_names_the_key(tracing: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        parse_config({"engines": [{"url": "http://127.0.0.1:1"}], "tracing": tracing})


def test_serve_takes_the_exporter_from_the_command_line(
        otlp_http: tuple[Received, str], engines: tuple[list[str], list[list[dict[str, str]]]],
        tmp_path: Path) -> None:
    from kvgate.procs import spawn

    received, endpoint = otlp_http
    urls, _ = engines
    port = free_port()
    gw = spawn("gateway-cli", ["serve", "--engines", ",".join(urls), "--port", str(port),
                               "--trace-exporter", "otlp-http,memory",
                               "--otlp-endpoint", endpoint], f"http://127.0.0.1:{port}",
               tmp_path)
    try:
        wait_healthy(gw)
        status, _ = post(f"{gw.url}/v1/completions",
                         {"model": MODEL, "max_tokens": 2, "prompt": "hello"})
        assert status == 200
        assert get(f"{gw.url}/v1/traces")[0] == 200
    finally:
        gw.stop()  # a clean stop sends the spans still batched
    spans = received.wait_for(lambda ss: any(s["name"] == f"text_completion {MODEL}"
                                             for s in ss), timeout=5)
    assert one(spans, f"text_completion {MODEL}")["parent_span_id"] is None


def test_the_console_exporter_prints_spans_as_json(
        engines: tuple[list[str], list[list[dict[str, str]]]], tmp_path: Path) -> None:
    from kvgate.procs import spawn

    urls, _ = engines
    port = free_port()
    gw = spawn("gateway-console", ["serve", "--engines", ",".join(urls), "--port", str(port),
                                   "--trace-exporter", "console"], f"http://127.0.0.1:{port}",
               tmp_path)
    try:
        wait_healthy(gw)
        status, _ = post(f"{gw.url}/v1/chat/completions",
                         {"model": MODEL, "max_tokens": 2,
                          "messages": [{"role": "user", "content": "hi"}]},
                         {"x-request-id": "printed"})
        assert status == 200
    finally:
        gw.stop()
    assert '"kvgate.request.id": "printed"' in gw.log_path.read_text()


def test_an_otlp_grpc_endpoint_is_dialled_as_grpc_reads_it() -> None:
    from gateway.tracing import grpc_target

    assert grpc_target("http://collector:4317") == "collector:4317"
    assert grpc_target("http://collector") == "collector:4317"
    # An IPv6 host without a port was dialled as `::1:4317`, which gRPC cannot read.
    assert grpc_target("http://[::1]") == "[::1]:4317"
    assert grpc_target("http://[::1]:5000") == "[::1]:5000"


def test_latency_histograms_reach_past_the_longest_call() -> None:
    from gateway.config import GatewayConfig
    from gateway.metrics import LATENCY_BUCKETS

    # A call may run request_timeout_s and wait as long to be placed: every such call read
    # as the top bucket (300 s) in a quantile.
    timeout = GatewayConfig.model_fields["request_timeout_s"].default
    assert LATENCY_BUCKETS[-1] >= 2 * timeout
