"""What a simulated run reports: per-request times and their distributions,
throughput, KV use over time, preemptions."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sidecar.model.simulator_workload import SimRequest


@dataclass
class RequestRecord:
    """One request's life in the simulation (times in seconds from the run's start).

    `first_token_s` and `finish_s` include the engine's fixed per-request cost
    (`Efficiency.per_request_s`: a latency beside the steps, or with
    `EngineConfig.host_shares_device` device time in the step its first chunk runs in);
    `cached_tokens` are its first admission's prefix-cache
    hits; `recomputed_tokens` the tokens prefilled again after preemptions."""

    request: SimRequest
    admitted_s: float | None = None  # left kvgate's queue (gated runs), else arrival
    first_token_s: float | None = None
    finish_s: float | None = None
    preemptions: int = 0
    recomputed_tokens: int = 0
    cached_tokens: int = 0
    rejected: str | None = None  # why it was never served

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_s is None:
            return None
        return self.first_token_s - self.request.arrival_s

    @property
    def e2e_s(self) -> float | None:
        if self.finish_s is None:
            return None
        return self.finish_s - self.request.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if self.finish_s is None or self.first_token_s is None or \
                self.request.output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.request.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]) of unsorted values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def weighted_percentile(pairs: Sequence[tuple[float, int]], q: float) -> float | None:
    """Percentile of values repeated by their weights (value, weight)."""
    total = sum(weight for _, weight in pairs)
    if total <= 0:
        return None
    target = (total - 1) * q / 100.0
    seen = 0
    for value, weight in sorted(pairs):
        seen += weight
        if seen > target:
            return value
    return sorted(pairs)[-1][0]


def _distribution(values: Sequence[float]) -> dict[str, float | None]:
    return {
        "mean": sum(values) / len(values) if values else None,
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
    }


@dataclass
class SimulationResult:
    """A run's outcome. `itl_samples` are (seconds, tokens) pairs: every decode step
    gives each token it samples its duration; a request resumed after preemption adds
    the gap since its previous token."""

    records: list[RequestRecord]
    steps: int
    preemptions: int
    usable_blocks: int
    kv_samples: list[tuple[float, int]]  # (time, blocks held), sampled
    peak_blocks: int
    itl_samples: list[tuple[float, int]] = field(default_factory=list)
    busy_s: float = 0.0
    mean_blocks: float = 0.0  # time-weighted over the steps

    @property
    def completed(self) -> list[RequestRecord]:
        return [r for r in self.records if r.finish_s is not None]

    @property
    def makespan_s(self) -> float:
        done = self.completed
        if not done:
            return 0.0
        start = min(r.request.arrival_s for r in self.records)
        return max(r.finish_s for r in done if r.finish_s is not None) - start

    def summary(self, warmup_requests: int = 0, cooldown_requests: int = 0) -> dict[str, Any]:
        """The JSON-ready figures (`kvgate simulate --json` prints these per policy).
        The TTFT, TPOT and E2E distributions leave out the first `warmup_requests` and
        the last `cooldown_requests` to arrive (a closed loop's start-up wave, and its
        last wave, which runs as the others end without a next one: its steady state);
        the counts, throughput, ITL and KV figures cover the whole run."""
        done = self.completed
        measured, warm, cool = done, 0, 0
        if warmup_requests > 0 or cooldown_requests > 0:
            ordered = sorted(self.records, key=lambda r: r.request.arrival_s)
            start = min(len(ordered), max(0, warmup_requests))
            end = max(start, len(ordered) - max(0, cooldown_requests))
            measured = [r for r in ordered[start:end] if r.finish_s is not None]
            warm = sum(1 for r in ordered[:start] if r.finish_s is not None)
            cool = sum(1 for r in ordered[end:] if r.finish_s is not None)
        ttft = [r.ttft_s for r in measured if r.ttft_s is not None]
        tpot = [r.tpot_s for r in measured if r.tpot_s is not None]
        e2e = [r.e2e_s for r in measured if r.e2e_s is not None]
        span = self.makespan_s
        output_tokens = sum(r.request.output_tokens for r in done)
        itl = {
            "mean": _weighted_mean(self.itl_samples),
            "p50": weighted_percentile(self.itl_samples, 50),
            "p90": weighted_percentile(self.itl_samples, 90),
            "p99": weighted_percentile(self.itl_samples, 99),
        }
        return {
            "requests": len(self.records),
            "completed": len(done),
            "warmup_requests": warm,
            "cooldown_requests": cool,
            "rejected": sum(1 for r in self.records if r.rejected),
            "ttft_s": _distribution(ttft),
            "tpot_s": _distribution(tpot),
            "itl_s": itl,
            "e2e_s": _distribution(e2e),
            "throughput_requests_per_s": len(done) / span if span > 0 else None,
            "throughput_output_tokens_per_s": output_tokens / span if span > 0 else None,
            "makespan_s": span,
            "busy_s": self.busy_s,
            "steps": self.steps,
            "preemptions": self.preemptions,
            "preempted_requests": sum(1 for r in self.records if r.preemptions),
            "recomputed_tokens": sum(r.recomputed_tokens for r in self.records),
            "cached_tokens": sum(r.cached_tokens for r in self.records),
            "kv": {
                "usable_blocks": self.usable_blocks,
                "peak_blocks": self.peak_blocks,
                "mean_blocks": self.mean_blocks,
                "samples": [[round(t, 6), blocks] for t, blocks in self.kv_samples],
            },
        }


def _weighted_mean(pairs: Sequence[tuple[float, int]]) -> float | None:
    total = sum(weight for _, weight in pairs)
    if total <= 0:
        return None
    return sum(value * weight for value, weight in pairs) / total
