"""DAG priorities: which buffered call goes first (Autellix, Parrot; ANCHORS.md).

A workflow whose DAG is known (submitted ahead) is ranked by its remaining critical path: the
estimated seconds until it could finish at best, if every remaining task ran the moment it may.
Serving the workflow closest to done first is shortest-remaining-time-first at the level the
client waits on (its job completion time); within one workflow, the task with the longest path
below it goes first (critical path first). A workflow known only from hints has no future to
read, so it is ranked by least attained service (the output tokens it has been served, as the
seconds one sequence takes to decode them, so the two kinds of rank compare), which favours
short programs without knowing their length. A call with a deadline (`deadline_s`) ranks as a
workflow with at most that many seconds left. An explicit `priority` hint (vLLM's convention:
lower first) outranks all of these.

Ranks age: a call that has waited in the buffer ranks as a workflow with that many seconds
less left (`AGING`), so it goes ahead of every call admitted later with a rank less than that
much shorter. Without it, a workflow with a long path ahead (or, in hint mode, much service
attained) waited for as long as shorter work kept arriving while every engine was backed up.

The rank is also handed to engines running `--scheduling-policy priority` as vLLM's integer
`priority`, as it stands when the call is dispatched (its wait in the buffer taken off), so the
engine's own queue keeps the order of the calls released together. A call does not age further
once it waits at its engine: under batch release that queue is kept short (a couple of prefill
steps, `planner.release.PREFILL_STEPS_QUEUED`), and the values stay comparable between gateway
replicas sharing an engine, which no clock of one replica's would be.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from heapq import heapify, heappop

from planner.events import TaskSpec
from planner.hints import RequestHints
from planner.profiles import EngineProfile

PRIORITY_SCALE_S = 0.001
"""Engine `priority` resolution: one unit per millisecond of remaining critical path."""
MAX_RANK_S = 1e9
"""A rank beyond this (a workflow declaring years of work) is sent to engines as this."""
EXPLICIT_UNIT = 10**12
"""One explicit priority in the engine's integer `priority`: more than any rank (MAX_RANK_S at
PRIORITY_SCALE_S), so the explicit priority always decides first; `PRIORITY_LIMIT` of them
stay within the 64-bit integer vLLM's engine core carries it in."""
AGING = 1.0
"""Seconds of rank a call gains per second it waits in the gateway's buffer."""
AGING_STEP_S = 0.1
"""Waits count in whole steps of this: calls of one rank placed at once (a wait of a
millisecond or two) reach their engine with one priority, not a millisecond apart."""


MAX_HINTED = 100_000
"""Hint-mode workflows whose attained service is remembered (the most recently served)."""


@dataclass
class _Workflow:
    path_s: dict[str, float]
    """Per task: its own estimate plus the longest path of estimates below it."""
    done: set[str] = field(default_factory=set)
    remaining_s: float = 0.0
    attained_tokens: int = 0
    longest: list[tuple[float, str]] = field(default_factory=list)
    """The tasks' paths as a heap, longest first (negated), finished ones dropped lazily: the
    remaining critical path without a pass over a session's hundreds of tasks per call."""


def task_estimate_s(spec: TaskSpec, profile: EngineProfile) -> float:
    """Seconds one task takes alone on an idle engine: think time, prefill, decode."""
    decode = profile.decode_step_time(1, spec.prompt_tokens + spec.output_tokens // 2)
    return (spec.think_time_s + profile.prefill_time(spec.prompt_tokens)
            + spec.output_tokens * decode)


class WorkflowPriorities:
    """Ranks calls by their workflow's remaining critical path (or attained service)."""

    def __init__(self, profile: EngineProfile) -> None:
        self.profile = profile
        self._workflows: dict[str, _Workflow] = {}
        self._hinted: dict[str, int] = {}
        """Attained output tokens of workflows known only from hints."""

    def submit(self, workflow: str, tasks: tuple[TaskSpec, ...]) -> None:
        """Learn a workflow's DAG; cyclic or dangling `after` ids are the caller's error."""
        est = {t.task: task_estimate_s(t, self.profile) for t in tasks}
        children: dict[str, list[str]] = {t.task: [] for t in tasks}
        waiting_on = {t.task: 0 for t in tasks}
        for t in tasks:
            for parent in t.after:
                children[parent].append(t.task)
                waiting_on[t.task] += 1
        # Longest path below each task, sinks first (Kahn's order reversed; no recursion, so a
        # session of thousands of chained calls is as cheap as a fan-out).
        order = [t for t, n in waiting_on.items() if n == 0]
        for task in order:
            for c in children[task]:
                waiting_on[c] -= 1
                if waiting_on[c] == 0:
                    order.append(c)
        path: dict[str, float] = {}
        for task in reversed(order):
            path[task] = est[task] + max((path[c] for c in children[task]), default=0.0)
        longest = [(-p, t) for t, p in path.items()]
        heapify(longest)
        self._workflows[workflow] = _Workflow(path, remaining_s=max(path.values(), default=0.0),
                                              longest=longest)

    def task_done(self, workflow: str | None, task: str | None, output_tokens: int) -> None:
        """A call of the workflow finished."""
        if workflow is None:
            return
        wf = self._workflows.get(workflow)
        if wf is None:
            # Hint-mode workflows never say they are over: the least recently served are
            # forgotten past MAX_HINTED (back to no service attained, the best rank).
            hinted = self._hinted
            hinted[workflow] = hinted.pop(workflow, 0) + output_tokens
            if len(hinted) > MAX_HINTED:
                del hinted[next(iter(hinted))]
            return
        wf.attained_tokens += output_tokens
        if task is not None and task in wf.path_s and task not in wf.done:
            wf.done.add(task)
            longest = wf.longest
            while longest and longest[0][1] in wf.done:
                heappop(longest)
            wf.remaining_s = -longest[0][0] if longest else 0.0

    def forget(self, workflow: str) -> None:
        """The workflow is over."""
        self._workflows.pop(workflow, None)
        self._hinted.pop(workflow, None)

    def rank(self, hints: RequestHints, waited_s: float = 0.0) -> tuple[int, float, float]:
        """Sort key, smallest first: (explicit priority, workflow rank in seconds less what
        the call has waited (`AGING`), -task path)."""
        explicit = hints.priority if hints.priority is not None else 0
        rank, task_path = 0.0, 0.0
        if hints.workflow is not None:
            wf = self._workflows.get(hints.workflow)
            if wf is None:
                rank = self._hinted.get(hints.workflow, 0) * self._token_s
            else:
                rank = wf.remaining_s
                task_path = wf.path_s.get(hints.task or "", 0.0)
        if hints.deadline_s is not None and hints.deadline_s < rank:
            rank = hints.deadline_s
        steps = waited_s // AGING_STEP_S if waited_s > 0 else 0.0
        return (explicit, rank - AGING * steps * AGING_STEP_S if steps else rank, -task_path)

    @property
    def _token_s(self) -> float:
        """Seconds one sequence alone takes per output token (attained service in time)."""
        return self.profile.decode_step_time(1, 0)

    def engine_priority(self, hints: RequestHints, waited_s: float = 0.0) -> int:
        """The rank as vLLM's integer `priority` (lower runs first)."""
        explicit, rank, _ = self.rank(hints, waited_s)
        # Within +-MAX_RANK_S (NaN too): an integer for vLLM, below one explicit step.
        rank = rank if -MAX_RANK_S < rank < MAX_RANK_S else (
            -MAX_RANK_S if rank < 0 else MAX_RANK_S)
        return explicit * EXPLICIT_UNIT + min(EXPLICIT_UNIT - 1, max(
            1 - EXPLICIT_UNIT, int(rank / PRIORITY_SCALE_S)))
