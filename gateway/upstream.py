"""The proxy's upstream client: keep-alive HTTP/1.1 connections to engines, one request each.

Every forwarded call goes through here, so it does the least per request that is correct: one
write for the request line, headers and body; the response framed by `gateway.http1`; the
connection reused once the answer is whole. aiohttp's client did the same with about three
times the CPU per request (README, "Gateway added latency"). Health checks, scrapes and KV moves
keep using aiohttp.

Failures are told apart the way the proxy acts on them: `UpstreamConnectError` (no answer began:
refused, reset, closed, connect timeout; safe to send elsewhere), `UpstreamTimeout` (the engine
was silent for the read timeout) and `UpstreamBroken` (the answer began and then failed).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Callable, Iterable
from typing import cast
from urllib.parse import urlsplit

from multidict import CIMultiDict

from gateway.http1 import END, Event, Head, ProtocolError, ResponseParser

HIGH_WATER = 1 << 20
"""Buffered body bytes at which reading from the engine pauses until the client catches up."""


class UpstreamError(Exception):
    """A call to an engine failed."""


class UpstreamConnectError(UpstreamError, ConnectionError):
    """The engine never began an answer (refused, reset, closed, or the connect timed out)."""


class UpstreamDropped(UpstreamError, ConnectionError):
    """The engine closed the connection with no answer begun, after it had the request for a
    while: not a kept-alive connection it had closed before the request came (that is
    `UpstreamConnectError`, within `STALE_WINDOW_S`), so the engine may have worked on it."""


STALE_WINDOW_S = 0.5
"""A connection that ends with nothing answered this soon after the request was written was
closed by the engine before the request came (an idle keep-alive connection closing): the
request is sent again on a fresh one. Later, the engine had the request (`UpstreamDropped`)."""


class UpstreamTimeout(UpstreamError, TimeoutError):
    """The engine sent nothing for the read timeout."""


class UpstreamBroken(UpstreamError, ConnectionError):
    """The engine's answer began and then failed (connection lost or malformed)."""


KEEPALIVE_IDLE_S = 30
KEEPALIVE_INTERVAL_S = 10
KEEPALIVE_PROBES = 3
"""TCP keepalive on connections to engines: an engine whose host vanished from the network
mid-call (no FIN, no RST) is noticed after about a minute, not at `request_timeout_s` (600 s
by default) of silence."""


def keep_probing(sock: socket.socket | None) -> None:
    """Turn on TCP keepalive with the timings above (where the platform has them)."""
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
                            ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                            ("TCP_KEEPCNT", KEEPALIVE_PROBES)):
            option = getattr(socket, name, None)
            if option is not None:
                sock.setsockopt(socket.IPPROTO_TCP, option, value)
    except OSError:  # a transport whose socket takes no options (TLS over a pipe, say)
        pass


class _Connection(asyncio.Protocol):
    """One connection to an engine, carrying one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = ResponseParser()
        self.response: UpstreamResponse | None = None
        self.head: asyncio.Future[UpstreamResponse] | None = None
        """Set while a request awaits its answer's head."""
        self.target: tuple[Upstream, tuple[str, str, int], float | None] | None = None
        """The pool, key and read timeout of the request under way."""
        self.closed = False
        self.paused = False
        self.sent_at = 0.0
        """When the request under way was written (the event loop's clock)."""
        self.idle_in: list[_Connection] | None = None
        """The pool's list of idle connections this one waits in, if it does."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        keep_probing(transport.get_extra_info("socket"))

    def data_received(self, data: bytes) -> None:
        if self.head is None and self.response is None:
            # Bytes on an idle connection answer no request (the tail of a response that
            # miscounted its Content-Length, an unsolicited 408 before an idle close): kept,
            # they would be read as the head of the next request's answer.
            if self.transport is not None:
                self.transport.close()
            return
        try:
            events = self.parser.feed(data)
        except ProtocolError as e:
            self._fail(e)
            if self.transport is not None:
                self.transport.close()
            return
        self._deliver(events)

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost frames the end

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.idle_in is not None:
            self.idle_in.remove(self)  # closed while idle (uvicorn closes them after 5 s)
            self.idle_in = None
        if self.head is None and self.response is None:
            return
        try:
            events = self.parser.eof()
        except ProtocolError as e:
            self._fail(e if exc is None else exc)
            return
        if exc is not None and events:
            # A body framed by the connection's end ended in an error (a reset), not a close:
            # it may be cut short.
            self._fail(exc)
            return
        self._deliver(events)

    def _deliver(self, events: list[Event]) -> None:
        for ev in events:
            if isinstance(ev, bytes):
                resp = self.response
                if resp is not None:
                    resp._feed(ev)
            elif ev is END:
                if self.response is not None:
                    self.response._end()
            elif isinstance(ev, Head):
                # The response exists from its head on, so body bytes that come in the same
                # read are not lost before the caller resumes.
                head, self.head = self.head, None
                if head is not None and not head.done() and self.target is not None:
                    pool, key, read_timeout = self.target
                    self.response = UpstreamResponse(ev, self, pool, key, read_timeout)
                    head.set_result(self.response)

    def _fail(self, error: BaseException) -> None:
        head, self.head = self.head, None
        if head is not None and not head.done():
            what = str(error) or repr(error)
            if self.parser.started:
                head.set_exception(UpstreamBroken(what))
                return
            waited = asyncio.get_running_loop().time() - self.sent_at
            head.set_exception(
                UpstreamConnectError(what) if waited <= STALE_WINDOW_S else UpstreamDropped(
                    f"the engine closed the connection {waited:.1f} s after the request, "
                    f"before answering ({what})"))
        elif self.response is not None:
            self.response._fail(UpstreamBroken(str(error) or repr(error)))

    def pause(self) -> None:
        if not self.paused and self.transport is not None and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()


class UpstreamResponse:
    """An engine's answer: status and headers now, the body as it arrives."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_conn",
        "_eof",
        "_error",
        "_keep_alive",
        "_key",
        "_loop",
        "_pool",
        "_read_timeout",
        "_released",
        "_waiter",
        "_whole",
        "headers",
        "reason",
        "status",
    )

    def __init__(self, head: Head, conn: _Connection, pool: Upstream, key: tuple[str, str, int],
                 read_timeout: float | None) -> None:
        self.status = head.status
        self.reason = head.reason
        self.headers: CIMultiDict[str] = head.headers
        self._conn = conn
        self._pool = pool
        self._key = key
        self._keep_alive = head.keep_alive
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._eof = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._read_timeout = read_timeout
        self._loop = asyncio.get_running_loop()
        self._released = False
        self._whole = False
        """`read` takes the body whole: reading never pauses for it."""

    @property
    def content_type(self) -> str:
        """The media type, lower-cased, without parameters."""
        return self.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()

    def at_eof(self) -> bool:
        """The whole body has been read."""
        return self._eof and not self._chunks

    async def readany(self) -> bytes:
        """The body bytes that have arrived (waiting for some); b"" once the body has ended."""
        while not self._chunks:
            if self._eof:
                return b""
            if self._error is not None:
                raise self._error
            await self._wait()
        data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        self._conn.resume()
        return data

    async def read(self) -> bytes:
        """The whole body."""
        self._whole = True
        self._conn.resume()
        while not self._eof:
            if self._error is not None:
                raise self._error
            await self._wait()
        data = b"".join(self._chunks)
        self._chunks.clear()
        return data

    def release(self) -> None:
        """Give the connection back for reuse if the answer was read whole, else close it (an
        engine sees the disconnect and aborts an unfinished request)."""
        if self._released:
            return
        self._released = True
        conn = self._conn
        conn.response = None
        conn.target = None
        if (self._eof and self._keep_alive and conn.parser.reusable and not conn.closed
                and self._error is None):
            conn.parser = ResponseParser()
            conn.resume()
            self._pool._put(self._key, conn)
        elif conn.transport is not None:
            conn.transport.close()

    def close(self) -> None:
        """Drop the connection whatever the state of the answer."""
        self._keep_alive = False
        self.release()

    async def _wait(self) -> None:
        waiter = self._waiter = self._loop.create_future()
        timer = (self._loop.call_later(self._read_timeout, self._timed_out, waiter)
                 if self._read_timeout is not None else None)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def _timed_out(self, waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            waiter.set_exception(UpstreamTimeout(
                f"no data from the engine for {self._read_timeout:g} s"))

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER and not self._whole:
            self._conn.pause()
        self._wake()

    def _end(self) -> None:
        self._eof = True
        self._wake()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)


class Upstream:
    """Keep-alive connections to engines, by scheme, host and port."""

    def __init__(self, connect_timeout_s: float | None,
                 while_waiting: Callable[[], None] | None = None) -> None:
        """`while_waiting` runs each time a request has been written and its answer is awaited
        (the gateway catches up on its bookkeeping then: `gateway/later.py`)."""
        self.connect_timeout_s = connect_timeout_s
        self.while_waiting = while_waiting
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._bases: dict[str, tuple[str, str, int, bytes]] = {}
        self._ssl: ssl.SSLContext | None = None

    async def post(self, base_url: str, path: str, body: bytes,
                   headers: Iterable[tuple[str, str]], read_timeout: float | None
                   ) -> UpstreamResponse:
        """Send `body` to `base_url + path`; returns once the answer's head has arrived."""
        scheme, host, port, host_header = self._base(base_url)
        key = (scheme, host, port)
        head_lines = [b"POST ", path.encode(), b" HTTP/1.1\r\nHost: ", host_header,
                      b"\r\nContent-Length: ", str(len(body)).encode(), b"\r\n"]
        for name, value in headers:
            # The bytes the client sent: aiohttp reads header values as UTF-8, keeping bytes
            # that are not as surrogates.
            head_lines += (name.encode("utf-8", "surrogateescape"), b": ",
                           value.encode("utf-8", "surrogateescape"), b"\r\n")
        head_lines.append(b"\r\n")
        request = b"".join(head_lines) + body
        conn = self._take(key)
        reused = conn is not None
        while True:
            if conn is None:
                conn = await self._connect(scheme, host, port)
            conn.target = (self, key, read_timeout)
            try:
                return await self._send(conn, request, read_timeout, self.while_waiting)
            except UpstreamConnectError:
                if reused:
                    # A kept-alive connection the engine closed while idle: try a fresh one.
                    conn, reused = None, False
                    continue
                raise

    async def close(self) -> None:
        """Close every idle connection."""
        idle = [c for conns in self._idle.values() for c in conns]
        self._idle.clear()
        for c in idle:
            c.idle_in = None
            if c.transport is not None:
                c.transport.close()

    def _base(self, base_url: str) -> tuple[str, str, int, bytes]:
        base = self._bases.get(base_url)
        if base is None:
            u = urlsplit(base_url)
            if u.scheme not in ("http", "https") or not u.hostname:
                raise UpstreamConnectError(f"cannot forward to {base_url!r}: not an http(s) URL")
            port = u.port or (443 if u.scheme == "https" else 80)
            base = (u.scheme, u.hostname, port, u.netloc.rpartition("@")[2].encode("idna"))
            self._bases[base_url] = base
        return base

    def _take(self, key: tuple[str, str, int]) -> _Connection | None:
        conns = self._idle.get(key)
        while conns:
            conn = conns.pop()
            conn.idle_in = None
            if not conn.closed:
                return conn
        return None

    def _put(self, key: tuple[str, str, int], conn: _Connection) -> None:
        conns = self._idle.setdefault(key, [])
        conns.append(conn)
        conn.idle_in = conns

    def idle_connections(self) -> int:
        """Connections open and waiting for a request."""
        return sum(len(conns) for conns in self._idle.values())

    async def _connect(self, scheme: str, host: str, port: int) -> _Connection:
        loop = asyncio.get_running_loop()
        ssl_ctx: ssl.SSLContext | None = None
        if scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            ssl_ctx = self._ssl
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(_Connection, host, port, ssl=ssl_ctx)
        except TimeoutError:
            raise UpstreamConnectError(
                f"connecting to {host}:{port} took over {self.connect_timeout_s:g} s") from None
        except OSError as e:
            raise UpstreamConnectError(f"cannot connect to {host}:{port}: {e}") from None
        return conn

    @staticmethod
    async def _send(conn: _Connection, request: bytes, read_timeout: float | None,
                    while_waiting: Callable[[], None] | None) -> UpstreamResponse:
        assert conn.transport is not None
        head: asyncio.Future[UpstreamResponse] = asyncio.get_running_loop().create_future()
        conn.head = head
        conn.sent_at = asyncio.get_running_loop().time()
        conn.transport.write(request)
        if while_waiting is not None:
            while_waiting()
        try:
            async with asyncio.timeout(read_timeout):
                return await head
        except TimeoutError:
            conn.head = None
            if conn.transport is not None:
                conn.transport.close()
            raise UpstreamTimeout(
                f"no answer from the engine within {read_timeout:g} s") from None
        except BaseException:
            conn.head = None
            # Cancelled (the client went away): the engine sees the disconnect and aborts. A
            # response that arrived just as the wait ended is dropped with its connection.
            if conn.transport is not None:
                conn.transport.close()
            raise
