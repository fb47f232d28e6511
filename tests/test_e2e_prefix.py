"""Prefix-cache-aware admission in front of a real vLLM CPU server with prefix caching
on (vLLM's default) and its KV cache events on an ipc socket: bursts of requests that
share a long prefix run together, and sharing is counted only while it exists."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from support.env import free_port, model_dir, vllm_python
from support.fault_proxy import until
from support.load import stream_completion
from support.sidecar import Sidecar, metric_value
from support.vllm_server import VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCKS = 128  # of 32 tokens: 127 usable, kvgate's default target 120
MODEL = "tiny-llama"


def text(tag: str, words: int) -> str:
    """About 5.6 tokens a word with the tiny models' tokenizer."""
    return " ".join(f"{tag}{i}" for i in range(words))


def prompt(family: str, tail: int) -> str:
    """A ~960-token prefix shared by the family, then a ~60-token tail of its own."""
    return text(f"p{family}w", 172) + " " + text(f"t{tail}x", 10)


@pytest.fixture(scope="module")
def events_socket() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="kvgate-events-") as folder:
        yield f"ipc://{Path(folder) / 'kv-events.sock'}"


@pytest.fixture(scope="module")
def server(events_socket: str) -> Iterator[VllmServer]:
    config = ('{"enable_kv_cache_events": true, "publisher": "zmq", '
              f'"endpoint": "{events_socket}", "topic": "kv"}}')
    vllm = VllmServer(vllm_python(), str(model_dir(MODEL)), MODEL, free_port(),
                      max_model_len=2048, block_size=32, num_gpu_blocks_override=BLOCKS,
                      extra_args=["--kv-events-config", config])
    vllm.start()
    yield vllm
    vllm.stop()


def preemptions(server: VllmServer) -> float:
    return metric_value(server.metrics_text(), "vllm:num_preemptions_total")


async def burst(url: str, family: str, count: int = 16) -> list[dict[str, Any]]:
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return list(await asyncio.gather(*(
            stream_completion(session, url, 64, prompt=prompt(family, i), model=MODEL)
            for i in range(count))))


async def one(url: str, text_prompt: str, max_tokens: int = 8) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        return await stream_completion(session, url, max_tokens, prompt=text_prompt,
                                       model=MODEL)


def header(result: dict[str, Any], name: str) -> int:
    return int(float(result["headers"][name]))


async def test_a_burst_sharing_a_cached_prefix_runs_together(
    server: VllmServer, events_socket: str
) -> None:
    with Sidecar(server.url, "--kv-events-endpoint", events_socket) as sidecar:
        assert (await one(sidecar.url, prompt("a", 99)))["status"] == 200
        before = preemptions(server)
        results = await burst(sidecar.url, "a")
        assert [r["status"] for r in results] == [200] * 16
        assert preemptions(server) - before == 0
        # All but the first share the prefix's ~28 full blocks (~900 tokens); every one
        # finds them cached on the server.
        shared = sorted(header(r, "x-kvgate-kv-shared-blocks") for r in results)
        prefix_blocks = shared[-1]
        assert shared[0] == 0 and prefix_blocks >= 25 and set(shared[1:]) == {prefix_blocks}, [
            {k: v for k, v in r["headers"].items() if k.startswith("x-kvgate")} for r in results]
        assert all(header(r, "x-kvgate-cached-tokens") >= prefix_blocks * 32 for r in results)
        # The whole burst fits (28 + 16 x 5 blocks): nobody waited for another.
        waited = [float(r["headers"]["x-kvgate-queue-ms"]) for r in results]
        assert sum(ms == 0 for ms in waited) >= 15, waited
        state = sidecar.wait_idle()["admission"]
        assert state["prefix"]["source"] == "events"
        ledger = state["ledger"]
        assert ledger["reserved_blocks"] == 0 and ledger["held_prompt_blocks"] == 0
        # kvgate's predicted hit ratio and the server's own are both exported.
        deadline = time.monotonic() + 10
        while True:  # the server's counters arrive with kvgate's next scrape
            metrics = sidecar.metrics_text()
            predicted = metric_value(metrics, "kvgate_prefix_cache_hit_ratio",
                                     'source="predicted"')
            observed = metric_value(metrics, "kvgate_prefix_cache_hit_ratio", 'source="server"')
            if observed > 0.5 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        assert 0.5 < predicted <= 1.0 and 0.5 < observed <= 1.0, (predicted, observed)


async def test_a_burst_on_a_new_prefix_never_exceeds_the_cache(
    server: VllmServer, events_socket: str
) -> None:
    with Sidecar(server.url, "--kv-events-endpoint", events_socket,
                 "--queue-max-wait-s", "120") as sidecar:
        before = preemptions(server)
        results = await burst(sidecar.url, "new")
        assert [r["status"] for r in results] == [200] * 16
        assert preemptions(server) - before == 0
        assert sidecar.wait_idle()["admission"]["ledger"]["reserved_blocks"] == 0


async def test_a_prefix_evicted_by_other_traffic_is_no_longer_counted(
    server: VllmServer, events_socket: str
) -> None:
    with Sidecar(server.url, "--kv-events-endpoint", events_socket,
                 "--queue-max-wait-s", "120") as sidecar:
        assert (await one(sidecar.url, prompt("b", 99)))["status"] == 200
        # Other traffic, straight to the server, fills the cache with its own blocks.
        for index in range(6):
            assert (await one(server.url, text(f"fill{index}w", 200), 4))["status"] == 200
        before = preemptions(server)
        results = await burst(sidecar.url, "b")
        assert [r["status"] for r in results] == [200] * 16
        assert preemptions(server) - before == 0
        # The events told kvgate the prefix was gone: the first request of the burst
        # was not predicted to find it.
        assert min(header(r, "x-kvgate-cached-tokens") for r in results) == 0


async def test_without_events_the_cache_is_modelled_from_kvgates_own_traffic(
    server: VllmServer,
) -> None:
    with Sidecar(server.url) as sidecar:
        assert (await one(sidecar.url, prompt("c", 99)))["status"] == 200
        before = preemptions(server)
        results = await burst(sidecar.url, "c")
        assert [r["status"] for r in results] == [200] * 16
        assert preemptions(server) - before == 0
        shared = sorted(header(r, "x-kvgate-kv-shared-blocks") for r in results)
        assert shared[1] >= 25, shared
        assert sidecar.wait_idle()["admission"]["prefix"]["source"] == "traffic"


async def test_prefix_caching_off_charges_every_prompt_in_full(server: VllmServer) -> None:
    with Sidecar(server.url, "--prefix-caching", "off") as sidecar:
        result = await one(sidecar.url, prompt("d", 1))
        assert result["status"] == 200
        assert header(result, "x-kvgate-kv-shared-blocks") == 0
        assert header(result, "x-kvgate-cached-tokens") == 0
        assert sidecar.state()["admission"]["prefix"]["source"] == "off"


async def test_silent_events_fall_back_to_kvgates_own_model(server: VllmServer) -> None:
    with tempfile.TemporaryDirectory(prefix="kvgate-silent-") as folder:
        silent = f"ipc://{Path(folder) / 'nobody.sock'}"
        with Sidecar(server.url, "--kv-events-endpoint", silent,
                     "--kv-events-stale-s", "1") as sidecar:
            assert sidecar.state()["admission"]["prefix"]["source"] == "events"
            assert (await one(sidecar.url, prompt("e", 1)))["status"] == 200
            # Stale 1 s after the last event (none came), seen at the next scrape or
            # decision: the scrape comes each second, later on a busy machine.
            await until(lambda: sidecar.state()["admission"]["prefix"]["source"] == "traffic",
                        15, "the source falls back to kvgate's own traffic")
            assert sidecar.metric("kvgate_kv_events_stale") == 1
            assert sidecar.metric("kvgate_kv_events_connected") == 0


async def test_a_live_event_stream_stays_fresh_when_requests_store_nothing_new(
    server: VllmServer, events_socket: str
) -> None:
    with Sidecar(server.url, "--kv-events-endpoint", events_socket,
                 "--kv-events-stale-s", "1") as sidecar:
        # New blocks: their events arrive. Then the same prompt again and again, whose
        # blocks the server holds: vLLM publishes nothing, and nothing is stale.
        for _ in range(4):
            assert (await one(sidecar.url, prompt("f", 1), 2))["status"] == 200
            await asyncio.sleep(0.6)
        assert sidecar.state()["admission"]["prefix"]["source"] == "events"
        assert sidecar.metric("kvgate_kv_events_stale") == 0
        assert sidecar.metric("kvgate_kv_events_connected") == 1
