"""kvgate in front of a real vLLM, on a machine without a GPU.

Brings up a real vLLM (the CPU build) serving a small model built locally, with a
deliberately small KV cache, puts `kvgate serve` in front of it, drives the same
burst (larger than the whole KV cache) through both paths, and prints what happened.

Run it with `bash scripts/demo` (which prepares the environments first).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from support.env import free_port, model_dir, vllm_python  # noqa: E402
from support.load import stream_completion  # noqa: E402
from support.sidecar import Sidecar, metric_value  # noqa: E402
from support.vllm_server import VllmServer  # noqa: E402

# scripts/demo names a directory for the servers' logs, kept only when the demo fails.
if os.environ.get("KVGATE_LOG_DIR"):
    tempfile.tempdir = os.environ["KVGATE_LOG_DIR"]

MODEL = "tiny-llama"
SENTENCE = "The quick brown fox jumps over the lazy dog. "  # 10 tokens


async def timed_burst(url: str, count: int, max_tokens: int,
                      prompt: str) -> list[dict[str, Any]]:
    async def one(session: aiohttp.ClientSession) -> dict[str, Any]:
        started = time.monotonic()
        result = await stream_completion(session, url, max_tokens, prompt, MODEL)
        result["seconds"] = time.monotonic() - started
        return result

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        return list(await asyncio.gather(*(one(session) for _ in range(count))))


def summary(label: str, results: list[dict[str, Any]], preemptions: float) -> list[str]:
    served = [r for r in results if r["status"] == 200]
    rejected = [r for r in results if r["status"] != 200]
    with_retry = sum(1 for r in rejected if r.get("retry_after"))
    seconds = [r["seconds"] for r in served]
    p50 = statistics.median(seconds) if served else float("nan")
    last = max(seconds) if served else float("nan")
    return [label, str(len(served)), f"{len(rejected)} ({with_retry} with Retry-After)",
            f"{preemptions:g}", f"{p50:.1f} s", f"{last:.1f} s"]


def table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16, help="size of the burst")
    parser.add_argument("--max-tokens", type=int, default=400, help="output tokens each")
    parser.add_argument("--prompt-tokens", type=int, default=100,
                        help="about this many prompt tokens each (a multiple of 10)")
    args = parser.parse_args(argv)
    prompt = SENTENCE * max(1, args.prompt_tokens // 10)
    print("Starting a real vLLM (CPU build) with tiny-llama and a 2,048-token KV cache ...")
    server = VllmServer(vllm_python(), str(model_dir(MODEL)), MODEL, free_port(), 1024,
                        block_size=32, num_gpu_blocks_override=64).start()
    try:
        kv = server.kv_cache_info()
        print(f"  vLLM says: {kv.line.split('] ')[-1]}")
        sidecar = Sidecar(server.url, "--queue-max-wait-s", "120")
        print("Starting kvgate in front of it:\n  kvgate " + " ".join(sidecar.args[4:]))
        sidecar.start()
        try:
            burst_tokens = args.requests * (args.prompt_tokens + args.max_tokens)
            print(f"\nThe burst: {args.requests} streamed requests of ~{args.prompt_tokens} "
                  f"prompt + "
                  f"{args.max_tokens} output tokens ({burst_tokens:,} tokens of KV, "
                  f"{burst_tokens / kv.tokens:.1f}x the cache), sent at once.")
            before = metric_value(server.metrics_text(), "vllm:num_preemptions_total")
            print("\n1. Straight to vLLM ...")
            direct = asyncio.run(timed_burst(server.url, args.requests, args.max_tokens, prompt))
            mid = metric_value(server.metrics_text(), "vllm:num_preemptions_total")
            print("2. Through kvgate ...")
            gated = asyncio.run(timed_burst(sidecar.url, args.requests, args.max_tokens, prompt))
            after = metric_value(server.metrics_text(), "vllm:num_preemptions_total")
            state = sidecar.wait_idle()
            metrics = sidecar.metrics_text()
            print()
            print(table([
                ["path", "served", "rejected", "vLLM preemptions", "p50 time per request",
                 "last one done"],
                summary("vLLM alone", direct, mid - before),
                summary("through kvgate", gated, after - mid),
            ]))
            outcomes = {
                line.split('"')[1]: float(line.rsplit(" ", 1)[1])
                for line in metrics.splitlines()
                if line.startswith("kvgate_requests_total{")
            }
            waited = metric_value(metrics, "kvgate_queue_wait_seconds_count")
            print("\nkvgate's decisions: " + ", ".join(
                f"{name} {count:g}" for name, count in outcomes.items() if count))
            print(f"  {waited:g} of the admitted requests waited in kvgate's queue first;")
            ledger = state["admission"]["ledger"]
            print(f"  afterwards the ledger holds {ledger['reserved_blocks']} reserved blocks "
                  f"in {ledger['reservations']} reservations (capacity "
                  f"{ledger['capacity_blocks']} blocks, target {ledger['target_blocks']}).")
        finally:
            sidecar.stop()
    finally:
        server.stop()
    print("\nTo put kvgate in front of a server you already run:\n"
          "  kvgate serve --upstream http://127.0.0.1:8000 --gpu H100 --port 8080\n"
          "and send clients to port 8080 instead of 8000.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
