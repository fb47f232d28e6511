"""How well kvgate predicts TTFT and TPOT against a real vLLM, before and after it
calibrates itself, and how fast it follows a server that changes.

One command: `python bench/calibration.py [--smoke] [--out bench/results/calibration.json]`

It starts a real vLLM CPU server with a small random-weight model and `kvgate serve`
in front of it (calibration on, CPU device figures), then sends streamed requests of
varied prompt and output lengths at varied concurrency, each with a unique prompt
(no prefix-cache hits). For every request it compares kvgate's prediction (response
headers `x-kvgate-predicted-ttft-ms`, `x-kvgate-predicted-tpot-ms`) with what the
client observed (send to first token; time per token after it):

1. before: the first requests, predicted by the uncalibrated analytical model;
2. after: requests following a warm-up of a few hundred;
3. change: vLLM is restarted with different settings (CPU threads), kvgate re-learns
   it without a restart; the absolute percentage error is tracked in windows until
   its median is back under the bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
for extra in (ROOT, ROOT / "tests"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from bench.common import provenance, write_json  # noqa: E402
from support.env import free_port, model_dir, vllm_python  # noqa: E402
from support.sidecar import Sidecar  # noqa: E402
from support.vllm_server import VllmServer  # noqa: E402

MODEL = "small-llama"
BOUND = 0.25
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
    def ttft_ape(self) -> float:
        return abs(self.predicted_ttft_s - self.observed_ttft_s) / self.observed_ttft_s

    @property
    def tpot_ape(self) -> float:
        return abs(self.predicted_tpot_s - self.observed_tpot_s) / self.observed_tpot_s


@dataclass
class Run:
    samples: list[Sample] = field(default_factory=list)

    def phase(self, name: str) -> list[Sample]:
        return [s for s in self.samples if s.phase == name]


def summarise(samples: list[Sample]) -> dict[str, float]:
    if not samples:
        return {}
    ttft = sorted(s.ttft_ape for s in samples)
    tpot = sorted(s.tpot_ape for s in samples)

    def p90(values: list[float]) -> float:
        return values[min(len(values) - 1, int(0.9 * len(values)))]

    return {
        "requests": len(samples),
        "ttft_ape_p50": statistics.median(ttft),
        "ttft_ape_p90": p90(ttft),
        "tpot_ape_p50": statistics.median(tpot),
        "tpot_ape_p90": p90(tpot),
    }


async def one_request(session: aiohttp.ClientSession, url: str, rng: random.Random,
                      phase: str, concurrency: int, serial: list[int]) -> Sample | None:
    serial[0] += 1
    words = rng.randint(8, 600)
    # A unique head defeats vLLM's prefix cache.
    prompt = f"request {serial[0]} {rng.random():.12f} " + " ".join(
        rng.choice(WORDS) for _ in range(words))
    max_tokens = rng.randint(8, 96)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
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


async def drive(url: str, run: Run, phase: str, count: int, concurrency: int,
                rng: random.Random, serial: list[int]) -> None:
    """Closed loop: `concurrency` clients until `count` requests completed."""
    remaining = [count]
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def client() -> None:
            while remaining[0] > 0:
                remaining[0] -= 1
                sample = await one_request(session, url, rng, phase, concurrency, serial)
                if sample is not None:
                    run.samples.append(sample)

        await asyncio.gather(*(client() for _ in range(concurrency)))


def start_vllm(port: int, threads: str | None) -> VllmServer:
    env = {"VLLM_CPU_OMP_THREADS_BIND": threads} if threads else {}
    return VllmServer(vllm_python(), str(model_dir(MODEL)), MODEL, port, 2048,
                      block_size=128, kv_cache_space_gib=1, env=env).start()


async def scenario(smoke: bool, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    serial = [0]
    run = Run()
    warmup = 80 if smoke else 300
    measure = 30 if smoke else 60
    window = 20
    max_after_change = 100 if smoke else 200
    port = free_port()
    server = start_vllm(port, None)
    sidecar = Sidecar(server.url).start()
    windows: list[dict[str, float]] = []
    recovered_after: int | None = None
    try:
        await drive(sidecar.url, run, "before", 20, 1, rng, serial)
        phases = [1, 2, 4, 8, 3]
        per_phase = max(1, (warmup - 20) // len(phases))
        for concurrency in phases:
            await drive(sidecar.url, run, "warmup", per_phase, concurrency, rng, serial)
        for concurrency in (1, 2, 4):
            await drive(sidecar.url, run, "after", measure // 3, concurrency, rng, serial)
        efficiency_before_change = sidecar.state()["efficiency"]
        # The server restarts with other settings (2 CPU threads instead of 1).
        server.stop()
        server = start_vllm(port, "0-1")
        sidecar.wait_ready(120)
        sent = 0
        while sent < max_after_change:
            phase = f"change-{sent // window}"
            await drive(sidecar.url, run, phase, window, 2, rng, serial)
            sent += window
            stats = summarise(run.phase(phase))
            windows.append(stats)
            if stats and max(stats["ttft_ape_p50"], stats["tpot_ape_p50"]) < BOUND:
                recovered_after = sent
                break
        efficiency_after_change = sidecar.state()["efficiency"]
        calibration = json.loads(sidecar.get("/kvgate/v1/calibration")[1])
    finally:
        sidecar.stop()
        server.stop()
    return {
        "model": MODEL,
        "bound": BOUND,
        "before": summarise(run.phase("before")),
        "after": summarise(run.phase("after")),
        "windows_after_change": windows,
        "recovered_after_requests": recovered_after,
        "efficiency_before_change": efficiency_before_change,
        "efficiency_after_change": efficiency_after_change,
        "calibration": calibration,
        "samples": [vars(s) for s in run.samples],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="fewer requests (CI)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    started = time.time()
    record = provenance("bench/calibration.py")
    result = asyncio.run(scenario(args.smoke, args.seed))
    result.update(record)
    result["seconds"] = round(time.time() - started, 1)
    if args.out:
        write_json(args.out, result)
    print(_table(result))
    return 0


def _table(result: dict[str, Any]) -> str:
    rows = [("phase", "requests", "TTFT APE p50", "p90", "TPOT APE p50", "p90")]
    for name in ("before", "after"):
        stats = result[name]
        rows.append((name, str(stats["requests"]), f"{stats['ttft_ape_p50']:.1%}",
                     f"{stats['ttft_ape_p90']:.1%}", f"{stats['tpot_ape_p50']:.1%}",
                     f"{stats['tpot_ape_p90']:.1%}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.append(f"after the server changed: median error back under {result['bound']:.0%} "
                 f"after {result['recovered_after_requests']} requests")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
