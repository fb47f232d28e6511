"""The worked examples of the two seed documents (shared/seeds, restated in English in
the analytical-model reference), reproduced by the model - with seed 002's one
inconsistency corrected: Qwen3's config sets head_dim 128, so its KV is 112 KiB per
token, not 56 KiB."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sidecar.model import (
    ChainCall,
    Deployment,
    DeploymentError,
    Efficiency,
    ServedModel,
    chain,
    custom_gpu,
    parse_config,
    read_architecture,
)
from sidecar.model.latency import Prefill
from sidecar.model.planning import concurrency_by_littles_law, kv_concurrency_limit
from sidecar.model.units import GIB

MIB = 1024**2


def served(name: str, **deployment: object) -> ServedModel:
    return ServedModel(read_architecture(name), Deployment(**deployment))  # type: ignore[arg-type]


def test_kv_per_token_8b_class_model() -> None:
    # Seed 000 4.2: 32 layers x 8 KV heads x head_dim 128 x fp16: 2*32*8*128*2 = 131,072 B.
    model = served("meta-llama/Meta-Llama-3.1-8B")
    assert model.kv_bytes_per_token == 131_072
    # 8,192 tokens of context: 1 GiB per request; a batch of 4: 4 GiB.
    assert model.kv_bytes_per_sequence(8192) == 1 * GIB
    assert 4 * model.kv_bytes_per_sequence(8192) == 4 * GIB


@pytest.mark.parametrize(
    ("preset", "layers", "kv_per_token"),
    [
        # Seed 002 4.5 quick-reference table (bf16, head_dim 128 for Qwen3 dense).
        ("Qwen/Qwen3-0.6B", 28, 114_688),
        ("Qwen/Qwen3-1.7B", 28, 114_688),
        ("Qwen/Qwen3-4B", 36, 147_456),
        ("Qwen/Qwen3-8B", 36, 147_456),
        ("Qwen/Qwen3-14B", 40, 163_840),
        ("Qwen/Qwen3-32B", 64, 262_144),
        ("Qwen/Qwen3-30B-A3B", 48, 98_304),
        ("Qwen/Qwen3-235B-A22B", 94, 192_512),
        ("deepseek-ai/DeepSeek-R1", 61, 70_272),
    ],
)
def test_seed_kv_table(preset: str, layers: int, kv_per_token: int) -> None:
    model = served(preset)
    assert model.arch.num_layers == layers
    assert model.kv_bytes_per_token == kv_per_token


def test_seed_full_context_totals() -> None:
    # "Full context" column: Qwen3-8B at 128K ~ 18 GB, DeepSeek-R1 at 160K ~ 10.7 GB.
    assert served("Qwen/Qwen3-8B").kv_bytes_per_sequence(131_072) / GIB == pytest.approx(18.0)
    assert served("deepseek-ai/DeepSeek-R1").kv_bytes_per_sequence(163_840) / GIB == (
        pytest.approx(10.72, abs=0.01)
    )


GLM5_LIKE = {
    # The fields seed 002 quotes from GLM-5's public config.
    "model_type": "glm_moe_dsa",
    "hidden_size": 6144,
    "num_hidden_layers": 78,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "kv_lora_rank": 512,
    "q_lora_rank": 2048,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 192,
    "v_head_dim": 256,
    "index_head_dim": 128,
    "index_n_heads": 32,
    "index_topk": 2048,
    "vocab_size": 154_880,
    "max_position_embeddings": 202_752,
    "torch_dtype": "bfloat16",
}


def test_glm5_mla_plus_dsa_indexer() -> None:
    model = ServedModel(parse_config(GLM5_LIKE, "glm-5"))
    # 1,152 B latent + 132 B indexer per layer per token, x 78 layers.
    assert model.kv_bytes_per_token == 78 * (1152 + 132) == 100_152
    # Full context (202,752 tokens) ~ 18.9 GB (the seed's 1024-based GB).
    assert model.kv_bytes_per_sequence(202_752) / GIB == pytest.approx(18.9, abs=0.05)
    # fp8_ds_mla: 656 B latent + 132 B indexer = 61,464 B per token.
    fp8 = ServedModel(parse_config(GLM5_LIKE, "glm-5"), Deployment(kv_cache_dtype="fp8"))
    assert fp8.kv_bytes_per_token == 78 * (656 + 132) == 61_464


DSV4_LIKE = {
    "model_type": "deepseek_v4",
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "head_dim": 512,
    "q_lora_rank": 1536,
    "sliding_window": 128,
    "index_head_dim": 128,
    "compress_ratios": [4] * 30 + [128] * 31,
    "vocab_size": 129_280,
    "intermediate_size": 18_432,
    "max_position_embeddings": 1_048_576,
    "torch_dtype": "bfloat16",
}


def test_deepseek_v4_cross_token_compression() -> None:
    s = 1_048_576
    # Seed 002 4.6.3 counts per c4a layer a bf16 window (128 x 1,024 B), the compressed
    # latent (262,144 x 1,024 B) and a bf16 indexer (262,144 x 256 B). vLLM 0.32 stores
    # the indexer in fp8 (128 + 4 B scale) and keeps fp32 compressor states beside them
    # (tests/test_vllm_planner_capacity.py checks the layout against vLLM's planner).
    rows = ServedModel(parse_config(DSV4_LIKE, "dsv4"),
                       Deployment(attention_backend="FLASHINFER_MLA_SPARSE_DSV4"))
    c4 = [(spec.kind, spec.sequence_bytes(s)) for spec in rows.kv_specs[:5]]
    assert c4 == [("indexer", 262_144 * 132), ("compressor state", 8 * 2 * 2 * 128 * 4),
                  ("window", 128 * 1024), ("compressed", 262_144 * 1024),
                  ("compressor state", 8 * 2 * 2 * 512 * 4)]
    assert sum(size for _, size in c4) / MIB == pytest.approx(289.20, abs=0.01)
    # vLLM's default backend on every CUDA GPU stores fp8_ds_mla: 584 B per latent.
    default = ServedModel(parse_config(DSV4_LIKE, "dsv4"))
    assert {spec.token_bytes for spec in default.kv_specs if spec.kind == "window"} == {584}
    with pytest.raises(DeploymentError, match="fp8_ds_mla"):
        ServedModel(parse_config(DSV4_LIKE, "dsv4"), Deployment(kv_cache_dtype="bfloat16"))
    # Short sequences: min(S, W) replaces the window.
    window = next(spec for spec in rows.kv_specs if spec.kind == "window")
    assert window.sequence_bytes(64) == 64 * 1024


def test_qwen3_06b_capacity_on_a100_corrected() -> None:
    # Seed 002 7: 40 GiB - 1.12 GiB weights - 1.4 GiB overhead = 37.48 GiB for KV.
    model = served("Qwen/Qwen3-0.6B", available_kv_bytes=int(37.48 * GIB))
    assert model.weights_bytes / GIB == pytest.approx(1.12, abs=0.02)
    assert model.capacity is not None
    # With head_dim 128 (112 KiB per token) the capacity is ~350,900 tokens, not ~701,800.
    assert model.capacity.kv_capacity_tokens == pytest.approx(350_900, rel=1e-4)
    tokens = model.capacity.kv_capacity_tokens
    assert [tokens // s for s in (512, 4096, 32_768)] == [685, 85, 10]


def test_decode_floor_is_weights_over_bandwidth() -> None:
    # Seed 000 3.1: 7B fp16 = 14 GB read per token; at 1 TB/s: 14 ms, ~71 tokens/s.
    gpu = custom_gpu(80, 1000, 300)
    ideal = Efficiency(compute=1.0, bandwidth=1.0, per_layer_s=0.0, per_step_s=0.0)
    model = ServedModel(read_architecture("meta-llama/Llama-2-7b-hf"), Deployment(), gpu, ideal)
    step = model.roofline.step((), [1]) if model.roofline else None
    assert step is not None and step.bound == "memory"
    assert step.memory_s == pytest.approx(model.weights.bytes_read_per_step(1.0) / 1e12, rel=1e-3)
    # Llama-2-7B streams 6.6 B parameters per step (its 6.74 B less the embedding table,
    # which is only looked up): 13.2 ms, where the seed's round "7B" gives 14 ms.
    assert step.memory_s == pytest.approx(0.014, rel=0.06)
    # At 500 GB/s the floor doubles (~35 tokens/s).
    slow = ServedModel(model.arch, Deployment(), custom_gpu(80, 500, 300), ideal)
    assert slow.roofline is not None
    assert slow.roofline.step((), [1]).memory_s == pytest.approx(2 * step.memory_s, rel=1e-6)


def test_the_kv_cache_streams_at_its_own_share_of_the_bandwidth() -> None:
    # A decode batch reads the weights once and each sequence's KV cache: at a KV share
    # r, the KV bytes take 1 / r as long as the weights' bytes do, the weights' the same.
    gpu = custom_gpu(80, 1000, 300)
    ideal = Efficiency(compute=1.0, bandwidth=1.0, per_layer_s=0.0, per_step_s=0.0)
    arch = read_architecture("meta-llama/Llama-2-7b-hf")
    full = ServedModel(arch, Deployment(), gpu, ideal).roofline
    quarter = ServedModel(arch, Deployment(), gpu, replace(ideal, kv_bandwidth_ratio=0.25)
                          ).roofline
    assert full is not None and quarter is not None
    contexts = [4096] * 16
    weights_s = full.weights.bytes_read_per_step(1.0) / 1e12
    one, slow = full.step((), contexts), quarter.step((), contexts)
    kv_s = one.memory_s - weights_s  # the KV cache read and written, at full speed
    assert kv_s > weights_s  # 16 x 4,096 tokens of a 7B model: more KV than weights
    assert slow.memory_s == pytest.approx(weights_s + kv_s / 0.25, rel=1e-9)
    assert slow.bytes == one.bytes  # the same bytes, more slowly


def test_arithmetic_intensity_and_balance_point() -> None:
    # Seed 000 3.2-3.3: decode ~1 FLOP/byte (fp16), prefill of T tokens ~T FLOP/byte;
    # a 100 TFLOPS / 2 TB/s GPU balances at 50 FLOP/byte.
    gpu = custom_gpu(80, 2000, 100)
    model = ServedModel(read_architecture("meta-llama/Llama-2-7b-hf"), Deployment(), gpu)
    assert model.roofline is not None
    decode = model.roofline.step((), [1])
    assert decode.flops / decode.bytes == pytest.approx(1.0, rel=0.1)
    assert decode.bound == "memory"
    prefill = model.roofline.step([Prefill(1024)])
    assert prefill.flops / prefill.bytes == pytest.approx(1024, rel=0.2)
    assert prefill.bound == "compute"


def test_littles_law_and_kv_for_the_seed_example() -> None:
    # Seed 000 5.3: 500 tokens at 50 tokens/s = 10 s; 2 requests/s -> 20 in flight;
    # 4,096-token contexts at 128 KiB/token = 512 MiB each, 10 GiB for 20.
    assert concurrency_by_littles_law(2.0, 500 / 50) == 20
    model = served("meta-llama/Meta-Llama-3.1-8B")
    assert model.kv_bytes_per_sequence(4096) == 512 * MIB
    assert 20 * model.kv_bytes_per_sequence(4096) == 10 * GIB


def test_kv_margin_limits_concurrency() -> None:
    # Plan at 70-80% of the theoretical capacity.
    model = served("meta-llama/Meta-Llama-3.1-8B", available_kv_bytes=10 * GIB,
                   max_model_len=4096)
    assert model.capacity is not None
    full = model.capacity.usable_blocks // model.blocks_for_request(4096)
    assert kv_concurrency_limit(model, 4096, margin=1.0) == full
    assert kv_concurrency_limit(model, 4096, margin=0.8) == int(0.8 * model.capacity.usable_blocks
                                                                 // 256)


def test_chain_sums_calls_and_prefix_cache_saves_prefill() -> None:
    # Seed 000 6.4: three calls of 1000/200, 1500/300, 2000/500 tokens.
    model = ServedModel(read_architecture("Qwen/Qwen3-8B"), Deployment(),
                        custom_gpu(80, 3350, 989))
    calls = [ChainCall(1000, 200), ChainCall(1500, 300), ChainCall(2000, 500)]
    cold = chain(model, calls, prefix_cache=False)
    warm = chain(model, calls, prefix_cache=True)
    assert cold is not None and warm is not None
    assert cold.prefill_tokens == 4500
    # Call 2 reuses call 1's 1000 + 200 tokens but the last output token, which vLLM
    # samples and never computes, in whole blocks of 16 as vLLM does: 1,199 tokens are
    # 74 full blocks (1,184 tokens); call 3 reuses 1,799 tokens: 112 blocks (1,792).
    assert [c.cached_tokens for c in warm.calls] == [0, 1184, 1792]
    assert warm.prefill_tokens == 1000 + 316 + 208
    assert cold.total_s == pytest.approx(sum(c.ttft_s + c.decode_s for c in cold.calls))
    assert warm.total_s < cold.total_s
    # Decode dominates this chain: 1,000 output tokens.
    assert sum(c.decode_s for c in cold.calls) > sum(c.ttft_s for c in cold.calls)
