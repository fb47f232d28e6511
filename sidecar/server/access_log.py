"""Request ids and the access log: one line per proxied request, at its end.

Every proxied request gets an id: the client's `x-request-id` when it is usable
(1-128 printable ASCII characters, no space, quote or backslash), else a new one (32
random hex digits). kvgate sends it to the server as `X-Request-Id` (vLLM names its
own request `cmpl-<id>` / `chatcmpl-<id>` after it), returns it on every response, adds
`request_id=<id>` to every process-log line written while the request runs, and
writes one access-log line when the request ends:

    {"time": "2026-11-30T12:00:00.123Z", "request_id": "...", "method": "POST",
     "route": "/v1/completions", "tenant": "default", "priority": 1,
     "outcome": "admitted", "status": 200, "end": "done", "upstream_error": null, ...}

or, with `--access-log-format kv`, the same fields as `key=value`. `end` says how the
request ended: `done` (the server's answer was relayed to its end, whatever its
status), `client_gone`, `upstream_cut` (the connection to the server failed or broke),
`timeout` (the server was silent longer than --read-timeout-s), `drain` (cut by the
drain timeout), `rejected` (answered by kvgate itself, never sent to the server) or
`error` (a failure inside kvgate). Abnormal ends (`upstream_cut`, `timeout`, `drain`,
`error`, and answers of the server with a 5xx status) are also logged at WARNING in the
process log, with the id, whether or not the access log is on.

The event loop never writes the access log: it formats the line and hands it to a
writer thread, which writes batches every 50 ms (one `write` per batch, the file
reopened when it is rotated away). With `--access-log off` no line is formatted
and no thread runs.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import math
import os
import queue
import random
import re
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Literal, TypeVar

from aiohttp import web
from aiohttp.typedefs import Middleware

from sidecar.admission import REJECTIONS, AdmissionRequest, Decision, Ticket

log = logging.getLogger("kvgate.request")

REQUEST_ID_HEADER = "X-Request-Id"
MAX_REQUEST_ID_CHARS = 128
# Printable ASCII without space, '"' and '\': safe unquoted in JSON, key=value and
# log lines, and in vLLM's own request ids.
_SAFE = re.compile(r"[!#-\[\]-~]*")
MAX_ROUTE_CHARS = 256

# How a request ended (`end`).
END_DONE = "done"
END_CLIENT_GONE = "client_gone"
END_UPSTREAM_CUT = "upstream_cut"
END_TIMEOUT = "timeout"
END_DRAIN = "drain"
END_REJECTED = "rejected"
END_ERROR = "error"
ENDS = (END_DONE, END_CLIENT_GONE, END_UPSTREAM_CUT, END_TIMEOUT, END_DRAIN, END_REJECTED,
        END_ERROR)
ABNORMAL_ENDS = frozenset({END_UPSTREAM_CUT, END_TIMEOUT, END_DRAIN, END_ERROR})

# Outcomes beyond the admission decisions (`outcome`).
OUTCOME_INVALID = "invalid"  # kvgate refused the input itself (400 invalid_request, 413)
OUTCOME_PROXIED = "proxied"  # a route without admission, proxied untouched
_DECISION_CODES = frozenset(outcome.value for outcome in REJECTIONS)
_INVALID_CODES = frozenset({"invalid_request", "body_too_large"})
STATUS_CLIENT_GONE = 499  # nothing was answered: the client left first (nginx's code)

FIELDS = ("time", "request_id", "method", "route", "tenant", "priority", "outcome", "status",
          "end", "upstream_error", "stream", "prompt_tokens", "kv_blocks", "output_tokens",
          "queue_wait_s", "ttft_s", "duration_s", "predicted_ttft_s", "predicted_tpot_s")

QUEUE_MAX_LINES = 100_000
FLUSH_INTERVAL_S = 0.05
REOPEN_CHECK_S = 1.0

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvgate_request_id",
                                                                       default=None)

# Set by errors.py on the responses kvgate writes itself.
ERROR_CODE = web.ResponseKey("kvgate_error_code", str)
DECISION = web.ResponseKey("kvgate_decision", Decision)


def request_id(headers: Mapping[str, str]) -> str:
    """The client's x-request-id when usable, else a new one: 32 random hex digits
    (as many as a uuid4; from the process's generator, seeded from the OS at start,
    not the OS's per call: an id needs to be unique, not secret)."""
    given = headers.get(REQUEST_ID_HEADER)
    if given and len(given) <= MAX_REQUEST_ID_CHARS and _SAFE.fullmatch(given):
        return given
    return f"{_random.getrandbits(128):032x}"


_random = random.Random()


class RequestRecord:
    """What is known about one proxied request; the proxy fills it in as it goes."""

    __slots__ = (
        "admission",
        "end",
        "forwarded",
        "id",
        "method",
        "route",
        "started_s",
        "status",
        "stream",
        "ticket",
        "upstream_error",
        "upstream_status",
    )

    def __init__(self, request_id: str, method: str, route: str) -> None:
        self.id = request_id
        self.method = method
        self.route = route
        self.started_s = time.monotonic()
        self.admission: AdmissionRequest | None = None
        self.ticket: Ticket | None = None
        self.forwarded = False
        self.stream: bool | None = None
        self.upstream_status: int | None = None
        self.upstream_error: str | None = None
        self.end: str | None = None
        self.status: int | None = None  # as sent to the client

    def upstream_headers(self, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """The headers for the server (with no id of their own), carrying the id."""
        headers.append((REQUEST_ID_HEADER, self.id))
        return headers

    def upstream_failed(self, response: web.Response) -> web.Response:
        """No answer from the server; `response` is kvgate's (504 timeout, else 502/503)."""
        if response.status == 504:
            self.end, self.upstream_error = END_TIMEOUT, "timeout"
        else:
            self.end, self.upstream_error = END_UPSTREAM_CUT, "connect"
        return response

    def forwarding(self, ticket: Ticket | None, *, stream: bool | None) -> None:
        """The request is about to be sent to the server."""
        self.forwarded = True
        self.ticket = ticket
        self.stream = stream

    def broke(self, kind: str) -> None:
        """The server's answer broke off mid-response (`kind`: timeout or disconnect)."""
        self.end = END_TIMEOUT if kind == "timeout" else END_UPSTREAM_CUT
        self.upstream_error = kind


def record(request: web.Request) -> RequestRecord:
    """The request's record (made here when the access middleware did not run)."""
    found = request.get(RECORD)
    if found is None:
        found = RequestRecord(request_id(request.headers), request.method, _route(request))
        request[RECORD] = found
    return found


RECORD = web.RequestKey("kvgate_access_record", RequestRecord)


def _route(request: web.Request) -> str:
    return route_of(request.rel_url.raw_path)


def route_of(raw_path: str) -> str:
    """The route field: the percent-encoded path, without the query, bounded."""
    return raw_path if len(raw_path) <= MAX_ROUTE_CHARS else raw_path[:MAX_ROUTE_CHARS] + "..."


# ---- the line ------------------------------------------------------------------------

Value = str | int | float | bool | None


def _outcome(entry: RequestRecord, response: web.StreamResponse | None,
             cancelled: bool) -> str | None:
    """The admission decision, or what stood in for one."""
    if entry.ticket is not None:
        return "admitted"
    if entry.forwarded:
        return OUTCOME_PROXIED
    if response is not None:
        decision = response.get(DECISION)
        if decision is not None:
            return str(decision.outcome)
        code = response.get(ERROR_CODE)
        if code in _DECISION_CODES:
            return str(code)
        if code in _INVALID_CODES:
            return OUTCOME_INVALID
    return "cancelled" if cancelled else None


def _values(entry: RequestRecord, response: web.StreamResponse | None, ended_s: float,
            outcome: str | None) -> list[Value]:
    """The line's values, in the order of FIELDS (after `time`)."""
    admission, ticket = entry.admission, entry.ticket
    # An admitted request's figures are its ticket's (below): no decision to look up.
    decision = (response.get(DECISION) if response is not None
                and (ticket is None or admission is None) else None)
    details = decision.details if decision is not None else {}
    kv_blocks: Value = details.get("kv_blocks")
    queue_wait: Value = details.get("waited_s")
    predicted_ttft: Value = details.get("predicted_ttft_s")
    predicted_tpot: Value = details.get("predicted_tpot_s")
    prompt_tokens: Value = admission.prompt_tokens if admission is not None else \
        details.get("prompt_tokens")
    output_tokens: Value = None
    ttft: Value = None
    if ticket is not None:
        kv_blocks = ticket.cost.kv_blocks
        queue_wait = ticket.queue_wait_s
        predicted_ttft = ticket.predicted_ttft_s
        predicted_tpot = ticket.predicted_tpot_s
        output_tokens = ticket.output_tokens
        if ticket.first_token_s is not None:
            ttft = ticket.first_token_s - entry.started_s
    return [
        entry.id, entry.method, entry.route,
        admission.tenant if admission is not None else None,
        admission.band if admission is not None else None,
        outcome, entry.status, entry.end, entry.upstream_error, entry.stream,
        prompt_tokens, kv_blocks, output_tokens, queue_wait, ttft,
        ended_s - entry.started_s, predicted_ttft, predicted_tpot,
    ]


def _json_value(value: Value) -> str:
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, float):
        return f"{value:.6f}" if math.isfinite(value) else "null"
    if isinstance(value, int):
        return str(value)
    return f'"{value}"' if _SAFE.fullmatch(value) else json.dumps(value)


def _kv_value(value: Value) -> str:
    if value is None:
        return "-"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, float):
        return f"{value:.6f}" if math.isfinite(value) else "-"
    if isinstance(value, int):
        return str(value)
    return value if value and _SAFE.fullmatch(value) and "=" not in value \
        else json.dumps(value)


class _Clock:
    """UTC timestamps with milliseconds; the seconds part is formatted once a second."""

    def __init__(self) -> None:
        self._second = -1
        self._prefix = ""

    def now(self) -> str:
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second = second
            self._prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        return f"{self._prefix}.{int((now - second) * 1000):03d}Z"


def _number(value: Value) -> str:
    kind = value.__class__  # the usual kinds first: a line has a dozen numbers
    if kind is float:
        return f"{value:.6f}" if math.isfinite(value) else "null"  # type: ignore[arg-type]
    if kind is int:
        return str(value)
    if value is None or value is True or value is False:
        return "null" if value is None else str(value).lower()
    if isinstance(value, float):
        return f"{value:.6f}" if math.isfinite(value) else "null"
    return str(value)


# Quoted strings already seen (routes, tenants, outcomes, ends repeat), bounded: tenants
# come from clients.
_QUOTED: dict[str, str] = {}
_QUOTED_MAX = 4096


def _text(value: Value) -> str:
    """A JSON string; the ids, tenants and names kvgate checked need no escaping."""
    if value is None:
        return "null"
    if isinstance(value, str):
        quoted = _QUOTED.get(value)
        if quoted is None:
            quoted = f'"{value}"' if _SAFE.fullmatch(value) else json.dumps(value)
            if len(_QUOTED) >= _QUOTED_MAX:
                _QUOTED.clear()
            _QUOTED[value] = quoted
        return quoted
    return _number(value)


def format_line(fields: list[tuple[str, Value]], timestamp: str,
                style: Literal["json", "kv"]) -> str:
    if style == "kv":
        return f"time={timestamp} " + " ".join(
            f"{name}={_kv_value(value)}" for name, value in fields) + "\n"
    return f'{{"time": "{timestamp}", ' + ", ".join(
        f'"{name}": {_json_value(value)}' for name, value in fields) + "}\n"


def _json_line(timestamp: str, v: list[Value]) -> str:
    """The usual line, in one piece (the access log's hot path)."""
    return (f'{{"time": "{timestamp}", "request_id": "{v[0]}", "method": "{v[1]}", '
            f'"route": {_text(v[2])}, "tenant": {_text(v[3])}, "priority": {_number(v[4])}, '
            f'"outcome": {_text(v[5])}, "status": {_number(v[6])}, "end": {_text(v[7])}, '
            f'"upstream_error": {_text(v[8])}, "stream": {_number(v[9])}, '
            f'"prompt_tokens": {_number(v[10])}, "kv_blocks": {_number(v[11])}, '
            f'"output_tokens": {_number(v[12])}, "queue_wait_s": {_number(v[13])}, '
            f'"ttft_s": {_number(v[14])}, "duration_s": {_number(v[15])}, '
            f'"predicted_ttft_s": {_number(v[16])}, "predicted_tpot_s": {_number(v[17])}}}\n')


# ---- the writer ------------------------------------------------------------------------


class AccessLogError(Exception):
    """The access log's file cannot be opened."""


class _Writer:
    """Writes lines handed over by the event loop, from its own thread, in batches."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._queue: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._fd = -1
        self._identity: tuple[int, int] | None = None
        self._checked_s = 0.0
        self._writer_thread: threading.Thread | None = None
        self.dropped = 0
        self.failed = 0

    def open(self) -> None:
        if self.target == "stdout":
            self._fd = sys.stdout.fileno()
            return
        try:
            self._fd = os.open(self.target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            raise AccessLogError(f"--access-log {self.target}: cannot open "
                                 f"({exc.strerror})") from exc
        stat = os.fstat(self._fd)
        self._identity = (stat.st_dev, stat.st_ino)

    def start(self) -> None:
        self.open()
        self._writer_thread = threading.Thread(target=self._run, name="kvgate-access-log",
                                        daemon=True)
        self._writer_thread.start()

    def put(self, line: str) -> None:
        if self._queue.qsize() >= QUEUE_MAX_LINES:
            self.dropped += 1  # the disk cannot keep up: never hold the event loop
            return
        self._queue.put(line)

    def close(self, timeout_s: float = 5.0) -> None:
        if self._writer_thread is None:
            return
        self._queue.put(None)
        self._writer_thread.join(timeout_s)
        self._writer_thread = None
        if self.target != "stdout" and self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self.dropped or self.failed:
            log.warning("access log: %d lines dropped (queue full), %d not written "
                        "(write errors)", self.dropped, self.failed)

    def _run(self) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is None:
                stopping = True
                lines = []
            else:
                lines = [first]
                time.sleep(FLUSH_INTERVAL_S)  # let a batch gather
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stopping = True
                    continue
                lines.append(item)
            if lines:
                self._write("".join(lines).encode("utf-8", "replace"), len(lines))

    def _write(self, data: bytes, count: int) -> None:
        self._reopen_if_rotated()
        view = memoryview(data)
        try:
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
        except OSError as exc:
            self.failed += count
            log.warning("access log: cannot write to %s (%s)", self.target, exc.strerror)

    def _reopen_if_rotated(self) -> None:
        """A rotated-away file (logrotate, mv) is reopened under its name."""
        if self._identity is None:
            return
        now = time.monotonic()
        if now - self._checked_s < REOPEN_CHECK_S:
            return
        self._checked_s = now
        try:
            stat = os.stat(self.target)
            current: tuple[int, int] | None = (stat.st_dev, stat.st_ino)
        except OSError:
            current = None
        if current == self._identity:
            return
        try:
            fd = os.open(self.target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            log.warning("access log: cannot reopen %s (%s)", self.target, exc.strerror)
            return
        os.close(self._fd)
        self._fd = fd
        stat = os.fstat(fd)
        self._identity = (stat.st_dev, stat.st_ino)


class AccessLog:
    """`--access-log off|stdout|FILE`, `--access-log-format json|kv`."""

    def __init__(self, target: str, style: Literal["json", "kv"] = "json") -> None:
        self.enabled = target != "off"
        self.style: Literal["json", "kv"] = style
        self._writer = _Writer(target) if self.enabled else None
        self._clock = _Clock()

    def start(self) -> None:
        if self._writer is not None:
            self._writer.start()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    def finish(self, entry: RequestRecord, response: web.StreamResponse | None, *,
               cancelled: bool) -> None:
        """The request ended: its line, and a WARNING when it ended abnormally."""
        ended_s = time.monotonic()
        if entry.status is None:
            entry.status = (STATUS_CLIENT_GONE if cancelled else
                            500 if response is None else response.status)
        if entry.upstream_error is None and (entry.upstream_status or 0) >= 500:
            entry.upstream_error = "status"
        if entry.end is None:
            if cancelled or (response is not None and response.status == STATUS_CLIENT_GONE):
                entry.end = END_CLIENT_GONE
            elif entry.upstream_status is not None:
                entry.end = END_DONE
            elif response is None:
                entry.end = END_ERROR
            else:
                entry.end = END_REJECTED
        outcome = _outcome(entry, response, cancelled)
        if entry.end in ABNORMAL_ENDS or entry.upstream_error == "status":
            log.warning(
                "request %s ended abnormally: end=%s upstream_error=%s status=%s outcome=%s "
                "route=%s duration_s=%.3f", entry.id, entry.end, entry.upstream_error or "-",
                entry.status, outcome or "-", entry.route, ended_s - entry.started_s,
                extra={"request_id": None})
        if self._writer is not None:
            values = _values(entry, response, ended_s, outcome)
            timestamp = self._clock.now()
            self._writer.put(_json_line(timestamp, values) if self.style == "json" else
                             format_line(list(zip(FIELDS[1:], values, strict=True)),
                                         timestamp, "kv"))


ACCESS_LOG = web.AppKey("access_log", AccessLog)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


R = TypeVar("R", bound=web.StreamResponse)


async def logged(access: AccessLog, entry: RequestRecord, handle: Callable[[], Awaitable[R]],
                 drain_cut: str) -> R:
    """Run a proxied request's handler under its id, and write its line when it ends
    (however it ends: answered, cancelled, failed)."""
    REQUEST_ID.set(entry.id)  # this request's own task: nothing to reset
    response: R | None = None
    cancelled = False
    try:
        response = await handle()
        return response
    except asyncio.CancelledError as exc:
        cancelled = True
        if exc.args and exc.args[0] == drain_cut and entry.end is None:
            entry.end = END_DRAIN
        raise
    finally:
        access.finish(entry, response, cancelled=cancelled)


def middleware(access: AccessLog, proxied: Collection[Handler], drain_cut: str) -> Middleware:
    """The id and the access-log line of every request to a `proxied` handler."""

    @web.middleware
    async def access_log(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.match_info.route.handler not in proxied:
            return await handler(request)
        entry = RequestRecord(request_id(request.headers), request.method, _route(request))
        request[RECORD] = entry
        return await logged(access, entry, lambda: handler(request), drain_cut)

    return access_log


def stamp(entry: RequestRecord, response: web.StreamResponse) -> None:
    """A proxied request's answer carries its id; its status is recorded as sent."""
    response.headers[REQUEST_ID_HEADER] = entry.id
    if entry.status is None and response.status != STATUS_CLIENT_GONE:
        entry.status = response.status


async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """Every response carries the request's id; a proxied one records its status."""
    entry = request.get(RECORD)
    if entry is None:
        response.headers[REQUEST_ID_HEADER] = request_id(request.headers)
        return
    stamp(entry, response)


# ---- the process log -------------------------------------------------------------------


class RequestIdFilter(logging.Filter):
    """Tags each record with the id of the request it was written for, if any."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = REQUEST_ID.get()
        return True


class RequestIdFormatter(logging.Formatter):
    """Appends ` request_id=<id>` to lines written for a request."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        rid = getattr(record, "request_id", None)
        return f"{text} request_id={rid}" if rid else text


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str) -> None:
    """The process log on stderr, each line about a request carrying its id."""
    handler = logging.StreamHandler()
    handler.setFormatter(RequestIdFormatter(LOG_FORMAT))
    handler.addFilter(RequestIdFilter())
    logging.basicConfig(level=level.upper(), handlers=[handler])
