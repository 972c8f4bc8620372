"""`--workload-arg sessions=...` picks which claude-code sessions a replay runs."""

from __future__ import annotations

import pytest

from kvgate.bench.prompts import Vocabulary
from kvgate.bench.workloads import TRACES, WorkloadError, build_workload
from kvindex.tokenizer import Tokenizer

pytestmark = pytest.mark.skipif(not TRACES.exists(),
                                reason="../shared/traces is not beside the checkout")


@pytest.fixture(scope="module")
def vocab() -> Vocabulary:
    return Vocabulary(Tokenizer.load())


def test_subagents_keeps_only_sessions_that_fork_sub_agents(vocab: Vocabulary) -> None:
    every = build_workload("claude-code", None, {}, 7, "m", vocab).workflows
    forking = build_workload("claude-code", None, {"sessions": "subagents"}, 7, "m",
                             vocab).workflows
    assert len(forking) == 7
    # Sub-agent tasks are named parent-turn/agent/turn.
    assert all(any("/" in t.id for t in wf.tasks) for wf in forking)
    assert any(not any("/" in t.id for t in wf.tasks) for wf in every)


def test_an_unknown_sessions_value_is_an_error_naming_the_choices(vocab: Vocabulary) -> None:
    with pytest.raises(WorkloadError, match="sessions=some: expected one of all, subagents"):
        build_workload("claude-code", None, {"sessions": "some"}, 1, "m", vocab)
