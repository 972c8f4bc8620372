"""HTTP hooks that put the current workflow context on outgoing OpenAI calls.

They work on any `httpx.AsyncClient` or `httpx2.AsyncClient` (the OpenAI client's, LangChain's
`http_async_client`, the OpenAI Agents SDK's through its `AsyncOpenAI`): the request hook runs in
the caller's asyncio task, so it reads the context variables at send time, not when the client
was made. Only POSTs to `/chat/completions` and `/completions` are annotated; a request that
names its own workflow or task (`X-KVGate-Workflow`, `X-KVGate-Task`, or the body's
`kvgate.workflow` / `kvgate.task`) is left alone, and a hint header the caller set itself (a
priority, say) is never replaced.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

from kvgate.sdk.context import (
    AFTER_HEADER,
    TASK_HEADER,
    WORKFLOW_HEADER,
    Call,
    call_hints,
    start_call,
)
from planner.hints import BODY_FIELD

_ANNOTATED = ("/chat/completions", "/completions")
_RETRY_HEADER = "x-stainless-retry-count"
"""The OpenAI client's retry counter: a retry is the same call, so it keeps its id."""

_in_flight: weakref.WeakKeyDictionary[Any, Call] = weakref.WeakKeyDictionary()


async def on_request(request: Any) -> None:
    """httpx request hook: add the hint headers of the current context."""
    if request.method != "POST" or not request.url.path.endswith(_ANNOTATED):
        return
    if WORKFLOW_HEADER in request.headers or TASK_HEADER in request.headers or _names_own(
            request):
        return
    retry = request.headers.get(_RETRY_HEADER, "0") not in ("", "0")
    call = start_call(retry=retry)
    if call is None:
        # Outside a workflow a `hints` block's priority and deadline still apply (the gateway
        # takes them on any call).
        for name, value in call_hints().items():
            if name not in request.headers:
                request.headers[name] = value
        return
    for name, value in call.headers.items():
        if name not in request.headers:
            request.headers[name] = value
    extra = call.body_hints
    if extra is not None and not _put_in_body(request, extra):
        # Not a JSON body the hook can rewrite: the header, however long, and the gateway
        # (or a proxy before it) says whether it takes it.
        request.headers[AFTER_HEADER] = ",".join(call.after)
    _in_flight[request] = call


def _names_own(request: Any) -> bool:
    """The JSON body's `kvgate` field names a workflow or task of the caller's own."""
    content = getattr(request, "_content", None)
    if not isinstance(content, bytes) or b'"' + BODY_FIELD.encode() + b'"' not in content:
        return False
    try:
        ours = json.loads(content).get(BODY_FIELD)
    except (ValueError, AttributeError):
        return False
    return isinstance(ours, dict) and ("workflow" in ours or "task" in ours)


def _put_in_body(request: Any, extra: dict[str, Any]) -> bool:
    """Merge `extra` into the JSON body's `kvgate` field (fields the caller set there win);
    False when the body is not a JSON object already read into memory."""
    content = getattr(request, "_content", None)
    if not isinstance(content, bytes) or "json" not in request.headers.get("content-type", ""):
        return False
    try:
        body = json.loads(content)
    except ValueError:
        return False
    if not isinstance(body, dict):
        return False
    ours = body.get(BODY_FIELD)
    if ours is None:
        ours = body[BODY_FIELD] = {}
    elif not isinstance(ours, dict):
        return False  # the gateway answers the caller's own malformed field with a 400
    for key, value in extra.items():
        ours.setdefault(key, value)
    new = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    request.stream = type(request.stream)(new)
    request._content = new
    request.headers["content-length"] = str(len(new))
    return True


async def on_response(response: Any) -> None:
    """httpx response hook: an answered call becomes a parent for later work once its body
    is read (a streamed answer at its end, or where the caller stops reading it); a failed
    one does not, and stays open for the client's retry. The hook runs when the response's
    head arrives, so the body's stream is wrapped to tell when it ends."""
    call = _in_flight.pop(response.request, None)
    if call is None or not 200 <= response.status_code < 300:
        return
    wrapper = _finishing_stream(type(response.stream))
    if wrapper is None or getattr(response, "is_closed", False):
        call.finished()  # no stream to follow (an unknown client, or read already)
        return
    response.stream = wrapper(response.stream, call)


_wrappers: dict[type, type | None] = {}


def _finishing_stream(kind: type) -> type | None:
    """A stream class that passes `kind`'s body through and finishes the call when the body
    ends or is closed without a failure; None where `kind` is no async byte stream."""
    if kind in _wrappers:
        return _wrappers[kind]
    base = next((c for c in kind.__mro__ if c.__name__ == "AsyncByteStream"), None)
    wrapper: type | None = None
    if base is not None:

        class _Finishing(base):  # type: ignore[misc, valid-type]
            def __init__(self, inner: Any, call: Call) -> None:
                self._inner = inner
                self._call: Call | None = call
                self._failed = False

            async def __aiter__(self) -> Any:
                try:
                    async for piece in self._inner:
                        yield piece
                except GeneratorExit:
                    raise  # the caller stopped reading: `aclose` tells the rest
                except BaseException:
                    self._failed = True
                    raise
                self._finish()

            async def aclose(self) -> None:
                self._finish()
                await self._inner.aclose()

            def _finish(self) -> None:
                call, self._call = self._call, None
                if call is not None and not self._failed:
                    call.finished()

        wrapper = _Finishing
    _wrappers[kind] = wrapper
    return wrapper


def add_hints(client: Any) -> Any:
    """Add the hooks to an `httpx.AsyncClient` / `httpx2.AsyncClient` (once); returns it. A
    synchronous client is refused: it would never run the hooks' coroutines."""
    if not hasattr(client, "__aenter__"):
        raise TypeError(f"add_hints takes an async HTTP client (httpx.AsyncClient); "
                        f"{type(client).__name__} is synchronous")
    hooks = client.event_hooks
    request_hooks = list(hooks.get("request", []))
    response_hooks = list(hooks.get("response", []))
    if on_request not in request_hooks:
        request_hooks.append(on_request)
    if on_response not in response_hooks:
        response_hooks.append(on_response)
    client.event_hooks = {"request": request_hooks, "response": response_hooks}
    return client


def http_client(**kwargs: Any) -> Any:
    """A new async HTTP client for `openai.AsyncOpenAI(http_client=...)` or LangChain's
    `ChatOpenAI(http_async_client=...)`, with the OpenAI client's defaults and the hooks.
    `kwargs` go to its constructor (timeout, limits, ...)."""
    import openai

    return add_hints(openai.DefaultAsyncHttpxClient(**kwargs))


def instrument(client: Any) -> Any:
    """An `openai.AsyncOpenAI` like `client` (same key, base URL, options) whose calls carry
    the workflow hints: a copy over a hooked HTTP client (a new one: a custom transport,
    proxy or TLS setting of the original's HTTP client is not carried over; for those, build
    the client yourself and pass it through `add_hints`)."""
    if not hasattr(client, "__aenter__"):
        raise TypeError(f"instrument takes an openai.AsyncOpenAI; {type(client).__name__} is "
                        "synchronous (the SDK's workflows are async)")
    return client.copy(http_client=http_client(timeout=client.timeout))
