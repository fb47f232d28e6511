"""`kvgate plan`'s answers under load, from the engine simulator. Pure: no I/O.

- latency at `--concurrency` c: a closed loop of c clients (each sends its next
  request when the previous one ends), the server's own max_num_seqs, token budget and
  KV cache; TTFT and TPOT are the run's p50 (and p90), E2E its mean, in its steady
  state: the clients start spread over one request's E2E alone (`ClosedLoop.ramp_s`),
  and the first c requests (a start-up wave, queued behind each other where a request
  under load takes longer than alone) and the last c - 1 (which run as the others end
  without a next one) are left out of the figures;
- the recommended `--max-num-seqs`: the largest c, up to the KV margin's limit
  (`planning.kv_concurrency_limit`) and vLLM's max_num_seqs, at which a closed loop of
  c clients on a server with max_num_seqs = c keeps the p90 TTFT and p90 TPOT within
  the targets (a bisection: latency grows with c);
- with `--arrival-rate` R: one replica at that max_num_seqs serves at most the
  closed loop's throughput T (requests/s with every seat taken), so replicas start at
  ceil(R / T); with targets they grow until a Poisson open loop at R / replicas keeps
  both p90s within them. In flight (Little's law) is R x the open loop's mean E2E.

Each closed loop has `REQUESTS_PER_CLIENT` x c requests (at least `MIN_REQUESTS`), of
which all but the first c and the last c - 1 give the latency figures; each open loop
has `OPEN_LOOP_REQUESTS`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from sidecar.model.errors import ModelError
from sidecar.model.planning import DEFAULT_KV_MARGIN, kv_concurrency_limit
from sidecar.model.served import ServedModel
from sidecar.model.simulator import simulate
from sidecar.model.simulator_engine import EngineConfig
from sidecar.model.simulator_workload import ClosedLoop, Lengths, OpenLoop, Workload

MIN_REQUESTS = 16
REQUESTS_PER_CLIENT = 3
OPEN_LOOP_REQUESTS = 200
MAX_EXTRA_REPLICAS = 16  # replicas tried past the throughput bound


@dataclass(frozen=True)
class LoadPoint:
    """One simulated run's figures (seconds, requests/s)."""

    clients: int | None  # closed loop; None for an open loop
    rate_per_s: float | None  # open loop
    max_num_seqs: int
    ttft_p50_s: float
    ttft_p90_s: float
    tpot_p50_s: float | None  # None: one output token, no time per output token
    tpot_p90_s: float | None
    e2e_mean_s: float
    throughput_per_s: float
    preemptions: int

    def meets(self, ttft_target_s: float | None, tpot_target_s: float | None) -> str | None:
        """The first target missed at p90 ("tpot-slo", "ttft-slo"), or None."""
        if (tpot_target_s is not None and self.tpot_p90_s is not None
                and self.tpot_p90_s > tpot_target_s):
            return "tpot-slo"
        if ttft_target_s is not None and self.ttft_p90_s > ttft_target_s:
            return "ttft-slo"
        return None

    def as_dict(self) -> dict[str, float | int | None]:
        return dict(vars(self))


@dataclass(frozen=True)
class SimulatedRecommendation:
    max_num_seqs: int
    limited_by: str  # "kv-cache", "tpot-slo", "ttft-slo", "max-num-seqs"
    at_max: LoadPoint  # the closed loop at max_num_seqs clients
    replicas: int | None  # with an arrival rate
    per_replica: LoadPoint | None  # the open loop at rate / replicas
    concurrency_needed: float | None  # in flight over all replicas (Little's law)
    targets_met: bool = True  # False: even 1 seat, or MAX_EXTRA_REPLICAS more, miss them


class PlanSimulator:
    """The plan's workload through the simulator, runs memoised on their shape."""

    def __init__(self, served: ServedModel, prompt_tokens: int, output_tokens: int,
                 shared_prefix_tokens: int = 0, seed: int = 0) -> None:
        if served.roofline is None or served.capacity is None:
            raise ValueError("the simulator needs a GPU and a KV cache size")
        self.served = served
        self.lengths = Lengths(prompt_tokens, output_tokens,
                               prefix_group="shared" if shared_prefix_tokens else None,
                               prefix_tokens=min(shared_prefix_tokens, prompt_tokens))
        self.shared_prefix_tokens = shared_prefix_tokens
        self.seed = seed
        self.config = EngineConfig.of(served)
        self._runs: dict[tuple[str, float, int], LoadPoint] = {}

    def closed_loop(self, clients: int, max_num_seqs: int | None = None) -> LoadPoint:
        seats = max_num_seqs or self.config.max_num_seqs
        key = ("closed", float(clients), seats)
        if key not in self._runs:
            count = max(MIN_REQUESTS, REQUESTS_PER_CLIENT * clients)
            ramp = self.closed_loop(1).e2e_mean_s if clients > 1 else 0.0
            workload = ClosedLoop(clients, count, self.lengths, seed=self.seed, ramp_s=ramp)
            self._runs[key] = self._run(workload, seats, clients, None, warmup=clients,
                                        cooldown=clients - 1)
        return self._runs[key]

    def open_loop(self, rate_per_s: float, max_num_seqs: int | None = None) -> LoadPoint:
        seats = max_num_seqs or self.config.max_num_seqs
        key = ("open", rate_per_s, seats)
        if key not in self._runs:
            workload = OpenLoop(rate_per_s, OPEN_LOOP_REQUESTS, self.lengths, seed=self.seed)
            self._runs[key] = self._run(workload, seats, None, rate_per_s)
        return self._runs[key]

    def _run(self, workload: Workload, seats: int, clients: int | None,
             rate: float | None, warmup: int = 0, cooldown: int = 0) -> LoadPoint:
        config = replace(self.config, max_num_seqs=seats)
        summary = simulate(self.served, workload, config).summary(warmup, cooldown)
        if summary["completed"] < summary["requests"]:
            raise ModelError("the simulated server cannot serve a request of "
                             f"{self.lengths.prompt_tokens} + {self.lengths.output_tokens} "
                             "tokens (longer than max-model-len, or larger than the KV cache)")

        def figure(name: str, stat: str) -> float:
            value = summary[name][stat]
            return 0.0 if value is None else float(value)

        def tpot(stat: str) -> float | None:  # none with one output token
            value = summary["tpot_s"][stat]
            return None if value is None else float(value)

        return LoadPoint(
            clients, rate, seats,
            figure("ttft_s", "p50"), figure("ttft_s", "p90"),
            tpot("p50"), tpot("p90"),
            figure("e2e_s", "mean"),
            float(summary["throughput_requests_per_s"] or 0.0),
            int(summary["preemptions"]),
        )

    def recommend(self, arrival_rate_per_s: float | None = None,
                  ttft_target_s: float | None = None, tpot_target_s: float | None = None,
                  margin: float = DEFAULT_KV_MARGIN) -> SimulatedRecommendation:
        served = self.served
        limit, limited_by = served.max_num_seqs, "max-num-seqs"
        kv_limit = kv_concurrency_limit(
            served, self.lengths.prompt_tokens + self.lengths.output_tokens, margin,
            output_tokens=self.lengths.output_tokens,
            shared_prefix_tokens=self.shared_prefix_tokens)
        if kv_limit is not None and kv_limit < limit:
            limit, limited_by = max(kv_limit, 1), "kv-cache"

        def missed(clients: int) -> str | None:
            return self.closed_loop(clients, clients).meets(ttft_target_s, tpot_target_s)

        reason = missed(limit) if (ttft_target_s or tpot_target_s) else None
        if reason is not None:
            low, high = 1, limit - 1
            while low < high:
                mid = (low + high + 1) // 2
                if missed(mid) is None:
                    low = mid
                else:
                    high = mid - 1
            limit, limited_by = low, missed(low + 1) or reason
        at_max = self.closed_loop(limit, limit)
        met = at_max.meets(ttft_target_s, tpot_target_s) is None
        if not arrival_rate_per_s:
            return SimulatedRecommendation(limit, limited_by, at_max, None, None, None, met)
        replicas = max(1, math.ceil(arrival_rate_per_s / at_max.throughput_per_s)) \
            if at_max.throughput_per_s > 0 else 1
        per_replica = self.open_loop(arrival_rate_per_s / replicas, limit)
        if (ttft_target_s or tpot_target_s) and met:  # else no replica count helps
            for _ in range(MAX_EXTRA_REPLICAS):
                if per_replica.meets(ttft_target_s, tpot_target_s) is None:
                    break
                replicas += 1
                per_replica = self.open_loop(arrival_rate_per_s / replicas, limit)
        needed = arrival_rate_per_s * per_replica.e2e_mean_s
        met = met and per_replica.meets(ttft_target_s, tpot_target_s) is None
        return SimulatedRecommendation(limit, limited_by, at_max, replicas, per_replica, needed,
                                       met)
