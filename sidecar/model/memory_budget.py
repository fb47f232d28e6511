"""How much GPU memory vLLM leaves for the KV cache.

vLLM measures it at start-up:

    available_kv = total_memory x gpu_memory_utilization
                   - weights - peak activations of a dummy forward pass over
                     max_num_batched_tokens tokens - non-torch memory
                   - CUDA graphs (from vLLM 0.21)

and logs `Available KV cache memory: X GiB`. When that figure is known (from a log
or from the server's own `vllm:cache_config_info`), use it: capacity then follows
exactly. Otherwise this module estimates the terms that are not weights:

- activation peak: the dummy pass keeps, per token, the MLP's gate/up output and
  its activation (3 x intermediate / tp elements; for MoE the top-k experts' share,
  bounded by the fused-MoE chunk) plus three hidden-size buffers (input, residual,
  output), in the activation dtype; the sampler's dummy run adds fp32 logits for
  max_num_seqs sequences over the whole vocabulary (logits are gathered to full
  vocabulary on the rank that samples, and the pool follows the smallest rank);
- non-torch memory: the CUDA context, cuBLAS workspaces and, with TP > 1, NCCL
  buffers: 0.4 GiB plus 0.2 GiB with TP > 1;
- CUDA graphs (vLLM 0.21 and later, unless --enforce-eager): before sizing the KV cache
  vLLM captures graphs into a throwaway pool and subtracts what they took
  (`profile_cudagraph_memory`, `VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS`, on by default
  since 0.21; earlier versions capture after the KV cache, out of the headroom that
  gpu_memory_utilization leaves). Each captured graph keeps its kernel nodes and the
  buffers between the pieces, layer by layer, so the pool grows with layers x graphs:
  each layer's MLP kind says what a graph keeps of it (`cudagraph_bytes_per_graph`:
  0.26 MiB dense, 0.47 MiB MoE, whose router and expert kernels add nodes), the graphs
  counted as vLLM 0.32 chooses them (`cudagraph_counts`).

  Calibration: the median per layer and graph of 23 vLLM 0.19 start-up logs on H100
  (tests/data/groundtruth/cudagraph_memory.csv; 2.5B-70B dense, three MoE; TP 1-4):
  dense 0.185-0.337 MiB, MoE 0.40-0.47 MiB, not changing with TP or hidden size beyond
  that spread. Held out one model at a time, the pool is predicted within 9% (median),
  0.47 GiB at worst (tests/test_cudagraph_memory.py). vLLM 0.32's default model runner
  measures the piecewise graphs in full and extrapolates the full ones, so its estimate
  follows the pool; 0.21's (an LMCache log of Qwen3-8B) estimated 0.52 GiB where this
  gives 0.79.

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
CUDAGRAPH_PROFILED_SINCE = (0, 21)  # vLLM subtracts its graph estimate from the KV budget
_GRAPH_CEILING = 512  # vLLM's default largest capture size (1,024 on Blackwell)
# Model families whose vLLM config sets the largest capture size itself (and then does
# not add max_num_seqs to the sizes): GptOssForCausalLMConfig.verify_and_update_config.
_CAPTURE_CEILING_BY_MODEL_TYPE = {"gpt_oss": 1024}
_HIDDEN_BUFFERS = 3
_MOE_CHUNK_TOKENS = 32768


@dataclass(frozen=True)
class MemoryBudget:
    total_bytes: int
    utilization: float
    weights_bytes: int
    activation_bytes: int
    non_torch_bytes: int
    cudagraph_bytes: int = 0

    @property
    def kv_budget_bytes(self) -> int:
        usable = int(self.total_bytes * self.utilization)
        return (usable - self.weights_bytes - self.activation_bytes - self.non_torch_bytes
                - self.cudagraph_bytes)


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


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int, blackwell: bool = False,
                  model_type: str = "") -> list[int]:
    """The batch sizes vLLM 0.32 captures piecewise graphs for by default
    (`VllmConfig._set_cudagraph_sizes`): 1, 2, 4, then every 8 below 256 and every 16
    from 256, up to min(2 x max_num_seqs, 512 (1,024 on Blackwell), max_num_batched_tokens)
    or the model family's own ceiling, plus max_num_batched_tokens and (without a
    family ceiling) max_num_seqs when they are within it."""
    family = _CAPTURE_CEILING_BY_MODEL_TYPE.get(model_type)
    extra: tuple[int, ...]
    if family is None:
        ceiling = min(2 * max_num_seqs, 1024 if blackwell else _GRAPH_CEILING,
                      max_num_batched_tokens)
        extra = (max_num_batched_tokens, max_num_seqs)
    else:
        ceiling = min(family, max_num_batched_tokens)
        extra = (max_num_batched_tokens,)
    sizes = {size for size in (1, 2, 4) if size <= ceiling}
    sizes.update(range(8, min(ceiling + 1, 256), 8))
    sizes.update(range(256, ceiling + 1, 16))
    sizes.update(size for size in extra if size <= ceiling)
    return sorted(sizes)


def cudagraph_counts(max_num_seqs: int, max_num_batched_tokens: int, blackwell: bool = False,
                     model_type: str = "") -> tuple[int, int]:
    """(piecewise, full) graphs vLLM 0.32 captures by default (FULL_AND_PIECEWISE):
    a piecewise graph per capture size, a full graph per capture size a batch of
    decodes fills (at most max_num_seqs). Assumes an attention backend that supports
    full graphs (chunked local attention's does not: piecewise only)."""
    sizes = capture_sizes(max_num_seqs, max_num_batched_tokens, blackwell, model_type)
    return len(sizes), sum(1 for size in sizes if size <= max_num_seqs)


def cudagraph_bytes(arch: ModelArchitecture, graphs: int) -> int:
    """The graph pool vLLM subtracts from the KV budget for `graphs` graphs, on each
    GPU: what one graph keeps of each layer, by the layer's MLP kind."""
    return graphs * sum(layer.mlp.cudagraph_bytes_per_graph for layer in arch.layers)
