#!/usr/bin/env python3
"""Bursts on sliding-window models, vLLM alone and through kvgate, on real vLLM CPU
servers with vLLM's defaults (prefix caching on, chunked prefill).

    python bench/sliding_burst.py [--smoke] [--out bench/results/sliding_burst.json]
    python bench/sliding_burst.py --report bench/results/sliding_burst.json

Issue 19's shape: 16 streamed /v1/completions of ~450 prompt tokens and 300 output
tokens (`ignore_eos`), each prompt its own (nothing shared, nothing cached), sent at
once, on two tiny random-weight models (tests/support/build_tiny_models.py) with
max_model_len 1024 and KV blocks of 32 tokens:

- `tiny-mistral`: a 256-token sliding window on every layer, 64 blocks;
- `tiny-gptoss`: a hybrid of sliding (128) and full attention layers, 160 blocks.

One server at a time; on each, the paths alternate between repetitions: `vllm`
(clients call vLLM) and `kvgate` (`kvgate serve --mode enforce` with the CPU's
figures as a custom device, everything else default). Per burst: served, preemptions
(delta of vllm:num_preemptions_total), median TTFT, completion time (send to the last
request's end), the most requests vLLM ran at once and kvgate's reservation per
request (`x-kvgate-kv-blocks`). Target (issue 19): through kvgate 0 preemptions and
completion within 1.5x of vLLM alone measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for _extra in (ROOT, ROOT / "tests"):
    if str(_extra) not in sys.path:
        sys.path.insert(0, str(_extra))

from bench.common import (  # noqa: E402
    RESULTS,
    BenchError,
    Process,
    benchmark_main,
    free_port,
    provenance,
    provenance_line,
    render_table,
    rounded,
    temporary_directory,
)
from bench.prefix_burst import (  # noqa: E402
    _ratios,
    _spread,
    common_arguments,
    fit,
    locate,
    quiet_budget,
    run_burst,
    say,
    send_one,
    start_kvgate,
    summarise,
    versus,
    vllm_version,
    wait_idle,
    words,
)
from support.vllm_server import VllmServer, VllmServerError  # noqa: E402

MODELS = {"tiny-mistral": 64, "tiny-gptoss": 160}  # KV blocks of 32 tokens
PATHS: dict[str, tuple[str, ...]] = {"vllm": (), "kvgate": (),
                                     "kvgate_r1.0": ("--kv-target-ratio", "1.0")}


def one_model(args: argparse.Namespace, python: str, models: Path, name: str, tmp: Path
              ) -> dict[str, Any]:
    paths = [p for p in PATHS if p in args.paths.split(",")]
    server = VllmServer(python, str(models / name), name, free_port(), max_model_len=1024,
                        block_size=32, num_gpu_blocks_override=MODELS[name],
                        log_path=str(tmp / f"vllm-{name}.log"))
    try:
        server.start()
    except VllmServerError as exc:
        raise BenchError(str(exc)) from exc
    proxies: dict[str, tuple[Process | None, str]] = {}
    result: dict[str, Any] = {}
    try:
        labels = server.cache_config_info()
        result["server"] = {
            "model": name, "argv": ["python", *server.command()[1:]], "max_model_len": 1024,
            "block_size": int(labels["block_size"]),
            "num_gpu_blocks": int(labels["num_gpu_blocks"]),
            "prefix_caching": labels.get("enable_prefix_caching"),
            "startup_s": rounded(server.startup_seconds, 1),
        }
        for path in paths:
            if path == "vllm":
                proxies[path] = (None, server.url)
            else:
                proxies[path] = start_kvgate(server.url, tmp, f"{path}-{name}", PATHS[path])
        result["paths"] = {p: {"what": "clients call vLLM directly"} if p == "vllm" else
                           {"argv": ["kvgate", *(proxies[p][0].argv[3:]
                                                 if proxies[p][0] else [])]} for p in paths}
        for path in paths:
            send_one(proxies[path][1], name, f"warm up {path} " + words("w", 100), 8)
        wait_idle(server.url)

        def prompts(tag: str) -> list[str]:
            return [fit(server.url, name, f"{tag} {i} " + words(f"{tag}q{i}x", 200),
                        args.prompt_tokens)[0] for i in range(args.requests)]

        # One unmeasured burst first (the server's first long prompts cost more).
        run_burst(server.url, server.url, name, prompts("warmup"), args.output_tokens)
        bursts: dict[str, list[dict[str, Any]]] = {p: [] for p in paths}
        for rep in range(args.repeat):
            order = paths if rep % 2 == 0 else paths[::-1]
            for path in order:
                url = proxies[path][1]
                batch = prompts(f"r{rep}{path.replace('_', '').replace('.', '')}")
                wait_idle(server.url, None if url == server.url else url)
                waited = args.quiet.wait()
                process = proxies[path][0]
                pids = [p for p in (server.pid, process and process.pid) if p]
                record = run_burst(server.url, url, name, batch, args.output_tokens, pids)
                record["repetition"] = rep + 1
                record["waited_for_quiet_s"] = round(waited, 1)
                bursts[path].append(record)
                say(f"{name} {rep + 1}/{args.repeat} {path}: served {record['served']}/"
                    f"{record['requests']}, preemptions {record['preemptions']}, burst "
                    f"{record['burst_s']} s, max running {record['max_running']}, kvgate "
                    f"{record.get('kvgate', {}).get('kv_blocks_median')} blocks/request")
        summaries = {p: summarise(bursts[p]) for p in paths}
        for path in paths:
            blocks = [b["kvgate"]["kv_blocks_median"] for b in bursts[path] if "kvgate" in b]
            if blocks:
                summaries[path]["kv_blocks_per_request"] = blocks[0]
        result["prompt_tokens"] = next(
            (b["kvgate"]["prompt_tokens"] for p in paths for b in bursts[p] if "kvgate" in b),
            None)
        result["summary"] = summaries
        result["bursts"] = bursts
        result["versus_vllm"] = versus(summaries, 1.5, None, bursts) if "vllm" in paths else {}
    finally:
        for process, _ in proxies.values():
            if process is not None:
                process.stop()
        server.stop()
    return result


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    names = [m for m in MODELS if m in args.models.split(",")]
    python, models = locate(args, names)
    started = time.monotonic()
    report: dict[str, Any] = {"benchmark": "sliding_burst",
                              **provenance("bench/sliding_burst.py"),
                              "engine": f"vLLM {vllm_version(python)} (CPU)"}
    report["workload"] = {
        "requests": args.requests, "prompt_tokens": f"<= {args.prompt_tokens} (each its own)",
        "output_tokens": args.output_tokens,
        "request": "POST /v1/completions, stream, ignore_eos, temperature 0, all sent at once",
    }
    report["models"] = {}
    with temporary_directory("kvgate-sliding-burst-", keep=args.keep_logs) as tmp:
        for name in names:
            report["models"][name] = one_model(args, python, models, name, tmp)
    report["targets"] = {"burst_ratio_max": 1.5,
                         "source": "issue 19: 0 preemptions through kvgate, completion within "
                                   "1.5x of vLLM alone"}
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    return report


def print_report(report: dict[str, Any]) -> None:
    print("\n" + provenance_line(report))
    workload = report["workload"]
    print(f"{report['engine']}; {workload['requests']} requests of {workload['prompt_tokens']} "
          f"prompt tokens + {workload['output_tokens']} output tokens, sent at once\n")
    rows = []
    for name, data in report["models"].items():
        for path, s in data["summary"].items():
            verdict = data["versus_vllm"].get(path, {})
            rows.append([name, f"{data['server']['num_gpu_blocks']} x "
                         f"{data['server']['block_size']}", path, s["served"],
                         "/".join(str(p) for p in s["preemptions"]),
                         _spread(s["burst_s"], 2), _spread(s["ttft_ms_median"], 0),
                         _spread(s["max_running"], 0), s.get("kv_blocks_per_request"),
                         _ratios(verdict, "burst"), s.get("other_load_max")])
    print(render_table(["model", "cache", "path", "served", "preemptions", "done in s",
                        "median TTFT ms", "max running", "kvgate blocks/request",
                        "time / vLLM", "other load (max)"], rows))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_arguments(parser)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--paths", default="vllm,kvgate",
                        help="comma-separated subset of " + ", ".join(PATHS))
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=450)
    parser.add_argument("--output-tokens", type=int, default=300)
    args = parser.parse_args(argv)
    if args.repeat is None:
        args.repeat = 1 if args.smoke else 3
    quiet_budget(args)
    if args.smoke:
        args.models = "tiny-mistral"
    if args.out is None:
        args.out = (str(Path(os.environ.get("TMPDIR", "/tmp")) / "kvgate-sliding-smoke.json")
                    if args.smoke else str(RESULTS / "sliding_burst.json"))
    return args


def main() -> int:
    return benchmark_main("bench/sliding_burst.py", parse_args, benchmark, print_report)


if __name__ == "__main__":
    raise SystemExit(main())
