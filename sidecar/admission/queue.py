"""The admission queue: mechanism only. Policies (`policies/`) decide the order.

Structure: priority bands -> tenants -> a heap per tenant keyed by the ordering
policy. Removal (a client that left, a request that timed out) is lazy: the entry
is marked and skipped when it reaches the top of a heap; counters are exact at all
times. Every operation is O(log n) in the tenant's queue plus O(bands + tenants of
one band) for the choice of the next request.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from sidecar.admission.policies import (
    BandView,
    EntryView,
    FairnessPolicy,
    OrderingPolicy,
    PriorityPolicy,
    TenantView,
)

# The arrival order a request not yet pushed is compared with (after every waiting one).
_NEWEST = 2 ** 62
# Served-cost memory of tenants with empty queues, per band.
_REMEMBERED_TENANTS = 4096


@dataclass(eq=False)
class Entry:
    """One waiting request. `payload` is the mechanism's user's (a future)."""

    arrival_s: float
    band: int
    tenant: str
    blocks: int
    cost: float
    deadline_s: float | None = None
    payload: Any = None
    seq: int = -1
    removed: bool = False

    def view(self) -> EntryView:
        return EntryView(self.seq, self.arrival_s, self.deadline_s)


@dataclass
class _Tenant:
    served_cost: float
    heap: list[tuple[tuple[float, int], int, Entry]] = field(default_factory=list)
    size: int = 0

    def head(self) -> Entry | None:
        while self.heap and self.heap[0][2].removed:
            heapq.heappop(self.heap)
        return self.heap[0][2] if self.heap else None


@dataclass
class _Band:
    tenants: dict[str, _Tenant] = field(default_factory=dict)
    arrivals: list[tuple[float, int, Entry]] = field(default_factory=list)
    served: OrderedDict[str, float] = field(default_factory=OrderedDict)
    size: int = 0
    blocks: int = 0

    def oldest(self) -> Entry | None:
        while self.arrivals and self.arrivals[0][2].removed:
            heapq.heappop(self.arrivals)
        return self.arrivals[0][2] if self.arrivals else None


class AdmissionQueue:
    def __init__(
        self, ordering: OrderingPolicy, fairness: FairnessPolicy, priority: PriorityPolicy
    ) -> None:
        self.ordering = ordering
        self.fairness = fairness
        self.priority = priority
        self._bands: dict[int, _Band] = {}
        self._seq = itertools.count()
        self._size = 0
        self._blocks = 0
        self._version = 0

    def __len__(self) -> int:
        return self._size

    @property
    def version(self) -> int:
        """Changes whenever an entry comes or goes (what is ahead of whom may change)."""
        return self._version

    @property
    def blocks(self) -> int:
        return self._blocks

    def push(self, entry: Entry) -> Entry:
        entry.seq = next(self._seq)
        band = self._bands.setdefault(entry.band, _Band())
        tenant = band.tenants.get(entry.tenant)
        if tenant is None:
            active = [t.served_cost for t in band.tenants.values()]
            own = band.served.pop(entry.tenant, 0.0)
            start = self.fairness.joined(own, min(active) if active else None)
            tenant = band.tenants[entry.tenant] = _Tenant(start)
        heapq.heappush(tenant.heap, (self.ordering.key(entry.view()), entry.seq, entry))
        heapq.heappush(band.arrivals, (entry.arrival_s, entry.seq, entry))
        tenant.size += 1
        band.size += 1
        band.blocks += entry.blocks
        self._size += 1
        self._blocks += entry.blocks
        self._version += 1
        return entry

    def remove(self, entry: Entry) -> bool:
        """Take a waiting entry out. False if it already left (popped or removed)."""
        if entry.removed or entry.seq < 0:
            return False
        band = self._bands.get(entry.band)
        tenant = band.tenants.get(entry.tenant) if band else None
        if band is None or tenant is None:
            return False
        entry.removed = True
        self._account_leave(band, entry.tenant, tenant, entry)
        return True

    def _account_leave(self, band: _Band, name: str, tenant: _Tenant, entry: Entry) -> None:
        self._version += 1
        tenant.size -= 1
        band.size -= 1
        band.blocks -= entry.blocks
        self._size -= 1
        self._blocks -= entry.blocks
        if tenant.size == 0:
            del band.tenants[name]
            band.served[name] = tenant.served_cost
            if len(band.served) > _REMEMBERED_TENANTS:
                band.served.popitem(last=False)
        if band.size == 0:
            band.arrivals.clear()

    def peek(self, now_s: float) -> Entry | None:
        """The entry the policies would admit next."""
        chosen = self._choose(now_s)
        return None if chosen is None else chosen[2]

    def pop(self, now_s: float) -> Entry | None:
        """Take the next entry out and charge its tenant."""
        chosen = self._choose(now_s)
        if chosen is None:
            return None
        band, name, entry = chosen
        tenant = band.tenants[name]
        heapq.heappop(tenant.heap)
        entry.removed = True
        tenant.served_cost += entry.cost
        self._account_leave(band, name, tenant, entry)
        return entry

    def _choose(self, now_s: float) -> tuple[_Band, str, Entry] | None:
        views = []
        for number, band in self._bands.items():
            oldest = band.oldest() if band.size else None
            if oldest is not None:
                views.append(BandView(number, band.size, oldest.arrival_s))
        if not views:
            return None
        band = self._bands[self.priority.pick(views, now_s)]
        tenant_views = []
        for name, tenant in band.tenants.items():
            head = tenant.head()
            if head is not None:
                tenant_views.append(TenantView(name, tenant.served_cost, head.seq))
        name = self.fairness.pick(tenant_views)
        head = band.tenants[name].head()
        assert head is not None
        return band, name, head

    def newcomer_key(self, deadline_s: float | None) -> tuple[float, int]:
        """The ordering key a request pushed now with `deadline_s` would get (after
        every waiting one on a tie)."""
        return self.ordering.key(EntryView(_NEWEST, 0.0, deadline_s))

    def ahead_of(self, band: int, tenant: str,
                 key: tuple[float, int] | None = None) -> list[Entry]:
        """The entries served before a request of `tenant` pushed now to `band` (with
        the ordering `key`, `newcomer_key`; None: after all of its tenant's): those of
        the more important bands, and of its own band those the fairness policy takes
        first, its own tenant's those its ordering puts first. Starvation promotions are
        not foreseen. In the order the queue serves them: the more important bands
        first, each tenant's in its own order; a band's tenants one after another, where
        the queue alternates between them. (A list, built in comprehensions: with
        thousands queued, every arrival's predicted wait reads it. Sorting each tenant's
        heap, whose list is partly in order already, costs the decision nothing
        measurable: `bench/admission_decision.py`.)"""
        ahead: list[Entry] = []
        for number in sorted(self._bands):
            if number > band:
                break
            found = self._bands[number]
            if number < band:
                for other in found.tenants.values():
                    ahead += [entry for _, _, entry in sorted(other.heap) if not entry.removed]
                continue
            mine = found.tenants.get(tenant)
            if mine is not None:
                own = [entry for item_key, _, entry in sorted(mine.heap)
                       if not entry.removed and (key is None or item_key <= key)]
                ahead += own
                served = mine.served_cost + sum(entry.cost for entry in own)
            else:
                active = [t.served_cost for t in found.tenants.values()]
                served = self.fairness.joined(found.served.get(tenant, 0.0),
                                              min(active) if active else None)
            for name, other in found.tenants.items():
                if name == tenant:
                    continue
                level = other.served_cost
                if not self.fairness.goes_first(level, served):
                    continue
                # In the tenant's order: its items compare by (key, seq); seq is unique,
                # so the entries themselves are never compared.
                for _, _, entry in sorted(other.heap):
                    if entry.removed:
                        continue
                    if not self.fairness.goes_first(level, served):
                        break
                    ahead.append(entry)
                    level += entry.cost
        return ahead

    def waiting_ahead_of(self, band: int, now_s: float) -> int:
        """The requests served before a new one of `band` arriving at `now_s`: those of
        bands as important, and those of less important bands the priority policy
        serves first (starved past its bound)."""
        if not self._size:
            return 0
        return sum(b.size for b in self._bands_before(band, now_s))

    def _bands_before(self, band: int, now_s: float) -> list[_Band]:
        """The bands whose waiting requests are all served before a new one of `band`."""
        before = [b for number, b in self._bands.items() if number <= band]
        views = []
        for number, waiting in self._bands.items():
            oldest = waiting.oldest() if waiting.size and number > band else None
            if oldest is not None:
                views.append(BandView(number, waiting.size, oldest.arrival_s))
        if not views:
            return before
        own = self._bands.get(band)
        oldest_own = own.oldest() if own is not None and own.size else None
        views.append(BandView(band, 1, now_s if oldest_own is None else oldest_own.arrival_s))
        while True:
            picked = self.priority.pick(views, now_s)
            if picked == band:
                return before
            before.append(self._bands[picked])
            views = [v for v in views if v.band != picked]

    def oldest(self) -> Entry | None:
        oldest = [b.oldest() for b in self._bands.values() if b.size]
        candidates = [e for e in oldest if e is not None]
        return min(candidates, key=lambda e: e.arrival_s) if candidates else None

    def entries(self) -> Iterator[Entry]:
        for band in self._bands.values():
            for tenant in band.tenants.values():
                yield from _waiting(tenant)

    def summary(self) -> dict[str, dict[str, int]]:
        """Waiting requests per band and tenant (for the state endpoint)."""
        return {
            str(number): {name: t.size for name, t in band.tenants.items()}
            for number, band in sorted(self._bands.items())
            if band.size
        }

    def served_costs(self, band: int) -> dict[str, float]:
        found = self._bands.get(band)
        if found is None:
            return {}
        costs = dict(found.served)
        costs.update({name: t.served_cost for name, t in found.tenants.items()})
        return costs


def _waiting(tenant: _Tenant) -> Iterator[Entry]:
    return (entry for _, _, entry in tenant.heap if not entry.removed)
