"""The time of the engine steps ahead, each at the batch running in it."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.admission.step_clock import StepClock

STEP_S = {1: 4.0, 2: 6.0, 3: 7.0}


def seconds_until(step: float, spans: list[tuple[int, int]],
                  step_s: Callable[[int], float] = STEP_S.__getitem__) -> float:
    return StepClock(spans, step_s).seconds_until(step)


def test_the_worked_example() -> None:
    """Two running, ending after steps 3 and 5: 4 steps of 2, then 2 of 1."""
    spans = [(0, 4), (0, 6)]
    assert seconds_until(6, spans) == 4 * 6.0 + 2 * 4.0
    assert seconds_until(4, spans) == 4 * 6.0
    assert seconds_until(5, spans) == 4 * 6.0 + 4.0
    assert seconds_until(0, spans) == 0.0
    assert seconds_until(math.inf, spans) == math.inf


def test_a_request_admitted_on_the_way_slows_the_steps_it_runs_in() -> None:
    """One running until step 5, one admitted at step 2 for 2 steps: steps 2 and 3 are
    steps of 2."""
    spans = [(0, 6), (2, 4)]
    assert seconds_until(6, spans) == 2 * 4.0 + 2 * 6.0 + 2 * 4.0


def test_steps_with_nothing_running_are_priced_at_a_batch_of_one() -> None:
    assert seconds_until(5, [(0, 2)]) == 5 * 4.0
    assert seconds_until(3, []) == 3 * 4.0


def test_each_batch_is_priced_once() -> None:
    asked: list[int] = []
    clock = StepClock([(0, 4), (0, 6), (2, 8)], lambda b: asked.append(b) or 1.0 * b)
    assert sorted(asked) == [1, 2, 3]
    assert clock.seconds_until(8) == 2 * 2 + 2 * 3 + 2 * 2 + 2 * 1


@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 40)), max_size=4),
       st.integers(0, 50))
def test_equals_the_sum_over_each_step(spans: list[tuple[int, int]], step: int) -> None:
    """Against a step-by-step count of the batch."""
    def step_s(batch: int) -> float:
        return 1.0 + 0.5 * batch

    by_step = sum(step_s(max(1, sum(first <= s < after for first, after in spans)))
                  for s in range(step))
    assert seconds_until(step, spans, step_s) == pytest.approx(by_step)
