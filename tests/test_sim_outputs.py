"""The simulated engine answers what a request asks of its output as vLLM 0.32 does, read with
the official `openai` client: stop strings and stop token ids, logprobs, a required or named
tool call and `response_format` (structured output), `echo`, continuous usage, and the 400s
vLLM answers for out-of-range sampling fields. Each used to be ignored (a 200 without it)."""

from __future__ import annotations

import json

import openai
import pytest

from kvgate.procs import Child
from tests.conftest import MODEL

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "required": ["city", "days"], "properties": {
        "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1},
        "unit": {"type": "string", "enum": ["C", "F"]}}}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "properties": {
        "q": {"type": "string"}}, "required": ["q"]}}}
ASK = [{"role": "user", "content": "Tell me about the weather in Paris this week."}]


@pytest.fixture(scope="module")
def client(sims: list[Child]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{sims[0].url}/v1", api_key="x", max_retries=0)


def test_a_stop_string_ends_the_answer_before_it(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12,
                                          extra_body={"ignore_eos": True})
    text = full.choices[0].message.content or ""
    words = text.split(" ")
    stop = " " + words[3]
    cut = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, stop=[stop],
                                         extra_body={"ignore_eos": True})
    choice = cut.choices[0]
    assert choice.message.content == text[:text.index(stop)]
    assert choice.finish_reason == "stop"
    assert choice.model_extra is not None and choice.model_extra["stop_reason"] == stop
    assert cut.usage is not None and cut.usage.completion_tokens < 12
    kept = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=12, stop=stop,
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].message.content == text[:text.index(stop) + len(stop)]
    # Streamed, the same text arrives, never a piece of the stop string.
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=12, stop=[stop], stream=True,
        extra_body={"ignore_eos": True}) if c.choices]
    assert "".join(pieces) == choice.message.content
    with pytest.raises(openai.BadRequestError, match="stop"):
        client.chat.completions.create(model=MODEL, messages=ASK, extra_body={"stop": 5})


def test_a_stop_token_id_ends_the_answer_and_is_its_stop_reason(
        client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    stop_id = _third_token(client, full.choices[0].text)
    cut = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10,
                                    extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].model_extra is not None
    assert cut.choices[0].model_extra["stop_reason"] == stop_id
    assert cut.usage is not None and cut.usage.completion_tokens == 3
    assert full.choices[0].text.startswith(cut.choices[0].text)


def _third_token(client: openai.OpenAI, text: str) -> int:
    # The sim's tokenizer endpoint, as vLLM's /tokenize.
    import urllib.request

    base = str(client.base_url).removesuffix("/v1/")
    req = urllib.request.Request(f"{base}/tokenize", method="POST", data=json.dumps(
        {"model": MODEL, "prompt": text, "add_special_tokens": False}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return int(json.load(r)["tokens"][2])


def test_logprobs_come_back_for_every_token_in_openais_shape(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6,
                                            logprobs=True, top_logprobs=3,
                                            extra_body={"ignore_eos": True})
    content = answer.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 6
    assert "".join(c.token for c in content) == answer.choices[0].message.content
    for c in content:
        assert c.logprob <= 0 and len(c.top_logprobs) == 3
        assert c.top_logprobs[0].token == c.token  # greedy: the sampled token is the likeliest
        assert [t.logprob for t in c.top_logprobs] == sorted(
            (t.logprob for t in c.top_logprobs), reverse=True)
    streamed = [c for c in client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=6, logprobs=True, top_logprobs=3, stream=True,
        extra_body={"ignore_eos": True}) if c.choices and c.choices[0].logprobs]
    assert [e.logprob for c in streamed for e in c.choices[0].logprobs.content or []] == [
        c.logprob for c in content]
    done = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4,
                                     logprobs=2, extra_body={"ignore_eos": True})
    lp = done.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 4
    assert "".join(lp.tokens) == done.choices[0].text
    assert lp.top_logprobs is not None and all(len(t) == 2 for t in lp.top_logprobs)
    with pytest.raises(openai.BadRequestError, match="`logprobs` must be set to true"):
        client.chat.completions.create(model=MODEL, messages=ASK, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="greater than max allowed"):
        client.chat.completions.create(model=MODEL, messages=ASK, logprobs=True,
                                       top_logprobs=21)


def test_a_required_or_named_tool_call_is_made_with_arguments_its_schema_accepts(
        client: openai.OpenAI) -> None:
    named = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, SEARCH],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    args = json.loads(call.function.arguments)  # type: ignore[union-attr]
    assert isinstance(args["city"], str) and isinstance(args["days"], int) and args["days"] >= 1
    assert choice.finish_reason == "stop"  # a named tool finishes with stop, as OpenAI's
    # The arguments are what the model generated: they are its output tokens.
    assert named.usage is not None and named.usage.completion_tokens > 3
    required = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, SEARCH],  # type: ignore[list-item]
        tool_choice="required")
    assert required.choices[0].finish_reason == "tool_calls"
    (call,) = required.choices[0].message.tool_calls or []
    assert call.function.name in ("get_weather", "search")  # type: ignore[union-attr]
    json.loads(call.function.arguments)  # type: ignore[union-attr]
    # Streamed: the call's id and name first, then its arguments.
    chunks = [c for c in client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], stream=True,  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}}) if c.choices]
    calls = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert calls[0].function is not None and calls[0].function.name == "get_weather"
    streamed = "".join((d.function.arguments or "") for d in calls if d.function)
    assert json.loads(streamed).keys() >= {"city", "days"}
    with pytest.raises(openai.BadRequestError, match="has not been passed"):
        client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[SEARCH],  # type: ignore[list-item]
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    with pytest.raises(openai.BadRequestError, match="must not be an empty array"):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[])


def test_response_format_gives_json_that_its_schema_accepts(client: openai.OpenAI) -> None:
    schema = {"type": "object", "required": ["name", "tags", "score"], "properties": {
        "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
        "score": {"type": "number", "minimum": 0, "maximum": 1}}}
    answer = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format={  # type: ignore[arg-type]
            "type": "json_schema", "json_schema": {"name": "card", "schema": schema}})
    data = json.loads(answer.choices[0].message.content or "")
    assert isinstance(data["name"], str) and all(isinstance(t, str) for t in data["tags"])
    assert 0 <= data["score"] <= 1
    plain = client.chat.completions.create(model=MODEL, messages=ASK,
                                           response_format={"type": "json_object"})
    assert isinstance(json.loads(plain.choices[0].message.content or ""), dict)


def test_echo_continuous_usage_and_sampling_ranges(client: openai.OpenAI) -> None:
    echoed = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3,
                                       echo=True)
    assert echoed.choices[0].text.startswith("Once upon a time")
    usage = [c.usage for c in client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=4, stream=True,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True})]  # type: ignore[typeddict-unknown-key]
    assert all(u is not None for u in usage)
    assert [u.completion_tokens for u in usage if u is not None][-1] == 4
    # vLLM's SamplingParams._verify_args: its words, and its parameter where it names one.
    for field, value, param in (("temperature", -1, "temperature"),
                                ("temperature", 2.5, "temperature"),
                                ("top_p", 0, "top_p"), ("presence_penalty", 3, None),
                                ("repetition_penalty", 0, None), ("min_p", 2, None),
                                ("top_k", -2, None)):
        with pytest.raises(openai.BadRequestError, match=field) as e:
            client.chat.completions.create(model=MODEL, messages=ASK,
                                           extra_body={field: value})
        assert e.value.body["param"] == param  # type: ignore[index]
    for fine in ({"top_k": 0}, {"top_k": -1}, {"temperature": 2}):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1,
                                       extra_body=fine)
    with pytest.raises(openai.BadRequestError, match="empty string"):
        client.chat.completions.create(model=MODEL, messages=ASK, stop=["a", ""])
    # vLLM's `priority` is a lax integer field: "3", 3.0 and True are integers, "x" is not.
    for lax in ("3", 3.0, True):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1,
                                       extra_body={"priority": lax})
    with pytest.raises(openai.BadRequestError, match="priority"):
        client.chat.completions.create(model=MODEL, messages=ASK, extra_body={"priority": "x"})
    # An empty model name stands for the served model, as vLLM reads it.
    assert client.chat.completions.create(model="", messages=ASK, max_tokens=2).model == MODEL


def test_structured_output_follows_refs_and_bounds_and_stays_small(
        client: openai.OpenAI) -> None:
    import time

    # What pydantic (and `openai`'s `.parse()`) send for nested models: `$ref`s to `$defs`.
    schema = {"$defs": {"City": {"type": "object", "required": ["name"],
                                 "properties": {"name": {"type": "string"}}}},
              "type": "object", "required": ["city", "n", "id"], "properties": {
                  "city": {"$ref": "#/$defs/City"},
                  "n": {"type": "integer", "exclusiveMinimum": 0, "maximum": 3},
                  "huge": {"type": "array", "minItems": 3_000_000, "items": {"type": "string"},
                           "description": "left out: not required"}}}
    answer = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format={  # type: ignore[arg-type]
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    data = json.loads(answer.choices[0].message.content or "")
    assert isinstance(data["city"]["name"], str) and 0 < data["n"] <= 3
    assert "id" in data  # required, though no property says what it is
    # A schema asking millions of items is answered at once, not built on the event loop.
    started = time.monotonic()
    big = {"type": "object", "required": ["xs"], "properties": {
        "xs": {"type": "array", "minItems": 3_000_000, "items": {"type": "string",
                                                                 "minLength": 10**9}}}}
    client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=5, response_format={  # type: ignore[arg-type]
            "type": "json_schema", "json_schema": {"name": "big", "schema": big}})
    assert time.monotonic() - started < 5


def test_streamed_completion_logprob_offsets_are_the_whole_answers(
        client: openai.OpenAI) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "logprobs": 2,
            "echo": True, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**body)  # type: ignore[call-overload]
    parts = [c.choices[0].logprobs for c in client.completions.create(  # type: ignore[call-overload]
        stream=True, **body) if c.choices and c.choices[0].logprobs]
    offsets = [o for p in parts for o in p.text_offset or []]
    assert whole.choices[0].logprobs is not None
    assert offsets == whole.choices[0].logprobs.text_offset
    assert offsets[0] == len("Once upon a time")  # after the echoed prompt
