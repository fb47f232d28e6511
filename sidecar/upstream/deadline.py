"""A deadline that moves with every request, checked by one timer.

Arming an event-loop timer and cancelling it costs about a microsecond; a connection
that re-armed one for every request (its idle timeout) or every wait for the server (its
read timeout) paid that each time. `Deadline` keeps one timer, armed at most once per
timeout: moving the deadline later only records it, and the timer, when it fires early,
is armed again for what is left.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

# A timer may fire this early against the loop's clock (its resolution): it counts as due.
TIMER_SLACK_S = 0.001


class Deadline:
    """Calls `on_due` once the loop's clock passes the deadline last set, unless it was
    cleared (or set again, later) before then."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_due: Callable[[], None]) -> None:
        self._loop = loop
        self._on_due = on_due
        self._at = math.inf  # loop time; inf: none
        self._timer: asyncio.TimerHandle | None = None

    def set(self, at: float) -> None:
        self._at = at
        timer = self._timer
        if timer is not None and timer.when() > at:
            timer.cancel()  # sooner than the one armed
            timer = None
        if timer is None:
            self._timer = self._loop.call_at(at, self._check)

    def clear(self) -> None:
        """No deadline (an armed timer finds none when it fires)."""
        self._at = math.inf

    def stop(self) -> None:
        """No deadline, and no timer left holding on to the owner."""
        self._at = math.inf
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        self._timer = None
        at = self._at
        if at == math.inf:
            return  # armed again by the next `set`
        if self._loop.time() >= at - TIMER_SLACK_S:
            self._at = math.inf
            self._on_due()
        else:  # moved later since the timer was armed: the rest of it
            self._timer = self._loop.call_at(at, self._check)
