"""`kvgate bench`: build a workload, bound it, run every policy on it and report."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import replace
from typing import Any, TypeVar

import adapters.sim
from gateway.config import engine_url_problem
from kvgate.bench.bound import LowerBound, TaskShape, lower_bound
from kvgate.bench.goodput import (
    DEFAULT_PRECISION,
    DEFAULT_SLO,
    GoodputPoint,
    burst_rate,
    isolation_rate,
    search_goodput,
    start_rate,
)
from kvgate.bench.options import BenchOptions, Prepared, StatusLine, progress_bar
from kvgate.bench.prompts import ChatRenderer, Vocabulary
from kvgate.bench.report import (
    FOLD_ALL,
    build_report,
    format_goodput,
    format_table,
    format_tasks,
    goodput_plot_path,
    plot,
    plot_goodput,
    seconds,
    summarise,
    task_breakdown,
)
from kvgate.bench.virtual import (
    MODEL,
    GiveUp,
    Load,
    PromptBuilder,
    RunResult,
    VirtualRun,
    poisson_arrivals,
    request_overhead,
    trace_arrivals,
)
from kvgate.bench.workloads import (
    BenchTask,
    BenchWorkflow,
    Workload,
    WorkloadError,
    build_workload,
    load_workflow_trace,
)
from kvindex.keys import PromptKeyer
from kvindex.tokenizer import Tokenizer, TokenizerError
from planner.core import moves_kv_with_a_link, planner_names
from planner.dag import DagNode, topological_order
from planner.profiles import EngineProfile

LIVE_ONLY_POLICIES = ("sglang-router",)
DEFAULT_WORKFLOWS = {"claude-code": 77, "mooncake-conversation": 1000,
                     "mooncake-synthetic": 1000, "prefix-groups": 750}



MAX_ENGINES = 4096
"""The most engines a run simulates (each has its own cache and queue in memory)."""

def check_options(o: BenchOptions) -> None:
    """Reject impossible option combinations with a message naming the option."""
    if [o.workload, o.dag_file, o.workflow_trace].count(None) != 2:
        raise WorkloadError("give exactly one of --workload NAME, --dag-file FILE or "
                            "--workflow-trace FILE")
    if o.rate is not None and o.concurrency is not None:
        raise WorkloadError("give at most one of --rate and --concurrency")
    if o.rate is not None and not (o.rate > 0 and math.isfinite(o.rate)):
        raise WorkloadError("--rate must be a positive number of workflows per second")
    if o.concurrency is not None and o.concurrency < 1:
        raise WorkloadError("--concurrency must be at least 1")
    if not 1 <= o.engines <= MAX_ENGINES:
        raise WorkloadError(f"--engines must be from 1 to {MAX_ENGINES}, got {o.engines}")
    if o.workflows is not None and o.workflows < 1:
        raise WorkloadError("--workflows must be at least 1")
    if o.mode not in ("virtual", "live"):
        raise WorkloadError(f"--mode must be virtual or live, not {o.mode!r}")
    if o.fidelity and o.mode != "live":
        raise WorkloadError("--fidelity runs both modes: use it with --mode live")
    if o.tasks_fold != FOLD_ALL:
        if not o.tasks:
            raise WorkloadError("--tasks-fold sets how --tasks folds task ids: use it with "
                                "--tasks")
        try:
            re.compile(o.tasks_fold)
        except re.error as e:
            raise WorkloadError(f"--tasks-fold is not a regular expression: {e}") from None
    if o.slo_bound_profile is not None:
        if not o.goodput:
            raise WorkloadError("--slo-bound-profile sets the goodput SLO's bound: use it with "
                                "--goodput")
        try:
            o.slo_profile()
        except (ValueError, OSError) as e:
            raise WorkloadError(f"--slo-bound-profile: {e}") from None
    if o.slo_jct is not None and not o.goodput:
        raise WorkloadError("--slo-jct sets the goodput SLO: use it with --goodput")
    if o.slo_jct is not None and not (o.slo_jct > 1.0 and math.isfinite(o.slo_jct)):
        raise WorkloadError("--slo-jct must be a number above 1 (no policy beats the lower "
                            "bound)")
    if o.goodput and o.mode != "virtual":
        raise WorkloadError("--goodput searches rates in virtual time: use it with --mode "
                            "virtual")
    if o.engine_urls is not None or o.engine_config is not None:
        if o.mode != "live" or o.fidelity:
            raise WorkloadError("--engine-urls/--engine-config run on engines that are already "
                                "up: use them with --mode live (and without --fidelity)")
        if o.engine_urls is not None and o.engine_config is not None:
            raise WorkloadError("give at most one of --engine-urls and --engine-config")
        if o.engine_urls is not None and not o.engine_urls:
            raise WorkloadError("--engine-urls needs at least one URL")
        for url in o.engine_urls or []:
            if problem := engine_url_problem(url):
                raise WorkloadError(f"--engine-urls: {problem}")
    if not 0 < o.goodput_precision < 1:
        raise WorkloadError("--goodput-precision must be between 0 and 1")
    if o.goodput_precision != DEFAULT_PRECISION and not o.goodput:
        raise WorkloadError("--goodput-precision sets how finely --goodput searches: use it "
                            "with --goodput")
    try:
        o.engine_profile()
    except ValueError as e:
        raise WorkloadError(str(e)) from None
    known = set(planner_names()) | (set(LIVE_ONLY_POLICIES) if o.mode == "live" else set())
    for p in o.policies:
        if p not in known:
            hint = " (runs only with --mode live)" if p in LIVE_ONLY_POLICIES else ""
            raise WorkloadError(f"unknown policy {p!r}{hint}; known: {', '.join(sorted(known))}")
    if not o.policies:
        raise WorkloadError("--policy needs at least one policy")
    twice = sorted({p for p in o.policies if o.policies.count(p) > 1})
    if twice:
        raise WorkloadError(f"--policy names {', '.join(twice)} more than once (a report has "
                            "one row per policy)")


def default_load(o: BenchOptions, workflows: list[BenchWorkflow]) -> tuple[float | None,
                                                                            int | None]:
    """Neither --rate nor --concurrency: traces replay their timestamps, DAGs run 4 per engine."""
    if o.rate is not None or o.concurrency is not None:
        return o.rate, o.concurrency
    if all(w.arrival_s is not None for w in workflows):
        return None, None
    return None, 4 * o.engines


def prepare(o: BenchOptions, tokenizer: Tokenizer | None = None) -> Prepared:
    """Build the workload, its arrival times and its lower bound."""
    tok = tokenizer or Tokenizer.load()
    vocab = Vocabulary(tok)
    builder = PromptBuilder(vocab, ChatRenderer(tok, vocab), PromptKeyer(tok, 16))
    count = o.workflows or DEFAULT_WORKFLOWS.get(o.workload or "", 100)
    profile = o.engine_profile()
    max_tokens = min(profile.max_model_len, profile.num_blocks(profile.block_size)
                     * profile.block_size)
    if o.workflow_trace is not None:
        if o.workload_args:
            raise WorkloadError("--workflow-trace takes no --workload-arg")
        workload = Workload(load_workflow_trace(o.workflow_trace, vocab, o.workflows))
    else:
        workload = build_workload(o.workload, o.dag_file, o.workload_args, count, MODEL, vocab,
                                  max_tokens, o.seed)
    workflows = workload.workflows
    rate, concurrency = default_load(o, workflows)
    if concurrency is not None:
        load = Load(concurrency=concurrency)
    elif rate is not None:
        load = Load(arrivals=poisson_arrivals(workflows, rate, o.seed))
    else:
        load = Load(arrivals=trace_arrivals(workflows))
    tasks = []
    for wf in workflows:
        try:
            tasks.append((wf.id, [(t, builder.shape(wf, t)) for t in _topological(wf)]))
        except TokenizerError as e:  # e.g. a message role the model's chat template refuses
            raise WorkloadError(f"workflow {wf.id}: its prompts cannot be rendered with the "
                                f"model's chat template: {e}") from None
    arrivals = load.arrivals

    def bound_for(p: EngineProfile) -> LowerBound:
        shapes = [(wid, [TaskShape(t.id, t.after, *shape, t.output_tokens, t.think_time_s,
                                   request_overhead(p, t, sum(n for _, n in shape[0])))
                             for t, shape in ordered])
                  for wid, ordered in tasks]
        return lower_bound(shapes, p, o.engines,
                           arrivals.__getitem__ if arrivals is not None else None, concurrency)

    slo_profile = o.slo_profile()
    return Prepared(workflows, load, bound_for(profile), builder, rate, concurrency,
                    workload.clipped_requests,
                    bound_for(slo_profile) if slo_profile is not None else None)


def no_link_note(policies: list[str], link: bool) -> str | None:
    """For a run without `--link`, a line naming the chosen policies that copy KV between
    engines when they have a transfer path, so their figures are not read as with one."""
    movers = [] if link else [p for p in policies if moves_kv_with_a_link(p)]
    if not movers:
        return None
    return (f"note: without --link no KV moves between engines for {', '.join(movers)} (a "
            "pull is not made, a prefetch recomputes the prefix, nothing is replicated); "
            "--link rdma|nvlink|GBPS gives them a transfer path")


def _topological(wf: BenchWorkflow) -> list[BenchTask]:
    """The workflow's tasks, each after the tasks it depends on (the DAG runtime's order)."""
    try:
        order = topological_order([DagNode(t.id, t.after) for t in wf.tasks])
    except ValueError as e:
        raise WorkloadError(f"workflow {wf.id}: {e}") from None
    return [wf.task(n.id) for n in order]


T = TypeVar("T")

_JOB: Callable[[str], Any] | None = None
"""The per-policy function forked workers run (set before the fork, so it is never pickled)."""

_PROGRESS: Any = None
"""While workers draw a status line: the queue their progress goes to (inherited by the fork)."""


def _run_job(policy: str) -> tuple[str, Any, float]:
    assert _JOB is not None
    started = time.monotonic()
    return policy, _JOB(policy), time.monotonic() - started


def worker_progress(policy: str) -> Callable[[int, int], None] | None:
    """In a worker under a status line: a progress callback that sends each change of the
    finished-workflow count to the parent; else None."""
    queue = _PROGRESS
    if queue is None:
        return None
    last = [-1]

    def update(done: int, total: int) -> None:
        if done != last[0]:
            last[0] = done
            queue.put((policy, done, total))

    return update


def per_policy(o: BenchOptions, fn: Callable[[str], T], status: bool = False) -> dict[str, T]:
    """`fn(policy)` for every policy, in the options' order: one after another here, or with
    `o.jobs` > 1 up to that many at once in forked workers, which share the prepared workload
    (copy on write) and send back only their results. A policy's run depends on nothing but
    the prepared workload and its own state, so the results are the same either way.
    With workers and progress on a terminal, a line per finished policy, and with `status`
    the running ones' progress (`worker_progress`) on one line under them."""
    jobs = o.workers
    if not jobs:
        return {p: fn(p) for p in o.policies}
    global _JOB, _PROGRESS
    _JOB = fn
    # The tokenizer's Rust thread pool must not be used across a fork; the workers only keep
    # tokenizing what they are given, one thread each.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ctx = multiprocessing.get_context("fork")
    board = StatusLine(sys.stderr, o.policies) if o.progress and sys.stderr.isatty() else None
    reader = None
    if board is not None and status:
        _PROGRESS = ctx.SimpleQueue()
        reader = threading.Thread(target=board.follow, args=(_PROGRESS,), daemon=True)
        reader.start()
    done: dict[str, T] = {}
    try:
        # A pool that notices a worker dying (BrokenProcessPool) rather than waiting forever.
        with ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
            futures = [pool.submit(_run_job, policy) for policy in o.policies]
            for future in as_completed(futures):
                if future.exception() is not None:
                    for other in futures:
                        other.cancel()  # those not started; the running ones end first
                policy, result, took = future.result()
                done[policy] = result
                if board is not None:
                    board.done(policy, took)
    finally:
        if reader is not None:
            _PROGRESS.put(None)
            reader.join()
        _JOB = _PROGRESS = None
    return {p: done[p] for p in o.policies}


def run_virtual(o: BenchOptions, prepared: Prepared) -> dict[str, RunResult]:
    """Every policy over fresh engine models in virtual time."""
    profile = o.engine_profile()
    bars = o.progress and not o.workers

    def run(policy: str) -> RunResult:
        return VirtualRun(policy, prepared.workflows, prepared.load, profile, o.engines,
                          prepared.builder, seed=o.seed,
                          progress=progress_bar(policy) if bars else worker_progress(policy),
                          link=o.transfer_link()).run()

    return per_policy(o, run, status=True)


def slo_of(o: BenchOptions) -> float:
    """The goodput SLO: `--slo-jct`, else the default multiple of the bound."""
    return o.slo_jct if o.slo_jct is not None else DEFAULT_SLO


def probe_goodput(o: BenchOptions, prepared: Prepared, policy: str, rate: float,
                  give_up: bool = True) -> GoodputPoint:
    """One probe of the goodput search: `policy` at Poisson `rate`, its mean JCT over the SLO's
    bound. With `give_up`, the run stops as soon as it can no longer meet the SLO
    (`virtual.GiveUp`; the point is then `cut_short`, its JCT the least it could have been)."""
    slo = slo_of(o)
    slo_bound = prepared.slo_bound or prepared.bound
    load = Load(arrivals=poisson_arrivals(prepared.workflows, rate, o.seed))
    run = VirtualRun(policy, prepared.workflows, load, o.engine_profile(), o.engines,
                     prepared.builder, seed=o.seed, link=o.transfer_link(),
                     give_up=GiveUp(prepared.bound.jct_s, slo * slo_bound.jct_mean_s)
                     if give_up else None).run()
    cut = run.cut_short_jct_mean_s
    if cut is None:
        jct = summarise(run)["jct_mean_s"]  # None: no workflow finished
        failed = sum(1 for w in run.workflows if w.failed or w.finished_s is None)
    else:
        jct = cut
        failed = sum(1 for w in run.workflows if w.failed)
    x = (None if jct is None else
         jct / slo_bound.jct_mean_s if slo_bound.jct_mean_s > 0 else float("inf"))
    if o.progress:
        print(f"goodput {policy}: rate {rate:.4g}/s -> {'>= ' if cut else ''}{seconds(x, 2)}"
              f" x bound, {failed} failed", file=sys.stderr)
    return GoodputPoint(rate, jct, x, failed, cut_short=cut is not None)


def run_goodput(o: BenchOptions, prepared: Prepared) -> dict[str, Any]:
    """Each policy's goodput: the report's `goodput` section."""
    slo = slo_of(o)
    bound = prepared.bound
    first = start_rate(len(prepared.workflows), o.engines, sum(bound.jct_s.values()))
    burst = burst_rate(prepared.workflows, bound.jct_mean_s, o.seed, o.goodput_precision)
    section: dict[str, Any] = {"slo_jct_x_bound": slo}
    # The search brackets rates by the engines' own bound; the SLO may be another profile's.
    if prepared.slo_bound is not None:
        section["slo_bound_profile"] = o.slo_bound_profile
        section["slo_bound_jct_mean_s"] = prepared.slo_bound.jct_mean_s

    def search(policy: str) -> dict[str, Any]:
        result: dict[str, Any] = search_goodput(
            lambda rate: probe_goodput(o, prepared, policy, rate), first, slo,
            o.goodput_precision, max_rate=burst,
            plateau_below=isolation_rate(bound.jct_mean_s)).as_json()
        return result

    section.update(per_policy(o, search))
    return section


def fidelity(virtual: dict[str, dict[str, Any]],
             live: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per policy run in both modes: mean JCT and TTFT p50 of each, and the relative gap of the
    live JCT from the virtual one (null where either finished no workflow)."""
    out = {}
    for name in virtual.keys() & live.keys():
        v, lv = virtual[name], live[name]
        jv, jl = v["jct_mean_s"], lv["jct_mean_s"]
        out[name] = {
            "jct_mean_virtual_s": jv, "jct_mean_live_s": jl,
            "jct_mean_diff": (jl - jv) / jv if jv and jl is not None else None,
            "ttft_p50_virtual_s": v["ttft_p50_s"], "ttft_p50_live_s": lv["ttft_p50_s"],
        }
    return dict(sorted(out.items()))


def _cpu_time() -> float:
    """CPU seconds of this process and of its finished child processes (forked workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def run_bench(o: BenchOptions, out: Any = sys.stdout) -> dict[str, Any]:
    """The whole command: prepare, run each policy, write the report, table and plot."""
    check_options(o)
    if o.engine_urls is not None or o.engine_config is not None:
        from kvgate.bench.live import existing_engines

        o = replace(o, engines=len(existing_engines(o)))
    if o.mode != "virtual":
        # Live runs start servers and threads; nothing forks after them.
        o = replace(o, jobs=1)
    prepared = prepare(o)
    started, started_cpu = time.monotonic(), _cpu_time()
    extra: dict[str, Any] = {"workload_args": dict(sorted(o.workload_args.items())),
                             "clipped_requests": prepared.clipped_requests}
    if o.mode == "virtual" and not o.fidelity:
        runs = run_virtual(o, prepared)
    else:
        from kvgate.bench.live import run_live

        runs = run_live(o, prepared)
        if o.fidelity:
            in_virtual = replace(o, policies=[p for p in o.policies
                                              if p not in LIVE_ONLY_POLICIES])
            virtual = {name: summarise(run)
                       for name, run in run_virtual(in_virtual, prepared).items()}
            extra["fidelity"] = fidelity(virtual, {n: summarise(r) for n, r in runs.items()})
    if o.goodput:
        extra["goodput"] = run_goodput(o, prepared)
    link = o.transfer_link()
    if link.enabled:
        extra["link"] = {"name": o.link, "bandwidth_bytes_s": link.bandwidth_bytes_s,
                         "setup_s": link.setup_s}
    elapsed, cpu = time.monotonic() - started, _cpu_time() - started_cpu
    results = {name: summarise(run) for name, run in runs.items()}
    if o.tasks:
        for name, run in runs.items():
            results[name]["tasks"] = task_breakdown(run, o.tasks_fold)
    report = build_report(
        workload=o.name, profile=o.engine_profile().name, engines=o.engines, seed=o.seed,
        mode=o.mode,
        rate=prepared.rate, concurrency=prepared.concurrency,
        workflows=len(prepared.workflows), bound=prepared.bound, results=results, extra=extra,
    )
    print(format_table(report), file=out)
    note = no_link_note(o.policies, o.transfer_link().enabled)
    if note is not None:
        print(note, file=out)
    if o.workflows is not None and len(prepared.workflows) < o.workflows:
        print(f"note: --workflows {o.workflows} asked for more than {o.name} holds; all "
              f"{len(prepared.workflows)} of its workflows ran", file=out)
    if o.tasks:
        print(format_tasks(report), file=out)
    if "goodput" in report:
        print(format_goodput(report), file=out)
    for name, f in extra.get("fidelity", {}).items():
        diff = f["jct_mean_diff"]
        print(f"fidelity {name}: JCT mean virtual {seconds(f['jct_mean_virtual_s'])} s, live "
              f"{seconds(f['jct_mean_live_s'])} s"
              f"{'' if diff is None else f' ({100 * diff:+.1f}%)'}; TTFT p50 virtual "
              f"{seconds(f['ttft_p50_virtual_s'])} s, live {seconds(f['ttft_p50_live_s'])} s",
              file=out)
    engine_model = ("compiled engine model" if adapters.sim.native_path
                    else "engine model as Python; `kvgate native build` compiles it")
    where = f"this process and {o.workers} worker processes" if o.workers else "this process"
    print(f"(ran in {elapsed:.1f} s wall time, {cpu:.1f} s CPU in {where}; {engine_model})",
          file=out)
    if o.json_out:
        with open(o.json_out, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    if o.plot_out:
        plot(report, runs, o.plot_out)
        if "goodput" in report:
            plot_goodput(report, goodput_plot_path(o.plot_out))
    return report

