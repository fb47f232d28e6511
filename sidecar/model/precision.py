"""Storage precision of weights and KV cache, including quantization metadata.

A `Precision` answers two questions: how many bits one weight costs in memory
(scales and zero points included) and which tensor-core rate its matmuls run at.

Worked example, AWQ/GPTQ int4 with group size 128: each weight is 4 bits, each
group of 128 input weights per output column carries a 16-bit scale and a packed
4-bit zero point: 4 + 16/128 + 4/128 = 4.156 bits per weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class ComputeRate(StrEnum):
    """Which peak of the GPU a matmul on these weights can use."""

    BF16 = "bf16"
    FP8 = "fp8"
    FP4 = "fp4"


@dataclass(frozen=True)
class Precision:
    name: str
    bits_per_weight: float
    compute: ComputeRate = ComputeRate.BF16

    @property
    def bytes_per_weight(self) -> float:
        return self.bits_per_weight / 8


FLOAT32 = Precision("float32", 32.0)
BFLOAT16 = Precision("bfloat16", 16.0)
FLOAT16 = Precision("float16", 16.0)
FP8 = Precision("fp8", 8.0, ComputeRate.FP8)
INT8 = Precision("int8", 8.0)
INT4 = Precision("int4", 4.0)


def fp8_block_scaled(block_rows: int, block_cols: int) -> Precision:
    """FP8 weights with one fp32 scale per block (DeepSeek-V3 style 128x128 blocks)."""
    return Precision(
        f"fp8-block{block_rows}x{block_cols}",
        8.0 + 32.0 / (block_rows * block_cols),
        ComputeRate.FP8,
    )


def int_grouped(bits: int, group_size: int, *, zero_point: bool = True) -> Precision:
    """Integer weight-only quantization with a 16-bit scale per group (AWQ, GPTQ, ...).

    Weight-only int formats dequantize to bf16 for the matmul, so compute runs at
    the bf16 rate.  A group size <= 0 means one scale per output channel, which is
    negligible per weight.
    """
    if group_size <= 0:
        return Precision(f"int{bits}-channel", float(bits))
    zeros_bits = bits if zero_point else 0
    return Precision(
        f"int{bits}-g{group_size}", bits + (16.0 + zeros_bits) / group_size
    )


def microscaled_fp4(group_size: int, scale_bits: int, name: str) -> Precision:
    """FP4 with a shared scale per small group: mxfp4 (32, e8m0) or nvfp4 (16, fp8)."""
    return Precision(name, 4.0 + scale_bits / group_size, ComputeRate.FP4)


MXFP4 = microscaled_fp4(32, 8, "mxfp4")
NVFP4 = microscaled_fp4(16, 8, "nvfp4")


_BY_TORCH_DTYPE: dict[str, Precision] = {
    "float32": FLOAT32,
    "float": FLOAT32,
    "bfloat16": BFLOAT16,
    "float16": FLOAT16,
    "half": FLOAT16,
}


def served_dtype(torch_dtype: str | None) -> Precision:
    """The precision vLLM's `--dtype auto` serves a checkpoint in.

    vLLM keeps bf16 and fp16 checkpoints as they are and serves fp32 checkpoints
    in bf16 (half precision on GPUs); a config without a dtype is taken as bf16.
    """
    if torch_dtype is None:
        return BFLOAT16
    precision = _BY_TORCH_DTYPE.get(torch_dtype.removeprefix("torch."))
    if precision is None or precision is FLOAT32:
        return BFLOAT16
    return precision


def kv_element_bytes(kv_cache_dtype: str, model_dtype: Precision) -> int:
    """Bytes per KV element: `auto` follows the model's activation dtype, fp8 is 1."""
    if kv_cache_dtype == "auto":
        return max(1, int(model_dtype.bytes_per_weight))
    if kv_cache_dtype.startswith("fp8"):
        return 1
    if kv_cache_dtype in ("bfloat16", "float16", "half"):
        return 2
    if kv_cache_dtype in ("float32", "float"):
        return 4
    raise ValueError(f"unknown KV cache dtype {kv_cache_dtype!r} (use auto or fp8)")
