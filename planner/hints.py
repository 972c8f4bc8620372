"""What a plain OpenAI call tells the planner about its place in a workflow (hint mode).

Agents that drive their own loop send ordinary chat/completions calls annotated with
`X-KVGate-*` headers or `extra_body={"kvgate": {...}}`, or the vocabularies agents already send
(Dynamo's `nvext.agent_hints`, `x-session-id`). The gateway parses them into `RequestHints`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RequestHints:
    """A call's workflow annotations; every field is optional."""

    workflow: str | None = None
    """The workflow the call belongs to (`X-KVGate-Workflow`, `kvgate.workflow`)."""
    task: str | None = None
    """The call's task id within the workflow (`X-KVGate-Task`, `kvgate.task`)."""
    after: tuple[str, ...] = ()
    """Task ids of the workflow whose outputs this call extends (`X-KVGate-After`)."""
    expect_children: int | None = None
    """How many calls will extend this call's context (`X-KVGate-Expect-Children`)."""
    priority: int | None = None
    """Lower runs first, as vLLM's `priority` (`X-KVGate-Priority`, `kvgate.priority`,
    `nvext.agent_hints.priority`)."""
    deadline_s: float | None = None
    """Seconds from arrival by which the caller wants the answer (`X-KVGate-Deadline`,
    `kvgate.deadline_s`)."""
    osl: int | None = None
    """Expected output length in tokens (`nvext.agent_hints.osl`)."""
    session: str | None = None
    """A session id (`x-session-id`, or the body's `user`)."""

    @property
    def in_workflow(self) -> bool:
        """The call named a workflow (it shows up in `GET /v1/workflows/{id}`)."""
        return self.workflow is not None


class HintError(ValueError):
    """A hint that cannot be read; the message names the header or field and the problem."""


WORKFLOW_HEADER = "x-kvgate-workflow"
TASK_HEADER = "x-kvgate-task"
AFTER_HEADER = "x-kvgate-after"
EXPECT_CHILDREN_HEADER = "x-kvgate-expect-children"
PRIORITY_HEADER = "x-kvgate-priority"
DEADLINE_HEADER = "x-kvgate-deadline"
SESSION_HEADER = "x-session-id"
BODY_FIELD = "kvgate"
"""`extra_body={"kvgate": {...}}`: read, then stripped before the body reaches the engine."""
MAX_AFTER_HEADER = 2048
"""Clients of the gateway's own (its workflow runner, the SDK) send a call's parents in
`X-KVGate-After` up to this many characters, else in the body's `kvgate.after`: HTTP servers cap
a header field (aiohttp at 8,190 bytes), and a proxy in front of the gateway may cap lower."""

_BODY_KEYS = frozenset({"workflow", "task", "after", "expect_children", "priority", "deadline_s"})
_MAX_ID = 256

MAX_TOKENS = 2**31 - 1
"""The largest output length (`max_tokens`, `osl`, a task's `output_tokens`) the planner takes
as an estimate; vLLM's own limit is the model's context, far below."""
PRIORITY_LIMIT = 1_000_000
"""An explicit priority lies within +-this (the engine's integer priority spends 10**12 per
unit on the workflow's rank beneath it, `planner.priorities.EXPLICIT_UNIT`)."""
MAX_EXPECT_CHILDREN = 1000
"""A call announcing more children counts as announcing this many: the planner prepares at
most this many destinations for a fan-out (a workflow spec's default task limit)."""


def lax_int(value: object) -> int | None:
    """`value` as pydantic's lax mode reads it into vLLM's `priority: int` field, else None."""
    if isinstance(value, bool | int):
        return int(value)
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            try:
                f = float(value)
            except ValueError:
                return None
            return int(f) if f.is_integer() else None
    return None


def _ident(value: object, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise HintError(f"{where} must be a non-empty string")
    value = value.strip()
    if len(value) > _MAX_ID:
        raise HintError(f"{where} is longer than {_MAX_ID} characters")
    try:
        value.encode()
    except UnicodeEncodeError:
        # Bytes that are no UTF-8 (a header's, kept as surrogates): no store or trace id
        # can be made of them.
        raise HintError(f"{where} must be UTF-8 text") from None
    return value


MAX_AFTER = 1000
"""The most parents one call may name (the workflow API's default `max_tasks`): the list is kept
with the task's record and each of its events for the workflow's lifetime."""


def _ids(value: object, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        parts: list[object] = [p for p in value.split(",") if p.strip()]
    elif isinstance(value, list):
        parts = list(value)
    else:
        raise HintError(f"{where} must be a list of task ids or a comma-separated string")
    ids = tuple(dict.fromkeys(_ident(p, where) for p in parts))
    if len(ids) > MAX_AFTER:
        raise HintError(f"{where} names {len(ids)} tasks; a call may name at most {MAX_AFTER}")
    return ids


def _int(value: object, where: str, low: int, high: int) -> int:
    if isinstance(value, str):
        text = value.strip()
        if len(text) > 24:
            raise HintError(f"{where} must be an integer from {low} to {high}")
        try:
            value = int(text)
        except ValueError:
            raise HintError(f"{where} must be an integer, got {value!r}") from None
    if type(value) is not int:
        raise HintError(f"{where} must be an integer")
    if not low <= value <= high:
        shown = str(value) if len(str(value)) <= 24 else f"{str(value)[:20]}..."
        raise HintError(f"{where} must be an integer from {low} to {high}, got {shown}")
    return value


def _priority(value: object, where: str) -> int:
    return _int(value, where, -PRIORITY_LIMIT, PRIORITY_LIMIT)


def _seconds(value: object, where: str) -> float:
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise HintError(f"{where} must be a number of seconds, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise HintError(f"{where} must be a positive number of seconds")
    try:
        seconds = float(value)
    except OverflowError:  # an integer past any float
        raise HintError(f"{where} must be a positive number of seconds, not {len(str(value))} "
                        "digits") from None
    if seconds == float("inf"):
        raise HintError(f"{where} must be a positive number of seconds")
    return seconds


def parse_hints(headers: Mapping[str, str], body: dict[str, Any]
                ) -> tuple[RequestHints, dict[str, Any] | None]:
    """Read a call's hints from its headers and body; the body to forward instead (the
    `kvgate` field removed) or None when it goes unchanged.

    Sources, later ones winning field by field: `X-KVGate-*` headers, then the body's
    `kvgate` object (the client's own code, closest to the call), with Dynamo's
    `nvext.agent_hints` (`priority`, vLLM's convention, lower first; `osl`) for what those
    leave unset. `nvext` is forwarded untouched: vLLM ignores fields it does not know.
    The session is `x-session-id`, else the body's `user`. Raises `HintError` on a bad value.
    """
    get = headers.get
    workflow = get(WORKFLOW_HEADER)
    task = get(TASK_HEADER)
    after_h = get(AFTER_HEADER)
    expect_h = get(EXPECT_CHILDREN_HEADER)
    fields: dict[str, Any] = {}
    if workflow is not None:
        fields["workflow"] = _ident(workflow, "header X-KVGate-Workflow")
    if task is not None:
        fields["task"] = _ident(task, "header X-KVGate-Task")
    if after_h is not None:
        fields["after"] = _ids(after_h, "header X-KVGate-After")
    if expect_h is not None:
        fields["expect_children"] = min(MAX_EXPECT_CHILDREN, _int(
            expect_h, "header X-KVGate-Expect-Children", 0, MAX_TOKENS))
    priority_h = get(PRIORITY_HEADER)
    if priority_h is not None:
        fields["priority"] = _priority(priority_h, "header X-KVGate-Priority")
    deadline_h = get(DEADLINE_HEADER)
    if deadline_h is not None:
        fields["deadline_s"] = _seconds(deadline_h, "header X-KVGate-Deadline")
    nvext = body.get("nvext")
    if isinstance(nvext, dict):
        agent = nvext.get("agent_hints")
        if agent is not None:
            if not isinstance(agent, dict):
                raise HintError("nvext.agent_hints must be an object")
            if agent.get("priority") is not None:
                priority = _priority(agent["priority"], "nvext.agent_hints.priority")
                fields.setdefault("priority", priority)
            if agent.get("osl") is not None:
                fields["osl"] = _int(agent["osl"], "nvext.agent_hints.osl", 0, MAX_TOKENS)
    forwarded = None
    if BODY_FIELD in body:
        ours = body[BODY_FIELD]
        if not isinstance(ours, dict):
            raise HintError("body field `kvgate` must be an object")
        unknown = sorted(set(ours) - _BODY_KEYS)
        if unknown:
            raise HintError(f"body field `kvgate` has unknown keys: {', '.join(unknown)}; "
                            f"known: {', '.join(sorted(_BODY_KEYS))}")
        for key in ("workflow", "task"):
            if ours.get(key) is not None:
                fields[key] = _ident(ours[key], f"kvgate.{key}")
        if ours.get("after") is not None:
            fields["after"] = _ids(ours["after"], "kvgate.after")
        if ours.get("expect_children") is not None:
            fields["expect_children"] = min(MAX_EXPECT_CHILDREN, _int(
                ours["expect_children"], "kvgate.expect_children", 0, MAX_TOKENS))
        if ours.get("priority") is not None:
            fields["priority"] = _priority(ours["priority"], "kvgate.priority")
        if ours.get("deadline_s") is not None:
            if isinstance(ours["deadline_s"], str):
                raise HintError("kvgate.deadline_s must be a positive number of seconds")
            fields["deadline_s"] = _seconds(ours["deadline_s"], "kvgate.deadline_s")
        forwarded = {k: v for k, v in body.items() if k != BODY_FIELD}
    session = get(SESSION_HEADER)
    if session is None and isinstance(body.get("user"), str):
        session = body["user"]
    if session:
        fields["session"] = session
    if ("task" in fields or "after" in fields) and "workflow" not in fields:
        raise HintError("a task id or `after` needs a workflow id (X-KVGate-Workflow or "
                        "kvgate.workflow)")
    if "task" in fields and fields["task"] in fields.get("after", ()):
        # A task cannot run after itself: an agent that names each turn's task the same
        # (`after` it too) means its earlier call, which the record keeps as the same task.
        fields["after"] = tuple(t for t in fields["after"] if t != fields["task"])
    return (RequestHints(**fields) if fields else NO_HINTS), forwarded


NO_HINTS = RequestHints()


def names_a_store_key(workflow_id: str) -> bool:
    """The id would name one of the Redis workflow store's own keys (`{ns}:wf:index`,
    `:running`, a workflow's `:ev` stream or `:lease`), or is a path segment a URL resolves
    away (`.`, `..`: `GET /v1/workflows/..` could never read it), so no workflow may have it,
    in either store (the gateway refuses it; the SDK, where the id is set)."""
    return (workflow_id in ("index", "running", ".", "..")
            or workflow_id.endswith((":ev", ":lease")))
