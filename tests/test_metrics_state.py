"""The gauges kvgate exports from its state at each Prometheus scrape."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, generate_latest

from sidecar.metrics import SidecarMetrics, StateView


def _exported(view: StateView) -> dict[str, float]:
    registry = CollectorRegistry()
    SidecarMetrics(registry, lambda: view)
    values = {}
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith("kvgate_kv_"):
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
