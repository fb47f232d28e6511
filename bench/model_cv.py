#!/usr/bin/env python3
"""Out-of-sample accuracy of the latency model: the fit of its physics terms,
cross-validated by model family, against the public measurements in tests/data.

    python bench/model_cv.py [--json bench/results/model_cv.json]
    python bench/model_cv.py --fit

`--fit` runs the same fit once on every usable row and sets it beside the constants
`kvgate plan` and the sidecar ship with (`DEFAULT_EFFICIENCY`, `ENGINE_TERMS`): these
are that fit's figures to three digits, so the out-of-fold errors below are those of
the procedure that made the shipped constants.

The fit (`fit`) moves only terms that are physics or engine properties, never a
per-model or per-GPU constant: the hardware efficiencies shared by every row
(bandwidth, per-layer cost, serial fraction), and each serving engine's share of peak
FLOP/s (its kernels) and host
costs (per step, per request, per all-reduce). It starts from a fixed textbook prior
(`NEUTRAL_START`), not from the committed constants, so no fold sees the rows it is
tested on, even through its starting point; and from the same prior with each engine's
cost per request at 2, 10 or 30 ms (`PER_REQUEST_STARTS_S`), keeping the start that
fits the training rows best. An engine's FLOP/s share is fitted only on
rows that time a prefill (not a prompt the benchmark's warm-up left cached), at least
`MIN_ROWS_PER_ENGINE` of them: vLLM's public rows hold ten (nine of Llama 3's, one
request at a time, and Qwen3-14B-AWQ's 16,000 tokens), so with Llama 3 held out vLLM
keeps the prior's half of peak.

Then, on the engine's rows under load (bursts and closed loops, at least
`MIN_ROWS_PER_ENGINE`), the share of the weights' bandwidth its attention kernels reach
on the KV cache (`fit_kv_bandwidth`): one request at a time a step reads one sequence's
cache beside all the weights, so only many sequences a step show it.

Leave one model family out (`FAMILIES`; a model outside them is a family of its own,
`model_family`): for each family, the terms are fitted on the rows of every other
family (one request at a time; the KV share under load) and then predict the held
family's rows:

- steady rows (concurrency 1): TTFT and TPOT by `steady_latency`, as `kvgate plan`;
- burst rows (N prompts sent at once, concurrency > 1): mean TTFT and TPOT from the
  engine simulator (`sidecar.model.simulator`), as `kvgate plan` now answers;
- closed-loop rows (C clients, each sending its next request when its last one ends, as
  `vllm bench serve --max-concurrency C` does, or after the short pause the row's client
  took): the median TTFT, TPOT and inter-token latency that the row gives, from the
  simulator's closed loop. Their band is that of
  C; the ITL (the median gap between two tokens, which no other row gives) is reported
  beside the TPOT, never in its place.

Every figure printed is out of fold: each row is predicted by constants fitted without
its family. An engine whose rows all belong to the held family keeps the prior for its
host costs (nothing is fitted on fewer than `MIN_ROWS_PER_ENGINE` rows).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import multiprocessing
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for _extra in (ROOT, ROOT / "tests"):
    if str(_extra) not in sys.path:
        sys.path.insert(0, str(_extra))

from sidecar.cli.table import render  # noqa: E402
from sidecar.model import ServedModel  # noqa: E402
from sidecar.model.latency import (  # noqa: E402
    DEFAULT_EFFICIENCY,
    ENGINE_TERMS,
    TENSORRT_LLM,
    VLLM,
    Efficiency,
    EngineTerms,
)
from sidecar.model.simulator import EngineConfig, SimRequest, Trace, simulate  # noqa: E402
from sidecar.model.simulator_workload import ClosedLoop, Lengths  # noqa: E402

from support.groundtruth import LatencyCase, latency_cases, predict_steady  # noqa: E402

ENGINES = (VLLM, TENSORRT_LLM)

# Model families: a family shares its architecture and its makers' choices, so holding
# one out asks the fit to predict a model it has never seen.
FAMILIES = {"llama-2": "Llama-2", "llama-3": "Llama-3", "mistral": "Mistral-7B",
            "mixtral": "Mixtral", "qwen": "Qwen", "gpt-oss": "gpt-oss"}

# A fixed prior, not fitted to any row: half of peak FLOP/s (per engine), 70% of peak
# bandwidth (the KV cache's traffic as fast as the weights'), 20 us per layer, overlap
# complete, 1 ms per step, 10 ms per request, 10 us per all-reduce.
NEUTRAL_START: dict[str, float] = {
    "bandwidth": 0.7, "per_layer_s": 20e-6, "serial_fraction": 0.0,
    **{f"{engine}.{name}": value for engine in ENGINES for name, value in
       (("compute", 0.5), ("per_step_s", 1e-3), ("per_request_s", 10e-3),
        ("allreduce_latency_s", 10e-6), ("kv_bandwidth_ratio", 1.0))},
}
HARDWARE = (("bandwidth", 0.3, 1.0), ("per_layer_s", 0.0, 2e-4),
            ("serial_fraction", 0.0, 1.0))
ENGINE_BOUNDS = (("compute", 0.2, 1.0), ("per_step_s", 0.0, 1e-2), ("per_request_s", 0.0, 0.1),
                ("allreduce_latency_s", 0.0, 1e-4))
# The share of the weights' bandwidth an engine's attention kernels reach on the KV
# cache, fitted on the engine's rows under load after the rest (`fit_kv_bandwidth`):
# one request at a time, a step reads one sequence's cache beside all the weights.
KV_RATIO = "kv_bandwidth_ratio"
ENGINE_TERM_NAMES = (*(name for name, _, _ in ENGINE_BOUNDS), KV_RATIO)
MIN_ROWS_PER_ENGINE = 3
BANDS = ("concurrency 1", "concurrency > 1")


def model_family(model: str) -> str:
    """The model's family in FAMILIES; a model outside them is a family of its own: its
    name without organisation and size (`google/gemma-2-27b-it` -> `gemma-2`)."""
    for name, marker in FAMILIES.items():
        # The marker as a word of the name: "Llama-3" in Meta-Llama-3.1-8B, not in
        # CodeLlama-34b or Llama-30b.
        if re.search(rf"(?<![a-z]){re.escape(marker)}(?![0-9])", model, re.IGNORECASE):
            return name
    stem = model.rsplit("/", 1)[-1].split(" (", maxsplit=1)[0].strip().lower()
    return re.split(r"-(?:\d+x)?\d+(?:\.\d+)?[bm](?![a-z])", stem)[0]


def family(case: LatencyCase) -> str:
    return model_family(case.model)


@cache
def _sources() -> dict[str, str]:
    """Each latency row's source: the repository its source_url names."""
    with (ROOT / "tests" / "data" / "groundtruth" / "latency.csv").open(
            encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle))
    return {f"latency.csv:{line}": _source_of(row["source_url"])
            for line, row in enumerate(rows, start=1)}


def _source_of(url: str) -> str:
    """A GitHub repository (`owner/name`), or the site that published the figures."""
    parts = url.split("/")
    return "/".join(parts[3:5]) if parts[2] == "github.com" else parts[2]


def source(case: LatencyCase) -> str:
    return _sources()[case.ref]


GROUPINGS: dict[str, Callable[[LatencyCase], str]] = {"family": family, "source": source}


def usable_cases() -> list[LatencyCase]:
    """Rows with a config, a GPU and the figures their kind is predicted on: TTFT and
    TPOT one request at a time or in a burst; at least the TTFT in a closed loop."""
    return [c for c in latency_cases() if c.usable and c.ttft_ms is not None
            and (c.tpot_ms is not None or c.kind == "closed")]


def efficiency_for(values: dict[str, float], engine: str) -> Efficiency:
    """The efficiency of `engine`'s rows under the fit's `values`."""
    base = replace(DEFAULT_EFFICIENCY, **{name: values[name] for name, _, _ in HARDWARE})
    return base.with_engine(EngineTerms(
        **{name: values[f"{engine}.{name}"] for name in ENGINE_TERM_NAMES}))


def committed_values() -> dict[str, float]:
    """The shipped constants (`DEFAULT_EFFICIENCY`, `ENGINE_TERMS`) as the fit's values."""
    values = {name: float(getattr(DEFAULT_EFFICIENCY, name)) for name, _, _ in HARDWARE}
    for engine in ENGINES:
        for name in ENGINE_TERM_NAMES:
            values[f"{engine}.{name}"] = float(getattr(ENGINE_TERMS[engine], name))
    return values


def differing_terms(fitted: dict[str, float], committed: dict[str, float],
                    rel: float = 5e-3) -> list[str]:
    """The terms whose committed figure is not the fitted one to three digits."""
    return [name for name, value in fitted.items()
            if not math.isclose(value, committed[name], rel_tol=rel, abs_tol=1e-12)]


class _WarmCase:
    """A case whose served model keeps what no efficiency changes (weights, KV specs,
    matmul parameters) across the fit's thousands of efficiencies: `predict_steady`
    gives the same figures, several times faster."""

    def __init__(self, case: LatencyCase) -> None:
        self.case = case
        self.base: ServedModel = case.served()
        self.input_len, self.output_len = case.input_len, case.output_len
        self.cached_tokens, self.engine = case.cached_tokens, case.engine
        self.num_prompts, self.tpot_priced = case.num_prompts, case.tpot_priced
        self.ttft_ms, self.tpot_ms = case.ttft_ms, case.tpot_ms
        base_roofline = self.base.roofline
        assert base_roofline is not None
        self.matmul_params = base_roofline._matmul_params
        self.warm = {name: getattr(self.base, name) for name in ("weights", "kv_specs")}

    def served(self) -> _WarmServed:
        return _WarmServed(self)


class _WarmServed:
    def __init__(self, warm: _WarmCase) -> None:
        self.warm = warm

    def with_efficiency(self, efficiency: Efficiency) -> ServedModel:
        base = self.warm.base
        served = base.with_efficiency(efficiency)
        served.__dict__.update(self.warm.warm)
        roofline = served.roofline
        assert roofline is not None
        object.__setattr__(roofline, "_matmul_params", self.warm.matmul_params)
        return served


def objective(cases: Sequence[LatencyCase]) -> Callable[[dict[str, float]], float]:
    """Mean over engines of the median |log(model / measured)| of steady TTFT and TPOT:
    each engine's host costs answer to its own rows, the hardware terms to all."""
    warm = [_WarmCase(case) for case in cases]
    check = efficiency_for(NEUTRAL_START, VLLM)
    for one in warm[:3]:
        assert predict_steady(one, check) == predict_steady(one.case, check)

    def score(values: dict[str, float]) -> float:
        errors: dict[str, list[float]] = {}
        for case in warm:
            assert case.ttft_ms is not None and case.tpot_ms is not None
            ttft, tpot = predict_steady(case, efficiency_for(values, case.engine))
            engine = errors.setdefault(case.engine, [])
            engine.append(abs(math.log(ttft * 1e3 / case.ttft_ms)))
            if case.tpot_priced:
                engine.append(abs(math.log(tpot * 1e3 / case.tpot_ms)))
        return statistics.fmean(statistics.median(v) for v in errors.values())

    return score


# Where the search starts each engine's cost per request. The median objective is flat
# over wide stretches of it (a few rows move at a time), so a search from one start
# stops where it began; it runs from each of these (2 ms, a C++ runtime's; 10 ms; 30
# ms, an HTTP server's) and keeps the start that fits the training rows best.
PER_REQUEST_STARTS_S = (2e-3, 10e-3, 30e-3)


def fit(cases: Sequence[LatencyCase], rounds: int = 5,
        starts_s: Sequence[float] = PER_REQUEST_STARTS_S) -> dict[str, float]:
    """Coordinate search over the physics and engine terms, on the steady rows of
    `cases`, from NEUTRAL_START with each fitted engine's cost per request started at
    each of `starts_s`; the lowest training objective wins (the first start
    on a tie). Engines with fewer than MIN_ROWS_PER_ENGINE rows keep the prior. Then
    each engine's KV cache bandwidth, on its rows under load (`fit_kv_bandwidth`).
    Deterministic."""
    steady = [c for c in cases if c.kind == "steady"]
    rows = {engine: sum(1 for c in steady if c.engine == engine) for engine in ENGINES}
    bounds = {name: (low, high) for name, low, high in HARDWARE}
    prefills = {engine: sum(1 for c in steady if c.engine == engine and c.prefill_measured)
                for engine in ENGINES}
    fitted = [engine for engine in ENGINES if rows[engine] >= MIN_ROWS_PER_ENGINE]
    for engine in fitted:
        for name, low, high in ENGINE_BOUNDS:
            if name != "compute" or prefills[engine] >= MIN_ROWS_PER_ENGINE:
                bounds[f"{engine}.{name}"] = (low, high)
    score = objective(steady)
    best: tuple[float, dict[str, float]] | None = None
    for per_request in itertools.product(starts_s, repeat=len(fitted)):
        start = {**NEUTRAL_START, **{f"{engine}.per_request_s": value
                                      for engine, value in zip(fitted, per_request, strict=True)}}
        values, value_score = _coordinate_search(score, bounds, start, rounds)
        if best is None or value_score < best[0] - 1e-9:
            best = (value_score, values)
    assert best is not None
    values = best[1]
    for engine in fitted:
        loaded = [c for c in cases if c.kind != "steady" and c.engine == engine]
        if len(loaded) >= MIN_ROWS_PER_ENGINE:
            values = fit_kv_bandwidth(values, engine, loaded)
    return values


# The KV cache's share of the weights' bandwidth the fit tries, then refined around
# the best by factors of 2^(1/4) and 2^(1/8) (never above 1).
KV_RATIO_GRID = (1.0, 0.71, 0.5, 0.35, 0.25)
# Requests per client of a closed-loop row while fitting (20 when predicting): its
# medians move by about 1%, five times faster.
FIT_REQUESTS_PER_CLIENT = 5


def fit_kv_bandwidth(values: dict[str, float], engine: str,
                     loaded: Sequence[LatencyCase]) -> dict[str, float]:
    """`values` with the engine's KV cache bandwidth (its share of the weights') fitted on
    its rows under load (`loaded`: bursts and closed loops, by the engine simulator),
    where many sequences' caches are read each step: the median |log(model /
    measured)| of their TTFT and TPOT, over KV_RATIO_GRID and then around the best. The
    largest of equal scores wins (the prior's 1 first); deterministic."""
    name = f"{engine}.{KV_RATIO}"

    def score(ratio: float) -> float:
        efficiency = efficiency_for({**values, name: ratio}, engine)
        errors = []
        for case in loaded:
            assert case.ttft_ms is not None
            if case.kind == "closed":
                ttft, tpot, _ = predict_closed(case, efficiency, FIT_REQUESTS_PER_CLIENT)
            else:
                ttft, tpot = predict_burst(case, efficiency)
            errors.append(abs(math.log(ttft * 1e3 / case.ttft_ms)))
            if case.tpot_ms is not None and case.tpot_priced:
                errors.append(abs(math.log(tpot * 1e3 / case.tpot_ms)))
        return statistics.median(errors)

    scores = {ratio: score(ratio) for ratio in KV_RATIO_GRID}
    best = min(scores, key=lambda r: (scores[r], -r))
    for factor in (2 ** 0.25, 2 ** 0.125):
        for candidate in (best / factor, min(1.0, best * factor)):
            if candidate not in scores:
                scores[candidate] = score(candidate)
        best = min(scores, key=lambda r: (scores[r], -r))
    return {**values, name: best}


def _coordinate_search(score: Callable[[dict[str, float]], float],
                       bounds: dict[str, tuple[float, float]], start: dict[str, float],
                       rounds: int) -> tuple[dict[str, float], float]:
    """Each term in turn up or down by a factor (1.5, then halving its excess each
    round) while the score improves; the terms and their score."""
    values = dict(start)
    best = score(values)
    step = 0.5
    for _ in range(rounds):
        improved = True
        while improved:
            improved = False
            for name, (low, high) in bounds.items():
                for factor in (1 + step, 1 / (1 + step)):
                    current = values[name]
                    trial_value = current * factor if current > 0 else (high - low) * step / 10
                    trial_value = min(high, max(low, trial_value))
                    if trial_value == current:
                        continue
                    trial = {**values, name: trial_value}
                    trial_score = score(trial)
                    if trial_score < best - 1e-9:
                        values, best, improved = trial, trial_score, True
                        break
        step /= 2
    return values, best


def predict_burst(case: LatencyCase, efficiency: Efficiency) -> tuple[float, float]:
    """Mean TTFT and TPOT (s) of `num_prompts` requests sent at once, by the engine
    simulator (the server's max_num_seqs, token budget and KV cache)."""
    served = case.served().with_efficiency(efficiency)
    requests = [SimRequest(0.0, case.input_len, case.output_len)
                for _ in range(case.num_prompts or 1)]
    summary = simulate(served, Trace(requests), EngineConfig.of(served)).summary()
    return summary["ttft_s"]["mean"], summary["tpot_s"]["mean"]


# Requests per client a closed-loop row is simulated with (its source gives percentiles
# over a number of prompts it does not state; the median barely depends on it).
CLOSED_LOOP_REQUESTS_PER_CLIENT = 20


def predict_closed(case: LatencyCase, efficiency: Efficiency,
                   requests_per_client: int = CLOSED_LOOP_REQUESTS_PER_CLIENT
                   ) -> tuple[float, float, float]:
    """Median TTFT, TPOT and inter-token latency (s) of `case.num_prompts` clients in a
    closed loop, all starting at once, as `vllm bench serve --max-concurrency C
    --request-rate inf` runs them (or as the row's client paused: its first requests
    spread over the first pause, a uniform pause before each next one), by the engine
    simulator."""
    served = case.served().with_efficiency(efficiency)
    clients = case.num_prompts
    workload = ClosedLoop(clients, requests_per_client * clients,
                          Lengths(case.input_len, case.output_len),
                          ramp_s=case.first_pause_s, jitter_s=case.pause_s)
    summary = simulate(served, workload, EngineConfig.of(served)).summary()
    return summary["ttft_s"]["p50"], summary["tpot_s"]["p50"], summary["itl_s"]["p50"]


@dataclass(frozen=True)
class Prediction:
    ref: str
    model: str
    family: str
    engine: str
    band: str
    quantity: str  # "ttft", "tpot" or "itl"
    predicted_ms: float
    measured_ms: float

    @property
    def ape(self) -> float:
        return abs(self.predicted_ms / self.measured_ms - 1)


def cross_validate(
    cases: Sequence[LatencyCase] | None = None, rounds: int = 5, by: str = "family",
    starts_s: Sequence[float] = PER_REQUEST_STARTS_S, workers: int | None = None,
) -> tuple[list[Prediction], dict[str, dict[str, float]]]:
    """Leave-one-group-out predictions of every usable row (groups: model families, or
    `by="source"` the measurements' sources), and each fold's terms. The folds' fits
    run in `workers` processes (default: one per core, at most 2); each is
    deterministic, so the answer is the same however many."""
    cases = list(cases if cases is not None else usable_cases())
    group = GROUPINGS[by]
    out: list[Prediction] = []
    held_out = sorted({group(c) for c in cases})
    training = [[c for c in cases if group(c) != held] for held in held_out]
    workers = min(2, os.cpu_count() or 1) if workers is None else workers
    if workers > 1 and len(training) > 1:
        # Spawned, not forked: the caller (a test session) may hold threads and locks.
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(workers, mp_context=context) as pool:
            fitted = list(pool.map(fit, training, itertools.repeat(rounds),
                                   itertools.repeat(tuple(starts_s))))
    else:
        fitted = [fit(rows, rounds, starts_s) for rows in training]
    folds: dict[str, dict[str, float]] = dict(zip(held_out, fitted, strict=True))
    for held, values in folds.items():
        for case in (c for c in cases if group(c) == held):
            efficiency = efficiency_for(values, case.engine)
            itl = None
            if case.kind == "steady":
                ttft, tpot = predict_steady(case, efficiency)
                band = BANDS[0]
            elif case.kind == "closed":
                ttft, tpot, itl = predict_closed(case, efficiency)
                band = BANDS[0] if case.num_prompts == 1 else BANDS[1]
            else:
                ttft, tpot = predict_burst(case, efficiency)
                band = BANDS[1]
            for quantity, predicted, measured in (("ttft", ttft, case.ttft_ms),
                                                  ("tpot", tpot, case.tpot_ms),
                                                  ("itl", itl, case.itl_ms)):
                if predicted is None or measured is None:
                    continue
                if quantity != "ttft" and not case.tpot_priced:
                    continue
                out.append(Prediction(case.ref, case.model, family(case), case.engine, band,
                                      quantity, predicted * 1e3, measured))
    return out, folds


def median_ape(predictions: Sequence[Prediction], **where: str) -> tuple[int, float, float]:
    """(rows, median APE, p90 APE) of the predictions matching `where`."""
    errors = sorted(p.ape for p in predictions
                    if all(getattr(p, key) == value for key, value in where.items()))
    if not errors:
        return 0, math.nan, math.nan
    p90 = errors[min(len(errors) - 1, math.ceil(0.9 * len(errors)) - 1)]
    return len(errors), statistics.median(errors), p90


def summary(predictions: Sequence[Prediction]) -> list[dict[str, Any]]:
    """Out-of-fold errors per engine (and all) and concurrency band."""
    out = []
    for engine in ("all", *ENGINES):
        for band in BANDS:
            where = {"band": band} if engine == "all" else {"band": band, "engine": engine}
            entry: dict[str, Any] = {"engine": engine, "band": band}
            for quantity in ("ttft", "tpot", "itl"):
                rows, median, p90 = median_ape(predictions, quantity=quantity, **where)
                if rows or quantity != "itl":
                    entry[quantity] = {"rows": rows, "median_ape": median, "p90_ape": p90}
            if entry["ttft"]["rows"]:
                out.append(entry)
    return out


def _milliseconds(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) * 1e-3 for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of numbers: {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"each start must be positive: {text!r}")
    return values


def _fit_all(rounds: int, starts_s: Sequence[float]) -> int:
    """Print the fit on every usable row beside the shipped constants; 1 if they differ."""
    cases = usable_cases()
    fitted = fit(cases, rounds, starts_s)
    committed = committed_values()
    differ = differing_terms(fitted, committed)
    steady = sum(1 for c in cases if c.kind == "steady")
    print(f"The fit on the {steady} one-request rows of all {len(cases)} usable rows, "
          "beside the shipped constants")
    print(render([[name, f"{fitted[name]:.4g}", f"{committed[name]:.4g}",
                   "differs" if name in differ else ""] for name in fitted],
                 ["term", "fitted", "shipped", ""]))
    if differ:
        print("\nThe shipped constants are not this fit's: set DEFAULT_EFFICIENCY and "
              "ENGINE_TERMS in sidecar/model/latency.py to the fitted column (three digits).")
        return 1
    print("\nThe shipped constants are this fit's, to three digits.")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, metavar="OUT", help="write the results here")
    parser.add_argument("--rounds", type=int, default=5, help="coordinate-search rounds")
    parser.add_argument("--per-request-starts-ms", type=_milliseconds, metavar="A,B,...",
                        default=PER_REQUEST_STARTS_S,
                        help="where the fit starts each engine's cost per request (default: "
                             + ",".join(f"{v * 1e3:g}" for v in PER_REQUEST_STARTS_S) + ")")
    parser.add_argument("--by", choices=[*GROUPINGS, "both"], default="both",
                        help="hold out each model family, each source, or both in turn "
                             "(default: both)")
    parser.add_argument("--fit", action="store_true",
                        help="instead of cross-validating, fit once on every usable row and "
                             "compare with the shipped constants (~2 min)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    record: dict[str, Any] = {}
    if args.fit:
        return _fit_all(args.rounds, args.per_request_starts_ms)
    for by in GROUPINGS if args.by == "both" else [args.by]:
        predictions, folds = cross_validate(rounds=args.rounds, by=by,
                                            starts_s=args.per_request_starts_ms)
        table = summary(predictions)
        print(f"Out-of-fold absolute percentage error (leave one {by} out)")
        print(render([[e["engine"], e["band"], str(e["ttft"]["rows"]),
                       f"{e['ttft']['median_ape']:.1%}", f"{e['ttft']['p90_ape']:.1%}",
                       f"{e['tpot']['median_ape']:.1%}", f"{e['tpot']['p90_ape']:.1%}"]
                      for e in table],
                     ["engine", "band", "rows", "TTFT p50", "TTFT p90", "TPOT p50",
                      "TPOT p90"]))
        itl = [e for e in table if "itl" in e]
        if itl:
            print("Median inter-token latency (closed-loop rows that give it, not in the "
                  "TPOT column):")
            print(render([[e["engine"], e["band"], str(e["itl"]["rows"]),
                           f"{e['itl']['median_ape']:.1%}", f"{e['itl']['p90_ape']:.1%}"]
                          for e in itl], ["engine", "band", "rows", "ITL p50", "ITL p90"]))
        print(f"\nFitted terms per held-out {by}")
        names = list(NEUTRAL_START)
        print(render([[held, *(f"{values[n]:.3g}" for n in names)]
                      for held, values in folds.items()], ["held out", *names]))
        print()
        record[f"by_{by}"] = {"folds": folds, "summary": table,
                              "rows": [vars(p) | {"ape": p.ape} for p in predictions]}
    if args.json:
        from bench.common import provenance, write_json
        run = provenance("bench/model_cv.py")
        run.update({
            "method": "leave one model family out, and leave one source out; fit on the "
                      "other groups' steady rows from a fixed prior (the best of 3 starts of "
                      "each engine's cost per request), then each engine's KV cache "
                      "bandwidth on the other groups' rows under load; burst and "
                      "closed-loop rows predicted by the engine simulator",
            "families": FAMILIES, "prior": NEUTRAL_START,
            "per_request_starts_s": list(args.per_request_starts_ms), **record,
            "seconds": round(time.perf_counter() - started, 1),
        })
        write_json(args.json, run)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
