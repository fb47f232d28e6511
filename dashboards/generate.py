#!/usr/bin/env python3
"""Generate kvgate's Grafana dashboard.

    python dashboards/generate.py           # (re)write the dashboard files
    python dashboards/generate.py --check   # exit 1 if any of them is out of date

Writes ``dashboards/kvgate.json`` and the chart's copy ``helm/kvgate/files/kvgate-dashboard.json``
(identical). The dashboard has no ``__inputs``: it imports as is (UI, provisioning or the
Grafana sidecar's ConfigMap) and asks for the Prometheus data source in its ``datasource``
variable. Variables:

* ``model``         kvgate_info's ``model`` label
* ``instance``      kvgate sidecars serving the selected models (kvgate_info)
* ``vllm_instance`` vLLM servers of the selected models (any target exposing
                    ``vllm:num_requests_running``, by its ``model_name``: the served name,
                    kvgate_info's ``model``; the sidecar's ``--gateway-metrics`` does not
                    expose that one)

Metric names are those of ``docs/contracts.md``. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "dashboards" / "kvgate.json"
HELM_DASHBOARD = ROOT / "helm" / "kvgate" / "files" / "kvgate-dashboard.json"

SCHEMA_VERSION = 39
DS = {"type": "prometheus", "uid": "${datasource}"}
RI = "$__rate_interval"
K = 'instance=~"$instance"'  # kvgate sidecars
V = 'instance=~"$vllm_instance"'  # vLLM servers

Panel = dict[str, Any]


# --- building blocks -------------------------------------------------------------------


def target(expr: str, legend: str = "", *, instant: bool = False) -> dict[str, Any]:
    """A Prometheus query. ``refId`` is filled in by the panel."""
    result: dict[str, Any] = {
        "datasource": DS,
        "editorMode": "code",
        "expr": expr,
        "legendFormat": legend or "__auto",
        "range": not instant,
        "instant": instant,
    }
    if instant:
        result["format"] = "table"
    return result


def _with_ref_ids(targets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**t, "refId": chr(ord("A") + i)} for i, t in enumerate(targets)]


def _thresholds(steps: list[tuple[float | None, str]]) -> dict[str, Any]:
    return {
        "mode": "absolute",
        "steps": [{"color": color, "value": value} for value, color in steps],
    }


def timeseries(
    title: str,
    description: str,
    targets: list[dict[str, Any]],
    *,
    unit: str = "short",
    stack: bool = False,
    minimum: float | None = 0,
    maximum: float | None = None,
    thresholds: list[tuple[float | None, str]] | None = None,
    log_scale: bool = False,
) -> Panel:
    custom: dict[str, Any] = {
        "drawStyle": "line",
        "lineWidth": 1,
        "fillOpacity": 20 if stack else 0,
        "showPoints": "never",
        "spanNulls": False,
        "stacking": {"mode": "normal" if stack else "none", "group": "A"},
        "thresholdsStyle": {"mode": "dashed" if thresholds else "off"},
        "axisSoftMin": minimum,
    }
    if log_scale:
        custom["scaleDistribution"] = {"type": "log", "log": 2}
    defaults: dict[str, Any] = {
        "unit": unit,
        "custom": custom,
        "color": {"mode": "palette-classic"},
        "thresholds": _thresholds(thresholds or [(None, "green")]),
    }
    if maximum is not None:
        defaults["max"] = maximum
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": _with_ref_ids(targets),
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def stat(
    title: str,
    description: str,
    targets: list[dict[str, Any]],
    *,
    unit: str = "short",
    thresholds: list[tuple[float | None, str]],
    mappings: list[dict[str, Any]] | None = None,
) -> Panel:
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": _with_ref_ids(targets),
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "thresholds": _thresholds(thresholds),
                "mappings": mappings or [],
                "color": {"mode": "thresholds"},
            },
            "overrides": [],
        },
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "background",
            "graphMode": "area",
            "justifyMode": "auto",
            "orientation": "auto",
            "textMode": "auto",
        },
    }


def table(title: str, description: str, targets: list[dict[str, Any]]) -> Panel:
    return {
        "type": "table",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": _with_ref_ids(targets),
        "fieldConfig": {"defaults": {}, "overrides": []},
        "options": {"showHeader": True, "cellHeight": "sm"},
        "transformations": [
            {
                "id": "organize",
                "options": {
                    "excludeByName": {"Time": True, "Value": True, "__name__": True},
                    "indexByName": {"instance": 0, "model": 1, "version": 2, "mode": 3},
                },
            }
        ],
    }


def row(title: str) -> Panel:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def quantile(q: float, metric: str, selector: str, by: str = "le") -> str:
    return f"histogram_quantile({q}, sum by ({by}) (rate({metric}_bucket{{{selector}}}[{RI}])))"


# --- the panels ------------------------------------------------------------------------

NON_ADMITTED = 'outcome!~"admitted|cancelled"'

# (panel, width, height); a row is always full width.
LAYOUT: list[tuple[Panel, int, int]] = [
    (row("Admission decisions"), 24, 1),
    (
        timeseries(
            "Decisions by outcome",
            "Rate of kvgate's admission decisions by outcome (docs/contracts.md): admitted, "
            "never_fits, queue_full, deadline, queue_timeout, unavailable, draining, cancelled.",
            [
                target(
                    f"sum by (outcome) (rate(kvgate_requests_total{{{K}}}[{RI}]))",
                    "{{outcome}}",
                )
            ],
            unit="reqps",
            stack=True,
        ),
        10,
        8,
    ),
    (
        timeseries(
            "Rejections by reason",
            "Requests kvgate did not admit, by outcome (cancelled = the client left while "
            "queued, not a rejection). never_fits: the prompt leaves no room for output within "
            "max_model_len, or the request needs more KV blocks than the cache can ever give "
            "one request (a max_tokens past the context is not refused: vLLM 0.32 serves it up "
            "to the limit); queue_full / deadline / queue_timeout: not enough capacity; "
            "unavailable / draining: upstream down or shutting down.",
            [
                target(
                    f"sum by (outcome) (rate(kvgate_requests_total{{{K}, {NON_ADMITTED}}}[{RI}]))",
                    "{{outcome}}",
                )
            ],
            unit="reqps",
            stack=True,
        ),
        10,
        8,
    ),
    (
        stat(
            "Rejected share",
            "Share of decisions that rejected the request (all outcomes but admitted and "
            "cancelled). Alert KvgateHighRejectionRate fires above 10% for 10 minutes.",
            [
                target(
                    f"sum(rate(kvgate_requests_total{{{K}, {NON_ADMITTED}}}[{RI}]))"
                    f" / sum(rate(kvgate_requests_total{{{K}}}[{RI}]))",
                    "rejected",
                )
            ],
            unit="percentunit",
            thresholds=[(None, "green"), (0.05, "orange"), (0.1, "red")],
        ),
        4,
        8,
    ),
    (row("Queue and concurrency"), 24, 1),
    (
        timeseries(
            "Queue length and inflight requests",
            "Requests waiting in kvgate's queue, and requests admitted and running on the "
            "server, per sidecar.",
            [
                target(f"kvgate_queue_requests{{{K}}}", "{{instance}} queued"),
                target(f"kvgate_inflight_requests{{{K}}}", "{{instance}} inflight"),
            ],
        ),
        8,
        8,
    ),
    (
        timeseries(
            "Queue wait",
            "Quantiles of the time admitted or timed-out requests waited in kvgate's queue. "
            "Alert KvgateQueueWaitHigh fires when p90 stays above 10 s.",
            [
                target(quantile(0.5, "kvgate_queue_wait_seconds", K), "p50"),
                target(quantile(0.9, "kvgate_queue_wait_seconds", K), "p90"),
                target(quantile(0.99, "kvgate_queue_wait_seconds", K), "p99"),
            ],
            unit="s",
        ),
        8,
        8,
    ),
    (
        timeseries(
            "Recommended max concurrency vs inflight",
            "kvgate's recommendation for the number of concurrent requests the server's KV "
            "cache holds (compare with vLLM's --max-num-seqs), the requests kvgate has in "
            "flight, and the requests the vLLM server reports running.",
            [
                target(f"kvgate_recommended_max_concurrency{{{K}}}", "{{instance}} recommended"),
                target(f"kvgate_inflight_requests{{{K}}}", "{{instance}} inflight"),
                target(
                    f"sum by (instance) (vllm:num_requests_running{{{V}}})",
                    "{{instance}} vLLM running",
                ),
            ],
        ),
        8,
        8,
    ),
    (
        timeseries(
            "What the queue waits on",
            "The share of time kvgate's queue waited on each limit: the KV cache (no room "
            "for the head's peak beside what runs: add KV cache or replicas), the server's "
            "--max-num-seqs (raise it if the KV cache has room), its --max-num-queued-reqs "
            "or --max-num-queued-tokens. 'now' is 1 (100%) "
            "for the limit the queue waits on at the scrape, 0 for the others.",
            [
                target(f"sum by (instance, limit) (rate(kvgate_queue_blocked_seconds_total"
                       f"{{{K}}}[{RI}]))", "{{instance}} {{limit}}"),
                target(f"kvgate_queue_waiting_on{{{K}}}", "{{instance}} now: {{limit}}"),
            ],
            unit="percentunit",
            maximum=1,
        ),
        24,
        7,
    ),
    (row("KV cache"), 24, 1),
    (
        timeseries(
            "KV blocks: capacity, reserved, used, forecast",
            "KV cache blocks of the server: its capacity, what kvgate has reserved for "
            "admitted requests, what the server reports in use, the part of that use "
            "kvgate's requests do not explain (traffic that bypasses kvgate), and kvgate's "
            "forecast peak (forecast peak ratio x capacity). Forecast above capacity means "
            "preemptions.",
            [
                target(f"kvgate_kv_capacity_blocks{{{K}}}", "{{instance}} capacity"),
                target(f"kvgate_kv_reserved_blocks{{{K}}}", "{{instance}} reserved"),
                target(f"kvgate_kv_used_blocks{{{K}}}", "{{instance}} used"),
                target(f"kvgate_kv_others_blocks{{{K}}}", "{{instance}} others' use"),
                target(
                    f"kvgate_kv_forecast_peak_ratio{{{K}}} * kvgate_kv_capacity_blocks{{{K}}}",
                    "{{instance}} forecast peak",
                ),
            ],
        ),
        12,
        9,
    ),
    (
        timeseries(
            "KV utilisation: kvgate vs server",
            "Shares of the KV capacity: reserved and used as seen by kvgate, its forecast "
            "peak ratio (alert KvgateKVExhaustionPredicted above 1), and the vLLM server's "
            "own vllm:kv_cache_usage_perc (vllm:gpu_cache_usage_perc on older servers).",
            [
                target(
                    f"kvgate_kv_reserved_blocks{{{K}}} / kvgate_kv_capacity_blocks{{{K}}}",
                    "{{instance}} reserved",
                ),
                target(
                    f"kvgate_kv_used_blocks{{{K}}} / kvgate_kv_capacity_blocks{{{K}}}",
                    "{{instance}} used",
                ),
                target(f"kvgate_kv_forecast_peak_ratio{{{K}}}", "{{instance}} forecast peak"),
                target(
                    f"max by (instance) (vllm:kv_cache_usage_perc{{{V}}})"
                    f" or max by (instance) (vllm:gpu_cache_usage_perc{{{V}}})",
                    "{{instance}} vLLM usage",
                ),
            ],
            unit="percentunit",
            thresholds=[(None, "green"), (1, "red")],
        ),
        12,
        9,
    ),
    (
        timeseries(
            "Forecast time to KV exhaustion",
            "Time until kvgate's forecast peak exceeds the KV capacity, capped at 1 h for "
            "display (+Inf, never, shows as 1 h). Alert KvgateKVExhaustionImminent fires "
            "below 60 s.",
            [
                target(
                    f"clamp_max(kvgate_kv_forecast_exhaustion_seconds{{{K}}}, 3600)",
                    "{{instance}}",
                )
            ],
            unit="s",
            thresholds=[(None, "red"), (60, "green")],
        ),
        12,
        8,
    ),
    (
        timeseries(
            "vLLM preemptions",
            "Requests the vLLM server preempted (KV cache ran out). kvgate's job is to keep "
            "this at zero; alert VllmPreemptions.",
            [
                target(
                    f"sum by (instance) (rate(vllm:num_preemptions_total{{{V}}}[{RI}]))",
                    "{{instance}}",
                )
            ],
            unit="ops",
        ),
        12,
        8,
    ),
    (row("Prefix cache"), 24, 1),
    (
        timeseries(
            "Shared prompt blocks: held and saved",
            "Prefix caching (docs/prefix-caching.md). Held: distinct prompt blocks admitted "
            "requests hold by reference, each counted once however many requests share it "
            "(part of reserved). Saved: blocks the running requests share with requests "
            "admitted before them instead of each reserving a copy. Reserved blocks for scale.",
            [
                target(f"kvgate_prefix_held_blocks{{{K}}}", "{{instance}} held"),
                target(f"kvgate_prefix_shared_blocks{{{K}}}", "{{instance}} saved by sharing"),
                target(f"kvgate_kv_reserved_blocks{{{K}}}", "{{instance}} reserved"),
            ],
        ),
        12,
        8,
    ),
    (
        timeseries(
            "Prefix cache hit ratio: predicted vs server",
            "Prompt tokens found in the prefix cache over prompt tokens looked up. Predicted: "
            "kvgate's prediction at admission, for the requests whose prompt blocks it can "
            "key. vLLM: the server's own vllm:prefix_cache_hits / vllm:prefix_cache_queries "
            "(vllm:gpu_prefix_cache_* on older servers), over all its traffic; both over the "
            "rate interval, and since start (kvgate_prefix_cache_hit_ratio). Predicted well "
            "above the server's: kvgate counts on hits that do not happen (its view of the "
            "server's cache is off; see the events panels).",
            [
                target(
                    "sum by (instance) "
                    f"(rate(kvgate_prefix_predicted_hit_tokens_total{{{K}}}[{RI}]))"
                    f" / sum by (instance) (rate(kvgate_prefix_query_tokens_total{{{K}}}[{RI}]))",
                    "{{instance}} predicted",
                ),
                target(
                    f"(sum by (instance) (rate(vllm:prefix_cache_hits_total{{{V}}}[{RI}]))"
                    f" or sum by (instance) (rate(vllm:gpu_prefix_cache_hits_total{{{V}}}[{RI}])))"
                    f" / (sum by (instance) (rate(vllm:prefix_cache_queries_total{{{V}}}[{RI}]))"
                    " or sum by (instance) "
                    f"(rate(vllm:gpu_prefix_cache_queries_total{{{V}}}[{RI}])))",
                    "{{instance}} vLLM",
                ),
                target(
                    f"kvgate_prefix_cache_hit_ratio{{{K}}}", "{{instance}} {{source}} since start"
                ),
            ],
            unit="percentunit",
            maximum=1,
        ),
        12,
        8,
    ),
    (
        stat(
            "Prefix cache source",
            "Where kvgate's view of the server's prefix cache comes from "
            "(kvgate_prefix_cache_source): events (the server's KV cache events, "
            "--kv-events-endpoint), traffic (a model fed by kvgate's own requests: no events "
            "configured, or they are stale) or off (the server does not share prompt blocks, "
            "or --prefix-caching off).",
            [
                target(
                    f'sum by (instance) (3 * kvgate_prefix_cache_source{{{K}, source="events"}}'
                    f' or 2 * kvgate_prefix_cache_source{{{K}, source="traffic"}}'
                    f' or kvgate_prefix_cache_source{{{K}, source="off"}})',
                    "{{instance}}",
                )
            ],
            thresholds=[(None, "text"), (2, "blue"), (3, "green")],
            mappings=[
                {
                    "type": "value",
                    "options": {
                        "1": {"text": "off", "color": "text", "index": 0},
                        "2": {"text": "traffic", "color": "blue", "index": 1},
                        "3": {"text": "events", "color": "green", "index": 2},
                    },
                }
            ],
        ),
        5,
        7,
    ),
    (
        stat(
            "Server prefix caching",
            "Whether the vLLM server shares prompt blocks between requests, from its "
            "vllm:cache_config_info (kvgate_server_prefix_caching; vLLM's default is on).",
            [target(f"kvgate_server_prefix_caching{{{K}}}", "{{instance}}")],
            thresholds=[(None, "text"), (1, "green")],
            mappings=[
                {
                    "type": "value",
                    "options": {
                        "0": {"text": "OFF", "color": "text", "index": 0},
                        "1": {"text": "ON", "color": "green", "index": 1},
                    },
                }
            ],
        ),
        4,
        7,
    ),
    (
        stat(
            "KV events stale",
            "1 when the server prefilled requests kvgate sent and published no KV cache event "
            "for them within --kv-events-stale-s (default 5 s): kvgate models the server's "
            "cache from its own traffic until events flow again (docs/prefix-caching.md). "
            "Alert "
            "KvgateKVEventsStale when it lasts 5 minutes with the server's prefix caching on "
            "while kvgate sends it requests. No data: --kv-events-endpoint is not set.",
            [target(f"kvgate_kv_events_stale{{{K}}}", "{{instance}}")],
            thresholds=[(None, "green"), (1, "red")],
            mappings=[
                {
                    "type": "value",
                    "options": {
                        "0": {"text": "fresh", "color": "green", "index": 0},
                        "1": {"text": "STALE", "color": "red", "index": 1},
                    },
                }
            ],
        ),
        4,
        7,
    ),
    (
        timeseries(
            "KV events age",
            "Seconds since the last batch of the server's KV cache events, capped at 1 h for "
            "display (+Inf, none received yet, shows as 1 h). The server publishes only when "
            "its cache changes: an idle server's events age without being stale. No data: "
            "--kv-events-endpoint is not set.",
            [
                target(
                    f"clamp_max(kvgate_kv_events_age_seconds{{{K}}}, 3600)", "{{instance}}"
                )
            ],
            unit="s",
        ),
        6,
        7,
    ),
    (
        timeseries(
            "KV events gaps, decode errors and connection",
            "Gaps in the KV cache events' sequence numbers (missed events, a restarted "
            "server, a lost connection) and batches kvgate could not decode (a changed event "
            "format): each drops kvgate's view of the server's cache, which then refills from "
            "new events. Connected: 1 while the subscription is up. No data: "
            "--kv-events-endpoint is not set.",
            [
                target(
                    f"sum by (instance) (increase(kvgate_kv_events_gaps_total{{{K}}}[{RI}]))",
                    "{{instance}} gaps",
                ),
                target(
                    "sum by (instance) "
                    f"(increase(kvgate_kv_events_decode_errors_total{{{K}}}[{RI}]))",
                    "{{instance}} decode errors",
                ),
                target(f"kvgate_kv_events_connected{{{K}}}", "{{instance}} connected"),
            ],
        ),
        5,
        7,
    ),
    (row("Predictions"), 24, 1),
    (
        timeseries(
            "TTFT: predicted vs observed",
            "Time to first token: kvgate's prediction at admission vs what it observed on "
            "the proxied stream, beside the vLLM server's own histogram.",
            [
                target(quantile(0.5, "kvgate_predicted_ttft_seconds", K), "predicted p50"),
                target(quantile(0.5, "kvgate_observed_ttft_seconds", K), "observed p50"),
                target(quantile(0.9, "kvgate_predicted_ttft_seconds", K), "predicted p90"),
                target(quantile(0.9, "kvgate_observed_ttft_seconds", K), "observed p90"),
                target(quantile(0.9, "vllm:time_to_first_token_seconds", V), "vLLM p90"),
            ],
            unit="s",
        ),
        12,
        8,
    ),
    (
        timeseries(
            "TPOT: predicted vs observed",
            "Time per output token: kvgate's prediction vs what it observed, beside the vLLM "
            "server's inter-token latency (vllm:time_per_output_token_seconds on older "
            "servers).",
            [
                target(quantile(0.5, "kvgate_predicted_tpot_seconds", K), "predicted p50"),
                target(quantile(0.5, "kvgate_observed_tpot_seconds", K), "observed p50"),
                target(quantile(0.9, "kvgate_predicted_tpot_seconds", K), "predicted p90"),
                target(quantile(0.9, "kvgate_observed_tpot_seconds", K), "observed p90"),
                target(
                    "histogram_quantile(0.9, "
                    f"sum by (le) (rate(vllm:inter_token_latency_seconds_bucket{{{V}}}[{RI}]))"
                    " or sum by (le) "
                    f"(rate(vllm:time_per_output_token_seconds_bucket{{{V}}}[{RI}])))",
                    "vLLM p90",
                ),
            ],
            unit="s",
        ),
        12,
        8,
    ),
    (
        timeseries(
            "Prediction error ratio (observed / predicted)",
            "Quantiles of observed / predicted per quantity; 1 is perfect. Alert "
            "KvgatePredictionDrift fires when the median stays outside [0.67, 1.5] "
            "(dashed lines): above, kvgate admits too much; below, it is too cautious.",
            [
                target(
                    quantile(0.5, "kvgate_prediction_error_ratio", K, "quantity, le"),
                    "{{quantity}} median",
                ),
                target(
                    quantile(0.1, "kvgate_prediction_error_ratio", K, "quantity, le"),
                    "{{quantity}} p10",
                ),
                target(
                    quantile(0.9, "kvgate_prediction_error_ratio", K, "quantity, le"),
                    "{{quantity}} p90",
                ),
            ],
            unit="none",
            thresholds=[(None, "red"), (0.67, "green"), (1.5, "red")],
            log_scale=True,
            minimum=None,
        ),
        24,
        8,
    ),
    (row("Upstream and sidecar"), 24, 1),
    (
        stat(
            "Upstream up",
            "Whether each kvgate sees its vLLM server as reachable (alert KvgateUpstreamDown).",
            [target(f"kvgate_upstream_up{{{K}}}", "{{instance}}")],
            thresholds=[(None, "red"), (1, "green")],
            mappings=[
                {
                    "type": "value",
                    "options": {
                        "0": {"text": "DOWN", "color": "red", "index": 0},
                        "1": {"text": "UP", "color": "green", "index": 1},
                    },
                }
            ],
        ),
        6,
        7,
    ),
    (
        timeseries(
            "Upstream metrics age",
            "Seconds since kvgate last read the vLLM server's /metrics (alert "
            "KvgateUpstreamMetricsStale above 30 s); shown as 1 h until the first read "
            "(a server loading its model: alert KvgateUpstreamNeverUp).",
            [target(f"clamp_max(kvgate_upstream_metrics_age_seconds{{{K}}}, 3600)",
                    "{{instance}}")],
            unit="s",
            thresholds=[(None, "green"), (30, "red")],
        ),
        6,
        7,
    ),
    (
        table(
            "kvgate sidecars",
            "kvgate_info: version, served model and mode (enforce or shadow) of each sidecar.",
            [target(f'kvgate_info{{{K}, model=~"$model"}}', instant=True)],
        ),
        12,
        7,
    ),
    (
        timeseries(
            "Shadow decisions",
            "Shadow mode (--mode shadow) admits everything; this is what enforce mode would "
            "have decided, by outcome.",
            [
                target(
                    f"sum by (outcome) (rate(kvgate_shadow_decisions_total{{{K}}}[{RI}]))",
                    "{{outcome}}",
                )
            ],
            unit="reqps",
            stack=True,
        ),
        12,
        7,
    ),
    (
        timeseries(
            "Prompt counting",
            "Who counted each prompt: local (kvgate's tokenizer: no round trip to the "
            "server), server (its /tokenize: the first checks of each request shape, shapes "
            "whose ids differed, prompts with images) or estimate (neither could: KV "
            "predictions less exact); the checks of local ids against the server's "
            "(a mismatch sends that shape to the server for good); and long prompts "
            "counted from where they differ from a recent one (spliced), those joins "
            "compared with the whole prompt encoded (checked) and any difference "
            "(mismatch: every prompt encoded whole from then on).",
            [
                target(
                    f"sum by (source) (rate(kvgate_prompt_tokens_counted_total{{{K}}}[{RI}]))",
                    "counted: {{source}}",
                ),
                target(
                    f"sum by (result) (rate(kvgate_tokenizer_checks_total{{{K}}}[{RI}]))",
                    "checked: {{result}}",
                ),
                target(
                    f"sum(rate(kvgate_tokenize_fallback_total{{{K}}}[{RI}]))",
                    "estimated (fallback)",
                ),
                target(
                    f"sum by (result) "
                    f"(rate(kvgate_tokenizer_prefix_reuse_total{{{K}}}[{RI}]))",
                    "long prompts reused: {{result}}",
                ),
            ],
            unit="reqps",
        ),
        12,
        7,
    ),
    (
        timeseries(
            "Upstream errors",
            "Proxied requests that failed between kvgate and vLLM, by kind: connect (refused "
            "or unreachable), timeout (--read-timeout-s), disconnect (cut mid-answer), "
            "status (vLLM answered 5xx).",
            [
                target(
                    f"sum by (kind) (rate(kvgate_upstream_errors_total{{{K}}}[{RI}]))",
                    "{{kind}}",
                )
            ],
            unit="reqps",
            stack=True,
        ),
        12,
        7,
    ),
    (
        timeseries(
            "Server admission refusals",
            "Requests the server's own admission refused (vLLM 0.29+: 503 for "
            "--max-num-queued-reqs / --max-num-queued-tokens), by reason: those kvgate "
            "forwarded (give kvgate the server's limits and this stays at 0) and all the "
            "server refused, kvgate's traffic or not.",
            [
                target(
                    f"sum by (reason) (rate(kvgate_upstream_refusals_total{{{K}}}[{RI}]))",
                    "through kvgate: {{reason}}",
                ),
                target(
                    f"sum by (reason) (rate(vllm:admission_rejections_total{{{V}}}[{RI}]))",
                    "vLLM: {{reason}}",
                ),
            ],
            unit="reqps",
        ),
        12,
        7,
    ),
    (row("vLLM server"), 24, 1),
    (
        timeseries(
            "vLLM KV cache usage",
            "The server's own KV cache usage (0-1): vllm:kv_cache_usage_perc, or "
            "vllm:gpu_cache_usage_perc on older servers.",
            [
                target(
                    f"max by (instance) (vllm:kv_cache_usage_perc{{{V}}})"
                    f" or max by (instance) (vllm:gpu_cache_usage_perc{{{V}}})",
                    "{{instance}}",
                )
            ],
            unit="percentunit",
            maximum=1,
        ),
        8,
        8,
    ),
    (
        timeseries(
            "vLLM requests running / waiting",
            "Requests the vLLM scheduler runs and holds waiting. With kvgate in front, "
            "waiting should stay near zero: kvgate queues instead.",
            [
                target(
                    f"sum by (instance) (vllm:num_requests_running{{{V}}})",
                    "{{instance}} running",
                ),
                target(
                    f"sum by (instance) (vllm:num_requests_waiting{{{V}}})",
                    "{{instance}} waiting",
                ),
            ],
        ),
        8,
        8,
    ),
    (
        stat(
            "vLLM preemptions in range",
            "Requests the vLLM servers preempted over the dashboard's time range.",
            [
                target(
                    f"sum by (instance) (increase(vllm:num_preemptions_total{{{V}}}[$__range]))",
                    "{{instance}}",
                )
            ],
            thresholds=[(None, "green"), (1, "red")],
        ),
        8,
        8,
    ),
    (
        timeseries(
            "vLLM time to first token",
            "Quantiles of the server's vllm:time_to_first_token_seconds.",
            [
                target(quantile(q, "vllm:time_to_first_token_seconds", V), f"p{round(q * 100)}")
                for q in (0.5, 0.9, 0.99)
            ],
            unit="s",
        ),
        12,
        8,
    ),
    (
        timeseries(
            "vLLM inter-token latency",
            "Quantiles of the server's vllm:inter_token_latency_seconds "
            "(vllm:time_per_output_token_seconds on older servers).",
            [
                target(
                    f"histogram_quantile({q}, "
                    f"sum by (le) (rate(vllm:inter_token_latency_seconds_bucket{{{V}}}[{RI}]))"
                    " or sum by (le) "
                    f"(rate(vllm:time_per_output_token_seconds_bucket{{{V}}}[{RI}])))",
                    f"p{round(q * 100)}",
                )
                for q in (0.5, 0.9, 0.99)
            ],
            unit="s",
        ),
        12,
        8,
    ),
]


def _place(layout: list[tuple[Panel, int, int]]) -> list[Panel]:
    """Give each panel an id and a gridPos, filling 24-column lines left to right."""
    panels: list[Panel] = []
    x = y = line_height = 0
    for number, (panel, width, height) in enumerate(layout, start=1):
        if panel["type"] == "row" or x + width > 24:
            y += line_height
            x = line_height = 0
        panels.append({"id": number, "gridPos": {"h": height, "w": width, "x": x, "y": y}, **panel})
        x += width
        line_height = max(line_height, height)
        if panel["type"] == "row":
            y += height
            x = line_height = 0
    return panels


def _query_variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "definition": query,
        "query": query,
        "refresh": 2,  # on time range change: new sidecars appear
        "includeAll": True,
        "multi": True,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "options": [],
        "regex": "",
        "sort": 1,
        "hide": 0,
        "skipUrlSync": False,
    }


def dashboard() -> dict[str, Any]:
    return {
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "description": "kvgate: KV-cache-aware admission control in front of vLLM. Decisions, "
        "queue, KV capacity vs reserved vs used vs forecast, prefix cache sharing and its "
        "source, predicted vs observed latency, and the vLLM server's own metrics. "
        "Generated by dashboards/generate.py.",
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [],
        "panels": _place(LAYOUT),
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "tags": ["kvgate", "vllm"],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "options": [],
                    "refresh": 1,
                    "regex": "",
                    "includeAll": False,
                    "multi": False,
                    "hide": 0,
                    "skipUrlSync": False,
                },
                _query_variable("model", "Model", "label_values(kvgate_info, model)"),
                _query_variable(
                    "instance",
                    "kvgate instance",
                    'label_values(kvgate_info{model=~"$model"}, instance)',
                ),
                _query_variable(
                    "vllm_instance",
                    "vLLM instance",
                    'label_values(vllm:num_requests_running{model_name=~"$model"}, instance)',
                ),
            ]
        },
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": "kvgate",
        "uid": "kvgate",
        "version": 1,
        "weekStart": "",
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def outputs() -> dict[Path, str]:
    text = render()
    return {DASHBOARD: text, HELM_DASHBOARD: text}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if a generated file is out of date"
    )
    args = parser.parse_args(argv)
    stale = []
    for path, text in outputs().items():
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == text:
            continue
        if args.check:
            stale.append(path)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path.relative_to(ROOT)}")
    for path in stale:
        print(
            f"{path.relative_to(ROOT)} is out of date: run python dashboards/generate.py",
            file=sys.stderr,
        )
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
