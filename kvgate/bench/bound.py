"""A lower bound on what any placement policy can achieve for a workload (sans-IO).

Per task: its prompt is served from cache as far as any other task shares its prefix (piece by
piece, whatever the order), it never queues and it runs alone on an engine, so it costs one
prefill of the rest plus one batch-1 decode step per further output token. A workflow's bound is
its critical path (think time included) from its arrival. The makespan bound also respects total
capacity: every distinct prefix token and every output token is computed at least once, and the
engines together compute no faster than their peak rate. Template tokens around synthetic output
messages are left out, which only lowers the bound.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from planner.profiles import EngineProfile

PieceSeq = list[tuple[str, int]]
"""A prompt as (piece name, tokens) pairs; equal names mean equal tokens."""


@dataclass
class _Node:
    tokens: int
    count: int = 0
    children: dict[str, _Node] = field(default_factory=dict)


@dataclass(frozen=True)
class TaskShape:
    """What the bound needs of one task."""

    id: str
    after: tuple[str, ...]
    prompt: PieceSeq
    extended: PieceSeq
    """The prompt as a later task would see it continued by this task's output."""
    output_tokens: int
    think_time_s: float


@dataclass(frozen=True)
class LowerBound:
    """Per-workflow bounds and the run's."""

    jct_s: dict[str, float]
    jct_mean_s: float
    makespan_s: float
    capacity_s: float
    """Total compute at peak rate over all engines: no run can finish sooner after it starts."""


def decode_time_lb(profile: EngineProfile, prompt: int, output: int) -> float:
    """At most the time of the batch-1 decode steps after the first token (a closed form of
    the sum of `decode_step_time`, with max of sums <= sum of maxes)."""
    n = output - 1
    if n <= 0:
        return 0.0
    ctx_sum = n * (prompt + 1) + n * (n - 1) / 2  # sum of (context + 1) over the steps
    compute = (n * 2.0 * profile.params + 4.0 * profile.layers * profile.hidden * ctx_sum) / (
        profile.peak_flops * profile.mfu)
    memory = (n * profile.weight_bytes + ctx_sum * profile.kv_bytes_per_token) / (
        profile.mem_bandwidth * profile.mbu)
    return n * profile.step_overhead_s + max(compute, memory)


def lower_bound(
    workflows: Sequence[tuple[str, Sequence[TaskShape]]],
    profile: EngineProfile,
    engines: int,
    arrivals: Callable[[str], float] | None,
    concurrency: int | None = None,
) -> LowerBound:
    """The bound for `workflows` arriving at `arrivals(workflow)` (None: closed loop with
    `concurrency` workflows in flight)."""
    root = _Node(0)
    # Each task counts once on every node of its prompt and extended paths.
    for _, tasks in workflows:
        for t in tasks:
            seen: set[int] = set()
            for seq in (t.prompt, t.extended):
                node = root
                for key, n in seq:
                    child = node.children.get(key)
                    if child is None:
                        child = node.children[key] = _Node(n)
                    if id(child) not in seen:
                        seen.add(id(child))
                        child.count += 1
                    node = child
    unique_tokens = _tokens(root)
    jct: dict[str, float] = {}
    ends: list[float] = []
    for wf_id, tasks in workflows:
        start = arrivals(wf_id) if arrivals is not None else 0.0
        done: dict[str, float] = {}
        for t in tasks:  # tasks come in a topological order
            ready = max((done[d] for d in t.after), default=start) + t.think_time_s
            prompt = sum(n for _, n in t.prompt)
            cached = min(_shared(root, t.prompt), prompt - 1)
            run = profile.prefill_time(prompt - cached, cached) + decode_time_lb(
                profile, prompt, t.output_tokens)
            done[t.id] = ready + run
        finish = max(done.values(), default=start)
        jct[wf_id] = finish - start
        ends.append(finish)
    capacity = unique_tokens * 2.0 * profile.params / (profile.peak_flops * profile.mfu)
    capacity /= max(1, engines)
    if arrivals is not None:
        first = min((arrivals(w) for w, _ in workflows), default=0.0)
        makespan = max(max(ends, default=first) - first, capacity)
    else:
        paths = list(jct.values())
        makespan = max(max(paths, default=0.0), sum(paths) / max(1, concurrency or 1), capacity)
    mean = sum(jct.values()) / len(jct) if jct else 0.0
    return LowerBound(jct, mean, makespan, capacity)


def _tokens(node: _Node) -> int:
    total = 0
    stack = list(node.children.values())
    while stack:
        n = stack.pop()
        total += n.tokens
        stack.extend(n.children.values())
    return total


def _shared(root: _Node, seq: PieceSeq) -> int:
    """Leading tokens of `seq` that some other task's prompt or extended prompt also has."""
    node, cached = root, 0
    for key, n in seq:
        child = node.children.get(key)
        if child is None or child.count < 2:
            break
        cached += n
        node = child
    return cached
