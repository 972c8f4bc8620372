"""The virtual driver keys a trace prompt in chunks of its blocks (`CHUNK_BLOCKS`): the same ids
and keys as one piece per block, whatever the keyer has cached from either way of keying."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.bench.prompts import Piece
from kvgate.bench.virtual import CHUNK_BLOCKS, _chunked
from kvindex.keys import KeyExtras, PromptKeyer
from kvindex.tokenizer import Tokenizer

BLOCK = 4


def block(name: int, size: int = BLOCK) -> Piece:
    rng = random.Random(name * 7919 + size)
    return Piece(f"b{name}/{size}", tuple(rng.randrange(1, 4000) for _ in range(size)), "")


def per_block(keyer: PromptKeyer, pieces: list[Piece], extras: KeyExtras
              ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    k = keyer.named([p.key for p in pieces], [p.ids for p in pieces], extras)
    return k.token_ids, k.keys


def chunked(keyer: PromptKeyer, pieces: list[Piece], extras: KeyExtras
            ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    k = keyer.named(*_chunked(pieces), extras)
    return k.token_ids, k.keys


@settings(max_examples=40, deadline=None)
@given(turns=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2 * CHUNK_BLOCKS + 5),
                                st.booleans(), st.integers(1, BLOCK + 3)),
                      min_size=1, max_size=6),
       salted=st.booleans(), cache_bytes=st.sampled_from([0, 20_000, 64 * 1024 * 1024]))
def test_chunked_keys_equal_per_block_keys(turns: list[tuple[int, int, bool, int]],
                                           salted: bool, cache_bytes: int) -> None:
    """Conversations that grow, fork back to an earlier length and end in a short tail block:
    a keyer that sees chunks, one that sees blocks, and one that sees both in turn agree."""
    tok = Tokenizer.load()
    extras = KeyExtras(cache_salt="t" if salted else None)
    by_chunk, by_block, both = (PromptKeyer(tok, BLOCK, cache_bytes) for _ in range(3))
    prompt: list[Piece] = []
    for i, (back, grow, tail, tail_len) in enumerate(turns):
        prompt = prompt[: max(0, len(prompt) - back * CHUNK_BLOCKS // 2)]
        prompt += [block(1000 * i + j) for j in range(grow)]
        pieces = [*prompt, block(-i, tail_len)] if tail else list(prompt)
        expected = per_block(by_block, pieces, extras)
        assert sum(len(p.ids) for p in pieces) == len(expected[0])
        assert chunked(by_chunk, pieces, extras) == expected
        mixed = chunked(both, pieces, extras) if i % 2 else per_block(both, pieces, extras)
        assert mixed == expected


def test_chunk_ids_are_made_on_demand_and_index_like_a_list() -> None:
    pieces = [block(j) for j in range(2 * CHUNK_BLOCKS + 3)]
    names, ids = _chunked(pieces)
    assert len(names) == len(ids) == 3
    assert names[2] == "|".join(p.key for p in pieces[2 * CHUNK_BLOCKS:])
    whole = [list(p.ids) for p in pieces]
    for i in range(3):
        expected = tuple(t for ids_ in whole[i * CHUNK_BLOCKS:(i + 1) * CHUNK_BLOCKS]
                         for t in ids_)
        assert ids[i] == expected == ids[i - 3]
    assert ids[1:] == [ids[1], ids[2]]
    assert ids[5:] == []
    with pytest.raises(IndexError):
        ids[3]
    with pytest.raises(IndexError):
        ids[-4]
