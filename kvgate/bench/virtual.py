"""The virtual-time driver: a discrete-event run of the gateway's planner over engine models.

Everything that decides is the live service's own code: the `Planner` object (routing policy,
load ledger, holding), the KV index fed by the engines' KV events through the same
`EventIngestor` (as vLLM's wire structs, handed over decoded: the msgpack round trip gave the
same operations and cost a tenth of a trace replay), the prompt keyer, and the sans-IO
`EngineModel` the simulated server runs. This driver only turns workflow arrivals and engine
steps into planner events and carries out the planner's actions.
Only the clock is virtual: an engine step that takes `d` seconds moves its engine's next step
`d` ahead, and the loop jumps from event to event. Deterministic for a seed.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import random
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, cast

from adapters.sim.frontend import ApiServer
from adapters.sim.link import LinkModel
from adapters.sim.model import (
    BlockRemoved,
    EngineConfig,
    EngineModel,
    KVEvent,
    KVPull,
    RemotePrefill,
    SimRequest,
    StepOutput,
)
from adapters.sim.publisher import wire_batch
from gateway.config import GatewayConfig, IndexSettings
from kvgate.bench.prompts import ChatMessage, ChatRenderer, Content, Piece, Vocabulary
from kvgate.bench.workloads import BenchTask, BenchWorkflow, OutputRef
from kvindex.index import InMemoryIndex
from kvindex.ingest import EventIngestor, apply_ops_sync
from kvindex.keys import KeyExtras, PromptKeyer, block_key
from planner.actions import Action, Reject, Transfer, Warm
from planner.core import PACE, Call, make_planner, planner_settings, reject_message
from planner.dag import DagNode, DagRun, Wakeup
from planner.events import (
    EngineJoined,
    EngineScraped,
    Finished,
    FirstToken,
    TaskSpec,
    TransferDone,
    TransferFailed,
    WorkflowOver,
    WorkflowSubmitted,
)
from planner.hints import RequestHints
from planner.movement import RECENT_ORIGINS
from planner.policy import PolicyContext, RouteRequest, reads_index, scrape_interval
from planner.profiles import EngineProfile
from planner.segments import SYSTEM_ROLES
from planner.transfer import NO_LINK, TransferLink

MODEL = "kvgate-bench"


@dataclass
class RequestRecord:
    """One task's request, as the client and the engine saw it."""

    workflow: str
    task: str
    ready_s: float
    dispatched_s: float = 0.0
    first_token_s: float | None = None
    finished_s: float | None = None
    engine: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    failed: str | None = None
    static_tokens: int | None = None
    """Tokens (whole blocks) of the static segment its prompt opens with; None where the
    driver does not know the segments (live mode)."""


@dataclass
class WorkflowRecord:
    """One workflow's life."""

    id: str
    arrival_s: float
    finished_s: float | None = None
    failed: bool = False


@dataclass
class RunResult:
    """Everything a run observed, for the report."""

    policy: str
    requests: list[RequestRecord]
    workflows: list[WorkflowRecord]
    busy_s: dict[str, float]
    """Per engine, seconds spent in steps."""
    utilisation: dict[str, dict[int, float]]
    """Per engine, busy seconds per `bucket_s` bucket of the run."""
    bucket_s: float
    computed_prompt_tokens: int
    """Prompt tokens the engines computed rather than served from cache (their prefix-cache
    queries minus hits)."""
    transferred_bytes: int = 0
    flops: float | None = None
    """Model FLOPs the engines executed (None where the driver cannot see them: live mode)."""
    peak_flops: float = 0.0
    """One engine's peak FLOP/s, for compute utilisation."""
    cut_short_jct_mean_s: float | None = None
    """Set when the run stopped early (`GiveUp`): the least mean JCT it could still have had."""
    moves_started: dict[str, int] | None = None
    """KV moves the planner started, by kind and reason (`transfer:prefetch`, `warm:pace`:
    a paced prefill's pieces, ...); None where the driver cannot see the planner (live mode)."""


@dataclass(frozen=True)
class GiveUp:
    """Stop a run once its mean JCT can no longer stay within `mean_jct_s` (a goodput probe
    that has already missed its SLO). Each workflow's JCT is at least its lower bound
    (`floor_s`, the workload's `Bound.jct_s`) and, while it runs, at least the time since it
    arrived; the run stops when those floors and the JCTs of the finished ones sum to more
    than `mean_jct_s` per workflow."""

    floor_s: dict[str, float]
    mean_jct_s: float


@dataclass
class Load:
    """How workflows arrive: at given times (`arrivals`) or as a closed loop (`concurrency`)."""

    arrivals: dict[str, float] | None = None
    concurrency: int | None = None


def poisson_arrivals(workflows: list[BenchWorkflow], rate: float, seed: int) -> dict[str, float]:
    """Arrival times: trace timestamps rescaled to `rate`, else a seeded Poisson process."""
    timed = [w for w in workflows if w.arrival_s is not None]
    first = min((w.arrival_s or 0.0 for w in timed), default=0.0)
    span = max((w.arrival_s or 0.0 for w in timed), default=0.0) - first
    # A trace whose arrivals have no spread (one instant, or one workflow) cannot be rescaled
    # to `rate`: it arrives as the Poisson process below does.
    if timed and len(timed) == len(workflows) and (span > 0 or len(timed) == 1):
        scale = 1.0 if rate <= 0 or span <= 0 else (len(timed) - 1) / rate / span
        return {w.id: ((w.arrival_s or 0.0) - first) * scale for w in workflows}
    rng = random.Random(seed)
    t = 0.0
    out = {}
    for w in workflows:
        out[w.id] = t
        t += rng.expovariate(rate)
    return out


def trace_arrivals(workflows: list[BenchWorkflow]) -> dict[str, float]:
    """Arrival times exactly as the trace has them, from 0."""
    first = min((w.arrival_s or 0.0) for w in workflows)
    return {w.id: (w.arrival_s or 0.0) - first for w in workflows}


def _engine_hasher(
    parent: int | None, tokens: Sequence[int], extra: tuple[object, ...] | None
) -> int:
    """The index's own block key, so a prompt's keys can seed the engine model's hashes (the
    model's extras are (name, value) pairs; the index's are the flattened values)."""
    flat = None
    if extra:
        flat = tuple(str(x) for pair in extra if isinstance(pair, tuple) for x in pair)
    return block_key(parent, tokens, flat)


def is_chat(task: BenchTask | None) -> bool:
    """A chat request (a trace task is sent as a completion, a KV move's legs, `task` None, as
    token ids)."""
    return task is not None and not task.blocks


def request_overhead(profile: EngineProfile, task: BenchTask | None = None,
                     prompt_tokens: int = 0) -> float:
    """The server's latency before a request can be scheduled, without queueing: the profile's
    request overhead and its cost per prompt token, plus its chat overhead for a chat task.
    0 for the GPU profiles."""
    return profile.server_latency(is_chat(task), prompt_tokens)


def _merged_removals(events: list[KVEvent]) -> list[KVEvent]:
    """A step's events with each run of consecutive BlockRemoved merged into one event.

    vLLM announces every evicted block on its own; the ingestor turns a run of removals into
    one index operation whichever way they are packed, so the index sees the same operations.
    Under eviction, encoding and decoding thousands of one-block events per step was a large
    share of a long-context run: the driver's engines announce an allocation's evictions in one
    event (`EngineConfig.removal_per_event` off), and a step's allocations are merged here.
    """
    out: list[KVEvent] = []
    for kind, run in itertools.groupby(events, type):
        if kind is BlockRemoved:
            removed = cast("Iterable[BlockRemoved]", run)
            out.append(BlockRemoved(tuple(itertools.chain.from_iterable(
                map(_REMOVED_HASHES, removed)))))
        else:
            out.extend(run)
    return out


_REMOVED_HASHES = attrgetter("block_hashes")
_PIECE_IDS = attrgetter("ids")
_PIECE_KEY = attrgetter("key")

CHUNK_BLOCKS = 64
"""A trace prompt (one piece per block) is keyed in chunks of this many of its pieces, counted
from its start, so a conversation's next turn shares every whole chunk of the last one: the
keyer walks a path of ~100 nodes instead of one per block (the same ids and keys: a chunk's
name joins its pieces' names, and equal names mean equal ids)."""


class _ChunkIds(Sequence[Sequence[int]]):
    """The ids of a trace prompt's chunks, each made only when the keyer asks for it (the
    chunks it has not cached: a turn's last one or two)."""

    def __init__(self, pieces: Sequence[Piece], count: int) -> None:
        self._pieces = pieces
        self._count = count

    def __len__(self) -> int:
        return self._count

    def _chunk(self, i: int) -> tuple[int, ...]:
        start = i * CHUNK_BLOCKS
        return tuple(itertools.chain.from_iterable(
            map(_PIECE_IDS, self._pieces[start:start + CHUNK_BLOCKS])))

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self._chunk(j) for j in range(*i.indices(self._count))]
        if not -self._count <= i < self._count:
            raise IndexError(i)
        return self._chunk(i % self._count)


class _Prefix(Sequence[int]):
    """The first `n` of `ids`, without a copy (the engine model reads a prompt by `len` and
    slices)."""

    __slots__ = ("_ids", "_n")

    def __init__(self, ids: Sequence[int], n: int) -> None:
        self._ids = ids
        self._n = n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return self._ids[slice(*i.indices(self._n))]
        if not -self._n <= i < self._n:
            raise IndexError(i)
        return self._ids[i % self._n]


def _chunked(pieces: Sequence[Piece]) -> tuple[list[str], Sequence[Sequence[int]]]:
    """Names and ids of a trace prompt's chunks (`CHUNK_BLOCKS`)."""
    names = list(map(_PIECE_KEY, pieces))
    chunk_names = ["|".join(names[i:i + CHUNK_BLOCKS]) for i in range(0, len(names),
                                                                       CHUNK_BLOCKS)]
    return chunk_names, _ChunkIds(pieces, len(chunk_names))


@dataclass
class _Engine:
    name: str
    model: EngineModel
    busy: bool = False
    seq: int = 0
    buckets: dict[int, float] = field(default_factory=dict)
    """Busy seconds per utilisation bucket (`Fleet.utilisation`)."""


@dataclass
class _Live:
    """A request in flight."""

    record: RequestRecord
    wf: BenchWorkflow
    task: BenchTask
    route: RouteRequest
    output_piece: Piece
    token_ids: Sequence[int]


@dataclass
class _Leg:
    """One engine request of a KV move: a transfer's producer or consumer leg, or a warm-up."""

    move: Transfer | Warm
    token_ids: Sequence[int]
    cache_salt: str | None


@dataclass
class _Waiting:
    """A ready request not sent yet (the planner may hold it at the gateway)."""

    record: RequestRecord
    wf: BenchWorkflow
    task: BenchTask
    route: RouteRequest
    token_ids: Sequence[int]


class EventHeap:
    """The virtual clock's agenda: (time, kind, data) in time order, ties in push order."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str, object]] = []
        self._order = itertools.count()

    def __bool__(self) -> bool:
        return bool(self._heap)

    def push(self, t: float, kind: str, data: object) -> None:
        """Schedule `kind` at `t`."""
        heapq.heappush(self._heap, (t, next(self._order), kind, data))

    def pop(self) -> tuple[float, str, object]:
        """The earliest event."""
        t, _, kind, data = heapq.heappop(self._heap)
        return t, kind, data

    def next_time(self) -> float:
        """When the earliest event is due (infinity when there is none)."""
        return self._heap[0][0] if self._heap else float("inf")


class Fleet:
    """The engine models, the KV index their events feed, and their step accounting.

    Engines step on their own: `kick` starts a step on every idle engine touched since the last
    kick and returns when each will end; `step_done` ingests the step's KV events (vLLM's wire
    structs, through the gateway's `EventIngestor`) into the index.
    """

    def __init__(self, names: list[str], profile: EngineProfile, eos_token_id: int,
                 sample: Callable[[SimRequest], int], index_block_size: int,
                 bucket_s: float, priority_scheduling: bool = False,
                 link: TransferLink = NO_LINK) -> None:
        bs = profile.block_size
        num_blocks = profile.num_blocks(bs)
        self.config = EngineConfig(
            block_size=bs, num_blocks=num_blocks,
            max_num_batched_tokens=profile.max_num_batched_tokens,
            long_prefill_token_threshold=profile.long_prefill_token_threshold,
            max_num_seqs=profile.max_num_seqs,
            max_model_len=min(profile.max_model_len, num_blocks * bs),
            eos_token_id=eos_token_id, priority_scheduling=priority_scheduling,
            removal_per_event=False,
        )
        self.engines = {n: _Engine(n, EngineModel(self.config, profile, sample,
                                                  _engine_hasher)) for n in names}
        self.index = InMemoryIndex()
        self.ingestor = EventIngestor(index_block_size)
        self.ingest = True
        """Ingest the engines' KV events into the index (off when no one reads it)."""
        self.index_block_size = index_block_size
        self.bucket_s = bucket_s
        self.utilisation: dict[str, dict[int, float]] = {
            n: e.buckets for n, e in self.engines.items()}
        self._dirty: list[_Engine] = []
        self.link = LinkModel(link) if link.enabled else None
        self.block_bytes = bs * profile.kv_bytes_per_token
        self.pulls: list[tuple[float, str, KVPull]] = []
        """Pulls the last kicks started: (when the link delivers, destination, pull)."""

    def add(self, engine: str, request: SimRequest) -> None:
        """Queue a request at an engine (it starts at the next kick)."""
        e = self.engines[engine]
        self._dirty.append(e)
        e.model.add_request(request)

    def scraped(self) -> list[EngineScraped]:
        """What each engine's `/metrics` would show now."""
        return [EngineScraped(e.name, e.model.num_running, e.model.num_waiting,
                              e.model.pool.usage) for e in self.engines.values()]

    def kick(self, now: float) -> list[tuple[float, _Engine, StepOutput]]:
        """Start a step on every idle engine that may have work; (end time, engine, step)."""
        dirty = self._dirty
        if not dirty:
            return []
        self._dirty = []
        started = []
        for e in dirty:
            if e.busy or not e.model.has_work():
                continue
            step = self.start(e, now)
            if step is not None:
                started.append(step)
        return started

    def start(self, e: _Engine, now: float) -> tuple[float, _Engine, StepOutput] | None:
        """Start a step on an idle engine with work; (end time, engine, step), or None when
        nothing is schedulable until something finishes."""
        preemptions = e.model.stats.num_preemptions
        out = e.model.step(now)
        if e.model.loading:
            for pull in e.model.drain_pulls():
                self._pull(e.name, pull, now)
        if (out.num_scheduled_tokens == 0 and not out.outputs
                and e.model.stats.num_preemptions == preemptions):
            return None
        # A step that only preempted (a running request that found no free block and was the
        # last one left to evict: vLLM then schedules nothing more that step) is a step all
        # the same: vLLM's engine loop schedules again at once, and the requests still running
        # go on. Left idle here, the engine would wait for a finish that never comes.
        e.busy = True
        end = now + out.duration
        # Most steps end in the bucket they start in: `_account`'s first pass, inline.
        b = int(now // self.bucket_s)
        if now < end <= (b + 1) * self.bucket_s:
            e.buckets[b] = e.buckets.get(b, 0.0) + (end - now)
        else:
            self._account(e, now, out)
        return end, e, out

    def _pull(self, destination: str, pull: KVPull, now: float) -> None:
        if self.link is None:
            # No transfer path: the connector's load fails at once and the engine recomputes.
            self.pulls.append((now, destination, pull))
            return
        done = self.link.schedule(pull.remote_engine_id, destination,
                                  pull.num_blocks * self.block_bytes, now)
        self.pulls.append((done, destination, pull))

    def pulled(self, destination: str, pull: KVPull) -> None:
        """The link delivered a pull: the consumer goes on, the producer frees its blocks."""
        dest = self.engines[destination]
        dest.model.finish_remote_load(pull.request_id, ok=self.link is not None)
        source = self.engines.get(pull.remote_engine_id)
        if source is not None:
            source.model.release_export(pull.remote_request_id)
            self._dirty.append(source)
        self._dirty.append(dest)

    @property
    def transferred_bytes(self) -> int:
        """KV bytes moved between engines so far."""
        return self.link.bytes_moved if self.link is not None else 0

    def step_done(self, e: _Engine, out: StepOutput, now: float) -> None:
        """A step ended: the engine may start another; its KV events reach the index."""
        e.busy = False
        self._dirty.append(e)
        if out.kv_events and self.ingest:
            batch = wire_batch(_merged_removals(out.kv_events), now)
            result = self.ingestor.on_batch(e.name, e.seq, batch)
            e.seq += 1
            apply_ops_sync(self.index, result.ops)

    def idle_again(self, e: _Engine) -> bool:
        """An inert step of `e` ended (nothing for the index): `step_done` for it, True when
        no other engine waits to be kicked, so `e` alone may start its next step."""
        e.busy = False
        if self._dirty or self.pulls:
            self._dirty.append(e)
            return False
        return True

    def _account(self, e: _Engine, now: float, out: StepOutput) -> None:
        """Spread a step's busy time over the buckets it spans."""
        buckets = e.buckets
        t, end = now, now + out.duration
        while t < end:
            b = int(t // self.bucket_s)
            upto = min(end, (b + 1) * self.bucket_s)
            buckets[b] = buckets.get(b, 0.0) + (upto - t)
            t = upto


def static_segment(task: BenchTask, tenant: str | None) -> str:
    """A name for the static segment the task's prompt opens with (its tools and leading
    system message; equal content of one tenant, equal name), "" if it opens with none."""
    lead = task.messages[0] if task.messages else None
    system = (f"{lead.role}:{lead.content.key}" if isinstance(lead, ChatMessage)
              and lead.role in SYSTEM_ROLES else "")
    if not system and not task.tools_key:
        return ""
    return f"{tenant or ''}|{task.tools_key or ''}|{system}"


def _system(m: object) -> bool:
    """A system message (a segment's or a literal one), which opens a call's static lead."""
    return isinstance(m, ChatMessage) and m.role in SYSTEM_ROLES


class PromptBuilder:
    """Materialises task prompts (with their parents' outputs) as pieces, text and keys."""

    def __init__(self, vocab: Vocabulary, renderer: ChatRenderer, keyer: PromptKeyer) -> None:
        self.vocab = vocab
        self.renderer = renderer
        self.keyer = keyer

    def output_piece(self, wf: BenchWorkflow, task: BenchTask) -> Piece:
        """The task's output: deterministic synthetic words, the same under every policy."""
        return self.vocab.piece(f"out:{wf.id}/{task.id}", task.output_tokens)

    def pieces(self, wf: BenchWorkflow, task: BenchTask) -> list[Piece]:
        """The prompt as pieces (blocks for trace tasks, rendered messages for chat tasks)."""
        if task.blocks:
            return list(task.blocks)
        messages = []
        for m in task.messages:
            if isinstance(m, OutputRef):
                out = self.output_piece(wf, wf.task(m.task))
                m = ChatMessage(m.role, Content(out.key, out.text, out.ids))
            messages.append(m)
        return self.renderer.render(messages, task.tools, task.tools_key)

    def static_blocks(self, task: BenchTask, pieces: Sequence[Piece], block_size: int) -> int:
        """Full blocks of the prompt's static lead, as the live gateway counts a call's
        (`gateway.proxy.static_blocks`): the template's framing, the tools and the leading
        system messages; none when no system message leads (tools alone render differently
        without one in some templates). The planner tags the rest of the prompt by its own
        rules, in both drivers. Trace prompts (blocks, no messages) have none."""
        messages = list(task.messages)
        if task.blocks or not messages or not _system(messages[0]):
            return 0
        j = tokens = 0
        for p in pieces:
            if p.key == "<bos>" or p.key.startswith("tools:"):
                if p.key != "<bos>" and j < len(messages) and _system(messages[j]):
                    j += 1  # the template folds the leading system message into the tools
                tokens += len(p.ids)
                continue
            if p.key == "<generation>" or j >= len(messages) or not _system(messages[j]):
                break
            j += 1
            tokens += len(p.ids)
        return tokens // block_size

    def prompt_tokens(self, wf: BenchWorkflow, task: BenchTask) -> int:
        """Tokens in the task's prompt (the sum of `shape`'s prompt counts)."""
        if task.blocks:
            return sum(map(len, map(_PIECE_IDS, task.blocks)))
        return sum(n for _, n in self.shape(wf, task)[0])

    def shape(self, wf: BenchWorkflow, task: BenchTask) -> tuple[list[tuple[str, int]],
                                                                 list[tuple[str, int]]]:
        """(prompt, prompt continued by the output) as named token counts, for the bound."""
        out_key = f"out:{wf.id}/{task.id}"
        if task.blocks:
            prompt = [(p.key, len(p.ids)) for p in task.blocks]
            return prompt, [*prompt, (out_key, task.output_tokens)]
        seq: list[tuple[str, int]] = []
        for m in task.messages:
            if isinstance(m, OutputRef):
                seq.append((f"{m.role}:out:{wf.id}/{m.task}", wf.task(m.task).output_tokens))
            else:
                seq.append((f"{m.role}:{m.content.key}", len(self.renderer.message(m).ids)))
        return seq, [*seq, (f"assistant:{out_key}", task.output_tokens)]


class VirtualRun:
    """One policy over fresh engine models in virtual time."""

    def __init__(
        self,
        policy: str,
        workflows: list[BenchWorkflow],
        load: Load,
        profile: EngineProfile,
        engines: int,
        builder: PromptBuilder,
        seed: int = 0,
        bucket_s: float = 1.0,
        progress: Callable[[int, int], None] | None = None,
        link: TransferLink = NO_LINK,
        give_up: GiveUp | None = None,
    ) -> None:
        self.workflows = workflows
        self.give_up = give_up if load.arrivals is not None else None
        self.load = load
        self.profile = profile
        self.builder = builder
        self.bucket_s = bucket_s
        self.progress = progress
        defaults = GatewayConfig.model_fields
        self.scrape_s = float(defaults["scrape_interval_s"].default)
        index = IndexSettings()
        self.block_size = index.block_size
        self.speculative_ttl_s = index.speculative_ttl_s
        names = [f"engine-{i}" for i in range(engines)]
        ctx = PolicyContext(profiles=dict.fromkeys(names, profile), default_profile=profile,
                            block_size=self.block_size, seed=seed, link=link)
        self.policy_name = policy
        # A planner that ranks calls runs its engines with `--scheduling-policy priority` (its
        # deployment); the per-request routers' engines run vLLM's default, fcfs.
        self.fleet = Fleet(names, profile, builder.vocab.tokenizer.eos_token_id, self._sample,
                           self.block_size, bucket_s,
                           priority_scheduling=planner_settings(policy).priorities,
                           link=link)
        self.config = self.fleet.config
        self._api = {n: ApiServer(profile) for n in names}
        """Each engine's API server (its per-request cost and queue)."""
        self.index = self.fleet.index
        self.planner = make_planner(policy, ctx, speculative_ttl_s=self.speculative_ttl_s,
                                    engine_block_size=self.fleet.ingestor.engine_block_size)
        routing = self.planner.policy
        self.scrape_s = scrape_interval(routing, self.scrape_s)
        # Only character-level policies read the prompt text; building it costs a join.
        self._needs_text = bool(getattr(routing, "reads_prompt_text", False))
        # A policy that never reads the index needs no matches and no ingested events (the
        # engines' own caches, which the report reads, are the same either way).
        self._reads_index = reads_index(routing)
        self.fleet.ingest = self._reads_index
        self._wakeup_at: float | None = None
        for n in names:
            self.planner.on_event(EngineJoined(n, healthy=True, models=frozenset((MODEL,))), 0.0)
        self._heap = EventHeap()
        self._live: dict[str, _Live] = {}
        self._waiting: dict[str, _Waiting] = {}
        self._legs: dict[str, _Leg] = {}
        self._paced: dict[str, int] = {}
        """Per request, prompt tokens its own paced-prefill warm-ups computed (they are its
        prefill, not cache hits: its record's cached tokens leave them out)."""
        self._recent: OrderedDict[str, tuple[Sequence[int], str | None]] = OrderedDict()
        """Prompts of the last RECENT_ORIGINS finished requests: a later move may copy one
        (a join's prefetch names a parent that has finished)."""
        self._over = 0
        self._jct_sum = 0.0
        """Summed JCTs of the workflows over (`GiveUp`)."""
        self._floor_to_come = (sum(self.give_up.floor_s.get(w.id, 0.0) for w in workflows)
                               if self.give_up is not None else 0.0)
        """Summed lower bounds of the workflows yet to arrive (`GiveUp`)."""
        self._runs: dict[str, DagRun] = {}
        self._rid = itertools.count()
        self.records: list[RequestRecord] = []
        self.wf_records: dict[str, WorkflowRecord] = {}
        self.computed_prompt_tokens = 0
        self.now = 0.0
        self._cut_short: float | None = None

    # -- engine model hooks ---------------------------------------------------------------------

    @staticmethod
    def _sample(req: SimRequest) -> int:
        """Only a move's legs ask (a task's request carries its planned output,
        `SimRequest.output_plan`): they answer one token nobody reads."""
        return 0

    # -- event loop -----------------------------------------------------------------------------

    def _push(self, t: float, kind: str, data: object) -> None:
        self._heap.push(t, kind, data)

    def run(self) -> RunResult:
        """Run every workflow to completion (or failure)."""
        # The run allocates millions of short-lived acyclic objects; cyclic collection passes
        # over them cost a fifth of the time and find nothing.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            return self._run()
        finally:
            if gc_was_enabled:
                gc.enable()

    def _run(self) -> RunResult:
        pending = list(self.workflows)
        if self.load.arrivals is not None:
            for wf in pending:
                self._push(self.load.arrivals[wf.id], "arrive", wf)
            self._queue: list[BenchWorkflow] = []
        else:
            c = max(1, self.load.concurrency or 1)
            for wf in pending[:c]:
                self._push(0.0, "arrive", wf)
            self._queue = pending[c:][::-1]
        self._push(0.0, "scrape", None)
        total = len(self.workflows)
        finished = 0
        while self._heap:
            t, kind, data = self._heap.pop()
            self.now = t
            if kind == "arrive":
                assert isinstance(data, BenchWorkflow)
                self._arrive(data)
            elif kind == "ready":
                assert isinstance(data, tuple)
                self._ready(*data)
            elif kind == "step":
                assert isinstance(data, tuple)
                e, out = data
                if out.inert and not self.planner.pending:
                    # It only frees its engine: no KV event, first token or end reaches the
                    # index or the planner, and nothing waits to be released, so the rest of
                    # `_step_done` would find nothing to do (most of a trace replay's steps).
                    if self.fleet.idle_again(e):
                        self._restart(e)
                    else:
                        self._kick()
                    continue
                finished += self._step_done(e, out)
                if self.progress is not None:
                    self.progress(finished, total)
            elif kind == "pulled":
                assert isinstance(data, tuple)
                self.fleet.pulled(*data)
            elif kind == "admit":
                assert isinstance(data, tuple)
                self.fleet.add(*data)
            elif kind == "wakeup":
                if self._wakeup_at == t:
                    self._wakeup_at = None
                    self._carry_out_all(self.planner.release(t))
            elif kind == "scrape":
                self._scrape()
                self._release()
                # Keep scraping while any workflow is still to come or unfinished (engines may
                # be idle during think time and busy again after it).
                if self._over < total:
                    if self._doomed():
                        break
                    self._push(self._next_scrape(t), "scrape", None)
                continue
            self._kick()
        return self._result()

    def _next_scrape(self, t: float) -> float:
        """When to scrape after the scrape at `t`: the next tick of the scrape clock, or, when
        the ticks before the next event could change nothing, the last of them.

        Engine figures change only at events, so such ticks would read what this one read;
        with nothing waiting at the gateway (held, buffered or to be released: a scrape would
        offer those again, at its tick's time) they reach no decision, and with no workflow
        under way `_doomed` reads the same at each. Skipping them keeps the clock's ticks (the
        same float additions) and the reports exact, and spares a run at a low arrival rate
        a scrape of every engine per tick of the idle time between workflows."""
        step = self.scrape_s
        nxt = t + step
        planner = self.planner
        if (planner.pending or planner.held or planner.buffered
                or (self.give_up is not None and self._runs)):
            return nxt
        following = self._heap.next_time()
        if following == float("inf"):
            return nxt
        while nxt + step < following:
            nxt += step
        return nxt

    def _doomed(self) -> bool:
        """The run's mean JCT can no longer stay within its `GiveUp`; records the least it
        could be (`RunResult.cut_short_jct_mean_s`)."""
        give_up = self.give_up
        if give_up is None:
            return False
        floor = give_up.floor_s
        least = self._jct_sum + self._floor_to_come + sum(
            max(self.now - self.wf_records[wf].arrival_s, floor.get(wf, 0.0))
            for wf in self._runs)
        n = len(self.workflows)
        if least <= give_up.mean_jct_s * n:
            return False
        self._cut_short = least / n
        return True

    def _result(self) -> RunResult:
        engines = self.fleet.engines
        busy = {n: e.model.stats.busy_time for n, e in engines.items()}
        # As live mode reads it from /metrics: prefix-cache queries minus hits.
        # As live mode reads it from /metrics: prefix-cache queries minus local and external
        # hits.
        self.computed_prompt_tokens = sum(
            e.model.stats.prefix_cache_queries - e.model.stats.prefix_cache_hits
            - e.model.stats.external_prefix_cache_hits for e in engines.values())
        return RunResult(self.policy_name, self.records, list(self.wf_records.values()), busy,
                         self.fleet.utilisation, self.bucket_s, self.computed_prompt_tokens,
                         transferred_bytes=self.fleet.transferred_bytes,
                         flops=sum(e.model.stats.flops for e in engines.values()),
                         peak_flops=self.profile.peak_flops,
                         cut_short_jct_mean_s=self._cut_short,
                         moves_started=dict(sorted(self.planner.moves.stats.started.items())))

    def _scrape(self) -> None:
        for event in self.fleet.scraped():
            self.planner.on_event(event, self.now)

    def _kick(self) -> None:
        """Start a step on every idle engine that may have work (those touched since)."""
        self._started(self.fleet.kick(self.now))

    def _restart(self, e: _Engine) -> None:
        """`_kick` when `e` is the only engine to look at (`Fleet.idle_again`)."""
        step = self.fleet.start(e, self.now) if e.model.has_work() else None
        self._started([step] if step is not None else [])

    def _started(self, started: list[tuple[float, _Engine, StepOutput]]) -> None:
        """Put the steps just started on the agenda (running a lone inert one ahead), and the
        pulls they began."""
        if len(started) == 1 and started[0][2].inert and not self.planner.pending:
            started = self._run_ahead(*started[0])
        for end, e, out in started:
            self._push(end, "step", (e, out))
        if self.fleet.pulls:
            for done, dest, pull in self.fleet.pulls:
                self._push(done, "pulled", (dest, pull))
            self.fleet.pulls = []

    def _run_ahead(self, end: float, e: _Engine, out: StepOutput
                   ) -> list[tuple[float, _Engine, StepOutput]]:
        """Deliver the engine's inert steps that end before any other event, each starting the
        next step at once, as the event loop would; the step left to schedule, if any.

        An inert step's delivery only frees its engine (nothing reaches the index or the
        planner, and nothing is pending to release), so when it ends before the earliest event
        on the agenda nothing can happen between its end and the next step's start: decode runs
        on one engine skip the agenda (most of a trace replay's million steps).
        """
        until = self._heap.next_time()
        fleet = self.fleet
        while out.inert and end < until and not fleet.pulls:
            e.busy = False
            step = fleet.start(e, end)
            if step is None:
                return []
            end, e, out = step
        return [(end, e, out)]

    # -- workflows ------------------------------------------------------------------------------

    def _arrive(self, wf: BenchWorkflow) -> None:
        self.wf_records[wf.id] = WorkflowRecord(wf.id, self.now)
        if self.give_up is not None:
            self._floor_to_come -= self.give_up.floor_s.get(wf.id, 0.0)
        run = DagRun(wf.id, [DagNode(t.id, t.after, t.think_time_s) for t in wf.tasks])
        # Always told (its tasks only when it uses them): a workflow submitted whole is not a
        # hint-mode one, whose remembered calls the planner caps.
        self.planner.on_event(WorkflowSubmitted(wf.id, tuple(
            TaskSpec(t.id, tuple(t.after), self.builder.prompt_tokens(wf, t),
                     t.output_tokens, t.think_time_s, static_segment(t, wf.tenant))
            for t in wf.tasks) if self.planner.wants_workflows else ()), self.now)
        self._runs[wf.id] = run
        self._wake(wf, run.start(self.now))

    def _wake(self, wf: BenchWorkflow, wakeups: list[Wakeup]) -> None:
        for w in wakeups:
            self._push(w.at, "ready", (wf, wf.task(w.task)))

    def _ready(self, wf: BenchWorkflow, task: BenchTask) -> None:
        self._runs[wf.id].wake(task.id, self.now)
        record = RequestRecord(wf.id, task.id, self.now)
        self.records.append(record)
        pieces = self.builder.pieces(wf, task)
        extras = KeyExtras(cache_salt=wf.tenant)
        if task.blocks and len(pieces) > CHUNK_BLOCKS:
            names, ids = _chunked(pieces)
            keys = self.builder.keyer.named(names, ids, extras)
        else:
            keys = self.builder.keyer.named(list(map(_PIECE_KEY, pieces)),
                                            list(map(_PIECE_IDS, pieces)), extras)
        record.prompt_tokens = keys.num_tokens
        if keys.num_tokens + task.output_tokens > self.config.max_model_len:
            record.failed = (f"prompt of {keys.num_tokens} tokens plus {task.output_tokens} "
                             f"output tokens exceeds max_model_len {self.config.max_model_len}")
            self._task_failed(wf, task, record.failed)
            return
        rid = f"{wf.id}/{task.id}#{next(self._rid)}"
        text = "".join([p.text for p in pieces]) if self._needs_text else ""
        route = RouteRequest(
            request_id=rid, model=MODEL, session_id=wf.id, prompt_tokens=keys.num_tokens,
            block_keys=keys.keys, block_size=self.block_size,
            matches=self.index.match_sync(keys.keys, self.now) if self._reads_index else {},
            prompt_text=text,
            max_tokens=task.output_tokens)
        self._waiting[rid] = _Waiting(record, wf, task, route, keys.token_ids)
        # A spec's own task priority ranks the call as the workflow API's does.
        hints = RequestHints(workflow=wf.id, task=task.id, after=tuple(task.after),
                             priority=task.priority or None)
        static = self.builder.static_blocks(task, pieces, self.block_size)
        record.static_tokens = min(static * self.block_size, keys.num_tokens)
        self.planner.admit(Call(route, hints=hints, static_blocks=static), self.now)
        self._release()

    def _release(self) -> None:
        """Carry out whatever the planner decides now."""
        if self.planner.pending:
            self._carry_out_all(self.planner.release(self.now))

    def _carry_out_all(self, actions: list[Action]) -> None:
        for action in actions:
            self._carry_out(action)
        wake = self.planner.next_wakeup()
        if wake is not None and (self._wakeup_at is None or wake < self._wakeup_at):
            wake = max(wake, self.now)  # the virtual clock never steps back
            self._wakeup_at = wake
            self._push(wake, "wakeup", None)

    def _carry_out(self, action: Action) -> None:
        if isinstance(action, Transfer | Warm):
            self._start_move(action)
            return
        w = self._waiting.pop(action.request_id)
        record, wf, task, route = w.record, w.wf, w.task, w.route
        if isinstance(action, Reject):
            record.failed = reject_message(action)
            self._task_failed(wf, task, record.failed)
            return
        rid = route.request_id
        engine_name = action.engine
        if action.speculative_keys:
            self.index.add_speculative_sync(engine_name, action.speculative_keys, self.now,
                                            action.speculative_ttl_s)
        record.dispatched_s = self.now
        record.engine = engine_name
        self._runs[wf.id].dispatched(task.id, self.now)
        out_piece = self.builder.output_piece(wf, task)
        self._live[rid] = _Live(record, wf, task, route, out_piece, w.token_ids)
        same_blocks = self.config.block_size == self.block_size
        self._send(engine_name, SimRequest(
            request_id=rid, prompt_token_ids=w.token_ids, max_tokens=task.output_tokens,
            arrival_time=self.now, ignore_eos=True, natural_output_len=task.output_tokens,
            cache_salt=wf.tenant,
            priority=action.priority if action.priority is not None else task.priority,
            block_hashes=list(route.block_keys) if same_blocks else [],
            output_plan=out_piece.ids, prefill_cap=action.prefill_cap,
            prefill_caps=action.prefill_caps), task)

    def _send(self, engine: str, request: SimRequest, task: BenchTask | None = None) -> None:
        """A request reaches its engine's scheduler after the server's per-request cost and
        any queue at its API server (`adapters.sim.frontend.ApiServer`)."""
        at = self._api[engine].admitted_at(self.now, is_chat(task),
                                           len(request.prompt_token_ids))
        if at > self.now:
            self._push(at, "admit", (engine, request))
        else:
            self.fleet.add(engine, request)

    # -- KV moves -------------------------------------------------------------------------------

    def _origin(self, request_id: str) -> tuple[Sequence[int], str | None] | None:
        """Token ids and cache salt of a request the driver knows (waiting or in flight)."""
        w = self._waiting.get(request_id)
        if w is not None:
            return w.token_ids, w.wf.tenant
        live = self._live.get(request_id)
        if live is not None:
            return live.token_ids, live.wf.tenant
        return self._recent.get(request_id)

    def _start_move(self, move: Transfer | Warm) -> None:
        """A transfer's first leg at its source (the prefix alone, `do_remote_decode`), or a
        warm-up at its engine (the prefix alone, `max_tokens` 1)."""
        origin = self._origin(move.origin)
        if origin is None or len(origin[0]) < move.tokens or move.tokens <= 0:
            self.planner.on_event(TransferFailed(move.move_id, "origin request gone"), self.now)
            return
        ids = origin[0]
        if len(ids) > move.tokens:
            # A prefix of up to a whole long context, read where it lies: a paced prompt's
            # pieces would otherwise copy it once each.
            ids = _Prefix(ids, move.tokens)
        salt = origin[1]
        leg = _Leg(move, ids, salt)
        if isinstance(move, Transfer):
            rid, engine = f"{move.move_id}:produce", move.source
        else:
            rid, engine = f"{move.move_id}:warm", move.engine
        self._legs[rid] = leg
        produce = isinstance(move, Transfer)
        self._send(engine, self._leg_request(rid, leg, remote_decode=produce))

    def _leg_request(self, rid: str, leg: _Leg, remote_decode: bool = False,
                     remote: RemotePrefill | None = None) -> SimRequest:
        same_blocks = self.config.block_size == self.block_size
        keys = leg.move.block_keys
        return SimRequest(
            request_id=rid, prompt_token_ids=leg.token_ids, max_tokens=1,
            arrival_time=self.now, ignore_eos=True, natural_output_len=1,
            cache_salt=leg.cache_salt, remote_decode=remote_decode, remote_prefill=remote,
            block_hashes=list(keys) if same_blocks and len(keys) * self.block_size
            == len(leg.token_ids) else [])

    def _leg_done(self, req: SimRequest) -> None:
        leg = self._legs.pop(req.request_id)
        move = leg.move
        if isinstance(move, Warm) and move.reason == PACE:
            self._paced[move.origin] = self._paced.get(move.origin, 0) + max(
                0, len(req.prompt_token_ids) - max(0, req.num_cached_tokens))
        if isinstance(move, Transfer) and req.remote_decode:
            if req.finish_reason is None or not req.exported_block_ids:
                self.planner.on_event(TransferFailed(move.move_id, "producer leg failed"),
                                      self.now)
                return
            rid = f"{move.move_id}:consume"
            self._legs[rid] = leg
            self._send(move.destination, self._leg_request(rid, leg, remote=RemotePrefill(
                move.source, req.request_id, req.exported_block_ids)))
            return
        self.planner.on_event(TransferDone(move.move_id), self.now)

    def _step_done(self, e: _Engine, out: StepOutput) -> int:
        self.fleet.step_done(e, out, self.now)
        finished = 0
        for req in out.finished:
            live = self._live.get(req.request_id)
            if live is not None:
                live.record.cached_tokens = max(
                    0, req.num_cached_tokens - self._paced.pop(req.request_id, 0))
                live.record.output_tokens = len(req.output_token_ids)
            elif req.request_id in self._legs:
                self._leg_done(req)
        live_requests = self._live
        planner = self.planner
        for o in out.outputs:
            live = live_requests.get(o.request_id)
            if live is None:
                continue
            r = live.record
            if r.first_token_s is None:
                r.first_token_s = self.now
                planner.on_event(FirstToken(o.request_id), self.now)
            if o.finish_reason is not None:
                finished += self._request_done(live)
        self._release()
        return finished

    def _request_done(self, live: _Live) -> int:
        rid = live.route.request_id
        del self._live[rid]
        self._recent[rid] = (live.token_ids, live.wf.tenant)
        if len(self._recent) > RECENT_ORIGINS:
            self._recent.popitem(last=False)
        r = live.record
        r.finished_s = self.now
        self.planner.on_event(Finished(rid, r.output_tokens), self.now)
        return self._task_done(live.wf, live.task)

    def _task_done(self, wf: BenchWorkflow, task: BenchTask) -> int:
        run = self._runs[wf.id]
        self._wake(wf, run.finished(task.id, self.now))
        return self._workflow_over(wf) if run.over else 0

    def _task_failed(self, wf: BenchWorkflow, task: BenchTask, error: str) -> None:
        """A failed task fails its workflow: its dependents are skipped, and the workflow ends
        once nothing of it is in flight."""
        self.wf_records[wf.id].failed = True
        run = self._runs[wf.id]
        run.fail(task.id, self.now, error)
        if run.over:
            self._workflow_over(wf)

    def _workflow_over(self, wf: BenchWorkflow) -> int:
        del self._runs[wf.id]
        self.planner.on_event(WorkflowOver(wf.id), self.now)
        record = self.wf_records[wf.id]
        record.finished_s = self.now
        self._jct_sum += self.now - record.arrival_s
        self._over += 1
        if self._queue:
            self._push(self.now, "arrive", self._queue.pop())
        return 1
