"""The forwarding path to the server: a lean HTTP/1.1 client over kept-alive connections.

Every admitted request goes through here, so it does only what forwarding needs:
one write per request (line, headers and body together), the response's head parsed
once, its body handed on piece by piece as the socket delivers it (Content-Length,
chunked, or until the server closes), and the connection back in the pool once the
body is complete. A response the caller closes before its end closes its connection,
which is how vLLM learns that a client went away (it aborts the request).

Failures are typed (forward_errors.py) so the proxy can answer each the way it should:
`UpstreamUnavailable` (refused, reset, closed or a connect timeout before any answer:
503), `UpstreamTimeout` (silent longer than the read timeout: 504, or a stream ended
with an error), `UpstreamProtocolError` (an answer that is not HTTP/1.x: 502), and
`UpstreamBroke` (the body ended early: the stream is ended with an error).

A kept-alive connection the server closed while idle is skipped when that is known
before the request goes out. When it is noticed only after (no byte back), the request
is sent once more on a new connection only if its method is idempotent: the server may
have read a POST and started on it. Idle connections are closed after `keepalive_s`,
before the server's own idle timeout can race a request (uvicorn's default is 5 s).
"""

from __future__ import annotations

import asyncio
import collections
import re
import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

from multidict import CIMultiDict

from sidecar.upstream.deadline import Deadline
from sidecar.upstream.forward_errors import (
    UpstreamBroke,
    UpstreamConnectTimeout,
    UpstreamProtocolError,
    UpstreamTimeout,
    UpstreamUnavailable,
)

# Reading pauses when this much body is waiting for the caller (a slow client): the
# server is then backpressured through TCP instead of kvgate buffering the stream.
HIGH_WATER_BYTES = 256 * 1024
LOW_WATER_BYTES = 64 * 1024
# A response head longer than this is not an answer kvgate can use.
MAX_HEAD_BYTES = 64 * 1024
NO_BODY_STATUSES = frozenset({204, 304})
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"})
# Framing is kvgate's to write: a caller's own would let the server frame it otherwise.
_OWN_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})
_DIGITS = re.compile(r"[0-9]{3}")  # a status code (str.isdigit also takes "²")
_LENGTH = re.compile(r"[0-9]{1,18}")
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")


@dataclass(frozen=True)
class Origin:
    """Where forwarded requests go: scheme, host, port and an optional path prefix."""

    host: str
    port: int
    tls: bool
    prefix: str
    host_header: str

    @classmethod
    def parse(cls, base_url: str) -> Origin:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        host = parts.hostname
        shown = f"[{host}]" if ":" in host else host
        default = port == (443 if tls else 80)
        return cls(host, port, tls, parts.path.rstrip("/"),
                   shown if default else f"{shown}:{port}")


class _Connection(asyncio.Protocol):
    """One connection: parses one response at a time and queues its body pieces."""

    def __init__(self, pool: Http1Pool) -> None:
        self._pool = pool
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle = False  # in the pool, between exchanges
        self.idle_since = 0.0  # loop time it went back to the pool
        # The read timeout of the current wait.
        self._timeout_s = 0.0
        self._deadline = Deadline(self.loop, self._timed_out)
        self._reset()

    # -- one exchange -------------------------------------------------------------
    def _reset(self) -> None:
        self.received_any = False
        self.head: tuple[int, str, CIMultiDict[str]] | None = None
        self._buffer = bytearray()
        self._chunks: collections.deque[bytes] = collections.deque()
        self._queued = 0
        self._paused = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._head_only = False
        # Body framing: "length" (self._left bytes), "chunked", "close" (until EOF).
        self._framing = ""
        self._left = 0
        self.body_length: int | None = None  # the body's length, when framed by one
        self._chunk_state = "size"  # size | data | data_end | trailer
        self.body_done = False
        self.keep_alive = True

    def begin(self, head_only: bool) -> None:
        self._reset()
        self._head_only = head_only

    # -- asyncio.Protocol ---------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is not a subclass of asyncio's, but behaves as one).
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.head is not None and self.body_done:
            # Bytes after a complete answer, which nothing asked for: never reuse it.
            self.keep_alive = False
            if self.idle:
                self.close()
            return
        self.received_any = True
        try:
            if self.head is None:
                self._buffer += data
                if not self._parse_head():
                    return
                data = bytes(self._buffer)
                self._buffer.clear()
            if data:
                self._body(data)
        except UpstreamProtocolError as exc:
            self._fail(exc)
            self.close()
        except Exception as exc:  # whatever the bytes were: an answer that failed
            self._fail(UpstreamProtocolError(f"unreadable answer: {exc!r}"[:200]))
            self.close()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.forget(self)
        self._deadline.stop()
        if (self.head is not None and self._framing == "close" and not self.body_done
                and exc is None):
            self.body_done = True  # a body delimited by the end of the connection
            self.keep_alive = False
        elif self.head is None:
            self._fail(UpstreamUnavailable(
                f"the server closed the connection before answering ({exc or 'EOF'})"))
        elif not self.body_done:
            self._fail(UpstreamBroke(f"the server closed the connection mid-body "
                                     f"({exc or 'EOF'})"))
        self._wake()

    # -- parsing --------------------------------------------------------------------
    def _parse_head(self) -> bool:
        while True:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buffer) > MAX_HEAD_BYTES:
                    raise UpstreamProtocolError("response head too large")
                return False
            raw = bytes(self._buffer[:end])
            breaks = raw.count(b"\r\n")
            if raw.count(b"\r") != breaks or raw.count(b"\n") != breaks or b"\0" in raw:
                # A line not ended by CRLF, or NUL: no header of it can be passed on.
                raise UpstreamProtocolError("a bare CR, a bare LF or a NUL in the response head")
            # As aiohttp decodes headers: its server writes them back byte for byte.
            lines = raw.decode("utf-8", "surrogateescape").split("\r\n")
            del self._buffer[:end + 4]
            version, _, rest = lines[0].partition(" ")
            code, _, reason = rest.partition(" ")
            if not version.startswith("HTTP/1.") or not _DIGITS.fullmatch(code):
                raise UpstreamProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
            status = int(code)
            if 100 <= status < 200:
                continue  # an interim answer (100 Continue): the real one follows
            headers: CIMultiDict[str] = CIMultiDict()
            for line in lines[1:]:
                name, sep, value = line.partition(":")
                if not sep or not name or name != name.strip():
                    raise UpstreamProtocolError(f"malformed header line: {line[:80]!r}")
                headers.add(name, value.strip())
            self._framing_of(status, version, headers)  # raises before a head is given out
            # A reason phrase is shown, never trusted: no control characters.
            self.head = (status, "".join(c for c in reason if c.isprintable()), headers)
            return True

    def _framing_of(self, status: int, version: str, headers: CIMultiDict[str]) -> None:
        connection = headers.get("Connection", "").lower()
        self.keep_alive = ("close" not in connection
                           and (version == "HTTP/1.1" or "keep-alive" in connection))
        if self._head_only or status in NO_BODY_STATUSES:
            self._framing, self.body_done = "length", True
            return
        if "chunked" in headers.get("Transfer-Encoding", "").lower():
            self._framing = "chunked"
            return
        lengths = headers.getall("Content-Length", [])
        if lengths:
            length = ",".join(lengths)
            values = {value.strip() for value in length.split(",")}  # "3, 3" is one length
            if len(values) != 1 or not _LENGTH.fullmatch(next(iter(values))):
                raise UpstreamProtocolError(f"bad Content-Length: {length[:40]!r}")
            length = next(iter(values))
            self._framing, self._left = "length", int(length)
            self.body_length = self._left
            self.body_done = self._left == 0
            return
        self._framing, self.keep_alive = "close", False

    def _body(self, data: bytes) -> None:
        if self._framing == "length":
            if self.body_done:
                if data:
                    self.keep_alive = False  # bytes past the body: do not reuse
                return
            piece = data[:self._left]
            self._left -= len(piece)
            self._push(piece)
            if self._left == 0:
                self.body_done = True
                if len(data) > len(piece):
                    self.keep_alive = False
        elif self._framing == "chunked":
            self._buffer += data
            self._dechunk()
        else:
            self._push(data)

    def _dechunk(self) -> None:
        buffer = self._buffer
        while buffer and not self.body_done:
            if self._chunk_state == "size":
                end = buffer.find(b"\r\n")
                if end < 0:
                    if len(buffer) > 1024:
                        raise UpstreamProtocolError("chunk size line too long")
                    return
                size_text = bytes(buffer[:end]).split(b";", 1)[0].strip()
                del buffer[:end + 2]
                if not _CHUNK_SIZE.fullmatch(size_text):  # hex digits only: no sign, no 0x
                    raise UpstreamProtocolError(f"bad chunk size {size_text[:20]!r}")
                self._left = int(size_text, 16)
                self._chunk_state = "data" if self._left else "trailer"
            elif self._chunk_state == "data":
                piece = bytes(buffer[:self._left])
                del buffer[:len(piece)]
                self._left -= len(piece)
                self._push(piece)
                if self._left == 0:
                    self._chunk_state = "data_end"
            elif self._chunk_state == "data_end":
                if len(buffer) < 2:
                    return
                if buffer[:2] != b"\r\n":
                    raise UpstreamProtocolError("chunk not followed by CRLF")
                del buffer[:2]
                self._chunk_state = "size"
            else:  # trailer section: lines until an empty one
                end = buffer.find(b"\r\n")
                if end < 0:
                    return
                del buffer[:end + 2]
                if end == 0:
                    self.body_done = True
                    if buffer:
                        self.keep_alive = False

    def _push(self, piece: bytes) -> None:
        if not piece:
            return
        self._chunks.append(piece)
        self._queued += len(piece)
        if self._queued > HIGH_WATER_BYTES and not self._paused and self.transport:
            self._paused = True
            self.transport.pause_reading()

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- what the response reads ---------------------------------------------------------
    async def wait(self, timeout_s: float | None) -> None:
        """Until something changed (data, the end, an error), or the read timeout."""
        waiter = self.loop.create_future()
        self._waiter = waiter
        if timeout_s is not None:
            self._timeout_s = timeout_s
            self._deadline.set(self.loop.time() + timeout_s)
        try:
            await waiter
        finally:
            self._waiter = None
            self._deadline.clear()

    def _timed_out(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(UpstreamTimeout(
                f"the server sent nothing for {self._timeout_s:g} s"))

    def take(self) -> bytes:
        """Every body byte received so far (b"" if none)."""
        if not self._chunks:
            return b""
        data = (self._chunks.popleft() if len(self._chunks) == 1
                else b"".join(self._chunks))
        self._chunks.clear()
        self._queued = 0
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()
        return data

    def raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    @property
    def has_data(self) -> bool:
        return bool(self._chunks)

    def close(self) -> None:
        self._pool.forget(self)
        self._deadline.stop()
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()


class ForwardResponse:
    """A forwarded request's answer: its head, and its body as it arrives."""

    def __init__(self, connection: _Connection, pool: Http1Pool,
                 read_timeout_s: float | None) -> None:
        assert connection.head is not None
        self.status, self.reason, self.headers = connection.head
        # The length the body is framed by (None: chunked, until the connection closes,
        # or no body): the one parsed, not the header as sent ("3, 3"; or beside chunked).
        self.body_length = connection.body_length
        self._connection: _Connection | None = connection
        self._pool = pool
        self._read_timeout_s = read_timeout_s

    @property
    def content_type(self) -> str:
        return self.headers.get("Content-Type", "").partition(";")[0].strip().lower()

    @property
    def received_whole(self) -> bool:
        """The whole body has arrived (reading it can no longer fail or wait)."""
        connection = self._connection
        return connection is None or connection.body_done

    def take_received(self) -> bytes:
        """The body received so far; with `received_whole`, all of it."""
        connection = self._connection
        if connection is None:
            return b""
        data = connection.take()
        if connection.body_done:
            self._release()
        return data

    async def read_chunk(self) -> bytes:
        """The body bytes received since the last call, waiting for some; b"" at the
        end. Raises `UpstreamTimeout` or `UpstreamBroke`."""
        connection = self._connection
        if connection is None:
            return b""
        while True:
            data = connection.take()
            if data:
                return data
            connection.raise_error()
            if connection.body_done:
                self._release()
                return b""
            await connection.wait(self._read_timeout_s)

    async def read(self) -> bytes:
        """The rest of the body."""
        parts = []
        while chunk := await self.read_chunk():
            parts.append(chunk)
        return b"".join(parts)

    def _release(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            self._pool.release(connection)

    def close(self) -> None:
        """Done with the answer: a connection whose body is complete goes back to the
        pool, any other is closed (the server then aborts the request)."""
        connection, self._connection = self._connection, None
        if connection is None:
            return
        if connection.body_done and not connection.has_data:
            self._pool.release(connection)
        else:
            connection.close()


class Http1Pool:
    """Kept-alive connections to one server; unbounded (admission bounds the load)."""

    def __init__(self, base_url: str, *, connect_timeout_s: float,
                 keepalive_s: float) -> None:
        self.origin = Origin.parse(base_url)
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self._idle: list[_Connection] = []
        self._active: set[_Connection] = set()
        self._ssl: ssl.SSLContext | None = (ssl.create_default_context()
                                            if self.origin.tls else None)
        self._closed = False
        self._sweep: asyncio.TimerHandle | None = None

    # -- the pool ---------------------------------------------------------------------
    async def _acquire(self) -> tuple[_Connection, bool]:
        # The loop's clock through a connection's loop: asking asyncio for the running
        # loop costs a system call (getpid) on every request.
        fresh_after = self._idle[-1].loop.time() - self.keepalive_s if self._idle else 0.0
        while self._idle:
            connection = self._idle.pop()  # the most recently used: least likely closed
            connection.idle = False
            if connection.closed or not connection.keep_alive:
                connection.close()
                continue
            if connection.idle_since < fresh_after:
                connection.close()  # idle too long: the server may be closing it now
                continue
            self._active.add(connection)
            return connection, True
        return await self._connect(), False

    async def _connect(self) -> _Connection:
        if self._closed:
            raise UpstreamUnavailable("the connection pool is closed")
        loop = asyncio.get_running_loop()
        origin = self.origin
        try:
            _, protocol = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self), origin.host, origin.port,
                                       ssl=self._ssl,
                                       server_hostname=origin.host if self._ssl else None),
                self.connect_timeout_s)
        except TimeoutError as exc:
            raise UpstreamConnectTimeout(
                f"no connection to {origin.host}:{origin.port} within "
                f"{self.connect_timeout_s:g} s") from exc
        except OSError as exc:
            raise UpstreamUnavailable(
                f"cannot connect to {origin.host}:{origin.port}: {exc}") from exc
        if protocol.closed:  # accepted and closed at once (a proxy whose backend is down)
            raise UpstreamUnavailable(
                f"{origin.host}:{origin.port} closed the connection as it opened")
        self._active.add(protocol)
        return protocol

    def release(self, connection: _Connection) -> None:
        self._active.discard(connection)
        if connection.closed or not connection.keep_alive or self._closed:
            connection.close()
            return
        loop = connection.loop
        connection.idle_since = loop.time()
        connection.idle = True
        self._idle.append(connection)
        if self._sweep is None:
            self._sweep = loop.call_later(self.keepalive_s, self._close_expired)

    def _close_expired(self) -> None:
        """Close the connections idle longer than `keepalive_s` (one timer for the pool,
        not one per request)."""
        self._sweep = None
        loop = asyncio.get_running_loop()
        fresh_after = loop.time() - self.keepalive_s
        for connection in [c for c in self._idle if c.idle_since <= fresh_after]:
            connection.close()
        if self._idle:
            oldest = min(c.idle_since for c in self._idle)
            self._sweep = loop.call_at(oldest + self.keepalive_s, self._close_expired)

    def forget(self, connection: _Connection) -> None:
        """A connection that closed: no longer in the pool."""
        self._active.discard(connection)
        if connection.idle:
            connection.idle = False
            self._idle.remove(connection)

    def counts(self) -> dict[str, int]:
        return {"active": len(self._active), "idle": len(self._idle)}

    async def close(self) -> None:
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for connection in [*self._idle, *self._active]:
            connection.close()
        self._idle.clear()
        self._active.clear()

    # -- one request ----------------------------------------------------------------------
    def _encode(self, method: str, path_qs: str, headers: Iterable[tuple[str, str]],
                body: bytes | None) -> bytes:
        lines = [f"{name}: {value}" for name, value in headers
                 if name.lower() not in _OWN_HEADERS]
        # One look for CR and LF over all the client's headers (only the separators may
        # have them); a header that has one is never forwarded: it would split the request.
        text = "\r\n".join(lines)
        if lines and (text.count("\r") != len(lines) - 1
                      or text.count("\n") != len(lines) - 1):
            lines = [line for line in lines if "\r" not in line and "\n" not in line]
        lines[:0] = (f"{method} {self.origin.prefix}{path_qs} HTTP/1.1",
                     f"Host: {self.origin.host_header}")
        if body or method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
            lines.append(f"Content-Length: {len(body) if body else 0}")
        # Header values as the client sent their bytes (aiohttp decodes them so).
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")
        return head + body if body else head

    async def request(self, method: str, path_qs: str,
                      headers: Iterable[tuple[str, str]], body: bytes | None,
                      read_timeout_s: float | None) -> ForwardResponse:
        """Send one request and wait for the response's head."""
        data = self._encode(method, path_qs, headers, body)
        head_only = method == "HEAD"
        for attempt in range(2):
            connection, reused = await self._acquire()
            transport = connection.transport
            if transport is None or connection.closed or transport.is_closing():
                connection.close()  # closed by the server since: never written to
                if reused:
                    continue
                raise UpstreamUnavailable("the server closed the connection as it opened")
            connection.begin(head_only)
            try:
                try:
                    transport.write(data)
                except (RuntimeError, OSError) as exc:  # uvloop: a transport closing now
                    raise UpstreamUnavailable(f"cannot send: {exc}") from exc
                while connection.head is None:
                    connection.raise_error()
                    await connection.wait(read_timeout_s)
            except UpstreamUnavailable:
                connection.close()
                # A kept-alive connection the server closed as the request went out: sent
                # again only when that cannot repeat work (the server may have read it).
                if (reused and attempt == 0 and not connection.received_any
                        and method in IDEMPOTENT_METHODS):
                    continue
                raise
            except BaseException:
                connection.close()
                raise
            return ForwardResponse(connection, self, read_timeout_s)
        raise UpstreamUnavailable("no open connection to the server")
