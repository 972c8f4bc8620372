"""Tokenisation shared by the simulated vLLM engine and the gateway.

Both sides must produce exactly the token ids real vLLM produces for the same tokenizer
directory, otherwise prefix-cache block keys computed by the gateway would not match the
blocks the engine reports. So this module does what vLLM does:

* the tokenizer is loaded with ``transformers.AutoTokenizer.from_pretrained(path)``;
* completions prompts are encoded with ``add_special_tokens=True`` (the shipped tokenizer
  then prepends ``<|begin_of_text|>``);
* chat requests are rendered with ``apply_chat_template(..., tokenize=False)`` and the text
  is encoded with ``add_special_tokens=False`` (the template writes the BOS itself);
* before rendering, messages are normalised like vLLM's ``parse_chat_messages`` for
  text-only models: ``None`` content becomes ``""``, lists of text parts are joined with
  ``"\\n"``, and assistant ``tool_calls[].function.arguments`` JSON strings are parsed into
  objects (invalid JSON or a non-object becomes ``{}``; empty ``tool_calls`` are dropped).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["Tokenizer", "TokenizerError"]

# transformers reads these at import time: silence the "PyTorch was not found" banner and
# never touch the network. Set before the (lazy) transformers import below.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Content-part types vLLM treats as text, and the field holding their text.
_TEXT_PART_FIELDS: dict[str, str] = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
}


class TokenizerError(ValueError):
    """A prompt or chat could not be rendered or tokenised (callers map it to HTTP 400)."""


def _content_to_text(content: Any, where: str) -> str:
    """Flatten OpenAI message content to the string vLLM renders for a text-only model."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TokenizerError(
            f"{where}.content must be a string, null or a list of content parts, "
            f"not {type(content).__name__}"
        )
    texts: list[str] = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise TokenizerError(f"{where}.content[{j}] must be an object")
        part_type = part.get("type")
        field = _TEXT_PART_FIELDS.get(part_type) if isinstance(part_type, str) else None
        if field is None:
            raise TokenizerError(
                f"{where}.content[{j}] has unsupported type {part_type!r}; "
                "only text content parts are supported"
            )
        text = part.get(field)
        if text is None:
            continue
        if not isinstance(text, str):
            raise TokenizerError(f"{where}.content[{j}].{field} must be a string")
        texts.append(text)
    return "\n".join(texts)


def _normalise_tool_calls(tool_calls: list[Any], where: str) -> list[dict[str, Any]]:
    """Copy assistant tool calls, parsing ``arguments`` into a dict as vLLM does."""
    out: list[dict[str, Any]] = []
    for j, item in enumerate(tool_calls):
        if not isinstance(item, dict):
            raise TokenizerError(f"{where}.tool_calls[{j}] must be an object")
        function = item.get("function")
        if item.get("type", "function") != "function" or not isinstance(function, dict):
            raise TokenizerError(f"{where}.tool_calls[{j}] must be of type 'function'")
        raw = function.get("arguments")
        arguments: Any = {}
        if isinstance(raw, dict):
            arguments = raw
        elif isinstance(raw, str) and raw:
            try:
                arguments = json.loads(raw)
            except json.JSONDecodeError:
                arguments = {}
        elif raw:
            arguments = raw
        if not isinstance(arguments, dict):
            arguments = {}
        out.append({**item, "function": {**function, "arguments": arguments}})
    return out


_FUNCTION_OPTIONAL = ("strict", "defer_loading")
"""FunctionDefinition fields vLLM 0.32 dumps only when set (its serializer drops them as None)."""


def _normalise_tools(tools: list[Any]) -> list[Any]:
    """The tools as vLLM renders them: `[tool.model_dump() for tool in request.tools]`
    (0.32's `renderers/online_renderer.py`). Each is `{"type", "function": {"name",
    "description", "parameters", ...}}` in that order, None where absent, `strict` and
    `defer_loading` only when set (a tool-level `defer_loading` moves into the function), and no
    other key. A template that prints a tool whole (`tojson`: Qwen's, Hermes's) sees exactly
    that. A tool not of that shape is left as given (vLLM refuses the request)."""
    out: list[Any] = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            out.append(tool)
            continue
        dumped: dict[str, Any] = {"name": fn["name"], "description": fn.get("description"),
                                  "parameters": fn.get("parameters")}
        if fn.get("defer_loading") is None and tool.get("defer_loading") is not None:
            fn = {**fn, "defer_loading": tool["defer_loading"]}
        for key in _FUNCTION_OPTIONAL:
            if fn.get(key) is not None:
                dumped[key] = fn[key]
        out.append({"type": tool.get("type", "function"), "function": dumped})
    return out


def _normalise_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Return fresh message dicts in the shape vLLM hands to the chat template."""
    if not isinstance(messages, list) or not messages:
        raise TokenizerError("messages must be a non-empty list")
    conversation: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise TokenizerError(f"{where} must be an object")
        role = message.get("role")
        if not isinstance(role, str):
            raise TokenizerError(f"{where}.role must be a string")
        msg: dict[str, Any] = {
            "role": role,
            "content": _content_to_text(message.get("content"), where),
        }
        if role == "assistant":
            tool_calls = message.get("tool_calls")
            if tool_calls is not None:
                if not isinstance(tool_calls, list):
                    raise TokenizerError(f"{where}.tool_calls must be a list")
                if tool_calls:
                    msg["tool_calls"] = _normalise_tool_calls(tool_calls, where)
            reasoning = message.get("reasoning")
            if reasoning is not None:
                msg["reasoning"] = reasoning
                msg["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in message:
            msg["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            msg["name"] = message["name"]
        conversation.append(msg)
    return conversation


class Tokenizer:
    """A loaded Hugging Face tokenizer, used exactly the way vLLM uses it.

    Instances are cheap wrappers and safe to share; obtain them with :meth:`load`.
    """

    def __init__(self, hf_tokenizer: Any, name_or_path: str) -> None:
        """Wrap an already-loaded transformers tokenizer (prefer :meth:`load`)."""
        self._hf: Any = hf_tokenizer
        self._name_or_path = name_or_path
        self._special_ids = frozenset(
            int(idx) for idx, tok in hf_tokenizer.added_tokens_decoder.items() if tok.special
        ) | frozenset(int(idx) for idx in hf_tokenizer.all_special_ids)
        self._direct = _DirectTemplate.for_tokenizer(hf_tokenizer)

    @classmethod
    def load(cls, path: str | Path | None = None) -> Tokenizer:
        """Load (once per path, then cached) the tokenizer at ``path``.

        ``None`` means the shipped tiny tokenizer in ``kvgate/assets/tiny_tokenizer``. A path
        to an existing directory is resolved to an absolute path before caching; anything
        else is passed to ``AutoTokenizer.from_pretrained`` unchanged (offline hub cache).
        """
        if path is None:
            from kvgate.assets.tiny_tokenizer import TOKENIZER_DIR

            path = TOKENIZER_DIR
        candidate = Path(path).expanduser()
        if not candidate.exists() and str(path).startswith(("/", "./", "../", "~")):
            # A path, not a hub id: transformers would call it a malformed repo id.
            raise TokenizerError(f"tokenizer {str(path)!r}: no such directory")
        key = str(candidate.resolve()) if candidate.exists() else str(path)
        return _load_cached(key)

    # ------------------------------------------------------------------ encoding

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids for a completions prompt (``add_special_tokens=True``, i.e. BOS first)."""
        return self.encode(text, add_special_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids for raw ``text``; special-token strings in it map to their ids."""
        if not isinstance(text, str):
            raise TokenizerError(f"prompt must be a string, not {type(text).__name__}")
        ids = self._hf.encode(text, add_special_tokens=add_special_tokens)
        return [int(i) for i in ids]

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render OpenAI-style ``messages`` (and ``tools``) to prompt text via the chat template.

        Extra keyword arguments (e.g. ``continue_final_message``) go to
        ``apply_chat_template``. Raises :class:`TokenizerError` for malformed messages or
        when the template rejects the conversation (unknown role, non-text content, ...).
        """
        conversation = _normalise_messages(messages)
        if tools is not None and not isinstance(tools, list):
            raise TokenizerError("tools must be a list of tool definitions")
        if tools:
            tools = _normalise_tools(tools)
        import jinja2

        direct = self._direct
        try:
            if direct is not None and not template_kwargs and direct.takes(tools):
                return direct.render(conversation, tools or None, add_generation_prompt)
            rendered = self._hf.apply_chat_template(
                conversation,
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **template_kwargs,
            )
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"chat template error: {exc}") from exc
        except (TypeError, ValueError) as exc:
            raise TokenizerError(f"cannot render chat: {exc}") from exc
        if not isinstance(rendered, str):
            raise TokenizerError("chat template did not render a string")
        return rendered

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids for a chat request: :meth:`render_chat`, then encode without specials."""
        text = self.render_chat(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        return self.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """Text for ``ids``; special tokens are dropped by default, as in vLLM's outputs."""
        return str(self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens))

    # ------------------------------------------------------------------ metadata

    @property
    def eos_token_id(self) -> int:
        """Id of the end-of-sequence token (``<|im_end|>`` for the shipped tokenizer)."""
        return self._required_id("eos_token_id")

    @property
    def bos_token_id(self) -> int:
        """Id of the beginning-of-sequence token (``<|begin_of_text|>`` for the shipped one)."""
        return self._required_id("bos_token_id")

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added/special tokens included (4096 for the shipped one)."""
        return len(self._hf)

    @property
    def name_or_path(self) -> str:
        """The path (or hub id) the tokenizer was loaded from."""
        return self._name_or_path

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of all special tokens (named ones plus added tokens flagged special)."""
        return self._special_ids

    def _required_id(self, attr: str) -> int:
        value = getattr(self._hf, attr)
        if value is None:
            raise TokenizerError(f"tokenizer {self._name_or_path!r} has no {attr}")
        return int(value)

    def __repr__(self) -> str:
        """Short description naming the source path."""
        return f"Tokenizer({self._name_or_path!r}, vocab_size={self.vocab_size})"


def _plain_json(general: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """transformers' `_plain_template_data` (`general`: every value rebuilt from plain JSON
    types, anything else made an inert placeholder) for a value that holds only exact JSON
    types, as a request's parsed JSON does, is an equal copy of it: such a value is handed to
    the template as it is (an immutable sandbox, which cannot change it), checked without
    recursion, at a fraction of the cost of the copy (whose checks go through `isinstance`
    against abstract classes per value; a prompt with two dozen tools spent as long there as
    in the template). Anything else goes to `general`."""

    def plain(value: Any) -> Any:
        stack = [value]
        pop, push, extend = stack.pop, stack.append, stack.extend
        while stack:
            item = pop()
            kind = type(item)
            if kind is dict:
                for key, inner in item.items():
                    if type(key) is not str:
                        return general(value)
                    push(inner)
            elif kind is list:
                extend(item)
            elif not (kind is str or item is None or kind is int or kind is float
                      or kind is bool):
                return general(value)
        return value

    return plain


def _with_fast_tojson(compiled: Any, source: str) -> Any:
    """`source` compiled in an overlay of transformers' environment for it (the same sandbox,
    globals and extensions) whose `tojson` filter encodes with one reused encoder when called
    with transformers' defaults, as `json.dumps(x, ensure_ascii=False)` does: that builds a new
    encoder per call, a few microseconds each, and a template with two dozen tools calls it
    three times per tool. Called with other arguments (`tojson(indent=2)`) it is transformers'
    own filter."""
    general = compiled.environment.filters["tojson"]
    encode = json.JSONEncoder(ensure_ascii=False).encode

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | str | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        if ensure_ascii or indent is not None or separators is not None or sort_keys:
            return str(general(x, ensure_ascii=ensure_ascii, indent=indent,
                               separators=separators, sort_keys=sort_keys))
        return encode(x)

    env = compiled.environment.overlay()
    env.filters = {**compiled.environment.filters, "tojson": tojson}
    return env.from_string(source)


class _DirectTemplate:
    """The tokenizer's chat template rendered as ``apply_chat_template(..., tokenize=False)``
    renders it, for the calls the proxy keys: one conversation of messages already
    normalised here, tools as JSON objects, no extra template arguments.

    It takes transformers' own steps for such a call (the template it would pick, compiled in
    its sandbox with its globals and extensions; None-valued message keys dropped; values as
    plain JSON types, `_plain_json`; reasoning fields aliased; the special tokens as template
    variables) and leaves out the per-call work they do not need (choosing among batched
    forms, looking the template up, converting message objects, copying the template's
    globals, building a JSON encoder per `tojson`, `_with_fast_tojson`): a short chat renders
    in less than half the time, a prompt with two dozen tools in about three fifths.
    Anything else goes through ``apply_chat_template``; so does everything when the
    transformers in use lacks these steps. ``tests/test_tokenizer.py`` checks both give the
    same text over a range of conversations and templates.
    """

    def __init__(self, hf_tokenizer: Any, compile_template: Any, plain: Any, alias: Any) -> None:
        self._hf = hf_tokenizer
        self._compile = compile_template
        self._plain = _plain_json(plain)
        self._alias = alias
        self._kwargs: dict[str, Any] = plain(dict(hf_tokenizer.special_tokens_map))
        self._compiled: dict[str, tuple[Any, dict[str, Any]]] = {}
        """Per template source (as `get_chat_template` picks it for the call): the compiled
        template and its variables that never change."""

    @classmethod
    def for_tokenizer(cls, hf_tokenizer: Any) -> _DirectTemplate | None:
        """None when the tokenizer has no template or transformers lacks the steps."""
        if getattr(hf_tokenizer, "chat_template", None) is None:
            return None
        try:
            from transformers.utils import chat_template_utils as ctu

            steps = (ctu._compile_jinja_template, ctu._plain_template_data,
                     ctu._alias_reasoning_fields)
        except (ImportError, AttributeError):
            return None
        return cls(hf_tokenizer, *steps)

    @staticmethod
    def takes(tools: list[Any] | None) -> bool:
        """Whether a call with `tools` renders here (tools given as JSON objects only)."""
        return tools is None or all(type(t) is dict for t in tools)

    def render(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool) -> str:
        """The rendered text; jinja2's errors propagate as from ``apply_chat_template``."""
        source = self._hf.get_chat_template(None, tools)
        compiled = self._compiled.get(source)
        if compiled is None:
            template = _with_fast_tojson(self._compile(source), source)
            # `Template.render` copies the template's globals and the variables into a fresh
            # dict on every call; the globals do not change, so they are copied once here and
            # the call's variables added to a copy of that (jinja's `shared` context).
            compiled = (template, {**template.globals, **self._kwargs})
            self._compiled[source] = compiled
        template, parent = compiled
        plain = self._plain
        chat = self._alias(plain([{k: v for k, v in m.items() if v is not None}
                                  for m in conversation]))
        context = template.new_context({**parent, "messages": chat, "tools": plain(tools),
                                        "documents": None,
                                        "add_generation_prompt": add_generation_prompt},
                                       shared=True)
        rendered = template.environment.concat(template.root_render_func(context))
        if not isinstance(rendered, str):
            raise TokenizerError("chat template did not render a string")
        return rendered


@functools.lru_cache(maxsize=16)
def _load_cached(key: str) -> Tokenizer:
    """Load and wrap the tokenizer for ``key`` (an absolute path or hub id)."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(key)
    return Tokenizer(hf, key)
