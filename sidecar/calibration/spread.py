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
- a change: when the median of the last `recent` ratios (half the window while it
  holds fewer than 2 x `recent`) differs from the window's by more than `shift` (x or
  /), the older ratios no longer describe the server (restart with other settings, a
  tenant that arrived, a fit that just converged) and are dropped; a server restart,
  or the fit restarting on a drift, drops them all (`reset`);
- by load: the ratios are kept per load bucket (`model.latency.load_bucket`: the
  requests running at admission, 0, 1, 2-3, 4+), since a request's wait for the
  others grows with them in a way the model prices only on average; a bucket with
  fewer than `min_samples` ratios uses all buckets' together;
- before `min_samples` ratios: p50 x1 and the prior p90 factor (`PRIOR_P90_RATIO`: the
  model's p90 error on the public measurements it was fitted to, `model.latency`);
- against the current model: when calibration replaces the model, the ratios of the
  requests whose inputs are known are taken again against the new one (`rebase`).
  Otherwise a fit that just moved would be corrected by ratios to the model it left:
  from a prior 10x off, the first minutes' ratios say "predictions are 10x too long"
  long after they no longer are.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from sidecar.model.latency import LOAD_BUCKETS
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


# The model's own prediction of a request from its inputs (None: it cannot say).
Predictor = Callable[[str, Hashable], float | None]


class _Ratio:
    """One request's observed / predicted, and what its prediction was made from."""

    __slots__ = ("inputs", "observed_s", "value")

    def __init__(self, observed_s: float, predicted_s: float, inputs: Hashable | None) -> None:
        self.observed_s = observed_s
        self.value = observed_s / predicted_s
        self.inputs = inputs


class _Window:
    """The recent ratios of one quantity (and load bucket), and their values kept
    sorted as they come and go (every completed request adds one: no sort per add)."""

    def __init__(self, size: int, recent: int, shift: float) -> None:
        self.ratios: deque[_Ratio] = deque(maxlen=size)
        self.recent = recent
        self.shift = shift
        self._sorted: list[float] = []
        self._factors: Factors | None = None  # until the next ratio

    def add(self, ratio: _Ratio) -> None:
        ratios = self.ratios
        if len(ratios) == ratios.maxlen:
            del self._sorted[bisect.bisect_left(self._sorted, ratios[0].value)]
        ratios.append(ratio)
        bisect.insort(self._sorted, ratio.value)
        self._factors = None
        # The last `recent` (half the window while it is short: a fit converging from a
        # far prior moves the ratios within a few requests) against all of them.
        count = len(ratios)
        recent = min(self.recent, count // 2)
        if recent >= 4:
            last = sorted(ratios[i].value for i in range(count - recent, count))
            median_recent = quantile(last, 0.5)
            median_all = quantile(self._sorted, 0.5)
            if abs(math.log(median_recent / median_all)) > math.log(self.shift):
                kept = [ratios[i] for i in range(count - recent, count)]
                ratios.clear()
                ratios.extend(kept)
                self._sorted = last

    def changed(self) -> None:
        """Ratios' values were changed in place (`Spread.rebase`)."""
        self._sorted = sorted(r.value for r in self.ratios)
        self._factors = None

    def factors(self) -> Factors:
        if self._factors is None:
            values = self._sorted
            p50 = quantile(values, 0.5)
            # The conformal rank: the ceil((n + 1) x 0.9)-th smallest of n ratios is
            # above the next one with probability >= 0.9.
            rank = min(len(values), math.ceil((len(values) + 1) * 0.9))
            self._factors = Factors(p50, max(p50, values[rank - 1]), len(values))
        return self._factors


class Spread:
    def __init__(self, window: int = 64, recent: int = 12, shift: float = 1.3,
                 min_samples: int = 8) -> None:
        self.window = window
        self.recent = recent
        self.shift = shift
        self.min_samples = min_samples
        self._windows: dict[tuple[str, int | None], _Window] = {}
        self._factors: dict[tuple[str, int], Factors] = {}
        self.reset()

    def observe(self, quantity: str, observed_s: float, predicted_s: float,
                bucket: int = 0, inputs: Hashable | None = None) -> None:
        """One completed request: what it took, what the model predicted for it, the
        load bucket it was admitted in, and what the prediction was made from (for
        `rebase`; None: the ratio stays as it is)."""
        if not (math.isfinite(observed_s) and math.isfinite(predicted_s)
                and observed_s > 0 and predicted_s > 0):
            return
        ratio = _Ratio(observed_s, predicted_s, inputs)
        self._windows[quantity, None].add(ratio)
        self._windows[quantity, min(LOAD_BUCKETS - 1, max(0, bucket))].add(ratio)
        self._factors.clear()

    def rebase(self, predict: Predictor) -> None:
        """The model was replaced: every ratio with known inputs becomes observed / the
        new model's prediction of the same request."""
        seen: set[int] = set()
        for (quantity, _), window in self._windows.items():
            for ratio in window.ratios:
                if ratio.inputs is None or id(ratio) in seen:
                    continue
                seen.add(id(ratio))
                predicted = predict(quantity, ratio.inputs)
                if predicted is not None and math.isfinite(predicted) and predicted > 0:
                    ratio.value = ratio.observed_s / predicted
            window.changed()
        self._factors.clear()

    def factors(self, quantity: str, bucket: int | None = None) -> Factors:
        """The p50 and p90 factors for requests admitted in `bucket` (None: all)."""
        key = (quantity, -1 if bucket is None else bucket)
        found = self._factors.get(key)
        if found is None:
            own = self._windows[quantity, bucket]
            pooled = self._windows[quantity, None]
            if len(own.ratios) >= self.min_samples:
                found = own.factors()
            elif len(pooled.ratios) >= self.min_samples:
                found = pooled.factors()
            else:
                found = Factors(1.0, PRIOR_P90[quantity], len(pooled.ratios))
            self._factors[key] = found
        return found

    def reset(self) -> None:
        self._windows = {(q, b): _Window(self.window, self.recent, self.shift)
                         for q in QUANTITIES for b in (None, *range(LOAD_BUCKETS))}
        self._factors.clear()

    def status(self) -> dict[str, object]:
        out: dict[str, object] = {}
        for q in QUANTITIES:
            pooled = self.factors(q)
            out[q] = {"p50": pooled.p50, "p90": pooled.p90, "samples": pooled.samples,
                      "by_load": [{"p50": f.p50, "p90": f.p90,
                                   "samples": len(self._windows[q, b].ratios)}
                                  for b in range(LOAD_BUCKETS) for f in (self.factors(q, b),)]}
        return out
