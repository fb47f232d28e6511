"""Online calibration without a server: a synthetic server with known timings, noise
and outliers. The fit must find it from priors far off either way, stay finite, follow
a change, survive a lost or corrupt file; the spread must give p90 predictions that
cover 90% of new requests; deadlines must use the quantile asked for."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import statistics
from collections.abc import Callable, Hashable
from dataclasses import replace
from pathlib import Path

import pytest

from sidecar.admission import (
    AdmissionController,
    AdmissionRequest,
    CostModel,
    Decision,
    Outcome,
    Rejected,
    ServerState,
)
from sidecar.admission.cost import LatencySpread, ModelInputs
from sidecar.calibration import (
    CalibrationFileError,
    CalibrationStore,
    Calibrator,
    RobustFit,
    Spread,
    health,
    read_calibration,
    warning_kind,
)
from sidecar.calibration.spread import quantile
from sidecar.model import Efficiency, ServedModel, custom_gpu, parse_config
from sidecar.model.latency import DEFAULT_EFFICIENCY
from sidecar.upstream import UpstreamView
from sidecar.upstream.server_metrics import HistogramTotals, ServerMetrics

from support.admission_fixtures import TINY_LLAMA, tiny_served

# A CPU-like server: its device figures, and how it really behaves on them (a roofline
# with overlap, host work per sequence and per request).
CPU = custom_gpu(24, 20, 0.5, name="cpu")
TRUTH = Efficiency(compute=0.3, bandwidth=0.5, per_layer_s=2e-4, per_step_s=3e-3,
                   per_request_s=8e-3, serial_fraction=0.22, per_sequence_s=9e-4)
PRIORS = {
    "generic": custom_gpu(80, 8000, 2250, name="generic"),
    "cpu x10": custom_gpu(240, 200, 5, name="cpu x10"),
    "cpu /20": custom_gpu(1.2, 1, 0.025, name="cpu /20"),
}


def on(gpu, efficiency: Efficiency | None = None) -> ServedModel:  # type: ignore[no-untyped-def]
    base = tiny_served()
    served = ServedModel(base.arch, base.deployment, gpu)
    return served if efficiency is None else served.with_efficiency(efficiency)


def request(rng: random.Random) -> tuple[int, int, int]:
    prompt, running = rng.randint(16, 900), rng.randint(0, 3)
    return prompt, running, prompt + rng.randint(8, 128)


def feed(calibrator: Calibrator, served: ServedModel, truth: ServedModel, count: int,
         rng: random.Random, outliers: float = 0.05) -> None:
    for _ in range(count):
        prompt, running, context = request(rng)
        ttft = truth.ttft(prompt, (context,) * running).seconds  # type: ignore[union-attr]
        tpot = truth.tpot((context,) * (running + 1)).seconds  # type: ignore[union-attr]
        noise = rng.lognormvariate(0, 0.05)
        if rng.random() < outliers:
            noise *= rng.choice((8.0, 0.1))  # a hiccup, or a clock glitch
        calibrator.observe_prefill(served, prompt, running, context, ttft * noise)
        calibrator.observe_decode(served, running + 1, context,
                                  tpot * rng.lognormvariate(0, 0.05))


def ratios(model: ServedModel, truth: ServedModel, seed: int) -> tuple[list[float], list[float]]:
    """true / predicted TTFT and TPOT of held-out requests."""
    rng = random.Random(seed)
    ttft, tpot = [], []
    for _ in range(200):
        prompt, running, context = request(rng)
        ttft.append(truth.ttft(prompt, (context,) * running).seconds  # type: ignore[union-attr]
                    / model.ttft(prompt, (context,) * running).seconds)  # type: ignore[union-attr]
        tpot.append(truth.tpot((context,) * (running + 1)).seconds  # type: ignore[union-attr]
                    / model.tpot((context,) * (running + 1)).seconds)  # type: ignore[union-attr]
    return ttft, tpot


def worst_log_error(values: list[float]) -> float:
    return max(abs(math.log(v)) for v in values)


@pytest.mark.parametrize("prior", sorted(PRIORS))
def test_finds_the_server_from_a_prior_off_either_way(prior: str) -> None:
    truth = on(CPU, TRUTH)
    served = on(PRIORS[prior])
    before = ratios(served, truth, 2)
    calibrator = Calibrator()
    feed(calibrator, served, truth, 100, random.Random(1))
    after = ratios(served.with_efficiency(calibrator.efficiency(served)), truth, 2)
    # The control: the prior alone is far off (by 2x or more at the median).
    assert max(abs(math.log(statistics.median(r))) for r in before) > math.log(2), before
    for quantity in after:
        assert statistics.median(quantity) == pytest.approx(1.0, abs=0.05)
        assert worst_log_error(quantity) < math.log(1.25)
    # The rates are the server's whatever the device was called: the same effective
    # FLOP/s as from the right figures.
    flops = calibrator.status(served)["rates"]["prefill_flops_per_s"]
    reference = Calibrator()
    feed(reference, on(CPU), truth, 100, random.Random(1))
    assert flops == pytest.approx(reference.status(on(CPU))["rates"]["prefill_flops_per_s"],
                                  rel=0.3)


Observe = Callable[[Calibrator, int, int, int, random.Random], None]


def prefill_ratio_after(truth: ServedModel, served: ServedModel, observe: Observe) -> float:
    """`observe` 150 of the sidecar's requests with others running (a prompt, the
    running count, the context; each with its decode from `truth`), fit, and return
    the fitted model's prefill over the truth's, median over 100 requests held out."""
    rng = random.Random(5)
    calibrator = Calibrator()
    for _ in range(150):
        prompt, running, context = request(rng)
        running = max(1, running)
        observe(calibrator, prompt, running, context, rng)
        tpot = truth.tpot((context,) * (running + 1))
        assert tpot is not None
        calibrator.observe_decode(served, running + 1, context,
                                  tpot.seconds * rng.lognormvariate(0, 0.03))
    fitted = served.with_efficiency(calibrator.efficiency(served))
    rng = random.Random(6)
    errors = []
    for _ in range(100):
        prompt, running, context = request(rng)
        running = max(1, running)
        true, predicted = (m.prefill(prompt, (context,) * running) for m in (truth, fitted))
        assert true is not None and predicted is not None
        errors.append(predicted.seconds / true.seconds)
    return statistics.median(errors)


def test_prefills_behind_prompts_ahead_are_learned_without_the_wait() -> None:
    """A request with prompts ahead of it waited for their steps, not the running
    requests' (`CostModel`): its observation is told so (`waited=False`) and fitted
    without the wait. Told it waited, the same times read as a faster server."""
    truth, served = on(CPU, TRUTH), on(PRIORS["generic"])
    fits = {}
    for told in (False, True):
        def observe(calibrator: Calibrator, prompt: int, running: int, context: int,
                    rng: random.Random, told: bool = told) -> None:
            ttft = truth.prefill(prompt, (context,) * running)
            assert ttft is not None
            calibrator.observe_prefill(served, prompt, running, context,
                                       ttft.seconds * rng.lognormvariate(0, 0.03),
                                       waited=told)

        fits[told] = prefill_ratio_after(truth, served, observe)
    assert fits[False] == pytest.approx(1.0, abs=0.05)
    assert fits[True] < 0.95  # the wait it did not have, taken out of its prefill


def test_prompts_side_by_side_under_a_long_prefill_threshold_are_learned_over_their_steps(
) -> None:
    """Behind prompts ahead under the threshold, `CostModel` prices their chunks and its
    own over the steps until its last (`ModelInputs.ahead_steps`): observations told
    those steps fit the server; the same times read as the tokens at the whole budget
    (one step here) read as a slower one."""
    truth = on(CPU, TRUTH).with_deployment(long_prefill_token_threshold=64)
    served = on(PRIORS["generic"]).with_deployment(long_prefill_token_threshold=64)
    fits = {}
    for told in (True, False):
        def observe(calibrator: Calibrator, prompt: int, running: int, context: int,
                    rng: random.Random, told: bool = told) -> None:
            steps = -(-prompt // 64)  # its own chunks, a prompt as long beside it
            ttft = truth.prefill_in_steps(2 * prompt, steps, (context,) * running)
            assert ttft is not None
            calibrator.observe_prefill(served, 2 * prompt, running, context,
                                       ttft.seconds * rng.lognormvariate(0, 0.03),
                                       waited=False, capped=False,
                                       in_steps=steps if told else 0)

        fits[told] = prefill_ratio_after(truth, served, observe)
    assert fits[True] == pytest.approx(1.0, abs=0.05)
    assert fits[False] > 1.25


def test_the_same_result_whatever_the_order_of_the_requests() -> None:
    truth, served = on(CPU, TRUTH), on(PRIORS["generic"])
    results = []
    for seed in (1, 2, 3):
        calibrator = Calibrator()
        feed(calibrator, served, truth, 100, random.Random(seed))
        fitted = served.with_efficiency(calibrator.efficiency(served))
        results.append([statistics.median(r) for r in ratios(fitted, truth, 9)])
    for quantity in zip(*results, strict=True):
        assert max(quantity) - min(quantity) < 0.05, results


def test_follows_a_change_after_a_restart() -> None:
    served = on(CPU)
    calibrator = Calibrator()
    feed(calibrator, served, on(CPU, TRUTH), 300, random.Random(3))
    faster = on(CPU, replace(TRUTH, compute=0.9, per_step_s=1e-3, per_layer_s=1e-4))
    calibrator.server_restarted()
    feed(calibrator, served, faster, 50, random.Random(4))
    for quantity in ratios(served.with_efficiency(calibrator.efficiency(served)), faster, 5):
        assert statistics.median(quantity) == pytest.approx(1.0, abs=0.1)


def test_learns_the_host_work_each_sequence_adds_to_a_step() -> None:
    """On a CPU server a decode step grows with the batch through host work per
    sequence (sampling, output processing, streaming), not through the roofline: the
    fit finds that cost and predicts TPOT at batch sizes it saw and between them."""
    served, truth = on(CPU), on(CPU, replace(TRUTH, per_sequence_s=1.5e-3))
    calibrator = Calibrator()
    feed(calibrator, served, truth, 300, random.Random(5))
    fitted = served.with_efficiency(calibrator.efficiency(served))
    for batch in (1, 2, 4):
        want = truth.tpot((300,) * batch).seconds  # type: ignore[union-attr]
        got = fitted.tpot((300,) * batch).seconds  # type: ignore[union-attr]
        assert got == pytest.approx(want, rel=0.1), batch
    # Without such a cost, much less of it is found.
    plain = Calibrator()
    feed(plain, served, on(CPU, replace(TRUTH, per_sequence_s=0.0)), 300, random.Random(5))
    assert plain.efficiency(served).per_sequence_s < 0.3 * calibrator.efficiency(
        served).per_sequence_s


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
    calibrator.observe_decode(served, 2, 150, served.tpot((150, 150)).seconds)  # type: ignore[union-attr]
    calibrator.observe_server(_view(0, 0, 2), _view(slow * 100, 100, 2), served)
    assert calibrator.status(served)["decode_observations"] == 1
    # Traffic that bypasses the sidecar: the histograms teach it.
    for i in range(1, 40):
        calibrator.observe_server(_view(slow * 100 * i, 100 * i, 2),
                                  _view(slow * 100 * (i + 1), 100 * (i + 1), 2), served)
    learned = served.with_efficiency(calibrator.efficiency(served)).tpot((150, 150))
    assert learned is not None and learned.seconds == pytest.approx(slow, rel=0.2)


def test_absurd_observations_never_produce_absurd_values() -> None:
    served = tiny_served()
    calibrator = Calibrator()
    for value in (0.0, -1.0, float("nan"), float("inf"), 1e9, 1e-12):
        calibrator.observe_prefill(served, 100, 1, 120, value)
        calibrator.observe_decode(served, 2, 120, value)
    fitted = calibrator.efficiency(served)
    for name, value in fitted.as_dict().items():
        assert math.isfinite(value) and value >= 0, name
    assert fitted.compute > 0 and fitted.bandwidth > 0
    assert fitted.per_step_s <= 5 and fitted.per_request_s <= 30


def test_robust_fit_bounds_the_influence_of_one_outlier() -> None:
    fit = RobustFit([1.0, 0.0], [(0.0, 100.0), (0.0, 1.0)])
    for x in range(1, 201):
        fit.observe([x / 100, 1.0], 2 * x / 100 + 0.01)
    assert fit.predict([1.0, 1.0]) == pytest.approx(2.01, rel=0.02)
    assert fit.predict([1.8, 1.0]) == pytest.approx(3.61, rel=0.02)
    before = fit.predict([1.0, 1.0])
    fit.observe([1.0, 1.0], 500.0)
    assert fit.predict([1.0, 1.0]) == pytest.approx(before, rel=0.02)


def test_spread_p90_covers_nine_in_ten_new_requests() -> None:
    rng = random.Random(7)
    spread = Spread()
    covered = total = 0
    for i in range(2000):
        predicted = rng.uniform(0.01, 1.0)
        observed = predicted * 1.3 * rng.lognormvariate(0, 0.3)  # biased and noisy
        if i >= 100:  # out of sample: judged before it is observed
            total += 1
            covered += observed <= predicted * spread.factors("ttft").p90
        spread.observe("ttft", observed, predicted)
    assert 0.86 <= covered / total <= 0.94
    assert spread.factors("ttft").p50 == pytest.approx(1.3, rel=0.1)
    # Nothing observed for TPOT: the prior spread.
    assert spread.factors("tpot").samples == 0 and spread.factors("tpot").p50 == 1.0


def test_spread_forgets_a_server_that_changed() -> None:
    spread = Spread()
    for _ in range(64):
        spread.observe("tpot", 1.0, 1.0)
    for _ in range(24):
        spread.observe("tpot", 2.0, 1.0)
    assert spread.factors("tpot").p50 == pytest.approx(2.0)
    spread.reset()
    assert spread.factors("tpot").samples == 0


def test_spread_factors_are_those_of_the_window_sorted_afresh() -> None:
    """The window keeps its values sorted as ratios come, leave and are re-priced: its
    factors equal those of the same ratios sorted from scratch at every step, through
    evictions, the drop of old ratios after a change (decided here by the rule, from
    scratch), and a rebase."""
    rng = random.Random(11)
    spread = Spread(window=16, recent=6)
    drops = 0
    seen: list[tuple[float, float, float]] = []  # (observed, predicted, as-of-now ratio)

    def expected() -> tuple[float, float]:
        values = sorted(o / p for o, p, _ in seen)
        rank = min(len(values), math.ceil((len(values) + 1) * 0.9))
        return quantile(values, 0.5), max(quantile(values, 0.5), values[rank - 1])

    for i in range(400):
        level = 1.0 if (i // 25) % 2 == 0 else 1.6  # a server that changes: drops
        predicted = rng.uniform(0.5, 1.5)
        observed = predicted * level * rng.lognormvariate(0, 0.3)
        spread.observe("ttft", observed, predicted, inputs=predicted)
        seen = [*seen, (observed, predicted, observed / predicted)][-16:]
        recent = min(6, len(seen) // 2)
        if recent >= 4:
            median_recent = quantile(sorted(r for _, _, r in seen[-recent:]), 0.5)
            median_all = quantile(sorted(r for _, _, r in seen), 0.5)
            if abs(math.log(median_recent / median_all)) > math.log(spread.shift):
                seen, drops = seen[-recent:], drops + 1
        window = spread._windows["ttft", None]
        assert [r.observed_s for r in window.ratios] == [o for o, _, _ in seen]
        factors = spread.factors("ttft")
        if len(seen) >= spread.min_samples:  # fewer: the prior factors
            assert (factors.p50, factors.p90) == pytest.approx(expected())
        if i == 250:  # a new model predicting 2x as long: every ratio halves
            spread.rebase(lambda _q, inputs: 2.0 * float(inputs))  # type: ignore[arg-type]
            seen = [(o, 2.0 * p, o / (2.0 * p)) for o, p, _ in seen]
            factors = spread.factors("ttft")
            assert (factors.p50, factors.p90) == pytest.approx(expected())
    assert drops >= 6  # every change of level, at least


def test_spread_keeps_loads_apart() -> None:
    """A request admitted beside 4 others waits for their steps more than the model's
    average says; one admitted alone does not: each load has its own factors."""
    spread = Spread()
    for _ in range(20):
        spread.observe("ttft", 1.0, 1.0, bucket=0)
        spread.observe("ttft", 2.0, 1.0, bucket=3)
    assert spread.factors("ttft", 0).p50 == pytest.approx(1.0)
    assert spread.factors("ttft", 3).p50 == pytest.approx(2.0)
    assert spread.factors("ttft", 1) == spread.factors("ttft")  # none of its own: all together
    served = tiny_served()
    factors = LatencySpread((1.0, 1.0, 1.0, 2.0), (1.5,) * 4, (1.0,) * 4, (1.2,) * 4)
    model = CostModel(served, factors)
    alone, crowded = model.cost(300, 20, running=0), model.cost(300, 20, running=5)
    assert alone.load_bucket == 0 and crowded.load_bucket == 3
    assert crowded.prefill_s == pytest.approx(2.0 * crowded.prefill_model_s)
    assert alone.prefill_s == pytest.approx(alone.prefill_model_s)


def test_a_cost_prices_the_same_request_again_from_its_inputs() -> None:
    """What the spread re-prices with: the model's own times of a request, from the
    inputs its cost kept, equal the cost's; another model prices them its own way."""
    model = CostModel(on(CPU, TRUTH), LatencySpread.uniform(2.0, 3.0, 1.5, 2.0))
    cost = model.cost(700, 40, running=2, mean_context=900, slowdown=1.4, cached_tokens=256)
    assert cost.model_inputs is not None
    assert model.model_s("ttft", cost.model_inputs) == pytest.approx(cost.prefill_model_s)
    assert model.model_s("tpot", cost.model_inputs) == pytest.approx(cost.tpot_model_s)
    slower = CostModel(on(PRIORS["cpu /20"], TRUTH))
    assert slower.model_s("ttft", cost.model_inputs) > 2 * cost.prefill_model_s


def test_spread_rebased_on_a_new_model_keeps_no_ratio_to_the_old_one() -> None:
    """A fit converging from a device 100x too slow: the requests' ratios to the prior
    would scale the new model's predictions down by as much as the prior was off;
    taken again against the new model they say what it leaves, about 1.3 (here: the
    server's noise and a bias the fit does not see)."""
    rng = random.Random(3)
    truth = on(CPU, TRUTH)
    prior = CostModel(on(custom_gpu(0.24, 0.2, 0.005, name="cpu /100")))
    fitted = CostModel(truth)
    spread = Spread()
    kept = Spread()  # the same ratios without their inputs: never re-priced
    for _ in range(40):
        prompt, running, context = request(rng)
        cost = prior.cost(prompt, 30, running=running, mean_context=context)
        assert cost.model_inputs is not None
        for quantity, predicted in (("ttft", cost.prefill_model_s), ("tpot", cost.tpot_model_s)):
            observed = fitted.model_s(quantity, cost.model_inputs) * 1.3 * rng.lognormvariate(
                0, 0.05)
            spread.observe(quantity, observed, predicted, cost.load_bucket, cost.model_inputs)
            kept.observe(quantity, observed, predicted, cost.load_bucket)
    for quantity in ("ttft", "tpot"):  # ratios to the prior: far from what the fit leaves
        assert abs(math.log(spread.factors(quantity).p50 / 1.3)) > math.log(1.5)

    def reprice(quantity: str, inputs: Hashable) -> float | None:
        return fitted.model_s(quantity, inputs) if isinstance(inputs, ModelInputs) else None

    spread.rebase(reprice)
    kept.rebase(reprice)
    for quantity in ("ttft", "tpot"):
        assert spread.factors(quantity).p50 == pytest.approx(1.3, rel=0.05)
        assert spread.factors(quantity).p90 == pytest.approx(1.3, rel=0.15)
        for bucket in range(4):
            assert spread.factors(quantity, bucket).p50 == pytest.approx(1.3, rel=0.05)
        # No inputs: nothing to re-price.
        assert abs(math.log(kept.factors(quantity).p50 / 1.3)) > math.log(1.5)
    # A predictor that cannot say leaves a ratio as it was.
    spread.rebase(lambda quantity, inputs: None)
    assert spread.factors("ttft").p50 == pytest.approx(1.3, rel=0.05)


def test_a_health_warning_is_the_same_kind_whatever_its_figures() -> None:
    """The log says each kind of warning once: a fit that moves from 3.8x to 2.9x the
    compute peak is the same warning, the bandwidth peak another one."""
    served = on(CPU)
    kinds = set()
    for scale in (0.2, 0.3):
        fast = served.with_efficiency(replace(TRUTH, compute=1 / scale, bandwidth=2 / scale))
        found = health(fast, 100)
        assert found is not None and len(found.warnings) == 2
        kinds.add(tuple(warning_kind(w) for w in found.warnings))
    assert len(kinds) == 1
    (compute, bandwidth), = kinds
    assert compute != bandwidth and "compute" in compute and "bandwidth" in bandwidth


def test_health_warns_of_a_device_that_is_not_the_one_named() -> None:
    served = on(CPU)
    calibrator = Calibrator()
    feed(calibrator, served, on(CPU, TRUTH), 60, random.Random(1))
    assert calibrator.status(served)["health"]["warnings"] == []
    # Told it is a much faster device than it is: "the server runs Nx slower".
    h100 = on(custom_gpu(80, 3350, 989, name="H100-like"))
    slow = Calibrator()
    feed(slow, h100, on(CPU, TRUTH), 60, random.Random(1))
    found = slow.status(h100)["health"]
    assert any("prefill runs" in w and "slower than H100-like" in w
               for w in found["warnings"]), found
    assert found["slowdown_vs_device"]["prefill"] > 100
    # Told it is a much slower device: it runs faster than that device's peak.
    tiny = on(PRIORS["cpu /20"])
    fast = Calibrator()
    feed(fast, tiny, on(CPU, TRUTH), 60, random.Random(1))
    assert any("peak of cpu /20" in w for w in fast.status(tiny)["health"]["warnings"])
    # The generic stand-in (no --gpu) is reported, never warned about.
    generic = on(PRIORS["generic"])
    quiet = Calibrator()
    feed(quiet, generic, on(CPU, TRUTH), 60, random.Random(1))
    assert quiet.status(generic, device_named=False)["health"]["warnings"] == []
    checked = health(generic.with_efficiency(quiet.efficiency(generic)), 60)
    assert checked is not None and checked.compute_efficiency < 0.01


def test_calibration_survives_restarts_through_a_file_it_can_lose(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    served = on(CPU)
    path = tmp_path / "calibration.json"
    first = Calibrator(CalibrationStore(str(path)))
    feed(first, served, on(CPU, TRUTH), 120, random.Random(5))
    saved = json.loads(path.read_text())
    assert saved["key"] == Calibrator.key(served) and saved["format"] == 2
    second = Calibrator(CalibrationStore(str(path)))
    warm = second.efficiency(served)
    assert warm.compute == pytest.approx(saved["efficiency"]["compute"])
    path.write_text("{corrupt")
    third = Calibrator(CalibrationStore(str(path)))
    assert third.efficiency(served) == served.efficiency  # relearns from the prior
    path.write_text(json.dumps({**saved, "key": "another|model|tp1"}))
    with caplog.at_level(logging.WARNING):
        assert Calibrator(CalibrationStore(str(path))).efficiency(served) == served.efficiency
    assert "it is for another|model|tp1" in caplog.text  # a warning: the file is ignored
    path.write_text(json.dumps({**saved, "efficiency": {"compute": -1}}))
    assert Calibrator(CalibrationStore(str(path))).efficiency(served) == served.efficiency


def test_one_reader_names_what_is_wrong(tmp_path: Path) -> None:
    path = tmp_path / "cal.json"
    for content, message in (
        ("{corrupt", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        (json.dumps({"format": 99, "efficiency": {}}), "unknown format 99"),
        (json.dumps({"key": 3, "efficiency": {}}), "'key' must be a string"),
        (json.dumps({"rates": {}}), "no 'efficiency' object"),
        (json.dumps({"efficiency": {"bandwidth": "fast"}}), "bandwidth must be a number"),
        (json.dumps({"efficiency": {"compute": 0}}), "compute must be a positive number"),
        (json.dumps({"efficiency": {"kv_bandwidth_ratio": -0.5}}),
         "kv_bandwidth_ratio must be a positive number"),
        (json.dumps({"efficiency": {"kv_bandwidth_ratio": float("nan")}}),
         "kv_bandwidth_ratio must be a positive number"),
    ):
        path.write_text(content)
        with pytest.raises(CalibrationFileError, match=message) as caught:
            read_calibration(path)
        assert str(path) in str(caught.value)
    with pytest.raises(CalibrationFileError, match="cannot read"):
        read_calibration(tmp_path / "missing.json")
    # A file from GET /kvgate/v1/calibration (no format), beyond the named device's peak.
    path.write_text(json.dumps({"key": "m|cpu|tp1", "efficiency": {"compute": 3.0}}))
    saved = read_calibration(path)
    assert saved.efficiency.compute == 3.0 and saved.device == "cpu"
    # A file written before the KV share was a term fitted its memory rate with the KV
    # cache at the weights' bandwidth: it is read so, whatever the prior's share is.
    assert saved.efficiency.kv_bandwidth_ratio == 1.0
    assert DEFAULT_EFFICIENCY.kv_bandwidth_ratio < 1.0
    path.write_text(json.dumps({"efficiency": {"compute": 3.0, "kv_bandwidth_ratio": 0.4}}))
    assert read_calibration(path).efficiency.kv_bandwidth_ratio == 0.4


def test_the_fit_keeps_the_prior_s_kv_share_in_what_it_measures_and_returns() -> None:
    # A server whose KV cache streams at the prior's share of its bandwidth: the fit's
    # features price the KV bytes at that share, as its returned model does, so the
    # server is found at long contexts too, where the KV cache is most of a step.
    truth = on(CPU, replace(TRUTH, kv_bandwidth_ratio=DEFAULT_EFFICIENCY.kv_bandwidth_ratio))
    served = on(CPU)
    calibrator = Calibrator()
    feed(calibrator, served, truth, 100, random.Random(1))
    fitted = served.with_efficiency(calibrator.efficiency(served))
    assert fitted.efficiency.kv_bandwidth_ratio == DEFAULT_EFFICIENCY.kv_bandwidth_ratio
    for batch, context in ((1, 900), (4, 900), (4, 300)):
        ours = fitted.tpot((context,) * batch)
        real = truth.tpot((context,) * batch)
        assert ours is not None and real is not None
        assert ours.seconds == pytest.approx(real.seconds, rel=0.05), (batch, context)


def test_the_bandwidth_warned_about_is_the_kv_cache_s() -> None:
    # What one server's contexts identify is the KV cache's share of the peak (the
    # weights' time moves with the cost per step): a fit whose weights' share reads 1.5
    # at a KV share of 0.382 streams the KV cache at 57% of the peak, which is no sign
    # of another device; at 3.0 it is (115%).
    ratio = DEFAULT_EFFICIENCY.kv_bandwidth_ratio
    warned = []
    for bandwidth in (1.5, 3.0):
        fitted = on(CPU, replace(DEFAULT_EFFICIENCY, bandwidth=bandwidth))
        checked = health(fitted, 1000)
        assert checked is not None
        warned.append([w for w in checked.warnings if "bandwidth peak" in w])
    assert warned[0] == []
    assert warned[1] == [f"the server reaches {3.0 * ratio:.1f}x the bandwidth peak of cpu: it "
                         "is not that device, or the device's figures are too low (--gpu)"]


def test_a_new_model_on_the_same_device_starts_from_the_last_fit() -> None:
    served = on(CPU)
    calibrator = Calibrator()
    feed(calibrator, served, on(CPU, TRUTH), 100, random.Random(1))
    learned = calibrator.efficiency(served)
    base = tiny_served()
    bigger = ServedModel(parse_config({**TINY_LLAMA, "num_hidden_layers": 8}, "tiny-llama-8"),
                         base.deployment, CPU)
    assert Calibrator.key(bigger) != Calibrator.key(served)
    assert calibrator.efficiency(bigger).compute == pytest.approx(learned.compute)


# ---- the deadline quantile -------------------------------------------------------------

def test_costs_carry_p50_and_p90_and_deadlines_use_the_one_asked_for() -> None:
    served = tiny_served()
    spread = LatencySpread.uniform(ttft_p50=1.1, ttft_p90=2.0, tpot_p50=0.9, tpot_p90=1.5)
    p50 = CostModel(served, spread).cost(300, 50)
    p90 = CostModel(served, spread, "p90").cost(300, 50)
    assert p50.prefill_s == pytest.approx(1.1 * p50.prefill_model_s)
    assert p50.prefill_p90_s == pytest.approx(2.0 * p50.prefill_model_s)
    assert p50.tpot_s == pytest.approx(0.9 * p50.tpot_model_s)
    assert p50.tpot_p90_s == pytest.approx(1.5 * p50.tpot_model_s)
    assert p50.deadline_prefill_s == p50.prefill_s
    assert p90.deadline_prefill_s == p90.prefill_p90_s


def test_a_target_between_p50_and_p90_is_refused_only_on_p90() -> None:
    served = tiny_served()
    spread = LatencySpread.uniform(ttft_p50=1.0, ttft_p90=50.0)

    async def decide(quantile: str, target_s: float) -> Decision | None:
        controller = AdmissionController(CostModel(served, spread, quantile))  # type: ignore[arg-type]
        controller.update_server(ServerState(num_blocks=64, used_blocks=0))
        # Fill the cache so that the request would wait: its deadline decides then.
        holder = await controller.admit(AdmissionRequest(prompt_tokens=600, max_tokens=300))
        try:
            waiter = await asyncio.wait_for(controller.admit(AdmissionRequest(
                prompt_tokens=300, max_tokens=20, ttft_slo_s=target_s)), 0.05)
            waiter.finish(completed=True)
        except Rejected as rejected:
            return rejected.decision
        except TimeoutError:
            return None  # queued: waiting for the holder to finish
        finally:
            holder.finish(completed=True)
        return None

    impossible = asyncio.run(decide("p50", 1e-3))
    assert impossible is not None and impossible.outcome is Outcome.DEADLINE
    median = float(impossible.details["predicted_ttft_s"])  # type: ignore[arg-type]
    target = 1.05 * median  # past the median, far short of the p90
    assert asyncio.run(decide("p50", target)) is None
    refused = asyncio.run(decide("p90", target))
    assert refused is not None and refused.outcome is Outcome.DEADLINE, refused


def test_the_prefill_load_is_rescaled_when_the_model_is_recalibrated() -> None:
    """The prefill load is the predicted prefill seconds admitted lately. Admitted under
    a prior 20x too slow, it would saturate and stretch every prediction for its time
    constant after calibration had found the server; recalibrating re-expresses it in
    the new model's seconds."""
    slow, right = CostModel(on(PRIORS["cpu /20"])), CostModel(on(CPU))
    ctl = _admitted_prefills(slow)
    now = ctl.clock()
    loaded = ctl.prefill_load.utilisation(now)
    ratio = right.prefill_work_s(512) / slow.prefill_work_s(512)
    assert ratio < 0.5  # the prior prices a prefill several times too long
    ctl.set_cost_model(right)
    assert 0 < loaded < 0.8  # below the cap: the rescaled load is exact
    assert ctl.prefill_load.utilisation(now) == pytest.approx(loaded * ratio)
    # The load now matches what the same prefills cost under the new model (the
    # prompts are the reference size; a few ms pass between the two readings).
    fresh = _admitted_prefills(right)
    assert ctl.prefill_load.utilisation(now) == pytest.approx(
        fresh.prefill_load.utilisation(fresh.clock()), rel=0.05)


def _admitted_prefills(model: CostModel) -> AdmissionController:
    """A controller that has admitted (and settled) six prompts of the reference size."""
    ctl = AdmissionController(model)
    ctl.update_server(ServerState(available=True))

    async def scenario() -> None:
        for _ in range(6):
            ticket = await ctl.admit(AdmissionRequest(prompt_tokens=512, max_tokens=4))
            ticket.finish()  # type: ignore[attr-defined]

    asyncio.run(scenario())
    return ctl
