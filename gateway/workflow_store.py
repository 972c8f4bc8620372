"""Where workflow state lives: snapshots and an append-only event log per workflow.

A snapshot is the JSON document `GET /v1/workflows/{id}` returns:

    {"id", "source": "api"|"hints", "model", "tenant",
     "state": "running"|"done"|"failed"|"cancelled", "created_s", "finished_s", "replica",
     "tasks": {TASK_ID: {"state", "after", "engine", "request_id", "ready_s", "dispatched_s",
                         "first_token_s", "finished_s", "prompt_tokens", "cached_tokens",
                         "output_tokens", "output", "error"}}}

Stores keep the workflow-level fields and each task's record separately, so writers touching
different tasks (hint-mode calls landing on different replicas) never overwrite each other.
Timestamps are wall-clock epoch seconds, set by the gateway. A workflow's snapshot and events
expire `ttl_s` after the write that passes `ttl_s` (the workflow is over).

Two backends: `MemoryWorkflowStore` (one gateway process) and `RedisWorkflowStore` (replicas
sharing one Redis: snapshots in a hash, events in a Redis Stream, cancel requests on a pub/sub
channel so the replica running a workflow hears a DELETE sent to another).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis.asyncio as aioredis

Json = dict[str, Any]

START = "0"
"""The event id before the first event: `events(wf, START)` replays from the beginning."""


class WorkflowStore(Protocol):
    """Workflow snapshots and event logs, shared by every replica that uses the same backend."""

    async def create(self, workflow: Mapping[str, Any],
                     tasks: Mapping[str, Mapping[str, Any]]) -> bool:
        """Store a new workflow (its fields without `tasks`, and its tasks); False if a
        workflow with this id exists already (nothing is written then)."""
        ...

    async def update(self, workflow_id: str, *, workflow: Mapping[str, Any] | None = None,
                     tasks: Mapping[str, Mapping[str, Any]] | None = None,
                     events: Sequence[Mapping[str, Any]] = (),
                     ttl_s: float | None = None, owner: str | None = None,
                     drop_tasks: Sequence[str] = ()) -> bool:
        """Replace the workflow-level fields (if given) and the given tasks' records, append
        `events`, all at once; with `ttl_s`, everything of the workflow expires that long after.
        With `owner`, only while `owner` holds the workflow's lease: False (nothing written)
        once another replica has taken it over. `drop_tasks` (not with `owner`): task records
        to delete in the same write."""
        ...

    async def get(self, workflow_id: str) -> Json | None:
        """The snapshot, or None if the workflow is unknown or expired."""
        ...

    async def head(self, workflow_id: str) -> Json | None:
        """The workflow-level fields alone (no task records: a cheap read of its state,
        owner and creation time), or None if the workflow is unknown or expired."""
        ...

    async def events(self, workflow_id: str, after: str = START,
                     wait_s: float = 0.0) -> list[tuple[str, Json]]:
        """Events after the event id `after` (oldest first, with their ids); waits up to
        `wait_s` for one when there are none yet."""
        ...

    async def recent(self, limit: int, keep: Callable[[Json], bool] | None = None
                     ) -> list[Json]:
        """Up to `limit` workflows, newest `created_s` first: snapshots whose task records
        lack `output` (a listing needs states and timings, not texts); with `keep`, only
        those whose workflow record (no tasks) it keeps, read on until `limit` are found."""
        ...

    async def request_cancel(self, workflow_id: str) -> None:
        """Ask whichever replica runs the workflow to cancel it, and keep the request with the
        workflow (`cancel_requested`): a replica that missed the message, or takes the
        workflow over later, still sees it."""
        ...

    async def cancel_requested(self, workflow_ids: Sequence[str]) -> list[str]:
        """Those of `workflow_ids` whose cancel was asked for (`request_cancel`)."""
        ...

    def cancel_requests(self) -> AsyncIterator[str]:
        """Ids of workflows whose cancel some replica asked for, as the requests arrive."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...

    # -- taking over a workflow whose replica is gone (API workflows only) --------------------

    shared: bool
    """Other gateway processes read and write the same workflows (so they can take one over)."""

    async def save_resume(self, workflow_id: str, document: Mapping[str, Any]) -> None:
        """Keep what another replica needs to go on with a running workflow (its spec and the
        headers its calls carry), and list the workflow as running; both end with it."""
        ...

    async def resume_document(self, workflow_id: str) -> Json | None:
        """What `save_resume` kept, or None."""
        ...

    async def claim(self, workflow_id: str, owner: str, lease_s: float) -> bool:
        """Become the workflow's driver unless a live replica is: True if `owner` holds its
        lease (for `lease_s`) now."""
        ...

    async def renew(self, owner: str, workflow_ids: Sequence[str], lease_s: float
                    ) -> list[str]:
        """Extend `owner`'s leases on `workflow_ids`; the ids whose lease it no longer holds."""
        ...

    async def release(self, owner: str, workflow_ids: Sequence[str]) -> None:
        """Give up `owner`'s leases on `workflow_ids` (another replica may take them over)."""
        ...

    async def orphans(self) -> list[str]:
        """Running API workflows whose lease nobody holds (their replica stopped or died)."""
        ...

    def handoffs(self) -> AsyncIterator[str]:
        """Ids of workflows a stopping replica gave up (`release`), as it gives them up."""
        ...

    async def heartbeat(self, owner: str, lease_s: float) -> None:
        """`owner` (a replica) is alive for the next `lease_s` seconds."""
        ...

    async def alive(self, owners: Collection[str]) -> set[str]:
        """Which of `owners` have a heartbeat that has not run out."""
        ...


# -- in memory ------------------------------------------------------------------------------------


RECENT_SCAN_MAX = 20_000
"""Ids a filtered listing reads at most (a tenant with no workflow among many others')."""
MAX_EVENTS = 10_000
"""Events a workflow's stream keeps (the oldest go first): a hint-mode workflow's stream grows
with every call for as long as its client keeps calling. An API workflow writes about four
events per task: one of up to about 2,500 tasks (`max_tasks` is 1,000 by default) keeps its
whole stream."""


SWEEP_EVERY_S = 1.0
"""How often the memory store drops expired workflows (a read of one expired drops it at once)."""


@dataclass
class _Entry:
    workflow: Json
    tasks: dict[str, Json]
    events: list[Json] = field(default_factory=list)
    dropped: int = 0
    """Events trimmed from the front (ids go on counting)."""
    expires_at: float | None = None
    """time.monotonic() deadline, once a ttl was given."""
    grew: asyncio.Condition = field(default_factory=asyncio.Condition)
    cancel_asked: bool = False


class MemoryWorkflowStore:
    """Workflows of one gateway process; event ids are positions in the log ("1", "2", ...)."""

    shared = False

    def __init__(self) -> None:
        self._beats: dict[str, float] = {}
        self._entries: dict[str, _Entry] = {}
        self._cancels: asyncio.Queue[str] = asyncio.Queue()
        self._resume: dict[str, Json] = {}
        self._leases: dict[str, tuple[str, float]] = {}
        """Per workflow: owner and time.monotonic() expiry."""
        self._handoffs: asyncio.Queue[str] = asyncio.Queue()
        self._swept_at = -SWEEP_EVERY_S

    def _entry(self, workflow_id: str) -> _Entry | None:
        e = self._entries.get(workflow_id)
        if e is not None and e.expires_at is not None and time.monotonic() >= e.expires_at:
            del self._entries[workflow_id]
            return None
        return e

    def _sweep(self) -> None:
        """Drop expired entries, at most once a `SWEEP_EVERY_S` (each create swept them all:
        2.6 ms at 10k workflows, 73 ms at 100k, on every new hint-mode workflow)."""
        now = time.monotonic()
        if now - self._swept_at < SWEEP_EVERY_S:
            return
        self._swept_at = now
        for wf, e in list(self._entries.items()):
            if e.expires_at is not None and now >= e.expires_at:
                del self._entries[wf]

    async def create(self, workflow: Mapping[str, Any],
                     tasks: Mapping[str, Mapping[str, Any]]) -> bool:
        """See `WorkflowStore.create`."""
        self._sweep()
        wf_id = str(workflow["id"])
        if self._entry(wf_id) is not None:
            return False
        self._entries[wf_id] = _Entry(_copy(workflow), {t: _copy(r) for t, r in tasks.items()})
        return True

    async def update(self, workflow_id: str, *, workflow: Mapping[str, Any] | None = None,
                     tasks: Mapping[str, Mapping[str, Any]] | None = None,
                     events: Sequence[Mapping[str, Any]] = (),
                     ttl_s: float | None = None, owner: str | None = None,
                     drop_tasks: Sequence[str] = ()) -> bool:
        """See `WorkflowStore.update`."""
        if owner is not None and self._holder(workflow_id) != owner:
            return False
        e = self._entry(workflow_id)
        if e is None:
            e = self._entries[workflow_id] = _Entry({"id": workflow_id}, {})
        if workflow is not None:
            e.workflow = _copy(workflow)
        for t in drop_tasks:
            e.tasks.pop(t, None)
        for t, rec in (tasks or {}).items():
            e.tasks[t] = _copy(rec)
        e.events.extend(_copy(ev) for ev in events)
        if len(e.events) > MAX_EVENTS:
            excess = len(e.events) - MAX_EVENTS
            del e.events[:excess]
            e.dropped += excess
        if ttl_s is not None:
            e.expires_at = time.monotonic() + ttl_s
            self._resume.pop(workflow_id, None)
            self._leases.pop(workflow_id, None)
        if events:
            async with e.grew:
                e.grew.notify_all()
        return True

    async def get(self, workflow_id: str) -> Json | None:
        """See `WorkflowStore.get`."""
        e = self._entry(workflow_id)
        if e is None:
            return None
        return {**_copy(e.workflow), "tasks": {t: _copy(r) for t, r in e.tasks.items()}}

    async def head(self, workflow_id: str) -> Json | None:
        """See `WorkflowStore.head`."""
        e = self._entry(workflow_id)
        return None if e is None else _copy(e.workflow)

    async def events(self, workflow_id: str, after: str = START,
                     wait_s: float = 0.0) -> list[tuple[str, Json]]:
        """See `WorkflowStore.events`."""
        e = self._entry(workflow_id)
        if e is None:
            return []
        start = int(after) if after.isascii() and after.isdigit() else 0
        if e.dropped + len(e.events) <= start and wait_s > 0:
            async with e.grew:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        e.grew.wait_for(lambda: e.dropped + len(e.events) > start), wait_s)
        first = max(start, e.dropped)
        return [(str(i + 1), _copy(ev))
                for i, ev in enumerate(e.events[first - e.dropped:], first)]

    async def recent(self, limit: int, keep: Callable[[Json], bool] | None = None
                     ) -> list[Json]:
        """See `WorkflowStore.recent`."""
        self._sweep()
        entries = sorted((e for e in self._entries.values() if keep is None or keep(e.workflow)),
                         key=lambda e: e.workflow.get("created_s") or 0.0, reverse=True)
        return [_listed(e.workflow, e.tasks) for e in entries[:max(0, limit)]]

    async def request_cancel(self, workflow_id: str) -> None:
        """See `WorkflowStore.request_cancel`."""
        entry = self._entry(workflow_id)
        if entry is not None:
            entry.cancel_asked = True
        self._cancels.put_nowait(workflow_id)

    async def cancel_requested(self, workflow_ids: Sequence[str]) -> list[str]:
        """See `WorkflowStore.cancel_requested`."""
        return [wf for wf in workflow_ids
                if (entry := self._entry(wf)) is not None and entry.cancel_asked]

    async def cancel_requests(self) -> AsyncIterator[str]:
        """See `WorkflowStore.cancel_requests`."""
        while True:
            yield await self._cancels.get()

    async def close(self) -> None:
        """Nothing to release."""

    async def save_resume(self, workflow_id: str, document: Mapping[str, Any]) -> None:
        """See `WorkflowStore.save_resume`."""
        self._resume[workflow_id] = _copy(document)

    async def resume_document(self, workflow_id: str) -> Json | None:
        """See `WorkflowStore.resume_document`."""
        doc = self._resume.get(workflow_id)
        return _copy(doc) if doc is not None and self._entry(workflow_id) is not None else None

    def _holder(self, workflow_id: str) -> str | None:
        lease = self._leases.get(workflow_id)
        if lease is None or time.monotonic() >= lease[1]:
            return None
        return lease[0]

    async def claim(self, workflow_id: str, owner: str, lease_s: float) -> bool:
        """See `WorkflowStore.claim`."""
        if self._holder(workflow_id) not in (None, owner):
            return False
        self._leases[workflow_id] = (owner, time.monotonic() + lease_s)
        return True

    async def renew(self, owner: str, workflow_ids: Sequence[str], lease_s: float
                    ) -> list[str]:
        """See `WorkflowStore.renew`."""
        lost = []
        for wf in workflow_ids:
            if self._holder(wf) == owner:
                self._leases[wf] = (owner, time.monotonic() + lease_s)
            else:
                lost.append(wf)
        return lost

    async def release(self, owner: str, workflow_ids: Sequence[str]) -> None:
        """See `WorkflowStore.release`."""
        for wf in workflow_ids:
            if self._holder(wf) == owner:
                del self._leases[wf]
                self._handoffs.put_nowait(wf)

    async def handoffs(self) -> AsyncIterator[str]:
        """See `WorkflowStore.handoffs`."""
        while True:
            yield await self._handoffs.get()

    async def orphans(self) -> list[str]:
        """See `WorkflowStore.orphans`."""
        return [wf for wf in self._resume
                if self._entry(wf) is not None and self._holder(wf) is None]

    async def heartbeat(self, owner: str, lease_s: float) -> None:
        """See `WorkflowStore.heartbeat`."""
        self._beats[owner] = time.monotonic() + lease_s

    async def alive(self, owners: Collection[str]) -> set[str]:
        """See `WorkflowStore.alive`."""
        now = time.monotonic()
        return {o for o in owners if self._beats.get(o, 0.0) > now}


def _listed(workflow: Mapping[str, Any], tasks: Mapping[str, Mapping[str, Any]]) -> Json:
    """A workflow as `recent` lists it: the snapshot without task outputs."""
    return {**_copy(workflow),
            "tasks": {t: {k: v for k, v in _copy(r).items() if k != "output"}
                      for t, r in tasks.items()}}


def _copy(doc: Mapping[str, Any]) -> Json:
    """A deep copy through JSON, so callers never share mutable state with the store (and
    anything stored is JSON, as in Redis)."""
    out: Json = json.loads(json.dumps(doc))
    return out


# -- Redis ----------------------------------------------------------------------------------------

# KEYS: the workflow's hash, the index of workflows by creation time; ARGV: the workflow id,
# its created_s, the index's size bound, the workflow JSON, then task id / task JSON pairs.
_CREATE = """
if redis.call('HSETNX', KEYS[1], 'w', ARGV[4]) == 0 then return 0 end
for i = 5, #ARGV, 2 do redis.call('HSET', KEYS[1], 't:' .. ARGV[i], ARGV[i + 1]) end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('ZREMRANGEBYRANK', KEYS[2], 0, -tonumber(ARGV[3]) - 1)
return 1
"""

# KEYS: the workflow's hash, its event stream, the running set, its lease; ARGV: the owner, the
# ttl in ms (0: none), the workflow id, the number of hash fields, field/value pairs, then the
# events. Writes only while the owner holds the lease; 1 if written.
_UPDATE_FENCED = """
if redis.call('GET', KEYS[4]) ~= ARGV[1] then return 0 end
local i = 5
for _ = 1, tonumber(ARGV[4]) do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  i = i + 2
end
while i <= #ARGV do
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', MAX_EVENTS, '*', 'e', ARGV[i])
  i = i + 1
end
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  redis.call('PEXPIRE', KEYS[1], ttl)
  redis.call('PEXPIRE', KEYS[2], ttl)
  redis.call('HDEL', KEYS[1], 'r')
  redis.call('SREM', KEYS[3], ARGV[3])
  redis.call('DEL', KEYS[4])
end
return 1
""".replace("MAX_EVENTS", str(MAX_EVENTS))

# KEYS: lease keys; ARGV: the owner, the lease in ms. Extends the leases the owner holds and
# returns the positions (1-based) of those it does not.
_RENEW = """
local lost = {}
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then redis.call('PEXPIRE', key, ARGV[2])
  else table.insert(lost, i) end
end
return lost
"""

# KEYS: lease keys; ARGV: the owner. Deletes the leases the owner holds.
_RELEASE = """
for _, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then redis.call('DEL', key) end
end
return 0
"""

# KEYS: the workflow's hash. Marks a cancel asked for, on a workflow that exists only (HSET
# alone would make a hash of a workflow gone, one no snapshot reads and nothing expires).
_ASK_CANCEL = """
if redis.call('HEXISTS', KEYS[1], 'w') == 1 then redis.call('HSET', KEYS[1], 'c', '1') end
return 0
"""

INDEX_LIMIT = 10_000
"""Workflow ids the Redis index keeps (the newest); older ones drop out of listings, and their
snapshots stay readable by id until they expire."""


READ_TIMEOUT_S = 5.0
"""How long a Redis reply may take (redis-py's own default): past it the store is away. A
blocking read of the events waits less than this at a time."""


class RedisWorkflowStore:
    """Workflows shared by gateway replicas through one Redis.

      {ns}:wf:{id}      HASH    "w" -> the workflow-level fields (JSON), "t:{task}" -> a task,
                        "c" -> present once its cancel was asked for
      {ns}:wf:{id}:ev   STREAM  entries {"e": event JSON}; the entry id is the event id
      {ns}:wf:cancel    pub/sub channel of workflow ids to cancel
      {ns}:wf:index     SORTED SET  workflow ids by created_s (the newest INDEX_LIMIT); ids whose
                        hash has expired are removed when a listing meets them
      {ns}:wf:running   SET     API workflows not over yet (their hash also holds "r": the
                        resume document)
      {ns}:wf:{id}:lease STRING the driving replica's instance id, expiring unless renewed
      {ns}:wf:handoff   pub/sub channel of workflow ids a stopping replica gave up
    """

    shared = True

    def __init__(self, client: aioredis.Redis, namespace: str = "kvgate") -> None:
        self.r = client
        self.ns = namespace
        self._create = client.register_script(_CREATE)
        self._renew = client.register_script(_RENEW)
        self._update_fenced = client.register_script(_UPDATE_FENCED)
        self._release = client.register_script(_RELEASE)
        self._ask_cancel = client.register_script(_ASK_CANCEL)

    @classmethod
    def from_url(cls, url: str, namespace: str = "kvgate") -> RedisWorkflowStore:
        """A store on a fresh connection pool to `url`."""
        return cls(aioredis.Redis.from_url(url, socket_timeout=READ_TIMEOUT_S), namespace)

    def _key(self, workflow_id: str) -> str:
        return f"{self.ns}:wf:{workflow_id}"

    def _events_key(self, workflow_id: str) -> str:
        return f"{self.ns}:wf:{workflow_id}:ev"

    @property
    def _cancel_channel(self) -> str:
        return f"{self.ns}:wf:cancel"

    @property
    def _index_key(self) -> str:
        return f"{self.ns}:wf:index"

    @property
    def _running_key(self) -> str:
        return f"{self.ns}:wf:running"

    def _lease_key(self, workflow_id: str) -> str:
        return f"{self.ns}:wf:{workflow_id}:lease"

    @property
    def _handoff_channel(self) -> str:
        return f"{self.ns}:wf:handoff"

    async def create(self, workflow: Mapping[str, Any],
                     tasks: Mapping[str, Mapping[str, Any]]) -> bool:
        """See `WorkflowStore.create`."""
        wf_id = str(workflow["id"])
        args = [wf_id, repr(float(workflow.get("created_s") or 0.0)), str(INDEX_LIMIT),
                _dumps(workflow)]
        for t, rec in tasks.items():
            args += [t, _dumps(rec)]
        created = await self._create(keys=[self._key(wf_id), self._index_key], args=args)
        return bool(created)

    async def update(self, workflow_id: str, *, workflow: Mapping[str, Any] | None = None,
                     tasks: Mapping[str, Mapping[str, Any]] | None = None,
                     events: Sequence[Mapping[str, Any]] = (),
                     ttl_s: float | None = None, owner: str | None = None,
                     drop_tasks: Sequence[str] = ()) -> bool:
        """See `WorkflowStore.update`."""
        if owner is not None and drop_tasks:
            raise ValueError("drop_tasks is for writes without an owner (hint mode)")
        key, ev_key = self._key(workflow_id), self._events_key(workflow_id)
        fields: dict[str, str] = {}
        if workflow is not None:
            fields["w"] = _dumps(workflow)
        for t, rec in (tasks or {}).items():
            fields[f"t:{t}"] = _dumps(rec)
        if owner is not None:
            ttl_ms = max(1, int(ttl_s * 1000)) if ttl_s is not None else 0
            args: list[str] = [owner, str(ttl_ms), workflow_id, str(len(fields))]
            for k, v in fields.items():
                args += [k, v]
            args += [_dumps(ev) for ev in events]
            written = await self._update_fenced(
                keys=[key, ev_key, self._running_key, self._lease_key(workflow_id)], args=args)
            return bool(written)
        async with self.r.pipeline(transaction=True) as pipe:
            if drop_tasks:
                pipe.hdel(key, *(f"t:{t}" for t in drop_tasks))
            if fields:
                pipe.hset(key, mapping=fields)  # type: ignore[arg-type]
            for ev in events:
                pipe.xadd(ev_key, {"e": _dumps(ev)}, maxlen=MAX_EVENTS, approximate=True)
            if ttl_s is not None:
                ms = max(1, int(ttl_s * 1000))
                pipe.pexpire(key, ms)
                pipe.pexpire(ev_key, ms)
                pipe.hdel(key, "r")
                pipe.srem(self._running_key, workflow_id)
                pipe.delete(self._lease_key(workflow_id))
            await pipe.execute()
        return True

    async def get(self, workflow_id: str) -> Json | None:
        """See `WorkflowStore.get`."""
        raw: dict[bytes, bytes] = await self.r.hgetall(self._key(workflow_id))  # type: ignore[assignment]
        if b"w" not in raw:
            return None
        workflow, tasks = _parse(raw)
        return {**workflow, "tasks": tasks}

    async def head(self, workflow_id: str) -> Json | None:
        """See `WorkflowStore.head`."""
        raw = await self.r.hget(self._key(workflow_id), "w")
        return json.loads(raw) if raw is not None else None

    async def events(self, workflow_id: str, after: str = START,
                     wait_s: float = 0.0) -> list[tuple[str, Json]]:
        """See `WorkflowStore.events`."""
        timeout = self.r.connection_pool.connection_kwargs.get("socket_timeout",
                                                               READ_TIMEOUT_S)
        if timeout is not None:
            # Under the client's read timeout, which a longer block would trip with a
            # TimeoutError though the store is well.
            wait_s = min(wait_s, max(0.1, timeout - max(1.0, 0.2 * timeout)))
        block = max(1, int(wait_s * 1000)) if wait_s > 0 else None
        reply: Any = await self.r.xread({self._events_key(workflow_id): after}, block=block)
        out: list[tuple[str, Json]] = []
        for _, entries in reply or []:
            for entry_id, data in entries:
                out.append((entry_id.decode(), json.loads(data[b"e"])))
        return out

    async def recent(self, limit: int, keep: Callable[[Json], bool] | None = None
                     ) -> list[Json]:
        """See `WorkflowStore.recent`. Reads the index newest first, a page at a time, and
        drops the ids whose snapshot has expired."""
        out: list[Json] = []
        seen: set[bytes] = set()
        start = scanned = 0
        while len(out) < limit and scanned < RECENT_SCAN_MAX:
            page = max(limit - len(out), 16 if keep is None else 256)
            ids: list[bytes] = await self.r.zrevrange(  # type: ignore[assignment]
                self._index_key, start, start + page - 1)
            if not ids:
                break
            start += len(ids)
            scanned += len(ids)
            # The workflow fields first: with `keep`, only the kept ones' tasks are read.
            async with self.r.pipeline(transaction=False) as pipe:
                for wf_id in ids:
                    pipe.hget(self._key(wf_id.decode()), "w")
                heads: list[bytes | None] = await pipe.execute()
            gone: list[bytes] = []
            wanted: list[bytes] = []
            for wf_id, head in zip(ids, heads, strict=True):
                if head is None:
                    gone.append(wf_id)
                elif len(out) + len(wanted) < limit and wf_id not in seen:
                    # A workflow created meanwhile shifts the ranks: one id may come twice.
                    seen.add(wf_id)
                    if keep is None or keep(json.loads(head)):
                        wanted.append(wf_id)
            if wanted:
                async with self.r.pipeline(transaction=False) as pipe:
                    for wf_id in wanted:
                        pipe.hgetall(self._key(wf_id.decode()))
                    hashes: list[dict[bytes, bytes]] = await pipe.execute()
                out += [_listed(*_parse(raw)) for raw in hashes if b"w" in raw]
            if gone:
                await self.r.zrem(self._index_key, *gone)
                start -= len(gone)
        return out

    async def request_cancel(self, workflow_id: str) -> None:
        """See `WorkflowStore.request_cancel`."""
        await self._ask_cancel(keys=[self._key(workflow_id)])
        await self.r.publish(self._cancel_channel, workflow_id)

    async def cancel_requested(self, workflow_ids: Sequence[str]) -> list[str]:
        """See `WorkflowStore.cancel_requested`."""
        if not workflow_ids:
            return []
        async with self.r.pipeline(transaction=False) as pipe:
            for wf in workflow_ids:
                pipe.hexists(self._key(wf), "c")
            asked: list[Any] = await pipe.execute()
        return [wf for wf, yes in zip(workflow_ids, asked, strict=True) if yes]

    async def cancel_requests(self) -> AsyncIterator[str]:
        """See `WorkflowStore.cancel_requests`."""
        async for wf in self._listen(self._cancel_channel):
            yield wf

    async def handoffs(self) -> AsyncIterator[str]:
        """See `WorkflowStore.handoffs`."""
        async for wf in self._listen(self._handoff_channel):
            yield wf

    def _beat_key(self, owner: str) -> str:
        # Beside the workflows' keys (`wf:`), so no workflow id can name it.
        return f"{self.ns}:replica:{owner}"

    async def heartbeat(self, owner: str, lease_s: float) -> None:
        """See `WorkflowStore.heartbeat`."""
        await self.r.set(self._beat_key(owner), b"1", px=max(1, int(lease_s * 1000)))

    async def alive(self, owners: Collection[str]) -> set[str]:
        """See `WorkflowStore.alive`."""
        names = list(owners)
        if not names:
            return set()
        async with self.r.pipeline(transaction=False) as pipe:
            for o in names:
                pipe.exists(self._beat_key(o))
            there: list[int] = await pipe.execute()
        return {o for o, n in zip(names, there, strict=True) if n}

    async def _listen(self, channel: str) -> AsyncIterator[str]:
        pubsub = self.r.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(channel)
        try:
            async for msg in pubsub.listen():
                if msg.get("type") == "message":
                    yield bytes(msg["data"]).decode()
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call]

    async def close(self) -> None:
        """Close the connection pool."""
        await self.r.aclose()

    async def save_resume(self, workflow_id: str, document: Mapping[str, Any]) -> None:
        """See `WorkflowStore.save_resume`."""
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(self._key(workflow_id), "r", _dumps(document))
            pipe.sadd(self._running_key, workflow_id)
            await pipe.execute()

    async def resume_document(self, workflow_id: str) -> Json | None:
        """See `WorkflowStore.resume_document`."""
        raw = await self.r.hget(self._key(workflow_id), "r")
        return json.loads(raw) if raw is not None else None

    async def claim(self, workflow_id: str, owner: str, lease_s: float) -> bool:
        """See `WorkflowStore.claim`."""
        key, ms = self._lease_key(workflow_id), max(1, int(lease_s * 1000))
        if await self.r.set(key, owner, nx=True, px=ms):
            return True
        return not await self.renew(owner, [workflow_id], lease_s)

    async def renew(self, owner: str, workflow_ids: Sequence[str], lease_s: float
                    ) -> list[str]:
        """See `WorkflowStore.renew`."""
        if not workflow_ids:
            return []
        lost: list[int] = await self._renew(
            keys=[self._lease_key(wf) for wf in workflow_ids],
            args=[owner, max(1, int(lease_s * 1000))])
        return [workflow_ids[i - 1] for i in lost]

    async def release(self, owner: str, workflow_ids: Sequence[str]) -> None:
        """See `WorkflowStore.release`."""
        if workflow_ids:
            await self._release(keys=[self._lease_key(wf) for wf in workflow_ids],
                                args=[owner])
            for wf in workflow_ids:
                await self.r.publish(self._handoff_channel, wf)

    async def orphans(self) -> list[str]:
        """See `WorkflowStore.orphans`. Ids whose workflow has expired leave the set."""
        members: set[bytes] = await self.r.smembers(self._running_key)  # type: ignore[assignment]
        ids = sorted(m.decode() for m in members)
        if not ids:
            return []
        async with self.r.pipeline(transaction=False) as pipe:
            for wf in ids:
                pipe.exists(self._lease_key(wf))
                pipe.hexists(self._key(wf), "r")
            found: list[Any] = await pipe.execute()
        out, gone = [], []
        for i, wf in enumerate(ids):
            leased, kept = found[2 * i], found[2 * i + 1]
            if not kept:
                gone.append(wf)
            elif not leased:
                out.append(wf)
        if gone:
            await self.r.srem(self._running_key, *gone)
        return out


def _parse(raw: Mapping[bytes, bytes]) -> tuple[Json, dict[str, Json]]:
    """A workflow hash's fields: the workflow-level document and the task records."""
    workflow: Json = json.loads(raw[b"w"])
    tasks = {k.decode()[2:]: json.loads(v) for k, v in raw.items() if k.startswith(b"t:")}
    return workflow, tasks


def _dumps(doc: Mapping[str, Any]) -> str:
    return json.dumps(doc, separators=(",", ":"))


def make_store(backend: str, redis_url: str | None, namespace: str) -> WorkflowStore:
    """The configured backend."""
    if backend == "redis":
        if not redis_url:
            raise ValueError("the redis workflow store needs a redis_url")
        return RedisWorkflowStore.from_url(redis_url, namespace)
    return MemoryWorkflowStore()
