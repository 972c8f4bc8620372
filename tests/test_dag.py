"""The DAG runtime (planner/dag.py): readiness, think times, failure, cancel, legal transitions."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.dag import (
    DagNode,
    DagRun,
    IllegalTransition,
    TaskState,
    UnknownTask,
    Wakeup,
    topological_order,
)


def fanout(width: int = 3, think: float = 0.0) -> list[DagNode]:
    workers = [DagNode(f"w{i}", ("plan",), think) for i in range(width)]
    return [DagNode("plan"), *workers, DagNode("reduce", tuple(w.id for w in workers))]


def run_to_ready(run: DagRun, wakeups: list[Wakeup]) -> list[str]:
    for w in wakeups:
        run.wake(w.task, w.at)
    return [w.task for w in wakeups]


def test_roots_wake_after_their_think_time() -> None:
    run = DagRun("wf", [DagNode("a", (), 2.5), DagNode("b", ("a",))])
    assert run.start(10.0) == [Wakeup("a", 12.5)]
    assert run.state("a") is TaskState.THINKING
    assert run.state("b") is TaskState.BLOCKED


def test_a_task_is_ready_only_when_its_last_dependency_finishes() -> None:
    run = DagRun("wf", fanout(width=2, think=1.0))
    run_to_ready(run, run.start(0.0))
    run.dispatched("plan", 0.0)
    wakeups = run.finished("plan", 3.0, output="plan text")
    assert wakeups == [Wakeup("w0", 4.0), Wakeup("w1", 4.0)]
    run_to_ready(run, wakeups)
    run.dispatched("w0", 4.0)
    run.dispatched("w1", 4.0)
    assert run.finished("w0", 5.0) == []
    assert run.finished("w1", 6.0) == [Wakeup("reduce", 6.0)]
    assert run.outputs_of(["plan", "w0", "reduce"]) == {"plan": "plan text", "w0": None}


def test_the_workflow_is_over_when_every_task_is() -> None:
    run = DagRun("wf", [DagNode("a"), DagNode("b", ("a",))])
    run_to_ready(run, run.start(0.0))
    run.dispatched("a", 0.0)
    run_to_ready(run, run.finished("a", 1.0))
    assert not run.over
    run.dispatched("b", 1.0)
    run.finished("b", 2.0)
    assert run.over and not run.failed


def test_a_failure_skips_every_dependent_but_not_siblings() -> None:
    nodes = [DagNode("a"), DagNode("b", ("a",)), DagNode("c", ("b",)), DagNode("d", ("a",)),
             DagNode("e")]
    run = DagRun("wf", nodes)
    run_to_ready(run, run.start(0.0))
    run.dispatched("a", 0.0)
    run_to_ready(run, run.finished("a", 1.0))
    assert sorted(run.fail("b", 2.0, "prompt too long")) == ["c"]
    assert run.state("c") is TaskState.SKIPPED
    assert run.state("d") is TaskState.READY
    assert run.failed and not run.over
    run.dispatched("d", 2.0)
    run.finished("d", 3.0)
    run.dispatched("e", 3.0)
    run.finished("e", 4.0)
    assert run.over


def test_cancel_ends_every_open_task_and_names_the_running_ones() -> None:
    run = DagRun("wf", fanout(width=2))
    run_to_ready(run, run.start(0.0))
    run.dispatched("plan", 0.0)
    run_to_ready(run, run.finished("plan", 1.0))
    run.dispatched("w0", 1.0)
    assert run.cancel(2.0) == ["w0"]
    assert run.over
    assert run.in_state(TaskState.CANCELLED) == ["w0", "w1", "reduce"]


def test_illegal_transitions_raise() -> None:
    run = DagRun("wf", [DagNode("a"), DagNode("b", ("a",))])
    with pytest.raises(IllegalTransition, match="blocked -> running"):
        run.dispatched("b", 0.0)
    run.start(0.0)
    with pytest.raises(IllegalTransition, match="thinking -> done"):
        run.finished("a", 0.0)


def test_unknown_ids_and_cycles_are_named() -> None:
    with pytest.raises(UnknownTask, match="unknown task 'x'"):
        DagRun("wf", [DagNode("a", ("x",))])
    with pytest.raises(ValueError, match="cycle: a, b"):
        DagRun("wf", [DagNode("a", ("b",)), DagNode("b", ("a",))])
    with pytest.raises(ValueError, match="duplicate task id 'a'"):
        DagRun("wf", [DagNode("a"), DagNode("a")])
    with pytest.raises(UnknownTask):
        DagRun("wf", [DagNode("a")]).state("nope")


def test_topological_order_is_stable() -> None:
    nodes = [DagNode("r", ("p",)), DagNode("p"), DagNode("q"), DagNode("s", ("r", "q"))]
    assert [n.id for n in topological_order(nodes)] == ["p", "q", "r", "s"]


@st.composite
def dags(draw: st.DrawFn) -> list[DagNode]:
    n = draw(st.integers(1, 12))
    nodes = []
    for i in range(n):
        parents = (draw(st.lists(st.integers(0, i - 1), max_size=3, unique=True))
                   if i else [])
        think = draw(st.sampled_from([0.0, 0.5, 2.0]))
        nodes.append(DagNode(f"t{i}", tuple(f"t{p}" for p in parents), think))
    return nodes


@settings(max_examples=200, deadline=None)
@given(dags(), st.integers(0, 2**32 - 1), st.floats(0.0, 0.3))
def test_any_run_respects_dependencies_and_ends(nodes: list[DagNode], seed: int,
                                               fail_p: float) -> None:
    rng = random.Random(seed)
    run = DagRun("wf", nodes)
    pending = list(run.start(0.0))
    finished_at: dict[str, float] = {}
    now = 0.0
    while pending:
        w = pending.pop(rng.randrange(len(pending)))
        now = max(now, w.at)
        run.wake(w.task, now)
        node = run.tasks[w.task].node
        assert all(run.state(d) is TaskState.DONE for d in node.after)
        assert all(finished_at[d] + node.think_time_s <= w.at + 1e-9 for d in node.after)
        if rng.random() < fail_p:
            skipped = run.fail(w.task, now, "boom")
            assert all(run.state(s) is TaskState.SKIPPED for s in skipped)
            continue
        run.dispatched(w.task, now)
        now += rng.random()
        finished_at[w.task] = now
        pending.extend(run.finished(w.task, now))
    assert run.over
    assert not run.in_state(TaskState.BLOCKED, TaskState.THINKING, TaskState.READY,
                            TaskState.RUNNING)


# -- going on where another run left off (a replica's takeover) ---------------------------


def test_a_restored_run_starts_the_tasks_whose_dependencies_were_done() -> None:
    run = DagRun("wf", fanout(3, think=2.0))
    wakeups = run.restore({"plan": "p", "w0": "a", "w2": "c"}, {}, 10.0)
    # w1 starts over (its think time from now); reduce still waits for it.
    assert wakeups == [Wakeup("w1", 12.0)]
    assert {t: run.state(t) for t in run.tasks} == {
        "plan": TaskState.DONE, "w0": TaskState.DONE, "w1": TaskState.THINKING,
        "w2": TaskState.DONE, "reduce": TaskState.BLOCKED}
    assert run.outputs_of(["plan", "w0", "w1"]) == {"plan": "p", "w0": "a"}
    run_to_ready(run, wakeups)
    run.dispatched("w1", 12.0)
    assert [w.task for w in run.finished("w1", 13.0, "b")] == ["reduce"]


def test_a_restored_failure_skips_its_dependents_as_the_first_run_did() -> None:
    run = DagRun("wf", fanout(2))
    assert run.restore({"plan": "p"}, {"w0": "boom"}, 1.0) == [Wakeup("w1", 1.0)]
    assert run.state("w0") is TaskState.FAILED and run.state("reduce") is TaskState.SKIPPED
    assert run.tasks["w0"].error == "boom"


def test_a_restored_run_with_everything_done_is_over() -> None:
    run = DagRun("wf", fanout(1))
    assert run.restore({"plan": "p", "w0": "a", "reduce": "r"}, {}, 1.0) == []
    assert run.over and not run.failed


@pytest.mark.parametrize("done", [{"w0": "a"}, {"nope": "x"}])
def test_a_record_no_run_could_leave_is_refused(done: dict[str, object]) -> None:
    with pytest.raises((ValueError, UnknownTask), match=r"w0|nope"):
        DagRun("wf", fanout(2)).restore(done, {}, 1.0)
