"""The context length vLLM derives from a Hugging Face config (vLLM 0.32,
`vllm/config/model.py:_get_and_verify_max_len` and the model-architecture convertor's
`derive_max_model_len_and_key`):

- the smallest of the length keys present (`max_position_embeddings`, `n_positions`,
  `max_seq_len`, ...), or `model_max_length` whenever the config gives it (Command-R);
  2048 when none is;
- times the RoPE scaling factor, for the scaling types whose factor is not already in
  `max_position_embeddings` (linear, dynamic, ...; not YaRN, Llama 3, LongRoPE), except
  Gemma 3, whose length is already scaled;
- served by default at that length, or at `original_max_position_embeddings` for a
  LongRoPE model (Phi-3.5), which vLLM prefers for the speed of short sequences.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from sidecar.model.architecture import ContextLength
from sidecar.model.errors import ConfigError

# vLLM's keys for the model's length, in its order (the smallest present wins).
LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
               "model_max_length", "max_target_positions", "max_sequence_length",
               "max_seq_length", "seq_len")
# Without any of them vLLM assumes this length (and warns).
DEFAULT_LENGTH = 2048
# RoPE types whose factor is already in max_position_embeddings (or that extend nothing).
_UNSCALED_ROPE_TYPES = frozenset({"su", "longrope", "llama3", "yarn", "deepseek_yarn",
                                  "deepseek_llama_scaling"})
# Legacy names vLLM patches to the modern ones.
_LEGACY_ROPE_TYPES = {"su": "longrope", "mrope": "default"}


def context_length(cfg: Mapping[str, Any], model_type: str, name: str) -> ContextLength:
    """vLLM's limit and default context length for the text model's config `cfg`."""
    lengths = {key: _length(cfg, key, name) for key in LENGTH_KEYS if cfg.get(key) is not None}
    if lengths.get("model_max_length"):
        key = "model_max_length"
    elif lengths:
        key = min(lengths, key=lambda k: lengths[k])
    else:
        key = ""
    derived = float(lengths[key]) if key else float(DEFAULT_LENGTH)
    source = key or f"vLLM's default of {DEFAULT_LENGTH} (the config gives no length)"
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
        original = cfg.get("original_max_position_embeddings")
        if original is not None:
            default = _length(cfg, "original_max_position_embeddings", name)
    if limit <= 0 or default <= 0:
        raise ConfigError(f"{name}: the config's context length ({source}) must be positive")
    return ContextLength(limit=limit, default=default, source=source)


def _length(cfg: Mapping[str, Any], key: str, name: str) -> int:
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise ConfigError(f"{name}: config field {key!r} must be an integer, got {value!r}")
    return int(value)


def _factor(value: object, name: str) -> float:
    if value is None:  # vLLM falls back to 1.0 (and warns)
        return 1.0
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"{name}: rope scaling 'factor' must be a positive number, "
                          f"got {value!r}")
    return float(value)


def _rope_parameters(cfg: Mapping[str, Any], name: str) -> Iterator[dict[str, Any]]:
    """Each set of RoPE parameters (one per layer type when nested), with its modern
    `rope_type` (Transformers reads a legacy `rope_scaling` as `rope_parameters`)."""
    found = cfg.get("rope_parameters")
    if found is None:
        found = cfg.get("rope_scaling")
    if found is None:
        return
    if not isinstance(found, Mapping):
        raise ConfigError(f"{name}: config field 'rope_scaling' must be an object, "
                          f"got {found!r}")
    nested = bool(found) and all(isinstance(v, Mapping) for v in found.values())
    for params in (found.values() if nested else [found]):
        if not params:
            continue
        rope_type = params.get("rope_type", params.get("type", "default"))
        rope_type = _LEGACY_ROPE_TYPES.get(str(rope_type), str(rope_type))
        yield {**params, "rope_type": rope_type}
