"""kvgate's Python SDK: mark workflows and tasks in agent code, and the calls made inside carry
the gateway's hints (workflow, task, parents) on their own; or submit a whole DAG.

    from kvgate.sdk import Client, task, workflow

    kv = Client("http://127.0.0.1:8000")

    @task
    async def ask(q: str) -> str:
        r = await kv.openai.chat.completions.create(model=M, messages=[...])
        return r.choices[0].message.content

    @workflow
    async def research(q: str) -> str:
        plan = await ask(q)                                        # ask-1
        notes = await asyncio.gather(*(ask(p) for p in split(plan)))  # ask-2.. after ask-1
        return await ask("\\n".join(notes))                         # after all of them

The rules for parents are in `kvgate.sdk.context`.
"""

from kvgate.sdk.client import (
    Client,
    GatewayUnreachable,
    InvalidWorkflow,
    KVGateError,
    RequestTooLarge,
    WorkflowNotCancellable,
    WorkflowNotFound,
    WorkflowSnapshot,
    WorkflowTimeout,
)
from kvgate.sdk.context import (
    Call,
    TaskFunction,
    TaskScope,
    WorkflowFunction,
    WorkflowInfo,
    WorkflowResult,
    WorkflowScope,
    current_task,
    current_workflow,
    hints,
    start_call,
    task,
    workflow,
)
from kvgate.sdk.dag import Dag, SegmentRef, TaskRef, assistant, system, user
from kvgate.sdk.hooks import add_hints, http_client, instrument

__all__ = [
    "Call",
    "Client",
    "Dag",
    "GatewayUnreachable",
    "InvalidWorkflow",
    "KVGateError",
    "RequestTooLarge",
    "SegmentRef",
    "TaskFunction",
    "TaskRef",
    "TaskScope",
    "WorkflowFunction",
    "WorkflowInfo",
    "WorkflowNotCancellable",
    "WorkflowNotFound",
    "WorkflowResult",
    "WorkflowScope",
    "WorkflowSnapshot",
    "WorkflowTimeout",
    "add_hints",
    "assistant",
    "current_task",
    "current_workflow",
    "hints",
    "http_client",
    "instrument",
    "start_call",
    "system",
    "task",
    "user",
    "workflow",
]
