"""A preemption the server reports while kvgate enforces is logged with kvgate's view
of the KV cache at that scrape."""

from __future__ import annotations

import asyncio

import pytest

from sidecar.admission import AdmissionRequest
from sidecar.upstream.server_metrics import CacheConfig, ServerMetrics
from sidecar.upstream.watcher import UpstreamView

from support.admission_fixtures import FakeClock, wired_services


def test_a_preemption_the_server_reports_is_logged_with_kvgates_view(
        caplog: pytest.LogCaptureFixture) -> None:
    """Admission exists to prevent preemptions: when a scrape shows some, the log says
    what kvgate believed then, for the operator and for the bug report."""
    clock = FakeClock()
    services = wired_services(clock)
    services.calibrator = None
    ctl = services.controller
    assert ctl is not None
    cache = CacheConfig(block_size=16, num_gpu_blocks=64)

    def view(preemptions: float, restarts: int = 0) -> UpstreamView:
        return UpstreamView(up=True, restarts=restarts, metrics_at=clock(),
                            metrics=ServerMetrics(kv_usage_ratio=0.5, running=1,
                                                  preemptions_total=preemptions, cache=cache))

    async def scenario() -> None:
        ticket = await ctl.admit(AdmissionRequest(prompt_tokens=100, max_tokens=60))
        with caplog.at_level("WARNING", logger="kvgate"):
            services.on_upstream(view(3), view(3))  # none since the last scrape
            services.on_upstream(view(0, restarts=0), view(2, restarts=1))  # a restart
            assert not caplog.records
            services.on_upstream(view(3), view(5))
        (record,) = caplog.records
        message = record.getMessage()
        assert "the server preempted 2 request(s) since its last scrape" in message
        assert "100 prompt + 0/60 output tokens" in message
        assert f"{ctl.ledger.reserved_blocks} reserved" in message
        assert "32 used on the server" in message  # half of the 63 usable blocks
        ticket.finish()

    asyncio.run(scenario())
