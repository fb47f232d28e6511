"""kvgate's lean front end (server/front.py, server/lean.py) without the proxy: which
requests it reads itself, how it answers on the socket, and what it hands to aiohttp.

The handler here stands in for the proxy (it echoes what it was given); the proxy
behind the lean front end is what every end-to-end test of `kvgate serve` runs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import uvloop
from aiohttp import web

from sidecar.server.access_log import AccessLog
from sidecar.server.front import FrontDoor
from sidecar.server.lean import LeanRequest, encode_head, parse_head

ROUTES = frozenset({b"/v1/completions", b"/v1/chat/completions"})
BODY = b'{"prompt": "hi"}'


def post(body: bytes = BODY, *headers: bytes, target: bytes = b"/v1/completions") -> bytes:
    return (b"POST " + target + b" HTTP/1.1\r\nHost: k\r\nContent-Type: application/json\r\n"
            + b"".join(h + b"\r\n" for h in headers)
            + b"Content-Length: %d\r\n\r\n" % len(body) + body)


# ---- the head: what the reader takes, and what it leaves to aiohttp -------------------------


def test_a_plain_post_to_a_generation_route_is_read() -> None:
    head = parse_head(b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: k\r\nX-Kvgate-Tenant: "
                      b"t\xc3\xa9\xff\r\nContent-Length: 12\r\nConnection: keep-alive", ROUTES)
    assert head is not None
    assert (head.raw_path, head.raw_path_qs, head.content_length, head.close) == (
        "/v1/completions", "/v1/completions?x=1", 12, False)
    # Values decoded as aiohttp decodes them: UTF-8, other bytes kept as surrogates.
    assert head.headers["x-kvgate-tenant"] == b"t\xc3\xa9\xff".decode("utf-8", "surrogateescape")
    closing = parse_head(b"POST /v1/chat/completions HTTP/1.1\r\nConnection: Close", ROUTES)
    assert closing is not None and closing.close and closing.content_length == 0


@pytest.mark.parametrize("head", [
    b"GET /v1/completions HTTP/1.1\r\nHost: k",  # another method
    b"POST /v1/models HTTP/1.1\r\nContent-Length: 2",  # another route
    b"POST /v1/completions/ HTTP/1.1\r\nContent-Length: 2",
    b"POST /v1/%63ompletions HTTP/1.1\r\nContent-Length: 2",  # aiohttp decodes, routes
    b"POST /v1/../v1/completions HTTP/1.1\r\nContent-Length: 2",
    b"POST http://evil/v1/completions HTTP/1.1\r\nContent-Length: 2",  # absolute form
    b"POST /v1/completions HTTP/1.0\r\nContent-Length: 2",
    b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked",
    b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nTransfer-Encoding: chunked",
    b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 2",
    b"POST /v1/completions HTTP/1.1\r\nContent-Length: +2",
    b"POST /v1/completions HTTP/1.1\r\nContent-Length: 0x2",
    b"POST /v1/completions HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2",
    b"POST /v1/completions HTTP/1.1\r\nConnection: upgrade\r\nUpgrade: h2c",
    b"POST /v1/completions HTTP/1.1\r\nX-A: 1\r\n folded",  # obsolete line folding
    b"POST /v1/completions HTTP/1.1\r\nX-A : 1",  # a space before the colon
    b"POST /v1/completions HTTP/1.1\r\nX-A: a\x00b",
    b"POST /v1/completions HTTP/1.1\r\nX-A: a\rb",
    b"POST /v1/completions HTTP/1.1\r\nX-A: a\nX-B: b",
    b"POST /v1/completions HTTP/1.1\r\nX\xff: 1",
    b"POST /v1/completions HTTP/1.1\r\n\r\nX-A: 1",  # an empty line inside the head
    b"POST /v1/completions HTTP/1.1\r\nX-A: " + b"a" * 9000,  # longer than aiohttp's line
    b"POST  /v1/completions HTTP/1.1",
    b"\r\nPOST /v1/completions HTTP/1.1",
])
def test_anything_unusual_is_left_to_aiohttp(head: bytes) -> None:
    assert parse_head(head, ROUTES) is None


def test_an_answer_head_is_framed_by_the_writer() -> None:
    head = encode_head(200, "OK", [("Content-Type", "text/plain"), ("Content-Length", "99"),
                                   ("Transfer-Encoding", "chunked"), ("Connection", "x")],
                       length=5, close=True).decode()
    lines = head.split("\r\n")
    assert lines[0] == "HTTP/1.1 200 OK" and head.endswith("\r\n\r\n")
    assert "Content-Length: 5" in lines and "Connection: close" in lines
    assert "Content-Length: 99" not in lines and "Transfer-Encoding: chunked" not in lines
    assert sum(line.startswith("Date: ") for line in lines) == 1
    chunked = encode_head(200, "OK", [("date", "then")], length=None, close=False).decode()
    assert "Transfer-Encoding: chunked" in chunked and "Date: " not in chunked
    assert "date: then" in chunked and "Connection" not in chunked
    for bad in ("a\r\nX-Injected: 1", "a\nb", "a\rb"):
        with pytest.raises(ValueError, match="CR or LF in the response header 'X-B'"):
            encode_head(200, "OK", [("X-A", "fine"), ("X-B", bad), ("X-C", "fine")],
                        length=0, close=False)
    with pytest.raises(ValueError, match="CR or LF"):
        encode_head(200, "OK", [("X-\nA", "fine")], length=0, close=False)
    empty = encode_head(204, "No Content", [], length=None, close=False).decode()
    assert empty.startswith("HTTP/1.1 204 No Content\r\nDate: ")
    assert empty.endswith("GMT\r\n\r\n") and "Transfer-Encoding" not in empty


class RecordingWire:
    """A client connection that keeps each write apart."""

    def __init__(self) -> None:
        self.transport: Any = None
        self.keep_alive = True
        self.writes: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.writes.append(data)

    async def drain(self) -> None:
        return None


def test_a_stream_that_is_all_there_goes_out_in_one_write() -> None:
    from sidecar.server.access_log import RequestRecord
    from sidecar.server.lean import LeanStream

    wire = RecordingWire()
    events = b"data: one\n\ndata: [DONE]\n\n"
    LeanStream(wire, RequestRecord("r1", "POST", "/v1/completions"), 200, "OK",
               [("Content-Type", "text/event-stream")], None, events, end=True)
    (only,) = wire.writes
    head, _, body = only.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in head and b"X-Request-Id: r1" in head
    assert body == b"%x\r\n%b\r\n0\r\n\r\n" % (len(events), events)


def test_a_stream_writes_the_head_with_what_came_and_its_last_data_with_the_end() -> None:
    from sidecar.server.access_log import RequestRecord
    from sidecar.server.lean import LeanStream

    async def scenario() -> None:
        wire = RecordingWire()
        stream = LeanStream(wire, RequestRecord("r2", "POST", "/v1/completions"), 200, "OK",
                            [], None, b"data: a\n\n")
        assert wire.writes[0].endswith(b"\r\n\r\n9\r\ndata: a\n\n\r\n")
        await stream.write(b"data: b\n\n")
        await stream.write_eof(b"data: [DONE]\n\n")
        await stream.write_eof(b"ignored")  # ended: nothing more
        assert wire.writes[1:] == [b"9\r\ndata: b\n\n\r\n",
                                   b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"]
        with pytest.raises(RuntimeError, match="ended"):
            await stream.write(b"late")
        sized = RecordingWire()
        plain = LeanStream(sized, RequestRecord("r3", "POST", "/v1/completions"), 200, "OK",
                           [], 6, b"abc")
        await plain.write_eof(b"def")
        head, _, body = sized.writes[0].partition(b"\r\n\r\n")
        assert b"\r\nContent-Length: 6\r\n" in head and body == b"abc"
        assert sized.writes[1:] == [b"def"]

    asyncio.run(scenario())


# ---- a front door on a socket --------------------------------------------------------------


class Echo:
    """The stand-in for the proxy: records what it was given, answers by the body."""

    def __init__(self) -> None:
        self.cancelled = 0
        self.started = asyncio.Event()

    async def __call__(self, request: LeanRequest | web.Request) -> web.StreamResponse:
        body = await request.read()
        answer = {"lean": isinstance(request, LeanRequest), "target": request.rel_url.raw_path_qs,
                  "body": body.decode(), "tenant": request.headers.get("x-kvgate-tenant")}
        if body == b"hang":
            self.started.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        if body == b"slow":
            await asyncio.sleep(0.5)  # longer than the idle timeout of its scenario
        if body == b"empty":
            return web.Response(status=204 if request.headers.get("x-a") else 499)
        if body == b"stream-then-fail" and isinstance(request, LeanRequest):
            stream = request.start_stream(200, "OK", [("Content-Type", "text/event-stream")],
                                          None)
            await stream.write(b"data: one\n\n")
            raise RuntimeError("a fault inside kvgate after the answer began")
        if body == b"stream" and isinstance(request, LeanRequest):
            stream = request.start_stream(200, "OK", [("Content-Type", "text/event-stream")],
                                          None)
            for word in (b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n"):
                await stream.write(word)
            await stream.write_eof()
            return stream
        return web.json_response(answer)


async def models(request: web.Request) -> web.Response:
    return web.json_response({"data": []})


async def with_door(scenario: Callable[[FrontDoor, Echo], Awaitable[None]],
                    idle_timeout_s: float = 30.0) -> None:
    echo = Echo()
    app = web.Application(client_max_size=1024)

    async def route(request: web.Request) -> web.StreamResponse:
        return await echo(request)

    app.router.add_post("/v1/completions", route)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    assert runner.server is not None
    door = FrontDoor(app, echo, runner.server, access=AccessLog("off"),
                     routes=frozenset({"/v1/completions"}), max_body_bytes=1024,
                     idle_timeout_s=idle_timeout_s, drain_cut="cut")
    await door.start("127.0.0.1", 0, backlog=16)
    try:
        await asyncio.wait_for(scenario(door, echo), 20)
    finally:
        await door.stop(timeout_s=1.0)
        await runner.cleanup()


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 answer: status, headers (lower-cased names), body (de-chunked)."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    status = int(head[0].split(" ")[1])
    headers = {name.lower(): value for name, _, value in
               (line.partition(": ") for line in head[1:] if line)}
    if status in (204, 304):
        return status, headers, b""
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    assert headers.get("transfer-encoding") == "chunked", headers
    body = b""
    while True:
        size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
        chunk = await reader.readexactly(size + 2)
        if size == 0:
            return status, headers, body
        body += chunk[:-2]


async def connect(door: FrontDoor) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", door.port)


async def keep_alive_and_hand_off(door: FrontDoor, echo: Echo) -> None:
    reader, writer = await connect(door)
    for n in range(3):
        writer.write(post(b'{"n": %d}' % n, b"X-Request-Id: req-%d" % n,
                          b"X-Kvgate-Tenant: alice", target=b"/v1/completions?n=%d" % n))
        status, headers, body = await read_answer(reader)
        answer = json.loads(body)
        assert status == 200 and answer["lean"] and answer["tenant"] == "alice"
        assert answer["target"] == f"/v1/completions?n={n}" and answer["body"] == f'{{"n": {n}}}'
        assert headers["x-request-id"] == f"req-{n}" and "date" in headers
        assert len(door.connections) == 1
    # A pipelined pair: the POST read here, the GET (and the connection) aiohttp's.
    writer.write(post() + b"GET /v1/models HTTP/1.1\r\nHost: k\r\n\r\n" + post())
    first, second, third = [await read_answer(reader) for _ in range(3)]
    assert json.loads(first[2])["lean"] and json.loads(second[2]) == {"data": []}
    assert first[0] == second[0] == third[0] == 200
    assert not json.loads(third[2])["lean"]  # after the hand-off, aiohttp reads them all
    assert not door.connections
    writer.close()


async def unusual_requests_get_aiohttps_answers(door: FrontDoor, echo: Echo) -> None:
    chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: k\r\nTransfer-Encoding: chunked\r\n"
               b"\r\n5\r\nhello\r\n0\r\n\r\n")
    cases = [(chunked, 200), (post(b"x" * 2000), 413), (post(BODY, b"X-A: a\x00b"), 400),
             (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3"
              b"\r\n\r\nab", 400),
             # Heads that never end in CRLF CRLF: answered at once, not at the idle timeout.
             (b"POST /v1/completions HTTP/1.1\nHost: k\nContent-Length: 2\n\n{}", 400),
             (b"HELLO WORLD\r\nHost: k\r\n", 400)]
    for request, expected in cases:
        reader, writer = await connect(door)
        writer.write(request)
        status, _, body = await read_answer(reader)
        assert status == expected, (request[:80], body[:200])
        if expected == 200:
            assert json.loads(body) == {"lean": False, "target": "/v1/completions",
                                        "body": "hello", "tenant": None}
        writer.close()


async def answers_without_a_body(door: FrontDoor, echo: Echo) -> None:
    """An answer without a body (the proxy's 499 for a client that went away) is
    written with an empty one, not refused."""
    reader, writer = await connect(door)
    for header, status, length in ((b"X-A: 1", 204, None), (b"X-B: 1", 499, "0")):
        writer.write(post(b"empty", header))
        answer = await read_answer(reader)
        assert (answer[0], answer[1].get("content-length"), answer[2]) == (status, length, b"")
        assert "transfer-encoding" not in answer[1]
    writer.close()


async def streams_close_and_cancel(door: FrontDoor, echo: Echo) -> None:
    # A fault after the answer began: the connection closes, with no second answer.
    reader, writer = await connect(door)
    writer.write(post(b"stream-then-fail"))
    written = await asyncio.wait_for(reader.read(), 5)
    assert b"data: one\n\n" in written and written.count(b"HTTP/1.1 ") == 1
    writer.close()
    reader, writer = await connect(door)
    writer.write(post(b"stream"))
    status, headers, body = await read_answer(reader)
    assert status == 200 and headers["transfer-encoding"] == "chunked"
    assert body == b"data: one\n\ndata: two\n\ndata: [DONE]\n\n" and "x-request-id" in headers
    # Connection: close is answered, then the connection closes.
    writer.write(post(BODY, b"Connection: close"))
    status, headers, _ = await read_answer(reader)
    assert status == 200 and headers["connection"] == "close"
    assert await reader.read() == b""
    writer.close()
    # A client that goes away cancels its request.
    reader, writer = await connect(door)
    writer.write(post(b"hang"))
    await echo.started.wait()
    writer.close()
    for _ in range(100):
        if echo.cancelled:
            break
        await asyncio.sleep(0.02)
    assert echo.cancelled == 1


async def idle_connections_close(door: FrontDoor, echo: Echo) -> None:
    reader, writer = await connect(door)
    writer.write(post())
    assert (await read_answer(reader))[0] == 200
    # Idle past the timeout, and a head that never ends: both closed.
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    reader, writer = await connect(door)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: k\r\n")
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    assert not door.connections


async def idle_is_counted_from_the_last_answer(door: FrontDoor, echo: Echo) -> None:
    # A request answered just before the idle timeout, and one that starts just before
    # it and runs past it: the connection stays open for the whole timeout after each
    # answer.
    loop = asyncio.get_running_loop()
    for body, before_s in ((BODY, 0.15), (b"slow", 0.2)):
        reader, writer = await connect(door)
        await asyncio.sleep(before_s)
        writer.write(post(body))
        assert (await read_answer(reader))[0] == 200
        answered_at = loop.time()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        assert loop.time() - answered_at >= 0.3 - 0.01  # never early (a busy loop is late)
        writer.close()
    assert not door.connections


async def stop_cancels_what_still_runs(door: FrontDoor, echo: Echo) -> None:
    reader, writer = await connect(door)
    idle_reader, idle_writer = await connect(door)
    writer.write(post(b"hang"))
    await echo.started.wait()
    await door.stop(timeout_s=0.1)
    assert echo.cancelled == 1
    assert await reader.read() == b"" and await idle_reader.read() == b""
    assert not door.connections
    writer.close()
    idle_writer.close()


SCENARIOS: dict[str, tuple[Callable[[FrontDoor, Echo], Awaitable[None]], dict[str, Any]]] = {
    "keep-alive and hand-off": (keep_alive_and_hand_off, {}),
    "unusual requests": (unusual_requests_get_aiohttps_answers, {}),
    "answers without a body": (answers_without_a_body, {}),
    "streams, close and cancel": (streams_close_and_cancel, {}),
    "idle connections": (idle_connections_close, {"idle_timeout_s": 0.3}),
    "idle after the last answer": (idle_is_counted_from_the_last_answer,
                                   {"idle_timeout_s": 0.3}),
    "stop": (stop_cancels_what_still_runs, {}),
}


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_front_door(name: str, loop: str) -> None:
    scenario, options = SCENARIOS[name]
    run = uvloop.run if loop == "uvloop" else asyncio.run
    run(with_door(scenario, **options))
