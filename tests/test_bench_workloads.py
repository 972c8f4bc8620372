"""Benchmark workloads of the long-context regimes: per-workflow shared contexts, agent types,
llm-d's prefix-groups shape and `--workflow-trace` replays."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.bench.options import BenchOptions
from kvgate.bench.prompts import ChatMessage, ChatRenderer, Vocabulary
from kvgate.bench.runner import check_options, prepare, run_bench
from kvgate.bench.virtual import PromptBuilder, static_segment
from kvgate.bench.workloads import (
    BenchWorkflow,
    OutputRef,
    WorkloadError,
    build_workload,
    load_workflow_trace,
)
from kvindex.keys import PromptKeyer
from kvindex.tokenizer import Tokenizer

SMALL = {"static_tokens": "200"}
SMALL_GROUPS = {"groups": "3", "users": "2", "system_tokens": "64", "question_tokens": "16",
                "output_tokens": "8"}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load()


@pytest.fixture(scope="module")
def vocab(tokenizer: Tokenizer) -> Vocabulary:
    return Vocabulary(tokenizer)


def chat(wf: BenchWorkflow, task: str, index: int) -> ChatMessage:
    m = wf.task(task).messages[index]
    assert isinstance(m, ChatMessage)
    return m


def bench(**kw: object) -> dict:
    return run_bench(BenchOptions(progress=False, **kw), out=io.StringIO())  # type: ignore[arg-type]


# -- context_tokens and agent_types -------------------------------------------------------------


@pytest.mark.parametrize("name,args", [
    ("fanout", {"width": "2"}),
    ("react", {"turns": "3"}),
    ("tree", {"branch": "2", "depth": "1"}),
    ("debate", {"agents": "2", "rounds": "2"}),
])
def test_every_task_extends_its_workflows_context_after_the_system_prompt(
        vocab: Vocabulary, name: str, args: dict[str, str]) -> None:
    (wf,) = build_workload(name, None, {**SMALL, **args, "context_tokens": "300"}, 1, "m",
                           vocab).workflows
    for t in wf.tasks:
        system, context = chat(wf, t.id, 0), chat(wf, t.id, 1)
        assert system.role == "system" and system.content.key.startswith("static:")
        assert context.role == "user" and context.content.ids is not None
        assert len(context.content.ids) == 300
        assert context.content == chat(wf, wf.tasks[0].id, 1).content


def test_each_workflow_has_its_own_context(vocab: Vocabulary) -> None:
    a, b = build_workload("fanout", None, {**SMALL, "width": "2", "context_tokens": "300"}, 2,
                          "m", vocab).workflows
    assert chat(a, "plan", 1).content.ids != chat(b, "plan", 1).content.ids
    assert chat(a, "plan", 0).content.ids == chat(b, "plan", 0).content.ids


def test_no_context_by_default(vocab: Vocabulary) -> None:
    (wf,) = build_workload("fanout", None, {**SMALL, "width": "2"}, 1, "m", vocab).workflows
    assert chat(wf, "plan", 0).content.key == "static:m::system"
    assert chat(wf, "plan", 1).content.key.startswith("transient:")


def test_agent_types_are_distinct_static_prompts_each_workflow_uses_one(
        vocab: Vocabulary) -> None:
    workflows = build_workload("react", None, {**SMALL, "turns": "2", "agent_types": "3"}, 12,
                               "m", vocab).workflows
    systems = [chat(wf, "turn0", 0).content for wf in workflows]
    assert len({s.key for s in systems}) == 3
    assert len({s.ids for s in systems}) == 3
    for wf in workflows:
        assert chat(wf, "turn1", 0).content == chat(wf, "turn0", 0).content


def test_worker_types_make_the_researchers_sub_agents_of_their_own_kind(
        vocab: Vocabulary) -> None:
    args = {**SMALL, "width": "2", "agent_types": "2", "worker_types": "2",
            "worker_static_tokens": "150", "context_tokens": "300"}
    workflows = build_workload("fanout", None, args, 8, "m", vocab).workflows
    for wf in workflows:
        worker = chat(wf, "research0", 0)
        assert worker.role == "system" and worker.content.key.startswith("static:")
        assert worker.content != chat(wf, "plan", 0).content  # not the parent's prompt
        assert chat(wf, "research1", 0).content == worker.content
        assert chat(wf, "research0", 1).content.key.startswith("transient:")  # no context
        # The bench names each task's static segment for the planner's replication demand.
        assert static_segment(wf.task("research0"), wf.tenant) != \
            static_segment(wf.task("plan"), wf.tenant)
    names = {static_segment(wf.task("research0"), wf.tenant) for wf in workflows}
    assert len(names) == 2  # one per worker type, equal across workflows
    assert static_segment(wf.task("plan"), "other") != static_segment(wf.task("plan"), None)


def test_agent_types_are_drawn_by_the_seed(vocab: Vocabulary) -> None:
    def types(seed: int) -> list[str]:
        workflows = build_workload("fanout", None, {**SMALL, "width": "1", "agent_types": "4"},
                                   16, "m", vocab, seed=seed).workflows
        return [chat(wf, "plan", 0).content.key for wf in workflows]

    assert types(1) == types(1)
    assert types(1) != types(2)


def test_long_context_prompts_render_exactly_as_the_engine_tokenises_them(
        tokenizer: Tokenizer, vocab: Vocabulary) -> None:
    builder = PromptBuilder(vocab, ChatRenderer(tokenizer, vocab), PromptKeyer(tokenizer, 16))
    (wf,) = build_workload("fanout", None, {**SMALL, "width": "2", "context_tokens": "500",
                                            "agent_types": "2"}, 1, "m", vocab).workflows
    for task in (wf.task("plan"), wf.task("reduce")):
        plain = []
        for m in task.messages:
            if isinstance(m, OutputRef):
                plain.append({"role": m.role,
                              "content": builder.output_piece(wf, wf.task(m.task)).text})
            else:
                plain.append({"role": m.role, "content": m.content.text})
        ids = [i for p in builder.pieces(wf, task) for i in p.ids]
        assert ids == tokenizer.encode_chat(plain)


def test_context_tokens_must_not_be_negative(vocab: Vocabulary) -> None:
    with pytest.raises(WorkloadError, match="context_tokens: expected a non-negative integer"):
        build_workload("fanout", None, {"context_tokens": "-5"}, 1, "m", vocab)


# -- prefix-groups ------------------------------------------------------------------------------


def test_prefix_groups_sends_groups_x_users_prompts_with_one_system_prompt_per_group(
        vocab: Vocabulary) -> None:
    workflows = build_workload("prefix-groups", None, SMALL_GROUPS, 6, "m", vocab).workflows
    assert len(workflows) == 6 and all(len(wf.tasks) == 1 for wf in workflows)
    prompts = [wf.tasks[0].blocks for wf in workflows]
    assert all(len(system.ids) == 64 and len(question.ids) == 16 for system, question in prompts)
    assert all(wf.tasks[0].output_tokens == 8 for wf in workflows)
    by_group: dict[tuple[int, ...], set[tuple[int, ...]]] = {}
    for system, question in prompts:
        by_group.setdefault(system.ids, set()).add(question.ids)
    assert sorted(len(q) for q in by_group.values()) == [2, 2, 2]


def test_prefix_groups_requests_cycle_through_the_prompts(vocab: Vocabulary) -> None:
    workflows = build_workload("prefix-groups", None, SMALL_GROUPS, 12, "m", vocab).workflows
    keys = [tuple(p.key for p in wf.tasks[0].blocks) for wf in workflows]
    assert keys[:6] == keys[6:] and len(set(keys[:6])) == 6


def test_prefix_groups_order_follows_the_seed(vocab: Vocabulary) -> None:
    def order(seed: int) -> list[str]:
        workflows = build_workload("prefix-groups", None, SMALL_GROUPS, 6, "m", vocab,
                                   seed=seed).workflows
        return [wf.tasks[0].blocks[1].key for wf in workflows]

    assert order(3) == order(3)
    assert order(3) != order(4)


# -- --workflow-trace ---------------------------------------------------------------------------


def spec_line(arrival: object, **extra: object) -> str:
    doc = {"model": "m", "segments": {"sys": {"kind": "static", "tokens": 100}},
           "tasks": [{"id": "a", "messages": [{"segment": "sys"},
                                              {"role": "user", "content": "Plan it."}],
                      "output_tokens": 8},
                     {"id": "b", "messages": [{"segment": "sys"}, {"output_of": "a"}],
                      "output_tokens": 8}], **extra}
    if arrival is not None:
        doc["arrival_s"] = arrival
    return json.dumps(doc)


def write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_workflow_trace_replays_each_line_at_its_arrival(tmp_path: Path,
                                                         tokenizer: Tokenizer) -> None:
    path = write(tmp_path, spec_line(2.0), spec_line(3.5, id="review"), spec_line(6.0))
    prepared = prepare(BenchOptions(workflow_trace=str(path)), tokenizer)
    assert prepared.rate is None and prepared.concurrency is None
    assert prepared.load.arrivals == {"workflow-L1": 0.0, "review-L2": 1.5, "workflow-L3": 4.0}


def test_rate_rescales_workflow_trace_arrivals(tmp_path: Path, tokenizer: Tokenizer) -> None:
    path = write(tmp_path, spec_line(0.0), spec_line(1.0), spec_line(4.0))
    prepared = prepare(BenchOptions(workflow_trace=str(path), rate=2.0), tokenizer)
    assert prepared.load.arrivals == {"workflow-L1": 0.0, "workflow-L2": 0.25,
                                      "workflow-L3": 1.0}


def test_workflows_limits_a_workflow_trace_to_its_first_lines(tmp_path: Path,
                                                              vocab: Vocabulary) -> None:
    path = write(tmp_path, spec_line(0.0), "", spec_line(1.0), spec_line(2.0))
    assert [wf.id for wf in load_workflow_trace(path, vocab, 2)] == ["workflow-L1",
                                                                     "workflow-L3"]


@pytest.mark.parametrize("line,problem", [
    ("{not json", "not valid JSON"),
    (spec_line(None), "missing arrival_s"),
    (spec_line(-1.0), "arrival_s must be a non-negative number of seconds, not -1.0"),
    (spec_line("soon"), "arrival_s must be a non-negative number of seconds, not 'soon'"),
    ("[1, 2]", "a line must be a JSON object"),
    (spec_line(1.0, tasks=[{"id": "a", "messages": [{"segment": "nope"}]}]),
     "task 'a' refers to unknown segment 'nope'"),
])
def test_workflow_trace_errors_name_the_line_and_the_problem(
        tmp_path: Path, vocab: Vocabulary, line: str, problem: str) -> None:
    path = write(tmp_path, spec_line(0.0), line)
    with pytest.raises(WorkloadError) as e:
        load_workflow_trace(path, vocab)
    assert str(e.value).startswith(f"{path}:2: ")
    assert problem in str(e.value)


def test_an_empty_workflow_trace_is_an_error(tmp_path: Path, vocab: Vocabulary) -> None:
    with pytest.raises(WorkloadError, match="no workflows"):
        load_workflow_trace(write(tmp_path, ""), vocab)


def test_bad_workflow_trace_exits_2_from_the_command_line(tmp_path: Path) -> None:
    path = write(tmp_path, spec_line(0.0), spec_line(-3))
    proc = subprocess.run([sys.executable, "-m", "kvgate.cli", "bench", "--workflow-trace",
                           str(path), "--no-progress"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert f"{path}:2: arrival_s must be a non-negative number" in proc.stderr
    assert "Traceback" not in proc.stderr


# -- runs ---------------------------------------------------------------------------------------


def test_workflow_trace_runs_like_a_builtin_workload(tmp_path: Path) -> None:
    path = write(tmp_path, spec_line(0.0), spec_line(0.5), spec_line(1.0))
    report = bench(workflow_trace=str(path), policies=["kvgate", "round-robin"], engines=2)
    assert report["workload"] == f"workflow-trace:{path}"
    for r in report["results"].values():
        assert r["workflows"] == 3 and r["requests"] == 6 and r["failed"] == 0


@pytest.mark.parametrize("workload,args", [
    ("prefix-groups", SMALL_GROUPS),
    ("fanout", {**SMALL, "width": "2", "context_tokens": "400", "agent_types": "2"}),
])
def test_same_seed_gives_an_identical_report(workload: str, args: dict[str, str]) -> None:
    kw = dict(workload=workload, workload_args=args, workflows=8, engines=2, rate=4.0, seed=5,
              policies=["kvgate", "llmd-like"])
    first = bench(**kw)
    assert first == bench(**kw)
    assert all(r["failed"] == 0 and r["workflows"] == 8 for r in first["results"].values())


def test_a_trace_arriving_at_one_instant_is_spread_at_the_rate_asked(
        tmp_path: Path, tokenizer: Tokenizer) -> None:
    # Its timestamps cannot be rescaled; they used to all arrive at once whatever --rate said.
    path = write(tmp_path, spec_line(5.0), spec_line(5.0), spec_line(5.0))
    arrivals = prepare(BenchOptions(workflow_trace=str(path), rate=2.0), tokenizer).load.arrivals
    assert arrivals is not None
    times = sorted(arrivals.values())
    assert times[0] == 0.0 and times[1] > 0.0 and times[2] > times[1]


@pytest.mark.parametrize(("options", "problem"), [
    (BenchOptions(workload="fanout", rate=float("nan")), "--rate must be a positive number"),
    (BenchOptions(workload="fanout", rate=float("inf")), "--rate must be a positive number"),
    (BenchOptions(workload="fanout", goodput=True, slo_jct=float("nan")),
     "--slo-jct must be a number above 1"),
    (BenchOptions(workload="fanout", workload_args={"width": "nan"}),
     "--workload-arg width=nan: expected a finite number"),
    (BenchOptions(workload="fanout", workload_args={"width": "1e400"}),
     "--workload-arg width=1e400: expected a finite number"),
    (BenchOptions(workload="react", workload_args={"think_s": "-1"}),
     "--workload-arg think_s: expected a number at least 0"),
    (BenchOptions(workload="claude-code", workload_args={"think_scale": "-1"}),
     "--workload-arg think_scale: expected a number at least 0"),
    (BenchOptions(workload="fanout", workload_args={"static_tokens": "1e10"}),
     "segments.system.tokens: Input should be less than or equal to 10000000"),
])
def test_numbers_that_would_make_a_run_meaningless_are_refused(
        tokenizer: Tokenizer, options: BenchOptions, problem: str) -> None:
    with pytest.raises(WorkloadError, match=problem.replace("+", r"\+")):
        check_options(options)
        prepare(options, tokenizer)


def test_a_dag_file_that_is_not_text_or_not_renderable_names_the_problem(
        tmp_path: Path, tokenizer: Tokenizer) -> None:
    binary = tmp_path / "dag.json"
    binary.write_bytes(b'{"model": "m"\xff\xfe}')
    with pytest.raises(WorkloadError, match="not UTF-8 text"):
        prepare(BenchOptions(dag_file=str(binary)), tokenizer)
    role = tmp_path / "role.json"
    role.write_text(json.dumps({"model": "m", "tasks": [
        {"id": "a", "output_tokens": 2, "messages": [{"role": "bot", "content": "x"}]}]}))
    # A role no chat template renders is refused with the spec, naming the roles there are.
    with pytest.raises(WorkloadError, match="role: Input should be 'system', 'developer', "
                                            "'user', 'assistant' or 'tool'"):
        prepare(BenchOptions(dag_file=str(role), workflows=1), tokenizer)


def test_a_synthetic_segment_too_large_to_build_is_refused(tmp_path: Path,
                                                           tokenizer: Tokenizer) -> None:
    spec = tmp_path / "huge.json"
    spec.write_text(json.dumps({"model": "m", "segments": {"s": {"kind": "static",
                                                                 "tokens": 10**10}},
                                "tasks": [{"id": "a", "messages": [{"segment": "s"}]}]}))
    with pytest.raises(WorkloadError, match=r"segments\.s\.tokens: Input should be less than or "
                                            r"equal to 10000000"):
        prepare(BenchOptions(dag_file=str(spec), workflows=1), tokenizer)
