"""A static workflow DAG built in code and submitted whole (`POST /v1/workflows`).

`Dag` builds the same document `kvgate bench --dag-file` and the workflow API read (see
planner/workflow.py): segments, and tasks whose messages are segments, literal messages, or the
outputs of earlier tasks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from planner.workflow import WorkflowError, load_workflow, runnable_problems


@dataclass(frozen=True)
class SegmentRef:
    """A segment of the DAG, usable as a message of a task."""

    name: str

    def message(self) -> dict[str, Any]:
        """The spec's `{"segment": NAME}`."""
        return {"segment": self.name}


@dataclass(frozen=True)
class TaskRef:
    """A task of the DAG: usable in another task's `after`, and its output as a message."""

    id: str

    def output(self, role: Literal["assistant", "user"] = "assistant") -> dict[str, Any]:
        """This task's output as a message of a later task (which then runs after it)."""
        return {"output_of": self.id, "role": role}


Message = SegmentRef | Mapping[str, Any]


def system(content: str) -> dict[str, Any]:
    """A literal system message."""
    return {"role": "system", "content": content}


def user(content: str) -> dict[str, Any]:
    """A literal user message."""
    return {"role": "user", "content": content}


def assistant(content: str) -> dict[str, Any]:
    """A literal assistant message."""
    return {"role": "assistant", "content": content}


class Dag:
    """A workflow spec under construction: `segment`, `task`, then `Client.submit(dag)`."""

    def __init__(self, name: str, model: str, *, tenant: str | None = None,
                 deadline_s: float | None = None) -> None:
        self.name = name
        self.model = model
        self.tenant = tenant
        self.deadline_s = deadline_s
        self._segments: dict[str, dict[str, Any]] = {}
        self._tasks: dict[str, dict[str, Any]] = {}

    def segment(self, name: str, content: str | None = None, *,
                kind: Literal["static", "shared", "transient"] = "static",
                role: str = "system", tools: list[dict[str, Any]] | None = None) -> SegmentRef:
        """Add a reusable piece of prompt (a system prompt, tool definitions)."""
        if name in self._segments:
            raise ValueError(f"segment {name!r} is already defined")
        seg: dict[str, Any] = {"kind": kind, "role": role}
        if content is not None:
            seg["content"] = content
        if tools is not None:
            seg["tools"] = tools
        self._segments[name] = seg
        return SegmentRef(name)

    def task(self, task_id: str, messages: Sequence[Message], *,
             after: Iterable[TaskRef | str] = (), tools: SegmentRef | str | None = None,
             max_tokens: int | None = None, think_time_s: float = 0.0,
             output_tokens: int | None = None, priority: int = 0,
             **params: Any) -> TaskRef:
        """Add one LLM call. It runs once the tasks in `after`, and those whose output it
        uses, are done. `output_tokens` asks for exactly that many tokens (a benchmark's
        synthetic length), `priority` ranks the call (vLLM's convention: lower first);
        `params` are extra OpenAI fields (temperature, ...)."""
        if task_id in self._tasks:
            raise ValueError(f"task {task_id!r} is already defined")
        spec: dict[str, Any] = {
            "id": task_id,
            "messages": [m.message() if isinstance(m, SegmentRef) else dict(m)
                         for m in messages],
        }
        deps = [a.id if isinstance(a, TaskRef) else a for a in after]
        if deps:
            spec["after"] = deps
        if tools is not None:
            spec["tools"] = tools.name if isinstance(tools, SegmentRef) else tools
        if max_tokens is not None:
            spec["max_tokens"] = max_tokens
        if think_time_s:
            spec["think_time_s"] = think_time_s
        if output_tokens is not None:
            spec["output_tokens"] = output_tokens
        if priority:
            spec["priority"] = priority
        if params:
            spec["params"] = params
        self._tasks[task_id] = spec
        return TaskRef(task_id)

    def to_dict(self) -> dict[str, Any]:
        """The workflow spec document."""
        doc: dict[str, Any] = {"id": self.name, "model": self.model,
                               "segments": dict(self._segments),
                               "tasks": list(self._tasks.values())}
        if self.tenant is not None:
            doc["tenant"] = self.tenant
        if self.deadline_s is not None:
            doc["deadline_s"] = self.deadline_s
        return doc

    def problems(self) -> list[str]:
        """What the gateway would reject in this spec (empty when it can run)."""
        try:
            spec = load_workflow(self.to_dict(), source=self.name)
        except WorkflowError as e:
            return str(e).splitlines()
        return runnable_problems(spec)
