"""What the admission queue waits on: the limit that keeps its head from going in now,
and how long the queue has waited on each since start.

The queue moves only when its head goes in (the requests behind it wait for its turn),
so the head's limit is the queue's. It is the KV cache (no room for the head's peak
beside what runs) or one of the server's own limits that kvgate keeps (its
`--max-num-seqs`, `--max-num-queued-reqs`, `--max-num-queued-tokens`). (Nothing waits
on a server that is down: its queue is refused as it goes.) An operator reads from it
what to change: more KV cache (or replicas) when the queue waits on the cache, a larger
`--max-num-seqs` when it waits on that.
"""

from __future__ import annotations

from sidecar.admission.server_queue import MAX_PREFILL_TOKENS, MAX_REQUESTS, MAX_RUNNING

KV_CACHE = "kv_cache"
# Every limit the queue can wait on, as exported (the metrics' `limit` label).
LIMITS = (KV_CACHE, MAX_RUNNING, MAX_REQUESTS, MAX_PREFILL_TOKENS)


class QueueBlockage:
    """The limit the queue waits on now (None: it is empty, or its head can go) and the
    seconds it has waited on each, the current wait included."""

    __slots__ = ("_seconds", "_since_s", "current")

    def __init__(self, now_s: float) -> None:
        self.current: str | None = None
        self._since_s = now_s
        self._seconds = dict.fromkeys(LIMITS, 0.0)

    def set(self, limit: str | None, now_s: float) -> None:
        """From `now_s` on the queue waits on `limit` (None: on nothing; a limit not
        among `LIMITS` is counted under its own name)."""
        if limit is None and self.current is None:
            return  # nothing waited, nothing waits: no change
        if self.current is not None:
            self._seconds[self.current] = (self._seconds.get(self.current, 0.0)
                                           + max(0.0, now_s - self._since_s))
        self.current = limit
        self._since_s = now_s

    def seconds(self, now_s: float) -> dict[str, float]:
        """Seconds the queue has waited on each limit, up to `now_s`."""
        seconds = dict(self._seconds)
        if self.current is not None:
            seconds[self.current] = (seconds.get(self.current, 0.0)
                                     + max(0.0, now_s - self._since_s))
        return seconds
