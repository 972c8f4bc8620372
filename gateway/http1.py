"""HTTP/1.1 response framing as a sans-IO state machine (the h11 pattern): feed it bytes, it
returns the response head, body pieces and the end of the message.

The proxy's upstream client (gateway/upstream.py) runs on it. It frames exactly what engines
send: a `Content-Length` body, a chunked body (vLLM's streamed answers), a body that ends with the
connection, and none for 1xx/204/304 answers. Interim 1xx answers are skipped. Anything else it
can not frame raises `ProtocolError` naming the problem.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from multidict import CIMultiDict

MAX_HEAD_BYTES = 64 * 1024
"""A response head longer than this is refused (vLLM's are a few hundred bytes)."""


class ProtocolError(Exception):
    """The peer sent something that is not an HTTP/1.1 response this parser can frame."""


@dataclass(frozen=True, slots=True)
class Head:
    """A response's status line and headers."""

    status: int
    reason: str
    headers: CIMultiDict[str]
    keep_alive: bool
    """The connection can carry another request once this response's body has ended."""


class _End:
    """The response's body has ended."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "END"


END = _End()
Event = Head | bytes | _End

# Framing states.
_FORBIDDEN = re.compile(rb"[\r\n\0]")
"""Bytes no header value may hold."""

_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILERS, _UNTIL_CLOSE, _DONE = range(8)



def _header_text(value: bytes) -> str:
    """A response header's value as text: UTF-8 where it is (aiohttp writes the client's
    headers as UTF-8, so a Latin-1 reading sent `cafÃ©` for `café`), else Latin-1."""
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return value.decode("latin-1")

class ResponseParser:
    """Frames one response; `feed` returns the events the new bytes complete."""

    __slots__ = ("_buf", "_keep_alive", "_remaining", "_state")

    def __init__(self) -> None:
        self._buf = b""
        self._state = _HEAD
        self._remaining = 0
        self._keep_alive = False

    @property
    def reusable(self) -> bool:
        """The connection may carry another request once this response is done (keep-alive,
        and nothing came after the response's end)."""
        return self._keep_alive

    @property
    def done(self) -> bool:
        """The whole response has been framed."""
        return self._state == _DONE

    @property
    def started(self) -> bool:
        """Some of the response has arrived."""
        return self._state != _HEAD or bool(self._buf)

    def feed(self, data: bytes) -> list[Event]:
        """The events `data` completes, in order; bytes after the response's end are an error."""
        if self._state == _DONE:
            if data:
                raise ProtocolError("the engine sent bytes after the end of its response")
            return []
        if self._state == _LENGTH and not self._buf:
            # The common case of a body piece: no copy, no rescan.
            n = len(data)
            if n < self._remaining:
                self._remaining -= n
                return [data]
            if n == self._remaining:
                self._state = _DONE
                return [data, END]
        self._buf = self._buf + data if self._buf else data
        events: list[Event] = []
        while True:
            state = self._state
            buf = self._buf
            if state == _HEAD:
                # Empty lines before the status line are skipped (RFC 9112, 2.2): a stray CRLF
                # after a body used to fail the next answer on that connection.
                while buf.startswith(b"\r\n"):
                    buf = self._buf = buf[2:]
                end = buf.find(b"\r\n\r\n")
                if end < 0 or end > MAX_HEAD_BYTES:
                    if len(buf) > MAX_HEAD_BYTES:
                        raise ProtocolError(f"response head exceeds {MAX_HEAD_BYTES} bytes")
                    return events
                self._buf = buf[end + 4:]
                head = self._head(buf[:end])
                if head is not None:
                    events.append(head)
                continue
            if state == _LENGTH:
                if not buf:
                    return events
                if len(buf) < self._remaining:
                    self._remaining -= len(buf)
                    self._buf = b""
                    events.append(buf)
                    return events
                events.append(buf[:self._remaining])
                self._buf = buf[self._remaining:]
                self._state = _DONE
            elif state == _CHUNK_SIZE:
                eol = buf.find(b"\r\n")
                if eol < 0:
                    if len(buf) > 1024:
                        raise ProtocolError("chunk size line exceeds 1024 bytes")
                    return events
                size_text = buf[:eol].split(b";", 1)[0].strip()
                try:
                    size = int(size_text, 16)
                except ValueError:
                    raise ProtocolError(f"bad chunk size {size_text[:40]!r}") from None
                if size < 0:
                    raise ProtocolError(f"bad chunk size {size_text[:40]!r}")
                self._buf = buf[eol + 2:]
                if size == 0:
                    self._state = _TRAILERS
                else:
                    self._remaining = size
                    self._state = _CHUNK_DATA
                continue
            elif state == _CHUNK_DATA:
                if not buf:
                    return events
                if len(buf) <= self._remaining:
                    self._remaining -= len(buf)
                    self._buf = b""
                    events.append(buf)
                    if self._remaining == 0:
                        self._state = _CHUNK_CRLF
                    return events
                events.append(buf[:self._remaining])
                self._buf = buf[self._remaining:]
                self._state = _CHUNK_CRLF
                continue
            elif state == _CHUNK_CRLF:
                if len(buf) < 2:
                    return events
                if buf[:2] != b"\r\n":
                    raise ProtocolError("chunk data not followed by CRLF")
                self._buf = buf[2:]
                self._state = _CHUNK_SIZE
                continue
            elif state == _TRAILERS:
                if buf.startswith(b"\r\n"):
                    self._buf = buf[2:]
                    self._state = _DONE
                else:
                    end = buf.find(b"\r\n\r\n")
                    if end < 0:
                        if len(buf) > MAX_HEAD_BYTES:
                            raise ProtocolError(f"trailers exceed {MAX_HEAD_BYTES} bytes")
                        return events
                    self._buf = buf[end + 4:]
                    self._state = _DONE
            elif state == _UNTIL_CLOSE:
                self._buf = b""
                if buf:
                    events.append(buf)
                return events
            # _DONE
            events.append(END)
            if self._buf:
                # The answer is whole; what follows it (a stray line end) is dropped with the
                # connection, which is not used again.
                self._buf = b""
                self._keep_alive = False
            return events

    def eof(self) -> list[Event]:
        """The connection closed: the end of a body that runs until close, else an error if a
        response was under way."""
        if self._state == _UNTIL_CLOSE:
            self._state = _DONE
            return [END]
        if self._state == _DONE:
            return []
        if self.started:
            raise ProtocolError("the connection closed in the middle of the response")
        raise ProtocolError("the connection closed before a response arrived")

    def _head(self, raw: bytes) -> Head | None:
        """Parse a head and set the body's framing; None for an interim 1xx answer."""
        lines = raw.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise ProtocolError(f"bad status line {lines[0][:80]!r}")
        try:
            status = int(parts[1])
        except ValueError:
            raise ProtocolError(f"bad status code {parts[1][:10]!r}") from None
        if not 100 <= status <= 999:
            raise ProtocolError(f"bad status code {status}")
        headers: CIMultiDict[str] = CIMultiDict()
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip():
                raise ProtocolError(f"bad header line {line[:80]!r}")
            if _FORBIDDEN.search(value):
                # RFC 9110 5.5: a CR, LF or NUL in a field value is an error (relayed, it would
                # split the client's answer).
                raise ProtocolError(f"control character in header line {line[:80]!r}")
            headers.add(name.decode("latin-1"), _header_text(value.strip()))
        if status < 200:
            return None  # 100 Continue and friends: the real answer follows
        connection = headers.get("Connection", "").lower()
        keep_alive = "close" not in connection and (parts[0] == b"HTTP/1.1"
                                                    or "keep-alive" in connection)
        if status in (204, 304):
            self._state = _DONE
        elif "chunked" in headers.get("Transfer-Encoding", "").lower():
            self._state = _CHUNK_SIZE
        elif "Content-Length" in headers:
            lengths = set(headers.getall("Content-Length"))
            try:
                length = int(lengths.pop()) if len(lengths) == 1 else -1
            except ValueError:
                length = -1
            if length < 0:
                raise ProtocolError("bad Content-Length header")
            self._remaining = length
            self._state = _LENGTH if length else _DONE
        else:
            self._state = _UNTIL_CLOSE
            keep_alive = False
        self._keep_alive = keep_alive
        return Head(status, parts[2].decode("latin-1") if len(parts) > 2 else "", headers,
                    keep_alive)
