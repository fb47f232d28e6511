"""How the queue waits kvgate predicts compare with the waits requests then have.

A predicted wait assumes every running request holds its KV blocks to the end of its
reserved output, and that the requests queued ahead are all served. Clients that
leave, streams cut short, outputs that end before `max_tokens` and the queue's
fairness (a new tenant goes before the busy ones) all make waits shorter; a slow server
makes them longer. The median of observed over predicted waits, over the last queued
requests that were admitted, corrects the model's waits before they decide anything
(a request refused because its wait would exceed the queue's maximum, a deadline,
`Retry-After`).

Only waits of requests that queued are seen: one refused at arrival has no observed
wait. The ratio therefore learns from the predictions below the queue's maximum, and
a ratio below 1 lets more requests queue, whose waits it then sees.
"""

from __future__ import annotations

import statistics
from collections import deque

# Predictions shorter than this are mostly the time to the next queue pass: noise.
MIN_PREDICTED_S = 0.05
MIN_SAMPLES = 16
WINDOW = 256
BOUNDS = (0.05, 20.0)


class WaitRatio:
    """Median observed / predicted queue wait over the last `WINDOW` admitted waits
    (1.0 until `MIN_SAMPLES` are seen), within `BOUNDS`."""

    def __init__(self) -> None:
        self._ratios: deque[float] = deque(maxlen=WINDOW)
        self._factor = 1.0

    def observe(self, predicted_s: float, waited_s: float) -> None:
        if predicted_s < MIN_PREDICTED_S or waited_s < 0:
            return
        self._ratios.append(waited_s / predicted_s)
        if len(self._ratios) >= MIN_SAMPLES:
            low, high = BOUNDS
            self._factor = min(high, max(low, statistics.median(self._ratios)))

    @property
    def factor(self) -> float:
        return self._factor

    @property
    def samples(self) -> int:
        return len(self._ratios)

    def scaled(self, predicted_s: float) -> float:
        return predicted_s * self._factor
