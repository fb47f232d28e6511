"""What one admission decision costs with a long queue.

One command: `python bench/admission_decision.py [--smoke] [--out FILE]`

Sets up the admission core for Qwen3-8B on an H100 (capacity from the model), fills
the KV cache with running requests and the queue with 10,000 waiting requests (three
priority bands, 50 tenants), then times, with `time.perf_counter_ns`, the decision
for each of many new arrivals (cost, never-fits check, headroom, predicted wait and
TTFT, queue-full and deadline checks) and, separately, entering the queue and
choosing the next request to dispatch. Garbage collection stays on, as in service.

Then churn with prefix caching: the cache filled with running requests whose prompts
share a system prompt (block keys as kvgate hashes them), and for each sample the
oldest one finishes and a new arrival is decided and admitted (each running request
streamed part of its output): what the admission
core does per request at a steady state near capacity (room over the steps ahead,
shared prompt blocks), in two shapes: few long prompts, many short ones.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sidecar.admission import (  # noqa: E402
    AdmissionController,
    AdmissionRequest,
    AdmissionSettings,
    CostModel,
    QueueLimits,
    ServerState,
    Ticket,
)
from sidecar.admission.queue import Entry  # noqa: E402
from sidecar.model import Deployment, ServedModel, find_gpu, read_architecture  # noqa: E402

from bench.common import percentile, provenance, rounded, write_json  # noqa: E402

QUEUED = 10_000
TENANTS = 50


def stats(values_ns: list[int]) -> dict[str, float | None]:
    values_us = [v / 1000.0 for v in values_ns]
    return {"p50_us": rounded(percentile(values_us, 50)),
            "p99_us": rounded(percentile(values_us, 99)),
            "max_us": max(values_us), "mean_us": rounded(statistics.fmean(values_us)),
            "samples": len(values_us)}


def admission_core(queue_length: int) -> AdmissionController:
    """The admission core for Qwen3-8B on an H100, the server up."""
    served = ServedModel(read_architecture("Qwen/Qwen3-8B"),
                         Deployment(max_model_len=32_768), find_gpu("H100"))
    controller = AdmissionController(
        CostModel(served),
        AdmissionSettings(limits=QueueLimits(max_length=queue_length, max_wait_s=3600)),
    )
    controller.update_server(ServerState(available=True))
    return controller


def admit_if_it_fits(controller: AdmissionController, req: AdmissionRequest) -> Ticket | None:
    """Decide `req` as admit() does on arrival and start it when it fits now."""
    plan = controller._plan(req)
    cost, decision = controller._decide_at_arrival(req, controller.clock(), plan)
    if decision is not None or cost is None:
        return None
    return controller._start(req, cost, controller.clock(), queue_wait_s=0.0,
                             predicted_ttft_s=cost.prefill_s, plan=plan)


def run(samples: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    controller = admission_core(QUEUED * 2)

    def request() -> AdmissionRequest:
        return AdmissionRequest(
            prompt_tokens=rng.randint(50, 8000), max_tokens=rng.randint(16, 2048),
            band=rng.randint(0, 2), tenant=f"tenant-{rng.randrange(TENANTS)}",
            ttft_slo_s=rng.choice((None, 2.0, 10.0)))

    # Fill the cache with running requests, then the queue with waiting ones.
    running = 0
    while admit_if_it_fits(controller, request()) is not None:
        running += 1
    # The waiting requests enter the queue as admit() would queue them (nothing frees
    # KV during the measurement, so none is dispatched).
    while len(controller.queue) < QUEUED:
        req = request()
        cost = controller._cost(req, controller._plan(req))
        controller.queue.push(Entry(
            arrival_s=controller.clock(), band=req.band, tenant=req.tenant,
            blocks=cost.kv_blocks, cost=cost.gpu_seconds(controller.ledger.capacity_blocks),
        ))

    decide, enqueue, choose = [], [], []
    clock = time.perf_counter_ns
    for _ in range(samples):
        req = request()
        started = clock()
        # What it shares is looked up once per arrival (admit), then decided.
        cost, _decision = controller._decide_at_arrival(req, controller.clock(),
                                                        controller._plan(req))
        decide.append(clock() - started)
        assert cost is not None
        entry = Entry(arrival_s=controller.clock(), band=req.band, tenant=req.tenant,
                      blocks=cost.kv_blocks, cost=1.0)
        started = clock()
        controller.queue.push(entry)
        enqueue.append(clock() - started)
        started = clock()
        controller.queue.peek(controller.clock())
        choose.append(clock() - started)
        controller.queue.remove(entry)
    return {
        "model": "Qwen/Qwen3-8B on H100-SXM, max_model_len 32768",
        "running_requests": running,
        "queued_requests": QUEUED,
        "tenants": TENANTS,
        "decision": stats(decide),
        "enqueue": stats(enqueue),
        "choose_next": stats(choose),
        "decision_plus_enqueue_p99_us": rounded(percentile(
            [(a + b) / 1000.0 for a, b in zip(decide, enqueue, strict=True)], 99)),
    }


CHURN_SHAPES = (  # (name, shared system prompt tokens, own prompt tokens)
    ("long prompts", 2_000, 6_000),
    ("short prompts", 200, 500),
)
CHURN_OUTPUT_TOKENS = (64, 1_024)


def streaming(ticket: Ticket, rng: random.Random) -> None:
    """A running request part-way through its output, as kvgate sees it streamed."""
    if ticket.first_token_s is None:
        ticket.first_token()
        ticket.progress(rng.randint(1, max(1, ticket.cost.output_tokens - 1)))


def shared_prefix_request(controller: AdmissionController, rng: random.Random,
                          system: list[int], own_tokens: int) -> AdmissionRequest:
    """The system prompt and `own_tokens` tokens of its own, hashed as kvgate hashes
    prompts, with an output length drawn from CHURN_OUTPUT_TOKENS."""
    ids = system + [rng.randrange(150_000) for _ in range(own_tokens)]
    return AdmissionRequest(prompt_tokens=len(ids),
                            max_tokens=rng.randint(*CHURN_OUTPUT_TOKENS),
                            block_keys=controller.prompt_keys(ids))


def churn(samples: int, seed: int) -> list[dict[str, Any]]:
    """Finish the oldest running request and admit a new one, near capacity."""
    results = []
    for name, system_tokens, own_tokens in CHURN_SHAPES:
        rng = random.Random(seed)
        controller = admission_core(100)
        system = [rng.randrange(150_000) for _ in range(system_tokens)]
        running = []
        while (ticket := admit_if_it_fits(controller, shared_prefix_request(
                controller, rng, system, own_tokens))) is not None:
            running.append(ticket)
            streaming(ticket, rng)
        # Hashed outside the timing.
        arrivals = [shared_prefix_request(controller, rng, system, own_tokens)
                    for _ in range(samples)]
        cycle = []
        clock = time.perf_counter_ns
        for req in arrivals:
            started = clock()
            oldest = running.pop(0)
            oldest.finish(oldest.cost.output_tokens, completed=True)
            ticket = admit_if_it_fits(controller, req)
            cycle.append(clock() - started)
            if ticket is not None:
                running.append(ticket)
                streaming(ticket, rng)
        results.append({"shape": name, "running_requests": len(running),
                        "prompt_blocks_per_request": len(running[0].reservation.keys),
                        "finish_and_admit": stats(cycle)})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="fewer samples (CI)")
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    result = run(1000 if args.smoke else args.samples, args.seed)
    result["churn"] = churn(50 if args.smoke else 1_000, args.seed)
    result.update(provenance("bench/admission_decision.py"))
    if args.out:
        write_json(args.out, result)
    for name in ("decision", "enqueue", "choose_next"):
        s = result[name]
        print(f"{name:12s} p50 {s['p50_us']:7.1f} us   p99 {s['p99_us']:7.1f} us   "
              f"max {s['max_us']:8.1f} us   ({s['samples']} samples)")
    print(f"with {result['queued_requests']:,} queued and {result['running_requests']} running; "
          f"decision + enqueue p99 {result['decision_plus_enqueue_p99_us']:.1f} us")
    for shape in result["churn"]:
        s = shape["finish_and_admit"]
        print(f"churn, {shape['shape']} ({shape['running_requests']} running, "
              f"{shape['prompt_blocks_per_request']} prompt blocks each): finish + admit "
              f"p50 {s['p50_us']:.0f} us, p99 {s['p99_us']:.0f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
