"""A request that forks several sequences (n > 1) on a real vLLM CPU server with prefix
caching on (its default): vLLM holds the prompt's full blocks once for all the forks,
and kvgate reserves what vLLM holds, not n whole copies of the request."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import math
import threading
import uuid
from urllib.parse import urlsplit

import aiohttp
import pytest

from support.sidecar import Sidecar, metric_value, released
from support.vllm_server import VllmServer

pytestmark = [pytest.mark.vllm]

BLOCK_TOKENS = 32  # the small_kv_vllm server: 64 blocks of 32 tokens
FORKS = 4
OUTPUT_TOKENS = 120
# ~850 tokens with the nonce: 26 full blocks, whose 4 copies (124 blocks with the forks'
# own) are twice the cache; held once they leave each fork 5 blocks of its own.
PROMPT = "Pack my box with five dozen liquor jugs, said the wizard. " * 25


class ServerUse:
    """vLLM's blocks in use, polled as fast as its /metrics answers."""

    def __init__(self, server: VllmServer) -> None:
        self.server = server
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        connection = http.client.HTTPConnection(urlsplit(self.server.url).netloc, timeout=5)
        with contextlib.closing(connection):
            while not self._stop.is_set():
                connection.request("GET", "/metrics")
                text = connection.getresponse().read().decode()
                # vLLM's usage is over its blocks but the one it keeps back.
                used = metric_value(text, "vllm:kv_cache_usage_perc") * 63
                self.peak = max(self.peak, round(used))

    def __enter__(self) -> ServerUse:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def preemptions(server: VllmServer) -> float:
    return metric_value(server.metrics_text(), "vllm:num_preemptions_total")


async def test_forks_of_one_prompt_are_reserved_as_vllm_holds_them(
        small_kv_vllm: VllmServer) -> None:
    before = preemptions(small_kv_vllm)
    # A prompt of its own (a nonce first): the forks share blocks with nothing cached.
    prompt = f"Request {uuid.uuid4().hex}. " + PROMPT
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": OUTPUT_TOKENS,
            "n": FORKS, "temperature": 1.0, "ignore_eos": True}
    with Sidecar(small_kv_vllm.url) as sidecar:
        target = sidecar.state()["admission"]["ledger"]["target_blocks"]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            with ServerUse(small_kv_vllm) as use:
                async with session.post(sidecar.url + "/v1/completions", json=body) as answer:
                    payload = await answer.json()
                    headers = answer.headers
                await asyncio.sleep(0.2)  # the poller's last answer
        assert answer.status == 200, payload
        assert len(payload["choices"]) == FORKS
        assert all(choice["finish_reason"] == "length" for choice in payload["choices"])
        reserved = int(headers["x-kvgate-kv-blocks"])
        prompt_tokens = int(headers["x-kvgate-prompt-tokens"])
        sidecar.wait_idle()
        assert released(sidecar)

    # The premise: charged as four separate requests, the forks would never fit.
    per_fork = math.ceil((prompt_tokens + OUTPUT_TOKENS - 1) / BLOCK_TOKENS)
    assert FORKS * per_fork > target, (per_fork, target)
    assert prompt_tokens + OUTPUT_TOKENS <= 1024, prompt_tokens  # not clamped
    # kvgate reserved what vLLM held at its peak: enough, and no more than a block a
    # fork over it (vLLM's gauge may miss the last step's block).
    shared = (prompt_tokens - 1) // BLOCK_TOKENS
    assert reserved == FORKS * per_fork - (FORKS - 1) * shared
    assert use.peak <= reserved, (use.peak, reserved)
    assert use.peak >= reserved - FORKS, (use.peak, reserved)
    assert preemptions(small_kv_vllm) == before
