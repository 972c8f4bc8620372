"""Bad input and failing engines get clear OpenAI-shaped errors; nothing is lost silently."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client.parser import text_string_to_metric_families

from kvgate.procs import Child, free_port, wait_healthy
from tests.conftest import MODEL, ThreadedServer


def post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def assert_openai_error(body: Any, *fragments: str) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    for f in fragments:
        assert f in body["error"]["message"]


def test_malformed_json_is_a_400_naming_the_problem(gateway: Child) -> None:
    status, body = post(f"{gateway.url}/v1/chat/completions", b'{"model": "x", "messages": [')
    assert status == 400
    assert_openai_error(body, "not valid JSON")


def test_non_object_and_empty_bodies_are_400(gateway: Child) -> None:
    status, body = post(f"{gateway.url}/v1/completions", b"[1, 2]")
    assert status == 400
    assert_openai_error(body, "JSON object")
    status, body = post(f"{gateway.url}/v1/completions", b"")
    assert status == 400
    assert_openai_error(body, "empty")


def test_a_body_its_encoding_does_not_decode_and_bytes_no_id_can_hold_are_400s(
    gateway: Child,
) -> None:
    for encoding in ("gzip", "deflate"):
        status, body = post(f"{gateway.url}/v1/chat/completions", b"not compressed",
                            {"Content-Encoding": encoding})
        assert status == 400, encoding
        assert_openai_error(body, "request body could not be read", encoding)
    host, port = gateway.url.removeprefix("http://").split(":")
    body_bytes = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 1}).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n"
                     b"X-KVGate-Workflow: w\xff\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body_bytes), body_bytes))
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), head
    assert_openai_error(json.loads(payload), "X-KVGate-Workflow must be UTF-8 text")


def test_json_python_cannot_read_is_a_400(gateway: Child) -> None:
    deep = b'{"model": "x", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, body = post(f"{gateway.url}/v1/chat/completions", deep)
    assert status == 400
    assert_openai_error(body, "nests JSON arrays or objects too deeply")
    digits = b'{"model": "x", "max_tokens": ' + b"9" * 5000 + b"}"
    status, body = post(f"{gateway.url}/v1/chat/completions", digits)
    assert status == 400
    assert_openai_error(body, "holds a value that cannot be read")
    # Tools nested just shallower than the parser's limit parse, but are deeper than the chat
    # template's `tojson` can go: the call is forwarded unkeyed, for the engine to judge.
    statuses = set()
    for depth in range(900, 1000):
        chat = (f'{{"model": "{MODEL}", "max_tokens": 1, "messages": [{{"role": "user", '
                f'"content": "hi"}}], "tools": [{{"type": "function", "function": {{"name": '
                f'"f", "parameters": {"[" * depth}{"]" * depth}}}}}]}}')
        status, body = post(f"{gateway.url}/v1/chat/completions", chat.encode())
        statuses.add(status)
        assert status < 500, (depth, body)
    assert 400 in statuses  # the deepest: the gateway's own parser refuses them


def test_values_the_planner_cannot_price_leave_the_gateway_working(gateway: Child) -> None:
    # A max_tokens beyond any float once broke the cost model, and the call, left in the
    # release buffer, broke every call after it. The engine is the authority on it: the
    # simulated engine, as vLLM, refuses it for the model's context.
    url = f"{gateway.url}/v1/chat/completions"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Name a river."}]}
    for huge, refusal in ((10**400, "cannot be greater than max_model_len"),
                          (-(10**400), "at least 1")):
        status, body = post(url, json.dumps({**chat, "max_tokens": huge}).encode(),
                            {"X-KVGate-Workflow": "absurd", "X-KVGate-Task": f"t{huge > 0}"})
        assert status == 400, body
        assert_openai_error(body, refusal)
    # A role that is not a string, in a call the planner tags by segment.
    odd = {**chat, "max_tokens": 2,
           "messages": [{"role": ["system"], "content": "x"}, *chat["messages"]]}
    status, body = post(url, json.dumps(odd).encode(), {"X-KVGate-Workflow": "odd-role"})
    assert status < 500, body
    status, body = post(url, json.dumps({**chat, "max_tokens": 2}).encode())
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body


def test_missing_model_is_a_400_naming_the_field(gateway: Child) -> None:
    status, body = post(f"{gateway.url}/v1/chat/completions",
                        json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode())
    assert status == 400
    assert body["error"]["param"] == "model"
    assert_openai_error(body, "model")


def test_body_over_the_limit_is_a_413(
    sims: list[Child], spawn_gateway: Callable[[dict[str, Any]], Child]
) -> None:
    gw = spawn_gateway({"engines": [{"url": sims[0].url}], "max_body_bytes": 2048})
    wait_healthy(gw)
    big = json.dumps({"model": MODEL, "prompt": "x" * 5000}).encode()
    status, body = post(f"{gw.url}/v1/completions", big)
    assert status == 413
    assert_openai_error(body, "2048 bytes")
    # A body under the limit still works through the same gateway.
    status, body = post(f"{gw.url}/v1/completions",
                        json.dumps({"model": MODEL, "prompt": "ok", "max_tokens": 1}).encode())
    assert status == 200
    # A client that asks first (`Expect: 100-continue`, as curl does past 1 KB) is refused
    # from its Content-Length before it sends the body (it was told to go on), and one within
    # the limit is told to go on, on every route that takes a body.
    host, port = gw.url.removeprefix("http://").split(":")
    small = json.dumps({"model": MODEL, "prompt": "ok", "max_tokens": 1}).encode()
    for path, size, answer in (("/v1/completions", 100_000_000, b"413"),
                               ("/v1/chat/completions", 5000, b"413"),
                               ("/v1/workflows", 100_000_000, b"413"),
                               ("/v1/completions", len(small), b"100 Continue")):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST %s HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n"
                         % (path.encode(), size))
            head = read_until(sock, b"\r\n\r\n")
            assert head.split(b"\r\n")[0].split(b" ", 1)[1].startswith(answer), (path, head)
            if answer == b"100 Continue":
                sock.sendall(small)
                assert b"200 OK" in read_until(sock, b"\r\n\r\n", head.split(b"\r\n\r\n", 1)[1])


def wait_listening(child: Child, timeout: float = 60.0) -> int:
    """Wait until the child answers HTTP at all (any status); return /health's status."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{child.url}/health", timeout=2) as r:
                return int(r.status)
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_no_healthy_engine_is_a_503(spawn_gateway: Callable[[dict[str, Any]], Child]) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    gw = spawn_gateway({"engines": [{"url": dead}], "health_interval_s": 0.2})
    # Listening (its start-up may be slow on a loaded machine) but not healthy.
    assert wait_listening(gw) == 503
    status, body = post(f"{gw.url}/v1/completions",
                        json.dumps({"model": MODEL, "prompt": "hi"}).encode())
    assert status == 503
    assert body["error"]["code"] == "no_healthy_engine"
    assert_openai_error(body, "no engine is healthy")


def test_engine_dying_mid_stream_ends_the_stream_with_an_error(
    spawn_sim: Callable[..., Child], spawn_gateway: Callable[[dict[str, Any]], Child]
) -> None:
    # Steps 50x slower than an H100 (about 0.4 s per token): the kill lands mid-stream.
    doomed = spawn_sim("--time-scale", "50")
    survivor = spawn_sim()
    gw = spawn_gateway({"engines": [{"url": doomed.url, "name": "doomed"},
                                    {"url": survivor.url, "name": "survivor"}],
                        "policy": "round-robin", "health_interval_s": 60})
    wait_healthy(gw)
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="k", max_retries=0, timeout=60)
    stream = client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=200, stream=True, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": "Write a long story."}],
    )
    assert stream.headers["x-kvgate-engine"] == "doomed"
    received = []
    with pytest.raises(openai.APIError) as info:
        for chunk in stream.parse():
            received.append(chunk)
            if len(received) == 2:
                doomed.kill()
    assert 2 <= len(received) < 200
    assert "doomed" in str(info.value) and "mid-stream" in str(info.value)
    # The pool keeps serving: the next request lands on the survivor.
    resp = client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Still there?"}])
    assert resp.headers["x-kvgate-engine"] == "survivor"


def test_engine_dead_before_answering_is_retried_on_another(
    spawn_sim: Callable[..., Child], spawn_gateway: Callable[[dict[str, Any]], Child]
) -> None:
    a, b = spawn_sim(), spawn_sim()
    gw = spawn_gateway({"engines": [{"url": a.url, "name": "a"}, {"url": b.url, "name": "b"}],
                        "policy": "round-robin", "health_interval_s": 60})
    wait_healthy(gw)
    a.kill()  # the gateway cannot know yet: health checks are a minute apart
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="k", max_retries=0, timeout=60)
    served = []
    for i in range(4):
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=f"q{i}",
                                                          max_tokens=1)
        served.append(raw.headers["x-kvgate-engine"])
    assert served == ["b"] * 4
    with urllib.request.urlopen(f"{gw.url}/metrics") as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    retries = sum(s.value for s in families["kvgate_retries"].samples
                  if s.name == "kvgate_retries_total" and s.labels["engine"] == "a")
    assert retries == 1
    # Four calls, four durations: the attempt re-sent elsewhere is not a call of its own.
    durations = sum(s.value for s in families["kvgate_request_duration_seconds"].samples
                    if s.name == "kvgate_request_duration_seconds_count")
    assert durations == 4


class RecordingEngine:
    """A minimal OpenAI-speaking upstream that records what the gateway forwarded."""

    def __init__(self) -> None:
        self.requests: list[tuple[CIMultiDict[str], bytes]] = []
        self.raw_headers: list[tuple[tuple[bytes, bytes], ...]] = []
        self.release = threading.Event()
        self.app = web.Application()
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/metrics", self.metrics)
        self.app.router.add_post("/v1/chat/completions", self.chat)

    async def health(self, _: web.Request) -> web.Response:
        return web.Response()

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "rec", "object": "model"}]})

    async def metrics(self, _: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.requests.append((CIMultiDict(request.headers), raw))
        self.raw_headers.append(request.raw_headers)
        body = json.loads(raw)
        if "fail_with" in body:
            return web.json_response({"error": {"message": "slow down", "type": "rate_limit",
                                                "param": None, "code": 429}},
                                     status=body["fail_with"], headers={"retry-after": "7"})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        # As vLLM: the answer's head goes out at once, its first event once the prompt is in.
        await asyncio.sleep(body.get("first_after_s", 0))
        if body.get("die_mid_event"):
            # A whole event, then half of one, and the engine is gone.
            await resp.write(b'data: {"n": 1}\n\n')
            await asyncio.sleep(0.2)
            await resp.write(b'data: {"n": 2, "par')
            await asyncio.sleep(0.2)
            assert request.transport is not None
            request.transport.abort()
            return resp
        end = b"\r\n\r\n" if body.get("crlf") else b"\n\n"
        await resp.write(b'data: {"n": 1}' + end)
        # Hold the rest until the test has seen the first chunk through the gateway.
        released = await asyncio.get_running_loop().run_in_executor(None, self.release.wait, 30)
        await resp.write(b'data: {"n": 2, "released": %s}\n\n' % str(released).lower().encode())
        await resp.write(b"data: [DONE]\n\n")
        if "linger_s" in body:
            # The last event is out; the stream's end comes later (a slow engine, a busy loop).
            await asyncio.sleep(body["linger_s"])
        return resp


class DroppingEngine(RecordingEngine):
    """An engine that takes each call, works on it for `work_s`, then drops the connection
    before any answer (a crash, a load balancer's idle timeout): a non-streamed call sees no
    head, a streamed one its head and no event. With `drop` false it answers."""

    def __init__(self, name: str, drop: bool, work_s: float = 1.0) -> None:
        super().__init__()
        self.name, self.drop, self.work_s = name, drop, work_s
        self.calls = 0
        self.seen: list[str] = []

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.calls += 1
        self.seen.append(body["messages"][0]["content"])
        assert request.transport is not None
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)  # vLLM's head goes out before the prompt is in
            if self.drop:
                await asyncio.sleep(self.work_s)
                request.transport.abort()
                return resp
            await resp.write(b'data: {"choices": [{"delta": {"content": "ok"}}]}\n\n')
            await resp.write(b"data: [DONE]\n\n")
            return resp
        await asyncio.sleep(self.work_s)
        if self.drop:
            request.transport.abort()
        return web.json_response({"choices": [{"message": {"content": "ok"}}],
                                  "usage": {"completion_tokens": 1}})


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_that_drops_a_call_it_worked_on_is_not_sent_it_again(
    stream: bool, threaded_server: Callable[[web.Application], ThreadedServer],
    spawn_gateway: Callable[[dict[str, Any]], Child],
) -> None:
    # It used to be sent the call again on a fresh connection (the generation ran twice),
    # then taken out of rotation; a stream that had its head but no event was a 200 with an
    # error event, never retried.
    dropper, answerer = DroppingEngine("dropper", True), DroppingEngine("answerer", False, 0)
    urls = {e.name: threaded_server(e.app).url for e in (dropper, answerer)}
    gw = spawn_gateway({"engines": [{"url": urls[n], "name": n} for n in urls],
                        "policy": "round-robin", "health_interval_s": 60})
    wait_healthy(gw)
    served = []
    for i in range(3):  # round-robin: the dropper is tried first for some of them
        body = {"model": "rec", "messages": [{"role": "user", "content": f"call {i}"}],
                "stream": stream}
        req = urllib.request.Request(f"{gw.url}/v1/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
            text = r.read().decode()
            served.append(r.headers["x-kvgate-engine"])
        assert "ok" in text and "error" not in text
    assert served == ["answerer"] * 3
    assert dropper.calls >= 1 and len(set(dropper.seen)) == dropper.calls  # none sent twice
    with urllib.request.urlopen(f"{gw.url}/health") as r:
        assert json.loads(r.read())["engines"]["dropper"] is True  # its checks decide
    with urllib.request.urlopen(f"{gw.url}/metrics") as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    dropped = [s for s in families["kvgate_upstream_errors"].samples
               if s.name == "kvgate_upstream_errors_total" and s.labels["kind"] == "dropped"]
    assert [(s.labels["engine"], s.value) for s in dropped] == [("dropper", dropper.calls)]


def test_a_stream_silent_past_the_timeout_before_its_first_event_is_a_504_not_a_retry(
    threaded_server: Callable[[web.Application], ThreadedServer],
    spawn_gateway: Callable[[dict[str, Any]], Child],
) -> None:
    slow, other = DroppingEngine("slow", True, 5.0), DroppingEngine("other", False, 0)
    urls = {e.name: threaded_server(e.app).url for e in (slow, other)}
    gw = spawn_gateway({"engines": [{"url": urls[n], "name": n} for n in urls],
                        "policy": "round-robin", "health_interval_s": 60,
                        "request_timeout_s": 1.0})
    wait_healthy(gw)
    answers = []
    for i in range(2):  # round-robin: one of the two goes to the slow engine
        req = urllib.request.Request(f"{gw.url}/v1/chat/completions", data=json.dumps(
            {"model": "rec", "stream": True,
             "messages": [{"role": "user", "content": f"call {i}"}]}).encode(),
            headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                answers.append((r.status, r.read()))
        except urllib.error.HTTPError as e:
            answers.append((e.code, json.loads(e.read())))
    assert slow.calls == 1 and len(other.seen) == 1  # the slow engine's call went nowhere else
    (timed_out,) = [body for status, body in answers if status == 504]
    assert timed_out["error"]["code"] == "engine_timeout"


def test_the_last_engines_failure_is_named_when_no_engine_is_left(
    threaded_server: Callable[[web.Application], ThreadedServer],
    spawn_gateway: Callable[[dict[str, Any]], Child],
) -> None:
    dropper = DroppingEngine("dropper", True, 0.8)
    gw = spawn_gateway({"engines": [{"url": threaded_server(dropper.app).url,
                                     "name": "dropper"}], "health_interval_s": 60})
    wait_healthy(gw)
    status, out = post(f"{gw.url}/v1/chat/completions", json.dumps(
        {"model": "rec", "messages": [{"role": "user", "content": "hi"}]}).encode())
    assert status == 503 and dropper.calls == 1, out
    assert "the engine tried before failed: dropper: the engine closed the connection" in \
        out["error"]["message"], out


@pytest.fixture
def recorded(
    threaded_server: Callable[[web.Application], ThreadedServer],
    spawn_gateway: Callable[[dict[str, Any]], Child],
) -> tuple[RecordingEngine, Child]:
    engine = RecordingEngine()
    server = threaded_server(engine.app)
    gw = spawn_gateway({"engines": [{"url": server.url}]})
    wait_healthy(gw)
    return engine, gw


def test_time_to_first_token_is_the_first_event_not_the_answers_head(
    recorded: tuple[RecordingEngine, Child],
) -> None:
    from tests.test_gateway_metrics import scrape, value

    engine, gw = recorded
    engine.release.set()
    req = urllib.request.Request(
        f"{gw.url}/v1/chat/completions", method="POST",
        data=b'{"model": "rec", "messages": [], "stream": true, "first_after_s": 0.5}',
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200 and b"[DONE]" in r.read()
    samples = scrape(gw.url)
    route = "/v1/chat/completions"
    assert value(samples, "kvgate_time_to_first_token_seconds_count", route=route) == 1
    assert (value(samples, "kvgate_time_to_first_token_seconds_sum", route=route) or 0) >= 0.5
    assert (value(samples, "kvgate_time_to_first_byte_seconds_sum", route=route) or 1) < 0.5


def test_unknown_fields_and_tracing_headers_pass_through(
    recorded: tuple[RecordingEngine, Child],
) -> None:
    engine, gw = recorded
    engine.release.set()
    body = (b'{"model": "rec", "messages": [], "stream": true, "kv_transfer_params": '
            b'{"do_remote_decode": true}, "priority": -3, "cache_salt": "t1", "x_custom": [1]}')
    headers = {"Authorization": "Bearer sk-123",
               "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
               "x-request-id": "req-42"}
    req = urllib.request.Request(f"{gw.url}/v1/chat/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(req, timeout=30) as r:
        r.read()
    got_headers, got_body = engine.requests[-1]
    assert got_body == body
    for k, v in headers.items():
        if k != "traceparent":
            assert got_headers[k] == v
    # Same trace, same flags; the parent is now the gateway's engine-call span (tracing.py).
    version, trace_id, parent, flags = got_headers["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", "0af7651916cd43dd8448eb211c80319c", "01")
    assert parent != "b7ad6b7169203331"


def test_the_kv_event_report_mode_is_taken_out_of_vllm_xargs(
    recorded: tuple[RecordingEngine, Child],
) -> None:
    # "full" would make the engine announce every reused block again, which the gateway's
    # index would count as copies no removal takes back; the client's other xargs stay.
    engine, gw = recorded
    engine.release.set()
    # Nor may a client set the planner's pacing caps (a cap of 1 token a step held an
    # engine's slot for thousands of steps) or vLLM's priority header, which outranks the
    # planner's `priority` at a priority-scheduled engine.
    body = {"model": "rec", "messages": [], "stream": True,
            "vllm_xargs": {"kv_cache_report_mode": "full", "client_note": "kept",
                           "kvgate_prefill_cap": 1, "kvgate_prefill_caps": [0, 1]}}
    req = urllib.request.Request(f"{gw.url}/v1/chat/completions", method="POST",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "X-Vllm-Priority": "-1000000"})
    with urllib.request.urlopen(req, timeout=30) as r:
        r.read()
    got = json.loads(engine.requests[-1][1])
    assert got == {**body, "vllm_xargs": {"client_note": "kept"}}
    assert "X-Vllm-Priority" not in engine.requests[-1][0]


def test_header_bytes_outside_latin_1_reach_the_engine_unchanged(
    recorded: tuple[RecordingEngine, Child],
) -> None:
    engine, gw = recorded
    engine.release.set()
    sent = {"x-title": "\u6771\u4eac agent".encode(), "x-raw": b"\xff\xfeok",
            "x-accented": "caf\u00e9".encode("latin-1")}
    req = urllib.request.Request(f"{gw.url}/v1/chat/completions", method="POST",
                                 data=b'{"model": "rec", "stream": true}',
                                 headers={"Content-Type": "application/json",
                                          **sent})  # type: ignore[dict-item]
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
        r.read()
    got = {name.decode().lower(): value for name, value in engine.raw_headers[-1]}
    for name, value in sent.items():
        assert got[name] == value, name


def test_engine_error_status_and_body_are_relayed(recorded: tuple[RecordingEngine, Child]) -> None:
    _, gw = recorded
    req = urllib.request.Request(f"{gw.url}/v1/chat/completions", method="POST",
                                 data=b'{"model": "rec", "fail_with": 429}',
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 429
    assert info.value.headers["retry-after"] == "7"
    assert json.loads(info.value.read())["error"]["message"] == "slow down"


def test_stream_chunks_are_forwarded_before_the_stream_ends(
    recorded: tuple[RecordingEngine, Child],
) -> None:
    engine, gw = recorded
    req = urllib.request.Request(f"{gw.url}/v1/chat/completions", method="POST",
                                 data=b'{"model": "rec", "stream": true}',
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        first = r.readline()
        # The engine holds its second chunk until we have seen the first: a buffering gateway
        # would deliver nothing here and the engine would report released=false.
        assert first == b'data: {"n": 1}\n'
        engine.release.set()
        rest = r.read()
    assert b'"released": true' in rest


def raw_chat(gw: Child, body: bytes, timeout: float) -> socket.socket:
    """A socket that has sent `body` to the gateway's chat route (its answer is the caller's
    to read)."""
    host, port = gw.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(body), body))
    return sock


def read_until(sock: socket.socket, marker: bytes, got: bytes = b"") -> bytes:
    """What the socket gave until `marker` arrived (after `got`, read before)."""
    while marker not in got:
        chunk = sock.recv(65536)
        assert chunk, f"the stream ended before {marker!r}: {got!r}"
        got += chunk
    return got


class FloodingEngine(RecordingEngine):
    """An engine that streams `mb` MB of events as fast as it can, and notes whether the
    gateway dropped its connection before the end. The default is far more than the kernel
    buffers between it and a client that stops reading can hold (with tcp_rmem's maximum at
    32 MB, 16 MB fit whole in the gateway's upstream receive buffer and the engine finished)."""

    def __init__(self, mb: int = 1024) -> None:
        super().__init__()
        self.mb = mb
        self.dropped = threading.Event()
        self.finished = threading.Event()

    async def chat(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        event = b'data: {"choices": [{"delta": {"content": "' + b"x" * 1000 + b'"}}]}\n\n'
        try:
            for _ in range(self.mb * 1000):
                await resp.write(event)
            await resp.write(b"data: [DONE]\n\n")
            self.finished.set()
        except (ConnectionResetError, ConnectionError):
            self.dropped.set()
        return resp


def test_a_client_that_stops_reading_is_dropped_and_its_call_ended(
    threaded_server: Callable[[web.Application], ThreadedServer],
    spawn_gateway: Callable[[dict[str, Any]], Child],
) -> None:
    from tests.test_kv_moves_live import metrics

    # It used to keep the call in flight, the engine writing into a paused socket, for as
    # long as the client's connection stayed open (a vanished client: about 15 minutes).
    engine = FloodingEngine()
    gw = spawn_gateway({"engines": [{"url": threaded_server(engine.app).url}],
                        "client_write_timeout_s": 1.0})
    wait_healthy(gw)
    with raw_chat(gw, b'{"model": "rec", "messages": [], "stream": true}', 30) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        assert b"200 OK" in read_until(sock, b"\r\n\r\n")
        # ... and reads no more.
        assert engine.dropped.wait(20) and not engine.finished.is_set()

        def in_flight() -> list[float]:
            return [v for (name, _), v in metrics(gw.url).items()
                    if name == "kvgate_engine_in_flight"]

        deadline = time.monotonic() + 10
        while in_flight() != [0.0] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert in_flight() == [0.0]  # with the client's connection still open
    assert _request_counts(gw.url).get("499") == 1


def _request_counts(url: str, route: str = "/v1/chat/completions") -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {s.labels["status"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "kvgate_requests_total"
            and s.labels["route"] == route}


def test_an_engine_dying_mid_event_leaves_the_client_whole_events_and_the_error(
    recorded: tuple[RecordingEngine, Child],
) -> None:
    """The half event the engine sent before it died is not forwarded: the error event
    begins on an event boundary, so an SSE client reads it (and the openai client raises)."""
    _, gw = recorded
    req = urllib.request.Request(
        f"{gw.url}/v1/chat/completions", method="POST",
        data=b'{"model": "rec", "messages": [], "stream": true, "die_mid_event": true}',
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        events = r.read().decode().split("\n\n")
    assert events[0] == 'data: {"n": 1}' and events[-1] == ""
    assert events[1].startswith('data: {"error": ') and len(events) == 3, events
    # The client had a 200 head; the call's own span says what became of it, as the counters
    # do (a search for failed calls finds it).
    with urllib.request.urlopen(f"{gw.url}/v1/traces", timeout=10) as r:
        ids = [t["trace_id"] for t in json.loads(r.read())["traces"]]
    calls = []
    for tid in ids:
        with urllib.request.urlopen(f"{gw.url}/v1/traces/{tid}", timeout=10) as r:
            calls += [sp for sp in json.loads(r.read())["spans"]
                      if sp["name"].startswith("chat") and sp["parent_span_id"] is None]
    (call,) = calls
    assert call["attributes"]["http.response.status_code"] == 502
    assert call["status"]["code"] == "error" and "failed mid-stream" in call["status"][
        "description"]
    assert _request_counts(gw.url).get("502") == 1


def test_events_that_end_in_crlf_are_forwarded_as_they_come(
    recorded: tuple[RecordingEngine, Child],
) -> None:
    engine, gw = recorded  # the engine holds its second event until `release`
    with raw_chat(gw, b'{"model": "rec", "stream": true, "crlf": true}', 10) as sock:
        got = read_until(sock, b'data: {"n": 1}\r\n\r\n')
        engine.release.set()
        read_until(sock, b"data: [DONE]", got)


def test_every_answer_is_counted_once_by_its_route(
    recorded: tuple[RecordingEngine, Child],
) -> None:
    """Not only the proxied calls: the workflow API's answers, a wrong method and an unknown
    path are counted too, so a per-route error ratio reads what clients got."""
    engine, gw = recorded
    engine.release.set()
    for method, path in (("GET", "/v1/workflows"), ("GET", "/v1/workflows"),
                         ("GET", "/v1/workflows/nobody"), ("GET", "/no/such/path"),
                         ("PUT", "/v1/chat/completions")):
        req = urllib.request.Request(f"{gw.url}{path}", method=method)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                r.read()
        except urllib.error.HTTPError as e:
            e.read()
    req = urllib.request.Request(f"{gw.url}/v1/chat/completions", method="POST",
                                 data=b'{"model": "rec", "messages": []}',
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        r.read()
    with urllib.request.urlopen(f"{gw.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    counted = {(s.labels["route"], s.labels["status"]): s.value
               for f in text_string_to_metric_families(text)
               for s in f.samples if s.name == "kvgate_requests_total"}
    assert counted[("/v1/workflows", "200")] == 2
    assert counted[("/v1/workflows/{id}", "404")] == 1
    assert counted[("unmatched", "404")] == 1
    assert counted[("unmatched", "405")] == 1  # no route took the method
    assert counted[("/v1/chat/completions", "200")] == 1


def test_client_hanging_up_after_the_last_event_is_no_499(
    recorded: tuple[RecordingEngine, Child],
) -> None:
    """A client that reads up to `data: [DONE]` and hangs up before the chunked body's last
    frame (httpx-based clients such as guidellm do) had the whole answer: a 200, not a 499."""
    engine, gw = recorded
    engine.release.set()
    with raw_chat(gw, b'{"model": "rec", "stream": true, "linger_s": 1.0}', 30) as sock:
        read_until(sock, b"data: [DONE]")
        # Hang up at once, with a reset, while the gateway still waits for the engine's end.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not _request_counts(gw.url):
        time.sleep(0.1)
    assert _request_counts(gw.url) == {"200": 1.0}


def test_invalid_config_names_the_bad_key(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("engines:\n  - url: not-a-url\n    prfile: x\npolicy: fastest\nbogus: 1\n")
    proc = subprocess.run([sys.executable, "-m", "kvgate.cli", "serve", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "engines.0.url" in proc.stderr
    assert "policy" in proc.stderr and "fastest" in proc.stderr
    assert "bogus" in proc.stderr
    # A misspelt key is named with the keys its section knows.
    assert "known keys here: host, port, engines" in proc.stderr
    assert "engines.0.prfile" in proc.stderr and "profile, profile_file" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_client_hanging_up_aborts_the_request_at_the_engine(
    spawn_sim: Callable[..., Child], spawn_gateway: Callable[[dict[str, Any]], Child]
) -> None:
    slow = spawn_sim("--time-scale", "50")
    gw = spawn_gateway({"engines": [{"url": slow.url}]})
    wait_healthy(gw)
    body = json.dumps({"model": MODEL, "prompt": "tell me everything", "max_tokens": 500,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{gw.url}/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(TimeoutError):
        urllib.request.urlopen(req, timeout=1.0)

    def engine_counts() -> tuple[float, float]:
        """Requests at the engine (running or waiting), and requests it finished. vLLM counts
        no statistics for a request its client left: the 500-token answer, which takes the
        engine half a minute, leaves the engine at once and is never finished."""
        with urllib.request.urlopen(f"{slow.url}/metrics") as r:
            text = r.read().decode()
        present = finished = 0.0
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                    present += s.value
                if s.name == "vllm:request_success_total":
                    finished += s.value
        return present, finished

    for _ in range(100):
        if engine_counts() == (0.0, 0.0):
            break
        threading.Event().wait(0.1)
    assert engine_counts() == (0.0, 0.0)
    # Counted as the client's hang-up, and a hint-mode call's record says it was cancelled.
    assert _request_counts(gw.url, "/v1/completions") == {"499": 1.0}
    req.add_header("X-KVGate-Workflow", "left")
    with pytest.raises(TimeoutError):
        urllib.request.urlopen(req, timeout=1.0)
    for _ in range(100):
        with urllib.request.urlopen(f"{gw.url}/v1/workflows/left", timeout=10) as r:
            workflow = json.load(r)
        if workflow["state"] != "running":
            break
        threading.Event().wait(0.1)
    [task] = workflow["tasks"].values()
    assert task["state"] == "cancelled" and "client went away" in task["error"]
    assert workflow["state"] == "done"
    assert _request_counts(gw.url, "/v1/completions") == {"499": 2.0}


class CutJsonEngine:
    """An upstream whose JSON completion promises 400 bytes and dies after 20."""

    def __init__(self) -> None:
        self.app = web.Application()
        self.app.router.add_get("/health", self.ok)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/metrics", self.metrics)
        self.app.router.add_post("/v1/completions", self.complete)

    async def ok(self, _: web.Request) -> web.Response:
        return web.Response()

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "cut", "object": "model"}]})

    async def metrics(self, _: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")

    async def complete(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "application/json",
                                           "Content-Length": "400"})
        await resp.prepare(request)
        await resp.write(b'{"id": "cmpl-1", "ob')
        assert request.transport is not None
        request.transport.abort()
        return resp


class CutHeadEngine(CutJsonEngine):
    """An upstream that dies halfway through its answer's head."""

    async def complete(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        assert request.transport is not None
        request.transport.write(b"HTTP/1.1 200 OK\r\nContent-Ty")
        await asyncio.sleep(0.05)
        request.transport.abort()
        return web.StreamResponse()


def _completion_through(engine: web.Application, retries: int,
                        threaded_server: Callable[[web.Application], ThreadedServer],
                        spawn_gateway: Callable[[dict[str, Any]], Child],
                        ) -> tuple[int, dict[str, Any], Child]:
    """One completion through a gateway whose only engine is `engine` (named `cutter`): the
    status the client got, the error object and the gateway."""
    server = threaded_server(engine)
    gw = spawn_gateway({"engines": [{"url": server.url, "name": "cutter"}], "retries": retries})
    wait_healthy(gw)
    body = json.dumps({"model": "cut", "prompt": "hello", "max_tokens": 2}).encode()
    req = urllib.request.Request(f"{gw.url}/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(req, timeout=30)
    return caught.value.code, json.loads(caught.value.read())["error"], gw


def test_engine_dying_mid_head_is_a_502_naming_the_engine_not_a_retry(
    threaded_server: Callable[[web.Application], ThreadedServer],
    spawn_gateway: Callable[[dict[str, Any]], Child],
) -> None:
    """The engine had the request (it began answering), so the gateway does not send it again."""
    status, error, gw = _completion_through(CutHeadEngine().app, 2, threaded_server,
                                            spawn_gateway)
    assert status == 502
    assert "cutter" in error["message"] and error["code"] == "engine_failed"
    assert "Traceback" not in gw.log_tail(200)


def test_engine_dying_mid_json_body_is_a_502_naming_the_engine(
    threaded_server: Callable[[web.Application], ThreadedServer],
    spawn_gateway: Callable[[dict[str, Any]], Child],
) -> None:
    status, error, _ = _completion_through(CutJsonEngine().app, 0, threaded_server,
                                           spawn_gateway)
    assert status == 502
    assert "cutter" in error["message"] and error["code"] == "engine_failed"


def test_a_hint_mode_call_goes_on_when_the_workflow_store_is_away(
    spawn_sim: Callable[..., Child], spawn_gateway: Callable[[dict[str, Any]], Child],
) -> None:
    # The workflow record is the call's account, not the call: with Redis gone the call is
    # answered (it was a 500), unrecorded, and the engine's load is given back.
    from tests.redis_server import RedisServer
    from tests.test_kv_moves_live import metrics

    sim = spawn_sim()
    with RedisServer() as url:
        gw = spawn_gateway({"engines": [{"url": sim.url}],
                            "workflows": {"store": "redis", "redis_url": url}})
        wait_healthy(gw)
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="none", max_retries=0)
    for task in ("plan", "work"):
        answer = client.chat.completions.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}],
            extra_headers={"X-KVGate-Workflow": "away-1", "X-KVGate-Task": task})
        assert answer.choices[0].message.content is not None
    in_flight = [v for (name, _), v in metrics(gw.url).items()
                 if name == "kvgate_engine_in_flight"]
    assert in_flight == [0.0]


def test_workflow_reads_with_the_store_away_are_503s_and_a_follower_gets_an_error_event(
    spawn_sim: Callable[..., Child], spawn_gateway: Callable[[dict[str, Any]], Child],
) -> None:
    from tests.redis_server import RedisServer

    sim = spawn_sim("--time-scale", "20")
    with RedisServer() as url:
        gw = spawn_gateway({"engines": [{"url": sim.url}],
                            "workflows": {"store": "redis", "redis_url": url}})
        wait_healthy(gw)
        status, snap = post(f"{gw.url}/v1/workflows", json.dumps({
            "model": MODEL, "tasks": [{"id": "t", "output_tokens": 200, "messages": [
                {"role": "user", "content": "a long answer"}]}]}).encode())
        assert status == 201
        wf = snap["id"]
        follower = urllib.request.urlopen(f"{gw.url}/v1/workflows/{wf}/events", timeout=30)
        assert follower.readline().startswith(b"id: ")
    # Redis is gone: reads, the list and a cancel say so, with the store's code.
    for method, path in (("GET", f"/v1/workflows/{wf}"), ("GET", "/v1/workflows"),
                         ("DELETE", f"/v1/workflows/{wf}"),
                         ("GET", f"/v1/workflows/{wf}/events")):
        req = urllib.request.Request(gw.url + path, method=method)
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=30)
        assert info.value.code == 503, (method, path)
        body = json.loads(info.value.read())
        assert_openai_error(body, "workflow store could not be reached")
        assert body["error"]["code"] == "workflow_store_unavailable"
    # The follower's stream ends with an error event rather than a cut connection.
    rest = follower.read().decode()
    last = [line for line in rest.splitlines() if line.startswith("data: ")][-1]
    error = json.loads(last[6:])
    assert error["type"] == "error" and error["error"]["code"] == "workflow_store_unavailable"


class GarbageEngine(RecordingEngine):
    """An engine whose `/v1/models` and `/metrics` answer nothing a health check can read."""

    def __init__(self, models: bytes) -> None:
        super().__init__()
        self.models_body = models

    async def models(self, _: web.Request) -> web.Response:
        return web.Response(body=self.models_body, content_type="application/json")

    async def metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=b"\xff\xfe vllm:num_requests_running 0\n",
                            content_type="text/plain")


@pytest.mark.parametrize("models", [b"[1, 2]", b'"ok"', b'{"data": [{"name": "m"}]}',
                                    b'{"data": [{"id": "\xff"}]}'])
def test_an_engine_answering_garbage_is_unhealthy_not_a_crash(
    models: bytes, threaded_server: Callable[[web.Application], ThreadedServer],
    spawn_sim: Callable[..., Child], spawn_gateway: Callable[[dict[str, Any]], Child],
) -> None:
    sim = spawn_sim()
    garbage = threaded_server(GarbageEngine(models).app)
    gw = spawn_gateway({"engines": [{"url": sim.url}, {"url": garbage.url}],
                        "admin_key": "k" * 32})
    wait_healthy(gw)  # it starts: the good engine serves
    with urllib.request.urlopen(f"{gw.url}/health", timeout=10) as r:
        engines = json.loads(r.read())["engines"]
    assert engines == {sim.url.removeprefix("http://"): True,
                       garbage.url.removeprefix("http://"): False}
    other = threaded_server(GarbageEngine(models).app)
    status, body = post(f"{gw.url}/admin/engines", json.dumps({"url": other.url}).encode(),
                        {"Authorization": f"Bearer {'k' * 32}"})
    assert (status, body) == (201, {"name": other.url.removeprefix("http://"),
                                    "healthy": False})


def test_a_body_nested_too_deeply_to_send_on_is_a_400_and_gives_its_engine_back(
    threaded_server: Callable[[web.Application], ThreadedServer],
    spawn_gateway: Callable[[dict[str, Any]], Child],
) -> None:
    """A priority-scheduled engine gets the call's `priority` in its body; a body that carries
    one of its own is encoded again for that, from deeper in the stack than it was read. Nested
    just less deeply than reading allows, it could not be (a 500, after the planner had placed
    the call: the engine's load never given back). Swept over the depths where that happens."""
    from tests.test_kv_moves_live import metrics

    engine = RecordingEngine()
    engine.release.set()  # its answers go out whole at once
    server = threaded_server(engine.app)
    gw = spawn_gateway({"policy": "kvgate", "engines": [
        {"url": server.url, "name": "r", "scheduling_policy": "priority"}]})
    wait_healthy(gw)
    statuses = set()
    for depth in range(1000, 930, -1):
        body = (b'{"model": "rec", "messages": [{"role": "user", "content": "hi"}], '
                b'"max_tokens": 1, "priority": 0, "x": ' + b"[" * depth + b"]" * depth + b"}")
        req = urllib.request.Request(f"{gw.url}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                statuses.add(r.status)
                assert b"[DONE]" in r.read()
        except urllib.error.HTTPError as e:
            statuses.add(e.code)
            error = e.read()
            assert e.code == 400 and b"too deeply" in error, error
    assert statuses == {200, 400}
    in_flight = [v for (name, _), v in metrics(gw.url).items()
                 if name == "kvgate_engine_in_flight"]
    assert in_flight == [0.0]
    assert "Traceback" not in gw.log_tail(200)


@pytest.mark.parametrize("scheduling", [None, "priority"])
def test_engines_named_on_the_command_line_may_schedule_by_priority(
    threaded_server: Callable[[web.Application], ThreadedServer], tmp_path: Path,
    scheduling: str | None,
) -> None:
    """`kvgate serve --engines ... --scheduling-policy priority` sends each call's rank as
    vLLM's `priority`, as a config entry's `scheduling_policy: priority` does (the live
    benchmark deploys a ranking planner's engines so, as the virtual one does); without it
    the engines get none (an fcfs vLLM refuses one)."""
    from kvgate.procs import start_gateway

    engine = RecordingEngine()
    engine.release.set()
    server = threaded_server(engine.app)
    gw = start_gateway([server.url], tmp_path, ["--scheduling-policy", scheduling]
                       if scheduling else [])
    try:
        req = urllib.request.Request(
            f"{gw.url}/v1/chat/completions", data=json.dumps({
                "model": "rec", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2}).encode(),
            headers={"Content-Type": "application/json", "X-KVGate-Workflow": "w",
                     "X-KVGate-Task": "a"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert b"[DONE]" in r.read()
    finally:
        gw.stop()
    sent = json.loads(engine.requests[-1][1])
    assert ("priority" in sent) == (scheduling == "priority")
