"""Paced prefill in the live gateway: in front of one real simulated engine with a sequence
decoding, a long prompt is computed in free pieces (warm-ups the gateway sends to the engine)
before the request itself goes out; read from the gateway's and the engine's own `/metrics`
and the answer's `usage`, with the official `openai` client."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from adapters.vllm_plugins.kvgate_pace_caps import cap_at, read_caps
from gateway.proxy import with_fields
from kvgate.procs import Child, free_port, spawn, wait_healthy
from tests.conftest import MODEL
from tests.test_kv_moves_live import metrics
from tests.test_sim_priority import post


def start(logs: Path, policy: str, scheduler: str = "vllm") -> tuple[Child, Child]:
    events = free_port()
    port = free_port()
    sim = spawn(f"sim-{policy}", ["sim", "--host", "127.0.0.1", "--port", str(port),
                                  "--model", MODEL, "--kv-events", f"tcp://127.0.0.1:{events}",
                                  "--enable-prompt-tokens-details"],
                f"http://127.0.0.1:{port}", logs)
    wait_healthy(sim)
    port = free_port()
    path = logs / f"gateway-{policy}.yaml"
    path.write_text(yaml.safe_dump({
        "host": "127.0.0.1", "port": port, "policy": policy,
        "kv_events_bind": f"tcp://127.0.0.1:{events}", "scrape_interval_s": 0.2,
        "engines": [{"url": sim.url, "scheduler": scheduler}]}))
    gateway = spawn(f"gateway-{policy}", ["serve", "--config", str(path)],
                    f"http://127.0.0.1:{port}", logs)
    try:
        wait_healthy(gateway)
    except Exception:
        sim.stop()
        raise
    return sim, gateway


@pytest.fixture(scope="module", params=["kvgate", "kvgate-no-pace", "kvgate-engine-pace",
                                        "kvgate+kvgate-pace"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[str, dict[tuple[str, tuple[tuple[str, str], ...]], float],
                               dict[tuple[str, tuple[tuple[str, str], ...]], float], int]]:
    """A long prompt sent while another call decodes, through a gateway running `policy`:
    the gateway's and the engine's metrics afterwards, and the prompt's cached tokens."""
    # "kvgate+kvgate-pace": the default policy in front of an engine whose config entry says it
    # runs kvgate's pacing scheduler (`scheduler: kvgate-pace`).
    policy = request.param
    name, _, scheduler = policy.partition("+")
    sim, gateway = start(tmp_path_factory.mktemp("pace-live"), name, scheduler or "vllm")
    try:
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0)
        first = threading.Event()
        errors: list[BaseException] = []

        def decode() -> None:
            try:
                stream = client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "Tell a long story."}],
                    max_tokens=300, stream=True, extra_body={"ignore_eos": True})
                for _ in stream:
                    first.set()
            except BaseException as e:
                errors.append(e)
                first.set()

        thread = threading.Thread(target=decode)
        thread.start()
        assert first.wait(30)
        time.sleep(0.5)  # a scrape and a few steps: the gateway sees it decoding
        # A client's own `vllm_xargs` too: the gateway adds the cap beside it. Salted: the
        # pieces must be computed under the call's salt to be found by it.
        answer = client.chat.completions.create(
            model=MODEL, max_tokens=4,
            extra_body={"ignore_eos": True, "vllm_xargs": {"client_note": "kept"},
                        "cache_salt": "tenant-a"},
            messages=[{"role": "user", "content": "Summarise this. " + "lorem ipsum " * 1500}])
        thread.join(60)
        assert not errors, errors
        assert answer.choices[0].message.content is not None
        details = answer.usage.prompt_tokens_details if answer.usage else None
        cached = details.cached_tokens or 0 if details is not None else 0
        yield policy, metrics(gateway.url), metrics(sim.url), cached
    finally:
        gateway.stop()
        sim.stop()


def test_a_long_prompt_beside_a_decode_is_computed_in_pieces_first(
        served: tuple[str, dict[tuple[str, tuple[tuple[str, str], ...]], float],
                      dict[tuple[str, tuple[tuple[str, str], ...]], float], int]) -> None:
    policy, gw, engine, cached = served
    pieces = gw.get(("kvgate_kv_moves_total", (("kind", "warm"), ("outcome", "done"),
                                               ("reason", "pace"))), 0.0)
    paced = gw.get(("kvgate_placements_total", (("reason", "pace"),)), 0.0)
    # The engine answered every piece as a request of its own, besides the two calls.
    requests = sum(v for (name, labels), v in engine.items()
                   if name == "vllm:request_success_total")
    # The engine's own tokens per step (vLLM's `vllm:iteration_tokens_total`): the largest
    # step's bucket.
    steps = {float(dict(labels)["le"]): v for (name, labels), v in engine.items()
             if name == "vllm:iteration_tokens_total_bucket"}
    total = max(steps.values())
    largest = min(le for le, v in steps.items() if v == total)
    if policy == "kvgate":
        assert pieces >= 2 and paced == 1
        assert requests == 2 + pieces
        # The call found its pieces in the engine's own prefix cache (under its salt): computed
        # ahead, in steps beside the decode.
        assert cached >= 1000
        assert largest <= 512
    elif policy in ("kvgate-engine-pace", "kvgate+kvgate-pace"):
        # Sent once, with its cap: the engine computed it in small steps beside the decode.
        assert pieces == 0 and paced == 0 and requests == 2 and cached == 0
        assert largest <= 512
    else:
        assert pieces == 0 and paced == 0 and requests == 2 and cached == 0
        assert largest > 2048  # the whole prompt in one step


def test_the_sim_reads_the_cap_from_vllm_xargs_as_the_plugin_does(
        spawn_sim: Callable[..., Child]) -> None:
    """`vllm_xargs` must be an object, as vLLM's request model has it; inside, a cap that is
    not a positive integer is no cap (the plugin ignores it), not an error."""
    sim = spawn_sim()
    url = f"{sim.url}/v1/completions"
    status, body = post(url, {"model": MODEL, "prompt": "x", "max_tokens": 1,
                              "vllm_xargs": [1]})
    assert status == 400 and body["error"]["param"] == "body.vllm_xargs"
    assert "valid dictionary" in body["error"]["message"]
    for cap in (64, "64", -1, True):
        status, body = post(url, {"model": MODEL, "prompt": "x", "max_tokens": 1,
                                  "vllm_xargs": {"kvgate_prefill_cap": cap, "other": "kept"}})
        assert status == 200, body
    # The later caps: a flat list, as vLLM takes a `vllm_xargs` value; pairs are refused there.
    for caps in ([2048, 128, 4096, 96], [2048], ["a", 1]):
        status, body = post(url, {"model": MODEL, "prompt": "x", "max_tokens": 1, "vllm_xargs": {
            "kvgate_prefill_cap": 64, "kvgate_prefill_caps": caps}})
        assert status == 200, body
    status, body = post(url, {"model": MODEL, "prompt": "x", "max_tokens": 1, "vllm_xargs": {
        "kvgate_prefill_caps": [[2048, 128]]}})
    assert status == 400 and body["error"]["param"] == "body.vllm_xargs.kvgate_prefill_caps"


@pytest.mark.parametrize(("xargs", "expected"), [
    ({"kvgate_prefill_cap": 64}, (64, ())),
    ({"kvgate_prefill_cap": 64, "kvgate_prefill_caps": [100, 32, 200, 16]},
     (64, ((100, 32), (200, 16)))),
    ({"kvgate_prefill_caps": [100, 32]}, (0, ((100, 32),))),
    ({"kvgate_prefill_cap": True, "kvgate_prefill_caps": [100, 32, 50, 16]}, (0, ())),
    ({"kvgate_prefill_cap": 64, "kvgate_prefill_caps": [100, 32, 200]}, (64, ())),
    ({"kvgate_prefill_cap": 64, "kvgate_prefill_caps": [100, 0]}, (64, ())),
    ({"kvgate_prefill_cap": 64, "kvgate_prefill_caps": [100, 32.0]}, (64, ())),
    ({"kvgate_prefill_cap": -5, "kvgate_prefill_caps": "100,32"}, (0, ())),
    ([64], (0, ())),
])
def test_the_caps_are_read_as_the_plugin_reads_them(xargs: object,
                                                   expected: tuple[int, object]) -> None:
    """Malformed later caps are no later caps (tokens not rising, odd length, non-integers,
    a cap not positive); the first cap stands on its own."""
    assert read_caps(xargs) == expected
    first, steps = read_caps(xargs)
    if steps:
        assert cap_at(first, steps, 99) == first
        assert cap_at(first, steps, 100) == steps[0][1]
        assert cap_at(first, steps, 10**6) == steps[-1][1]


@given(st.dictionaries(st.sampled_from(["model", "messages", "priority", "vllm_xargs"])
                       | st.text(max_size=8), st.integers() | st.text(max_size=8), min_size=1,
                       max_size=5),
       st.dictionaries(st.sampled_from(["priority", "vllm_xargs", "model"]),
                       st.integers() | st.dictionaries(st.text(max_size=4), st.integers(),
                                                       max_size=2), min_size=1, max_size=3),
       st.sampled_from(["", "\n", "  \r\n"]))
def test_fields_go_into_the_forwarded_body_as_if_it_were_re_encoded(
        body: dict[str, object], fields: dict[str, object], tail: str) -> None:
    """The gateway adds `priority` and `vllm_xargs` to a body by splicing the raw bytes where
    it can (no second serialisation of a long prompt): the engine parses the same object as
    from a re-encoded body, whether the field was there or not."""
    raw = (json.dumps(body, indent=None if tail else 1) + tail).encode()
    sent = with_fields(raw, body, fields)

    def once(pairs: list[tuple[str, object]]) -> dict[str, object]:
        assert len({k for k, _ in pairs}) == len(pairs), pairs  # no key twice
        return dict(pairs)

    assert json.loads(sent, object_pairs_hook=once) == {**body, **fields}
