"""A network fault injector between kvgate and a REAL vLLM server.

    with FaultProxy(vllm.url) as proxy:
        sidecar = Sidecar(proxy.url, ...)           # kvgate talks to vLLM through it
        proxy.set_faults(Fault(path="/metrics", status=500))
        proxy.set_faults(Fault(path="/v1/completions", stall_after_bytes=2000))
        proxy.refuse()                              # connection refused ...
        proxy.accept()                              # ... and back on the same port

It is an HTTP-aware (aiohttp) forwarder, not a fake server: every request it
does not fail on purpose goes to the real vLLM and its real answer streams back,
chunk by chunk, with backpressure (it reads from vLLM only as fast as kvgate reads
from it). Faults, each limited to a path prefix (and method), a number of uses and
a probability:

- `delay_s`: wait before forwarding (the server is slow to answer); if kvgate
  gives up meanwhile, nothing is forwarded (`Seen.abandoned`);
- `chunk_delay_s`: wait before passing on each line of the body that is not blank
  (the server is slow to stream: one gap per server-sent event);
- `status`: answer this status without forwarding (e.g. `/metrics` failing);
- `hang`: never answer (until kvgate closes the connection);
- `stall_after_bytes`: forward that many bytes of the response body, then stop
  (the connection to vLLM is closed, so vLLM aborts the request) and hold the
  connection to kvgate open until kvgate closes it;
- `cut_after_bytes`: forward that many bytes, then abort the connection (what
  kvgate sees when vLLM dies mid-response); 0: abort before forwarding anything.

`refuse()` closes the listening socket (connection refused), `accept()` reopens it
on the same port. Everything that reached the proxy is recorded (`seen`).

It runs in a thread with its own event loop, so synchronous and asyncio tests can
both drive it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from support import access
from support.env import free_port

T = TypeVar("T")

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length",
})
BODY_KEPT_BYTES = 64 * 1024


@dataclass
class Fault:
    path: str = ""  # prefix of the path it applies to; "" for every path
    method: str | None = None
    delay_s: float = 0.0
    status: int | None = None
    hang: bool = False
    stall_after_bytes: int | None = None
    cut_after_bytes: int | None = None
    chunk_delay_s: float = 0.0  # a slow stream: wait this long before each event
    times: int | None = None  # uses left; None: unlimited
    probability: float = 1.0
    name: str = ""

    def label(self) -> str:
        if self.name:
            return self.name
        for attr in ("status", "hang", "stall_after_bytes", "cut_after_bytes", "delay_s",
                     "chunk_delay_s"):
            value = getattr(self, attr)
            if value not in (None, False, 0.0):
                return f"{attr}={value}"
        return "none"

    def matches(self, method: str, path: str) -> bool:
        if self.method is not None and self.method != method:
            return False
        return path.startswith(self.path)


@dataclass
class Seen:
    """One request that reached the proxy."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    at: float  # time.monotonic() when it arrived
    fault: str | None = None
    forwarded: bool = False  # sent on to vLLM
    abandoned: bool = False  # kvgate went away before the proxy forwarded it
    status: int | None = None
    bytes_out: int = 0  # response body bytes handed to kvgate's connection
    done: bool = False


class FaultProxy:
    def __init__(self, target: str, *, port: int | None = None, sndbuf: int | None = None,
                 seed: int = 0, keep: int = 20_000) -> None:
        self.target = target.rstrip("/")
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.sndbuf = sndbuf
        self.seen: deque[Seen] = deque(maxlen=keep)
        self.counts: dict[str, int] = {}  # fault label -> times applied
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self._random = random.Random(seed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._site: web.BaseSite | None = None
        self._session: aiohttp.ClientSession | None = None
        self._stalled: set[asyncio.Event] = set()

    # ---- life cycle ---------------------------------------------------------------

    def start(self) -> FaultProxy:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True,
                                        name=f"fault-proxy-{self.port}")
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("the fault proxy did not start")
        self._call(self._setup())
        return self

    def _run(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _setup(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
        self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=1.0)
        await self._runner.setup()
        await self._listen()

    async def _listen(self) -> None:
        assert self._runner is not None
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.sndbuf is not None:
            # Inherited by accepted connections: bounds what the kernel holds for kvgate.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.sndbuf)
        sock.bind(("127.0.0.1", self.port))
        sock.listen(1024)
        sock.setblocking(False)
        self._site = web.SockSite(self._runner, sock)
        await self._site.start()

    async def _unlisten(self) -> None:
        if self._site is not None:
            await self._site.stop()
            self._site = None
        # Like a server that went away: established (keep-alive) connections close too.
        assert self._runner is not None and self._runner.server is not None
        for connection in self._runner.server.connections:
            connection.force_close()

    def refuse(self) -> None:
        """Close the listening socket and every connection: new ones are refused."""
        self._call(self._unlisten())

    def accept(self) -> None:
        """Listen again on the same port."""
        if self._site is None:
            self._call(self._listen())

    def stop(self) -> None:
        if self._loop is None:
            return
        with contextlib.suppress(Exception):
            self._call(self._teardown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(30)
        self._loop = None

    async def _teardown(self) -> None:
        for event in list(self._stalled):
            event.set()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- faults ------------------------------------------------------------------------

    def set_faults(self, *faults: Fault) -> None:
        with self._lock:
            self._faults = list(faults)

    def clear(self) -> None:
        self.set_faults()

    def release_stalls(self) -> None:
        """End stalled responses now (their connections are closed)."""
        assert self._loop is not None
        for event in list(self._stalled):
            self._loop.call_soon_threadsafe(event.set)

    def _pick(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if not fault.matches(method, path):
                    continue
                if fault.times is not None and fault.times <= 0:
                    continue
                if fault.probability < 1.0 and self._random.random() >= fault.probability:
                    continue
                if fault.times is not None:
                    fault.times -= 1
                label = fault.label()
                self.counts[label] = self.counts.get(label, 0) + 1
                return fault
        return None

    # ---- what was seen ----------------------------------------------------------------

    def requests(self, path: str = "", method: str | None = None,
                 since: float = 0.0) -> list[Seen]:
        """What reached the proxy on `path` (a prefix), from `since` (time.monotonic())."""
        if since > time.monotonic():
            # A wall-clock time (time.time()) would silently match nothing.
            raise ValueError(f"since={since} is later than now: pass time.monotonic()")
        with self._lock:
            items = list(self.seen)
        return [s for s in items if s.path.startswith(path) and s.at >= since
                and (method is None or s.method == method)]

    def forwarded(self, path: str, method: str = "POST", since: float = 0.0) -> list[Seen]:
        return [s for s in self.requests(path, method, since) if s.forwarded]

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError("condition not reached in time")
            time.sleep(0.05)

    # ---- the forwarder -------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        seen = Seen(request.method, request.path, dict(request.headers),
                    body[:BODY_KEPT_BYTES], time.monotonic())
        with self._lock:
            self.seen.append(seen)
        fault = self._pick(request.method, request.path)
        seen.fault = fault.label() if fault else None
        try:
            return await self._serve(request, body, fault, seen)
        except aiohttp.ClientConnectionResetError:  # kvgate closed the connection
            return web.Response(status=599)
        except asyncio.CancelledError:
            if not seen.forwarded:
                seen.abandoned = True
            raise
        finally:
            seen.done = True

    async def _serve(self, request: web.Request, body: bytes, fault: Fault | None,
                     seen: Seen) -> web.StreamResponse:
        if fault is not None and fault.delay_s:
            await asyncio.sleep(fault.delay_s)
        if fault is not None and fault.hang:
            await self._stall()
            return self._abort(request, web.Response(status=599))
        if fault is not None and fault.cut_after_bytes == 0:
            return self._abort(request, web.Response())  # reset before any answer
        if fault is not None and fault.status is not None:
            seen.status = fault.status
            return web.Response(status=fault.status, text=f"fault injected: {fault.status}\n")
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        seen.forwarded = True
        async with self._session.request(
            request.method, self.target + request.rel_url.path_qs, headers=headers,
            data=body or None, allow_redirects=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        ) as upstream:
            seen.status = upstream.status
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for name, value in upstream.headers.items():
                if name.lower() not in HOP_BY_HOP:
                    response.headers.add(name, value)
            if "Content-Length" in upstream.headers:
                response.content_length = int(upstream.headers["Content-Length"])
            await response.prepare(request)
            limit = None
            if fault is not None:
                limit = fault.stall_after_bytes if fault.stall_after_bytes is not None \
                    else fault.cut_after_bytes
            # A slow stream is slow per event (each line but the blank ones that end the
            # events): vLLM's events may reach the proxy merged into one chunk.
            chunks = (upstream.content if fault is not None and fault.chunk_delay_s
                      else upstream.content.iter_any())
            async for chunk in chunks:
                if fault is not None and fault.chunk_delay_s and chunk.strip():
                    await asyncio.sleep(fault.chunk_delay_s)
                if limit is not None and seen.bytes_out + len(chunk) >= limit:
                    head = chunk[: max(0, limit - seen.bytes_out)]
                    if head:
                        await response.write(head)
                        seen.bytes_out += len(head)
                    assert fault is not None
                    upstream.close()  # vLLM aborts the request
                    if fault.cut_after_bytes is not None:
                        await asyncio.sleep(0.05)  # let the bytes leave first
                    else:
                        await self._stall()
                    return self._abort(request, response)
                await response.write(chunk)
                seen.bytes_out += len(chunk)
            await response.write_eof()
            return response

    @staticmethod
    def _abort(request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
        """Drop the connection to kvgate (aiohttp then finds it closed and says nothing)."""
        if request.transport is not None:
            request.transport.abort()
        return response

    async def _stall(self) -> None:
        event = asyncio.Event()
        self._stalled.add(event)
        try:
            await event.wait()
        finally:
            self._stalled.discard(event)


# ---- helpers shared by the fault, hostile-input and soak tests -----------------------


def process_figures(pid: int) -> dict[str, int]:
    """Resident memory and open file descriptors of a process (Linux /proc)."""
    rss = 0
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return {"rss_bytes": rss, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def raw_exchange(port: int, data: bytes, timeout_s: float = 5.0) -> bytes:
    """Send bytes on a fresh connection; return everything received until the peer
    closes it or it stays silent for `timeout_s`."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(data)
        received = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := sock.recv(65536):
                received += chunk
        return received


def status_line(raw: bytes) -> str:
    return raw.split(b"\r\n", 1)[0].decode("latin-1")


@dataclass
class StreamResult:
    status: int
    headers: dict[str, str]
    body: Any = None  # the JSON body of a non-streamed or refused request
    events: list[dict[str, Any]] = field(default_factory=list)  # streamed data events
    done: bool = False  # saw `data: [DONE]`
    error: dict[str, Any] | None = None  # an error event in the stream
    broken: str | None = None  # the stream ended in a transport error
    elapsed_s: float = 0.0
    request_id: str = ""  # the x-request-id it was sent with

    @property
    def text(self) -> str:
        return "".join(c.get("text", "") for e in self.events for c in e.get("choices", []))


async def post_stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                      headers: dict[str, str] | None = None,
                      on_event: Callable[[int], Any] | None = None) -> StreamResult:
    """POST a generation request and read its answer, streamed or not, to the end.
    It carries an x-request-id, and what the client saw is kept for the access-log
    check (`support.access`)."""
    started = time.monotonic()
    headers = dict(headers or {})
    request_id = headers.setdefault("x-request-id", f"test-{uuid.uuid4().hex}")
    view = access.sent(request_id, url)
    try:
        async with session.post(url, json=body, headers=headers) as response:
            view.status = response.status
            # The id kvgate used (its own when the client's was not usable).
            request_id = view.request_id = response.headers.get("X-Request-Id", request_id)
            result = await _read_answer(response, on_event)
    except aiohttp.ClientConnectionError:
        view.kind = access.NO_ANSWER
        raise
    result.elapsed_s = time.monotonic() - started
    result.request_id = request_id
    view.kind, view.code = _view(result)
    return result


def _view(result: StreamResult) -> tuple[str, str | None]:
    """What the client saw, in the terms of the access-log check."""
    if result.status != 200:
        body = result.body if isinstance(result.body, dict) else {}
        error = body.get("error") if isinstance(body.get("error"), dict) else None
        code = error.get("code") if error else None
        return access.answer_kind(code), code
    if result.error is not None:
        return access.ERROR_EVENT, result.error.get("code")
    if result.broken is not None:
        return access.CUT, None
    return access.COMPLETE, None


async def _read_answer(response: aiohttp.ClientResponse,
                       on_event: Callable[[int], Any] | None) -> StreamResult:
    result = StreamResult(response.status, dict(response.headers))
    content_type = response.headers.get("Content-Type", "")
    try:
        if "text/event-stream" not in content_type:
            result.body = await response.json(content_type=None)
        else:
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    result.done = True
                    continue
                event = json.loads(payload)
                if "error" in event:
                    result.error = event["error"]
                else:
                    result.events.append(event)
                    if on_event is not None:
                        await on_event(len(result.events))
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
        result.broken = exc.__class__.__name__
    except (json.JSONDecodeError, UnicodeDecodeError):
        result.body = None  # not JSON: the server's own answer, passed through
    return result


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.05)


async def until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """wait_until for asyncio tests: the test's own tasks keep running meanwhile."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.05)


@dataclass(frozen=True)
class TcpQueue:
    local_port: int
    remote_port: int
    tx_bytes: int  # sent by this end, not yet acknowledged by the other
    rx_bytes: int  # received by the kernel, not yet read by the application


def tcp_queues() -> list[TcpQueue]:
    """Established IPv4 connections and their kernel queues (/proc/net/tcp): where
    bytes wait that no application holds in its own memory."""
    found = []
    with open("/proc/net/tcp", encoding="ascii") as table:
        next(table)
        for line in table:
            fields = line.split()
            if fields[3] != "01":  # ESTABLISHED
                continue
            tx, rx = (int(part, 16) for part in fields[4].split(":"))
            found.append(TcpQueue(int(fields[1].split(":")[1], 16),
                                  int(fields[2].split(":")[1], 16), tx, rx))
    return found
