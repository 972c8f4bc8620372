"""The proxy's upstream client: HTTP/1.1 framing (sans-IO) and keep-alive connections over real
sockets to a real aiohttp server."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from gateway.http1 import END, Head, ProtocolError, ResponseParser
from gateway.proxy import EventFramer
from gateway.upstream import (
    KEEPALIVE_IDLE_S,
    Upstream,
    UpstreamBroken,
    UpstreamConnectError,
    UpstreamTimeout,
)
from kvgate.procs import free_port


def frame(data: bytes, cuts: list[int]) -> tuple[Head, bytes, bool]:
    """Feed `data` split at `cuts`; the head, the body and whether the end was seen."""
    parser = ResponseParser()
    events: list[object] = []
    last = 0
    for cut in [*sorted(c % (len(data) + 1) for c in cuts), len(data)]:
        events += parser.feed(data[last:cut])
        last = max(last, cut)
    heads = [e for e in events if isinstance(e, Head)]
    assert len(heads) == 1
    body = b"".join(e for e in events if isinstance(e, bytes))
    return heads[0], body, events[-1] is END


def chunked(body: bytes, sizes: list[int]) -> bytes:
    out, i = [], 0
    for n in [*sizes, len(body)]:
        piece = body[i:i + max(n, 1)]
        if not piece:
            break
        out.append(b"%x\r\n%s\r\n" % (len(piece), piece))
        i += len(piece)
    return b"".join(out) + b"0\r\n\r\n"


@given(st.binary(max_size=300), st.lists(st.integers(0, 400), max_size=6))
def test_a_content_length_body_is_framed_whatever_the_reads(body: bytes, cuts: list[int]) -> None:
    data = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    head, got, ended = frame(data, cuts)
    assert (head.status, got, ended, head.keep_alive) == (200, body, True, True)


@given(st.binary(min_size=1, max_size=300), st.lists(st.integers(1, 50), max_size=8),
       st.lists(st.integers(0, 600), max_size=6))
def test_a_chunked_body_is_framed_whatever_the_reads(body: bytes, sizes: list[int],
                                                     cuts: list[int]) -> None:
    data = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + chunked(body, sizes))
    head, got, ended = frame(data, cuts)
    assert (got, ended) == (body, True)
    assert head.headers["content-type"] == "text/event-stream"


def test_interim_answers_are_skipped_and_trailers_read() -> None:
    parser = ResponseParser()
    events = parser.feed(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n3;ext=1\r\nabc\r\n0\r\nX-T: 1\r\n\r\n")
    assert [e.status if isinstance(e, Head) else e for e in events] == [200, b"abc", END]


def test_a_body_without_length_runs_until_close_and_ends_keep_alive() -> None:
    parser = ResponseParser()
    events = parser.feed(b"HTTP/1.1 200 OK\r\n\r\npart")
    assert isinstance(events[0], Head) and not events[0].keep_alive
    assert events[1:] == [b"part"]
    assert parser.eof() == [END]


def test_connection_close_and_http_1_0_are_not_kept_alive() -> None:
    for head in (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
                 b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n"):
        events = ResponseParser().feed(head)
        assert isinstance(events[0], Head) and not events[0].keep_alive and events[1] is END


@pytest.mark.parametrize("data, message", [
    (b"SMTP ready\r\n\r\n", "bad status line"),
    (b"HTTP/1.1 abc OK\r\n\r\n", "bad status code"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "bad header line"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -4\r\n\r\n", "bad Content-Length"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\naXX", "not followed by CRLF"),
    (b"HTTP/1.1 200 OK\r\nX-Debug: a\rb\r\n\r\n", "control character"),
    (b"HTTP/1.1 200 OK\r\nX-Debug: a\nb\r\n\r\n", "control character"),
    (b"HTTP/1.1 200 OK\r\nX-Debug: a\0b\r\n\r\n", "control character"),
])
def test_malformed_responses_raise_an_error_naming_the_problem(data: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        ResponseParser().feed(data)


def test_an_answer_is_whole_even_with_bytes_after_it_and_leading_line_ends_are_skipped(
) -> None:
    # Bytes after the end used to turn a whole 200 into a broken answer (a 502, the engine
    # out of rotation), and a stray line end before the next status line the next answer.
    parser = ResponseParser()
    events = parser.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok\r\n")
    assert [e.status if isinstance(e, Head) else e for e in events] == [200, b"ok", END]
    assert not parser.reusable  # its connection is not used again
    parser = ResponseParser()
    events = parser.feed(b"\r\n\r\nHTTP/1.1 204 No Content\r\nX-Name: caf\xc3\xa9\r\n"
                         b"X-Raw: \xff\r\n\r\n")
    head = events[0]
    assert isinstance(head, Head) and head.status == 204 and events[1:] == [END]
    assert parser.reusable
    # UTF-8 values read as UTF-8 (they were read as Latin-1 and reached clients garbled);
    # others as Latin-1.
    assert (head.headers["X-Name"], head.headers["X-Raw"]) == ("café", "\xff")
    # A head too long is refused however it arrives, in one read too.
    with pytest.raises(ProtocolError, match="response head exceeds"):
        ResponseParser().feed(b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70_000 + b"\r\n\r\n")


def test_a_connection_closed_mid_body_is_an_error() -> None:
    parser = ResponseParser()
    parser.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
    with pytest.raises(ProtocolError, match="middle of the response"):
        parser.eof()


# -- the client, against a real server ------------------------------------------------------------


class Engine:
    """A real aiohttp server with the answers the tests need; counts its connections."""

    def __init__(self) -> None:
        self.peers: set[object] = set()
        self.disconnected = asyncio.Event()

    async def echo(self, request: web.Request) -> web.Response:
        self.peers.add(request.transport)
        return web.Response(body=await request.read(), headers={"X-Got": request.path})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(3):
                await resp.write(b"data: %d\n\n" % i)
                await asyncio.sleep(0.01)
            await asyncio.sleep(float(request.query.get("hang", "0")))
            await resp.write_eof()
        except asyncio.CancelledError:
            self.disconnected.set()
            raise
        return resp

    async def silent(self, request: web.Request) -> web.Response:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.disconnected.set()
            raise
        return web.Response()

    async def big(self, request: web.Request) -> web.Response:
        return web.Response(body=b"y" * (3 << 20))

    async def cut(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Length": "100"})
        await resp.prepare(request)
        await resp.write(b"x" * 10)
        assert request.transport is not None
        request.transport.close()
        return resp


@contextlib.asynccontextmanager
async def serving(app: web.Application, **runner_options: Any) -> AsyncIterator[str]:
    """`app` on a real 127.0.0.1 socket for the block; yields its base URL."""
    runner = web.AppRunner(app, **runner_options)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.fixture
async def engine() -> AsyncIterator[tuple[Engine, str]]:
    e = Engine()
    app = web.Application()
    app.router.add_post("/echo", e.echo)
    app.router.add_post("/stream", e.stream)
    app.router.add_post("/silent", e.silent)
    app.router.add_post("/cut", e.cut)
    app.router.add_post("/big", e.big)
    async with serving(app, handler_cancellation=True) as url:
        yield e, url


async def test_answers_come_back_whole_over_one_kept_alive_connection(
        engine: tuple[Engine, str]) -> None:
    e, url = engine
    up = Upstream(connect_timeout_s=5)
    for i in range(3):
        resp = await up.post(url, "/echo", b"hello %d" % i, [("X-Request-Id", "r")], 5)
        assert (resp.status, resp.headers["X-Got"]) == (200, "/echo")
        assert await resp.read() == b"hello %d" % i
        resp.release()
    assert len(e.peers) == 1
    # The connection probes a silent peer (an engine whose host left the network mid-call
    # was otherwise noticed only at the read timeout, 600 s by default).
    (conns,) = up._idle.values()
    sock = conns[0].transport.get_extra_info("socket")
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == KEEPALIVE_IDLE_S
    await up.close()


async def test_a_body_larger_than_the_read_buffer_is_read_whole(
        engine: tuple[Engine, str]) -> None:
    """Reading pauses while a streamed body's reader lags, never for a body read whole."""
    _, url = engine
    up = Upstream(connect_timeout_s=5)
    resp = await up.post(url, "/big", b"{}", [], 5)
    await asyncio.sleep(0.2)  # the whole body arrives (and pauses reading) before it is read
    assert await resp.read() == b"y" * (3 << 20)
    resp.release()
    resp = await up.post(url, "/big", b"{}", [], 5)
    got = b""
    while chunk := await resp.readany():
        got += chunk
    assert got == b"y" * (3 << 20)
    resp.release()
    await up.close()


async def test_a_stream_arrives_piece_by_piece(engine: tuple[Engine, str]) -> None:
    _, url = engine
    up = Upstream(connect_timeout_s=5)
    resp = await up.post(url, "/stream", b"{}", [], 5)
    assert resp.content_type == "text/event-stream"
    pieces = []
    while chunk := await resp.readany():
        pieces.append(chunk)
    assert b"".join(pieces) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n" and len(pieces) >= 2
    assert resp.at_eof()
    resp.release()
    await up.close()


async def test_closing_an_unfinished_answer_disconnects_the_engine(
        engine: tuple[Engine, str]) -> None:
    e, url = engine
    up = Upstream(connect_timeout_s=5)
    resp = await up.post(url, "/stream?hang=30", b"{}", [], 5)
    await resp.readany()
    resp.close()
    await asyncio.wait_for(e.disconnected.wait(), 5)
    await up.close()


async def test_a_caller_cancelled_while_waiting_disconnects_the_engine(
        engine: tuple[Engine, str]) -> None:
    e, url = engine
    up = Upstream(connect_timeout_s=5)
    call = asyncio.ensure_future(up.post(url, "/silent", b"{}", [], 60))
    await asyncio.sleep(0.2)
    call.cancel()
    await asyncio.wait_for(e.disconnected.wait(), 5)
    await up.close()


async def test_a_silent_engine_times_out(engine: tuple[Engine, str]) -> None:
    _, url = engine
    up = Upstream(connect_timeout_s=5)
    with pytest.raises(UpstreamTimeout, match=r"within 0\.2 s"):
        await up.post(url, "/silent", b"{}", [], 0.2)
    resp = await up.post(url, "/stream?hang=30", b"{}", [], 0.3)
    with pytest.raises(UpstreamTimeout, match=r"for 0\.3 s"):
        while await resp.readany():
            pass
    resp.close()
    await up.close()


async def test_an_answer_cut_short_is_broken_not_a_connect_error(
        engine: tuple[Engine, str]) -> None:
    _, url = engine
    up = Upstream(connect_timeout_s=5)
    resp = await up.post(url, "/cut", b"{}", [], 5)
    with pytest.raises(UpstreamBroken, match="middle of the response"):
        await resp.read()
    resp.release()
    await up.close()


async def test_idle_connections_the_engine_closes_leave_the_pool() -> None:
    app = web.Application()
    app.router.add_post("/echo", Engine().echo)
    async with serving(app, keepalive_timeout=0.2) as url:  # uvicorn's is 5 s
        up = Upstream(connect_timeout_s=5)
        answers = await asyncio.gather(*(up.post(url, "/echo", b"x", [], 5) for _ in range(3)))
        for resp in answers:
            await resp.read()
            resp.release()
        assert up.idle_connections() == 3
        await asyncio.sleep(1.0)
        assert up.idle_connections() == 0
        resp = await up.post(url, "/echo", b"again", [], 5)
        assert await resp.read() == b"again"
        resp.release()
        await up.close()


async def test_a_refused_connection_is_a_connect_error() -> None:
    up = Upstream(connect_timeout_s=5)
    with pytest.raises(UpstreamConnectError, match="cannot connect"):
        await up.post(f"http://127.0.0.1:{free_port()}", "/echo", b"{}", [], 5)
    with pytest.raises(UpstreamConnectError, match="not an http"):
        await up.post("ftp://127.0.0.1:1", "/echo", b"{}", [], 5)


async def test_a_kept_alive_connection_the_engine_closed_is_replaced() -> None:
    """An engine that closes an idle connection just as a request goes out on it (uvicorn
    closes idle ones after 5 s) costs no failed call: the request is sent on a fresh one."""
    served = 0

    async def answer_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        for n in range(2):
            await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(2)
            if n == 1:
                break  # the second request on this connection: close without an answer
            served += 1
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer_once, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    up = Upstream(connect_timeout_s=5)
    for _ in range(3):
        resp = await up.post(f"http://127.0.0.1:{port}", "/x", b"{}", [], 5)
        assert await resp.read() == b"ok"
        resp.release()
    assert served == 3
    server.close()
    await up.close()


async def test_while_waiting_runs_once_per_request_after_it_is_written(
        engine: tuple[Engine, str]) -> None:
    """The gateway's deferred bookkeeping runs while the engine works: once per request, after
    the request has gone out (the engine may already be answering it) and before its answer
    is handed back."""
    e, url = engine
    seen: list[int] = []
    up = Upstream(connect_timeout_s=5, while_waiting=lambda: seen.append(len(e.peers)))
    for i in range(3):
        resp = await up.post(url, "/echo", b"hi %d" % i, [], 5)
        assert len(seen) == i + 1
        assert await resp.read() == b"hi %d" % i
        resp.release()
    # The engine (served on this loop) has not run yet when the hook does: the first request's
    # connection is new to it; the next ones reuse it.
    assert seen == [0, 1, 1]
    await up.close()


async def test_a_body_until_close_that_ends_in_a_reset_is_broken() -> None:
    # No Content-Length, no chunks: the body runs until the connection closes. A reset is not
    # a close: the answer may be cut short.
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\npartial")
        await writer.drain()
        await asyncio.sleep(0.05)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    up = Upstream(connect_timeout_s=5)
    try:
        resp = await up.post(f"http://127.0.0.1:{port}", "/reset", b"{}", [], 5)
        with pytest.raises(UpstreamBroken):
            await resp.read()
        resp.release()
    finally:
        await up.close()
        server.close()
        await server.wait_closed()


@given(st.lists(st.sampled_from([b'data: {"a": 1}\n\n', b'data: {"b": "x"}\r\n\r\n',
                                 b"data: [DONE]\n\n", b": keep-alive\n\n"]), max_size=8),
       st.binary(max_size=20).filter(lambda b: b"\n" not in b and b"\r" not in b),
       st.lists(st.integers(0, 200), max_size=10))
def test_events_come_out_whole_however_the_stream_is_cut(
        events: list[bytes], unfinished: bytes, cuts: list[int]) -> None:
    data = b"".join(events) + unfinished
    framer = EventFramer()
    out, last = [], 0
    for cut in [*sorted(c % (len(data) + 1) for c in cuts), len(data)]:
        piece = framer.feed(data[last:cut])
        last = max(last, cut)
        if piece:
            # Each piece ends where an event ends, and is as much as has ended.
            out.append(piece)
            assert piece.endswith((b"\n\n", b"\r\n\r\n"))
    assert b"".join(out) == b"".join(events) and framer.rest() == unfinished
    assert framer.pending_bytes == len(unfinished)


@pytest.mark.parametrize("stray", [
    b"   \n",  # the tail of an answer that counted its Content-Length short
    b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
])
async def test_bytes_on_an_idle_connection_never_reach_the_next_answer(stray: bytes) -> None:
    """What an engine sends while a connection waits in the pool answers no request: the
    connection is dropped, and the next request goes out on a fresh one and is answered (the
    bytes used to be read as the head of its answer: a 502, or a wait for the read timeout
    when the engine closed after an unsolicited 408)."""
    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        first = connections == 1
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(2)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
                if first:
                    await asyncio.sleep(0.05)
                    writer.write(stray)
                    await writer.drain()
                    await asyncio.sleep(0.5)  # an idle close comes later, if at all
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    up = Upstream(connect_timeout_s=5)
    resp = await up.post(url, "/x", b"{}", [], 5)
    assert await resp.read() == b"ok"
    resp.release()
    await asyncio.sleep(0.2)
    assert up.idle_connections() == 0
    resp = await asyncio.wait_for(up.post(url, "/x", b"{}", [], 5), 2)
    assert resp.status == 200 and await resp.read() == b"ok"
    resp.release()
    assert connections == 2
    server.close()
    await up.close()
