"""Microbenchmarks of the KV index: prefix lookup, event ingestion, memory per block.

`kvgate microbench index` reports:
- match: the index walk alone for an 8k-token prompt (512 keys) against 1M indexed blocks held by
  64 engines;
- lookup: the gateway's whole per-request path before placement: chat template, cached
  tokenisation and keying of the static prefix, plus the match;
- ingest: KV-event batches decoded, mapped to index keys and applied, in blocks per second;
- memory: bytes per indexed block for the index, and per engine block for the ingestor's map.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
import tracemalloc
from typing import Any

from kvindex.events import BlockRemoved, BlockStored, KVEventBatch, encode_batch
from kvindex.index import InMemoryIndex
from kvindex.ingest import EventIngestor, apply_ops_sync
from kvindex.keys import PromptKeyer, chain_keys
from kvindex.tokenizer import Tokenizer

BLOCK = 16


def _percentiles(samples_s: list[float]) -> dict[str, float]:
    samples = sorted(samples_s)
    return {
        "p50_us": statistics.median(samples) * 1e6,
        "p99_us": samples[min(len(samples) - 1, int(len(samples) * 0.99))] * 1e6,
    }


def _agent_chat(turn: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    duties = " ".join(f"Rule {k}: verify claim {k} against two independent sources and log it."
                      for k in range(230))
    system = f"You are a senior research agent. {duties}"
    tools = [{"type": "function", "function": {
        "name": f"tool_{t}", "description": f"Tool {t} searches corpus {t} for evidence.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}
        for t in range(24)]
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": f"Question number {turn}: what changed?"}]
    return messages, tools


def build_index(blocks: int, engines: int, seed: int = 0) -> InMemoryIndex:
    """`blocks` distinct keys in chains of 512, each chain held by 1-3 of `engines` engines."""
    rng = random.Random(seed)
    index = InMemoryIndex()
    names = [f"engine-{i}" for i in range(engines)]
    chain_len = 512
    for c in range(blocks // chain_len):
        tokens = [rng.randrange(4, 4096) for _ in range(chain_len * BLOCK)]
        keys = chain_keys(tokens, BLOCK)
        for name in rng.sample(names, rng.randint(1, 3)):
            index.add_sync(name, keys)
        del tokens, keys
        if c % 200 == 0:
            gc.collect()
    return index


def bench_lookup(blocks: int = 1_000_000, engines: int = 64, iterations: int = 300
                 ) -> dict[str, Any]:
    """Match and full-lookup latency for an 8k-token prompt, plus index memory per block."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = build_index(blocks, engines)
    gc.collect()
    index_bytes = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    keyer = PromptKeyer(Tokenizer.load(), BLOCK)
    messages, tools = _agent_chat(0)
    prompt = keyer.chat(messages, tools)
    # Three engines hold the prompt's static prefix, as after replication.
    for name in ("engine-1", "engine-7", "engine-42"):
        index.add_sync(name, prompt.keys[: len(prompt.keys) - 8])
    match_s, lookup_s = [], []
    for i in range(iterations):
        t0 = time.perf_counter()
        index.match_sync(prompt.keys, 0.0)
        match_s.append(time.perf_counter() - t0)
        msgs, tls = _agent_chat(i + 1)
        t0 = time.perf_counter()
        keys = keyer.chat(msgs, tls)
        index.match_sync(keys.keys, 0.0)
        lookup_s.append(time.perf_counter() - t0)
    stats = index.stats_sync()
    return {
        "prompt_tokens": prompt.num_tokens,
        "prompt_blocks": len(prompt.keys),
        "indexed_keys": stats.keys,
        "indexed_entries": stats.entries,
        "engines": engines,
        "match": _percentiles(match_s),
        "lookup_with_template": _percentiles(lookup_s),
        "index_bytes_per_key": index_bytes / max(1, stats.keys),
        "index_mb_per_million_keys": index_bytes / max(1, stats.keys) * 1e6 / 2**20,
    }


def _event_batches(batches: int, blocks_per_event: int, seed: int = 1) -> list[bytes]:
    """A vLLM-like stream: each batch stores a chained run of blocks and evicts older ones."""
    rng = random.Random(seed)
    out = []
    next_hash = 1
    live: list[int | bytes] = []
    for _ in range(batches):
        tokens = [rng.randrange(4, 4096) for _ in range(blocks_per_event * BLOCK)]
        hashes: list[int | bytes] = list(range(next_hash, next_hash + blocks_per_event))
        next_hash += blocks_per_event
        events: list[Any] = [BlockStored(
            block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=BLOCK,
            lora_id=None, medium="GPU", lora_name=None, extra_keys=[None] * blocks_per_event,
            group_idx=0, kv_cache_spec_kind="full_attention")]
        live.extend(hashes)
        if len(live) > 20 * blocks_per_event:
            evicted, live = live[:blocks_per_event], live[blocks_per_event:]
            events += [BlockRemoved(block_hashes=[h], medium="GPU", group_idx=0)
                       for h in evicted]
        out.append(encode_batch(KVEventBatch(ts=0.0, events=events, data_parallel_rank=0)))
    return out


def bench_ingest(batches: int = 4000, blocks_per_event: int = 32) -> dict[str, Any]:
    """Blocks per second through decode -> key mapping -> index, and ingestor memory."""
    payloads = _event_batches(batches, blocks_per_event)
    ingestor = EventIngestor(BLOCK)
    index = InMemoryIndex()
    t0 = time.perf_counter()
    for seq, data in enumerate(payloads):
        apply_ops_sync(index, ingestor.on_message("engine-0", seq, data).ops)
    elapsed = time.perf_counter() - t0
    stored = ingestor.stats.blocks_stored
    # Memory of the ingestor's engine-hash map, with nothing evicted.
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    keep = EventIngestor(BLOCK)
    for seq, data in enumerate(_event_batches(batches // 4, blocks_per_event, seed=2)):
        keep.on_message("engine-1", seq, data)
    gc.collect()
    map_bytes = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    mapped = keep.engine_blocks("engine-1")
    return {
        "batches": batches,
        "blocks_stored": stored,
        "blocks_removed": ingestor.stats.blocks_removed,
        "seconds": elapsed,
        "blocks_per_s": (stored + ingestor.stats.blocks_removed) / elapsed,
        "stored_blocks_per_s": stored / elapsed,
        "ingestor_bytes_per_engine_block": map_bytes / max(1, mapped),
    }
