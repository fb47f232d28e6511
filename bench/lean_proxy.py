#!/usr/bin/env python3
"""What a Python proxy costs without a web framework: a raw asyncio protocol in front of
kvgate's own forwarding client.

    python bench/lean_proxy.py --port 20003 --upstream http://127.0.0.1:20001

No admission, no parsing of the body, no metrics: it reads each request's head and its
Content-Length body from the socket, sends it upstream on kvgate's forwarding pool
(`sidecar/upstream/http1.py`, kept-alive connections) and writes the answer back: in
one write when the whole body came with the head, else chunk by chunk as it arrives
(chunked encoding). One request at a time per connection (HTTP/1.1 keep-alive, no
pipelining), no chunked request bodies, no TLS. The canned-upstream run of
`bench/overhead.py` holds it beside the bare aiohttp proxy and kvgate: the difference
between it and the aiohttp proxy is what aiohttp's server and client cost per request,
the bound a leaner front end could bring kvgate to.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import cast

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sidecar.server.proxy import HOP_BY_HOP as PROXY_HOP_BY_HOP
from sidecar.upstream.forward_errors import ForwardError
from sidecar.upstream.http1 import Http1Pool

# The headers kvgate's proxy does not pass on, as the bytes this parser compares.
HOP_BY_HOP = frozenset(name.encode("latin-1") for name in PROXY_HOP_BY_HOP)
MAX_HEAD_BYTES = 64 * 1024
READ_TIMEOUT_S = 60.0


class LeanProxy(asyncio.Protocol):
    """One client connection: requests read from the buffer one after another."""

    def __init__(self, pool: Http1Pool) -> None:
        self.pool = pool
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Task[None] | None = None
        self.writable: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.task is None:
            self._next()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.task is not None:
            self.task.cancel()  # closes the upstream answer: the server stops the request
        self._wake()

    def pause_writing(self) -> None:
        self.writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        self._wake()

    def _wake(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        self.writable = None

    def _fail(self, status: bytes) -> None:
        if self.transport is not None:
            self.transport.write(b"HTTP/1.1 " + status + b"\r\nContent-Length: 0\r\n"
                                 b"Connection: close\r\n\r\n")
            self.transport.close()

    def _next(self) -> None:
        """Start on the next whole request in the buffer, if there is one."""
        buffer = self.buffer
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(buffer) > MAX_HEAD_BYTES:
                self._fail(b"431 Request Header Fields Too Large")
            return
        lines = bytes(buffer[:end]).split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            self._fail(b"400 Bad Request")
            return
        headers: list[tuple[str, str]] = []
        length = 0
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            lowered = name.strip().lower()
            if not colon:
                self._fail(b"400 Bad Request")
                return
            if lowered == b"transfer-encoding":
                self._fail(b"501 Not Implemented")
                return
            if lowered == b"content-length":
                if not value.strip().isdigit():
                    self._fail(b"400 Bad Request")
                    return
                length = int(value)
            elif lowered not in HOP_BY_HOP:
                headers.append((name.decode("latin-1"), value.strip().decode("latin-1")))
        if len(buffer) < end + 4 + length:
            return
        body = bytes(buffer[end + 4:end + 4 + length])
        del buffer[:end + 4 + length]
        self.task = asyncio.ensure_future(self._forward(
            parts[0].decode("ascii"), parts[1].decode("latin-1"), headers, body))

    async def _forward(self, method: str, target: str, headers: list[tuple[str, str]],
                       body: bytes) -> None:
        try:
            upstream = await self.pool.request(method, target, headers, body or None,
                                               READ_TIMEOUT_S)
        except ForwardError:
            self.task = None
            self._fail(b"502 Bad Gateway")
            return
        try:
            head = [b"HTTP/1.1 %d %s" % (upstream.status, upstream.reason.encode("latin-1"))]
            head.extend(f"{name}: {value}".encode("latin-1")
                        for name, value in upstream.headers.items()
                        if name.lower().encode("latin-1") not in HOP_BY_HOP)
            if upstream.received_whole:
                data = upstream.take_received()
                head.append(b"Content-Length: %d\r\n\r\n" % len(data))
                self._write(b"\r\n".join(head) + data)
            else:
                head.append(b"Transfer-Encoding: chunked\r\n\r\n")
                self._write(b"\r\n".join(head))
                while chunk := await upstream.read_chunk():
                    self._write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    if self.writable is not None:
                        await self.writable
                self._write(b"0\r\n\r\n")
        except ForwardError:
            if self.transport is not None:
                self.transport.close()  # a body cut short: only closing says so
        finally:
            upstream.close()
        self.task = None
        if self.buffer and self.transport is not None:
            self._next()

    def _write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)


async def serve(port: int, upstream: str) -> None:
    pool = Http1Pool(upstream, connect_timeout_s=5.0, keepalive_s=30.0)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: LeanProxy(pool), "127.0.0.1", port,
                                      backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--event-loop", choices=("uvloop", "asyncio"), default="uvloop",
                        help="as kvgate's --event-loop (default uvloop, kvgate's default)")
    args = parser.parse_args()
    if args.event_loop == "uvloop":
        import uvloop

        uvloop.run(serve(args.port, args.upstream.rstrip("/")))
    else:
        asyncio.run(serve(args.port, args.upstream.rstrip("/")))


if __name__ == "__main__":
    main()
