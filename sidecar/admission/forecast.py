"""The KV the running requests will hold over time.

- `kv_forecast`: the peak of the summed use over time, as a ratio of capacity (above
  1 means vLLM will run out and preempt) and the time until the use first exceeds
  capacity; each running request holds some blocks now, grows linearly to its
  expected final size while it decodes and releases everything when it finishes at a
  predicted time (the metrics and /kvgate/v1/state report it).
- `Holding` and `holdings_profile`: bounds on what each request holds at each engine
  step ahead, which admission sums (`room`) to let a request in when the sum with it
  stays within the target at every step, and to predict when it will.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class RunningRequest:
    blocks_now: int  # blocks its tokens occupy now
    blocks_final: int  # blocks at its expected final length
    blocks_reserved: int  # what it holds in the ledger (released when it finishes)
    finish_in_s: float  # predicted time until it finishes


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


# ---- holdings over the engine steps ahead ------------------------------------------------
#
# vLLM's scheduler gives every running request one token per engine step, so the steps
# ahead are a clock all running requests share whatever a step lasts. A request holds
# blocks for its tokens: at most one more block per group each time its token count
# crosses a multiple of the group's block size, never more than the peak still ahead of
# it (its reservation), and nothing once it has finished. `Holding` is that bound as a
# line capped by the peak; `HoldingsForecast` sums the running requests' holdings over
# the steps ahead, so that a newcomer is admitted when the sum with it stays within the
# target at every step (requests that finish first make room for it), not only when the
# peaks of all of them added up fit.


class Holding(NamedTuple):
    """One request's KV blocks over the engine steps ahead (step 0 is the next one):
    at most `min(cap_blocks, start_blocks + blocks_per_step * step)` while
    `step < end_steps`, none after. (A named tuple: one is made for every running
    request each time room is judged near capacity.)"""

    start_blocks: float
    blocks_per_step: float
    cap_blocks: float
    end_steps: int

    def at(self, step: int) -> float:
        if step >= self.end_steps:
            return 0.0
        return min(self.cap_blocks, self.start_blocks + self.blocks_per_step * step)

    def delayed(self, steps: int) -> Holding:
        """The same request started `steps` steps later (its holdings shifted right,
        bounded from step 0 on by its start as its line is nondecreasing)."""
        if steps <= 0:
            return self
        return Holding(self.start_blocks, self.blocks_per_step, self.cap_blocks,
                       self.end_steps + steps)


def holdings_profile(holdings: Sequence[Holding], base_blocks: float = 0.0
                     ) -> list[tuple[int, float]]:
    """(step, blocks held) at step 0 and at the last step of each request (each
    holding is nondecreasing while it lasts, so the sum peaks at one of those steps),
    in step order. O(n log n)."""
    return _profile_and_lines(holdings, base_blocks)[0]


def _profile_and_lines(holdings: Sequence[Holding], base_blocks: float
                       ) -> tuple[list[tuple[int, float]], list[tuple[float, float]]]:
    """`holdings_profile`, and after each of its points a line (blocks at step 0,
    blocks per step) that bounds the sum until the next point: the holdings still
    running, those not at their cap yet taken as never reaching it."""
    # Saturation: the step from which a holding stays at its cap.
    start = sum_rate = capped = 0.0
    saturated = [False] * len(holdings)
    alive = [True] * len(holdings)
    saturations: list[tuple[float, int]] = []
    for i, h in enumerate(holdings):
        if h.end_steps <= 0:
            alive[i] = False
            continue
        if h.start_blocks >= h.cap_blocks:
            saturated[i] = True
            capped += h.cap_blocks
            continue
        start += h.start_blocks
        sum_rate += h.blocks_per_step
        if h.blocks_per_step > 0:
            saturations.append(((h.cap_blocks - h.start_blocks) / h.blocks_per_step, i))
    saturations.sort()
    ends = sorted((h.end_steps - 1, i) for i, h in enumerate(holdings) if alive[i])
    profile = [(0, base_blocks + start + capped)]
    lines = [(base_blocks + start + capped, sum_rate)]
    next_saturation = 0
    for step, i in ends:
        while (next_saturation < len(saturations)
               and saturations[next_saturation][0] <= step):
            j = saturations[next_saturation][1]
            next_saturation += 1
            if alive[j] and not saturated[j]:
                saturated[j] = True
                start -= holdings[j].start_blocks
                sum_rate -= holdings[j].blocks_per_step
                capped += holdings[j].cap_blocks
        profile.append((step, base_blocks + start + sum_rate * step + capped))
        alive[i] = False
        if saturated[i]:
            capped -= holdings[i].cap_blocks
        else:
            start -= holdings[i].start_blocks
            sum_rate -= holdings[i].blocks_per_step
        lines.append((base_blocks + start + capped, sum_rate))
    if len(lines) > 1:  # every holding has ended: the base, without rounding left over
        lines[-1] = (base_blocks, 0.0)
    return profile, lines


def holdings_peak(holdings: Sequence[Holding], base_blocks: float = 0.0) -> float:
    """The most the holdings (plus `base_blocks` held throughout) add up to at any
    step ahead."""
    return max(blocks for _, blocks in holdings_profile(holdings, base_blocks))


def steps_until_room(holdings: Sequence[Holding], blocks: float, limit_blocks: float,
                     base_blocks: float = 0.0) -> float:
    """The first step from which `blocks` more blocks stay within `limit_blocks` at
    every step after (0: now; inf: not even once every holding has ended)."""
    return RoomProfile.of(holdings, base_blocks).steps_until_room(blocks, limit_blocks)


@dataclass(frozen=True)
class RoomProfile:
    """The holdings' sum at each request's last step, with the most it reaches from
    there on: how long until some more blocks fit for good, in O(log n); and the most
    over a window of steps (`most_over`: whether a request fits while it runs)."""

    steps: tuple[int, ...]  # step 0, then each last step, ascending
    suffix_max: tuple[float, ...]  # the most held at these steps and after
    base_blocks: float
    # The most held over 2**level points from each (a sparse table: `most_over`).
    by_level: tuple[tuple[float, ...], ...] = ()
    # After each point, a line bounding the sum until the next (`_profile_and_lines`).
    lines: tuple[tuple[float, float], ...] = ()

    @staticmethod
    def of(holdings: Sequence[Holding], base_blocks: float = 0.0) -> RoomProfile:
        profile, lines = _profile_and_lines(holdings, base_blocks)
        suffix = [0.0] * len(profile)
        most = base_blocks
        for index in range(len(profile) - 1, -1, -1):
            most = max(most, profile[index][1])
            suffix[index] = most
        level = [blocks for _, blocks in profile]
        by_level = [tuple(level)]
        width = 1
        while 2 * width <= len(profile):
            level = [max(level[i], level[i + width]) for i in range(len(level) - width)]
            by_level.append(tuple(level))
            width *= 2
        return RoomProfile(tuple(step for step, _ in profile), tuple(suffix), base_blocks,
                           tuple(by_level), tuple(lines))

    def most_over(self, first: int, last: int) -> tuple[float, int | None]:
        """The most held at any step from `first` to `last`, and the first step after
        `first` from which that over as many steps may be less (None: never; a window
        starting before that holds at least as much). Between two points nothing
        ends and every holding grows: the most is at a point within, or at `last`,
        bounded there by the next point and by the line after the one before. O(log n)."""
        steps = self.steps
        count = len(steps)
        low = bisect.bisect_left(steps, first)
        if low >= count:
            return self.base_blocks, None
        high = bisect.bisect_left(steps, last)  # the first point at `last` or after
        if high < count and steps[high] == last:
            most = self.by_level[0][high]
        else:
            at_zero, per_step = self.lines[high - 1]
            most = at_zero + per_step * last
            if high < count:
                most = min(most, self.by_level[0][high])
        if high > low:  # the points from `first` to before `last`
            level = (high - low).bit_length() - 1
            row = self.by_level[level]
            most = max(most, row[low], row[high - (1 << level)])
        return most, steps[low] + 1

    def most_from(self, step: int) -> tuple[float, int | None]:
        """The most held at `step` and every step after, and the first step after it
        from which that may be less (None: it stays)."""
        index = bisect.bisect_left(self.steps, step)
        if index >= len(self.steps):
            return self.base_blocks, None
        return self.suffix_max[index], self.steps[index] + 1

    def steps_until_room(self, blocks: float, limit_blocks: float) -> float:
        if self.base_blocks + blocks > limit_blocks + 1e-9:
            return math.inf
        if len(self.steps) == 1 or self.suffix_max[0] + blocks <= limit_blocks + 1e-9:
            return 0.0
        # From just after one request's last step to the next one's, the sum is at most
        # its value at the next one's last step: the first point from which the suffix
        # fits gives the answer (the step after the previous point), else after the last.
        room = limit_blocks + 1e-9 - blocks
        low, high = 1, len(self.steps)  # suffix_max is non-increasing
        while low < high:
            mid = (low + high) // 2
            if self.suffix_max[mid] <= room:
                high = mid
            else:
                low = mid + 1
        return float(self.steps[low - 1] + 1)
