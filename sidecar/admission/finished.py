"""Requests kvgate saw finish, kept for a while: a scrape of the server's KV use
describes a moment between when it was sent and when its answer came, so it may still
count the blocks of requests kvgate has seen finish since it was sent. Without them,
those blocks would pass for traffic kvgate does not know of until the next scrape.
"""

from __future__ import annotations

import itertools
from collections import deque

# Kept at most this long (a scrape in flight longer is stale anyway).
KEEP_S = 10.0


class RecentlyFinished:
    def __init__(self, engines: int = 1) -> None:
        self.engines = max(1, engines)
        self._finished: deque[tuple[float, int, int]] = deque()  # (at, blocks, engine)

    def add(self, at_s: float, blocks: int, engine: int = 0) -> None:
        """A request finished at `at_s`, the server holding up to `blocks` for it."""
        while self._finished and self._finished[0][0] < at_s - KEEP_S:
            self._finished.popleft()
        if blocks > 0:
            self._finished.append((at_s, blocks, min(max(engine, 0), self.engines - 1)))

    def since(self, from_s: float | None, now: float, count: int | None = None) -> list[int]:
        """Blocks per engine of the requests that finished at or after `from_s` (when
        the scrape was sent; None: not known, nothing), the latest `count` of them at
        most (those the server still counted: it reported that many requests more than
        kvgate runs; None: all). Those that finished before `from_s` are forgotten:
        later scrapes are sent later."""
        horizon = now - KEEP_S if from_s is None else min(from_s, now)
        while self._finished and self._finished[0][0] < horizon:
            self._finished.popleft()
        blocks = [0] * self.engines
        if from_s is None or count == 0:
            return blocks
        # The latest `count`, walked from the end (no copy of all of them: at thousands
        # of requests a second they are tens of thousands).
        latest = (self._finished if count is None
                  else itertools.islice(reversed(self._finished), count))
        for _, held, engine in latest:
            blocks[engine] += held
        return blocks

    def __len__(self) -> int:
        return len(self._finished)
