"""The OpenAI-compatible proxy: key the prompt, ask the index, let the planner place, forward.

The proxy is the live driver of the planner (planner/core.py): it admits each request, runs the
planner's `release`, carries out its `Dispatch`/`Reject` actions, and reports first tokens and
finishes back as events. It decides nothing itself.

Bodies are forwarded byte for byte (unknown fields survive) and responses are streamed back chunk
by chunk as the engine produces them. A request whose engine fails before answering is re-sent to
another engine; one whose engine dies mid-stream ends with an OpenAI-shaped error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from aiohttp.web_urldispatcher import _default_expect_handler
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
from gateway.tenants import Tenant, caller, salt_label
from gateway.tracing import NO_CALL, CallTrace, EngineCallTrace, NoCall
from gateway.upstream import (
    UpstreamBroken,
    UpstreamConnectError,
    UpstreamDropped,
    UpstreamError,
    UpstreamResponse,
    UpstreamTimeout,
)
from kvindex.keys import KeyExtras, PromptKeys
from kvindex.tokenizer import TokenizerError
from planner.actions import (
    PREFILL_CAP_ARG,
    PREFILL_CAPS_ARG,
    Dispatch,
    Reject,
    Transfer,
    Warm,
)
from planner.core import Call, reject_message
from planner.events import Cancelled, Finished, FirstToken
from planner.hints import (
    MAX_TOKENS,
    NO_HINTS,
    HintError,
    RequestHints,
    lax_int,
    names_a_store_key,
    parse_hints,
)
from planner.policy import RouteRequest
from planner.segments import KINDS, static_lead

log = logging.getLogger(__name__)

# Hop-by-hop headers (RFC 9110 7.6.1), ones the upstream client sets itself, and `Expect` (the
# body has been read whole by then) are never forwarded.
_HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE",
        "Trailer", "Transfer-Encoding", "Upgrade", "Host", "Content-Length", "Accept-Encoding",
        "Content-Encoding", "Expect",
    )
)  # fmt: skip

ENGINE_HEADER = "x-kvgate-engine"
SEGMENTS_HEADER = "x-kvgate-segments"
PROXIED = "kvgate.proxied"
"""Set on a request the proxy handles: it counts its answer in `kvgate_requests_total` itself
(the middleware counts every other route's)."""
"""On a hint-mode call's answer: its prompt's full blocks by kind, e.g. `static=3,shared=9,..`."""
RETRYING = -1
"""`_Flight.status` of a call whose engine failed before answering: it is sent elsewhere."""


def forward_headers(headers: Any) -> CIMultiDict[str]:
    """End-to-end headers only."""
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in headers.items():
        if k.lower() not in _HOP_BY_HOP:
            out.add(k, v)
    return out


RECORD_TIMEOUT_S = 5.0
"""How long a hint-mode call waits for its workflow record's first write."""
REPORT_MODE = "kv_cache_report_mode"
GATEWAY_XARGS = frozenset({REPORT_MODE, PREFILL_CAP_ARG, PREFILL_CAPS_ARG})
"""`vllm_xargs` keys taken out of a client's call (the gateway sets the caps itself)."""
PRIORITY_HEADER = "X-Vllm-Priority"
"""vLLM 0.32's priority header (`entrypoints/generate/base/serving.py`), which outranks the
body's `priority`: a client's would override the planner's rank at a priority-scheduled
engine (and have vLLM preempt other callers' requests for it)."""
"""A `vllm_xargs` key the proxy drops: how the engine reports reused blocks in its KV events,
which the gateway's index reads (vLLM's default, "incremental", announces each block once)."""


NESTED_TOO_DEEPLY = "request body nests JSON arrays or objects too deeply"
"""A body Python's JSON decoder or encoder cannot follow (a 400, whichever of them stops)."""


def with_fields(raw: bytes, body: dict[str, Any], fields: dict[str, Any]) -> bytes:
    """The request body `raw` (parsed: `body`) with `fields` set. Fields the body lacks are
    spliced in before its closing brace, so a long prompt is not serialised again (a paced
    prompt of 100k tokens is a few hundred kB); otherwise the body is re-encoded."""
    stripped = raw.rstrip()
    if body and fields and stripped.endswith(b"}") and not any(k in body for k in fields):
        return stripped[:-1] + b"," + json.dumps(fields)[1:].encode()
    try:
        return json.dumps({**body, **fields}).encode()
    except RecursionError:
        # Read, the body nested just less deeply than the decoder allows; encoded from deeper
        # in the stack, it does not.
        raise InvalidRequest(NESTED_TOO_DEEPLY) from None


ExpectHandler = Callable[[web.Request], Awaitable[web.StreamResponse | None]]
"""How a route answers a request's `Expect` header (aiohttp's `expect_handler`)."""


def expect_within(limit: Callable[[], int], counted: Callable[[web.Request, int], None]
                  ) -> ExpectHandler:
    """An expect handler (`Expect: 100-continue`, which curl sends for bodies over 1 KB) that
    refuses a body past `limit()` from its Content-Length, before the client sends it; aiohttp's
    own answered "100 Continue" to any size. Runs before the middlewares: `counted` counts the
    answer."""
    async def expect(request: web.Request) -> web.StreamResponse | None:
        n, most = request.content_length, limit()
        if n is not None and n > most:
            counted(request, BodyTooLarge.status)
            resp = BodyTooLarge(f"request body is {n} bytes; the limit is {most} bytes").response()
            resp.force_close()  # the client may send the body regardless: not read here
            return resp
        await _default_expect_handler(request)
        return None

    return expect


async def read_json(request: web.Request, limit: int) -> tuple[bytes, dict[str, Any]]:
    """The raw body and its parsed JSON object; 413/400 with a clear message otherwise."""
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(
            f"request body is {request.content_length} bytes; the limit is {limit} bytes"
        )
    chunks = []
    size = 0
    try:
        async for chunk in request.content.iter_chunked(64 * 1024):
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
    except RequestPayloadError as e:
        # A body its Content-Encoding does not decode (gzip that is not gzip), or whose
        # chunked framing breaks off.
        cause = e.__cause__ or e
        raise InvalidRequest(f"request body could not be read: "
                             f"{getattr(cause, 'message', None) or cause}") from None
    raw = b"".join(chunks)
    if not raw:
        raise InvalidRequest("request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidRequest(NESTED_TOO_DEEPLY) from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise InvalidRequest(f"request body holds a value that cannot be read: {e}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return raw, body


def prompt_keys(state: GatewayState, route: str, body: dict[str, Any]) -> PromptKeys | None:
    """Tokenise and key the prompt exactly as the engine will; None if it cannot be keyed.

    A prompt the gateway cannot key is still forwarded: the engine is the authority on validity.
    """
    extras = request_extras(state, body)
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
    except (TokenizerError, ValueError, TypeError, KeyError, RecursionError) as e:
        # RecursionError: tools nested deeper than the template's `tojson` goes.
        log.debug("prompt could not be keyed: %r", e)
    return None


def key_extras(body: dict[str, Any], loras: AbstractSet[str] = frozenset()) -> KeyExtras:
    """What besides the prompt's tokens enters its block keys: the `cache_salt`, and the
    adapter's name when `model` is a LoRA adapter (one of `loras`), as vLLM hashes them."""
    salt = body.get("cache_salt")
    model = body.get("model")
    return KeyExtras(lora_name=model if isinstance(model, str) and model in loras else None,
                     cache_salt=salt if isinstance(salt, str) else None)


def request_extras(state: GatewayState, body: dict[str, Any]) -> KeyExtras:
    """`key_extras` with the pool's LoRA adapters."""
    return key_extras(body, state.pool.lora_models if state.pool is not None else frozenset())


def static_blocks(state: GatewayState, route: str, body: dict[str, Any]) -> int:
    """Full index blocks of a chat call's static segment (`planner.segments.static_lead`, with
    the tools), by rendering it alone: chat templates render a conversation's prefix first.
    0 for completions or when no system message leads (tools alone render differently
    without one in some templates, so they are not counted then)."""
    messages = body.get("messages")
    if route != "/v1/chat/completions" or not isinstance(messages, list):
        return 0
    lead = static_lead(messages)
    if not lead:
        return 0
    tools = body.get("tools")
    try:
        keys = state.keyer.chat(lead, tools=tools if isinstance(tools, list) else None,
                                extras=request_extras(state, body),
                                add_generation_prompt=False)
    except (TokenizerError, ValueError, TypeError, KeyError):
        return 0
    return len(keys.keys)


@dataclass
class _Flight:
    """One request at its engine, as the proxy follows it."""

    route: RouteRequest
    dispatch: Dispatch
    streamed_tokens: int = 0
    """Output events seen in the stream."""
    usage_tokens: int | None = None
    """`completion_tokens` of the engine's own usage (a JSON answer's; a stream's last usage
    event, when its client asked for one): exact, where a stream's events may each carry
    several tokens (vLLM merges the ones its API server had not yet sent, and
    `--stream-interval` sends every n-th)."""
    first_token: bool = False
    recorder: _Recorder | None = None
    """Where a call that names a workflow reports its progress (hint mode)."""
    answer: bytes | None = None
    """A whole JSON answer, kept for the recorder."""
    usage_event: bytes | None = None
    """The last streamed event that carries `usage` (`stream_options.include_usage`), kept for
    the recorder."""
    status: int = 0
    """The engine's HTTP status once the answer is complete (0: it never completed)."""
    trace: EngineCallTrace | None = None
    """This attempt's span (tracing on)."""
    gone: bool = False
    """The client went away before its answer was complete."""

    @property
    def output_tokens(self) -> int:
        """Tokens the engine generated, as its usage says, else as the stream's events count."""
        return self.usage_tokens if self.usage_tokens is not None else self.streamed_tokens


CLIENT_GONE = "the client went away"


class Proxy:
    """Forwards OpenAI calls where the planner places them."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self._placing: dict[str, tuple[asyncio.Future[Dispatch], RouteRequest]] = {}
        """Admitted requests whose handlers await the planner's decision."""
        self._ids: set[str] = set()
        """Request ids in use, from the moment a call is given one until its handler ends
        (before the planner admits it: keying may await the index)."""
        self._timer: asyncio.TimerHandle | None = None
        """The planner's next wakeup (`Planner.next_wakeup`): a batch interval while requests
        wait in its buffer, a move's deadline, a paced request's next piece."""
        self._timer_at = 0.0
        """When `_timer` fires (the planner's clock)."""
        self._background: set[asyncio.Task[None]] = set()
        """Workflow-record writes of hint-mode calls, kept until done."""
        self._answered: dict[str, int] = {}
        """Streams whose client hung up after the last event, with the engine's status."""
        self._broke: dict[str, GatewayError] = {}
        """Streams whose engine failed after their 200 head, with the error they ended with."""
        self._released_ns: dict[str, tuple[int, int]] = {}
        """Wall-clock span of the planner release that placed each request (tracing on)."""
        state.pump = self._pump

    async def route_request(
        self, request: web.Request, route: str, body: dict[str, Any],
        hints: RequestHints = NO_HINTS, dispatched: bool = True,
    ) -> RouteRequest:
        """Everything the policy may know about this request, index matches included.
        `dispatched=False`: only looked at (the admin's match), so its prompt is not kept as
        a KV move's possible origin."""
        state = self.state
        model = body.get("model")
        if model is None:
            raise InvalidRequest("you must provide a model parameter", param="model")
        if not isinstance(model, str) or not model:
            raise InvalidRequest("`model` must be a non-empty string", param="model")
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        if request_id in self._ids or state.planner.knows(request_id) or (
                state.planner.moves_kv and state.mover.knows(request_id)):
            # The client reused an id still in flight (or whose prompt a KV move may still
            # copy): the planner and the mover need them told apart.
            request_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        if not dispatched:
            return await self._route(request_id, route, body, hints, dispatched)
        self._ids.add(request_id)  # released by `handle`, or here if this raises
        try:
            return await self._route(request_id, route, body, hints, dispatched)
        except BaseException:
            self._ids.discard(request_id)
            raise

    async def _route(self, request_id: str, route: str, body: dict[str, Any],
                     hints: RequestHints, dispatched: bool) -> RouteRequest:
        state = self.state
        model = body["model"]
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:
            max_tokens = hints.osl
        t0 = time.perf_counter()
        keys = prompt_keys(state, route, body)
        matches = {}
        if keys is not None and keys.keys:
            matches = await state.match(keys.keys, state.now())
            if state.planner.moves_kv and dispatched:
                # The prompt may be the origin of a KV move (a pull, a prefetch).
                state.mover.remember(request_id, model, keys.token_ids,
                                     (hints.workflow, hints.task or request_id)
                                     if hints.workflow is not None else None,
                                     request_extras(state, body).cache_salt)
        state.later(state.metrics.lookup_time.observe, time.perf_counter() - t0)
        return RouteRequest(
            request_id=request_id,
            model=model,
            session_id=hints.session,
            prompt_tokens=keys.num_tokens if keys else 0,
            block_keys=keys.keys if keys else (),
            block_size=state.config.index.block_size,
            matches=matches,
            prompt_text=keys.text if keys else "",
            # Only a plausible length is an estimate; the engine answers for any other.
            max_tokens=(max_tokens if type(max_tokens) is int and 0 <= max_tokens <= MAX_TOKENS
                        else None),
            streams=body.get("stream") is True,
            sequences=sequences_of(body),
        )

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Validate, route and forward one OpenAI request."""
        state = self.state
        route = request.path
        request[PROXIED] = True
        arrived = time.monotonic()
        arrived_ns = time.time_ns()
        raw, body = await read_json(request, state.config.max_body_bytes)
        try:
            hints, stripped = parse_hints(request.headers, body)
        except HintError as e:
            raise InvalidRequest(str(e), param="kvgate") from None
        if hints.workflow is not None and names_a_store_key(hints.workflow):
            raise InvalidRequest(f"workflow id {hints.workflow!r} is reserved (it would name a "
                                 "key of the workflow store: index, running, or one ending in "
                                 ":ev or :lease; or be resolved away in a URL: . and ..)",
                                 param="kvgate")
        tenant = caller(request)
        if tenant is not None:
            if "kv_transfer_params" in body:
                # They name engines' blocks and the host a NIXL read goes to: a tenant's call
                # would pin blocks, learn engines' addresses, or read KV not its own.
                raise InvalidRequest("`kv_transfer_params` is the gateway's to set (it moves KV "
                                     "between engines itself); a tenant's call may not carry "
                                     "it", param="kv_transfer_params")
            # The tenant's salt, whatever the client sent: tenants are cached apart.
            stripped = {**(stripped or body), "cache_salt": tenant.salt}
            # A tenant may not rank its calls ahead of others' past what it is allowed.
            hints, clamped = tenant.clamp(hints)
            # vLLM reads "-5", -5.0 and True as integers: so does the clamp, and the engine
            # gets the integer (a value it would refuse is left for it to refuse).
            asked = lax_int(stripped.get("priority"))
            if asked is not None:
                stripped["priority"] = max(asked, tenant.priority_floor)
                if asked < tenant.priority_floor:
                    clamped.append("body priority")
            for hint in clamped:
                state.metrics.hints_clamped.labels(tenant.name, hint).inc()
            if hints.workflow is not None and state.workflows is not None:
                # Before the call is traced, keyed or placed as part of that workflow.
                await state.workflows.check_owner(hints.workflow, tenant.name)
        xargs = body.get("vllm_xargs")
        if isinstance(xargs, dict) and not GATEWAY_XARGS.isdisjoint(xargs):
            # "full" makes vLLM announce every block a call reuses again: the index would take
            # each for another copy, which no BlockRemoved ever takes back. The pacing caps
            # are the planner's to set: a client's cap of 1 token a step held its engine's
            # slot for thousands of steps, unknown to the planner.
            stripped = {**(stripped or body), "vllm_xargs": {
                k: v for k, v in xargs.items() if k not in GATEWAY_XARGS}}
        if stripped is not None:
            body = stripped
            try:
                raw = json.dumps(body).encode()
            except RecursionError:
                raise InvalidRequest("request body nests JSON arrays or objects too "
                                     "deeply") from None
        route_req = await self.route_request(request, route, body, hints)
        try:
            trace = state.tracing.call(
                request.headers, route, route_req.request_id, route_req.model,
                _call_attributes(route_req, hints), hints.workflow,
                hints.task or route_req.request_id, hints.after, arrived_ns)
        except BaseException:
            self._ids.discard(route_req.request_id)
            raise
        status, error = 0, None
        try:
            resp = await self._handle(request, route, raw, body, hints, route_req, arrived, trace)
            broke = self._broke.pop(route_req.request_id, None)
            status, error = (resp.status, None) if broke is None else (broke.status,
                                                                        broke.message)
            return resp
        except GatewayError as e:
            status, error = e.status, e.message
            raise
        except asyncio.CancelledError:
            # The client's connection closed. A hang-up the relay saw is counted already (with
            # the engine's status when the whole answer had been written); any other (while the
            # call was held, placed, or waiting for its engine's answer) is a 499 here.
            counted = self._answered.get(route_req.request_id)
            if counted is None:
                state.metrics.requests.labels(route, "499").inc()
            status = counted or 499
            error = None if status != 499 else CLIENT_GONE
            raise
        except Exception as e:
            status, error = 500, f"internal gateway error: {e!r}"
            raise
        finally:
            self._ids.discard(route_req.request_id)
            state.mover.forget(route_req.request_id)
            self._released_ns.pop(route_req.request_id, None)
            self._answered.pop(route_req.request_id, None)
            self._broke.pop(route_req.request_id, None)
            if trace.enabled:
                state.tracing.forget_call(route_req.request_id)
                state.later(trace.end, status, error, time.time_ns())

    async def _handle(self, request: web.Request, route: str, raw: bytes, body: dict[str, Any],
                      hints: RequestHints, route_req: RouteRequest, arrived: float,
                      trace: CallTrace | NoCall = NO_CALL) -> web.StreamResponse:
        state = self.state
        if hints.workflow is not None and hints.task is None:
            hints = replace(hints, task=route_req.request_id)
        # The client's x-request-id is forwarded untouched; vLLM uses it as its request id.
        headers = forward_headers(request.headers)
        headers.popall(PRIORITY_HEADER, None)
        if state.engine_authorization is not None:
            headers["Authorization"] = state.engine_authorization
        elif state.tenancy.enabled:
            headers.popall("Authorization", None)
        recorder = (_Recorder.start(self, hints, route_req, body, caller(request))
                    if hints.in_workflow else None)
        static = static_blocks(state, route, body) if hints.in_workflow else 0
        if recorder is not None:
            await recorder.started()
        tried: set[str] = set()
        last_error = ""
        for attempt in range(state.config.retries + 1):
            admitted_ns = time.time_ns()
            try:
                d = await self._place(route_req, tried, hints, static)
            except BaseException as e:
                if isinstance(e, GatewayError) and last_error:
                    # No engine left to retry on: say what became of the last one tried.
                    e.message = f"{e.message}; the engine tried before failed: {last_error}"
                if recorder is not None:
                    recorder.finished(None, str(e) if isinstance(e, GatewayError)
                                      else f"{CLIENT_GONE} before the call was placed",
                                      cancelled=isinstance(e, asyncio.CancelledError))
                raise
            engine = d.engine
            tried.add(engine)
            flight = _Flight(route_req, d, recorder=recorder)
            try:
                sent, sent_headers = self._dispatching(request, body, raw, headers, flight,
                                                       trace, admitted_ns, attempt)
            except BaseException as e:
                # The planner placed the call: undo that, whatever stops it being sent.
                self._finished(flight, str(e) if isinstance(e, GatewayError)
                               else f"the call could not be sent: {e!r}")
                raise
            try:
                return await self._forward(request, route, flight, sent, sent_headers,
                                           arrived)
            except _RetryableFailure as e:
                last_error = str(e)
                state.metrics.count(state.metrics.retries, engine)
                log.warning("request %s: engine %s failed before answering (%s); retrying",
                            route_req.request_id, engine, e)
        if recorder is not None:
            recorder.finished(None, f"every engine tried failed: {last_error}")
        raise NoHealthyEngine(
            f"every engine tried failed before answering ({', '.join(sorted(tried))}); "
            f"last error: {last_error}"
        )

    # -- placing -------------------------------------------------------------------------------

    def _dispatching(self, request: web.Request, body: dict[str, Any], raw: bytes,
                     headers: CIMultiDict[str], flight: _Flight, trace: CallTrace | NoCall,
                     admitted_ns: int, attempt: int) -> tuple[bytes, CIMultiDict[str]]:
        """The placed call's trace and progress record, and the body and headers its engine
        gets (vLLM's `priority`, the pacing plugin's `vllm_xargs`, the trace context)."""
        state = self.state
        d = flight.dispatch
        engine = d.engine
        sent_headers = headers
        if trace.enabled:
            placed_ns = time.time_ns()
            trace.buffer_wait(admitted_ns, placed_ns)
            trace.placement(d, state.config.policy, *self._released_ns.pop(
                d.request_id, (placed_ns, placed_ns)))
            entry = state.pool.engines.get(engine) if state.pool is not None else None
            url = entry.url if entry is not None else ""
            flight.trace = trace.engine_call(engine, url, attempt)
            if flight.trace is not None:
                sent_headers = headers.copy()
                flight.trace.inject(sent_headers)
        if flight.recorder is not None:
            flight.recorder.dispatched(engine)
        sent = raw
        extra: dict[str, Any] = {}
        if state.priority_engine(engine):
            if d.priority is not None:
                # vLLM's own field, for an engine running --scheduling-policy priority.
                extra["priority"] = d.priority
            elif lax_int(body.get("priority", 0)) == 0 and (held := held_behind(request)):
                # A tenant kept behind others (a priority_floor above vLLM's default, 0)
                # under a policy that sends no priority of its own; an engine without
                # priority scheduling would refuse a priority.
                extra["priority"] = held
        if d.prefill_cap > 0:
            # For kvgate's scheduler plugin (adapters/vllm_plugins/kvgate_pace.py).
            # A client's malformed `vllm_xargs` is left for the engine to refuse.
            xargs = body.get("vllm_xargs") or {}
            if isinstance(xargs, dict):
                extra["vllm_xargs"] = {**xargs, **d.pace_xargs()}
        if extra:
            sent = with_fields(raw, body, extra)
        return sent, sent_headers

    async def _place(self, route_req: RouteRequest, exclude: set[str],
                     hints: RequestHints = NO_HINTS, static: int = 0) -> Dispatch:
        """Admit the request to the planner and wait for its decision; a request the planner
        holds waits here until it is placed, its client goes away, or `request_timeout_s`
        passes (504)."""
        state = self.state
        rid = route_req.request_id
        placed: asyncio.Future[Dispatch] = asyncio.get_running_loop().create_future()
        self._placing[rid] = (placed, route_req)
        admitted = time.monotonic()
        state.planner.admit(Call(route_req, frozenset(exclude), hints, static_blocks=static),
                            state.now())
        self._pump()
        d = placed.result() if placed.done() else await self._wait_held(route_req, placed)
        state.later(state.metrics.planner_wait.observe, time.monotonic() - admitted)
        return d

    async def _wait_held(self, route_req: RouteRequest, placed: asyncio.Future[Dispatch]
                         ) -> Dispatch:
        state = self.state
        rid = route_req.request_id
        timeout_s = state.config.request_timeout_s
        log.debug("request %s held at the gateway", rid)
        try:
            async with asyncio.timeout(timeout_s):
                return await placed
        except BaseException as exc:
            waiting = self._placing.pop(rid, None) is not None
            if placed.done() and not placed.cancelled() and placed.exception() is None:
                # Placed just as the wait ended: the engine never sees it, so undo the count.
                self._finished(_Flight(route_req, placed.result()))
            elif waiting:
                placed.cancel()
                state.notify(Cancelled(rid))
            # Else a release took it after this wait was cancelled, and undid it (`_pump`).
            if isinstance(exc, TimeoutError):
                raise EngineTimeout(
                    f"request held at the gateway for request_timeout_s={timeout_s:g}: every "
                    "engine stayed backed up"
                ) from None
            raise

    def _pump(self) -> None:
        """Run the planner's release and carry out its actions."""
        state = self.state
        t0 = time.perf_counter()
        released_ns = time.time_ns()
        actions = state.planner.release(state.now())
        state.later(state.metrics.routing_time.observe, time.perf_counter() - t0)
        released = (released_ns, time.time_ns()) if state.tracing.enabled else None
        orphans: list[_Flight] = []
        for action in actions:
            if isinstance(action, Transfer | Warm):
                state.mover.carry_out(action)
                continue
            waiter = self._placing.pop(action.request_id, None)
            if waiter is None:
                continue
            placed, route_req = waiter
            if placed.done():
                # Its handler was cancelled (the client went away) and has not yet run to say
                # so: the placement is undone below, once this release is carried out.
                if not isinstance(action, Reject):
                    orphans.append(_Flight(route_req, action))
                continue
            if isinstance(action, Reject):
                state.metrics.placements.labels("rejected").inc()
                placed.set_exception(self._reject_error(action))
                continue
            if released is not None:
                self._released_ns[action.request_id] = released
            state.later(state.metrics.dispatched, action, route_req.prompt_tokens,
                        route_req.block_keys, state.now())
            placed.set_result(action)
        for flight in orphans:
            state.later(state.metrics.dispatched, flight.dispatch, flight.route.prompt_tokens,
                        flight.route.block_keys, state.now())
            self._finished(flight, "its wait ended (the client went away, or the hold timed "
                                   "out) as the call was placed")
        wake = state.planner.next_wakeup()
        if wake is not None and self._timer is not None and wake < self._timer_at:
            # Due sooner than the timer set (a paced request's next piece, say).
            self._timer.cancel()
            self._timer = None
        if wake is not None and self._timer is None:
            self._timer_at = wake
            self._timer = asyncio.get_running_loop().call_later(
                max(0.0, wake - state.now()), self._wake)

    def background(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run a write the response does not wait for; a failure is logged, never raised."""
        async def guarded() -> None:
            try:
                await work
            except Exception:
                log.exception("recording a hint-mode call failed")

        task = asyncio.get_running_loop().create_task(guarded())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _wake(self) -> None:
        self._timer = None
        self._pump()

    def _reject_error(self, reject: Reject) -> GatewayError:
        if reject.available_models and not reject.model_known:
            return ModelNotFound(
                f"The model `{reject.model}` does not exist. Available models: "
                f"{', '.join(reject.available_models)}",
                param="model",
            )
        return NoHealthyEngine(reject_message(reject))

    # -- accounting -----------------------------------------------------------------------------

    def _first_token(self, flight: _Flight, observed: bool) -> bool:
        """The engine started answering (the first time it is called for `flight`: True)."""
        if flight.first_token:
            return False
        flight.first_token = True
        self.state.notify(FirstToken(flight.route.request_id, observed))
        if observed and flight.recorder is not None:
            flight.recorder.first_token()
        if observed and flight.trace is not None:
            flight.trace.first_token()
        return True

    def _finished(self, flight: _Flight, error: str | None = None) -> None:
        """The request ended at its engine: undo the dispatch accounting and tell the planner
        (with the streamed token count)."""
        state = self.state
        state.later(state.metrics.finished, flight.dispatch.engine, flight.dispatch.request_id)
        state.notify(Finished(flight.route.request_id, flight.output_tokens, error))
        if flight.recorder is not None and flight.status != RETRYING:
            flight.recorder.finished(flight, error, cancelled=flight.gone and error is not None)
        if flight.trace is not None:
            state.later(flight.trace.end, max(flight.status, 0), flight.output_tokens or None,
                        "the engine was unreachable; the call is sent elsewhere"
                        if flight.status == RETRYING else error,
                        # A stream's usage is in its usage event (`include_usage`).
                        flight.answer or flight.usage_event, time.time_ns())

    # -- forwarding -----------------------------------------------------------------------------

    async def _forward(
        self,
        request: web.Request,
        route: str,
        flight: _Flight,
        raw: bytes,
        headers: CIMultiDict[str],
        arrived: float,
    ) -> web.StreamResponse:
        """Send the placed request (closed here whatever happens) and relay the answer."""
        state = self.state
        d = flight.dispatch
        engine = d.engine
        metrics = state.metrics
        try:
            assert state.pool is not None and state.upstream is not None
            entry = state.pool.engines.get(engine)
            if entry is None:  # removed through the admin API while the call was placed
                flight.status = RETRYING
                raise _RetryableFailure(f"{engine} left the pool")
            url = entry.url
            if d.speculative_keys:
                await state.add_speculative(engine, d.speculative_keys, state.now(),
                                                  d.speculative_ttl_s)
            try:
                upstream = await state.upstream.post(url, route, raw, headers.items(),
                                                     state.config.request_timeout_s)
            except UpstreamTimeout:
                # Slow, not dead (a long generation, a deep queue): no retry, no eviction.
                metrics.count(metrics.upstream_errors, engine, "timeout")
                raise EngineTimeout(
                    f"engine {engine} sent no response within request_timeout_s="
                    f"{state.config.request_timeout_s:g}"
                ) from None
            except UpstreamConnectError as e:
                # Refused, reset, disconnected or connect timeout: the engine never answered.
                metrics.count(metrics.upstream_errors, engine, "connect")
                state.pool.mark_failed(engine, str(e))
                flight.status = RETRYING
                raise _RetryableFailure(f"{engine}: {e}") from None
            except UpstreamDropped as e:
                raise self._dropped(engine, flight, e) from None
            except UpstreamError as e:
                # The answer's head began and broke off: the engine had the request, so it is
                # not sent again.
                raise self._engine_failure(engine, e) from None
            try:
                return await self._relay(request, route, flight, upstream, arrived)
            finally:
                # Fully read, the connection goes back to the pool; otherwise it is dropped, so
                # the engine sees the disconnect and aborts the request.
                upstream.release()
        except asyncio.CancelledError:
            flight.gone = True  # the client's connection closed: the server cancels its handler
            raise
        finally:
            self._finished(flight, None if 200 <= flight.status < 300 else
                           CLIENT_GONE if flight.gone else
                           f"the call did not complete (engine status {flight.status or 'none'})")
            if flight.status != RETRYING:  # a call's duration once, not once per attempt
                state.later(metrics.observe, metrics.duration, route, time.monotonic() - arrived)

    async def _relay(
        self,
        request: web.Request,
        route: str,
        flight: _Flight,
        upstream: UpstreamResponse,
        arrived: float,
    ) -> web.StreamResponse:
        later = self.state.later
        metrics = self.state.metrics
        engine = flight.dispatch.engine
        later(metrics.observe, metrics.time_to_first_byte, route, time.monotonic() - arrived)
        out_headers = forward_headers(upstream.headers)
        out_headers[ENGINE_HEADER] = engine
        if flight.recorder is not None:
            seg = flight.dispatch.segments
            out_headers[SEGMENTS_HEADER] = ",".join(
                f"{kind}={seg.blocks_of(kind)}" for kind in KINDS)
        is_sse = upstream.content_type == "text/event-stream"
        if not is_sse:
            # A JSON response arrives whole: the engine is done with the prompt by now. It is
            # relayed as one body with a length (one write, no chunked framing), and an engine
            # that dies before it is whole gets the client a clear 502 rather than a cut body.
            self._first_token(flight, observed=False)
            try:
                body = await upstream.read()
            except UpstreamError as e:
                raise self._engine_failure(engine, e) from None
            flight.status = upstream.status
            flight.usage_tokens = completion_tokens(body)
            if flight.recorder is not None or flight.trace is not None:
                flight.answer = body
            answer = web.Response(status=upstream.status, body=body, headers=out_headers)
            # Written here, in one write, so the accounting that follows (the planner's finish,
            # the trace) runs after the client has its answer, not before.
            try:
                async with asyncio.timeout(self.state.config.client_write_timeout_s):
                    await answer.prepare(request)
                    await answer.write_eof()
            except ConnectionResetError:
                self._client_gone(route, engine, "before the answer was written", flight)
                return answer
            except TimeoutError:
                self._client_stalled(request, route, engine, flight)
                return answer
            later(metrics.answered, route, upstream.status)
            return answer
        resp = web.StreamResponse(status=upstream.status, headers=out_headers)
        try:
            async with asyncio.timeout(None) as writing:
                broke = await self._relay_events(request, route, flight, upstream, resp,
                                                 arrived, writing)
        except ConnectionResetError:
            self._hung_up(route, engine, flight)
            return resp
        except TimeoutError:
            # Only the writes to the client are timed here (the engine's reads carry their
            # own timeout, raised as UpstreamTimeout and handled inside).
            self._client_stalled(request, route, engine, flight)
            return resp
        except asyncio.CancelledError:
            # The client's connection closed (the server cancels its handler): counted before
            # the cancellation goes on.
            self._hung_up(route, engine, flight)
            raise
        if not broke:
            later(metrics.answered, route, upstream.status)
            flight.status = upstream.status
        return resp

    async def _relay_events(self, request: web.Request, route: str, flight: _Flight,
                            upstream: UpstreamResponse, resp: web.StreamResponse,
                            arrived: float, writing: asyncio.Timeout) -> bool:
        """Relay a stream in whole server-sent events, so an error event can follow cleanly if
        the engine dies mid-event (the incomplete tail waits for the rest of its event); the
        client's head waits for the first whole event, so a stream the engine drops before it
        goes to another engine. Each write to the client must end within
        `client_write_timeout_s` (`writing` fires otherwise). True if the engine broke off
        after the client had its head (the stream then ends with an error event)."""
        later = self.state.later
        metrics = self.state.metrics
        engine = flight.dispatch.engine
        loop = asyncio.get_running_loop()
        write_s = self.state.config.client_write_timeout_s
        events = EventFramer()
        done = False
        while True:
            try:
                chunk = await upstream.readany()
                if events.pending_bytes > MAX_EVENT_BYTES:
                    raise UpstreamBroken(f"the engine sent an event of over {MAX_EVENT_BYTES} "
                                         "bytes")
            except UpstreamError as e:
                if not resp.prepared:
                    # Nothing of the answer reached the client: another engine may take it,
                    # unless this one is only slow (a 504, as for a silent JSON answer).
                    if isinstance(e, TimeoutError):
                        raise self._engine_failure(engine, e) from None
                    raise self._dropped(engine, flight, e) from None
                writing.reschedule(loop.time() + write_s)
                err = await self._engine_died(resp, engine, e)
                # The client had a 200 head already: the call's span and counters say what
                # became of it.
                self._broke[flight.route.request_id] = err
                metrics.requests.labels(route, str(err.status)).inc()
                return True
            if not chunk:
                break
            # vLLM streams its first chunk once the prompt is prefilled.
            observed = upstream.status == 200
            if self._first_token(flight, observed) and observed:
                later(metrics.observe, metrics.time_to_first_token, route,
                      time.monotonic() - arrived)
            chunk = events.feed(chunk)
            if not chunk:
                continue
            flight.streamed_tokens += _token_events(chunk)
            if b'"usage":{' in chunk:
                usage = _usage_event(chunk)
                if usage is not None:
                    flight.usage_event = usage
                    flight.usage_tokens = completion_tokens(usage)
            if b"data: [DONE]" in chunk:
                # vLLM's last event: the answer is whole once it is written, even if the
                # client hangs up right after reading it (as the openai client may, which
                # cancels this handler before the engine's stream ends).
                done = True
            writing.reschedule(loop.time() + write_s)
            if not resp.prepared:
                await resp.prepare(request)
            await resp.write(chunk)
            writing.reschedule(None)
            if done:
                flight.status = upstream.status
        # The engine answered in full: a client that hangs up once it has read the last event
        # (as the openai client may) does not make the call a failure.
        flight.status = upstream.status
        writing.reschedule(loop.time() + write_s)
        if not resp.prepared:  # an empty stream
            await resp.prepare(request)
        rest = events.rest()
        if rest:
            await resp.write(rest)
        await resp.write_eof()
        return False

    def _client_stalled(self, request: web.Request, route: str, engine: str,
                        flight: _Flight) -> None:
        """The client took none of its answer for `client_write_timeout_s`: its connection is
        dropped (the engine's with it, so the engine aborts the call) and it counts as gone."""
        log.warning("client took none of its answer from %s for %g s; dropping it", engine,
                    self.state.config.client_write_timeout_s)
        if request.transport is not None:
            request.transport.abort()
        self._client_gone(route, engine, "by not reading", flight)

    def _hung_up(self, route: str, engine: str, flight: _Flight) -> None:
        """The client hung up mid-stream. Once `data: [DONE]` was written (the flight has the
        engine's status then) it had the whole answer and only skipped the chunked body's last
        frame (httpx-based clients such as guidellm do): that counts with the engine's status,
        not as a 499."""
        if flight.status:
            log.debug("client hung up after the last event from %s", engine)
            self.state.metrics.requests.labels(route, str(flight.status)).inc()
            self._answered[flight.route.request_id] = flight.status
        else:
            self._client_gone(route, engine, "during the response", flight)

    def _client_gone(self, route: str, engine: str, when: str, flight: _Flight) -> None:
        """The client hung up while its answer was being written: counted as a 499."""
        log.info("client went away %s from %s", when, engine)
        flight.gone = True
        self._answered[flight.route.request_id] = 499
        self.state.metrics.requests.labels(route, "499").inc()

    def _dropped(self, engine: str, flight: _Flight, error: UpstreamError) -> _RetryableFailure:
        """The engine closed the connection after it had the call a while, with nothing of an
        answer sent (a non-streamed call's head, a stream's first event): the call goes to
        another engine (never again to this one). The engine stays in rotation; its health
        checks say whether it is gone (a load balancer's idle timeout cuts calls of engines
        that are fine)."""
        self.state.metrics.count(self.state.metrics.upstream_errors, engine, "dropped")
        flight.status = RETRYING
        return _RetryableFailure(f"{engine}: {error}")

    def _engine_failure(self, engine: str, error: BaseException) -> GatewayError:
        """The engine failed mid-response: count it, take it out of rotation unless it was only
        slow, and return the error that names it to the client."""
        state = self.state
        assert state.pool is not None
        timed_out = isinstance(error, TimeoutError)
        state.metrics.count(state.metrics.upstream_errors, engine,
                            "timeout" if timed_out else "mid-stream")
        log.warning("engine %s failed mid-response: %r", engine, error)
        if timed_out:
            return EngineTimeout(f"engine {engine} timed out mid-response")
        state.pool.mark_failed(engine, repr(error))
        return EngineFailed(f"engine {engine} failed mid-stream: {error!r}")

    async def _engine_died(
        self, resp: web.StreamResponse, engine: str, error: BaseException
    ) -> GatewayError:
        """The engine failed mid-stream: end the stream with an error event naming it (the
        error returned)."""
        err = self._engine_failure(engine, error)
        await resp.write(err.sse_event())
        await resp.write_eof()
        return err


def _call_attributes(route: RouteRequest, hints: RequestHints) -> dict[str, Any]:
    """A call's span attributes known on arrival."""
    attrs: dict[str, Any] = {"kvgate.prompt_tokens": route.prompt_tokens}
    if route.max_tokens is not None:
        attrs["gen_ai.request.max_tokens"] = route.max_tokens
    if hints.workflow is not None:
        attrs["kvgate.workflow.id"] = hints.workflow
        attrs["kvgate.task.id"] = hints.task or route.request_id
    if hints.session is not None:
        attrs["kvgate.session.id"] = hints.session
    if hints.priority is not None:
        attrs["kvgate.request.priority"] = hints.priority
    return attrs


MAX_EVENT_BYTES = 64 * 1024 * 1024
"""The longest server-sent event relayed (prompt logprobs of a long prompt run to megabytes); an
engine whose event runs past it is treated as broken rather than held in memory without end."""


class EventFramer:
    """Cuts a stream into whole server-sent events: `feed` returns the events a read completes
    (b"" while one is still under way), `rest` what is left at the end. Only the new bytes,
    and the 3 before them, are searched for an event's end, and a long event is joined once:
    it was rejoined and searched again on every read, quadratic in its length."""

    __slots__ = ("_edge", "_pending", "pending_bytes")

    def __init__(self) -> None:
        self._pending: list[bytes] = []
        self.pending_bytes = 0
        """Bytes of the event under way."""
        self._edge = b""  # its last 3 bytes: a blank line may span them and the next read

    def feed(self, chunk: bytes) -> bytes:
        """The whole events `chunk` completes, with what came before them."""
        edge = self._edge
        probe = edge + chunk if edge else chunk
        cut = _events_end(probe) - len(edge)
        if cut <= 0:
            self._pending.append(chunk)
            self.pending_bytes += len(chunk)
            self._edge = probe[-3:]
            return b""
        pending, rest = self._pending, chunk[cut:]
        whole = b"".join((*pending, chunk[:cut])) if pending else chunk[:cut]
        self._pending, self.pending_bytes, self._edge = (
            ([rest], len(rest), rest[-3:]) if rest else ([], 0, b""))
        return whole

    def rest(self) -> bytes:
        """What came after the last whole event."""
        return b"".join(self._pending)


def _events_end(data: bytes) -> int:
    """Where the last whole server-sent event in `data` ends (0: none is whole yet). Events
    end with a blank line; vLLM writes `\n\n`, and `\r\n\r\n` is taken too."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def _token_events(events: bytes) -> int:
    """Output-carrying events in whole SSE events from vLLM (one token per event by default)."""
    return events.count(b'"content":"') + events.count(b'"text":"') - events.count(
        b'"content":""') - events.count(b'"text":""')


def completion_tokens(answer: bytes) -> int | None:
    """`usage.completion_tokens` of a JSON answer or event, found from its end (vLLM writes
    usage after the choices; a key inside a string value would have its quotes escaped), or
    None."""
    at = answer.rfind(b'"completion_tokens"')
    if at < 0:
        return None
    match = _COUNT.match(answer, at + len(b'"completion_tokens"'))
    return int(match.group(1)) if match else None


_COUNT = re.compile(rb"\s*:\s*(\d{1,12})")


def _usage_event(events: bytes) -> bytes | None:
    """The JSON of the last event in whole SSE events that carries a `usage` object."""
    for event in reversed(events.split(b"\n\n")):
        if event.startswith(b"data: {") and b'"usage":{' in event:
            return event[6:]
    return None


MAX_SEQUENCES = 256
"""The most sequences (`n`) one call counts as at its engine: vLLM's `max_num_seqs` default."""


def sequences_of(body: dict[str, Any]) -> int:
    """The sequences an engine decodes for the call (vLLM's `n`, parallel sampling): each
    steps and reads the prompt's KV like a call of its own. A value the engine would refuse
    counts as one (it is the engine's to refuse)."""
    n = lax_int(body.get("n", 1))
    return min(n, MAX_SEQUENCES) if n is not None and n > 1 else 1


def held_behind(request: web.Request) -> int:
    """The priority a call goes to a priority-scheduled engine with when it asked none: its
    tenant's `priority_floor` where that is above vLLM's default, 0, else 0 (none sent)."""
    tenant = caller(request)
    return tenant.priority_floor if tenant is not None and tenant.priority_floor > 0 else 0


class _Recorder:
    """Reports a hint-mode call's progress to the workflow service (`GET /v1/workflows/{id}`).

    `started` is awaited before the call is placed, so the record exists before anything
    updates it; the rest is written in the background, in order (nothing stands between a
    placement and the engine call, and a client hanging up must not lose the end). The record
    is the call's account, not the call: a store that cannot write it (Redis away or slow
    past RECORD_TIMEOUT_S) leaves the call unrecorded, not failed."""

    def __init__(self, proxy: Proxy, hints: RequestHints, route: RouteRequest,
                 tenant: str | None, owned: bool = False) -> None:
        assert hints.workflow is not None and hints.task is not None
        self.proxy = proxy
        self.workflow = hints.workflow
        self.task = hints.task
        self.after = hints.after
        self.route = route
        self.tenant = tenant
        self.owned = owned
        """Tenants are configured: the workflow must be `tenant`'s."""
        self._last: asyncio.Future[None] | None = None
        """The previous background write: writes land in the order they were made."""
        self.attempt = uuid.uuid4().hex
        """This call's token in the task's record (a retry may reuse its request id)."""
        self.unrecorded = False
        """Its first write failed: the rest are not made."""

    def _write(self, work: Coroutine[Any, Any, None]) -> None:
        previous = self._last

        async def in_order() -> None:
            if previous is not None:
                with contextlib.suppress(Exception):
                    await previous
            await work

        self._last = self.proxy.background(in_order())

    @classmethod
    def start(cls, proxy: Proxy, hints: RequestHints, route: RouteRequest,
              body: dict[str, Any], tenant: Tenant | None) -> _Recorder | None:
        """A recorder for the call, or None when the gateway keeps no workflows. The
        workflow's tenant: the caller's (tenants configured), else the call's salt."""
        if proxy.state.workflows is None:
            return None
        if tenant is not None:
            return cls(proxy, hints, route, tenant.name, owned=True)
        salt = body.get("cache_salt")
        return cls(proxy, hints, route, salt_label(salt) if isinstance(salt, str) else None)

    async def started(self) -> None:
        workflows = self.proxy.state.workflows
        assert workflows is not None
        try:
            await asyncio.wait_for(workflows.hinted_task_started(
                self.workflow, self.task, self.after, self.route.request_id, self.route.model,
                self.tenant, attempt=self.attempt, owned=self.owned), RECORD_TIMEOUT_S)
        except GatewayError:
            raise  # another tenant's workflow: the call is refused
        except Exception as e:  # TimeoutError, the store's own errors
            log.warning("workflow %s, task %s: its record could not be written (%r); the "
                        "call goes on unrecorded", self.workflow, self.task, e)
            self.unrecorded = True

    def dispatched(self, engine: str) -> None:
        workflows = self.proxy.state.workflows
        assert workflows is not None
        if not self.unrecorded:
            self._write(workflows.hinted_task_dispatched(
                self.workflow, self.task, engine, attempt=self.attempt, at=workflows.clock()))

    def first_token(self) -> None:
        assert self.proxy.state.workflows is not None
        if self.unrecorded:
            return
        workflows = self.proxy.state.workflows
        self._write(workflows.hinted_first_token(self.workflow, self.task, attempt=self.attempt,
                                                 at=workflows.clock()))

    def finished(self, flight: _Flight | None, error: str | None,
                 cancelled: bool = False) -> None:
        """The call ended: answered (`error` None), failed, or `cancelled` (its client went
        away)."""
        assert self.proxy.state.workflows is not None
        if self.unrecorded:
            return
        output = None
        output_tokens = flight.output_tokens if flight is not None else None
        cached = None
        if flight is not None and flight.answer is None and flight.usage_event is not None:
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                usage = json.loads(flight.usage_event)["usage"]
                output_tokens = usage.get("completion_tokens", output_tokens)
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if flight is not None and flight.answer is not None:
            with contextlib.suppress(ValueError, TypeError, KeyError, IndexError,
                                     AttributeError):
                doc = json.loads(flight.answer)
                usage = doc.get("usage") or {}
                output_tokens = usage.get("completion_tokens", output_tokens)
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                choice = doc["choices"][0]
                output = (choice["message"]["content"] if "message" in choice
                          else choice.get("text"))
        self._write(self.proxy.state.workflows.hinted_task_finished(
            self.workflow, self.task, prompt_tokens=self.route.prompt_tokens or None,
            output_tokens=output_tokens, cached_tokens=cached, output=output, error=error,
            cancelled=cancelled, attempt=self.attempt, at=self.proxy.state.workflows.clock()))


class _RetryableFailure(Exception):
    """The engine failed before a single response byte reached the client."""
