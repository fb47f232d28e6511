"""Limits: is there room in the queue, and has a request waited too long?

`QueueLimits(max_length, max_wait_s)`: at most `max_length` requests wait; a request
that waited `max_wait_s` is rejected (`queue_timeout`) rather than sent late.
Trade-off: a long queue absorbs bursts but adds latency; a short one sheds early
with a Retry-After so clients can back off or go to another replica.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QueueLimits:
    max_length: int = 1000
    max_wait_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_length < 0:
            raise ValueError(f"queue max length must be >= 0, got {self.max_length}")
        if not self.max_wait_s > 0:
            raise ValueError(f"queue max wait must be positive, got {self.max_wait_s}")

    def has_room(self, queued: int) -> bool:
        return queued < self.max_length

    def expired(self, arrival_s: float, now_s: float) -> bool:
        return now_s - arrival_s >= self.max_wait_s

    def remaining_s(self, arrival_s: float, now_s: float) -> float:
        return max(0.0, self.max_wait_s - (now_s - arrival_s))
