"""Blocks one request costs on the layer kinds vLLM 0.32 allocates differently from
plain attention: MLA + DSA indexer (64-token blocks), DeepSeek-V4 (caches with their
own block sizes in packed groups), Mamba-2 / gated-delta-net hybrids (state groups of
1 or 2 blocks per request, raised attention blocks), MTP drafter layers, and the choices
that depend on the GPU or the server's flags. The figures are vLLM's planner's
(tests/test_vllm_planner_capacity.py checks them against it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.model import Deployment, DeploymentError, ServedModel, parse_config, read_architecture
from sidecar.model.gpu import find_gpu
from sidecar.model.lifecycle import Step
from sidecar.model.units import cdiv

DATA = Path(__file__).parent / "data" / "planner"


def served(model: str, gpu: str = "H100", **deployment: object) -> ServedModel:
    arch = read_architecture(DATA / f"{model}.json")
    return ServedModel(arch, Deployment(max_num_batched_tokens=8192, **deployment),  # type: ignore[arg-type]
                       find_gpu(gpu))


def test_dsa_models_run_at_64_token_blocks_unless_told() -> None:
    glm = served("zai-org__GLM-5.2", tp=8, max_model_len=65_536)
    assert glm.block_size == 64
    # 1,000 prompt + 200 output tokens: cdiv(1,199, 64) = 19 blocks, not the 75 of
    # 16-token blocks.
    assert glm.lifecycle.peak_blocks(1000, 200) == 19
    assert served("zai-org__GLM-5.2", tp=8, block_size=128).block_size == 128


def test_indexshare_layers_keep_no_indexer_cache() -> None:
    # GLM-5.2: index_topk_freq 4, offset 3: layers 0, 1, 2, 6, 10, ... 74 index (21 of 78).
    glm = served("zai-org__GLM-5.2", tp=8)
    kinds = [spec.kind for spec in glm.kv_specs]
    assert kinds.count("mla") == 78
    assert kinds.count("indexer") == 21
    v32 = served("deepseek-ai__DeepSeek-V3.2-Exp", tp=8)
    assert [spec.kind for spec in v32.kv_specs].count("indexer") == 61


def test_fp8_sparse_mla_layout_follows_the_gpu() -> None:
    # Hopper (FlashMLA sparse): fp8_ds_mla, 656 B per token; Blackwell (FlashInfer
    # sparse): plain fp8, 576 B. The indexer keeps 132 B either way.
    hopper = served("deepseek-ai__DeepSeek-V3.2-Exp", "H100", kv_cache_dtype="fp8")
    blackwell = served("deepseek-ai__DeepSeek-V3.2-Exp", "B200", kv_cache_dtype="fp8")
    assert hopper.kv_bytes_per_token == 61 * (656 + 132)
    assert blackwell.kv_bytes_per_token == 61 * (576 + 132)
    assert find_gpu("H100").compute_capability == (9, 0)
    assert find_gpu("B200").compute_capability == (10, 0)


def test_glm_serves_fp8_kv_by_default_on_blackwell_only() -> None:
    assert served("zai-org__GLM-5.2", "B200").kv_cache_dtype == "fp8_e4m3"
    assert served("zai-org__GLM-5.2", "H100").kv_cache_dtype == "auto"
    assert served("deepseek-ai__DeepSeek-V3.2-Exp", "B200").kv_cache_dtype == "auto"


def test_qwen3_next_align_mode_takes_two_state_blocks_per_group() -> None:
    # 36 gated-delta-net layers and 12 full-attention layers: 1 attention group and 3
    # state groups of 12 layers. The attention block is raised to 544 tokens so that an
    # attention page holds a state page.
    model = served("Qwen__Qwen3-Next-80B-A3B-Instruct", max_model_len=131_072)
    assert model.block_size == 544
    assert sorted(g.spec.kind for g in model.layout.groups) == ["full", "state", "state",
                                                                 "state"]
    assert model.lifecycle.peak_blocks(1000, 200) == cdiv(1199, 544) + 3 * 2
    assert model.layout.blocks_budgeted_per_request(131_072, model.in_flight_tokens) == 241 + 6
    assert model.layout.prefix_groups == 1
    assert model.layout.prefix_block_size == 544


def test_without_prefix_caching_state_groups_take_one_block() -> None:
    model = served("Qwen__Qwen3-Next-80B-A3B-Instruct", max_model_len=131_072,
                   enable_prefix_caching=False)
    assert model.deployment.resolved_mamba_cache_mode == "none"
    assert model.lifecycle.peak_blocks(1000, 200) == cdiv(1199, 544) + 3 * 1
    # vLLM's mamba_block_size is then max_model_len.
    assert {g.block_size for g in model.layout.groups if g.spec.kind == "state"} == {131_072}


def test_speculative_tokens_add_state_blocks_and_widen_the_conv_state() -> None:
    base = served("Qwen__Qwen3-Next-80B-A3B-Instruct", max_model_len=32_768)
    spec = served("Qwen__Qwen3-Next-80B-A3B-Instruct", max_model_len=32_768,
                  num_speculative_tokens=2)
    state = next(s.state_page_bytes for s in base.kv_specs if s.state_page_bytes)
    wider = next(s.state_page_bytes for s in spec.kv_specs if s.state_page_bytes)
    assert state is not None and wider is not None
    assert wider - state == 2 * 8192 * 2  # two more conv rows of 8,192 bf16 channels
    assert spec.lifecycle.peak_blocks(1000, 200) == cdiv(1199, spec.block_size) + 3 * 4


def test_state_dtypes_follow_the_family_defaults() -> None:
    # Nemotron-H: fp32 temporal state unless told; Qwen3.5: its config's mamba_ssm_dtype
    # (float32); Qwen3-Next: the model dtype. The conv state follows the model dtype,
    # never the KV cache dtype.
    nemotron = served("nvidia__NVIDIA-Nemotron-Nano-9B-v2")
    conv = 3 * (128 * 80 + 2 * 8 * 128) * 2
    temporal = 128 * 80 * 128
    states = {s.state_page_bytes for s in nemotron.kv_specs if s.kind == "state"}
    assert states == {conv + temporal * 4}
    fp8 = served("nvidia__NVIDIA-Nemotron-Nano-9B-v2", kv_cache_dtype="fp8")
    assert {s.state_page_bytes for s in fp8.kv_specs if s.kind == "state"} == states
    bf16 = served("nvidia__NVIDIA-Nemotron-Nano-9B-v2", mamba_ssm_cache_dtype="bfloat16")
    assert {s.state_page_bytes for s in bf16.kv_specs if s.kind == "state"} == {
        conv + temporal * 2}
    qwen35 = served("Qwen__Qwen3.5-9B")
    assert {s.state_page_bytes for s in qwen35.kv_specs if s.kind == "state"} == {
        3 * 8192 * 2 + 32 * 128 * 128 * 4}


def test_mamba2_groups_are_replicated_when_tp_does_not_divide_them() -> None:
    arch = read_architecture(DATA / "nvidia__NVIDIA-Nemotron-Nano-9B-v2.json")
    mixer = next(layer.mixer for layer in arch.layers if layer.mixer.tp_error(1) is None
                 and hasattr(layer.mixer, "n_groups"))
    # 8 groups over 16 ranks: vLLM extends them to 16 so every head's group travels with it.
    assert mixer.conv_elements(16, 0) == 3 * (128 * 80 + 16 * 2 * 128) // 16


def test_tp_check_covers_every_layer_kind() -> None:
    compressed = parse_config({
        "model_type": "deepseek_v4", "hidden_size": 1024, "num_hidden_layers": 2,
        "vocab_size": 1000, "num_attention_heads": 6, "head_dim": 512,
        "compress_ratios": [4, 128], "sliding_window": 128, "intermediate_size": 2048,
    })
    with pytest.raises(DeploymentError, match="6 attention heads"):
        ServedModel(compressed, Deployment(tp=4))
    hybrid = read_architecture(DATA / "Qwen__Qwen3-Next-80B-A3B-Instruct.json")
    with pytest.raises(DeploymentError, match="state heads|attention heads"):
        ServedModel(hybrid, Deployment(tp=64))


def test_a_reported_fp8_ds_mla_cache_keeps_its_layout_on_any_gpu() -> None:
    # vLLM reports the cache dtype it rewrote (cache_config_info's cache_dtype).
    reported = served("deepseek-ai__DeepSeek-V3.2-Exp", "B200", kv_cache_dtype="fp8_ds_mla")
    assert reported.kv_bytes_per_token == 61 * (656 + 132)


def test_an_mtp_drafter_adds_its_full_attention_layers() -> None:
    budget = 40 * 1024**3
    plain = served("Qwen__Qwen3-Next-80B-A3B-Instruct", tp=2, num_speculative_tokens=2,
                   available_kv_bytes=budget)
    mtp = served("Qwen__Qwen3-Next-80B-A3B-Instruct", tp=2, num_speculative_tokens=2,
                 speculative_method="mtp", available_kv_bytes=budget)
    kinds = [spec.kind for spec in mtp.kv_specs]
    assert kinds.count("full") == [s.kind for s in plain.kv_specs].count("full") + 1
    assert kinds[-1] == "full"  # the drafter's layer comes after the backbone's
    # 13 attention layers instead of 12 make groups of 13 layers: a block holds 13
    # pages instead of 12, so fewer blocks fit.
    assert mtp.layout.bytes_per_block * 12 == plain.layout.bytes_per_block * 13
    assert mtp.capacity is not None and plain.capacity is not None
    assert 0 < mtp.capacity.num_blocks < plain.capacity.num_blocks


def test_speculative_methods_kvgate_cannot_model_are_refused() -> None:
    with pytest.raises(DeploymentError, match="MTP layers of"):
        served("nvidia__NVIDIA-Nemotron-Nano-9B-v2", num_speculative_tokens=2,
               speculative_method="mtp")
    with pytest.raises(DeploymentError, match="needs --num-speculative-tokens"):
        served("Qwen__Qwen3.5-9B", speculative_method="mtp")
    with pytest.raises(DeploymentError, match="must be one of ngram, mtp"):
        served("Qwen__Qwen3.5-9B", num_speculative_tokens=2, speculative_method="eagle3")


def test_deepseek_v4_caches_and_their_blocks() -> None:
    v4 = served("deepseek-ai__DeepSeek-V4-Flash", max_model_len=131_072)
    assert v4.block_size == 256
    groups = sorted((g.block_size, g.spec.kind) for g in v4.layout.groups)
    assert groups == [(4, "compressor state"), (8, "compressor state"), (64, "window"),
                      (64, "window"), (256, "indexer+compressed")]
    # A 1,000-token prompt + 200 output tokens: 5 blocks of 256 latent tokens, the
    # windows capped by the in-flight tokens, one step of 1,200 tokens.
    assert v4.blocks_for_request(1200) == cdiv(1200, 256) + 2 * cdiv(1200, 64) + (
        cdiv(1200, 4) + cdiv(1200, 8))
    with pytest.raises(DeploymentError, match="fp8_ds_mla"):
        served("deepseek-ai__DeepSeek-V4-Flash", kv_cache_dtype="bfloat16")


@pytest.mark.parametrize("model", sorted(path.stem for path in DATA.glob("*.json")))
def test_blocks_held_by_token_count_equal_the_step_by_step_view(model: str) -> None:
    """Where no group frees blocks as a request advances, what a request holds is looked
    up by its token count (memoised): the same as the step that wrote its last token
    holds, for every layer kind (state groups, DSA indexers, padded hybrids)."""
    lifecycle = served(model, max_model_len=16_384).lifecycle
    for prompt in (0, 1, 63, 64, 65, 1000, 8191, 8193):
        for produced in (0, 1, 2, 63, 64, 65, 500):
            if prompt + produced == 0:
                continue
            step = (Step(0, prompt, 0) if produced <= 0
                    else lifecycle.decode_step(prompt, produced))
            assert lifecycle.blocks_now(prompt, produced) == lifecycle.held(step), (
                prompt, produced)


def test_forks_share_their_prompt_only_where_every_group_keeps_it() -> None:
    from sidecar.admission import CostModel

    # DSA: the MLA cache and the indexer's keys, one group of 64-token blocks that
    # keeps its prompt blocks.
    plain = CostModel(served("deepseek-ai__DeepSeek-V3.2-Exp", "B200"))
    assert plain.served.layout.prefix_groups == 1
    assert plain.served.layout.prefix_block_size == 64
    assert plain.fork_shared_blocks(1000, 3, forks_share=True) == 2 * (999 // 64)
    assert plain.peak_blocks(1000, 50, 3, forks_share=True) == (
        3 * plain.peak_blocks(1000, 50) - 2 * (999 // 64))
    # A hybrid (Qwen3-Next: linear-attention state groups), with or without its MTP
    # drafter: nothing is counted.
    for deployment in ({}, {"num_speculative_tokens": 2, "speculative_method": "mtp"}):
        hybrid = CostModel(served("Qwen__Qwen3-Next-80B-A3B-Instruct", tp=2, **deployment))
        assert hybrid.fork_shared_blocks(1000, 3, forks_share=True) == 0
