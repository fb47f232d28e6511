"""`kvgate simulate`: replay a trace against the served model in the engine simulator,
as vLLM alone and as kvgate would gate it.

Imports only the pure model, like `kvgate plan`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sidecar.cli.args import Parser, fraction
from sidecar.cli.served_args import add_served_model_args, gpu_from_args, served_model_from_args
from sidecar.cli.table import render
from sidecar.model import ModelError, ServedModel, gpu_names
from sidecar.model.simulator import EngineConfig, KvgateGate, Trace, parse_trace, simulate

DESCRIPTION = """\
Replay a trace of requests against a model served by vLLM, in kvgate's engine
simulator: vLLM V1's scheduling loop step by step (continuous batching, chunked
prefill within --max-num-batched-tokens, --max-num-seqs, KV blocks per request with
prefix caching, preemption by recompute when the cache is full), each step priced by
kvgate's roofline. It runs the trace twice:

  vLLM alone      every request goes straight to vLLM's queue;
  through kvgate  a request is sent only when the KV blocks reserved for the requests
                  already sent (each at its peak, a prefix group's shared blocks
                  once) fit in --kv-target-ratio of the cache; the others wait in
                  arrival order, and a request that can never fit is refused
                  (never_fits).

and prints, for each, TTFT, TPOT, inter-token latency and end-to-end time
(p50/p90/p99), throughput, preemptions and KV use: a what-if for tuning
--max-num-seqs, the KV cache size and the target ratio before serving.

The trace is JSON lines, one request each:
  {"arrival_s": 0.0, "prompt_tokens": 512, "output_tokens": 128}
  {"arrival_s": 0.1, "prompt_tokens": 900, "output_tokens": 64,
   "prefix_group": "agent", "prefix_tokens": 700, "priority": 0}
arrival_s is seconds from the start; prefix_group/prefix_tokens say which requests
share their first tokens (a system prompt); lower priority values go first with
--policy priority. Times are the roofline's: calibrate it (--calibration) for a
specific server.
"""

EPILOG = """\
examples:
  kvgate simulate --model Qwen/Qwen3-8B --gpu H100 --trace trace.jsonl
  kvgate simulate --model meta-llama/Meta-Llama-3.1-8B --gpu L40S --max-num-seqs 64 \\
      --num-gpu-blocks-override 4000 --trace trace.jsonl --json

Exit codes: 0 ok, 2 bad input (the message names what is wrong, for a trace its line
and field). Known GPUs: """


def build_parser(prog: str = "kvgate simulate") -> Parser:
    parser = Parser(prog=prog, description=DESCRIPTION, epilog=EPILOG + ", ".join(gpu_names()),
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    add_served_model_args(parser)
    vllm = next(group for group in parser._action_groups if group.title == "vLLM settings")
    vllm.add_argument("--policy", choices=("fcfs", "priority"), default="fcfs",
                      help="vLLM's --scheduling-policy (default: fcfs)")
    sim = parser.add_argument_group("simulation")
    sim.add_argument("--trace", type=Path, required=True, metavar="FILE",
                     help="the requests: JSON lines (see above)")
    sim.add_argument("--kv-target-ratio", type=fraction, default=0.95, metavar="F",
                     help="share of the KV cache kvgate reserves up to (default: 0.95, "
                          "as `kvgate serve`)")
    sim.add_argument("--calibration", "--calibration-file", type=Path, metavar="FILE",
                     help="efficiencies saved by a live sidecar (GET /kvgate/v1/calibration)")
    sim.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def _served(args: argparse.Namespace) -> ServedModel:
    if gpu_from_args(args) is None:
        raise ModelError("the simulator prices every step by roofline: give --gpu "
                         "(or --gpu-memory-gib, --gpu-bandwidth-gbps and --gpu-tflops)")
    return served_model_from_args(args)


def _read_trace(path: Path) -> Trace:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ModelError(f"--trace {path}: cannot read ({exc.strerror})") from exc
    except UnicodeDecodeError:
        raise ModelError(f"--trace {path}: not UTF-8 text") from None
    return Trace(parse_trace(text.splitlines(), str(path)))


def run_simulation(args: argparse.Namespace) -> dict[str, Any]:
    served = _served(args)
    capacity = served.capacity
    if capacity is not None and not capacity.fits_one_request:
        raise ModelError(f"the KV cache ({capacity.usable_blocks:,} usable blocks) does not "
                         f"hold one request of --max-model-len {served.max_model_len:,} "
                         f"tokens ({capacity.blocks_per_request:,} blocks): vLLM would not "
                         "start; lower --max-model-len or give more KV")
    trace = _read_trace(args.trace)
    config = EngineConfig.of(served, policy=args.policy,
                             prefix_caching=not args.no_prefix_cache)
    alone = simulate(served, trace, config)
    gated = simulate(served, trace, config, KvgateGate(args.kv_target_ratio))
    requests = trace.requests
    arrivals = [r.arrival_s for r in requests]
    return {
        "model": served.arch.name,
        "gpu": served.gpu.name if served.gpu else None,
        "tp": served.deployment.tp,
        "settings": {
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "long_prefill_token_threshold": config.long_prefill_token_threshold,
            "block_size": served.block_size,
            "usable_blocks": config.usable_blocks,
            "policy": config.policy,
            "prefix_caching": config.prefix_caching,
            "async_scheduling": config.async_scheduling,
            "host_shares_device": config.host_shares_device,
            "kv_target_ratio": args.kv_target_ratio,
        },
        "trace": {
            "path": str(args.trace),
            "requests": len(requests),
            "duration_s": max(arrivals) - min(arrivals),
            "mean_prompt_tokens": sum(r.prompt_tokens for r in requests) / len(requests),
            "mean_output_tokens": sum(r.output_tokens for r in requests) / len(requests),
        },
        "vllm": alone.summary(),
        "kvgate": gated.summary(),
    }


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:,.1f} ms" if value < 1 else f"{value:,.2f} s"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"


def format_report(result: dict[str, Any]) -> str:
    settings, trace = result["settings"], result["trace"]
    head = (f"{result['model']} on {result['gpu']} x{result['tp']}: "
            f"{settings['usable_blocks']:,} KV blocks of {settings['block_size']} tokens, "
            f"--max-num-seqs {settings['max_num_seqs']}, --max-num-batched-tokens "
            f"{settings['max_num_batched_tokens']:,}, "
            + (f"--long-prefill-token-threshold {settings['long_prefill_token_threshold']:,}, "
               if settings["long_prefill_token_threshold"] else "")
            + f"{settings['policy']}, prefix cache "
            f"{'on' if settings['prefix_caching'] else 'off'}"
            + ("" if settings["async_scheduling"] else ", no asynchronous scheduling")
            + (", the API server on the engine's cores (CPU build)"
               if settings["host_shares_device"] else ""))
    lead = (f"Trace {trace['path']}: {trace['requests']:,} requests over "
            f"{trace['duration_s']:,.1f} s, {trace['mean_prompt_tokens']:,.0f} prompt + "
            f"{trace['mean_output_tokens']:,.0f} output tokens on average")
    paths = (result["vllm"], result["kvgate"])

    def row(label: str, cell: Any) -> list[str]:
        return [label, *(cell(p) for p in paths)]

    rows = [
        row("served", lambda p: f"{p['completed']:,}"),
        row("refused (never fits)", lambda p: f"{p['rejected']:,}"),
        row("preemptions", lambda p: f"{p['preemptions']:,} ({p['preempted_requests']:,} "
                                     f"requests)"),
        row("tokens recomputed", lambda p: f"{p['recomputed_tokens']:,}"),
        row("prefix-cache hits (tokens)", lambda p: f"{p['cached_tokens']:,}"),
    ]
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"),
                       ("e2e_s", "E2E")):
        rows.append(row(f"{label} p50 / p90 / p99",
                        lambda p, k=key: " / ".join(_ms(p[k][q]) for q in ("p50", "p90",
                                                                            "p99"))))
    rows += [
        row("throughput (requests/s)", lambda p: _rate(p["throughput_requests_per_s"])),
        row("output tokens/s", lambda p: _rate(p["throughput_output_tokens_per_s"])),
        row("KV blocks peak / mean", lambda p: f"{p['kv']['peak_blocks']:,} / "
                                               f"{p['kv']['mean_blocks']:,.0f}"),
        row("engine steps", lambda p: f"{p['steps']:,}"),
        row("last request done", lambda p: _ms(p["makespan_s"])),
    ]
    table = render(rows, ["", "vLLM alone",
                          f"through kvgate (target {settings['kv_target_ratio']:g})"])
    return "\n".join([head, lead, "", table])


def run(argv: Sequence[str], prog: str = "kvgate simulate") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        result = run_simulation(args)
    except (ModelError, ValueError) as exc:
        parser.error(str(exc))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_report(result))
    return 0
