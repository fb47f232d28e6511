"""A robust online linear fit: y = slope x + intercept + per_z z.

x is the main regressor (an ideal time), z an optional count (sequences in a step);
without z observations the z term stays at its prior.

- decay: every observation first multiplies the accumulated weights by
  0.5 ** (1 / half_life), so the fit follows a server that changes;
- bounded influence: an observation whose relative residual r = (y - fit) / fit
  exceeds k in size counts with weight k / |r| (Huber on the relative residual: times
  span orders of magnitude), so its pull on the fit is at most k x fit however wild
  it is; k is twice a running mean of |r| (at least 0.2): one hiccup in steady data
  moves the fit little, while after a real change the residuals stay large, k grows
  with them and the new regime counts fully within a few tens of observations; the
  first `warmup` observations count fully, since the analytical prior can be off by
  more than any threshold;
- a prior: a ridge pull toward (prior_slope, prior_intercept, prior_per_z) worth
  `prior_weight` observations, so the fit starts from the analytical model and moves
  only with evidence, and stays put where the data cannot tell (all x alike);
- bounds: each coefficient is clamped to a physically meaningful range (a clamped
  coefficient is held there and the others re-fitted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

_TERMS = 3  # slope (x), intercept (1), per_z (z)


def _solve(m: list[list[float]], r: list[float]) -> list[float] | None:
    """Solve a 1x1, 2x2 or 3x3 linear system by Cramer's rule; None when singular."""
    n = len(r)
    if n == 1:
        return [r[0] / m[0][0]] if m[0][0] != 0 else None
    if n == 2:
        det = m[0][0] * m[1][1] - m[0][1] * m[1][0]
        if det == 0 or not math.isfinite(det):
            return None
        return [(r[0] * m[1][1] - m[0][1] * r[1]) / det,
                (m[0][0] * r[1] - r[0] * m[1][0]) / det]
    (a, b, c), (d, e, f), (g, h, i) = m
    co_a, co_b, co_c = e * i - f * h, f * g - d * i, d * h - e * g
    det = a * co_a + b * co_b + c * co_c
    if det == 0 or not math.isfinite(det):
        return None
    x = r[0] * co_a + b * (r[2] * f - r[1] * i) + c * (r[1] * h - r[2] * e)
    y = a * (r[1] * i - f * r[2]) + r[0] * co_b + c * (d * r[2] - r[1] * g)
    z = a * (e * r[2] - r[1] * h) + b * (r[1] * g - d * r[2]) + r[0] * co_c
    return [x / det, y / det, z / det]


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
    prior_per_z: float = 0.0
    per_z_bounds: tuple[float, float] = (0.0, 0.0)
    # accumulated weighted sums of f f^T and f y, f = (x, 1, z)
    sff: list[list[float]] = field(default_factory=lambda: [[0.0] * _TERMS
                                                            for _ in range(_TERMS)])
    sfy: list[float] = field(default_factory=lambda: [0.0] * _TERMS)
    x_ref: float = 0.0
    z_ref: float = 0.0
    spread: float = 0.2  # running mean of |y - fit| / fit
    observations: int = 0
    since_reset: int = 0
    _solved: tuple[float, float, float] | None = field(default=None, init=False, repr=False,
                                                       compare=False)

    def coefficients(self) -> tuple[float, float, float]:
        """(slope, intercept, per_z), clamped to their bounds."""
        if self._solved is None:
            self._solved = self._fit()
        return self._solved

    def _fit(self) -> tuple[float, float, float]:
        priors = [self.prior_slope, self.prior_intercept, self.prior_per_z]
        bounds = [self.slope_bounds, self.intercept_bounds, self.per_z_bounds]
        # The ridge weight of each term, in units of one observation at its scale.
        scale = [self.x_ref or 1.0, 1.0, self.z_ref or 1.0]
        ridge = [self.prior_weight * v * v for v in scale]
        fixed: dict[int, float] = {}
        values = priors[:]
        for _ in range(_TERMS):
            free = [i for i in range(_TERMS) if i not in fixed]
            matrix = [[self.sff[i][j] + (ridge[i] if i == j else 0.0) for j in free]
                      for i in free]
            rhs = [self.sfy[i] + ridge[i] * priors[i]
                   - sum(self.sff[i][k] * v for k, v in fixed.items()) for i in free]
            solved = _solve(matrix, rhs)
            if solved is None:
                return self.prior_slope, self.prior_intercept, self.prior_per_z
            for i, value in zip(free, solved, strict=True):
                values[i] = value
            # Hold the first coefficient out of its bounds at the bound; re-fit the rest.
            out = next((i for i in free if not bounds[i][0] <= values[i] <= bounds[i][1]),
                       None)
            if out is None:
                break
            fixed[out] = min(bounds[out][1], max(bounds[out][0], values[out]))
            values[out] = fixed[out]
        clamped = [min(b[1], max(b[0], v)) for v, b in zip(values, bounds, strict=True)]
        return clamped[0], clamped[1], clamped[2]

    def estimate(self) -> tuple[float, float]:
        """(slope, intercept)."""
        slope, intercept, _ = self.coefficients()
        return slope, intercept

    def predict(self, x: float, z: float = 0.0) -> float:
        slope, intercept, per_z = self.coefficients()
        return slope * x + intercept + per_z * z

    def observe(self, x: float, y: float, weight: float = 1.0, z: float = 0.0) -> bool:
        """Add an observation; False (and nothing) when it is not usable."""
        usable = all(math.isfinite(v) for v in (x, y, z, weight))
        if not usable or x <= 0 or y <= 0 or z < 0 or weight <= 0:
            return False
        predicted = max(self.predict(x, z), 1e-12)
        ratio = abs(y - predicted) / predicted
        limit = max(self.huber_floor, 2.0 * self.spread)
        influence = 1.0
        if self.since_reset >= self.warmup and ratio > limit:
            influence = limit / ratio
        self.spread = 0.9 * self.spread + 0.1 * min(ratio, 3.0 * limit)
        decay = 0.5 ** (1.0 / self.half_life)
        w = weight * influence
        self._solved = None
        f = (x, 1.0, z)
        for i in range(_TERMS):
            self.sfy[i] = self.sfy[i] * decay + w * f[i] * y
            for j in range(_TERMS):
                self.sff[i][j] = self.sff[i][j] * decay + w * f[i] * f[j]
        first = self.observations == 0
        self.x_ref = x if first else 0.9 * self.x_ref + 0.1 * x
        if z > 0:
            self.z_ref = z if not self.z_ref else 0.9 * self.z_ref + 0.1 * z
        self.observations += 1
        self.since_reset += 1
        return True

    def restart(self) -> None:
        """The server changed under us: the current fit becomes the prior (what we knew)
        and the evidence starts over, the next observations counting fully."""
        self.prior_slope, self.prior_intercept, self.prior_per_z = self.coefficients()
        self._solved = None
        self.sff = [[0.0] * _TERMS for _ in range(_TERMS)]
        self.sfy = [0.0] * _TERMS
        self.since_reset = 0
        self.spread = 0.2
