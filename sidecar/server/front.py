"""The front door: generation requests read straight off the socket, the rest by aiohttp.

Every admitted request costs kvgate's one event-loop thread its HTTP handling twice
(the client's side and the server's). aiohttp's server does far more per request than
a plain POST needs: a request object, its router and middlewares, a response object
written through its payload writer. So kvgate listens itself: each connection starts
here, and a request whose head `parse_head` takes (a POST with one Content-Length body
to a generation route, nothing unusual) is read here, handed to the proxy with its
access-log line, and answered straight onto the socket (server/lean.py). The first
request it does not take hands the connection, bytes read so far included, to aiohttp
for good: its parser and routes answer it and everything after it on that connection,
exactly as with `--front-end aiohttp`.

Per connection: one request at a time (pipelined ones wait in the buffer, reading
paused when it fills), keep-alive until the client closes or asks to, and closed when
idle (or slow to send a whole request) for `idle_timeout_s`. A client that goes away
cancels its request, which releases its reservation and closes the server's side.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

from aiohttp import web

from sidecar.server import access_log
from sidecar.server.lean import (
    Head,
    LeanRequest,
    LeanStream,
    client_gone,
    encode_answer,
    parse_head,
)
from sidecar.upstream.deadline import Deadline

log = logging.getLogger("kvgate.front")

# The longest request head the reader looks for: past it, aiohttp answers (431 or 400).
MAX_HEAD_BYTES = 64 * 1024
# Pipelined bytes buffered while a request runs before reading pauses.
MAX_WAITING_BYTES = 256 * 1024

Handler = Callable[[LeanRequest], Awaitable[web.StreamResponse]]


class FrontDoor:
    """The listening socket's protocol factory, and its connections."""

    def __init__(self, app: web.Application, handler: Handler, fallback: web.Server, *,
                 access: access_log.AccessLog, routes: frozenset[str], max_body_bytes: int,
                 idle_timeout_s: float, drain_cut: str,
                 connections: set[FrontConnection] | None = None) -> None:
        self.app = app
        self.handler = handler
        self.fallback = fallback
        self.access = access
        self.routes = frozenset(route.encode("ascii") for route in routes)
        self.max_body_bytes = max_body_bytes
        self.idle_timeout_s = idle_timeout_s
        self.drain_cut = drain_cut
        # The open connections still read here (a set the caller may hold on to).
        self.connections: set[FrontConnection] = set() if connections is None else connections
        self._server: asyncio.Server | None = None

    def __call__(self) -> FrontConnection:
        return FrontConnection(self)

    async def start(self, host: str, port: int, *, backlog: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self, host, port, backlog=backlog)

    @property
    def port(self) -> int:
        """The port listened on (useful when started on port 0)."""
        # uvloop's server lists its sockets where asyncio's gives a tuple.
        sockets: Sequence[Any] = getattr(self._server, "sockets", None) or ()
        assert sockets, "the front door is not listening"
        port: int = sockets[0].getsockname()[1]
        return port

    async def stop(self, timeout_s: float) -> None:
        """Stop listening, close idle connections, give running requests `timeout_s`,
        then cancel the ones left."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for connection in list(self.connections):
            if connection.task is None:
                connection.close()
        running = [c.task for c in self.connections if c.task is not None]
        if running:
            _, left = await asyncio.wait(running, timeout=timeout_s)
            for task in left:
                task.cancel()
            if left:
                await asyncio.wait(left, timeout=1.0)
        for connection in list(self.connections):
            connection.close()


class FrontConnection(asyncio.Protocol):
    """One client connection, until it closes or goes to aiohttp."""

    def __init__(self, door: FrontDoor) -> None:
        self.door = door
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.task: asyncio.Task[None] | None = None
        self.keep_alive = True
        self._pending: tuple[Head, int] | None = None  # a head whose body is arriving
        self._writable: asyncio.Future[None] | None = None
        self._idle: Deadline | None = None  # closes it when idle too long (set when it opens)
        self._reading_paused = False
        self.answering = False  # a byte of the current request's answer was written
        self.loop: asyncio.AbstractEventLoop | None = None  # set when the connection opens

    # ---- asyncio's callbacks -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        # Asked once per connection, not per request: each ask is a system call (getpid).
        self.loop = asyncio.get_running_loop()
        self._idle = Deadline(self.loop, self.close)
        self.door.connections.add(self)
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.task is None:
            self._next()
        elif len(self.buffer) > MAX_WAITING_BYTES and not self._reading_paused:
            self._pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.door.connections.discard(self)
        self._stop_idle()
        if self.task is not None:
            self.task.cancel()  # the client went away: the proxy releases and cleans up
        self._wake()

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = self._loop().create_future()

    def resume_writing(self) -> None:
        self._wake()

    # ---- the Wire the lean request writes its answer on ----------------------------------

    def send(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise client_gone()
        self.answering = True
        transport.write(data)

    async def drain(self) -> None:
        while self._writable is not None:
            await self._writable
        if self.transport is None:
            raise client_gone()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # ---- requests --------------------------------------------------------------------------

    def _next(self) -> None:
        """Start on the next whole request in the buffer, if there is one."""
        if self.transport is None:
            return
        pending = self._pending
        if pending is None:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > MAX_HEAD_BYTES or not self._may_be_lean():
                    self._hand_off()  # aiohttp answers it now, not at the idle timeout
                return
            head = parse_head(bytes(self.buffer[:end]), self.door.routes)
            if head is None or head.content_length > self.door.max_body_bytes:
                self._hand_off()  # aiohttp answers it (400, 413, another route, ...)
                return
            pending = self._pending = (head, end + 4)
        head, start = pending
        stop = start + head.content_length
        if len(self.buffer) < stop:
            return  # the body is still arriving (within the idle timeout)
        body = bytes(self.buffer[start:stop])
        del self.buffer[:stop]
        self._pending = None
        self._disarm_idle()
        if head.close:
            self.keep_alive = False
        self.task = self._loop().create_task(self._serve(head, body))

    async def _serve(self, head: Head, body: bytes) -> None:
        door = self.door
        entry = access_log.RequestRecord(access_log.request_id(head.headers), "POST",
                                         access_log.route_of(head.raw_path))
        request = LeanRequest(door.app, self, head, body, entry)
        self.answering = False  # no byte of this request's answer written yet
        try:
            response = await access_log.logged(door.access, entry,
                                               lambda: door.handler(request), door.drain_cut)
        except asyncio.CancelledError:
            self.task = None
            self.close()  # the client went away, or kvgate is stopping
            raise
        except Exception:
            log.exception("request %s failed inside kvgate", entry.id)
            self.keep_alive = False
            if self.answering:  # a second answer would be read as the next request's
                self.task = None
                self.close()
                return
            response = web.Response(status=500, text="500 Internal Server Error")
        try:
            if isinstance(response, LeanStream):
                # Ended here when the proxy left it open (as aiohttp ends a returned
                # stream); not on a connection the proxy cut.
                if self.transport is not None and not self.transport.is_closing():
                    await response.write_eof()
            elif isinstance(response, web.Response):
                self.send(encode_answer(response, entry, close=not self.keep_alive))
            else:
                raise TypeError(f"cannot write a {type(response).__name__} here")
        except (ConnectionError, ValueError, TypeError) as exc:
            if not isinstance(exc, ConnectionError):
                log.error("request %s: its answer could not be written: %s", entry.id, exc)
            self.keep_alive = False
        self.task = None
        if not self.keep_alive or self.transport is None:
            self.close()
            return
        self._arm_idle()
        if self._reading_paused and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()
        if self.buffer:
            self._next()

    def _may_be_lean(self) -> bool:
        """Whether the bytes of an unfinished head can still begin one the lean path
        reads: a POST, every line so far ended by CRLF."""
        buffer = self.buffer
        if buffer[:5] != b"POST "[:len(buffer)]:
            return False
        newline = buffer.find(b"\n")
        while newline >= 0:
            if newline == 0 or buffer[newline - 1] != 0x0D:
                return False  # a bare LF
            newline = buffer.find(b"\n", newline + 1)
        return True

    def _hand_off(self) -> None:
        """From here on the connection is aiohttp's, with the bytes read so far (between
        requests, so reading is not paused)."""
        transport = self.transport
        assert transport is not None
        self._stop_idle()
        self.door.connections.discard(self)
        self.transport = None
        data = bytes(self.buffer)
        self.buffer.clear()
        handler = self.door.fallback()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if data:
            handler.data_received(data)

    # ---- idle and paused -------------------------------------------------------------------

    def _loop(self) -> asyncio.AbstractEventLoop:
        return self.loop if self.loop is not None else asyncio.get_running_loop()

    def _arm_idle(self) -> None:
        """Idle from now: closed after `idle_timeout_s` unless a request starts."""
        if self._idle is not None:
            self._idle.set(self._loop().time() + self.door.idle_timeout_s)

    def _disarm_idle(self) -> None:
        if self._idle is not None:
            self._idle.clear()

    def _stop_idle(self) -> None:
        if self._idle is not None:
            self._idle.stop()

    def _pause_reading(self) -> None:
        if self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def _wake(self) -> None:
        writable, self._writable = self._writable, None
        if writable is not None and not writable.done():
            writable.set_result(None)
