"""A request that forks several sequences (n > 1) on a real vLLM CPU server with prefix
caching on (its default): vLLM holds the prompt's full blocks once for all the forks,
and kvgate reserves what vLLM holds, not n whole copies of the request."""

from __future__ import annotations

import math

import aiohttp
import pytest

from support.forks import FORKS, OUTPUT_TOKENS, PROMPT, forked
from support.sidecar import Sidecar, metric_value, released
from support.vllm_server import VllmServer

pytestmark = [pytest.mark.vllm]

# The small_kv_vllm server (tests/conftest.py's SMALL_KV): 64 blocks of 32 tokens.
# forked()'s prompt has 26 full blocks, whose 4 copies (124 blocks with the forks' own)
# are twice the cache; held once they leave each fork 5 blocks of its own.
SERVER_BLOCKS = 64
BLOCK_TOKENS = 32


def preemptions(server: VllmServer) -> float:
    return metric_value(server.metrics_text(), "vllm:num_preemptions_total")


async def test_forks_of_one_prompt_are_reserved_as_vllm_holds_them(
        small_kv_vllm: VllmServer) -> None:
    before = preemptions(small_kv_vllm)
    with Sidecar(small_kv_vllm.url) as sidecar:
        target = sidecar.state()["admission"]["ledger"]["target_blocks"]
        peaks: list[tuple[int, int]] = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            # vLLM's gauge shows the forks' peak for a few tenths of a second: a busy
            # machine's poller may miss it, so up to three tries to see it.
            for _ in range(3):
                payload, peak = await forked(session, sidecar, small_kv_vllm, SERVER_BLOCKS)
                assert len(payload["choices"]) == FORKS
                assert all(c["finish_reason"] == "length" for c in payload["choices"])
                reserved = int(payload["headers"]["x-kvgate-kv-blocks"])
                prompt_tokens = int(payload["headers"]["x-kvgate-prompt-tokens"])
                # The premise: charged as four separate requests, the forks would never
                # fit.
                per_fork = math.ceil((prompt_tokens + OUTPUT_TOKENS - 1) / BLOCK_TOKENS)
                assert FORKS * per_fork > target, (per_fork, target)
                assert prompt_tokens + OUTPUT_TOKENS <= 1024, prompt_tokens  # not clamped
                shared = (prompt_tokens - 1) // BLOCK_TOKENS
                assert reserved == FORKS * per_fork - (FORKS - 1) * shared
                # kvgate reserved enough for what vLLM held, every time.
                assert peak <= reserved, (peak, reserved)
                peaks.append((peak, reserved))
                if peak >= reserved - FORKS:
                    break
        sidecar.wait_idle()
        assert released(sidecar)

    # And no more than a block a fork over what vLLM held (its gauge may miss the last
    # step's blocks).
    assert peak >= reserved - FORKS, peaks
    assert preemptions(small_kv_vllm) == before


async def test_forks_that_do_not_read_the_prefix_cache_are_reserved_in_full(
        small_kv_vllm: VllmServer) -> None:
    # Asking for the prompt's logprobs, vLLM 0.32 computes the whole prompt for every
    # fork (`SamplingParams.skip_reading_prefix_cache`): kvgate charges four whole
    # copies, more than it admits.
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": OUTPUT_TOKENS,
            "n": FORKS, "temperature": 1.0, "prompt_logprobs": 0}
    with Sidecar(small_kv_vllm.url) as sidecar:
        timeout = aiohttp.ClientTimeout(total=60)
        async with (aiohttp.ClientSession(timeout=timeout) as session,
                    session.post(sidecar.url + "/v1/completions", json=body) as answer):
            payload = await answer.json()
        assert released(sidecar)
    assert answer.status == 400, payload
    assert payload["error"]["code"] == "never_fits"
    per_fork = math.ceil((payload["kvgate"]["prompt_tokens"] + OUTPUT_TOKENS - 1)
                         / BLOCK_TOKENS)
    assert payload["kvgate"]["kv_blocks"] == FORKS * per_fork
