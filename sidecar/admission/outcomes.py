"""What the admission core decides about a request, and why.

`Outcome` is a small enum usable as a metric label; a `Decision` carries the reason
a person can act on and the numbers behind it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from sidecar.admission.quick_init import quick_init


class Outcome(StrEnum):
    ADMITTED = "admitted"
    """Sent to the server, at once or after waiting in the queue."""
    NEVER_FITS = "never_fits"
    """Prompt plus output reservation exceed max_model_len or the whole KV cache."""
    QUEUE_FULL = "queue_full"
    """No KV headroom now and the queue holds its maximum."""
    DEADLINE = "deadline"
    """The predicted time to first token exceeds the request's TTFT target."""
    QUEUE_TIMEOUT = "queue_timeout"
    """Waited in the queue longer than the maximum wait."""
    UNAVAILABLE = "unavailable"
    """The server is down or its capacity is unknown."""
    DRAINING = "draining"
    """The sidecar is shutting down."""
    CANCELLED = "cancelled"
    """The client went away while the request was queued."""
    QUEUED = "queued"
    """Shadow mode only: enforce mode would have queued the request."""


# Every final outcome of a request (QUEUED is never final).
FINAL_OUTCOMES: tuple[Outcome, ...] = tuple(o for o in Outcome if o is not Outcome.QUEUED)
REJECTIONS: tuple[Outcome, ...] = tuple(
    o for o in FINAL_OUTCOMES if o not in (Outcome.ADMITTED, Outcome.CANCELLED)
)
# What shadow mode records: what enforce mode would have done at arrival.
SHADOW_OUTCOMES: tuple[Outcome, ...] = (
    Outcome.ADMITTED,
    Outcome.QUEUED,
    Outcome.NEVER_FITS,
    Outcome.QUEUE_FULL,
    Outcome.DEADLINE,
    Outcome.UNAVAILABLE,
)

Detail = int | float | str | None


@quick_init
@dataclass(frozen=True)
class Decision:
    outcome: Outcome
    reason: str
    retry_after_s: float | None = None
    details: Mapping[str, Detail] = field(default_factory=dict)

    @property
    def admitted(self) -> bool:
        return self.outcome is Outcome.ADMITTED


class Rejected(Exception):
    """Raised by the controller when a request is not admitted."""

    def __init__(self, decision: Decision) -> None:
        super().__init__(decision.reason)
        self.decision = decision
