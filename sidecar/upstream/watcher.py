"""Watch the server: scrape `/metrics` on an interval, learn `/v1/models`, notice
when the server goes away and when it comes back (perhaps different).

The watcher only observes; its `on_update` callback (wired by the server's
composition root) turns each observation into decisions. A server that refuses
connections is down at once, one that fails twice is down unless it still answers
`/v1/models`: then only its /metrics fail, and they go stale.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from sidecar.upstream.client import ModelInfo, UpstreamClient, UpstreamError
from sidecar.upstream.server_metrics import ServerMetrics

log = logging.getLogger("kvgate.upstream")


@dataclass(frozen=True)
class UpstreamView:
    """Everything known about the server at one moment."""

    up: bool = False
    models: tuple[ModelInfo, ...] = ()
    metrics: ServerMetrics | None = None
    metrics_at: float | None = None  # monotonic time of the last good scrape
    metrics_sent_at: float | None = None  # when that scrape was sent
    last_error: str | None = None
    consecutive_failures: int = 0
    restarts: int = 0  # times the server came back after being down
    previous_metrics: ServerMetrics | None = field(default=None, repr=False)
    previous_metrics_at: float | None = None

    def metrics_age_s(self, now: float) -> float:
        return float("inf") if self.metrics_at is None else max(0.0, now - self.metrics_at)

    @property
    def model(self) -> ModelInfo | None:
        return self.models[0] if self.models else None


class UpstreamWatcher:
    def __init__(
        self,
        client: UpstreamClient,
        *,
        interval_s: float = 1.0,
        failures_before_down: int = 2,
        clock: Callable[[], float] = time.monotonic,
        on_update: Callable[[UpstreamView, UpstreamView], None] | None = None,
    ) -> None:
        self.client = client
        self.interval_s = interval_s
        self.failures_before_down = failures_before_down
        self.clock = clock
        self.on_update = on_update
        self.view = UpstreamView()
        self._wake = asyncio.Event()

    def poke(self) -> None:
        """Poll now (e.g. after a request failed to connect)."""
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self.poll_once()
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)

    async def poll_once(self) -> UpstreamView:
        before = self.view
        try:
            sent = self.clock()
            metrics = await self.client.metrics()
            models = before.models
            if not before.up or not models:
                models = tuple(await self.client.models())
            now = self.clock()
            after = replace(
                before,
                up=True,
                models=models,
                metrics=metrics,
                metrics_at=now,
                metrics_sent_at=sent,
                last_error=None,
                consecutive_failures=0,
                restarts=before.restarts + (1 if before.metrics_at and not before.up else 0),
                previous_metrics=before.metrics,
                previous_metrics_at=before.metrics_at,
            )
        except UpstreamError as exc:
            after = await self._failed(before, exc)
        except Exception as exc:  # a reply no parser expected: a failed poll; the polls go on
            if not before.consecutive_failures:
                log.exception("polling the server failed")
            after = await self._failed(before, UpstreamError("protocol",
                                                             f"unexpected reply: {exc!r}"))
        if after.up and not before.up:
            log.info("upstream is up: model %s", after.model.id if after.model else "?")
        self.view = after
        if self.on_update is not None:
            self.on_update(before, after)
        return after

    async def _failed(self, before: UpstreamView, exc: UpstreamError) -> UpstreamView:
        """The view after a failed poll: down on a refused connection or after
        `failures_before_down` failures in a row (unless the server still answers)."""
        failures = before.consecutive_failures + 1
        down = exc.kind == "connect" or failures >= self.failures_before_down
        models = () if down else before.models
        if down and exc.kind != "connect" and before.up:
            # Only /metrics may be failing: a server that still answers stays up,
            # its metrics go stale and decisions fall back to the model alone.
            alive = await self._alive()
            if alive is not None:
                if failures == self.failures_before_down:
                    log.warning("the server's /metrics fails (%s) but the server "
                                "answers: its metrics will go stale", exc)
                down, models = False, alive
        after = replace(
            before,
            up=before.up and not down,
            last_error=str(exc),
            consecutive_failures=failures,
            models=models,
        )
        if before.up and down:
            log.warning("upstream is down: %s", exc)
        return after

    async def _alive(self) -> tuple[ModelInfo, ...] | None:
        """The served models if the server answers /v1/models, else None."""
        try:
            models = tuple(await self.client.models())
        except Exception:  # an UpstreamError, or a reply no parser expected
            return None
        return models or None
