"""Queue policies: small pure pieces, one question each, apart from the queue mechanism.

- ordering (`ordering.py`): which request of a tenant goes next?
- fairness (`fairness.py`): which tenant of a priority band goes next?
- priority (`priority.py`): which band goes next?
- limits (`limits.py`): is there room in the queue, and has a request waited too long?

Each takes a snapshot and returns an answer; the queue (`sidecar.admission.queue`)
holds the state. `tests/test_policy_conformance.py` runs every implementation of a
kind through the same suite.
"""

from sidecar.admission.policies.fairness import ArrivalOrder, CostFair, FairnessPolicy, TenantView
from sidecar.admission.policies.limits import QueueLimits
from sidecar.admission.policies.ordering import (
    EarliestDeadline,
    EntryView,
    Fcfs,
    OrderingPolicy,
)
from sidecar.admission.policies.priority import BandView, PriorityPolicy, StrictPriority

ORDERINGS: dict[str, type[Fcfs] | type[EarliestDeadline]] = {
    Fcfs.name: Fcfs,
    EarliestDeadline.name: EarliestDeadline,
}
FAIRNESS: dict[str, type[CostFair] | type[ArrivalOrder]] = {
    CostFair.name: CostFair,
    ArrivalOrder.name: ArrivalOrder,
}

__all__ = [
    "FAIRNESS",
    "ORDERINGS",
    "ArrivalOrder",
    "BandView",
    "CostFair",
    "EarliestDeadline",
    "EntryView",
    "FairnessPolicy",
    "Fcfs",
    "OrderingPolicy",
    "PriorityPolicy",
    "QueueLimits",
    "StrictPriority",
    "TenantView",
]
