"""Does kvgate's calibration find a real vLLM server from a wrong start, and are its p90
predictions calibrated? Each case beside a `--no-calibrate` control.

One command: `python bench/calibration.py [--priors generic,x10,/10] [--repeats 3]
[--changes threads,model] [--smoke] [--out bench/results/calibration.json]`; to keep
each run short, repetitions can run apart (`--repeats 1 --first-repeat 2`) and be
merged (`python bench/calibration.py --merge OUT FILE...`: cases and changes of all,
the summary over them).

It starts a real vLLM CPU server with a small random-weight model (`small-llama`), then
for each prior (the device figures kvgate is given) and repetition:

1. calibrated: a fresh `kvgate serve` with that prior, `WARMUP` requests (100) at
   concurrency 1-4, then `MEASURED` requests (30) at concurrency 1, 2 and 4;
2. control: a fresh `kvgate serve --no-calibrate` with the same prior, the same
   measured requests.

Every request is streamed with a unique prompt of 8-600 words and 8-96 output tokens:
a run's prompts start with a text of its own, so that neither the control (the same
lengths as its case) nor the other priors' runs of the same seed find them in the
server's prefix cache. For each, observed / predicted TTFT and TPOT: observed by the
client (send to first token; time per token after it), predicted in kvgate's response
headers (`x-kvgate-predicted-ttft-ms`, `x-kvgate-predicted-tpot-ms`: its p50). The p90
coverage is the share of measured requests whose observed value was at or below
kvgate's p90 prediction (its `kvgate_prediction_p90_covered_total` over
`kvgate_prediction_error_ratio_count`, read before and after the measured requests).

Priors: `generic` (no device figures: kvgate's generic device), `x10` and `/10` (this
CPU's rough figures, 20 GB/s and 0.5 TFLOP/s, times and over 10), `cpu` (those
figures).

Changes (`--changes`): a calibrated kvgate (generic prior) after its warm-up; vLLM is
restarted behind it with other settings (`threads`: 2 CPU threads instead of 1;
`model`: another model, `tiny-llama`, a smaller one); then `AFTER_CHANGE` requests
(50) at concurrency 1-4 and the measured set: the medians in windows of 10 requests
after the change, and over the measured set.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
for extra in (ROOT, ROOT / "tests"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from bench.common import provenance, write_json  # noqa: E402
from support.env import free_port, model_dir, vllm_python  # noqa: E402
from support.sidecar import Sidecar, metric_value  # noqa: E402
from support.vllm_server import VllmServer  # noqa: E402

MODEL = "small-llama"
OTHER_MODEL = "tiny-llama"
WARMUP = 100
MEASURED = 30
AFTER_CHANGE = 50
WINDOW = 10
BOUNDS = (0.85, 1.15)  # the median observed / predicted, TTFT and TPOT
COVERAGE = (0.85, 0.95)  # of the p90
CPU = (24.0, 20.0, 0.5)  # GiB, GB/s, TFLOP/s: this machine's rough figures
PRIORS: dict[str, tuple[str, ...]] = {
    "generic": (),
    **{name: ("--gpu-memory-gib", str(CPU[0]), "--gpu-bandwidth-gbps", f"{CPU[1] * f:g}",
              "--gpu-tflops", f"{CPU[2] * f:g}")
       for name, f in (("x10", 10.0), ("/10", 0.1), ("cpu", 1.0))},
}
WORDS = (
    "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
    "juliet", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo",
    "sierra", "tango", "uniform", "victor", "whiskey", "xray", "yankee", "zulu", "red",
    "green", "blue", "yellow", "orange", "purple", "cat", "dog", "bird", "fish", "tree",
)


@dataclass
class Sample:
    phase: str
    prompt_words: int
    max_tokens: int
    concurrency: int
    predicted_ttft_s: float
    observed_ttft_s: float
    predicted_tpot_s: float
    observed_tpot_s: float

    @property
    def ttft_ratio(self) -> float:
        return self.observed_ttft_s / max(self.predicted_ttft_s, 1e-6)

    @property
    def tpot_ratio(self) -> float:
        # The header has 10 us resolution: a prediction below it reads as 0.
        return self.observed_tpot_s / max(self.predicted_tpot_s, 1e-5)


def medians(samples: Sequence[Sample]) -> dict[str, float]:
    if not samples:
        return {"requests": 0}
    return {"requests": len(samples),
            "ttft_ratio_p50": statistics.median(s.ttft_ratio for s in samples),
            "tpot_ratio_p50": statistics.median(s.tpot_ratio for s in samples)}


def in_bounds(stats: dict[str, float]) -> bool:
    return stats.get("requests", 0) > 0 and all(
        BOUNDS[0] <= stats[f"{q}_ratio_p50"] <= BOUNDS[1] for q in ("ttft", "tpot"))


class Workload:
    """Requests of varied lengths with unique prompts: the same lengths for every run of a
    seed, the text also unique to the run (`salt`, a new one per Workload by default), so
    that no run finds another's prompts in the server's prefix cache."""

    def __init__(self, seed: int, salt: str | None = None) -> None:
        self.rng = random.Random(seed)
        self.salt = uuid.uuid4().hex[:12] if salt is None else salt
        self.serial = 0

    def next(self) -> tuple[str, int, int]:
        self.serial += 1
        words = self.rng.randint(8, 600)
        prompt = f"{self.salt} request {self.serial} {self.rng.random():.12f} " + " ".join(
            self.rng.choice(WORDS) for _ in range(words))
        return prompt, words, self.rng.randint(8, 96)


async def one_request(session: aiohttp.ClientSession, url: str, model: str,
                      workload: Workload, phase: str, concurrency: int) -> Sample | None:
    prompt, words, max_tokens = workload.next()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0}
    sent = time.monotonic()
    first = None
    tokens = 0
    async with session.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            await response.read()
            return None
        predicted_ttft = float(response.headers["x-kvgate-predicted-ttft-ms"]) / 1000
        predicted_tpot = float(response.headers["x-kvgate-predicted-tpot-ms"]) / 1000
        async for line in response.content:
            if line.startswith(b"data: {"):
                tokens += 1
                if first is None:
                    first = time.monotonic()
    end = time.monotonic()
    if first is None or tokens < 2:
        return None
    return Sample(phase, words, max_tokens, concurrency, predicted_ttft, first - sent,
                  predicted_tpot, (end - first) / (tokens - 1))


async def drive(url: str, model: str, samples: list[Sample], phase: str, count: int,
                concurrency: int, workload: Workload) -> None:
    """Closed loop: `concurrency` clients until `count` requests were sent."""
    remaining = [count]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def client() -> None:
            while remaining[0] > 0:
                remaining[0] -= 1
                sample = await one_request(session, url, model, workload, phase, concurrency)
                if sample is not None:
                    samples.append(sample)

        await asyncio.gather(*(client() for _ in range(concurrency)))


async def mixed(url: str, model: str, samples: list[Sample], phase: str, count: int,
                workload: Workload) -> None:
    """`count` requests at concurrency 1, 2, 4 and 3 in turn."""
    levels = (1, 2, 4, 3)
    for i, concurrency in enumerate(levels):
        share = count // len(levels) + (1 if i < count % len(levels) else 0)
        await drive(url, model, samples, phase, share, concurrency, workload)


async def measured(sidecar: Sidecar, model: str, samples: list[Sample], phase: str,
                   count: int, workload: Workload) -> dict[str, float]:
    """`count` requests at concurrency 1, 2 and 4: medians and kvgate's p90 coverage."""
    before = sidecar.metrics_text()
    for concurrency in (1, 2, 4):
        await drive(sidecar.url, model, samples, phase, count // 3, concurrency, workload)
    after = sidecar.metrics_text()
    stats = medians([s for s in samples if s.phase == phase])
    for quantity in ("ttft", "tpot"):
        label = f'quantity="{quantity}"'
        covered = (metric_value(after, "kvgate_prediction_p90_covered_total", label)
                   - metric_value(before, "kvgate_prediction_p90_covered_total", label))
        total = (metric_value(after, "kvgate_prediction_error_ratio_count", label)
                 - metric_value(before, "kvgate_prediction_error_ratio_count", label))
        stats[f"{quantity}_p90_coverage"] = covered / total if total else math.nan
        stats[f"{quantity}_p90_checked"] = total
    return stats


def calibration_of(sidecar: Sidecar) -> dict[str, Any] | None:
    status, body = sidecar.get("/kvgate/v1/calibration")
    return json.loads(body) if status == 200 else None


def start_vllm(port: int, model: str = MODEL, threads: str | None = None) -> VllmServer:
    env = {"VLLM_CPU_OMP_THREADS_BIND": threads} if threads else {}
    return VllmServer(vllm_python(), str(model_dir(model)), model, port, 2048,
                      block_size=128, kv_cache_space_gib=1, env=env).start()


async def case(server: VllmServer, prior: str, seed: int, warmup: int,
               count: int) -> dict[str, Any]:
    """One repetition of one prior: calibrated, then the control."""
    samples: list[Sample] = []
    result: dict[str, Any] = {"prior": prior, "seed": seed}
    sidecar = Sidecar(server.url, device=PRIORS[prior]).start()
    try:
        workload = Workload(seed)
        await mixed(sidecar.url, MODEL, samples, "warmup", warmup, workload)
        result["calibrated"] = await measured(sidecar, MODEL, samples, "calibrated", count,
                                              workload)
        result["calibration"] = calibration_of(sidecar)
    finally:
        sidecar.stop()
    control = Sidecar(server.url, "--no-calibrate", device=PRIORS[prior]).start()
    try:
        # The same measured requests as the calibrated run's.
        workload = Workload(seed)
        for _ in range(warmup):
            workload.next()
        result["control"] = await measured(control, MODEL, samples, "control", count, workload)
    finally:
        control.stop()
    result["samples"] = [vars(s) for s in samples]
    return result


async def change(server: VllmServer, kind: str, seed: int, warmup: int, count: int,
                 after_change: int) -> tuple[dict[str, Any], VllmServer]:
    """A calibrated kvgate (generic prior) whose server restarts with other settings."""
    samples: list[Sample] = []
    sidecar = Sidecar(server.url, device=PRIORS["generic"]).start()
    try:
        workload = Workload(seed)
        await mixed(sidecar.url, MODEL, samples, "warmup", warmup, workload)
        before = await measured(sidecar, MODEL, samples, "before", count, workload)
        port = server.port
        server.stop()
        model = MODEL
        if kind == "threads":
            server = start_vllm(port, MODEL, "0-1")
        else:
            model = OTHER_MODEL
            server = start_vllm(port, OTHER_MODEL)
        sidecar.wait_ready(120)
        for window in range(after_change // WINDOW):
            await mixed(sidecar.url, model, samples, f"change-{window}", WINDOW, workload)
        after = await measured(sidecar, model, samples, "after", count, workload)
        calibration = calibration_of(sidecar)
    finally:
        sidecar.stop()
    windows = [medians([s for s in samples if s.phase == f"change-{w}"])
               for w in range(after_change // WINDOW)]
    back = next(((i + 1) * WINDOW for i, w in enumerate(windows) if in_bounds(w)), None)
    return {"change": kind, "seed": seed, "before": before, "windows": windows,
            "back_in_bounds_after_requests": back, "after": after,
            "calibration": calibration, "samples": [vars(s) for s in samples]}, server


async def benchmark(priors: Sequence[str], repeats: int, changes: Sequence[str],
                    smoke: bool, first_repeat: int = 1) -> dict[str, Any]:
    warmup, count, after_change = (40, 15, 20) if smoke else (WARMUP, MEASURED, AFTER_CHANGE)
    server = start_vllm(free_port())
    cases: list[dict[str, Any]] = []
    changed: list[dict[str, Any]] = []
    try:
        for repeat in range(first_repeat - 1, first_repeat - 1 + repeats):
            for prior in priors:
                cases.append(await case(server, prior, 100 * repeat + 7, warmup, count))
                print(_case_line(cases[-1]), flush=True)
        for i, kind in enumerate(changes):
            result, server = await change(server, kind, 1000 * first_repeat + i, warmup, count,
                                          after_change)
            changed.append(result)
            print(_change_line(result), flush=True)
            if kind == "model":  # back to the benchmark's model for what follows
                port = server.port
                server.stop()
                server = start_vllm(port)
    finally:
        server.stop()
    return {
        "model": MODEL,
        "bounds": BOUNDS,
        "coverage_bounds": COVERAGE,
        "requests": {"warmup": warmup, "measured": count, "after_change": after_change,
                     "window": WINDOW},
        "cases": cases,
        "changes": changed,
        "summary": summary(cases, changed),
    }


def summary(cases: list[dict[str, Any]], changed: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for run in ("calibrated", "control"):
        pooled: dict[str, float] = {}
        for quantity in ("ttft", "tpot"):
            covered = sum(c[run][f"{quantity}_p90_coverage"] * c[run][f"{quantity}_p90_checked"]
                          for c in cases if c[run][f"{quantity}_p90_checked"])
            total = sum(c[run][f"{quantity}_p90_checked"] for c in cases)
            pooled[f"{quantity}_p90_coverage"] = covered / total if total else math.nan
        out[run] = {
            "in_bounds": sum(in_bounds(c[run]) for c in cases),
            "runs": len(cases),
            **pooled,
        }
    out["changes_back_within"] = {c["change"]: c["back_in_bounds_after_requests"]
                                  for c in changed}
    out["changes_after_in_bounds"] = {c["change"]: in_bounds(c["after"]) for c in changed}
    return out


def _case_line(c: dict[str, Any]) -> str:
    def part(stats: dict[str, float]) -> str:
        return (f"TTFT {stats['ttft_ratio_p50']:.2f} TPOT {stats['tpot_ratio_p50']:.2f} "
                f"(p90 coverage {stats['ttft_p90_coverage']:.0%} / "
                f"{stats['tpot_p90_coverage']:.0%})")
    return (f"prior {c['prior']:>7} seed {c['seed']:>3}: calibrated {part(c['calibrated'])}"
            f"   control {part(c['control'])}")


def _change_line(c: dict[str, Any]) -> str:
    windows = " ".join(f"{w['ttft_ratio_p50']:.2f}/{w['tpot_ratio_p50']:.2f}"
                       for w in c["windows"] if w.get("requests"))
    after = c["after"]
    return (f"change {c['change']}: windows of {WINDOW} (TTFT/TPOT median obs/pred) {windows}; "
            f"back in bounds after {c['back_in_bounds_after_requests']} requests; then "
            f"{after['ttft_ratio_p50']:.2f}/{after['tpot_ratio_p50']:.2f}")


def merge(out: Path, files: Sequence[Path]) -> dict[str, Any]:
    """One result of several runs: their cases and changes, the summary over them, and
    each run's record (command, date, machine, revision)."""
    runs = [json.loads(f.read_text()) for f in files]
    cases = [c for r in runs for c in r["cases"]]
    changed = [c for r in runs for c in r["changes"]]
    merged = {key: runs[0][key] for key in ("model", "bounds", "coverage_bounds", "requests")}
    merged.update(cases=cases, changes=changed, summary=summary(cases, changed),
                  runs=[{k: r[k] for k in ("command", "date", "machine", "kvgate_revision",
                                           "seconds")} for r in runs])
    write_json(out, merged)
    return merged


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--merge"]:
        if len(argv) < 3:
            raise SystemExit("usage: bench/calibration.py --merge OUT FILE...")
        print(json.dumps(merge(Path(argv[1]), [Path(a) for a in argv[2:]])["summary"],
                         indent=2))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--priors", default="generic,x10,/10",
                        help=f"comma-separated, of {', '.join(PRIORS)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--changes", default="",
                        help="comma-separated, of threads, model (default none)")
    parser.add_argument("--first-repeat", type=int, default=1,
                        help="number of the first repetition (its seeds)")
    parser.add_argument("--smoke", action="store_true", help="fewer requests")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    priors = [p for p in args.priors.split(",") if p]
    changes = [c for c in args.changes.split(",") if c]
    unknown = [p for p in priors if p not in PRIORS] + [
        c for c in changes if c not in ("threads", "model")]
    if unknown:
        parser.error(f"unknown prior or change: {', '.join(unknown)}")
    started = time.time()
    record = provenance("bench/calibration.py")
    result = asyncio.run(benchmark(priors, args.repeats, changes, args.smoke,
                                   args.first_repeat))
    result.update(record)
    result["seconds"] = round(time.time() - started, 1)
    if args.out:
        write_json(args.out, result)
    print(json.dumps(result["summary"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
