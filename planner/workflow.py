"""The workflow spec: a task DAG whose prompts are built from tagged segments (sans-IO).

One document, JSON or YAML, read by the benchmark and accepted by `POST /v1/workflows`.
Segments are static (system prompt, tools: long-lived, shared across tasks and workflows), shared
(a parent's context several children extend) or transient (one branch's reasoning). Tasks list
their messages as segment references, literal messages, or the output of an earlier task.
Validation names the problem: unknown ids, cycles, dangling `output_of`, an empty DAG.
`runnable_problems` adds what a live run needs (real text, ids fit for headers), and
`render_task` turns a ready task and its parents' outputs into an OpenAI chat body.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from math import isfinite
from typing import Any, Literal

import networkx as nx
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from planner.events import TaskSpec
from planner.hints import MAX_AFTER, MAX_TOKENS, PRIORITY_LIMIT
from planner.segments import SYSTEM_ROLES

SegmentKind = Literal["static", "shared", "transient"]


class WorkflowError(ValueError):
    """A workflow spec that cannot run; the message names every problem found."""


MAX_SEGMENT_TOKENS = 10_000_000
"""A synthetic segment's largest size (the longest contexts served are 1M tokens; a size
beyond this was a mistake that built its token list until memory ran out)."""


ChatRole = Literal["system", "developer", "user", "assistant", "tool"]
"""The roles of OpenAI's chat messages that vLLM's chat templates render."""

MAX_SALT = 128
"""vLLM's longest `cache_salt` (which also may not hold `@`, `/`, `\\` or NUL)."""


def _check_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    for i, tool in enumerate(tools or ()):
        function = tool.get("function")
        if (tool.get("type") != "function" or not isinstance(function, dict)
                or not isinstance(function.get("name"), str) or not function["name"]):
            raise ValueError(f"tool {i} must be {{\"type\": \"function\", \"function\": "
                             "{\"name\": ..., ...}} (OpenAI's tool shape, which vLLM takes)")
    return tools


class Segment(BaseModel):
    """A reusable piece of prompt: text (or a synthetic size) and optionally tool definitions."""

    model_config = ConfigDict(extra="forbid")

    kind: SegmentKind
    role: ChatRole = "system"
    content: str | None = None
    tools: list[dict[str, Any]] | None = None
    tokens: int | None = Field(default=None, gt=0, le=MAX_SEGMENT_TOKENS)
    """Synthetic size for benchmarks: deterministic tokens, the same for the same segment."""

    @model_validator(mode="after")
    def _has_substance(self) -> Segment:
        if self.content is None and self.tools is None and self.tokens is None:
            raise ValueError("a segment needs content, tools or tokens")
        _check_tools(self.tools)
        return self


class SegmentRef(BaseModel):
    """`{"segment": NAME}`: the named segment, as a message."""

    model_config = ConfigDict(extra="forbid")

    segment: str


class LiteralMessage(BaseModel):
    """`{"role": ..., "content": ...}`: an ordinary chat message."""

    model_config = ConfigDict(extra="forbid")

    role: ChatRole
    content: str


class OutputOf(BaseModel):
    """`{"output_of": TASK_ID}`: an earlier task's output, as an assistant (or user) message."""

    model_config = ConfigDict(extra="forbid")

    output_of: str
    role: Literal["assistant", "user"] = "assistant"


TaskMessage = SegmentRef | LiteralMessage | OutputOf


MAX_THINK_TIME_S = 86_400.0
"""The longest tool-call gap a task may declare (a day)."""


class Task(BaseModel):
    """One LLM call in the DAG."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1)
    after: list[str] = Field(default_factory=list)
    messages: list[TaskMessage] = Field(min_length=1)
    tools: str | None = None
    """Name of a segment whose `tools` the call offers."""
    max_tokens: int | None = Field(default=None, gt=0, le=MAX_TOKENS)
    output_tokens: int | None = Field(default=None, gt=0, le=MAX_TOKENS)
    """Synthetic output length for benchmarks (the engine is asked for exactly this many)."""
    think_time_s: float = Field(default=0.0, ge=0, le=MAX_THINK_TIME_S, allow_inf_nan=False)
    """A tool-call gap after the task's dependencies finish, before it may start."""
    priority: int = Field(default=0, ge=-PRIORITY_LIMIT, le=PRIORITY_LIMIT)
    params: dict[str, Any] = Field(default_factory=dict)
    """Extra OpenAI request fields (temperature, ...)."""

    @model_validator(mode="after")
    def _finite_params(self) -> Task:
        bad = [k for k, v in self.params.items() if isinstance(v, float) and not isfinite(v)]
        if bad:
            raise ValueError(f"params {', '.join(sorted(bad))}: a number must be finite")
        return self


class Workflow(BaseModel):
    """A validated workflow: segments, tasks, and the DAG they form."""

    model_config = ConfigDict(extra="forbid")

    id: str | None = None
    model: str = Field(min_length=1)
    tenant: str | None = Field(default=None, min_length=1, max_length=MAX_SALT)
    """Its calls' `cache_salt` (vLLM takes no empty salt, nor one longer than 128 characters
    or holding `@`, `/`, `\\` or NUL)."""
    deadline_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    segments: dict[str, Segment] = Field(default_factory=dict)
    tasks: list[Task]

    @field_validator("tenant")
    @classmethod
    def _salt_vllm_takes(cls, tenant: str | None) -> str | None:
        if tenant is not None and any(c in tenant for c in "@/\\\x00"):
            raise ValueError("the tenant becomes its calls' cache_salt, which vLLM refuses "
                             "with `@`, `/`, `\\` or NUL in it")
        return tenant

    @model_validator(mode="after")
    def _valid_dag(self) -> Workflow:
        problems = _dag_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def graph(self) -> nx.DiGraph:
        """Edges from each task to the tasks that wait for it (`after` and `output_of`)."""
        g = nx.DiGraph()
        for t in self.tasks:
            g.add_node(t.id)
            for dep in dependencies(t):
                g.add_edge(dep, t.id)
        return g

    def topological_order(self) -> list[str]:
        """Task ids so that every task comes after everything it depends on (stable)."""
        order = {t.id: i for i, t in enumerate(self.tasks)}
        return list(nx.lexicographical_topological_sort(self.graph(), key=order.__getitem__))

    def task(self, task_id: str) -> Task:
        """The task with this id."""
        for t in self.tasks:
            if t.id == task_id:
                return t
        raise KeyError(task_id)


CHARS_PER_TOKEN = 4
"""For the planner's priorities only: a task's prompt length estimated from its text."""

DEFAULT_OUTPUT_TOKENS = 128


def static_segment_name(spec: Workflow, task: Task, namespace: str = "") -> str:
    """A name for the static segment `task`'s prompt opens with (the tools it offers and a
    leading system or static message), equal for equal content within `namespace` (a
    tenant: its prompts are cached apart); "" if it opens with none."""
    parts: list[str] = []
    if task.tools is not None:
        parts.append(json.dumps(spec.segments[task.tools].tools, sort_keys=True))
    lead = task.messages[0]
    if isinstance(lead, SegmentRef):
        seg = spec.segments[lead.segment]
        if seg.kind == "static" or seg.role in SYSTEM_ROLES:
            body = seg.content if seg.content is not None else f"<{seg.tokens} tokens of "\
                f"{lead.segment}>"
            parts.append(f"{seg.role}:{body}:{json.dumps(seg.tools, sort_keys=True)}")
    elif isinstance(lead, LiteralMessage) and lead.role in SYSTEM_ROLES:
        parts.append(f"{lead.role}:{lead.content}")
    if not parts:
        return ""
    digest = hashlib.sha256("\0".join([namespace, *parts]).encode()).hexdigest()
    return digest[:24]


def task_specs(spec: Workflow, namespace: str = "") -> tuple[TaskSpec, ...]:
    """What the planner needs of each task ahead: its dependencies and estimated sizes (prompt
    text at `CHARS_PER_TOKEN`, parents' outputs at their output limits), for its priorities,
    and the static segment it opens with, for replication (`namespace`: the tenant)."""
    out_tokens = {t.id: task_length(t) or DEFAULT_OUTPUT_TOKENS
                  for t in spec.tasks}
    specs = []
    for t in spec.tasks:
        chars = 0
        prompt = 0
        for m in t.messages:
            if isinstance(m, SegmentRef):
                seg = spec.segments[m.segment]
                chars += len(seg.content or "") + len(json.dumps(seg.tools or []))
            elif isinstance(m, LiteralMessage):
                chars += len(m.content)
            elif isinstance(m, OutputOf):
                prompt += out_tokens[m.output_of]
        specs.append(TaskSpec(t.id, dependencies(t), prompt + chars // CHARS_PER_TOKEN,
                              out_tokens[t.id], t.think_time_s,
                              static_segment_name(spec, t, namespace)))
    return tuple(specs)


def dependencies(task: Task) -> tuple[str, ...]:
    """Every task this one waits for: its `after` list, then the tasks whose output it uses."""
    deps = list(task.after)
    deps += [m.output_of for m in task.messages if isinstance(m, OutputOf)]
    return tuple(dict.fromkeys(deps))


def _dag_problems(wf: Workflow) -> list[str]:
    problems: list[str] = []
    if not wf.tasks:
        return ["the workflow has no tasks"]
    ids = [t.id for t in wf.tasks]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        problems.append(f"duplicate task ids: {', '.join(dupes)}")
    known = set(ids)
    for t in wf.tasks:
        for dep in t.after:
            if dep not in known:
                problems.append(f"task {t.id!r} runs after unknown task {dep!r}")
        for m in t.messages:
            if isinstance(m, OutputOf) and m.output_of not in known:
                problems.append(f"task {t.id!r} uses the output of unknown task {m.output_of!r}")
            if isinstance(m, SegmentRef) and m.segment not in wf.segments:
                problems.append(f"task {t.id!r} refers to unknown segment {m.segment!r}")
        if t.tools is not None:
            seg = wf.segments.get(t.tools)
            if seg is None:
                problems.append(f"task {t.id!r} takes tools from unknown segment {t.tools!r}")
            elif not seg.tools:
                problems.append(f"task {t.id!r} takes tools from segment {t.tools!r}, "
                                "which defines none")
    if problems:
        return problems
    cycle = a_cycle(wf.graph())
    if cycle is None:
        return []
    path = " -> ".join([*cycle, cycle[0]])
    return [f"the task graph has a cycle: {path}"]


def a_cycle(g: nx.DiGraph) -> list[str] | None:
    """The nodes of one cycle of `g`, in order, or None: one depth-first pass, linear in its
    size (networkx's `find_cycle` walks on from every start through nodes it had explored:
    a chain of 1,000 tasks listed in reverse took 6 s, the event loop held meanwhile)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in g:
        if root in state:
            continue
        path: list[str] = [root]
        at: dict[str, int] = {root: 0}
        state[root] = 1
        stack = [iter(g.successors(root))]
        while stack:
            child = next(stack[-1], None)
            if child is None:
                stack.pop()
                done = path.pop()
                del at[done]
                state[done] = 2
                continue
            seen = state.get(child)
            if seen == 1:
                return path[at[child]:]
            if seen is None:
                state[child] = 1
                at[child] = len(path)
                path.append(child)
                stack.append(iter(g.successors(child)))
    return None


def load_workflow(data: Any, source: str = "workflow") -> Workflow:
    """Validate a parsed JSON/YAML document; WorkflowError lists every problem with its path."""
    if not isinstance(data, dict):
        raise WorkflowError(f"{source}: a workflow must be a JSON object")
    try:
        return Workflow.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"{source}: {loc + ': ' if loc else ''}{msg}")
        raise WorkflowError("\n".join(lines)) from None


# -- running a spec for real ----------------------------------------------------------------------

TASK_ID = re.compile(r"[A-Za-z0-9._:@+=-]{1,128}")
"""Task ids a live run accepts: they travel in `X-KVGate-Task`/`X-KVGate-After` headers
(comma-separated) and in request ids (`WORKFLOW/TASK`)."""

WORKFLOW_ID = re.compile(r"[!-.0-~]([ -.0-~]{0,126}[!-.0-~])?")
"""A live workflow's id: it travels in headers (no control characters, nothing a header
strips) and in `/v1/workflows/{id}` paths (no `/`)."""

RESERVED_PARAMS = frozenset({"model", "messages", "tools", "stream", "stream_options", "n",
                             "kvgate", "cache_salt", "kv_transfer_params"})
"""Request fields the spec itself decides; a task's `params` may not set them (`cache_salt`:
the workflow's `tenant` is its calls' salt, and no task runs outside it; `kv_transfer_params`:
the gateway moves KV between engines itself). The output's length in `params` is taken, but
the task's own `max_tokens` / `output_tokens` win over it (`render_task`)."""


def runnable_problems(wf: Workflow) -> list[str]:
    """Why a valid spec cannot run against real engines (empty when it can): synthetic `tokens`
    segments, segments without text used as messages, task ids unfit for headers, reserved
    `params`."""
    problems: list[str] = []
    if wf.id is not None and not WORKFLOW_ID.fullmatch(wf.id):
        problems.append(f"workflow id {wf.id!r} may hold printable ASCII but `/`, without "
                        "spaces around it (at most 128 characters)")
    synthetic = sorted(name for name, seg in wf.segments.items() if seg.tokens is not None)
    if synthetic:
        problems.append(f"segments {', '.join(repr(n) for n in synthetic)} have synthetic "
                        "`tokens`; a live workflow needs `content` (and/or `tools`)")
    for t in wf.tasks:
        if not TASK_ID.fullmatch(t.id):
            problems.append(f"task id {t.id!r} may hold only letters, digits and . _ : @ + = - "
                            "(at most 128)")
        for m in t.messages:
            if isinstance(m, SegmentRef):
                seg = wf.segments[m.segment]
                if seg.content is None and seg.tokens is None:
                    problems.append(f"task {t.id!r} uses segment {m.segment!r} as a message, "
                                    "but it has no content")
        reserved = sorted(RESERVED_PARAMS & t.params.keys())
        if reserved:
            problems.append(f"task {t.id!r}: params may not set {', '.join(reserved)}")
        waits = len(dependencies(t))
        if waits > MAX_AFTER:
            problems.append(f"task {t.id!r} waits for {waits} tasks; a call may name at most "
                            f"{MAX_AFTER} parents")
    return problems


def call_size_floors(wf: Workflow) -> dict[str, int]:
    """Per task, about how many bytes its call body takes before its parents' outputs are in it
    (`render_task` with every output empty), without rendering it: each segment is measured
    once, however many tasks use it."""
    sizes: dict[tuple[str, str], int] = {}

    def segment(name: str, part: str) -> int:
        if (part, name) not in sizes:
            seg = wf.segments[name]
            value = seg.content if part == "content" else seg.tools
            sizes[part, name] = len(json.dumps(value)) if value is not None else 0
        return sizes[part, name]

    floors: dict[str, int] = {}
    for task in wf.tasks:
        size = len(json.dumps({"model": wf.model, "cache_salt": wf.tenant, **task.params}))
        for m in task.messages:
            size += 32  # the message's own keys and role
            if isinstance(m, SegmentRef):
                size += segment(m.segment, "content")
            elif isinstance(m, LiteralMessage):
                size += len(json.dumps(m.content))
        if task.tools is not None:
            size += segment(task.tools, "tools")
        floors[task.id] = size
    return floors


def render_task(wf: Workflow, task_id: str, outputs: Mapping[str, str],
                limit: int | None = None) -> dict[str, Any]:
    """The OpenAI chat body for one task: its messages (segments, literal messages, parents'
    outputs from `outputs`), tools, `max_tokens` and `params`; the tenant becomes `cache_salt`
    so tenants never share cached prefixes. `output_tokens` asks for exactly that many tokens
    (vLLM's `ignore_eos`). With `limit`, WorkflowError before the body is built when its
    parents' outputs would make it larger than that many bytes (a task naming one parent's
    output thousands of times built a body of gigabytes)."""
    task = wf.task(task_id)
    if limit is not None:
        size = sum(len(outputs.get(m.output_of, "")) for m in task.messages
                   if isinstance(m, OutputOf))
        if size > limit:
            raise WorkflowError(f"task {task_id!r}: its parents' outputs alone would make its "
                                f"call {size} bytes; the gateway takes calls of at most "
                                f"{limit} bytes")
    messages: list[dict[str, Any]] = []
    for m in task.messages:
        if isinstance(m, SegmentRef):
            seg = wf.segments[m.segment]
            if seg.content is None:
                raise WorkflowError(f"task {task_id!r}: segment {m.segment!r} has no content")
            messages.append({"role": seg.role, "content": seg.content})
        elif isinstance(m, LiteralMessage):
            messages.append({"role": m.role, "content": m.content})
        else:
            if m.output_of not in outputs:
                raise WorkflowError(f"task {task_id!r} needs the output of {m.output_of!r}, "
                                    "which has none yet")
            messages.append({"role": m.role, "content": outputs[m.output_of]})
    body: dict[str, Any] = {**task.params, "model": wf.model, "messages": messages}
    if task.tools is not None:
        body["tools"] = wf.segments[task.tools].tools
    # The task's own length wins over its params' (the planner prices it): `output_tokens`
    # asks for exactly that many, capped by a `max_tokens` beside it (which used to
    # override it, while the planner priced `output_tokens`).
    length = task_length(task)
    if length is not None:
        body["max_tokens"] = length
    if task.output_tokens is not None:
        body["ignore_eos"] = True
    if wf.tenant is not None:
        body["cache_salt"] = wf.tenant
    return body


def task_length(task: Task) -> int | None:
    """The output length a task's call asks (None: the engine's default)."""
    if task.output_tokens is not None and task.max_tokens is not None:
        return min(task.output_tokens, task.max_tokens)
    return task.output_tokens if task.output_tokens is not None else task.max_tokens
