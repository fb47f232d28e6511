"""GET /kvgate/v1/plan refuses what it would take long to simulate, and computes one
plan at a time (the route shares the proxy's process)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from sidecar.cli.model_source import read_model
from sidecar.model import Deployment, ServedModel, find_gpu
from sidecar.server import admin
from sidecar.server.keys import SERVICES


def _app() -> web.Application:
    app = web.Application()
    served = ServedModel(read_model("Qwen/Qwen3-0.6B"), Deployment(max_model_len=4096),
                         find_gpu("L4"))
    app[SERVICES] = SimpleNamespace(  # type: ignore[assignment]
        served=served, settings=SimpleNamespace(kv_target_ratio=0.95), ready=(True, ""))
    app[admin.PLAN_LOCK] = asyncio.Lock()
    return app


async def _ask(app: web.Application, query: str) -> tuple[int, dict[str, object]]:
    response = await admin.plan(make_mocked_request("GET", f"/kvgate/v1/plan?{query}",
                                                    app=app))
    assert isinstance(response, web.Response) and response.text is not None
    return response.status, json.loads(response.text)


def test_out_of_bounds_queries_are_refused_before_anything_is_simulated() -> None:
    async def scenario() -> None:
        app = _app()
        for query, message in (("prompt_tokens=4000&output_tokens=97", "max_model_len (4096)"),
                               ("concurrency=4097", "4096 clients"),
                               ("arrival_rate=inf", "finite"),
                               ("concurrency=0", "positive")):
            status, body = await _ask(app, query)
            error = body["error"]
            assert status == 400 and isinstance(error, dict), body
            assert message in str(error["message"]), body
        status, body = await _ask(app, "prompt_tokens=4000&output_tokens=96")
        assert status == 200 and body["max_model_len"] == 4096, body

    asyncio.run(scenario())


def test_a_second_plan_while_one_is_computed_is_told_to_retry() -> None:
    async def scenario() -> None:
        app = _app()
        async with app[admin.PLAN_LOCK]:
            response = await admin.plan(make_mocked_request("GET", "/kvgate/v1/plan", app=app))
        assert response.status == 429 and response.headers["Retry-After"] == "1"

    asyncio.run(scenario())
