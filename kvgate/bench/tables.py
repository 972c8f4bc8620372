"""Markdown tables from `kvgate bench --json` reports: `python -m kvgate.bench.tables FILE...`.

The README's result tables are this module's output over the reports `make bench-tables` writes,
so every figure there can be regenerated with one command.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

from kvgate.bench.report import rivals, seconds


def _load_line(report: dict[str, Any]) -> str:
    load = report["load"]
    if load["rate"] is not None:
        how = f"Poisson {load['rate']:g} workflows/s"
    elif load["concurrency"] is not None:
        how = f"closed loop, concurrency {load['concurrency']}"
    else:
        how = "trace timestamps"
    args = report.get("workload_args") or {}
    arg_text = ", ".join(f"{k}={v}" for k, v in args.items())
    lb = report["lower_bound"]
    return (f"**{report['workload']}**{f' ({arg_text})' if arg_text else ''}: "
            f"{report['engines']} x `{report['profile']}`, {load['workflows']} workflows, {how}, "
            f"seed {report['seed']}; lower bound JCT mean {lb['jct_mean_s']:.2f} s")


def _util(r: dict[str, Any]) -> str:
    u = r.get("compute_utilisation")
    return "-" if u is None else f"{100 * u:.1f}%"


def results_table(report: dict[str, Any]) -> str:
    """One row per policy: JCT (and x bound), TTFT, throughput, hits, utilisation, wait."""
    bound = report["lower_bound"]["jct_mean_s"]
    rows = [_load_line(report), "",
            "| policy | JCT mean (s) | x bound | JCT p99 (s) | TTFT p50 / p90 (s) | out tok/s "
            "| prefix hits | compute util. | gateway wait p50 (s) | failed |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["results"].items():
        jct = r["jct_mean_s"]
        x = jct / bound if jct is not None and bound > 0 else None
        rows.append(
            f"| {name} | {seconds(jct, 2)} | {seconds(x, 2)} | {seconds(r['jct_p99_s'], 2)} | "
            f"{seconds(r['ttft_p50_s'])} / {seconds(r['ttft_p90_s'])} | "
            f"{r['output_tokens_per_s']:.0f} | "
            f"{100 * r['prefix_hit_ratio']:.1f}% | {_util(r)} | "
            f"{r.get('gateway_wait_p50_s', 0.0):.3f} | {r['failed']} |")
    return "\n".join(rows)


def goodput_table(report: dict[str, Any]) -> str | None:
    """Goodput per policy and its ratio to the best rival's (`report.rivals`); None without
    `--goodput`."""
    section = report.get("goodput")
    if not section:
        return None
    slo = section["slo_jct_x_bound"]
    rates = {name: v["rate"] for name, v in section.items() if isinstance(v, dict)}
    rows = [f"Goodput (highest Poisson workflow rate with mean JCT <= {slo:g} x bound, "
            "no failures):", "",
            "| policy | goodput (workflows/s) | vs best rival | probes |", "|---|---|---|---|"]
    for name, rate in sorted(rates.items(), key=lambda kv: -kv[1]):
        others = [rates[n] for n in rivals(name, rates)]
        best_other = max(others, default=0.0)
        ratio = f"{rate / best_other:.2f}x" if best_other > 0 else "-"
        points = section[name]["points"]
        if rate <= 0:
            shown = "none met"
        elif not any(p["rate"] > rate for p in points):
            shown = f">= {rate:.3f} (all arrived at once)"
        else:
            shown = f"{rate:.3f}"
        rows.append(f"| {name} | {shown} | {ratio} | {len(points)} |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    """Print every report's tables, in the order given."""
    paths = list(sys.argv[1:] if argv is None else argv)
    if not paths:
        print("usage: python -m kvgate.bench.tables REPORT.json ...", file=sys.stderr)
        return 2
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        print(results_table(report))
        good = goodput_table(report)
        if good:
            print()
            print(good)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
