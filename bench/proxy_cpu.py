"""CPU time per proxied request: kvgate from two or more checkouts, and the bare proxy.

    python bench/proxy_cpu.py [--checkout DIR ...] [--bare] [--rounds 4] [--duration 4]
        [--stream] [--unique] [--out bench/results/proxy_cpu.json]

A per-request cut is judged here, not by req/s: on a shared machine throughput moves
between runs more than a cut of a few percent does, and the process's own CPU time over
the requests it served moves far less. Each checkout's `python -m sidecar serve` (run
from that directory, so its own code) and, with `--bare`, `bench/bare_proxy.py` are
started in turn over the canned upstream of `bench/overhead.py --canned` (nginx with
vLLM's routes), loaded by wrk at 16 connections: 1 s unmeasured after 2 s of identical
prompts (kvgate's first checks of the shape, which the canned /tokenize answers), then
`--duration` seconds measured. The order alternates between rounds. Reports each
target's CPU microseconds per request (median and all rounds) and its req/s.

Give a checkout as a `git worktree add` of the revision to compare with; one built in
place with `KVGATE_COMPILE=1 python setup.py build_ext --inplace` runs compiled (its
row says so).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent.parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.canned import (
    canned_bodies,
    find_tool,
    local_prompt_ids,
    run_wrk,
    upstream_config,
    wrk_script,
)
from bench.common import (
    RESULTS,
    ROOT,
    BenchError,
    Process,
    benchmark_main,
    cpu_seconds,
    free_port,
    kvgate_revision,
    provenance,
    provenance_line,
    render_table,
    temporary_directory,
    wait_http,
)

BARE = "bare-aiohttp"
CONNECTIONS = 16


def _argv(target: str, port: int, upstream: str, tokenizer: Path) -> list[str]:
    if target == BARE:
        return [sys.executable, str(ROOT / "bench" / "bare_proxy.py"), "--port", str(port),
                "--upstream", upstream]
    return [sys.executable, "-m", "sidecar", "serve", "--upstream", upstream,
            "--model-config", "Qwen/Qwen3-0.6B", "--tokenizer", str(tokenizer),
            "--host", "127.0.0.1", "--port", str(port), "--mode", "enforce",
            "--event-loop", "uvloop", "--tokenizer-check-every", "0"]


def _one(target: str, tmp: Path, upstream: str, tokenizer: Path, wrk: str,
         args: argparse.Namespace) -> tuple[float, float]:
    """(CPU us per request, req/s) of one measured run of `target`."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    process = Process(target, _argv(target, port, upstream, tokenizer), tmp / "target.log",
                      env=env, cwd=ROOT if target == BARE else Path(target))
    url = f"http://127.0.0.1:{port}"
    try:
        process.start()
        wait_http(url + ("/health" if target == BARE else "/readyz"), process, timeout_s=60)
        run_wrk(wrk, url, wrk_script(tmp, args.stream, False), CONNECTIONS, 2)
        script = wrk_script(tmp, args.stream, args.unique)
        run_wrk(wrk, url, script, CONNECTIONS, 1)
        assert process.proc is not None
        before = cpu_seconds(process.proc.pid)
        measured = run_wrk(wrk, url, script, CONNECTIONS, args.duration)
        used = cpu_seconds(process.proc.pid) - before
    finally:
        process.stop()
    # Only whole successful answers count: an error costs less than a proxied answer.
    if measured["requests"] <= 0 or measured["non_2xx"] or measured["socket_errors"]:
        raise BenchError(f"{target}: errors under load: {measured}")
    return 1e6 * used / measured["requests"], measured["throughput_rps"]


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    record = provenance("bench/proxy_cpu.py")  # dated at the start, as every benchmark
    checkouts = [str(Path(c).resolve()) for c in args.checkout] or [str(ROOT)]
    if len(set(checkouts)) != len(checkouts):
        raise BenchError("a checkout is given twice")
    for checkout in checkouts:
        if not (Path(checkout) / "sidecar" / "__main__.py").is_file():
            raise BenchError(f"--checkout {checkout}: not a kvgate checkout")
    targets = [*checkouts, *([BARE] if args.bare else [])]
    if len(targets) < 2:
        raise BenchError("give two checkouts, or one and --bare: the figures are comparisons")
    nginx, wrk = find_tool("nginx", "nginx"), find_tool("wrk", "wrk")
    tokenizer = Path(args.tokenizer).expanduser()
    runs: dict[str, list[tuple[float, float]]] = {t: [] for t in targets}
    with temporary_directory("kvgate-proxy-cpu-") as tmp:
        upstream_port = free_port()
        (tmp / "upstream.conf").write_text(upstream_config(
            tmp, upstream_port, canned_bodies(local_prompt_ids(tokenizer))))
        upstream = Process("canned upstream", [
            nginx, "-p", str(tmp), "-e", str(tmp / "upstream.err"), "-c",
            str(tmp / "upstream.conf"), "-g", "daemon off;"], tmp / "upstream.out")
        url = f"http://127.0.0.1:{upstream_port}"
        try:
            upstream.start()
            wait_http(url + "/health", upstream)
            for round_ in range(args.rounds):
                for target in targets if round_ % 2 == 0 else targets[::-1]:
                    runs[target].append(_one(target, tmp, url, tokenizer, wrk, args))
        finally:
            upstream.stop()
    return record | {
        "benchmark": "proxy_cpu",
        "setup": {"rounds": args.rounds, "duration_s": args.duration, "stream": args.stream,
                  "unique": args.unique, "connections": CONNECTIONS},
        "targets": [{
            "target": target,
            # The commit, and whether sidecar/ differs from it (a hash of its sources).
            "revision": None if target == BARE else kvgate_revision(Path(target)),
            "cpu_us_per_request": [round(us, 1) for us, _ in runs[target]],
            "requests_per_s": [round(rps) for _, rps in runs[target]],
        } for target in targets],
    }


def print_report(report: dict[str, Any]) -> None:
    print(provenance_line(report))
    print()
    setup = report["setup"]
    print(f"{'streamed' if setup['stream'] else 'non-streamed'}, "
          f"{'unique' if setup['unique'] else 'identical'} prompts, {setup['rounds']} rounds "
          f"of {setup['duration_s']:g} s")
    rows = []
    for entry in report["targets"]:
        cpu, rps = entry["cpu_us_per_request"], entry["requests_per_s"]
        revision = entry["revision"]
        if isinstance(revision, str):  # the first results kept only the commit
            revision = {"commit": revision}
        name = (entry["target"] if revision is None else f"kvgate {revision.get('commit')}"
                + (" (+ uncommitted)" if revision.get("sidecar_uncommitted_changes") else "")
                + (" compiled" if revision.get("compiled_modules") else ""))
        rows.append([name, f"{statistics.median(cpu):.1f}",
                     " / ".join(f"{v:.1f}" for v in cpu), f"{statistics.median(rps):.0f}"])
    print(render_table(["target", "CPU us / request (median)", "each round", "req/s (median)"],
                       rows))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=(
        "Example: git worktree add /tmp/base HEAD~1 && python bench/proxy_cpu.py "
        "--checkout /tmp/base --checkout . --bare"))
    parser.add_argument("--checkout", action="append", default=[],
                        help="a kvgate checkout to run (repeat; default: this one)")
    parser.add_argument("--bare", action="store_true", help="the bare aiohttp proxy too")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--duration", type=float, default=4.0, help="measured seconds")
    parser.add_argument("--stream", action="store_true", help="streamed requests")
    parser.add_argument("--unique", action="store_true",
                        help="unique prompts (a request number appended)")
    parser.add_argument("--tokenizer", default=str(Path(os.environ.get(
        "KVGATE_MODELS_DIR", Path.home() / ".cache" / "kvgate" / "models")) / "tiny-qwen3"),
        help="the tokenizer kvgate counts with and the canned /tokenize answers from")
    parser.add_argument("--out", default=str(RESULTS / "proxy_cpu.json"))
    args = parser.parse_args()
    if args.rounds < 1 or args.duration <= 0:
        parser.error("--rounds and --duration must be positive")
    return args


if __name__ == "__main__":
    raise SystemExit(benchmark_main("bench/proxy_cpu.py", parse_args, benchmark, print_report))
