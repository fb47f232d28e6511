"""The context length vLLM derives from a Hugging Face config (vLLM 0.32,
`vllm/config/model.py:_get_and_verify_max_len` and the model-architecture convertor's
`derive_max_model_len_and_key`):

- the smallest of the length keys present (`max_position_embeddings`, `n_positions`,
  `max_seq_len`, ...), or `model_max_length` whenever the config gives it (Command-R).
  With none, vLLM checks no `--max-model-len` and serves the model class's default
  length, which a config file does not say: 2048 (vLLM's own fallback) is assumed;
- times the RoPE scaling factor, for the scaling types whose factor is not already in
  `max_position_embeddings` (linear, dynamic, ...; not YaRN, Llama 3, LongRoPE), except
  Gemma 3, whose length is already scaled;
- served by default at that length, or at `original_max_position_embeddings` for a
  LongRoPE model (Phi-3.5), which vLLM prefers for the speed of short sequences.

Only the config file is read: a value that Transformers' config class fills in when
the file leaves it out (a class's default length, Phi3Config's original length of
4,096) is not known here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from sidecar.model.architecture import ContextLength
from sidecar.model.errors import ConfigError

# vLLM's keys for the model's length, in its order (the smallest present wins).
LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
               "model_max_length", "max_target_positions", "max_sequence_length",
               "max_seq_length", "seq_len")
# Without any of them: vLLM's fallback (the model class's own default, when it has one,
# is not in the config file).
DEFAULT_LENGTH = 2048
# RoPE types whose factor is already in max_position_embeddings (or that extend nothing).
_UNSCALED_ROPE_TYPES = frozenset({"su", "longrope", "llama3", "yarn", "deepseek_yarn",
                                  "deepseek_llama_scaling"})
# Legacy names vLLM patches to the modern ones.
_LEGACY_ROPE_TYPES = {"su": "longrope", "mrope": "default", "telechat3-yarn": "yarn"}
# Transformers' layer types: RoPE parameters keyed by those of a config's `layer_types`
# are one set per layer type.
_LAYER_TYPES = frozenset({
    "full_attention", "sliding_attention", "chunked_attention", "window_attention",
    "indexed_attention", "compressed_sparse_attention", "heavily_compressed_attention",
    "minimax_m3_sparse", "conv", "moe", "hybrid", "hybrid_sliding", "linear_attention",
    "sparse", "dense"})


def context_length(cfg: Mapping[str, Any], model_type: str, name: str,
                   read_int: Callable[[str], int | None]) -> ContextLength:
    """vLLM's limit and default context length for the text model's config `cfg`;
    `read_int` reads one integer field (None when absent), with an error naming it."""
    lengths = {key: value for key in LENGTH_KEYS if (value := read_int(key)) is not None}
    if not lengths:
        return ContextLength(limit=None, default=DEFAULT_LENGTH,
                             source="no length in the config (vLLM checks none)")
    key = ("model_max_length" if lengths.get("model_max_length")
           else min(lengths, key=lambda k: lengths[k]))
    derived = float(lengths[key])
    source = key
    rope = list(_rope_parameters(cfg, name))
    if rope and "gemma3" not in model_type:
        factor = 1.0
        for params in rope:
            if params["rope_type"] not in _UNSCALED_ROPE_TYPES:
                factor = _factor(params.get("factor", factor), name)
        if factor != 1.0:
            derived *= factor
            source = f"{source} x rope factor {factor:g}"
    limit = int(derived)
    default = limit
    if any(params["rope_type"] == "longrope" for params in rope):
        original = read_int("original_max_position_embeddings")
        if original is not None:
            default = original
    if limit <= 0 or default <= 0:
        raise ConfigError(f"{name}: the config's context length ({source}) must be positive")
    return ContextLength(limit=limit, default=default, source=source)


def _factor(value: object, name: str) -> float:
    if value is None:  # vLLM falls back to 1.0 (and warns)
        return 1.0
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"{name}: rope scaling 'factor' must be a positive number, "
                          f"got {value!r}")
    return float(value)


def _rope_parameters(cfg: Mapping[str, Any], name: str) -> Iterator[dict[str, Any]]:
    """Each set of RoPE parameters (one per layer type when nested), with its modern
    `rope_type`. Transformers reads a legacy `rope_scaling` in place of
    `rope_parameters` (first when both are there), and nests them by layer type only
    under the config's own `layer_types` (as the config classes that read them do,
    Qwen3's and Gemma 3's among them)."""
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    found = cfg.get(key)
    if not found:
        return
    if not isinstance(found, Mapping):
        raise ConfigError(f"{name}: config field {key!r} must be an object, got {found!r}")
    layer_types = cfg.get("layer_types")
    declared = ({kind for kind in layer_types if isinstance(kind, str)} & _LAYER_TYPES
                if isinstance(layer_types, list) else set())
    nested = set(found) <= declared
    for params in (found.values() if nested else [found]):
        if not params:
            continue
        if not isinstance(params, Mapping):
            raise ConfigError(f"{name}: config field {key!r} must hold objects, "
                              f"got {params!r}")
        rope_type = params.get("rope_type", params.get("type", "default"))
        rope_type = _LEGACY_ROPE_TYPES.get(str(rope_type), str(rope_type))
        yield {**params, "rope_type": rope_type}
