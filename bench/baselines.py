#!/usr/bin/env python3
"""The admission policies kvgate is compared with, as small reverse proxies.

    python bench/baselines.py cap --upstream http://127.0.0.1:8000 --port 20010 \
        --max-parallel 6
    python bench/baselines.py threshold --upstream http://127.0.0.1:8000 --port 20011 \
        [--kv-threshold 0.8] [--queue-threshold 5] [--interval-s 0.2]

Both forward every request to the upstream unchanged and stream the answer back
chunk by chunk (SSE passes through); they differ only in what they refuse:

- `cap`, a static concurrency cap, as LiteLLM's `max_parallel_requests` does (its
  parallel request limiter): at most N generation requests in flight; one more is
  refused at once with 429 "Max parallel request limit reached" and a
  `retry-after` of the seconds left to the next minute (LiteLLM's header, tied to
  its per-minute counters, not to when a slot frees up). Nothing waits.
- `threshold`, threshold shedding as the Gateway API Inference Extension's default
  saturation detector does (pkg/epp/saturationdetector): it reads the server's
  /metrics every `--interval-s` and considers it saturated when the metrics are
  stale, `vllm:num_requests_waiting` > 5 or `vllm:kv_cache_usage_perc` > 0.8 (the
  detector's "good capacity" is waiting <= 5 and usage <= 0.8). While saturated,
  sheddable requests - those whose `x-kvgate-priority` is `low` here, a negative
  InferenceObjective priority there - are refused with 429 and no Retry-After;
  critical ones always pass.

Neither reads request sizes, tokenizes or reserves KV: that is the difference
kvgate's admission makes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

GENERATION = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses",
                        "/v1/messages"})
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "te", "trailer", "transfer-encoding", "upgrade", "host",
                        "content-length"})


@dataclass
class Policy:
    kind: str
    max_parallel: int = 0
    kv_threshold: float = 0.8
    queue_threshold: int = 5
    interval_s: float = 0.2
    staleness_s: float = 1.0
    sheddable: frozenset[str] = frozenset({"low"})


class ProxyState:
    def __init__(self, upstream: str, policy: Policy) -> None:
        self.upstream = upstream.rstrip("/")
        self.policy = policy
        self.in_flight = 0
        self.session: aiohttp.ClientSession | None = None
        self.kv_usage: float | None = None
        self.waiting: float | None = None
        self.metrics_at = -math.inf
        self.counts: dict[str, int] = {"forwarded": 0, "rejected": 0}


STATE = web.AppKey("state", ProxyState)


def error(status: int, message: str, code: str, headers: dict[str, str] | None = None
          ) -> web.Response:
    body = {"error": {"message": message, "type": "rate_limit_error", "code": code,
                      "param": None}}
    return web.Response(status=status, text=json.dumps(body), content_type="application/json",
                        headers=headers or {})


def seconds_to_next_minute() -> float:
    now = datetime.datetime.now()
    following = (now + datetime.timedelta(minutes=1)).replace(second=0, microsecond=0)
    return (following - now).total_seconds()


def parse_metrics(text: str) -> tuple[float | None, float | None]:
    """(KV usage averaged over engines, waiting summed over engines) from vLLM's text."""
    usage: list[float] = []
    waiting: list[float] = []
    for line in text.splitlines():
        if line.startswith(("vllm:kv_cache_usage_perc{", "vllm:gpu_cache_usage_perc{")):
            usage.append(float(line.rsplit(" ", 1)[1]))
        elif line.startswith("vllm:num_requests_waiting{"):
            waiting.append(float(line.rsplit(" ", 1)[1]))
    return (sum(usage) / len(usage) if usage else None,
            sum(waiting) if waiting else None)


async def scrape(state: ProxyState) -> None:
    """The saturation detector's metrics loop."""
    assert state.session is not None
    timeout = aiohttp.ClientTimeout(total=max(1.0, state.policy.interval_s * 5))
    while True:
        try:
            async with state.session.get(state.upstream + "/metrics",
                                         timeout=timeout) as response:
                text = await response.text()
            usage, waiting = parse_metrics(text)
            if usage is not None and waiting is not None:
                state.kv_usage, state.waiting = usage, waiting
                state.metrics_at = time.monotonic()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            pass
        await asyncio.sleep(state.policy.interval_s)


def saturated(state: ProxyState) -> bool:
    policy = state.policy
    if time.monotonic() - state.metrics_at > policy.staleness_s:
        return True
    assert state.kv_usage is not None and state.waiting is not None
    return state.waiting > policy.queue_threshold or state.kv_usage > policy.kv_threshold


def refusal(request: web.Request, state: ProxyState) -> web.Response | None:
    policy = state.policy
    if request.method != "POST" or request.path not in GENERATION:
        return None
    if policy.kind == "cap" and state.in_flight >= policy.max_parallel:
        return error(429, f"Max parallel request limit reached. active requests: "
                          f"{state.in_flight}", "429",
                     {"retry-after": str(seconds_to_next_minute())})
    if policy.kind == "threshold":
        priority = request.headers.get("x-kvgate-priority", "").strip().lower()
        if priority in policy.sheddable and saturated(state):
            return error(429, "system saturated, sheddable request dropped",
                         "InferencePoolResourceExhausted")
    return None


async def proxy(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    refused = refusal(request, state)
    if refused is not None:
        state.counts["rejected"] += 1
        return refused
    counted = request.method == "POST" and request.path in GENERATION
    if counted:
        state.in_flight += 1
    try:
        return await forward(request, state)
    finally:
        if counted:
            state.in_flight -= 1


async def forward(request: web.Request, state: ProxyState) -> web.StreamResponse:
    assert state.session is not None
    body = await request.read()
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
    state.counts["forwarded"] += 1
    try:
        upstream = await state.session.request(
            request.method, state.upstream + request.rel_url.path_qs, data=body or None,
            headers=headers, timeout=aiohttp.ClientTimeout(total=None, sock_read=600),
            allow_redirects=False, auto_decompress=False)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return error(503, f"upstream unavailable: {exc.__class__.__name__}", "unavailable")
    try:
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for name, value in upstream.headers.items():
            if name.lower() not in HOP_BY_HOP:
                response.headers.add(name, value)
        await response.prepare(request)
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response
    finally:
        upstream.release()


async def stats(request: web.Request) -> web.Response:
    state = request.app[STATE]
    data: dict[str, Any] = {"policy": state.policy.kind, "in_flight": state.in_flight,
                            **state.counts, "kv_usage": state.kv_usage,
                            "waiting": state.waiting}
    return web.json_response(data)


async def _context(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        state.session = session
        task = asyncio.create_task(scrape(state)) if state.policy.kind == "threshold" else None
        yield
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def build_app(upstream: str, policy: Policy) -> web.Application:
    app = web.Application(client_max_size=8 * 1024 * 1024)
    app[STATE] = ProxyState(upstream, policy)
    app.cleanup_ctx.append(_context)
    app.router.add_get("/baseline/stats", stats)
    app.router.add_route("*", "/{tail:.*}", proxy)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=["cap", "threshold"])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-parallel", type=int, default=8, help="cap: requests in flight")
    parser.add_argument("--kv-threshold", type=float, default=0.8)
    parser.add_argument("--queue-threshold", type=int, default=5)
    parser.add_argument("--interval-s", type=float, default=0.2,
                        help="threshold: how often to read the server's /metrics")
    parser.add_argument("--staleness-s", type=float, default=1.0,
                        help="threshold: metrics older than this count as saturated")
    args = parser.parse_args()
    policy = Policy(kind=args.kind, max_parallel=args.max_parallel,
                    kv_threshold=args.kv_threshold, queue_threshold=args.queue_threshold,
                    interval_s=args.interval_s, staleness_s=args.staleness_s)
    web.run_app(build_app(args.upstream, policy), host=args.host, port=args.port,
                access_log=None, print=None)


if __name__ == "__main__":
    main()
