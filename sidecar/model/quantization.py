"""Which precision each kind of weight is stored in, from `quantization_config` or a
`--dtype` override.

Quantization schemes convert the linear layers of attention and MLPs; embeddings,
lm_head, norms and MoE routers stay at the served dtype unless the scheme says
otherwise. `modules_to_not_convert` / `ignore` lists keep further roles at full
precision (gpt-oss keeps attention in bf16 and quantizes only its experts).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from sidecar.model.architecture import Role
from sidecar.model.errors import ConfigError, DeploymentError
from sidecar.model.precision import (
    BFLOAT16,
    FLOAT16,
    FP8,
    INT8,
    MXFP4,
    NVFP4,
    ComputeRate,
    Precision,
    fp8_block_scaled,
    int_grouped,
    served_dtype,
)

_LINEAR_ROLES = frozenset({Role.ATTENTION, Role.MLP, Role.EXPERTS, Role.SHARED_EXPERTS})

DTYPE_CHOICES = ("auto", "bfloat16", "float16", "fp8", "int8", "int4")


@dataclass(frozen=True)
class WeightPrecision:
    """Precision per parameter role; roles not listed use `default`."""

    default: Precision
    by_role: Mapping[Role, Precision] = field(default_factory=dict)
    label: str = ""
    # Kernels that pad expert matrices: (hidden multiple, intermediate multiple).
    expert_padding: tuple[int, int] | None = None
    # Whole decoder layers the checkpoint keeps unquantized (`model.layers.0`).
    unconverted_layers: frozenset[int] = frozenset()

    def of(self, role: Role) -> Precision:
        return self.by_role.get(role, self.default)

    @property
    def compute(self) -> ComputeRate:
        """The rate of the bulk matmuls (the linear layers)."""
        rates = {self.of(role).compute for role in _LINEAR_ROLES}
        if ComputeRate.BF16 in rates:
            return ComputeRate.BF16
        return ComputeRate.FP8 if ComputeRate.FP8 in rates else ComputeRate.FP4


def weight_precision(
    quantization: Mapping[str, object] | None,
    torch_dtype: str | None,
    dtype_override: str = "auto",
) -> WeightPrecision:
    """Resolve the weight precision of a checkpoint as vLLM would serve it."""
    base = served_dtype(torch_dtype)
    if dtype_override not in DTYPE_CHOICES:
        raise DeploymentError(
            f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype_override!r}"
        )
    if dtype_override == "bfloat16":
        return WeightPrecision(BFLOAT16, label="bfloat16")
    if dtype_override == "float16":
        return WeightPrecision(FLOAT16, label="float16")
    if dtype_override == "fp8":
        return _linear_only(base, FP8, "fp8 (override)")
    if dtype_override == "int8":
        return _linear_only(base, Precision("int8-w8a8", 8.0, ComputeRate.FP8), "int8 (override)")
    if dtype_override == "int4":
        return _linear_only(base, int_grouped(4, 128), "int4-g128 (override)")
    if not quantization:
        return WeightPrecision(base, label=base.name)
    return _from_quantization_config(quantization, base)


def _linear_only(
    base: Precision, quantized: Precision, label: str, keep: Iterable[Role] = (),
    layers: frozenset[int] = frozenset(),
) -> WeightPrecision:
    kept = set(keep)
    by_role = {role: quantized for role in _LINEAR_ROLES if role not in kept}
    return WeightPrecision(base, by_role, label, unconverted_layers=layers)


_WHOLE_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)$")


def _layers_not_converted(patterns: object) -> frozenset[int]:
    """Decoder layers listed whole (`model.layers.0`), kept at full precision."""
    if not isinstance(patterns, list):
        return frozenset()
    found = (_WHOLE_LAYER.search(p) for p in patterns if isinstance(p, str))
    return frozenset(int(m.group(1)) for m in found if m)


def _roles_not_converted(patterns: object) -> set[Role]:
    """Roles named by a `modules_to_not_convert` / `ignore` list.

    An entry naming one layer's module (`model.layers.0.mlp.gate`) marks the whole
    role: checkpoints list such exceptions for every layer or for none.
    """
    roles: set[Role] = set()
    if not isinstance(patterns, list):
        return roles
    for raw in patterns:
        if not isinstance(raw, str):
            continue
        name = raw.lower()
        if "lm_head" in name:
            roles.add(Role.LM_HEAD)
        elif "embed" in name and "vision" not in name:
            roles.add(Role.EMBEDDING)
        elif "router" in name or name.endswith(("mlp.gate", ".gate")):
            roles.add(Role.ROUTER)
        elif "vision" in name or "visual" in name or "mm_projector" in name:
            roles.add(Role.VISION)
        elif "self_attn" in name or ".attn" in name or name.endswith("attention"):
            roles.add(Role.ATTENTION)
    return roles


def _from_quantization_config(
    quantization: Mapping[str, object], base: Precision
) -> WeightPrecision:
    method = str(quantization.get("quant_method") or quantization.get("quant_algo") or "").lower()
    excluded = (
        quantization.get("modules_to_not_convert")
        or quantization.get("ignored_layers")
        or quantization.get("ignore")
        or quantization.get("exclude_modules")
    )
    not_converted = _roles_not_converted(excluded)
    layers = _layers_not_converted(excluded)
    if method in ("fp8", "fbgemm_fp8", "fp8_dynamic"):
        block = quantization.get("weight_block_size")
        if isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) for b in block):
            precision = fp8_block_scaled(int(block[0]), int(block[1]))
        else:
            precision = FP8
        return _linear_only(base, precision, precision.name, not_converted, layers)
    if method in ("awq", "gptq", "awq_marlin", "gptq_marlin", "auto-round", "autoround"):
        bits = _int_field(quantization, ("bits", "w_bit"), 4)
        group = _int_field(quantization, ("group_size", "q_group_size"), 128)
        zero_point = bool(quantization.get("zero_point", True)) or method.startswith("gptq")
        precision = int_grouped(bits, group, zero_point=zero_point)
        return _linear_only(base, precision, f"{method} {precision.name}", not_converted)
    if method == "mxfp4":
        kept = not_converted | {Role.ATTENTION, Role.MLP, Role.SHARED_EXPERTS}
        experts_only = _linear_only(base, MXFP4, "mxfp4 (experts)", kept)
        # vLLM's Marlin/TRT-LLM MXFP4 MoE kernels pad hidden to 256, intermediate to 128.
        return replace(experts_only, expert_padding=(256, 128))
    if method == "modelopt" or method in ("nvfp4", "modelopt_fp4"):
        algo = str(quantization.get("quant_algo") or method).upper()
        precision = NVFP4 if "FP4" in algo else FP8
        return _linear_only(base, precision, f"modelopt {precision.name}", not_converted,
                            layers)
    if method == "compressed-tensors":
        return _compressed_tensors(quantization, base, not_converted)
    if method == "bitsandbytes":
        if quantization.get("load_in_4bit"):
            # NF4 with one fp32 absmax per 64 weights (8-bit with double quantization).
            return _linear_only(base, Precision("nf4", 4.0 + 8.0 / 64), "bitsandbytes nf4",
                                not_converted)
        return _linear_only(base, Precision("int8-bnb", 8.0 + 32.0 / 4096), "bitsandbytes int8",
                            not_converted)
    raise ConfigError(
        f"quantization method {method or '(none)'!r} is not supported; supported: fp8, awq, "
        "gptq, mxfp4, modelopt, compressed-tensors, bitsandbytes (or override with --dtype)"
    )


def _int_field(cfg: Mapping[str, object], keys: Iterable[str], default: int) -> int:
    for key in keys:
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return default


def _compressed_tensors(
    quantization: Mapping[str, object], base: Precision, not_converted: set[Role]
) -> WeightPrecision:
    groups = quantization.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ConfigError("compressed-tensors quantization_config has no config_groups")
    first = next(iter(groups.values()))
    weights = first.get("weights") if isinstance(first, Mapping) else None
    if not isinstance(weights, Mapping):
        raise ConfigError("compressed-tensors config group has no 'weights' entry")
    bits = _int_field(weights, ("num_bits",), 8)
    kind = str(weights.get("type", "int"))
    group = _int_field(weights, ("group_size",), 0)
    activations = first.get("input_activations") if isinstance(first, Mapping) else None
    act_bits = (
        _int_field(activations, ("num_bits",), 16) if isinstance(activations, Mapping) else 16
    )
    if kind == "float" and bits == 4:
        precision = NVFP4 if group in (0, 16) else Precision(
            f"fp4-g{group}", 4.0 + 8.0 / group, ComputeRate.FP4
        )
    elif kind == "float" and bits == 8:
        block = weights.get("block_structure")
        if isinstance(block, list) and len(block) == 2:
            precision = fp8_block_scaled(int(block[0]), int(block[1]))
        else:
            precision = FP8
    elif bits == 8 and act_bits == 8:
        precision = Precision("int8-w8a8", 8.0, ComputeRate.FP8)
    elif bits == 8:
        precision = INT8 if group <= 0 else int_grouped(8, group, zero_point=False)
    else:
        symmetric = bool(weights.get("symmetric", True))
        precision = int_grouped(bits, group, zero_point=not symmetric)
    return _linear_only(base, precision, f"compressed-tensors {precision.name}", not_converted)
