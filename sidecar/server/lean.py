"""A generation request read by kvgate's own HTTP/1.1 reader (server/front.py), and its
answer written straight to the socket.

The proxy handles these as it handles aiohttp's requests: `LeanRequest` has the few
attributes of `web.Request` the proxy reads, and `LeanStream` is a `web.StreamResponse`
whose head is written when it is made and whose body goes out chunk by chunk
(chunked transfer encoding, or as is under a Content-Length). The reader only takes
requests it parses without doubt (`parse_head`): anything else is aiohttp's.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from email.utils import formatdate
from typing import Protocol

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from sidecar.server.access_log import RequestRecord, stamp

# RFC 9110's token: a header name.
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# Control characters other than tab, in a header value or the request target.
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_LENGTH = re.compile(rb"[0-9]{1,18}")
# Visible ASCII from a leading slash: an origin-form request target.
_TARGET = re.compile(rb"/[!-~]*")
# A request line or header line longer than this is aiohttp's to refuse (its limit).
MAX_LINE_BYTES = 8190
# Headers the reader leaves to aiohttp: other framings, and changes of protocol.
_NOT_LEAN = frozenset({b"transfer-encoding", b"expect", b"upgrade"})
# Answers that never have a body, nor a header framing one.
_NO_BODY = frozenset({204, 304})
# Framing headers the writer sets itself.
_FRAMING = frozenset({"content-length", "transfer-encoding", "connection"})


@dataclass(frozen=True, slots=True)
class Head:
    """A request's head, as `web.Request.rel_url` and `headers` give it."""

    raw_path: str  # percent-encoded, as sent
    raw_path_qs: str  # with the query, as sent
    headers: CIMultiDictProxy[str]
    content_length: int
    close: bool  # the client asked to close the connection after the answer


def parse_head(data: bytes, routes: frozenset[bytes]) -> Head | None:
    """The head of a POST to one of `routes` (`data` up to the blank line), or None when
    it is anything else or anything unusual: HTTP/1.0, another method or path, a body
    not framed by one Content-Length, `Expect`, `Upgrade`, a line too long, obsolete
    line folding, control characters, a header name that is not a token. Those go to
    aiohttp, whose parser answers them as it always has."""
    lines = data.split(b"\r\n")
    method, _, rest = lines[0].partition(b" ")
    target, _, version = rest.partition(b" ")
    if method != b"POST" or version != b"HTTP/1.1" or len(lines[0]) > MAX_LINE_BYTES:
        return None
    path = target.partition(b"?")[0]
    if path not in routes or not _TARGET.fullmatch(target) or b"#" in target:
        return None
    headers: CIMultiDict[str] = CIMultiDict()
    length: int | None = None
    close = False
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if (not colon or len(line) > MAX_LINE_BYTES or not _TOKEN.fullmatch(name)
                or _CONTROL.search(value)):
            return None
        value = value.strip(b" \t")
        lowered = name.lower()
        if lowered == b"content-length":
            if length is not None or not _LENGTH.fullmatch(value):
                return None
            length = int(value)
        elif lowered in _NOT_LEAN:
            return None
        elif lowered == b"connection":
            options = {option.strip().lower() for option in value.split(b",")}
            if b"upgrade" in options:
                return None
            close = b"close" in options
        # As aiohttp decodes header values: bytes that are not UTF-8 kept as surrogates.
        headers.add(name.decode("ascii"), value.decode("utf-8", "surrogateescape"))
    return Head(path.decode("ascii"), target.decode("ascii"), CIMultiDictProxy(headers),
                length or 0, close)


class Wire(Protocol):
    """The client connection a lean request came on (server/front.py)."""

    transport: asyncio.Transport | None
    keep_alive: bool

    def send(self, data: bytes) -> None:
        """Write to the client; raises `aiohttp.ClientConnectionResetError` once the
        connection is closing."""

    async def drain(self) -> None:
        """Wait while the client reads slower than the answer is written."""


class _Date:
    """The Date header's value, formatted once a second."""

    def __init__(self) -> None:
        self._second = -1
        self._value = ""

    def now(self) -> str:
        second = int(time.time())
        if second != self._second:
            self._second, self._value = second, formatdate(second, usegmt=True)
        return self._value


_date = _Date()


def encode_head(status: int, reason: str | None, headers: Iterable[tuple[str, str]], *,
                length: int | None, close: bool) -> bytes:
    """A response's status line and headers, framed by `length` (None: chunked; neither
    for 204 and 304, which have no body), with a Date unless the headers have one.
    Header names and values with CR or LF are refused (ValueError), as aiohttp refuses
    them."""
    lines: list[str] = []
    dated = False
    for name, value in headers:
        lowered = name.lower()
        if lowered in _FRAMING:
            continue
        if lowered == "date":
            dated = True
        lines.append(f"{name}: {value}")
    # One look for CR and LF over all the headers: only the separators may have them.
    text = "\r\n".join(lines)
    if lines and (text.count("\r") != len(lines) - 1 or text.count("\n") != len(lines) - 1):
        bad = next(line for line in lines if "\r" in line or "\n" in line)
        raise ValueError(f"a CR or LF in the response header {bad.partition(':')[0]!r}")
    head = [f"HTTP/1.1 {status} {reason or ''}"]
    if not dated:
        head.append(f"Date: {_date.now()}")
    if status not in _NO_BODY:
        head.append("Transfer-Encoding: chunked" if length is None
                    else f"Content-Length: {length}")
    if close:
        head.append("Connection: close")
    if lines:
        head.append(text)  # the headers after the status line and framing: order is free
    head.append("\r\n")
    return "\r\n".join(head).encode("utf-8", "surrogateescape")


def encode_answer(response: web.Response, entry: RequestRecord, *, close: bool) -> bytes:
    """A whole answer (kvgate's own, or the server's when it came with its head), stamped
    with the request's id as aiohttp's `on_prepare` stamps it."""
    stamp(entry, response)
    body = response.body
    if body is None:
        body = b""  # e.g. the 499 the proxy returns for a client that went away
    elif not isinstance(body, bytes):
        raise TypeError(f"a lean answer's body must be bytes, not {type(body).__name__}")
    return encode_head(response.status, response.reason, response.headers.items(),
                       length=len(body), close=close) + body


class LeanRequest:
    """The attributes of `web.Request` the proxy reads, for a request read by the lean
    front end; its access-log record comes with it."""

    __slots__ = ("_body", "app", "headers", "method", "path", "record", "rel_url", "wire")

    def __init__(self, app: web.Application, wire: Wire, head: Head, body: bytes,
                 record: RequestRecord) -> None:
        self.app = app
        self.wire = wire
        self.method = "POST"
        self.path = head.raw_path  # a route's path: nothing in it to decode
        self.rel_url = head
        self.headers = head.headers
        self.record = record
        self._body = body

    @property
    def transport(self) -> asyncio.Transport | None:
        return self.wire.transport

    async def read(self) -> bytes:
        return self._body

    def start_stream(self, status: int, reason: str | None, headers: list[tuple[str, str]],
                     length: int | None, first: bytes = b"", *, end: bool = False
                     ) -> LeanStream:
        return LeanStream(self.wire, self.record, status, reason, headers, length, first,
                          end=end)


class LeanStream(web.StreamResponse):
    """A streamed answer on a lean connection: the head is written when it is made,
    with `first` (the body that came with it) and, with `end`, the end of the answer:
    one write where the answer is all there. Then each `write` goes out as it comes
    (one chunk each, chunked encoding when there is no length); `write_eof` ends it,
    its last data and the end in one write."""

    def __init__(self, wire: Wire, entry: RequestRecord, status: int, reason: str | None,
                 headers: list[tuple[str, str]], length: int | None, first: bytes = b"",
                 *, end: bool = False) -> None:
        super().__init__(status=status, reason=reason, headers=headers)
        self._wire = wire
        self._chunked = length is None and status not in _NO_BODY
        self._ended = end
        stamp(entry, self)
        wire.send(encode_head(status, reason, self.headers.items(), length=length,
                              close=not wire.keep_alive) + self._framed(first, end=end))

    def _framed(self, data: bytes, *, end: bool) -> bytes:
        """`data` as it goes on the wire, followed by the end of a chunked answer."""
        if not self._chunked:
            return data
        chunk = b"%x\r\n%b\r\n" % (len(data), data) if data else b""
        return chunk + b"0\r\n\r\n" if end else chunk

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._ended:
            raise RuntimeError("the answer has ended")
        if not data:
            return
        self._wire.send(self._framed(bytes(data), end=False))
        await self._wire.drain()

    async def write_eof(self, data: bytes = b"") -> None:
        if self._ended:
            return
        self._ended = True
        last = self._framed(data, end=True)
        if last:
            self._wire.send(last)

    def force_close(self) -> None:
        super().force_close()
        self._wire.keep_alive = False


def client_gone() -> aiohttp.ClientConnectionResetError:
    """What writing to a client that went away raises (as aiohttp's writer does)."""
    return aiohttp.ClientConnectionResetError("Cannot write to closing transport")
