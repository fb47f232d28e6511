"""Seconds until an engine step ahead, as the batch running then shrinks and grows.

Admission counts in engine steps (`forecast.Holding`): vLLM gives every running request
one token per step, so the steps ahead are a clock all of them share. A wait for room
is a number of steps; what it lasts depends on the batch of each of them. A step of 6
requests takes longer than a step of 3 (more KV read, more tokens through the layers),
and while a request waits for room, the running ones finish one after another: the
steps get shorter. Pricing every step at today's batch makes the wait too long by as
much as the batch shrinks (on the CPU test server, a step of 6 takes about twice one of
1).

Worked example: two requests running, one ending after step 3 and one after step 5
(`spans` [(0, 4), (0, 6)]), a step of 2 taking 6 ms and of 1 taking 4 ms: the first 4
steps take 6 ms each, the next 2 take 4 ms, so step 6 starts after 32 ms (36 ms if each
step were priced at today's batch).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable


def seconds_until(step: float, spans: Iterable[tuple[int, int]],
                  step_s: Callable[[int], float]) -> float:
    """Seconds from now until engine step `step` starts (0: the next one), each step
    lasting `step_s(batch)` of the requests running in it: a span (first step, the step
    after its last) is one request running over those steps. A step with nothing
    running is priced at a batch of 1. inf for an infinite `step`."""
    if step <= 0:
        return 0.0
    if math.isinf(step):
        return math.inf
    changes: dict[int, int] = {}
    for first, after in spans:
        if after > first and first < step:
            changes[first] = changes.get(first, 0) + 1
            changes[after] = changes.get(after, 0) - 1
    seconds = 0.0
    batch = 0
    at = 0.0
    for change_at in sorted(changes):
        if change_at >= step:
            break
        if change_at > at:
            seconds += (change_at - at) * step_s(max(1, batch))
            at = change_at
        batch += changes[change_at]
    return seconds + (step - at) * step_s(max(1, batch))
