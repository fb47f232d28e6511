#!/usr/bin/env python3
"""Streaming fidelity: inter-token latency seen by a client, vLLM alone and through
kvgate, measured by vLLM's own `vllm bench serve`.

    python bench/stream_fidelity.py [--smoke] [--out bench/results/stream_fidelity.json]
    python bench/stream_fidelity.py --report bench/results/stream_fidelity.json

One real vLLM CPU server (tiny-qwen3, vLLM's defaults: prefix caching on, chunked
prefill; the CPU build turns asynchronous scheduling off) with room for every request,
and `kvgate serve` in front of it (enforce mode, the CPU's figures as a custom device,
tokens counted locally).
`vllm bench serve` (from the vLLM environment) runs the same random workload against
each path in turn, the order alternating between repetitions: streamed
/v1/completions, --random-input-len prompt tokens, --random-output-len output tokens
(`--ignore-eos`), --max-concurrency requests at once. It timestamps every SSE event as
it arrives, so events that reach the client together show as an ITL of 0: a proxy that
merges events lowers the median, one that delays them raises it.

Target (issue 18): through kvgate, ITL p50 and p90 within 10% or 0.5 ms of vLLM alone.

A control runs beside them (`bare_proxy`): the bare aiohttp stream-through proxy of
`bench/bare_proxy.py` (no admission, no parsing, no metrics) in front of the same server.
What it adds over vLLM alone is what one more Python process in the stream's path costs
on this machine, whatever the proxy does; what kvgate adds beyond it is kvgate's own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for _extra in (ROOT, ROOT / "tests"):
    if str(_extra) not in sys.path:
        sys.path.insert(0, str(_extra))

from bench.clients import VLLM_BENCH_SERVE  # noqa: E402
from bench.common import (  # noqa: E402
    RESULTS,
    BenchError,
    benchmark_main,
    free_port,
    provenance,
    provenance_line,
    render_table,
    rounded,
    temporary_directory,
)
from bench.prefix_burst import (  # noqa: E402
    common_arguments,
    locate,
    quiet_budget,
    say,
    start_bare_proxy,
    start_kvgate,
)
from support.vllm_server import VllmServer, VllmServerError  # noqa: E402

MODEL = "tiny-qwen3"
METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (50, 90, 99)


def bench_serve(python: str, model_dir: Path, url: str, args: argparse.Namespace,
                out: Path, seed: int) -> dict[str, Any]:
    argv = [python, "-c", VLLM_BENCH_SERVE,
            "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", MODEL, "--tokenizer", str(model_dir), "--dataset-name", "random",
            "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--ignore-eos",
            "--num-prompts", str(args.prompts), "--max-concurrency", str(args.concurrency),
            "--percentile-metrics", ",".join(METRICS),
            "--metric-percentiles", ",".join(str(p) for p in PERCENTILES),
            "--seed", str(seed), "--save-result", "--result-dir", str(out.parent),
            "--result-filename", out.name, "--disable-tqdm", "--ready-check-timeout-sec", "0"]
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING",
           "PATH": "/usr/bin:/bin"}
    completed = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env,
                               check=False)
    if completed.returncode != 0 or not out.exists():
        raise BenchError(f"vllm bench serve failed ({completed.returncode}):\n"
                         f"{(completed.stderr or completed.stdout)[-3000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    keep = {"completed", "failed", "request_throughput", "output_throughput", "duration"}
    record = {k: result.get(k) for k in keep}
    for metric in METRICS:
        for p in PERCENTILES:
            record[f"{metric}_p{p}_ms"] = rounded(result.get(f"p{p}_{metric}_ms"), 3)
        record[f"{metric}_mean_ms"] = rounded(result.get(f"mean_{metric}_ms"), 3)
    return record


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    python, models = locate(args, [MODEL])
    report: dict[str, Any] = {"benchmark": "stream_fidelity",
                              **provenance("bench/stream_fidelity.py")}
    with temporary_directory("kvgate-stream-fidelity-", keep=args.keep_logs) as tmp:
        server = VllmServer(python, str(models / MODEL), MODEL, free_port(),
                            max_model_len=2048, block_size=32,
                            num_gpu_blocks_override=2048,
                            log_path=str(tmp / "vllm.log"))
        try:
            server.start()
        except VllmServerError as exc:
            raise BenchError(str(exc)) from exc
        kvgate = bare = None
        try:
            kvgate, kvgate_url = start_kvgate(server.url, tmp, "kvgate", ())
            bare, bare_url = start_bare_proxy(server.url, tmp)
            urls = {"vllm": server.url, "kvgate": kvgate_url, "bare_proxy": bare_url}
            report["setup"] = {
                "server": {"model": MODEL, "argv": ["python", *server.command()[1:]]},
                "kvgate": {"argv": ["kvgate", *kvgate.argv[3:]]},
                "bare_proxy": {"argv": ["python", "bench/bare_proxy.py"],
                               "what": "the control: a bare aiohttp stream-through proxy"},
                "load": {"tool": "vllm bench serve (vLLM 0.32)", "prompts": args.prompts,
                         "max_concurrency": args.concurrency, "input_len": args.input_len,
                         "output_len": args.output_len, "repetitions": args.repeat,
                         "order": "alternating between repetitions"},
            }
            bench_serve(python, models / MODEL, server.url, args, tmp / "warmup.json", 0)
            runs: dict[str, list[dict[str, Any]]] = {p: [] for p in urls}
            for rep in range(args.repeat):
                order = list(urls) if rep % 2 == 0 else list(urls)[::-1]
                for path in order:
                    args.quiet.wait()
                    record = bench_serve(python, models / MODEL, urls[path], args,
                                         tmp / f"{path}-{rep}.json", rep + 1)
                    record["repetition"] = rep + 1
                    runs[path].append(record)
                    say(f"{rep + 1}/{args.repeat} {path}: ITL p50 {record['itl_p50_ms']} ms, "
                        f"p90 {record['itl_p90_ms']} ms, TPOT p50 {record['tpot_p50_ms']} ms, "
                        f"{record['completed']} completed, {record['failed']} failed")
        finally:
            for process in (kvgate, bare):
                if process is not None:
                    process.stop()
            server.stop()
    report["runs"] = runs
    report["summary"] = summary(runs)
    return report


def summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    def median(path: str, key: str) -> float | None:
        values = [r[key] for r in runs[path] if r.get(key) is not None]
        return rounded(statistics.median(values), 3) if values else None

    out: dict[str, Any] = {}
    for key in ("itl_p50_ms", "itl_p90_ms", "itl_p99_ms", "tpot_p50_ms", "ttft_p50_ms",
                "request_throughput"):
        vllm, kvgate = median("vllm", key), median("kvgate", key)
        bare = median("bare_proxy", key) if runs.get("bare_proxy") else None
        out[key] = {"vllm": vllm, "kvgate": kvgate,
                    "difference_ms": rounded(kvgate - vllm, 3)
                    if vllm is not None and kvgate is not None else None,
                    "ratio": rounded(kvgate / vllm, 3) if vllm and kvgate is not None else None,
                    "bare_proxy": bare,
                    "bare_proxy_difference_ms": rounded(bare - vllm, 3)
                    if vllm is not None and bare is not None else None}
    out["itl_within_target"] = all(
        out[k]["difference_ms"] is not None and (abs(out[k]["difference_ms"]) <= 0.5
                                                 or abs(out[k]["ratio"] - 1) <= 0.10)
        for k in ("itl_p50_ms", "itl_p90_ms"))
    return out


def print_report(report: dict[str, Any]) -> None:
    print(f"\n{provenance_line(report)}\n")
    rows = [[key, v["vllm"], v["kvgate"], v["difference_ms"], v["ratio"],
             v.get("bare_proxy"), v.get("bare_proxy_difference_ms")]
            for key, v in report["summary"].items() if isinstance(v, dict)]
    print(render_table(["median over repetitions", "vLLM alone", "through kvgate",
                        "difference", "ratio", "through the bare proxy", "difference"], rows))
    print(f"\nITL p50 and p90 within 10% or 0.5 ms: {report['summary']['itl_within_target']}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_arguments(parser)
    parser.add_argument("--prompts", type=int, help="requests per run (default 64; smoke 16)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    args.repeat = args.repeat or (1 if args.smoke else 3)
    args.prompts = args.prompts or (16 if args.smoke else 64)
    args.out = args.out or str(RESULTS / "stream_fidelity.json")
    quiet_budget(args)
    return args


def main() -> int:
    return benchmark_main("bench/stream_fidelity.py", parse_args, benchmark, print_report)


if __name__ == "__main__":
    raise SystemExit(main())
