"""Calibration learns from every completed request up to 50 a second and from a
sample spread evenly in time above that rate; the metrics still count every request."""

from __future__ import annotations

import pytest

from sidecar.admission import AdmissionRequest, CostModel, Ticket
from sidecar.calibration.calibrator import LEARN_BURST, LEARN_PER_S
from sidecar.calibration.sample import RateSample
from sidecar.server.services import Services

from support.admission_fixtures import FakeClock, tiny_served, wired_services


def test_every_request_is_taken_below_the_rate() -> None:
    sample = RateSample(per_s=10.0, burst=5.0)
    # 9 a second for a minute, then a burst of 5 at once after a pause.
    taken = [sample.take(i / 9.0) for i in range(540)]
    taken += [sample.take(61.0) for _ in range(5)]
    assert all(taken)
    assert sample.taken == 545 and sample.left_out == 0


def test_above_the_rate_the_sample_is_the_rate_spread_evenly() -> None:
    sample = RateSample(per_s=10.0, burst=5.0)
    times = [i / 1000.0 for i in range(20_000)]  # 1,000 a second for 20 s
    taken = [t for t in times if sample.take(t)]
    assert len(taken) == pytest.approx(5 + 10 * 20, abs=1)
    assert sample.left_out == len(times) - len(taken)
    # After the burst, one every 0.1 s: no second of the run is missed or crowded.
    per_second = [sum(1 for t in taken if s <= t < s + 1) for s in range(1, 20)]
    assert set(per_second) <= {9, 10, 11}


def test_a_clock_that_goes_back_adds_nothing() -> None:
    sample = RateSample(per_s=10.0, burst=1.0)
    assert sample.take(100.0)
    assert not sample.take(50.0)  # earlier: no tokens for the time "between"
    assert not sample.take(100.05)
    assert sample.take(100.1)


@pytest.mark.parametrize(("per_s", "burst"), [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.5)])
def test_bad_settings_are_refused(per_s: float, burst: float) -> None:
    with pytest.raises(ValueError, match="per_s|burst"):
        RateSample(per_s, burst)


async def test_a_busy_server_calibrates_on_a_sample_and_its_metrics_count_all() -> None:
    clock = FakeClock()
    services = wired_services(clock)
    calibrator = services.calibrator
    assert calibrator is not None
    registry = services.metrics.registry
    completed = 600
    for _ in range(completed):  # 600 streamed requests in 2 s
        ticket = await services.controller.admit(AdmissionRequest(100, 8))
        started = clock()
        ttft = ticket.cost.prefill_model_s
        ticket.finish(8)
        services.observe_completion(
            ticket, streamed=True, arrived_at=started, sent_at=started,
            first_token_at=started + ttft, ended_at=started + ttft + 0.01,
            output_tokens=8, batch_at_start=0)
        clock.advance(2.0 / completed)
    learned = LEARN_BURST + LEARN_PER_S * 2.0
    status = calibrator.status(services.served)
    assert status["prefill_observations"] == pytest.approx(learned, abs=1)
    assert status["decode_observations"] == pytest.approx(learned, abs=1)
    assert status["requests_left_out"] == completed - calibrator.sample.taken
    assert calibrator.spread.status()["ttft"]["samples"] <= learned + 1
    # Every request is in the predicted-vs-observed metrics.
    assert registry.get_sample_value("kvgate_observed_ttft_seconds_count") == completed
    # Requests left out are still the sidecar's own traffic (a learned one counts its
    # two observations): the next scrape's histograms are not taken for traffic that
    # bypassed it.
    taken, left_out = calibrator.sample.taken, calibrator.sample.left_out
    assert taken + left_out == completed
    assert calibrator._own_since_scrape == 2 * taken + left_out


def complete(services: Services, clock: FakeClock, *tickets: Ticket) -> None:
    """Each of `tickets` streamed 8 tokens, its first after 50 ms, and was sent with
    those before it running (the proxy's count includes itself)."""
    for batch_at_start, ticket in enumerate(tickets, start=1):
        started = clock()
        ticket.finish(8)
        services.observe_completion(
            ticket, streamed=True, arrived_at=started, sent_at=started,
            first_token_at=started + 0.05, ended_at=started + 0.1,
            output_tokens=8, batch_at_start=batch_at_start)


async def test_a_request_is_learned_beside_the_others_it_ran_with_not_itself(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The proxy's running count at sending includes the request itself; the prefill
    the calibration learns is priced with the others only, as admission priced it (one
    alone waits for no step), and with the wait for their steps unless prompts were
    ahead of it."""
    clock = FakeClock()
    services = wired_services(clock)
    assert services.calibrator is not None
    seen: list[tuple[int, bool]] = []
    monkeypatch.setattr(services.calibrator, "observe_prefill",
                        lambda served, tokens, running, *a, waited=True, **k:
                        seen.append((running, waited)))
    first = await services.controller.admit(AdmissionRequest(100, 8))
    assert first.cost.model_inputs is not None and first.cost.model_inputs.running == 0
    second = await services.controller.admit(AdmissionRequest(100, 8))
    assert second.cost.model_inputs is not None and second.cost.model_inputs.running == 1
    complete(services, clock, first, second)
    ahead = second.cost.model_inputs.ahead_tokens
    assert ahead == 100  # the first one's prompt, admitted and not yet prefilled
    assert seen == [(0, True), (1, False)]


async def test_under_a_long_prefill_threshold_a_prefill_is_learned_as_it_was_priced(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under vLLM's long-prefill threshold, calibration learns each time to first token
    in the form admission priced it: a prompt behind another over the steps the walk
    found (`in_steps`), a request with forks capped (`capped`)."""
    clock = FakeClock()
    services = wired_services(clock)
    assert services.calibrator is not None
    # 192 tokens of a step for a prompt beside others, 256 in all: the second prompt
    # gets what the first leaves, over several steps, not in 1 chunk of its own.
    services.served = tiny_served(256).with_deployment(long_prefill_token_threshold=192,
                                                       max_num_batched_tokens=256)
    services.controller.set_cost_model(CostModel(services.served))
    seen: list[tuple[int, bool | None, int]] = []
    monkeypatch.setattr(services.calibrator, "observe_prefill",
                        lambda served, tokens, running, *a, capped=None, in_steps=0, **k:
                        seen.append((tokens, capped, in_steps)))
    first = await services.controller.admit(AdmissionRequest(900, 8))
    second = await services.controller.admit(AdmissionRequest(190, 8))
    forked = await services.controller.admit(AdmissionRequest(60, 8, sequences=2))
    inputs = [t.cost.model_inputs for t in (first, second, forked)]
    assert all(i is not None for i in inputs)
    steps = [i.ahead_steps for i in inputs if i is not None]
    assert steps[0] == 0 and steps[1] > 0 and steps[2] > 0  # the later ones share steps
    complete(services, clock, first, second, forked)
    assert [(capped, in_steps) for _, capped, in_steps in seen] == [
        (None, 0), (None, steps[1]), (True, steps[2])]
    # With its prompts ahead: their tokens and its own.
    assert [tokens for tokens, _, _ in seen] == [
        i.prefilled_tokens + i.ahead_tokens for i in inputs if i is not None]
    assert seen[1][0] == 190 + inputs[1].ahead_tokens > 190  # type: ignore[union-attr]
