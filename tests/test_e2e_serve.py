"""`kvgate serve` in front of a real vLLM CPU server: overload, streaming,
disconnects, never-fits and bad input."""

from __future__ import annotations

import asyncio
import io
import json
from typing import Any

import aiohttp
import pytest

from support.concurrency import RunningSampler
from support.load import PROMPT, burst, most_streaming_at_once, stream_completion
from support.sidecar import Sidecar, generated_on, metric_value
from support.vllm_server import VllmServer

pytestmark = [pytest.mark.vllm]

BURST = 16


def preemptions(server: VllmServer) -> float:
    return metric_value(server.metrics_text(), "vllm:num_preemptions_total")


@pytest.fixture
def sidecar(small_kv_vllm: VllmServer) -> Any:
    with Sidecar(small_kv_vllm.url, "--queue-max-wait-s", "120") as running:
        yield running


async def test_overload_direct_preempts_and_kvgate_does_not(
    small_kv_vllm: VllmServer, sidecar: Sidecar
) -> None:
    before = preemptions(small_kv_vllm)
    direct = await burst(small_kv_vllm.url)
    assert all(r["status"] == 200 for r in direct)
    direct_preemptions = preemptions(small_kv_vllm) - before
    assert direct_preemptions > 0, "the burst should overflow vLLM's 2,048-token KV cache"

    before = preemptions(small_kv_vllm)
    async with RunningSampler(small_kv_vllm.url) as running:
        gated = await burst(sidecar.url)
    assert preemptions(small_kv_vllm) - before == 0
    for result in gated:
        assert result["status"] in (200, 429, 503), result
        if result["status"] != 200:
            assert result["retry_after"] is not None
    assert sum(r["status"] == 200 for r in gated) >= BURST // 2
    state = sidecar.wait_idle()
    # Not one request at a time: kvgate ran at least about as many at once as the cache
    # holds at their peaks, as its model counts them (the first request's peak blocks,
    # then each other's own blocks beside the prompt blocks they share). It may run more,
    # letting a request in while others near their end and free their blocks (admission
    # on the holdings over the steps ahead); never more than fit, or vLLM would preempt.
    admitted = [r["headers"] for r in gated if r["status"] == 200]
    peaks = {int(h["x-kvgate-kv-blocks"]) for h in admitted}
    shares = {int(h["x-kvgate-kv-shared-blocks"]) for h in admitted} - {0}
    assert len(peaks) == 1 and len(shares) <= 1, (peaks, shares)  # one prompt, one length
    peak = peaks.pop()
    own = peak - (shares.pop() if shares else 0)
    fits_at_once = 1 + (state["admission"]["ledger"]["target_blocks"] - peak) // own
    assert fits_at_once >= 3, fits_at_once
    # Sampled from vLLM's gauge, or from the streams themselves: on a busy machine the
    # sampler may get few samples (vLLM's /metrics answers slowly) and miss the peak.
    at_once = max(running.max, most_streaming_at_once(gated))
    assert at_once >= fits_at_once - 1, (running.samples, at_once, fits_at_once)
    ledger = state["admission"]["ledger"]
    assert ledger["reserved_blocks"] == 0 and ledger["reservations"] == 0
    assert sidecar.metric("kvgate_requests_total", 'outcome="admitted"') >= BURST // 2


async def test_streaming_through_kvgate_yields_the_same_tokens(
    small_kv_vllm: VllmServer, sidecar: Sidecar
) -> None:
    async with aiohttp.ClientSession() as session:
        # The prompt cached first: both answers then come from the same cached prefix
        # (a prefill of the whole prompt and one of its tail can differ in the last bit,
        # enough to flip a token of the random tiny model).
        await stream_completion(session, small_kv_vllm.url, 1)
        direct = await stream_completion(session, small_kv_vllm.url, 40, seed=7)
        gated = await stream_completion(session, sidecar.url, 40, seed=7)
    assert direct["status"] == gated["status"] == 200
    assert direct["text"] and direct["text"] == gated["text"]


async def test_client_disconnect_mid_stream_aborts_upstream_and_releases(
    small_kv_vllm: VllmServer, sidecar: Sidecar
) -> None:
    await disconnect_mid_stream(small_kv_vllm, sidecar)


async def test_the_aiohttp_front_end_streams_and_releases_as_the_lean_one(
    small_kv_vllm: VllmServer,
) -> None:
    """`--front-end aiohttp` (every request read by aiohttp): the same tokens, the
    request's id on the answer, and a client that goes away releases its reservation.
    (Every other end-to-end test runs behind the default lean front end.)"""
    with Sidecar(small_kv_vllm.url, "--front-end", "aiohttp") as gated:
        async with aiohttp.ClientSession() as session:
            await stream_completion(session, small_kv_vllm.url, 1)  # cached, as above
            direct = await stream_completion(session, small_kv_vllm.url, 24, seed=11)
            through = await stream_completion(session, gated.url, 24, seed=11)
            async with session.post(gated.url + "/v1/completions", headers={
                    "X-Request-Id": "front-end-check"}, json={
                    "model": "tiny-llama", "prompt": "hello", "max_tokens": 2}) as response:
                assert response.status == 200
                assert response.headers["X-Request-Id"] == "front-end-check"
        assert direct["text"] and direct["text"] == through["text"]
        await disconnect_mid_stream(small_kv_vllm, gated)


async def disconnect_mid_stream(small_kv_vllm: VllmServer, sidecar: Sidecar) -> None:
    """A client that goes away after its first tokens: vLLM stops generating (fewer
    than the 800 tokens asked for are ever made) and kvgate releases its reservation.
    The client leaves at once; checking anything first could race the ~2 s the whole
    answer takes on a fast machine."""
    before = generated_on(small_kv_vllm)
    async with aiohttp.ClientSession() as session:
        body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 800, "stream": True,
                "ignore_eos": True}
        response = await session.post(sidecar.url + "/v1/completions", json=body)
        assert response.status == 200
        for _ in range(5):
            await response.content.readline()
        response.close()  # the client goes away mid-stream
        assert int(response.headers["x-kvgate-kv-blocks"]) > 0  # it held a reservation
    for _ in range(100):
        running = metric_value(small_kv_vllm.metrics_text(), "vllm:num_requests_running")
        reserved = sidecar.state()["admission"]["ledger"]["reserved_blocks"]
        if running == 0 and reserved == 0:
            break
        await asyncio.sleep(0.1)
    assert running == 0 and reserved == 0
    assert 3 <= generated_on(small_kv_vllm) - before < 800  # aborted mid-answer (5 lines: 3 events)


async def test_never_fits_is_400_before_the_server_sees_it(
    small_kv_vllm: VllmServer, sidecar: Sidecar
) -> None:
    prompts_before = metric_value(small_kv_vllm.metrics_text(), "vllm:prompt_tokens_total")
    async with aiohttp.ClientSession() as session:
        # 4 sequences of up to 1,023 tokens (max_tokens clamped to the context, as vLLM
        # clamps it) need over 120 blocks (the prompt's 2 full blocks held once): more
        # than the 59 kvgate ever gives one request.
        result = await stream_completion(session, sidecar.url, 3000, n=4, temperature=1.0)
    assert result["status"] == 400
    error = result["body"]["error"]
    assert error["code"] == "never_fits" and error["param"] == "max_tokens"
    assert "largest max_tokens that fits" in error["message"]
    assert result["body"]["kvgate"]["largest_max_tokens"] > 0
    assert metric_value(small_kv_vllm.metrics_text(), "vllm:prompt_tokens_total") == (
        prompts_before)


async def test_bad_input_gets_clear_errors_and_kvgate_keeps_serving(sidecar: Sidecar) -> None:
    url = sidecar.url
    async with aiohttp.ClientSession() as session:
        async def post(path: str, data: bytes) -> tuple[int, dict[str, Any]]:
            async with session.post(url + path, data=io.BytesIO(data),
                                    headers={"content-type": "application/json"}) as r:
                return r.status, await r.json(content_type=None)

        status, body = await post("/v1/chat/completions", b"{not json")
        assert status == 400 and "not valid JSON" in body["error"]["message"]
        status, body = await post("/v1/chat/completions", json.dumps(
            {"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}],
             "max_tokens": "many"}).encode())
        assert status == 400 and body["error"]["param"] == "max_tokens"
        status, body = await post("/v1/completions", b'{"prompt": "' + b"x" * (9 << 20) + b'"}')
        assert status == 413 and "larger than the limit" in body["error"]["message"]
        async with session.get(url + "/v1/no-such-route") as response:
            assert response.status == 404
        # ignore_eos: the tiny model's sampled first token may be its end of text.
        status, body = await post("/v1/completions", json.dumps(
            {"model": "tiny-llama", "prompt": "hello", "max_tokens": 5, "ignore_eos": True,
             "temperature": 0}).encode())
        assert status == 200 and isinstance(body["choices"][0]["text"], str)
        assert body["usage"]["completion_tokens"] == 5
        async with session.get(url + "/v1/models") as response:
            assert response.status == 200
            assert (await response.json())["data"][0]["id"] == "tiny-llama"


async def test_a_head_is_answered_with_the_server_s_status_and_length(
    small_kv_vllm: VllmServer, sidecar: Sidecar
) -> None:
    """A HEAD passes through with what the server said: its status, and the length of
    the body the GET would have (no body)."""
    async with aiohttp.ClientSession() as session:
        for path in ("/v1/models", "/health"):
            answers = []
            for base in (small_kv_vllm.url, sidecar.url):
                async with session.head(base + path) as response:
                    answers.append((response.status, response.headers.get("Content-Length"),
                                    await response.read()))
            direct, gated = answers
            assert gated == direct, (path, direct, gated)
            assert direct[2] == b""


def test_the_plan_route_answers_under_load_from_the_engine_simulator(sidecar: Sidecar) -> None:
    """GET /kvgate/v1/plan gives what `kvgate plan --json` gives for the served model:
    latency at the asked concurrency and the recommendation from the simulator."""
    status, body = sidecar.get("/kvgate/v1/plan?prompt_tokens=256&output_tokens=32"
                               "&concurrency=8&arrival_rate=2", timeout=60)
    assert status == 200, body
    plan = json.loads(body)
    assert plan["latency_source"] == "simulator"
    assert plan["recommendation"]["source"] == "simulator"
    assert plan["recommendation"]["max_num_seqs"] >= 1
    assert plan["closed_form"]["ttft_s"] > 0
    # Eight clients wait for each other: the simulated TTFT is above one request's alone.
    status, body = sidecar.get("/kvgate/v1/plan?prompt_tokens=256&output_tokens=32"
                               "&concurrency=1", timeout=60)
    assert status == 200, body
    alone = json.loads(body)
    assert alone["latency_source"] == "simulator"
    assert plan["ttft_s"] > alone["ttft_s"] > 0
    assert plan["throughput_requests_per_s"] > 0
    # Out of bounds: refused before anything is simulated.
    max_len = plan["max_model_len"]
    for query, message in ((f"prompt_tokens={max_len}&output_tokens=1", "max_model_len"),
                           ("concurrency=100000000", "4096 clients"),
                           ("arrival_rate=inf", "finite")):
        status, body = sidecar.get(f"/kvgate/v1/plan?{query}", timeout=60)
        assert status == 400 and message in json.loads(body)["error"]["message"], body
