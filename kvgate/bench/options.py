"""What a bench run is given and what it prepares: the options, the prepared workload, progress.

Shared by the virtual runner (`runner.py`) and the live client (`live.py`), which import this
module and never each other's.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvgate.bench.bound import LowerBound
from kvgate.bench.goodput import DEFAULT_PRECISION
from kvgate.bench.report import FOLD_ALL
from kvgate.bench.virtual import Load, PromptBuilder
from kvgate.bench.workloads import BenchWorkflow
from planner.profile_file import load_profile_file
from planner.profiles import PROFILES, EngineProfile, get_profile
from planner.transfer import TransferLink, parse_link


@dataclass
class BenchOptions:
    """The command line of `kvgate bench` (BENCHMARKS.md)."""

    workload: str | None = None
    dag_file: str | None = None
    workload_args: dict[str, str] = field(default_factory=dict)
    policies: list[str] = field(default_factory=lambda: ["kvgate"])
    engines: int = 8
    profile: str = "h100-llama3-8b"
    profile_file: str | None = None
    """A profile YAML that replaces `profile` (its constants and its name)."""
    rate: float | None = None
    concurrency: int | None = None
    workflows: int | None = None
    seed: int = 0
    mode: str = "virtual"
    json_out: str | None = None
    plot_out: str | None = None
    progress: bool = True
    time_scale: float | None = None
    """Live mode: multiply simulated step times (None: the profile's default)."""
    fidelity: bool = False
    """Run virtual and live, report live, and add how far apart the two are."""
    workflow_trace: str | None = None
    """JSON Lines of workflow specs with their `arrival_s`, replayed at those times."""
    goodput: bool = False
    """Also search each policy's goodput (BENCHMARKS.md)."""
    tasks: bool = False
    """Add each policy's per-task-kind breakdown (`results.<policy>.tasks`) and its table."""
    tasks_fold: str = FOLD_ALL
    """With `tasks`: the digits inside this regex's matches are folded (`report.task_kind`)."""
    slo_jct: float | None = None
    """The goodput SLO: mean JCT at most this many times the bound (default 1.5)."""
    slo_bound_profile: str | None = None
    """With `goodput`: the SLO's bound is computed for engines of this profile (a built-in
    name or a profile YAML) instead of the run's, so every policy is held to the JCT in
    seconds that profile's bound sets: what-ifs on other hardware or engine settings."""
    goodput_precision: float = DEFAULT_PRECISION
    """Bisect until the passing and failing rates are this close (relative)."""
    link: str = "none"
    """The KV transfer link between engines: nvlink, rdma, none, or GB/s."""
    engine_urls: list[str] | None = None
    """Live mode on engines that are already up (real vLLM, say) instead of fresh sims."""
    engine_config: str | None = None
    """Live mode on the engines of this gateway config (their KV-event sockets, tokenizer,
    KV link): `kvgate serve --config` runs it, with each policy in turn."""
    jobs: int = 1
    """Virtual mode: run up to this many policies at once, each in a forked worker process
    (1: one after another, in this process). Results do not depend on it."""

    @property
    def name(self) -> str:
        """The workload's name in the report."""
        if self.workflow_trace is not None:
            return f"workflow-trace:{self.workflow_trace}"
        return self.workload or f"dag-file:{self.dag_file}"

    @property
    def workers(self) -> int:
        """Worker processes the policies run in (0: none, one after another here)."""
        jobs = min(self.jobs, len(self.policies))
        return jobs if jobs > 1 else 0

    def transfer_link(self) -> TransferLink:
        """The link `--link` names."""
        return parse_link(self.link)

    def engine_profile(self) -> EngineProfile:
        """The engines' profile: from --profile-file if given, else the built-in --profile."""
        return load_profile_file(self.profile_file) if self.profile_file else get_profile(
            self.profile)

    def slo_profile(self) -> EngineProfile | None:
        """The profile the goodput SLO's bound is computed for (`slo_bound_profile`: a
        built-in name, else a profile YAML); None: the engines' own."""
        name = self.slo_bound_profile
        if name is None:
            return None
        if name in PROFILES or not name.endswith((".yaml", ".yml")):
            return get_profile(name)
        return load_profile_file(name)


@dataclass
class Prepared:
    """A workload ready to run under any policy."""

    workflows: list[BenchWorkflow]
    load: Load
    bound: LowerBound
    builder: PromptBuilder
    rate: float | None
    concurrency: int | None
    clipped_requests: int = 0
    slo_bound: LowerBound | None = None
    """The goodput SLO's bound when it is another profile's (`slo_bound_profile`)."""


def progress_bar(label: str, stream: Any = sys.stderr) -> Callable[[int, int], None]:
    """A one-line progress bar on a terminal (nothing when `stream` is not a tty)."""
    last = [-1.0]
    started = time.monotonic()

    def update(done: int, total: int) -> None:
        if not stream.isatty() or total <= 0:
            return
        now = time.monotonic()
        if done < total and now - last[0] < 0.2:
            return
        last[0] = now
        width = 30
        filled = int(width * done / total)
        stream.write(f"\r{label:<16} [{'#' * filled}{'.' * (width - filled)}] "
                     f"{done}/{total} workflows, {now - started:.0f} s")
        if done >= total:
            stream.write("\n")
        stream.flush()

    return update


class StatusLine:
    """One line on a terminal for policies running side by side in worker processes: how many
    workflows each has finished, and a line of its own for each policy that is done."""

    def __init__(self, stream: Any, policies: list[str]) -> None:
        self.stream = stream
        self.total = len(policies)
        self.running: dict[str, tuple[int, int]] = {}
        self.finished: set[str] = set()
        self.lock = threading.Lock()
        self.drawn = 0.0

    def follow(self, queue: Any) -> None:
        """Read (policy, done, total) from `queue` until None, redrawing at most 5 times a
        second."""
        while (item := queue.get()) is not None:
            policy, done, total = item
            with self.lock:
                if policy in self.finished:
                    continue
                self.running[policy] = (done, total)
                now = time.monotonic()
                if now - self.drawn >= 0.2:
                    self.drawn = now
                    self._draw()

    def done(self, policy: str, took: float) -> None:
        """`policy` finished: its own line, then the others' status again."""
        with self.lock:
            self.finished.add(policy)
            self.running.pop(policy, None)
            self._clear()
            self.stream.write(f"{policy}: done in {took:.1f} s ({len(self.finished)}/"
                              f"{self.total} policies)\n")
            if self.running:
                self._draw()
            self.stream.flush()

    def _width(self) -> int:
        return max(shutil.get_terminal_size().columns - 1, 20)

    def _clear(self) -> None:
        self.stream.write("\r" + " " * self._width() + "\r")

    def _draw(self) -> None:
        parts = ", ".join(f"{p} {d}/{t}" for p, (d, t) in self.running.items())
        line = f"{len(self.finished)}/{self.total} policies done; running: {parts} workflows"
        self._clear()
        self.stream.write(line[: self._width()])
        self.stream.flush()
