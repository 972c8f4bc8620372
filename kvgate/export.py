"""`kvgate export-workflows`: served workflows as the `--workflow-trace` JSON Lines the bench
replays, so policies can be compared on an operator's own traffic.

The gateway keeps no prompt text, so an exported workflow keeps the shape of what was served
(the DAG, each task's prompt and output token counts, think times, arrivals) and the bench
fills prompts with its synthetic tokens:

- a `static` segment per model and tenant (the system prompt every workflow shares), sized by
  `--static-tokens` or, by default, the median of what root tasks found cached (the part of
  their prompt other workflows had already put in the cache);
- each task's own message, a segment of its own (`shared` when other tasks depend on it,
  else `transient`), sized so the bench's rendered prompt has exactly the recorded
  `prompt_tokens`;
- a task with dependencies extends its first dependency's prompt and output, then the other
  dependencies' outputs, when its recorded prompt is long enough to hold them (an agent's next
  turn, a fan-out child); otherwise it starts from the static segment and its dependencies'
  outputs, or the static segment alone, as its length allows.

Think times are the gap between a task's dependencies finishing (the workflow's start, for
roots) and the task becoming ready; `arrival_s` counts from the earliest exported workflow's
start.
Only finished workflows whose tasks all have token counts are exported; the rest are listed as
skipped with the reason.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvgate.bench.prompts import ChatMessage, ChatRenderer, Vocabulary
from kvindex.tokenizer import Tokenizer
from planner.workflow import MAX_THINK_TIME_S

Json = dict[str, Any]

MIN_STATIC_TOKENS = 16
"""A static segment shorter than one index block is left out (it would never be cached)."""


class ExportError(RuntimeError):
    """The workflows cannot be read from the given source; the message says why."""


@dataclass
class ExportResult:
    """The trace lines (oldest arrival first) and why each left-out workflow was left out."""

    lines: list[Json] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    inexact: list[str] = field(default_factory=list)
    """Tasks whose recorded prompt was too short for their messages' framing: their replayed
    prompt is longer than the recorded one."""


class PromptSizer:
    """Token counts of chat prompts as the bench renders them (its tokenizer and template):
    a fixed part (BOS, generation prompt) plus each message's frame and content."""

    def __init__(self, tokenizer: Tokenizer | None = None) -> None:
        tok = tokenizer or Tokenizer.load()
        vocab = Vocabulary(tok)
        self._renderer = ChatRenderer(tok, vocab)
        self._vocab = vocab
        self.fixed = sum(len(p.ids) for p in self._renderer.render([]))
        self._frames: dict[str, int] = {}

    def frame(self, role: str) -> int:
        """Tokens a message of `role` adds beyond its content."""
        if role not in self._frames:
            probe = ChatMessage(role, self._vocab.content(f"probe:{role}", 1))
            self._frames[role] = len(self._renderer.message(probe).ids) - 1
        return self._frames[role]

    def size(self, messages: Iterable[tuple[str, int]]) -> int:
        """The prompt's tokens for messages given as (role, content tokens)."""
        return self.fixed + sum(self.frame(role) + n for role, n in messages)


def _number(rec: Mapping[str, Any], key: str) -> float | None:
    v = rec.get(key)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _order(tasks: Mapping[str, Json]) -> list[str] | None:
    """Task ids with dependencies first (None if the records form a cycle)."""
    deps = {t: [a for a in rec.get("after") or [] if a in tasks] for t, rec in tasks.items()}
    done: list[str] = []
    seen: set[str] = set()
    while len(done) < len(tasks):
        ready = [t for t in tasks if t not in seen and all(d in seen for d in deps[t])]
        if not ready:
            return None
        ready.sort(key=lambda t: (_number(tasks[t], "ready_s") or 0.0, t))
        for t in ready:
            seen.add(t)
            done.append(t)
    return done


def _problem(snapshot: Json) -> str | None:
    """Why the workflow cannot be exported, or None."""
    if snapshot.get("state") != "done":
        return f"its state is {snapshot.get('state')!r}, not 'done'"
    tasks = snapshot.get("tasks") or {}
    if not tasks:
        return "it has no tasks"
    for t, rec in tasks.items():
        for key in ("prompt_tokens", "output_tokens"):
            v = rec.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                return f"task {t!r} has no {key}"
    if _order(tasks) is None:
        return "its tasks' `after` lists form a cycle"
    return None


def static_sizes(snapshots: Iterable[Json], sizer: PromptSizer) -> dict[tuple[str, str], int]:
    """Per (model, tenant): the median of root tasks' cached tokens, capped so every root's
    own message keeps at least one token; 0 below one index block."""
    cached: dict[tuple[str, str], list[int]] = {}
    room: dict[tuple[str, str], int] = {}
    for snap in snapshots:
        key = (str(snap.get("model")), str(snap.get("tenant") or ""))
        tasks = snap["tasks"]
        for rec in tasks.values():
            if any(a in tasks for a in rec.get("after") or []):
                continue
            c = rec.get("cached_tokens")
            if isinstance(c, int) and not isinstance(c, bool):
                cached.setdefault(key, []).append(c)
            fit = rec["prompt_tokens"] - sizer.size([("user", 1)]) - sizer.frame("system")
            room[key] = min(room.get(key, fit), fit)
    out = {}
    for key, fit in room.items():
        size = min(int(statistics.median(cached.get(key) or [0])), fit)
        out[key] = size if size >= MIN_STATIC_TOKENS else 0
    return out


def started_at(snapshot: Json) -> float:
    """When the workflow started: its creation for one submitted whole, its first call's
    arrival for a hint-mode one (its record is created while that call is placed)."""
    created = _number(snapshot, "created_s") or 0.0
    if snapshot.get("source") != "hints":
        return created
    readies = [r for r in (_number(t, "ready_s") for t in snapshot["tasks"].values())
               if r is not None]
    return min(readies, default=created)


def workflow_line(snapshot: Json, static_tokens: int, sizer: PromptSizer, arrival_s: float,
                  inexact: list[str]) -> Json:
    """One exported workflow: a workflow spec plus `arrival_s` (see the module docstring)."""
    tasks: dict[str, Json] = snapshot["tasks"]
    order = _order(tasks)
    assert order is not None
    wf_id = str(snapshot["id"])
    created = started_at(snapshot)
    deps = {t: [a for a in rec.get("after") or [] if a in tasks] for t, rec in tasks.items()}
    has_readers = {d for t in tasks for d in deps[t]}
    segments: Json = {}
    static_size: list[tuple[str, int]] = []
    static_msgs: list[Json] = []
    if static_tokens > 0:
        segments["static"] = {"kind": "static", "role": "system", "tokens": static_tokens}
        static_size, static_msgs = [("system", static_tokens)], [{"segment": "static"}]
    sizes: dict[str, list[tuple[str, int]]] = {}
    messages: dict[str, list[Json]] = {}
    out_tasks: list[Json] = []
    for t in order:
        rec = tasks[t]
        target = int(rec["prompt_tokens"])
        outputs = [("assistant", int(tasks[d]["output_tokens"])) for d in deps[t]]
        outputs_msgs: list[Json] = [{"output_of": d} for d in deps[t]]
        candidates: list[tuple[list[tuple[str, int]], list[Json]]] = []
        if deps[t]:
            first = deps[t][0]
            candidates.append((sizes[first] + outputs, messages[first] + outputs_msgs))
            candidates.append((static_size + outputs, static_msgs + outputs_msgs))
        candidates.append((static_size, static_msgs))
        candidates.append(([], []))
        fitting = [(target - sizer.size([*c[0], ("user", 0)]), c) for c in candidates]
        own, (prefix_sizes, prefix_msgs) = next(
            ((n, c) for n, c in fitting if n >= 1), (1, candidates[-1]))
        if fitting[-1][0] < 1:
            inexact.append(f"{wf_id}/{t}")
        name = f"task:{t}"
        segments[name] = {"kind": "shared" if t in has_readers else "transient",
                          "role": "user", "tokens": own}
        sizes[t] = [*prefix_sizes, ("user", own)]
        messages[t] = [*prefix_msgs, {"segment": name}]
        started = max((_number(tasks[d], "finished_s") or created for d in deps[t]),
                      default=created)
        ready = _number(rec, "ready_s")
        # A gap beyond what a spec takes (a day) is replayed as a day.
        think = min(MAX_THINK_TIME_S,
                    max(0.0, ready - started) if ready is not None else 0.0)
        task: Json = {"id": t, "messages": messages[t],
                      "output_tokens": int(rec["output_tokens"])}
        # Dependencies whose output the prompt does not carry still order the DAG.
        carried = {m["output_of"] for m in messages[t] if "output_of" in m}
        after = [d for d in deps[t] if d not in carried]
        if after:
            task["after"] = after
        if think > 0:
            task["think_time_s"] = round(think, 3)
        out_tasks.append(task)
    line: Json = {"arrival_s": round(arrival_s, 3), "id": wf_id,
                  "model": str(snapshot.get("model")), "segments": segments, "tasks": out_tasks}
    if snapshot.get("tenant"):
        line["tenant"] = snapshot["tenant"]
    return line


def export(snapshots: Iterable[Json], static_tokens: int | None = None,
           sizer: PromptSizer | None = None) -> ExportResult:
    """Trace lines for every exportable snapshot, oldest first."""
    sizer = sizer or PromptSizer()
    result = ExportResult()
    good: list[Json] = []
    for snap in snapshots:
        problem = _problem(snap)
        if problem is None:
            good.append(snap)
        else:
            result.skipped.append(f"{snap.get('id')}: {problem}")
    good.sort(key=lambda s: (started_at(s), str(s["id"])))
    sizes = static_sizes(good, sizer) if static_tokens is None else {}
    start = started_at(good[0]) if good else 0.0
    for snap in good:
        key = (str(snap.get("model")), str(snap.get("tenant") or ""))
        static = static_tokens if static_tokens is not None else sizes.get(key, 0)
        arrival = started_at(snap) - start
        result.lines.append(workflow_line(snap, static, sizer, arrival, result.inexact))
    return result


def with_hint_state(snapshot: Json) -> Json:
    """A snapshot as `GET /v1/workflows/{id}` shows it (hint-mode workflows' state follows
    their tasks)."""
    from gateway.workflows import hint_state

    return hint_state(snapshot) if snapshot.get("source") == "hints" else snapshot


def keep(snapshots: list[Json], since_s: float | None, limit: int | None,
         now: float | None = None) -> list[Json]:
    """The newest `limit` snapshots created within the last `since_s` seconds."""
    now = time.time() if now is None else now
    if since_s is not None:
        snapshots = [s for s in snapshots if (_number(s, "created_s") or 0.0) >= now - since_s]
    snapshots.sort(key=lambda s: _number(s, "created_s") or 0.0, reverse=True)
    return snapshots[:limit] if limit is not None else snapshots


async def from_redis(url: str, namespace: str) -> list[Json]:
    """Every workflow snapshot in the Redis workflow store (`{namespace}:wf:{id}` hashes)."""
    import redis.asyncio as aioredis
    from redis.exceptions import RedisError

    from gateway.config import check_redis_url
    from gateway.workflow_store import RedisWorkflowStore

    try:
        check_redis_url(url)
    except ValueError as e:
        raise ExportError(str(e)) from None
    store = RedisWorkflowStore.from_url(url, namespace)
    prefix = f"{namespace}:wf:"
    out = []
    try:
        client: aioredis.Redis = store.r
        async for key in client.scan_iter(match=f"{prefix}*", _type="hash", count=500):
            wf_id = key.decode()[len(prefix):]
            snap = await store.get(wf_id)
            if snap is not None:
                out.append(with_hint_state(snap))
    except (RedisError, OSError) as e:
        raise ExportError(f"cannot read workflows from {url} (namespace {namespace!r}): "
                          f"{e}") from None
    finally:
        await store.close()
    return out


GATEWAY_LIST_MAX = 500
"""The most workflows `GET /v1/workflows` lists at once (its `limit` maximum)."""


async def from_gateway(url: str, api_key: str | None, limit: int) -> list[Json]:
    """The newest `limit` workflows a gateway lists (`GET /v1/workflows?limit=N`, at most
    `GATEWAY_LIST_MAX`), each read whole (`GET /v1/workflows/{id}`)."""
    import urllib.parse

    import aiohttp
    import yarl

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base = url.rstrip("/")
    out = []
    try:
        async with aiohttp.ClientSession(headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=60)) as s:
            params = {"limit": str(min(limit, GATEWAY_LIST_MAX))}
            async with s.get(f"{base}/v1/workflows", params=params) as r:
                if r.status in (404, 405):
                    raise ExportError(f"{base} does not list workflows (GET /v1/workflows "
                                      f"answered {r.status}); read the store instead with "
                                      "--redis URL --namespace NS")
                if r.status != 200:
                    raise ExportError(f"GET {base}/v1/workflows answered {r.status}: "
                                      f"{(await r.text())[:200]}")
                listing = await r.json()
            # An OpenAI-style list ({"object": "list", "data": [...]}), newest first.
            items = listing.get("data") if isinstance(listing, dict) else None
            if not isinstance(items, list):
                raise ExportError(f"GET {base}/v1/workflows did not answer a list "
                                  '({"object": "list", "data": [...]})')
            for item in items[:limit]:
                wf_id = item.get("id") if isinstance(item, dict) else None
                if not isinstance(wf_id, str):
                    raise ExportError(f"GET {base}/v1/workflows listed an item without an id: "
                                      f"{item!r}"[:300])
                # Quoted whole: an id is the client's text (a hint-mode id may hold `/`, `?`
                # or `..`), never a path of its own.
                path = f"/v1/workflows/{urllib.parse.quote(wf_id, safe='')}"
                async with s.get(yarl.URL(base + path, encoded=True)) as r:
                    if r.status == 404:
                        continue  # expired since it was listed
                    if r.status != 200:
                        raise ExportError(f"GET {base}{path} answered {r.status}")
                    try:
                        out.append(json.loads(await r.read()))
                    except ValueError:
                        raise ExportError(f"GET {base}{path} did not answer JSON") from None
    except (aiohttp.ClientError, TimeoutError) as e:
        # The error's own text, not its repr: that would show the request's headers, the
        # admin key among them.
        raise ExportError(f"cannot reach {base}: {type(e).__name__}: {e}") from None
    return out


def write_lines(lines: Iterable[Json], path: str) -> None:
    """JSON Lines to `path` (`-`: standard output)."""
    text = "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines)
    if path == "-":
        import sys

        sys.stdout.write(text)
    else:
        with open(path, "w") as f:
            f.write(text)
