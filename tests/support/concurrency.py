"""How many requests a vLLM server runs at once during a load: its own
`vllm:num_requests_running`, sampled from its /metrics while the load runs."""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType

import aiohttp

from support.sidecar import metric_value


class RunningSampler:
    """`async with RunningSampler(server_url) as running: await load()`; then
    `running.max` is the most requests the server ran at once in a sample."""

    def __init__(self, server_url: str, interval_s: float = 0.05) -> None:
        self.url = server_url + "/metrics"
        self.interval_s = interval_s
        self.samples: list[float] = []
        self._task: asyncio.Task[None] | None = None

    @property
    def max(self) -> float:
        assert self.samples, "no sample of vllm:num_requests_running was taken"
        return max(self.samples)

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                async with session.get(self.url) as response:
                    text = await response.text()
                self.samples.append(metric_value(text, "vllm:num_requests_running"))
                await asyncio.sleep(self.interval_s)

    async def __aenter__(self) -> RunningSampler:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        trace: TracebackType | None) -> None:
        assert self._task is not None
        if self._task.done():
            self._task.result()  # a sampler that failed says why
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
