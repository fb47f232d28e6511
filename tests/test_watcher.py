"""The upstream watcher's view of a scrape: when it was sent and when it came back."""

from __future__ import annotations

import asyncio
from typing import cast

from sidecar.upstream.client import ModelInfo, UpstreamClient
from sidecar.upstream.server_metrics import ServerMetrics
from sidecar.upstream.watcher import UpstreamWatcher


class SlowMetricsClient:
    """Answers /metrics 0.4 s (of a fake clock) after it was asked."""

    def __init__(self) -> None:
        self.now = 100.0

    def clock(self) -> float:
        return self.now

    async def metrics(self) -> ServerMetrics:
        self.now += 0.4
        return ServerMetrics(kv_usage_ratio=0.5, running=3, waiting=1)

    async def models(self) -> list[ModelInfo]:
        return [ModelInfo("tiny", None, 2048)]


def test_a_scrape_records_when_it_was_sent_and_when_it_came_back() -> None:
    client = SlowMetricsClient()
    watcher = UpstreamWatcher(cast(UpstreamClient, client), clock=client.clock)
    view = asyncio.run(watcher.poll_once())
    assert view.up and view.metrics is not None and view.metrics.running == 3
    # The figures describe the server somewhere between the two moments.
    assert view.metrics_sent_at == 100.0
    assert view.metrics_at == 100.4
    client.now += 0.6
    view = asyncio.run(watcher.poll_once())
    assert (view.metrics_sent_at, view.metrics_at) == (101.0, 101.4)
