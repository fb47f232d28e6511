"""SIGTERM during load, against a real vLLM CPU server: streams in flight finish
within the drain timeout, queued and new requests are refused with 503 and
Retry-After, readiness turns false, and the process exits 0. Streams still running
when the drain timeout ends are ended with an error event."""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import aiohttp
import pytest

from support.access import access_log_checked  # noqa: F401 (autouse: every request logged once)
from support.fault_proxy import Fault, FaultProxy, post_stream, until
from support.sidecar import Sidecar
from support.vllm_server import VllmServer

pytestmark = [pytest.mark.vllm]

PROMPT = "The quick brown fox jumps over the lazy dog. " * 9  # ~100 tokens


def completion(max_tokens: int, tag: str = "") -> dict[str, Any]:
    """A streamed completion; requests with other tags share no prompt block."""
    return {"model": "tiny-llama", "prompt": f"{tag} {PROMPT}", "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}}


async def test_sigterm_lets_streams_finish_and_refuses_new_work(
    small_kv_vllm: VllmServer,
) -> None:
    drain_s = 40
    # The tiny model generates 500 tokens in under a second here: the streams are paced
    # (10 ms before each event) so that they are still running through the test's steps.
    proxy = FaultProxy(small_kv_vllm.url).start()
    proxy.set_faults(Fault(path="/v1/completions", chunk_delay_s=0.01))
    sidecar = Sidecar(proxy.url, "--drain-timeout-s", str(drain_s),
                      "--queue-max-wait-s", "60").start()
    assert sidecar.proc is not None
    try:
        url = sidecar.url + "/v1/completions"
        async with aiohttp.ClientSession() as session:
            counts = [0, 0, 0]

            def counter(index: int) -> Any:
                async def on_event(n: int) -> None:
                    counts[index] = n
                return on_event

            # Three streams of 19 blocks run (57 of the 59 kvgate admits); a fourth like
            # them waits: it would hold ~18 blocks when theirs reach their peaks.
            running = [asyncio.create_task(post_stream(session, url, completion(500, str(i)),
                                                       on_event=counter(i)))
                       for i in range(3)]
            await until(lambda: min(counts) >= 3, 60, "streams started")
            queued = asyncio.create_task(post_stream(session, url, completion(500, "q")))
            await until(lambda: sidecar.state()["admission"]["queue"]["length"] == 1, 10,
                        "one queued")
            signalled = time.monotonic()
            sidecar.proc.send_signal(signal.SIGTERM)
            events_at_signal = max(counts)  # before the checks below take their time
            refused_queued = await asyncio.wait_for(queued, 10)
            new = await post_stream(session, url, completion(8))
            async with session.get(sidecar.url + "/v1/models") as models:
                passthrough = (models.status, models.headers.get("Retry-After"))
            ready = sidecar.get("/readyz")
            alive = sidecar.get("/healthz")[0]
            assert events_at_signal < 500, "the streams were still running at SIGTERM"
            results = await asyncio.wait_for(asyncio.gather(*running), drain_s)
        exit_code = await asyncio.to_thread(sidecar.proc.wait, drain_s)
        stopped_s = time.monotonic() - signalled
    finally:
        sidecar.stop()
        proxy.stop()
    for refused in (refused_queued, new):
        assert refused.status == 503, refused
        assert refused.body["error"]["code"] == "draining"
        assert int(refused.headers["Retry-After"]) >= 1
    assert passthrough[0] == 503 and passthrough[1] is not None
    assert ready[0] == 503 and "draining" in ready[1]
    assert alive == 200
    for result in results:  # every stream in flight ran to its end
        assert result.status == 200 and result.done and result.error is None, result
        usage = [e["usage"] for e in result.events if e.get("usage")]
        assert usage and usage[-1]["completion_tokens"] == 500, usage
    assert exit_code == 0
    assert stopped_s < drain_s, "exits as soon as the streams are done"
    log = sidecar.log_text()
    assert "draining: 4 requests in flight" in log and "kvgate stopped" in log  # 3 + queued


async def test_streams_beyond_the_drain_timeout_are_ended_with_an_error(
    small_kv_vllm: VllmServer,
) -> None:
    drain_s = 2.0
    # A stream that outlasts the drain: the fault proxy stalls it after a few events.
    with FaultProxy(small_kv_vllm.url) as proxy:
        proxy.set_faults(Fault(path="/v1/completions", stall_after_bytes=3000))
        sidecar = Sidecar(proxy.url, "--drain-timeout-s", str(drain_s)).start()
        assert sidecar.proc is not None
        try:
            async with aiohttp.ClientSession() as session:
                started = asyncio.Event()

                async def on_event(n: int) -> None:
                    started.set()

                stream = asyncio.create_task(post_stream(
                    session, sidecar.url + "/v1/completions", completion(900),
                    on_event=on_event))
                await asyncio.wait_for(started.wait(), 60)
                await asyncio.sleep(0.5)
                signalled = time.monotonic()
                sidecar.proc.send_signal(signal.SIGTERM)
                result = await asyncio.wait_for(stream, 30)
                ended_s = time.monotonic() - signalled
            exit_code = await asyncio.to_thread(sidecar.proc.wait, 30)
        finally:
            sidecar.stop()
            proxy.release_stalls()
    assert exit_code == 0
    assert result.status == 200 and result.events and not result.done
    assert result.error is not None and result.error["code"] == "draining", result
    assert drain_s <= ended_s < drain_s + 4, ended_s
    assert "drain timeout: 1 requests still running are cut off" in sidecar.log_text()
