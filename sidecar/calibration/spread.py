"""How observed times spread around the model's prediction: its p50 and p90 factors.

For each quantity (TTFT, TPOT) the ratio observed / predicted of recent completed
requests, where "predicted" is the model's own prediction made at admission (before
the request's times were known: out of sample). The median ratio corrects what the
fit leaves biased (a least-squares fit meets the mean; times are skewed by other
requests' prefills landing inside a request), the 90th percentile gives p90
predictions: p50 = model x q50, p90 = model x q90. This is split conformal
prediction on a sliding window: whatever the model's errors, about 90% of the next
requests land under the p90 while the server behaves as in the window.

- window: the last `window` ratios of each quantity;
- a change: when the median of the last `recent` ratios differs from the window's by
  more than `shift` (x or /), the older ratios no longer describe the server
  (restart with other settings, a tenant that arrived, a fit that just converged) and
  are dropped; a server restart drops them too (`reset`);
- before `min_samples` ratios: p50 x1 and the prior p90 factor (`PRIOR_P90_RATIO`: the
  model's p90 error on the public measurements it was fitted to, `model.latency`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from sidecar.model.latency import PRIOR_P90_RATIO as PRIOR_P90

QUANTITIES = ("ttft", "tpot")


@dataclass(frozen=True)
class Factors:
    """Multipliers on the model's prediction of one quantity."""

    p50: float
    p90: float
    samples: int


def quantile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    if not sorted_values:
        raise ValueError("no values")
    position = q * (len(sorted_values) - 1)
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


class Spread:
    def __init__(self, window: int = 64, recent: int = 12, shift: float = 1.3,
                 min_samples: int = 8) -> None:
        self.window = window
        self.recent = recent
        self.shift = shift
        self.min_samples = min_samples
        self._ratios: dict[str, deque[float]] = {q: deque(maxlen=window) for q in QUANTITIES}
        self._factors: dict[str, Factors] = {}

    def observe(self, quantity: str, observed_s: float, predicted_s: float) -> None:
        """One completed request: what it took and what the model predicted for it."""
        ratios = self._ratios[quantity]
        if not (math.isfinite(observed_s) and math.isfinite(predicted_s)
                and observed_s > 0 and predicted_s > 0):
            return
        ratios.append(observed_s / predicted_s)
        self._factors.pop(quantity, None)
        if len(ratios) >= 2 * self.recent:
            values = list(ratios)
            recent = sorted(values[-self.recent:])
            median_recent = quantile(recent, 0.5)
            median_all = quantile(sorted(values), 0.5)
            if abs(math.log(median_recent / median_all)) > math.log(self.shift):
                ratios.clear()
                ratios.extend(values[-self.recent:])

    def factors(self, quantity: str) -> Factors:
        found = self._factors.get(quantity)
        if found is None:
            values = sorted(self._ratios[quantity])
            if len(values) < self.min_samples:
                found = Factors(1.0, PRIOR_P90[quantity], len(values))
            else:
                p50 = quantile(values, 0.5)
                # The conformal rank: the ceil((n + 1) x 0.9)-th smallest of n ratios is
                # above the next one with probability >= 0.9.
                rank = min(len(values), math.ceil((len(values) + 1) * 0.9))
                found = Factors(p50, max(p50, values[rank - 1]), len(values))
            self._factors[quantity] = found
        return found

    def reset(self) -> None:
        for ratios in self._ratios.values():
            ratios.clear()
        self._factors.clear()

    def status(self) -> dict[str, dict[str, float]]:
        return {q: {"p50": f.p50, "p90": f.p90, "samples": f.samples}
                for q in QUANTITIES for f in (self.factors(q),)}
