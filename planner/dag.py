"""The DAG runtime: one workflow's tasks as a state machine (sans-IO, one implementation).

A task waits for the tasks it runs after, then for its think time (a tool-call gap), and then is
ready to be sent. The driver (the workflow API, the virtual-time benchmark, the live benchmark
client) owns the clock: it schedules the `Wakeup`s this returns, reports dispatches, outputs and
failures, and reads which tasks became ready. A failed task skips everything that depends on it;
a cancel ends every task not yet over. Each task's state moves only along `TRANSITIONS`; anything
else raises `IllegalTransition`, so a driver bug shows up where it happens.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field


class TaskState(enum.Enum):
    """Where one task of a running workflow is."""

    BLOCKED = "blocked"
    """Some task it runs after has not finished."""
    THINKING = "thinking"
    """Its dependencies are done; its think time has not passed yet."""
    READY = "ready"
    """It may be sent (the planner may still buffer it)."""
    RUNNING = "running"
    """Its request is at an engine."""
    DONE = "done"
    FAILED = "failed"
    SKIPPED = "skipped"
    """A task it depends on failed: it will never run."""
    CANCELLED = "cancelled"


TERMINAL = frozenset({TaskState.DONE, TaskState.FAILED, TaskState.SKIPPED, TaskState.CANCELLED})

TRANSITIONS: dict[TaskState, frozenset[TaskState]] = {
    TaskState.BLOCKED: frozenset({TaskState.THINKING, TaskState.SKIPPED, TaskState.CANCELLED}),
    TaskState.THINKING: frozenset({TaskState.READY, TaskState.CANCELLED}),
    TaskState.READY: frozenset({TaskState.RUNNING, TaskState.FAILED, TaskState.CANCELLED}),
    TaskState.RUNNING: frozenset({TaskState.DONE, TaskState.FAILED, TaskState.CANCELLED}),
    TaskState.DONE: frozenset(),
    TaskState.FAILED: frozenset(),
    TaskState.SKIPPED: frozenset(),
    TaskState.CANCELLED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A task was asked to move to a state its current state cannot reach."""


class UnknownTask(KeyError):
    """The workflow has no task with this id."""


@dataclass(frozen=True)
class DagNode:
    """What the runtime needs of a task: its id, what it runs after, and its think time."""

    id: str
    after: tuple[str, ...] = ()
    think_time_s: float = 0.0


@dataclass(frozen=True)
class Wakeup:
    """`task` becomes ready at `at` (the driver calls `DagRun.wake` then)."""

    task: str
    at: float


@dataclass
class TaskRecord:
    """One task's state and timeline."""

    node: DagNode
    state: TaskState = TaskState.BLOCKED
    waiting_on: int = 0
    ready_at: float | None = None
    started_at: float | None = None
    ended_at: float | None = None
    output: object = None
    error: str | None = None


def topological_order(nodes: Sequence[DagNode]) -> list[DagNode]:
    """The nodes, each after every node it runs after; stable (pool order among equals).

    Raises ValueError naming the tasks left when they wait on each other in a cycle.
    """
    done: set[str] = set()
    out: list[DagNode] = []
    remaining = list(nodes)
    while remaining:
        rest = []
        for n in remaining:
            if all(d in done for d in n.after):
                out.append(n)
                done.add(n.id)
            else:
                rest.append(n)
        if len(rest) == len(remaining):
            stuck = ", ".join(n.id for n in rest)
            raise ValueError(f"tasks wait on each other in a cycle: {stuck}")
        remaining = rest
    return out


@dataclass
class DagRun:
    """One workflow's tasks from start to the last task over."""

    workflow: str
    nodes: Sequence[DagNode]
    tasks: dict[str, TaskRecord] = field(init=False)
    _children: dict[str, list[str]] = field(init=False)
    _open: int = field(init=False)

    def __post_init__(self) -> None:
        self.tasks = {}
        self._children = {}
        for n in self.nodes:
            if n.id in self.tasks:
                raise ValueError(f"workflow {self.workflow}: duplicate task id {n.id!r}")
            self.tasks[n.id] = TaskRecord(n, waiting_on=len(n.after))
        for n in self.nodes:
            for dep in n.after:
                if dep not in self.tasks:
                    raise UnknownTask(f"workflow {self.workflow}: task {n.id!r} runs after "
                                      f"unknown task {dep!r}")
                self._children.setdefault(dep, []).append(n.id)
        topological_order(self.nodes)
        self._open = len(self.tasks)

    # -- what the driver asks -------------------------------------------------------------------

    @property
    def over(self) -> bool:
        """Every task is done, failed, skipped or cancelled."""
        return self._open == 0

    @property
    def failed(self) -> bool:
        """Some task failed (its dependents were skipped)."""
        return any(t.state is TaskState.FAILED for t in self.tasks.values())

    def state(self, task: str) -> TaskState:
        """The task's current state."""
        return self._task(task).state

    def outputs_of(self, tasks: Iterable[str]) -> dict[str, object]:
        """The recorded outputs of finished tasks among `tasks`."""
        return {t: self.tasks[t].output for t in tasks
                if t in self.tasks and self.tasks[t].state is TaskState.DONE}

    def in_state(self, *states: TaskState) -> list[str]:
        """Task ids currently in any of `states`, in the workflow's order."""
        return [n.id for n in self.nodes if self.tasks[n.id].state in states]

    # -- what the driver reports ----------------------------------------------------------------

    def start(self, now: float) -> list[Wakeup]:
        """The workflow begins: tasks that run after nothing start their think time."""
        wakeups = []
        for n in self.nodes:
            if not n.after:
                wakeups.append(self._unblock(n.id, now))
        return wakeups

    def restore(self, done: Mapping[str, object], failed: Mapping[str, str],
                now: float) -> list[Wakeup]:
        """Start a fresh run where an earlier one left off (another gateway replica took the
        workflow over): the tasks in `done` finished with these outputs and those in `failed`
        failed, as recorded; every other task starts over. Returns the wakeups of the tasks
        that may run now (their think time counted from `now`).

        Raises UnknownTask for a task the workflow does not have, and ValueError when the
        record is not one a run could have left (a task recorded over while a task it runs
        after is not done)."""
        if any(t not in self.tasks for t in (*done, *failed)):
            unknown = sorted(t for t in (*done, *failed) if t not in self.tasks)
            raise UnknownTask(f"workflow {self.workflow}: no task {unknown[0]!r}")
        pending = {w.task: w for w in self.start(now)}
        for node in topological_order(self.nodes):
            if node.id not in done and node.id not in failed:
                continue
            if pending.pop(node.id, None) is None:
                raise ValueError(f"workflow {self.workflow}: task {node.id!r} is recorded over "
                                 "but a task it runs after is not done")
            self.wake(node.id, now)
            self.dispatched(node.id, now)
            if node.id in done:
                for w in self.finished(node.id, now, done[node.id]):
                    pending[w.task] = w
            else:
                self.fail(node.id, now, failed[node.id])
        return [w for w in pending.values() if self.tasks[w.task].state is TaskState.THINKING]

    def wake(self, task: str, now: float) -> None:
        """The task's think time has passed: it is ready to be sent."""
        rec = self._move(task, TaskState.READY)
        rec.ready_at = now

    def dispatched(self, task: str, now: float) -> None:
        """The task's request went to an engine."""
        rec = self._move(task, TaskState.RUNNING)
        rec.started_at = now

    def finished(self, task: str, now: float, output: object = None) -> list[Wakeup]:
        """The task's request completed with `output`; dependents whose last dependency this
        was start their think time (in the workflow's order)."""
        rec = self._move(task, TaskState.DONE)
        rec.ended_at = now
        rec.output = output
        self._open -= 1
        wakeups = []
        for child in self._children.get(task, ()):
            c = self.tasks[child]
            if c.state is not TaskState.BLOCKED:
                continue
            c.waiting_on -= 1
            if c.waiting_on == 0:
                wakeups.append(self._unblock(child, now))
        return wakeups

    def fail(self, task: str, now: float, error: str) -> list[str]:
        """The task failed (ready but unplaceable, or its request failed); every task that
        depends on it, directly or not, is skipped. Returns the skipped ids."""
        rec = self._move(task, TaskState.FAILED)
        rec.ended_at = now
        rec.error = error
        self._open -= 1
        skipped = []
        frontier = [task]
        while frontier:
            for child in self._children.get(frontier.pop(), ()):
                c = self.tasks[child]
                if c.state is TaskState.BLOCKED:
                    self._move(child, TaskState.SKIPPED)
                    c.ended_at = now
                    c.error = f"skipped: task {task!r} failed"
                    self._open -= 1
                    skipped.append(child)
                    frontier.append(child)
        return skipped

    def cancel(self, now: float) -> list[str]:
        """Every task not over is cancelled. Returns those that were running (the driver
        aborts their requests)."""
        running = []
        for n in self.nodes:
            rec = self.tasks[n.id]
            if rec.state in TERMINAL:
                continue
            if rec.state is TaskState.RUNNING:
                running.append(n.id)
            self._move(n.id, TaskState.CANCELLED)
            rec.ended_at = now
            self._open -= 1
        return running

    # -- internals ------------------------------------------------------------------------------

    def _unblock(self, task: str, now: float) -> Wakeup:
        rec = self._move(task, TaskState.THINKING)
        return Wakeup(task, now + rec.node.think_time_s)

    def _task(self, task: str) -> TaskRecord:
        try:
            return self.tasks[task]
        except KeyError:
            raise UnknownTask(f"workflow {self.workflow} has no task {task!r}") from None

    def _move(self, task: str, to: TaskState) -> TaskRecord:
        rec = self._task(task)
        if to not in TRANSITIONS[rec.state]:
            raise IllegalTransition(f"workflow {self.workflow}, task {task!r}: "
                                    f"{rec.state.value} -> {to.value} is not allowed")
        rec.state = to
        return rec
