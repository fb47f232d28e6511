"""The sidecar's Prometheus metrics, on an injected registry.

Names follow `kvgate_<subsystem>_<name>_<unit>`; label values are bounded and
initialised at start. Event counts and latencies are recorded as they happen;
state (queue, KV ledger, forecast, upstream) is read at scrape time by a
collector, so a scrape always shows the present. With `gateway_metrics`, the
collector also exposes the two model-server names the Gateway API Inference
Extension / llm-d endpoint picker reads, filled with kvgate's predictive view.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client import utils as prometheus_utils
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from sidecar.admission import FINAL_OUTCOMES, SHADOW_OUTCOMES, Decision
from sidecar.admission.server_queue import REASONS as SERVER_LIMITS

LATENCY_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
    5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
TPOT_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
    0.2, 0.3, 0.5, 0.75, 1.0, 2.0,
)
QUEUE_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0)
QUANTITIES = ("ttft", "tpot")


PREFIX_SOURCES = ("events", "traffic", "off")


@dataclass(frozen=True)
class PrefixView:
    """Prefix caching as kvgate sees it, read at scrape time."""

    source: str  # events | traffic | off
    server_prefix_caching: bool | None
    held_blocks: int  # distinct prompt blocks admitted requests hold (counted once)
    saved_blocks: int  # blocks requests share instead of each reserving them
    query_tokens: int  # prompt tokens of admitted requests planned against the cache
    predicted_hit_tokens: int  # of which kvgate predicted prefix-cache hits
    server_query_tokens: float | None  # vllm:prefix_cache_queries_total
    server_hit_tokens: float | None  # vllm:prefix_cache_hits_total
    events_configured: bool
    events_connected: bool
    events_decode_errors: int
    events_age_s: float | None  # since the last event batch (None: none yet)
    events_stale: bool
    events_gaps: int


@dataclass(frozen=True)
class StateView:
    """What the collector reads at scrape time."""

    queue_requests: int
    inflight_requests: int
    capacity_blocks: int | None
    reserved_blocks: int
    used_blocks: int | None
    forecast_peak_ratio: float
    forecast_exhaustion_s: float
    recommended_max_concurrency: int | None
    upstream_up: bool
    upstream_metrics_age_s: float
    server_waiting: int | None
    prefix: PrefixView | None = None
    others_blocks: int | None = None  # server use kvgate's requests do not explain
    # The limit the queue waits on now (admission/blockage.py; None: none), and the
    # seconds it has waited on each since start.
    queue_waiting_on: str | None = None
    queue_blocked_s: Mapping[str, float] | None = None


class LoopBuckets:
    """One labelled series of a `LoopHistogram`."""

    __slots__ = ("_upper", "counts", "sum")

    def __init__(self, upper: tuple[float, ...]) -> None:
        self._upper = upper
        self.counts = [0] * len(upper)  # per bucket, not cumulative
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """One observation (NaN is ignored: it belongs in no bucket)."""
        if math.isnan(value):
            return
        self.counts[bisect_left(self._upper, value)] += 1
        self.sum += value


class LoopHistogram(Collector):
    """A Prometheus histogram for the request path: observed from the event loop's
    thread only, and read by the scrape, which runs on the same thread. An observation
    is a bisection and two additions, where prometheus_client's `Histogram` takes a lock
    for the sum and walks the buckets, taking a lock again for the one it counts in.
    Exposed as a histogram: `_bucket{le}` (cumulative), `_count`, `_sum`."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float],
                 registry: CollectorRegistry, labelnames: Sequence[str] = ()) -> None:
        bounds = sorted(float(b) for b in buckets)
        if not bounds or any(not math.isfinite(b) for b in bounds) or len(set(bounds)) != len(
                bounds):
            raise ValueError(f"{name}: buckets must be distinct finite numbers, got {buckets}")
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._upper = (*bounds, math.inf)
        # `le` as prometheus_client writes it (1.0, 0.005, +Inf).
        go_string = cast(Callable[[float], str], prometheus_utils.floatToGoString)
        self._les = [go_string(b) for b in self._upper]
        self._series: dict[tuple[str, ...], LoopBuckets] = {}
        registry.register(self)

    def labels(self, *values: str) -> LoopBuckets:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: labels {self.labelnames}, got {values}")
        series = self._series.get(values)
        if series is None:
            series = self._series[values] = LoopBuckets(self._upper)
        return series

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, series in self._series.items():
            cumulative, total = [], 0
            for le, count in zip(self._les, series.counts, strict=True):
                total += count
                cumulative.append((le, float(total)))
            family.add_metric(list(values), cumulative, series.sum)
        yield family


class SidecarMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        state: Callable[[], StateView],
        *,
        gateway_metrics: bool = False,
        version: str = "",
        mode: str = "enforce",
    ) -> None:
        self.registry = registry
        self.requests = Counter(
            "kvgate_requests", "Admission decisions by final outcome.", ["outcome"],
            registry=registry,
        )
        self.shadow_decisions = Counter(
            "kvgate_shadow_decisions",
            "Shadow mode: what enforce mode would have decided at arrival.", ["outcome"],
            registry=registry,
        )
        # Each decision's counter, looked up once (`labels` validates and locks per call).
        self._decision_counters: dict[tuple[bool, str], Counter] = {}
        for outcome in FINAL_OUTCOMES:
            self.requests.labels(outcome.value)
        for outcome in SHADOW_OUTCOMES:
            self.shadow_decisions.labels(outcome.value)
        self.queue_wait_seconds = LoopHistogram(
            "kvgate_queue_wait_seconds",
            "Time requests waited in the queue, whatever came of them (admitted, refused "
            "at their deadline or the queue's maximum wait, or cancelled by the client).",
            QUEUE_BUCKETS_S, registry,
        ).labels()
        self.predicted_ttft = LoopHistogram(
            "kvgate_predicted_ttft_seconds", "Predicted time to first token at admission.",
            LATENCY_BUCKETS_S, registry,
        ).labels()
        self.predicted_tpot = LoopHistogram(
            "kvgate_predicted_tpot_seconds", "Predicted time per output token at admission.",
            TPOT_BUCKETS_S, registry,
        ).labels()
        self.observed_ttft = LoopHistogram(
            "kvgate_observed_ttft_seconds",
            "Observed time to first token of streamed requests (from arrival at kvgate to "
            "the first streamed token).",
            LATENCY_BUCKETS_S, registry,
        ).labels()
        self.observed_tpot = LoopHistogram(
            "kvgate_observed_tpot_seconds",
            "Observed time per output token after the first, of streamed requests.",
            TPOT_BUCKETS_S, registry,
        ).labels()
        self.prediction_error = LoopHistogram(
            "kvgate_prediction_error_ratio", "Observed / predicted, per quantity.",
            RATIO_BUCKETS, registry, ("quantity",),
        )
        self._prediction_errors = {q: self.prediction_error.labels(q) for q in QUANTITIES}
        self.p90_covered = Counter(
            "kvgate_prediction_p90_covered",
            "Completed requests whose observed value was at or below kvgate's p90 prediction, "
            "per quantity; over kvgate_prediction_error_ratio_count: the p90's coverage "
            "(0.9 when calibrated).",
            ["quantity"], registry=registry,
        )
        self._p90_covered = {q: self.p90_covered.labels(q) for q in QUANTITIES}
        self.tokenize_fallback = Counter(
            "kvgate_tokenize_fallback",
            "Prompts counted by the fallback estimate because the server's /tokenize failed.",
            registry=registry,
        )
        self.prompt_tokens_counted = Counter(
            "kvgate_prompt_tokens_counted",
            "Prompts counted, by who counted them: local (the model's tokenizer in kvgate), "
            "server (its /tokenize) or estimate (the fallback when neither could).",
            ["source"], registry=registry,
        )
        self.counted_by = {source: self.prompt_tokens_counted.labels(source)
                           for source in ("local", "server", "estimate")}
        self.tokenizer_checks = Counter(
            "kvgate_tokenizer_checks",
            "Local token ids compared with the server's /tokenize: match, mismatch (that "
            "request shape is counted by the server from then on) or failed (no answer).",
            ["result"], registry=registry,
        )
        for result in ("match", "mismatch", "failed"):
            self.tokenizer_checks.labels(result)
        self.tokenizer_reuse = Counter(
            "kvgate_tokenizer_prefix_reuse",
            "Long prompts encoded from where they differ from a recent prompt they share a "
            "prefix with: spliced (the recent prompt's tokens reused), checked (a splice "
            "compared with the whole prompt encoded), mismatch (a splice that differed: "
            "reuse is off from then on).",
            ["result"], registry=registry,
        )
        for result in ("spliced", "checked", "mismatch"):
            self.tokenizer_reuse.labels(result)
        self.upstream_errors = Counter(
            "kvgate_upstream_errors", "Proxied requests that failed upstream, by kind.",
            ["kind"], registry=registry,
        )
        for kind in ("connect", "protocol", "timeout", "disconnect", "status"):
            self.upstream_errors.labels(kind)
        self.upstream_refusals = Counter(
            "kvgate_upstream_refusals",
            "Requests kvgate forwarded that the server's own admission refused (vLLM's "
            "--max-num-queued-reqs / --max-num-queued-tokens 503), by vLLM's reason.",
            ["reason"], registry=registry,
        )
        for reason in SERVER_LIMITS:
            self.upstream_refusals.labels(reason)
        self.info = Gauge(
            "kvgate_info", "Constant 1, labelled with the sidecar's version, model and mode.",
            ["version", "model", "mode"], registry=registry,
        )
        self._version = version
        self._mode = mode
        self.set_model("")
        registry.register(_StateCollector(state, gateway_metrics))

    def set_model(self, model: str) -> None:
        self.info.clear()
        self.info.labels(self._version, model, self._mode).set(1)

    # ---- the admission core's listener ----------------------------------------------

    def decided(self, decision: Decision, *, shadow: bool) -> None:
        key = (shadow, decision.outcome.value)
        counter = self._decision_counters.get(key)
        if counter is None:
            target = self.shadow_decisions if shadow else self.requests
            counter = self._decision_counters[key] = target.labels(key[1])
        counter.inc()

    def queue_wait(self, seconds: float) -> None:
        self.queue_wait_seconds.observe(seconds)

    # ---- per-request observations -------------------------------------------------

    def predicted(self, ttft_s: float, tpot_s: float) -> None:
        self.predicted_ttft.observe(ttft_s)
        self.predicted_tpot.observe(tpot_s)

    def observed(self, quantity: str, observed_s: float, predicted_s: float,
                 predicted_p90_s: float | None = None) -> None:
        histogram = self.observed_ttft if quantity == "ttft" else self.observed_tpot
        histogram.observe(observed_s)
        if predicted_s > 0:
            self._prediction_errors[quantity].observe(observed_s / predicted_s)
            if predicted_p90_s is not None and observed_s <= predicted_p90_s:
                self._p90_covered[quantity].inc()


class _StateCollector(Collector):
    def __init__(self, state: Callable[[], StateView], gateway_metrics: bool) -> None:
        self._state = state
        self._gateway = gateway_metrics

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        view = self._state()

        def gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc)
            family.add_metric([], math.nan if value is None else float(value))
            return family

        yield gauge("kvgate_queue_requests", "Requests waiting in the admission queue.",
                    view.queue_requests)
        if view.queue_blocked_s is not None:
            yield from _queue_limits(view.queue_waiting_on, view.queue_blocked_s)
        yield gauge("kvgate_inflight_requests", "Admitted requests not finished yet.",
                    view.inflight_requests)
        yield gauge("kvgate_kv_capacity_blocks",
                    "Usable KV cache blocks of the server (its own figure when it reports one).",
                    view.capacity_blocks)
        yield gauge("kvgate_kv_reserved_blocks", "KV blocks reserved by admitted requests.",
                    view.reserved_blocks)
        yield gauge("kvgate_kv_used_blocks", "KV blocks the server reports in use.",
                    view.used_blocks)
        yield gauge("kvgate_kv_others_blocks",
                    "KV blocks the server reported in use at its last scrape that kvgate's "
                    "requests do not explain (traffic that bypasses kvgate), as admission "
                    "counts them until the next scrape.",
                    view.others_blocks)
        yield gauge("kvgate_kv_forecast_peak_ratio",
                    "Forecast peak KV use of running requests over capacity (> 1: preemption).",
                    view.forecast_peak_ratio)
        yield gauge("kvgate_kv_forecast_exhaustion_seconds",
                    "Seconds until forecast KV use exceeds capacity (+Inf: never).",
                    view.forecast_exhaustion_s)
        yield gauge("kvgate_recommended_max_concurrency",
                    "Concurrent requests of the observed typical size that fit the KV target.",
                    view.recommended_max_concurrency)
        yield gauge("kvgate_upstream_up", "1 when the model server answers, else 0.",
                    1.0 if view.upstream_up else 0.0)
        yield gauge("kvgate_upstream_metrics_age_seconds",
                    "Age of the last good scrape of the server's /metrics (+Inf: never).",
                    view.upstream_metrics_age_s)
        if view.prefix is not None:
            yield from _prefix_metrics(view.prefix, gauge)
        if self._gateway:
            yield gauge("vllm:num_requests_waiting",
                        "kvgate's predictive view: its queue plus the server's waiting requests.",
                        view.queue_requests + (view.server_waiting or 0))
            yield gauge("vllm:kv_cache_usage_perc",
                        "kvgate's predictive view: 1 while kvgate holds requests back, else "
                        "max(reserved + others', used, forecast peak) / capacity.",
                        gateway_kv_usage(view))


def _queue_limits(waiting_on: str | None, blocked_s: Mapping[str, float]
                  ) -> Iterator[Metric]:
    now = GaugeMetricFamily(
        "kvgate_queue_waiting_on",
        "1 for the limit the admission queue waits on (its head's, as of kvgate's last try "
        "to admit it: an arrival, a finish, a scrape): kv_cache, or the server's "
        "max_num_seqs, max_num_queued_reqs or max_num_queued_tokens; 0 for the others, "
        "all 0 when nothing waits.", labels=["limit"])
    total = CounterMetricFamily(
        "kvgate_queue_blocked_seconds",
        "Seconds the admission queue has waited on each limit (rate: the share of time).",
        labels=["limit"])
    for limit, seconds in blocked_s.items():
        now.add_metric([limit], 1.0 if limit == waiting_on else 0.0)
        total.add_metric([limit], seconds)
    yield now
    yield total


def gateway_kv_usage(view: StateView) -> float:
    """The KV usage an endpoint picker reads (`--gateway-metrics`): 1.0 while kvgate
    holds any request back (the pod has no room for another, whatever its blocks in use
    say: the queue waits for room the running requests will need, or for the server's
    limits), else the most of what kvgate reserved plus what others hold (traffic that
    bypasses it), what the server reports in use, and the forecast peak, over capacity."""
    if view.queue_requests > 0:
        return 1.0
    if not view.capacity_blocks:
        return 0.0
    committed = view.reserved_blocks + (view.others_blocks or 0)
    return min(1.0, max(committed, view.used_blocks or 0,
                        view.forecast_peak_ratio * view.capacity_blocks) / view.capacity_blocks)


def _ratio(part: float | None, whole: float | None) -> float | None:
    if part is None or whole is None or whole <= 0:
        return None
    return part / whole


def _prefix_metrics(
    prefix: PrefixView, gauge: Callable[[str, str, float | None], GaugeMetricFamily]
) -> Iterator[Metric]:
    source = GaugeMetricFamily(
        "kvgate_prefix_cache_source",
        "1 for where kvgate's view of the server's prefix cache comes from: the server's "
        "KV cache events, a model fed by kvgate's own traffic, or off.", labels=["source"])
    for name in PREFIX_SOURCES:
        source.add_metric([name], 1.0 if prefix.source == name else 0.0)
    yield source
    caching = prefix.server_prefix_caching
    yield gauge("kvgate_server_prefix_caching",
                "1 when the server has prefix caching on (its cache_config_info), else 0.",
                None if caching is None else float(caching))
    yield gauge("kvgate_prefix_held_blocks",
                "Prompt blocks admitted requests hold by reference, each counted once.",
                prefix.held_blocks)
    yield gauge("kvgate_prefix_shared_blocks",
                "KV blocks admitted requests share with other admitted requests instead of "
                "each reserving them.", prefix.saved_blocks)
    queries = CounterMetricFamily(
        "kvgate_prefix_query_tokens",
        "Prompt tokens of admitted requests planned against the prefix cache.")
    queries.add_metric([], float(prefix.query_tokens))
    yield queries
    hits = CounterMetricFamily(
        "kvgate_prefix_predicted_hit_tokens",
        "Of those, prompt tokens kvgate predicted the server would find in its prefix cache.")
    hits.add_metric([], float(prefix.predicted_hit_tokens))
    yield hits
    ratio = GaugeMetricFamily(
        "kvgate_prefix_cache_hit_ratio",
        "Prefix-cache hit tokens over queried prompt tokens since start: kvgate's "
        "prediction, and the server's own (vllm:prefix_cache_hits / queries).",
        labels=["source"])
    predicted = _ratio(prefix.predicted_hit_tokens, prefix.query_tokens)
    server = _ratio(prefix.server_hit_tokens, prefix.server_query_tokens)
    ratio.add_metric(["predicted"], math.nan if predicted is None else predicted)
    ratio.add_metric(["server"], math.nan if server is None else server)
    yield ratio
    if prefix.events_configured:
        yield gauge("kvgate_kv_events_age_seconds",
                    "Seconds since the last batch of the server's KV cache events (+Inf: none "
                    "yet).", math.inf if prefix.events_age_s is None else prefix.events_age_s)
        yield gauge("kvgate_kv_events_stale",
                    "1 when the server prefilled requests but sent no KV cache events for them: "
                    "kvgate falls back to its own model of the server's cache.",
                    float(prefix.events_stale))
        yield gauge("kvgate_kv_events_connected",
                    "1 while kvgate's subscription to the server's KV cache events is "
                    "connected, else 0.", float(prefix.events_connected))
        errors = CounterMetricFamily(
            "kvgate_kv_events_decode_errors",
            "Batches of KV cache events kvgate could not decode (each drops its view of the "
            "server's cache, as a gap does).")
        errors.add_metric([], float(prefix.events_decode_errors))
        yield errors
        gaps = CounterMetricFamily(
            "kvgate_kv_events_gaps",
            "Gaps in the KV cache event sequence (missed events, server restarts): each "
            "drops kvgate's view of the server's cache.")
        gaps.add_metric([], float(prefix.events_gaps))
        yield gaps
