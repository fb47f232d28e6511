#!/usr/bin/env python3
"""How fast the engine simulator (`sidecar.model.simulator`) runs 10,000 requests.

    python bench/simulator_speed.py [--runs 3] [--requests 10000]
                                    [--out bench/results/simulator_speed.json]
    python bench/simulator_speed.py --report bench/results/simulator_speed.json

Runs each case in this process, one core, `--runs` times, and reports the CPU seconds
of the fastest and the median run (CPU time of this process: other load on a shared
machine slows the wall clock more than it does this figure), with the simulated
steps, preemptions and completed requests. The target (issue 15) is 10,000 requests in
2 s or less. Cases: Qwen3-8B on an H100 (full attention) at a steady open-loop rate,
in a closed loop of 64 clients, with a small cache that preempts, and with a shared
system prompt (prefix caching); gpt-oss-20b (sliding-window layers, whose decoding
requests are visited every step) open loop.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sidecar.cli.model_source import read_model  # noqa: E402
from sidecar.model import Deployment, ServedModel, find_gpu  # noqa: E402
from sidecar.model.simulator import (  # noqa: E402
    ClosedLoop,
    Lengths,
    OpenLoop,
    Workload,
    simulate,
)

from bench.common import benchmark_main, provenance, render_table  # noqa: E402

TARGET_S = 2.0


def _served(model: str, **deployment: Any) -> ServedModel:
    return ServedModel(read_model(model), Deployment(**deployment), find_gpu("H100"))


def cases(requests: int) -> dict[str, tuple[Callable[[], ServedModel], Callable[[], Workload]]]:
    lengths = Lengths(512, 128, spread=0.5)
    shared = Lengths(1536, 128, spread=0.3, prefix_group="system", prefix_tokens=1024)
    return {
        "Qwen3-8B, open loop 20 req/s": (
            lambda: _served("Qwen/Qwen3-8B", max_model_len=32768),
            lambda: OpenLoop(20.0, requests, lengths, seed=1)),
        "Qwen3-8B, closed loop 64 clients": (
            lambda: _served("Qwen/Qwen3-8B", max_model_len=32768),
            lambda: ClosedLoop(64, requests, lengths, seed=1)),
        "Qwen3-8B, 2,000 blocks, bursts (preempts)": (
            lambda: _served("Qwen/Qwen3-8B", max_model_len=8192,
                            num_gpu_blocks_override=2000),
            lambda: OpenLoop(40.0, requests, lengths, burst_size=32, seed=1)),
        "Qwen3-8B, shared 1,024-token prefix": (
            lambda: _served("Qwen/Qwen3-8B", max_model_len=32768),
            lambda: OpenLoop(20.0, requests, shared, seed=1)),
        "gpt-oss-20b (sliding window), open loop": (
            lambda: _served("openai/gpt-oss-20b", max_model_len=32768),
            lambda: OpenLoop(20.0, requests, lengths, seed=1)),
    }


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    results = []
    for name, (make_served, make_workload) in cases(args.requests).items():
        cpu: list[float] = []
        wall: list[float] = []
        summary: dict[str, Any] = {}
        for _ in range(args.runs):
            served = make_served()  # fresh: no memo carried between runs
            workload = make_workload()
            started_cpu, started_wall = time.process_time(), time.perf_counter()
            result = simulate(served, workload)
            cpu.append(time.process_time() - started_cpu)
            wall.append(time.perf_counter() - started_wall)
            summary = result.summary()
        results.append({
            "case": name,
            "requests": summary["requests"],
            "completed": summary["completed"],
            "steps": summary["steps"],
            "preemptions": summary["preemptions"],
            "cpu_s_best": min(cpu),
            "cpu_s_median": statistics.median(cpu),
            "wall_s_median": statistics.median(wall),
            "within_target": min(cpu) <= TARGET_S,
        })
        print(f"{name}: {min(cpu):.2f} s CPU", file=sys.stderr)
    return {"benchmark": "simulator_speed", "target_s": TARGET_S, "runs": args.runs,
            "cases": results, **provenance("bench/simulator_speed.py")}


def print_report(report: dict[str, Any]) -> None:
    print(f"\n{report['command']}  ({report['date']}, {report['machine']['cpu_model']})\n")
    rows = [[c["case"], c["requests"], c["steps"], c["preemptions"], c["cpu_s_best"],
             c["cpu_s_median"], c["wall_s_median"], "yes" if c["within_target"] else "NO"]
            for c in report["cases"]]
    print(render_table(["case", "requests", "steps", "preemptions", "CPU s (best)",
                        "CPU s (median)", "wall s (median)",
                        f"<= {report['target_s']:g} s"], rows))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per case (default 3)")
    parser.add_argument("--requests", type=int, default=10_000,
                        help="requests per case (default 10000)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" /
                                             "simulator_speed.json"))
    return parser.parse_args()


def main() -> int:
    return benchmark_main("bench/simulator_speed.py", parse_args, benchmark, print_report)


if __name__ == "__main__":
    raise SystemExit(main())
