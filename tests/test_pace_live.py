"""Paced prefill in the live gateway: in front of one real simulated engine with a sequence
decoding, a long prompt is computed in free pieces (warm-ups the gateway sends to the engine)
before the request itself goes out; read from the gateway's and the engine's own `/metrics`
and the answer's `usage`, with the official `openai` client."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml

from kvgate.procs import Child, free_port, spawn, wait_healthy
from tests.conftest import MODEL
from tests.test_kv_moves_live import metrics


def start(logs: Path, policy: str) -> tuple[Child, Child]:
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
        "engines": [{"url": sim.url}]}))
    gateway = spawn(f"gateway-{policy}", ["serve", "--config", str(path)],
                    f"http://127.0.0.1:{port}", logs)
    try:
        wait_healthy(gateway)
    except Exception:
        sim.stop()
        raise
    return sim, gateway


@pytest.fixture(scope="module", params=["kvgate", "kvgate-no-pace"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[str, dict[tuple[str, tuple[tuple[str, str], ...]], float],
                               dict[tuple[str, tuple[tuple[str, str], ...]], float], int]]:
    """A long prompt sent while another call decodes, through a gateway running `policy`:
    the gateway's and the engine's metrics afterwards, and the prompt's cached tokens."""
    policy = request.param
    sim, gateway = start(tmp_path_factory.mktemp("pace-live"), policy)
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
        answer = client.chat.completions.create(
            model=MODEL, max_tokens=4, extra_body={"ignore_eos": True},
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
    if policy == "kvgate":
        assert pieces >= 2 and paced == 1
        assert requests == 2 + pieces
        # The call found its pieces in the engine's own prefix cache: computed ahead, in steps
        # beside the decode.
        assert cached >= 1000
    else:
        assert pieces == 0 and paced == 0 and requests == 2 and cached == 0
