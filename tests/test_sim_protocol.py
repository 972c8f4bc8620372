"""The simulated engine speaks vLLM 0.32's KV-event and metrics protocols, checked from outside.

These tests start `kvgate sim` as a subprocess and read its ZMQ and HTTP output the way a real
vLLM consumer would: KV events are decoded with a private copy of vLLM's msgspec structs (not
`kvindex.events`, so a shared mistake cannot hide), and /metrics with prometheus_client's parser.
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from kvgate.procs import Child, free_port, start_sim

# ---------------------------------------------------------------------------------------------
# A field-for-field copy of vllm/distributed/kv_events.py (vLLM 0.32). Do not import vllm or
# kvindex.events here: the point is an independent decoder, as any vLLM subscriber would have.
# ---------------------------------------------------------------------------------------------

ExternalBlockHash = bytes | int  # vllm/v1/core/kv_cache_utils.py


class EventBatch(
    msgspec.Struct,
    array_like=True,  # type: ignore[call-arg]
    omit_defaults=True,  # type: ignore[call-arg]
    gc=False,  # type: ignore[call-arg]
):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(
    msgspec.Struct,
    omit_defaults=True,  # type: ignore[call-arg]
    gc=False,  # type: ignore[call-arg]
    tag=True,
):
    """Base class for all KV cache-related events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]  # type: ignore[assignment]


VLLM_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
BLOCK = 16
SIM_BASE = ["--profile", "cpu-tiny", "--time-scale", "0.05", "--seed", "7"]

# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _http(url: str, body: dict[str, Any] | None = None, timeout: float = 10.0) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.status == 200
        out: bytes = r.read()
        return out


def _refused(url: str, body: dict[str, Any]) -> tuple[int, str]:
    """POST `body`, which the engine must refuse: its status and error text."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    return err.value.code, err.value.read().decode()


def served_model(child: Child) -> str:
    cards = json.loads(_http(child.url + "/v1/models"))["data"]
    assert len(cards) == 1
    name: str = cards[0]["id"]
    return name


def complete(child: Child, model: str, prompt: Sequence[int], max_tokens: int) -> dict[str, Any]:
    """POST /v1/completions with a token-id prompt; returns the JSON response."""
    body = {"model": model, "prompt": list(prompt), "max_tokens": max_tokens}
    resp: dict[str, Any] = json.loads(_http(child.url + "/v1/completions", body))
    assert resp["usage"]["prompt_tokens"] == len(prompt)
    return resp


def token_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 4000) for _ in range(n)]


@contextlib.contextmanager
def running_sim(tmp_path: Path, name: str, extra: Sequence[str]) -> Iterator[Child]:
    child = start_sim(name, tmp_path / "logs", [*SIM_BASE, *extra])
    try:
        yield child
    finally:
        child.stop()


class SubCollector:
    """A SUB socket (subscribed to everything) polled continuously by a background thread.

    With `connect=None` it binds a free 127.0.0.1 port (publishers connect to `endpoint`);
    otherwise it connects there. The socket lives entirely in the thread, as ZMQ requires.
    """

    def __init__(self, connect: str | None = None) -> None:
        self._ctx = zmq.Context()
        self._connect = connect
        self._lock = threading.Lock()
        self._messages: list[list[bytes]] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.endpoint = ""
        self._thread = threading.Thread(target=self._run, name="test-sub", daemon=True)
        self._thread.start()
        if not self._ready.wait(5) or self._error is not None:
            self.close()
            raise RuntimeError(f"SUB socket did not start: {self._error!r}")

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            if self._connect is None:
                port = sock.bind_to_random_port("tcp://127.0.0.1")
                self.endpoint = f"tcp://127.0.0.1:{port}"
            else:
                sock.connect(self._connect)
                self.endpoint = self._connect
            self._ready.set()
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            while not self._stop.is_set():
                if not poller.poll(20):
                    continue
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    with self._lock:
                        self._messages.append(frames)
        except BaseException as e:  # surfaced by the constructor or by wait_for
            self._error = e
            self._ready.set()
        finally:
            sock.close(linger=0)

    def messages(self) -> list[list[bytes]]:
        with self._lock:
            return list(self._messages)

    def wait_for(
        self, pred: Callable[[list[list[bytes]]], bool], timeout: float = 10.0, what: str = ""
    ) -> list[list[bytes]]:
        deadline = time.monotonic() + timeout
        while True:
            msgs = self.messages()
            if self._error is not None:
                raise AssertionError(f"SUB thread failed: {self._error!r}")
            if pred(msgs):
                return msgs
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; got {len(msgs)} messages")
            time.sleep(0.02)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._ctx.term()


@contextlib.contextmanager
def collector(connect: str | None = None) -> Iterator[SubCollector]:
    sub = SubCollector(connect)
    try:
        yield sub
    finally:
        sub.close()


def decode(msgs: list[list[bytes]]) -> list[tuple[int, KVEventBatch]]:
    """Check the 3-frame envelope and decode each payload as a vLLM subscriber does."""
    out = []
    for frames in msgs:
        assert len(frames) == 3, f"expected [topic, seq, payload], got {len(frames)} frames"
        _, seq, payload = frames
        assert len(seq) == 8
        out.append((int.from_bytes(seq, "big"), VLLM_DECODER.decode(payload)))
    return out


def events_of(batches: list[tuple[int, KVEventBatch]], kind: type) -> list[Any]:
    return [e for _, b in batches for e in b.events if isinstance(e, kind)]


def stored_blocks(msgs: list[list[bytes]]) -> int:
    return sum(len(e.block_hashes) for e in events_of(decode(msgs), BlockStored))


def check_stored_event(ev: BlockStored) -> None:
    assert ev.block_size == BLOCK
    assert ev.block_hashes, "BlockStored without hashes"
    assert all(type(h) is int for h in ev.block_hashes), ev.block_hashes
    assert ev.parent_block_hash is None or type(ev.parent_block_hash) is int
    assert len(ev.token_ids) == BLOCK * len(ev.block_hashes)
    assert ev.medium == "GPU"
    assert ev.lora_id is None and ev.lora_name is None
    assert ev.extra_keys is None or len(ev.extra_keys) == len(ev.block_hashes)


# ---------------------------------------------------------------------------------------------
# 1. Connect mode, decoded with vLLM's own structs
# ---------------------------------------------------------------------------------------------


def test_kv_events_decode_as_vllm_subscriber(tmp_path: Path) -> None:
    rng = random.Random(1)
    prompt_a = token_ids(rng, 100)
    prompt_b = prompt_a[:64] + token_ids(rng, 36)
    assert prompt_b[64:80] != prompt_a[64:80]

    with collector() as sub, running_sim(
        tmp_path, "sim-connect",
        ["--kv-events", sub.endpoint, "--kv-topic", "engine-a", "--block-size", str(BLOCK)],
    ) as sim:
        model = served_model(sim)
        complete(sim, model, prompt_a, max_tokens=2)
        first = sub.wait_for(lambda m: stored_blocks(m) >= 6, what="6 blocks of request A")
        complete(sim, model, prompt_b, max_tokens=2)
        msgs = sub.wait_for(lambda m: stored_blocks(m) >= 8, what="2 new blocks of request B")
        time.sleep(0.2)  # anything unexpected still in flight shows up in the final snapshot
        msgs = sub.messages()

    # Envelope: 3 frames, our topic, seq 0, 1, 2, ... (8-byte big-endian).
    for frames in msgs:
        assert len(frames) == 3
        assert frames[0] == b"engine-a"
    batches = decode(msgs)
    assert [seq for seq, _ in batches] == list(range(len(batches)))

    # The payload is vLLM's array [ts, events, dp_rank] holding "type"-tagged maps (0.32 layout).
    for frames in msgs:
        raw = msgspec.msgpack.decode(frames[2])
        assert isinstance(raw, list) and len(raw) == 3
        assert isinstance(raw[0], float) and raw[2] == 0
        for ev in raw[1]:
            assert isinstance(ev, dict) and ev["type"] in {
                "BlockStored", "BlockRemoved", "AllBlocksCleared"}
    for _, batch in batches:
        assert batch.data_parallel_rank == 0
        assert batch.events, "vLLM publishes no empty batches"

    assert not events_of(batches, BlockRemoved)
    assert not events_of(batches, AllBlocksCleared)

    n_first = len(first)
    stored_a = events_of(batches[:n_first], BlockStored)
    stored_b = events_of(batches[n_first:], BlockStored)

    # Request A: its 6 full blocks (96 of 100 tokens), chained from a None parent.
    hashes_a: list[int] = []
    for ev in stored_a:
        check_stored_event(ev)
        assert ev.parent_block_hash == (hashes_a[-1] if hashes_a else None)
        start = len(hashes_a) * BLOCK
        assert ev.token_ids == prompt_a[start:start + len(ev.token_ids)]
        hashes_a.extend(ev.block_hashes)
    assert len(hashes_a) == 6
    assert len(set(hashes_a)) == 6

    # Request B: the 4 shared prefix blocks are reused, not re-announced; blocks 4 and 5 are new
    # and chain from A's 4th block.
    hashes_b: list[int] = []
    for ev in stored_b:
        check_stored_event(ev)
        assert ev.parent_block_hash == (hashes_b[-1] if hashes_b else hashes_a[3])
        start = (4 + len(hashes_b)) * BLOCK
        assert ev.token_ids == prompt_b[start:start + len(ev.token_ids)]
        hashes_b.extend(ev.block_hashes)
    assert len(hashes_b) == 2
    assert not set(hashes_b) & set(hashes_a)


# ---------------------------------------------------------------------------------------------
# 2. Bind mode (the sim binds because of `*`) and replay through the ROUTER
# ---------------------------------------------------------------------------------------------


def _replay(endpoint: str, start: int, timeout: float = 5.0) -> list[list[bytes]]:
    """Ask the replay ROUTER for every batch from `start`; return frames up to the end marker."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out: list[list[bytes]] = []
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0 and dealer.poll(int(left * 1000)), "replay did not finish in time"
            frames = dealer.recv_multipart()
            if frames == [b"", b"", END_SEQ, b""]:
                return out
            out.append(frames)
    finally:
        dealer.close(linger=0)
        ctx.term()


def test_bind_mode_and_replay(tmp_path: Path) -> None:
    pub_port, replay_port = free_port(), free_port()
    while replay_port == pub_port:
        replay_port = free_port()
    rng = random.Random(2)
    with running_sim(
        tmp_path, "sim-bind",
        ["--kv-events", f"tcp://*:{pub_port}", "--kv-replay", f"tcp://*:{replay_port}",
         "--kv-topic", "engine-b", "--block-size", str(BLOCK)],
    ) as sim, collector(f"tcp://127.0.0.1:{pub_port}") as sub:
        model = served_model(sim)
        # Slow joiner: batches published before our subscription reaches the PUB are dropped,
        # so send prompts until one arrives (replay must still return the dropped ones).
        for _ in range(50):
            complete(sim, model, token_ids(rng, 40), max_tokens=1)
            with contextlib.suppress(AssertionError):
                sub.wait_for(bool, timeout=0.2)
                break
        else:
            pytest.fail("no KV event reached a SUB connected to the bound PUB")
        for _ in range(2):
            complete(sim, model, token_ids(rng, 40), max_tokens=1)
        live = sub.wait_for(lambda m: len(m) >= 3, what="live batches")
        time.sleep(0.2)
        live = sub.messages()
        replayed = _replay(f"tcp://127.0.0.1:{replay_port}", 0)
        # A replay from the middle returns just the tail.
        last_live = int.from_bytes(live[-1][1], "big")
        tail = _replay(f"tcp://127.0.0.1:{replay_port}", last_live)

    live_by_seq = {}
    for frames in live:
        assert len(frames) == 3 and frames[0] == b"engine-b"
        live_by_seq[int.from_bytes(frames[1], "big")] = frames[2]
    live_seqs = sorted(live_by_seq)
    assert live_seqs == list(range(live_seqs[0], live_seqs[-1] + 1)), "gap in live batches"

    for frames in replayed:
        assert len(frames) == 4, "replay frames are [b'', topic, seq, payload]"
        assert frames[0] == b"" and frames[1] == b"engine-b"
    replay_by_seq = {int.from_bytes(f[2], "big"): f[3] for f in replayed}
    assert [int.from_bytes(f[2], "big") for f in replayed] == list(range(live_seqs[-1] + 1))
    for seq, payload in live_by_seq.items():
        assert replay_by_seq[seq] == payload, f"replayed batch {seq} differs from the live one"
    for payload in replay_by_seq.values():
        assert events_of([(0, VLLM_DECODER.decode(payload))], BlockStored)

    assert [int.from_bytes(f[2], "big") for f in tail] == [last_live]


# ---------------------------------------------------------------------------------------------
# 3. Eviction from a tiny pool announces BlockRemoved
# ---------------------------------------------------------------------------------------------


def test_block_removed_on_eviction(tmp_path: Path) -> None:
    rng = random.Random(3)
    prompts = [token_ids(rng, 48) for _ in range(5)]  # 3 full blocks each, 15 in all > 8
    with collector() as sub, running_sim(
        tmp_path, "sim-evict",
        ["--kv-events", sub.endpoint, "--kv-topic", "engine-c", "--block-size", str(BLOCK),
         "--kv-blocks", "8"],
    ) as sim:
        model = served_model(sim)
        for p in prompts:
            complete(sim, model, p, max_tokens=1)
        sub.wait_for(lambda m: stored_blocks(m) >= 15, what="15 stored blocks")
        time.sleep(0.2)
        msgs = sub.messages()

    batches = decode(msgs)
    assert [seq for seq, _ in batches] == list(range(len(batches)))
    live: set[int] = set()
    announced: set[int] = set()
    removed: list[int] = []
    for _, batch in batches:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                check_stored_event(ev)
                live.update(ev.block_hashes)
                announced.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                assert ev.medium == "GPU"
                for h in ev.block_hashes:
                    assert h in live, f"BlockRemoved for {h} which is not (or no longer) stored"
                    live.discard(h)
                    removed.append(h)
            else:
                pytest.fail(f"unexpected event {ev!r}")
    assert len(announced) == 15
    assert removed, "a pool of 8 blocks held 15 blocks without evicting any"
    assert len(live) <= 8


# ---------------------------------------------------------------------------------------------
# 4. /metrics, parsed by prometheus_client
# ---------------------------------------------------------------------------------------------


def _metrics(child: Child) -> dict[str, Any]:
    text = _http(child.url + "/metrics").decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(families: dict[str, Any], family: str, sample: str) -> float:
    values = [s.value for s in families[family].samples if s.name == sample]
    assert len(values) == 1, f"{sample}: {values}"
    return float(values[0])


def test_metrics_parse_like_vllm(tmp_path: Path) -> None:
    rng = random.Random(4)
    with running_sim(
        tmp_path, "sim-metrics",
        ["--model", "test-model", "--block-size", str(BLOCK), "--enable-prompt-tokens-details"],
    ) as sim:
        model = served_model(sim)
        assert model == "test-model"
        complete(sim, model, token_ids(rng, 100), max_tokens=2)
        fams = _metrics(sim)

        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                     "vllm:kv_cache_usage_perc"):
            assert fams[name].type == "gauge", name
            assert [s.name for s in fams[name].samples] == [name]
        for name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
                     "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success"):
            assert fams[name].type == "counter", name
            assert {s.name for s in fams[name].samples} == {name + "_total"}, name
        for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                     "vllm:e2e_request_latency_seconds"):
            assert fams[name].type == "histogram", name
            names = {s.name for s in fams[name].samples}
            assert {name + "_bucket", name + "_count", name + "_sum"} <= names, name
            inf = [s for s in fams[name].samples
                   if s.name == name + "_bucket" and s.labels["le"] == "+Inf"]
            assert len(inf) == 1 and inf[0].value >= 1, name

        for fam in fams.values():
            if not fam.name.startswith("vllm:"):
                continue
            for s in fam.samples:
                assert s.labels.get("model_name") == model, s
                assert s.labels.get("engine") == "0", s
        success = [s for s in fams["vllm:request_success"].samples if s.value > 0]
        assert [s.labels.get("finished_reason") for s in success] == ["length"]
        assert all("finished_reason" in s.labels for s in fams["vllm:request_success"].samples)
        assert _value(fams, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == 100
        assert _value(fams, "vllm:generation_tokens", "vllm:generation_tokens_total") == 2
        assert _value(fams, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc") == 0

        # Same 64-token prompt twice: the second run hits 3 blocks (the last block of a fully
        # cached prompt is recomputed to get logits), and both runs query all 64 tokens.
        hits_0 = _value(fams, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")
        queries_0 = _value(fams, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total")
        prompt = token_ids(random.Random(5), 64)
        complete(sim, model, prompt, max_tokens=1)
        second = complete(sim, model, prompt, max_tokens=1)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
        fams = _metrics(sim)
        hits_1 = _value(fams, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")
        queries_1 = _value(fams, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total")
        assert hits_1 - hits_0 == 48
        assert queries_1 - queries_0 == 128
        # vLLM 0.32's cached-token counters: every tier declared, the local hits on `device`,
        # and the total (local + external) equal to the prefix-cache hits without a connector.
        tiers = {s.labels["source"]: s.value
                 for s in fams["vllm:prompt_tokens_cached_by_source"].samples
                 if s.name.endswith("_total")}
        assert tiers == {"device": hits_1, "host": 0, "disk": 0, "p2p": 0,
                         "external_unspecified": 0}
        assert _value(fams, "vllm:prompt_tokens_cached", "vllm:prompt_tokens_cached_total") \
            == hits_1


# ---------------------------------------------------------------------------------------------
# 5. The project's decoder accepts both wire layouts and rejects garbage
# ---------------------------------------------------------------------------------------------


def test_kvindex_decode_batch_both_layouts() -> None:
    from kvindex.events import AllBlocksCleared as KAllCleared
    from kvindex.events import BlockRemoved as KRemoved
    from kvindex.events import BlockStored as KStored
    from kvindex.events import KVEventDecodeError, decode_batch

    ids = list(range(100, 132))
    ts = 1700000000.5
    positional = msgspec.msgpack.encode([
        ts,
        [["BlockStored", [1, 2], None, ids, 16, None, "GPU", None],
         ["BlockRemoved", [7], "GPU"],
         ["AllBlocksCleared"]],
        0,
    ])
    map_layout = msgspec.msgpack.Encoder().encode(KVEventBatch(
        ts=ts,
        events=[
            BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=ids,
                        block_size=16, lora_id=None, medium="GPU", lora_name=None,
                        extra_keys=[None, None], group_idx=0,
                        kv_cache_spec_kind="full_attention"),
            BlockRemoved(block_hashes=[7], medium="GPU", group_idx=0),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    ))
    assert isinstance(msgspec.msgpack.decode(map_layout)[1][0], dict)

    for payload in (positional, map_layout):
        batch = decode_batch(payload)
        assert batch.ts == ts and batch.data_parallel_rank == 0
        stored, removed, cleared = batch.events
        assert isinstance(stored, KStored)
        assert stored.block_hashes == [1, 2] and stored.parent_block_hash is None
        assert stored.token_ids == ids and stored.block_size == 16
        assert stored.medium == "GPU" and stored.lora_id is None and stored.lora_name is None
        assert isinstance(removed, KRemoved) and removed.block_hashes == [7]
        assert removed.medium == "GPU"
        assert isinstance(cleared, KAllCleared)

    for garbage in (b"\xc1\xff not msgpack", b"", msgspec.msgpack.encode({"ts": 1}),
                    msgspec.msgpack.encode([ts, [7], 0])):
        with pytest.raises(KVEventDecodeError):
            decode_batch(garbage)
    # An event of a type a later vLLM may add is left out; its batch's others are kept.
    unknown: list[str] = []
    batch = decode_batch(msgspec.msgpack.encode([ts, [["NoSuchEvent", 1],
                                                      ["AllBlocksCleared"]], 0]), unknown)
    assert [type(e) for e in batch.events] == [KAllCleared] and unknown == ["'NoSuchEvent'"]


def test_sglang_worker_info_endpoints_describe_the_engine(tmp_path: Path) -> None:
    """sglang-router discovers workers through these (new and deprecated paths)."""
    with running_sim(tmp_path, "sim-info", ["--model", "info-model", "--block-size", "32",
                                            "--kv-blocks", "100"]) as sim:
        for path in ("/get_model_info", "/model_info"):
            with urllib.request.urlopen(sim.url + path, timeout=10) as r:
                info = json.load(r)
            assert info["model_path"] == info["served_model_name"] == "info-model"
            assert info["is_generation"] is True
            assert info["max_context_length"] == 3200
        for path in ("/get_server_info", "/server_info"):
            with urllib.request.urlopen(sim.url + path, timeout=10) as r:
                server = json.load(r)
            assert server["page_size"] == 32 and server["max_total_num_tokens"] == 3200
            assert server["dp_size"] == 1


def test_a_prefix_cache_reset_answers_success_as_vllm(tmp_path: Path) -> None:
    """vLLM 0.32's `POST /reset_prefix_cache`: always a 200, `{"success": false}` while a
    request holds blocks; the live bench and `kvgate calibrate` read `success`."""
    from adapters.vllm.dev import reset_done

    with running_sim(tmp_path, "sim-reset", ["--time-scale", "5"]) as sim:
        model = served_model(sim)
        complete(sim, model, list(range(20, 60)), max_tokens=1)
        answers: list[bytes] = []
        decoding = threading.Thread(target=lambda: answers.append(_http(
            sim.url + "/v1/completions", {"model": model, "prompt": list(range(100, 140)),
                                          "max_tokens": 200, "min_tokens": 200}, 60.0)))
        decoding.start()
        time.sleep(0.5)
        busy = _http(sim.url + "/reset_prefix_cache", {})
        # vLLM's `reset_running_requests` preempts the running request first: the reset
        # succeeds, and the request resumes (recomputing) and still ends whole.
        forced = _http(sim.url + "/reset_prefix_cache?reset_running_requests=true", {})
        decoding.join()
        idle = _http(sim.url + "/reset_prefix_cache", {})
        status, _ = _refused(sim.url + "/reset_prefix_cache?reset_running_requests=maybe", {})
    assert status == 400
    assert json.loads(forced) == {"success": True}
    assert json.loads(answers[0])["usage"]["completion_tokens"] == 200
    assert json.loads(busy) == {"success": False} and not reset_done(busy)
    assert json.loads(idle) == {"success": True} and reset_done(idle)
    assert reset_done(b"")  # an older vLLM's empty 200
    assert not reset_done(b"<html>") and not reset_done(b'{"success": "yes"}')


def test_max_tokens_past_the_room_left_is_clamped_as_vllm(tmp_path: Path) -> None:
    """vLLM 0.32 caps `max_tokens` at what the prompt leaves of the context (get_max_tokens)
    and refuses only more than the whole context."""
    with running_sim(tmp_path, "sim-room", ["--block-size", "16", "--kv-blocks", "8"]) as sim:
        model = served_model(sim)  # max_model_len: the 128 tokens the KV cache holds
        body = {"model": model, "prompt": list(range(20, 120)), "max_tokens": 100,
                "ignore_eos": True}
        answer = json.loads(_http(sim.url + "/v1/completions", body))
        assert answer["usage"]["completion_tokens"] == 28
        assert answer["choices"][0]["finish_reason"] == "length"
        status, text = _refused(sim.url + "/v1/completions", {**body, "max_tokens": 129})
        assert status == 400
        assert "cannot be greater than max_model_len=128" in text


def test_defaults_and_refusals_as_vllms_handlers_give_them(tmp_path: Path) -> None:
    with running_sim(tmp_path, "sim-defaults", []) as sim:
        model = served_model(sim)
        # A completion that sets no max_tokens gets 16 (vLLM's CompletionRequest default).
        answer = json.loads(_http(sim.url + "/v1/completions", {
            "model": model, "prompt": [11, 12, 13], "ignore_eos": True}))
        assert answer["usage"]["completion_tokens"] == 16
        assert answer["choices"][0]["finish_reason"] == "length"
        # Fields read as pydantic reads them in lax mode: "false" is False, "5" is 5.
        answer = json.loads(_http(sim.url + "/v1/completions", {
            "model": model, "prompt": [11, 12, 13], "max_tokens": "5", "ignore_eos": "true",
            "stream": "false"}))
        assert answer["usage"]["completion_tokens"] == 5
        status, text = _refused(sim.url + "/v1/completions", {"model": model, "prompt": ""})
        assert status == 400 and "must be provided and non-empty" in text
        status, text = _refused(sim.url + "/v1/completions", {"model": "nope", "prompt": "x"})
        error = json.loads(text)["error"]
        assert status == 404 and (error["type"], error["param"]) == ("NotFoundError", "model")
        assert error["message"] == f"The model `nope` does not exist. Valid aliases: {model}."
        # vLLM 0.32's words for a prompt past the context, and one that leaves no room.
        room = json.loads(_http(sim.url + "/v1/models"))["data"][0]["max_model_len"]
        for n, words, param in ((room + 1, f"your prompt contains {room + 1} input tokens",
                                 "input_tokens"),
                                (room, "max_tokens must be at least 1, got 0", "max_tokens")):
            status, text = _refused(sim.url + "/v1/completions", {
                "model": model, "prompt": [11] * n, "max_tokens": 1})
            assert status == 400 and words in text and json.loads(text)["error"]["param"] \
                == param, text
        # What vLLM's ValueError/TypeError handlers answer: a 400 in its error shape, never a
        # plain-text 500.
        for path, body in (
                ("/v1/completions", {"model": model, "prompt": "\ud800 lone", "max_tokens": 1}),
                ("/v1/completions", {"model": model, "prompt": [11], "max_tokens": 1,
                                     "stream": True, "stream_options": "yes"})):
            status, text = _refused(sim.url + path, body)
            assert status == 400, (body, text)
            assert json.loads(text)["error"]["type"] == "BadRequestError"
        # Only JSON bodies, as vLLM's validate_json_request has it.
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            req = urllib.request.Request(sim.url + path, data=b'{"model": "x"}',
                                         headers={"Content-Type": "text/plain"})
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(req, timeout=10)
            assert err.value.code == 400
            assert "Only 'application/json' is allowed" in err.value.read().decode()


def test_a_cache_salt_vllm_refuses_is_a_400(tmp_path: Path) -> None:
    with running_sim(tmp_path, "sim-salt", []) as sim:
        model = served_model(sim)
        for salt in ("", "team/a", "a@b", "x" * 129, 7):
            status, text = _refused(sim.url + "/v1/completions", {
                "model": model, "prompt": [11, 12], "max_tokens": 1, "cache_salt": salt})
            assert status == 400 and "cache_salt" in text, salt
        complete(sim, model, [11, 12], max_tokens=1)


def test_a_streamed_usage_chunk_leaves_out_what_is_unset(tmp_path: Path) -> None:
    """vLLM writes its chunks with `exclude_unset`: without `--enable-prompt-tokens-details`
    the usage chunk has no `prompt_tokens_details` at all (the whole answer has it, null)."""
    with running_sim(tmp_path, "sim-usage", []) as sim:
        body = {"model": served_model(sim), "prompt": [11, 12, 13], "max_tokens": 2,
                "stream": True, "stream_options": {"include_usage": True}}
        raw = _http(sim.url + "/v1/completions", body).decode()
        events = [json.loads(line[6:]) for line in raw.splitlines()
                  if line.startswith("data: {")]
        usage = events[-1]["usage"]
        assert usage["prompt_tokens"] == 3 and "prompt_tokens_details" not in usage
        del body["stream_options"]
        whole = json.loads(_http(sim.url + "/v1/completions", {**body, "stream": False}))
        assert whole["usage"]["prompt_tokens_details"] is None
        # As vLLM: stream options without a stream are refused.
        status, text = _refused(sim.url + "/v1/completions", {
            **body, "stream": False, "stream_options": {"include_usage": True}})
        assert status == 400 and "only be defined when" in text


def stream_messages(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON messages of a streamed answer, in order (without `[DONE]`)."""
    raw = _http(url + path, {**body, "stream": True}, timeout=60.0).decode()
    return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]


def check_fingerprint_on_last_message(url: str, model: str) -> None:
    """vLLM 0.32 stamps `system_fingerprint` on a streamed answer's last message only: the
    terminal chunk, or the usage chunk when `include_usage` asks for one. Run against the
    simulated engine here and against a real vLLM in the vllm tier."""
    asks = [("/v1/completions", {"model": model, "prompt": "The sky is", "max_tokens": 3,
                                 "ignore_eos": True}),
            ("/v1/chat/completions", {"model": model, "max_tokens": 3, "ignore_eos": True,
                                      "messages": [{"role": "user", "content": "hi"}]})]
    for path, body in asks:
        for usage in (False, True):
            ask = {**body, "stream_options": {"include_usage": True}} if usage else body
            messages = stream_messages(url, path, ask)
            stamped = ["system_fingerprint" in m for m in messages]
            assert stamped == [False] * (len(messages) - 1) + [True], (path, usage, messages)
            last = messages[-1]
            assert last["system_fingerprint"].startswith("vllm-0.32.0")
            if usage:
                assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3
            else:
                assert last["choices"][0]["finish_reason"] == "length" and "usage" not in last


def test_a_streamed_answer_carries_the_fingerprint_on_its_last_message(tmp_path: Path) -> None:
    with running_sim(tmp_path, "sim-fingerprint", []) as sim:
        check_fingerprint_on_last_message(sim.url, served_model(sim))


def test_server_load_counts_requests_in_flight_when_tracked(tmp_path: Path) -> None:
    """vLLM's `GET /load`: 0 unless the server runs with `--enable-server-load-tracking`,
    then the generation requests in flight, a streamed one until its answer ends."""
    for tracked in (False, True):
        extra = ["--time-scale", "5"] + (["--enable-server-load-tracking"] if tracked else [])
        with running_sim(tmp_path, f"sim-load-{tracked}", extra) as sim:
            assert json.loads(_http(sim.url + "/load")) == {"server_load": 0}
            body = {"model": served_model(sim), "prompt": list(range(100, 140)),
                    "max_tokens": 200, "min_tokens": 200}
            calls = [threading.Thread(target=_http, args=(sim.url + "/v1/completions", {
                **body, "stream": streamed}, 60.0)) for streamed in (False, True)]
            for call in calls:
                call.start()
            time.sleep(0.5)
            during = json.loads(_http(sim.url + "/load"))
            for call in calls:
                call.join()
            after = json.loads(_http(sim.url + "/load"))
        assert during == {"server_load": 2 if tracked else 0}, tracked
        assert after == {"server_load": 0}


def test_a_lora_adapters_blocks_carry_its_name_and_int_id(tmp_path: Path) -> None:
    """vLLM numbers `--lora-modules` 1, 2, ... in order (`lora_int_id`) and sends that id as
    `lora_id` beside `lora_name` in the adapter's BlockStored events (0.32's block_pool.py)."""
    with collector() as sub, running_sim(
        tmp_path, "sim-lora",
        ["--kv-events", sub.endpoint, "--block-size", str(BLOCK),
         "--model", "base", "--lora-modules", "sql=/loras/sql", "chat=/loras/chat"],
    ) as sim:
        prompt = token_ids(random.Random(5), 3 * BLOCK + 1)
        complete(sim, "chat", prompt, max_tokens=1)
        complete(sim, "base", prompt, max_tokens=1)
        msgs = sub.wait_for(lambda m: stored_blocks(m) >= 6, what="3 blocks of each request")
    stored = events_of(decode(msgs), BlockStored)
    assert {(ev.lora_id, ev.lora_name) for ev in stored} == {(2, "chat"), (None, None)}
