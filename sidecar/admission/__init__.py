"""The admission core: KV reservations, a fair priority queue and predicted TTFT.

asyncio, but no HTTP and no Prometheus: the server wires it to both.
"""

from sidecar.admission.controller import (
    AdmissionController,
    AdmissionSettings,
    DecisionListener,
    Mode,
    ServerState,
)
from sidecar.admission.cost import CostModel, RequestCost
from sidecar.admission.forecast import Forecast
from sidecar.admission.ledger import Ledger, Reservation
from sidecar.admission.outcomes import (
    FINAL_OUTCOMES,
    REJECTIONS,
    SHADOW_OUTCOMES,
    Decision,
    Outcome,
    Rejected,
)
from sidecar.admission.policies import QueueLimits
from sidecar.admission.running import AdmissionRequest, Ticket
from sidecar.admission.server_queue import ServerQueueLimits

__all__ = [
    "FINAL_OUTCOMES",
    "REJECTIONS",
    "SHADOW_OUTCOMES",
    "AdmissionController",
    "AdmissionRequest",
    "AdmissionSettings",
    "CostModel",
    "Decision",
    "DecisionListener",
    "Forecast",
    "Ledger",
    "Mode",
    "Outcome",
    "QueueLimits",
    "Rejected",
    "RequestCost",
    "Reservation",
    "ServerQueueLimits",
    "ServerState",
    "Ticket",
]
