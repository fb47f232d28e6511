"""The engine simulator schedules as vLLM 0.32's own scheduler does: the same number of
steps and the same preemptions, request by request.

`support/vllm_scheduler.py` runs vLLM's `AsyncScheduler` with its KV cache manager under
the vLLM CPU build's python, with no model: a stand-in model runner samples a token
wherever a step reaches the end of a request's tokens, two batches in flight as the
engine core keeps them with asynchronous scheduling, or vLLM's `Scheduler` one step at
a time as the CPU build runs it (`-sync` cases). Cases: a full-attention pool too small
for three requests (preemption by recompute), one where 9 of 64 requests fit and the
rest wait for blocks to free, a sliding-window / full-attention hybrid whose third
request must wait for a window's chunked prefill to fit (vLLM's admission check), and
gpt-oss-120b's bursts on one H100's 6,582-block pool (GPUStack's rows in
tests/data/groundtruth/latency.csv)."""

from __future__ import annotations

import json
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from sidecar.model import Deployment, ServedModel, custom_gpu, parse_config, read_architecture
from sidecar.model.gpu import find_gpu
from sidecar.model.simulator import EngineConfig, SimRequest, Trace, simulate

from support.admission_fixtures import TINY_LLAMA
from support.env import model_dir, vllm_python

pytestmark = [pytest.mark.vllm]

ORACLE = Path(__file__).parent / "support" / "vllm_scheduler.py"
GPT_OSS_120B = Path(__file__).parent / "data" / "groundtruth" / "configs" / (
    "openai__gpt-oss-120b.json")


HYBRID = {**TINY_LLAMA, "model_type": "gemma2", "num_hidden_layers": 2, "head_dim": 32,
          "sliding_window": 128, "query_pre_attn_scalar": 32,
          "layer_types": ["sliding_attention", "full_attention"]}


def served(config: dict[str, Any], blocks: int, chunk: int, max_len: int,
           seqs: int, long_prefill: int = 0) -> ServedModel:
    return ServedModel(parse_config({**config, "max_position_embeddings": max_len}, "tiny"),
                       Deployment(block_size=16, max_model_len=max_len,
                                  num_gpu_blocks_override=blocks, max_num_batched_tokens=chunk,
                                  max_num_seqs=seqs, long_prefill_token_threshold=long_prefill),
                       custom_gpu(16, 100, 1))


def _gpt_oss_on_h100() -> ServedModel:
    # The pool kvgate sizes for the row (vLLM's planner gives the same on that budget).
    return ServedModel(read_architecture(GPT_OSS_120B),
                       Deployment(max_model_len=32_768, num_gpu_blocks_override=6_582),
                       find_gpu("H100"))


# name: (model, requests, asynchronous scheduling)
CASES: dict[str, tuple[Any, list[tuple[int, int]], bool]] = {
    "full-attention-small-pool": (lambda: served(TINY_LLAMA, 20, 2048, 4096, 256),
                                  [(100, 150)] * 3, True),
    # 9 fit at once (7 blocks each, 63 usable), the rest wait for blocks to free: a
    # step sooner without asynchronous scheduling (20 steps against 27)
    "full-attention-queue": (lambda: served(TINY_LLAMA, 64, 2048, 4096, 256),
                             [(100, 1 + k % 4) for k in range(64)], True),
    "hybrid-window-waits": (lambda: served(HYBRID, 236, 128, 1140, 64), [(1024, 100)] * 3,
                            True),
    # --long-prefill-token-threshold 200: prompts of 1,000-3,000 tokens get 200 tokens a
    # step while another request is eligible; the last one left, the whole budget.
    "long-prefill-threshold": (lambda: served(TINY_LLAMA, 512, 2048, 4096, 256, 200),
                               [(1_000, 40), (3_000, 8), (700, 60), (2_500, 3)], True),
    "long-prefill-threshold-alone": (lambda: served(TINY_LLAMA, 512, 2048, 4096, 256, 200),
                                     [(300, 2), (3_000, 4)], True),
    # ... and with a pool too small for all of them at once (preemptions).
    "long-prefill-threshold-small-pool": (lambda: served(TINY_LLAMA, 150, 1024, 4096, 256,
                                                         200),
                                          [(1_000, 200), (1_200, 150), (900, 250)], True),
    "gpt-oss-120b-h100-32000x100": (_gpt_oss_on_h100, [(32_000, 100)] * 100, True),
    "gpt-oss-120b-h100-2000x500": (_gpt_oss_on_h100, [(2_000, 100)] * 500, True),
}
# The same without asynchronous scheduling, as vLLM's CPU build runs.
CASES.update({f"{name}-sync": (make, requests, False)
              for name, (make, requests, _) in list(CASES.items())
              if name != "gpt-oss-120b-h100-32000x100"})


def _case(model: ServedModel, requests: list[tuple[int, int]],
          asynchronous: bool) -> dict[str, Any]:
    capacity = model.capacity
    assert capacity is not None
    return {
        "model_dir": str(model_dir("tiny-gemma2")),  # the model config vLLM asks for
        "block_size": model.block_size,
        "max_num_batched_tokens": model.max_num_batched_tokens,
        "max_num_seqs": model.max_num_seqs,
        "max_model_len": model.max_model_len,
        "num_blocks": capacity.num_blocks,
        "groups": [{"kind": group.spec.kind, "window": getattr(group.spec, "window", None)}
                   for group in model.layout.groups],
        "requests": requests,
        "async_scheduling": asynchronous,
        "long_prefill_token_threshold": model.long_prefill_cap,
    }


@cache
def vllm_runs() -> dict[str, dict[str, Any]]:
    """vLLM's scheduler on every case, in one run of the vLLM python."""
    request = [_case(make(), requests, asynchronous)
               for make, requests, asynchronous in CASES.values()]
    proc = subprocess.run([vllm_python(), str(ORACLE)], input=json.dumps(request),
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs: list[dict[str, Any]] = json.loads(proc.stdout)
    return dict(zip(CASES, runs, strict=True))


@pytest.mark.parametrize("name", list(CASES))
def test_steps_and_preemptions_equal_vllms_scheduler(name: str) -> None:
    make, requests, asynchronous = CASES[name]
    model = make()
    assert {g.spec.kind for g in model.layout.groups} <= {"full", "sliding"}
    result = simulate(model, Trace([SimRequest(0.0, p, o) for p, o in requests]),
                      EngineConfig.of(model, async_scheduling=asynchronous))
    expected = vllm_runs()[name]
    assert expected["finished"] == len(requests)
    assert all(r.finish_s is not None for r in result.records)
    assert result.steps == expected["steps"]
    assert [r.preemptions for r in result.records] == expected["preemptions"]
