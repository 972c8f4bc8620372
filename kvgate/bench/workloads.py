"""Benchmark workloads: built-in agent DAGs, workflow-spec files, and real trace replays.

Every workload becomes a list of `BenchWorkflow`s. DAG workloads (`fanout`, `react`, `tree`,
`debate`, `--dag-file`, `--workflow-trace`) are workflow specs (planner.workflow) whose prompts are
chats; trace workloads (`claude-code`, `mooncake-*`) and `prefix-groups` are token-block prompts
sent as completions, where equal trace hash ids become equal synthetic blocks.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from kvgate.bench.prompts import ChatMessage, Content, Piece, Vocabulary
from planner.documents import load_json, load_yaml
from planner.workflow import (
    LiteralMessage,
    OutputOf,
    SegmentRef,
    Workflow,
    WorkflowError,
    load_workflow,
)


def find_traces() -> Path:
    """Where the real traces live: `$KVGATE_TRACES`, else `shared/traces` beside the checkout
    (or beside the working directory), else the team machine's `/work/shared/traces`. They are
    read in place, never copied."""
    env = os.environ.get("KVGATE_TRACES")
    if env:
        return Path(env)
    candidates = [Path(__file__).resolve().parents[2].parent / "shared" / "traces",
                  Path.cwd().resolve().parent / "shared" / "traces",
                  Path("/work/shared/traces")]
    return next((c for c in candidates if c.is_dir()), candidates[0])


TRACES = find_traces()


@dataclass(frozen=True)
class OutputRef:
    """A message whose content is an earlier task's output, known only at run time."""

    task: str
    role: str


@dataclass(frozen=True)
class BenchTask:
    """One LLM call of a benchmark workflow."""

    id: str
    after: tuple[str, ...]
    output_tokens: int
    think_time_s: float = 0.0
    priority: int = 0
    messages: tuple[ChatMessage | OutputRef, ...] = ()
    """Chat prompt (empty for block prompts)."""
    tools: list[dict[str, Any]] | None = None
    tools_key: str | None = None
    blocks: tuple[Piece, ...] = ()
    """Completion prompt as synthetic token blocks (empty for chat prompts)."""
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BenchWorkflow:
    """A workflow as the benchmark runs it."""

    id: str
    tenant: str | None
    tasks: tuple[BenchTask, ...]
    arrival_s: float | None = None
    """Arrival from a trace's timestamps (None: set by the load generator)."""

    def task(self, task_id: str) -> BenchTask:
        """The task with this id."""
        for t in self.tasks:
            if t.id == task_id:
                return t
        raise KeyError(task_id)


class WorkloadError(ValueError):
    """A workload that cannot be built: unknown name or argument, missing trace, bad spec."""


@dataclass
class WorkloadArgs:
    """`--workload-arg KEY=VALUE` values, each read (with a default) at most once."""

    values: dict[str, str]
    used: set[str] = field(default_factory=set)

    def num(self, key: str, default: float) -> float:
        """A float argument."""
        self.used.add(key)
        raw = self.values.get(key)
        if raw is None:
            return default
        try:
            value = float(raw)
        except ValueError:
            raise WorkloadError(f"--workload-arg {key}={raw}: expected a number") from None
        if not math.isfinite(value):
            raise WorkloadError(f"--workload-arg {key}={raw}: expected a finite number")
        return value

    def seconds(self, key: str, default: float) -> float:
        """A non-negative number (a time, or a factor on one)."""
        value = self.num(key, default)
        if value < 0:
            raise WorkloadError(f"--workload-arg {key}: expected a number at least 0")
        return value

    def count(self, key: str, default: int) -> int:
        """A non-negative integer argument (0 turns the feature it sizes off)."""
        value = self.num(key, default)
        if value != int(value) or value < 0:
            raise WorkloadError(f"--workload-arg {key}: expected a non-negative integer")
        return int(value)

    def int(self, key: str, default: int) -> int:
        """A positive integer argument."""
        value = self.num(key, default)
        if value != int(value) or value < 1:
            raise WorkloadError(f"--workload-arg {key}: expected a positive integer")
        return int(value)

    def check_all_used(self, workload: str) -> None:
        """Unknown argument names are an error, not silently ignored."""
        unknown = sorted(set(self.values) - self.used)
        if unknown:
            known = ", ".join(sorted(self.used))
            raise WorkloadError(f"workload {workload!r} takes no argument "
                                f"{', '.join(unknown)}; it takes: {known}")


# -- DAG workloads as workflow specs ------------------------------------------------------------


def _seg(kind: str, tokens: int, role: str = "system") -> dict[str, Any]:
    return {"kind": kind, "role": role, "tokens": tokens}


def _head(a: WorkloadArgs, agent: int, static_tokens: int) -> tuple[dict[str, Any],
                                                                   list[dict[str, Any]]]:
    """Segments and messages every task of a workflow starts with: agent type `agent`'s static
    system prompt (one of `agent_types`), then the workflow's own long context (`context_tokens`:
    a repository, a document set, a transcript; none by default)."""
    system = "system" if a.int("agent_types", 1) == 1 else f"system{agent}"
    segments = {system: _seg("static", a.int("static_tokens", static_tokens))}
    messages = [{"segment": system}]
    context = a.count("context_tokens", 0)
    if context:
        segments["context"] = _seg("shared", context, "user")
        messages.append({"segment": "context"})
    return segments, messages


def fanout_spec(a: WorkloadArgs, agent: int) -> dict[str, Any]:
    """plan -> `width` parallel researchers -> reduce, all on one static system prompt (and the
    workflow's shared context, if any). With `worker_types` K, the researchers are sub-agents
    of their own kind instead: each opens with worker type (agent mod K)'s static prompt
    (`worker_static_tokens`, its instructions and tools) and the question, not the parent's
    context."""
    width = a.int("width", 8)
    think = a.seconds("think_s", 0.0)
    out = {"plan": a.int("plan_tokens", 128), "research": a.int("research_tokens", 256),
           "reduce": a.int("reduce_tokens", 256)}
    segments, head = _head(a, agent, 4000)
    segments |= {"question": _seg("transient", a.int("question_tokens", 200), "user"),
                 "reduce_ask": _seg("transient", 32, "user")}
    head = [*head, {"segment": "question"}]
    worker_head = head
    worker_types = a.count("worker_types", 0)
    worker_static = a.int("worker_static_tokens", 4000)  # read always: a known argument
    if worker_types == 0 and "worker_static_tokens" in a.values:
        raise WorkloadError("--workload-arg worker_static_tokens sizes the sub-agents' own "
                            "prompts: it needs worker_types (at least 1)")
    if worker_types > 0:
        worker = f"worker{agent % worker_types}"
        segments[worker] = _seg("static", worker_static)
        worker_head = [{"segment": worker}, {"segment": "question"}]
    tasks: list[dict[str, Any]] = [{"id": "plan", "messages": head,
                                    "output_tokens": out["plan"]}]
    for i in range(width):
        segments[f"ask{i}"] = _seg("transient", a.int("worker_prompt_tokens", 64), "user")
        tasks.append({"id": f"research{i}", "think_time_s": think, "output_tokens": out["research"],
                      "messages": [*worker_head, {"output_of": "plan"}, {"segment": f"ask{i}"}]})
    tasks.append({"id": "reduce", "output_tokens": out["reduce"], "messages": [
        *head, {"output_of": "plan"},
        *({"output_of": f"research{i}", "role": "user"} for i in range(width)),
        {"segment": "reduce_ask"}]})
    return {"segments": segments, "tasks": tasks}


def react_spec(a: WorkloadArgs, agent: int) -> dict[str, Any]:
    """One agent, `turns` tool-call turns with think time; the context grows every turn."""
    turns = a.int("turns", 8)
    think = a.seconds("think_s", 2.0)
    step = a.int("step_tokens", 128)
    segments, head = _head(a, agent, 4000)
    segments["task"] = _seg("transient", a.int("task_tokens", 300), "user")
    history: list[dict[str, Any]] = [*head, {"segment": "task"}]
    tasks: list[dict[str, Any]] = []
    for k in range(turns):
        tasks.append({"id": f"turn{k}", "messages": list(history), "output_tokens": step,
                      "think_time_s": think if k else 0.0})
        segments[f"obs{k}"] = _seg("transient", a.int("observation_tokens", 400), "tool")
        history += [{"output_of": f"turn{k}"}, {"segment": f"obs{k}"}]
    return {"segments": segments, "tasks": tasks}


def tree_spec(a: WorkloadArgs, agent: int) -> dict[str, Any]:
    """Tree of thought: every node extends its parent's path; a vote joins the leaves."""
    branch, depth = a.int("branch", 3), a.int("depth", 3)
    thought = a.int("thought_tokens", 128)
    segments, head = _head(a, agent, 4000)
    segments |= {"problem": _seg("transient", a.int("problem_tokens", 300), "user"),
                 "vote_ask": _seg("transient", 32, "user")}
    for i in range(branch):
        segments[f"branch{i}"] = _seg("transient", 16, "user")
    tasks: list[dict[str, Any]] = []
    leaves: list[str] = []

    def grow(node: str, messages: list[dict[str, Any]], level: int) -> None:
        tasks.append({"id": node, "messages": messages, "output_tokens": thought})
        if level == depth:
            leaves.append(node)
            return
        for i in range(branch):
            grow(f"{node}.{i}", [*messages, {"output_of": node}, {"segment": f"branch{i}"}],
                 level + 1)

    grow("n", [*head, {"segment": "problem"}], 0)
    tasks.append({"id": "vote", "output_tokens": a.int("vote_tokens", 256), "messages": [
        *head, {"segment": "problem"},
        *({"output_of": leaf, "role": "user"} for leaf in leaves), {"segment": "vote_ask"}]})
    return {"segments": segments, "tasks": tasks}


def debate_spec(a: WorkloadArgs, agent: int) -> dict[str, Any]:
    """`agents` x `rounds` on a shared transcript (each agent's persona last), then a judge."""
    agents, rounds = a.int("agents", 3), a.int("rounds", 3)
    turn = a.int("turn_tokens", 256)
    segments, head = _head(a, agent, 3000)
    segments |= {"topic": _seg("transient", a.int("topic_tokens", 500), "user"),
                 "judge_ask": _seg("transient", 64, "user")}
    for m in range(agents):
        segments[f"persona{m}"] = _seg("transient", a.int("persona_tokens", 200), "user")
    transcript: list[dict[str, Any]] = [*head, {"segment": "topic"}]
    tasks: list[dict[str, Any]] = []
    for r in range(rounds):
        ids = [f"r{r}a{m}" for m in range(agents)]
        for m, task_id in enumerate(ids):
            tasks.append({"id": task_id, "output_tokens": turn,
                          "messages": [*transcript, {"segment": f"persona{m}"}]})
        transcript = [*transcript, *({"output_of": t, "role": "user"} for t in ids)]
    tasks.append({"id": "judge", "output_tokens": a.int("judge_tokens", 256),
                  "messages": [*transcript, {"segment": "judge_ask"}]})
    return {"segments": segments, "tasks": tasks}


DAG_WORKLOADS: dict[str, Callable[[WorkloadArgs, int], dict[str, Any]]] = {
    "fanout": fanout_spec, "react": react_spec, "tree": tree_spec, "debate": debate_spec,
}


def _read_text(p: Path, option: str) -> str:
    """The file's text; WorkloadError naming the option and why it cannot be read."""
    try:
        return p.read_text()
    except OSError as e:
        raise WorkloadError(f"cannot read {option} {p}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise WorkloadError(f"cannot read {option} {p}: not UTF-8 text ({e.reason} at byte "
                            f"{e.start})") from None


def load_dag_file(path: str | Path) -> Workflow:
    """A workflow spec from a JSON or YAML file; WorkloadError names the file and problem."""
    p = Path(path)
    text = _read_text(p, "--dag-file")
    as_yaml = p.suffix in (".yaml", ".yml")
    try:
        data = load_yaml(text) if as_yaml else load_json(text)
    except (yaml.YAMLError, ValueError) as e:  # a JSONDecodeError, a key given twice
        raise WorkloadError(f"{p}: not valid {'YAML' if as_yaml else 'JSON'}: {e}") from None
    try:
        return load_workflow(data, str(p))
    except ValueError as e:
        raise WorkloadError(str(e)) from None


def load_workflow_trace(path: str | Path, vocab: Vocabulary,
                        limit: int | None = None) -> list[BenchWorkflow]:
    """`--workflow-trace`: JSON Lines, each a workflow spec plus its `arrival_s` (the first
    `limit` lines); WorkloadError names the file, the line and the problem."""
    p = Path(path)
    lines = _read_text(p, "--workflow-trace").splitlines()
    out: list[BenchWorkflow] = []
    for n, line in enumerate(lines, 1):
        if limit is not None and len(out) >= limit:
            break
        if not line.strip():
            continue
        where = f"{p}:{n}"
        try:
            data = load_json(line)
        except ValueError as e:  # a JSONDecodeError, a key given twice
            raise WorkloadError(f"{where}: not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise WorkloadError(f"{where}: a line must be a JSON object (a workflow spec "
                                "plus arrival_s)")
        arrival = data.pop("arrival_s", None)
        if arrival is None:
            raise WorkloadError(f"{where}: missing arrival_s (seconds from the trace's start)")
        if isinstance(arrival, bool) or not isinstance(arrival, int | float) or \
                not math.isfinite(arrival) or arrival < 0:
            raise WorkloadError(f"{where}: arrival_s must be a non-negative number of seconds, "
                                f"not {arrival!r}")
        try:
            spec = load_workflow(data, where)
        except ValueError as e:
            raise WorkloadError(str(e)) from None
        wf = compile_workflow(spec, f"{spec.id or 'workflow'}-L{n}", vocab)
        out.append(replace(wf, arrival_s=float(arrival)))
    if not out:
        raise WorkloadError(f"{p}: no workflows (one JSON workflow spec per line)")
    return out


def compile_workflow(spec: Workflow, wf_id: str, vocab: Vocabulary,
                     default_output_tokens: int = 256) -> BenchWorkflow:
    """Resolve a spec's segments into contents; static segments are shared per model+tenant."""
    tenant = spec.tenant or ""
    contents: dict[str, Content] = {}
    for name, seg in spec.segments.items():
        scope = f"static:{spec.model}:{tenant}" if seg.kind == "static" else f"{seg.kind}:{wf_id}"
        if seg.content is not None:
            contents[name] = Content(f"lit:{_digest(seg.content)}", seg.content)
        elif seg.tokens is not None:
            contents[name] = vocab.content(f"{scope}:{name}", seg.tokens)
        else:
            contents[name] = Content(f"{scope}:{name}:empty", "")
    tasks = []
    for t in spec.tasks:
        messages: list[ChatMessage | OutputRef] = []
        for m in t.messages:
            if isinstance(m, SegmentRef):
                seg = spec.segments[m.segment]
                messages.append(ChatMessage(seg.role, contents[m.segment]))
            elif isinstance(m, LiteralMessage):
                messages.append(ChatMessage(m.role, Content(f"lit:{_digest(m.content)}",
                                                            m.content)))
            elif isinstance(m, OutputOf):
                messages.append(OutputRef(m.output_of, m.role))
        deps = list(t.after) + [m.output_of for m in t.messages if isinstance(m, OutputOf)]
        tools = spec.segments[t.tools].tools if t.tools else None
        output = t.output_tokens or t.max_tokens or default_output_tokens
        tasks.append(BenchTask(
            id=t.id, after=tuple(dict.fromkeys(deps)), output_tokens=output,
            think_time_s=t.think_time_s, priority=t.priority, messages=tuple(messages),
            tools=tools, tools_key=f"{spec.model}:{tenant}:{t.tools}" if t.tools else None,
            params=dict(t.params)))
    return BenchWorkflow(wf_id, spec.tenant, tuple(tasks))


def _digest(text: str) -> str:
    from xxhash import xxh3_64_hexdigest

    return xxh3_64_hexdigest(text.encode())


# -- trace replays ------------------------------------------------------------------------------


def _trace_file(*parts: str) -> Path:
    p = TRACES.joinpath(*parts)
    if not p.exists():
        raise WorkloadError(f"trace not found: {p} (set KVGATE_TRACES to the traces directory)")
    return p


def _clip(n_in: int, n_out: int, max_tokens: int) -> tuple[int, int, bool]:
    """A trace request that does not fit the engine's context keeps its prefix and loses its
    newest prompt tokens (and, if it must, output beyond an eighth of the context)."""
    if n_in + n_out <= max_tokens:
        return n_in, n_out, False
    n_out = min(n_out, max_tokens // 8)
    return max_tokens - n_out, n_out, True


def _blocks(vocab: Vocabulary, keys: list[str], block: int, total: int) -> tuple[Piece, ...]:
    """One piece per full block of a `total`-token prompt, named by its hash-id key."""
    return tuple(vocab.piece(k, block) for k in keys[: total // block])


def mooncake(name: str, a: WorkloadArgs, vocab: Vocabulary, limit: int,
             max_tokens: int) -> tuple[list[BenchWorkflow], int]:
    """Each trace request its own one-task workflow, arriving at its timestamp (requests longer
    than `max_tokens` are clipped at the end; their count is returned too)."""
    file = {"mooncake-conversation": "conversation_trace.jsonl.gz",
            "mooncake-synthetic": "synthetic_trace.jsonl.gz"}[name]
    block = 512
    out: list[BenchWorkflow] = []
    clipped = 0
    with gzip.open(_trace_file("mooncake", file), "rt") as f:
        for i, line in enumerate(f):
            if i >= limit:
                break
            r = json.loads(line)
            n_in, hids = int(r["input_length"]), r["hash_ids"]
            n_in, n_out, cut = _clip(n_in, max(1, int(r["output_length"])), max_tokens)
            clipped += cut
            pieces = list(_blocks(vocab, [f"mc:{name}:{h}" for h in hids], block, n_in))
            tail = n_in - len(pieces) * block
            if tail > 0:
                pieces.append(vocab.piece(f"mc:{name}:{i}:tail", tail))
            task = BenchTask("r", (), n_out, blocks=tuple(pieces))
            out.append(BenchWorkflow(f"{name}-{i}", None, (task,),
                                     arrival_s=float(r["timestamp"]) / 1000.0))
    return out, clipped


@dataclass
class _Replay:
    """Settings and counters of one claude-code replay."""

    vocab: Vocabulary
    think_scale: float
    max_think_s: float
    max_tokens: int
    clipped: int = 0
    pieces: dict[tuple[object, ...], Piece] = field(default_factory=dict)
    """Block pieces by ("cc-static", model, position) for static blocks, (session, hash id) for
    the rest: every turn repeats its session's earlier blocks, so most lookups hit here."""


def _cc_requests(entries: list[dict[str, Any]], session: str, rp: _Replay, static_tokens: int,
                 tasks: list[BenchTask], after: tuple[str, ...], prefix: str) -> tuple[str, ...]:
    """Append a session's (or sub-agent's) requests as a chain; returns the tasks to join on."""
    block = 64
    last = after
    for k, r in enumerate(entries):
        if r.get("type") == "subagent":
            sub_static = int(r.get("tool_tokens", 0)) + int(r.get("system_tokens", 0))
            # The parent is paused while the sub-agent runs: fork here, join at its end.
            last = _cc_requests(r["requests"], session, rp, sub_static, tasks, last,
                                f"{prefix}{r.get('agent_id', k)}/")
            continue
        model = r.get("model", "model")
        n_in, hids = int(r["in"]), r["hash_ids"]
        n_in, n_out, cut = _clip(n_in, max(1, int(r["out"])), rp.max_tokens)
        rp.clipped += cut
        static_blocks = static_tokens // block
        pieces: list[Piece] = []
        for j, h in enumerate(hids[: n_in // block]):
            at = ("cc-static", model, j) if j < static_blocks else (session, h)
            piece = rp.pieces.get(at)
            if piece is None:
                key = f"cc-static:{model}:{j}" if j < static_blocks else f"cc:{session}:{h}"
                piece = rp.pieces[at] = rp.vocab.piece(key, block)
            pieces.append(piece)
        tail = n_in - len(pieces) * block
        task_id = f"{prefix}{k}"
        if tail > 0:
            key = f"cc:{session}:{task_id}:tail"
            pieces.append(rp.vocab.piece(key, tail))
        think = min(float(r.get("think_time") or 0.0) * rp.think_scale, rp.max_think_s)
        tasks.append(BenchTask(task_id, last, n_out, think_time_s=think, blocks=tuple(pieces)))
        last = (task_id,)
    return last


_CC_SESSIONS = ("all", "subagents")


def _cc_sessions(a: WorkloadArgs) -> str:
    """`sessions=all` (every session, the default) or `subagents` (only sessions that fork
    sub-agents: 17 of the 77)."""
    a.used.add("sessions")
    value = a.values.get("sessions", "all")
    if value not in _CC_SESSIONS:
        raise WorkloadError(f"--workload-arg sessions={value}: expected one of "
                            f"{', '.join(_CC_SESSIONS)}")
    return value


def claude_code(a: WorkloadArgs, vocab: Vocabulary, limit: int,
                max_tokens: int) -> tuple[list[BenchWorkflow], int]:
    """Each Claude Code session a workflow: turns chained by think time, sub-agents fork/join.

    Returns the workflows and how many requests were clipped to `max_tokens` (prompt+output).
    """
    rp = _Replay(vocab, a.seconds("think_scale", 1.0), a.seconds("max_think_s", 60.0),
                 max_tokens)
    only_subagents = _cc_sessions(a) == "subagents"
    files = sorted(_trace_file("weka-claude-code").glob("trace_*.json.gz"))
    out: list[BenchWorkflow] = []
    for f in files:
        if len(out) >= limit:
            break
        with gzip.open(f, "rt") as fh:
            doc = json.load(fh)
        if only_subagents and not any(r.get("type") == "subagent" for r in doc["requests"]):
            continue
        static = int(doc.get("tool_tokens", 0)) + int(doc.get("system_tokens", 0))
        tasks: list[BenchTask] = []
        _cc_requests(doc["requests"], doc["id"], rp, static, tasks, (), "")
        out.append(BenchWorkflow(f"claude-code-{doc['id']}", None, tuple(tasks)))
    return out, rp.clipped


def prefix_groups(a: WorkloadArgs, vocab: Vocabulary, limit: int,
                  seed: int) -> list[BenchWorkflow]:
    """llm-d's published benchmark shape (inference-perf's shared-prefix data): `groups` x
    `users` prompts, each its group's system prompt then the user's question, shuffled by the
    seed; request i (its own workflow) sends prompt i modulo their number."""
    groups, users = a.int("groups", 150), a.int("users", 5)
    system, question = a.int("system_tokens", 6000), a.int("question_tokens", 1200)
    output = a.int("output_tokens", 1000)
    prompts = [(g, u) for g in range(groups) for u in range(users)]
    random.Random(f"prefix-groups:{seed}").shuffle(prompts)
    out = []
    for i in range(limit):
        g, u = prompts[i % len(prompts)]
        blocks = (vocab.piece(f"pg:system:{g}", system), vocab.piece(f"pg:question:{g}:{u}",
                                                                     question))
        out.append(BenchWorkflow(f"prefix-groups-{i}", None,
                                 (BenchTask("r", (), output, blocks=blocks),)))
    return out


TRACE_WORKLOADS = ("claude-code", "mooncake-conversation", "mooncake-synthetic")
WORKLOADS = (*DAG_WORKLOADS, *TRACE_WORKLOADS, "prefix-groups")


@dataclass
class Workload:
    """The workflows of a run, and what building them changed."""

    workflows: list[BenchWorkflow]
    clipped_requests: int = 0
    """Trace requests cut to the engine's context length (prefix kept)."""


def build_workload(name: str | None, dag_file: str | None, args: dict[str, str],
                   workflows: int, model: str, vocab: Vocabulary,
                   max_tokens: int = 1 << 30, seed: int = 0) -> Workload:
    """`workflows` copies of a DAG (each of an agent type drawn by `seed`), or the first
    `workflows` of a trace; trace requests longer than `max_tokens` (prompt + output) are
    clipped."""
    a = WorkloadArgs(args)
    if dag_file is not None:
        spec = load_dag_file(dag_file)
        a.check_all_used("--dag-file")
        return Workload([compile_workflow(spec, f"{spec.id or 'dag'}-{i}", vocab)
                         for i in range(workflows)])
    if name in DAG_WORKLOADS:
        agent_types = a.int("agent_types", 1)
        try:
            specs = [load_workflow({"model": model, **DAG_WORKLOADS[name](a, k)}, name)
                     for k in range(agent_types)]
        except WorkflowError as e:  # a size from --workload-arg beyond what a spec takes
            raise WorkloadError(f"--workload-arg: {e}") from None
        a.check_all_used(name)
        # A stream of its own, so agent types do not follow the Poisson gaps of the same seed.
        pick = random.Random(f"agent-types:{seed}")
        return Workload([compile_workflow(
            specs[pick.randrange(agent_types) if agent_types > 1 else 0], f"{name}-{i}", vocab)
            for i in range(workflows)])
    if name == "prefix-groups":
        result = Workload(prefix_groups(a, vocab, workflows, seed))
    elif name == "claude-code":
        result = Workload(*claude_code(a, vocab, workflows, max_tokens))
    elif name in ("mooncake-conversation", "mooncake-synthetic"):
        result = Workload(*mooncake(name, a, vocab, workflows, max_tokens))
    else:
        raise WorkloadError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    a.check_all_used(name)
    return result


def iter_tasks(workflows: list[BenchWorkflow]) -> Iterator[tuple[BenchWorkflow, BenchTask]]:
    """Every (workflow, task) pair."""
    for wf in workflows:
        for t in wf.tasks:
            yield wf, t
