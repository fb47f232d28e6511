"""Health, readiness, metrics and introspection routes."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import math
import os
from collections import Counter
from collections.abc import Sized
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from sidecar import compiled_modules
from sidecar.model.summary import PlanInput, compute_plan, plan_under_load
from sidecar.server.errors import error_response
from sidecar.server.keys import SERVICES

REGISTRY = web.AppKey("registry", CollectorRegistry)
# The process's HTTP runners (main and admin port), for the connection counts of /state.
RUNNERS = web.AppKey("runners", list[web.AppRunner])
# The connections kvgate's lean front end holds (server/front.py), for the same counts.
FRONT_CONNECTIONS = web.AppKey("front_connections", Sized)
# One plan is simulated at a time (in a worker thread, which shares the interpreter's
# lock with the proxy's event loop); another asked meanwhile gets 429.
PLAN_LOCK = web.AppKey("plan_lock", asyncio.Lock)
# The most clients /kvgate/v1/plan simulates (3 requests each, about a second per 5,000).
MAX_PLAN_CONCURRENCY = 4096


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, text=json.dumps(data, indent=2, default=str),
                        content_type="application/json")


async def healthz(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    ready, reason = request.app[SERVICES].ready
    return _json({"ready": ready, "reason": reason}, 200 if ready else 503)


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[REGISTRY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


@web.middleware
async def admin_token(request: web.Request, handler: Any) -> web.StreamResponse:
    """Require `Authorization: Bearer <token>` on /kvgate/v1/* when a token is set."""
    token = request.app[SERVICES].settings.admin_token
    if token and request.path.startswith("/kvgate/"):
        given = request.headers.get("Authorization", "")
        expected = f"Bearer {token}"
        # Header values are decoded with surrogateescape: encode them back the same way.
        if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"),
                                   expected.encode("utf-8", "surrogateescape")):
            return error_response(401, "this route needs Authorization: Bearer <admin token>",
                                  code="unauthorized")
    response: web.StreamResponse = await handler(request)
    return response


async def state(request: web.Request) -> web.Response:
    services = request.app[SERVICES]
    view = services.watcher.view if services.watcher else None
    data: dict[str, Any] = {
        "ready": services.ready[1],
        "model": dataclasses.asdict(services.learned) if services.learned else None,
        "model_problem": services.model_problem,
        "upstream": None if view is None else {
            "up": view.up,
            "last_error": view.last_error,
            "restarts": view.restarts,
            "metrics_age_s": view.metrics_age_s(services.clock()),
            "kv_usage_ratio": view.metrics.kv_usage_ratio if view.metrics else None,
            "preemptions_total": view.metrics.preemptions_total if view.metrics else None,
        },
        "admission": services.controller.state() if services.controller else None,
        "efficiency": services.served.efficiency.as_dict() if services.served else None,
        "process": _process(request),
    }
    return _json(data)


def _process(request: web.Request) -> dict[str, Any]:
    """Leak indicators: asyncio tasks, client and upstream connections, fds, memory."""
    services = request.app[SERVICES]
    runners = request.app.get(RUNNERS, [])
    clients = sum(len(r.server.connections) for r in runners if r.server is not None)
    clients += len(request.app.get(FRONT_CONNECTIONS, ()))
    upstream: dict[str, int] | None = None
    if services.client is not None:
        upstream = services.client.connections()
    rss_bytes = fds = None
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    rss_bytes = int(line.split()[1]) * 1024
        fds = len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux
        pass
    # (A compiled coroutine has no __qualname__: its type's name says which it is.)
    tasks = Counter(getattr(coro, "__qualname__", None) or type(coro).__qualname__
                    for coro in (task.get_coro() for task in asyncio.all_tasks()))
    return {
        "asyncio_tasks": sum(tasks.values()),
        "asyncio_tasks_by_coroutine": dict(tasks),
        "active_requests": services.active_requests,
        "client_connections": clients,
        "upstream_connections": upstream,
        "rss_bytes": rss_bytes,
        "open_fds": fds,
        "compiled_modules": len(compiled_modules()),
    }


async def plan(request: web.Request) -> web.Response:
    services = request.app[SERVICES]
    served = services.served
    if served is None:
        return error_response(503, f"no model yet: {services.ready[1]}", code="unavailable")
    query = request.query
    try:
        prompt = int(query.get("prompt_tokens", "1024"))
        output = int(query.get("output_tokens", "256"))
        concurrency = int(query.get("concurrency", "1"))
        rate = float(query["arrival_rate"]) if "arrival_rate" in query else None
    except ValueError:
        return error_response(400, "prompt_tokens, output_tokens and concurrency must be "
                              "integers, arrival_rate a number", code="invalid_request")
    if min(prompt, output, concurrency) < 1 or (rate is not None and not rate > 0):
        return error_response(400, "query values must be positive", code="invalid_request")
    if rate is not None and not math.isfinite(rate):
        return error_response(400, "arrival_rate must be finite", code="invalid_request")
    if concurrency > MAX_PLAN_CONCURRENCY:
        return error_response(400, f"concurrency {concurrency} is more than the "
                              f"{MAX_PLAN_CONCURRENCY} clients this route simulates "
                              "(`kvgate plan` has no such limit)", code="invalid_request")
    if prompt + output > served.max_model_len:
        return error_response(400, f"prompt_tokens + output_tokens ({prompt + output}) is "
                              f"more than the server's max_model_len ({served.max_model_len})",
                              code="invalid_request")
    inputs = PlanInput(
        served=served, sequence_tokens=served.max_model_len, prompt_tokens=prompt,
        output_tokens=output, concurrency=concurrency, arrival_rate=rate, ttft_slo_s=None,
        tpot_slo_s=None, kv_margin=services.settings.kv_target_ratio, chain=(),
        prefix_cache=served.deployment.enable_prefix_caching, server_running=True,
    )

    def answer() -> dict[str, Any]:
        # As `kvgate plan` answers, with the server's calibrated speeds: under load from
        # the engine simulator (pure Python, ~0.1-1 s: off the event loop).
        result = compute_plan(inputs)
        plan_under_load(result, inputs)
        return result

    lock = request.app[PLAN_LOCK]
    if lock.locked():
        return error_response(429, "another plan is being computed: retry in a moment",
                              code="busy", retry_after_s=1)

    async def computed() -> dict[str, Any]:
        async with lock:
            return await asyncio.to_thread(answer)

    # The lock is held until the thread ends, also when the client leaves (which cancels
    # this handler, not the thread).
    task = asyncio.ensure_future(computed())
    _PLANS.add(task)
    task.add_done_callback(_settled)
    return _json(await asyncio.shield(task))


_PLANS: set[asyncio.Task[dict[str, Any]]] = set()


def _settled(task: asyncio.Task[dict[str, Any]]) -> None:
    """Forget a plan's task; an error nobody awaited (its client left) is dropped."""
    _PLANS.discard(task)
    if not task.cancelled():
        task.exception()


async def calibration(request: web.Request) -> web.Response:
    services = request.app[SERVICES]
    status = services.calibration_status()
    if status is None:
        return error_response(404, "calibration is off or no model is known yet",
                              code="not_found")
    return _json(status)


def add_admin_routes(app: web.Application, *, introspection: bool) -> None:
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    if introspection:
        app[PLAN_LOCK] = asyncio.Lock()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/kvgate/v1/state", state)
        app.router.add_get("/kvgate/v1/plan", plan)
        app.router.add_get("/kvgate/v1/calibration", calibration)
