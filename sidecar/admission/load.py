"""How busy the server is with prefills: a decaying rate of admitted prefill time.

vLLM runs prefills and decodes in the same steps, so while it prefills new prompts
the running requests decode more slowly, and a new prompt may find the engine busy
with others. If prefills take a share rho of the engine's time (seconds of
predicted prefill admitted per second), decoding gets 1 - rho of it:

    TPOT ~ decode step / (1 - rho')        TTFT ~ own prefill / (1 - rho')

where rho' counts only the prefills of the *other* requests: with n others running
(all issuing prefills at the same rate), rho' = rho x n / (n + 1). A lone request's own
prefill happens before its decode and stretches nothing.

rho is estimated as an exponentially decaying sum of the admitted prefill seconds
over a time constant (10 s), capped so that predictions stay finite.
"""

from __future__ import annotations

import math

MAX_UTILISATION = 0.8


class PrefillLoad:
    def __init__(self, time_constant_s: float = 10.0) -> None:
        self.time_constant_s = time_constant_s
        self._sum = 0.0
        self._at: float | None = None

    def _decay_to(self, now: float) -> None:
        if self._at is not None and now > self._at:
            self._sum *= math.exp(-(now - self._at) / self.time_constant_s)
        self._at = now if self._at is None else max(self._at, now)

    def add(self, now: float, prefill_s: float) -> None:
        self._decay_to(now)
        self._sum += max(0.0, prefill_s)

    def rescale(self, factor: float) -> None:
        """The prefill seconds admitted so far, re-expressed by a model that prices the
        same work `factor` times as long."""
        if factor > 0:
            self._sum *= factor

    def utilisation(self, now: float) -> float:
        """The share of engine time spent prefilling lately, in [0, MAX_UTILISATION]."""
        self._decay_to(now)
        return min(MAX_UTILISATION, self._sum / self.time_constant_s)

    def slowdown(self, now: float, others: int) -> float:
        """The factor 1 / (1 - rho') by which the prefills of `others` concurrent
        requests stretch one request's work."""
        return slowdown_at(self.utilisation(now), others)


def slowdown_at(utilisation: float, others: int) -> float:
    """`PrefillLoad.slowdown` at a known `utilisation` (rho)."""
    share = others / (others + 1) if others > 0 else 0.0
    return 1.0 / (1.0 - utilisation * share)
