"""A client that is refused with `Retry-After` and retries after it gets in: kvgate in
front of a real vLLM CPU server with a small KV cache (64 blocks of 32 tokens) and no
queue, so a request that does not fit beside a running one is refused at once."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import aiohttp
import pytest

from support.load import PROMPT
from support.sidecar import Sidecar
from support.vllm_server import VllmServer

pytestmark = [pytest.mark.vllm]

# The holder: ~90 prompt + 900 output tokens (31 blocks at its end). The retrying client:
# a prompt of its own (~500 tokens, no block shared with the holder's) and two sequences
# of 420 output tokens (43 blocks at their end, the prompt's full blocks held once).
# kvgate sums what each will hold step by step, so a client fits beside a running
# request that will end before the two together outgrow the 59 blocks kvgate reserves
# up to. This one fits only once the holder is ~720 of its 900 tokens along: the first
# try, sent as the holder's first token arrives, is refused however busy the machine
# (with one short sequence it would fit once the holder is ~230 tokens along, a
# fraction of a second that a busy machine's client can miss).
MAX_TOKENS = 900
OTHER_PROMPT = "Pack my box with five dozen liquor jugs, said the wizard. " * 15
OTHER_MAX_TOKENS = 420
OTHER_SEQUENCES = 2
LONGEST_WAIT_S = 60.0  # a client waits at most this long in all


async def attempt(session: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, Any]]:
    """Send the request; on 200 read only the first event, then leave (its stream is
    aborted); else read the refusal."""
    body = {"model": "tiny-llama", "prompt": OTHER_PROMPT, "max_tokens": OTHER_MAX_TOKENS,
            "n": OTHER_SEQUENCES, "stream": True, "ignore_eos": True}
    async with session.post(url + "/v1/completions", json=body) as response:
        if response.status == 200:
            await response.content.readline()
            return 200, dict(response.headers)
        return response.status, {"retry_after": response.headers.get("Retry-After"),
                                 "body": await response.json(content_type=None)}


async def test_a_client_retrying_after_retry_after_gets_in(small_kv_vllm: VllmServer) -> None:
    with Sidecar(small_kv_vllm.url, "--queue-max-length", "0") as sidecar:
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            started = time.monotonic()
            ended: list[float] = []

            first_token = asyncio.Event()

            async def hold() -> dict[str, Any]:
                body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                        "stream": True, "ignore_eos": True}
                async with session.post(sidecar.url + "/v1/completions",
                                        json=body) as response:
                    result: dict[str, Any] = {"status": response.status}
                    async for line in response.content:
                        if line.startswith(b"data: {"):
                            first_token.set()
                ended.append(time.monotonic() - started)
                return result

            holder = asyncio.create_task(hold())
            waiting = asyncio.create_task(first_token.wait())
            await asyncio.wait({holder, waiting}, return_when=asyncio.FIRST_COMPLETED)
            assert first_token.is_set(), holder.result()
            refusals: list[tuple[float, dict[str, Any]]] = []
            waited_s = 0.0
            while True:
                sent_s = time.monotonic() - started
                status, answer = await attempt(session, sidecar.url)
                if status == 200:
                    got_in_s = time.monotonic() - started
                    break
                assert status == 429, (status, answer)
                assert answer["body"]["error"]["code"] == "queue_full", answer
                retry_after = answer["retry_after"]
                assert retry_after is not None and retry_after.isdigit(), answer
                refusals.append((time.monotonic() - started, answer))
                # Retry-After counts from when the refusal arrives; kvgate computed it
                # when it decided, up to this long before.
                answered_in_s = refusals[-1][0] - sent_s
                waited_s += int(retry_after)
                assert waited_s <= LONGEST_WAIT_S, f"still refused after {refusals}"
                await asyncio.sleep(int(retry_after))
            held = await holder
        sidecar.wait_idle()

    assert held["status"] == 200, held
    # The control: the first try was refused while the other request held the cache.
    assert refusals, "the second request should not fit beside the first"
    assert refusals[0][0] < ended[0]
    assert refusals[0][1]["body"]["kvgate"]["reserved_blocks"] > 0, refusals[0]
    # Retry-After was computed from when the cache frees: the client got in within a
    # few tries, and no later than shortly after the running request ended (kvgate may
    # let it in a little before, as the running request's last steps free its blocks).
    # "Few" and "shortly" scale with how long the holder took: a prediction made while
    # the machine's load changes is off by a share of the time, not by a constant.
    assert len(refusals) <= max(4, math.ceil(ended[0]) + 1), (refusals, ended)
    slack_s = max(2.0, 0.5 * ended[0])
    assert got_in_s <= ended[0] + slack_s + answered_in_s, (got_in_s, ended, answered_in_s,
                                                            refusals)
