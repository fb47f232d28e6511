"""vLLM's own scheduler, run step by step without a model: the engine simulator's
reference. Runs under the vLLM CPU build's python (not the project's venv): reads a JSON
list of cases on stdin and prints, for each, what vLLM's scheduler did.

What comes from vLLM 0.32 itself: the configuration (`EngineArgs.create_engine_config`,
with a local model directory for the model config), the KV cache specs
(`FullAttentionSpec`, `SlidingWindowSpec`), grouping (`get_kv_cache_groups`,
`get_kv_cache_config_from_groups`), and the whole scheduling loop: `AsyncScheduler`
(`Scheduler.schedule`, `update_from_output`) with its `KVCacheManager`, block pool,
prefix caching and preemption.

What stands in for the rest of the engine:
- the model runner: each scheduled request samples one token when its step reaches the
  end of its tokens (`Request.is_prefill_chunk` false after `schedule()`), none for a
  prefill chunk, as the GPU model runner discards a partial prefill's sample;
- `EngineCore.step_with_batch_queue`: with asynchronous scheduling (the GPU default;
  the CPU platform turns it off, so it is turned back on here) the next step is
  scheduled before the previous step's output is processed, two batches at a time;
  a case with `"async_scheduling": false` runs `Scheduler` as `EngineCore.step` does
  (the CPU build's way): each step's output is processed before the next schedule;
- the KV pool size: `num_blocks` as given (`--num-gpu-blocks-override`), one layer per
  kind (the pool's blocks are shared by the groups whatever their layer counts).

Each case: {"model_dir", "block_size", "max_num_batched_tokens", "max_num_seqs",
"max_model_len", "num_blocks", "groups": [{"kind": "full"|"sliding", "window"}],
"requests": [[prompt_tokens, output_tokens], ...] (all sent at once, in that order),
"async_scheduling" (optional, default true), "long_prefill_token_threshold" (optional,
default 0)}.
Each answer: {"steps": steps that scheduled tokens, "preemptions": per request,
"finished": count, "max_running": most requests running at once}.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # no model is run
ANSWER = sys.stdout
sys.stdout = sys.stderr  # vLLM's log handler writes to what stdout is when it is set up

import torch  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

MAX_STEPS = 200_000


def run(case: dict[str, Any]) -> dict[str, Any]:
    block = case["block_size"]
    args = EngineArgs(model=case["model_dir"], max_model_len=case["max_model_len"],
                      max_num_batched_tokens=case["max_num_batched_tokens"],
                      max_num_seqs=case["max_num_seqs"], block_size=block,
                      num_gpu_blocks_override=case["num_blocks"],
                      enable_prefix_caching=True, enable_chunked_prefill=True,
                      long_prefill_token_threshold=case.get("long_prefill_token_threshold", 0))
    config = args.create_engine_config()
    asynchronous = bool(case.get("async_scheduling", True))
    config.scheduler_config.async_scheduling = asynchronous
    batches = 2 if asynchronous else 1
    layout = KVCacheLayout["LBNHC"]  # FlashAttention declares none
    object.__setattr__(config.cache_config, "get_resolved_kv_cache_layout", lambda: layout)
    specs: dict[str, KVCacheSpec] = {}
    for index, group in enumerate(case["groups"]):
        common: dict[str, Any] = {"block_size": block, "num_kv_heads": 1, "head_size": 32,
                                  "dtype": torch.bfloat16}
        specs[f"model.layers.{index}.self_attn.attn"] = (
            SlidingWindowSpec(sliding_window=group["window"], **common)
            if group["kind"] == "sliding" else FullAttentionSpec(**common))
    kv_config = get_kv_cache_config_from_groups(config, get_kv_cache_groups(config, specs),
                                                10**12)
    kv_config.num_blocks = case["num_blocks"]
    config.cache_config.num_gpu_blocks = case["num_blocks"]
    scheduler_class = AsyncScheduler if asynchronous else Scheduler
    scheduler = scheduler_class(vllm_config=config, kv_cache_config=kv_config,
                               structured_output_manager=StructuredOutputManager(config),
                               block_size=block, log_stats=False)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(block, sha256)
    requests = []
    for number, (prompt, output) in enumerate(case["requests"]):
        tokens = [(number * 7919 + j * 31) % 997 + 3 for j in range(prompt)]  # unique
        request = Request(f"r{number}", tokens, SamplingParams(max_tokens=output,
                                                               ignore_eos=True),
                          None, arrival_time=number * 1e-6, block_hasher=hasher)
        requests.append(request)
        scheduler.add_request(request)
    in_flight: list[tuple[Any, dict[str, bool]]] = []
    steps = max_running = 0
    while scheduler.has_requests() or in_flight:
        if scheduler.has_requests():
            output = scheduler.schedule()
            if output.num_scheduled_tokens:
                steps += 1
            chunk = {rid: scheduler.requests[rid].is_prefill_chunk
                     for rid in output.num_scheduled_tokens}
            max_running = max(max_running, len(scheduler.running))
            in_flight.append((output, chunk))
            if len(in_flight) < batches and output.num_scheduled_tokens:
                continue  # the second batch is scheduled while the first runs
        if not in_flight:
            break
        done, chunk = in_flight.pop(0)
        ids = list(done.num_scheduled_tokens)
        scheduler.update_from_output(done, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={rid: k for k, rid in enumerate(ids)},
            sampled_token_ids=[[] if chunk[rid] else [7] for rid in ids]))
        if steps > MAX_STEPS:
            raise RuntimeError("vLLM's scheduler did not finish the case")
    return {"steps": steps, "preemptions": [r.num_preemptions for r in requests],
            "finished": sum(r.is_finished() for r in requests), "max_running": max_running}


if __name__ == "__main__":
    json.dump([run(case) for case in json.load(sys.stdin)], ANSWER)
