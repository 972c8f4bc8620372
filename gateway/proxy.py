"""The OpenAI-compatible proxy: key the prompt, ask the index, let the policy place, forward.

Bodies are forwarded byte for byte (unknown fields survive) and responses are streamed back chunk
by chunk as the engine produces them. A request whose engine fails before answering is re-sent to
another engine; one whose engine dies mid-stream ends with an OpenAI-shaped error event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from gateway.errors import (
    BodyTooLarge,
    EngineFailed,
    EngineTimeout,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    NoHealthyEngine,
)
from gateway.state import GatewayState
from kvindex.keys import KeyExtras, PromptKeys
from kvindex.tokenizer import TokenizerError
from planner.holding import HoldQueue
from planner.ledger import Dispatch, close_dispatch, open_dispatch, prefill_done
from planner.policy import Hold, NoEngineAvailable, RouteRequest

log = logging.getLogger(__name__)

# Hop-by-hop headers (RFC 9110 7.6.1) and ones aiohttp recomputes are never forwarded.
_HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE",
        "Trailer", "Transfer-Encoding", "Upgrade", "Host", "Content-Length", "Accept-Encoding",
        "Content-Encoding",
    )
)  # fmt: skip

ENGINE_HEADER = "x-kvgate-engine"
SESSION_HEADER = "x-session-id"


def forward_headers(headers: Any) -> CIMultiDict[str]:
    """End-to-end headers only."""
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in headers.items():
        if k.lower() not in _HOP_BY_HOP:
            out.add(k, v)
    return out


async def read_json(request: web.Request, limit: int) -> tuple[bytes, dict[str, Any]]:
    """The raw body and its parsed JSON object; 413/400 with a clear message otherwise."""
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(
            f"request body is {request.content_length} bytes; the limit is {limit} bytes"
        )
    chunks = []
    size = 0
    async for chunk in request.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw:
        raise InvalidRequest("request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return raw, body


def prompt_keys(state: GatewayState, route: str, body: dict[str, Any]) -> PromptKeys | None:
    """Tokenise and key the prompt exactly as the engine will; None if it cannot be keyed.

    A prompt the gateway cannot key is still forwarded: the engine is the authority on validity.
    """
    salt = body.get("cache_salt")
    extras = KeyExtras(cache_salt=salt if isinstance(salt, str) else None)
    try:
        if route == "/v1/chat/completions":
            messages = body.get("messages")
            tools = body.get("tools")
            if not isinstance(messages, list) or not messages:
                return None
            return state.keyer.chat(
                messages, tools=tools if isinstance(tools, list) else None, extras=extras,
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            )
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str) or (
            isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)
        ):
            return state.keyer.completion(prompt, extras)
    except (TokenizerError, ValueError, TypeError, KeyError) as e:
        log.debug("prompt could not be keyed: %s", e)
    return None


@dataclass
class _Held:
    """A request the policy holds: its handler awaits `placed` (the dispatch once sent)."""

    route_req: RouteRequest
    exclude: set[str]
    placed: asyncio.Future[Dispatch]


class Proxy:
    """Forwards OpenAI calls to the engine the policy picks."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self.held: HoldQueue[_Held] = HoldQueue()
        """Requests the policy holds at the gateway, offered again when load changes."""

    def _choose(self, route_req: RouteRequest, exclude: set[str]) -> str:
        state = self.state
        pool = state.pool
        assert pool is not None
        views = [v for v in pool.views() if v.name not in exclude]
        t0 = time.perf_counter()
        try:
            return state.policy.choose(route_req, views, state.now())
        except NoEngineAvailable as e:
            healthy_models = pool.models()
            if healthy_models and route_req.model not in pool.known_models():
                raise ModelNotFound(
                    f"The model `{route_req.model}` does not exist. Available models: "
                    f"{', '.join(healthy_models)}",
                    param="model",
                ) from None
            raise NoHealthyEngine(str(e)) from None
        finally:
            state.metrics.routing_time.observe(time.perf_counter() - t0)

    async def route_request(
        self, request: web.Request, route: str, body: dict[str, Any]
    ) -> RouteRequest:
        """Everything the policy may know about this request, index matches included."""
        state = self.state
        model = body.get("model")
        if model is None:
            raise InvalidRequest("you must provide a model parameter", param="model")
        if not isinstance(model, str) or not model:
            raise InvalidRequest("`model` must be a non-empty string", param="model")
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        session = request.headers.get(SESSION_HEADER) or body.get("user")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        t0 = time.perf_counter()
        keys = prompt_keys(state, route, body)
        matches = {}
        if keys is not None and keys.keys:
            matches = await state.index.match(keys.keys, state.now())
        state.metrics.lookup_time.observe(time.perf_counter() - t0)
        return RouteRequest(
            request_id=request_id,
            model=model,
            session_id=session if isinstance(session, str) else None,
            prompt_tokens=keys.num_tokens if keys else 0,
            block_keys=keys.keys if keys else (),
            block_size=state.config.index.block_size,
            matches=matches,
            prompt_text=keys.text if keys else "",
            max_tokens=max_tokens if type(max_tokens) is int else None,
        )

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Validate, route and forward one OpenAI request."""
        state = self.state
        route = request.path
        arrived = time.monotonic()
        raw, body = await read_json(request, state.config.max_body_bytes)
        route_req = await self.route_request(request, route, body)
        # The client's x-request-id is forwarded untouched; vLLM uses it as its request id.
        headers = forward_headers(request.headers)
        tried: set[str] = set()
        last_error = ""
        for _ in range(state.config.retries + 1):
            d = await self._place(route_req, tried)
            engine = d.engine
            tried.add(engine)
            try:
                return await self._forward(request, route, route_req, d, raw, headers, arrived)
            except _RetryableFailure as e:
                last_error = str(e)
                state.metrics.retries.labels(engine).inc()
                log.warning("request %s: engine %s failed before answering (%s); retrying",
                            route_req.request_id, engine, e)
        raise NoHealthyEngine(
            f"every engine tried failed before answering ({', '.join(sorted(tried))}); "
            f"last error: {last_error}"
        )

    # -- placing and holding --------------------------------------------------------------------

    async def _place(self, route_req: RouteRequest, exclude: set[str]) -> Dispatch:
        """Choose an engine and count the request against it; a request the policy holds waits
        here until it is placed, its client goes away, or `request_timeout_s` passes (504)."""
        try:
            engine = self._choose(route_req, exclude)
        except Hold as hold:
            return await self._wait_held(route_req, exclude, hold)
        return self._dispatched(route_req, engine)

    async def _wait_held(self, route_req: RouteRequest, exclude: set[str], hold: Hold) -> Dispatch:
        timeout_s = self.state.config.request_timeout_s
        held = _Held(route_req, exclude, asyncio.get_running_loop().create_future())
        self.held.hold(route_req.request_id, held)
        log.debug("request %s held at the gateway: %s", route_req.request_id, hold.reason)
        try:
            async with asyncio.timeout(timeout_s):
                return await held.placed
        except BaseException as exc:
            self.held.discard(route_req.request_id)
            placed = held.placed
            if placed.done() and not placed.cancelled() and placed.exception() is None:
                # Placed just as the wait ended: the engine never sees it, so undo the count.
                self._finished(route_req, placed.result())
            else:
                placed.cancel()
            if isinstance(exc, TimeoutError):
                raise EngineTimeout(
                    f"request held at the gateway for request_timeout_s={timeout_s:g} "
                    f"({hold.reason})"
                ) from None
            raise

    def _offer(self, held: _Held) -> bool:
        """Offer a held request to the policy again; False if it holds it still."""
        if held.placed.done():
            return True  # its client went away or its wait timed out
        try:
            engine = self._choose(held.route_req, held.exclude)
        except Hold:
            return False
        except GatewayError as e:
            held.placed.set_exception(e)
            return True
        held.placed.set_result(self._dispatched(held.route_req, engine))
        return True

    def _release_held(self) -> None:
        """Load changed: offer the held requests again, oldest first."""
        if self.held:
            self.held.release(self._offer)

    # -- accounting -----------------------------------------------------------------------------

    def _dispatched(self, route_req: RouteRequest, engine: str) -> Dispatch:
        """Count the request against the engine (undone by `_finished`, whatever happens)."""
        state = self.state
        assert state.pool is not None
        target = state.pool.engines[engine]
        d = open_dispatch(route_req, engine, target.load, state.ingestor.engine_block_size(engine))
        m = state.metrics
        m.in_flight.labels(engine).inc()
        m.routed.labels(engine).inc()
        m.routed_prompt_tokens.labels(engine).inc(route_req.prompt_tokens)
        m.routed_cached_tokens.labels(engine).inc(d.cached_tokens)
        state.policy.on_dispatch(route_req, engine, state.now())
        return d

    def _first_token(self, route_req: RouteRequest, d: Dispatch, observed: bool) -> None:
        if prefill_done(d):
            if observed:
                self.state.policy.on_first_token(route_req.request_id, d.engine, self.state.now())
            self._release_held()

    def _finished(self, route_req: RouteRequest, d: Dispatch) -> None:
        """Undo the dispatch accounting and tell the policy (with the streamed token count)."""
        state = self.state
        # The load object captured at dispatch: an engine re-added under the same name since
        # then has fresh counters that this request never touched.
        if close_dispatch(d):
            state.metrics.in_flight.labels(d.engine).dec()
            state.policy.on_finish(route_req.request_id, d.engine, state.now(), d.streamed_tokens)
            self._release_held()

    # -- forwarding -----------------------------------------------------------------------------

    async def _forward(
        self,
        request: web.Request,
        route: str,
        route_req: RouteRequest,
        d: Dispatch,
        raw: bytes,
        headers: CIMultiDict[str],
        arrived: float,
    ) -> web.StreamResponse:
        """Send the placed request (`d`, closed here whatever happens) and relay the answer."""
        state = self.state
        engine = d.engine
        metrics = state.metrics
        try:
            assert state.pool is not None and state.session is not None
            url = state.pool.engines[engine].url
            timeout = aiohttp.ClientTimeout(
                total=None, connect=state.config.connect_timeout_s,
                sock_read=state.config.request_timeout_s,
            )
            if (route_req.block_keys and state.config.index.speculative_ttl_s > 0
                    and state.policy.speculative_entries):
                await state.index.add_speculative(engine, route_req.block_keys, state.now(),
                                                  state.config.index.speculative_ttl_s)
            try:
                upstream = await state.session.post(
                    f"{url}{route}", data=raw, headers=headers, timeout=timeout
                )
            except aiohttp.SocketTimeoutError:
                # Slow, not dead (a long generation, a deep queue): no retry, no eviction.
                metrics.upstream_errors.labels(engine, "timeout").inc()
                raise EngineTimeout(
                    f"engine {engine} sent no response within request_timeout_s="
                    f"{state.config.request_timeout_s:g}"
                ) from None
            except (TimeoutError, aiohttp.ClientConnectionError) as e:
                # Refused, reset, disconnected or connect timeout: the engine never answered.
                metrics.upstream_errors.labels(engine, "connect").inc()
                state.pool.mark_failed(engine, repr(e))
                raise _RetryableFailure(f"{engine}: {e!r}") from None
            try:
                return await self._relay(request, route, route_req, d, upstream, arrived)
            finally:
                if upstream.content.at_eof():
                    upstream.release()  # fully read: the connection goes back to the pool
                else:
                    # Closing an unfinished response drops the connection, so the engine sees
                    # the disconnect and aborts the request.
                    upstream.close()
        finally:
            self._finished(route_req, d)
            metrics.duration.labels(route).observe(time.monotonic() - arrived)

    async def _relay(
        self,
        request: web.Request,
        route: str,
        route_req: RouteRequest,
        d: Dispatch,
        upstream: aiohttp.ClientResponse,
        arrived: float,
    ) -> web.StreamResponse:
        metrics = self.state.metrics
        engine = d.engine
        metrics.time_to_first_byte.labels(route).observe(time.monotonic() - arrived)
        out_headers = forward_headers(upstream.headers)
        out_headers[ENGINE_HEADER] = engine
        is_sse = upstream.content_type == "text/event-stream"
        if not is_sse:
            # A JSON response arrives whole: the engine is done with the prompt by now. It is
            # relayed as one body with a length (one write, no chunked framing), and an engine
            # that dies before it is whole gets the client a clear 502 rather than a cut body.
            self._first_token(route_req, d, observed=False)
            try:
                body = await upstream.read()
            except (TimeoutError, aiohttp.ClientPayloadError,
                    aiohttp.ClientConnectionError) as e:
                raise self._engine_failure(engine, e) from None
            metrics.requests.labels(route, str(upstream.status)).inc()
            return web.Response(status=upstream.status, body=body, headers=out_headers)
        resp = web.StreamResponse(status=upstream.status, headers=out_headers)
        # SSE is forwarded in whole events only, so an error event can follow cleanly if the
        # engine dies mid-event; the incomplete tail waits for the rest of its event.
        tail = b""
        try:
            await resp.prepare(request)
            while True:
                try:
                    chunk = await upstream.content.readany()
                except (TimeoutError, aiohttp.ClientPayloadError,
                        aiohttp.ClientConnectionError) as e:
                    await self._engine_died(resp, engine, e)
                    metrics.requests.labels(route, "502").inc()
                    return resp
                if not chunk:
                    break
                # vLLM streams its first chunk once the prompt is prefilled.
                self._first_token(route_req, d, observed=upstream.status == 200)
                if is_sse:
                    data = tail + chunk
                    cut = data.rfind(b"\n\n") + 2
                    chunk, tail = data[:cut], data[cut:]
                    if not chunk:
                        continue
                    d.streamed_tokens += _token_events(chunk)
                await resp.write(chunk)
            if tail:
                await resp.write(tail)
            await resp.write_eof()
        except ConnectionResetError:
            log.info("client went away during a response from %s", engine)
            metrics.requests.labels(route, "499").inc()
            return resp
        metrics.requests.labels(route, str(upstream.status)).inc()
        return resp

    def _engine_failure(self, engine: str, error: BaseException) -> GatewayError:
        """The engine failed mid-response: count it, take it out of rotation unless it was only
        slow, and return the error that names it to the client."""
        state = self.state
        assert state.pool is not None
        timed_out = isinstance(error, TimeoutError)
        state.metrics.upstream_errors.labels(engine, "timeout" if timed_out else "mid-stream").inc()
        log.warning("engine %s failed mid-response: %r", engine, error)
        if timed_out:
            return EngineTimeout(f"engine {engine} timed out mid-response")
        state.pool.mark_failed(engine, repr(error))
        return EngineFailed(f"engine {engine} failed mid-stream: {error!r}")

    async def _engine_died(
        self, resp: web.StreamResponse, engine: str, error: BaseException
    ) -> None:
        """The engine failed mid-stream: end the stream with an error event naming it."""
        err = self._engine_failure(engine, error)
        await resp.write(err.sse_event())
        await resp.write_eof()


def _token_events(events: bytes) -> int:
    """Output-carrying events in whole SSE events from vLLM (one token per event by default)."""
    return events.count(b'"content":"') + events.count(b'"text":"') - events.count(
        b'"content":""') - events.count(b'"text":""')


class _RetryableFailure(Exception):
    """The engine failed before a single response byte reached the client."""
