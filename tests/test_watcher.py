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


class BrokenOnceClient(SlowMetricsClient):
    """Its first /metrics reply breaks a parser (not an UpstreamError); then it answers."""

    def __init__(self) -> None:
        super().__init__()
        self.scrapes = 0

    async def metrics(self) -> ServerMetrics:
        self.scrapes += 1
        if self.scrapes == 1:
            raise UnicodeDecodeError("utf-8", b"\xe9", 0, 1, "invalid continuation byte")
        return await super().metrics()


def test_a_reply_no_parser_expected_is_a_failed_poll_and_the_polls_go_on() -> None:
    client = BrokenOnceClient()
    watcher = UpstreamWatcher(cast(UpstreamClient, client), interval_s=0.01,
                              clock=client.clock)
    view = asyncio.run(watcher.poll_once())
    assert view.consecutive_failures == 1 and "UnicodeDecodeError" in (view.last_error or "")

    async def run_a_while() -> None:
        task = asyncio.create_task(watcher.run())
        await asyncio.sleep(0.1)
        assert not task.done()  # the watcher did not die with the first bad reply
        task.cancel()

    client.scrapes = 0
    watcher.view = type(watcher.view)()
    asyncio.run(run_a_while())
    assert client.scrapes >= 3
    assert watcher.view.up and watcher.view.consecutive_failures == 0
