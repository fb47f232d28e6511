"""Workloads for the engine simulator: what arrives when, and how long it is.

Three kinds, all deterministic for a given seed:

- `ClosedLoop`: `clients` clients, each sending its next request when the previous
  one finished (plus an optional think time, fixed or exponential);
- `OpenLoop`: requests at `rate_per_s`, Poisson (exponential gaps) or bursty
  (bursts of `burst_size` requests arriving together, the bursts Poisson at
  rate / burst_size);
- a trace: JSON lines of `arrival_s`, `prompt_tokens`, `output_tokens` and, optional,
  `prefix_group`, `prefix_tokens`, `priority` (`parse_trace`; the caller reads the
  file, this module does no I/O).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from sidecar.model.errors import ModelError


class TraceError(ModelError):
    """A trace line that is not a request: names the line and the field."""


@dataclass(frozen=True)
class SimRequest:
    """One request as a client sends it. Lower `priority` values are served first
    (vLLM's convention); requests with the same `prefix_group` share their first
    `prefix_tokens` prompt tokens (a system prompt, tool definitions)."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_group: str | None = None
    prefix_tokens: int = 0
    priority: int = 0


class Workload(Protocol):
    """Where requests come from: some up front, some in answer to a finished one."""

    def initial(self) -> list[SimRequest]:
        """Requests known before the run (any arrival times, in any order)."""
        ...

    def after(self, finished: SimRequest, finish_s: float) -> SimRequest | None:
        """The request sent because `finished` completed at `finish_s`, if any."""
        ...


@dataclass(frozen=True)
class Lengths:
    """Prompt and output lengths: each uniform in mean x [1 - spread, 1 + spread]."""

    prompt_tokens: int
    output_tokens: int
    spread: float = 0.0
    prefix_group: str | None = None
    prefix_tokens: int = 0

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ModelError("prompt and output lengths must be >= 1 token")
        if not 0.0 <= self.spread < 1.0:
            raise ModelError(f"length spread must be in [0, 1), got {self.spread}")

    def draw(self, rng: random.Random, arrival_s: float) -> SimRequest:
        return SimRequest(arrival_s, self._one(rng, self.prompt_tokens),
                          self._one(rng, self.output_tokens), self.prefix_group,
                          self.prefix_tokens)

    def _one(self, rng: random.Random, mean: int) -> int:
        if not self.spread:
            return mean
        low = max(1, round(mean * (1 - self.spread)))
        high = max(low, round(mean * (1 + self.spread)))
        return rng.randint(low, high)


class ClosedLoop:
    """`clients` clients sending `requests` requests in all, each after the previous
    one of the same client finished and a think time (exponential with mean
    `think_s` when `exponential_think`, else exactly `think_s`; plus a pause drawn
    uniformly from [0, `jitter_s`), as some benchmark clients add). The clients' first
    requests arrive together, or, with `ramp_s`, evenly spread over [0, ramp_s) (client
    k at k x ramp_s / clients): a ramp of one request's E2E starts the loop as it runs
    in its steady state, without a first wave of prefills queued behind each other."""

    def __init__(self, clients: int, requests: int, lengths: Lengths, think_s: float = 0.0,
                 exponential_think: bool = False, seed: int = 0, ramp_s: float = 0.0,
                 jitter_s: float = 0.0) -> None:
        if clients < 1 or requests < 1:
            raise ModelError("a closed loop needs >= 1 client and >= 1 request")
        if think_s < 0 or ramp_s < 0 or jitter_s < 0:
            raise ModelError("think time, ramp and jitter must not be negative")
        self.jitter_s = jitter_s
        self.ramp_s = ramp_s
        self.clients = clients
        self.requests = requests
        self.lengths = lengths
        self.think_s = think_s
        self.exponential_think = exponential_think
        self._rng = random.Random(seed)
        self._sent = 0

    def initial(self) -> list[SimRequest]:
        first = min(self.clients, self.requests)
        self._sent = first
        return [self.lengths.draw(self._rng, k * self.ramp_s / self.clients)
                for k in range(first)]

    def after(self, finished: SimRequest, finish_s: float) -> SimRequest | None:
        if self._sent >= self.requests:
            return None
        self._sent += 1
        think = self.think_s
        if think and self.exponential_think:
            think = self._rng.expovariate(1.0 / think)
        if self.jitter_s:
            think += self._rng.uniform(0.0, self.jitter_s)
        return self.lengths.draw(self._rng, finish_s + think)


class OpenLoop:
    """`requests` requests arriving at `rate_per_s`: Poisson, or in Poisson bursts of
    `burst_size` requests sent together."""

    def __init__(self, rate_per_s: float, requests: int, lengths: Lengths,
                 burst_size: int = 1, seed: int = 0) -> None:
        if not rate_per_s > 0 or requests < 1 or burst_size < 1:
            raise ModelError("an open loop needs a rate > 0, >= 1 request, bursts >= 1")
        self.rate_per_s = rate_per_s
        self.requests = requests
        self.lengths = lengths
        self.burst_size = burst_size
        self.seed = seed

    def initial(self) -> list[SimRequest]:
        rng = random.Random(self.seed)
        burst_rate = self.rate_per_s / self.burst_size
        out: list[SimRequest] = []
        now = 0.0
        while len(out) < self.requests:
            for _ in range(min(self.burst_size, self.requests - len(out))):
                out.append(self.lengths.draw(rng, now))
            now += rng.expovariate(burst_rate)
        return out

    def after(self, finished: SimRequest, finish_s: float) -> SimRequest | None:
        return None


class Trace:
    """A fixed list of requests (a parsed trace)."""

    def __init__(self, requests: Sequence[SimRequest]) -> None:
        self.requests = list(requests)

    def initial(self) -> list[SimRequest]:
        return list(self.requests)

    def after(self, finished: SimRequest, finish_s: float) -> SimRequest | None:
        return None


_TRACE_FIELDS = ("arrival_s", "prompt_tokens", "output_tokens", "prefix_group",
                 "prefix_tokens", "priority")


# Seconds: past this (31 years) a step's milliseconds are lost in the arrival times.
MAX_ARRIVAL_S = 1e9


def parse_trace(lines: Iterable[str], source: str = "trace") -> list[SimRequest]:
    """Requests from JSON lines; blank lines and lines starting with # are skipped.

    Each error names the line and the field: `trace.jsonl line 3: prompt_tokens must
    be an integer >= 1, got "12x"`."""
    requests: list[SimRequest] = []
    for number, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        where = f"{source} line {number}"
        try:
            item = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(item, dict):
            raise TraceError(f"{where}: expected a JSON object, got {type(item).__name__}")
        unknown = sorted(set(item) - set(_TRACE_FIELDS))
        if unknown:
            raise TraceError(f"{where}: unknown field {unknown[0]!r} "
                             f"(known: {', '.join(_TRACE_FIELDS)})")
        for name in ("arrival_s", "prompt_tokens", "output_tokens"):
            if name not in item:
                raise TraceError(f"{where}: missing field {name!r}")
        arrival = item["arrival_s"]
        if isinstance(arrival, bool) or not isinstance(arrival, int | float) \
                or not 0 <= arrival <= MAX_ARRIVAL_S:
            raise TraceError(f"{where}: arrival_s must be a number from 0 to {MAX_ARRIVAL_S:g} "
                             f"(seconds), got {arrival!r}")
        group = item.get("prefix_group")
        if group is not None and (isinstance(group, bool) or not isinstance(group, str | int)):
            raise TraceError(f"{where}: prefix_group must be a string or an integer, "
                             f"got {group!r}")
        prefix_tokens = _integer(item, "prefix_tokens", where, minimum=0, default=0)
        if prefix_tokens and group is None:
            raise TraceError(f"{where}: prefix_tokens needs a prefix_group")
        prompt_tokens = _integer(item, "prompt_tokens", where, minimum=1)
        if prefix_tokens > prompt_tokens:
            raise TraceError(f"{where}: prefix_tokens ({prefix_tokens}) must not exceed "
                             f"prompt_tokens ({prompt_tokens})")
        requests.append(SimRequest(
            arrival_s=float(arrival),
            prompt_tokens=prompt_tokens,
            output_tokens=_integer(item, "output_tokens", where, minimum=1),
            prefix_group=None if group is None else str(group),
            prefix_tokens=prefix_tokens,
            priority=_integer(item, "priority", where, minimum=None, default=0),
        ))
    if not requests:
        raise TraceError(f"{source}: no requests")
    return requests


def _integer(item: dict[str, object], name: str, where: str, minimum: int | None,
             default: int | None = None) -> int:
    value = item.get(name, default)
    if value is None and default is not None:
        return default
    ok = isinstance(value, int) and not isinstance(value, bool)
    if ok and minimum is not None and value < minimum:  # type: ignore[operator]
        ok = False
    if not ok:
        bound = "an integer" if minimum is None else f"an integer >= {minimum}"
        raise TraceError(f"{where}: {name} must be {bound}, got {value!r}")
    assert isinstance(value, int)
    return value
