"""A robust online line fit: y = slope x + intercept.

- decay: every observation first multiplies the accumulated weights by
  0.5 ** (1 / half_life), so the fit follows a server that changes;
- bounded influence: an observation whose relative residual r = (y - line) / line
  exceeds k in size counts with weight k / |r| (Huber on the relative residual: times
  span orders of magnitude), so its pull on the fit is at most k x line however wild
  it is; k is twice a running mean of |r| (at least 0.2): one hiccup in steady data
  moves the fit little, while after a real change the residuals stay large, k grows
  with them and the new regime counts fully within a few tens of observations; the
  first `warmup` observations count fully, since the analytical prior can be off by
  more than any threshold;
- a prior: a ridge pull toward (prior_slope, prior_intercept) worth `prior_weight`
  observations, so the fit starts from the analytical model and moves only with
  evidence, and stays put where the data cannot tell (all x alike);
- bounds: the result is clamped to physically meaningful ranges.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class RobustLine:
    prior_slope: float
    prior_intercept: float
    slope_bounds: tuple[float, float]
    intercept_bounds: tuple[float, float]
    prior_weight: float = 2.0
    half_life: float = 200.0
    huber_floor: float = 0.2
    warmup: int = 10
    # accumulated weighted sums
    sw: float = 0.0
    swx: float = 0.0
    swy: float = 0.0
    swxx: float = 0.0
    swxy: float = 0.0
    x_ref: float = 0.0
    spread: float = 0.2  # running mean of |y - line| / line
    observations: int = 0
    since_reset: int = 0

    def estimate(self) -> tuple[float, float]:
        x_ref = self.x_ref or 1.0
        lam_a = self.prior_weight * x_ref * x_ref
        lam_b = self.prior_weight
        a11 = self.swxx + lam_a
        a12 = self.swx
        a22 = self.sw + lam_b
        r1 = self.swxy + lam_a * self.prior_slope
        r2 = self.swy + lam_b * self.prior_intercept
        det = a11 * a22 - a12 * a12
        if det <= 0 or not math.isfinite(det):
            return self.prior_slope, self.prior_intercept
        slope = (r1 * a22 - a12 * r2) / det
        intercept = (a11 * r2 - a12 * r1) / det
        low, high = self.slope_bounds
        slope = min(high, max(low, slope))
        low, high = self.intercept_bounds
        # With the slope clamped, re-fit the intercept alone.
        intercept = (self.swy - slope * self.swx + lam_b * self.prior_intercept) / (
            self.sw + lam_b
        )
        intercept = min(high, max(low, intercept))
        return slope, intercept

    def observe(self, x: float, y: float, weight: float = 1.0) -> bool:
        """Add an observation; False (and nothing) when it is not usable."""
        if not (math.isfinite(x) and math.isfinite(y)) or x <= 0 or y <= 0 or weight <= 0:
            return False
        slope, intercept = self.estimate()
        predicted = max(slope * x + intercept, 1e-12)
        ratio = abs(y - predicted) / predicted
        limit = max(self.huber_floor, 2.0 * self.spread)
        influence = 1.0
        if self.since_reset >= self.warmup and ratio > limit:
            influence = limit / ratio
        self.spread = 0.9 * self.spread + 0.1 * min(ratio, 3.0 * limit)
        decay = 0.5 ** (1.0 / self.half_life)
        w = weight * influence
        self.sw = self.sw * decay + w
        self.swx = self.swx * decay + w * x
        self.swy = self.swy * decay + w * y
        self.swxx = self.swxx * decay + w * x * x
        self.swxy = self.swxy * decay + w * x * y
        self.x_ref = x if self.observations == 0 else 0.9 * self.x_ref + 0.1 * x
        self.observations += 1
        self.since_reset += 1
        return True

    def restart(self) -> None:
        """The server changed under us: the current fit becomes the prior (what we knew)
        and the evidence starts over, the next observations counting fully."""
        self.prior_slope, self.prior_intercept = self.estimate()
        for name in ("sw", "swx", "swy", "swxx", "swxy"):
            setattr(self, name, 0.0)
        self.since_reset = 0
        self.spread = 0.2
