"""How many output tokens to reserve KV for when a request gives no `max_tokens`.

vLLM lets such a request run to `max_model_len`; reserving that much for every
request is safe but wasteful. Two policies, one question each
("how many output tokens should this request's reservation cover?"):

- `WorstCase`: up to `max_model_len` - prompt. Never under-reserves.
- `LearnedQuantile`: a quantile (default p90) of the output lengths recently
  observed for the same tenant (or all tenants while a tenant has few samples),
  never above the worst case. It overcommits the cache by design; the controller
  bounds the total overcommit and falls back to the worst case beyond it, and a
  request that outgrows its reservation grows it as it streams.

An explicit `max_tokens` is always respected as the reservation.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Protocol


class OutputReservation(Protocol):
    name: str

    def reserve(
        self, prompt_tokens: int, max_tokens: int | None, max_model_len: int, tenant: str
    ) -> int: ...

    def observe(self, tenant: str, output_tokens: int) -> None: ...


def worst_case(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    room = max(0, max_model_len - prompt_tokens)
    return room if max_tokens is None else max_tokens


@dataclass
class WorstCase:
    name: str = "worst-case"

    def reserve(
        self, prompt_tokens: int, max_tokens: int | None, max_model_len: int, tenant: str
    ) -> int:
        return worst_case(prompt_tokens, max_tokens, max_model_len)

    def observe(self, tenant: str, output_tokens: int) -> None:
        return None


@dataclass
class _Window:
    values: deque[int]
    cached: int | None = None
    since_cache: int = 0


@dataclass
class LearnedQuantile:
    quantile: float = 0.9
    min_samples: int = 20
    window: int = 512
    max_tenants: int = 1024
    refresh_every: int = 16
    name: str = "quantile"
    _tenants: OrderedDict[str, _Window] = field(default_factory=OrderedDict)
    _all: _Window | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.quantile <= 1.0:
            raise ValueError(f"output quantile must be in (0, 1], got {self.quantile}")
        self._all = _Window(deque(maxlen=self.window))

    def _estimate(self, window: _Window) -> int | None:
        if len(window.values) < self.min_samples:
            return None
        if window.cached is None or window.since_cache >= self.refresh_every:
            ordered = sorted(window.values)
            index = min(len(ordered) - 1, int(self.quantile * len(ordered)))
            window.cached = ordered[index]
            window.since_cache = 0
        return window.cached

    def reserve(
        self, prompt_tokens: int, max_tokens: int | None, max_model_len: int, tenant: str
    ) -> int:
        worst = worst_case(prompt_tokens, max_tokens, max_model_len)
        if max_tokens is not None:
            return worst
        own = self._tenants.get(tenant)
        estimate = self._estimate(own) if own is not None else None
        if estimate is None and self._all is not None:
            estimate = self._estimate(self._all)
        return worst if estimate is None else max(1, min(worst, estimate))

    def observe(self, tenant: str, output_tokens: int) -> None:
        window = self._tenants.get(tenant)
        if window is None:
            window = _Window(deque(maxlen=self.window))
            self._tenants[tenant] = window
            if len(self._tenants) > self.max_tenants:
                self._tenants.popitem(last=False)
        else:
            self._tenants.move_to_end(tenant)
        for target in (window, self._all):
            if target is not None:
                target.values.append(output_tokens)
                target.since_cache += 1
