"""Calibrate the model's efficiency terms against the live server.

Two robust lines (`fit.RobustLine`), in seconds:
- decode: observed step time (TPOT) = slope x ideal step time + overhead
  + per-sequence cost x batch, where the ideal time is the roofline at 100% efficiency
  and no overheads for the batch and context at the time: slope = 1 / bandwidth
  efficiency (decode is bandwidth-bound), overhead = per-step + per-layer costs, and
  the per-sequence cost the host work each sequence adds to a step (sampling, output
  processing, streaming: small on a GPU server, most of a step on a CPU one);
- prefill: observed time to first token, less the per-sequence cost of the batch
  it ran in, = slope x ideal prefill time + overhead:
  slope = 1 / compute efficiency; what its overhead exceeds the decode overhead by is
  the engine's per-request cost (API server, tokenizer, first-token streaming).
Per-step and per-layer overheads cannot be told apart on one model (the layer count
is fixed), so the fitted overhead scales both in their prior proportion.

Observations come from the sidecar's own requests (time from sending to the first
streamed token; time per token after it; the batch at the time) and from the
server's histograms (inter-token latency and prefill time between two scrapes, with
its running count) for intervals in which the sidecar had no traffic of its own
(requests that bypass it). Each line starts at the analytical prior and is clamped to
physical ranges: efficiencies in [0.001, 1], overheads in [0, 2 s], the per-sequence
cost in [0, 50 ms].
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, replace
from typing import Any

from sidecar.calibration.fit import RobustLine
from sidecar.calibration.store import CalibrationStore
from sidecar.model import Efficiency, ServedModel
from sidecar.upstream import UpstreamView

MIN_EFFICIENCY = 0.001
MAX_OVERHEAD_S = 2.0
MAX_PER_SEQUENCE_S = 0.05
_CONTEXT_BUCKET = 128
SAVE_EVERY = 50


@dataclass(frozen=True)
class CalibrationStatus:
    efficiency: Efficiency
    decode_observations: int
    prefill_observations: int


class Calibrator:
    def __init__(self, store: CalibrationStore | None = None) -> None:
        self.store = store or CalibrationStore(None)
        self._key: str | None = None
        self._prior: Efficiency | None = None
        self._decode: RobustLine | None = None
        self._prefill: RobustLine | None = None
        self._served: ServedModel | None = None
        self._ideal: dict[float, ServedModel] = {}
        self._ideal_cache: dict[tuple[str, int, int, int, float], float] = {}
        self._since_save = 0
        self._own_since_scrape = 0  # the sidecar's own observations since the last scrape

    @staticmethod
    def key(served: ServedModel) -> str:
        gpu = served.gpu.name if served.gpu else "none"
        return f"{served.arch.name}|{gpu}|tp{served.deployment.tp}"

    def _ensure(self, served: ServedModel) -> None:
        key = self.key(served)
        if key == self._key:
            return
        prior = served.efficiency
        stored = self.store.load(key)
        if stored is not None:
            with contextlib.suppress(ValueError):
                prior = Efficiency.from_mapping(stored["efficiency"], prior)
        layers = served.arch.num_layers
        overhead = prior.per_step_s + prior.per_layer_s * layers
        self._key, self._prior = key, prior
        self._decode = RobustLine(1.0 / prior.bandwidth, overhead,
                                  (1.0, 1.0 / MIN_EFFICIENCY), (0.0, MAX_OVERHEAD_S),
                                  prior_per_z=prior.per_sequence_s,
                                  per_z_bounds=(0.0, MAX_PER_SEQUENCE_S))
        self._prefill = RobustLine(1.0 / prior.compute, overhead + prior.per_request_s,
                                   (1.0, 1.0 / MIN_EFFICIENCY), (0.0, MAX_OVERHEAD_S))
        self._served = served
        self._ideal.clear()
        self._ideal_cache.clear()

    def _ideal_model(self, compute: float) -> ServedModel:
        """The model with no overheads, full bandwidth and the given compute efficiency."""
        assert self._served is not None and self._prior is not None
        found = self._ideal.get(compute)
        if found is None:
            efficiency = replace(self._prior, compute=compute, bandwidth=1.0, per_layer_s=0.0,
                                 per_step_s=0.0, per_request_s=0.0, allreduce_latency_s=0.0,
                                 per_sequence_s=0.0)
            found = self._ideal[compute] = self._served.with_efficiency(efficiency)
            if len(self._ideal) > 64:
                self._ideal.clear()
                self._ideal[compute] = found
        return found

    def _ideal_seconds(self, kind: str, tokens: int, batch: int, context: int) -> float:
        """The x of a line: the roofline without overheads. Prefill at full compute
        efficiency (its slope is 1 / compute efficiency); decode at the compute
        efficiency fitted so far and full bandwidth (its slope is then 1 / bandwidth
        efficiency where decode is memory-bound, and ~1 where it is compute-bound)."""
        compute = 1.0
        if kind == "decode":
            assert self._prefill is not None
            compute = float(f"{_clamp(1.0 / self._prefill.estimate()[0]):.2g}")
        context = max(1, (context // _CONTEXT_BUCKET) * _CONTEXT_BUCKET)
        cache_key = (kind, tokens, batch, context, compute)
        cached = self._ideal_cache.get(cache_key)
        if cached is None:
            model = self._ideal_model(compute)
            if kind == "decode":
                phase = model.tpot((context,) * max(1, batch))
            else:
                phase = model.ttft(max(1, tokens), (context,) * max(0, batch))
            cached = phase.seconds if phase is not None else 0.0
            if len(self._ideal_cache) > 8192:
                self._ideal_cache.clear()
            self._ideal_cache[cache_key] = cached
        return cached

    # ---- observations -------------------------------------------------------------

    def observe_decode(self, served: ServedModel, batch: int, context: int, seconds: float,
                       weight: float = 1.0) -> None:
        """One of the sidecar's own requests: its time per output token."""
        self._own_since_scrape += 1
        self._fit_decode(served, batch, context, seconds, weight)

    def observe_prefill(self, served: ServedModel, prompt_tokens: int, running: int,
                        context: int, seconds: float, weight: float = 1.0) -> None:
        """One of the sidecar's own requests: its time to first token."""
        self._own_since_scrape += 1
        self._fit_prefill(served, prompt_tokens, running, context, seconds, weight)

    def _fit_decode(self, served: ServedModel, batch: int, context: int, seconds: float,
                    weight: float) -> None:
        self._ensure(served)
        assert self._decode is not None
        if self._decode.observe(self._ideal_seconds("decode", 1, batch, context), seconds,
                                weight, z=max(1, batch)):
            self._saved_later(served)

    def _fit_prefill(self, served: ServedModel, prompt_tokens: int, running: int,
                     context: int, seconds: float, weight: float) -> None:
        self._ensure(served)
        assert self._prefill is not None and self._decode is not None
        # The step it ran in also carried the running sequences' host work.
        per_sequence = self._decode.coefficients()[2] * (max(0, running) + 1)
        if self._prefill.observe(
            self._ideal_seconds("prefill", prompt_tokens, running, context),
            seconds - per_sequence, weight,
        ):
            self._saved_later(served)

    def observe_server(self, before: UpstreamView, after: UpstreamView,
                       served: ServedModel, slowdown: float = 1.0,
                       sidecar_traffic: bool = False) -> None:
        """Use the server's own histograms between two scrapes; `slowdown` is the
        prefill load's stretch factor at the time (see admission.load).

        Only where the sidecar saw no traffic of its own in the interval
        (`sidecar_traffic`: requests in flight; or observations since the last scrape):
        requests that bypass it, a sidecar that just started. Where both exist the
        sidecar's own observations win: they measure what it predicts (TTFT and TPOT
        as clients see them, API server included) at the batch each request saw, while
        the histograms are the engine's view, at a running count sampled at the scrape.
        """
        own = self._own_since_scrape
        self._own_since_scrape = 0
        if sidecar_traffic or own > 0:
            return
        old, new = before.metrics, after.metrics
        if old is None or new is None or not after.up or before.restarts != after.restarts:
            return
        running = new.running or 0
        itl = _delta(old.histograms.get("itl"), new.histograms.get("itl"))
        tokens = _delta(old.histograms.get("generation_tokens"),
                        new.histograms.get("generation_tokens"))
        prompts = _delta(old.histograms.get("prompt_tokens"),
                         new.histograms.get("prompt_tokens"))
        context = 0
        if prompts is not None and prompts[1] > 0:
            context = int(prompts[0] / prompts[1])
            if tokens is not None and tokens[1] > 0:
                context += int(tokens[0] / tokens[1] / 2)
        if itl is not None and itl[1] >= 2 and running > 0:
            self._fit_decode(served, running, context, itl[0] / itl[1] / slowdown,
                             weight=min(10.0, itl[1] / 10))
        prefill = _delta(old.histograms.get("prefill"), new.histograms.get("prefill"))
        if prefill is not None and prefill[1] >= 1 and prompts is not None and prompts[1] >= 1:
            self._fit_prefill(served, int(prompts[0] / prompts[1]), max(0, running - 1),
                              context, prefill[0] / prefill[1] / slowdown,
                              weight=min(5.0, prefill[1]))

    def server_restarted(self) -> None:
        """The server came back, perhaps with other settings: start the fits over from
        what they had learned (see RobustLine.restart)."""
        for line in (self._decode, self._prefill):
            if line is not None:
                line.restart()

    # ---- results --------------------------------------------------------------------

    def efficiency(self, served: ServedModel) -> Efficiency:
        self._ensure(served)
        assert self._prior is not None and self._decode is not None and self._prefill is not None
        prior = self._prior
        if not self._decode.observations and not self._prefill.observations:
            return prior
        decode_slope, overhead, per_sequence = self._decode.coefficients()
        prefill_slope, prefill_overhead = self._prefill.estimate()
        prior_overhead = prior.per_step_s + prior.per_layer_s * served.arch.num_layers
        factor = overhead / prior_overhead if prior_overhead > 0 else 1.0
        per_step = prior.per_step_s * factor if prior_overhead > 0 else overhead
        # What the first token costs beyond one step: the engine's per-request work.
        per_request = max(0.0, prefill_overhead - overhead)
        return replace(
            prior,
            compute=_clamp(1.0 / prefill_slope),
            bandwidth=_clamp(1.0 / decode_slope),
            per_layer_s=prior.per_layer_s * factor,
            per_step_s=per_step,
            per_request_s=per_request,
            per_sequence_s=per_sequence,
        )

    def status(self, served: ServedModel) -> dict[str, Any]:
        efficiency = self.efficiency(served)
        assert self._decode is not None and self._prefill is not None
        return {
            "key": self.key(served),
            "efficiency": efficiency.as_dict(),
            "prior": self._prior.as_dict() if self._prior else None,
            "decode_observations": self._decode.observations,
            "prefill_observations": self._prefill.observations,
            "saved_at": time.time(),
        }

    def _saved_later(self, served: ServedModel) -> None:
        self._since_save += 1
        if self._since_save >= SAVE_EVERY:
            self._since_save = 0
            self.store.save(self.status(served))


def _clamp(efficiency: float) -> float:
    if not math.isfinite(efficiency):
        return 1.0
    return min(1.0, max(MIN_EFFICIENCY, efficiency))


def _delta(old: Any, new: Any) -> tuple[float, float] | None:
    if old is None or new is None:
        return None
    total, count = new.sum - old.sum, new.count - old.count
    if count <= 0 or total < 0:
        return None
    return total, count
