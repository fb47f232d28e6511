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
  bounded by the fused-MoE chunk) plus about four hidden-size buffers, in the
  activation dtype; the sampler's dummy run adds fp32 logits for max_num_seqs
  sequences over the vocabulary;
- non-torch memory: the CUDA context, cuBLAS workspaces and, with TP > 1, NCCL
  buffers: 0.4 GiB plus 0.25 GiB with TP > 1.

Calibration: on vLLM's public start-up logs in the project's test data the residual
"utilization x memory - weights - KV" is 0.8-1.4 GiB for 8-32B models with 2,048-8,192
batched tokens, which these terms reproduce to within ~0.5 GiB (see the README's model
accuracy table); the activation slope was checked against a log pair that differs only
in max_model_len (V0 engine: +0.92 GiB for +9,000 tokens on Llama-3.1-8B, the model
gives 0.96 GiB).
"""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.model.architecture import DenseMlp, ModelArchitecture, MoeMlp
from sidecar.model.units import GIB

NON_TORCH_BYTES = int(0.4 * GIB)
NCCL_BYTES = int(0.25 * GIB)
_HIDDEN_BUFFERS = 4
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
    widest = 0
    for layer in arch.layers:
        mlp = layer.mlp
        if isinstance(mlp, MoeMlp):
            per_token = mlp.top_k * mlp.expert_intermediate_size + mlp.shared_intermediate_size
            width = 3 * per_token / tp
            width = min(width, 3 * mlp.num_experts * mlp.expert_intermediate_size / tp)
        elif isinstance(mlp, DenseMlp):
            width = 3 * mlp.intermediate_size / tp
        widest = max(widest, int(width))
    tokens = max_num_batched_tokens
    moe_tokens = min(tokens, _MOE_CHUNK_TOKENS) if arch.is_moe else tokens
    per_token = widest * activation_bytes
    hidden = _HIDDEN_BUFFERS * arch.hidden_size * activation_bytes * tokens
    sampler = max_num_seqs * arch.vocab_size * 4 // tp
    return moe_tokens * per_token + hidden + sampler


def non_torch_bytes(tp: int) -> int:
    return NON_TORCH_BYTES + (NCCL_BYTES if tp > 1 else 0)
