"""`kvgate serve --gateway-metrics` scraped as the Gateway API Inference Extension's
endpoint picker (EPP) scrapes a model server, in front of a real vLLM CPU server, and
read by the EPP's default saturation detector.

What the EPP reads, from kubernetes-sigs/gateway-api-inference-extension: its flags
`--total-queued-requests-metric` (default `vllm:num_requests_waiting`) and
`--kv-cache-usage-percentage-metric` (default `vllm:kv_cache_usage_perc`, "the fraction
of KV-cache blocks currently in use (from 0 to 1)"), the gauges its model-server
protocol (docs/proposals/003-model-server-protocol) names TotalQueuedRequests and
KVCacheUtilization. Its default saturation detector (pkg/epp/saturationdetector) finds
a pod with room while its waiting queue is at most 5 (QueueDepthThreshold) and its KV
cache usage at most 0.8 (KVCacheUtilThreshold); the utilization detector scores a pod
max(waiting / 5, usage / 0.8), saturated from 1.0 on.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.load import burst
from support.sidecar import Sidecar
from support.vllm_server import VllmServer

pytestmark = [pytest.mark.vllm]

QUEUED_METRIC = "vllm:num_requests_waiting"
KV_USAGE_METRIC = "vllm:kv_cache_usage_perc"
QUEUE_DEPTH_THRESHOLD = 5
KV_CACHE_UTIL_THRESHOLD = 0.8


@dataclass(frozen=True)
class Reading:
    """One scrape: the EPP's two gauges and kvgate's own view beside them."""

    waiting: float
    usage: float
    queued_in_kvgate: float
    reserved_blocks: float
    capacity_blocks: float

    @property
    def saturated(self) -> bool:
        """The EPP's default saturation detector: no room on this pod."""
        return self.waiting > QUEUE_DEPTH_THRESHOLD or self.usage > KV_CACHE_UTIL_THRESHOLD

    @property
    def score(self) -> float:
        """The utilization detector's score (>= 1.0: saturated)."""
        return max(self.waiting / QUEUE_DEPTH_THRESHOLD, self.usage / KV_CACHE_UTIL_THRESHOLD)


def read(text: str) -> Reading:
    """Parse a scrape as Prometheus text; each of the EPP's names must be one gauge
    with one sample."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in (QUEUED_METRIC, KV_USAGE_METRIC):
            assert family.type == "gauge", (family.name, family.type)
            assert len(family.samples) == 1, family.samples
        values.update({s.name: s.value for s in family.samples if not s.labels})
    missing = {QUEUED_METRIC, KV_USAGE_METRIC} - set(values)
    assert not missing, f"{sorted(missing)} not on kvgate's /metrics"
    return Reading(values[QUEUED_METRIC], values[KV_USAGE_METRIC],
                   values["kvgate_queue_requests"], values["kvgate_kv_reserved_blocks"],
                   values["kvgate_kv_capacity_blocks"])


async def scrape(session: aiohttp.ClientSession, sidecar: Sidecar) -> Reading:
    async with session.get(sidecar.url + "/metrics") as response:
        assert response.status == 200
        return read(await response.text())


async def test_gateway_metrics_saturate_the_epp_while_kvgate_queues(
    small_kv_vllm: VllmServer,
) -> None:
    with Sidecar(small_kv_vllm.url, "--gateway-metrics", "--queue-max-wait-s", "120") as sidecar:
        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            idle = await scrape(session, sidecar)
            for _ in range(50):  # the shared server's gauges may still hold a last test's
                if not idle.saturated:
                    break
                await asyncio.sleep(0.2)
                idle = await scrape(session, sidecar)
            # 800 output tokens (28 blocks at their peak): two run at a time, and more
            # than five wait in kvgate for seconds, however late the first scrape is
            # (with 400, four ran at once and the queue could fall under six within a
            # wave, before a busy machine's first scrape).
            load = asyncio.create_task(burst(sidecar.url, count=12, max_tokens=800))
            readings = []
            while not load.done():
                readings.append(await scrape(session, sidecar))
                await asyncio.sleep(0.1)
            results = load.result()
            sidecar.wait_idle()
            # The server's KV use kvgate reads lags by a scrape of its /metrics (every
            # second): the pod shows room again once kvgate has seen the server idle.
            after = await scrape(session, sidecar)
            for _ in range(50):
                if not after.saturated:
                    break
                await asyncio.sleep(0.2)
                after = await scrape(session, sidecar)

    assert all(r["status"] == 200 for r in results), results
    # Idle, before and after: room on this pod.
    for reading in (idle, after):
        assert reading.waiting == 0 and reading.queued_in_kvgate == 0, reading
        assert not reading.saturated and reading.score < 1.0, reading
    assert any(r.queued_in_kvgate > QUEUE_DEPTH_THRESHOLD for r in readings), (
        "the burst should queue more than 5 requests in kvgate")
    queued = [r for r in readings if r.queued_in_kvgate > 0]
    for reading in readings:
        # The queue the EPP reads holds kvgate's (and the server's, when it queues).
        assert reading.waiting >= reading.queued_in_kvgate, reading
        # The usage the EPP reads is a fraction, at least what kvgate has reserved.
        assert 0.0 <= reading.usage <= 1.0 and math.isfinite(reading.usage), reading
        reserved = min(1.0, reading.reserved_blocks / reading.capacity_blocks)
        assert reading.usage >= reserved - 1e-9, reading
    # Whenever kvgate holds a request back, the EPP sees this pod as saturated (by the
    # queue, or by the KV usage kvgate reserved).
    assert all(r.saturated and r.score >= 1.0 for r in queued), queued
