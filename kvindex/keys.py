"""The index's own chained block keys over token ids, and a prompt keyer that caches them.

A block's key is a 64-bit xxh3 hash of (parent key, the block's token ids, its extra keys), so a
key names a whole prefix, like vLLM's block hash but computed by the gateway itself: requests are
keyed with `PromptKeyer`, and engines' BlockStored events (which carry token ids) are keyed with
`chain_keys` + `KeyExtras.from_event`, giving the same keys for the same tokens.

`PromptKeyer` caches token ids and keys of repeated prompt prefixes. Fast HF tokenizers split
their input at added tokens (special tokens such as `<|im_start|>`) before anything else, so a
rendered prompt tokenises as the concatenation of its pieces between added tokens. The keyer cuts
the text into segments that each start at an added token, and keeps a trie of segments whose
nodes hold the state after them (their token ids and the keys of blocks they complete); a request
walks the trie as far as its segments match and tokenises and hashes only the rest. Whether that
invariant holds for the loaded tokenizer is checked once at start-up; if not, the keyer tokenises
whole prompts (and caches only exact repeats).
"""

from __future__ import annotations

import re
import sys
import threading
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain, pairwise
from operator import attrgetter
from typing import Any, NamedTuple

from xxhash import xxh3_64_intdigest

from kvindex.index import BlockKey
from kvindex.tokenizer import Tokenizer, TokenizerError

__all__ = [
    "NO_EXTRAS",
    "KeyExtras",
    "PromptKeyer",
    "PromptKeys",
    "block_key",
    "chain_keys",
]

# Fixed little-endian uint32 packing, so keys agree across processes and machines.
_U32 = next(code for code in "IL" if array(code).itemsize == 4)
_BIG_ENDIAN = sys.byteorder == "big"
# The root has no parent key; its one-byte encoding can never equal a child's nine bytes.
_ROOT_PREFIX = b"\x00"
_CHILD_TAG = b"\x01"
_NO_EXTRA = b"\x00"


@dataclass(frozen=True)
class KeyExtras:
    """What besides token ids sets a request's KV apart: its LoRA adapter and cache salt."""

    lora_name: str | None = None
    cache_salt: str | None = None

    def for_block(self, block_index: int) -> tuple[str, ...] | None:
        """Extra keys of block `block_index` of a chain: the LoRA on every block, the salt on 0.

        An empty salt counts as none, as in vLLM.
        """
        extra: tuple[str, ...] = ()
        if self.lora_name is not None:
            extra += ("lora", self.lora_name)
        if self.cache_salt and block_index == 0:
            extra += ("cache_salt", self.cache_salt)
        return extra or None

    @classmethod
    def from_event(
        cls, lora_name: str | None, first_block_extra: tuple[Any, ...] | list[Any] | None
    ) -> KeyExtras:
        """Extras of a BlockStored event, given its `lora_name` and its first block's extra keys.

        vLLM 0.32 publishes each block's extra keys untagged, in order: the LoRA name (when
        `lora_name` is set), `(mm_identifier, offset)` pairs, the cache salt (block 0 only) and
        prompt-embeds digests (bytes); so the salt is the first string after the LoRA name.
        """
        entries = list(first_block_extra or ())
        if lora_name is not None and entries and entries[0] == lora_name:
            entries = entries[1:]
        salt = next((entry for entry in entries if isinstance(entry, str)), None)
        return cls(lora_name=lora_name, cache_salt=salt or None)


NO_EXTRAS = KeyExtras()
"""No LoRA, no salt."""


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32s (OverflowError for ids outside [0, 2**32))."""
    packed = array(_U32, token_ids)
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def _parent_prefix(parent: BlockKey | None) -> bytes:
    return _ROOT_PREFIX if parent is None else _CHILD_TAG + parent.to_bytes(8, "little")


def _extra_bytes(extra: tuple[str, ...] | None) -> bytes:
    """Unambiguous encoding: a presence tag, a count, then length-prefixed UTF-8 strings."""
    if extra is None:
        return _NO_EXTRA
    parts = [b"\x01", len(extra).to_bytes(4, "little")]
    for item in extra:
        data = item.encode("utf-8", "surrogatepass")
        parts += [len(data).to_bytes(4, "little"), data]
    return b"".join(parts)


def block_key(
    parent: BlockKey | None, token_ids: Sequence[int], extra: tuple[str, ...] | None
) -> BlockKey:
    """Key of one block: xxh3-64 of its parent's key (None for the first block), ids and extras."""
    packed = _pack_tokens(token_ids)
    return xxh3_64_intdigest(
        b"".join(
            (
                _parent_prefix(parent),
                len(token_ids).to_bytes(4, "little"),
                packed,
                _extra_bytes(extra),
            )
        )
    )


def chain_keys(
    token_ids: Sequence[int],
    block_size: int,
    extras: KeyExtras = NO_EXTRAS,
    parent: BlockKey | None = None,
    first_block_index: int = 0,
) -> list[BlockKey]:
    """Keys of every full block of `token_ids`, chained from `parent`; a partial tail gets none.

    `first_block_index` is the position of the first block here in the whole chain (the salt
    applies only to block 0), for continuing a chain from a known parent, e.g. over the token ids
    of an engine's BlockStored event. Same result as calling `block_key` block by block.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, not {block_size}")
    if first_block_index < 0:
        raise ValueError(f"first_block_index must be >= 0, not {first_block_index}")
    num_blocks = len(token_ids) // block_size
    if num_blocks == 0:
        return []
    packed = _pack_tokens(token_ids[: num_blocks * block_size])
    stride = 4 * block_size
    count = block_size.to_bytes(4, "little")
    first_extra = _extra_bytes(extras.for_block(first_block_index))
    key = xxh3_64_intdigest(
        b"".join((_parent_prefix(parent), count, packed[:stride], first_extra))
    )
    keys = [key]
    # Every later block has a parent and the same extras: the loop is `_parent_prefix` inlined,
    # as an engine's BlockStored of a whole long prompt chains thousands of blocks here.
    later_extra = _extra_bytes(extras.for_block(first_block_index + 1))
    join = b"".join
    for start in range(stride, num_blocks * stride, stride):
        key = xxh3_64_intdigest(
            join((_CHILD_TAG, key.to_bytes(8, "little"), count,
                  packed[start : start + stride], later_extra))
        )
        keys.append(key)
    return keys


@dataclass(frozen=True)
class PromptKeys:
    """A prompt's token ids, the keys of its full blocks, and the text they came from.

    `text` is the rendered prompt for chat, the prompt for completions, "" for token-id prompts.
    """

    token_ids: tuple[int, ...]
    keys: tuple[BlockKey, ...]
    text: str

    @property
    def num_tokens(self) -> int:
        """Number of prompt tokens."""
        return len(self.token_ids)


class _PiecewiseEncoder:
    """Tokenises a text segment by segment, each segment starting at an added token.

    Valid only when the tokenizer's first step is to split on these added tokens and every piece
    between them is tokenised on its own; `for_tokenizer` checks that once.
    """

    def __init__(
        self,
        backend: Any,
        split_ids: dict[str, int],
        pre: tuple[int, ...],
        post: tuple[int, ...],
    ) -> None:
        self._backend = backend
        self._split_ids = split_ids
        # Longest first: at one position the regex takes the first alternative that matches,
        # which then is the longest, like the tokenizer's leftmost-longest matcher.
        ordered = sorted(split_ids, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, ordered))) if ordered else None
        self.pre = pre
        """Ids `add_special_tokens=True` puts before the text (e.g. BOS)."""
        self.post = post
        """Ids `add_special_tokens=True` puts after the text."""

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer) -> _PiecewiseEncoder | None:
        """An encoder equivalent to `tokenizer.encode` on probe texts, or None if unsupported."""
        hf: Any = tokenizer._hf
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None or getattr(hf, "split_special_tokens", False):
            return None
        split_ids: dict[str, int] = {}
        for idx, token in backend.get_added_tokens_decoder().items():
            if token.normalized:
                continue  # matched only inside pieces, after normalisation
            if token.lstrip or token.rstrip or token.single_word:
                return None  # matches that swallow neighbouring text: boundaries would move
            split_ids[token.content] = int(idx)
        probe = "kvgate probe"
        plain = tokenizer.encode(probe)
        full = tokenizer.encode(probe, add_special_tokens=True)
        start = next(
            (i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain),
            None,
        )
        if not plain or start is None:
            return None
        encoder = cls(backend, split_ids, tuple(full[:start]), tuple(full[start + len(plain) :]))
        for text in _probe_texts(list(split_ids)):
            for special in (False, True):
                expected = tokenizer.encode(text, add_special_tokens=special)
                if not encoder.usable() or encoder.encode(text, special) != expected:
                    return None
        return encoder

    def usable(self) -> bool:
        """Whether the backend is in the state `Tokenizer.encode` leaves it in (no truncation,
        padding or special-token splitting switched on by another caller)."""
        backend = self._backend
        return (
            not backend.encode_special_tokens
            and backend.truncation is None
            and backend.padding is None
        )

    def split(self, text: str) -> list[str]:
        """Cut `text` before every added token; only the first segment may lack one."""
        if self._pattern is None:
            return [text] if text else []
        starts = [m.start() for m in self._pattern.finditer(text)]
        if not starts or starts[0] != 0:
            starts.insert(0, 0)
        starts.append(len(text))
        return [text[a:b] for a, b in pairwise(starts) if b > a]

    def encode_segments(self, segments: Sequence[str]) -> list[list[int]]:
        """Token ids of each segment (as produced by `split`), without pre/post ids."""
        heads: list[int | None] = []
        pieces: list[str] = []
        for segment in segments:
            match = self._pattern.match(segment) if self._pattern is not None else None
            if match is None:
                heads.append(None)
                pieces.append(segment)
            else:
                heads.append(self._split_ids[match.group()])
                pieces.append(segment[match.end() :])
        out: list[list[int]] = []
        for head, piece in zip(heads, pieces, strict=True):
            ids = [] if head is None else [head]
            # Empty pieces are never tokenised: alone they could gain a prefix space. One piece
            # at a time: `encode_batch` hands small batches to a thread pool, slower here.
            if piece:
                ids.extend(self._backend.encode(piece, add_special_tokens=False).ids)
            out.append(ids)
        return out

    def encode(self, text: str, special: bool) -> list[int]:
        """All token ids of `text`, as `Tokenizer.encode(text, add_special_tokens=special)`."""
        ids: list[int] = list(self.pre) if special else []
        for segment_ids in self.encode_segments(self.split(text)):
            ids.extend(segment_ids)
        if special:
            ids.extend(self.post)
        return ids


def _probe_texts(tokens: list[str]) -> list[str]:
    """Texts on which piecewise tokenisation must match whole-text tokenisation."""
    texts = ["", " ", "plain text", "  two leading spaces", "trailing space ", "héllo\n\n wörld 🙂"]
    for token in tokens:
        texts += [
            token,
            token + token,
            f"a{token}b",
            f" {token} ",
            f"x \n{token}\n\n y",
            f"{token}  héllo",
            f"wörld\t{token}",
        ]
    if tokens:
        texts.append(" mixed ".join(tokens) + " end")
    return texts


class _Node:
    """State after one more segment: the segment's ids and the keys of blocks it completes."""

    __slots__ = ("children", "cost", "ids", "keys", "parent", "segment", "whole")

    def __init__(
        self,
        parent: _Node | None,
        segment: str,
        ids: tuple[int, ...],
        keys: tuple[BlockKey, ...],
    ) -> None:
        self.parent = parent
        self.segment = segment
        self.ids = ids
        self.keys = keys
        self.children: dict[str, _Node] = {}
        self.cost = _NODE_BYTES + len(segment) + _ITEM_BYTES * (len(ids) + len(keys))
        self.whole: _Prefix | None = None
        """All ids and keys from the root through this node, while the node ends one of the
        keyer's most recent prompts or is the one before its end."""


_NODE_IDS = attrgetter("ids")
_NODE_KEYS = attrgetter("keys")

# Rough memory per cached node and per cached id or key (a pointer plus an int object).
_NODE_BYTES = 200
_ITEM_BYTES = 36

_RootKey = tuple[str, bool, bool, KeyExtras]
_Whole = tuple[tuple[int, ...], tuple[BlockKey, ...]]


class _Prefix(NamedTuple):
    """The leading `num_ids` ids and `num_keys` keys of a whole prompt's, and the nodes and
    segments from the root to the node that keeps it."""

    whole: _Whole
    num_ids: int
    num_keys: int
    path: tuple[_Node, ...]
    segments: list[str]


def _ids_after(head: tuple[int, ...], tail: list[int], start: int) -> Sequence[int]:
    """Ids from position `start` on of `head` followed by `tail` (a prompt's last blocks: a
    short copy)."""
    if start >= len(head):
        return tail[start - len(head) :]
    return [*head[start:], *tail]


_WHOLE_PROMPTS = 32
"""Recent prompts whose whole ids and keys stay at their last two nodes: a prompt that extends
one (a conversation's next turn, which replaces the last segment, the generation prompt or a
partial block, and adds more) copies that state rather than gathering thousands of nodes'."""


_JUMP_MIN_SEGMENTS = 48
"""Prompts of fewer segments are walked from the root without looking for a recent prompt they
extend (the look costs about as much as walking this many nodes)."""


class PromptKeyer:
    """Token ids and block keys of chat and completion prompts, caching repeated prefixes.

    The cache holds about `cache_bytes` (prefix text plus ids and keys), least recently used
    first out; 0 disables it. Besides, the last `_WHOLE_PROMPTS` prompts keep their whole ids and
    keys (references to the same int objects). Thread-safe.
    """

    def __init__(
        self, tokenizer: Tokenizer, block_size: int, cache_bytes: int = 64 * 1024 * 1024
    ) -> None:
        """Key prompts for `tokenizer` in blocks of `block_size` tokens."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, not {block_size}")
        if cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0, not {cache_bytes}")
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.cache_bytes = cache_bytes
        self._piecewise = _PiecewiseEncoder.for_tokenizer(tokenizer)
        self._roots: dict[_RootKey, _Node] = {}
        self._root_keys: dict[_Node, _RootKey] = {}
        self._lru: OrderedDict[_Node, None] = OrderedDict()
        self._wholes: OrderedDict[_Node, None] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()

    @property
    def piecewise(self) -> bool:
        """Whether prompts are tokenised segment by segment (else whole, exact repeats cached)."""
        return self._piecewise is not None

    @property
    def cached_bytes(self) -> int:
        """Approximate memory the cache holds now."""
        return self._used

    def chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        extras: KeyExtras = NO_EXTRAS,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> PromptKeys:
        """Keys of a chat request: ids exactly as `Tokenizer.encode_chat` gives them.

        Raises `TokenizerError` when the chat cannot be rendered.
        """
        text = self.tokenizer.render_chat(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        return self._prompt_keys(text, False, extras)

    def completion(self, prompt: str | list[int], extras: KeyExtras = NO_EXTRAS) -> PromptKeys:
        """Keys of a completions prompt: text as `Tokenizer.encode_prompt` tokenises it, or ids.

        Raises `TokenizerError` for a prompt that is neither a string nor a list of token ids.
        """
        if isinstance(prompt, str):
            return self._prompt_keys(prompt, True, extras)
        error = "prompt must be a string or a list of token ids in [0, 2**32)"
        if not isinstance(prompt, list):
            raise TokenizerError(error)
        try:
            _pack_tokens(prompt)
        except (TypeError, OverflowError):
            raise TokenizerError(error) from None
        ids = tuple(prompt)
        return PromptKeys(ids, tuple(chain_keys(ids, self.block_size, extras)), "")

    def _prompt_keys(self, text: str, special: bool, extras: KeyExtras) -> PromptKeys:
        """Ids and keys of `text`, reusing the cached state of its longest known prefix."""
        piecewise = self._piecewise
        encode: Callable[[Sequence[str]], list[list[int]]]
        if piecewise is not None and piecewise.usable():
            segments = piecewise.split(text)
            pre, post = (piecewise.pre, piecewise.post) if special else ((), ())
            encode = piecewise.encode_segments
        else:
            piecewise = None
            segments = [text]
            pre = post = ()

            def encode(whole: Sequence[str]) -> list[list[int]]:
                return [self.tokenizer.encode(s, add_special_tokens=special) for s in whole]

        ids, keys = self._walk(("text", piecewise is not None, special, extras), pre, segments,
                               encode)
        if post:
            ids += post
            keys += tuple(self._continue(ids[len(keys) * self.block_size :],
                                         keys[-1] if keys else None, len(keys), extras))
        return PromptKeys(ids, keys, text)

    def pieces(
        self, pieces: Sequence[tuple[str, Sequence[int]]], extras: KeyExtras = NO_EXTRAS
    ) -> PromptKeys:
        """Keys of a prompt given as already tokenised pieces, each named by a unique `key`.

        For callers that know how a prompt is built (the benchmark, workflows): equal names must
        mean equal ids. Shares the cache with nothing else; `text` is "".
        """
        return self.named([k for k, _ in pieces], [ids for _, ids in pieces], extras)

    def named(
        self, names: Sequence[str], ids: Sequence[Sequence[int]], extras: KeyExtras = NO_EXTRAS
    ) -> PromptKeys:
        """`pieces` given as parallel sequences of names and ids."""
        if len(names) != len(ids):
            raise ValueError(f"{len(names)} names for {len(ids)} pieces")

        def encode(rest: Sequence[str]) -> list[list[int]]:
            # The segments not cached are the last pieces.
            return [list(piece) for piece in ids[len(ids) - len(rest) :]]

        whole_ids, keys = self._walk(("pieces", False, False, extras), (), names, encode)
        return PromptKeys(whole_ids, keys, "")

    def _walk(
        self,
        root_key: _RootKey,
        pre: tuple[int, ...],
        segments: Sequence[str],
        encode: Callable[[Sequence[str]], list[list[int]]],
    ) -> _Whole:
        """Ids and keys after `segments`, from the cached state of their longest known prefix;
        `encode` tokenises the segments not yet cached."""
        extras = root_key[3]
        bs = self.block_size
        with self._lock:
            node = root = self._root(root_key, pre)
            path: list[_Node] = []
            start = _Prefix((root.ids, root.keys), len(root.ids), len(root.keys), (), [])
            known = 0
            # Jump to the deepest recent prompt that `segments` extend (a conversation's next
            # turn): its path is known, so only the segments after it are walked node by node.
            # A short prompt's walk costs less than looking.
            for kept in self._wholes if len(segments) >= _JUMP_MIN_SEGMENTS else ():
                prefix = kept.whole
                assert prefix is not None
                depth = len(prefix.path)
                if (known < depth <= len(segments) and prefix.path[0].parent is root
                        and segments[depth - 1] == kept.segment
                        and segments[:depth] == prefix.segments):
                    start, known = prefix, depth
            if known:
                path = list(start.path)
                node = path[-1]
            for segment in segments[known:] if known else segments:
                child = node.children.get(segment)
                if child is None:
                    break
                path.append(child)
                node = child
                if child.whole is not None:
                    start, known = child.whole, len(path)
            matched = len(path)
            if known:
                self._wholes.move_to_end(path[known - 1])
            # Long prompts walk thousands of nodes: concatenate their state in C-level passes,
            # from the longest recent prompt on the path. Its ids and keys are copied once,
            # into the result (a prompt's ids are its largest part: tens of thousands per turn).
            head = start.whole[0]
            if start.num_ids < len(head):
                head = head[: start.num_ids]
            tail = list(chain.from_iterable(map(_NODE_IDS, path[known:])))
            base = start.whole[1]
            if start.num_keys < len(base):
                base = base[: start.num_keys]
            more = list(chain.from_iterable(map(_NODE_KEYS, path[known:])))
            rest = segments[len(path) :]
            for segment, segment_ids in zip(rest, encode(rest) if rest else [], strict=True):
                tail.extend(segment_ids)
                num_keys = len(base) + len(more)
                pending = _ids_after(head, tail, num_keys * bs)
                parent = more[-1] if more else base[-1] if base else None
                new_keys = self._continue(pending, parent, num_keys, extras)
                child = _Node(node, segment, tuple(segment_ids), tuple(new_keys))
                more.extend(new_keys)
                node.children[segment] = child
                self._lru[child] = None
                self._used += child.cost
                path.append(child)
                node = child
            # Leaf first, so a node is always more recent than its descendants and the least
            # recently used node is a leaf.
            deque(map(self._lru.move_to_end, reversed(path)), maxlen=0)
            ids = head + tuple(tail) if tail else head
            whole = (ids, base + tuple(more) if more else base)
            if path:
                last = path[-1]
                nodes = tuple(path)
                names = list(segments[: len(path)])
                self._keep_whole(last, _Prefix(whole, len(ids), len(whole[1]), nodes, names))
                if len(path) > 1:
                    self._keep_whole(path[-2], _Prefix(
                        whole, len(ids) - len(last.ids), len(whole[1]) - len(last.keys),
                        nodes[:-1], names[:-1]))
                if known < matched < len(path) - 1:
                    # The prompt left the cache below a node no recent prompt ends at (an
                    # agent's next call: the same system prompt and tools, a new question).
                    # That node keeps the state up to it, copied to its exact length once, so
                    # the calls that branch there next start from it: one copy of the ids
                    # into their result instead of gathering the nodes' and copying again.
                    branch = path[matched - 1]
                    num_ids = len(ids) - sum(map(len, map(_NODE_IDS, path[matched:])))
                    num_keys = len(whole[1]) - sum(map(len, map(_NODE_KEYS, path[matched:])))
                    self._keep_whole(branch, _Prefix(
                        (ids[:num_ids], whole[1][:num_keys]), num_ids, num_keys,
                        nodes[:matched], names[:matched]))
            self._evict()
            if not root.children:
                self._drop_root(root)
        return whole

    def _keep_whole(self, node: _Node, prefix: _Prefix) -> None:
        """Keep `prefix` at its node, dropping the least recent beyond the limit."""
        node.whole = prefix
        self._wholes[node] = None
        self._wholes.move_to_end(node)
        while len(self._wholes) > 2 * _WHOLE_PROMPTS:
            oldest, _ = self._wholes.popitem(last=False)
            oldest.whole = None

    def _continue(
        self, pending: Sequence[int], parent: BlockKey | None, num_keys: int, extras: KeyExtras
    ) -> list[BlockKey]:
        """Keys of the blocks `pending` completes, the ids after the `num_keys` blocks already
        keyed (the last of which is `parent`)."""
        if len(pending) < self.block_size:
            return []
        return chain_keys(
            pending, self.block_size, extras, parent=parent, first_block_index=num_keys
        )

    def _root(self, key: _RootKey, pre: tuple[int, ...]) -> _Node:
        root = self._roots.get(key)
        if root is None:
            extras = key[3]
            root = _Node(None, "", pre, tuple(chain_keys(pre, self.block_size, extras)))
            self._roots[key] = root
            self._root_keys[root] = key
        return root

    def _evict(self) -> None:
        while self._used > self.cache_bytes and self._lru:
            victim, _ = self._lru.popitem(last=False)
            parent = victim.parent
            assert parent is not None and not victim.children
            del parent.children[victim.segment]
            self._used -= victim.cost
            if victim.whole is not None:
                victim.whole = None
                del self._wholes[victim]
            if parent.parent is None and not parent.children:
                self._drop_root(parent)

    def _drop_root(self, root: _Node) -> None:
        """Forget a root without children (there is one per salt, so they must not pile up)."""
        key = self._root_keys.pop(root, None)
        if key is not None:
            del self._roots[key]
