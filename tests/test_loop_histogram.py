"""kvgate's request-path histogram exposes what prometheus_client's Histogram exposes for
the same observations (its oracle), without the locks."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from sidecar.metrics import LATENCY_BUCKETS_S, RATIO_BUCKETS, LoopHistogram


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in registry.collect() for s in family.samples
            if not s.name.endswith("_created")}


@given(st.lists(st.floats(min_value=-5, max_value=200, allow_nan=False), max_size=60)
       | st.lists(st.sampled_from([*LATENCY_BUCKETS_S, 0.0, 1e9]), max_size=60))
def test_the_same_exposition_as_prometheus_client(values: list[float]) -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    mine = LoopHistogram("kvgate_x_seconds", "x.", LATENCY_BUCKETS_S, ours).labels()
    reference = Histogram("kvgate_x_seconds", "x.", buckets=LATENCY_BUCKETS_S,
                          registry=theirs)
    for value in values:
        mine.observe(value)
        reference.observe(value)
    got, want = samples(ours), samples(theirs)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key


def test_labelled_series_and_the_text_format() -> None:
    registry = CollectorRegistry()
    errors = LoopHistogram("kvgate_e_ratio", "Observed / predicted.", RATIO_BUCKETS, registry,
                           ("quantity",))
    errors.labels("ttft").observe(1.0)  # on a bound: counted in le="1.0"
    errors.labels("ttft").observe(7.0)  # above the last bound: only in +Inf
    errors.labels("tpot").observe(math.nan)  # ignored, as it fits no bucket
    text = generate_latest(registry).decode()
    assert "# TYPE kvgate_e_ratio histogram" in text
    assert 'kvgate_e_ratio_bucket{le="0.9",quantity="ttft"} 0.0' in text
    assert 'kvgate_e_ratio_bucket{le="1.0",quantity="ttft"} 1.0' in text
    assert 'kvgate_e_ratio_bucket{le="5.0",quantity="ttft"} 1.0' in text
    assert 'kvgate_e_ratio_bucket{le="+Inf",quantity="ttft"} 2.0' in text
    assert 'kvgate_e_ratio_count{quantity="ttft"} 2.0' in text
    assert 'kvgate_e_ratio_sum{quantity="ttft"} 8.0' in text
    assert 'kvgate_e_ratio_count{quantity="tpot"} 0.0' in text


def test_bad_buckets_labels_and_names_are_refused() -> None:
    registry = CollectorRegistry()
    with pytest.raises(ValueError, match="distinct finite"):
        LoopHistogram("kvgate_a", "a.", [1.0, 1.0], registry)
    with pytest.raises(ValueError, match="distinct finite"):
        LoopHistogram("kvgate_b", "b.", [1.0, math.inf], registry)
    labelled = LoopHistogram("kvgate_c", "c.", [1.0], registry, ("quantity",))
    with pytest.raises(ValueError, match="labels"):
        labelled.labels()
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        LoopHistogram("kvgate_c", "again.", [1.0], registry)
