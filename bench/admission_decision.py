"""What one admission decision costs with a long queue, and admission per request.

One command: `python bench/admission_decision.py [--smoke] [--out FILE]`

Sets up the admission core for Qwen3-8B on an H100 (capacity from the model), fills
the KV cache with running requests and the queue with waiting requests as admit()
queues them (1,000, the default --queue-max-length, then 10,000; three priority
bands, 50 tenants), then times, with `time.perf_counter_ns`, the decision for each of
many new arrivals (cost, never-fits check, headroom, predicted wait and TTFT,
queue-full and deadline checks): once with the queue changed since the last arrival
(one came and went: the requests ahead are walked through the room again), once for
another arrival of the same tenant and band with the queue unchanged (a full queue
refusing a burst: the last walk is reused); and, separately, entering the queue and
choosing the next request to dispatch. Garbage collection stays on, as in service.

Then churn with prefix caching: the cache filled with running requests whose prompts
share a system prompt (block keys as kvgate hashes them), and for each sample the
oldest one finishes and a new arrival is decided and admitted (each running request
streamed part of its output): what the admission
core does per request at a steady state near capacity (room over the steps ahead,
shared prompt blocks), in two shapes: few long prompts, many short ones.

Last, admit and finish one request at a time in an empty cache with prompts of 128,
2,000 and 8,000 tokens unlike any other: the work per request as its prompt blocks
(each held by reference, then released) grow.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from dataclasses import replace
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
    RequestCost,
    ServerState,
    Ticket,
)
from sidecar.admission.controller import _Waiter  # noqa: E402
from sidecar.admission.queue import Entry  # noqa: E402
from sidecar.model import Deployment, ServedModel, find_gpu, read_architecture  # noqa: E402

from bench.common import percentile, provenance, rounded, write_json  # noqa: E402

QUEUE_LENGTHS = (1_000, 10_000)  # the default --queue-max-length, and ten times it
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


def run(samples: int, seed: int, queued: int) -> dict[str, Any]:
    rng = random.Random(seed)
    controller = admission_core(queued)
    loop = asyncio.new_event_loop()

    def request() -> AdmissionRequest:
        return AdmissionRequest(
            prompt_tokens=rng.randint(50, 8000), max_tokens=rng.randint(16, 2048),
            band=rng.randint(0, 2), tenant=f"tenant-{rng.randrange(TENANTS)}",
            ttft_slo_s=rng.choice((None, 2.0, 10.0)))

    def waiting(req: AdmissionRequest, cost: RequestCost) -> Entry:
        """The queue's entry for `req` as admit() queues it (a waiter that will hold
        its peak once admitted)."""
        return Entry(arrival_s=controller.clock(), band=req.band, tenant=req.tenant,
                     blocks=cost.kv_blocks,
                     cost=cost.gpu_seconds(controller.ledger.capacity_blocks),
                     payload=_Waiter(loop.create_future(), req, cost,
                                     controller.room.queued(req, cost),
                                     controller._refused_at_s(req, cost, controller.clock())))

    # Fill the cache with running requests, then the queue with waiting ones (nothing
    # frees KV during the measurement, so none is dispatched; the queue is full).
    running = 0
    while admit_if_it_fits(controller, request()) is not None:
        running += 1
    while len(controller.queue) < queued:
        req = request()
        controller.queue.push(waiting(req, controller._cost(req, controller._plan(req))))

    def decide(req: AdmissionRequest) -> tuple[int, RequestCost]:
        started = clock()
        # What it shares is looked up once per arrival (admit), then decided.
        cost, _decision = controller._decide_at_arrival(req, controller.clock(),
                                                        controller._plan(req))
        elapsed = clock() - started
        assert cost is not None
        return elapsed, cost

    changed, unchanged, enqueue, choose = [], [], [], []
    clock = time.perf_counter_ns
    for _ in range(samples):
        req = request()
        # The queue changed since the last arrival (one came and went): walked again.
        elapsed, cost = decide(req)
        changed.append(elapsed)
        # Another arrival of the same tenant and band, the queue unchanged (a full queue
        # refuses a burst): the last walk of the queue is reused.
        unchanged.append(decide(replace(request(), band=req.band, tenant=req.tenant))[0])
        entry = waiting(req, cost)
        started = clock()
        controller.queue.push(entry)
        enqueue.append(clock() - started)
        started = clock()
        controller.queue.peek(controller.clock())
        choose.append(clock() - started)
        controller.queue.remove(entry)
    loop.close()
    return {
        "model": "Qwen/Qwen3-8B on H100-SXM, max_model_len 32768",
        "running_requests": running,
        "queued_requests": queued,
        "tenants": TENANTS,
        "decision": stats(changed),
        "decision_same_queue": stats(unchanged),
        "enqueue": stats(enqueue),
        "choose_next": stats(choose),
        "decision_plus_enqueue_p99_us": rounded(percentile(
            [(a + b) / 1000.0 for a, b in zip(changed, enqueue, strict=True)], 99)),
    }


PROMPT_LENGTHS = (128, 2_000, 8_000)


def by_prompt_length(samples: int, seed: int) -> list[dict[str, Any]]:
    """Admit and finish one request at a time in an empty cache (prefix caching on, a
    prompt unlike any other): the admission core's work per request as its prompt's
    blocks grow (each is held by reference, and released)."""
    results = []
    rng = random.Random(seed)
    for tokens in PROMPT_LENGTHS:
        controller = admission_core(100)
        requests = [AdmissionRequest(
            prompt_tokens=tokens, max_tokens=256,
            block_keys=controller.prompt_keys([rng.randrange(150_000)
                                               for _ in range(tokens)]))
            for _ in range(min(samples, 2_000))]
        cycle = []
        clock = time.perf_counter_ns
        for req in requests:
            started = clock()
            ticket = admit_if_it_fits(controller, req)
            assert ticket is not None
            ticket.finish(256, completed=True)
            cycle.append(clock() - started)
        results.append({"prompt_tokens": tokens, "prompt_blocks": len(requests[0].block_keys),
                        "admit_and_finish": stats(cycle)})
    return results


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
    samples = 1000 if args.smoke else args.samples
    queues = [run(samples if length <= 1_000 else max(1, samples // 10), args.seed, length)
              for length in QUEUE_LENGTHS]
    result: dict[str, Any] = {"queues": queues}
    result["churn"] = churn(50 if args.smoke else 1_000, args.seed)
    result["by_prompt_length"] = by_prompt_length(200 if args.smoke else 2_000, args.seed)
    result.update(provenance("bench/admission_decision.py"))
    if args.out:
        write_json(args.out, result)
    for queue in queues:
        print(f"with {queue['queued_requests']:,} queued and {queue['running_requests']} "
              f"running:")
        for name, what in (("decision", "decision, the queue changed since the last"),
                           ("decision_same_queue", "decision, the queue unchanged"),
                           ("enqueue", "enqueue"), ("choose_next", "choose the next")):
            s = queue[name]
            print(f"  {what:42s} p50 {s['p50_us']:8.1f} us   p99 {s['p99_us']:8.1f} us   "
                  f"({s['samples']} samples)")
    for shape in result["churn"]:
        s = shape["finish_and_admit"]
        print(f"churn, {shape['shape']} ({shape['running_requests']} running, "
              f"{shape['prompt_blocks_per_request']} prompt blocks each): finish + admit "
              f"p50 {s['p50_us']:.0f} us, p99 {s['p99_us']:.0f} us")
    for shape in result["by_prompt_length"]:
        s = shape["admit_and_finish"]
        print(f"admit + finish, a {shape['prompt_tokens']:,}-token prompt "
              f"({shape['prompt_blocks']} blocks): p50 {s['p50_us']:.0f} us, "
              f"p99 {s['p99_us']:.0f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
