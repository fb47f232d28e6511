#!/usr/bin/env python3
"""Accuracy of the analytical model against the public measurements in tests/data.

    python bench/model_accuracy.py [--json OUT]

Runs every row of tests/data/groundtruth (vLLM start-up logs, latency measurements)
through the model's `kvgate plan` code path - `ServedModel` and `steady_latency` -
with the row mapping shared with tests/test_groundtruth.py (tests/support/
groundtruth.py), and prints one table per row kind with the error of every row and
the median and p90 absolute percentage error per kind:

- weights: weights per GPU vs vLLM's "Model loading took";
- kv_tokens: KV tokens (or V0 blocks) from the logged budget vs the logged figure;
  the budget is printed rounded to 0.01 GiB, so the check is whether the logged
  figure lies in the interval of figures the rounding allows;
- kv_budget: the KV budget estimated from GPU memory, utilization and the profile
  run vs the logged "Available KV cache memory";
- kv_tokens_est: KV tokens from that estimated budget vs the logged figure;
- ttft / tpot: one request at a time (batch 1, concurrency 1, num_prompts=1);
- burst_ttft / burst_tpot: N prompts sent at once (request_rate=inf), simulated step
  by step with vLLM's scheduler rules (report only).

The latency rows are priced with the shipped constants, which were fitted on the
one-request rows (`python bench/model_cv.py --fit`): their errors there are training
errors, and the accuracy to quote is bench/model_cv.py's, out of fold. `--json OUT`
writes the rows and the summary (bench/results/model_accuracy.json by convention).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
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
    Efficiency,
    Prefill,
    Roofline,
    StepCost,
)
from sidecar.model.units import GIB, cdiv  # noqa: E402

from support.groundtruth import (  # noqa: E402
    KV_EXACT_EXCEPTIONS,
    KvCase,
    LatencyCase,
    kv_cases,
    latency_cases,
    predict_steady,
    token_interval,
    tokens_reported,
)

# The targets, per kind (median absolute error). TTFT and TPOT one request at a time
# are the rows the shipped constants were fitted on: their error here is a training
# error, and the target is checked out of fold (bench/model_cv.py).
IN_SAMPLE = "training error; the target is checked out of fold (model_cv.py)"
TARGETS = {"weights": "every row within 3%", "kv_tokens": "exact (in the rounding interval)",
           "tpot": IN_SAMPLE, "ttft": IN_SAMPLE}
KINDS = ("weights", "kv_tokens", "kv_budget", "kv_tokens_est", "ttft", "tpot",
         "burst_ttft", "burst_tpot")

# ---- per-row results -------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    kind: str
    ref: str
    model: str
    config: str
    setup: str  # GPU, TP, dtype, lengths: what the row was run as
    predicted: float
    measured: float
    unit: str
    note: str = ""
    ok: bool | None = None  # for exact checks
    engine: str = ""  # latency rows: "vllm" or "tensorrt-llm"

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.predicted / self.measured - 1.0)

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "ref": self.ref, "model": self.model, "config": self.config,
                "setup": self.setup, "predicted": self.predicted, "measured": self.measured,
                "unit": self.unit, "error_pct": round(self.error_pct, 3), "ok": self.ok,
                "engine": self.engine, "note": self.note}


def _kv_setup(case: KvCase) -> str:
    gpu = case.gpu.gpu.name if case.gpu.gpu else case.gpu.note
    parts = [gpu, f"tp{case.tp}", f"vLLM {case.engine.upper()}"]
    if case.utilization is not None:
        parts.append(f"util {case.utilization:g}")
    if case.max_model_len:
        parts.append(f"len {case.max_model_len}")
    return ", ".join(parts)


def weights_rows() -> list[Row]:
    rows = []
    for case in kv_cases():
        if not case.checks_weights:
            continue
        assert case.weights_gib is not None
        predicted = case.served().weights_bytes / GIB
        error = predicted / case.weights_gib - 1
        rows.append(Row("weights", case.ref, case.model, case.choice.note, _kv_setup(case),
                        predicted, case.weights_gib, "GiB", ok=abs(error) <= 0.03))
    return rows


def kv_token_rows() -> list[Row]:
    rows = []
    for case in kv_cases():
        if not case.checks_kv_exact:
            continue
        interval = token_interval(case)
        if case.kv_tokens is not None:
            inside = interval.has_tokens(case.kv_tokens)
            measured, predicted = case.kv_tokens, interval.tokens_at_logged
            span = f"tokens {interval.tokens_low:,}-{interval.tokens_high:,}"
        else:
            assert case.gpu_blocks is not None
            inside = interval.has_blocks(case.gpu_blocks)
            measured, predicted = case.gpu_blocks, interval.blocks_at_logged
            span = f"blocks {interval.blocks_low:,}-{interval.blocks_high:,}"
        if case.kv_tokens is not None and case.gpu_blocks is not None:
            inside = inside and interval.has_blocks(case.gpu_blocks)
            span += f", blocks {interval.blocks_low:,}-{interval.blocks_high:,}"
        note = f"{case.available_kv_gib} GiB allows {span}"
        if case.ref in KV_EXACT_EXCEPTIONS:
            note += f"; explained: {KV_EXACT_EXCEPTIONS[case.ref]}"
        rows.append(Row("kv_tokens", case.ref, case.model, case.choice.note, _kv_setup(case),
                        float(predicted), float(measured), "tokens" if case.kv_tokens
                        else "blocks", note, inside))
    return rows


def kv_budget_rows() -> list[Row]:
    rows = []
    for case in kv_cases():
        if not case.checks_kv_budget:
            continue
        assert case.available_kv_gib is not None and case.utilization is not None
        served = case.served()
        budget = served.memory_budget
        assert budget is not None and case.gpu.gpu is not None
        predicted = budget.kv_budget_bytes / GIB
        modelled = (budget.activation_bytes + budget.non_torch_bytes) / GIB
        note = f"profile {served.max_num_batched_tokens} tokens; modelled non-KV non-weights " \
               f"{modelled:.2f} GiB"
        if case.weights_gib is not None:
            residual = (case.utilization * case.gpu.gpu.memory_gib - case.weights_gib
                        - case.available_kv_gib)
            note += f", logged {residual:.2f} GiB (util x memory - weights - KV)"
        rows.append(Row("kv_budget", case.ref, case.model, case.choice.note, _kv_setup(case),
                        predicted, case.available_kv_gib, "GiB", note))
    return rows


def kv_tokens_estimated_rows() -> list[Row]:
    rows = []
    for case in kv_cases():
        if not case.checks_kv_tokens_estimated:
            continue
        served = case.served()
        capacity = served.capacity
        assert capacity is not None
        if case.kv_tokens is not None:
            predicted, measured, unit = tokens_reported(served, case.engine), case.kv_tokens, \
                "tokens"
        else:
            assert case.gpu_blocks is not None
            predicted, measured, unit = capacity.num_blocks, case.gpu_blocks, "blocks"
        rows.append(Row("kv_tokens_est", case.ref, case.model, case.choice.note,
                        _kv_setup(case), float(predicted), float(measured), unit,
                        f"profile {served.max_num_batched_tokens} tokens"))
    return rows


# ---- latency -----------------------------------------------------------------------------


def _latency_setup(case: LatencyCase) -> str:
    gpu = case.gpu.gpu.name if case.gpu.gpu else "?"
    where = " across nodes" if case.gpu.cross_node else ""
    load = f"x{case.num_prompts}" if case.kind == "burst" else ""
    return (f"{gpu}{where} tp{case.tp} {case.dtype} {case.engine} "
            f"{case.input_len}/{case.output_len}{load}")


def _served(case: LatencyCase, efficiency: Efficiency) -> ServedModel:
    return case.served().with_efficiency(efficiency)


@dataclass
class _Request:
    prompt: int
    output: int
    computed: int = 0  # tokens whose KV is in the cache
    generated: int = 0
    blocks: int = 0
    first_s: float | None = None
    finish_s: float | None = None

    @property
    def context(self) -> int:
        return self.prompt + self.generated

    @property
    def prefilling(self) -> bool:
        return self.computed < self.context - (1 if self.generated else 0)


class _Steps:
    """Step costs, memoized on a coarse key: decode contexts by their mean (exact for
    full attention, whose cost is linear in context), cached prefix rounded."""

    def __init__(self, roofline: Roofline) -> None:
        self.roofline = roofline
        self.memo: dict[tuple[Any, ...], StepCost] = {}

    def cost(self, chunks: Sequence[tuple[int, int]], contexts: Sequence[int]) -> float:
        mean = (sum(contexts) // len(contexts)) // 32 * 32 if contexts else 0
        key = (tuple((new, cached // 64) for new, cached in chunks), len(contexts), mean)
        step = self.memo.get(key)
        if step is None:
            step = self.roofline.step([Prefill(n, c // 64 * 64) for n, c in chunks],
                                      [mean] * len(contexts))
            self.memo[key] = step
        return step.seconds


def simulate_burst(case: LatencyCase, efficiency: Efficiency) -> tuple[float, float]:
    """Mean TTFT and TPOT (s) when `num_prompts` requests arrive at once.

    vLLM V1's scheduler, step by step: running requests first (one decode token each,
    or their next prefill chunk), then waiting ones while the token budget
    (max_num_batched_tokens), max_num_seqs and free KV blocks allow; a prompt longer
    than the budget left is chunked. A running request that finds no free block
    preempts the most recently admitted one, which later recomputes its context.
    The benchmark's warm-up request makes the first prompt a prefix-cache hit. TTFT
    ends with the step that finishes the prefill, plus the engine's per-request cost;
    TPOT is (finish - first token) / (output - 1), as benchmark_serving.py reports.
    """
    served = _served(case, efficiency)
    roofline = served.roofline
    capacity = served.capacity
    assert roofline is not None and capacity is not None
    block = served.block_size
    budget_tokens = served.max_num_batched_tokens
    free_blocks = capacity.usable_blocks
    steps = _Steps(roofline)
    requests = [_Request(case.input_len, case.output_len) for _ in range(case.num_prompts)]
    requests[0].computed = (case.input_len - 1) // block * block
    waiting = list(requests)
    running: list[_Request] = []
    now = 0.0
    while waiting or running:
        budget = budget_tokens
        scheduled: list[tuple[_Request, int]] = []
        preempted = False
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            want = request.context - request.computed if request.prefilling else 1
            tokens = min(want, budget)
            need = cdiv(request.computed + tokens, block) - request.blocks
            while need > free_blocks and running[-1] is not request:
                victim = running.pop()
                free_blocks += victim.blocks
                victim.blocks, victim.computed = 0, 0
                waiting.insert(0, victim)
                preempted = True
            if need > free_blocks:  # the last running request: it preempts itself
                running.pop()
                free_blocks += request.blocks
                request.blocks, request.computed = 0, 0
                waiting.insert(0, request)
                preempted = True
                break
            free_blocks -= need
            request.blocks += need
            scheduled.append((request, tokens))
            budget -= tokens
            index += 1
        while (waiting and budget > 0 and not preempted
               and len(running) < served.max_num_seqs):
            request = waiting[0]
            tokens = min(request.context - request.computed, budget)
            need = cdiv(request.computed + tokens, block) - request.blocks
            if need > free_blocks:
                break
            waiting.pop(0)
            free_blocks -= need
            request.blocks += need
            running.append(request)
            scheduled.append((request, tokens))
            budget -= tokens
        if not scheduled:
            raise RuntimeError(f"{case.ref}: a request does not fit the KV cache")
        chunks = [(tokens, r.computed) for r, tokens in scheduled if r.prefilling]
        contexts = [r.context for r, _ in scheduled if not r.prefilling]
        now += steps.cost(chunks, contexts)
        for request, tokens in scheduled:
            request.computed += tokens
            if request.prefilling:
                continue
            request.generated += 1
            if request.first_s is None:
                request.first_s = now
            if request.generated >= request.output:
                request.finish_s = now
                free_blocks += request.blocks
                request.blocks = 0
                running.remove(request)
    extra = efficiency.per_request_s
    ttft = statistics.fmean((r.first_s or 0.0) + extra for r in requests)
    tpot = statistics.fmean(((r.finish_s or 0.0) - (r.first_s or 0.0)) / max(1, r.output - 1)
                            for r in requests)
    return ttft, tpot


def latency_rows(base: Efficiency = DEFAULT_EFFICIENCY, bursts: bool = True) -> list[Row]:
    rows = []
    for case in latency_cases():
        if not case.usable or case.ttft_ms is None or case.tpot_ms is None:
            continue
        efficiency = base.for_engine(case.engine)
        if case.kind == "steady":
            ttft, tpot = predict_steady(case, efficiency)
            kinds = ("ttft", "tpot")
        elif bursts:
            ttft, tpot = simulate_burst(case, efficiency)
            kinds = ("burst_ttft", "burst_tpot")
        else:
            continue
        note = f"prefix-cached {case.cached_tokens}" if case.cached_tokens else ""
        if case.cached_tokens and case.num_prompts > 1:
            note += f" (1 of {case.num_prompts} prompts)"
        if not case.tpot_priced:
            note += "; TPOT not priced (--enforce-eager)"
        for kind, predicted, measured in zip(kinds, (ttft, tpot), (case.ttft_ms, case.tpot_ms),
                                             strict=True):
            if kind.endswith("tpot") and not case.tpot_priced:
                continue
            rows.append(Row(kind, case.ref, case.model, case.choice.note,
                            _latency_setup(case), predicted * 1e3, measured, "ms", note,
                            engine=case.engine))
    return rows


def skipped() -> list[dict[str, str]]:
    out = []
    for kv in kv_cases():
        reason = kv.skip or kv.choice.skip
        if reason is None and not (kv.checks_weights or kv.checks_kv_exact
                                   or kv.checks_kv_budget or kv.checks_kv_tokens_estimated):
            reason = "nothing the model can check: no weights, no budget with tokens, " \
                     "no utilization with a GPU"
        if reason:
            out.append({"ref": kv.ref, "model": kv.model, "reason": reason})
    for lat in latency_cases():
        if lat.skip:
            out.append({"ref": lat.ref, "model": lat.model, "reason": lat.skip})
    return out


# ---- summary ----------------------------------------------------------------------------


def percentile(values: Sequence[float], share: float) -> float:
    """Linear-interpolated percentile (as numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    position = (len(ordered) - 1) * share
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(rows: Iterable[Row]) -> dict[str, dict[str, Any]]:
    by_kind: dict[str, list[Row]] = {}
    for row in rows:
        by_kind.setdefault(row.kind, []).append(row)
    summary = {}
    for kind in KINDS:
        group = by_kind.get(kind, [])
        if not group:
            continue
        errors = [abs(row.error_pct) for row in group]
        entry: dict[str, Any] = {
            "rows": len(group),
            "median_abs_error_pct": round(statistics.median(errors), 2),
            "p90_abs_error_pct": round(percentile(errors, 0.9), 2),
            "target": TARGETS.get(kind, "report only"),
        }
        if kind == "kv_tokens":
            explained = [row for row in group if row.ref in KV_EXACT_EXCEPTIONS]
            entry["exact"] = sum(1 for row in group if row.ok)
            entry["explained_exceptions"] = len(explained)
        if kind == "weights":
            entry["within_3pct"] = sum(1 for row in group if row.ok)
        engines = sorted({row.engine for row in group if row.engine})
        if len(engines) > 1:
            entry["by_engine"] = {
                engine: {"rows": len(errs), "median_abs_error_pct":
                         round(statistics.median(errs), 2),
                         "p90_abs_error_pct": round(percentile(errs, 0.9), 2)}
                for engine in engines
                for errs in [[abs(row.error_pct) for row in group if row.engine == engine]]
            }
        summary[kind] = entry
    return summary


def summary_table(summary: dict[str, dict[str, Any]]) -> list[list[str]]:
    table = []
    for kind, entry in summary.items():
        table.append([kind, str(entry["rows"]), f"{entry['median_abs_error_pct']:.1f}%",
                      f"{entry['p90_abs_error_pct']:.1f}%", entry["target"]])
        for engine, part in entry.get("by_engine", {}).items():
            table.append([f"  {kind}, {engine}", str(part["rows"]),
                          f"{part['median_abs_error_pct']:.1f}%",
                          f"{part['p90_abs_error_pct']:.1f}%", ""])
    return table


def print_report(rows: Sequence[Row], skips: Sequence[dict[str, str]]) -> None:
    titles = {
        "weights": "Weights per GPU vs vLLM's 'Model loading took' (GiB)",
        "kv_tokens": "KV tokens (V0: blocks) from the logged budget: is the logged figure in "
                     "the interval the rounded budget allows?",
        "kv_budget": "KV budget estimated from GPU memory vs logged 'Available KV cache "
                     "memory' (GiB)",
        "kv_tokens_est": "KV tokens (V0: blocks) from the estimated budget vs logged",
        "ttft": "TTFT, one request at a time (ms)",
        "tpot": "TPOT, one request at a time (ms)",
        "burst_ttft": "Burst: mean TTFT of N prompts sent at once (ms, includes queueing)",
        "burst_tpot": "Burst: mean TPOT of N prompts sent at once (ms)",
    }
    for kind in KINDS:
        group = [row for row in rows if row.kind == kind]
        if not group:
            continue
        table = []
        for row in group:
            digits = 0 if row.unit in ("tokens", "blocks") else 2
            check = "" if row.ok is None else ("ok" if row.ok else "MISS")
            table.append([row.ref, row.model[:34], row.setup, f"{row.predicted:,.{digits}f}",
                          f"{row.measured:,.{digits}f}", f"{row.error_pct:+.1f}%", check,
                          row.note])
        print(f"\n== {titles[kind]}")
        print(render(table, ["row", "model", "as run", "model", "measured", "error", "",
                             "note"]))
    print("\n== Summary: absolute error per row kind")
    print(render(summary_table(summarize(rows)), ["kind", "rows", "median", "p90", "target"]))
    print("\n== Rows not run")
    print(render([[skip["ref"], skip["model"][:44], skip["reason"]] for skip in skips],
                 ["row", "model", "reason"]))


# ---- main -------------------------------------------------------------------------------


def collect(base: Efficiency = DEFAULT_EFFICIENCY) -> list[Row]:
    return (weights_rows() + kv_token_rows() + kv_budget_rows() + kv_tokens_estimated_rows()
            + latency_rows(base))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, metavar="OUT",
                        help="write rows and summary as JSON (e.g. "
                             "bench/results/model_accuracy.json)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows = collect()
    skips = skipped()
    print_report(rows, skips)
    result: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "processor": platform.processor() or platform.machine()},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python bench/model_accuracy.py " + " ".join(
            sys.argv[1:] if argv is None else argv),
        "efficiency": DEFAULT_EFFICIENCY.as_dict(),
        "engine_terms": {engine: dataclasses.asdict(terms)
                         for engine, terms in ENGINE_TERMS.items()},
        "summary": summarize(rows),
        "rows": [row.as_dict() for row in rows],
        "skipped": skips,
    }
    result["seconds"] = round(time.perf_counter() - started, 1)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
