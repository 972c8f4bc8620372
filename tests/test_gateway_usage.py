"""The planner hears how many tokens each call generated as the engine counts them: a JSON
answer's usage, a stream's usage event where its client asked for one (`stream_options`), and
otherwise the stream's events (which may each carry several tokens: an undercount)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from aiohttp import web

from kvgate.procs import Child, wait_healthy
from tests.conftest import ThreadedServer
from tests.test_gateway_failures import RecordingEngine

TOKENS_PER_EVENT = 4
"""As vLLM streams when its API server falls behind (or with `--stream-interval 4`)."""


class UsageEngine(RecordingEngine):
    """An OpenAI-speaking upstream that records each body and answers `max_tokens` tokens,
    streamed `TOKENS_PER_EVENT` to an event."""

    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[dict[str, Any]] = []

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        self.bodies.append(body)
        n = body["max_tokens"]
        usage = {"prompt_tokens": 5, "total_tokens": 5 + n, "completion_tokens": n}
        if not body.get("stream"):
            return web.json_response({
                "id": "chatcmpl-1", "object": "chat.completion", "model": "rec",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * n},
                             "finish_reason": "length"}], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(n // TOKENS_PER_EVENT):
            event = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "rec",
                     "choices": [{"index": 0, "delta": {"content": "x" * TOKENS_PER_EVENT}}]}
            await resp.write(b"data: " + json.dumps(event, separators=(",", ":")).encode()
                             + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            event = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "rec",
                     "choices": [], "usage": usage}
            await resp.write(b"data: " + json.dumps(event, separators=(",", ":")).encode()
                             + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        await asyncio.sleep(0)
        return resp


def chat(gw: Child, workflow: str, task: str, max_tokens: int, stream: bool = False,
         **extra: Any) -> bytes:
    body = {"model": "rec", "messages": [{"role": "user", "content": f"{workflow} {task}"}],
            "max_tokens": max_tokens, "stream": stream, **extra}
    req = urllib.request.Request(
        f"{gw.url}/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json", "X-KVGate-Workflow": workflow,
                 "X-KVGate-Task": task})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
        answer = r.read()
    time.sleep(0.2)  # the call's end reaches the planner after the client has its answer
    return bytes(answer)


def test_the_engines_token_counts_rank_hint_mode_workflows_by_service(
    threaded_server: Callable[[web.Application], ThreadedServer],
    spawn_gateway: Callable[[dict[str, Any]], Child],
) -> None:
    engine = UsageEngine()
    server = threaded_server(engine.app)
    gw = spawn_gateway({"policy": "kvgate", "engines": [
        {"url": server.url, "name": "u", "scheduling_policy": "priority"}]})
    wait_healthy(gw)

    chat(gw, "answered", "a", 400)
    chat(gw, "streamed", "a", 400, stream=True, stream_options={"include_usage": True})
    events = chat(gw, "events", "a", 400, stream=True)
    assert events.count(b"data: ") == 400 // TOKENS_PER_EVENT + 1  # the answer, and [DONE]

    priority = {}
    for workflow in ("answered", "streamed", "events", "fresh"):
        chat(gw, workflow, "b", 4)
        priority[workflow] = engine.bodies[-1]["priority"]
    # Least attained service first (vLLM runs the lower number first): 400 tokens each, as the
    # engine counted them, whether answered whole or streamed four to an event with its usage;
    # without usage, the stream's 100 events.
    assert priority["fresh"] < priority["events"] < priority["answered"]
    assert priority["answered"] == priority["streamed"]
    assert "Traceback" not in gw.log_tail(200)
