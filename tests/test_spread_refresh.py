"""The calibrated spread (p50/p90 factors) reaches predictions at most
SPREAD_PERIOD_S after the completions that moved it: rebuilt at a completion or before
a decision once that long has passed, not at every completion. The services' wiring
alone: a real controller and calibrator, no server."""

from __future__ import annotations

import pytest

from sidecar.admission import AdmissionRequest, Ticket
from sidecar.server.services import SPREAD_PERIOD_S, Services

from support.admission_fixtures import FakeClock, wired_services

# Replaces methods of a Services, which the compiled build does not allow.
pytestmark = pytest.mark.pure_python


def wired(clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> Services:
    services = wired_services(clock)
    assert services.calibrator is not None
    # The fit is not under test: left alone, a server 3x slower than predicted makes it
    # restart (which resets the spread) or move (which re-prices the spread's ratios).
    monkeypatch.setattr(services.calibrator, "observe_prefill", lambda *a, **k: None)
    monkeypatch.setattr(services.calibrator, "observe_decode", lambda *a, **k: None)
    monkeypatch.setattr(services, "apply_calibration", lambda *a, **k: None)
    return services


async def completed(services: Services, clock: FakeClock, slow: float) -> Ticket:
    """One streamed request admitted now, its TTFT `slow` x the model's own prediction
    (before the spread's factor)."""
    assert services.controller is not None
    ticket = await services.controller.admit(AdmissionRequest(100, 8))
    started = clock()
    ttft = ticket.cost.prefill_model_s * slow
    ticket.finish(8)
    services.observe_completion(
        ticket, streamed=True, arrived_at=started, sent_at=started,
        first_token_at=started + ttft, ended_at=started + ttft + 7 * ticket.cost.tpot_model_s,
        output_tokens=8, batch_at_start=0)
    return ticket


async def test_the_spread_reaches_predictions_at_most_a_period_late(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    services = wired(clock, monkeypatch)
    assert services.controller is not None and services.calibrator is not None
    before = services.controller.cost_model.spread
    for _ in range(12):  # past the spread's minimum samples, every TTFT 3x its prediction
        await completed(services, clock, 3.0)
    assert services.calibrator.spread.factors("ttft").p50 == pytest.approx(3.0)
    # The first completion rebuilt it (with the prior: too few samples yet); the later
    # ones, within the period, did not.
    assert services.controller.cost_model.spread.ttft_p50 == before.ttft_p50
    clock.advance(2 * SPREAD_PERIOD_S)
    services.refresh()  # before the next decision
    latest = services.controller.cost_model.spread
    factors = services.calibrator.spread
    assert latest.ttft_p50 == tuple(factors.factors("ttft", b).p50 for b in range(4))
    assert latest.ttft_p50[0] > 2.0


async def test_a_completion_a_period_after_the_last_rebuild_applies_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    services = wired(clock, monkeypatch)
    assert services.controller is not None and services.calibrator is not None
    for _ in range(12):
        clock.advance(2 * SPREAD_PERIOD_S)
        await completed(services, clock, 3.0)
    spread = services.controller.cost_model.spread
    assert spread.ttft_p50 == tuple(services.calibrator.spread.factors("ttft", b).p50
                                    for b in range(4))
    assert spread.ttft_p50[0] == pytest.approx(3.0)
