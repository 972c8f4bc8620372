"""`Client`: an OpenAI client whose calls carry the workflow hints, and the workflow API
(submit a whole DAG, read it, follow its events, wait for it, cancel it).

Errors the gateway answers become `KVGateError` subclasses carrying its message.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from types import TracebackType
from typing import Any

import aiohttp

from kvgate.sdk.dag import Dag
from kvgate.sdk.hooks import http_client


def _workflow_path(workflow_id: str) -> str:
    """The workflow's resource path, its id escaped (an id may hold `/`, `#`, `?`)."""
    return f"/v1/workflows/{urllib.parse.quote(workflow_id, safe='')}"


class KVGateError(Exception):
    """The gateway answered with an error; `message` is its own."""

    def __init__(self, message: str, status: int = 0, code: str | None = None,
                 body: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.body = body


class InvalidWorkflow(KVGateError):
    """400: the spec or request is invalid (the message names the problem)."""


class WorkflowNotFound(KVGateError):
    """404: no workflow with that id (unknown, or expired)."""


class WorkflowNotCancellable(KVGateError):
    """409: the workflow is over already, or driven by its client (hint mode)."""


class RequestTooLarge(KVGateError):
    """413: the spec is larger than the gateway's `workflows.max_body_bytes`."""


class GatewayUnreachable(KVGateError):
    """No answer from the gateway (connection refused, reset, timed out)."""


class WorkflowTimeout(KVGateError):
    """`wait` gave up before the workflow ended."""


_BY_STATUS: dict[int, type[KVGateError]] = {400: InvalidWorkflow, 404: WorkflowNotFound,
                                            409: WorkflowNotCancellable, 413: RequestTooLarge}


@dataclass(frozen=True)
class WorkflowSnapshot:
    """A workflow as `GET /v1/workflows/{id}` shows it."""

    raw: dict[str, Any]

    @property
    def id(self) -> str:
        """The workflow's id."""
        return str(self.raw["id"])

    @property
    def state(self) -> str:
        """running, done, failed or cancelled."""
        return str(self.raw["state"])

    @property
    def source(self) -> str:
        """`api` (submitted whole) or `hints` (recorded from annotated calls)."""
        return str(self.raw.get("source"))

    @property
    def tasks(self) -> dict[str, dict[str, Any]]:
        """Each task's record: state, after, engine, timings, token counts, output, error."""
        tasks: dict[str, dict[str, Any]] = self.raw.get("tasks") or {}
        return tasks

    @property
    def over(self) -> bool:
        """The workflow ended (for hint mode: no call is open now)."""
        return self.state != "running"

    def placement(self) -> str:
        """One line per task, in start order: its id, engine, parents and cached tokens."""
        def start(item: tuple[str, dict[str, Any]]) -> float:
            rec = item[1]
            return float(rec.get("ready_s") or rec.get("dispatched_s") or 0.0)

        lines = []
        for name, rec in sorted(self.tasks.items(), key=start):
            after = ",".join(rec.get("after") or []) or "-"
            lines.append(f"  {name:<16} {rec.get('state', '?'):<9} engine={rec.get('engine')} "
                         f"after={after} cached={rec.get('cached_tokens')}")
        return "\n".join(lines)


class Client:
    """kvgate's client: `openai` (an `openai.AsyncOpenAI` whose calls carry the hints of the
    workflow and task they are made in), and the workflow API.

    `base_url` is the gateway's root (`http://127.0.0.1:8000`; a trailing `/v1` is accepted).
    `openai_options` go to `openai.AsyncOpenAI` (max_retries, default_headers, ...).
    Use it as `async with Client(...) as client:` or call `aclose()`.
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 *, timeout_s: float = 600.0, **openai_options: Any) -> None:
        root = base_url.rstrip("/")
        self.base_url = root.removesuffix("/v1")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.openai_options = openai_options
        self._session: aiohttp.ClientSession | None = None

    @cached_property
    def http_client(self) -> Any:
        """The hooked async HTTP client under `openai`; pass it to frameworks that take one
        (LangChain's `ChatOpenAI(http_async_client=client.http_client)`)."""
        return http_client(timeout=self.timeout_s)

    @cached_property
    def openai(self) -> Any:
        """An `openai.AsyncOpenAI` pointed at the gateway; its calls carry the hints."""
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key or "-",
                                  http_client=self.http_client, **self.openai_options)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP connections."""
        if self._session is not None:
            await self._session.close()
            self._session = None
        if "openai" in self.__dict__:
            await self.openai.close()
        elif "http_client" in self.__dict__:
            await self.http_client.aclose()

    # -- the workflow API ----------------------------------------------------------------------

    async def submit(self, dag: Dag | Mapping[str, Any]) -> WorkflowSnapshot:
        """Submit a whole DAG (`POST /v1/workflows`); the gateway runs it. Its first snapshot
        (`.id` names it)."""
        doc = dag.to_dict() if isinstance(dag, Dag) else dict(dag)
        return WorkflowSnapshot(await self._json("POST", "/v1/workflows", doc))

    async def get(self, workflow_id: str) -> WorkflowSnapshot:
        """The workflow as it is now (submitted or hint mode)."""
        return WorkflowSnapshot(await self._json("GET", _workflow_path(workflow_id)))

    async def cancel(self, workflow_id: str) -> WorkflowSnapshot:
        """Cancel a running submitted workflow; its snapshot."""
        return WorkflowSnapshot(await self._json("DELETE", _workflow_path(workflow_id)))

    async def events(self, workflow_id: str,
                     last_event_id: str | None = None) -> AsyncIterator[dict[str, Any]]:
        """Follow `GET /v1/workflows/{id}/events`: every task transition from the start (or
        after `last_event_id`), ending with the `{"type": "workflow"}` event. Each event also
        has its stream id under `event_id` (pass it as `last_event_id` to resume). A stream
        that breaks off (the gateway's store away for a moment, which it says with an error
        event; a replica restarting) is resumed after the last event read, up to
        `EVENTS_RESUMES` times in a row, then the error is raised."""
        timeout = aiohttp.ClientTimeout(total=None, sock_read=self.timeout_s)
        url = f"{self.base_url}{_workflow_path(workflow_id)}/events"
        failures = 0
        while True:
            headers = self._headers()
            if last_event_id is not None:
                headers["Last-Event-ID"] = last_event_id
            problem: KVGateError
            try:
                async with self._client().get(url, headers=headers, timeout=timeout) as resp:
                    if resp.status != 200:
                        problem = _error(resp.status, await resp.read())
                        if resp.status not in RESUMABLE_STATUS:
                            raise problem
                    else:
                        async for event_id, data in _sse(resp.content):
                            event = {**json.loads(data), "event_id": event_id}
                            if event.get("type") == "error":
                                error = event.get("error") or {}
                                problem = KVGateError(
                                    str(error.get("message") or data), 503, error.get("code"))
                                break
                            failures = 0
                            last_event_id = event_id or last_event_id
                            yield event
                            if event.get("type") == "workflow":
                                return
                        else:
                            problem = GatewayUnreachable(f"{url}: the stream ended before "
                                                         "the workflow's final event")
            except (aiohttp.ClientError, TimeoutError) as e:
                problem = GatewayUnreachable(f"{url}: {type(e).__name__}: {e}")
            failures += 1
            if failures > EVENTS_RESUMES:
                raise problem
            await asyncio.sleep(min(EVENTS_RESUME_S * 2 ** (failures - 1), 2.0))

    async def wait(self, workflow_id: str, timeout_s: float | None = None,
                   poll_s: float = 0.2) -> WorkflowSnapshot:
        """Wait until the workflow ends; its final snapshot. A submitted workflow is followed
        through its events; a hint-mode one is polled until no call of it is open."""
        async def read() -> WorkflowSnapshot:
            failures = 0
            while True:
                try:
                    return await self.get(workflow_id)
                except KVGateError as e:
                    failures += 1
                    if e.status not in RESUMABLE_STATUS or failures > EVENTS_RESUMES:
                        raise
                await asyncio.sleep(min(EVENTS_RESUME_S * 2 ** (failures - 1), 2.0))

        async def follow() -> WorkflowSnapshot:
            snap = await read()
            if snap.source == "hints":
                while not snap.over:
                    await asyncio.sleep(poll_s)
                    snap = await read()
                return snap
            async for _ in self.events(workflow_id):
                pass
            return await read()

        started = time.monotonic()
        try:
            return await asyncio.wait_for(follow(), timeout_s)
        except TimeoutError:
            raise WorkflowTimeout(f"workflow {workflow_id!r} still running after "
                                  f"{time.monotonic() - started:.1f}s") from None

    # -- plumbing ---------------------------------------------------------------------------

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._session

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def _json(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        url = f"{self.base_url}{path}"
        try:
            async with self._client().request(method, url, json=body,
                                              headers=self._headers()) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError) as e:
            raise GatewayUnreachable(f"{method} {url}: {type(e).__name__}: {e}") from e
        if not 200 <= status < 300:
            raise _error(status, raw)
        doc = json.loads(raw)
        if not isinstance(doc, dict):
            raise KVGateError(f"{method} {url}: expected a JSON object", status, body=doc)
        return doc


EVENTS_RESUMES = 5
"""How many times in a row `Client.events` resumes a stream that broke off."""
EVENTS_RESUME_S = 0.2
"""Its first wait before resuming (doubled each time, at most 2 s)."""
RESUMABLE_STATUS = frozenset({429, 502, 503, 504})
"""Answers to a stream's reconnect (or a wait's poll) that are tried again: the gateway's
store away for a moment, a replica restarting behind a load balancer; any other error is
raised at once."""


async def _sse(content: aiohttp.StreamReader) -> AsyncIterator[tuple[str | None, str]]:
    """Each server-sent event's id and data, read in chunks (a line, as an event carrying a
    task's long output, may be longer than aiohttp's line reader takes)."""
    pending: list[bytes] = []
    data: list[str] = []
    event_id: str | None = None
    async for chunk in content.iter_any():
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            pending.append(chunk[start:end])
            start = end + 1
            line = b"".join(pending).decode().rstrip("\r")
            pending = []
            if line.startswith("data:"):
                data.append(line[5:].strip())
            elif line.startswith("id:"):
                event_id = line[3:].strip()
            elif not line and data:
                yield event_id, "\n".join(data)
                data = []
        if start < len(chunk):
            pending.append(chunk[start:])


def _error(status: int, raw: bytes) -> KVGateError:
    """The typed error for a gateway answer, with the gateway's own message."""
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        doc = None
    message, code = None, None
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        message = doc["error"].get("message")
        code = doc["error"].get("code")
    if not isinstance(message, str):
        message = raw[:500].decode(errors="replace") or f"HTTP {status}"
    return _BY_STATUS.get(status, KVGateError)(message, status, code, doc)
