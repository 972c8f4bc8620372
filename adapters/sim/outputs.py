"""What the simulated engine's API server does with a request's output tokens, as vLLM 0.32's
does: stop strings and stop token ids (`v1/engine/detokenizer.py`, `v1/core/sched/utils.py`),
logprobs (`chat_completion/serving.py` `_create_chat_logprobs`, `completion/serving.py`
`_create_completion_logprobs`), and output forced into a shape (a required or named tool call,
`response_format`), which a real vLLM gets from structured-output decoding.

The model is random, so the values are made up, but deterministically (the same request, the
same answer) and in vLLM's shapes: the sampled token is the most likely one (greedy), its
logprob a small negative number, its alternatives less likely.
"""

from __future__ import annotations

import json
import math
import random
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20
"""vLLM's default `--max-logprobs`."""

class OutputError(ValueError):
    """A request field the engine refuses (400), naming the parameter."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _number(body: dict[str, Any], key: str, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise OutputError(f"{key} must be a number, got {v!r}.", key)
    return float(v)


def check_sampling(body: dict[str, Any]) -> None:
    """vLLM 0.32's `SamplingParams._verify_args` on the fields clients set, in its order and
    words (a message that names its parameter in vLLM names it here too)."""
    presence = _number(body, "presence_penalty", 0.0)
    if not -2.0 <= presence <= 2.0:
        raise OutputError(f"presence_penalty must be in [-2, 2], got {presence}.", "")
    frequency = _number(body, "frequency_penalty", 0.0)
    if not -2.0 <= frequency <= 2.0:
        raise OutputError(f"frequency_penalty must be in [-2, 2], got {frequency}.", "")
    repetition = _number(body, "repetition_penalty", 1.0)
    if not math.isfinite(repetition):
        raise OutputError(f"repetition_penalty must be a finite number, got {repetition}.", "")
    if repetition <= 0.0:
        raise OutputError(
            f"repetition_penalty must be greater than zero, got {repetition}.", "")
    temperature = _number(body, "temperature", 1.0)
    for bad, words in ((not math.isfinite(temperature), "must be a finite number"),
                       (temperature < 0.0, "must be non-negative"),
                       (temperature > 2.0, "must be in [0, 2]")):
        if bad:
            raise OutputError(f"temperature {words}, got {temperature}. "
                              f"(parameter=temperature, value={temperature})", "temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise OutputError(f"top_p must be in (0, 1], got {top_p}. "
                          f"(parameter=top_p, value={top_p})", "top_p")
    top_k = body.get("top_k")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int):
            raise OutputError(f"top_k must be an integer, got {type(top_k).__name__}", "")
        if top_k < -1:
            raise OutputError(f"top_k must be 0 (disable), or at least 1, got {top_k}.", "")
    min_p = _number(body, "min_p", 0.0)
    if not 0.0 <= min_p <= 1.0:
        raise OutputError(f"min_p must be in [0, 1], got {min_p}.", "")


@dataclass(frozen=True)
class StopSpec:
    """When the API server ends an answer before the model would."""

    strings: tuple[str, ...] = ()
    token_ids: frozenset[int] = frozenset()
    include: bool = False
    """`include_stop_str_in_output`."""
    min_tokens: int = 0

    @classmethod
    def read(cls, body: dict[str, Any], min_tokens: int) -> StopSpec:
        """The body's `stop`, `stop_token_ids` and `include_stop_str_in_output`."""
        stop = body.get("stop")
        if stop is None:
            strings: tuple[str, ...] = ()
        elif isinstance(stop, str):
            strings = (stop,)
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            strings = tuple(stop)
        else:
            raise OutputError("stop must be a string or a list of strings.", "stop")
        if any(not s for s in strings):
            raise OutputError("stop cannot contain an empty string.", "")
        ids = body.get("stop_token_ids")
        if ids is None:
            token_ids: frozenset[int] = frozenset()
        elif isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                           for i in ids):
            token_ids = frozenset(ids)
        else:
            raise OutputError("stop_token_ids must be a list of integers.", "stop_token_ids")
        include = body.get("include_stop_str_in_output", False)
        if not isinstance(include, bool):
            raise OutputError("include_stop_str_in_output must be a boolean.",
                              "include_stop_str_in_output")
        return cls(strings, token_ids, include, min_tokens)


@dataclass
class OutputText:
    """A request's output as its API server sees it token by token: the text, where a stop
    string or stop token ended it, and the text held back from a stream while it might still
    turn into a stop string (vLLM's `stop_buffer_length`). The text is decoded when read (on
    every token only while stop strings are being looked for)."""

    decode: Callable[[list[int]], str]
    spec: StopSpec
    eos: int
    ids: list[int] = field(default_factory=list)
    stop_reason: str | int | None = None
    stopped: bool = False
    """A stop string or stop token id ended it (the engine must stop the request)."""
    _text: str = ""
    _covers: int = 0
    """Output ids `_text` is decoded from."""
    _wanted: int = 0
    """Output ids the text is of: all, but a stop token left out of it."""
    _sent: int = 0

    @property
    def text(self) -> str:
        if self._covers != self._wanted:
            eos = self.eos
            self._text = self.decode([i for i in self.ids[:self._wanted] if i != eos])
            self._covers = self._wanted
        return self._text

    @property
    def _held(self) -> int:
        strings = self.spec.strings
        return max(map(len, strings)) - 1 if strings and not self.spec.include else 0

    def add(self, new_ids: Sequence[int]) -> int:
        """Take the engine's new tokens; how many of them the answer keeps (those after a
        stop are dropped)."""
        kept = 0
        strings = self.spec.strings
        for token in new_ids:
            if self.stopped:
                break
            self.ids.append(token)
            kept += 1
            past_min = len(self.ids) > self.spec.min_tokens
            if token in self.spec.token_ids and past_min:
                self.stopped, self.stop_reason = True, token
                self._wanted = len(self.ids) if self.spec.include else len(self.ids) - 1
                continue
            if strings and past_min:
                before = len(self.text)
                self._wanted = len(self.ids)
                self._check_strings(len(self.text) - before)
            else:
                self._wanted = len(self.ids)
        return kept

    def _check_strings(self, new_chars: int) -> None:
        if new_chars <= 0:
            return
        text = self.text
        best: tuple[int, int, str] | None = None
        for s in self.spec.strings:
            at = text.find(s, max(0, len(text) - new_chars - len(s) + 1))
            if at != -1 and (best is None or at + len(s) < best[0]):
                best = (at + len(s), at, s)
        if best is None:
            return
        end, at, s = best
        self.stopped, self.stop_reason = True, s
        self._text = text[:end] if self.spec.include else text[:at]

    def delta(self, finished: bool) -> str:
        """The text not yet sent that may be sent now."""
        text = self.text
        upto = len(text) if finished or self.stopped else max(0, len(text) - self._held)
        if upto <= self._sent:
            return ""
        out = text[self._sent:upto]
        self._sent = upto
        return out


class Logprobs:
    """Made-up logprobs for sampled tokens, deterministic per request and position."""

    def __init__(self, seed: int, decode: Callable[[list[int]], str], vocab: Sequence[int],
                 top: int) -> None:
        self.seed = seed
        self.decode = decode
        self.vocab = vocab
        self.top = top

    def _step(self, position: int, token: int) -> list[tuple[int, float]]:
        """The step's top tokens, most likely first: the sampled one, then others."""
        rng = random.Random(self.seed * 1_000_003 + position)
        lp = -rng.expovariate(4.0)
        out = [(token, lp)]
        while len(out) < max(1, self.top):
            other = self.vocab[rng.randrange(len(self.vocab))]
            if other != token and all(other != t for t, _ in out):
                lp -= rng.expovariate(1.0) + 1e-3
                out.append((other, lp))
        return out

    def _piece(self, token: int, lp: float) -> dict[str, Any]:
        text = self.decode([token])
        return {"token": text, "logprob": max(lp, -9999.0),
                "bytes": list(text.encode("utf-8", errors="replace"))}

    def chat(self, start: int, tokens: Sequence[int]) -> dict[str, Any]:
        """A chat choice's `logprobs` for `tokens`, the output's from position `start`."""
        content = []
        for i, t in enumerate(tokens):
            step = self._step(start + i, t)
            entry = self._piece(t, step[0][1])
            entry["top_logprobs"] = [self._piece(o, lp) for o, lp in step[:self.top]]
            content.append(entry)
        return {"content": content}

    def completion(self, start: int, tokens: Sequence[int], offset: int) -> dict[str, Any]:
        """A completion choice's `logprobs` for `tokens` (text offsets from `offset`)."""
        text_offset, token_logprobs, names, top = [], [], [], []
        for i, t in enumerate(tokens):
            step = self._step(start + i, t)
            name = self.decode([t])
            text_offset.append(offset)
            offset += len(name)
            names.append(name)
            token_logprobs.append(max(step[0][1], -9999.0))
            top.append({self.decode([o]): max(lp, -9999.0) for o, lp in step[:self.top]})
        return {"text_offset": text_offset, "token_logprobs": token_logprobs, "tokens": names,
                "top_logprobs": top}


def chat_logprobs(body: dict[str, Any]) -> int | None:
    """The top-logprob count a chat request asks (None: no logprobs)."""
    asked = body.get("logprobs")
    top = body.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int)):
        raise OutputError("top_logprobs must be an integer.", "top_logprobs")
    if top is not None and top < 0 and top != -1:
        raise OutputError("`top_logprobs` must be a positive value or -1.", "top_logprobs")
    if top is not None and (top == -1 or top > 0) and not asked:
        raise OutputError("when using `top_logprobs`, `logprobs` must be set to true.",
                          "top_logprobs")
    if asked is not None and not isinstance(asked, bool):
        raise OutputError("logprobs must be a boolean.", "logprobs")
    if not asked:
        return None
    n = top or 0
    if n == -1 or n > MAX_LOGPROBS:  # -1: the whole vocabulary
        raise OutputError(f"Requested sample logprobs of {n}, which is greater than max "
                          f"allowed: {MAX_LOGPROBS}", "logprobs")
    return n


def completion_logprobs(body: dict[str, Any]) -> int | None:
    """The top-logprob count a completion request asks (None: no logprobs)."""
    n = body.get("logprobs")
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, int):
        raise OutputError("logprobs must be an integer.", "logprobs")
    if n < 0 and n != -1:
        raise OutputError("`logprobs` must be a positive value or -1.", "logprobs")
    if n == -1 or n > MAX_LOGPROBS:  # -1: the whole vocabulary
        raise OutputError(f"Requested sample logprobs of {n}, which is greater than max "
                          f"allowed: {MAX_LOGPROBS}", "logprobs")
    return n


# -- output forced into a shape ---------------------------------------------------------------

@dataclass(frozen=True)
class Forced:
    """An answer a real engine's structured-output decoding would force: the text the model
    generates, and the tool call it stands for (None: `response_format`, the text is the
    answer)."""

    text: str
    tool: str | None = None
    arguments: str = ""
    required: bool = False
    """`tool_choice: "required"`: the model writes a JSON array of `{"name", "parameters"}`
    and the call finishes with `tool_calls`; a named tool's arguments are the text, and the
    call finishes with `stop`."""

    def tool_call(self, rid: str, text: str) -> dict[str, Any]:
        """The message's `tool_calls` entry, from the text the model got to write (all of it
        unless `max_tokens` cut it short)."""
        assert self.tool is not None
        arguments = self.arguments if text == self.text else (text if not self.required
                                                              else "")
        return {"id": tool_call_id(rid), "type": "function",
                "function": {"name": self.tool, "arguments": arguments}}


def tool_call_id(rid: str) -> str:
    """vLLM's `chatcmpl-tool-` ids, made deterministic per request."""
    return f"chatcmpl-tool-{uuid.uuid5(uuid.NAMESPACE_OID, rid).hex}"


def forced_output(body: dict[str, Any], seed: int) -> Forced | None:
    """The shape a chat request's `tool_choice` or `response_format` forces, if any."""
    rng = random.Random(seed)
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is not None and isinstance(tools, list) and not tools:
        raise OutputError("`tools` must not be an empty array.", "tools")
    functions = {}
    for t in tools or []:
        f = t.get("function") if isinstance(t, dict) else None
        if isinstance(f, dict) and isinstance(f.get("name"), str):
            functions[f["name"]] = f.get("parameters") or {"type": "object"}
    if choice == "required" or isinstance(choice, dict):
        if not functions:
            raise OutputError("When using `tool_choice`, `tools` must be set.", "tool_choice")
        if isinstance(choice, dict):
            f = choice.get("function")
            name = f.get("name") if isinstance(f, dict) else None
            if name not in functions:
                raise OutputError(f"Tool '{name}' has not been passed in `tools`.",
                                  "tool_choice")
            arguments = json.dumps(example(functions[name], rng))
            return Forced(arguments, name, arguments)
        name = sorted(functions)[rng.randrange(len(functions))]
        parameters = example(functions[name], rng)
        return Forced(json.dumps([{"name": name, "parameters": parameters}]), name,
                      json.dumps(parameters), required=True)
    fmt = body.get("response_format")
    if isinstance(fmt, dict):
        kind = fmt.get("type")
        if kind == "json_object":
            return Forced(json.dumps(example({"type": "object"}, rng)))
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            return Forced(json.dumps(example(schema if isinstance(schema, dict) else {}, rng)))
    return None


_WORDS = ("alpha", "delta", "river", "stone", "maple", "orbit", "cedar", "lumen")

MAX_ITEMS = 16
"""An array made for a schema holds at most this many items (and a string at most
`MAX_CHARS` characters), whatever its `minItems`/`minLength` ask: a real engine would stop at
`max_tokens` anyway, and a schema asking millions froze the server while it was built."""
MAX_CHARS = 256


def example(schema: dict[str, Any], rng: random.Random, depth: int = 0,
            root: dict[str, Any] | None = None) -> Any:
    """A value valid against a JSON schema's common keywords (type, properties, required,
    items, enum, const, anyOf/oneOf/allOf, local `$ref`s to `$defs`/`definitions`, minimum,
    maximum and their exclusive forms, min/maxItems, min/maxLength)."""
    if not isinstance(schema, dict) or depth > 8:
        return None
    root = schema if root is None else root
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target: Any = root
        for part in ref[2:].split("/"):
            target = target.get(part) if isinstance(target, dict) else None
        return example(target if isinstance(target, dict) else {}, rng, depth + 1, root)
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][rng.randrange(len(schema["enum"]))]
    for key in ("anyOf", "oneOf", "allOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            return example(options[0], rng, depth + 1, root)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        kind = "object" if "properties" in schema or "required" in schema else "string"
    if kind == "object":
        props = schema.get("properties")
        props = props if isinstance(props, dict) else {}
        required = schema.get("required")
        names = list(props) if not isinstance(required, list) else [
            n for n in props if n in required] + [
            n for n in required if isinstance(n, str) and n not in props]
        return {n: example(props.get(n, {"type": "string"}), rng, depth + 1, root)
                for n in names}
    if kind == "array":
        least = _bound(schema.get("minItems"), 1)
        most = _bound(schema.get("maxItems"), max(least, 2))
        count = min(max(least, min(2, most)), MAX_ITEMS)
        return [example(schema.get("items") or {}, rng, depth + 1, root) for _ in range(count)]
    if kind in ("integer", "number"):
        return _number_in(schema, rng, kind == "integer")
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    word = _WORDS[rng.randrange(len(_WORDS))]
    least = min(_bound(schema.get("minLength"), 0), MAX_CHARS)
    most = _bound(schema.get("maxLength"), max(least, 64))
    return (word * (least // len(word) + 1))[:max(least, min(len(word), most))]


def _bound(value: Any, default: int) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        else default


def _number_in(schema: dict[str, Any], rng: random.Random, integer: bool) -> int | float:
    """A number within the schema's bounds (inclusive and exclusive)."""
    lo, hi = -math.inf, math.inf
    for key, strict in (("minimum", False), ("exclusiveMinimum", True)):
        v = schema.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool):
            lo = max(lo, v + (1 if integer else 1e-6) if strict else v)
    for key, strict in (("maximum", False), ("exclusiveMaximum", True)):
        v = schema.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool):
            hi = min(hi, v - (1 if integer else 1e-6) if strict else v)
    if integer:
        low = math.ceil(lo) if lo > -math.inf else 0
        high = math.floor(hi) if hi < math.inf else low + 9
        return low if high <= low else low + rng.randrange(min(high - low, 9) + 1)
    start = lo if lo > -math.inf else 0.0
    stop = hi if hi < math.inf else start + 10.0
    return start if stop <= start else start + rng.random() * (stop - start)
