"""Earliest-deadline-first ordering, with real deadlines: requests queued behind a full
cache, each with its own TTFT target, are admitted in order of their deadlines
(arrival + target), those without a target last; first come, first served admits the
same requests in arrival order."""

from __future__ import annotations

import asyncio

from sidecar.admission import AdmissionRequest, QueueLimits, Ticket

from support.admission_fixtures import FakeClock, FakeClockLoop, controller

# (name, TTFT target in seconds or None), one arrival a second, in this order.
ARRIVALS = [("a", 90.0), ("b", 30.0), ("c", None), ("d", 60.0), ("e", 45.0)]


def deadline_order() -> list[str]:
    """The order EDF should admit ARRIVALS in, from their deadlines."""
    deadlines = {name: (float("inf") if slo is None else arrival_s + slo)
                 for arrival_s, (name, slo) in enumerate(ARRIVALS)}
    return sorted(deadlines, key=lambda name: (deadlines[name], name))


def admission_order(ordering: str) -> list[str]:
    """Fill the cache, queue ARRIVALS (each alone fills it), then free it one request at
    a time: the names in the order they were admitted."""
    clock = FakeClock()
    # 40 usable blocks, target 38: one request of 300 + 200 tokens (32 blocks) at a time.
    ctl = controller(num_blocks=41, clock=clock, ordering=ordering, starvation_bound_s=None,
                     limits=QueueLimits(max_wait_s=1e6))
    loop = FakeClockLoop(clock)
    try:
        running: Ticket = loop.run_until_complete(
            ctl.admit(AdmissionRequest(300, 200)))
        waiting: dict[str, asyncio.Task[Ticket]] = {}
        for name, slo in ARRIVALS:
            waiting[name] = loop.create_task(
                ctl.admit(AdmissionRequest(300, 200, ttft_slo_s=slo)))
            loop.run_until_complete(asyncio.sleep(0))
            clock.advance(1.0)
        assert len(ctl.queue) == len(ARRIVALS), "every request should wait for the cache"
        order: list[str] = []
        while waiting:
            running.finish()
            for _ in range(3):
                loop.run_until_complete(asyncio.sleep(0))
            admitted = [name for name, task in waiting.items() if task.done()]
            assert len(admitted) == 1, f"one request fits at a time, admitted {admitted}"
            running = waiting.pop(admitted[0]).result()  # raises if it was rejected
            order.append(admitted[0])
            clock.advance(0.5)
        running.finish()
        assert ctl.ledger.reserved_blocks == 0 and len(ctl.queue) == 0
        return order
    finally:
        loop.close()


def test_edf_admits_by_deadline() -> None:
    expected = deadline_order()
    assert expected == ["b", "e", "d", "a", "c"]  # the arithmetic above, by hand
    assert admission_order("edf") == expected


def test_fcfs_admits_the_same_requests_by_arrival() -> None:
    """The control: the same queue under FCFS goes in arrival order, so the EDF test
    above is not passing on arrival order."""
    fcfs = admission_order("fcfs")
    assert fcfs == [name for name, _ in ARRIVALS]
    assert fcfs != deadline_order()

