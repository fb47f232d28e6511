"""vLLM's own KV cache planner, run on layer specs built the way vLLM 0.32's model code
builds them. Runs under the vLLM CPU build's python (not the project's venv): reads one
JSON setting on stdin and prints vLLM's plan as JSON.

What comes from vLLM itself: the spec classes (`vllm.v1.kv_cache_interface`), the state
shape and dtype calculators (`MambaStateShapeCalculator`, `MambaStateDtypeCalculator`),
grouping, page unification and block sizing (`get_kv_cache_groups`,
`get_kv_cache_config_from_groups`), the concurrency and token figures
(`get_max_concurrency_for_kv_cache_config`), and the family defaults of
`vllm/model_executor/models/config.py` (`MambaModelConfig`,
`NemotronHForCausalLMConfig`, `Qwen3_5ForConditionalGenerationConfig`,
`GlmMoeDsaForCausalLM`), applied to a stand-in config object.

What is transcribed here (GPU-only code the CPU build cannot run), each from the file
named:
- the layer specs of `DeepseekV2MLAAttention` + `DeepseekV32IndexerCache`
  (`models/deepseek_v2.py`, `layers/attention/mla_attention.py`), `Attention`
  (`layers/attention/attention.py`) and `MambaBase` (`layers/mamba/abstract.py`);
- the block size the backends force: the DSA indexer's only kernel block is 64 tokens
  on CUDA (`DeepseekV32IndexerBackend`), and `Platform._align_hybrid_block_size` for
  Mamba hybrids, with FlashAttention's 16-token kernel block (Hopper);
- the sparse MLA backend per GPU: FLASHMLA_SPARSE on SM90 stores an fp8 cache as
  `fp8_ds_mla` (656 B per token), FLASHINFER_MLA_SPARSE on SM100 as plain fp8.

DeepSeek-V4 runs more of vLLM's own code: its cache layers (`DeepseekV4SWACache`,
`CompressorStateCache`, `DeepseekV4IndexerCache`) are constructed and the attention
layer class the GPU gets (`_select_dsv4_attn_cls`, asked with the GPU's compute
capability) answers `get_kv_cache_spec` itself; the block size comes from the layers'
backends (`Platform._preferred_block_size_for_backends`), the cache layout from
`resolve_kv_cache_layout`. Transcribed from `models/deepseek_v4/attention.py` and
`compressor.py`: which caches a layer with compress ratio r has (a sliding-window
cache; for r > 1 the compressed latent and an fp32 compressor state of
2 x (1 + [r == 4]) x head_dim; for r == 4 an indexer cache of 128 + 4 B and its
compressor state), and their registration order.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace
from typing import Any

import torch
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.model_executor.models.config import (
    MambaModelConfig,
    NemotronHForCausalLMConfig,
    Qwen3_5ForConditionalGenerationConfig,
)
from vllm.utils.math_utils import cdiv
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.core.kv_cache_utils import (
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
    get_max_concurrency_for_kv_cache_config,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SparseCacheRole,
    get_kv_quant_mode,
)

DEFAULT_BLOCK_SIZE = 16
FLASH_ATTN_KERNEL_BLOCK = 16  # FlashAttention: MultipleOf(16) on CUDA
DSA_INDEXER_BLOCK = 64  # DeepseekV32IndexerBackend.get_supported_kernel_block_sizes


class _Namespace(SimpleNamespace):
    def __getattr__(self, name: str) -> Any:  # config fields vLLM reads but we never set
        return None


def _cache_config(s: dict[str, Any]) -> _Namespace:
    layout = "LBNHC"  # FlashAttention / FlashMLA / GDN / Mamba declare no layout
    cache = _Namespace(
        block_size=s.get("block_size") or DEFAULT_BLOCK_SIZE,
        user_specified_block_size=s.get("block_size") is not None,
        cache_dtype=s.get("kv_cache_dtype", "auto"),
        enable_prefix_caching=s.get("prefix_caching", True),
        mamba_cache_mode=s.get("mamba_cache_mode") or "none",
        mamba_block_size=None,
        mamba_page_size_padded=None,
        mamba_cache_dtype=s.get("mamba_cache_dtype", "auto"),
        mamba_ssm_cache_dtype=s.get("mamba_ssm_cache_dtype", "auto"),
        num_gpu_blocks_override=s.get("num_gpu_blocks_override"),
        prefix_cache_retention_interval=None,
        use_replayssm=False,
        kv_cache_layout=layout,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    cache.get_resolved_kv_cache_layout = lambda: KVCacheLayout[layout]
    return cache


def _vllm_config(s: dict[str, Any], hf: SimpleNamespace) -> _Namespace:
    spec_tokens = s.get("num_speculative_tokens", 0)
    method = s.get("speculative_method") or "ngram"
    eagle = method == "mtp"  # SpeculativeConfig.use_eagle
    model = _Namespace(
        hf_config=hf, hf_text_config=hf, max_model_len=s["max_model_len"],
        dtype=STR_DTYPE_TO_TORCH_DTYPE[s.get("dtype", "bfloat16")],
        architecture=(_opt(hf, "architectures") or ["?"])[0],
    )
    batched = s.get("max_num_batched_tokens", 8192)
    return _Namespace(
        model_config=model,
        cache_config=_cache_config(s),
        parallel_config=_Namespace(tensor_parallel_size=s.get("tp", 1),
                                   decode_context_parallel_size=1),
        scheduler_config=_Namespace(disable_hybrid_kv_cache_manager=False,
                                    enable_chunked_prefill=True),
        attention_config=_Namespace(hisparse_config=None),
        # n-gram: a drafter without KV layers; mtp: the model's MTP layers, whose specs
        # `_mtp_specs` adds after the backbone's, as the drafter registers them.
        speculative_config=(_Namespace(num_speculative_tokens=spec_tokens, method=method,
                                       use_eagle=lambda: eagle,
                                       use_eagle_block_drop=lambda: eagle)
                            if spec_tokens else None),
        num_speculative_tokens=spec_tokens,
        max_in_flight_tokens=batched,
    )


def _kv_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return model_dtype if cache_dtype == "auto" else STR_DTYPE_TO_TORCH_DTYPE[cache_dtype]


# ---- MLA + DSA indexer (DeepSeek-V3.2, GLM-5) -----------------------------------------

def _sparse_mla_specs(vc: _Namespace, s: dict[str, Any]) -> dict[str, KVCacheSpec]:
    hf = vc.model_config.hf_config
    cache = vc.cache_config
    capability = s.get("capability", 90)
    # GlmMoeDsaForCausalLM.verify_and_update_config, with its platform test answered
    # for the GPU in question (auto -> fp8_e4m3 on SM10x).
    glm = "GlmMoeDsaForCausalLM" in (_opt(hf, "architectures") or [])
    if glm and cache.cache_dtype == "auto" and capability // 10 == 10:
        cache.cache_dtype = "fp8_e4m3"
    dtype = cache.cache_dtype
    if dtype.startswith("fp8") and capability // 10 == 9:
        dtype = "fp8_ds_mla"  # _canonicalize_sparse_mla_kv_cache_dtype, FLASHMLA_SPARSE
    if not cache.user_specified_block_size:
        cache.block_size = DSA_INDEXER_BLOCK
    block = cache.block_size
    mla_dtype = (torch.uint8 if dtype == "fp8_ds_mla"
                 else _kv_dtype(dtype, vc.model_config.dtype))
    freq = getattr(hf, "index_topk_freq", 1)
    pattern = getattr(hf, "index_topk_pattern", None)
    offset = getattr(hf, "index_skip_topk_offset", 2)
    index_head = hf.index_head_dim
    specs: dict[str, KVCacheSpec] = {}
    for layer in range(hf.num_hidden_layers + _mtp_layers(s, hf)):
        if layer >= hf.num_hidden_layers:
            skip = False  # MTP layers always build an indexer (DeepseekV2MLAAttention)
        elif pattern is None:
            skip = max(layer - offset + 1, 0) % freq != 0
        else:
            skip = layer < len(pattern) and pattern[layer] == "S"
        specs[f"layers.{layer}.attn"] = MLAAttentionSpec(
            block_size=block, num_kv_heads=1, max_tp_shards=1,
            head_size=hf.kv_lora_rank + hf.qk_rope_head_dim, dtype=mla_dtype,
            cache_dtype_str=dtype, kv_quant_mode=get_kv_quant_mode(dtype),
            state_content_bytes={"fp8_ds_mla": 656}.get(dtype),
            is_index_group_leader=not skip,
        )
        if not skip:
            specs[f"layers.{layer}.attn.indexer.k_cache"] = MLAAttentionSpec(
                block_size=block, num_kv_heads=1, max_tp_shards=1,
                head_size=index_head + index_head // 128 * 4, dtype=torch.uint8,
                cache_role=SparseCacheRole.INDEXER,
            )
    return specs


# ---- DeepSeek-V4 compressed attention ---------------------------------------------------

def _dsv4_specs(vc: _Namespace, s: dict[str, Any]) -> dict[str, KVCacheSpec]:
    from vllm.config.attention import AttentionConfig
    from vllm.config.vllm import set_current_vllm_config
    from vllm.models.deepseek_v4 import attention as v4_attention
    from vllm.models.deepseek_v4.compressor import CompressorStateCache
    from vllm.models.deepseek_v4.nvidia import model as v4_nvidia
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability, Platform
    from vllm.v1.attention.backends.mla.indexer import dsa_indexer_uses_fp4
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    hf = vc.model_config.hf_config
    cache = vc.cache_config
    cache.kv_cache_layout = None
    cache.get_resolved_kv_cache_layout = lambda: KVCacheLayout[cache.kv_cache_layout]
    vc.attention_config = AttentionConfig()
    if s.get("attention_backend"):
        vc.attention_config.backend = AttentionBackendEnum[s["attention_backend"]]
    vc.compilation_config = _Namespace(static_forward_context={})
    capability = s.get("capability", 90)
    current_platform.get_device_capability = (  # type: ignore[method-assign]
        lambda device_id=0: DeviceCapability(capability // 10, capability % 10))
    attn_cls = v4_nvidia._select_dsv4_attn_cls(vc)
    head_dim = hf.head_dim
    index_head = hf.index_head_dim
    layers: dict[str, Any] = vc.compilation_config.static_forward_context
    with set_current_vllm_config(vc):
        for i in range(hf.num_hidden_layers + _mtp_layers(s, hf)):
            prefix = f"model.layers.{i}.attn"
            # MTP layers (after the backbone) run with compress ratio 1.
            ratio = max(1, hf.compress_ratios[i]) if i < hf.num_hidden_layers else 1
            if ratio == 4:  # DeepseekV4Indexer: its key cache, then its compressor
                fp4 = dsa_indexer_uses_fp4(vc)
                k_head = (index_head // 2 + index_head // 32 if fp4
                          else index_head + index_head // 128 * 4)
                v4_attention.DeepseekV4IndexerCache(
                    head_dim=k_head, dtype=torch.uint8, prefix=f"{prefix}.indexer.k_cache",
                    cache_config=cache, compress_ratio=ratio)
                CompressorStateCache(2 * 2 * index_head, torch.float32, ratio,
                                     f"{prefix}.indexer.compressor.state_cache")
            attn = attn_cls.__new__(attn_cls)
            torch.nn.Module.__init__(attn)
            attn.compress_ratio = ratio
            attn.head_dim = head_dim
            attn.kv_cache_dtype, attn.kv_cache_torch_dtype = (
                v4_attention._resolve_dsv4_kv_cache_dtype(
                    attn._uses_fp8_ds_mla_layout(), cache.cache_dtype, cache))
            DeepseekV4SWACache(head_dim=head_dim, window_size=hf.sliding_window,
                               dtype=attn.kv_cache_torch_dtype, prefix=f"{prefix}.swa_cache",
                               cache_config=cache, backend_cls=attn.swa_backend_cls)
            layers[prefix] = attn
            if ratio > 1:
                coff = 1 + (ratio == 4)
                CompressorStateCache(2 * coff * head_dim, torch.float32, ratio,
                                     f"{prefix}.compressor.state_cache")
    backends = []
    for layer in layers.values():
        backend = layer.get_attn_backend()
        if backend not in backends:
            backends.append(backend)
    if not cache.user_specified_block_size:  # Platform.update_block_size_for_backend
        cache.block_size = Platform._preferred_block_size_for_backends(
            backends, DEFAULT_BLOCK_SIZE, vc)
    specs = {name: spec for name, layer in layers.items()
             if (spec := layer.get_kv_cache_spec(vc)) is not None}
    layouts = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
    resolve_kv_cache_layout(vc, [layouts], specs.values())
    return specs


# ---- Mamba-2 / gated delta net hybrids --------------------------------------------------

def _layer_kinds(hf: SimpleNamespace) -> list[str]:
    if _opt(hf, "hybrid_override_pattern"):
        return ["mamba" if c == "M" else "attention" if c == "*" else "mlp"
                for c in hf.hybrid_override_pattern[: hf.num_hidden_layers]]
    if _opt(hf, "layer_types"):
        return ["mamba" if t == "linear_attention" else "attention"
                for t in hf.layer_types[: hf.num_hidden_layers]]
    interval = hf.full_attention_interval
    return ["attention" if (i + 1) % interval == 0 else "mamba"
            for i in range(hf.num_hidden_layers)]


def _state(vc: _Namespace) -> tuple[tuple[tuple[int, ...], ...], tuple[torch.dtype, ...],
                                    MambaAttentionBackendEnum]:
    hf = vc.model_config.hf_config
    cache = vc.cache_config
    tp = vc.parallel_config.tensor_parallel_size
    spec = vc.num_speculative_tokens
    if _opt(hf, "hybrid_override_pattern"):  # NemotronHForCausalLM
        shapes = MambaStateShapeCalculator.mamba2_state_shape(
            tp_world_size=tp, intermediate_size=hf.mamba_num_heads * hf.mamba_head_dim,
            n_groups=hf.n_groups, num_heads=hf.mamba_num_heads, head_dim=hf.mamba_head_dim,
            state_size=hf.ssm_state_size, conv_kernel=hf.conv_kernel, num_spec=spec)
        dtypes = MambaStateDtypeCalculator.mamba2_state_dtype(
            vc.model_config.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype)
        return shapes, dtypes, MambaAttentionBackendEnum.MAMBA2
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        tp, hf.linear_num_key_heads, hf.linear_num_value_heads, hf.linear_key_head_dim,
        hf.linear_value_head_dim, hf.linear_conv_kernel_dim, spec)
    dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(
        vc.model_config.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype)
    return shapes, dtypes, MambaAttentionBackendEnum.GDN_ATTN


def _hybrid_specs(vc: _Namespace, s: dict[str, Any]) -> dict[str, KVCacheSpec]:
    hf = vc.model_config.hf_config
    cache = vc.cache_config
    arch = vc.model_config.architecture
    if arch.startswith("NemotronH"):
        NemotronHForCausalLMConfig.verify_and_update_config(vc)
    if arch.startswith("Qwen3_5"):
        Qwen3_5ForConditionalGenerationConfig.verify_and_update_config(vc)
    MambaModelConfig.verify_and_update_config(vc)  # HybridAttentionMambaModelConfig
    tp = vc.parallel_config.tensor_parallel_size
    kv_heads = max(1, hf.num_key_value_heads // tp)
    head = _opt(hf, "head_dim") or hf.hidden_size // hf.num_attention_heads
    kv_dtype = _kv_dtype(cache.cache_dtype, vc.model_config.dtype)
    quant = get_kv_quant_mode(cache.cache_dtype)
    shapes, dtypes, mamba_type = _state(vc)
    # Platform._align_hybrid_block_size
    attn_1_token = FullAttentionSpec(block_size=1, num_kv_heads=kv_heads, head_size=head,
                                     dtype=kv_dtype, kv_quant_mode=quant).page_size_bytes
    mamba_page = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=-1).page_size_bytes
    alignment = max(FLASH_ATTN_KERNEL_BLOCK, cache.block_size)
    attn_block = alignment * cdiv(mamba_page, alignment * attn_1_token)
    attn_block = FLASH_ATTN_KERNEL_BLOCK * cdiv(attn_block, FLASH_ATTN_KERNEL_BLOCK)
    cache.block_size = max(cache.block_size, attn_block)
    if cache.mamba_cache_mode == "align":
        cache.mamba_block_size = cache.block_size
    if cache.block_size * attn_1_token != mamba_page:
        cache.mamba_page_size_padded = cache.block_size * attn_1_token
    specs: dict[str, KVCacheSpec] = {}
    for layer, kind in enumerate(_layer_kinds(hf)):
        if kind == "attention":
            specs[f"layers.{layer}.attn"] = FullAttentionSpec(
                block_size=cache.block_size, num_kv_heads=kv_heads, head_size=head,
                dtype=kv_dtype, kv_quant_mode=quant)
        elif kind == "mamba":
            specs[f"layers.{layer}.mixer"] = MambaSpec(
                shapes=tuple(shapes), dtypes=dtypes, block_size=cache.mamba_block_size,
                page_size_padded=cache.mamba_page_size_padded, mamba_type=mamba_type,
                mamba_cache_mode=cache.mamba_cache_mode,
                num_speculative_blocks=vc.num_speculative_tokens)
    for i in range(_mtp_layers(s, hf)):  # Qwen3NextMTP / Qwen3_5MTP: full attention
        specs[f"mtp.layers.{i}.self_attn.attn"] = FullAttentionSpec(
            block_size=cache.block_size, num_kv_heads=kv_heads, head_size=head,
            dtype=kv_dtype, kv_quant_mode=quant)
    return specs


def _mtp_layers(s: dict[str, Any], hf: SimpleNamespace) -> int:
    """Layers of the MTP drafter (its model class's own count)."""
    if s.get("speculative_method") != "mtp":
        return 0
    if _opt(hf, "hybrid_override_pattern"):
        raise ValueError("no MTP drafter modelled for Nemotron-H")
    if "Qwen3_5" in (_opt(hf, "architectures") or ["?"])[0]:
        return int(getattr(hf, "mtp_num_hidden_layers", 1))  # Qwen3_5MTP
    if _opt(hf, "model_type") == "qwen3_next":
        return int(getattr(hf, "num_nextn_predict_layers", 1))  # Qwen3NextMTP
    count = _opt(hf, "num_nextn_predict_layers")  # DeepSeekMTP, DeepSeekV4MTP
    if count is None:
        raise ValueError("the config names no num_nextn_predict_layers")
    return int(count)


def _hf_config(raw: dict[str, Any]) -> SimpleNamespace:
    """The text model's config (multimodal wrappers keep it under text_config), with
    the keys vLLM reads through getattr defaults left absent."""
    text = dict(raw.get("text_config") or raw)
    text.setdefault("architectures", raw.get("architectures"))
    return SimpleNamespace(**text)


def _opt(hf: SimpleNamespace, name: str) -> Any:
    return getattr(hf, name, None)


def plan(s: dict[str, Any]) -> dict[str, Any]:
    hf = _hf_config(s["config"])
    vc = _vllm_config(s, hf)
    if _opt(hf, "compress_ratios") is not None:
        specs = _dsv4_specs(vc, s)
    elif _opt(hf, "index_topk") is not None:
        specs = _sparse_mla_specs(vc, s)
    else:
        specs = _hybrid_specs(vc, s)
    groups = get_kv_cache_groups(vc, specs)
    config = get_kv_cache_config_from_groups(vc, groups, s["available_bytes"])
    concurrency = get_max_concurrency_for_kv_cache_config(vc, config)
    per_group = [
        {"block_size": g.kv_cache_spec.block_size, "layers": len(g.layer_names),
         "page_bytes": g.kv_cache_spec.page_size_bytes,
         "blocks_per_request": cdiv(g.kv_cache_spec.max_memory_usage_bytes(vc),
                                    g.kv_cache_spec.page_size_bytes)}
        for g in config.kv_cache_groups
    ]
    return {
        "block_size": vc.cache_config.block_size,
        "kv_cache_dtype": vc.cache_config.cache_dtype,
        "mamba_cache_mode": vc.cache_config.mamba_cache_mode,
        "groups": per_group,
        "num_gpu_blocks": config.num_blocks,
        "blocks_per_request": sum(g["blocks_per_request"] for g in per_group),
        "max_concurrency": concurrency,
        "kv_capacity_tokens": int(concurrency * s["max_model_len"]),
    }


if __name__ == "__main__":
    json.dump([plan(one) for one in json.load(sys.stdin)], sys.stdout)
