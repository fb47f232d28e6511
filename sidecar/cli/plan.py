"""`kvgate plan`: capacity planning for a model on a GPU, offline.

Imports only the pure model, so `kvgate plan --json` starts fast.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sidecar.cli.args import Parser, fraction, positive_float, positive_int
from sidecar.cli.served_args import add_served_model_args, served_model_from_args
from sidecar.cli.table import render
from sidecar.model import (
    ChainCall,
    ModelError,
    gpu_names,
    presets,
)
from sidecar.model.planning import DEFAULT_KV_MARGIN
from sidecar.model.simulator import simulate_plan
from sidecar.model.summary import PlanInput, compute_plan, plan_under_load
from sidecar.model.units import GIB

DESCRIPTION = """\
Plan a vLLM deployment from the model's config.json and the GPU's figures: weights per
GPU, KV cache bytes per token and per sequence, the KV budget, the KV cache size and
maximum concurrency exactly as vLLM logs them at start-up; TTFT/TPOT/E2E at the given
concurrency, the recommended --max-num-seqs under the TTFT/TPOT targets and the replica
count for an arrival rate, from the engine simulator (vLLM's scheduler step by step,
each step priced by the roofline), with the one-request closed form beside them.
"""

EPILOG = """\
examples:
  kvgate plan --model Qwen/Qwen3-8B --gpu H100
  kvgate plan --model meta-llama/Llama-3.1-70B-Instruct --gpu H100 --tp 4
  kvgate plan --model ./my-model/ --gpu L40S --tp 2 --kv-cache-dtype fp8 --json
  kvgate plan --model meta-llama/Meta-Llama-3.1-8B --available-kv-gib 3.81 \\
      --max-model-len 20000 --json        # capacity from the budget vLLM logged
  kvgate plan --model Qwen/Qwen3-8B --gpu A100-80GB --prompt-tokens 2000 \\
      --output-tokens 500 --arrival-rate 4 --tpot-slo-ms 50 --print vllm-args

Exit codes: 0 ok (also when no deployment meets the TTFT/TPOT targets: the report says
NOT MET, --print notes it on stderr); 1 the deployment does not fit (vLLM would refuse to
start: the report says why, and --print prints no arguments); 2 bad input (the message
names what is wrong).
Known GPUs: """


# The request planned when none is given.
DEFAULT_PROMPT_TOKENS = 1024
DEFAULT_OUTPUT_TOKENS = 256


def build_parser(prog: str = "kvgate plan") -> Parser:
    parser = Parser(
        prog=prog,
        description=DESCRIPTION,
        epilog=EPILOG + ", ".join(gpu_names()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_served_model_args(parser)

    load = parser.add_argument_group("workload")
    load.add_argument("--sequence-tokens", type=positive_int, metavar="S",
                      help="tokens of one sequence for kv_bytes_per_sequence "
                           "(default: max-model-len)")
    load.add_argument("--prompt-tokens", type=positive_int, metavar="P",
                      help=f"prompt tokens per request (default: {DEFAULT_PROMPT_TOKENS}, "
                           "less where --max-model-len is shorter)")
    load.add_argument("--output-tokens", type=positive_int, metavar="O",
                      help=f"output tokens per request (default: {DEFAULT_OUTPUT_TOKENS})")
    load.add_argument("--concurrency", type=positive_int, default=1, metavar="C",
                      help="clients in a closed loop (each sends its next request when the "
                      "previous one ends) for TTFT/TPOT/E2E (default: 1)")
    load.add_argument("--arrival-rate", type=positive_float, metavar="R",
                      help="requests per second: sizes replicas (simulated throughput and "
                      "targets) and requests in flight (Little's law)")
    load.add_argument("--ttft-slo-ms", type=positive_float, metavar="MS",
                      help="TTFT target for the p90: caps the recommended --max-num-seqs "
                      "and raises replicas")
    load.add_argument("--tpot-slo-ms", type=positive_float, metavar="MS",
                      help="TPOT target for the p90: caps the recommended --max-num-seqs "
                      "and raises replicas")
    load.add_argument("--kv-margin", type=fraction, default=DEFAULT_KV_MARGIN, metavar="F",
                      help="share of the KV cache the recommended --max-num-seqs fills "
                      "with every request at its peak: room left for requests longer than "
                      "planned (default: %(default)s; `kvgate serve` admits up to its "
                      "--kv-target-ratio, 0.95, and its /kvgate/v1/plan plans with that)")
    load.add_argument("--chain", metavar="IN:OUT,...",
                      help="a multi-call chain (agent/RAG), e.g. 1000:200,1500:300,2000:500: "
                           "prints its total latency")
    load.add_argument("--shared-prefix-tokens", type=positive_int, metavar="T", default=0,
                      help="tokens at the start of every prompt that all requests share (a "
                      "system prompt, tool definitions): held once in the KV cache and not "
                      "prefilled again")
    load.add_argument("--calibration", "--calibration-file", type=Path, metavar="FILE",
                      help="efficiencies saved by a live sidecar (GET /kvgate/v1/calibration)")
    load.add_argument("--simulate", action="store_true",
                      help="also print the engine simulator's full summaries (`kvgate "
                      "simulate`) of this workload: a closed loop of --concurrency clients "
                      "started one request's time apart and, with --arrival-rate, a Poisson "
                      "open loop at that rate on one replica (needs a GPU)")

    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object")
    out.add_argument("--print", dest="emit", choices=("report", "vllm-args", "helm-values"),
                     default="report",
                     help="what to print: the report (default), the recommended vLLM "
                          "arguments, or Helm values for the kvgate chart")
    return parser


def _parse_chain(text: str | None) -> tuple[ChainCall, ...]:
    if not text:
        return ()
    calls = []
    for part in text.split(","):
        head, sep, tail = part.strip().partition(":")
        try:
            inputs, outputs = int(head), int(tail)
        except ValueError:
            raise ModelError(f"--chain entry {part.strip()!r} is not IN:OUT integers") from None
        if not sep or inputs <= 0 or outputs <= 0:
            raise ModelError(f"--chain entry {part.strip()!r} is not IN:OUT positive integers")
        calls.append(ChainCall(inputs, outputs))
    return tuple(calls)


def _check_chain(calls: tuple[ChainCall, ...], max_model_len: int) -> tuple[ChainCall, ...]:
    """A chain whose every call fits in max_model_len (vLLM cuts a longer one's output,
    or refuses it: it would not be the chain planned)."""
    for number, call in enumerate(calls, 1):
        if call.input_tokens + call.output_tokens > max_model_len:
            raise ModelError(
                f"--chain call {number} ({call.input_tokens:,}:{call.output_tokens:,}) is "
                f"{call.input_tokens + call.output_tokens:,} tokens, more than --max-model-len "
                f"{max_model_len:,}: vLLM would cut its output there (0.32) or refuse it "
                "(0.20 and before)")
    return calls


def _note(line: str) -> None:
    print(f"kvgate plan: note: {line}", file=sys.stderr)


def _request_tokens(args: argparse.Namespace, max_model_len: int) -> tuple[int, int]:
    """The planned request's prompt and output tokens. A request the user gave that is
    longer than max_model_len is bad input (vLLM cuts its output there or refuses it:
    not the request planned); the default one is shortened to fit, with a note."""
    prompt, output = args.prompt_tokens, args.output_tokens
    default = DEFAULT_PROMPT_TOKENS + DEFAULT_OUTPUT_TOKENS
    if prompt is None and output is None and default > max_model_len:
        output = max(1, min(DEFAULT_OUTPUT_TOKENS, max_model_len // 4))
        prompt = max(1, max_model_len - output)
        _note(f"the default request ({DEFAULT_PROMPT_TOKENS:,} + {DEFAULT_OUTPUT_TOKENS:,} "
              f"tokens) is longer than --max-model-len {max_model_len:,}: latency is planned "
              f"for {prompt:,} + {output:,} (give --prompt-tokens and --output-tokens)")
        return prompt, output
    prompt = DEFAULT_PROMPT_TOKENS if prompt is None else prompt
    output = DEFAULT_OUTPUT_TOKENS if output is None else output
    if prompt + output > max_model_len:
        raise ModelError(
            f"--prompt-tokens {prompt:,} + --output-tokens {output:,} = {prompt + output:,} "
            f"tokens is more than --max-model-len {max_model_len:,}: vLLM would cut its output "
            "there (0.32) or refuse it (0.20 and before); raise --max-model-len or plan "
            "shorter requests")
    return prompt, output


def plan_input(args: argparse.Namespace) -> PlanInput:
    served = served_model_from_args(args, _note)
    prompt_tokens, output_tokens = _request_tokens(args, served.max_model_len)
    if args.shared_prefix_tokens > prompt_tokens:
        raise ModelError(
            f"--shared-prefix-tokens {args.shared_prefix_tokens:,} is more than --prompt-tokens "
            f"{prompt_tokens:,}: the shared prefix is the start of every prompt")
    if args.sequence_tokens and args.sequence_tokens > served.max_model_len:
        raise ModelError(f"--sequence-tokens {args.sequence_tokens:,} is more than --max-model-len "
                         f"{served.max_model_len:,}: no sequence grows past it")
    context = served.arch.context
    if context.limit is not None and served.max_model_len > context.limit:
        _note(f"--max-model-len {served.max_model_len:,} is beyond the model's "
              f"{context.source} ({context.limit:,}): vLLM refuses it unless "
              "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 is set")
    return PlanInput(
        served=served,
        sequence_tokens=args.sequence_tokens or served.max_model_len,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        concurrency=args.concurrency,
        arrival_rate=args.arrival_rate,
        ttft_slo_s=args.ttft_slo_ms / 1000 if args.ttft_slo_ms else None,
        tpot_slo_s=args.tpot_slo_ms / 1000 if args.tpot_slo_ms else None,
        kv_margin=args.kv_margin,
        chain=_check_chain(_parse_chain(args.chain), served.max_model_len),
        prefix_cache=not args.no_prefix_cache,
        shared_prefix_tokens=args.shared_prefix_tokens,
    )


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GIB:,.2f} GiB"


def _ms(value: float | None) -> str:
    if value is None:
        return "- (needs a GPU)"
    return f"{value * 1000:,.1f} ms" if value < 1 else f"{value:,.2f} s"


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _indent(text: str) -> str:
    return "\n".join("  " + line if line else line for line in text.splitlines())


def _closed_form_label(result: dict[str, Any]) -> str:
    running = result["closed_form_running"]
    if running == result["concurrency"]:
        return "closed form (one prefill beside c - 1 decodes)"
    return f"closed form (one prefill beside {running - 1:,} decodes: what runs at once)"


def format_report(result: dict[str, Any]) -> str:
    head = (
        f"{result['model']} ({result['model_type']}) on "
        f"{result['gpu'] or 'no GPU given'} x{result['tp']}"
        + (f" per engine, {result['data_parallel_size']} engines (data parallel)"
           if result["data_parallel_size"] > 1 else "")
        + f", weights {result['weight_precision']},"
        f" KV {result['kv_cache_element_bytes']} B/element, block {result['block_size']} tokens"
    )
    params = (f"{result['params_total'] / 1e9:,.2f} B / {result['params_active'] / 1e9:,.2f} B")
    model_rows = [
        ["parameters (total / active)", params],
        ["weights per GPU", _gib(result["weights_bytes"])],
        ["KV per token (all layers)", f"{result['kv_bytes_per_token']:,} B"],
        [f"KV per sequence of {result['sequence_tokens']:,} tokens",
         _gib(result["kv_bytes_per_sequence"])],
    ]
    model_rows += [["KV cache group", line] for line in result["kv_layout"]]
    memory_rows = [
        ["KV budget per GPU", f"{_gib(result['kv_budget_bytes'])} ({result['kv_budget_source']})"
         if result["kv_budget_bytes"] is not None else "- (give --gpu or --available-kv-gib)"],
    ]
    if result["activation_peak_bytes"] is not None:
        memory_rows[:0] = [
            ["activation peak + non-torch", f"{_gib(result['activation_peak_bytes'])} + "
                                            f"{_gib(result['non_torch_bytes'])}"],
            [f"CUDA graphs (vLLM {result['vllm_version']})", _graphs_cell(result)],
        ]
    memory_rows += [
        ["KV cache blocks", f"{_count(result['num_gpu_blocks'])} x "
                            f"{_count(result['bytes_per_block'])} B"],
        ["KV cache size (vLLM's log)", f"{_count(result['kv_capacity_tokens'])} tokens"],
        [f"max concurrency @ {result['max_model_len']:,} tokens",
         "-" if result["max_concurrency"] is None else f"{result['max_concurrency']:.2f}x"],
        ["fits", _fits_cell(result)],
    ]
    simulated = result.get("latency_source") == "simulator"
    closed = result.get("closed_form") or {}
    if simulated:
        latency_rows = [
            ["TTFT p50 / p90", f"{_ms(result['ttft_s'])} / {_ms(result['ttft_p90_s'])}"
             f"{_bound(result['prefill_bound'])}"],
            ["TPOT p50 / p90", "- (one output token)" if result["tpot_s"] is None
             else f"{_ms(result['tpot_s'])} / {_ms(result['tpot_p90_s'])}"
             f"{_bound(result['decode_bound'])}"],
            ["E2E mean", _ms(result["e2e_s"])],
            [_closed_form_label(result),
             f"TTFT {_ms(closed.get('ttft_s'))}, TPOT {_ms(closed.get('tpot_s'))}"],
        ]
    else:
        latency_rows = [
            ["TTFT", f"{_ms(result['ttft_s'])}{_bound(result['prefill_bound'])}"],
            ["TPOT", f"{_ms(result['tpot_s'])}{_bound(result['decode_bound'])}"],
            ["E2E = TTFT + (output - 1) x TPOT", _ms(result["e2e_s"])],
        ]
    rec = result["recommendation"]
    plan_rows = [
        ["recommended --max-num-seqs", "- (the deployment does not fit)"
         if rec["max_num_seqs"] is None
         else f"{rec['max_num_seqs']} (limited by {rec['limited_by']})"],
    ]
    if rec.get("ttft_p90_s_at_max") is not None:
        seats = rec["max_num_seqs"]
        plan_rows.append([f"p90 at {seats:,} {'client' if seats == 1 else 'clients'}",
                          f"TTFT {_ms(rec['ttft_p90_s_at_max'])}, "
                          + ("" if rec["tpot_p90_s_at_max"] is None
                             else f"TPOT {_ms(rec['tpot_p90_s_at_max'])}, ")
                          + f"{rec['throughput_per_replica_per_s']:,.2f} req/s per replica"])
    if rec.get("targets_met") is False:
        plan_rows.append(["targets", "NOT MET, even at the recommendation (see p90 above)"
                          if rec.get("source") == "simulator"
                          else "NOT MET, even at 1 (closed form)"])
    if rec["concurrency_needed"] is not None:
        plan_rows.append([f"in flight at {rec['arrival_rate']:g} req/s (Little's law)",
                          f"{rec['concurrency_needed']:,.1f}"])
        replicas, engines = rec["replicas"], result["data_parallel_size"]
        plan_rows.append(["replicas needed", f"{replicas:,}" if engines == 1 or replicas is None
                          else f"{replicas} engines: {-(-replicas // engines)} server(s) of "
                               f"--data-parallel-size {engines}, or {replicas} pods of the "
                               "chart (one engine each)"])
    blocks = result["request_kv_blocks"]
    plan_rows.append(["KV blocks one request holds", f"{blocks['peak']:,} at its peak "
                      f"({blocks['prefill']:,} prefilling, {blocks['decoding']:,} decoding)"])
    shared = result.get("shared_prefix")
    if shared:
        plan_rows.append([f"shared prefix of {shared['tokens']:,} tokens",
                          f"{shared['shared_blocks_per_request']:,} blocks held once; saves "
                          f"{shared['kv_blocks_saved_at_concurrency']:,} blocks at "
                          f"{result['concurrency']} running"])
        without = shared["max_concurrency_without_sharing"]
        plan_rows.append(["--max-num-seqs without sharing",
                          "-" if without is None else f"{without:,}"])
    parts = [
        head,
        "",
        "Model",
        _indent(render(model_rows)),
        "",
        "Memory per GPU",
        _indent(render(memory_rows)),
        "",
        f"Latency: {result['prompt_tokens']:,} prompt + {result['output_tokens']:,} output "
        + (f"tokens, {result['concurrency']:,} "
           + ("client" if result["concurrency"] == 1 else "clients") + " (simulated closed loop)"
           if simulated else f"tokens, {result['closed_form_running']:,} running"
           + ("" if result["closed_form_running"] == result["concurrency"]
              else f" (of {result['concurrency']:,} clients: what runs at once)")),
        _indent(render(latency_rows)),
        "",
        "Plan",
        _indent(render(plan_rows)),
    ]
    if "simulated" in result:
        parts += _simulated_report(result["simulated"], result["fits"] is False)
    chain_result = result.get("chain")
    if chain_result:
        rows = [[str(i + 1), f"{c['input_tokens']:,}", f"{c['output_tokens']:,}",
                 f"{c['cached_tokens']:,}", _ms(c["ttft_s"]), _ms(c["decode_s"])]
                for i, c in enumerate(chain_result["calls"])]
        parts += ["", f"Chain (prefix cache {'on' if chain_result['prefix_cache'] else 'off'}): "
                      f"total {_ms(chain_result['total_s'])}",
                  _indent(render(rows, ["call", "input", "output", "cached", "TTFT", "decode"]))]
    return "\n".join(parts)


def _fits_cell(result: dict[str, Any]) -> str:
    if result["fits"] is None:
        return "- (give --gpu or --available-kv-gib)"
    if result["fits"]:
        return "yes"
    return "NO: " + "; ".join(result["fit_problems"])


def _bound(bound: str | None) -> str:
    return "" if bound is None else f" ({bound}-bound)"


def _simulated(inputs: PlanInput) -> dict[str, Any] | None:
    served = inputs.served
    if served.roofline is None or served.capacity is None:
        return None
    return simulate_plan(served, inputs.prompt_tokens, inputs.output_tokens,
                         inputs.concurrency, inputs.arrival_rate,
                         inputs.shared_prefix_tokens if inputs.prefix_cache else 0)


def _simulated_report(runs: dict[str, Any] | None, does_not_fit: bool) -> list[str]:
    if runs is None:
        return ["", "Simulated: - (the deployment does not fit)" if does_not_fit
                else "Simulated: - (the engine simulator needs a GPU)"]

    def pair(run: dict[str, Any], key: str) -> str:
        return f"{_ms(run[key]['p50'])} / {_ms(run[key]['p90'])}"

    rows = []
    for name, run in runs.items():
        label = (f"closed loop, {run['clients']:,} "
                 f"{'client' if run['clients'] == 1 else 'clients'}" if name == "closed_loop"
                 else f"open loop, {run['rate_per_s']:g} req/s")
        rate = run["throughput_requests_per_s"]
        rows.append([label, pair(run, "ttft_s"), pair(run, "tpot_s"), pair(run, "e2e_s"),
                     "-" if rate is None else f"{rate:,.2f}", f"{run['preemptions']:,}"])
    count = next(iter(runs.values()))["requests"]
    return ["", f"Simulated (engine simulator, {count:,} requests each)",
            _indent(render(rows, ["workload", "TTFT p50 / p90", "TPOT p50 / p90",
                                  "E2E p50 / p90", "req/s", "preemptions"]))]


def _graphs_cell(result: dict[str, Any]) -> str:
    """What the CUDA graph pool takes out of the KV budget, or why nothing."""
    graphs = result["cudagraphs"]
    if not graphs["piecewise"]:
        return "- (--enforce-eager)"
    if not result["cudagraph_bytes"]:
        return "- (captured after the KV cache before vLLM 0.21)"
    return (f"{_gib(result['cudagraph_bytes'])} ({graphs['piecewise']} piecewise + "
            f"{graphs['full']} full)")


def served_flags(args: argparse.Namespace) -> list[str]:
    """The vLLM flags, besides those the recommendation sets, for the server the plan
    describes: each setting given to `kvgate plan` that changes how vLLM runs."""
    flags: list[str] = []
    if args.dtype in ("bfloat16", "float16"):
        flags.append(f"--dtype {args.dtype}")
    elif args.dtype == "fp8":
        flags.append("--quantization fp8")  # vLLM quantizes the weights at load time
    # int8 / int4 describe a quantized checkpoint, which vLLM reads from its config.
    if args.kv_cache_dtype != "auto":
        flags.append(f"--kv-cache-dtype {args.kv_cache_dtype}")
    if args.max_num_batched_tokens is not None:
        flags.append(f"--max-num-batched-tokens {args.max_num_batched_tokens}")
    if args.long_prefill_token_threshold:
        flags.append(f"--long-prefill-token-threshold {args.long_prefill_token_threshold}")
    if args.data_parallel_size > 1:
        flags.append(f"--data-parallel-size {args.data_parallel_size}")
    if args.no_prefix_cache:
        flags.append("--no-enable-prefix-caching")
    if args.num_gpu_blocks_override is not None:
        flags.append(f"--num-gpu-blocks-override {args.num_gpu_blocks_override}")
    if args.attention_backend is not None:
        flags.append(f"--attention-backend {args.attention_backend}")
    if args.mamba_cache_mode is not None:
        flags.append(f"--mamba-cache-mode {args.mamba_cache_mode}")
    for flag, value in (("--mamba-cache-dtype", args.mamba_cache_dtype),
                        ("--mamba-ssm-cache-dtype", args.mamba_ssm_cache_dtype)):
        if value != "auto":
            flags.append(f"{flag} {value}")
    if args.num_speculative_tokens and args.speculative_method:
        config = {"method": args.speculative_method,
                  "num_speculative_tokens": args.num_speculative_tokens}
        flags.append(f"--speculative-config '{json.dumps(config)}'")
    if args.no_async_scheduling:
        flags.append("--no-async-scheduling")
    return flags


def _notes_on_flags_left_out(args: argparse.Namespace) -> None:
    if args.dtype in ("int8", "int4"):
        _note(f"--dtype {args.dtype} describes a quantized checkpoint: vLLM reads its "
              "quantization from the checkpoint's config, so serve one (no flag makes it)")
    if args.num_speculative_tokens and not args.speculative_method:
        _note("--num-speculative-tokens without --speculative-method: give vLLM your own "
              "--speculative-config (its drafter) and the sidecar KVGATE_NUM_SPECULATIVE_"
              "TOKENS; the plan assumed a drafter without KV layers")


def kvgate_env(result: dict[str, Any], args: argparse.Namespace) -> list[dict[str, str]]:
    """The sidecar's KVGATE_* settings for what it cannot learn from the server and the
    plan was given (the chart's kvgate.extraEnv). A CPU build's batched tokens are
    vLLM's CPU default, which the sidecar does not assume."""
    env = {
        "KVGATE_MAX_NUM_BATCHED_TOKENS": args.max_num_batched_tokens
        or (result["max_num_batched_tokens"] if args.cpu_build else None),
        # The sidecar assumes a GPU build's asynchronous scheduling unless told.
        "KVGATE_ASYNC_SCHEDULING": "false" if args.no_async_scheduling or args.cpu_build
        else None,
        "KVGATE_MAMBA_CACHE_MODE": args.mamba_cache_mode,
        "KVGATE_MAMBA_CACHE_DTYPE": None if args.mamba_cache_dtype == "auto"
        else args.mamba_cache_dtype,
        "KVGATE_MAMBA_SSM_CACHE_DTYPE": None if args.mamba_ssm_cache_dtype == "auto"
        else args.mamba_ssm_cache_dtype,
        # With the drafter vLLM is given (no --speculative-config without a method).
        "KVGATE_NUM_SPECULATIVE_TOKENS": args.num_speculative_tokens
        if args.speculative_method else None,
        "KVGATE_SPECULATIVE_METHOD": args.speculative_method,
        "KVGATE_ATTENTION_BACKEND": args.attention_backend,
        # The server does not report it.
        "KVGATE_LONG_PREFILL_TOKEN_THRESHOLD": args.long_prefill_token_threshold or None,
    }
    return [{"name": name, "value": str(value)} for name, value in env.items()
            if value is not None]


def engine_flags(result: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """The vLLM flags beside the model, its sizes and the recommendation: the plan's
    block size, the settings it was given, --enforce-eager when its budget has no CUDA
    graph pool."""
    _notes_on_flags_left_out(args)
    flags = [f"--block-size {result['block_size']}", *served_flags(args)]
    if not result["cudagraphs"]["piecewise"]:
        flags.append("--enforce-eager")
    return flags


def vllm_args(result: dict[str, Any], args: argparse.Namespace) -> str:
    rec = result["recommendation"]
    flags = [
        f"--tensor-parallel-size {result['tp']}",
        f"--max-model-len {result['max_model_len']}",
        f"--max-num-seqs {rec['max_num_seqs']}",
        f"--gpu-memory-utilization {rec['gpu_memory_utilization']}",
        *engine_flags(result, args),
    ]
    # The model positional (vLLM deprecated `vllm serve --model`): a local config's
    # directory, which is what vLLM loads, or the id (a preset's own for its bare name).
    local = _local_directory(args.model)
    model = str(local) if local else _model_names(args.model, str(result["model"]))[0]
    return " \\\n  ".join([f"vllm serve {model}", *flags])


def helm_values(result: dict[str, Any], args: argparse.Namespace) -> str:
    """Values for the kvgate Helm chart (helm/kvgate) from the recommendation."""
    rec = result["recommendation"]
    served_name, directory = _model_names(args.model, str(result["model"]))
    extra = [flag for flag in engine_flags(result, args)
             if not flag.startswith("--data-parallel")]
    if args.data_parallel_size > 1:
        _note("the chart runs one engine per pod (gpu.count is its tensor-parallel size): "
              "--data-parallel-size is left out; scale with replicaCount instead")
    lines = [
        "# Values for the kvgate chart (helm/kvgate), from `kvgate plan`",
        "model:",
        f"  name: {json.dumps(directory)}",
        f"  servedModelName: {json.dumps(served_name)}",
        f"  maxModelLen: {result['max_model_len']}",
        f"  maxNumSeqs: {rec['max_num_seqs']}",
        f"  gpuMemoryUtilization: {rec['gpu_memory_utilization']}",
        "gpu:",
        f"  name: {json.dumps(result['gpu'] or '')}",
        f"  count: {result['tp']}",
        *(['  resource: ""  # a CPU build requests no GPU'] if args.cpu_build else []),
        f"replicaCount: {rec['replicas'] or 1}",
        "vllm:",
        # One flag and its value per list entry: the chart passes each as one argument.
        "  extraArgs: " + json.dumps([part for flag in extra for part in _split_flag(flag)]),
    ]
    env = kvgate_env(result, args)
    if env:
        lines += ["kvgate:", "  extraEnv: " + json.dumps(env)]
    if rec["replicas"]:
        lines += [
            "autoscaling:",
            "  enabled: true",
            f"  minReplicas: {max(1, math.ceil(rec['replicas'] / 2))}",
            f"  maxReplicas: {rec['replicas'] * 2}",
        ]
    return "\n".join(lines)


def _note_load_not_sized(result: dict[str, Any], args: argparse.Namespace) -> None:
    """A note when an arrival rate or latency targets were given and cannot be used:
    without a GPU nothing prices latency (and without a KV budget, no capacity)."""
    if result["fits"] is False or result.get("latency_source") is not None:
        return
    if not (args.arrival_rate or args.ttft_slo_ms or args.tpot_slo_ms):
        return
    unknown = ("neither capacity nor latency is known" if result["fits"] is None
               else "latency is not known")
    _note(f"without a GPU {unknown}: replicas and --max-num-seqs are not sized for the "
          "arrival rate and targets given (give --gpu)")


def _local_directory(model: str) -> Path | None:
    """The directory of a local --model (a config.json or the folder holding it)."""
    local = Path(model).expanduser()
    if not local.exists():
        return None
    return local.parent if local.is_file() else local


def _model_names(model: str, planned: str) -> tuple[str, str]:
    """(the name clients send, the model's directory) for the chart. A local config's
    directory and its configured name; a preset's own id for its bare name or file
    stem; else the id asked for, not the preset of the same architecture that priced
    it (clients send that id)."""
    local = _local_directory(model)
    if local is not None:
        return planned, local.name
    found = presets.match(model)
    served = found.preset if found is not None and found.exact else model
    return served, served.rpartition("/")[2]


def _split_flag(flag: str) -> list[str]:
    """`--name value` as ["--name", "value"], the value unquoted."""
    name, _, value = flag.partition(" ")
    if not value:
        return [name]
    return [name, value[1:-1] if value.startswith("'") and value.endswith("'") else value]


def run(argv: Sequence[str], prog: str = "kvgate plan") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.json and args.emit != "report":
        parser.error(f"--json and --print {args.emit} each say what to print: give one")
    try:
        inputs = plan_input(args)
        result = compute_plan(inputs)
        fallback = plan_under_load(result, inputs)
        if fallback is not None:
            _note(f"{fallback}; latency from the closed form")
        if args.simulate:
            result["simulated"] = None if result["fits"] is False else _simulated(inputs)
    except ModelError as exc:
        parser.error(str(exc))
    except ValueError as exc:  # e.g. a calibration with out-of-range factors
        parser.error(str(exc))
    fits = result["fits"] is not False
    _note_load_not_sized(result, args)
    if args.json:
        print(json.dumps(result, indent=2))
    elif args.emit != "report" and not fits:
        print(f"{prog}: error: the deployment does not fit, so there is nothing to start: "
              + "; ".join(result["fit_problems"]), file=sys.stderr)
    elif args.emit in ("vllm-args", "helm-values"):
        if result["recommendation"].get("targets_met") is False:
            _note("the TTFT/TPOT targets are not met even at this recommendation (the "
                  "report shows its p90s): what is printed sizes the closest deployment")
        print(vllm_args(result, args) if args.emit == "vllm-args" else helm_values(result, args))
    else:
        print(format_report(result))
    return 0 if fits else 1
