"""`usage_of` reads an answer's `usage` from the tail when it is the answer's own, and the whole
answer otherwise: the same result as decoding it whole, for answers of every shape."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.tracing import usage_of

USAGE = {"prompt_tokens": 12, "total_tokens": 16, "completion_tokens": 4,
         "prompt_tokens_details": None}


def whole(answer: bytes) -> Any:
    """What decoding the whole answer gives."""
    try:
        doc = json.loads(answer)
    except ValueError:
        return None
    usage = doc.get("usage") if isinstance(doc, dict) else None
    return usage if isinstance(usage, dict) else None


def test_vllm_answer() -> None:
    answer = json.dumps({
        "id": "chatcmpl-1", "object": "chat.completion", "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": 'say "usage": {}'},
                     "finish_reason": "length"}],
        "usage": USAGE, "prompt_logprobs": None, "kv_transfer_params": None}).encode()
    assert usage_of(answer) == USAGE


def test_a_nested_usage_is_not_the_answers() -> None:
    # The last `"usage":` belongs to a nested object: the answer's own one comes first.
    answer = json.dumps({"usage": USAGE, "extra": {"usage": {"prompt_tokens": 1}}}).encode()
    assert usage_of(answer) == USAGE
    answer = json.dumps({"usage": USAGE, "extra": {"usage": {"x": 1}, "y": 2}}).encode()
    assert usage_of(answer) == USAGE
    answer = json.dumps({"choices": [{"usage": {"x": 1}}]}).encode()
    assert usage_of(answer) is None


def test_not_an_object_or_not_json() -> None:
    assert usage_of(b'{"usage": 3}') is None
    assert usage_of(b'{"usage": {"a": 1}') is None
    assert usage_of(b'[{"usage": {"a": 1}}]') is None
    assert usage_of(b"") is None
    assert usage_of(None) is None
    assert usage_of(b'{"usage":\xff}') is None


leaves = st.none() | st.booleans() | st.integers() | st.text(max_size=8)
values = st.recursive(
    leaves,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["usage", "a", "choices", "b"]), inner, max_size=3),
    max_leaves=10)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["usage", "id", "choices", "x"]), values, max_size=4),
       st.booleans())
def test_same_as_decoding_whole(doc: dict[str, Any], compact: bool) -> None:
    answer = json.dumps(doc, separators=(",", ":") if compact else None).encode()
    assert usage_of(answer) == whole(answer)
