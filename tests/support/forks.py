"""Requests that fork several sequences (n > 1), sent through kvgate to a real vLLM,
and vLLM's KV blocks in use meanwhile (polled from its /metrics as fast as it answers,
in a thread beside the request): the most it was seen to hold."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import threading
import uuid
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from support.sidecar import Sidecar, metric_value
from support.vllm_server import VllmServer

FORKS = 4
OUTPUT_TOKENS = 120
# ~860 tokens with forked()'s nonce: 26 full blocks of 32 tokens.
PROMPT = "Pack my box with five dozen liquor jugs, said the wizard. " * 25


class ServerUse:
    """vLLM's blocks in use while the `with` block runs: `peak` is the most seen."""

    def __init__(self, server: VllmServer, blocks: int) -> None:
        self.server = server
        # vLLM's usage is over its blocks but the one it keeps back.
        self.usable = blocks - 1
        self.peak = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        try:
            connection = http.client.HTTPConnection(urlsplit(self.server.url).netloc,
                                                    timeout=5)
            with contextlib.closing(connection):
                while not self._stop.is_set():
                    connection.request("GET", "/metrics")
                    text = connection.getresponse().read().decode()
                    used = metric_value(text, "vllm:kv_cache_usage_perc") * self.usable
                    self.peak = max(self.peak, round(used))
        except BaseException as exc:  # told to the test, not lost with the thread
            self.error = exc

    def __enter__(self) -> ServerUse:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if self.error is not None:
            raise AssertionError(f"polling vLLM's /metrics failed: {self.error!r}")


async def forked(session: aiohttp.ClientSession, sidecar: Sidecar, server: VllmServer,
                 server_blocks: int) -> tuple[dict[str, Any], int]:
    """One request of FORKS forks through kvgate, with a prompt of its own (a nonce
    first: the forks share blocks with nothing cached): its answer and kvgate's headers,
    and the most blocks the server (of `server_blocks`) was seen to use meanwhile."""
    prompt = f"Request {uuid.uuid4().hex}. " + PROMPT
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": OUTPUT_TOKENS,
            "n": FORKS, "temperature": 1.0, "ignore_eos": True}
    with ServerUse(server, server_blocks) as use:
        async with session.post(sidecar.url + "/v1/completions", json=body) as answer:
            payload = await answer.json()
            assert answer.status == 200, payload
            payload["headers"] = dict(answer.headers)
        await asyncio.sleep(0.2)  # the poller's last answer
    return payload, use.peak
