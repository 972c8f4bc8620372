"""Block keys and the prompt keyer: chaining, extras, event equivalence, and the prefix cache."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvindex.keys as keys_module
from kvindex.keys import (
    KeyExtras,
    PromptKeyer,
    PromptKeys,
    block_key,
    chain_keys,
)
from kvindex.tokenizer import Tokenizer, TokenizerError

REPO = Path(__file__).resolve().parents[1]
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
SYSTEM = "\n".join(
    f"Rule {i}: always check the tool result, cite the file, and never guess a value."
    for i in range(300)
)
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "description": f"Tool number {i} reads and writes report tables.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
    for i in range(20)
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load()


@pytest.fixture(scope="module")
def shared_keyer(tok: Tokenizer) -> PromptKeyer:
    """One keyer reused across hypothesis examples, small enough to evict constantly."""
    return PromptKeyer(tok, 16, cache_bytes=40_000)


def agent_chat(question: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


# ---------------------------------------------------------------------------- block keys

token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=80)
block_sizes = st.integers(1, 8)
extras_values = st.builds(
    KeyExtras,
    lora_name=st.one_of(st.none(), st.sampled_from(["adapter-a", "adapter-b"])),
    cache_salt=st.one_of(st.none(), st.sampled_from(["tenant-1", "tenant-2", "adapter-a"])),
)


@given(ids=token_lists, block_size=block_sizes, extras=extras_values)
def test_chain_keys_chains_block_key_over_full_blocks(
    ids: list[int], block_size: int, extras: KeyExtras
) -> None:
    expected: list[int] = []
    parent: int | None = None
    for i in range(len(ids) // block_size):
        parent = block_key(parent, ids[i * block_size : (i + 1) * block_size], extras.for_block(i))
        expected.append(parent)
    assert chain_keys(ids, block_size, extras) == expected


def test_partial_trailing_block_has_no_key() -> None:
    ids = list(range(40))
    assert len(chain_keys(ids, 16)) == 2
    assert chain_keys(ids, 16) == chain_keys(ids[:32], 16)
    assert chain_keys(ids[:15], 16) == []


@given(
    ids=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=8),
    parent=st.integers(0, 2**64 - 1),
)
def test_root_parent_differs_from_every_real_parent(ids: list[int], parent: int) -> None:
    assert block_key(None, ids, None) != block_key(parent, ids, None)


def test_key_depends_on_the_whole_prefix() -> None:
    ids = list(range(64))
    changed = [999, *ids[1:]]
    assert all(a != b for a, b in zip(chain_keys(ids, 16), chain_keys(changed, 16), strict=True))


def test_keys_are_unsigned_64_bit() -> None:
    assert all(0 <= key < 2**64 for key in chain_keys(list(range(256)), 16))


def test_key_format_is_stable() -> None:
    """Keys may be shared through Redis by gateways of different versions: pin the format."""
    assert chain_keys(list(range(8)), 4, KeyExtras("lora-x", "salt-y")) == [
        12703145684950907557,
        2648510730373313047,
    ]


def test_keys_are_identical_in_another_process(tok: Tokenizer) -> None:
    script = (
        "import json\n"
        "from kvindex.keys import KeyExtras, PromptKeyer, chain_keys\n"
        "from kvindex.tokenizer import Tokenizer\n"
        "ids = chain_keys(list(range(100)), 16, KeyExtras('lora-x', 'salt-y'))\n"
        "chat = PromptKeyer(Tokenizer.load(), 16).chat([{'role': 'user', 'content': 'hi'}] * 9)\n"
        "print(json.dumps([ids, list(chat.keys)]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    here = PromptKeyer(tok, 16).chat([{"role": "user", "content": "hi"}] * 9)
    assert json.loads(out.stdout) == [
        chain_keys(list(range(100)), 16, KeyExtras("lora-x", "salt-y")),
        list(here.keys),
    ]


def test_invalid_block_size_or_index_raises() -> None:
    with pytest.raises(ValueError, match="block_size"):
        chain_keys([1, 2], 0)
    with pytest.raises(ValueError, match="first_block_index"):
        chain_keys([1, 2], 1, first_block_index=-1)


# ---------------------------------------------------------------------------- extras


def test_extras_put_lora_on_every_block_and_salt_on_block_zero() -> None:
    extras = KeyExtras(lora_name="adapter", cache_salt="tenant")
    assert extras.for_block(0) == ("lora", "adapter", "cache_salt", "tenant")
    assert extras.for_block(1) == ("lora", "adapter")
    assert KeyExtras(cache_salt="tenant").for_block(3) is None
    assert KeyExtras().for_block(0) is None


def test_empty_salt_counts_as_no_salt() -> None:
    ids = list(range(64))
    assert chain_keys(ids, 16, KeyExtras(cache_salt="")) == chain_keys(ids, 16)


def test_cache_salt_isolates_keys_from_block_zero_on() -> None:
    ids = list(range(64))
    salted = chain_keys(ids, 16, KeyExtras(cache_salt="tenant-a"))
    other = chain_keys(ids, 16, KeyExtras(cache_salt="tenant-b"))
    plain = chain_keys(ids, 16)
    assert all(a != b != c != a for a, b, c in zip(salted, other, plain, strict=True))
    assert chain_keys(ids, 16, KeyExtras(cache_salt="tenant-a")) == salted


def test_lora_changes_every_key() -> None:
    ids = list(range(64))
    with_lora = chain_keys(ids, 16, KeyExtras(lora_name="adapter"))
    assert all(a != b for a, b in zip(with_lora, chain_keys(ids, 16), strict=True))
    # A LoRA name is not a salt, even when the strings are equal.
    assert with_lora != chain_keys(ids, 16, KeyExtras(cache_salt="adapter"))


@pytest.mark.parametrize(
    ("lora_name", "first_block_extra", "expected"),
    [
        (None, None, KeyExtras()),
        (None, ["tenant"], KeyExtras(cache_salt="tenant")),
        ("adapter", ["adapter"], KeyExtras(lora_name="adapter")),
        ("adapter", ("adapter", "tenant"), KeyExtras("adapter", "tenant")),
        ("same", ["same", "same"], KeyExtras("same", "same")),
        (None, [["mm-hash", 0], "tenant", b"\x01digest"], KeyExtras(cache_salt="tenant")),
        ("adapter", ["adapter", ["mm-hash", 5], b"digest"], KeyExtras(lora_name="adapter")),
    ],
)
def test_from_event_recovers_lora_and_salt(
    lora_name: str | None, first_block_extra: list[Any] | None, expected: KeyExtras
) -> None:
    assert KeyExtras.from_event(lora_name, first_block_extra) == expected


@given(
    ids=st.lists(st.integers(0, 4095), max_size=200),
    cuts=st.lists(st.integers(0, 12), max_size=4),
    extras=extras_values,
)
def test_chain_continued_from_a_parent_equals_one_call(
    ids: list[int], cuts: list[int], extras: KeyExtras
) -> None:
    block_size = 16
    whole = chain_keys(ids, block_size, extras)
    pieces: list[int] = []
    start = 0
    for cut in sorted(set(cuts)):
        end = min(cut * block_size, len(ids))
        if end <= start:
            continue
        parent = pieces[-1] if pieces else None
        pieces += chain_keys(ids[start:end], block_size, extras, parent, len(pieces))
        start = end
    pieces += chain_keys(ids[start:], block_size, extras, pieces[-1] if pieces else None,
                         len(pieces))
    assert pieces == whole


@pytest.mark.parametrize("engine_block", [16, 32, 64])
def test_engine_events_map_to_the_keys_of_the_same_prompt(
    tok: Tokenizer, engine_block: int
) -> None:
    """An engine's BlockStored events, keyed by chaining over their token ids, give exactly the
    keys the gateway computed for the request (index block 16 dividing the engine's)."""
    extras = KeyExtras(lora_name="adapter", cache_salt="tenant")
    prompt = PromptKeyer(tok, 16).chat(agent_chat("Where is the Q3 report?"), extras=extras)
    ids = list(prompt.token_ids)
    engine_blocks = len(ids) // engine_block
    assert engine_blocks >= 4
    # vLLM: extra keys untagged, the LoRA name on every block, the salt on block 0 only.
    event_extra: list[list[Any]] = [["adapter", "tenant"]] + [["adapter"]] * (engine_blocks - 1)
    event_extras = KeyExtras.from_event("adapter", event_extra[0])
    assert event_extras == extras
    split = engine_blocks // 3
    mapped: list[int] = []
    for first, end in [(0, split), (split, engine_blocks)]:
        tokens = ids[first * engine_block : end * engine_block]
        parent = mapped[-1] if mapped else None
        mapped += chain_keys(tokens, 16, event_extras, parent, len(mapped))
    assert mapped == list(prompt.keys[: len(mapped)])
    assert len(mapped) == engine_blocks * engine_block // 16


# ---------------------------------------------------------------------------- prompt keyer

FRAGMENTS = [
    *SPECIALS,
    "<|im_",
    "|>",
    "<",
    "\n",
    "\n\n",
    " ",
    "   ",
    "\t",
    "\r\n",
    "é",
    "🙂",
    "中文",
    "<tool_call>",
]
texts = st.lists(
    st.one_of(st.text(max_size=12), st.sampled_from(FRAGMENTS)), max_size=8
).map("".join)
tool_defs = st.lists(
    st.builds(
        lambda name, description, param: {
            "type": "function",
            "function": {
                "name": name,
                "description": description,
                "parameters": {"type": "object", "properties": {param: {"type": "string"}}},
            },
        },
        st.text(min_size=1, max_size=8),
        texts,
        st.text(max_size=6),
    ),
    max_size=3,
)
tool_calls = st.lists(
    st.builds(
        lambda name, args: {"type": "function", "function": {"name": name, "arguments": args}},
        st.text(min_size=1, max_size=6),
        st.one_of(
            st.dictionaries(st.text(max_size=4), texts, max_size=2),
            st.just('{"city": "Oslo"}'),
            st.just("{broken"),
        ),
    ),
    min_size=1,
    max_size=2,
)
contents = st.one_of(
    texts,
    st.none(),
    st.lists(st.builds(lambda t: {"type": "text", "text": t}, texts), max_size=2),
)
messages_st = st.lists(
    st.one_of(
        st.builds(lambda r, c: {"role": r, "content": c},
                  st.sampled_from(["system", "developer", "user", "tool"]), contents),
        st.builds(lambda c, calls: {"role": "assistant", "content": c, "tool_calls": calls},
                  contents, st.one_of(st.none(), tool_calls)),
    ),
    min_size=1,
    max_size=5,
)
keyer_extras = st.sampled_from([KeyExtras(), KeyExtras(cache_salt="t"), KeyExtras("lora", "t")])


def test_shipped_tokenizer_is_keyed_piecewise(shared_keyer: PromptKeyer) -> None:
    """Otherwise the property tests below would only exercise the whole-text fallback."""
    assert shared_keyer.piecewise


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    messages=messages_st,
    tools=st.one_of(st.none(), tool_defs),
    more=messages_st,
    extras=keyer_extras,
    generation=st.booleans(),
)
def test_chat_ids_and_keys_equal_whole_prompt_tokenisation(
    tok: Tokenizer,
    shared_keyer: PromptKeyer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    more: list[dict[str, Any]],
    extras: KeyExtras,
    generation: bool,
) -> None:
    # The longer conversation reuses the shorter one's cached prefix, partially or fully.
    for chat in (messages, messages + more, messages):
        got = shared_keyer.chat(chat, tools=tools, extras=extras, add_generation_prompt=generation)
        ids = tok.encode_chat(chat, tools=tools, add_generation_prompt=generation)
        assert list(got.token_ids) == ids
        assert list(got.keys) == chain_keys(ids, 16, extras)
        assert got.text == tok.render_chat(chat, tools=tools, add_generation_prompt=generation)
    assert shared_keyer.cached_bytes <= shared_keyer.cache_bytes


@settings(max_examples=300, deadline=None)
@given(prompt=texts, more=texts, extras=keyer_extras)
def test_completion_ids_and_keys_equal_whole_prompt_tokenisation(
    tok: Tokenizer, shared_keyer: PromptKeyer, prompt: str, more: str, extras: KeyExtras
) -> None:
    for text in (prompt, prompt + more, prompt):
        got = shared_keyer.completion(text, extras)
        ids = tok.encode_prompt(text)
        assert list(got.token_ids) == ids
        assert list(got.keys) == chain_keys(ids, 16, extras)
        assert got.text == text


def test_token_id_prompt_is_keyed_as_given(tok: Tokenizer) -> None:
    ids = list(range(100, 150))
    got = PromptKeyer(tok, 16).completion(ids, KeyExtras(cache_salt="s"))
    assert got == PromptKeys(tuple(ids), tuple(chain_keys(ids, 16, KeyExtras(cache_salt="s"))), "")
    assert got.num_tokens == 50


@pytest.mark.parametrize("prompt", [[1, -2], [1, 2**32], ["a"], [1.5], b"x"])
def test_invalid_token_id_prompt_raises_tokenizer_error(tok: Tokenizer, prompt: Any) -> None:
    with pytest.raises(TokenizerError, match="token ids"):
        PromptKeyer(tok, 16).completion(prompt)


def test_unrenderable_chat_raises_tokenizer_error(tok: Tokenizer) -> None:
    with pytest.raises(TokenizerError):
        PromptKeyer(tok, 16).chat([{"role": "wizard", "content": "hi"}])


def test_cached_results_equal_uncached_results(tok: Tokenizer) -> None:
    cached = PromptKeyer(tok, 16)
    uncached = PromptKeyer(tok, 16, cache_bytes=0)
    conversation = agent_chat("First question?")
    for turn in range(4):
        for extras in (KeyExtras(), KeyExtras(cache_salt="tenant")):
            warm = cached.chat(conversation, tools=TOOLS, extras=extras)
            assert warm == cached.chat(conversation, tools=TOOLS, extras=extras)
            assert warm == uncached.chat(conversation, tools=TOOLS, extras=extras)
        conversation = [
            *conversation,
            {"role": "assistant", "content": f"Answer {turn}."},
            {"role": "user", "content": f"Follow-up {turn}?"},
        ]
    assert uncached.cached_bytes == 0


def test_calls_that_branch_below_a_shared_prefix_start_from_its_state(tok: Tokenizer) -> None:
    """An agent's calls: the same system prompt and tools, a new question each. The node where
    they leave the cache keeps the state up to it, exactly as long as the prefix, and every
    later call's ids and keys equal an uncached keyer's."""
    cached = PromptKeyer(tok, 16)
    uncached = PromptKeyer(tok, 16, cache_bytes=0)
    for i in range(6):
        chat = agent_chat(f"Question {i}: what changed in release {i}?")
        warm = cached.chat(chat, tools=TOOLS)
        assert warm == uncached.chat(chat, tools=TOOLS)
    lead = uncached.chat(agent_chat("x")[:1], tools=TOOLS, add_generation_prompt=False)
    exact = [node.whole for node in cached._wholes
             if node.whole is not None and node.whole.num_ids == len(node.whole.whole[0])]
    assert any(w.num_ids >= len(lead.token_ids) - 1 and
               w.whole[0] == lead.token_ids[:w.num_ids] and
               w.whole[1] == lead.keys[:w.num_keys] for w in exact), exact


def test_extras_and_generation_prompt_are_part_of_the_cache_key(tok: Tokenizer) -> None:
    keyer = PromptKeyer(tok, 16)
    chat = agent_chat("Hi")
    plain = keyer.chat(chat)
    salted = keyer.chat(chat, extras=KeyExtras(cache_salt="tenant"))
    assert salted.token_ids == plain.token_ids
    assert salted.keys == tuple(chain_keys(plain.token_ids, 16, KeyExtras(cache_salt="tenant")))
    assert salted.keys[0] != plain.keys[0]
    no_prompt = keyer.chat(chat, add_generation_prompt=False)
    assert list(no_prompt.token_ids) == tok.encode_chat(chat, add_generation_prompt=False)
    assert no_prompt.token_ids != plain.token_ids


def test_cache_stays_within_its_byte_budget(tok: Tokenizer) -> None:
    keyer = PromptKeyer(tok, 16, cache_bytes=200_000)
    for i in range(30):
        keyer.chat([{"role": "system", "content": f"Prompt {i}. " + SYSTEM[: 3000 + i]}])
        assert keyer.cached_bytes <= 200_000
    assert keyer.cached_bytes > 0


class _SpyBackend:
    """Forwards to a `tokenizers.Tokenizer`, recording the texts it is asked to encode."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.encoded: list[str] = []

    def encode(self, text: str, *args: Any, **kwargs: Any) -> Any:
        self.encoded.append(text)
        return self._real.encode(text, *args, **kwargs)

    def encode_batch(self, texts: list[str], *args: Any, **kwargs: Any) -> Any:
        self.encoded.extend(texts)
        return self._real.encode_batch(texts, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _SpyHF:
    """An HF tokenizer whose backend is a `_SpyBackend`; everything else is the real one's."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.backend_tokenizer = _SpyBackend(real.backend_tokenizer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@pytest.fixture
def spy_keyer(tok: Tokenizer) -> Iterator[tuple[PromptKeyer, _SpyBackend]]:
    spy = _SpyHF(tok._hf)
    keyer = PromptKeyer(Tokenizer(spy, "spy"), 16)
    yield keyer, spy.backend_tokenizer


def test_warm_call_tokenises_only_the_new_tail(
    tok: Tokenizer, spy_keyer: tuple[PromptKeyer, _SpyBackend]
) -> None:
    keyer, backend = spy_keyer
    backend.encoded.clear()
    keyer.chat(agent_chat("What changed in Q3?"), tools=TOOLS)
    assert any(SYSTEM in text for text in backend.encoded)
    backend.encoded.clear()
    warm = keyer.chat(agent_chat("And in Q4?"), tools=TOOLS)
    assert list(warm.token_ids) == tok.encode_chat(agent_chat("And in Q4?"), tools=TOOLS)
    assert sum(map(len, backend.encoded)) < 40
    assert warm.num_tokens > 5000


def test_warm_call_hashes_only_the_new_tail_blocks(
    tok: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    keyer = PromptKeyer(tok, 16)
    cold = keyer.chat(agent_chat("What changed in Q3?"), tools=TOOLS)
    calls: list[bytes] = []
    real = keys_module.xxh3_64_intdigest

    def counting(data: bytes) -> int:
        calls.append(data)
        return real(data)

    monkeypatch.setattr(keys_module, "xxh3_64_intdigest", counting)
    warm = keyer.chat(agent_chat("And in the fourth quarter of the year?"), tools=TOOLS)
    shared = next(
        i for i, (a, b) in enumerate(zip(cold.token_ids, warm.token_ids, strict=False)) if a != b
    )
    assert len(warm.keys) > 300
    assert len(calls) <= (warm.num_tokens - shared) // 16 + 2


def _tiny_tokenizer(prepend_scheme: str, rstrip: bool = False) -> Tokenizer:
    """A word-level Metaspace tokenizer with separator token `<sep>` and BOS `<s>`."""
    from tokenizers import AddedToken, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<s>": 1, "<sep>": 2, "▁a": 3, "a": 4, "▁b": 5, "b": 6, "▁": 7}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=prepend_scheme)
    raw.add_special_tokens(["<s>", AddedToken("<sep>", rstrip=rstrip)])
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>")
    return Tokenizer(hf, f"metaspace-{prepend_scheme}")


@pytest.mark.parametrize(
    ("tokenizer_args", "piecewise"),
    [(("always",), True), (("first",), False), (("always", True), False)],
    ids=["independent-pieces", "first-piece-differs", "token-strips-neighbour"],
)
def test_tokenizers_that_break_piecewise_encoding_fall_back_to_whole_text(
    tokenizer_args: tuple[Any, ...], piecewise: bool
) -> None:
    tokenizer = _tiny_tokenizer(*tokenizer_args)
    keyer = PromptKeyer(tokenizer, 2)
    assert keyer.piecewise is piecewise
    for text in ("a<sep>b a", "b <sep> a<sep>", "a<sep>b a", ""):
        got = keyer.completion(text)
        assert list(got.token_ids) == tokenizer.encode_prompt(text)
        assert list(got.keys) == chain_keys(got.token_ids, 2)


@settings(max_examples=60, deadline=None)
@given(turns=st.lists(
    st.tuples(st.integers(0, 3), st.lists(st.integers(1, 40), min_size=1, max_size=5)),
    min_size=1, max_size=8))
def test_conversation_turns_as_pieces_get_the_whole_prompts_ids_and_keys(
    tok: Tokenizer, turns: list[tuple[int, list[int]]]
) -> None:
    """Each turn drops some of the previous prompt's last pieces and adds new ones (of any
    length, so blocks straddle pieces): the keyer's copy of the earlier state must still give
    the ids and keys of the whole prompt, also when it jumps to a recent prompt the new one
    extends (short prompts too, here)."""
    jump, keys_module._JUMP_MIN_SEGMENTS = keys_module._JUMP_MIN_SEGMENTS, 1
    try:
        _check_turns(tok, turns)
    finally:
        keys_module._JUMP_MIN_SEGMENTS = jump


def _check_turns(tok: Tokenizer, turns: list[tuple[int, list[int]]]) -> None:
    keyer = PromptKeyer(tok, 16)
    pieces: list[tuple[str, list[int]]] = []
    made = itertools.count()
    seen: list[list[tuple[str, list[int]]]] = []
    for drop, lengths in turns:
        del pieces[max(0, len(pieces) - drop):]
        for n in lengths:
            i = next(made)
            pieces.append((f"p{i}", [1000 * i + t for t in range(n)]))
        seen.append(list(pieces))
        got = keyer.pieces(pieces)
        ids = [t for _, piece in pieces for t in piece]
        assert list(got.token_ids) == ids
        assert list(got.keys) == chain_keys(ids, 16)
    # Back to every earlier branch (the tree the turns built must still be right), and each
    # prompt's first piece followed by its last (which only a wrongly attached node matches).
    for prompt in [*seen, *reversed(seen), *([p[0], p[-1]] for p in seen if len(p) > 2)]:
        got = keyer.pieces(prompt)
        ids = [t for _, piece in prompt for t in piece]
        assert list(got.token_ids) == ids
        assert list(got.keys) == chain_keys(ids, 16)
