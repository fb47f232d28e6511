"""What the admission queue waits on: the head's limit (the KV cache, the server's own
limits), how long it waited on each, and how that is exported."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from sidecar.admission import AdmissionRequest, Rejected, ServerQueueLimits, ServerState
from sidecar.admission.blockage import KV_CACHE, LIMITS, QueueBlockage
from sidecar.admission.server_queue import MAX_REQUESTS, MAX_RUNNING
from sidecar.metrics import SidecarMetrics, StateView

from support.admission_fixtures import FakeClock, controller


def test_the_seconds_on_each_limit_add_up_the_current_wait_included() -> None:
    blockage = QueueBlockage(10.0)
    assert blockage.current is None and set(blockage.seconds(99.0).values()) == {0.0}
    blockage.set(KV_CACHE, 11.0)
    blockage.set(KV_CACHE, 12.5)  # still the cache: the wait goes on
    blockage.set(MAX_RUNNING, 14.0)
    blockage.set(None, 15.0)
    blockage.set(KV_CACHE, 20.0)
    seconds = blockage.seconds(21.0)
    assert seconds[KV_CACHE] == pytest.approx(3.0 + 1.0)  # 11-14, and 20-21 so far
    assert seconds[MAX_RUNNING] == pytest.approx(1.0)
    assert seconds[MAX_REQUESTS] == 0.0 and set(seconds) == set(LIMITS)
    assert blockage.current == KV_CACHE
    blockage.set("a_new_limit", 22.0)  # counted under its name, never an error
    assert blockage.seconds(23.5)["a_new_limit"] == pytest.approx(1.5)


def _queued(ctl: Any, **request: Any) -> asyncio.Future[Any]:
    return asyncio.ensure_future(ctl.admit(AdmissionRequest(**request)))


def test_the_queue_waits_on_the_kv_cache_then_on_nothing() -> None:
    clock = FakeClock()
    ctl = controller(num_blocks=41, clock=clock)

    async def scenario() -> None:
        running = await ctl.admit(AdmissionRequest(prompt_tokens=500, max_tokens=12))
        waiting = _queued(ctl, prompt_tokens=500, max_tokens=12)
        await asyncio.sleep(0)
        assert not waiting.done()
        assert ctl.blockage.current == KV_CACHE
        assert ctl.state()["queue"]["waiting_on"] == KV_CACHE
        clock.advance(1.5)
        running.finish()
        ticket = await asyncio.wait_for(waiting, 1)
        assert ctl.blockage.current is None
        clock.advance(5.0)  # nothing waits: no more time on the cache
        assert ctl.blockage.seconds(clock())[KV_CACHE] == pytest.approx(1.5)
        assert ctl.state()["queue"]["blocked_s"][KV_CACHE] == pytest.approx(1.5)
        ticket.finish()

    asyncio.run(scenario())


def test_the_queue_waits_on_the_servers_max_num_seqs_where_the_cache_has_room() -> None:
    clock = FakeClock()
    ctl = controller(num_blocks=1024, clock=clock,
                     server_limits=ServerQueueLimits(max_running=1))

    async def scenario() -> None:
        running = await ctl.admit(AdmissionRequest(prompt_tokens=50, max_tokens=20))
        waiting = _queued(ctl, prompt_tokens=50, max_tokens=20)
        await asyncio.sleep(0)
        assert ctl.blockage.current == MAX_RUNNING
        clock.advance(2.0)
        running.finish()
        (await asyncio.wait_for(waiting, 1)).finish()
        seconds = ctl.blockage.seconds(clock())
        assert seconds[MAX_RUNNING] == pytest.approx(2.0)
        assert seconds[KV_CACHE] == 0.0 and ctl.blockage.current is None
        # A server that goes down refuses its queue at once: nothing waits on it.
        running = await ctl.admit(AdmissionRequest(prompt_tokens=50, max_tokens=20))
        waiting = _queued(ctl, prompt_tokens=50, max_tokens=20)
        await asyncio.sleep(0)
        assert ctl.blockage.current == MAX_RUNNING
        ctl.update_server(ServerState(available=False))
        assert ctl.blockage.current is None
        assert isinstance((await asyncio.gather(waiting, return_exceptions=True))[0],
                          Rejected)
        running.finish()

    asyncio.run(scenario())


def test_the_heads_limit_follows_what_holds_it_and_a_request_behind_changes_nothing(
        ) -> None:
    """The server's --max-num-seqs holds the head; then a scrape shows the cache full of
    traffic kvgate does not see: the cache holds it; once that traffic is gone, it goes
    in. A request queued behind the head leaves the head's limit as it is."""
    clock = FakeClock()
    ctl = controller(num_blocks=64, clock=clock, server_limits=ServerQueueLimits(max_running=1))

    async def scenario() -> None:
        running = await ctl.admit(AdmissionRequest(prompt_tokens=50, max_tokens=20))
        head = _queued(ctl, prompt_tokens=300, max_tokens=20)
        await asyncio.sleep(0)
        assert ctl.blockage.current == MAX_RUNNING
        behind = _queued(ctl, prompt_tokens=50, max_tokens=20)
        await asyncio.sleep(0)
        assert len(ctl.queue) == 2 and ctl.blockage.current == MAX_RUNNING
        clock.advance(1.0)
        ctl.update_server(ServerState(available=True, num_blocks=64, used_blocks=60))
        assert ctl.blockage.current == KV_CACHE
        clock.advance(2.0)
        running.finish()  # a slot frees, but not the cache
        await asyncio.sleep(0)
        assert not head.done() and ctl.blockage.current == KV_CACHE
        clock.advance(0.5)
        ctl.update_server(ServerState(available=True, num_blocks=64, used_blocks=0))
        first = await asyncio.wait_for(head, 1)
        assert ctl.blockage.current == MAX_RUNNING  # now `behind` waits for a slot
        first.finish()
        (await asyncio.wait_for(behind, 1)).finish()
        assert ctl.blockage.current is None
        seconds = ctl.blockage.seconds(clock())
        assert seconds[MAX_RUNNING] == pytest.approx(1.0)
        assert seconds[KV_CACHE] == pytest.approx(2.5)

    asyncio.run(scenario())


@pytest.mark.parametrize("how", ["cancelled", "drained"])
def test_the_last_waiting_request_leaving_leaves_nothing_waiting(how: str) -> None:
    """Its client went away, or the sidecar drains: nothing waits on anything."""
    ctl = controller(num_blocks=41, clock=FakeClock())

    async def scenario() -> None:
        running = await ctl.admit(AdmissionRequest(prompt_tokens=500, max_tokens=12))
        waiting = _queued(ctl, prompt_tokens=500, max_tokens=12)
        await asyncio.sleep(0)
        assert ctl.blockage.current == KV_CACHE
        if how == "cancelled":
            waiting.cancel()
        else:
            ctl.drain(5.0)
        (outcome,) = await asyncio.gather(waiting, return_exceptions=True)
        assert isinstance(outcome, asyncio.CancelledError if how == "cancelled" else Rejected)
        assert len(ctl.queue) == 0 and ctl.blockage.current is None
        running.finish()

    asyncio.run(scenario())


def test_the_limits_are_exported_with_every_label_initialised() -> None:
    registry = CollectorRegistry()
    seconds = dict.fromkeys(LIMITS, 0.0) | {KV_CACHE: 4.5}
    SidecarMetrics(registry, lambda: StateView(
        queue_requests=3, inflight_requests=2, capacity_blocks=100, reserved_blocks=90,
        used_blocks=80, forecast_peak_ratio=0.9, forecast_exhaustion_s=float("inf"),
        recommended_max_concurrency=4, upstream_up=True, upstream_metrics_age_s=1.0,
        server_waiting=0, queue_waiting_on=KV_CACHE, queue_blocked_s=seconds))
    text = generate_latest(registry).decode()
    assert 'kvgate_queue_waiting_on{limit="kv_cache"} 1.0' in text
    assert 'kvgate_queue_waiting_on{limit="max_num_seqs"} 0.0' in text
    assert 'kvgate_queue_blocked_seconds_total{limit="kv_cache"} 4.5' in text
    for limit in LIMITS:
        assert f'kvgate_queue_blocked_seconds_total{{limit="{limit}"}}' in text
