"""Calibrate the model's rates against the live server.

One robust linear fit (`fit.RobustFit`) over every observed prefill (time to first
token) and decode step (time per output token), in effective rates that no catalogue
peak bounds:

    seconds = r_compute x compute_s + r_memory x memory_s + s_step x steps
              + s_sequence x sequences + s_request x [a prefill] (+ all-reduces)

where compute_s and memory_s are the roofline's FLOP and byte terms at the named
device's peaks (`sidecar.model.latency`: the FLOPs and bytes of the batch at the time,
prompt attention and the KV cache read included, the KV bytes at the prior's share of
the weights' bandwidth, `kv_bandwidth_ratio`, which the fit keeps), steps the engine
steps of the phase, sequences the sequences those steps carried (sampling, output
processing, streaming: small on a GPU server, most of a step on a CPU one) and s_request
the engine's fixed cost per request (API server, tokenizer, first-token streaming).
r_compute and r_memory are the inverse efficiencies against that device: 1 / r is the
share of its peak the server reaches, above 1 when the server is faster than the device
kvgate was told about (see `health`). The model predicts with exactly this sum
(`Efficiency` with serial_fraction 1: no overlap credited between compute and memory
time, which the observations cannot tell).

What the observations identify on one server: prompt lengths separate r_compute from
the fixed costs (prefill), batch sizes s_sequence (decode, once r_compute is known
from prefills), prefill against decode s_request, and contexts r_memory's KV part.
The weights are read once per step whatever the batch, so their time and s_step move
together on one model: the fit's prior (worth two observations) splits that sum, the
prediction of both phases does not depend on the split, and a restart with another
model size re-fits it (`server_restarted`).

Observations come from the sidecar's own requests (time from admission to the first
streamed token; time per token after it; the batch at the time) and from the server's
histograms (inter-token latency and prefill time between two scrapes, with its running
count) for intervals in which the sidecar had no traffic of its own. The fit starts at
a prior: the saved calibration for this model, device and TP; else the last fit of
another model on the same device (a server restarted with another model); else the
analytical defaults.

`spread` keeps what the fit leaves: the median and p90 of observed / predicted of
recent requests (see `spread.Spread`), the factors of the p50 and p90 predictions.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from sidecar.calibration.fit import RobustFit
from sidecar.calibration.health import health
from sidecar.calibration.sample import RateSample
from sidecar.calibration.spread import Spread
from sidecar.calibration.store import CalibrationStore
from sidecar.model import Efficiency, ServedModel

if TYPE_CHECKING:
    from sidecar.upstream import UpstreamView

log = logging.getLogger("kvgate.calibration")

RATES = ("compute", "memory", "step", "sequence", "request")
# r_compute and r_memory: 1e-3 (1,000x the named peak) to 1e7 (1e-7 of it); the
# fixed costs within a few seconds.
BOUNDS = [(1e-3, 1e7), (1e-3, 1e7), (0.0, 5.0), (0.0, 1.0), (0.0, 30.0)]
_CONTEXT_BUCKET = 128
SAVE_EVERY = 50
# The sidecar's own requests learned from: all of them up to 50 a second (see sample).
LEARN_PER_S = 50.0
LEARN_BURST = 50.0


class Calibrator:
    def __init__(self, store: CalibrationStore | None = None) -> None:
        self.store = store or CalibrationStore(None)
        self.spread = Spread()
        self.sample = RateSample(LEARN_PER_S, LEARN_BURST)
        self._key: str | None = None
        self._prior: Efficiency | None = None
        self._fit: RobustFit | None = None
        self._fitted = False
        self._served: ServedModel | None = None
        self._ideal: ServedModel | None = None
        self._features: dict[tuple[str, int, int, int, float, bool | None, int],
                             tuple[list[float], float]] = {}
        self._since_save = 0
        self._own_since_scrape = 0  # the sidecar's own observations since the last scrape
        self._counts = {"decode": 0, "prefill": 0}  # usable observations since the start
        self._typical_log_s: dict[str, float] = {}  # running mean of log(seconds), per kind

    @staticmethod
    def key(served: ServedModel) -> str:
        gpu = served.gpu.name if served.gpu else "none"
        return f"{served.arch.name}|{gpu}|tp{served.deployment.tp}"

    def _ensure(self, served: ServedModel) -> None:
        key = self.key(served)
        if key == self._key:
            self._served = served
            return
        prior = served.efficiency
        previous = self._served
        if previous is not None and self._fit is not None and self._fitted and (
                previous.gpu == served.gpu and previous.deployment.tp == served.deployment.tp):
            # Another model on the same device: its rates are the best start.
            prior = self.efficiency(previous)
        stored = self.store.load(key, prior)
        if stored is not None:
            prior = stored.efficiency
        self._key, self._prior, self._served = key, prior, served
        self._fit = RobustFit(self._rates_of(prior, served), [*BOUNDS])
        self._fitted = False  # any observation for this key yet
        self._counts = {"decode": 0, "prefill": 0}
        # The KV cache's traffic keeps the prior's share of the weights' bandwidth: the
        # fitted memory rate scales both (one server's contexts seldom separate them).
        ideal = Efficiency(compute=1.0, bandwidth=1.0, per_layer_s=0.0, per_step_s=0.0,
                           allreduce_latency_s=prior.allreduce_latency_s, per_request_s=0.0,
                           serial_fraction=1.0, per_sequence_s=0.0,
                           kv_bandwidth_ratio=prior.kv_bandwidth_ratio)
        self._ideal = served.with_efficiency(ideal)
        self._features.clear()

    @staticmethod
    def _rates_of(efficiency: Efficiency, served: ServedModel) -> list[float]:
        return [1.0 / efficiency.compute, 1.0 / efficiency.bandwidth,
                efficiency.per_step_s + efficiency.per_layer_s * served.arch.num_layers,
                efficiency.per_sequence_s, efficiency.per_request_s]

    def _phase(self, kind: str, tokens: int, batch: int, context: int,
               wait_steps: float = 0.0, capped: bool | None = None, in_steps: int = 0,
               ) -> tuple[list[float], float] | None:
        """The features of one observation, and the all-reduce time to add to them. A
        prefill's `wait_steps` are the running requests' steps it waited for first
        (`ServedModel.pickup`); `capped`: whether the server's long-prefill threshold
        caps its chunks (`ServedModel.prefill_chunk_tokens`); `in_steps` (not 0): its
        tokens are several prompts' over that many steps (`ModelInputs.ahead_steps`)."""
        assert self._ideal is not None
        context = max(1, (context // _CONTEXT_BUCKET) * _CONTEXT_BUCKET)
        cache_key = (kind, tokens, batch, context, wait_steps, capped, in_steps)
        found = self._features.get(cache_key)
        if found is None:
            served = self._ideal
            if kind == "decode":
                batch = max(1, batch)
                phase = served.tpot((context,) * batch)
                steps, sequences, request = 1.0, float(batch), 0.0
            else:
                tokens, batch = max(1, tokens), max(0, batch)
                running = (context,) * batch
                prefill = (served.prefill_in_steps(tokens, in_steps, running) if in_steps
                           else served.prefill(tokens, running, capped=capped))
                wait = served.pickup(running, wait_steps)
                phase = None if prefill is None or wait is None else wait.plus(prefill)
                steps = float(min(in_steps, tokens) if in_steps else
                              -(-tokens // served.prefill_chunk_tokens(batch, capped)))
                sequences, request = steps * (batch + 1), 1.0
                if batch:
                    steps += wait_steps
                    sequences += wait_steps * batch
            if phase is None:
                return None
            others = max(0.0, phase.seconds - phase.compute_s - phase.memory_s)
            found = ([phase.compute_s, phase.memory_s, steps, sequences, request], others)
            if len(self._features) > 8192:
                self._features.clear()
            self._features[cache_key] = found
        return found

    # ---- observations -------------------------------------------------------------

    def learns_from(self, now_s: float) -> bool:
        """Whether to learn from the sidecar's request that completed at `now_s`
        (`RateSample`); one left out still counts as the sidecar's own traffic since
        the last scrape."""
        if self.sample.take(now_s):
            return True
        self._own_since_scrape += 1
        return False

    def observe_decode(self, served: ServedModel, batch: int, context: int, seconds: float,
                       weight: float = 1.0) -> None:
        """One of the sidecar's own requests: its time per output token."""
        self._own_since_scrape += 1
        self._observe(served, "decode", 1, batch, context, seconds, weight)

    def observe_prefill(self, served: ServedModel, prompt_tokens: int, running: int,
                        context: int, seconds: float, weight: float = 1.0, *,
                        waited: bool = True, capped: bool | None = None,
                        in_steps: int = 0) -> None:
        """One of the sidecar's own requests: its time to first token after admission,
        with `running` others decoding; `waited`: it waited for their steps first
        (`ServedModel.pickup`; not when prompts were ahead of it, whose prefill those
        steps are); `capped`, `in_steps`: as `CostModel` priced its prefill (the
        server's long-prefill threshold: `ServedModel.prefill_chunk_tokens`; prompts
        ahead of it under it: `ModelInputs.ahead_steps`)."""
        self._own_since_scrape += 1
        self._observe(served, "prefill", prompt_tokens, running, context, seconds, weight,
                      served.pickup_steps if waited else 0.0, capped, in_steps)

    def _observe(self, served: ServedModel, kind: str, tokens: int, batch: int, context: int,
                 seconds: float, weight: float, wait_steps: float = 0.0,
                 capped: bool | None = None, in_steps: int = 0) -> None:
        self._ensure(served)
        assert self._fit is not None
        found = self._phase(kind, tokens, batch, context, wait_steps, capped, in_steps)
        if found is None:
            return
        features, others = found
        y = seconds - others
        if not (math.isfinite(y) and y > 0):
            return
        # What a phase of this kind typically takes: the error's scale (see RobustFit).
        mean = self._typical_log_s.get(kind)
        mean = math.log(y) if mean is None else 0.95 * mean + 0.05 * math.log(y)
        self._typical_log_s[kind] = mean
        restarts = self._fit.restarts
        if self._fit.observe(features, y, weight, math.exp(mean)) is not None:
            if self._fit.restarts != restarts:
                # The fit found the server elsewhere: ratios to its old predictions go.
                self.spread.reset()
            self._fitted = True
            self._counts[kind] += 1
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
            self._observe(served, "decode", 1, running, context, itl[0] / itl[1] / slowdown,
                          weight=min(10.0, itl[1] / 10))
        prefill = _delta(old.histograms.get("prefill"), new.histograms.get("prefill"))
        if prefill is not None and prefill[1] >= 1 and prompts is not None and prompts[1] >= 1:
            # vLLM times a prefill from when it schedules the request, so the wait for
            # the step in flight is not in it; the step scheduled behind that one is,
            # with asynchronous scheduling.
            self._observe(served, "prefill", int(prompts[0] / prompts[1]), max(0, running - 1),
                          context, prefill[0] / prefill[1] / slowdown,
                          weight=min(5.0, prefill[1]),
                          wait_steps=max(0.0, served.pickup_steps - 0.5))

    def server_restarted(self) -> None:
        """The server came back, perhaps with other settings: start the fit over from
        what it had learned (see RobustFit.restart), and the spread from nothing."""
        if self._fit is not None:
            self._fit.restart()
        self.spread.reset()

    # ---- results --------------------------------------------------------------------

    @property
    def observations(self) -> int:
        """Usable observations of the current model, device and TP."""
        return sum(self._counts.values())

    def efficiency(self, served: ServedModel) -> Efficiency:
        self._ensure(served)
        assert self._prior is not None and self._fit is not None
        prior = self._prior
        if not self._fitted:
            return prior
        compute, memory, step, sequence, request = self._fit.rates()
        layers = served.arch.num_layers
        prior_step = prior.per_step_s + prior.per_layer_s * layers
        # The per-step cost, split between per-step and per-layer in the prior's shares.
        share = prior.per_step_s / prior_step if prior_step > 0 else 1.0
        return replace(
            prior,
            compute=1.0 / compute,
            bandwidth=1.0 / memory,
            per_step_s=step * share,
            per_layer_s=step * (1.0 - share) / layers if layers else 0.0,
            per_request_s=request,
            per_sequence_s=sequence,
            serial_fraction=1.0,
        )

    def status(self, served: ServedModel, *, device_named: bool = True) -> dict[str, Any]:
        efficiency = self.efficiency(served)
        assert self._fit is not None
        rates = dict(zip(RATES, self._fit.rates(), strict=True))
        checked = health(served.with_efficiency(efficiency), self.observations,
                         device_named=device_named)
        return {
            "key": self.key(served),
            "efficiency": efficiency.as_dict(),
            "prior": self._prior.as_dict() if self._prior else None,
            "rates": {
                "prefill_flops_per_s": _rate(served, "flops", rates["compute"]),
                "memory_bytes_per_s": _rate(served, "bytes", rates["memory"]),
                "step_s": rates["step"],
                "sequence_s": rates["sequence"],
                "request_s": rates["request"],
            },
            "health": checked.as_dict() if checked else None,
            "spread": self.spread.status(),
            "observations": self.observations,
            "restarts_on_drift": self._fit.restarts,
            "decode_observations": self._counts["decode"],
            "prefill_observations": self._counts["prefill"],
            "requests_left_out": self.sample.left_out,
            "saved_at": time.time(),
        }

    def _saved_later(self, served: ServedModel) -> None:
        if self.store.path is None:
            return  # nowhere to save: no status to build
        self._since_save += 1
        if self._since_save >= SAVE_EVERY:
            self._since_save = 0
            self.store.save(self.status(served))


def _rate(served: ServedModel, unit: str, inverse_efficiency: float) -> float | None:
    """The effective FLOP/s or bytes/s the fitted rate means on the named device."""
    gpu, roofline = served.gpu, served.roofline
    if gpu is None or roofline is None:
        return None
    peak = (gpu.peak_flops(roofline.compute_rate) if unit == "flops"
            else gpu.bandwidth_bytes_per_s)
    return peak / inverse_efficiency


def _delta(old: Any, new: Any) -> tuple[float, float] | None:
    if old is None or new is None:
        return None
    total, count = new.sum - old.sum, new.count - old.count
    if count <= 0 or total < 0:
        return None
    if not math.isfinite(total):
        return None
    return total, count
