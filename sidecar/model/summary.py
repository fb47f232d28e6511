"""The plan of a served model as one JSON-ready object: what `kvgate plan --json`
prints and what a running sidecar answers on GET /kvgate/v1/plan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sidecar.model.errors import ModelError
from sidecar.model.planning import (
    ChainCall,
    LatencyEstimate,
    chain,
    kv_concurrency_limit,
    recommend,
    shared_prefix_blocks,
    steady_latency,
)
from sidecar.model.served import ServedModel
from sidecar.model.simulator_plan import PlanSimulator
from sidecar.model.units import GIB


@dataclass(frozen=True)
class PlanInput:
    served: ServedModel
    sequence_tokens: int
    prompt_tokens: int
    output_tokens: int
    concurrency: int
    arrival_rate: float | None
    ttft_slo_s: float | None
    tpot_slo_s: float | None
    kv_margin: float
    chain: tuple[ChainCall, ...]
    prefix_cache: bool
    shared_prefix_tokens: int = 0  # at the start of every prompt (system prompt, tools)
    # The plan of a server that runs (GET /kvgate/v1/plan): it started, so it fits.
    server_running: bool = False


def compute_plan(plan: PlanInput) -> dict[str, Any]:
    """The plan as one JSON-ready object (the `--json` contract)."""
    served = plan.served
    arch = served.arch
    capacity = served.capacity
    budget = served.memory_budget
    shared_prefix = plan.shared_prefix_tokens if plan.prefix_cache else 0
    # The closed form prices the requests that run at once: no more than the server's
    # sequences and, at their peak, its KV cache hold (the rest wait, which it does not
    # see).
    running = plan.concurrency
    fit = kv_concurrency_limit(served, plan.prompt_tokens + plan.output_tokens, 1.0,
                               output_tokens=plan.output_tokens,
                               shared_prefix_tokens=shared_prefix)
    running = min(running, served.max_num_seqs, max(1, fit) if fit is not None else running)
    latency = steady_latency(served, plan.prompt_tokens, plan.output_tokens, running,
                             shared_prefix)
    rec = recommend(
        served,
        plan.prompt_tokens,
        plan.output_tokens,
        plan.arrival_rate,
        plan.ttft_slo_s,
        plan.tpot_slo_s,
        plan.kv_margin,
        shared_prefix,
    )
    kv_budget = served.kv_budget_bytes
    problems = [] if plan.server_running else fit_problems(served)
    # None: not known (no GPU and no logged budget); False: vLLM would refuse to start.
    fits = False if problems else (None if capacity is None else True)
    targets_met = _targets_met(rec.latency_at_max, plan.ttft_slo_s, plan.tpot_slo_s)
    result: dict[str, Any] = {
        "model": arch.name,
        "model_type": arch.model_type,
        "gpu": served.gpu.name if served.gpu else None,
        "tp": served.deployment.tp,
        # Engines with a KV pool each: the capacity figures below are per engine.
        "data_parallel_size": served.deployment.data_parallel_size,
        "weight_precision": served.weight_precision.label,
        "kv_cache_element_bytes": served.kv_element_bytes,
        "block_size": served.block_size,
        "max_model_len": served.max_model_len,
        "max_num_batched_tokens": served.max_num_batched_tokens,
        "params_total": arch.params_total(),
        "params_active": arch.params_active(),
        "weights_bytes": served.weights_bytes,
        "kv_bytes_per_token": round(served.kv_bytes_per_token),
        "sequence_tokens": plan.sequence_tokens,
        "kv_bytes_per_sequence": round(served.kv_bytes_per_sequence(plan.sequence_tokens)),
        "kv_layout": served.layout.describe(),
        "request_kv_blocks": request_blocks(served, plan.prompt_tokens, plan.output_tokens),
        "shared_prefix": shared_prefix_summary(served, plan, shared_prefix),
        "kv_budget_bytes": kv_budget,
        "kv_budget_source": "given" if served.deployment.available_kv_bytes else (
            "estimated" if budget else None),
        "activation_peak_bytes": budget.activation_bytes if budget else None,
        "non_torch_bytes": budget.non_torch_bytes if budget else None,
        "cudagraph_bytes": budget.cudagraph_bytes if budget else None,
        "cudagraphs": dict(zip(("piecewise", "full"), served.cudagraph_counts, strict=True)),
        "vllm_version": ".".join(map(str, served.deployment.vllm_version)),
        "num_gpu_blocks": capacity.num_blocks if capacity else None,
        "bytes_per_block": capacity.bytes_per_block if capacity else None,
        "blocks_per_max_len_request": capacity.blocks_per_request if capacity else None,
        "kv_capacity_tokens": capacity.kv_capacity_tokens if capacity else None,
        "max_concurrency": capacity.max_concurrency if capacity else None,
        "prompt_tokens": plan.prompt_tokens,
        "output_tokens": plan.output_tokens,
        "concurrency": plan.concurrency,
        "closed_form_running": running,
        "ttft_s": latency.ttft_s if latency else None,
        "tpot_s": latency.tpot_s if latency else None,
        "e2e_s": latency.e2e_s if latency else None,
        "prefill_bound": latency.prefill_bound if latency else None,
        "decode_bound": latency.decode_bound if latency else None,
        "efficiency": served.efficiency.as_dict(),
        "fits": fits,
        "fit_problems": problems,
        "ttft_p90_s": None,
        "tpot_p90_s": None,
        "throughput_requests_per_s": None,
        "recommendation": {
            "source": None if rec.latency_at_max is None else "closed-form",
            "max_num_seqs": rec.max_num_seqs,
            "limited_by": rec.limited_by,
            "kv_margin": plan.kv_margin,
            "arrival_rate": plan.arrival_rate,
            "concurrency_needed": rec.concurrency_needed,
            "replicas": rec.replicas,
            "gpu_memory_utilization": served.deployment.gpu_memory_utilization,
            "ttft_s_at_max": rec.latency_at_max.ttft_s if rec.latency_at_max else None,
            "tpot_s_at_max": rec.latency_at_max.tpot_s if rec.latency_at_max else None,
            "ttft_p90_s_at_max": None,
            "tpot_p90_s_at_max": None,
            "throughput_per_replica_per_s": None,
            "targets_met": targets_met,
            "per_replica_open_loop": None,
        },
    }
    if problems:
        # Nothing to recommend for a server that does not start.
        result["recommendation"].update({
            "source": None, "max_num_seqs": None, "limited_by": None,
            "concurrency_needed": None, "replicas": None, "ttft_s_at_max": None,
            "tpot_s_at_max": None, "targets_met": None,
        })
    if plan.chain:
        estimate = chain(served, plan.chain, plan.prefix_cache, plan.concurrency)
        result["chain"] = None if estimate is None else {
            "prefix_cache": plan.prefix_cache,
            "total_s": estimate.total_s,
            "prefill_tokens": estimate.prefill_tokens,
            "calls": [
                {"input_tokens": c.call.input_tokens, "output_tokens": c.call.output_tokens,
                 "cached_tokens": c.cached_tokens, "ttft_s": c.ttft_s, "decode_s": c.decode_s}
                for c in estimate.calls
            ],
        }
    return result




def fit_problems(served: ServedModel) -> list[str]:
    """Why vLLM would refuse to start this deployment, in words; empty when it starts or
    when that is not known (no GPU and no logged budget). A KV budget the server logged
    says its weights fit: they are not estimated again; with --num-gpu-blocks-override
    vLLM skips its own check of the KV memory, not the weights."""
    budget = served.memory_budget
    capacity = served.capacity
    deployment = served.deployment
    if deployment.available_kv_bytes is not None:
        budget = None
    if budget is not None and served.weights_bytes >= budget.total_bytes * budget.utilization:
        return [f"the weights take {served.weights_bytes / GIB:,.2f} GiB per GPU, more than "
                f"--gpu-memory-utilization {budget.utilization:g} of "
                f"{budget.total_bytes / GIB:,.2f} GiB"]
    kv_budget = None if budget is None else budget.kv_budget_bytes
    if kv_budget is not None and kv_budget <= 0 and not deployment.num_gpu_blocks_override:
        return [f"no memory is left for the KV cache ({kv_budget / GIB:,.2f} GiB after weights, "
                "activations and CUDA graphs)"]
    if capacity is not None and not capacity.fits_one_request:
        tokens = capacity.usable_blocks * served.block_size
        return [f"one request of --max-model-len {served.max_model_len:,} tokens needs "
                f"{capacity.blocks_per_request:,} KV blocks and the cache holds "
                f"{capacity.usable_blocks:,} (about {tokens:,} tokens): lower --max-model-len "
                "or give the KV cache more memory"]
    return []


def _targets_met(latency: LatencyEstimate | None, ttft_slo_s: float | None,
                 tpot_slo_s: float | None) -> bool | None:
    """Whether the closed form meets the targets at the recommendation (None without
    targets or latency)."""
    if latency is None or (ttft_slo_s is None and tpot_slo_s is None):
        return None
    return ((ttft_slo_s is None or latency.ttft_s <= ttft_slo_s)
            and (tpot_slo_s is None or latency.tpot_s <= tpot_slo_s))


def request_blocks(served: ServedModel, prompt_tokens: int, output_tokens: int) -> dict[str, int]:
    """The blocks one request of this shape holds over its life (`model.lifecycle`)."""
    lifecycle = served.lifecycle
    return {
        "peak": lifecycle.peak_blocks(prompt_tokens, output_tokens),
        "prefill": lifecycle.blocks_now(prompt_tokens, 0),
        "decoding": lifecycle.peak_blocks(prompt_tokens, output_tokens, 2)
        if output_tokens > 2 else lifecycle.blocks_now(prompt_tokens, max(1, output_tokens - 1)),
        "final": lifecycle.blocks_now(prompt_tokens, max(1, output_tokens - 1)),
    }


def shared_prefix_summary(served: ServedModel, plan: PlanInput,
                          shared_prefix_tokens: int) -> dict[str, Any] | None:
    """How much KV a prefix every request shares saves at the plan's concurrency."""
    if shared_prefix_tokens <= 0:
        return None
    shared = shared_prefix_blocks(served, shared_prefix_tokens, plan.prompt_tokens)
    peak = served.lifecycle.peak_blocks(plan.prompt_tokens, plan.output_tokens)
    concurrency = max(1, plan.concurrency)
    without = kv_concurrency_limit(served, plan.prompt_tokens + plan.output_tokens,
                                   plan.kv_margin, output_tokens=plan.output_tokens)
    return {
        "tokens": shared_prefix_tokens,
        "shared_blocks_per_request": shared,
        "kv_blocks_per_request": peak,
        "kv_blocks_at_concurrency": shared + concurrency * (peak - shared),
        "kv_blocks_saved_at_concurrency": (concurrency - 1) * shared,
        "max_concurrency_without_sharing": without,
    }


def plan_under_load(result: dict[str, Any], inputs: PlanInput) -> str | None:
    """Latency at the plan's concurrency and the recommendation from the engine simulator
    (`model.simulator_plan`), into `compute_plan`'s result, the closed form kept under
    `closed_form`. Without a GPU or a KV cache size the closed form stays
    (`latency_source`); when the simulator cannot run the workload, the reason is
    returned and the closed form stays."""
    served = inputs.served
    result["latency_source"] = None if result["ttft_s"] is None else "closed-form"
    result["closed_form"] = {key: result[key] for key in ("ttft_s", "tpot_s", "e2e_s")}
    if served.roofline is None or served.capacity is None or not result["fits"]:
        return None
    simulator = PlanSimulator(served, inputs.prompt_tokens, inputs.output_tokens,
                              inputs.shared_prefix_tokens if inputs.prefix_cache else 0)
    try:
        point = simulator.closed_loop(inputs.concurrency)
        rec = simulator.recommend(inputs.arrival_rate, inputs.ttft_slo_s, inputs.tpot_slo_s,
                                  inputs.kv_margin)
    except ModelError as exc:
        return str(exc)
    result.update({
        "latency_source": "simulator",
        "ttft_s": point.ttft_p50_s, "ttft_p90_s": point.ttft_p90_s,
        "tpot_s": point.tpot_p50_s, "tpot_p90_s": point.tpot_p90_s,
        "e2e_s": point.e2e_mean_s,
        "throughput_requests_per_s": point.throughput_per_s,
    })
    result["recommendation"].update({
        "source": "simulator",
        "max_num_seqs": rec.max_num_seqs,
        "limited_by": rec.limited_by,
        "concurrency_needed": rec.concurrency_needed,
        "replicas": rec.replicas,
        "ttft_s_at_max": rec.at_max.ttft_p50_s,
        "tpot_s_at_max": rec.at_max.tpot_p50_s,
        "ttft_p90_s_at_max": rec.at_max.ttft_p90_s,
        "tpot_p90_s_at_max": rec.at_max.tpot_p90_s,
        "throughput_per_replica_per_s": rec.at_max.throughput_per_s,
        "targets_met": rec.targets_met,
        "per_replica_open_loop": None if rec.per_replica is None else
        rec.per_replica.as_dict(),
    })
    return None
