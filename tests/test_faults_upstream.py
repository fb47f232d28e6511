"""Upstream faults, against a real vLLM CPU server: the server slow to answer or to
stream, cut mid-response, its /metrics failing or hanging, connection refused, and
the vLLM process killed mid-stream and coming back with another KV capacity and then
another model, while the same kvgate process keeps running.

Faults between kvgate and vLLM come from `support.fault_proxy.FaultProxy`, a network
fault injector in front of the real server (not a fake server)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from support.access import access_log_checked  # noqa: F401 (autouse: every request logged once)
from support.env import free_port, model_dir, vllm_python
from support.fault_proxy import Fault, FaultProxy, post_stream, until
from support.sidecar import Sidecar, running_on
from support.vllm_server import VllmServer

pytestmark = [pytest.mark.vllm]

PROMPT = "The quick brown fox jumps over the lazy dog. " * 9  # ~100 tokens
READ_TIMEOUT_S = 2.0
STALE_S = 2.0


def completion(max_tokens: int, *, stream: bool = True, model: str = "tiny-llama",
               **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "stream": stream,
            "ignore_eos": True, "temperature": 0, **extra}




def settled(sidecar: Sidecar) -> dict[str, Any]:
    """The state once nothing is admitted or queued; the ledger must be empty then."""
    state = sidecar.wait_idle(30)
    ledger = state["admission"]["ledger"]
    assert ledger["reserved_blocks"] == 0 and ledger["reservations"] == 0, ledger
    return state


@pytest.fixture
def gated(proxy: FaultProxy) -> Iterator[Sidecar]:
    with Sidecar(proxy.url, "--read-timeout-s", str(READ_TIMEOUT_S), "--metrics-stale-s",
                 str(STALE_S), "--metrics-interval-s", "0.5", "--connect-timeout-s", "2",
                 "--queue-max-wait-s", "20") as running:
        yield running


async def test_upstream_slow_to_answer_gets_504_after_the_read_timeout(
    proxy: FaultProxy, gated: Sidecar
) -> None:
    proxy.set_faults(Fault(path="/v1/completions", delay_s=8.0))
    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        for stream in (False, True):
            result = await post_stream(session, gated.url + "/v1/completions",
                                       completion(8, stream=stream))
            assert result.status == 504, result
            assert result.body["error"]["code"] == "upstream_timeout"
            assert "--read-timeout-s" in result.body["error"]["message"]
            assert int(result.headers["Retry-After"]) >= 1
            assert READ_TIMEOUT_S - 0.2 <= result.elapsed_s < READ_TIMEOUT_S + 3, result
    # kvgate gave up before the server would have answered: the proxy never forwarded
    # them, and kvgate released their reservations.
    seen = proxy.requests("/v1/completions", "POST", since=started)
    assert len(seen) == 2
    proxy.wait_for(lambda: all(s.done for s in seen), 10)
    assert all(s.abandoned and not s.forwarded for s in seen), seen
    settled(gated)
    assert gated.metric("kvgate_upstream_errors_total", 'kind="timeout"') >= 2
    assert gated.get("/readyz")[0] == 200  # only generation was slow


async def test_upstream_slow_to_stream_within_the_read_timeout_is_fine(
    proxy: FaultProxy, gated: Sidecar
) -> None:
    # Gaps shorter than --read-timeout-s: slow, but a stream like any other. Two tokens
    # and the end: three gaps.
    proxy.set_faults(Fault(path="/v1/completions", chunk_delay_s=READ_TIMEOUT_S * 0.7))
    async with aiohttp.ClientSession() as session:
        result = await post_stream(session, gated.url + "/v1/completions", completion(2))
    assert result.status == 200 and result.done and result.error is None, result
    assert result.elapsed_s > READ_TIMEOUT_S  # longer than the timeout, in all
    settled(gated)


async def test_upstream_stalls_mid_stream_ends_the_stream_with_an_error(
    small_kv_vllm: VllmServer, proxy: FaultProxy, gated: Sidecar
) -> None:
    proxy.set_faults(Fault(path="/v1/completions", stall_after_bytes=3000))
    try:
        async with aiohttp.ClientSession() as session:
            result = await post_stream(session, gated.url + "/v1/completions", completion(300))
    finally:
        proxy.release_stalls()
    assert result.status == 200
    assert result.events, "some tokens arrive before the stall"
    assert result.error is not None and result.error["code"] == "upstream_failed", result
    assert not result.done
    assert result.elapsed_s < READ_TIMEOUT_S + 8, result.elapsed_s
    settled(gated)
    assert gated.metric("kvgate_upstream_errors_total", 'kind="timeout"') >= 1
    await until(lambda: running_on(small_kv_vllm) == 0, 20, "vLLM aborted the request")


async def test_upstream_cut_mid_response(proxy: FaultProxy, gated: Sidecar) -> None:
    async with aiohttp.ClientSession() as session:
        proxy.set_faults(Fault(path="/v1/completions", cut_after_bytes=2500))
        streamed = await post_stream(session, gated.url + "/v1/completions", completion(300))
        proxy.set_faults(Fault(path="/v1/completions", cut_after_bytes=100))
        whole = await post_stream(session, gated.url + "/v1/completions",
                                  completion(8, stream=False))
    # A stream already started ends with an error event the client can see.
    assert streamed.status == 200 and streamed.events
    assert streamed.error is not None and streamed.error["code"] == "upstream_failed"
    assert not streamed.done
    # A plain response whose headers were sent cannot change its status: the
    # connection is closed before the announced Content-Length, which clients report.
    assert whole.status == 200 and whole.broken is not None, whole
    settled(gated)
    assert gated.metric("kvgate_upstream_errors_total", 'kind="disconnect"') >= 2


async def test_metrics_failing_or_hanging_means_model_only_decisions(
    proxy: FaultProxy, gated: Sidecar
) -> None:
    state = gated.state()
    assert state["admission"]["server"]["used_blocks"] is not None
    for fault in (Fault(path="/metrics", status=500), Fault(path="/metrics", hang=True)):
        proxy.set_faults(fault)
        # Stale, and the failure seen: a hanging scrape fails only at its timeout, which
        # can come just after the age crosses the line.
        await until(lambda: gated.metric("kvgate_upstream_metrics_age_seconds") > STALE_S + 0.5
                    and gated.state()["upstream"]["last_error"] is not None,
                    30, f"metrics stale with {fault.label()}")
        state = gated.state()
        # The server still answers: kvgate stays up and ready, and decides from its
        # model alone (no observed KV use), which the metrics show.
        assert state["upstream"]["up"] is True, state["upstream"]
        assert "/metrics" in state["upstream"]["last_error"]
        assert state["admission"]["server"]["used_blocks"] is None
        assert state["admission"]["ledger"]["observed_used_blocks"] is None
        assert gated.metric("kvgate_upstream_up") == 1
        assert gated.get("/readyz")[0] == 200
        async with aiohttp.ClientSession() as session:
            result = await post_stream(session, gated.url + "/v1/completions", completion(8))
        assert result.status == 200 and result.done, result
        assert int(result.headers["x-kvgate-kv-blocks"]) > 0
        proxy.clear()
        proxy.release_stalls()
        await until(lambda: gated.metric("kvgate_upstream_metrics_age_seconds") < STALE_S,
                   30, "metrics fresh again")
        await until(lambda: gated.state()["admission"]["server"]["used_blocks"] is not None,
                   10, "observed KV use again")
    settled(gated)


async def test_connection_refused_then_back(proxy: FaultProxy) -> None:
    proxy.refuse()
    gated = Sidecar(proxy.url, "--metrics-interval-s", "0.5", "--connect-timeout-s", "2")
    # kvgate starts although the server refuses connections: alive, not ready.
    gated.start(wait_ready=False)
    try:
        await until(lambda: gated.get("/healthz")[0] == 200, 30, "kvgate alive")
        status, body = gated.get("/readyz")
        assert status == 503 and "upstream unavailable" in body
        async with aiohttp.ClientSession() as session:
            refused = await post_stream(session, gated.url + "/v1/completions", completion(8))
            async with session.get(gated.url + "/v1/models") as models:
                passthrough = (models.status, models.headers.get("Retry-After"),
                               await models.json(content_type=None))
        assert refused.status == 503 and refused.body["error"]["code"] == "unavailable"
        assert int(refused.headers["Retry-After"]) >= 1
        assert refused.elapsed_s < 5
        assert passthrough[0] == 503 and passthrough[1] is not None
        assert passthrough[2]["error"]["code"] == "unavailable"
        assert gated.metric("kvgate_upstream_up") == 0
        proxy.accept()
        gated.wait_ready(30)
        async with aiohttp.ClientSession() as session:
            served = await post_stream(session, gated.url + "/v1/completions", completion(8))
        assert served.status == 200 and served.done
        # Refused again while running: readiness follows, requests get 503 at once.
        proxy.refuse()
        await until(lambda: gated.get("/readyz")[0] == 503, 10, "not ready")
        async with aiohttp.ClientSession() as session:
            refused = await post_stream(session, gated.url + "/v1/completions", completion(8))
        assert refused.status == 503 and "Retry-After" in refused.headers
        proxy.accept()
        gated.wait_ready(30)
        settled(gated)
    finally:
        assert gated.stop() == 0


async def test_vllm_killed_mid_stream_and_back_with_other_capacity_then_other_model() -> None:
    port = free_port()
    # Streams long enough (~4,000 tokens, several seconds on a CPU) to be cut by the kill,
    # however fast the machine runs them.
    server = VllmServer(vllm_python(), str(model_dir("tiny-llama")), "tiny-llama", port,
                        max_model_len=4096, block_size=32, num_gpu_blocks_override=400)
    server.start()
    qwen: VllmServer | None = None
    try:
        # The fourth stream's predicted wait (the first three's ~4,000 tokens) is ~6 s
        # here, and up to three times that on a busy machine: within --queue-max-wait-s.
        with Sidecar(server.url, "--metrics-interval-s", "0.5", "--queue-max-wait-s",
                     "25") as gated:
            pid = gated.proc.pid if gated.proc else None
            assert gated.state()["admission"]["ledger"]["capacity_blocks"] == 399
            # Three streams of 125 blocks run (375 of the 379 kvgate admits); a fourth waits
            # until they are all but done, however far they got before it came (kvgate
            # admits on the blocks each holds at every step ahead: with more room, one
            # that came late would fit beside the others' last steps).
            async with aiohttp.ClientSession() as session:
                first_tokens = asyncio.Event()
                counts = [0, 0, 0]

                def counter(index: int) -> Any:
                    async def on_event(n: int) -> None:
                        counts[index] = n
                        if all(c >= 3 for c in counts):
                            first_tokens.set()
                    return on_event

                url = gated.url + "/v1/completions"
                # Prompts of their own: a common prefix would be held once.
                running = [asyncio.create_task(post_stream(
                    session, url, completion(3900, prompt=f"{i} {PROMPT}"),
                    on_event=counter(i))) for i in range(3)]
                await asyncio.wait_for(first_tokens.wait(), 60)
                assert gated.state()["admission"]["ledger"]["reserved_blocks"] == 375
                queued = asyncio.create_task(post_stream(
                    session, url, completion(3900, prompt=f"3 {PROMPT}")))
                await until(lambda: gated.state()["admission"]["queue"]["length"] == 1, 10,
                            "the fourth request queued")
                assert not any(task.done() for task in running), "a stream ended before the kill"
                killed_at = time.monotonic()
                server.kill()
                results = await asyncio.wait_for(asyncio.gather(*running), 30)
                waited = await asyncio.wait_for(queued, 30)
                # Streams cut by the dead server end at once with an error event.
                for result in results:
                    assert result.status == 200 and result.events and not result.done
                    assert result.error is not None, result
                    assert result.error["code"] == "upstream_failed"
                assert time.monotonic() - killed_at < 30
                # The queued request gets a clean refusal with Retry-After, not a hang:
                # 503 when it was let in and found the server gone, 429 when it waited
                # out --queue-max-wait-s.
                assert waited.status in (429, 503), waited
                assert int(waited.headers["Retry-After"]) >= 1
                await until(lambda: gated.get("/readyz")[0] == 503, 10, "not ready")
                state = settled(gated)
                assert state["admission"]["inflight"] == 0
                assert state["upstream"]["up"] is False
                refused = await post_stream(session, url, completion(8))
                assert refused.status == 503 and refused.body["error"]["code"] == "unavailable"
                assert int(refused.headers["Retry-After"]) >= 1
                assert refused.elapsed_s < 5

                # Back with another KV capacity: re-learned without restarting kvgate.
                server.num_gpu_blocks_override = 192
                server.restart()
                gated.wait_ready(60)
                state = gated.state()
                assert state["model"]["num_blocks"] == 192
                assert state["admission"]["ledger"]["capacity_blocks"] == 191
                assert state["upstream"]["restarts"] >= 1
                assert gated.metric("kvgate_kv_capacity_blocks") == 191
                served = await post_stream(session, url, completion(16))
                assert served.status == 200 and served.done, served

                # Back as another model (another max_model_len too) on the same port.
                server.stop()
                await until(lambda: gated.get("/readyz")[0] == 503, 10, "not ready")
                qwen = VllmServer(vllm_python(), str(model_dir("tiny-qwen3")), "tiny-qwen3",
                                  port, max_model_len=1000, block_size=32,
                                  num_gpu_blocks_override=64)
                qwen.start()
                gated.wait_ready(60)
                state = gated.state()
                assert state["model"]["model_id"] == "tiny-qwen3"
                assert state["model"]["max_model_len"] == 1000
                assert state["admission"]["ledger"]["capacity_blocks"] == 63
                assert gated.metric("kvgate_info", 'model="tiny-qwen3"') == 1
                served = await post_stream(session, url, completion(16, model="tiny-qwen3"))
                assert served.status == 200 and served.done, served
                # Its context is 1,000 tokens now: 4 sequences of up to 1,000 tokens
                # need about 4 x 32 blocks (their prompt's few full blocks held once),
                # more than kvgate ever gives one request (59).
                too_long = await post_stream(session, url, completion(
                    950, model="tiny-qwen3", n=4, temperature=1.0))
                assert too_long.status == 400
                assert too_long.body["error"]["code"] == "never_fits"
                assert too_long.body["kvgate"]["max_model_len"] == 1000
                settled(gated)
            assert gated.proc is not None and gated.proc.pid == pid
            assert gated.proc.poll() is None, "the same kvgate process served throughout"
    finally:
        server.stop()
        if qwen is not None:
            qwen.stop()


async def test_a_chunked_answer_cut_short_reaches_the_client_broken() -> None:
    """An answer without a length (chunked) that the server cuts: the client must not
    get the last chunk kvgate's server would otherwise add, which would pass the cut
    body as whole."""
    async def cut(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(b'{"data": "the first half of an ans')
        await asyncio.sleep(0.1)
        assert request.transport is not None
        request.transport.abort()
        return response

    async with in_front_of([("GET", "/v1/export", cut)]) as (sidecar, session), \
            session.get(sidecar.url + "/v1/export") as response:
        assert response.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await response.read()


async def test_a_head_keeps_the_length_the_server_gave_and_no_other_framing() -> None:
    """A HEAD's answer has no body but keeps the server's Content-Length (the length its
    GET would have); one the server framed as chunked gets neither header."""
    async def sized(request: web.Request) -> web.StreamResponse:
        return web.Response(body=b"", headers={"Content-Length": "1234", "X-Kept": "1",
                                               "Connection": "X-Hop", "X-Hop": "2"})

    async def chunked(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"X-Kept": "1"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        return response

    routes = [("HEAD", "/v1/sized", sized), ("HEAD", "/v1/chunked", chunked)]
    async with in_front_of(routes) as (sidecar, session):
        async with session.head(sidecar.url + "/v1/sized") as response:
            assert response.status == 200
            assert response.headers.get("Content-Length") == "1234"
            assert response.headers.get("X-Kept") == "1"
            assert "X-Hop" not in response.headers  # named by the server's Connection
            assert await response.read() == b""
        async with session.head(sidecar.url + "/v1/chunked") as response:
            assert response.status == 200 and response.headers.get("X-Kept") == "1"
            assert "Content-Length" not in response.headers
            assert "Transfer-Encoding" not in response.headers


@contextlib.asynccontextmanager
async def in_front_of(routes: list[tuple[str, str, Any]]
                      ) -> AsyncIterator[tuple[Sidecar, aiohttp.ClientSession]]:
    """kvgate in front of an aiohttp server of `routes` (method, path, handler) on this
    test's loop, and a client session, once kvgate answers."""
    app = web.Application()
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    sidecar = Sidecar(f"http://127.0.0.1:{port}").start(wait_ready=False)
    try:
        async with aiohttp.ClientSession() as session:
            await until_async(session, sidecar.url + "/healthz")
            yield sidecar, session
    finally:
        sidecar.stop()
        await runner.cleanup()


async def until_async(session: aiohttp.ClientSession, url: str, timeout_s: float = 30.0) -> None:
    """Until `url` answers 200, without blocking the loop the test's upstream runs on."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(url) as response:
                if response.status == 200:
                    return
        await asyncio.sleep(0.2)
    raise AssertionError(f"{url} did not answer within {timeout_s} s")
