"""The official `openai` client talks to real simulated engines through a real gateway."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.procs import Child
from tests.conftest import MODEL

SYSTEM = "You are a careful assistant that answers in one short paragraph. " * 8


@pytest.fixture
def client(gateway: Child) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="test-key", max_retries=0,
                         timeout=60)


def test_models_lists_the_pool_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_chat_completion_returns_text_usage_and_serving_engine(
    client: openai.OpenAI, sims: list[Child]
) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=5,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}],
        extra_body={"ignore_eos": True},
    )
    resp = raw.parse()
    assert resp.choices[0].finish_reason == "length"
    assert resp.choices[0].message.content
    assert resp.usage is not None and resp.usage.completion_tokens == 5
    assert resp.usage.prompt_tokens > 100
    engine = raw.headers["x-kvgate-engine"]
    assert engine in {s.url.removeprefix("http://") for s in sims}


def test_chat_stream_arrives_in_chunks_with_final_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, max_tokens=6, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Count to six."}],
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    choices = [c.choices[0] for c in chunks if c.choices]
    content = [c.delta.content for c in choices if c.delta.content]
    assert len(content) == 6
    finish = [c.finish_reason for c in choices if c.finish_reason]
    assert finish == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


def test_completion_with_token_id_prompt(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt=list(range(10, 90)), max_tokens=3,
                                      extra_body={"ignore_eos": True})
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == 80
    assert resp.usage.completion_tokens == 3
    assert resp.choices[0].finish_reason == "length"


def test_completion_stream(client: openai.OpenAI) -> None:
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4,
                                       stream=True, extra_body={"ignore_eos": True})
    texts = [c.choices[0].text for c in stream if c.choices]
    assert len(texts) == 4 and all(texts)


def test_min_tokens_and_eos_are_honoured(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL, max_tokens=200, messages=[{"role": "user", "content": "Say something."}],
        extra_body={"min_tokens": 150},
    )
    assert resp.usage is not None and resp.usage.completion_tokens >= 150


def test_repeated_prefix_hits_the_engine_cache(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": SYSTEM * 2}, {"role": "user", "content": "Q1"}]
    first = client.chat.completions.with_raw_response.create(model=MODEL, max_tokens=1,
                                                             messages=messages)
    second = client.chat.completions.with_raw_response.create(model=MODEL, max_tokens=1,
                                                              messages=messages)
    if first.headers["x-kvgate-engine"] != second.headers["x-kvgate-engine"]:
        second = client.chat.completions.with_raw_response.create(model=MODEL, max_tokens=1,
                                                                  messages=messages)
    usage = second.parse().usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens
    assert usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 16


def test_unknown_model_is_a_404_in_openai_shape(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=[
            {"role": "user", "content": "hi"}])
    assert "no-such-model" in str(info.value)
    assert info.value.code == "model_not_found"


def test_engine_validation_errors_are_relayed_with_their_status(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=10_000_000)
    assert "cannot be greater than max_model_len" in str(info.value)


def test_gateway_health_and_metrics(gateway: Child, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="warm", max_tokens=1)
    with urllib.request.urlopen(f"{gateway.url}/health") as r:
        health = json.load(r)
    assert health["status"] == "ok" and all(health["engines"].values())
    with urllib.request.urlopen(f"{gateway.url}/metrics") as r:
        text = r.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["kvgate_requests"].type == "counter"
    served = [s for s in families["kvgate_requests"].samples
              if s.name == "kvgate_requests_total" and s.labels["status"] == "200"]
    assert sum(s.value for s in served) >= 1
    assert families["kvgate_engine_healthy"].type == "gauge"
