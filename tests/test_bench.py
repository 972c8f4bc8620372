"""`kvgate bench` in virtual time: workloads, prompts, determinism, the lower bound, the report."""

from __future__ import annotations

import io
import json
import os
import pty
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from adapters.sim.model import StepOutput
from kvgate.bench.bound import TaskShape, decode_time_lb, lower_bound
from kvgate.bench.options import BenchOptions, progress_bar
from kvgate.bench.prompts import ChatMessage, ChatRenderer, Content, Vocabulary
from kvgate.bench.report import percentile, task_kind
from kvgate.bench.runner import run_bench
from kvgate.bench.virtual import VirtualRun
from kvgate.bench.workloads import (
    TRACES,
    WorkloadError,
    build_workload,
    load_dag_file,
    load_workflow_trace,
)
from kvindex.tokenizer import Tokenizer
from planner.policy import PolicyContext, make_policy, policy_names, reads_index

REPORT_KEYS = {"workflows", "requests", "failed", "jct_mean_s", "jct_p50_s", "jct_p99_s",
               "makespan_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "output_tokens_per_s",
               "prefix_hit_ratio", "recomputed_prompt_tokens", "transferred_bytes",
               "gateway_wait_p50_s", "compute_utilisation"}
SMALL = {"static_tokens": "600"}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load()


@pytest.fixture(scope="module")
def vocab(tokenizer: Tokenizer) -> Vocabulary:
    return Vocabulary(tokenizer)


def bench(out: io.StringIO | None = None, **kw: object) -> dict:
    options = BenchOptions(progress=False, **kw)  # type: ignore[arg-type]
    return run_bench(options, out=out or io.StringIO())


# -- prompts ------------------------------------------------------------------------------------


def test_synthetic_content_is_one_token_per_word_and_the_same_for_the_same_key(
        tokenizer: Tokenizer, vocab: Vocabulary) -> None:
    a = vocab.content("static:model::system", 300)
    assert a.ids == vocab.content("static:model::system", 300).ids
    assert a.ids != vocab.content("static:model::other", 300).ids
    assert tokenizer.encode(a.text) == list(a.ids)


def test_rendered_pieces_are_exactly_the_ids_the_engine_computes(
        tokenizer: Tokenizer, vocab: Vocabulary) -> None:
    renderer = ChatRenderer(tokenizer, vocab)
    assert renderer.fast
    messages = [ChatMessage("system", vocab.content("s", 50)),
                ChatMessage("user", Content("lit:q", "Why is the sky blue?\n Explain.")),
                ChatMessage("assistant", vocab.content("out", 20)),
                ChatMessage("tool", vocab.content("obs", 12))]
    tools = [{"type": "function", "function": {"name": "search", "description": "web",
                                               "parameters": {"type": "object"}}}]
    for with_tools in (None, tools):
        pieces = renderer.render(messages, with_tools, "t")
        plain = [{"role": m.role, "content": m.content.text} for m in messages]
        assert [i for p in pieces for i in p.ids] == tokenizer.encode_chat(plain, tools=with_tools)
        assert "".join(p.text for p in pieces) == tokenizer.render_chat(plain, tools=with_tools)


# -- workloads ----------------------------------------------------------------------------------


def test_fanout_is_plan_then_parallel_researchers_then_reduce(vocab: Vocabulary) -> None:
    (wf,) = build_workload("fanout", None, {"width": "3"}, 1, "m", vocab).workflows
    assert [t.id for t in wf.tasks] == ["plan", "research0", "research1", "research2", "reduce"]
    assert wf.task("research1").after == ("plan",)
    assert set(wf.task("reduce").after) == {"plan", "research0", "research1", "research2"}


def test_static_segments_are_shared_across_workflows_and_transient_ones_are_not(
        vocab: Vocabulary) -> None:
    a, b = build_workload("react", None, {}, 2, "m", vocab).workflows
    sys_a, task_a = a.tasks[0].messages[:2]
    sys_b, task_b = b.tasks[0].messages[:2]
    assert isinstance(sys_a, ChatMessage) and isinstance(sys_b, ChatMessage)
    assert isinstance(task_a, ChatMessage) and isinstance(task_b, ChatMessage)
    assert sys_a.content.ids == sys_b.content.ids
    assert task_a.content.ids != task_b.content.ids


@pytest.mark.parametrize("name,args,tasks", [
    ("tree", {"branch": "2", "depth": "2"}, 1 + 2 + 4 + 1),
    ("debate", {"agents": "2", "rounds": "3"}, 2 * 3 + 1),
    ("react", {"turns": "5"}, 5),
])
def test_workload_arguments_shape_the_dag(vocab: Vocabulary, name: str, args: dict[str, str],
                                          tasks: int) -> None:
    (wf,) = build_workload(name, None, args, 1, "m", vocab).workflows
    assert len(wf.tasks) == tasks


def test_unknown_workload_argument_is_an_error_that_lists_the_known_ones(
        vocab: Vocabulary) -> None:
    with pytest.raises(WorkloadError, match=r"no argument widht.*width"):
        build_workload("fanout", None, {"widht": "4"}, 1, "m", vocab)
    # Every argument the workload reads is listed, also one read only with another set.
    with pytest.raises(WorkloadError, match=r"it takes: .*worker_static_tokens, worker_types"):
        build_workload("fanout", None, {"widht": "4"}, 1, "m", vocab)
    with pytest.raises(WorkloadError, match=r"worker_static_tokens .* needs worker_types"):
        build_workload("fanout", None, {"worker_static_tokens": "100"}, 1, "m", vocab)


@pytest.mark.parametrize("spec,problem", [
    ({"model": "m", "tasks": [{"id": "a", "after": ["b"], "messages": [{"role": "user",
                                                                        "content": "x"}]},
                              {"id": "b", "after": ["a"], "messages": [{"role": "user",
                                                                        "content": "y"}]}]},
     "cycle: a -> b -> a"),
    ({"model": "m", "tasks": [{"id": "a", "messages": [{"output_of": "zz"}]}]},
     "unknown task 'zz'"),
    ({"model": "m", "tasks": []}, "no tasks"),
])
def test_dag_file_errors_name_the_problem_and_exit_2(tmp_path: Path, spec: dict,
                                                     problem: str) -> None:
    path = tmp_path / "wf.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, "-m", "kvgate.cli", "bench", "--dag-file", str(path),
                           "--no-progress"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert problem in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_key_given_twice_in_a_dag_file_or_a_trace_line_is_named(tmp_path: Path,
                                                                   vocab: Vocabulary) -> None:
    # json and PyYAML kept the last of the two: a second `tasks` silently replaced the first.
    task = '{"id": "a", "messages": [{"role": "user", "content": "x"}]}'
    doc = f'{{"model": "m", "tasks": [{task}], "tasks": [{task}, {task}]}}'
    for name, text in [("wf.json", doc), ("wf.yaml", f"model: m\ntasks: [{task}]\n"
                                                     f"model: n\n")]:
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(WorkloadError, match="is given twice"):
            load_dag_file(path)
    trace = tmp_path / "trace.jsonl"
    trace.write_text(doc[:-1] + ', "arrival_s": 0, "arrival_s": 1}\n')
    with pytest.raises(WorkloadError, match=r"trace.jsonl:1: not valid JSON: key 'tasks'"):
        load_workflow_trace(str(trace), vocab)


def test_dag_file_runs_like_a_builtin_workload(tmp_path: Path) -> None:
    path = tmp_path / "wf.yaml"
    path.write_text("""
model: m
segments:
  sys: {kind: static, tokens: 300}
tasks:
  - {id: a, messages: [{segment: sys}, {role: user, content: "Plan it."}], output_tokens: 20}
  - {id: b, after: [a], messages: [{segment: sys}, {output_of: a}], output_tokens: 20}
""")
    report = bench(dag_file=str(path), workflows=3, policies=["kvgate", "round-robin"],
                   engines=2)
    for r in report["results"].values():
        assert r["workflows"] == 3 and r["requests"] == 6 and r["failed"] == 0


@pytest.mark.skipif(not TRACES.exists(), reason="../shared/traces is not beside the checkout")
def test_claude_code_subagents_fork_and_join(vocab: Vocabulary) -> None:
    workflows = build_workload("claude-code", None, {}, 1, "m", vocab).workflows
    (wf,) = workflows
    sub = [t for t in wf.tasks if "/" in t.id]
    assert sub, "trace_0003 has sub-agents"
    first_sub = sub[0]
    parent_before = first_sub.after
    assert parent_before and "/" not in parent_before[0]
    # The parent resumes after the sub-agent's last request.
    last_sub = [t for t in sub if t.id.split("/")[0] == first_sub.id.split("/")[0]][-1]
    assert any(t.after == (last_sub.id,) and "/" not in t.id for t in wf.tasks)
    # The static prefix (tools + system prompt) is one set of blocks per model.
    first = wf.tasks[0]
    assert first.blocks[0].key.startswith("cc-static:")


@pytest.mark.skipif(not TRACES.exists(), reason="../shared/traces is not beside the checkout")
def test_mooncake_equal_hash_ids_become_equal_blocks(vocab: Vocabulary) -> None:
    wfs = build_workload("mooncake-conversation", None, {}, 3, "m", vocab).workflows
    first_blocks = [wf.tasks[0].blocks[0] for wf in wfs]
    assert first_blocks[0].key == first_blocks[1].key == first_blocks[2].key  # hash id 0
    assert first_blocks[0].ids == first_blocks[1].ids
    assert wfs[0].tasks[0].blocks[1].ids != wfs[1].tasks[0].blocks[1].ids
    assert len(first_blocks[0].ids) == 512


# -- runs ---------------------------------------------------------------------------------------


def test_recomputed_static_tokens_count_what_no_cache_served_of_the_static_prompts() -> None:
    """One engine, one agent type: its static prompt is computed once, then every call finds
    it cached; four engines without a link: each engine the calls reach computes it once."""
    def static_recomputed(engines: int) -> tuple[int, int]:
        r = bench(workload="fanout", workload_args={**SMALL, "width": "3"}, workflows=4,
                  concurrency=4, engines=engines, policies=["round-robin"])
        result = r["results"]["round-robin"]
        return result["recomputed_static_tokens"], result["recomputed_prompt_tokens"]

    # The static range is whole blocks: 600 tokens and the template's framing, rounded down.
    one, total = static_recomputed(1)
    assert 576 <= one <= 700 and one < total  # computed once
    four, _ = static_recomputed(4)
    assert 4 * 576 <= four <= 4 * 700  # round-robin reaches every engine


def test_same_seed_gives_an_identical_report() -> None:
    kw = dict(workload="fanout", workload_args={**SMALL, "width": "4"}, workflows=6,
              policies=["kvgate", "round-robin", "sglang-like"], engines=3, rate=2.0, seed=7)
    assert bench(**kw) == bench(**kw)


def test_running_inert_steps_ahead_of_the_agenda_changes_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    kw = dict(workload="fanout", workload_args={**SMALL, "width": "4"}, workflows=6,
              policies=["kvgate", "least-loaded"], engines=3, rate=2.0, seed=3)
    ahead: list[bool] = []
    run_ahead = VirtualRun._run_ahead

    def counting(self: VirtualRun, end: float, e: Any, out: StepOutput) -> list[Any]:
        steps = run_ahead(self, end, e, out)
        ahead.append(not steps or steps[0][2] is not out)
        return steps

    monkeypatch.setattr(VirtualRun, "_run_ahead", counting)
    report = bench(**kw)
    assert sum(ahead) > 10
    monkeypatch.setattr(VirtualRun, "_run_ahead", lambda self, end, e, out: [(end, e, out)])
    assert bench(**kw) == report


@pytest.mark.parametrize("workload,args", [
    ("fanout", {**SMALL, "width": "4"}),
    ("react", {**SMALL, "turns": "4"}),
])
def test_policies_that_read_no_index_skip_it_and_get_the_same_report(
        monkeypatch: pytest.MonkeyPatch, workload: str, args: dict[str, str]) -> None:
    """The driver skips matching and ingesting for policies that declare `reads_index = False`;
    forcing both on must give the same reports, or a declaration is wrong."""
    policies = [p for p in policy_names() if not reads_index(make_policy(p, PolicyContext()))]
    assert {"round-robin", "least-loaded", "session", "sglang-like",
            "llmd-approx-like", "llmd-p2p-like"} <= set(policies)
    assert "kvgate" not in policies and "llmd-like" not in policies
    kw = dict(workload=workload, workload_args=args, workflows=8, policies=policies, engines=3,
              rate=3.0, seed=1)
    indexed: list[int] = []
    init = VirtualRun.__init__

    def skipping(self: VirtualRun, *a: Any, **k: Any) -> None:
        init(self, *a, **k)
        indexed.append(id(self))
        assert not self._reads_index and not self.fleet.ingest

    monkeypatch.setattr(VirtualRun, "__init__", skipping)
    skipped = bench(**kw)
    assert len(indexed) == len(policies)

    def forcing(self: VirtualRun, *a: Any, **k: Any) -> None:
        init(self, *a, **k)
        self._reads_index = self.fleet.ingest = True

    monkeypatch.setattr(VirtualRun, "__init__", forcing)
    assert bench(**kw) == skipped


def test_a_different_seed_changes_poisson_arrivals() -> None:
    kw = dict(workload="fanout", workload_args=SMALL, workflows=6, policies=["round-robin"],
              engines=2, rate=2.0)
    assert bench(seed=1, **kw)["results"] != bench(seed=2, **kw)["results"]


@pytest.mark.parametrize("workload,args", [
    ("fanout", {**SMALL, "width": "4"}),
    ("react", {**SMALL, "turns": "4", "think_s": "0.5"}),
    ("tree", {**SMALL, "branch": "2", "depth": "2"}),
    ("debate", {**SMALL, "agents": "2", "rounds": "2"}),
])
def test_lower_bound_never_exceeds_any_policy(workload: str, args: dict[str, str]) -> None:
    report = bench(workload=workload, workload_args=args, workflows=6, engines=2,
                   policies=policy_names(), concurrency=4)
    lb = report["lower_bound"]
    assert lb["jct_mean_s"] > 0
    for name, r in report["results"].items():
        assert r["failed"] == 0, name
        assert set(r) >= REPORT_KEYS
        assert lb["jct_mean_s"] <= r["jct_mean_s"], name
        assert lb["makespan_s"] <= r["makespan_s"], name


@pytest.mark.skipif(not TRACES.exists(), reason="../shared/traces is not beside the checkout")
def test_lower_bound_holds_on_a_trace_replay_by_timestamp() -> None:
    report = bench(workload="mooncake-synthetic", workflows=40, engines=2,
                   policies=["kvgate", "least-loaded", "llmd-like"])
    assert report["load"] == {"rate": None, "concurrency": None, "workflows": 40}
    for r in report["results"].values():
        assert report["lower_bound"]["jct_mean_s"] <= r["jct_mean_s"]
        assert report["lower_bound"]["makespan_s"] <= r["makespan_s"]


def test_bound_counts_a_prefix_shared_with_another_task_as_cached() -> None:
    from planner.profiles import get_profile

    profile = get_profile("h100-llama3-8b")
    alone = [("w1", [TaskShape("t", (), [("sys", 4000), ("q", 100)],
                               [("sys", 4000), ("q", 100), ("o", 10)], 10, 0.0)])]
    shared = [*alone, ("w2", [TaskShape("t", (), [("sys", 4000), ("q2", 100)],
                                        [("sys", 4000), ("q2", 100), ("o2", 10)], 10, 0.0)])]
    solo = lower_bound(alone, profile, 1, lambda w: 0.0).jct_s["w1"]
    pair = lower_bound(shared, profile, 1, lambda w: 0.0).jct_s["w1"]
    assert pair < solo


def test_bound_never_serves_a_workflows_private_context_before_it_is_computed() -> None:
    from planner.profiles import get_profile

    profile = get_profile("h100x4-llama3-70b")
    head = [("sys", 4000), ("ctx", 32000)]
    plan = TaskShape("plan", (), head, [*head, ("plan_out", 100)], 100, 0.0)
    kids = [TaskShape(f"k{i}", ("plan",), [*head, ("plan_out", 100), (f"ask{i}", 50)],
                      [*head, ("plan_out", 100), (f"ask{i}", 50), (f"o{i}", 10)], 10, 0.0)
            for i in range(2)]
    other = ("w2", [TaskShape("plan", (), [("sys", 4000), ("ctx2", 32000)],
                              [("sys", 4000), ("ctx2", 32000), ("p2", 100)], 100, 0.0)])
    bound = lower_bound([("w1", [plan, *kids]), other], profile, 1, lambda w: 0.0)
    # The plan computes its context (the static prompt is shared with w2, so it may be warm);
    # the children are served the plan's whole extended prompt and compute only their asks.
    plan_run = profile.prefill_time(32000, 4000) + decode_time_lb(profile, 36000, 100)
    kid_run = profile.prefill_time(50, 36100) + decode_time_lb(profile, 36150, 10)
    assert bound.jct_s["w1"] == pytest.approx(plan_run + kid_run)


def test_bound_serves_a_sibling_only_what_it_computed_before_the_sibling_was_ready() -> None:
    from planner.profiles import get_profile

    profile = get_profile("h100-llama3-8b")
    doc = [("doc", 8000)]

    def task(name: str, output: int, think: float) -> TaskShape:
        return TaskShape(name, (), [*doc, (name, 10)], [*doc, (name, 10), (f"o{name}", output)],
                         output, think)

    def cold(output: int) -> float:
        return profile.prefill_time(8010, 0) + decode_time_lb(profile, 8010, output)

    # Ready together: neither can read what the other is still computing.
    together = lower_bound([("w", [task("a", 5, 0.0), task("b", 200, 0.0)])], profile, 1,
                           lambda w: 0.0)
    assert together.jct_s["w"] == pytest.approx(cold(200))
    # Ready later: the document is in cache by then.
    later = lower_bound([("w", [task("a", 5, 0.0), task("c", 5, 2.0)])], profile, 1,
                        lambda w: 0.0)
    warm = 2.0 + profile.prefill_time(10, 8000) + decode_time_lb(profile, 8010, 5)
    assert warm > cold(5)
    assert later.jct_s["w"] == pytest.approx(warm)


def test_report_json_and_table(tmp_path: Path) -> None:
    out = io.StringIO()
    report = bench(out, workload="fanout", workload_args={**SMALL, "width": "2"}, workflows=3,
                   policies=["kvgate", "least-loaded"], engines=2,
                   json_out=str(tmp_path / "r.json"))
    on_disk = json.loads((tmp_path / "r.json").read_text())
    assert on_disk == json.loads(json.dumps(report))
    assert set(on_disk) >= {"workload", "profile", "engines", "seed", "mode", "load",
                            "lower_bound", "results"}
    assert on_disk["mode"] == "virtual" and on_disk["engines"] == 2
    table = out.getvalue()
    assert "kvgate" in table and "least-loaded" in table and "lower bound" in table


def test_tasks_breaks_each_run_down_by_task_kind() -> None:
    out = io.StringIO()
    args = {**SMALL, "width": "3", "plan_tokens": "5", "research_tokens": "9",
            "reduce_tokens": "4"}
    report = bench(out, workload="fanout", workload_args=args, workflows=4, rate=2.0,
                   policies=["kvgate", "round-robin"], engines=2, tasks=True)
    for name in ("kvgate", "round-robin"):
        r = report["results"][name]
        tasks = r["tasks"]
        # research0..2 fold into one kind; every finished request is counted once.
        assert sorted(tasks) == ["plan", "reduce", "research#"]
        assert [tasks[k]["requests"] for k in ("plan", "research#", "reduce")] == [4, 12, 4]
        assert sum(t["requests"] for t in tasks.values()) == r["requests"] - r["failed"]
        assert [tasks[k]["output_tokens_mean"] for k in ("plan", "research#", "reduce")] == [
            5, 9, 4]
        for t in tasks.values():
            assert 0 < t["itl_mean_s"] < 1 and t["ttft_after_dispatch_mean_s"] > 0
            assert 0 <= t["cached_tokens_mean"] <= t["prompt_tokens_mean"]
    assert "research#" in out.getvalue()
    # Off by default: seeded reports keep their shape.
    plain = bench(workload="fanout", workload_args=args, workflows=4, rate=2.0,
                  policies=["kvgate"], engines=2)
    assert "tasks" not in plain["results"]["kvgate"]
    assert task_kind("n.0.12") == "n.#.#" and task_kind("r1a2") == "r#a#"
    assert task_kind("r1a2", r"a\d+") == "r1a#" and task_kind("n.0.12", r"\.\d+$") == "n.0.#"


def test_tasks_fold_keeps_debate_rounds_apart() -> None:
    args = {"agents": "2", "rounds": "2", "static_tokens": "64", "topic_tokens": "16",
            "persona_tokens": "8", "turn_tokens": "4", "judge_tokens": "4"}
    report = bench(workload="debate", workload_args=args, workflows=3, rate=2.0,
                   policies=["round-robin"], engines=2, tasks=True, tasks_fold=r"a\d+")
    tasks = report["results"]["round-robin"]["tasks"]
    assert sorted(tasks) == ["judge", "r0a#", "r1a#"]
    assert [tasks[k]["requests"] for k in ("r0a#", "r1a#", "judge")] == [6, 6, 3]
    # A later round's prompt holds the earlier rounds' transcript.
    assert tasks["r1a#"]["prompt_tokens_mean"] > tasks["r0a#"]["prompt_tokens_mean"]
    for bad, problem in ((r"a\d+", "use it with --tasks"), ("(", "not a regular expression")):
        with pytest.raises(WorkloadError, match=problem):
            bench(workload="debate", workload_args=args, workflows=1, policies=["round-robin"],
                  engines=1, tasks=bad != r"a\d+", tasks_fold=bad)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "p.png"
    bench(workload="fanout", workload_args={**SMALL, "width": "2"}, workflows=3,
          policies=["kvgate", "round-robin"], engines=2, plot_out=str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_progress_bar_draws_only_on_a_terminal() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty, pipe = Tty(), io.StringIO()
    for stream in (tty, pipe):
        update = progress_bar("kvgate", stream)
        update(3, 3)
    assert "3/3 workflows" in tty.getvalue()
    assert pipe.getvalue() == ""


def test_sglang_router_policy_needs_live_mode() -> None:
    with pytest.raises(WorkloadError, match="runs only with --mode live"):
        bench(workload="fanout", workflows=1, policies=["sglang-router"])


def test_prompt_too_long_for_the_engine_fails_the_request_not_the_run(tmp_path: Path) -> None:
    path = tmp_path / "wf.json"
    path.write_text(json.dumps({"model": "m", "segments": {"big": {"kind": "static",
                                                                   "tokens": 40000}},
                                "tasks": [{"id": "a", "messages": [{"segment": "big"}]},
                                          {"id": "b", "after": ["a"],
                                           "messages": [{"role": "user", "content": "x"}]}]}))
    out = io.StringIO()
    report = bench(out, dag_file=str(path), workflows=2, policies=["kvgate"], engines=1,
                   profile="cpu-tiny", goodput=True)
    r = report["results"]["kvgate"]
    assert r["failed"] == 2 and r["workflows"] == 0 and r["requests"] == 2
    # No workflow finished: no JCT or TTFT to report, so null and "-", not a JCT of 0 s.
    assert r["jct_mean_s"] is r["jct_p99_s"] is r["ttft_p50_s"] is None
    row = next(line for line in out.getvalue().splitlines() if line.startswith("kvgate "))
    assert row.split()[1:7] == ["-"] * 6, row
    point = report["goodput"]["kvgate"]["points"][0]
    assert report["goodput"]["kvgate"]["rate"] == 0.0
    assert point["jct_mean_s"] is point["x_bound"] is None and point["failed"] == 2
    assert "no rate tried met the SLO" in out.getvalue()
    json.dumps(report, allow_nan=False)  # the report is strict JSON


def test_asking_for_more_workflows_than_a_trace_holds_says_so(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    spec = {"model": "m", "tasks": [{"id": "a", "messages": [{"role": "user", "content": "x"}],
                                     "output_tokens": 2}]}
    path.write_text("".join(json.dumps({**spec, "arrival_s": t}) + "\n" for t in (0, 1)))
    out = io.StringIO()
    report = bench(out, workflow_trace=str(path), workflows=5, policies=["round-robin"],
                   engines=1, profile="cpu-tiny")
    assert report["load"]["workflows"] == 2
    assert ("note: --workflows 5 asked for more than workflow-trace:" in out.getvalue()
            and "all 2 of its workflows ran" in out.getvalue())
    out = io.StringIO()
    bench(out, workflow_trace=str(path), workflows=2, policies=["round-robin"], engines=1,
          profile="cpu-tiny")
    assert "note: --workflows" not in out.getvalue()


def test_percentile_interpolates() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([], 99) == 0.0


@pytest.mark.skipif(not TRACES.exists(), reason="../shared/traces is not beside the checkout")
def test_trace_requests_longer_than_the_context_keep_their_prefix(vocab: Vocabulary) -> None:
    full = build_workload("mooncake-synthetic", None, {}, 20, "m", vocab).workflows
    cut = build_workload("mooncake-synthetic", None, {}, 20, "m", vocab, max_tokens=8000)
    assert cut.clipped_requests > 0
    for a, b in zip(full, cut.workflows, strict=True):
        ta, tb = a.tasks[0], b.tasks[0]
        assert sum(len(p.ids) for p in tb.blocks) + tb.output_tokens <= 8000
        kept = [p.key for p in tb.blocks if not p.key.endswith(":tail")]
        assert kept == [p.key for p in ta.blocks][: len(kept)]


def test_jobs_run_policies_in_worker_processes_and_change_no_result(tmp_path: Path) -> None:
    """`--jobs 3` forks a worker per policy (runs and goodput searches); the report is the one
    a run in this process writes, byte for byte."""
    reports = {}
    for jobs in ("1", "3"):
        out = tmp_path / f"jobs{jobs}.json"
        proc = subprocess.run(
            [sys.executable, "-m", "kvgate.cli", "bench", "--workload", "fanout",
             "--workload-arg", "static_tokens=600", "--workflows", "8", "--engines", "2",
             "--rate", "2", "--policy", "kvgate,dynamo-like,sglang-like", "--goodput",
             "--goodput-precision", "0.3", "--jobs", jobs, "--no-progress", "--json", str(out)],
            capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        last = proc.stdout.strip().splitlines()[-1]
        assert ("3 worker processes" in last) == (jobs == "3"), last
        reports[jobs] = out.read_text()
    assert json.loads(reports["3"])["goodput"].keys() == {"slo_jct_x_bound", "kvgate",
                                                         "dynamo-like", "sglang-like"}
    assert reports["1"] == reports["3"]


@pytest.mark.parametrize("value", ["0", "two"])
def test_jobs_must_be_a_positive_whole_number(value: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvgate.cli", "bench", "--jobs", value],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--jobs" in proc.stderr and "Traceback" not in proc.stderr


def test_jobs_a_worker_that_fails_or_dies_is_reported_not_waited_for() -> None:
    """A policy that raises re-raises its error here; a worker killed mid-run (OOM, a signal)
    ends the command with an error instead of a wait for a result that never comes. Run in a
    child process: the pool forks, and pytest's process may hold threads."""
    script = """
import os, sys
from kvgate.bench.options import BenchOptions
from kvgate.bench.runner import per_policy
o = BenchOptions(policies=["a", "b", "c"], jobs=2, progress=False)
print(per_policy(o, lambda p: p * 2))
def bad(p):
    if p == "b":
        raise ValueError("policy b broke")
    return p
def die(p):
    if p == "b":
        os._exit(3)
    return p
for fn in (bad, die):
    try:
        per_policy(o, fn)
    except Exception as e:
        print(type(e).__name__, e)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "{'a': 'aa', 'b': 'bb', 'c': 'cc'}"
    assert lines[1] == "ValueError policy b broke"
    assert lines[2].startswith("BrokenProcessPool")


def test_jobs_on_a_terminal_draw_one_status_line_and_a_line_per_finished_policy() -> None:
    """With workers, a terminal's progress is one line (every running policy's finished
    workflows) and a line of its own for each policy as it finishes."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvgate.cli", "bench", "--workload", "fanout", "--workload-arg",
         "static_tokens=600", "--workflows", "60", "--engines", "2", "--rate", "2",
         "--policy", "kvgate,dynamo-like,round-robin", "--jobs", "2"],
        stdout=subprocess.PIPE, stderr=slave, text=True)
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    out, _ = proc.communicate(timeout=300)
    os.close(master)
    err = b"".join(chunks).decode()
    assert proc.returncode == 0, err
    assert "policies done; running: " in err and "/60 workflows" in err
    for policy in ("kvgate", "dynamo-like", "round-robin"):
        assert f"\n{policy}: done in " in err.replace("\r", "\n")
    assert "3/3 policies)" in err
    assert "2 worker processes" in out.splitlines()[-1]


def test_a_run_without_a_link_names_the_policies_that_would_move_kv() -> None:
    """Without `--link` the table is followed by a note naming the chosen policies that copy KV
    between engines when they have a transfer path (kvgate-routing-only never does); with a
    link there is none."""
    kw = dict(workload="fanout", workload_args={**SMALL, "width": "2"}, workflows=2, engines=2,
              concurrency=2, policies=["kvgate", "least-loaded", "kvgate-routing-only",
                                       "llmd-p2p-like"])
    out = io.StringIO()
    bench(out=out, **kw)
    notes = [line for line in out.getvalue().splitlines() if line.startswith("note:")]
    assert len(notes) == 1
    assert "for kvgate, llmd-p2p-like (" in notes[0] and "--link" in notes[0]
    out = io.StringIO()
    bench(out=out, link="rdma", **kw)
    assert "note:" not in out.getvalue()


def test_the_report_counts_the_moves_the_planner_started_by_reason() -> None:
    # Long contexts arriving fast: kvgate paces their prefill beside the decodes (`warm:pace`,
    # each piece a request of its own); a per-request router moves nothing.
    report = run_bench(BenchOptions(progress=False, workload="fanout", workflows=4, engines=2,
                                    policies=["kvgate", "round-robin"], rate=4.0,
                                    workload_args={"context_tokens": "8000", "width": "3"}),
                       out=io.StringIO())
    kvgate, rr = report["results"]["kvgate"], report["results"]["round-robin"]
    assert rr["moves_started"] == {}
    assert kvgate["moves_started"].get("warm:pace", 0) > 0
    assert all(k.split(":")[0] in ("transfer", "warm") for k in kvgate["moves_started"])


def test_an_engine_whose_step_only_preempted_steps_again() -> None:
    # vLLM's priority policy evicts the worst-ranked running request when a running one finds
    # no free block; when that is the request itself, vLLM stops scanning the running list for
    # the step, so a step can schedule nothing though requests stay running. Its engine loop
    # schedules again at once; the virtual fleet must too, or the engine idles for good (a
    # claude-code run at 0.054/s on the API-server profile scraped on forever).
    from dataclasses import replace

    from adapters.sim.model import SimRequest
    from kvgate.bench.virtual import Fleet
    from planner.profiles import get_profile

    base = get_profile("h100-llama3-8b")
    profile = replace(base, kv_cache_bytes=40 * 16 * base.kv_bytes_per_token)  # 40 blocks
    fleet = Fleet(["e"], profile, eos_token_id=0, sample=lambda r: 5, index_block_size=16,
                  bucket_s=1.0, priority_scheduling=True)
    e = fleet.engines["e"]

    def req(rid: str, prompt: int, priority: int, first: int) -> SimRequest:
        return SimRequest(request_id=rid, prompt_token_ids=list(range(first, first + prompt)),
                          max_tokens=300, arrival_time=0.0, ignore_eos=True, priority=priority)

    fleet.add("e", req("low", 320, 5, 1000))  # admitted first: first in the running list
    now, empty_preempting, finished = 0.0, 0, set()
    for i in range(2000):
        if i == 1:
            fleet.add("e", req("high", 150, 0, 5000))
        before = e.model.stats.num_preemptions
        step = fleet.start(e, now)
        assert step is not None, f"the engine stalled with work at step {i}"
        end, _, out = step
        if out.num_scheduled_tokens == 0 and e.model.stats.num_preemptions > before:
            empty_preempting += 1
        fleet.step_done(e, out, end)
        finished |= {r.request_id for r in out.finished}
        now = end
        if not e.model.has_work():
            break
    assert finished == {"low", "high"}
    assert empty_preempting > 0  # the case this guards
