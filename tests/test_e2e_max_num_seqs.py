"""kvgate told the server's --max-num-seqs, in front of a real vLLM: it never has more
requests running at the server than that, and a freed slot goes to the request its
policies pick, where vLLM's own queue is first come first served."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from support.load import PROMPT, most_streaming_at_once, stream_completion
from support.sidecar import Sidecar
from support.vllm_server import VllmServer

pytestmark = [pytest.mark.vllm]

SEATS = 2
BURST = 6
# Long enough that a wave of streams lasts a second or more on any machine: the high-
# priority request must reach kvgate while four wait, not race the first wave's end.
OUTPUT_TOKENS = 600


async def burst(url: str, model: str, queued: int) -> tuple[list[dict[str, Any]],
                                                             dict[str, Any]]:
    """BURST normal-priority streams sent at once, then one high-priority stream once
    `queued` of them wait in kvgate's queue (their own prompts: nothing cached serves
    another)."""
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        # A fresh kvgate checks the first requests of a shape with the server's
        # /tokenize: spent here, so that the burst's requests all arrive together.
        for i in range(3):
            warm = await stream_completion(session, url, 1, prompt=f"warm {i} {PROMPT}",
                                           model=model)
            assert warm["status"] == 200, warm
        normal = [asyncio.ensure_future(stream_completion(
            session, url, OUTPUT_TOKENS, prompt=f"{i} {PROMPT}", model=model))
            for i in range(BURST)]
        for _ in range(200):
            async with session.get(url + "/kvgate/v1/state") as response:
                state = await response.json()
            if state["admission"]["queue"]["length"] >= queued:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"{queued} requests never waited together: {state}")
        high = await stream_completion(session, url, OUTPUT_TOKENS, prompt=f"high {PROMPT}",
                                       model=model, headers={"x-kvgate-priority": "high"})
        return list(await asyncio.gather(*normal)), high


def test_kvgate_runs_no_more_than_the_servers_seats_and_fills_them_in_its_order(
        big_kv_vllm: VllmServer) -> None:
    model = big_kv_vllm.served_name
    # The control: without the setting the server, with room for them all in its KV
    # cache and its own much larger --max-num-seqs, runs the whole burst at once.
    with Sidecar(big_kv_vllm.url) as sidecar:
        uncapped, _ = asyncio.run(burst(sidecar.url, model, queued=0))
    assert all(r["status"] == 200 for r in uncapped), uncapped
    assert most_streaming_at_once(uncapped) > SEATS

    with Sidecar(big_kv_vllm.url, "--max-num-seqs", str(SEATS),
                 "--queue-max-wait-s", "120") as sidecar:
        normal, high = asyncio.run(burst(sidecar.url, model, queued=BURST - SEATS))
        state = sidecar.state()
    results = [*normal, high]
    assert all(r["status"] == 200 for r in results), results
    # A request streams tokens only while the server runs it.
    assert most_streaming_at_once(results) == SEATS
    # The high-priority request came while four waited and took the first seat freed
    # after it came: ahead of at least two of them (three unless a seat freed just
    # before it came; first come first served would run it after all four).
    later = [r for r in normal if r["first_token_at"] > high["first_token_at"]]
    assert len(later) >= BURST - SEATS - 2, (
        [r["first_token_at"] for r in normal], high["first_token_at"])
    assert state["admission"]["server_queue"]["max_num_seqs"] == SEATS
    assert state["admission"]["server_queue"]["requests"] == 0
