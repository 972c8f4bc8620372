"""A lower bound on what any placement policy can achieve for a workload (sans-IO).

Per task: its prompt is served from cache as far as the workload lets any schedule have computed
it by the time the task is ready, it never queues and it runs alone on an engine, so it costs
one prefill of the rest plus one batch-1 decode step per further output token. A prefix counts
as cached when a task of another workflow also has it (whatever the order: a static prompt may
be warm before the run), or when a task of the same workflow computed it no later than this
task is ready in the bound's own schedule (a parent's prompt and output, an earlier sibling's
prompt). A workflow's own first computation of its private context is never free: no schedule
can read from cache what nothing has computed yet. A workflow's bound is its critical path
(think time included) from its arrival. The makespan bound also respects total capacity: every
distinct prefix token and every output token is computed at least once, and the engines together
compute no faster than their peak rate. Template tokens around synthetic output messages are left
out, which only lowers the bound.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from planner.profiles import EngineProfile

PieceSeq = list[tuple[str, int]]
"""A prompt as (piece name, tokens) pairs; equal names mean equal tokens."""


@dataclass
class _Node:
    tokens: int
    workflow: str | None = None
    """The first workflow whose tasks have this prefix."""
    shared_across: bool = False
    """Tasks of at least two workflows have this prefix."""
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
    overhead_s: float = 0.0
    """The server's latency before the task's request can be scheduled (the profile's request
    and chat overheads; 0 for the GPU profiles)."""


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
    attention = 4.0 * profile.layers * profile.hidden * ctx_sum
    compute = profile.compute_time(n * 2.0 * profile.params + attention, attention)
    memory = (n * profile.weight_bytes + ctx_sum * profile.kv_bytes_per_token) / (
        profile.mem_bandwidth * profile.mbu)
    return n * (profile.step_overhead_s + profile.seq_overhead_s) + max(compute, memory)


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
    for wf_id, tasks in workflows:
        for t in tasks:
            end = _insert(root, t.prompt, wf_id)
            # Inserting the prompt again as the extended sequence's head would change nothing.
            if _extends(t.extended, t.prompt):
                _insert(end, t.extended[len(t.prompt):], wf_id)
            else:
                _insert(root, t.extended, wf_id)
    unique_tokens = _tokens(root)
    jct: dict[str, float] = {}
    ends: list[float] = []
    for wf_id, tasks in workflows:
        start = arrivals(wf_id) if arrivals is not None else 0.0
        finish = _workflow_finish(root, tasks, start, profile)
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


def _insert(node: _Node, seq: PieceSeq, wf_id: str) -> _Node:
    """Add `seq` below `node` as a prefix `wf_id`'s tasks have; returns its last node."""
    for key, n in seq:
        child = node.children.get(key)
        if child is None:
            child = node.children[key] = _Node(n, wf_id)
        elif child.workflow != wf_id:
            child.shared_across = True
        node = child
    return node


def _extends(seq: PieceSeq, head: PieceSeq) -> bool:
    return len(seq) >= len(head) and seq[:len(head)] == head


def _tokens(node: _Node) -> int:
    total = 0
    stack = list(node.children.values())
    while stack:
        n = stack.pop()
        total += n.tokens
        stack.extend(n.children.values())
    return total


def _workflow_finish(root: _Node, tasks: Sequence[TaskShape], start: float,
                     profile: EngineProfile) -> float:
    """When the workflow's last task is done in the bound's schedule: tasks taken in the order
    they become ready, so every task that could have computed a prefix before another is ready
    has been costed first."""
    by_id = {t.id: t for t in tasks}
    waiting = {t.id: len(t.after) for t in tasks}
    dependents: dict[str, list[str]] = {t.id: [] for t in tasks}
    for t in tasks:
        for d in t.after:
            dependents[d].append(t.id)
    computed: dict[int, float] = {}
    """Prefix node (by id) -> when the workflow's own tasks first had it computed."""
    ready_heap = [(start + t.think_time_s, i, t.id) for i, t in enumerate(tasks) if not t.after]
    heapq.heapify(ready_heap)
    order = {t.id: i for i, t in enumerate(tasks)}
    ready_at: dict[str, float] = {}
    done: dict[str, float] = {}
    while ready_heap:
        ready, _, tid = heapq.heappop(ready_heap)
        t = by_id[tid]
        prompt = sum(n for _, n in t.prompt)
        cached = min(_cached(root, t.prompt, computed, ready), prompt - 1)
        prefill = profile.prefill_time(prompt - cached, cached)
        scheduled = ready + t.overhead_s
        done[tid] = scheduled + prefill + decode_time_lb(profile, prompt, t.output_tokens)
        finished = done[tid]

        def prompt_at(upto: int, scheduled: float = scheduled, cached: int = cached) -> float:
            return scheduled + profile.prefill_time(max(0, upto - cached), cached)

        def extended_at(upto: int, prompt: int = prompt, finished: float = finished) -> float:
            return prompt_at(upto) if upto <= prompt else finished

        end = _mark(root, t.prompt, computed, prompt_at, cached, ready)
        if _extends(t.extended, t.prompt):
            # The extended sequence's head is the prompt, marked just now with the same times.
            _mark(end, t.extended[len(t.prompt):], computed, extended_at, upto=prompt)
        else:
            _mark(root, t.extended, computed, extended_at)
        for s in dependents[tid]:
            waiting[s] -= 1
            ready_at[s] = max(ready_at.get(s, start), done[tid])
            if waiting[s] == 0:
                child = by_id[s]
                heapq.heappush(ready_heap, (ready_at[s] + child.think_time_s, order[s], s))
    return max(done.values(), default=start)


def _cached(root: _Node, seq: PieceSeq, computed: dict[int, float], ready: float) -> int:
    """Leading tokens of `seq` a schedule can serve from cache at `ready`: shared with another
    workflow, or computed by this workflow's own tasks by then."""
    node, cached = root, 0
    for key, n in seq:
        child = node.children.get(key)
        if child is None:
            break
        if not child.shared_across and computed.get(id(child), float("inf")) > ready:
            break
        cached += n
        node = child
    return cached


def _mark(node: _Node, seq: PieceSeq, computed: dict[int, float],
          at: Callable[[int], float], free: int = -1, free_at: float = 0.0,
          upto: int = 0) -> _Node:
    """Record when each prefix of `seq` (below `node`, which ends `upto` tokens in) is
    computed: `at(tokens up to its end)`, known to be `free_at` up to `free` tokens (served
    from cache: no prefill time); the earliest time wins (a prompt's leading chunks are in
    cache before its last one). Returns the last node."""
    inf = float("inf")
    for key, n in seq:
        node = node.children[key]
        upto += n
        when = free_at if upto <= free else at(upto)
        if computed.get(id(node), inf) > when:
            computed[id(node)] = when
    return node
