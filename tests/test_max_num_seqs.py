"""The server's --max-num-seqs: kvgate forwards at most that many sequences at once and
keeps the rest in its own queue, in its own order, with their wait predicted."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from sidecar.admission import AdmissionRequest, Outcome, Rejected, ServerQueueLimits
from sidecar.admission.server_queue import MAX_RUNNING, REASONS
from sidecar.server.settings import SettingsError, load_settings

from support.admission_fixtures import FakeClock, controller


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_requests_past_the_servers_running_limit_wait_in_kvgate_not_in_the_server() -> None:
    ctl = controller(num_blocks=1024, server_limits=ServerQueueLimits(max_running=2))

    async def scenario() -> None:
        first = await ctl.admit(AdmissionRequest(prompt_tokens=50, max_tokens=20))
        second = await ctl.admit(AdmissionRequest(prompt_tokens=50, max_tokens=20))
        third = asyncio.ensure_future(ctl.admit(AdmissionRequest(prompt_tokens=50,
                                                                 max_tokens=20)))
        await asyncio.sleep(0)
        assert not third.done(), "the server runs 2 sequences at once"
        assert ctl.ledger.headroom_blocks > 100  # KV is not what holds it back
        assert ctl.inflight == 2
        first.finish()
        ticket = await asyncio.wait_for(third, 1)
        assert ctl.inflight == 2
        for t in (second, ticket):
            t.finish()
        assert ctl.inflight == 0 and ctl.ledger.reserved_blocks == 0

    run(scenario())


def test_a_freed_slot_goes_to_the_most_important_waiting_request() -> None:
    """vLLM's own queue is first come, first served (its default policy): held in
    kvgate, a high-priority request that came last runs first."""
    ctl = controller(num_blocks=1024, server_limits=ServerQueueLimits(max_running=1))

    async def scenario() -> None:
        running = await ctl.admit(AdmissionRequest(prompt_tokens=50, max_tokens=20))
        low = asyncio.ensure_future(ctl.admit(AdmissionRequest(prompt_tokens=50,
                                                               max_tokens=20, band=2)))
        await asyncio.sleep(0)
        high = asyncio.ensure_future(ctl.admit(AdmissionRequest(prompt_tokens=50,
                                                                max_tokens=20, band=0)))
        await asyncio.sleep(0)
        assert not low.done() and not high.done()
        running.finish()
        first = await asyncio.wait_for(high, 1)
        await asyncio.sleep(0)
        assert not low.done(), "the low-priority request waits for the next slot"
        first.finish()
        (await asyncio.wait_for(low, 1)).finish()

    run(scenario())


def test_sequences_count_and_a_request_wider_than_the_limit_goes_alone() -> None:
    ctl = controller(num_blocks=1024, server_limits=ServerQueueLimits(max_running=4))

    async def scenario() -> None:
        three = await ctl.admit(AdmissionRequest(prompt_tokens=20, max_tokens=10,
                                                 sequences=3))
        two = asyncio.ensure_future(ctl.admit(AdmissionRequest(
            prompt_tokens=20, max_tokens=10, sequences=2)))
        await asyncio.sleep(0)
        assert not two.done()  # 3 + 2 > 4
        three.finish()
        held = await asyncio.wait_for(two, 1)
        # n = 6 is more than the server ever runs at once: it is no error (vLLM runs
        # its sequences in turns) but it goes only when nothing else of kvgate's runs.
        wide = asyncio.ensure_future(ctl.admit(AdmissionRequest(
            prompt_tokens=20, max_tokens=10, sequences=6)))
        await asyncio.sleep(0)
        assert not wide.done()
        held.finish()
        (await asyncio.wait_for(wide, 1)).finish()

    run(scenario())


def test_the_wait_walks_the_requests_queued_ahead_through_the_seats() -> None:
    """One seat: a running request and two queued ahead, each let in as the one before
    ends. A newcomer's predicted wait is the three in turn (finite: the queued ones end
    too), and a target shorter than that is refused at once, naming the limit."""
    clock = FakeClock()
    ctl = controller(num_blocks=1024, clock=clock,
                     server_limits=ServerQueueLimits(max_running=1))

    async def scenario() -> None:
        running = await ctl.admit(AdmissionRequest(prompt_tokens=50, max_tokens=100))
        first_s = ctl.running_requests()[0].finish_in_s
        queued = [asyncio.ensure_future(ctl.admit(AdmissionRequest(
            prompt_tokens=50, max_tokens=100))) for _ in range(2)]
        await asyncio.sleep(0)
        durations = [e.payload.cost.prefill_s + e.payload.cost.decode_s  # type: ignore[attr-defined]
                     for e in ctl.queue.entries()]
        expected_s = first_s + sum(durations)
        with pytest.raises(Rejected) as rejected:
            await ctl.admit(AdmissionRequest(prompt_tokens=50, max_tokens=20,
                                             ttft_slo_s=expected_s * 0.9))
        decision = rejected.value.decision
        assert decision.outcome is Outcome.DEADLINE, decision
        assert "the server's --max-num-seqs 1 is reached" in decision.reason
        waited = decision.details["predicted_ttft_s"] - decision.details["predicted_prefill_s"]
        assert waited == pytest.approx(expected_s, abs=1e-4)
        running.finish()
        for future in queued:
            (await asyncio.wait_for(future, 1)).finish()

    run(scenario())


def test_the_servers_seats_are_per_data_parallel_engine() -> None:
    from prometheus_client import CollectorRegistry

    from sidecar.server.services import Services

    for engines, seats in ((1, 64), (2, 128)):
        settings = load_settings({"upstream": "http://127.0.0.1:8000", "max_num_seqs": "64",
                                  "data_parallel_size": str(engines)}, {}, None)
        services = Services(settings, CollectorRegistry(), arch=None, gpu=None, version="t")
        assert services.admission_settings().server_limits.max_running == seats


def test_a_deadline_is_judged_on_the_wait_for_a_slot_and_the_reason_names_the_limit() -> None:
    clock = FakeClock()
    ctl = controller(num_blocks=1024, clock=clock,
                     server_limits=ServerQueueLimits(max_running=1))

    async def scenario() -> None:
        running = await ctl.admit(AdmissionRequest(prompt_tokens=50, max_tokens=400))
        finish_s = ctl.running_requests()[0].finish_in_s
        assert finish_s > 0.1
        with pytest.raises(Rejected) as rejected:
            await ctl.admit(AdmissionRequest(prompt_tokens=50, max_tokens=20,
                                             ttft_slo_s=finish_s / 2))
        decision = rejected.value.decision
        assert decision.outcome is Outcome.DEADLINE, decision
        assert decision.details["predicted_ttft_s"] >= finish_s
        # A target past the slot's predicted start waits for it.
        waiting = asyncio.ensure_future(ctl.admit(AdmissionRequest(
            prompt_tokens=50, max_tokens=20, ttft_slo_s=finish_s * 3)))
        await asyncio.sleep(0)
        assert not waiting.done()
        server_queue = ctl.state()["server_queue"]
        assert isinstance(server_queue, dict) and server_queue["max_num_seqs"] == 1
        running.finish()
        (await asyncio.wait_for(waiting, 1)).finish()

    run(scenario())


def test_the_running_limit_is_no_refusal_reason_of_the_server() -> None:
    limits = ServerQueueLimits(max_running=2)
    assert MAX_RUNNING not in REASONS
    assert limits.refusal(5, 0, 1) is None  # vLLM refuses nothing for it
    assert limits.holding_back(2, 0, 1) == MAX_RUNNING
    assert limits.holding_back(1, 0, 1) is None
    assert limits.holding_back(0, 0, 9) is None
    assert limits.describe(MAX_RUNNING) == "the server's --max-num-seqs 2"
    with pytest.raises(ValueError, match="--max-num-seqs"):
        ServerQueueLimits(max_running=0)


def test_the_setting_reaches_the_controller_and_is_checked() -> None:
    settings = load_settings({"upstream": "http://127.0.0.1:8000"},
                             {"KVGATE_MAX_NUM_SEQS": "64"}, None)
    assert settings.max_num_seqs == 64
    with pytest.raises(SettingsError, match="KVGATE_MAX_NUM_SEQS"):
        load_settings({"upstream": "http://127.0.0.1:8000"}, {"KVGATE_MAX_NUM_SEQS": "0"},
                      None)
