"""Priority: which band goes next?

- `StrictPriority(starvation_bound_s)`: the most important non-empty band (band 0
  first), except that a band whose oldest request has waited longer than the bound
  goes first (the longest-starved such band). Inputs: each band's size and oldest
  arrival, and the time. Trade-off: important traffic always goes ahead, and the
  bound caps how long less important traffic can be held back by it; with no bound
  (None) lower bands can wait forever under sustained high-priority load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol


@dataclass(frozen=True)
class BandView:
    band: int  # 0 is the most important
    size: int
    oldest_arrival_s: float


class PriorityPolicy(Protocol):
    name: ClassVar[str]

    def pick(self, bands: Sequence[BandView], now_s: float) -> int: ...


@dataclass(frozen=True)
class StrictPriority:
    starvation_bound_s: float | None = 30.0
    name: ClassVar[str] = "strict"

    def pick(self, bands: Sequence[BandView], now_s: float) -> int:
        if self.starvation_bound_s is not None:
            starved = [b for b in bands if now_s - b.oldest_arrival_s > self.starvation_bound_s]
            if starved:
                return min(starved, key=lambda b: (b.oldest_arrival_s, b.band)).band
        return min(b.band for b in bands)
