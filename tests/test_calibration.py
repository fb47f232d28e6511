"""Online calibration without a server: a synthetic server with known efficiencies,
noise and outliers; the fit must recover its timings, stay physical, follow a change
and survive a lost or corrupt file."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from sidecar.calibration import CalibrationStore, Calibrator, RobustLine
from sidecar.model import Efficiency
from sidecar.upstream import UpstreamView
from sidecar.upstream.server_metrics import HistogramTotals, ServerMetrics

from support.admission_fixtures import tiny_served


def timings(served, efficiency: Efficiency, prompt: int, batch: int, context: int):  # type: ignore[no-untyped-def]
    truth = served.with_efficiency(efficiency)
    ttft = truth.ttft(prompt, (context,) * batch).seconds
    tpot = truth.tpot((context,) * (batch + 1)).seconds
    return ttft, tpot


def feed(calibrator: Calibrator, served, truth: Efficiency, count: int,  # type: ignore[no-untyped-def]
         rng: random.Random, outliers: float = 0.05) -> None:
    for _ in range(count):
        prompt, batch = rng.randint(16, 900), rng.randint(0, 7)
        context = prompt + rng.randint(8, 128)
        ttft, tpot = timings(served, truth, prompt, batch, context)
        noise = rng.lognormvariate(0, 0.05)
        if rng.random() < outliers:
            noise *= rng.choice((8.0, 0.1))  # a hiccup, or a clock glitch
        calibrator.observe_prefill(served, prompt, batch, context, ttft * noise)
        calibrator.observe_decode(served, batch + 1, context, tpot * rng.lognormvariate(0, 0.05))


def errors(served, fitted: Efficiency, truth: Efficiency, rng: random.Random):  # type: ignore[no-untyped-def]
    ttft_errors, tpot_errors = [], []
    for _ in range(200):
        prompt, batch = rng.randint(16, 900), rng.randint(0, 7)
        context = prompt + 64
        true_ttft, true_tpot = timings(served, truth, prompt, batch, context)
        got_ttft, got_tpot = timings(served, fitted, prompt, batch, context)
        ttft_errors.append(abs(got_ttft - true_ttft) / true_ttft)
        tpot_errors.append(abs(got_tpot - true_tpot) / true_tpot)
    return sorted(ttft_errors)[100], sorted(tpot_errors)[100]


TRUTH = Efficiency(compute=0.08, bandwidth=0.35, per_layer_s=2e-4, per_step_s=3e-3,
                   per_request_s=8e-3, serial_fraction=0.22)


def test_recovers_a_server_far_from_the_prior() -> None:
    served = tiny_served()
    rng = random.Random(1)
    calibrator = Calibrator()
    before = errors(served, calibrator.efficiency(served), TRUTH, random.Random(2))
    feed(calibrator, served, TRUTH, 300, rng)
    fitted = calibrator.efficiency(served)
    after = errors(served, fitted, TRUTH, random.Random(2))
    assert max(before) > 0.5  # the prior is far off
    assert max(after) < 0.10, (before, after, fitted)
    for name, value in fitted.as_dict().items():
        assert value >= 0, name
    assert 0 < fitted.compute <= 1 and 0 < fitted.bandwidth <= 1


def test_follows_a_change_after_a_restart() -> None:
    served = tiny_served()
    rng = random.Random(3)
    calibrator = Calibrator()
    feed(calibrator, served, TRUTH, 300, rng)
    faster = replace(TRUTH, compute=0.2, per_step_s=1e-3, per_layer_s=1e-4)
    calibrator.server_restarted()
    feed(calibrator, served, faster, 100, rng)
    assert max(errors(served, calibrator.efficiency(served), faster, random.Random(4))) < 0.15


def test_learns_the_host_work_each_sequence_adds_to_a_step() -> None:
    """On a CPU server a decode step grows with the batch through host work per
    sequence (sampling, output processing, streaming), not through the roofline: the
    fit finds that cost and predicts TPOT at batch sizes in between."""
    served = tiny_served()
    truth = replace(TRUTH, per_sequence_s=1.5e-3)
    calibrator = Calibrator()
    feed(calibrator, served, truth, 300, random.Random(5))
    fitted = calibrator.efficiency(served)
    assert fitted.per_sequence_s == pytest.approx(1.5e-3, rel=0.2)
    for batch in (1, 4, 8):
        want = served.with_efficiency(truth).tpot((300,) * batch).seconds
        got = served.with_efficiency(fitted).tpot((300,) * batch).seconds
        assert got == pytest.approx(want, rel=0.1), batch
    # Without such a cost the term stays at (about) zero.
    plain = Calibrator()
    feed(plain, served, TRUTH, 300, random.Random(5))
    assert plain.efficiency(served).per_sequence_s < 2e-4


def _view(itl_sum: float, itl_count: float, running: int) -> UpstreamView:
    histograms = {"itl": HistogramTotals(itl_sum, itl_count),
                  "prompt_tokens": HistogramTotals(itl_count * 100, itl_count),
                  "generation_tokens": HistogramTotals(itl_count * 50, itl_count)}
    return UpstreamView(up=True, metrics=ServerMetrics(running=running, histograms=histograms))


def test_server_histograms_count_only_without_the_sidecars_own_traffic() -> None:
    served = tiny_served()
    slow = 0.5  # s per token: far from anything the prior predicts
    calibrator = Calibrator()
    prior = calibrator.efficiency(served)
    # The sidecar has requests in flight, or observed some since the last scrape: the
    # server's histograms are left to the sidecar's own observations.
    calibrator.observe_server(_view(0, 0, 2), _view(slow * 100, 100, 2), served,
                              sidecar_traffic=True)
    assert calibrator.efficiency(served) == prior
    calibrator.observe_decode(served, 2, 150, served.tpot((150, 150)).seconds)
    calibrator.observe_server(_view(0, 0, 2), _view(slow * 100, 100, 2), served)
    assert calibrator.status(served)["decode_observations"] == 1
    # Traffic that bypasses the sidecar: the histograms teach it.
    for i in range(1, 40):
        calibrator.observe_server(_view(slow * 100 * i, 100 * i, 2),
                                  _view(slow * 100 * (i + 1), 100 * (i + 1), 2), served)
    learned = served.with_efficiency(calibrator.efficiency(served)).tpot((150, 150)).seconds
    assert learned == pytest.approx(slow, rel=0.2)


def test_absurd_observations_never_produce_absurd_values() -> None:
    served = tiny_served()
    calibrator = Calibrator()
    for value in (0.0, -1.0, float("nan"), float("inf"), 1e9, 1e-12):
        calibrator.observe_prefill(served, 100, 1, 120, value)
        calibrator.observe_decode(served, 2, 120, value)
    fitted = calibrator.efficiency(served)
    assert 0.001 <= fitted.compute <= 1 and 0.001 <= fitted.bandwidth <= 1
    assert 0 <= fitted.per_step_s <= 2 and 0 <= fitted.per_request_s <= 2


def test_robust_line_bounds_the_influence_of_one_outlier() -> None:
    line = RobustLine(1.0, 0.0, (1.0, 100.0), (0.0, 1.0))
    for x in range(1, 201):
        line.observe(x / 100, 2 * x / 100 + 0.01)

    def at(x: float) -> float:
        slope, intercept = line.estimate()
        return slope * x + intercept

    # In the range it has seen, the fit predicts the line (the prior, slope 1 and
    # intercept 0, still trades a little slope for intercept).
    assert at(1.0) == pytest.approx(2.01, rel=0.05) and at(1.8) == pytest.approx(3.61, rel=0.05)
    before = at(1.0)
    line.observe(1.0, 500.0)
    assert at(1.0) == pytest.approx(before, rel=0.02)


def test_calibration_survives_restarts_through_a_file_it_can_lose(tmp_path: Path) -> None:
    served = tiny_served()
    path = tmp_path / "calibration.json"
    first = Calibrator(CalibrationStore(str(path)))
    feed(first, served, TRUTH, 120, random.Random(5))
    saved = json.loads(path.read_text())
    assert saved["key"] == Calibrator.key(served)
    second = Calibrator(CalibrationStore(str(path)))
    warm = second.efficiency(served)
    assert warm.compute == pytest.approx(saved["efficiency"]["compute"])
    path.write_text("{corrupt")
    third = Calibrator(CalibrationStore(str(path)))
    assert third.efficiency(served) == served.efficiency  # relearns from the prior
    path.write_text(json.dumps({**saved, "key": "another|model"}))
    assert Calibrator(CalibrationStore(str(path))).efficiency(served) == served.efficiency
