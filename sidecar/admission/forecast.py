"""When running requests will release their KV, and the peak KV they will reach.

Both answers come from the same picture: each running request holds some blocks
now, grows linearly to its expected final size while it decodes, and releases
everything when it finishes at a predicted time.

- `ReleaseSchedule.seconds_until(blocks)`: how long until `blocks` more blocks are
  free (a Retry-After, a queue wait). Past the last running request it extrapolates
  at the rate the cache turns over (capacity per mean request duration).
- `kv_forecast`: the peak of the summed use over time, as a ratio of capacity (above
  1 means vLLM will run out and preempt) and the time until the use first exceeds
  capacity.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RunningRequest:
    blocks_now: int  # blocks its tokens occupy now
    blocks_final: int  # blocks at its expected final length
    blocks_reserved: int  # what it holds in the ledger (released when it finishes)
    finish_in_s: float  # predicted time until it finishes


@dataclass(frozen=True)
class ReleaseSchedule:
    finish_s: tuple[float, ...]  # ascending, relative to when the schedule was built
    released_cumulative: tuple[int, ...]  # blocks freed by then
    turnover_blocks_per_s: float

    @staticmethod
    def build(
        running: Sequence[RunningRequest], capacity_blocks: int, request_duration_s: float
    ) -> ReleaseSchedule:
        """`request_duration_s`: how long an admitted request typically holds its KV
        (predicted prefill + decode): the cache turns over once per that time."""
        ordered = sorted((max(0.0, r.finish_in_s), r.blocks_reserved) for r in running)
        cumulative = []
        total = 0
        for _, blocks in ordered:
            total += blocks
            cumulative.append(total)
        turnover = capacity_blocks / request_duration_s if request_duration_s > 0 else 0.0
        return ReleaseSchedule(tuple(f for f, _ in ordered), tuple(cumulative), turnover)

    def seconds_until(self, blocks: int) -> float:
        """Time until `blocks` blocks have been released (0 if none are needed)."""
        if blocks <= 0:
            return 0.0
        index = bisect.bisect_left(self.released_cumulative, blocks)
        if index < len(self.finish_s):
            return self.finish_s[index]
        released = self.released_cumulative[-1] if self.released_cumulative else 0
        last = self.finish_s[-1] if self.finish_s else 0.0
        if self.turnover_blocks_per_s <= 0:
            return math.inf
        return last + (blocks - released) / self.turnover_blocks_per_s


@dataclass(frozen=True)
class Forecast:
    capacity_blocks: int
    peak_blocks: float
    exhaustion_s: float  # inf when the peak stays within capacity

    @property
    def peak_ratio(self) -> float:
        if self.capacity_blocks <= 0:
            return math.inf if self.peak_blocks > 0 else 0.0
        return self.peak_blocks / self.capacity_blocks


def kv_forecast(
    running: Sequence[RunningRequest], capacity_blocks: int, other_blocks: float = 0.0
) -> Forecast:
    """Peak KV of the running requests (plus `other_blocks` held by traffic the
    sidecar does not see), assuming each grows linearly until it finishes."""
    items = sorted(
        (
            max(r.finish_in_s, 1e-9),
            float(r.blocks_now),
            (r.blocks_final - r.blocks_now) / max(r.finish_in_s, 1e-9),
        )
        for r in running
    )
    # Suffix sums over requests still running at each breakpoint.
    base = [0.0] * (len(items) + 1)
    slope = [0.0] * (len(items) + 1)
    for i in range(len(items) - 1, -1, -1):
        base[i] = base[i + 1] + items[i][1]
        slope[i] = slope[i + 1] + max(0.0, items[i][2])
    peak = other_blocks + base[0]
    exhaustion = 0.0 if peak > capacity_blocks else math.inf
    start = 0.0
    for i, (finish, _, _) in enumerate(items):
        # Between `start` and `finish`, requests i.. are running: use = a + b t.
        a, b = other_blocks + base[i], slope[i]
        at_end = a + b * finish
        peak = max(peak, at_end)
        if math.isinf(exhaustion) and at_end > capacity_blocks:
            crossing = (capacity_blocks - a) / b if b > 0 else start
            exhaustion = max(start, crossing)
        start = finish
    return Forecast(capacity_blocks, peak, exhaustion)
