"""The benchmark report: the JSON of BENCHMARKS.md, a table for people, and plots."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

from kvgate.bench.bound import LowerBound
from kvgate.bench.virtual import RunResult
from planner.core import VARIANTS


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0-100) by linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarise(run: RunResult) -> dict[str, Any]:
    """One policy's figures, named as in the JSON report (plus compatible extras)."""
    done = [w for w in run.workflows if w.finished_s is not None and not w.failed]
    jct = [w.finished_s - w.arrival_s for w in done if w.finished_s is not None]
    ok = [r for r in run.requests if r.failed is None and r.finished_s is not None]
    ttft = [r.first_token_s - r.ready_s for r in ok if r.first_token_s is not None]
    waits = [r.dispatched_s - r.ready_s for r in ok]
    start = min((w.arrival_s for w in run.workflows), default=0.0)
    end = max((w.finished_s for w in run.workflows if w.finished_s is not None), default=start)
    makespan = end - start
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    outputs = sum(r.output_tokens for r in ok)
    engines = len(run.busy_s)
    busy = sum(run.busy_s.values())
    return {
        "workflows": len(done),
        "requests": len(run.requests),
        "failed": sum(1 for r in run.requests if r.failed is not None),
        # No workflow finished (every one failed): null, not a JCT of zero.
        "jct_mean_s": sum(jct) / len(jct) if jct else None,
        "jct_p50_s": percentile(jct, 50) if jct else None,
        "jct_p99_s": percentile(jct, 99) if jct else None,
        "makespan_s": makespan,
        "ttft_p50_s": percentile(ttft, 50) if ttft else None,
        "ttft_p90_s": percentile(ttft, 90) if ttft else None,
        "ttft_p99_s": percentile(ttft, 99) if ttft else None,
        "output_tokens_per_s": outputs / makespan if makespan > 0 else 0.0,
        "prefix_hit_ratio": cached / prompt if prompt else 0.0,
        "recomputed_prompt_tokens": run.computed_prompt_tokens,
        "recomputed_static_tokens": _recomputed_static(ok),
        "transferred_bytes": run.transferred_bytes,
        "moves_started": run.moves_started,
        "gateway_wait_p50_s": percentile(waits, 50),
        "compute_utilisation": _compute_utilisation(run, engines, makespan),
        # Live runs cannot see engine busy time: null, not a made-up zero.
        "engine_busy_ratio": busy / (engines * makespan) if engines and makespan > 0 else None,
        "requests_per_engine": _per_engine(ok, sorted(run.busy_s)),
    }


FOLD_ALL = r"\d+"
"""`task_kind`'s default: every number in a task id is folded."""


def task_kind(task: str, fold: str = FOLD_ALL) -> str:
    """A task id with its numbers folded, so siblings read as one kind: `research3` and
    `research7` are `research#`, `n.0.2` is `n.#.#`, `r1a2` is `r#a#`. With `fold`, only the
    numbers inside that regex's matches: `a\\d+` keeps a debate's rounds apart (`r1a#`)."""
    return re.sub(fold, lambda m: re.sub(r"\d+", "#", m.group()), task)


def task_breakdown(run: RunResult, fold: str = FOLD_ALL) -> dict[str, dict[str, float]]:
    """Per task kind (`task_kind` with `fold`), over its requests that finished: how many, and
    the mean gateway wait, time to first token after dispatch, inter-token latency, prompt,
    cached and output tokens. Where a workflow's time goes, against the bound's unloaded
    engine."""
    kinds: dict[str, list[Any]] = {}
    for r in run.requests:
        if r.failed is None and r.finished_s is not None and r.first_token_s is not None:
            kinds.setdefault(task_kind(r.task, fold), []).append(r)
    out: dict[str, dict[str, float]] = {}
    for kind, rs in sorted(kinds.items()):
        n = len(rs)
        gaps = [(r.finished_s - r.first_token_s) / (r.output_tokens - 1)
                for r in rs if r.output_tokens > 1]
        out[kind] = {
            "requests": n,
            "gateway_wait_mean_s": sum(r.dispatched_s - r.ready_s for r in rs) / n,
            "ttft_after_dispatch_mean_s": sum(r.first_token_s - r.dispatched_s for r in rs) / n,
            "itl_mean_s": sum(gaps) / len(gaps) if gaps else 0.0,
            "prompt_tokens_mean": sum(r.prompt_tokens for r in rs) / n,
            "cached_tokens_mean": sum(r.cached_tokens for r in rs) / n,
            "output_tokens_mean": sum(r.output_tokens for r in rs) / n,
        }
    return out


def format_tasks(report: dict[str, Any]) -> str:
    """The `--tasks` table: each policy's per-task-kind breakdown."""
    lines = [f"{'policy':<16}{'task':<14}{'n':>6}{'wait s':>9}{'TTFT s':>9}{'ITL ms':>8}"
             f"{'prompt':>8}{'cached':>8}{'output':>8}"]
    for name, r in report["results"].items():
        for kind, t in r.get("tasks", {}).items():
            lines.append(
                f"{name:<16}{kind:<14}{t['requests']:>6}{t['gateway_wait_mean_s']:>9.3f}"
                f"{t['ttft_after_dispatch_mean_s']:>9.3f}{1000 * t['itl_mean_s']:>8.1f}"
                f"{t['prompt_tokens_mean']:>8.0f}{t['cached_tokens_mean']:>8.0f}"
                f"{t['output_tokens_mean']:>8.0f}")
    return "\n".join(lines)


def _recomputed_static(records: Sequence[Any]) -> int | None:
    """Tokens of the static segments requests opened with that their engines did not serve
    from cache (first uses, evictions, placements away from every copy); None in live mode."""
    known = [r for r in records if r.static_tokens is not None and r.first_token_s is not None]
    if not known:
        return None
    return int(sum(max(0, r.static_tokens - r.cached_tokens) for r in known))


def _compute_utilisation(run: RunResult, engines: int, makespan: float) -> float | None:
    """Model FLOPs executed / (peak FLOP/s x engines x makespan): one sequence decoding per
    engine reads near 0, a pool saturated with prefill near the profile's MFU. Null where the
    FLOPs are not seen (live mode)."""
    if run.flops is None or engines == 0 or makespan <= 0 or run.peak_flops <= 0:
        return None
    return run.flops / (run.peak_flops * engines * makespan)


def _per_engine(records: Sequence[Any], engines: list[str]) -> list[int]:
    """Requests served per engine, in engine-name order (engines unknown to the client, as
    behind sglang-router, are left out)."""
    counts = dict.fromkeys(engines, 0)
    for r in records:
        if r.engine:
            counts[r.engine] = counts.get(r.engine, 0) + 1
    return [counts[e] for e in sorted(counts)]


def build_report(
    *, workload: str, profile: str, engines: int, seed: int, mode: str, rate: float | None,
    concurrency: int | None, workflows: int, bound: LowerBound,
    results: dict[str, dict[str, Any]], extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON report (BENCHMARKS.md); `extra` adds fields without changing existing ones."""
    report: dict[str, Any] = {
        "workload": workload, "profile": profile, "engines": engines, "seed": seed,
        "mode": mode,
        "load": {"rate": rate, "concurrency": concurrency, "workflows": workflows},
        "lower_bound": {"jct_mean_s": bound.jct_mean_s, "makespan_s": bound.makespan_s},
        "results": results,
    }
    if extra:
        report.update(extra)
    return report


def format_table(report: dict[str, Any]) -> str:
    """A readable table, each JCT also as a multiple of the lower bound."""
    lb = report["lower_bound"]
    load = report["load"]
    if load["rate"] is not None:
        how = f"rate {load['rate']}/s"
    elif load["concurrency"] is not None:
        how = f"concurrency {load['concurrency']}"
    else:
        how = "trace timestamps"
    w = max([16, *(len(name) + 2 for name in report["results"])])
    lines = [
        f"{report['workload']} on {report['engines']} x {report['profile']} "
        f"({report['mode']}, {load['workflows']} workflows, {how}, seed {report['seed']})",
        f"lower bound: JCT mean {lb['jct_mean_s']:.3f} s, makespan {lb['makespan_s']:.2f} s",
        "",
        f"{'policy':<{w}}{'JCT mean':>10}{'x bound':>8}{'JCT p99':>10}{'TTFT p50':>10}"
        f"{'TTFT p90':>10}{'TTFT p99':>10}{'out tok/s':>11}{'hit %':>7}{'util %':>7}"
        f"{'failed':>7}",
    ]
    for name, r in report["results"].items():
        jct = r["jct_mean_s"]
        ratio = jct / lb["jct_mean_s"] if jct is not None and lb["jct_mean_s"] > 0 else None
        lines.append(
            f"{name:<{w}}{seconds(jct):>10}{seconds(ratio, 2):>8}{seconds(r['jct_p99_s']):>10}"
            f"{seconds(r['ttft_p50_s']):>10}{seconds(r['ttft_p90_s']):>10}"
            f"{seconds(r['ttft_p99_s']):>10}"
            f"{r['output_tokens_per_s']:>11.0f}{100 * r['prefix_hit_ratio']:>7.1f}"
            f"{_pct(r.get('compute_utilisation')):>7}{r['failed']:>7}")
    return "\n".join(lines)


def seconds(value: float | None, digits: int = 3) -> str:
    """A figure of a report's results, or `-` where it is null (nothing finished)."""
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(ratio: float | None) -> str:
    return "-" if ratio is None else f"{100 * ratio:.1f}"


def plot(report: dict[str, Any], runs: dict[str, RunResult], path: str) -> None:
    """JCT and TTFT distributions per policy and engine utilisation over time, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    jct_ax, ttft_ax, util_ax = axes
    for name, run in runs.items():
        jct = sorted(w.finished_s - w.arrival_s for w in run.workflows
                     if w.finished_s is not None and not w.failed)
        ttft = sorted(r.first_token_s - r.ready_s for r in run.requests
                      if r.first_token_s is not None)
        for ax, xs in ((jct_ax, jct), (ttft_ax, ttft)):
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
        buckets: dict[int, float] = {}
        for per_engine in run.utilisation.values():
            for b, v in per_engine.items():
                buckets[b] = buckets.get(b, 0.0) + v
        if buckets:
            xs_b = sorted(buckets)
            engines = max(1, len(run.utilisation))
            util_ax.plot([b * run.bucket_s for b in xs_b],
                         [100 * buckets[b] / (engines * run.bucket_s) for b in xs_b], label=name)
    jct_ax.axvline(report["lower_bound"]["jct_mean_s"], color="grey", linestyle=":",
                   label="bound (mean)")
    jct_ax.set(title="Workflow completion time", xlabel="seconds", ylabel="CDF")
    ttft_ax.set(title="Time to first token", xlabel="seconds", ylabel="CDF", xscale="log")
    util_ax.set(title="Engine utilisation (mean over engines)", xlabel="time (s)",
                ylabel="busy %")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{report['workload']}: {report['engines']} x {report['profile']} "
                 f"({report['mode']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def rivals(name: str, others: Iterable[str]) -> list[str]:
    """The policies `name` is compared with: every other one, except that kvgate's variants
    (the planner and its ablations) are compared with the baselines, not with each other."""
    mine = name in VARIANTS
    return [o for o in others if o != name and not (mine and o in VARIANTS)]


def format_goodput(report: dict[str, Any]) -> str:
    """The goodput table: each policy's rate, its ratio to the best rival's (another policy;
    for kvgate's variants, the best baseline), and the JCT/bound at that rate; then a line for
    each policy whose search found no bracket."""
    section = report["goodput"]
    slo = section["slo_jct_x_bound"]
    policies = {k: v for k, v in section.items() if isinstance(v, dict)}
    w = max([20, *(len(name) + 2 for name in policies)])
    of = (f" ({section['slo_bound_profile']}'s, {section['slo_bound_jct_mean_s']:.3f} s)"
          if "slo_bound_profile" in section else "")
    lines = [f"goodput: highest Poisson workflow rate with mean JCT <= {slo:g} x bound{of} and "
             "no failed workflow",
             f"{'policy':<{w}}{'workflows/s':>12}{'vs best rival':>15}{'x bound':>9}"
             f"{'probes':>8}"]
    for name, g in sorted(policies.items(), key=lambda kv: -kv[1]["rate"]):
        best_other = max((policies[k]["rate"] for k in rivals(name, policies)), default=0.0)
        ratio = f"{g['rate'] / best_other:.2f}x" if best_other > 0 else "-"
        at = [p["x_bound"] for p in g["points"] if p["rate"] == g["rate"]]
        x = f"{at[0]:.2f}" if at else "-"
        rate = f"{g['rate']:.4g}" if g["rate"] > 0 else "none met"
        lines.append(f"{name:<{w}}{rate:>12}{ratio:>15}{x:>9}{len(g['points']):>8}")
    return "\n".join(lines + [note for name, g in policies.items()
                              if (note := _unbracketed(name, g, slo))])


def _unbracketed(name: str, g: dict[str, Any], slo: float) -> str:
    """Why a policy's goodput is no bracketed figure ("" when it is)."""
    if g["rate"] <= 0:
        low = g["points"][0]
        at_least = ">= " if low.get("cut_short") else ""
        return (f"{name}: no rate tried met the SLO (at {low['rate']:.3g}/s: "
                f"{at_least}{seconds(low['x_bound'])} x bound, {low['failed']} failed "
                "workflows)")
    if not any(p["rate"] > g["rate"] for p in g["points"]):
        return (f"{name}: every rate tried met the SLO, up to {g['rate']:.4g}/s where the "
                "workflows arrive as one burst (or the probe cap): goodput is at least that; "
                "more --workflows load the pool further")
    return ""


def goodput_plot_path(plot_path: str) -> str:
    """Where `--plot OUT.png` puts the goodput curves: `OUT-goodput.png`."""
    stem, dot, ext = plot_path.rpartition(".")
    return f"{stem}-goodput.{ext}" if dot else f"{plot_path}-goodput"


def plot_goodput(report: dict[str, Any], path: str) -> None:
    """JCT / bound against the Poisson rate, one line per policy, with the SLO drawn; probes
    cut short (their multiple a floor) are open upward triangles beside the line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    section = report["goodput"]
    fig, ax = plt.subplots(figsize=(7, 4.8))
    for name, g in section.items():
        if not isinstance(g, dict):
            continue
        points = [p for p in g["points"] if p["failed"] == 0 and not p.get("cut_short")]
        (line,) = ax.plot([p["rate"] for p in points], [p["x_bound"] for p in points],
                          marker="o", label=f"{name} ({g['rate']:.3g}/s)")
        floors = [p for p in g["points"] if p["failed"] == 0 and p.get("cut_short")]
        if floors:
            ax.scatter([p["rate"] for p in floors], [p["x_bound"] for p in floors],
                       marker="^", facecolors="none", edgecolors=line.get_color())
    ax.axhline(section["slo_jct_x_bound"], color="grey", linestyle=":", label="SLO")
    ax.set(title=f"{report['workload']}: {report['engines']} x {report['profile']}",
           xlabel="workflows per second (Poisson)", ylabel="mean JCT / lower bound",
           ylim=(1.0, None))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
