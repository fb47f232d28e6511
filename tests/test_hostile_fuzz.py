"""Fuzzing (hypothesis) of request parsing and of the accounting behind it.

Without a server: any bytes as a body and any text as a steering header either
parse or raise `BadRequest` naming what is wrong - never another exception.

Against a real vLLM CPU server: random requests (valid ones, mutated ones, garbage),
random steering headers and random client behaviour (reads the answer, leaves at
once, leaves after the first bytes) sent to a running kvgate. No answer is a 5xx,
nothing is logged as an error, and afterwards the ledger is empty, nothing is
queued or in flight and no connection is left open."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.server.client_headers import PRIORITY, TENANT, TTFT_SLO, parse_steering
from sidecar.server.requests import (
    ROUTES,
    BadRequest,
    estimate_tokens,
    parse_body,
    parse_generation,
)
from sidecar.server.token_stream import EventAligner

from support.fault_proxy import FaultProxy, wait_until
from support.sidecar import Sidecar
from support.vllm_server import VllmServer

KEYS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "n", "best_of", "stream",
        "user", "model", "prompt", "messages", "input", "system", "temperature",
        "stream_options", "metadata", "kvgate_unknown")
ODD_TEXT = st.sampled_from(["\ud800", "x\udcff", "\u00b2", "\x00", "\u202e", "", " ", "é"])
TEXT = st.text(max_size=12) | ODD_TEXT
NUMBERS = (st.integers(-3, 24) | st.integers(2000, 10**40) | st.integers(-(10**40), -1)
           | st.floats(allow_nan=True, allow_infinity=True))
SCALARS = st.none() | st.booleans() | NUMBERS | TEXT
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(TEXT | st.sampled_from(KEYS), inner, max_size=4),
                           max_leaves=12)


def _messages(content: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


VALID: dict[str, dict[str, Any]] = {
    "/v1/completions": {"model": "tiny-llama", "prompt": "Once upon a time", "max_tokens": 4},
    "/v1/chat/completions": {"model": "tiny-llama", "messages": _messages("hi"),
                             "max_tokens": 4},
    "/v1/responses": {"model": "tiny-llama", "input": "hi", "max_output_tokens": 4},
    "/v1/messages": {"model": "tiny-llama", "messages": _messages("hi"), "max_tokens": 4},
}
MAX_KEYS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


@st.composite
def bodies(draw: st.DrawFn, route: str) -> bytes:
    kind = draw(st.sampled_from(["mutated", "mutated", "mutated", "json", "bytes", "number"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "number":
        digits = draw(st.integers(1, 6000))
        return b'{"prompt": "x", "max_tokens": 1' + b"0" * digits + b"}"
    if kind == "json":
        value = draw(JSON_VALUES)
        return json.dumps(value).encode("utf-8", "surrogatepass")
    body = dict(VALID[route])
    for key in draw(st.lists(st.sampled_from(KEYS), max_size=3)):
        if draw(st.booleans()):
            body.pop(key, None)
        else:
            body[key] = draw(JSON_VALUES)
    if draw(st.booleans()):
        body["stream"] = True
    return json.dumps(body).encode("utf-8", "surrogatepass")


HEADER_VALUES = (st.sampled_from(["high", "low", "normal", "0", "2", "tenant-a", "250",
                                  "99", "-1", "1e3", "nan", ""])
                 | st.text(max_size=10) | ODD_TEXT)


@given(route=st.sampled_from(list(ROUTES)), raw=st.data())
@settings(max_examples=600, deadline=None)
def test_parsing_any_body_raises_only_bad_request(route: str, raw: st.DataObject) -> None:
    body = raw.draw(bodies(route))
    try:
        request = parse_generation(route, parse_body(body))
    except BadRequest as exc:
        assert str(exc)
        if exc.param is not None:
            assert exc.param.split("[")[0].split(".")[0] in str(exc)
        return
    assert request.sequences >= 1 and request.prompts >= 1
    assert request.max_tokens is None or 1 <= request.max_tokens <= 1 << 30
    assert estimate_tokens(request.estimate_text, request.message_count) >= 1
    for payload in request.tokenize_payloads:
        json.dumps(payload)  # what kvgate sends to /tokenize is always JSON


@given(priority=st.none() | HEADER_VALUES, tenant=st.none() | HEADER_VALUES,
       ttft=st.none() | HEADER_VALUES, user=st.none() | TEXT, bands=st.integers(1, 10))
@settings(max_examples=600, deadline=None)
def test_steering_any_header_raises_only_bad_request(
    priority: str | None, tenant: str | None, ttft: str | None, user: str | None, bands: int
) -> None:
    headers = {name: value for name, value in
               ((PRIORITY, priority), (TENANT, tenant), (TTFT_SLO, ttft)) if value is not None}
    try:
        steering = parse_steering(headers, user, bands)
    except BadRequest as exc:
        assert exc.param in (PRIORITY, TENANT, TTFT_SLO, "user")
        return
    assert 0 <= steering.band < bands
    assert 1 <= len(steering.tenant) <= 128 and steering.tenant.isascii()
    assert steering.ttft_slo_s is None or 0 < steering.ttft_slo_s <= 3600


def _plain(data: bytes) -> bytes:
    return data.replace(b"\n", b" ").replace(b"\r", b" ")


@given(events=st.lists(st.binary(max_size=40).map(lambda b: b"data: " + _plain(b)), max_size=8),
       tail=st.binary(max_size=30).map(_plain),
       cuts=st.lists(st.integers(0, 400), max_size=6), limit=st.integers(8, 200),
       end=st.sampled_from([b"\n\n", b"\r\n\r\n"]))
def test_event_aligner_passes_whole_events_and_everything(
    events: list[bytes], tail: bytes, cuts: list[int], limit: int, end: bytes
) -> None:
    """However the upstream splits a stream, what kvgate passes on is the same bytes,
    cut only at event boundaries (unless one event is larger than the limit), and an
    error event after a failure starts on a boundary. Events end in LF LF (vLLM's) or
    in CRLF CRLF."""
    stream = b"".join(event + end for event in events) + tail
    aligner = EventAligner(limit)
    passed, start = [], 0
    for cut in [*sorted({min(c, len(stream)) for c in cuts}), len(stream)]:
        out = aligner.feed(stream[start:cut])
        start = cut
        if out:
            passed.append(out)
            assert out.endswith(end) or len(out) > limit
        assert end not in stream[len(b"".join(passed)):start]  # no whole event held back
    assert b"".join(passed) + aligner.flush() == stream
    # The upstream fails after `cut` bytes: the error event starts on a boundary.
    aligner = EventAligner(limit)
    sent = aligner.feed(stream[: cuts[0] if cuts else 0])
    combined = sent + aligner.error_event(b"data: {}\n\n")
    start = len(combined) - len(b"data: {}\n\n")
    assert start == 0 or combined[:start].endswith((b"\n\n", b"\r\n\r\n"))


# ---- against the real server ----------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzzed(small_kv_vllm: VllmServer) -> Iterator[Sidecar]:
    with FaultProxy(small_kv_vllm.url) as proxy, \
            Sidecar(proxy.url, "--metrics-interval-s", "0.5", "--queue-max-wait-s", "10",
                    "--log-level", "debug") as sidecar:
        yield sidecar


def _header(name: str, value: str) -> bytes:
    return name.encode() + b": " + value.encode("utf-8", "surrogatepass") + b"\r\n"


def _exchange(port: int, request: bytes, behaviour: str) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(request)
        if behaviour == "leave":
            return b""
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
            if behaviour == "leave-early":
                break
        return received


@pytest.mark.vllm
def test_fuzzed_requests_never_break_kvgate_or_its_accounting(fuzzed: Sidecar) -> None:
    answers: dict[int, int] = {}

    @given(route=st.sampled_from(list(ROUTES)), data=st.data(),
           headers=st.dictionaries(st.sampled_from([PRIORITY, TENANT, TTFT_SLO]),
                                   HEADER_VALUES, max_size=3),
           behaviour=st.sampled_from(["read", "read", "leave", "leave-early"]))
    @settings(max_examples=300, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def one(route: str, data: st.DataObject, headers: dict[str, str], behaviour: str) -> None:
        body = data.draw(bodies(route))
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and not any(
                isinstance(parsed.get(k), int) and 0 < parsed[k] <= 64 for k in MAX_KEYS):
            behaviour = "leave-early"  # could run to max_model_len: do not wait for it
        request = (f"POST {route} HTTP/1.1\r\nHost: kvgate\r\nConnection: close\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n").encode()
        request += b"".join(_header(name, value) for name, value in headers.items())
        answer = _exchange(fuzzed.port, request + b"\r\n" + body, behaviour)
        if not answer:
            return
        status = int(answer.split(b" ", 2)[1])
        answers[status] = answers.get(status, 0) + 1
        assert status < 500, answer[:600]
        if 400 <= status < 500 and b"\r\n\r\n{" in answer:
            error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
            assert error["message"], error

    one()
    print(f"fuzzed answers by status: {dict(sorted(answers.items()))}")
    assert answers.get(200, 0) > 0 and answers.get(400, 0) > 0
    state = fuzzed.wait_idle(60)
    ledger = state["admission"]["ledger"]
    assert ledger["reserved_blocks"] == 0 and ledger["reservations"] == 0, ledger
    wait_until(lambda: fuzzed.state()["process"]["client_connections"] <= 1, 30,
               "client connections closed")
    with open(fuzzed.log.name, encoding="utf-8", errors="replace") as handle:
        log = handle.read()
    # Malformed HTTP is one DEBUG line (without its bytes), not an error with a traceback.
    assert " ERROR " not in log and "Traceback" not in log, log[-4000:]
