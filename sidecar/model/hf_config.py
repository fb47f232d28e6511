"""Read a Hugging Face `config.json` into a `ModelArchitecture`.

This is the only module that knows Hugging Face key names. It accepts a file, a
directory holding `config.json`, or a bundled preset name (see `presets`: variants
such as `-Instruct` find their base model's preset), unwraps
the `text_config` of multimodal wrappers, and maps each family's way of spelling
the same idea (experts, windows, latent attention, hybrid layer patterns) onto the
typed description.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from sidecar.model import presets
from sidecar.model.architecture import (
    CompressedAttention,
    DenseMlp,
    GqaAttention,
    Layer,
    MlaAttention,
    Mlp,
    ModelArchitecture,
    MoeMlp,
    NoMixer,
    StateMixer,
)
from sidecar.model.errors import ConfigError, UnknownPresetError
from sidecar.model.hf_context import context_length

Config = Mapping[str, Any]

# Wrappers whose language model lives under `text_config`.
_TEXT_CONFIG_KEYS = ("text_config", "language_config", "llm_config")
# Top-level keys of a wrapper that also apply to its text model.
_INHERITED_KEYS = ("torch_dtype", "dtype", "quantization_config", "tie_word_embeddings")


def load_config(source: str | Path) -> tuple[dict[str, Any], str]:
    """Return (raw config dict, display name) for a file, directory or preset name."""
    path = Path(source).expanduser()
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"{source}: directory has no config.json")
    if path.is_file():
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from exc
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read ({exc.strerror})") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: a config.json must hold a JSON object")
        _merge_modelopt_quantization(raw, path.parent / "hf_quant_config.json")
        name = path.parent.name if path.name == "config.json" else path.stem
        return raw, name
    found = presets.match(str(source))
    if found is None:
        raise UnknownPresetError(unknown_model_message(str(source)))
    return presets.load(found.preset), found.preset


def unknown_model_message(name: str, elsewhere: str = "") -> str:
    """One line for a name that is neither a file, a directory nor a preset: what is
    missing, and the closest presets. `elsewhere` adds where else it was looked for
    (", nor in ...")."""
    base = presets.quantized_base(name)
    if base is not None:
        return (
            f"model {name!r} is {base} quantized with {presets.quantization_of(name)}, "
            "but no bundled preset has that quantization (the preset's weights "
            f"would be counted at the wrong precision){elsewhere}: give its config.json "
            "(a file or a directory)"
        )
    close = presets.suggestions(name)
    listed = ", ".join(close[:-1]) + " or " + close[-1] if len(close) > 1 else "".join(close)
    hint = f"did you mean {listed}?" if close else "see `kvgate presets`"
    return (
        f"model {name!r} is not a file, a directory with config.json or a bundled preset"
        f"{elsewhere}; {hint}"
    )


def _merge_modelopt_quantization(raw: dict[str, Any], quant_file: Path) -> None:
    """NVIDIA ModelOpt checkpoints keep their quantization in hf_quant_config.json."""
    if "quantization_config" in raw or not quant_file.is_file():
        return
    try:
        data = json.loads(quant_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{quant_file}: cannot read ({exc})") from exc
    section = data.get("quantization") if isinstance(data, dict) else None
    if isinstance(section, dict):
        raw["quantization_config"] = {"quant_method": "modelopt", **section}


def read_architecture(source: str | Path) -> ModelArchitecture:
    raw, name = load_config(source)
    return parse_config(raw, name)


def parse_config(raw: Config, name: str = "model") -> ModelArchitecture:
    """Parse an already loaded config dict."""
    text, vision = _unwrap(raw)
    reader = _Reader(text, name)
    hidden = reader.positive_int("hidden_size", "n_embd", "d_model", "dim")
    num_layers = reader.positive_int("num_hidden_layers", "n_layer", "num_layers", "n_layers")
    vocab = reader.positive_int("vocab_size", "padded_vocab_size")
    model_type = str(text.get("model_type") or raw.get("model_type") or _arch_name(raw))
    layer_kinds = _layer_kinds(text, num_layers, model_type)
    mixers = [_mixer(reader, hidden, kind, index, model_type) for index, kind in
              enumerate(layer_kinds)]
    mlps = [
        # Nemotron-H layers are each one of Mamba, attention or MLP.
        DenseMlp(0) if "hybrid_override_pattern" in text and kind != NONE
        else _mlp(reader, index, num_layers, model_type)
        for index, kind in enumerate(layer_kinds)
    ]
    layers = tuple(Layer(mixer, mlp) for mixer, mlp in zip(mixers, mlps, strict=True))
    return ModelArchitecture(
        drafter_mixers=_mtp_mixers(reader, hidden, num_layers, model_type),
        name=name,
        model_type=model_type,
        hidden_size=hidden,
        vocab_size=vocab,
        tie_word_embeddings=_tied(text, raw, model_type),
        layers=layers,
        context=context_length(text, str(text.get("model_type") or model_type), name,
                               reader.optional_int),
        torch_dtype=_dtype(text, raw),
        quantization=_quantization(text, raw),
        vision_params=_vision_params(vision, hidden),
        # vLLM's GlmMoeDsaForCausalLM switches an auto KV cache to fp8 on SM10x.
        fp8_kv_default_on=(10,) if model_type == "glm_moe_dsa" else (),
    )


def _arch_name(raw: Config) -> str:
    archs = raw.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0]
    return "unknown"


def _unwrap(raw: Config) -> tuple[Config, Config | None]:
    """The text model's config (merged with inherited wrapper keys) and the vision config."""
    for key in _TEXT_CONFIG_KEYS:
        nested = raw.get(key)
        if isinstance(nested, Mapping) and "num_hidden_layers" not in raw:
            merged = dict(nested)
            for inherited in _INHERITED_KEYS:
                if inherited not in merged and inherited in raw:
                    merged[inherited] = raw[inherited]
            vision = raw.get("vision_config")
            return merged, vision if isinstance(vision, Mapping) else None
    return raw, None


def _dtype(text: Config, raw: Config) -> str | None:
    for cfg in (text, raw):
        for key in ("torch_dtype", "dtype"):
            value = cfg.get(key)
            if isinstance(value, str):
                return value
    return None


def _quantization(text: Config, raw: Config) -> Mapping[str, object] | None:
    for cfg in (raw, text):
        value = cfg.get("quantization_config")
        if isinstance(value, Mapping):
            return dict(value)
    return None


def _tied(text: Config, raw: Config, model_type: str) -> bool:
    for cfg in (text, raw):
        value = cfg.get("tie_word_embeddings")
        if isinstance(value, bool):
            return value
    # Transformers' defaults: Gemma ties its embeddings, most others do not.
    return model_type.startswith("gemma")


class _Reader:
    """Typed access to config fields with errors that name the field."""

    def __init__(self, cfg: Config, name: str) -> None:
        self.cfg = cfg
        self.name = name

    def _first(self, keys: Sequence[str]) -> tuple[str, Any] | None:
        for key in keys:
            if key in self.cfg and self.cfg[key] is not None:
                return key, self.cfg[key]
        return None

    def optional_int(self, *keys: str) -> int | None:
        found = self._first(keys)
        if found is None:
            return None
        key, value = found
        if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
            raise ConfigError(
                f"{self.name}: config field {key!r} must be an integer, got {value!r}"
            )
        if value < 0:
            raise ConfigError(f"{self.name}: config field {key!r} must not be negative")
        return int(value)

    def positive_int(self, *keys: str) -> int:
        value = self.optional_int(*keys)
        if value is None:
            raise ConfigError(f"{self.name}: config has no {keys[0]!r}")
        if value == 0:
            raise ConfigError(f"{self.name}: config field {keys[0]!r} must be positive")
        return value

    def int_or(self, default: int, *keys: str) -> int:
        value = self.optional_int(*keys)
        return default if value is None else value

    def flag(self, key: str, default: bool = False) -> bool:
        value = self.cfg.get(key)
        return value if isinstance(value, bool) else default

    def int_list(self, key: str) -> list[int] | None:
        value = self.cfg.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise ConfigError(f"{self.name}: config field {key!r} must be a list of integers")
        return list(value)


# ---- layer kinds -------------------------------------------------------------------

FULL = "full_attention"
SLIDING = "sliding_attention"
CHUNKED = "chunked_attention"
LINEAR = "linear_attention"
MAMBA = "mamba"
NONE = "none"


def _layer_kinds(cfg: Config, num_layers: int, model_type: str) -> list[str]:
    """One kind per layer: full, sliding, chunked, linear (state) or mamba."""
    explicit = cfg.get("layer_types")
    if isinstance(explicit, list) and len(explicit) >= num_layers:
        return [_normalise_kind(str(kind)) for kind in explicit[:num_layers]]
    interval = cfg.get("full_attention_interval")
    if isinstance(interval, int) and interval > 0 and "linear_num_value_heads" in cfg:
        # Qwen3-Next: gated delta net layers, every `interval`-th layer full attention.
        return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)]
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str) and len(pattern) >= num_layers:
        # Nemotron-H: M = Mamba-2, * = attention, - = MLP only (no cache).
        return [
            MAMBA if ch == "M" else FULL if ch == "*" else NONE for ch in pattern[:num_layers]
        ]
    window = cfg.get("sliding_window") or cfg.get("sliding_window_size")
    has_window = isinstance(window, int) and not isinstance(window, bool) and window > 0
    if model_type in ("gemma2",) and has_window:
        return [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)]
    if model_type.startswith("gemma3") and has_window:
        period = cfg.get("sliding_window_pattern") or 6
        return [SLIDING if (i + 1) % int(period) else FULL for i in range(num_layers)]
    if model_type.startswith("llama4") and cfg.get("attention_chunk_size"):
        interval = int(cfg.get("no_rope_layer_interval") or 4)
        return [CHUNKED if (i + 1) % interval else FULL for i in range(num_layers)]
    if model_type.startswith(("qwen2", "qwen3")):
        # Qwen ships `sliding_window` but uses it only with use_sliding_window: true,
        # and then only from layer `max_window_layers` on.
        if has_window and cfg.get("use_sliding_window") is True:
            first = int(cfg.get("max_window_layers") or 0)
            return [SLIDING if i >= first else FULL for i in range(num_layers)]
        return [FULL] * num_layers
    if has_window:
        return [SLIDING] * num_layers
    return [FULL] * num_layers


def _normalise_kind(kind: str) -> str:
    kind = kind.lower()
    if "sliding" in kind or kind == "local":
        return SLIDING
    if "chunk" in kind:
        return CHUNKED
    if "linear" in kind or "delta" in kind:
        return LINEAR
    if "mamba" in kind or kind in ("ssm", "recurrent"):
        return MAMBA
    return FULL


# ---- mixers ------------------------------------------------------------------------


def _mixer(
    r: _Reader, hidden: int, kind: str, index: int, model_type: str
) -> GqaAttention | MlaAttention | CompressedAttention | StateMixer | NoMixer:
    cfg = r.cfg
    if kind == NONE:
        return NoMixer()
    if kind == LINEAR:
        return _gated_delta_net(r, hidden, model_type)
    if kind == MAMBA:
        return _mamba2(r, hidden, model_type)
    ratios = r.int_list("compress_ratios")
    if ratios is not None:
        return _compressed(r, hidden, ratios[index] if index < len(ratios) else 0)
    if cfg.get("kv_lora_rank"):
        return _mla(r, hidden, index)
    heads = r.positive_int("num_attention_heads", "n_head", "num_heads")
    kv_heads = r.int_or(heads, "num_key_value_heads", "n_head_kv", "num_kv_heads")
    if cfg.get("multi_query") is True:
        kv_heads = 1
    head_dim = r.int_or(hidden // heads, "head_dim", "attention_head_dim")
    if kind == FULL and cfg.get("global_head_dim"):
        # Gemma 4: full-attention layers have their own head size and KV heads.
        head_dim = r.positive_int("global_head_dim")
        kv_heads = r.int_or(kv_heads, "num_global_key_value_heads")
    v_head_dim = r.int_or(head_dim, "v_head_dim") if not cfg.get("kv_lora_rank") else head_dim
    window: int | None = None
    if kind == SLIDING:
        window = r.positive_int("sliding_window", "sliding_window_size")
    elif kind == CHUNKED:
        window = r.positive_int("attention_chunk_size")
    bias = r.flag("attention_bias") or model_type in ("qwen2", "qwen2_moe", "qwen2_vl")
    return GqaAttention(
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        window=window,
        qkv_bias=bias,
        o_bias=r.flag("attention_bias") and model_type == "gpt_oss",
        shared_kv=kind == FULL and r.flag("attention_k_eq_v"),
    )


def _mtp_mixers(r: _Reader, hidden: int, num_layers: int,
                model_type: str) -> tuple[GqaAttention | MlaAttention | CompressedAttention, ...]:
    """The attention of the model's MTP (next-token prediction) layers, which vLLM
    loads as the drafter with --speculative-config method mtp: DeepSeek / GLM
    (`num_nextn_predict_layers` decoder layers after the backbone: MLA with an indexer
    for DSA, whatever IndexShare says; DeepSeek-V4 with compress ratio 1, a
    sliding-window cache only), Qwen3-Next (`num_nextn_predict_layers`, default 1) and
    Qwen3.5 (`mtp_num_hidden_layers`, default 1) full-attention layers. Others: none
    known."""
    cfg = r.cfg
    if cfg.get("compress_ratios") is not None:
        count = r.int_or(0, "num_nextn_predict_layers")
        return tuple(_compressed(r, hidden, 0) for _ in range(count))
    if cfg.get("kv_lora_rank"):
        count = r.int_or(0, "num_nextn_predict_layers")
        return tuple(replace(_mla(r, hidden, num_layers + i), indexer_cache=True)
                     for i in range(count))
    if model_type.startswith("qwen3_next"):
        count = r.int_or(1, "num_nextn_predict_layers")
    elif model_type.startswith("qwen3_5"):
        count = r.int_or(1, "mtp_num_hidden_layers")
    else:
        return ()
    return tuple(_full_attention(r, hidden, num_layers + i, model_type) for i in range(count))


def _full_attention(r: _Reader, hidden: int, index: int, model_type: str) -> GqaAttention:
    mixer = _mixer(r, hidden, FULL, index, model_type)
    assert isinstance(mixer, GqaAttention)
    return mixer


def _has_indexer_cache(cfg: Config, index: int) -> bool:
    """DSA with IndexCache (`index_topk_freq` / `index_topk_pattern`): only some layers
    compute (and cache) indexer keys; the others reuse them (vLLM's
    DeepseekV2MLAAttention)."""
    pattern = cfg.get("index_topk_pattern")
    if isinstance(pattern, str | list) and pattern:
        return not (index < len(pattern) and pattern[index] == "S")
    freq = cfg.get("index_topk_freq") or 1
    offset = cfg.get("index_skip_topk_offset")
    offset = 2 if offset is None else int(offset)
    return max(index - offset + 1, 0) % int(freq) == 0


def _mla(r: _Reader, hidden: int, index: int) -> MlaAttention:
    sparse = r.cfg.get("index_topk") is not None
    return MlaAttention(
        num_heads=r.positive_int("num_attention_heads"),
        q_lora_rank=r.optional_int("q_lora_rank") or None,
        kv_lora_rank=r.positive_int("kv_lora_rank"),
        qk_nope_head_dim=r.positive_int("qk_nope_head_dim"),
        qk_rope_head_dim=r.positive_int("qk_rope_head_dim"),
        v_head_dim=r.positive_int("v_head_dim"),
        index_head_dim=r.optional_int("index_head_dim"),
        index_n_heads=r.int_or(0, "index_n_heads"),
        sparse=sparse,
        indexer_cache=not sparse or _has_indexer_cache(r.cfg, index),
    )


def _compressed(r: _Reader, hidden: int, ratio: int) -> CompressedAttention:
    return CompressedAttention(
        num_heads=r.positive_int("num_attention_heads"),
        head_dim=r.positive_int("head_dim", "kv_lora_rank"),
        ratio=ratio,
        window=r.positive_int("sliding_window", "window_size"),
        index_head_dim=r.int_or(128, "index_head_dim"),
        q_lora_rank=r.optional_int("q_lora_rank") or None,
    )


def _ssm_dtype_default(cfg: Config, model_type: str) -> str | None:
    """The SSM state dtype a family asks vLLM for when --mamba-ssm-cache-dtype is auto:
    Qwen3.5 its config's `mamba_ssm_dtype`, Nemotron-H its config's
    `mamba_ssm_cache_dtype` or float32 (vLLM's model config defaults)."""
    if model_type.startswith("qwen3_5"):
        value = cfg.get("mamba_ssm_dtype")
        return value if isinstance(value, str) else None
    if model_type.startswith("nemotron_h"):
        value = cfg.get("mamba_ssm_cache_dtype")
        return value if isinstance(value, str) else "float32"
    return None


def _gated_delta_net(r: _Reader, hidden: int, model_type: str) -> StateMixer:
    """Qwen3-Next / Qwen3.5 gated delta net: conv state plus a per-head k x v state."""
    nk = r.positive_int("linear_num_key_heads")
    nv = r.positive_int("linear_num_value_heads")
    dk = r.positive_int("linear_key_head_dim")
    dv = r.positive_int("linear_value_head_dim")
    kernel = r.int_or(4, "linear_conv_kernel_dim")
    conv_dim = 2 * nk * dk + nv * dv
    params = hidden * (conv_dim + nv * dv) + hidden * 2 * nv + conv_dim * kernel + nv * dv * hidden
    return StateMixer(mixer_params=params, conv_channels=conv_dim, conv_kernel=kernel,
                      state_heads=nv, state_head_elements=dv * dk,
                      default_ssm_dtype=_ssm_dtype_default(r.cfg, model_type))


def _mamba2(r: _Reader, hidden: int, model_type: str) -> StateMixer:
    heads = r.positive_int("mamba_num_heads", "mamba_n_heads")
    head_dim = r.positive_int("mamba_head_dim", "mamba_d_head")
    d_state = r.positive_int("ssm_state_size", "mamba_d_state")
    groups = r.int_or(1, "n_groups", "mamba_n_groups")
    kernel = r.int_or(4, "conv_kernel", "mamba_d_conv")
    inner = heads * head_dim
    conv_dim = inner + 2 * groups * d_state
    params = hidden * (inner + conv_dim + heads) + conv_dim * kernel + inner * hidden
    return StateMixer(mixer_params=params, conv_channels=inner, conv_kernel=kernel,
                      state_heads=heads, state_head_elements=head_dim * d_state,
                      n_groups=groups, group_channels=2 * d_state,
                      default_ssm_dtype=_ssm_dtype_default(r.cfg, model_type))


# ---- MLPs --------------------------------------------------------------------------


def _mlp(r: _Reader, index: int, num_layers: int, model_type: str) -> Mlp:
    cfg = r.cfg
    gated = model_type not in ("gpt2", "gpt_bigcode", "opt", "falcon", "phi", "starcoder2")
    num_experts = r.int_or(
        0, "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"
    )
    dense_size = r.int_or(4 * r.positive_int("hidden_size", "n_embd", "d_model", "dim"),
                          "intermediate_size_mlp", "intermediate_size", "ffn_hidden_size",
                          "n_inner")
    if num_experts and _is_moe_layer(r, index, model_type):
        top_k = r.positive_int("num_experts_per_tok", "experts_per_token", "top_k_experts",
                               "moe_top_k")
        expert_size = r.int_or(0, "moe_intermediate_size", "expert_intermediate_size")
        if not expert_size:
            expert_size = r.positive_int("intermediate_size")
        shared = r.int_or(0, "shared_expert_intermediate_size")
        if not shared and r.optional_int("n_shared_experts"):
            shared = r.int_or(0, "n_shared_experts") * expert_size
        if model_type.startswith("llama4"):
            shared = expert_size
        dense_beside = 0
        if cfg.get("enable_moe_block") is True:
            dense_beside = r.int_or(0, "intermediate_size")
        return MoeMlp(
            num_experts=num_experts,
            top_k=top_k,
            expert_intermediate_size=expert_size,
            shared_intermediate_size=shared,
            gated=gated,
            shared_gate=model_type.startswith("qwen2_moe"),
            dense_intermediate_size=dense_beside,
        )
    if model_type.startswith("llama4"):
        dense_size = r.int_or(dense_size, "intermediate_size_mlp")
    elif "intermediate_size" in cfg and cfg["intermediate_size"] is not None:
        dense_size = r.positive_int("intermediate_size")
    return DenseMlp(intermediate_size=dense_size, gated=gated)


def _is_moe_layer(r: _Reader, index: int, model_type: str) -> bool:
    cfg = r.cfg
    first_dense = r.int_or(0, "first_k_dense_replace")
    if index < first_dense:
        return False
    only_mlp = cfg.get("mlp_only_layers")
    if isinstance(only_mlp, list) and index in only_mlp:
        return False
    if model_type.startswith("llama4"):
        step = r.int_or(1, "interleave_moe_layer_step")
        return (index + 1) % step == 0
    step = r.int_or(1, "decoder_sparse_step", "moe_layer_freq")
    return step <= 1 or (index + 1) % step == 0


# ---- vision towers -----------------------------------------------------------------


def _vision_params(vision: Config | None, text_hidden: int) -> int:
    """A ViT's parameters: per layer 4 h^2 (attention) + 2 h i (MLP), a patch embedding
    and a projector into the text model; vLLM loads the tower with the model."""
    if not vision:
        return 0
    reader = _Reader(vision, "vision_config")
    try:
        hidden = reader.positive_int("hidden_size", "width", "embed_dim")
        layers = reader.positive_int("num_hidden_layers", "depth", "layers")
    except ConfigError:
        return 0
    intermediate = reader.int_or(4 * hidden, "intermediate_size")
    patch = reader.int_or(14, "patch_size")
    per_layer = 4 * hidden * hidden + 2 * hidden * intermediate
    return layers * per_layer + 3 * patch * patch * hidden + hidden * text_hidden
