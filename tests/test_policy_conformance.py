"""One conformance suite per policy kind, run over every implementation."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.admission.policies import (
    FAIRNESS,
    ORDERINGS,
    BandView,
    EntryView,
    QueueLimits,
    StrictPriority,
    TenantView,
)

ORDERING_IMPLS = [cls() for cls in ORDERINGS.values()]
FAIRNESS_IMPLS = [cls() for cls in FAIRNESS.values()]
PRIORITY_IMPLS = [StrictPriority(None), StrictPriority(5.0), StrictPriority(0.0)]

entries = st.lists(
    st.builds(EntryView, st.integers(0, 10**6), st.floats(0, 1e6),
              st.none() | st.floats(0, 1e6)),
    min_size=1, max_size=30, unique_by=lambda e: e.seq,
)


@pytest.mark.parametrize("policy", ORDERING_IMPLS, ids=lambda p: p.name)
@given(entries)
def test_ordering_is_a_total_order_consistent_with_arrival_on_ties(
    policy: object, items: list[EntryView]
) -> None:
    keys = [policy.key(e) for e in items]  # type: ignore[attr-defined]
    assert len(set(keys)) == len(keys)  # unique: a total order
    for a in items:
        for b in items:
            same_rank = policy.key(a)[0] == policy.key(b)[0]  # type: ignore[attr-defined]
            if same_rank and a.seq < b.seq:
                assert policy.key(a) < policy.key(b)  # type: ignore[attr-defined]


@pytest.mark.parametrize("policy", ORDERING_IMPLS, ids=lambda p: p.name)
def test_ordering_without_deadlines_is_fcfs(policy: object) -> None:
    items = [EntryView(seq, float(seq), None) for seq in (5, 1, 3)]
    ranked = sorted(items, key=policy.key)  # type: ignore[attr-defined]
    assert [e.seq for e in ranked] == [1, 3, 5]


tenants = st.lists(
    st.builds(TenantView, st.text(min_size=1, max_size=4), st.floats(0, 1e6),
              st.integers(0, 10**6)),
    min_size=1, max_size=20, unique_by=lambda t: t.name,
)


@pytest.mark.parametrize("policy", FAIRNESS_IMPLS, ids=lambda p: p.name)
@given(tenants)
def test_fairness_picks_a_waiting_tenant_deterministically(
    policy: object, views: list[TenantView]
) -> None:
    chosen = policy.pick(views)  # type: ignore[attr-defined]
    assert chosen in {t.name for t in views}
    assert policy.pick(list(reversed(views))) == chosen  # type: ignore[attr-defined]


@pytest.mark.parametrize("policy", FAIRNESS_IMPLS, ids=lambda p: p.name)
@given(st.floats(0, 1e6), st.none() | st.floats(0, 1e6))
def test_fairness_join_never_gives_credit_below_own_history(
    policy: object, own: float, least: float | None
) -> None:
    assert policy.joined(own, least) >= own  # type: ignore[attr-defined]


def test_cost_fairness_prefers_the_least_served_tenant() -> None:
    policy = FAIRNESS["cost"]()
    views = [TenantView("a", 10.0, 1), TenantView("b", 2.0, 9)]
    assert policy.pick(views) == "b"
    # A tenant that joins late starts level with the least-served active one.
    assert policy.joined(0.0, 7.0) == 7.0


bands = st.lists(
    st.builds(BandView, st.integers(0, 9), st.integers(1, 100), st.floats(0, 1000)),
    min_size=1, max_size=10, unique_by=lambda b: b.band,
)


@pytest.mark.parametrize("policy", PRIORITY_IMPLS, ids=lambda p: f"strict-{p.starvation_bound_s}")
@given(bands, st.floats(0, 2000))
def test_priority_picks_a_non_empty_band_and_honours_the_bound(
    policy: StrictPriority, views: list[BandView], now: float
) -> None:
    chosen = policy.pick(views, now)
    assert chosen in {b.band for b in views}
    bound = policy.starvation_bound_s
    starved = [b for b in views if bound is not None and now - b.oldest_arrival_s > bound]
    if starved:
        oldest = min(b.oldest_arrival_s for b in starved)
        assert next(b for b in views if b.band == chosen).oldest_arrival_s == oldest
    else:
        assert chosen == min(b.band for b in views)


@given(st.integers(0, 100), st.integers(0, 200), st.floats(0.1, 100), st.floats(0, 200))
def test_limits(max_length: int, queued: int, max_wait: float, waited: float) -> None:
    limits = QueueLimits(max_length, max_wait)
    assert limits.has_room(queued) == (queued < max_length)
    assert limits.expired(0.0, waited) == (waited >= max_wait)
    assert limits.remaining_s(0.0, waited) == max(0.0, max_wait - waited)


def test_limits_reject_nonsense() -> None:
    with pytest.raises(ValueError, match="max wait"):
        QueueLimits(10, 0)
    with pytest.raises(ValueError, match="max length"):
        QueueLimits(-1, 1)
