"""The engine simulator: vLLM V1's scheduling loop step by step, priced by the
roofline. Pure: no I/O, no asyncio.

- `simulate(served, workload, config, gate)` runs a workload (`ClosedLoop`, `OpenLoop`,
  a `Trace` of `parse_trace` lines) through the engine (`simulator_engine`: what it
  follows of vLLM's scheduler, and what it leaves out), optionally behind a simplified
  kvgate (`KvgateGate`), and returns a `SimulationResult` (`simulator_results`);
- `simulate_plan` runs `kvgate plan`'s workload (`kvgate plan --simulate`).
"""

from __future__ import annotations

from typing import Any

from sidecar.model.served import ServedModel
from sidecar.model.simulator_engine import Engine, EngineConfig, KvgateGate, Policy
from sidecar.model.simulator_results import RequestRecord, SimulationResult
from sidecar.model.simulator_workload import (
    ClosedLoop,
    Lengths,
    OpenLoop,
    SimRequest,
    Trace,
    TraceError,
    Workload,
    parse_trace,
)

__all__ = [
    "ClosedLoop",
    "EngineConfig",
    "KvgateGate",
    "Lengths",
    "OpenLoop",
    "Policy",
    "RequestRecord",
    "SimRequest",
    "SimulationResult",
    "Trace",
    "TraceError",
    "Workload",
    "parse_trace",
    "simulate",
    "simulate_plan",
]


def simulate(served: ServedModel, workload: Workload, config: EngineConfig | None = None,
             gate: KvgateGate | None = None) -> SimulationResult:
    """Run `workload` through the simulated engine (behind `gate`, if given)."""
    return Engine(served, config or EngineConfig.of(served), gate).run(workload)


def simulate_plan(served: ServedModel, prompt_tokens: int, output_tokens: int,
                  concurrency: int, arrival_rate_per_s: float | None = None,
                  shared_prefix_tokens: int = 0, requests: int | None = None,
                  seed: int = 0) -> dict[str, Any]:
    """`kvgate plan --simulate`: the plan's workload through the simulator, a closed
    loop of `concurrency` clients (its latency figures without the clients' first
    requests and the last c - 1, as `PlanSimulator`'s) and, with a rate, a Poisson open
    loop. Each entry is a run's summary without its KV samples."""
    count = requests or max(200, 10 * concurrency)
    lengths = Lengths(prompt_tokens, output_tokens,
                      prefix_group="shared" if shared_prefix_tokens else None,
                      prefix_tokens=shared_prefix_tokens)
    runs: dict[str, Any] = {}
    # The clients start one request's E2E apart, as `PlanSimulator` starts them: sent at
    # one instant, identical requests would share every step for good, where real
    # clients fall out of step on the first (an idle engine starts on the first arrival).
    ramp_s = 0.0
    if concurrency > 1:
        alone = simulate(served, ClosedLoop(1, 1, lengths, seed=seed)).summary()
        ramp_s = alone["e2e_s"]["mean"] or 0.0
    closed = simulate(served, ClosedLoop(concurrency, count, lengths, seed=seed,
                                         ramp_s=ramp_s)).summary(concurrency, concurrency - 1)
    runs["closed_loop"] = {"clients": concurrency, "ramp_s": ramp_s, **closed}
    if arrival_rate_per_s:
        opened = simulate(served, OpenLoop(arrival_rate_per_s, count, lengths,
                                           seed=seed)).summary()
        runs["open_loop"] = {"rate_per_s": arrival_rate_per_s, **opened}
    for run in runs.values():
        run["kv"].pop("samples")
    return runs
