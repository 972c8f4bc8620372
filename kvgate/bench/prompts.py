"""Prompts for benchmark tasks: synthetic text whose tokens are known, rendered like the engine.

Synthetic content is a sequence of words that are each one token of the shipped tokenizer, drawn
deterministically from a key: the same key gives the same tokens (so a static segment really is
shared), and text and ids agree one to one. A chat prompt is rendered message by message through
the tokenizer's own chat template; `ChatRenderer` checks once, against `Tokenizer.encode_chat`,
that concatenating per-message ids gives exactly the ids the engine computes, and otherwise
tokenises every message for real.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from xxhash import xxh3_64_intdigest

from kvindex.tokenizer import Tokenizer, TokenizerError


@dataclass(frozen=True)
class Piece:
    """A run of prompt tokens with a name: equal names always mean equal ids and text."""

    key: str
    ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class Content:
    """A message's content: text, and its ids when they are known without tokenising."""

    key: str
    text: str
    ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ChatMessage:
    """One chat message of a task's prompt."""

    role: str
    content: Content


class Vocabulary:
    """Words that are exactly one token each, for synthetic text."""

    def __init__(self, tokenizer: Tokenizer, cache_pieces: int = 1_000_000) -> None:
        self.tokenizer = tokenizer
        ids: list[int] = []
        words: dict[int, str] = {}
        for i in range(tokenizer.vocab_size):
            if i in tokenizer.special_ids:
                continue
            text = tokenizer.decode([i])
            word = text[1:]
            if len(text) > 2 and text[0] == " " and word.isascii() and word.isalpha() and \
                    tokenizer.encode(text) == [i]:
                ids.append(i)
                words[i] = text
        if len(ids) < 64:
            raise ValueError("the tokenizer has too few single-token words for synthetic text")
        self.ids = ids
        self.words = words
        self._cache: OrderedDict[str, Piece] = OrderedDict()
        self._cache_pieces = cache_pieces

    def tokens(self, key: str, n: int) -> tuple[int, ...]:
        """`n` token ids determined by `key`."""
        rng = random.Random(xxh3_64_intdigest(key.encode()))
        return tuple(rng.choices(self.ids, k=n))

    def piece(self, key: str, n: int) -> Piece:
        """A synthetic piece of `n` tokens named `key` (cached, least recently used out, so
        prompts that repeat a piece share one object)."""
        cached = self._cache.get(key)
        if cached is not None and len(cached.ids) == n:
            self._cache.move_to_end(key)
            return cached
        ids = self.tokens(key, n)
        piece = Piece(key, ids, self.text(ids))
        self._cache[key] = piece
        if len(self._cache) > self._cache_pieces:
            self._cache.popitem(last=False)
        return piece

    def text(self, ids: Sequence[int]) -> str:
        """The text of synthetic ids."""
        words = self.words
        return "".join([words[i] for i in ids])

    def content(self, key: str, n: int) -> Content:
        """Synthetic content of `n` tokens named `key`."""
        piece = self.piece(key, n)
        return Content(key, piece.text, piece.ids)


_MARK = "\x00kvgate-content\x00"


class ChatRenderer:
    """Token ids and text of a chat prompt, built from per-message pieces."""

    def __init__(self, tokenizer: Tokenizer, vocabulary: Vocabulary) -> None:
        self.tokenizer = tokenizer
        self.vocabulary = vocabulary
        probe = [{"role": "user", "content": "probe"}]
        base = tokenizer.render_chat(probe, add_generation_prompt=False)
        with_gen = tokenizer.render_chat(probe, add_generation_prompt=True)
        self._generation_text = with_gen[len(base):] if with_gen.startswith(base) else ""
        user_head, _ = self._frame("user")
        first = tokenizer.render_chat([{"role": "user", "content": _MARK}],
                                      add_generation_prompt=False)
        self._bos_text = first.split(user_head + _MARK, 1)[0]
        self._frames: dict[str, tuple[tuple[int, ...], str, tuple[int, ...], str]] = {}
        self._slow: OrderedDict[str, Piece] = OrderedDict()
        self.fast = True
        self.fast = self._fast_path_agrees()

    def _frame(self, role: str) -> tuple[str, str]:
        """Text before and after a message's content for `role`."""
        lead = [{"role": "user", "content": "lead"}]
        base = self.tokenizer.render_chat(lead, add_generation_prompt=False)
        full = self.tokenizer.render_chat([*lead, {"role": role, "content": _MARK}],
                                          add_generation_prompt=False)
        if not full.startswith(base) or _MARK not in full:
            raise TokenizerError(f"the chat template does not render {role!r} messages in "
                                 "order")
        head, tail = full[len(base):].split(_MARK, 1)
        return head, tail

    def _frame_ids(self, role: str) -> tuple[tuple[int, ...], str, tuple[int, ...], str]:
        frame = self._frames.get(role)
        if frame is None:
            head, tail = self._frame(role)
            enc = self.tokenizer.encode
            frame = (tuple(enc(head)), head, tuple(enc(tail)), tail)
            self._frames[role] = frame
        return frame

    def _fast_path_agrees(self) -> bool:
        v = self.vocabulary
        messages = [ChatMessage("system", v.content("probe:system", 40)),
                    ChatMessage("user", Content("probe:literal", "What is 2 + 2?\nThink.")),
                    ChatMessage("assistant", v.content("probe:answer", 30)),
                    ChatMessage("tool", v.content("probe:tool", 20))]
        tools = [{"type": "function", "function": {"name": "probe", "parameters": {}}}]
        for with_tools in (None, tools):
            pieces = self.render(messages, with_tools, "probe-tools" if with_tools else None)
            ids = [i for p in pieces for i in p.ids]
            plain = [{"role": m.role, "content": m.content.text} for m in messages]
            expected = self.tokenizer.encode_chat(plain, tools=with_tools)
            if ids != expected or "".join(p.text for p in pieces) != \
                    self.tokenizer.render_chat(plain, tools=with_tools):
                return False
        return True

    def _tokenised(self, key: str, text: Callable[[], str]) -> Piece:
        """A piece tokenised for real, cached by key: `text` is rendered only on a miss."""
        piece = self._slow.get(key)
        if piece is None:
            rendered = text()
            piece = Piece(key, tuple(self.tokenizer.encode(rendered)), rendered)
            self._slow[key] = piece
            if len(self._slow) > 4096:
                self._slow.popitem(last=False)
        return piece

    def render(
        self,
        messages: Sequence[ChatMessage],
        tools: list[dict[str, Any]] | None = None,
        tools_key: str | None = None,
    ) -> list[Piece]:
        """The prompt as pieces, ending with the generation prompt; ids as the engine's."""
        pieces: list[Piece] = []
        if self._bos_text:
            pieces.append(self._tokenised("<bos>", lambda: self._bos_text))
        rest = list(messages)
        if tools:
            # The template folds a leading system message and the tools into one block.
            lead = rest[:1] if rest and rest[0].role in ("system", "developer") else []
            rest = rest[len(lead):]
            key = f"tools:{tools_key}:{lead[0].content.key if lead else ''}"
            pieces.append(self._tokenised(key, lambda: self._tools_text(lead, tools)))
        for m in rest:
            pieces.append(self.message(m))
        if self._generation_text:
            pieces.append(self._tokenised("<generation>", lambda: self._generation_text))
        return pieces

    def _tools_text(self, lead: list[ChatMessage], tools: list[dict[str, Any]]) -> str:
        """The block the template renders for the tools (with the leading system message)."""
        plain = [{"role": m.role, "content": m.content.text} for m in lead]
        whole = self.tokenizer.render_chat(plain or [{"role": "user", "content": _MARK}],
                                           tools=tools, add_generation_prompt=False)
        text = whole[len(self._bos_text):]
        if not lead:
            text = text.split(self._frame_ids("user")[1] + _MARK, 1)[0]
        return text

    def message(self, m: ChatMessage) -> Piece:
        """One message as a piece: its template frame around its content."""
        key = f"{m.role}:{m.content.key}"
        head_ids, head, tail_ids, tail = self._frame_ids(m.role)
        if not self.fast or m.content.ids is None:
            return self._tokenised(key, lambda: head + m.content.text + tail)
        return Piece(key, head_ids + m.content.ids + tail_ids, head + m.content.text + tail)
