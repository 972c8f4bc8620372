"""Tests for the shipped tiny tokenizer and the kvindex.tokenizer wrapper."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvgate.assets.tiny_tokenizer import TOKENIZER_DIR
from kvindex.tokenizer import Tokenizer, TokenizerError

SYSTEM = (
    "You are a meticulous research agent. Think step by step, cite the documents you use, "
    "and prefer calling tools over guessing. " * 8
)
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "search_documents",
            "description": "Search the document index and return the best matches.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "Free-text query."},
                    "top_k": {"type": "integer", "description": "How many hits to return."},
                },
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city (°C).",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load()


def test_shipped_files_present() -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (TOKENIZER_DIR / name).is_file()
    assert (TOKENIZER_DIR / "tokenizer.json").stat().st_size < 400_000
    config = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["chat_template"].startswith("{%- macro")
    assert config["model_max_length"] == 32768


def test_load_offline_and_cached(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert Tokenizer.load() is tok
    assert Tokenizer.load(TOKENIZER_DIR) is tok
    assert Tokenizer.load(str(TOKENIZER_DIR)) is tok
    assert tok.name_or_path == str(TOKENIZER_DIR.resolve())


def test_metadata(tok: Tokenizer) -> None:
    assert tok.vocab_size == 4096
    assert tok.bos_token_id == 0
    assert tok.eos_token_id == 3
    assert tok.special_ids == frozenset({0, 1, 2, 3})
    assert tok.encode("<|begin_of_text|><|end_of_text|><|im_start|><|im_end|>") == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "text",
    [
        "Hello world! The prefix cache hit rate is 97.5% today.",
        "def f(x):\n    return {'a': [1, 2, 3]}\n",
        "Café crème brûlée — naïve façade; Zürich 2024.",
        "你好，世界！ こんにちは 안녕하세요 Привет 🙂🚀 ∞",
        "  leading and trailing spaces  \n\n\ttabs\r\n",
        "",
    ],
)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode_prompt(text)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>" + text
    assert tok.encode(text) == ids[1:]
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_encode_prompt_is_deterministic_and_compresses(tok: Tokenizer) -> None:
    text = "The user asked the assistant to search the documents for the latest report. " * 20
    ids = tok.encode_prompt(text)
    assert ids == tok.encode_prompt(text)
    assert len(ids) < len(text.encode()) / 3


def test_render_chat_with_tools(tok: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
    ]
    text = tok.render_chat(messages, tools=TOOLS)
    assert text.startswith("<|begin_of_text|><|im_start|>system\nBe brief.\n\n# Tools\n")
    for tool in TOOLS:
        assert json.dumps(tool, ensure_ascii=False) in text
    assert "<|im_start|>user\nWeather in Paris?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert text.count("<|im_start|>system") == 1

    no_prompt = tok.render_chat(messages, tools=TOOLS, add_generation_prompt=False)
    assert no_prompt.endswith("<|im_end|>\n")
    assert no_prompt + "<|im_start|>assistant\n" == text


def test_render_chat_exact_without_tools(tok: Tokenizer) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "c"},
        {"role": "user", "content": "d"},
    ]
    assert tok.render_chat(messages) == (
        "<|begin_of_text|>"
        "<|im_start|>system\nS<|im_end|>\n"
        "<|im_start|>user\na\nb<|im_end|>\n"
        "<|im_start|>assistant\nc<|im_end|>\n"
        "<|im_start|>user\nd<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_tools_render_canonically(tok: Tokenizer) -> None:
    """A raw request tool and vLLM's pydantic model_dump() of it render identically."""
    msgs = [{"role": "user", "content": "hi"}]
    raw = [{"function": {"name": "ping", "strict": True}, "type": "function"}]
    dumped = [
        {
            "type": "function",
            "function": {"name": "ping", "description": None, "parameters": None, "strict": True},
        }
    ]
    text = tok.render_chat(msgs, tools=raw)
    assert text == tok.render_chat(msgs, tools=dumped)
    assert '{"type": "function", "function": {"name": "ping"}}\n' in text


def test_tool_calls_and_tool_results(tok: Tokenizer) -> None:
    as_string: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    ]
    as_dict = json.loads(json.dumps(as_string))
    as_dict[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    text = tok.render_chat(as_string, tools=TOOLS)
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>\n' in text
    )
    assert '<|im_start|>tool\n{"temp_c": 21}<|im_end|>\n' in text
    # vLLM parses the OpenAI JSON-string arguments into a dict before rendering.
    assert text == tok.render_chat(as_dict, tools=TOOLS)
    # The caller's messages are not mutated.
    assert as_string[1]["tool_calls"][0]["function"]["arguments"] == '{"city":"Paris"}'


def test_invalid_tool_call_arguments_become_empty_object(tok: Tokenizer) -> None:
    msgs: list[dict[str, Any]] = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "content": "Calling.",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{oops"}}],
        },
    ]
    text = tok.render_chat(msgs, add_generation_prompt=False)
    assert text.endswith(
        'Calling.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>\n'
    )


def test_encode_chat(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    ids = tok.encode_chat(messages)
    im_start = tok.encode("<|im_start|>")
    assert im_start == [2]
    assert ids[0] == tok.bos_token_id
    assert ids[1] == 2
    assert ids.count(tok.bos_token_id) == 1  # the template's BOS, not a second one
    assert ids == tok.encode(tok.render_chat(messages))
    assert tok.decode(ids, skip_special_tokens=False) == tok.render_chat(messages)


def test_shared_system_prompt_gives_shared_prefix(tok: Tokenizer) -> None:
    system = {"role": "system", "content": SYSTEM}
    chat_a = [system, {"role": "user", "content": "Find the Q3 revenue report."}]
    chat_b = [system, {"role": "user", "content": "What's the weather in Oslo?"}]
    ids_a = tok.encode_chat(chat_a, tools=TOOLS)
    ids_b = tok.encode_chat(chat_b, tools=TOOLS)

    # Everything up to and including the system block's <|im_end|>\n is shared.
    system_block = tok.render_chat([system], tools=TOOLS, add_generation_prompt=False)
    n = len(tok.encode(system_block))
    assert n > 100
    assert ids_a[:n] == ids_b[:n]
    shared = 0
    while ids_a[shared] == ids_b[shared]:
        shared += 1
    assert shared >= n
    # The same prefix also holds when the conversation grows (agent loop turn 2).
    turn2 = [
        *chat_a,
        {"role": "assistant", "content": "Searching."},
        {"role": "user", "content": "Thanks"},
    ]
    ids_a2 = tok.encode_chat(turn2, tools=TOOLS)
    prefix_len = len(tok.encode_chat(chat_a, tools=TOOLS, add_generation_prompt=False))
    assert ids_a2[:prefix_len] == ids_a[:prefix_len]


def test_none_content_renders_as_empty(tok: Tokenizer) -> None:
    """Like vLLM, content None (or missing) without tool_calls renders as empty content."""
    with_none = tok.render_chat([{"role": "user", "content": None}], add_generation_prompt=False)
    missing = tok.render_chat([{"role": "user"}], add_generation_prompt=False)
    assert with_none == missing == "<|begin_of_text|><|im_start|>user\n<|im_end|>\n"
    assistant = tok.render_chat(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}],
        add_generation_prompt=False,
    )
    assert assistant.endswith("<|im_start|>assistant\n<|im_end|>\n")


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty"),
        ([{"role": "wizard", "content": "hi"}], "Unsupported message role"),
        ([{"content": "no role"}], "role must be a string"),
        (["not a dict"], "must be an object"),
        ([{"role": "user", "content": {"text": "dict content"}}], "must be a string"),
        ([{"role": "user", "content": 42}], "must be a string"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "unsupported type 'image_url'",
        ),
        (
            [{"role": "assistant", "content": None, "tool_calls": [{"type": "retrieval"}]}],
            "type 'function'",
        ),
        ([{"role": "assistant", "content": "x", "tool_calls": "nope"}], "must be a list"),
    ],
)
def test_bad_input_raises_tokenizer_error(
    tok: Tokenizer, messages: list[dict[str, Any]], match: str
) -> None:
    with pytest.raises(TokenizerError, match=match):
        tok.encode_chat(messages)


def test_bad_tools_raise_tokenizer_error(tok: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(TokenizerError, match="string name"):
        tok.render_chat(msgs, tools=[{"type": "function", "function": {"description": "x"}}])
    with pytest.raises(TokenizerError, match=r"(?i)tool"):  # transformers rejects these itself
        tok.render_chat(msgs, tools=["search"])  # type: ignore[list-item]
    with pytest.raises(TokenizerError, match="list of tool definitions"):
        tok.render_chat(msgs, tools={"name": "x"})  # type: ignore[arg-type]
    assert issubclass(TokenizerError, ValueError)


def test_matches_autotokenizer_directly(tok: Tokenizer) -> None:
    """The wrapper is exactly what vLLM does with AutoTokenizer on the same directory."""
    from transformers import AutoTokenizer

    hf: Any = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    text = "Summarise the attached report in three bullet points."
    assert tok.encode_prompt(text) == hf(text, add_special_tokens=True)["input_ids"]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
    rendered = hf.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert tok.render_chat(messages, tools=TOOLS) == rendered
    assert (
        tok.encode_chat(messages, tools=TOOLS)
        == hf(rendered, add_special_tokens=False)["input_ids"]
    )


CONVERSATIONS: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = [
    ([{"role": "user", "content": "Client 0 asks a short question."}], None),
    ([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Find it."}], TOOLS),
    ([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": None}], None),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, "b",
                                   {"type": "text", "text": None}]}], TOOLS[:1]),
    ([{"role": "user", "content": "Weather?", "name": "ann"},
      {"role": "assistant", "content": None, "reasoning": "Look it up.",
       "tool_calls": [{"id": "c1", "type": "function",
                       "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
      {"role": "tool", "tool_call_id": "c1", "content": '{"temp_c": -3}'},
      {"role": "assistant", "content": "Cold.", "tool_calls": []},
      {"role": "user", "content": "héllo 🙂 <|im_start|>"}], TOOLS),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], []),
]


@pytest.mark.parametrize("generation", [True, False])
@pytest.mark.parametrize("template", ["shipped", "named", "reasoning", "tojson"])
def test_direct_render_matches_apply_chat_template(template: str, generation: bool) -> None:
    """The proxy's direct render gives apply_chat_template's text, error for error: the
    shipped template, a tokenizer with named templates (`tool_use` picked when tools are
    given), a template that reads the reasoning aliases transformers fills in, and one that
    calls `tojson` with and without its arguments."""
    from transformers import AutoTokenizer

    hf: Any = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    shipped = hf.chat_template
    if template == "named":
        hf.chat_template = {"default": shipped,
                            "tool_use": "TOOLS {{ tools | tojson }} " + shipped}
    elif template == "tojson":
        hf.chat_template = ("{{ tools | tojson }}|{{ tools | tojson(indent=2) }}|"
                            "{{ messages | tojson(sort_keys=true) }}|"
                            "{{ messages[-1] | tojson(ensure_ascii=true) }}|"
                            "{{ messages[0]['content'] | tojson }}")
    elif template == "reasoning":
        hf.chat_template = ("{% for m in messages %}[{{ m.role }}|{{ m.thinking }}|"
                            "{{ m.reasoning_content }}|{{ m.get('tool_call_id') }}]"
                            "{% endfor %}{{ eos_token }}{{ add_generation_prompt }}")
    fast = Tokenizer(hf, "direct")
    slow = Tokenizer(hf, "apply_chat_template")
    assert fast._direct is not None
    slow._direct = None
    for messages, tools in [*CONVERSATIONS,
                            ([{"role": "wizard", "content": "hi"}], None),
                            ([{"role": "user", "content": "hi"}], [{"function": {}}])]:
        try:
            want: str | type[Exception] = slow.render_chat(
                messages, tools=tools, add_generation_prompt=generation)
        except TokenizerError:
            want = TokenizerError
        if want is TokenizerError:
            with pytest.raises(TokenizerError):
                fast.render_chat(messages, tools=tools, add_generation_prompt=generation)
        else:
            assert fast.render_chat(messages, tools=tools,
                                    add_generation_prompt=generation) == want
    # A template changed after loading is rendered as changed.
    hf.chat_template = "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{% endfor %}"
    chat = CONVERSATIONS[1][0]
    assert fast.render_chat(chat) == slow.render_chat(chat) == "<|begin_of_text|><system><user>"


def test_plain_json_copies_as_transformers_does() -> None:
    """What the direct render hands the template for messages and tools equals transformers'
    copy: the value itself when it holds exact JSON types only, transformers' copy when
    anything else is inside (a subclass, a tuple, an object, a key that is not a string)."""
    import enum
    from decimal import Decimal

    from transformers.utils.chat_template_utils import _plain_template_data

    from kvindex.tokenizer import _plain_json

    class Colour(enum.StrEnum):
        RED = "red"

    plain = _plain_json(_plain_template_data)
    for value in [None, "s", 3, 2.5, True, [], {},
                  {"a": [1, {"b": None, "c": [True, 1.5]}], "d": "x"},
                  [{"nested": [Decimal(1), (1, "t"), Colour.RED]}, {1: "int key"}],
                  {"tools": [{Decimal(3): "a key that is not a string"}]},
                  {"params": {"obj": object(), "tuple": ("a", [Decimal("2")])}}]:
        got, want = plain(value), _plain_template_data(value)
        assert repr(got).split(" at 0x")[0] == repr(want).split(" at 0x")[0]
        assert type(got) is type(want)


TOJSON_TEMPLATE = (
    "{%- if tools %}<tools>{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n"
    "</tools>\n{%- endif %}"
    "{%- for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{%- endif %}")


def test_tools_render_as_vllm_dumps_them_under_a_template_that_prints_them_whole() -> None:
    """vLLM renders `[tool.model_dump() for tool in request.tools]` (0.32's online_renderer):
    the function's name, description and parameters in that order, None where absent,
    `strict` only when set, other keys dropped. Templates that print a tool whole (`tojson`,
    Qwen's and Hermes's) see exactly that; the dumps below are what vLLM 0.32's
    ChatCompletionToolsParam(**tool).model_dump() gave for each request tool."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    hf.chat_template = TOJSON_TEMPLATE
    tok = Tokenizer(hf, "tojson")
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        ({"type": "function", "function": {"name": "run_tests"}},
         {"type": "function", "function": {"name": "run_tests", "description": None,
                                           "parameters": None}}),
        ({"type": "function", "x_tool": 2, "function": {
            "parameters": {"type": "object"}, "name": "f", "description": "d", "x_extra": 1}},
         {"type": "function", "function": {"name": "f", "description": "d",
                                           "parameters": {"type": "object"}}}),
        ({"type": "function", "function": {"name": "g", "strict": True}},
         {"type": "function", "function": {"name": "g", "description": None,
                                           "parameters": None, "strict": True}}),
    ]
    for raw, dumped in cases:
        text = tok.render_chat(msgs, tools=[raw])
        assert text == tok.render_chat(msgs, tools=[dumped]), raw
        assert json.dumps(dumped) in text
