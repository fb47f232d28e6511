"""Hostile input, against a real vLLM CPU server: header injection through the
steering headers, absurd priorities, tenant-id cardinality explosions (metric labels
and per-tenant memory stay bounded), request smuggling attempts, the admin routes on
a separate port or behind a token, and prompts never logged unless asked for."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from sidecar.admission.output_policy import LearnedQuantile
from sidecar.admission.policies import FAIRNESS, ORDERINGS, StrictPriority
from sidecar.admission.queue import AdmissionQueue, Entry

from support.env import free_port
from support.fault_proxy import (
    Fault,
    FaultProxy,
    post_stream,
    process_figures,
    raw_exchange,
    status_line,
    until,
)
from support.sidecar import Sidecar, released
from support.vllm_server import VllmServer

PROMPT = "The quick brown fox jumps over the lazy dog. " * 9  # ~100 tokens
TOKEN_PROMPT = list(range(100, 200))  # 100 token ids: no /tokenize needed


def completion(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True, **extra}


def series(metrics_text: str) -> set[str]:
    """The sample series of an exposition (names with labels), without values."""
    return {line.rpartition(" ")[0] for line in metrics_text.splitlines()
            if line and not line.startswith("#")}


@pytest.fixture
def gated(proxy: FaultProxy) -> Iterator[Sidecar]:
    with Sidecar(proxy.url, "--queue-max-length", "5000", "--metrics-interval-s",
                 "0.5") as running:
        yield running


# ---- steering headers ------------------------------------------------------------------

BAD_HEADERS = [
    ("x-kvgate-priority", value) for value in (
        "-1", "3", "10", "99999999999999999999999", "1e3", "0x1", "NaN", "inf", "high;low",
        "urgent", "", "'; DROP TABLE", "\u00b2", "\u0661", "\uff11", "h\u0131gh")
] + [
    ("x-kvgate-tenant", value) for value in (
        "a b", "x" * 129, "", "<script>", "t\u00e9nant", "a\tb", "tenant\u2028x",
        "a,b", '"quoted"', "%0d%0aX-Injected: 1")
] + [
    ("x-kvgate-ttft-slo-ms", value) for value in (
        "-5", "0", "inf", "nan", "1e309", "3600001", "soon", "", "1_000", "\uff11\uff10")
]


@pytest.mark.vllm
async def test_bad_steering_headers_are_400_and_never_forwarded(
    proxy: FaultProxy, gated: Sidecar
) -> None:
    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        for name, value in BAD_HEADERS:
            async with session.post(gated.url + "/v1/completions", json=completion(4),
                                    headers={name: value}) as r:
                assert r.status == 400, (name, value)
                body = await r.json()
            assert body["error"]["param"] == name, (name, value, body)
            assert name in body["error"]["message"]
        # Valid ones are used, and not passed on to vLLM.
        good = {"x-kvgate-priority": " HIGH ", "x-kvgate-tenant": "team-a/app_1@x.org",
                "x-kvgate-ttft-slo-ms": "60000"}
        result = await post_stream(session, gated.url + "/v1/completions", completion(4),
                                   headers=good)
    assert result.status == 200 and result.done
    forwarded = proxy.forwarded("/v1/completions", since=started)
    assert len(forwarded) == 1
    assert not any(h.lower().startswith("x-kvgate-") for h in forwarded[0].headers)
    assert not any(h.lower().startswith("x-kvgate-") for s in proxy.requests(since=started)
                   for h in s.headers)
    assert released(gated)


@pytest.mark.vllm
def test_header_injection_with_raw_bytes_is_refused(proxy: FaultProxy, gated: Sidecar) -> None:
    """CR, LF and NUL inside a header value, obs-folding, bytes that are not text:
    the HTTP parser refuses them with 400 before any handler runs."""
    started = time.monotonic()
    body = json.dumps(completion(4)).encode()
    for header in (b"x-kvgate-tenant: alice\rX-Injected: 1", b"x-kvgate-tenant: alice\nX-I: 1",
                   b"x-kvgate-priority: high\r\n low", b"x-kvgate-tenant: a\x00b",
                   b"x-kvgate-tenant:\r\n alice", b"x-kvgate-tenant: alice\r\r\nX: 1"):
        request = (b"POST /v1/completions HTTP/1.1\r\nHost: kvgate\r\nContent-Type: "
                   b"application/json\r\n" + header + b"\r\nContent-Length: %d\r\n\r\n"
                   % len(body) + body)
        answer = raw_exchange(gated.port, request)
        assert " 400 " in status_line(answer), (header, answer[:200])
    # Non-ASCII bytes pass the parser (as text) and fail the header's own rules.
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: kvgate\r\nConnection: close\r\n"
               b"x-kvgate-priority: \xc2\xb2\r\nx-kvgate-tenant: \xff\xfe\r\n"
               b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
               + body)
    answer = raw_exchange(gated.port, request)
    assert " 400 " in status_line(answer) and b"x-kvgate-" in answer, answer[:300]
    assert not proxy.forwarded("/v1/completions", since=started)
    assert gated.get("/readyz")[0] == 200


# ---- tenant cardinality -----------------------------------------------------------------


@pytest.mark.vllm
async def test_thousands_of_tenants_leave_metrics_and_memory_bounded(
    proxy: FaultProxy,
) -> None:
    """3,000 tenants: queued, timed out, refused, cancelled and served. The metrics
    carry no tenant label; kvgate's memory does not grow with the number of tenants."""
    gated = Sidecar(proxy.url, "--queue-max-wait-s", "3", "--metrics-interval-s", "0.5")
    gated.start()
    try:
        assert gated.proc is not None
        before_series = series(gated.metrics_text())
        before = process_figures(gated.proc.pid)
        url = gated.url + "/v1/completions"
        rng = random.Random(7)
        # A stalled stream holds ~31 of the 59 blocks: larger requests must wait.
        proxy.set_faults(Fault(path="/v1/completions", stall_after_bytes=300, times=1))
        timeout = aiohttp.ClientTimeout(total=120)
        connector = aiohttp.TCPConnector(limit=256)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            holder = asyncio.create_task(post_stream(session, url, completion(900)))
            await until(lambda: gated.state()["admission"]["inflight"] == 1, 30, "holding")

            async def tenant_request(index: int) -> int:
                body = {"model": "tiny-llama", "prompt": TOKEN_PROMPT,
                        "max_tokens": rng.choice((900, 5000))}
                headers = {"x-kvgate-tenant": f"tenant-{index:05d}-{uuid.uuid4().hex[:8]}",
                           "x-kvgate-priority": rng.choice(("high", "normal", "low"))}
                async with session.post(url, json=body, headers=headers) as response:
                    await response.read()
                    return response.status

            statuses = await asyncio.gather(*(tenant_request(i) for i in range(2700)))
            assert set(statuses) <= {400, 429}, set(statuses)
            during = process_figures(gated.proc.pid)
            # Some leave (while queued, when kvgate predicts they can get in in time).
            waiting = [asyncio.create_task(tenant_request(i)) for i in range(2700, 2720)]
            await asyncio.sleep(1.0)
            for task in waiting:
                task.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
            proxy.release_stalls()
            held = await holder
            assert held.error is not None  # the stalled stream ended with an error event
            # 280 more tenants are served (kvgate learns output lengths per tenant).
            proxy.clear()
            results = await asyncio.gather(*(post_stream(
                session, url, {"model": "tiny-llama", "prompt": "hi", "max_tokens": 1},
                headers={"x-kvgate-tenant": f"served-{index}"}) for index in range(280)))
            assert all(r.status in (200, 429) for r in results)
            assert sum(r.status == 200 for r in results) >= 100
        await until(lambda: released(gated), 30, "all released")
        after_series = series(gated.metrics_text())
        after = process_figures(gated.proc.pid)
    finally:
        assert gated.stop() == 0
    print(f"3,000 tenants: /metrics series {len(before_series)} -> {len(after_series)}; "
          f"kvgate RSS {before['rss_bytes'] >> 20} -> {during['rss_bytes'] >> 20} -> "
          f"{after['rss_bytes'] >> 20} MiB")
    # No label carries a tenant: the set of series does not change at all.
    assert after_series == before_series
    assert not any("tenant" in line for line in after_series)
    assert after["rss_bytes"] - before["rss_bytes"] < 64 << 20


def test_per_tenant_memory_of_the_queue_and_output_policy_is_capped() -> None:
    """Without a server: the queue remembers the served cost of at most 4,096 idle
    tenants per band, the learned output lengths at most 1,024 tenants."""
    queue = AdmissionQueue(ORDERINGS["fcfs"](), FAIRNESS["cost"](), StrictPriority(30.0))
    for index in range(20_000):
        queue.push(Entry(arrival_s=index, band=index % 3, tenant=f"t{index}", blocks=1,
                         cost=1.0))
        assert queue.pop(index) is not None
    assert len(queue) == 0
    for band in range(3):
        assert len(queue.served_costs(band)) <= 4096
    policy = LearnedQuantile()
    for index in range(20_000):
        policy.observe(f"t{index}", 10)
    assert len(policy._tenants) <= policy.max_tenants == 1024


# ---- request smuggling ------------------------------------------------------------------

BODY = json.dumps({"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}).encode()
SMUGGLED = b"GET /smuggled HTTP/1.1\r\nHost: kvgate\r\n\r\n"
SMUGGLING = {
    "content-length and transfer-encoding": (
        b"POST /v1/completions HTTP/1.1\r\nHost: kvgate\r\nContent-Length: %d\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n" % (5 + len(SMUGGLED)) + SMUGGLED),
    "transfer-encoding and content-length": (
        b"POST /v1/completions HTTP/1.1\r\nHost: kvgate\r\nTransfer-Encoding: chunked\r\n"
        b"Content-Length: 4\r\n\r\n%x\r\n" % len(SMUGGLED) + SMUGGLED + b"\r\n0\r\n\r\n"),
    "two content-lengths": (
        b"POST /v1/completions HTTP/1.1\r\nHost: kvgate\r\nContent-Length: 0\r\n"
        b"Content-Length: %d\r\n\r\n" % len(SMUGGLED) + SMUGGLED),
    "obfuscated transfer-encoding": (
        b"POST /v1/completions HTTP/1.1\r\nHost: kvgate\r\nTransfer-Encoding: xchunked\r\n"
        b"\r\n0\r\n\r\n" + SMUGGLED),
    "space before the colon": (
        b"POST /v1/completions HTTP/1.1\r\nHost: kvgate\r\nTransfer-Encoding : chunked\r\n"
        b"\r\n0\r\n\r\n" + SMUGGLED),
    "transfer-encoding twice": (
        b"POST /v1/completions HTTP/1.1\r\nHost: kvgate\r\nTransfer-Encoding: chunked\r\n"
        b"Transfer-Encoding: identity\r\n\r\n0\r\n\r\n" + SMUGGLED),
    "obs-fold transfer-encoding": (
        b"POST /v1/completions HTTP/1.1\r\nHost: kvgate\r\nTransfer-Encoding:\r\n chunked\r\n"
        b"\r\n0\r\n\r\n" + SMUGGLED),
    "chunked on HTTP/1.0": (
        b"POST /v1/completions HTTP/1.0\r\nHost: kvgate\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"0\r\n\r\n" + SMUGGLED),
    "bad chunk size": (
        b"POST /v1/completions HTTP/1.1\r\nHost: kvgate\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"-1\r\n\r\n" + SMUGGLED),
    "bare LF line ends": (
        b"POST /v1/completions HTTP/1.1\nHost: kvgate\nContent-Length: 0\n\n" + SMUGGLED),
    "header too long": b"GET /v1/models HTTP/1.1\r\nHost: kvgate\r\nX-Big: "
                       + b"a" * 100_000 + b"\r\n\r\n",
}


@pytest.mark.vllm
@pytest.mark.parametrize("name", list(SMUGGLING))
def test_request_smuggling_is_refused(name: str, proxy: FaultProxy, gated: Sidecar) -> None:
    started = time.monotonic()
    answer = raw_exchange(gated.port, SMUGGLING[name])
    assert status_line(answer).split()[1:2] == ["400"], (name, answer[:300])
    answers = re.findall(rb"(?:^|\r\n)HTTP/1\.[01] \d{3} ", answer)
    assert len(answers) == 1, "one answer, and the connection closed after it"
    assert not proxy.requests(since=started) or all(
        s.path in ("/metrics", "/v1/models") and s.method == "GET"
        for s in proxy.requests(since=started)), "nothing reached vLLM"
    assert not proxy.requests("/smuggled")
    # kvgate keeps serving.
    status, _ = gated.get("/readyz")
    assert status == 200


@pytest.mark.vllm
def test_request_targets_cannot_reach_another_host(proxy: FaultProxy, gated: Sidecar) -> None:
    """Absolute-form and scheme-relative targets are paths on the one upstream."""
    started = time.monotonic()
    for target in (b"http://evil.example/v1/models", b"//evil.example/v1/models"):
        answer = raw_exchange(gated.port, b"GET " + target + b" HTTP/1.1\r\nHost: "
                              b"evil.example\r\nX-Test: target\r\nConnection: close\r\n\r\n")
        assert status_line(answer).split()[1] in ("200", "404"), answer[:200]
    seen = [s for s in proxy.requests(since=started) if "X-Test" in s.headers]
    assert len(seen) == 2
    assert all("evil" not in s.headers.get("Host", "") for s in seen), seen
    # A valid pipelined pair: two answers, the body stays a body.
    pipelined = (b"POST /v1/completions HTTP/1.1\r\nHost: k\r\nContent-Type: application/json"
                 b"\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY
                 + b"GET /v1/models HTTP/1.1\r\nHost: k\r\nConnection: close\r\n\r\n")
    answer = raw_exchange(gated.port, pipelined, timeout_s=30)
    assert answer.count(b"HTTP/1.1 200") == 2, answer[:500]


# ---- admin routes ---------------------------------------------------------------------------

TOKEN = "s3cret-admin-token"


@pytest.mark.vllm
def test_admin_routes_on_their_own_port_behind_a_token(small_kv_vllm: VllmServer) -> None:
    admin_port = free_port()
    with Sidecar(small_kv_vllm.url, "--admin-port", str(admin_port), "--admin-token",
                 TOKEN) as gated:
        admin = f"http://127.0.0.1:{admin_port}"
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        # The public port serves no introspection of kvgate's.
        for path in ("/kvgate/v1/state", "/kvgate/v1/plan", "/kvgate/v1/calibration"):
            status, body = gated.get(path, headers=bearer)
            assert status in (401, 404) and '"ledger"' not in body, (path, status)
        status, body = gated.get("/metrics")
        assert "kvgate_requests_total" not in body  # (that is vLLM's own /metrics)
        assert gated.get("/healthz")[0] == 200 and gated.get("/readyz")[0] == 200
        # The admin port: token required on /kvgate/v1/*, not on probes and /metrics.
        gated.url, public = admin, gated.url
        try:
            for headers in ({}, {"Authorization": "Bearer wrong-token-123"},
                            {"Authorization": TOKEN}, {"Authorization": f"bearer {TOKEN}x"}):
                status, body = gated.get("/kvgate/v1/state", headers=headers)
                assert status == 401 and json.loads(body)["error"]["code"] == "unauthorized"
            status, body = gated.get("/kvgate/v1/state", headers=bearer)
            assert status == 200 and json.loads(body)["admission"]["ledger"]
            assert "kvgate_requests_total" in gated.get("/metrics")[1]
            assert gated.get("/readyz")[0] == 200
        finally:
            gated.url = public
        # Bytes that are not text in the Authorization header: 401, not a crash.
        answer = raw_exchange(admin_port, b"GET /kvgate/v1/state HTTP/1.1\r\nHost: k\r\n"
                              b"Authorization: Bearer \xff\xfe\r\nConnection: close\r\n\r\n")
        assert " 401 " in status_line(answer), answer[:200]


@pytest.mark.vllm
def test_admin_token_on_the_main_port(small_kv_vllm: VllmServer) -> None:
    with Sidecar(small_kv_vllm.url, "--admin-token", TOKEN) as gated:
        assert gated.get("/kvgate/v1/state")[0] == 401
        assert gated.get("/kvgate/v1/plan")[0] == 401
        status, body = gated.get("/kvgate/v1/state",
                                 headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 200 and json.loads(body)["ready"] == "ready"
        assert gated.get("/readyz")[0] == 200
        assert "kvgate_requests_total" in gated.metrics_text()


# ---- prompts in logs ------------------------------------------------------------------------


def whole_log(sidecar: Sidecar) -> str:
    with open(sidecar.log.name, encoding="utf-8", errors="replace") as handle:
        return handle.read()


async def _send_marked_prompts(sidecar: Sidecar, marker: str) -> None:
    """The marker in prompts of every route, in requests that succeed, fail validation,
    fail the server's /tokenize (whose error quotes the prompt) and never fit."""
    url = sidecar.url
    user = [{"role": "user", "content": f"say {marker}"}]
    requests: list[tuple[str, dict[str, Any]]] = [
        ("/v1/completions", {"model": "tiny-llama", "prompt": f"{marker} once", "max_tokens": 2}),
        ("/v1/chat/completions", {"model": "tiny-llama", "messages": user, "max_tokens": 2,
                                  "stream": True}),
        ("/v1/responses", {"model": "tiny-llama", "input": f"{marker}", "max_output_tokens": 2}),
        ("/v1/messages", {"model": "tiny-llama", "messages": user, "max_tokens": 2}),
        ("/v1/completions", {"model": "tiny-llama", "prompt": marker, "max_tokens": "x"}),
        ("/v1/completions", {"model": "tiny-llama", "prompt": marker, "max_tokens": 5000}),
        ("/v1/chat/completions", {"model": "tiny-llama", "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"},
                                         {"type": "other", "other": marker}]}]}),
        ("/v1/completions", {"model": "tiny-llama", "prompt": {"text": marker},
                             "max_tokens": 2}),
    ]
    async with aiohttp.ClientSession() as session:
        for path, body in requests:
            async with session.post(url + path, json=body) as response:
                await response.read()
    # Malformed HTTP whose parser error would quote the prompt's bytes.
    prompt = json.dumps({"prompt": marker}).encode()
    for malformed in (b"Transfer-Encoding: chunked\r\n\r\n5\r\n" + prompt + b"\r\n0\r\n\r\n",
                      b"x-kvgate-tenant: " + marker.encode() + b"\x00\r\n\r\n"):
        answer = await asyncio.to_thread(
            raw_exchange, sidecar.port,
            b"POST /v1/completions HTTP/1.1\r\nHost: k\r\nContent-Type: application/json\r\n"
            + malformed)
        assert " 400 " in status_line(answer)


@pytest.mark.vllm
@pytest.mark.parametrize("log_prompts", [False, True])
async def test_prompts_are_logged_only_when_asked_for(
    small_kv_vllm: VllmServer, log_prompts: bool
) -> None:
    marker = f"PROMPT-MARKER-{uuid.uuid4().hex}"
    args = ["--log-level", "debug"] + (["--log-prompts"] if log_prompts else [])
    with Sidecar(small_kv_vllm.url, *args) as gated:
        await _send_marked_prompts(gated, marker)
        await until(lambda: released(gated), 10, "released")
        gated.stop()
        log = await asyncio.to_thread(whole_log, gated)
    assert "DEBUG" in log  # the most verbose level was on
    assert "Error handling request" not in log
    assert (marker in log) is log_prompts, log[-3000:]
