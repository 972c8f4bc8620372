"""An aiohttp server that speaks vLLM 0.32's HTTP, metrics and KV-event protocols over EngineModel.

This is the I/O shell around the sans-IO engine model: it owns the clock (steps sleep their
roofline duration, scaled by `time_scale`), tokenises with the same tokenizer a real engine would
load, streams SSE exactly as vLLM does, publishes KV events over ZMQ and exposes `vllm:` metrics.

`priority` is taken as vLLM 0.32.0 takes it: the request body's integer field (0 by default,
within int64 as the protocol's `Field(ge=_INT64_MIN, le=_INT64_MAX)` demands), overridden by an
`X-Vllm-Priority` header that parses as an integer. The engine orders by it only when started
with `--scheduling-policy priority` (`SimSettings.priority_scheduling`); under the default `fcfs`
a non-zero priority is accepted and ignored. vLLM 0.32 raises no error for it: the protocol's
field description still says "Any priority other than 0 will raise an error if the served model
does not use priority scheduling", but that check ("Got priority ... but Priority scheduling is
not enabled.") lived in the V0 engine and no V1 code path performs it (`InputProcessor`,
`AsyncLLM`, the serving classes and `Scheduler.add_request` pass `priority` through untouched).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import xxhash
from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from adapters.sim.frontend import ApiServer
from adapters.sim.link import LinkModel
from adapters.sim.metrics import EngineMetrics
from adapters.sim.model import (
    EngineConfig,
    EngineModel,
    FinishReason,
    KVPull,
    SimRequest,
    TokenOutput,
)
from adapters.sim.nixl import (
    HEARTBEAT_PATH,
    RELEASE_PATH,
    SIDE_CHANNEL_PATH,
    ConnectorConfig,
    Peer,
    producer_params,
    request_params,
)
from adapters.sim.outputs import (
    Forced,
    Logprobs,
    OutputError,
    OutputText,
    StopSpec,
    chat_logprobs,
    check_sampling,
    completion_logprobs,
    forced_output,
    tool_call_id,
)
from adapters.sim.publisher import KVEventPublisher
from adapters.vllm_plugins.kvgate_pace_caps import read_caps
from kvindex.tokenizer import Tokenizer, TokenizerError
from planner.hints import lax_int
from planner.profiles import EngineProfile
from planner.transfer import NAMED_LINKS, TransferLink

log = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"
SYSTEM_FINGERPRINT = f"vllm-{VLLM_VERSION}-kvgate-sim"

STREAM_ERROR = {"error": {"message": "Internal server error", "type": "InternalServerError",
                          "param": None, "code": 500}}
"""What vLLM streams when a request ends in an error (e.g. a failed KV load)."""

PRIORITY_HEADER = "X-Vllm-Priority"
"""vLLM 0.32 header that overrides the body's `priority` (generate/base/serving.py)."""
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class SimSettings:
    """Everything `kvgate sim` is started with."""

    model: str
    profile: EngineProfile
    block_size: int
    num_blocks: int
    seed: int = 0
    time_scale: float = 1.0
    tokenizer: str | None = None
    kv_events_endpoint: str | None = None
    kv_replay_endpoint: str | None = None
    kv_topic: str = ""
    enable_prompt_tokens_details: bool = False
    priority_scheduling: bool = False
    reserve_full_isl: bool = True
    """vLLM's `--scheduler-reserve-full-isl` (`EngineConfig.reserve_full_isl`)."""
    mean_output_tokens: int = 48
    kv_drop_seqs: frozenset[int] = frozenset()
    kv_connector: ConnectorConfig | None = None
    """vLLM's `--kv-transfer-config` (NixlConnector): the engine answers the two legs."""
    kv_link: TransferLink = NAMED_LINKS["rdma"]
    """The simulated fabric a pull crosses (this engine's NIC; transfers take turns)."""
    engine_id: str = ""
    """The connector's engine id (`remote_engine_id`); the server's URL if empty."""
    host: str = "127.0.0.1"
    port: int = 0
    """Where peers reach this engine's side channel (`remote_host`, `remote_port`)."""
    server_load_tracking: bool = False
    """vLLM's `--enable-server-load-tracking`: `GET /load` counts the generation requests in
    flight (0 without it, as vLLM answers)."""
    lora_modules: tuple[tuple[str, str], ...] = ()
    """LoRA adapters served beside the base model, (name, path), as vLLM's `--lora-modules
    name=path`: a request naming one as its `model` runs with it, and its KV is keyed apart
    (the adapter's name in every block's hash, in the KV events' `lora_name`, and its int id,
    1, 2, ... in this order as vLLM numbers them, in their `lora_id`)."""


COMPLETION_MAX_TOKENS = 16
"""vLLM's `max_tokens` for a completion that sets none (chat calls take the rest of the
context)."""


class APIError(Exception):
    """An error answered in vLLM's `{"error": {...}}` shape."""

    def __init__(self, status: int, message: str, err_type: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param

    def response(self) -> web.Response:
        """Render as vLLM's ErrorResponse."""
        body = {"error": {"message": self.message, "type": self.err_type, "param": self.param,
                          "code": self.status}}
        return web.json_response(body, status=self.status)


@dataclass
class _Stream:
    """Per-request channel from the engine loop to the HTTP handler."""

    request: SimRequest
    queue: asyncio.Queue[TokenOutput] = field(default_factory=asyncio.Queue)
    last_token_at: float | None = None


@dataclass(frozen=True)
class _Asked:
    """What a request asks of its output beyond its tokens (adapters/sim/outputs.py)."""

    stop: StopSpec
    top_logprobs: int | None
    forced: Forced | None = None


@dataclass
class _Answer:
    """One request's output as its API server builds it: the text (stops applied) and the
    logprobs of its tokens."""

    text: OutputText
    logprobs: Logprobs | None
    forced: Forced | None

    def take(self, out: TokenOutput) -> tuple[list[int], bool]:
        """Take the engine's new tokens: the ones the answer keeps, and whether it is over
        (the engine finished it, or a stop ended it here)."""
        start = len(self.text.ids)
        self.text.add(out.new_token_ids)
        return self.text.ids[start:], out.finish_reason is not None or self.text.stopped

    def reason(self, engine_reason: FinishReason | None) -> str | None:
        """The answer's `finish_reason`."""
        if self.text.stopped:
            return FinishReason.STOP.value
        return engine_reason.value if engine_reason is not None else None


class SimEngine:
    """Runs EngineModel in real time and answers vLLM's HTTP endpoints."""

    def __init__(self, settings: SimSettings) -> None:
        self.settings = settings
        self._loras = frozenset(name for name, _ in settings.lora_modules)
        self.tokenizer = Tokenizer.load(settings.tokenizer)
        profile = settings.profile
        self.config = EngineConfig(
            block_size=settings.block_size,
            num_blocks=settings.num_blocks,
            max_num_batched_tokens=profile.max_num_batched_tokens,
            long_prefill_token_threshold=profile.long_prefill_token_threshold,
            max_num_seqs=profile.max_num_seqs,
            # Like vLLM, never admit a context longer than the KV cache can hold.
            max_model_len=min(profile.max_model_len, settings.num_blocks * settings.block_size),
            eos_token_id=self.tokenizer.eos_token_id,
            priority_scheduling=settings.priority_scheduling,
            reserve_full_isl=settings.reserve_full_isl,
            kv_lease_s=settings.kv_connector.lease_s if settings.kv_connector else 30.0,
            kv_connector=settings.kv_connector is not None,
            kv_load_failure_policy=(settings.kv_connector.load_failure_policy
                                    if settings.kv_connector else "recompute"),
        )
        self._word_ids = self._readable_token_ids()
        self.model = EngineModel(self.config, profile, self._sample)
        self.api = ApiServer(profile, settings.time_scale)
        """vLLM's API server before the scheduler: each request's cost, and its queue."""
        self.metrics = EngineMetrics(settings.model)
        self.publisher: KVEventPublisher | None = None
        self._streams: dict[str, _Stream] = {}
        self._server_load = 0
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._t0 = time.monotonic()
        self.healthy = True
        self.engine_id = (settings.engine_id
                          or (settings.kv_connector.engine_id if settings.kv_connector else None)
                          or str(uuid.uuid4()))
        self.link = LinkModel(settings.kv_link)
        self._peers: dict[str, Peer] = {}
        """Consumer requests that have not begun their read yet, by request id."""
        self._leases: dict[str, tuple[Peer, str]] = {}
        """Consumer requests until their read ends: the peer and the producer's request id
        whose lease their heartbeats renew."""
        self._pulls: set[asyncio.Task[None]] = set()
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    # -- engine loop ----------------------------------------------------------------------------

    def _readable_token_ids(self) -> list[int]:
        """Token ids that decode to a plain word, so simulated output reads as text."""
        ids = []
        for i in range(self.tokenizer.vocab_size):
            if i in self.tokenizer.special_ids:
                continue
            text = self.tokenizer.decode([i])
            if len(text) > 2 and text[0] == " " and text[1:].isascii() and text[1:].isalpha():
                ids.append(i)
        return ids or [i for i in range(self.tokenizer.vocab_size)
                       if i not in self.tokenizer.special_ids]

    def _sample(self, req: SimRequest) -> int:
        h = xxhash.xxh64_intdigest(
            f"{req.sample_seed}:{len(req.output_token_ids)}".encode(), seed=self.settings.seed
        )
        return self._word_ids[h % len(self._word_ids)]

    def now(self) -> float:
        """Engine time: seconds since start on the monotonic clock."""
        return time.monotonic() - self._t0

    async def start(self) -> None:
        """Open the KV-event sockets and start the step loop."""
        s = self.settings
        if s.kv_events_endpoint:
            self.publisher = KVEventPublisher(
                s.kv_events_endpoint, s.kv_replay_endpoint, s.kv_topic, drop_seqs=s.kv_drop_seqs,
                lora_ids={name: n for n, (name, _) in enumerate(s.lora_modules, start=1)})
            self.publisher.start()
        if s.kv_connector is not None:
            self._session = aiohttp.ClientSession()
            self._heartbeat_task = asyncio.get_running_loop().create_task(self._heartbeats())
        self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop stepping and close sockets."""
        for loop_task in (self._loop_task, self._heartbeat_task):
            if loop_task is not None:
                loop_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await loop_task
        for task in list(self._pulls):
            task.cancel()
        await asyncio.gather(*self._pulls, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
        if self.publisher is not None:
            await self.publisher.close()

    async def _run(self) -> None:
        # Steps are paced by deadlines, so the server's own work (scheduling, streaming the
        # previous step's tokens) happens inside the modelled step time instead of adding to
        # it; a step that starts late catches up by at most its own duration.
        deadline: float | None = None
        while True:
            if not self.model.has_work():
                self._wakeup.clear()
                await self._wakeup.wait()
                deadline = None
                continue
            started = time.monotonic()
            out = self.model.step(self.now())
            if self.model.loading:
                for pull in self.model.drain_pulls():
                    task = asyncio.get_running_loop().create_task(self._pull(pull))
                    self._pulls.add(task)
                    task.add_done_callback(self._pulls.discard)
            duration = out.duration * self.settings.time_scale
            if deadline is not None and started - deadline <= duration:
                started = deadline
            deadline = started + duration
            await asyncio.sleep(max(0.0, deadline - time.monotonic()))
            if self.publisher is not None:
                await self.publisher.publish(out.kv_events)
            t = self.now()
            # vLLM's tokens per step: prompt tokens computed plus tokens generated, so a step
            # that ends a prompt counts its first token besides its chunk.
            step_tokens = out.num_scheduled_tokens
            for o in out.outputs:
                stream = self._streams.get(o.request_id)
                if stream is None:
                    continue
                if stream.last_token_at is None:
                    step_tokens += 1
                    self.metrics.ttft.observe(t - stream.request.arrival_time)
                else:
                    self.metrics.itl.observe(t - stream.last_token_at)
                stream.last_token_at = t
                stream.queue.put_nowait(o)
            for req in out.finished:
                # Outputs are stamped at step end; the request's clock follows the real one.
                req.finished_time = t
                self.metrics.request_finished(req)
            if out.num_scheduled_tokens:
                self.metrics.iteration_tokens.observe(step_tokens)
            self.metrics.after_step(self.model)

    # -- KV connector ---------------------------------------------------------------------------

    async def _heartbeats(self) -> None:
        """NixlConnector's lease renewal: every lease/6 (whole seconds, as vLLM divides), each
        producer hears which of its exports this engine's consumer requests still wait to
        read, and holds them two thirds of a lease longer."""
        assert self.settings.kv_connector is not None
        interval = max(0.1, self.settings.kv_connector.lease_s // 6)
        while True:
            await asyncio.sleep(interval)  # wall-clock, as the lease is
            by_peer: dict[Peer, list[str]] = {}
            for peer, remote_id in self._leases.values():
                by_peer.setdefault(peer, []).append(remote_id)
            # Side by side, so one slow peer delays no other's lease.
            await asyncio.gather(*(
                self._notify_peer(peer, HEARTBEAT_PATH, {"remote_request_ids": ids})
                for peer, ids in by_peer.items()))

    async def _notify_peer(self, peer: Peer, path: str, body: dict[str, Any]) -> None:
        if self._session is None:
            return
        try:
            async with self._session.post(f"http://{peer.host}:{peer.port}{path}", json=body,
                                          timeout=aiohttp.ClientTimeout(total=5)) as r:
                await r.read()
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            log.warning("KV connector notification to %s:%d failed: %r", peer.host, peer.port, e)

    async def _pull(self, pull: KVPull) -> None:
        """Read a consumer request's missing blocks from its producer over the side channel;
        on failure the request recomputes them (vLLM's default `kv_load_failure_policy`)."""
        try:
            await self._read_from_peer(pull)
        finally:
            self._leases.pop(pull.request_id, None)

    async def _read_from_peer(self, pull: KVPull) -> None:
        peer = self._peers.pop(pull.request_id, None)
        ok = False
        started = time.monotonic()
        if peer is not None and self._session is not None:
            body = {"remote_request_id": pull.remote_request_id,
                    "block_ids": list(pull.remote_block_ids), "consumer": self.engine_id,
                    "num_bytes": pull.num_blocks * self.block_bytes}
            try:
                async with self._session.post(
                        f"http://{peer.host}:{peer.port}{SIDE_CHANNEL_PATH}", json=body,
                        timeout=aiohttp.ClientTimeout(total=60)) as r:
                    ok = r.status == 200
                    if not ok:
                        log.warning("KV pull for %s refused by %s:%d: %s", pull.request_id,
                                    peer.host, peer.port, (await r.text())[:200])
            except (aiohttp.ClientError, TimeoutError) as e:
                log.warning("KV pull for %s failed: %r", pull.request_id, e)
        req = self.model.finish_remote_load(pull.request_id, ok, self.now())
        if req is None:
            return
        if ok:
            self.metrics.nixl_transfer(pull.num_blocks * self.block_bytes,
                                       time.monotonic() - started)
        if req.finish_reason is FinishReason.ERROR:
            # kv_load_failure_policy fail: the request ends in an error, as vLLM's does.
            self.metrics.request_finished(req)
            stream = self._streams.get(req.request_id)
            if stream is not None:
                stream.queue.put_nowait(TokenOutput(req.request_id, (), FinishReason.ERROR))
        self.metrics.after_step(self.model)
        self._wakeup.set()

    @property
    def block_bytes(self) -> int:
        """KV bytes of one block under the profile."""
        return self.config.block_size * self.settings.profile.kv_bytes_per_token

    async def nixl_read(self, request: web.Request) -> web.Response:
        """The side channel: a consumer reads a finished producer request's exported blocks.
        Answers when the simulated transfer is over, then frees them."""
        if self.settings.kv_connector is None:
            raise APIError(404, "this engine runs no KV connector", "NotFoundError")
        try:
            body = await request.json()
            rid = body["remote_request_id"]
            consumer = str(body["consumer"])
            num_bytes = int(body["num_bytes"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise APIError(400, f"bad side-channel read: {e!r}") from None
        if rid not in self.model.exports and rid not in self.model.expired:
            raise APIError(404, f"no exported blocks for request {rid!r}", "NotFoundError")
        now = self.now()
        done = self.link.schedule(self.engine_id, consumer, num_bytes, now)
        await asyncio.sleep(max(0.0, done - now) * self.settings.time_scale)
        if not self.model.release_export(rid):
            # Its lease ran out before the read ended: as vLLM, the read is not refused (the
            # blocks may have been reused, which NIXL cannot tell), only counted.
            self.metrics.nixl_after_expiry.inc()
        self.metrics.after_step(self.model)
        return web.json_response({"ok": True, "num_bytes": num_bytes})

    async def nixl_heartbeat(self, request: web.Request) -> web.Response:
        """A consumer renews the leases of exports its requests still wait to read."""
        if self.settings.kv_connector is None:
            raise APIError(404, "this engine runs no KV connector", "NotFoundError")
        try:
            ids = [str(x) for x in (await request.json())["remote_request_ids"]]
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise APIError(400, f"bad heartbeat: {e!r}") from None
        self.model.renew_exports(ids, self.now() + self.settings.kv_connector.lease_s * 2 / 3)
        return web.json_response({"ok": True})

    async def nixl_release(self, request: web.Request) -> web.Response:
        """A consumer's request ended before it read: the export is freed at once."""
        if self.settings.kv_connector is None:
            raise APIError(404, "this engine runs no KV connector", "NotFoundError")
        try:
            rid = str((await request.json())["remote_request_id"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise APIError(400, f"bad release: {e!r}") from None
        released = self.model.release_export(rid)
        self.metrics.after_step(self.model)
        return web.json_response({"ok": True, "released": released})

    def _transfer_params(self, req: SimRequest) -> dict[str, Any] | None:
        """A producer request's answer for its consumer (None for any other request)."""
        if not req.remote_decode or not req.exported_block_ids:
            return None
        s = self.settings
        return producer_params(self.engine_id, req.request_id, req.exported_block_ids, s.host,
                               s.port, req.num_prompt_tokens, max(req.num_cached_tokens, 0))

    # -- request plumbing -----------------------------------------------------------------------

    def _submit(self, prompt_ids: list[int], body: dict[str, Any],
                priority_header: str | None, received: float, chat: bool,
                plan: list[int] | None = None) -> _Stream:
        """Queue a request in the engine model; its id inside the engine is always unique.

        `received` is when the handler began (engine time): the profile's `request_overhead_s`
        and `request_overhead_per_token_s` (plus `chat_overhead_s` for a chat request: vLLM's
        API-server cost, queued behind the requests before it when the profile sets
        `api_servers`) count from there, so the sim's own parsing and tokenising are part of
        it rather than added to it.
        """
        cfg = self.config
        n_prompt = len(prompt_ids)
        if n_prompt == 0:
            raise APIError(400, "The prompt cannot be empty.")
        if n_prompt > cfg.max_model_len:
            # vLLM 0.32's renderers/params.py, with its VLLMValidationError's suffix.
            raise APIError(
                400,
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, "
                f"your prompt contains {n_prompt} input tokens, which exceeds this limit even "
                "without any output tokens. Please reduce the length of the input prompt. "
                f"(parameter=input_tokens, value={n_prompt})", param="input_tokens")
        if n_prompt == cfg.max_model_len:
            # No room for one output token (vLLM's get_max_tokens, then SamplingParams).
            raise APIError(400, "max_tokens must be at least 1, got 0. (parameter=max_tokens, "
                                "value=0)", param="max_tokens")
        max_tokens = _opt_int(body, "max_completion_tokens")
        if max_tokens is None:
            max_tokens = _opt_int(body, "max_tokens")
        room = cfg.max_model_len - n_prompt
        if max_tokens is None:
            # vLLM's defaults: a chat call may take the rest of the context, a completion 16
            # tokens (its CompletionRequest's `max_tokens: int | None = 16`, null read as 16).
            max_tokens = room if chat else min(COMPLETION_MAX_TOKENS, room)
        elif max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}. "
                                f"(parameter=max_tokens, value={max_tokens})",
                           param="max_tokens")
        elif max_tokens > cfg.max_model_len:
            raise APIError(
                400,
                f"{'max_completion_tokens' if 'max_completion_tokens' in body else 'max_tokens'}"
                f"={max_tokens} cannot be greater than max_model_len="
                f"{cfg.max_model_len}. Please request fewer output tokens.",
            )
        else:
            # vLLM 0.32 clamps what the prompt leaves room for (serve/utils/api_utils.py,
            # get_max_tokens) rather than refusing it: the answer ends with "length".
            max_tokens = min(max_tokens, room)
        min_tokens = _opt_int(body, "min_tokens") or 0
        if min_tokens < 0 or min_tokens > max_tokens:
            raise APIError(400, f"min_tokens must be in [0, max_tokens], got {min_tokens}.")
        ignore_eos = _flag(body, "ignore_eos")
        priority = _priority(body, priority_header)
        cache_salt = body.get("cache_salt")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise APIError(400, "Parameter 'cache_salt' must be a non-empty string if "
                                "provided.")
        if cache_salt is not None and (len(cache_salt) > 128
                                       or any(c in "@/\\\0" for c in cache_salt)):
            # vLLM 0.32's validate_cache_salt (entrypoints/generate/base/protocol.py).
            raise APIError(400, "Parameter 'cache_salt' must be at most 128 characters and "
                                "must not contain '@', '/', '\\\\', or NUL.")
        digest = xxhash.xxh64_intdigest(
            json.dumps([prompt_ids, body.get("seed"), cache_salt]).encode(), seed=self.settings.seed
        )
        rng = random.Random(digest)
        natural = 1 + int(rng.expovariate(1.0 / self.settings.mean_output_tokens))
        output_plan = None
        if plan is not None:
            # An output forced into a shape: those tokens, then EOS (padded for ignore_eos).
            natural = len(plan) + 1
            eos = self.tokenizer.eos_token_id
            output_plan = plan + [eos] * max(1, max_tokens - len(plan))
        produce, remote, peer = False, None, None
        if self.settings.kv_connector is not None:
            try:
                produce, remote, peer = request_params(body.get("kv_transfer_params"))
            except ValueError as e:
                raise APIError(400, str(e), param="kv_transfer_params") from None
        rid = uuid.uuid4().hex
        first_cap, later_caps = _prefill_caps(body)
        req = SimRequest(
            request_id=rid,
            prompt_token_ids=prompt_ids,
            max_tokens=max_tokens,
            arrival_time=received,
            min_tokens=min_tokens,
            ignore_eos=ignore_eos,
            natural_output_len=natural,
            cache_salt=cache_salt,
            lora_name=body["model"] if body.get("model") in self._loras else None,
            priority=priority,
            sample_seed=digest,
            remote_decode=produce,
            remote_prefill=remote,
            prefill_cap=first_cap,
            prefill_caps=later_caps,
            output_plan=output_plan,
        )
        if peer is not None and remote is not None:
            self._peers[rid] = peer
            self._leases[rid] = (peer, remote.remote_request_id)
        stream = _Stream(req)
        self._streams[rid] = stream
        delay = self.api.admitted_at(received, chat, len(prompt_ids)) - self.now()
        if delay > 0:
            asyncio.get_running_loop().call_later(delay, self._admit, stream)
        else:
            self._admit(stream)
        return stream

    def _admit(self, stream: _Stream) -> None:
        """Hand a request to the engine model, unless its client left in the meantime."""
        if self._streams.get(stream.request.request_id) is stream:
            self.model.add_request(stream.request)
            self._wakeup.set()

    def _release(self, stream: _Stream) -> None:
        rid = stream.request.request_id
        self._streams.pop(rid, None)
        peer = self._peers.pop(rid, None)
        lease = self._leases.pop(rid, None)
        if peer is not None and lease is not None:
            # Gone before its read began: the producer frees the export now, not at the
            # lease's end.
            task = asyncio.get_running_loop().create_task(
                self._notify_peer(peer, RELEASE_PATH, {"remote_request_id": lease[1]}))
            self._pulls.add(task)
            task.add_done_callback(self._pulls.discard)
        # As vLLM's output processor: a request its client left is dropped without a finished
        # request's statistics (no `request_success`, no latency histograms).
        if (stream.request.finish_reason is None
                and self.model.abort_request(rid, self.now()) is not None):
            self.metrics.after_step(self.model)

    async def _tokens(self, stream: _Stream) -> AsyncIterator[TokenOutput]:
        while True:
            out = await stream.queue.get()
            yield out
            if out.finish_reason is not None:
                return

    async def _collect(self, stream: _Stream, answer: _Answer) -> str:
        """Every output token of a non-streaming request into `answer`; its finish
        reason."""
        reason: FinishReason | None = None
        try:
            async for out in self._tokens(stream):
                _, over = answer.take(out)
                reason = out.finish_reason
                if over:
                    break
            self._stop(stream, answer)
        finally:
            self._release(stream)
        if reason is FinishReason.ERROR:
            raise APIError(500, "Internal server error", "InternalServerError")
        finish = answer.reason(reason)
        assert finish is not None
        return finish

    def _stop(self, stream: _Stream, answer: _Answer) -> None:
        """A stop string or token ended the answer: the engine stops the request there (a
        finished request to its statistics, as vLLM's output processor counts it)."""
        if not answer.text.stopped or stream.request.finish_reason is not None:
            return
        req = self.model.abort_request(stream.request.request_id, self.now(), FinishReason.STOP)
        if req is not None:
            self.metrics.request_finished(req)
            self.metrics.after_step(self.model)

    def _asked(self, body: dict[str, Any], chat: bool) -> _Asked:
        """Read and check what the request asks of its output (400 naming the field)."""
        try:
            check_sampling(body)
            top = chat_logprobs(body) if chat else completion_logprobs(body)
            forced = None
            if chat:
                seed = xxhash.xxh64_intdigest(json.dumps(
                    [body.get("messages"), body.get("seed")], sort_keys=True,
                    default=str).encode(), seed=self.settings.seed)
                forced = forced_output(body, seed)
            min_tokens = body.get("min_tokens")
            stop = StopSpec.read(body, min_tokens if isinstance(min_tokens, int) else 0)
        except OutputError as e:
            raise APIError(400, str(e), param=e.param or None) from None
        return _Asked(stop, top, forced)

    def _answer(self, stream: _Stream, asked: _Asked) -> _Answer:
        decode = self.tokenizer.decode
        text = OutputText(decode, asked.stop, self.tokenizer.eos_token_id)
        logprobs = (Logprobs(stream.request.sample_seed, decode, self._word_ids,
                             asked.top_logprobs)
                    if asked.top_logprobs is not None else None)
        return _Answer(text, logprobs, asked.forced)

    def _plan(self, asked: _Asked) -> list[int] | None:
        return self.tokenizer.encode(asked.forced.text) if asked.forced is not None else None

    def _usage(self, req: SimRequest, streamed: bool = False,
               completion_tokens: int | None = None) -> dict[str, Any]:
        """The answer's `usage`; a streamed chunk leaves out what is unset, as vLLM writes its
        chunks with `exclude_unset` (no `"prompt_tokens_details": null` there).
        `completion_tokens`: the answer's own count where a stop cut it short (the engine may
        have computed a token or two more meanwhile)."""
        done = len(req.output_token_ids) if completion_tokens is None else completion_tokens
        usage: dict[str, Any] = {
            "prompt_tokens": req.num_prompt_tokens,
            "total_tokens": req.num_prompt_tokens + done,
            "completion_tokens": done,
        }
        if self.settings.enable_prompt_tokens_details:
            cached = max(req.num_cached_tokens, 0)
            remote = req.remote_prefill
            if remote is not None and remote.remote_prefill_cached_tokens is not None:
                cached = remote.remote_prefill_cached_tokens  # as vLLM 0.32's consumer
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        elif not streamed:
            usage["prompt_tokens_details"] = None
        return usage

    def _text(self, ids: list[int]) -> str:
        eos = self.tokenizer.eos_token_id
        return self.tokenizer.decode([i for i in ids if i != eos])

    # -- HTTP handlers --------------------------------------------------------------------------

    async def _json_body(self, request: web.Request) -> dict[str, Any]:
        media = request.headers.get("Content-Type", "").lower().split(";", 1)[0].strip()
        if media != "application/json":
            # vLLM's validate_json_request, on the completion, chat and tokenizer routes.
            raise APIError(400, "Unsupported Media Type: Only 'application/json' is allowed")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"Request body is not valid JSON: {e}") from None
        except (RecursionError, ValueError) as e:  # nested too deep; a 5,000-digit integer
            raise APIError(400, f"Request body cannot be read: {e}") from None
        if not isinstance(body, dict):
            raise APIError(400, "Request body must be a JSON object.")
        model = body.get("model")
        # An empty name stands for the served model, as vLLM reads it (serve/engine/serving.py).
        if (model is not None and model != "" and model != self.settings.model
                and model not in self._loras):
            # vLLM 0.32's serve/engine/serving.py words it so (its aliases: the served names).
            raise APIError(404, f"The model `{model}` does not exist. Valid aliases: "
                                f"{self.settings.model}.", "NotFoundError", param="model")
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            # vLLM's request model (a StreamOptions object) refuses it in validation.
            raise APIError(400, "stream_options: Input should be a valid dictionary or object",
                           param="stream_options")
        if options and not _flag(body, "stream"):
            raise APIError(400, "Stream options can only be defined when `stream=True`.")
        return body

    def _answering(self, body: dict[str, Any]) -> str:
        """The model an answer names: the LoRA adapter the request asked for, as vLLM's
        (`models/serving.py`), else the served model."""
        asked = body.get("model")
        return asked if isinstance(asked, str) and asked in self._loras else self.settings.model

    def _check_n(self, body: dict[str, Any]) -> None:
        n = body.get("n", 1)
        if n not in (1, None):
            raise APIError(400, "The simulated engine supports n=1 only.")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions."""
        received = self.now()
        body = await self._json_body(request)
        self._check_n(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "`messages` must be a non-empty list.")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise APIError(400, "`tools` must be a list.")
        asked = self._asked(body, chat=True)
        try:
            prompt_ids = self.tokenizer.encode_chat(
                messages, tools=tools, add_generation_prompt=body.get("add_generation_prompt", True)
            )
        except TokenizerError as e:
            raise APIError(400, str(e)) from None
        stream = self._submit(prompt_ids, body, request.headers.get(PRIORITY_HEADER), received,
                              chat=True, plan=self._plan(asked))
        rid = f"chatcmpl-{_base_request_id(request, body)}"
        created = int(time.time())
        model = self._answering(body)
        answer = self._answer(stream, asked)
        if _flag(body, "stream"):
            return await self._stream_chat(request, body, stream, answer, rid, created)
        reason = await self._collect(stream, answer)
        text = answer.text
        forced = answer.forced
        tool_calls: list[dict[str, Any]] = []
        content: str | None = text.text
        if forced is not None and forced.tool is not None:
            tool_calls = [forced.tool_call(rid, text.text)]
            content = ""
            if forced.required and reason == FinishReason.STOP.value:
                reason = "tool_calls"
        return web.json_response({
            "id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": content, "refusal": None,
                            "annotations": None, "audio": None, "function_call": None,
                            "tool_calls": tool_calls, "reasoning": None},
                "logprobs": (answer.logprobs.chat(0, text.ids)
                             if answer.logprobs is not None else None),
                "finish_reason": reason, "stop_reason": text.stop_reason,
                "token_ids": None,
            }],
            "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": self._usage(stream.request, completion_tokens=len(text.ids)),
            "prompt_logprobs": None, "prompt_token_ids": None,
            "kv_transfer_params": self._transfer_params(stream.request),
            "ec_transfer_params": None, "metrics": None,
        })

    async def _stream_chat(self, request: web.Request, body: dict[str, Any], stream: _Stream,
                           answer: _Answer, rid: str, created: int) -> web.StreamResponse:
        model = self._answering(body)
        options = body.get("stream_options") or {}
        include_usage = bool(options.get("include_usage"))
        continuous = include_usage and bool(options.get("continuous_usage_stats"))
        forced = answer.forced
        tool = forced is not None and forced.tool is not None
        resp = web.StreamResponse()

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                  fingerprint: bool = False) -> bytes:
            payload: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk",
                                       "created": created, "model": model, "choices": choices}
            if usage is not None:
                payload["usage"] = usage
            elif continuous:
                payload["usage"] = self._usage(stream.request, streamed=True,
                                               completion_tokens=len(answer.text.ids))
            if fingerprint:
                payload["system_fingerprint"] = SYSTEM_FINGERPRINT
            return _sse(payload)

        try:
            resp = await _sse_response(request)
            started = False
            failed = False
            async for out in self._tokens(stream):
                if out.finish_reason is FinishReason.ERROR:
                    await resp.write(_sse(STREAM_ERROR))
                    failed = True
                    break
                if not started:
                    # vLLM sends the role chunk with the first output, i.e. after prefill.
                    started = True
                    await resp.write(chunk([{"index": 0,
                                             "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]))
                start = len(answer.text.ids)
                new_ids, over = answer.take(out)
                text = answer.text.delta(over)
                delta: dict[str, Any] = {"content": text}
                if tool:
                    assert forced is not None
                    call: dict[str, Any] = {"index": 0, "function": {"arguments": (
                        "" if forced.required else text)}}
                    if start == 0:
                        call = {"id": tool_call_id(rid), "type": "function", "index": 0,
                                "function": {"name": forced.tool,
                                             "arguments": call["function"]["arguments"]}}
                    elif forced.required and over:
                        call["function"]["arguments"] = forced.tool_call(
                            rid, answer.text.text)["function"]["arguments"]
                    delta = {"tool_calls": [call]}
                choice: dict[str, Any] = {
                    "index": 0, "delta": delta,
                    "logprobs": (answer.logprobs.chat(start, new_ids)
                                 if answer.logprobs is not None else None),
                    "finish_reason": None}
                last = chunk([choice])
                if over:
                    reason = answer.reason(out.finish_reason)
                    if tool and forced is not None and forced.required and reason == "stop":
                        reason = "tool_calls"
                    choice["finish_reason"] = reason
                    choice["stop_reason"] = answer.text.stop_reason
                    # vLLM stamps its fingerprint on the last message only: the terminal
                    # chunk, or the usage chunk where one follows.
                    last = chunk([choice], fingerprint=not include_usage)
                await resp.write(last)
                if over:
                    self._stop(stream, answer)
                    break
            if include_usage and not failed:  # vLLM: the error event, then [DONE]
                await resp.write(chunk([], self._usage(
                    stream.request, streamed=True, completion_tokens=len(answer.text.ids)),
                    fingerprint=True))
            await resp.write(b"data: [DONE]\n\n")
        finally:
            self._release(stream)
        return resp

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions (text or token-id prompt)."""
        received = self.now()
        body = await self._json_body(request)
        self._check_n(body)
        asked = self._asked(body, chat=False)
        prompt_ids = self._completion_prompt(body.get("prompt"))
        echo = self._text(prompt_ids) if _flag(body, "echo") else ""
        stream = self._submit(prompt_ids, body, request.headers.get(PRIORITY_HEADER), received,
                              chat=False)
        rid = f"cmpl-{_base_request_id(request, body)}"
        created = int(time.time())
        model = self._answering(body)
        answer = self._answer(stream, asked)
        if _flag(body, "stream"):
            options = body.get("stream_options") or {}
            include_usage = bool(options.get("include_usage"))
            continuous = include_usage and bool(options.get("continuous_usage_stats"))
            try:
                resp = await _sse_response(request)
                failed = False
                offset = len(echo)
                async for out in self._tokens(stream):
                    if out.finish_reason is FinishReason.ERROR:
                        await resp.write(_sse(STREAM_ERROR))
                        failed = True
                        break
                    start = len(answer.text.ids)
                    new_ids, over = answer.take(out)
                    text = answer.text.delta(over)
                    if start == 0 and echo:
                        text = echo + text  # vLLM's first chunk carries the prompt
                    reason = answer.reason(out.finish_reason) if over else None
                    logprobs = None
                    if answer.logprobs is not None:
                        # Offsets by the tokens' own texts (after the echoed prompt), as the
                        # answer given whole has them, not by the text sent so far.
                        logprobs = answer.logprobs.completion(start, new_ids, offset)
                        offset += sum(map(len, logprobs["tokens"]))
                    choice = {"index": 0, "text": text, "logprobs": logprobs,
                              "finish_reason": reason,
                              "stop_reason": answer.text.stop_reason if over else None}
                    piece: dict[str, Any] = {"id": rid, "object": "text_completion",
                                             "created": created, "model": model,
                                             "choices": [choice]}
                    if continuous:
                        piece["usage"] = self._usage(stream.request, streamed=True,
                                                     completion_tokens=len(answer.text.ids))
                    if reason is not None and not include_usage:
                        piece["system_fingerprint"] = SYSTEM_FINGERPRINT
                    await resp.write(_sse(piece))
                    if over:
                        self._stop(stream, answer)
                        break
                if include_usage and not failed:  # vLLM: the error event, then [DONE]
                    await resp.write(_sse({"id": rid, "object": "text_completion",
                                           "created": created, "model": model, "choices": [],
                                           "usage": self._usage(
                                               stream.request, streamed=True,
                                               completion_tokens=len(answer.text.ids)),
                                           "system_fingerprint": SYSTEM_FINGERPRINT}))
                await resp.write(b"data: [DONE]\n\n")
            finally:
                self._release(stream)
            return resp
        final = await self._collect(stream, answer)
        done = answer.text
        return web.json_response({
            "id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": echo + done.text,
                         "logprobs": (answer.logprobs.completion(0, done.ids, len(echo))
                                      if answer.logprobs is not None else None),
                         "finish_reason": final, "stop_reason": done.stop_reason,
                         "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None}],
            "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": self._usage(stream.request, completion_tokens=len(done.ids)),
            "kv_transfer_params": self._transfer_params(stream.request),
            "ec_transfer_params": None, "metrics": None,
        })

    def _completion_prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if prompt == "" or prompt == []:
            raise APIError(400, "Either prompt or prompt_embeds must be provided and non-empty.",
                           param="prompt")
        if isinstance(prompt, str):
            return self.tokenizer.encode_prompt(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.tokenizer.vocab_size]
            if bad:
                raise APIError(400, f"Token id {bad[0]} is out of vocabulary.")
            return list(prompt)
        if isinstance(prompt, list):
            raise APIError(400, "The simulated engine supports one prompt per request.")
        raise APIError(400, "`prompt` must be a string or a list of token ids.")

    async def models(self, _: web.Request) -> web.Response:
        """GET /v1/models."""
        s = self.settings
        def card(name: str, root: str, parent: str | None) -> dict[str, Any]:
            return {"id": name, "object": "model", "created": int(time.time()),
                    "owned_by": "vllm", "root": root, "parent": parent,
                    "max_model_len": self.config.max_model_len,
                    "permission": [{"id": f"modelperm-{uuid.uuid4().hex}",
                                    "object": "model_permission", "created": int(time.time()),
                                    "allow_create_engine": False, "allow_sampling": True,
                                    "allow_logprobs": True, "allow_search_indices": False,
                                    "allow_view": True, "allow_fine_tuning": False,
                                    "organization": "*", "group": None,
                                    "is_blocking": False}]}

        # LoRA adapters are listed as vLLM lists them: their path as `root`, the base as
        # `parent`.
        data = [card(s.model, s.model, None),
                *(card(name, path, s.model) for name, path in s.lora_modules)]
        return web.json_response({"object": "list", "data": data})

    async def health(self, _: web.Request) -> web.Response:
        """GET /health: 200 while the engine runs."""
        if not self.healthy or self._loop_task is None or self._loop_task.done():
            return web.Response(status=503)
        return web.Response(status=200)

    async def version(self, _: web.Request) -> web.Response:
        """GET /version."""
        return web.json_response({"version": VLLM_VERSION})

    async def load(self, _: web.Request) -> web.Response:
        """GET /load: vLLM's server load, the generation requests in flight when the server
        tracks them (`--enable-server-load-tracking`), else 0."""
        return web.json_response({"server_load": self._server_load})

    def load_aware(self, handler: Handler) -> Handler:
        """`handler` counted in `/load` while it runs (vLLM's `load_aware_call`: from the
        request's arrival to the end of its answer, a streamed one included)."""
        if not self.settings.server_load_tracking:
            return handler

        async def counted(request: web.Request) -> web.StreamResponse:
            self._server_load += 1
            try:
                return await handler(request)
            finally:
                self._server_load -= 1

        return counted

    def _tokenizer_path(self) -> str:
        if self.settings.tokenizer is not None:
            return self.settings.tokenizer
        from kvgate.assets.tiny_tokenizer import TOKENIZER_DIR

        return str(TOKENIZER_DIR)

    async def model_info(self, _: web.Request) -> web.Response:
        """GET /get_model_info (and /model_info): what SGLang workers report, for routers such
        as sglang-router that discover workers through it."""
        s = self.settings
        tok = self.tokenizer
        return web.json_response({
            "model_path": s.model, "tokenizer_path": self._tokenizer_path(),
            "served_model_name": s.model, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default",
            "max_context_length": self.config.max_model_len, "vocab_size": tok.vocab_size,
            "supports_vision": False, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
            "eos_token_ids": [tok.eos_token_id], "pad_token_id": None,
            "bos_token_id": tok.bos_token_id, "max_req_input_len": self.config.max_model_len - 1,
        })

    async def server_info(self, _: web.Request) -> web.Response:
        """GET /get_server_info (and /server_info): SGLang's server arguments and limits, as far
        as a router reads them."""
        s = self.settings
        return web.json_response({
            "model_path": s.model, "served_model_name": s.model,
            "tokenizer_path": self._tokenizer_path(), "dp_size": 1, "tp_size": 1,
            "page_size": self.config.block_size, "context_length": self.config.max_model_len,
            "max_total_num_tokens": self.config.num_blocks * self.config.block_size,
            "max_running_requests": self.config.max_num_seqs,
            "chunked_prefill_size": self.config.max_num_batched_tokens,
            "version": VLLM_VERSION,
        })

    async def tokenize(self, request: web.Request) -> web.Response:
        """POST /tokenize: `{model, prompt}` or `{model, messages, tools}`."""
        body = await self._json_body(request)
        if "messages" in body:
            try:
                ids = self.tokenizer.encode_chat(
                    body["messages"], tools=body.get("tools"),
                    add_generation_prompt=body.get("add_generation_prompt", True),
                )
            except TokenizerError as e:
                raise APIError(400, str(e)) from None
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise APIError(400, "`prompt` must be a string.")
            if body.get("add_special_tokens", True):
                ids = self.tokenizer.encode_prompt(prompt)
            else:
                ids = self.tokenizer.encode(prompt)
        return web.json_response({"count": len(ids), "max_model_len": self.config.max_model_len,
                                  "tokens": ids, "token_strs": None})

    async def detokenize(self, request: web.Request) -> web.Response:
        """POST /detokenize: `{model, tokens}`."""
        body = await self._json_body(request)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise APIError(400, "`tokens` must be a list of token ids.")
        return web.json_response({"prompt": self.tokenizer.decode(tokens)})

    async def metrics_endpoint(self, _: web.Request) -> web.Response:
        """GET /metrics in Prometheus text format."""
        self.metrics.after_step(self.model)
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """POST /reset_prefix_cache (vLLM's dev endpoint): 200 and `{"success": bool}`, false
        while requests hold blocks (vLLM 0.32's entrypoints/serve/dev/cache/api_router.py).
        `?reset_running_requests=true` preempts the running requests first, so it succeeds
        while they run; `reset_external` is taken (the sim has no connector-managed cache)."""
        running = _query_flag(request, "reset_running_requests")
        _query_flag(request, "reset_external")
        success = self.model.reset_prefix_cache(reset_running=running)
        if success and self.publisher is not None:
            await self.publisher.publish(self.model.pool.drain_events())
        return web.json_response({"success": success})


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        resp: web.StreamResponse = await handler(request)
        return resp
    except APIError as e:
        return e.response()
    except web.HTTPException as e:
        if e.status >= 400:
            return APIError(e.status, e.reason or "error", type(e).__name__).response()
        raise
    except (ValueError, TypeError, OverflowError) as e:
        # vLLM's fallback handlers for these (its exception_handling/register.py): a 400 in
        # its error shape with the exception's text (a prompt with a lone surrogate the
        # tokenizer cannot encode, a token id out of range, a field of the wrong type).
        return APIError(400, str(e)).response()


def _base_request_id(request: web.Request, body: dict[str, Any]) -> str:
    """vLLM's rule: the X-Request-Id header, else the body's `request_id`, else a random id."""
    header = request.headers.get("X-Request-Id")
    if header is not None:
        return header
    rid = body.get("request_id")
    return str(rid) if rid is not None else uuid.uuid4().hex


def _opt_int(body: dict[str, Any], key: str) -> int | None:
    """An integer field as vLLM's pydantic request model reads it (lax: `5`, `5.0`, `"5"`,
    `true`), None when unset or null; anything else is a 400."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, int):  # bool too: True is 1
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        if text.lstrip("+-").isdigit() and len(text) <= 24:
            return int(text)
    raise APIError(400, f"`{key}` must be an integer, got {value!r}.", param=key)


_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def _flag(body: dict[str, Any], key: str) -> bool:
    """A boolean field as vLLM's pydantic request model reads it (lax: `"false"` is False, 0 and
    1 are booleans), False when unset or null; anything else is a 400."""
    value = body.get(key)
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise APIError(400, f"`{key}` must be a boolean, got {value!r}.", param=key)


def _prefill_caps(body: dict[str, Any]) -> tuple[int, tuple[tuple[int, int], ...]]:
    """kvgate's engine-side pacing caps from `vllm_xargs` (`kvgate_prefill_cap` and
    `kvgate_prefill_caps`, (0, ()) for none), read as the scheduler plugin reads them from
    vLLM's `SamplingParams.extra_args` (adapters/vllm_plugins/kvgate_pace_caps.py). The request
    model's own check comes first: `vllm_xargs` is an object whose values are strings,
    numbers or flat lists of them."""
    xargs = body.get("vllm_xargs")
    if xargs is None:
        return 0, ()
    if not isinstance(xargs, dict):
        # vLLM's request model refuses it (`dict[str, ...] | None`), reported by its validation
        # handler as for `priority` above.
        err = {"type": "dict_type", "loc": "body.vllm_xargs",
               "msg": "Input should be a valid dictionary", "input": str(xargs)}
        raise APIError(400, f"1 validation error:\n  {err}", "Bad Request", "body.vllm_xargs")
    for key, value in xargs.items():
        if not _xarg(value) and not (isinstance(value, list) and all(map(_xarg, value))):
            loc = f"body.vllm_xargs.{key}"
            err = {"type": "union_type", "loc": loc,
                   "msg": "Input should be a string, a number or a list of them",
                   "input": str(value)}
            raise APIError(400, f"1 validation error:\n  {err}", "Bad Request", loc)
    return read_caps(xargs)


def _xarg(value: Any) -> bool:
    """A scalar vLLM takes as a `vllm_xargs` value (`str | int | float`)."""
    return isinstance(value, str | int | float)


def _priority(body: dict[str, Any], header: str | None) -> int:
    """The request's `priority` as vLLM 0.32 takes it (see the module docstring)."""
    asked = body.get("priority", 0)
    # vLLM's `priority: int` is a lax pydantic field: True, 3.0 and "3" are read as integers.
    priority = lax_int(asked)
    if priority is None:
        raise APIError(400, f"`priority` must be an integer, got {asked!r}.",
                       param="body.priority")
    if not _INT64_MIN <= priority <= _INT64_MAX:
        # The protocol's `Field(ge=_INT64_MIN, le=_INT64_MAX)`, reported like vLLM's validation
        # handler (vllm/entrypoints/serve/exception_handling/handlers/validation.py).
        if priority < _INT64_MIN:
            kind, op, word, bound = "greater_than_equal", "ge", "greater", _INT64_MIN
        else:
            kind, op, word, bound = "less_than_equal", "le", "less", _INT64_MAX
        err = {"type": kind, "loc": "body.priority",
               "msg": f"Input should be {word} than or equal to {bound}",
               "input": str(priority), "ctx": {op: bound}}
        raise APIError(400, f"1 validation error:\n  {err}", "Bad Request", "body.priority")
    if header is not None:
        # `_get_priority` (vllm/entrypoints/generate/base/serving.py), after the body validated:
        # the header wins when it parses as an int and is ignored when it does not.
        try:
            return int(header)
        except ValueError:
            pass
    return priority


def _query_flag(request: web.Request, name: str) -> bool:
    """A boolean query parameter as FastAPI reads one (vLLM's routes are FastAPI's)."""
    value = request.query.get(name)
    if value is None:
        return False
    v = value.strip().lower()
    if v in ("1", "true", "t", "yes", "y", "on"):
        return True
    if v in ("0", "false", "f", "no", "n", "off"):
        return False
    raise APIError(400, f"{name}: Input should be a valid boolean, unable to interpret input",
                   param=name)


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def _sse_response(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


def build_app(engine: SimEngine, client_max_size: int = 64 * 1024 * 1024) -> web.Application:
    """The aiohttp application for one simulated engine."""
    app = web.Application(middlewares=[_errors], client_max_size=client_max_size)
    app.router.add_post("/v1/chat/completions", engine.load_aware(engine.chat_completions))
    app.router.add_post("/v1/completions", engine.load_aware(engine.completions))
    app.router.add_get("/load", engine.load)
    app.router.add_get("/v1/models", engine.models)
    app.router.add_get("/health", engine.health)
    app.router.add_get("/version", engine.version)
    for path in ("/get_model_info", "/model_info"):
        app.router.add_get(path, engine.model_info)
    for path in ("/get_server_info", "/server_info"):
        app.router.add_get(path, engine.server_info)
    app.router.add_post("/tokenize", engine.tokenize)
    app.router.add_post("/detokenize", engine.detokenize)
    app.router.add_get("/metrics", engine.metrics_endpoint)
    app.router.add_post("/reset_prefix_cache", engine.reset_prefix_cache)
    app.router.add_post(SIDE_CHANNEL_PATH, engine.nixl_read)
    app.router.add_post(HEARTBEAT_PATH, engine.nixl_heartbeat)
    app.router.add_post(RELEASE_PATH, engine.nixl_release)

    async def on_startup(_: web.Application) -> None:
        await engine.start()

    async def on_cleanup(_: web.Application) -> None:
        await engine.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def run(settings: SimSettings, host: str, port: int) -> None:
    """Serve one simulated engine until interrupted."""
    engine = SimEngine(settings)
    log.info("simulated engine %s (%s) on http://%s:%d", settings.model, settings.profile.name,
             host, port)
    web.run_app(build_app(engine), host=host, port=port, print=None, access_log=None,
                handler_cancellation=True)
