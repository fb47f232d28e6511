"""A robust online linear fit: y ~ sum(rate_i x_i), each rate within its bounds.

The x are known feature values of an observation (seconds of ideal compute, seconds of
ideal memory traffic, engine steps, sequences in those steps, 1 for a request's fixed
cost); the rates are what is learned. Each observation's squared error counts relative
to sqrt(y x typical), `typical` a typical value of observations of its kind: a 5 ms
token and a 500 ms first token count alike, and a glitch that reads 10x too short
does not weigh 100x. With:

- decay: every observation first multiplies the accumulated sums by
  0.5 ** (1 / half_life), so the fit follows a server that changes;
- bounded influence: an observation whose residual r = log(y / fit) exceeds k in
  size counts with weight k / |r| (Huber on the log residual: 10x too long and 10x
  too short alike); k is twice a running mean of |r| (at least 0.2): one hiccup in
  steady data moves the fit little; the first `warmup` observations count fully,
  since the prior can be off by any factor;
- a change: `drift_run` observations in a row off the fit by more than `drift_ratio`
  the same way (all longer or all shorter) mean the server changed (or the prior was
  far off): the fit restarts from where it is (`restart`), the evidence of the old
  regime dropped, since relative weights would otherwise let it outweigh the new one;
- a prior: a ridge pull toward `prior`, worth `prior_weight` observations at each
  feature's typical size. It decides what the data cannot tell apart (two features
  that always move together); what the data identify moves within a few
  observations however far off the prior was;
- bounds: a rate out of its range is fixed at the bound and the others re-fitted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

# The fit is re-solved after every observation for its first REFIT_SHARE of them, then
# after every since_reset // REFIT_SHARE observations, at most REFIT_MAX apart.
REFIT_SHARE = 50
REFIT_MAX = 16


def solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when (nearly) singular."""
    n = len(rhs)
    a = [[*row, rhs[i]] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if not math.isfinite(a[pivot][col]) or abs(a[pivot][col]) < 1e-300:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            factor = a[r][col] / a[col][col]
            if factor:
                for c in range(col, n + 1):
                    a[r][c] -= factor * a[col][c]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (a[r][n] - sum(a[r][c] * out[c] for c in range(r + 1, n))) / a[r][r]
    return out if all(math.isfinite(v) for v in out) else None


@dataclass
class RobustFit:
    prior: list[float]
    bounds: list[tuple[float, float]]
    prior_weight: float = 2.0
    half_life: float = 150.0
    huber_floor: float = 0.2
    warmup: int = 10
    drift_run: int = 12
    drift_ratio: float = 1.5
    # accumulated weighted sums of x x^T and x y, weighted 1 / (y x typical)
    sxx: list[list[float]] = field(default_factory=list)
    sxy: list[float] = field(default_factory=list)
    scale: list[float] = field(default_factory=list)  # running mean of x_i / sqrt(y typ)
    spread: float = 0.2  # running mean of |log(y / fit)|
    observations: int = 0
    since_reset: int = 0
    restarts: int = 0  # restarts on drift
    _run: int = 0  # consecutive observations off the same way (signed)
    _solved: list[float] | None = field(default=None, init=False, repr=False, compare=False)
    _unsolved: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.prior)
        if len(self.bounds) != n:
            raise ValueError("one bound per rate")
        self.prior = [min(hi, max(lo, v)) for v, (lo, hi) in zip(self.prior, self.bounds,
                                                                   strict=True)]
        if not self.sxx:
            self.sxx = [[0.0] * n for _ in range(n)]
            self.sxy = [0.0] * n
            self.scale = [0.0] * n

    @property
    def size(self) -> int:
        return len(self.prior)

    def rates(self) -> list[float]:
        """The fitted rates, each within its bounds."""
        if self._solved is None:
            self._solved = self._fit()
            self._unsolved = 0
        return self._solved[:]

    def predict(self, x: Sequence[float]) -> float:
        return sum(t * v for t, v in zip(self.rates(), x, strict=True))

    def _fit(self) -> list[float]:
        n = self.size
        if self.observations == 0:
            return self.prior[:]
        # Unknown scales (a feature never seen non-zero) get a ridge of one unit.
        scale = [s if s > 0 else 1.0 for s in self.scale]
        ridge = [self.prior_weight * s * s for s in scale]
        fixed: dict[int, float] = {}
        values = self.prior[:]
        for _ in range(n):
            free = [i for i in range(n) if i not in fixed]
            if not free:
                break
            # Solved for u_i = rate_i x scale_i (each feature's typical share of an
            # observation, about 1): a well-conditioned system whatever the units.
            matrix = [[(self.sxx[i][j] + (ridge[i] if i == j else 0.0)) / (scale[i] * scale[j])
                       for j in free] for i in free]
            rhs = [(self.sxy[i] + ridge[i] * self.prior[i]
                    - sum(self.sxx[i][k] * v for k, v in fixed.items())) / scale[i]
                   for i in free]
            solved = solve(matrix, rhs)
            if solved is None:
                return self.prior[:]
            for i, u in zip(free, solved, strict=True):
                values[i] = u / scale[i]
            out = [i for i in free if not self.bounds[i][0] <= values[i] <= self.bounds[i][1]]
            if not out:
                break
            # Fix the coefficient furthest out of its range at the bound; re-fit the rest.
            worst = max(out, key=lambda i: _distance(values[i], self.bounds[i]))
            fixed[worst] = min(self.bounds[worst][1], max(self.bounds[worst][0], values[worst]))
            values[worst] = fixed[worst]
        return [min(hi, max(lo, v)) for v, (lo, hi) in zip(values, self.bounds, strict=True)]

    def observe(self, x: Sequence[float], y: float, weight: float = 1.0,
                typical: float | None = None) -> float | None:
        """Add an observation; returns its relative residual against the fit before it
        (out of sample), or None (and nothing) when it is not usable. `typical` is a
        typical value of observations of its kind (default y itself): the squared error
        counts relative to sqrt(y x typical), so a glitch that reads 10x too short does
        not weigh 100x."""
        values = [float(v) for v in x]
        if len(values) != self.size:
            raise ValueError(f"expected {self.size} features, got {len(values)}")
        usable = all(math.isfinite(v) and v >= 0 for v in values) and any(values)
        if not usable or not (math.isfinite(y) and y > 0) or not (
                math.isfinite(weight) and weight > 0):
            return None
        predicted = max(self.predict(values), 1e-12)
        ratio = (y - predicted) / predicted
        log_ratio = math.log(y / predicted)
        size = abs(log_ratio)  # symmetric: 10x too long as 10x too short
        if size > math.log(self.drift_ratio):
            sign = 1 if log_ratio > 0 else -1
            self._run = self._run + sign if self._run * sign > 0 else sign
        else:
            self._run = 0
        if abs(self._run) >= self.drift_run:
            self.restart()
            self.restarts += 1
        limit = max(self.huber_floor, 2.0 * self.spread)
        influence = 1.0
        if self.since_reset >= self.warmup and size > limit:
            influence = limit / size
        self.spread = 0.9 * self.spread + 0.1 * min(size, 3.0 * limit)
        decay = 0.5 ** (1.0 / self.half_life)
        scale = y * (typical if typical is not None and typical > 0 else y)
        w = weight * influence / scale
        # Re-solved after every observation while the fit is young, then after every
        # since_reset // REFIT_SHARE of them (at most REFIT_MAX): one observation moves a
        # fit of hundreds by little, and solving costs more than a request's admission.
        self._unsolved += 1
        if self._unsolved >= min(REFIT_MAX, max(1, self.since_reset // REFIT_SHARE)):
            self._solved = None
        for i in range(self.size):
            self.sxy[i] = self.sxy[i] * decay + w * values[i] * y
            row = self.sxx[i]
            for j in range(self.size):
                row[j] = row[j] * decay + w * values[i] * values[j]
            relative = values[i] / math.sqrt(scale)
            if relative > 0:
                self.scale[i] = relative if self.scale[i] == 0 else (
                    0.9 * self.scale[i] + 0.1 * relative)
        self.observations += 1
        self.since_reset += 1
        return ratio

    def restart(self, prior: Sequence[float] | None = None) -> None:
        """The server changed under us: the current fit (or `prior`) becomes the prior
        and the evidence starts over, the next observations counting fully."""
        self.prior = list(prior) if prior is not None else self.rates()
        self._solved = None
        n = self.size
        self.sxx = [[0.0] * n for _ in range(n)]
        self.sxy = [0.0] * n
        self.scale = [0.0] * n
        self.since_reset = 0
        self.observations = 0
        self.spread = 0.2
        self._run = 0


def _distance(value: float, bounds: tuple[float, float]) -> float:
    low, high = bounds
    if value < low:
        return (low - value) / max(abs(low), 1e-12)
    return (value - high) / max(abs(high), 1e-12)
