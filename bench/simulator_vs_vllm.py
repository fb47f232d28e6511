#!/usr/bin/env python3
"""The engine simulator against a real vLLM CPU server, on the same workloads.

    flock /tmp/kvgate-heavy.lock python bench/simulator_vs_vllm.py \\
        [--smoke] [--out bench/results/simulator_vs_vllm.json]
    python bench/simulator_vs_vllm.py --replay RESULT [--fit-terms per_step_s,...]

1. Calibration, on a separate warm-up: a real vLLM CPU server (`small-llama`, the
   CPU's rough figures as a custom device) is sent mixed-length streamed requests in
   closed loops of 1, 2, 4 and 8 clients (after a pass over the same loops that is not
   kept: a cold server's first batches of each shape run slower); the engine's
   costs (per step, per sequence in a step, per request, the prefill's share of peak
   FLOP/s) and two terms of the device (the KV cache's share of the bandwidth the
   weights reach, and the share of a step's compute and memory time that does not
   overlap: a CPU is not the GPUs the shipped values were fitted on) are fitted so
   that the simulator, replaying those requests, gives their median TTFT and TPOT
   (`fit_efficiency`: physics terms, six numbers for the server, none per workload).
2. Measurement, straight to vLLM: closed loops at c = 1, 2, 4, 8, 16, 32 with fixed and
   with mixed lengths, open-loop bursts (all requests at once; fixed and mixed) and a
   Poisson open loop at 0.6 of the rate the warm-up's 8 clients completed (the same
   load on a fast and a slow machine). Every prompt starts with a unique head (no
   prefix-cache hits); the client records each request's send time, first token, last
   token and prompt tokens (usage).
3. Prediction of the same requests: the simulator replays them (each closed-loop
   client's own requests in its order; the open loops' measured send times) on the
   server's settings (max_num_seqs, token budget, KV blocks); the old closed form
   (`steady_latency`: one prefill beside c - 1 decodes) is priced with the same
   efficiencies.

Reported per workload: TTFT and TPOT p50/p90 measured, simulated, closed form, and
the errors; vLLM's preemptions (`vllm:num_preemptions_total`) beside the simulator's;
`other_load`, the share of the machine's CPUs other processes took meanwhile (the
server's and the benchmark's own excluded).
The first workload runs again at the end as a control: `machine_drift` is its measured
p50 at the end over the start (the 2 cores are shared; a run whose drift is far from 1
measured a machine that changed under it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
for _extra in (ROOT, ROOT / "tests"):
    if str(_extra) not in sys.path:
        sys.path.insert(0, str(_extra))

from sidecar.cli.plan import build_parser  # noqa: E402
from sidecar.cli.served_args import served_model_from_args  # noqa: E402
from sidecar.model import ServedModel  # noqa: E402
from sidecar.model.latency import Efficiency  # noqa: E402
from sidecar.model.planning import steady_latency  # noqa: E402
from sidecar.model.simulator import EngineConfig, SimRequest, Trace, simulate  # noqa: E402
from sidecar.model.simulator_results import percentile  # noqa: E402

from bench.common import OtherLoad, provenance, write_json  # noqa: E402

# The CPU's rough figures as a custom device (as tests/support/sidecar.py gives kvgate).
CPU_DEVICE = ("--gpu-memory-gib", "24", "--gpu-bandwidth-gbps", "20", "--gpu-tflops", "0.5")
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
         "juliet", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo")


@dataclass(frozen=True)
class ServerShape:
    """The vLLM settings the simulator must share with the real server."""

    model_dir: str
    served_name: str
    max_model_len: int
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int

    def served(self, efficiency: Efficiency | None) -> ServedModel:
        args = build_parser().parse_args([
            "--model", self.model_dir, *CPU_DEVICE,
            "--max-model-len", str(self.max_model_len), "--block-size", str(self.block_size),
            "--num-gpu-blocks-override", str(self.num_blocks),
            "--max-num-seqs", str(self.max_num_seqs),
            "--max-num-batched-tokens", str(self.max_num_batched_tokens),
            # vLLM's CPU build schedules without asynchronous scheduling
            # (vllm/platforms/cpu.py), and its API server runs on the cores the steps
            # run on: the simulator follows the server it is held against.
            "--cpu-build"])
        served = served_model_from_args(args)
        return served if efficiency is None else served.with_efficiency(efficiency)


@dataclass
class Observed:
    client: int
    sent_s: float
    prompt_tokens: int
    output_tokens: int
    first_s: float | None = None
    last_s: float | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_s is None else self.first_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        if self.first_s is None or self.last_s is None or self.output_tokens < 2:
            return None
        return (self.last_s - self.first_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Shape:
    """A request to send: prompt words (about one token each) and output tokens."""

    words: int
    output_tokens: int


def shapes(count: int, mixed: bool, rng: random.Random, fixed: Shape) -> list[Shape]:
    if not mixed:
        return [fixed] * count
    return [Shape(rng.randint(fixed.words // 4, fixed.words * 2),
                  rng.randint(max(2, fixed.output_tokens // 4), fixed.output_tokens * 2))
            for _ in range(count)]


async def send(session: aiohttp.ClientSession, url: str, model: str, shape: Shape,
               client: int, origin: float, serial: int) -> Observed:
    prompt = f"{serial} {random.random():.9f} " + " ".join(
        WORDS[(serial + i) % len(WORDS)] for i in range(shape.words))
    body = {"model": model, "prompt": prompt, "max_tokens": shape.output_tokens,
            "stream": True, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    seen = Observed(client, time.monotonic() - origin, 0, 0)
    async with session.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"vLLM answered {response.status}: {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                now = time.monotonic() - origin
                seen.first_s = now if seen.first_s is None else seen.first_s
                seen.last_s = now
            usage = chunk.get("usage")
            if usage:
                seen.prompt_tokens = usage["prompt_tokens"]
                seen.output_tokens = usage["completion_tokens"]
    return seen


async def closed_loop(url: str, model: str, work: Sequence[Shape], clients: int,
                      serial0: int) -> list[Observed]:
    """`clients` clients, each sending its next request when the previous one ended;
    client k sends work[k], work[k + clients], ..."""
    origin = time.monotonic()
    out: list[Observed] = []
    timeout = aiohttp.ClientTimeout(total=900)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        async def client(k: int) -> None:
            for index in range(k, len(work), clients):
                out.append(await send(session, url, model, work[index], k, origin,
                                      serial0 + index))

        await asyncio.gather(*(client(k) for k in range(clients)))
    return out


async def open_loop(url: str, model: str, work: Sequence[Shape], gaps_s: Sequence[float],
                    serial0: int) -> list[Observed]:
    """Requests sent at fixed offsets (cumulative `gaps_s`), whatever is running."""
    origin = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=900)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        async def one(index: int, at: float) -> Observed:
            await asyncio.sleep(max(0.0, at - (time.monotonic() - origin)))
            return await send(session, url, model, work[index], index, origin, serial0 + index)

        offsets, at = [], 0.0
        for gap in gaps_s:
            at += gap
            offsets.append(at)
        return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(offsets))))


class ClientReplay:
    """A closed loop that replays measured requests: each client sends its own
    requests, in its order, its first when it measured sending it, each next one when
    its previous one finished plus the gap measured between the two (the client's own
    turnaround). Clients that start "together" are a millisecond apart, and an idle
    engine starts a step on the first request it receives: started all at 0, the
    simulated clients would share every step and stay in step, where the measured ones
    fall apart on the first one."""

    def __init__(self, observed: Sequence[Observed]) -> None:
        queues: dict[int, list[tuple[float, SimRequest]]] = {}
        last: dict[int, float] = {}
        for seen in sorted(observed, key=lambda s: s.sent_s):
            offset = (seen.sent_s if seen.client not in last
                      else max(0.0, seen.sent_s - last[seen.client]))
            last[seen.client] = seen.last_s if seen.last_s is not None else seen.sent_s
            queues.setdefault(seen.client, []).append(
                (offset, SimRequest(0.0, seen.prompt_tokens, seen.output_tokens)))
        self.queues = {k: list(reversed(v)) for k, v in queues.items()}
        self.owner: dict[int, int] = {}

    def _next(self, client: int, at: float) -> SimRequest | None:
        queue = self.queues[client]
        if not queue:
            return None
        offset, spec = queue.pop()
        spec = SimRequest(at + offset, spec.prompt_tokens, spec.output_tokens)
        self.owner[id(spec)] = client
        return spec

    def initial(self) -> list[SimRequest]:
        return [spec for k in sorted(self.queues) if (spec := self._next(k, 0.0)) is not None]

    def after(self, finished: SimRequest, finish_s: float) -> SimRequest | None:
        return self._next(self.owner[id(finished)], finish_s)


def stats(values: Sequence[float]) -> dict[str, float | None]:
    return {"p50": percentile(values, 50), "p90": percentile(values, 90)}


def compare(name: str, observed: Sequence[Observed], served: ServedModel, clients: int | None,
            preemptions: float) -> dict[str, Any]:
    """Measured vs simulated vs closed form for one workload."""
    done = [s for s in observed if s.ttft_s is not None and s.tpot_s is not None]
    measured = {"ttft_s": stats([s.ttft_s for s in done if s.ttft_s is not None]),
                "tpot_s": stats([s.tpot_s for s in done if s.tpot_s is not None])}
    if clients is not None:
        workload: Any = ClientReplay(done)
    else:
        workload = Trace([SimRequest(s.sent_s, s.prompt_tokens, s.output_tokens)
                          for s in sorted(done, key=lambda s: s.sent_s)])
    started = time.perf_counter()
    run = simulate(served, workload, EngineConfig.of(served))
    sim_seconds = time.perf_counter() - started
    summary = run.summary()
    simulated = {key: {"p50": summary[key]["p50"], "p90": summary[key]["p90"]}
                 for key in ("ttft_s", "tpot_s")}
    # The closed form at the workload's concurrency: the clients, or (open loop) the
    # mean number in flight by Little's law at the measured rate and E2E.
    prompt = round(statistics.fmean(s.prompt_tokens for s in done))
    output = round(statistics.fmean(s.output_tokens for s in done))
    if clients is None:
        span = max(s.last_s or 0.0 for s in done) - min(s.sent_s for s in done)
        e2e = statistics.fmean((s.last_s or 0.0) - s.sent_s for s in done)
        level = max(1, round(len(done) / span * e2e))
    else:
        level = clients
    estimate = steady_latency(served, prompt, output, level)
    assert estimate is not None
    closed_form = {"ttft_s": {"p50": estimate.ttft_s, "p90": estimate.ttft_s},
                   "tpot_s": {"p50": estimate.tpot_s, "p90": estimate.tpot_s}}

    def errors(predicted: dict[str, dict[str, float | None]]) -> dict[str, float]:
        out = {}
        for key in ("ttft_s", "tpot_s"):
            for q in ("p50", "p90"):
                value, truth = predicted[key][q], measured[key][q]
                assert value is not None and truth is not None
                out[f"{key[:4]}_{q}"] = value / truth - 1
        return out

    return {"workload": name, "clients": clients, "requests": len(done),
            "concurrency_for_closed_form": level, "measured": measured,
            "simulated": simulated, "closed_form": closed_form,
            "simulator_error": errors(simulated), "closed_form_error": errors(closed_form),
            "preemptions": {"vllm": preemptions, "simulated": summary["preemptions"]},
            "simulator_seconds": round(sim_seconds, 3),
            "observed": as_rows(done)}


def as_rows(observed: Sequence[Observed]) -> list[list[float]]:
    """Each request as measured: client, sent, prompt and output tokens, first and last
    token (seconds from the workload's start)."""
    return [[s.client, round(s.sent_s, 6), s.prompt_tokens, s.output_tokens,
             round(s.first_s or 0.0, 6), round(s.last_s or 0.0, 6)] for s in observed]


def preemptions_total(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:num_preemptions_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def measure_all(url: str, shape: ServerShape, efficiency: Efficiency | None,
                      levels: Sequence[int], per_level: int, fixed: Shape, seed: int,
                      mixed_too: bool = True, burst: int = 0, rate: float = 0.0,
                      rate_requests: int = 0, control: bool = False,
                      server_pid: int | None = None) -> list[dict[str, Any]]:
    """Every workload against the server at `url`, each compared with its prediction."""
    rng = random.Random(seed)
    served = shape.served(efficiency)
    results = []
    serial = [seed * 1_000_000]
    load = OtherLoad([server_pid] if server_pid is not None else [])

    async def run_closed(name: str, clients: int, work: list[Shape]) -> None:
        before = preemptions_total(url)
        load.start()
        observed = await closed_loop(url, shape.served_name, work, clients, serial[0])
        other = round(load.share(), 3)
        serial[0] += len(work)
        results.append(compare(name, observed, served, clients,
                               preemptions_total(url) - before) | {"other_load": other})

    for mixed in (False, True) if mixed_too else (False,):
        for clients in levels:
            count = max(per_level, 3 * clients)
            label = "mixed" if mixed else "fixed"
            await run_closed(f"closed c={clients} {label}", clients,
                             shapes(count, mixed, rng, fixed))
    for name, count, gaps, mixed in (
            ("open burst fixed", burst if mixed_too else 0, [0.0] * burst, False),
            ("open burst mixed", burst, [0.0] * burst, True),
            (f"open poisson {rate:g}/s mixed", rate_requests,
             [rng.expovariate(rate) if rate else 0.0 for _ in range(rate_requests)], True)):
        if not count:
            continue
        before = preemptions_total(url)
        work = shapes(count, mixed, rng, fixed)
        load.start()
        observed = await open_loop(url, shape.served_name, work, gaps, serial[0])
        other = round(load.share(), 3)
        serial[0] += count
        results.append(compare(name, observed, served, None, preemptions_total(url) - before)
                       | {"other_load": other})
    if control:
        # The first workload again: did the machine's speed change during the run?
        await run_closed(f"closed c={levels[0]} fixed (control, at the end)", levels[0],
                         shapes(max(per_level, 3 * levels[0]), False, rng, fixed))
    return results


# The terms the warm-up fits: (name, lower, upper). The rest keep the prior.
# `kv_bandwidth_ratio` and `serial_fraction` are the device's: the shipped ones were
# fitted on GPUs (paged-attention kernels, compute overlapping memory), not this CPU.
# `compute` is the share of the device's declared peak FLOP/s (CPU_DEVICE: rough figures
# for a CPU); above 1 where this machine's CPU outruns them.
FITTED = (("per_step_s", 1e-4, 0.05), ("per_sequence_s", 0.0, 0.01),
          ("per_request_s", 0.0, 0.2), ("compute", 0.005, 8.0),
          ("kv_bandwidth_ratio", 0.05, 4.0), ("serial_fraction", 0.0, 1.0))


def _log_error(predicted: float | None, measured: float | None) -> float:
    if not predicted or not measured:
        return 10.0
    return abs(math.log(predicted / measured))


def fit_efficiency(shape: ServerShape, warmups: Sequence[tuple[int, Sequence[Observed]]],
                   rounds: int = 5, terms: Sequence[tuple[str, float, float]] = FITTED
                   ) -> Efficiency:
    """The engine's costs that make the simulator reproduce the warm-up: a coordinate
    search minimising the sum over the warm-up loops of |log(simulated / measured)| of
    the median TTFT and TPOT. Deterministic."""
    base = shape.served(None)
    values = {name: float(getattr(base.efficiency, name)) for name, _, _ in terms}
    if "per_step_s" in values:
        values["per_step_s"] = max(values["per_step_s"], 1e-3)
    measured = [(clients, observed,
                 percentile([s.ttft_s for s in observed if s.ttft_s is not None], 50),
                 percentile([s.tpot_s for s in observed if s.tpot_s is not None], 50))
                for clients, observed in warmups]

    def score(trial: dict[str, float]) -> float:
        served = base.with_efficiency(replace(base.efficiency, **trial))
        total = 0.0
        for _clients, observed, ttft, tpot in measured:
            summary = simulate(served, ClientReplay(observed), EngineConfig.of(served)).summary()
            total += _log_error(summary["ttft_s"]["p50"], ttft)
            total += _log_error(summary["tpot_s"]["p50"], tpot)
        return total

    best = score(values)
    step = 1.0
    for _ in range(rounds):
        improved = True
        while improved:
            improved = False
            for name, low, high in terms:
                for factor in (1 + step, 1 / (1 + step)):
                    current = values[name]
                    moved = current * factor if current > 0 else high * step / 20
                    trial = {**values, name: min(high, max(low, moved))}
                    if trial[name] == current:
                        continue
                    trial_score = score(trial)
                    if trial_score < best - 1e-9:
                        values, best, improved = trial, trial_score, True
                        break
        step /= 2
    return replace(base.efficiency, **values)


# The Poisson open loop's rate, as a share of what the server completed in the warm-up's
# largest closed loop: the same load on a fast and a slow machine (a fixed rate was 0.8
# of one 2-core machine's capacity and 1.3x another's, where the queue grows without
# bound and TTFT depends on the run's length more than on any model).
POISSON_LOAD = 0.6


def warmup_rate(observed: Sequence[Observed]) -> float:
    """Requests completed per second over a closed loop."""
    done = [s for s in observed if s.last_s is not None]
    span = max(s.last_s or 0.0 for s in done) - min(s.sent_s for s in done)
    return len(done) / span if span > 0 else 0.0


async def warm_up(url: str, model: str, requests: int, fixed: Shape,
                  seed: int) -> list[tuple[int, list[Observed]]]:
    """Mixed-length closed loops of 1, 2, 4 and 8 clients: the calibration's data,
    after a pass over the same loops that is not kept (a server's first requests of
    each batch shape run slower: measured, a warm-up without that pass fitted a server
    ~1.5x slower than the one measured after it)."""
    rng = random.Random(seed + 1)
    for clients in (1, 2, 4, 8):
        await closed_loop(url, model, shapes(max(2 * clients, requests // 8), True, rng, fixed),
                          clients, 8_000_000 + clients * 10_000)
    out = []
    for clients in (1, 2, 4, 8):
        work = shapes(max(2 * clients, requests // 4), True, rng, fixed)
        out.append((clients, await closed_loop(url, model, work, clients,
                                               9_000_000 + clients * 10_000)))
    return out


def observed_rows(rows: Sequence[Sequence[float]]) -> list[Observed]:
    """`as_rows` read back."""
    return [Observed(int(r[0]), r[1], int(r[2]), int(r[3]), r[4] or None, r[5] or None)
            for r in rows]


def replay(path: Path, names: Sequence[str]) -> int:
    """Fit again on a result's stored warm-up, with only the terms `names`, and compare
    its workloads again: which terms the fit needs, without a server. The terms not
    fitted keep this checkout's prior; times were stored to 10 us (1 us since the
    replay came), so a replay of a run's own fit is within a few points of it, not
    equal."""
    from support.env import model_dir

    known = [name for name, _, _ in FITTED]
    unknown = sorted(set(names) - set(known))
    if unknown or not names:
        raise SystemExit(f"--fit-terms: {', '.join(unknown) or 'none given'}: give some of "
                         f"{', '.join(known)}")
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--replay {path}: {exc}") from exc
    if "warmup" not in record:
        raise SystemExit(f"--replay {path}: no stored warm-up (results before it was kept)")
    server = dict(record["server"])
    shape = ServerShape(**{**server, "model_dir": str(model_dir(server["served_name"]))})
    warmups = [(w["clients"], observed_rows(w["observed"])) for w in record["warmup"]]
    fitted = fit_efficiency(shape, warmups, terms=[t for t in FITTED if t[0] in names])
    served = shape.served(fitted)
    results = [compare(w["workload"], observed_rows(w["observed"]), served, w["clients"],
                       w["preemptions"]["vllm"]) for w in record["workloads"]]
    revision = record.get("kvgate_revision", {}).get("commit", "?")
    print(f"{path} (measured at {revision}), refitted here: " + ", ".join(
        f"{name} {getattr(fitted, name):.4g}" for name in known if name in names))
    print(table(results))
    print(json.dumps(within_targets(results)["simulator"]))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from support.env import free_port, model_dir, vllm_python
    from support.vllm_server import VllmServer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="fewer levels and requests")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--replay", type=Path, metavar="RESULT",
                        help="no server: fit again on RESULT's stored warm-up and compare "
                             "its workloads again")
    parser.add_argument("--fit-terms", default=",".join(name for name, _, _ in FITTED),
                        help="with --replay, the terms to fit, comma-separated (default: "
                             "all of them; the rest keep the prior)")
    args = parser.parse_args(argv)
    if args.replay:
        if args.smoke or args.out:
            parser.error("--replay runs no server: --smoke and --out do not apply")
        return replay(args.replay, [n.strip() for n in args.fit_terms.split(",") if n.strip()])
    if "--fit-terms" in (argv if argv is not None else sys.argv[1:]):
        parser.error("--fit-terms applies to --replay only (a run fits every term)")
    started = time.time()
    record = provenance("bench/simulator_vs_vllm.py" + (" --smoke" if args.smoke else ""))
    model = "small-llama"
    shape = ServerShape(str(model_dir(model)), model, 2048, 128, 64, 128, 2048)
    fixed = Shape(200, 48)
    levels = (1, 4, 16) if args.smoke else (1, 2, 4, 8, 16, 32)
    server = VllmServer(vllm_python(), shape.model_dir, model, free_port(),
                        shape.max_model_len, block_size=shape.block_size,
                        num_gpu_blocks_override=shape.num_blocks,
                        max_num_seqs=shape.max_num_seqs,
                        max_num_batched_tokens=shape.max_num_batched_tokens).start()
    try:
        warmups = asyncio.run(warm_up(server.url, model, 40 if args.smoke else 120, fixed,
                                      args.seed))
        fitted = fit_efficiency(shape, warmups)
        efficiency = fitted.as_dict()
        capacity = warmup_rate(max(warmups, key=lambda loop: loop[0])[1])  # 8 clients
        rate = round(POISSON_LOAD * capacity, 2)
        results = asyncio.run(measure_all(
            server.url, shape, fitted, levels,
            12 if args.smoke else 24, fixed, args.seed, mixed_too=not args.smoke,
            burst=16 if args.smoke else 32, rate=rate, rate_requests=24 if args.smoke else 48,
            control=True, server_pid=server.pid))
    finally:
        server.stop()
    control, results = results[-1], results[:-1]
    record["control"] = control
    record["machine_drift"] = {  # end / start of the same workload, measured
        key: control["measured"][key]["p50"] / results[0]["measured"][key]["p50"]
        for key in ("ttft_s", "tpot_s")}
    record["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    record.update({"model": model, "server": vars(shape), "fixed_lengths": vars(fixed),
                   "efficiency": efficiency,
                   # What the fit saw, to fit again without a server.
                   "warmup": [{"clients": clients, "observed": as_rows(observed)}
                              for clients, observed in warmups],
                   "poisson": {"rate_per_s": rate, "warmup_capacity_per_s": round(capacity, 3),
                               "load": POISSON_LOAD},
                   "workloads": results,
                   "within_targets": within_targets(results),
                   "seconds": round(time.time() - started, 1)})
    if args.out:
        write_json(args.out, record)
    print(table(results))
    drift = record["machine_drift"]
    print(f"machine drift (control at the end / start, measured p50): TTFT "
          f"{drift['ttft_s']:.2f}x, TPOT {drift['tpot_s']:.2f}x")
    return 0


def within_targets(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """How many workloads meet issue 15's bounds (p50 within 20%, p90 within 30%), for
    the simulator and for the closed form."""
    out: dict[str, Any] = {}
    for who in ("simulator", "closed_form"):
        errors = [r[f"{who}_error"] for r in results]
        out[who] = {
            "workloads": len(errors),
            "p50_within_20pct": sum(1 for e in errors if abs(e["ttft_p50"]) <= 0.2
                                    and abs(e["tpot_p50"]) <= 0.2),
            "p90_within_30pct": sum(1 for e in errors if abs(e["ttft_p90"]) <= 0.3
                                    and abs(e["tpot_p90"]) <= 0.3),
            "median_abs_error": {key: statistics.median(abs(e[key]) for e in errors)
                                 for key in ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90")},
        }
    return out


def table(results: Sequence[dict[str, Any]]) -> str:
    head = ("workload", "n", "TTFT p50 meas/sim/old ms", "p90 sim/old err",
            "TPOT p50 meas/sim/old ms", "p90 sim/old err", "preempt vllm/sim", "other load")
    rows = [head]
    for r in results:
        m, s, c = r["measured"], r["simulated"], r["closed_form"]
        se, ce = r["simulator_error"], r["closed_form_error"]
        rows.append((
            r["workload"], str(r["requests"]),
            f"{m['ttft_s']['p50']*1e3:.0f}/{s['ttft_s']['p50']*1e3:.0f}/"
            f"{c['ttft_s']['p50']*1e3:.0f} ({se['ttft_p50']:+.0%}/{ce['ttft_p50']:+.0%})",
            f"{se['ttft_p90']:+.0%}/{ce['ttft_p90']:+.0%}",
            f"{m['tpot_s']['p50']*1e3:.1f}/{s['tpot_s']['p50']*1e3:.1f}/"
            f"{c['tpot_s']['p50']*1e3:.1f} ({se['tpot_p50']:+.0%}/{ce['tpot_p50']:+.0%})",
            f"{se['tpot_p90']:+.0%}/{ce['tpot_p90']:+.0%}",
            f"{r['preemptions']['vllm']:.0f}/{r['preemptions']['simulated']}",
            "-" if r.get("other_load") is None else f"{r['other_load']:.0%}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))
                     for row in rows)


if __name__ == "__main__":
    raise SystemExit(main())
