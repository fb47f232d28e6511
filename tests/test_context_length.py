"""The context length kvgate plans with is vLLM's: the limit of `--max-model-len` and
its default, from the config's length keys and RoPE scaling (`sidecar/model/
hf_context.py`). The pure rules first; then vLLM 0.32's own ModelConfig as the oracle,
on every bundled preset its CPU build can inspect and on configs that exercise each
rule (`support/vllm_context_oracle.py`)."""

from __future__ import annotations

import json
import os
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from sidecar.model import read_architecture
from sidecar.model.errors import ConfigError
from sidecar.model.hf_config import parse_config

from support.env import vllm_python

PRESETS = Path(__file__).parent.parent / "sidecar" / "model" / "presets"
ORACLE = Path(__file__).parent / "support" / "vllm_context_oracle.py"
# Multimodal wrappers the CPU build's ModelConfig cannot inspect (their text configs'
# lengths are plain max_position_embeddings, checked by the rules below).
NOT_INSPECTABLE = {"google__gemma-4-26B-A4B", "nvidia__Gemma-4-31B-IT-NVFP4",
                   "meta-llama__Llama-4-Maverick-17B-128E-Instruct",
                   "meta-llama__Llama-4-Scout-17B-16E-Instruct"}

TINY: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}
GEMMA3 = json.loads((PRESETS / "google__gemma-3-1b-it.json").read_text())
CRAFTED: dict[str, dict[str, Any]] = {
    "linear x4": {**TINY, "rope_scaling": {"type": "linear", "factor": 4.0}},
    "dynamic x2": {**TINY, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    "yarn x4 (already scaled)": {**TINY, "max_position_embeddings": 16384, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}},
    "llama3 x8 (already scaled)": {**TINY, "max_position_embeddings": 131072,
                                   "rope_scaling": {
                                       "rope_type": "llama3", "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192}},
    "smallest key": {**TINY, "max_position_embeddings": 8192, "seq_length": 3072},
    "model_max_length wins": {**TINY, "max_position_embeddings": 8192,
                              "model_max_length": 65536},
    "gemma3 linear x8 (already scaled)": {**GEMMA3, "rope_scaling": {
        "rope_type": "linear", "factor": 8.0}},
    "null factor": {**TINY, "rope_scaling": {"rope_type": "linear", "factor": None}},
    # Qwen3's config class reads layer_types (Llama's would not: its RoPE set stays flat).
    "nested by layer type": {**TINY, "architectures": ["Qwen3ForCausalLM"],
                             "model_type": "qwen3", "head_dim": 64,
                             "layer_types": ["full_attention", "sliding_attention"],
                             "sliding_window": 512,
                             "rope_parameters": {
                                 "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                    "rope_theta": 1e6},
                                 "sliding_attention": {"rope_type": "default",
                                                       "rope_theta": 1e4}}},
    "layer-type keys without layer_types (flat)": {**TINY, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}},
    "rope_scaling before rope_parameters": {
        **TINY, "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
    "telechat3-yarn is yarn": {**TINY, "rope_scaling": {
        "rope_type": "telechat3-yarn", "factor": 4.0,
        "original_max_position_embeddings": 1024}},
}


def _preset(name: str) -> dict[str, Any]:
    raw: dict[str, Any] = json.loads((PRESETS / f"{name}.json").read_text())
    return raw


def _cases() -> dict[str, dict[str, Any]]:
    presets = {path.stem: _preset(path.stem) for path in sorted(PRESETS.glob("*.json"))
               if path.stem not in NOT_INSPECTABLE}
    return {**presets, **CRAFTED}


# ---- the rules, without vLLM -----------------------------------------------------------


def test_max_position_embeddings_is_the_length_without_scaling() -> None:
    context = parse_config(TINY).context
    assert (context.limit, context.default, context.source) == (
        4096, 4096, "max_position_embeddings")


def test_a_linear_factor_extends_the_limit_and_says_so() -> None:
    context = parse_config(CRAFTED["linear x4"]).context
    assert (context.limit, context.default) == (16384, 16384)
    assert context.source == "max_position_embeddings x rope factor 4"


@pytest.mark.parametrize("name", ["yarn x4 (already scaled)", "llama3 x8 (already scaled)",
                                  "gemma3 linear x8 (already scaled)"])
def test_factors_already_in_the_length_are_not_applied_again(name: str) -> None:
    config = CRAFTED[name]
    context = parse_config(config).context
    assert context.limit == context.default == config["max_position_embeddings"]


def test_longrope_serves_its_original_length_by_default() -> None:
    context = read_architecture("microsoft/Phi-3.5-mini-instruct").context
    assert (context.limit, context.default) == (131072, 4096)


def test_the_smallest_length_key_wins_but_model_max_length_overrides() -> None:
    assert parse_config(CRAFTED["smallest key"]).context.limit == 3072
    context = parse_config(CRAFTED["model_max_length wins"]).context
    assert (context.limit, context.source) == (65536, "model_max_length")


def test_rope_parameters_nest_by_the_configs_own_layer_types() -> None:
    assert parse_config(CRAFTED["nested by layer type"]).context.limit == 8192
    # Keyed by a layer type the config does not declare: one flat set, without a factor.
    assert parse_config(CRAFTED["layer-type keys without layer_types (flat)"]).context.limit \
        == 4096


def test_rope_scaling_is_read_before_rope_parameters() -> None:
    assert parse_config(CRAFTED["rope_scaling before rope_parameters"]).context.limit == 16384


@pytest.mark.parametrize(("legacy", "modern_limit"), [
    ({"type": "su", "factor": 4.0}, 4096),  # LongRoPE: not scaled
    ({"rope_type": "telechat3-yarn", "factor": 4.0}, 4096),  # YaRN: not scaled
    ({"type": "dynamic", "factor": 4.0}, 16384),
])
def test_legacy_rope_type_names(legacy: dict[str, Any], modern_limit: int) -> None:
    assert parse_config({**TINY, "rope_scaling": legacy}).context.limit == modern_limit


def test_without_a_length_key_no_limit_is_checked() -> None:
    # vLLM then checks no --max-model-len; it serves the model class's default length,
    # which the config file does not say: its own fallback, 2048, is assumed.
    config = {k: v for k, v in TINY.items() if k != "max_position_embeddings"}
    context = parse_config(config).context
    assert context.limit is None and context.default == 2048


@pytest.mark.parametrize(("change", "named"), [
    ({"max_position_embeddings": "4k"}, "'max_position_embeddings'"),
    ({"max_position_embeddings": -1}, "'max_position_embeddings'"),
    ({"rope_scaling": {"type": "linear", "factor": -2}}, "'factor'"),
    ({"rope_scaling": "linear"}, "'rope_scaling'"),
    ({"rope_parameters": ["linear"]}, "'rope_parameters'"),
])
def test_bad_lengths_are_errors_naming_the_field(change: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        parse_config({**TINY, **change})


# ---- vLLM's own ModelConfig ---------------------------------------------------------


@cache
def vllm_lengths() -> dict[str, dict[str, Any]]:
    request = {name: {"config": config, "limit": parse_config(config, name).context.limit}
               for name, config in _cases().items()}
    proc = subprocess.run([vllm_python(), str(ORACLE)], input=json.dumps(request),
                          capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    out: dict[str, dict[str, Any]] = json.loads(proc.stdout)
    return out


@pytest.mark.vllm
@pytest.mark.parametrize("name", list(_cases()))
def test_the_context_length_is_vllms(name: str) -> None:
    context = parse_config(_cases()[name], name).context
    vllm = vllm_lengths()[name]
    assert context.limit is not None
    assert vllm["default"] == context.default
    assert vllm["accepts_limit"], f"vLLM refuses --max-model-len {context.limit}"
    assert vllm["refuses_above"], f"vLLM accepts --max-model-len {context.limit + 1}"
