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


def test_the_step_running_at_a_time_is_the_inverse() -> None:
    """The worked example: 24 s in, step 4 starts; 2 s into a step of 4 s, half of it is
    done; past the last request the steps are priced at a batch of one."""
    clock = StepClock([(0, 4), (0, 6)], STEP_S.__getitem__)
    assert clock.step_at(24.0) == 4.0
    assert clock.step_at(26.0) == 4.5
    assert clock.step_at(3.0) == 0.5
    assert clock.step_at(32.0 + 8.0) == 8.0
    assert clock.step_at(0.0) == clock.step_at(-1.0) == 0.0
    assert clock.step_at(math.inf) == math.inf


@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 40)), max_size=4),
       st.floats(0, 200))
def test_the_step_at_a_time_starts_within_it(spans: list[tuple[int, int]],
                                             seconds: float) -> None:
    """`seconds_until(step_at(s))` is s: the step running then started by s, and the
    next one starts after it."""
    clock = StepClock(spans, lambda batch: 1.0 + 0.5 * batch)
    step = clock.step_at(seconds)
    assert clock.seconds_until(step) == pytest.approx(seconds, abs=1e-9)
    assert clock.seconds_until(math.floor(step)) <= seconds + 1e-9
    assert clock.seconds_until(math.floor(step) + 1) > seconds
