"""Which completed requests calibration learns from: every one up to a rate, and a
sample spread evenly in time above it.

Learning from a request (its two observations in the fit, its ratios in the spread)
costs far more than forwarding it; at a few hundred requests a second it would be
most of what the sidecar does, while a fit of five rates and windows of recent
ratios gain nothing from the thousandth observation of a second. A token bucket:
`burst` requests at once, then `per_s` a second.
"""

from __future__ import annotations

import math


class RateSample:
    __slots__ = ("_at_s", "_tokens", "burst", "left_out", "per_s", "taken")

    def __init__(self, per_s: float, burst: float) -> None:
        if not per_s > 0:
            raise ValueError(f"per_s must be > 0, not {per_s}")
        if not burst >= 1:
            raise ValueError(f"burst must be >= 1, not {burst}")
        self.per_s = per_s
        self.burst = burst
        self.taken = 0
        self.left_out = 0
        self._tokens = burst
        self._at_s = -math.inf  # the latest time seen

    def take(self, now_s: float) -> bool:
        """Whether to learn from the request that completed at `now_s`."""
        if now_s > self._at_s:  # a clock that went back adds nothing
            self._tokens = min(self.burst, self._tokens + (now_s - self._at_s) * self.per_s)
            self._at_s = now_s
        if self._tokens > 1.0 - 1e-9:  # a whole token, up to rounding
            self._tokens -= 1.0
            self.taken += 1
            return True
        self.left_out += 1
        return False
