"""What a plain OpenAI call tells the planner about its place in a workflow (hint mode).

Agents that drive their own loop send ordinary chat/completions calls annotated with
`X-KVGate-*` headers or `extra_body={"kvgate": {...}}`, or the vocabularies agents already send
(Dynamo's `nvext.agent_hints`, `x-session-id`). The gateway parses them into `RequestHints`.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    """Lower runs first, as vLLM's `priority` (`kvgate.priority`, `nvext.agent_hints.priority`)."""
    deadline_s: float | None = None
    """Seconds from arrival by which the caller wants the answer (`kvgate.deadline_s`)."""
    osl: int | None = None
    """Expected output length in tokens (`nvext.agent_hints.osl`)."""
    session: str | None = None
    """A session id (`x-session-id`, or the body's `user`)."""

    @property
    def in_workflow(self) -> bool:
        """The call named a workflow (it shows up in `GET /v1/workflows/{id}`)."""
        return self.workflow is not None
