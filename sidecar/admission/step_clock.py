"""Seconds until an engine step ahead, as the batch running then shrinks and grows.

Admission counts in engine steps (`forecast.Holding`): vLLM gives every running request
one token per step, so the steps ahead are a clock all of them share. A wait for room
is a number of steps; what it lasts depends on the batch of each of them. A step of 6
requests takes longer than a step of 3 (more KV read, more tokens through the layers),
and while a request waits for room, the running ones finish one after another: the
steps get shorter. Pricing every step at today's batch makes the wait too long by as
much as the batch shrinks (and too short where requests queued ahead join it).

Worked example: two requests running, one ending after step 3 and one after step 5
(spans [(0, 4), (0, 6)]), a step of 2 taking 6 ms and of 1 taking 4 ms: the first 4
steps take 6 ms each, the next 2 take 4 ms, so step 6 starts after 32 ms (36 ms if each
step were priced at today's batch).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable


class StepClock:
    """When each engine step ahead starts. A span (first step, the step after its last)
    is one request running over those steps; each step lasts `step_s(batch)` of the
    requests running in it, one with nothing running that of a batch of 1. Built once
    per set of spans (O(n log n)); each question is then O(log n)."""

    __slots__ = ("_seconds", "_starts", "_step_s")

    def __init__(self, spans: Iterable[tuple[int, int]],
                 step_s: Callable[[int], float]) -> None:
        changes: dict[int, int] = {}
        for first, after in spans:
            if after > first:
                changes[first] = changes.get(first, 0) + 1
                changes[after] = changes.get(after, 0) - 1
        by_batch: dict[int, float] = {}

        def priced(batch: int) -> float:
            batch = max(1, batch)
            if batch not in by_batch:
                by_batch[batch] = step_s(batch)
            return by_batch[batch]

        # Pieces of constant batch: from each start on, that step time.
        starts: list[int] = [0]
        seconds: list[float] = [0.0]
        times: list[float] = []
        batch = 0
        for at in sorted(changes):
            if at > starts[-1]:
                times.append(priced(batch))
                seconds.append(seconds[-1] + (at - starts[-1]) * times[-1])
                starts.append(at)
            batch += changes[at]
        times.append(priced(batch))
        self._starts = starts
        self._seconds = seconds
        self._step_s = times

    def seconds_until(self, step: float) -> float:
        """Seconds from now until engine step `step` starts (0: the next one; inf for an
        infinite step)."""
        if not step > 0:  # also NaN
            return 0.0
        if math.isinf(step):
            return math.inf
        piece = bisect.bisect_right(self._starts, step) - 1
        return self._seconds[piece] + (step - self._starts[piece]) * self._step_s[piece]

    def steps_at(self, seconds: Iterable[float]) -> list[float]:
        """`step_at` of each (one call for a whole queue)."""
        step_at = self.step_at
        return [step_at(each) for each in seconds]

    def step_at(self, seconds: float) -> float:
        """The engine step running `seconds` from now, with its fraction done: the
        inverse of `seconds_until` (0 for 0 or less; inf for inf)."""
        if not seconds > 0:  # also NaN
            return 0.0
        if math.isinf(seconds):
            return math.inf
        piece = bisect.bisect_right(self._seconds, seconds) - 1
        per_step = self._step_s[piece]
        if per_step <= 0:  # steps that take no time: every step ahead runs by then
            return math.inf
        return self._starts[piece] + (seconds - self._seconds[piece]) / per_step
