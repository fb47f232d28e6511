"""The forwarding client (sidecar/upstream/http1.py) against a scripted HTTP server.

The server is a plain asyncio socket server on 127.0.0.1 that reads each request and
answers with bytes written by the test, split where the test says: the framings a
server can use (Content-Length, chunked with extensions and trailers, until close),
kept-alive reuse, a kept-alive connection the server closed, and each failure the
proxy answers differently.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import pytest

from sidecar.upstream.http1 import (
    HIGH_WATER_BYTES,
    Http1Pool,
    Origin,
    UpstreamBroke,
    UpstreamConnectTimeout,
    UpstreamProtocolError,
    UpstreamTimeout,
    UpstreamUnavailable,
)

# One answer: the pieces written (with a pause between them), and whether the server
# then closes the connection.
Pieces = Sequence[bytes]


@dataclass
class Script:
    answers: list[tuple[Pieces, bool]] = field(default_factory=list)
    requests: list[bytes] = field(default_factory=list)
    connections: int = 0
    pause_s: float = 0.01


async def _read_request(reader: asyncio.StreamReader) -> bytes | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + (await reader.readexactly(length) if length else b"")


@pytest.fixture
async def server() -> AsyncIterator[tuple[Script, Http1Pool]]:
    script = Script()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        script.connections += 1
        try:
            while script.answers:
                request = await _read_request(reader)
                if request is None:
                    return
                script.requests.append(request)
                pieces, close = script.answers.pop(0)
                for index, piece in enumerate(pieces):
                    if index:
                        await asyncio.sleep(script.pause_s)
                    writer.write(piece)
                    await writer.drain()
                if close:
                    return
            await reader.read()  # keep the connection open until the client closes it
        finally:
            writer.close()

    listener = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    pool = Http1Pool(f"http://127.0.0.1:{port}/base", connect_timeout_s=2.0, keepalive_s=5.0)
    try:
        yield script, pool
    finally:
        await pool.close()
        listener.close()


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + extra
            + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


async def counts_become(pool: Http1Pool, expected: dict[str, int],
                        timeout_s: float = 5.0) -> None:
    """Wait until the pool's connections are `expected` (the server's bytes or close
    arrive when the loop gets to them: later on a busy machine)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while pool.counts() != expected:
        assert asyncio.get_running_loop().time() < deadline, pool.counts()
        await asyncio.sleep(0.01)


async def test_a_request_is_written_whole_and_the_answer_read(
        server: tuple[Script, Http1Pool]) -> None:
    script, pool = server
    script.answers.append(([ok(b'{"x": 1}', b"X-Server: a\r\n")], False))
    response = await pool.request("POST", "/v1/completions?a=1",
                                  [("Content-Type", "application/json"), ("X-Id", "r1")],
                                  b'{"prompt": "hi"}', 5.0)
    assert (response.status, response.reason) == (200, "OK")
    assert response.headers["x-server"] == "a" and response.content_type == "application/json"
    assert response.received_whole
    assert response.take_received() == b'{"x": 1}'
    response.close()
    sent = script.requests[0]
    assert sent.startswith(b"POST /base/v1/completions?a=1 HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"\r\nX-Id: r1\r\n" in sent and b"\r\nContent-Length: 16\r\n\r\n" in sent
    assert sent.endswith(b'{"prompt": "hi"}')
    assert pool.counts() == {"active": 0, "idle": 1}


async def test_connections_are_reused_and_bodies_split_anywhere(
        server: tuple[Script, Http1Pool]) -> None:
    script, pool = server
    answer = ok(b"0123456789" * 10)
    script.answers.append(([answer[:10], answer[10:40], answer[40:]], False))
    script.answers.append(([answer], False))
    for _ in range(2):
        response = await pool.request("GET", "/metrics", [], None, 5.0)
        assert await response.read() == b"0123456789" * 10
        response.close()
    assert script.connections == 1
    assert b"Content-Length" not in script.requests[0]  # a GET without a body


async def test_chunked_bodies_with_extensions_and_trailers(
        server: tuple[Script, Http1Pool]) -> None:
    script, pool = server
    head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    body = (b"6;ext=1\r\ndata: \r\n" + b"A\r\n0123456789\r\n" + b"0\r\nX-Trailer: t\r\n\r\n")
    # Split inside the size line, inside the data and inside the final CRLFs.
    script.answers.append(([head + body[:2], body[2:12], body[12:27], body[27:]], False))
    script.answers.append(([ok(b"next")], False))
    response = await pool.request("POST", "/v1/completions", [], b"{}", 5.0)
    assert response.content_type == "text/event-stream"
    pieces = []
    while chunk := await response.read_chunk():
        pieces.append(chunk)
    assert b"".join(pieces) == b"data: 0123456789"
    assert len(pieces) >= 2, "pieces are handed on as they arrive"
    response.close()
    # The connection was complete and is reused for the next request.
    second = await pool.request("GET", "/x", [], None, 5.0)
    assert await second.read() == b"next" and script.connections == 1
    second.close()


async def test_a_body_until_close_and_interim_answers(
        server: tuple[Script, Http1Pool]) -> None:
    script, pool = server
    script.answers.append(([b"HTTP/1.1 100 Continue\r\n\r\n",
                            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nall of",
                            b" it"], True))
    response = await pool.request("POST", "/v1/completions", [], b"{}", 5.0)
    assert response.status == 200
    assert await response.read() == b"all of it"
    response.close()
    assert pool.counts() == {"active": 0, "idle": 0}  # not reusable


async def test_no_body_answers(server: tuple[Script, Http1Pool]) -> None:
    script, pool = server
    script.answers.append(([b"HTTP/1.1 204 No Content\r\n\r\n"], False))
    script.answers.append(([b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n"], False))
    response = await pool.request("DELETE", "/x", [], None, 5.0)
    assert response.status == 204 and await response.read() == b""
    response.close()
    head = await pool.request("HEAD", "/x", [], None, 5.0)
    assert head.headers["Content-Length"] == "12" and await head.read() == b""
    head.close()
    assert script.connections == 1


async def test_a_kept_alive_connection_the_server_closed_is_retried_once(
        server: tuple[Script, Http1Pool]) -> None:
    script, pool = server
    script.answers.append(([ok(b"first")], True))  # answers, then closes while idle
    script.answers.append(([ok(b"second")], False))
    first = await pool.request("GET", "/x", [], None, 5.0)
    assert await first.read() == b"first"
    first.close()
    await counts_become(pool, {"active": 0, "idle": 0})  # the close seen while idle
    second = await pool.request("POST", "/x", [], b"{}", 5.0)
    assert await second.read() == b"second"
    second.close()
    assert script.connections == 2


async def test_bytes_nothing_asked_for_retire_a_connection(
        server: tuple[Script, Http1Pool]) -> None:
    script, pool = server
    script.answers.append(([ok(b"a"), b"HTTP/1.1 408 Request Timeout\r\n\r\n"], False))
    script.answers.append(([ok(b"b")], False))
    first = await pool.request("GET", "/x", [], None, 5.0)
    assert first.take_received() == b"a"
    first.close()
    # The stray answer arrives while the connection is idle, and retires it.
    await counts_become(pool, {"active": 0, "idle": 0})
    second = await pool.request("GET", "/x", [], None, 5.0)
    assert await second.read() == b"b" and script.connections == 2
    second.close()


async def test_silence_is_a_timeout_before_and_after_the_head(
        server: tuple[Script, Http1Pool]) -> None:
    script, pool = server
    script.pause_s = 1.0
    script.answers.append(([b"", ok(b"late")], False))
    with pytest.raises(UpstreamTimeout):
        await pool.request("POST", "/x", [], b"{}", 0.2)
    assert pool.counts() == {"active": 0, "idle": 0}  # the connection was closed
    answer = ok(b"0123456789")
    script.answers.append(([answer[:-5], answer[-5:]], False))
    response = await pool.request("POST", "/x", [], b"{}", 0.2)
    assert await response.read_chunk() == b"01234"
    with pytest.raises(UpstreamTimeout):
        await response.read_chunk()
    response.close()


async def test_each_wait_has_its_own_read_timeout(server: tuple[Script, Http1Pool]) -> None:
    # One timer per connection checks the read timeout: a wait that began after the one
    # it was armed for still gets its whole timeout, a shorter timeout is kept, and a
    # wait without one is never cut by a timer left from before.
    script, pool = server
    script.pause_s = 0.3
    loop = asyncio.get_running_loop()
    answer = ok(b"0123456789")
    timeouts_s = (0.5, 0.5, 0.15, None)
    # Three pieces 0.3 s apart: the wait for the last begins before the timer armed by
    # the one before it fires.
    script.answers.extend(([answer[:-5], answer[-5:-2], answer[-2:]], False)
                          for _ in timeouts_s)
    for timeout_s in timeouts_s:
        response = await pool.request("POST", "/x", [], b"{}", timeout_s)
        assert await response.read_chunk() == b"01234"
        if timeout_s is not None and timeout_s < script.pause_s:
            started = loop.time()
            with pytest.raises(UpstreamTimeout):
                await response.read_chunk()
            assert loop.time() - started >= timeout_s - 0.01
            response.close()
            continue
        assert await response.read() == b"56789"  # 0.3 s silences: within its timeout
        response.close()
        await asyncio.sleep(0.3)  # the connection's timer outlives the wait it was armed for
    assert len(script.requests) == 4


async def test_a_body_cut_short_is_broken(server: tuple[Script, Http1Pool]) -> None:
    script, pool = server
    script.answers.append(([ok(b"0123456789")[:-4]], True))
    response = await pool.request("POST", "/x", [], b"{}", 5.0)
    assert not response.received_whole
    assert await response.read_chunk() == b"012345"
    with pytest.raises(UpstreamBroke):
        await response.read_chunk()
    response.close()


async def test_garbage_and_silence_are_told_apart(server: tuple[Script, Http1Pool]) -> None:
    script, pool = server
    script.answers.append(([b"SSH-2.0-OpenSSH_9.6\r\n\r\n"], True))
    with pytest.raises(UpstreamProtocolError):
        await pool.request("GET", "/x", [], None, 5.0)
    script.answers.append(([b""], True))  # closes without answering
    with pytest.raises(UpstreamUnavailable):
        await pool.request("GET", "/x", [], None, 5.0)


async def test_refused_and_unroutable() -> None:
    listener = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    listener.close()
    await listener.wait_closed()
    pool = Http1Pool(f"http://127.0.0.1:{port}", connect_timeout_s=1.0, keepalive_s=5.0)
    with pytest.raises(UpstreamUnavailable, match="cannot connect"):
        await pool.request("GET", "/x", [], None, 5.0)
    # A TEST-NET address nothing answers (no route or a silent drop): never a hang.
    far = Http1Pool("http://192.0.2.1:9", connect_timeout_s=0.2, keepalive_s=5.0)
    with pytest.raises(UpstreamUnavailable):
        await far.request("GET", "/x", [], None, 5.0)


async def test_connect_timeout_is_its_own_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = asyncio.get_running_loop()

    async def never(*args: object, **kwargs: object) -> None:
        await asyncio.sleep(10)

    monkeypatch.setattr(loop, "create_connection", never)
    pool = Http1Pool("http://127.0.0.1:9", connect_timeout_s=0.05, keepalive_s=5.0)
    with pytest.raises(UpstreamConnectTimeout):
        await pool.request("GET", "/x", [], None, 5.0)


async def test_a_response_closed_early_closes_its_connection(
        server: tuple[Script, Http1Pool]) -> None:
    script, pool = server
    script.answers.append(([ok(b"0123456789")[:-4]], False))
    response = await pool.request("POST", "/x", [], b"{}", 5.0)
    response.close()  # the client went away: the server must see the disconnect
    assert pool.counts() == {"active": 0, "idle": 0}


async def test_a_slow_reader_pauses_the_server(server: tuple[Script, Http1Pool]) -> None:
    script, pool = server
    body = b"x" * (HIGH_WATER_BYTES * 8)
    script.answers.append(([ok(body)], False))
    response = await pool.request("GET", "/big", [], None, 5.0)
    await asyncio.sleep(0.2)  # nobody reads: at most about the high-water mark waits
    first = await response.read_chunk()
    assert len(first) <= HIGH_WATER_BYTES + 256 * 1024
    assert len(first) + len(await response.read()) == len(body)
    response.close()


async def test_idle_connections_expire(server: tuple[Script, Http1Pool]) -> None:
    script, pool = server
    pool.keepalive_s = 0.05
    script.answers.append(([ok(b"a")], False))
    response = await pool.request("GET", "/x", [], None, 5.0)
    await response.read()
    response.close()
    assert pool.counts()["idle"] == 1
    await asyncio.sleep(0.2)
    assert pool.counts()["idle"] == 0


def test_header_injection_is_never_forwarded() -> None:
    pool = Http1Pool("http://127.0.0.1:8000", connect_timeout_s=1.0, keepalive_s=1.0)
    data = pool._encode("POST", "/v1/x", [("X-A", "ok"), ("X-B", "a\r\nX-Evil: 1"),
                                          ("X-C", "a\rb"), ("X-\nD", "d"), ("X-E", "ok")], b"{}")
    assert data == (b"POST /v1/x HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nX-A: ok\r\nX-E: ok\r\n"
                    b"Content-Length: 2\r\n\r\n{}")
    assert pool._encode("GET", "/health", [], None) == (
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n\r\n")


@pytest.mark.parametrize(("url", "expected"), [
    ("http://10.0.0.1:8000", ("10.0.0.1", 8000, False, "", "10.0.0.1:8000")),
    ("https://vllm.internal/", ("vllm.internal", 443, True, "", "vllm.internal")),
    ("http://[::1]:80/prefix/", ("::1", 80, False, "/prefix", "[::1]")),
])
def test_origins(url: str, expected: tuple[object, ...]) -> None:
    origin = Origin.parse(url)
    assert (origin.host, origin.port, origin.tls, origin.prefix, origin.host_header) == expected


def test_not_a_url_is_refused() -> None:
    with pytest.raises(ValueError, match="http"):
        Origin.parse("vllm:8000")




def test_the_same_on_uvloop() -> None:
    """`--event-loop uvloop`: its transports are not asyncio's classes but work alike."""
    import uvloop

    async def exchange() -> tuple[bytes, bytes, int]:
        connections = 0

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal connections
            connections += 1
            while await _read_request(reader) is not None:
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                             b"5\r\nhello\r\n0\r\n\r\n")
            writer.close()

        listener = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        pool = Http1Pool(f"http://127.0.0.1:{port}", connect_timeout_s=2.0, keepalive_s=5.0)
        bodies = []
        for _ in range(2):
            response = await pool.request("POST", "/x", [], b"{}", 5.0)
            bodies.append(await response.read())
            response.close()
        await pool.close()
        listener.close()
        return bodies[0], bodies[1], connections

    assert uvloop.run(exchange()) == (b"hello", b"hello", 1)


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-3\r\nabcdefgh\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x3\r\nabc\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: \xc2\xb2\r\n\r\nab",
    b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
    b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
    b"HTTP/1.1 2\xc2\xb200 OK\r\nContent-Length: 0\r\n\r\n",
    # Lines not ended by CRLF: a client would read another header, or another answer.
    b"HTTP/1.1 200 OK\r\nX-A: 1\rContent-Length: 9\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nX-A: 1\nContent-Length: 9\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nX-A: 1\0\r\nContent-Length: 0\r\n\r\n",
])
async def test_framing_a_smuggler_could_use_is_refused(
        server: tuple[Script, Http1Pool], answer: bytes) -> None:
    script, pool = server
    script.answers.append(([answer], False))

    async def exchange() -> bytes:
        response = await pool.request("GET", "/x", [], None, 2.0)
        try:
            return await response.read()
        finally:
            response.close()

    with pytest.raises(UpstreamProtocolError):
        await asyncio.wait_for(exchange(), 5.0)  # never a loop that spins
    assert pool.counts() == {"active": 0, "idle": 0}


async def test_a_repeated_equal_length_is_one_length(server: tuple[Script, Http1Pool]) -> None:
    script, pool = server
    script.answers.append(([b"HTTP/1.1 200 OK\r\nContent-Length: 3, 3\r\n\r\nabc"], False))
    # Chunked wins over a length beside it: no length to frame the answer by.
    script.answers.append(([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
                            b"Content-Length: 3\r\n\r\nA\r\n0123456789\r\n0\r\n\r\n"], False))
    response = await pool.request("GET", "/x", [], None, 2.0)
    assert response.body_length == 3  # the length parsed, which the proxy frames by
    assert await response.read() == b"abc"
    response.close()
    response = await pool.request("GET", "/x", [], None, 2.0)
    assert response.body_length is None and await response.read() == b"0123456789"
    response.close()


async def test_a_post_the_server_may_have_read_is_never_sent_twice(
        server: tuple[Script, Http1Pool]) -> None:
    script, pool = server
    script.answers.append(([ok(b"first")], False))
    script.answers.append(([], True))  # reads the next request, then closes unanswered
    first = await pool.request("GET", "/x", [], None, 5.0)
    assert await first.read() == b"first"
    first.close()
    with pytest.raises(UpstreamUnavailable):
        await pool.request("POST", "/v1/completions", [], b"{}", 5.0)
    assert len(script.requests) == 2 and script.connections == 1  # sent once


async def test_a_get_in_the_same_case_is_sent_again(server: tuple[Script, Http1Pool]) -> None:
    script, pool = server
    script.answers.append(([ok(b"first")], False))
    script.answers.append(([], True))
    script.answers.append(([ok(b"again")], False))
    first = await pool.request("GET", "/x", [], None, 5.0)
    assert await first.read() == b"first"
    first.close()
    second = await pool.request("GET", "/x", [], None, 5.0)
    assert await second.read() == b"again" and script.connections == 2
    second.close()


async def test_a_server_that_closes_each_connection_at_once_is_unavailable_at_once() -> None:
    async def slam(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    listener = await asyncio.start_server(slam, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    pool = Http1Pool(f"http://127.0.0.1:{port}", connect_timeout_s=1.0, keepalive_s=5.0)
    started = asyncio.get_running_loop().time()
    for _ in range(3):
        with pytest.raises(UpstreamUnavailable):
            await pool.request("POST", "/x", [], b"{}", 30.0)
    assert asyncio.get_running_loop().time() - started < 10.0  # not the read timeout
    assert pool.counts() == {"active": 0, "idle": 0}
    listener.close()


async def test_a_body_until_close_cut_by_a_reset_is_broken() -> None:
    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n\r\npart of")
        await writer.drain()
        await asyncio.sleep(0.05)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # RST, not FIN

    listener = await asyncio.start_server(reset, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    pool = Http1Pool(f"http://127.0.0.1:{port}", connect_timeout_s=1.0, keepalive_s=5.0)
    response = await pool.request("GET", "/x", [], None, 5.0)
    assert await response.read_chunk() == b"part of"
    with pytest.raises(UpstreamBroke):
        await response.read_chunk()
    response.close()
    listener.close()


async def test_framing_headers_are_kvgates_and_reasons_are_printable(
        server: tuple[Script, Http1Pool]) -> None:
    script, pool = server
    script.answers.append(([b"HTTP/1.1 200 O\x01K\r\nX-Caf\xc3\xa9: \xc3\xa9t\xc3\xa9\r\n"
                            b"Content-Length: 0\r\n\r\n"], False))
    response = await pool.request(
        "POST", "/x", [("Content-Length", "99"), ("Transfer-Encoding", "chunked"),
                       ("Host", "evil"), ("X-A", "1")], b"{}", 5.0)
    assert response.reason == "OK" and response.headers["X-Café"] == "été"
    response.close()
    sent = script.requests[0]
    assert b"evil" not in sent and b"chunked" not in sent and b"Content-Length: 2\r\n" in sent
    assert sent.count(b"Content-Length") == 1 and b"X-A: 1\r\n" in sent
