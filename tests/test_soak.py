"""A bounded soak, against a real vLLM CPU server: thousands of requests with random
faults on both sides - the server cutting, stalling, delaying, failing requests and
its /tokenize and /metrics (through the fault proxy), clients leaving at every stage,
sending bad input, asking for too much, queueing - after which the ledger is zero,
the queue empty, no task or connection is left, and memory is back near its baseline.

    KVGATE_SOAK_REQUESTS=3000 KVGATE_SOAK_REPORT=/tmp/soak.json pytest tests/test_soak.py -s

The figures (requests, faults, RSS and fds before and after) are printed and, with
KVGATE_SOAK_REPORT, written as JSON; the README's "Failure behaviour" quotes a run."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from support.access import (
    COMPLETE,
    CUT,
    ERROR_EVENT,
    LEFT,
    NO_ANSWER,
    PASSED,
    ClientView,
    answer_kind,
    check_access_log,
)
from support.fault_proxy import Fault, FaultProxy, process_figures, until
from support.sidecar import Sidecar, metric_value
from support.vllm_server import VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REQUESTS = int(os.environ.get("KVGATE_SOAK_REQUESTS", "3000"))
WARMUP = 200
CONCURRENCY = 48
SEED = int(os.environ.get("KVGATE_SOAK_SEED", "20261129"))
PROMPTS = ["hi", "Tell me a story about a fox.", "The quick brown fox jumps over the lazy dog. "
           * 9, "List ten colours, " * 20]
BAD = [
    b"{not json", b"[]", b'{"prompt": "x", "max_tokens": -1}', b'{"prompt": 5}',
    b'{"messages": []}', b'{"prompt": "x", "n": 0}', b'{"prompt": "x", "stream": "yes"}',
    b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}",
]


def upstream_faults() -> list[Fault]:
    """What the proxy does to a share of the requests between kvgate and vLLM."""
    generation = [
        Fault(cut_after_bytes=1500, probability=0.03, name="cut mid-stream"),
        Fault(cut_after_bytes=0, probability=0.02, name="cut before the answer"),
        Fault(stall_after_bytes=800, probability=0.015, name="stall mid-stream"),
        Fault(delay_s=0.5, probability=0.04, name="slow first byte"),
        Fault(status=500, probability=0.02, name="server error"),
    ]
    faults = []
    for path in ("/v1/completions", "/v1/chat/completions"):
        for fault in generation:
            faults.append(Fault(**{**fault.__dict__, "path": path, "method": "POST"}))
    return [*faults,
            Fault(path="/tokenize", status=500, probability=0.05, name="tokenize fails"),
            Fault(path="/tokenize", delay_s=3.0, probability=0.005, name="tokenize slow"),
            Fault(path="/metrics", status=503, probability=0.1, name="metrics fail"),
            Fault(path="/metrics", hang=True, probability=0.01, name="metrics hang")]


class Client:
    """One random client behaviour per request."""

    def __init__(self, url: str, session: aiohttp.ClientSession, rng: random.Random,
                 views: list[ClientView]) -> None:
        self.url = url
        self.session = session
        self.rng = rng
        self.outcomes: Counter[str] = Counter()
        self.views = views  # what each client saw, for the access-log check

    def _body(self, max_tokens: int, *, chat: bool, stream: bool) -> dict[str, Any]:
        prompt = self.rng.choice(PROMPTS)
        body: dict[str, Any] = {"model": "tiny-llama", "max_tokens": max_tokens,
                                "stream": stream, "ignore_eos": True}
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if self.rng.random() < 0.1:
            body.update(n=self.rng.choice((2, 3)), temperature=0.8)
        return body

    def _headers(self) -> dict[str, str]:
        headers = {"x-kvgate-tenant": f"tenant-{self.rng.randrange(500)}",
                   "x-kvgate-priority": self.rng.choice(("high", "normal", "low", "0", "2"))}
        if self.rng.random() < 0.1:
            headers["x-kvgate-ttft-slo-ms"] = str(self.rng.choice((50, 500, 5000)))
        return headers

    async def one(self) -> None:
        kind = self.rng.choices(
            ["stream", "whole", "leave-mid-stream", "leave-early", "bad", "never-fits",
             "large"], weights=[43, 15, 10, 10, 12, 5, 5])[0]
        view = ClientView(f"soak-{len(self.views)}", self.url)  # (the rng stays the workload's)
        self.views.append(view)
        try:
            self.outcomes[f"{kind}:{await asyncio.wait_for(self._run(kind, view), 90)}"] += 1
        except TimeoutError:
            view.kind = LEFT
            self.outcomes[f"{kind}:client-timeout"] += 1

    async def _run(self, kind: str, view: ClientView) -> str:
        chat = self.rng.random() < 0.4
        path = "/v1/chat/completions" if chat else "/v1/completions"
        headers = {**self._headers(), "x-request-id": view.request_id}
        if kind == "bad":
            async with self.session.post(self.url + "/v1/completions",
                                         data=self.rng.choice(BAD), headers={
                                             "Content-Type": "application/json",
                                             "x-request-id": view.request_id}) as r:
                await refused(r, view)
                return str(r.status)
        max_tokens = {"never-fits": 5000, "large": self.rng.randrange(200, 500)}.get(
            kind, self.rng.randrange(1, 24))
        stream = kind != "whole"
        body = self._body(max_tokens, chat=chat, stream=stream)
        if kind == "leave-early":  # while counted, queued or waiting for the first byte
            request = asyncio.ensure_future(self._read(path, body, headers, 10**6, view))
            await asyncio.sleep(self.rng.uniform(0, 0.3))
            request.cancel()
            try:
                return await request
            except asyncio.CancelledError:
                view.kind = LEFT
                return "left"
        events = self.rng.randrange(1, 4) if kind == "leave-mid-stream" else 10**6
        if kind == "large" and self.rng.random() < 0.5:
            events = self.rng.randrange(1, 20)
        return await self._read(path, body, headers, events, view)

    async def _read(self, path: str, body: dict[str, Any], headers: dict[str, str],
                    events: int, view: ClientView) -> str:
        try:
            async with self.session.post(self.url + path, json=body, headers=headers) as r:
                view.status = r.status
                if r.status != 200:
                    await refused(r, view)
                    return str(r.status)
                if "text/event-stream" not in r.content_type:
                    await r.read()
                    view.kind = COMPLETE
                    return str(r.status)
                seen = 0
                async for line in r.content:
                    if line.startswith(b"data: {\"error\""):
                        view.kind = ERROR_EVENT
                        view.code = json.loads(line[6:])["error"]["code"]
                        return "200+error-event"
                    if line.startswith(b"data: {"):
                        seen += 1
                        if seen >= events:
                            r.close()
                            view.kind = LEFT
                            return "left-mid-stream"
                view.kind = COMPLETE
                return "200"
        except aiohttp.ClientPayloadError:
            view.kind = CUT
            return "200+cut"
        except aiohttp.ClientConnectionError as exc:
            view.kind = CUT if view.status is not None else NO_ANSWER
            return exc.__class__.__name__


async def refused(response: aiohttp.ClientResponse, view: ClientView) -> None:
    """A non-200 answer: kvgate's error (with its code) or the server's own."""
    view.status = response.status
    data = await response.read()
    try:
        code = json.loads(data)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        view.kind = PASSED
        return
    view.kind, view.code = answer_kind(code), code


async def drive(url: str, count: int, rng: random.Random,
                views: list[ClientView]) -> Counter[str]:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    connector = aiohttp.TCPConnector(limit=CONCURRENCY)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        client = Client(url, session, rng, views)
        queue: asyncio.Queue[int] = asyncio.Queue()
        for index in range(count):
            queue.put_nowait(index)

        async def worker() -> None:
            while not queue.empty():
                queue.get_nowait()
                await client.one()

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return client.outcomes


def snapshot(sidecar: Sidecar) -> dict[str, Any]:
    assert sidecar.proc is not None
    process = sidecar.state()["process"]
    return {**process_figures(sidecar.proc.pid), "tasks": process["asyncio_tasks"],
            "task_kinds": process["asyncio_tasks_by_coroutine"],
            "upstream": process["upstream_connections"],
            "clients": process["client_connections"]}


async def settle(sidecar: Sidecar, server: VllmServer) -> dict[str, Any]:
    """Wait until nothing is admitted, queued or running anywhere; return the state."""
    await until(lambda: sidecar.state()["admission"]["inflight"] == 0
                and sidecar.state()["admission"]["queue"]["length"] == 0, 60, "kvgate idle")
    await until(lambda: metric_value(server.metrics_text(), "vllm:num_requests_running") == 0,
                60, "vLLM idle")
    await until(lambda: sidecar.state()["process"]["active_requests"] == 0, 30,
                "no request handler left")
    # The background checks of prompts against the server's /tokenize end too (a
    # "tokenize slow" fault holds one for seconds); a scrape is short, so a moment with
    # no request to the server comes soon.
    await until(lambda: sidecar.state()["process"]["upstream_connections"]["active"] == 0,
                30, "no request to the server left")
    await asyncio.sleep(2)  # let closed connections and finished tasks go
    gc.collect()
    return sidecar.state()


async def test_soak_with_random_faults_leaves_nothing_behind(
    small_kv_vllm: VllmServer,
) -> None:
    rng = random.Random(SEED)
    with FaultProxy(small_kv_vllm.url, seed=SEED) as proxy:
        # Prompts are counted locally; every one is also checked against the server's
        # (faulty) /tokenize in the background, so its faults still meet kvgate.
        sidecar = Sidecar(proxy.url, "--read-timeout-s", "1.5", "--queue-max-wait-s", "3",
                          "--metrics-interval-s", "0.5", "--metrics-stale-s", "3",
                          "--tokenizer-check-every", "1").start()
        try:
            views: list[ClientView] = []
            await drive(sidecar.url, WARMUP, rng, views)
            proxy.set_faults(*upstream_faults())
            await settle(sidecar, small_kv_vllm)
            before = snapshot(sidecar)
            started = time.monotonic()
            outcomes = await drive(sidecar.url, REQUESTS, rng, views)
            elapsed = time.monotonic() - started
            proxy.clear()
            proxy.release_stalls()
            state = await settle(sidecar, small_kv_vllm)
            after = snapshot(sidecar)
            metrics = sidecar.metrics_text()
        finally:
            exit_code = sidecar.stop()
    log = await asyncio.to_thread(Path(sidecar.log.name).read_text, "utf-8", "replace")
    admission = state["admission"]
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "requests": REQUESTS,
        "warmup_requests": WARMUP,
        "concurrency": CONCURRENCY,
        "seed": SEED,
        "seconds": round(elapsed, 1),
        "client_outcomes": dict(sorted(outcomes.items())),
        "upstream_faults_injected": dict(sorted(proxy.counts.items())),
        "kvgate_outcomes": {
            outcome: metric_value(metrics, "kvgate_requests_total", f'outcome="{outcome}"')
            for outcome in ("admitted", "never_fits", "queue_full", "deadline",
                            "queue_timeout", "unavailable", "cancelled")},
        "upstream_errors": {
            kind: metric_value(metrics, "kvgate_upstream_errors_total", f'kind="{kind}"')
            for kind in ("connect", "protocol", "timeout", "disconnect", "status")},
        "tokenize_fallbacks": metric_value(metrics, "kvgate_tokenize_fallback_total"),
        "before": before,
        "after": after,
        "ledger_after": admission["ledger"],
        "queue_after": admission["queue"]["length"],
        "inflight_after": admission["inflight"],
    }
    print(json.dumps(report, indent=2))
    if os.environ.get("KVGATE_SOAK_REPORT"):
        await asyncio.to_thread(Path(os.environ["KVGATE_SOAK_REPORT"]).write_text,
                                json.dumps(report, indent=2))

    assert sum(outcomes.values()) == REQUESTS
    assert not any(key.endswith(":client-timeout") for key in outcomes), outcomes
    # One fault per 30 requests at least (the /tokenize faults now meet background
    # checks, some of which are skipped while 64 are in flight).
    assert sum(proxy.counts.values()) >= REQUESTS // 30, "faults were injected"
    # Nothing held, queued or running.
    assert admission["ledger"]["reserved_blocks"] == 0, admission["ledger"]
    assert admission["ledger"]["reservations"] == 0
    assert admission["queue"]["length"] == 0 and admission["inflight"] == 0
    assert metric_value(metrics, "kvgate_inflight_requests") == 0
    # No task, connection or descriptor left.
    # (one task may come and go: the watcher's wait between two scrapes)
    assert after["tasks"] <= before["tasks"] + 1, (before, after)
    assert after["clients"] <= 1 and after["upstream"]["active"] <= 1  # (a /metrics scrape)
    idle_change = after["upstream"]["idle"] - before["upstream"]["idle"]
    assert after["fds"] <= before["fds"] + max(0, idle_change) + 5, (before, after)
    # Memory back near its baseline.
    assert after["rss_bytes"] - before["rss_bytes"] < 32 << 20, (before, after)
    # No crash on the way, and a clean exit.
    assert " ERROR " not in log and "Traceback" not in log, log[-3000:]
    assert exit_code == 0
    # Every request has exactly one access-log line, telling what its client saw.
    assert sidecar.access_log is not None
    lines = await asyncio.to_thread(check_access_log, sidecar.access_log, views)
    sent = {view.request_id for view in views}
    assert all(line["request_id"] in sent for line in lines), "a line no client sent"
