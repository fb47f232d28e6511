"""The gauges kvgate exports from its state at each Prometheus scrape."""

from __future__ import annotations

import dataclasses
import math

from prometheus_client import CollectorRegistry, generate_latest

from sidecar.metrics import SidecarMetrics, StateView


def _exported(view: StateView, prefix: str = "kvgate_kv_", *,
              gateway: bool = False) -> dict[str, float]:
    registry = CollectorRegistry()
    SidecarMetrics(registry, lambda: view, gateway_metrics=gateway)
    values = {}
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith(prefix):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def _view(others_blocks: int | None) -> StateView:
    return StateView(queue_requests=0, inflight_requests=2, capacity_blocks=63,
                     reserved_blocks=40, used_blocks=45, forecast_peak_ratio=0.7,
                     forecast_exhaustion_s=math.inf, recommended_max_concurrency=4,
                     upstream_up=True, upstream_metrics_age_s=0.5, server_waiting=0,
                     others_blocks=others_blocks)


def test_others_use_is_exported_beside_reserved_and_used() -> None:
    values = _exported(_view(7))
    assert values["kvgate_kv_others_blocks"] == 7
    assert (values["kvgate_kv_reserved_blocks"], values["kvgate_kv_used_blocks"]) == (40, 45)
    # Without a fresh scrape there is no figure: NaN, not 0.
    assert math.isnan(_exported(_view(None))["kvgate_kv_others_blocks"])


def _gateway(view: StateView) -> dict[str, float]:
    return _exported(view, "vllm:", gateway=True)


def test_the_gateway_usage_counts_what_others_hold_beside_what_kvgate_reserved() -> None:
    view = dataclasses.replace(_view(30), capacity_blocks=100, forecast_peak_ratio=0.5,
                               server_waiting=1)
    values = _gateway(view)
    assert values["vllm:kv_cache_usage_perc"] == 0.7  # 40 reserved + 30 others
    assert values["vllm:num_requests_waiting"] == 1
    without_others = _gateway(dataclasses.replace(view, others_blocks=None))
    assert without_others["vllm:kv_cache_usage_perc"] == 0.5  # the forecast's peak


def test_the_gateway_sees_no_room_while_kvgate_holds_requests_back() -> None:
    # Two requests queued while little is reserved or used (the head needs more than
    # the target leaves, or the server's own limits hold them): an endpoint picker
    # must not send this pod more.
    view = dataclasses.replace(_view(20), queue_requests=2, inflight_requests=0,
                               reserved_blocks=5, used_blocks=10, forecast_peak_ratio=0.1)
    values = _gateway(view)
    assert values["vllm:kv_cache_usage_perc"] == 1.0
    assert values["vllm:num_requests_waiting"] == 2
