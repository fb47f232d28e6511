#!/usr/bin/env python3
"""What counting a long prompt costs kvgate's event loop, with and without reusing the
tokens of a recent prompt it extends (`sidecar/tokens/reuse.py`).

    python bench/tokenize_reuse.py [--tokenizer DIR] [--prompts 400] [--runs 3]
                                   [--out bench/results/tokenize_reuse.json]
    python bench/tokenize_reuse.py --report bench/results/tokenize_reuse.json

Each workload is a seeded sequence of completions prompts, counted in order by one
`LocalTokenizer` (as the server counts them, one request after the other) with reuse
on, and the same prompts by a second one with reuse off (`PrefixReuse.enabled =
False`: every prompt encoded whole). Reported: CPU microseconds per prompt of this
process (median of `--runs`; the checks of joins, which the server runs on a worker
thread, run inline here and are included), the share of prompts joined, and whether
every count equals the whole encoding (it must). Workloads:

- shared system prompt: a ~1,000-token system prompt and a new ~60-token question;
- agent sessions: 8 sessions interleaved, each turn the previous prompt + an answer +
  new text, up to ~2,500 tokens (what `bench/admission_quality.py --workload agentic`
  sends);
- unique: ~1,000-token prompts that share nothing (what reuse costs when it cannot help).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sidecar.tokens import LocalTokenizer  # noqa: E402

from bench.common import (  # noqa: E402
    BenchError,
    benchmark_main,
    provenance,
    provenance_line,
    render_table,
)

_WORDS = ("the cache holds blocks of keys and values for every request the scheduler "
              "admits while decoding tokens one step at a time on the server under load "
              "with prefix sharing across sessions of an agent calling tools 2026 12 01 "
              "latency p99 rose from 2 s to 19 s é 東京 🚀")
VOCABULARY = tuple(_WORDS.split(" "))


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(VOCABULARY) for _ in range(words))


def shared_system(count: int) -> list[str]:
    rng = random.Random(1)
    system = _text(rng, 900)
    return [f"{system}\nQuestion {n}: {_text(rng, 50)}\nAnswer:" for n in range(count)]


def agent_sessions(count: int) -> list[str]:
    rng = random.Random(2)
    tools = _text(rng, 300)
    sessions = [f"{tools}\nSession {s}: {_text(rng, 60)}" for s in range(8)]
    prompts = []
    while len(prompts) < count:
        s = rng.randrange(len(sessions))
        if len(sessions[s]) > 11_000:  # ~2,500 tokens: the session ends, a new one starts
            sessions[s] = f"{tools}\nSession {len(prompts)}: {_text(rng, 60)}"
        prompts.append(sessions[s])
        sessions[s] += f"\nassistant: {_text(rng, 40)}\nuser: {_text(rng, 30)}"
    return prompts


def unique(count: int) -> list[str]:
    rng = random.Random(3)
    return [f"{n} {_text(rng, 900)}" for n in range(count)]


WORKLOADS: dict[str, Callable[[int], list[str]]] = {
    "shared system prompt": shared_system,
    "agent sessions": agent_sessions,
    "unique": unique,
}


def _count_all(directory: Path, prompts: list[str], reuse: bool) -> tuple[float, list[int],
                                                                         dict[str, int]]:
    tokenizer = LocalTokenizer.load(directory)
    tokenizer.reuse.enabled = reuse
    counts = []
    started = time.process_time()
    for prompt in prompts:
        counts.append(len(tokenizer.tokenize({"prompt": prompt})))
    return time.process_time() - started, counts, dict(tokenizer.reuse.counts)


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    directory = Path(args.tokenizer).expanduser()
    if not (directory / "tokenizer.json").is_file():
        raise BenchError(f"--tokenizer {directory}: no tokenizer.json")
    rows = []
    for name, build in WORKLOADS.items():
        prompts = build(args.prompts)
        whole_s, joined_s = [], []
        equal = True
        counts: dict[str, int] = {}
        tokens: list[int] = []
        for _ in range(args.runs):
            seconds, tokens, _ = _count_all(directory, prompts, reuse=False)
            whole_s.append(seconds)
            seconds, joined, counts = _count_all(directory, prompts, reuse=True)
            joined_s.append(seconds)
            equal = equal and joined == tokens
        whole_us = statistics.median(whole_s) / len(prompts) * 1e6
        joined_us = statistics.median(joined_s) / len(prompts) * 1e6
        rows.append({
            "workload": name, "prompts": len(prompts),
            "mean_prompt_tokens": round(statistics.fmean(tokens)),
            "whole_us_per_prompt": round(whole_us, 1),
            "with_reuse_us_per_prompt": round(joined_us, 1),
            "speedup": round(whole_us / joined_us, 2),
            "joined_share": round(counts.get("spliced", 0) / len(prompts), 3),
            "checked": counts.get("checked", 0), "mismatches": counts.get("mismatch", 0),
            "counts_equal_whole_encoding": equal,
        })
    return {"benchmark": "tokenize_reuse", **provenance("bench/tokenize_reuse.py"),
            "tokenizer": str(directory), "runs": args.runs,
            "measure": "CPU time of this process per prompt, median of the runs",
            "workloads": rows}


def print_report(report: dict[str, Any]) -> None:
    print(provenance_line(report))
    print(f"tokenizer {report['tokenizer']}; {report['measure']}\n")
    header = ["workload", "prompts", "mean tokens", "whole us", "with reuse us", "speedup",
              "joined", "checked", "mismatches", "counts equal"]
    print(render_table(header, [[r["workload"], r["prompts"], r["mean_prompt_tokens"],
                                 r["whole_us_per_prompt"], r["with_reuse_us_per_prompt"],
                                 f"{r['speedup']}x", r["joined_share"], r["checked"],
                                 r["mismatches"], r["counts_equal_whole_encoding"]]
                                for r in report["workloads"]]))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=str(
        Path.home() / ".cache" / "kvgate" / "models" / "tiny-llama"),
        help="a model directory with tokenizer.json (default: the tiny-llama test model "
             "that `bash scripts/check` builds)")
    parser.add_argument("--prompts", type=int, default=400)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" /
                                             "tokenize_reuse.json"))
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(benchmark_main("bench/tokenize_reuse.py", parse_args, benchmark, print_report))
