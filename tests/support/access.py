"""What a client saw, against kvgate's access log, joined by request id.

Every request a test sends through `post_stream` carries an `x-request-id` and is
remembered here (`SENT`) with what its client saw; `check_access_log` then asserts
that kvgate's access log has exactly one line for each, and that the line's
outcome, end and status agree with the client's view.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# Client views (`ClientView.kind`).
COMPLETE = "complete"  # the whole answer (a stream to [DONE], or a whole body)
ERROR_EVENT = "error-event"  # a stream ended by an error event (`code`)
CUT = "cut"  # the answer started and broke off (transport error)
REFUSED = "refused"  # a non-200 answer in kvgate's error format (`code`)
PASSED = "passed"  # a non-200 answer of the server's own, passed through
LEFT = "left"  # the client went away (or never got to read an answer)
NO_ANSWER = "no-answer"  # the connection failed before any status

DECISIONS = {"never_fits", "queue_full", "deadline", "queue_timeout", "unavailable",
             "draining"}
INVALID = {"invalid_request", "body_too_large"}
# Error codes of kvgate's own answers (others are the server's, passed through).
KVGATE_CODES = DECISIONS | INVALID | {"upstream_timeout", "upstream_failed"}


def answer_kind(code: object) -> str:
    """REFUSED for an error code of kvgate's own, PASSED for anything else."""
    return REFUSED if isinstance(code, str) and code in KVGATE_CODES else PASSED


@dataclass
class ClientView:
    request_id: str
    url: str
    kind: str = LEFT
    status: int | None = None
    code: str | None = None

    def describe(self) -> str:
        return f"{self.kind} {self.status} {self.code or ''}".strip()


SENT: list[ClientView] = []


def sent(request_id: str, url: str) -> ClientView:
    view = ClientView(request_id, url)
    SENT.append(view)
    return view


def read_access_log(path: str | Path) -> list[dict[str, Any]]:
    """The JSON lines of an access log (other lines are ignored)."""
    lines = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.startswith("{"):
                lines.append(json.loads(line))
    return lines


def matches(view: ClientView, line: dict[str, Any]) -> bool:
    """Does kvgate's line tell what its client saw?"""
    outcome, end, status = line["outcome"], line["end"], line["status"]
    if view.kind == LEFT:
        return True  # wherever the request was when the client left
    if view.status is not None and status != view.status:
        return False
    if view.kind == COMPLETE:
        return end == "done" and outcome in ("admitted", "proxied")
    if view.kind == ERROR_EVENT:
        if view.code == "draining":
            return end == "drain"
        return end in ("upstream_cut", "timeout") and line["upstream_error"] is not None
    if view.kind == CUT:
        return end in ("upstream_cut", "timeout", "drain")
    if view.kind == PASSED:
        return end == "done" and outcome in ("admitted", "proxied")
    if view.kind == REFUSED:
        code = view.code
        if code in DECISIONS and outcome == code and end == "rejected":
            return True
        if code == "unavailable":  # let in, and the server could not be reached
            return end == "upstream_cut" and line["upstream_error"] == "connect"
        if code == "draining":  # no answer yet at the end of the drain
            return end == "drain"
        if code in INVALID:
            return outcome == "invalid" and end == "rejected"
        if code == "upstream_timeout":
            return end == "timeout" and line["upstream_error"] == "timeout"
        if code == "upstream_failed":
            return end == "upstream_cut"
        return False
    if view.kind == NO_ANSWER:
        return end in ("upstream_cut", "timeout", "drain", "error", "client_gone")
    return False


def _maybe_unsent(view: ClientView) -> bool:
    """A client that left before any answer may have left before its request was
    whole (while connecting or sending): kvgate then never had a request to log."""
    return view.kind == LEFT and view.status is None


def check_access_log(path: str | Path, views: Iterable[ClientView],
                     timeout_s: float = 5.0) -> list[dict[str, Any]]:
    """Exactly one line per request, agreeing with its client; returns the lines."""
    wanted = list(views)
    deadline = time.monotonic() + timeout_s
    while True:  # the writer flushes every 50 ms
        lines = read_access_log(path)
        by_id = Counter(line["request_id"] for line in lines)
        if all(by_id[v.request_id] >= 1 for v in wanted if not _maybe_unsent(v)) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    found: dict[str, list[dict[str, Any]]] = {}
    for line in lines:
        found.setdefault(line["request_id"], []).append(line)
    problems = []
    for view in wanted:
        mine = found.get(view.request_id, [])
        if not mine and _maybe_unsent(view):
            continue
        if len(mine) != 1:
            problems.append(f"{view.request_id} ({view.describe()}): {len(mine)} lines")
        elif not matches(view, mine[0]):
            problems.append(f"{view.request_id}: client saw {view.describe()}, access log "
                            f"says outcome={mine[0]['outcome']} end={mine[0]['end']} "
                            f"status={mine[0]['status']} "
                            f"upstream_error={mine[0]['upstream_error']}")
    assert not problems, "\n".join(problems[:20])
    return lines


@pytest.fixture(autouse=True)
def access_log_checked() -> Iterator[None]:
    """Imported by a test module: after each of its tests, every request sent with
    `post_stream` has exactly one access-log line agreeing with its client."""
    from support.sidecar import SIDECARS

    first = len(SENT)
    yield
    views = SENT[first:]
    del SENT[first:]
    by_log: dict[str, list[ClientView]] = {}
    for view in views:
        # The latest sidecar on that port (ports are reused across tests).
        sidecar = next((s for s in reversed(SIDECARS) if view.url.startswith(s.url + "/")),
                       None)
        if sidecar is not None and sidecar.access_log is not None:
            by_log.setdefault(sidecar.access_log, []).append(view)
    for path, mine in by_log.items():
        check_access_log(path, mine)
