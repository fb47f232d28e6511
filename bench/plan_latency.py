"""How long `kvgate plan --json` takes, start to finish, as a user runs it.

One command: `python bench/plan_latency.py [--runs 20] [--out FILE]`

Runs the command as a fresh process each time (interpreter start-up and imports
included) for a dense model on a GPU (with an arrival rate; and with TTFT/TPOT targets,
which the engine simulator answers by bisection) and for a hybrid MoE with a logged
budget, and reports the median and worst wall time.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import provenance, write_json  # noqa: E402

CASES = {
    "dense, GPU": ["--model", "Qwen/Qwen3-8B", "--gpu", "H100", "--arrival-rate", "4"],
    # The simulator's bisection for --max-num-seqs under both targets, and replicas.
    "dense, GPU, targets": ["--model", "Qwen/Qwen3-8B", "--gpu", "H100", "--concurrency", "16",
                            "--prompt-tokens", "2000", "--output-tokens", "500",
                            "--arrival-rate", "20", "--tpot-slo-ms", "30",
                            "--ttft-slo-ms", "500"],
    "hybrid MoE, logged budget": ["--model", "openai/gpt-oss-120b", "--available-kv-gib",
                                  "36.5", "--max-model-len", "131072"],
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    results = {}
    for name, case in CASES.items():
        times, cpu = [], []
        for _ in range(args.runs):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            started = time.perf_counter()
            subprocess.run([sys.executable, "-m", "sidecar", "plan", *case, "--json"],
                           check=True, capture_output=True)
            times.append(time.perf_counter() - started)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        # CPU time is what the command costs; wall time also counts waiting for a busy
        # machine's cores.
        results[name] = {"median_s": statistics.median(times), "max_s": max(times),
                         "median_cpu_s": statistics.median(cpu), "runs": args.runs}
        print(f"{name:28s} median {results[name]['median_s'] * 1000:6.0f} ms   "
              f"max {results[name]['max_s'] * 1000:6.0f} ms   "
              f"CPU {results[name]['median_cpu_s'] * 1000:6.0f} ms   ({args.runs} runs)")
    if args.out:
        write_json(args.out, {"results": results, **provenance("bench/plan_latency.py")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
