"""Sharing under vLLM's --long-prefill-token-threshold, on a real vLLM CPU server with
prefix caching on: a step schedules at most the threshold's tokens of one request's
prompt while others are eligible, so the requests behind it (and the later forks of a
request with n > 1) start on the rest of the prompt themselves and hold their own copy
of it. kvgate, told the server's threshold, counts them as sharing only the first
chunk, and the server never holds more than kvgate reserved."""

from __future__ import annotations

import asyncio
import contextlib
import math
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest

from support.env import free_port, model_dir, vllm_python
from support.forks import FORKS, OUTPUT_TOKENS, ServerUse, forked
from support.load import stream_completion
from support.sidecar import Sidecar, metric_value, released
from support.vllm_server import VllmServer

pytestmark = [pytest.mark.vllm]

MODEL = "tiny-llama"
BLOCKS = 128  # of 32 tokens: 127 usable, kvgate's default target 120
BLOCK_TOKENS = 32
THRESHOLD = 256  # tokens: 8 full blocks


@pytest.fixture(scope="module")
def server() -> Iterator[VllmServer]:
    vllm = VllmServer(vllm_python(), str(model_dir(MODEL)), MODEL, free_port(),
                      max_model_len=2048, block_size=BLOCK_TOKENS,
                      num_gpu_blocks_override=BLOCKS,
                      extra_args=["--long-prefill-token-threshold", str(THRESHOLD)])
    vllm.start()
    yield vllm
    vllm.stop()


def preemptions(server: VllmServer) -> float:
    return metric_value(server.metrics_text(), "vllm:num_preemptions_total")


@contextlib.asynccontextmanager
async def decoding(session: aiohttp.ClientSession, url: str) -> AsyncIterator[int]:
    """A request decoding beside the test's, from its first token on: vLLM caps a
    prefill at the threshold only while another request is eligible (alone, a request's
    prompt is scheduled whole). Yields the blocks kvgate reserved for it."""
    body = {"model": MODEL, "prompt": "Count on.", "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    async with session.post(url + "/v1/completions", json=body) as answer:
        assert answer.status == 200, await answer.text()
        async for line in answer.content:
            if line.startswith(b"data: {"):
                break  # running
        yield int(answer.headers["x-kvgate-kv-blocks"])
        async for _ in answer.content:
            pass


def prefix_hit_tokens(server: VllmServer) -> float:
    return metric_value(server.metrics_text(), "vllm:prefix_cache_hits_total")


async def test_forks_share_only_the_first_chunk_of_their_prompt(server: VllmServer) -> None:
    before = preemptions(server)
    with Sidecar(server.url, "--long-prefill-token-threshold", str(THRESHOLD)) as sidecar:
        timeout = aiohttp.ClientTimeout(total=120)
        async with (aiohttp.ClientSession(timeout=timeout) as session,
                    decoding(session, sidecar.url) as beside):
            hits_before = prefix_hit_tokens(server)
            payload, peak = await forked(session, sidecar, server, BLOCKS)
            hits = prefix_hit_tokens(server) - hits_before
        assert len(payload["choices"]) == FORKS
        reserved = int(payload["headers"]["x-kvgate-kv-blocks"])
        prompt_tokens = int(payload["headers"]["x-kvgate-prompt-tokens"])
        per_fork = math.ceil((prompt_tokens + OUTPUT_TOKENS - 1) / BLOCK_TOKENS)
        chunk_blocks = THRESHOLD // BLOCK_TOKENS
        assert reserved == FORKS * per_fork - (FORKS - 1) * chunk_blocks
        # What kvgate reserved covered what vLLM held (the gauge counts the request
        # beside them too).
        assert peak <= reserved + beside, (peak, reserved, beside)
        sidecar.wait_idle()
        assert released(sidecar)
    # vLLM's own count of the prompt tokens its later forks found cached: at least the
    # first chunk's full blocks each, as kvgate counts, and short of the whole prompt's
    # (which a server without a threshold gives them, and kvgate counted before).
    whole_tokens = (prompt_tokens - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    assert (FORKS - 1) * chunk_blocks * BLOCK_TOKENS <= hits < (FORKS - 1) * whole_tokens, (
        hits, whole_tokens)
    assert preemptions(server) == before


def prefixed(family: str, tail: int) -> str:
    """A ~1,000-token prefix shared by the family (its name first, so a new family is a
    new prefix), then a ~60-token tail of its own."""
    words = " ".join(f"pw{i}" for i in range(172))
    return f"{family} {words} " + " ".join(f"t{tail}x{i}" for i in range(10))


async def test_a_burst_on_a_new_prefix_stays_within_what_kvgate_reserved(
        server: VllmServer) -> None:
    # 16 requests sharing a prefix the server has never seen, sent at once: the first
    # few each compute part of the prefix themselves. kvgate reserves for that, and the
    # server holds no more.
    before = preemptions(server)
    family = uuid.uuid4().hex[:6]
    with Sidecar(server.url, "--long-prefill-token-threshold", str(THRESHOLD),
                 "--queue-max-wait-s", "120") as sidecar:
        target = sidecar.state()["admission"]["ledger"]["target_blocks"]
        timeout = aiohttp.ClientTimeout(total=300)
        with ServerUse(server, BLOCKS) as use:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                results: list[dict[str, Any]] = list(await asyncio.gather(*(
                    stream_completion(session, sidecar.url, 64, prompt=prefixed(family, i),
                                      model=MODEL)
                    for i in range(16))))
            await asyncio.sleep(0.2)
        assert [r["status"] for r in results] == [200] * 16
        # The second request admitted shared only the first chunk of the new prefix.
        shared = sorted(int(r["headers"]["x-kvgate-kv-shared-blocks"]) for r in results)
        assert shared[0] == 0 and THRESHOLD // BLOCK_TOKENS in shared, shared
        sidecar.wait_idle()
        assert released(sidecar)
    assert use.peak <= target, (use.peak, target)
    assert preemptions(server) == before
