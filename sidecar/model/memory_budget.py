"""How much GPU memory vLLM leaves for the KV cache.

vLLM measures it at start-up:

    available_kv = total_memory x gpu_memory_utilization
                   - weights - peak activations of a dummy forward pass over
                     max_num_batched_tokens tokens - non-torch memory

and logs `Available KV cache memory: X GiB`. When that figure is known (from a log
or from the server's own `vllm:cache_config_info`), use it: capacity then follows
exactly. Otherwise this module estimates the two terms that are not weights:

- activation peak: the dummy pass keeps, per token, the MLP's gate/up output and
  its activation (3 x intermediate / tp elements; for MoE the top-k experts' share,
  bounded by the fused-MoE chunk) plus three hidden-size buffers (input, residual,
  output), in the activation dtype; the sampler's dummy run adds fp32 logits for
  max_num_seqs sequences over the whole vocabulary (logits are gathered to full
  vocabulary on the rank that samples, and the pool follows the smallest rank);
- non-torch memory: the CUDA context, cuBLAS workspaces and, with TP > 1, NCCL
  buffers: 0.4 GiB plus 0.2 GiB with TP > 1.

Calibration, on the public start-up logs in tests/data/groundtruth (`python
bench/model_accuracy.py`, kinds kv_budget and kv_tokens_est):

- Activation slope: two V0 logs of Llama-3.1-8B on one RTX 3090 that differ only in
  max_model_len (20,000 vs 29,000, which V0 also profiles as batched tokens) lose
  0.92 +- 0.01 GiB of KV (3.81 -> 2.89 GiB), i.e. 108,600-111,000 B per token.
  3 x 14,336 + 3 x 4,096 elements in bf16 give 110,592 B (0.927 GiB); the earlier
  four hidden buffers gave 118,784 B (0.996 GiB, outside the interval).
- Residual "utilization x memory - weights - KV" where a log gives all three: 2.42
  and 3.34 GiB for those two V0 logs (the model: 2.58 and 3.51), 0.54 GiB for
  R1-Distill-Qwen-14B at TP2 with 2,048 tokens (model 0.88; the other worker had
  1.2 GiB less KV), 1.24 GiB for gpt-oss-20b and 1.33 GiB for gemma-4-26B-A4B on
  2026 (0.19-era) vLLM on A100s (model 0.76 and 0.75). Where a log gives no weights,
  against the model's weights: four Qwen2-7B logs on vLLM 0.10 (TP1 and TP2) leave
  0.19 GiB more KV than the model, Qwen3-8B on vLLM 0.21 0.13 GiB less. So non-torch
  memory grew with vLLM versions: ~0.2-0.4 GiB in the V0 and 0.10 logs, 0.5-1.0 GiB
  in the 0.19-0.21 logs; 0.4 GiB sits between. The NCCL term is the TP2 - TP1
  difference of the same Qwen2-7B deployment (0.19 GiB). Median error of the
  estimated budget over the 12 logs with a utilization: 2.7%.
- Not reproduced: two H100 logs of large MoE models (gpt-oss-120b at TP1 with 1,024
  batched tokens, Qwen3-235B-A22B-FP8 at TP4; 2025 vLLM) leave 6.4-6.5 GiB less KV
  than the model: with the model's weights, their non-KV, non-weight memory is
  7.7-8.0 GiB. Neither the activation nor the sampler terms come near it, and the
  A100 logs rule out a sampler that large.
"""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.model.architecture import ModelArchitecture
from sidecar.model.units import GIB

NON_TORCH_BYTES = int(0.4 * GIB)
NCCL_BYTES = int(0.2 * GIB)
_HIDDEN_BUFFERS = 3
_MOE_CHUNK_TOKENS = 32768


@dataclass(frozen=True)
class MemoryBudget:
    total_bytes: int
    utilization: float
    weights_bytes: int
    activation_bytes: int
    non_torch_bytes: int

    @property
    def kv_budget_bytes(self) -> int:
        usable = int(self.total_bytes * self.utilization)
        return usable - self.weights_bytes - self.activation_bytes - self.non_torch_bytes


def activation_peak_bytes(
    arch: ModelArchitecture,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    tp: int,
    activation_bytes: int = 2,
) -> int:
    widest = max((layer.mlp.activation_width(tp) for layer in arch.layers), default=0)
    tokens = max_num_batched_tokens
    moe_tokens = min(tokens, _MOE_CHUNK_TOKENS) if arch.is_moe else tokens
    per_token = widest * activation_bytes
    hidden = _HIDDEN_BUFFERS * arch.hidden_size * activation_bytes * tokens
    sampler = max_num_seqs * arch.vocab_size * 4
    return moe_tokens * per_token + hidden + sampler


def non_torch_bytes(tp: int) -> int:
    return NON_TORCH_BYTES + (NCCL_BYTES if tp > 1 else 0)
