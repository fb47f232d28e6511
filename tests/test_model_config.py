"""Reading configs: presets, files, wrappers, families, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sidecar.model import (
    ConfigError,
    Deployment,
    DeploymentError,
    ServedModel,
    UnknownPresetError,
    parse_config,
    presets,
    read_architecture,
)
from sidecar.model.architecture import GqaAttention, MlaAttention, MoeMlp, Role
from sidecar.model.units import GIB


@pytest.mark.parametrize("name", presets.names())
def test_every_preset_parses(name: str) -> None:
    arch = read_architecture(name)
    assert arch.params_total() > 0
    assert arch.params_active() <= arch.params_total()
    ServedModel(arch).layout  # noqa: B018 - grouping must not fail


@pytest.mark.parametrize(
    ("name", "total_b", "active_b"),
    [
        # Published totals; active as the vendors count it (embeddings included).
        ("meta-llama/Meta-Llama-3.1-8B", 8.03, 8.03),
        ("meta-llama/Meta-Llama-3.1-70B", 70.6, 70.6),
        ("meta-llama/Meta-Llama-3.1-405B", 405.9, 405.9),
        ("Qwen/Qwen3-30B-A3B", 30.5, 3.35),
        ("Qwen/Qwen3-235B-A22B", 235.1, 22.2),
        ("mistralai/Mixtral-8x7B-v0.1", 46.7, 12.9),
        ("deepseek-ai/DeepSeek-V3", 671.0, 37.5),
        ("openai/gpt-oss-120b", 116.8, 5.7),
        ("openai/gpt-oss-20b", 20.9, 4.2),
    ],
)
def test_parameter_counts(name: str, total_b: float, active_b: float) -> None:
    arch = read_architecture(name)
    assert arch.params_total() / 1e9 == pytest.approx(total_b, rel=0.01)
    assert arch.params_active() / 1e9 == pytest.approx(active_b, rel=0.02)


def test_tied_embeddings_are_counted_once() -> None:
    tied = read_architecture("Qwen/Qwen3-0.6B")
    assert tied.tie_word_embeddings
    roles = tied.params_by_role()
    assert Role.LM_HEAD not in roles
    untied = read_architecture("Qwen/Qwen3-8B")
    assert untied.params_by_role()[Role.LM_HEAD] == untied.params_by_role()[Role.EMBEDDING]


def test_lookup_by_id_bare_name_and_case() -> None:
    assert presets.find("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"
    assert presets.find("qwen3-8b") == "Qwen/Qwen3-8B"
    assert presets.find("nope") is None


def test_file_and_directory(tmp_path: Path) -> None:
    cfg = presets.load("Qwen/Qwen3-8B")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert read_architecture(tmp_path).params_total() == read_architecture(
        tmp_path / "config.json").params_total()
    assert read_architecture(str(tmp_path)).name == tmp_path.name


def test_multimodal_wrapper_uses_text_config() -> None:
    arch = read_architecture("google/gemma-4-26B-A4B")
    assert arch.num_layers == 30
    assert arch.vision_params > 0
    assert isinstance(arch.layers[0].mlp, MoeMlp)
    # Full-attention layers use the global head size and KV heads.
    full = [l.mixer for l in arch.layers if isinstance(l.mixer, GqaAttention) and not
            l.mixer.window]
    assert full and all(m.head_dim == 512 and m.num_kv_heads == 2 for m in full)


def test_family_layer_patterns() -> None:
    gemma2 = read_architecture("google/gemma-2-9b")
    windows = [l.mixer.window for l in gemma2.layers if isinstance(l.mixer, GqaAttention)]
    assert windows[:4] == [4096, None, 4096, None]
    gemma3 = read_architecture("google/gemma-3-1b-it")
    kinds = [l.mixer.window is None for l in gemma3.layers if isinstance(l.mixer, GqaAttention)]
    assert [i for i, full in enumerate(kinds) if full] == [5, 11, 17, 23]
    gpt_oss = read_architecture("openai/gpt-oss-20b")
    assert [isinstance(l.mixer, GqaAttention) and l.mixer.window == 128
            for l in gpt_oss.layers][:2] == [True, False]
    # Qwen ships sliding_window but does not use it (use_sliding_window: false).
    qwen = read_architecture("Qwen/Qwen2.5-7B")
    assert all(isinstance(l.mixer, GqaAttention) and l.mixer.window is None
               for l in qwen.layers)
    mistral = read_architecture("mistralai/Mistral-7B-v0.1")
    assert all(isinstance(l.mixer, GqaAttention) and l.mixer.window == 4096
               for l in mistral.layers)


def test_deepseek_dense_then_moe_layers() -> None:
    arch = read_architecture("deepseek-ai/DeepSeek-V3")
    assert all(isinstance(l.mixer, MlaAttention) for l in arch.layers)
    kinds = [isinstance(l.mlp, MoeMlp) for l in arch.layers]
    assert kinds[:4] == [False, False, False, True]


@pytest.mark.parametrize(
    ("name", "tp", "gib"),
    [
        # vLLM's "Model loading took" in the public logs (tests/data/groundtruth).
        ("meta-llama/Meta-Llama-3.1-8B", 1, 14.9888),
        ("Qwen/Qwen3-30B-A3B", 4, 14.2474),
        ("openai/gpt-oss-20b", 1, 13.72),
        ("openai/gpt-oss-120b", 1, 65.9651),
        ("Qwen/Qwen2.5-14B", 2, 13.9476),
    ],
)
def test_weights_match_vllm_logs_within_3_percent(name: str, tp: int, gib: float) -> None:
    served = ServedModel(read_architecture(name), Deployment(tp=tp))
    assert served.weights_bytes / GIB == pytest.approx(gib, rel=0.03)


def test_quantization_formats() -> None:
    fp8 = ServedModel(read_architecture("Qwen/Qwen3-32B-FP8"))
    bf16 = ServedModel(read_architecture("Qwen/Qwen3-32B"))
    # Linear layers in fp8, embeddings and lm_head in bf16.
    ratio = fp8.weights_bytes / bf16.weights_bytes
    assert 0.5 < ratio < 0.55
    int4 = ServedModel(read_architecture("Qwen/Qwen3-32B"), Deployment(dtype="int4"))
    # 4.156 bits per linear weight, embeddings at 16 bits.
    assert 0.26 < int4.weights_bytes / bf16.weights_bytes < 0.30
    mx = ServedModel(read_architecture("openai/gpt-oss-120b"))
    assert mx.weight_precision.of(Role.EXPERTS).bits_per_weight == 4.25
    assert mx.weight_precision.of(Role.ATTENTION).bits_per_weight == 16


def test_compressed_tensors_nvfp4_keeps_ignored_attention() -> None:
    arch = read_architecture("nvidia/Gemma-4-31B-IT-NVFP4")
    precision = ServedModel(arch).weight_precision
    assert precision.of(Role.MLP).bits_per_weight == 4.5
    assert precision.of(Role.ATTENTION).bits_per_weight == 16
    assert precision.of(Role.LM_HEAD).bits_per_weight == 16


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"hidden_size": 64}, "num_hidden_layers"),
        ({"hidden_size": "wide", "num_hidden_layers": 2, "vocab_size": 10,
          "num_attention_heads": 2}, "'hidden_size' must be an integer"),
        ({"hidden_size": 64, "num_hidden_layers": -2, "vocab_size": 10,
          "num_attention_heads": 2}, "must not be negative"),
        ({"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 10,
          "num_attention_heads": 2, "quantization_config": {"quant_method": "magic"}},
         "quantization method 'magic'"),
    ],
)
def test_bad_configs_name_the_field(config: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        arch = parse_config(config, "bad")
        ServedModel(arch).weights_bytes  # noqa: B018


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(UnknownPresetError, match="not a file"):
        read_architecture(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="no config.json"):
        read_architecture(tmp_path)
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        read_architecture(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        read_architecture(bad)


def test_impossible_deployments() -> None:
    arch = read_architecture("Qwen/Qwen3-8B")
    with pytest.raises(DeploymentError, match="does not divide the 32 attention heads"):
        ServedModel(arch, Deployment(tp=3))
    with pytest.raises(DeploymentError, match="gpu-memory-utilization"):
        ServedModel(arch, Deployment(gpu_memory_utilization=1.5))
    with pytest.raises(DeploymentError, match="--block-size"):
        ServedModel(arch, Deployment(block_size=0))
