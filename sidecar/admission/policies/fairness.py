"""Fairness: which tenant of a priority band goes next?

- `CostFair`: the tenant that has been served the least predicted GPU cost
  (GPU-seconds: prefill time plus the KV share held while decoding), like weighted
  fair queuing with cost as the weight. A tenant that (re)joins starts at the
  least-served active tenant's level, so idling earns no credit. Inputs: each
  tenant's served cost and head arrival. Trade-off: a tenant of long prompts or
  long outputs gets fewer requests through than one of short ones, by design;
  fairness is by what requests cost, not by how many there are.
- `ArrivalOrder`: no fairness: the tenant whose head arrived first (global FCFS in
  the band). Trade-off: one tenant's burst delays everyone behind it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol


@dataclass(frozen=True)
class TenantView:
    name: str
    served_cost: float
    head_seq: int


class FairnessPolicy(Protocol):
    name: ClassVar[str]

    def pick(self, tenants: Sequence[TenantView]) -> str:
        """The tenant to serve next; `tenants` are those with queued requests."""
        ...

    def joined(self, own_cost: float, least_active_cost: float | None) -> float:
        """The served cost a tenant starts from when its queue becomes non-empty."""
        ...

    def goes_first(self, served_cost: float, other_served_cost: float) -> bool:
        """Whether a waiting request, its tenant at `served_cost` once the tenant's
        earlier ones are served, goes before a newcomer whose tenant is then at
        `other_served_cost` (for predicted waits)."""
        ...


@dataclass(frozen=True)
class CostFair:
    name: ClassVar[str] = "cost"

    def pick(self, tenants: Sequence[TenantView]) -> str:
        return min(tenants, key=lambda t: (t.served_cost, t.head_seq, t.name)).name

    def joined(self, own_cost: float, least_active_cost: float | None) -> float:
        if least_active_cost is None:
            return own_cost
        return max(own_cost, least_active_cost)

    def goes_first(self, served_cost: float, other_served_cost: float) -> bool:
        return served_cost <= other_served_cost  # a tie goes to the older head


@dataclass(frozen=True)
class ArrivalOrder:
    name: ClassVar[str] = "none"

    def pick(self, tenants: Sequence[TenantView]) -> str:
        return min(tenants, key=lambda t: (t.head_seq, t.name)).name

    def joined(self, own_cost: float, least_active_cost: float | None) -> float:
        return own_cost

    def goes_first(self, served_cost: float, other_served_cost: float) -> bool:
        return True  # it arrived first
