"""kvgate's KV capacity equals what vLLM 0.32's own KV cache planner computes, for the
layer kinds the CPU build cannot serve: MLA + DSA indexer (DeepSeek-V3.2, GLM-5 with
IndexShare), DeepSeek-V4 compressed attention (sliding-window caches, compressed
latents per ratio, indexers and fp32 compressor states in packed groups), and Mamba-2 /
gated-delta-net hybrids (Qwen3-Next, Qwen3.5, Nemotron-H).

`support/vllm_planner.py` runs under the vLLM CPU build's python: it builds each layer's
spec with vLLM's spec classes and state calculators as the model code does, applies
vLLM's family defaults, and runs vLLM's grouping and capacity functions. The matrix
covers two context lengths, bf16 and fp8 KV, TP 1 and TP > 1, prefix caching on and
off (mamba cache mode align / none), speculative tokens, --block-size, Hopper and
Blackwell (fp8_ds_mla vs plain fp8 for sparse MLA; GLM's fp8 default on Blackwell), and
for DeepSeek-V4 contexts up to 1M tokens, SM90/SM100/SM120 and both layouts of its
attention backends (fp8_ds_mla, and plain bf16 / fp8 rows with FlashInfer).
Configs: tests/data/planner (each names its source)."""

from __future__ import annotations

import json
import subprocess
from dataclasses import asdict, dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from sidecar.model import Deployment, ServedModel, read_architecture
from sidecar.model.gpu import Gpu, find_gpu

from support.env import vllm_python

pytestmark = [pytest.mark.vllm]

DATA = Path(__file__).parent / "data" / "planner"
ORACLE = Path(__file__).parent / "support" / "vllm_planner.py"
GIB = 1024**3
BUDGET = 61 * GIB + 123_456_789  # not a whole number of blocks for any layout

SPARSE_MLA = ("deepseek-ai__DeepSeek-V3.2-Exp", "zai-org__GLM-5.2")
COMPRESSED = ("deepseek-ai__DeepSeek-V4-Flash",)
FLASHINFER_V4 = "FLASHINFER_MLA_SPARSE_DSV4"
HYBRIDS = ("Qwen__Qwen3-Next-80B-A3B-Instruct", "Qwen__Qwen3.5-9B",
           "nvidia__NVIDIA-Nemotron-Nano-9B-v2")
GPU_BY_CAPABILITY = {90: "H100", 100: "B200"}


@dataclass(frozen=True)
class Setting:
    model: str
    max_model_len: int
    kv_cache_dtype: str = "auto"
    tp: int = 1
    prefix_caching: bool = True
    capability: int = 90
    block_size: int | None = None
    num_speculative_tokens: int = 0
    mamba_ssm_cache_dtype: str = "auto"
    attention_backend: str | None = None
    speculative_method: str | None = None

    @property
    def id(self) -> str:
        parts = [self.model.split("__")[1], f"len{self.max_model_len}", self.kv_cache_dtype,
                 f"tp{self.tp}", "pc" if self.prefix_caching else "nopc",
                 f"sm{self.capability}"]
        if self.block_size:
            parts.append(f"bs{self.block_size}")
        if self.num_speculative_tokens:
            parts.append(f"spec{self.num_speculative_tokens}")
        if self.mamba_ssm_cache_dtype != "auto":
            parts.append(f"ssm-{self.mamba_ssm_cache_dtype}")
        if self.attention_backend:
            parts.append(self.attention_backend.lower())
        if self.speculative_method:
            parts.append(self.speculative_method)
        return "-".join(parts)


def _matrix() -> list[Setting]:
    settings = []
    for model in SPARSE_MLA:
        for length in (32_768, 163_840):
            for dtype in ("auto", "fp8"):
                for tp in (1, 8):
                    for capability in (90, 100):
                        settings.append(Setting(model, length, dtype, tp,
                                                capability=capability))
        settings.append(Setting(model, 65_536, "auto", 8, prefix_caching=False))
        settings.append(Setting(model, 65_536, "auto", 8, block_size=128))
    for model in COMPRESSED:
        for length in (32_768, 131_072, 1_048_576):
            for dtype in ("auto", "fp8"):
                for backend in (None, FLASHINFER_V4):
                    settings.append(Setting(model, length, dtype, 1,
                                            attention_backend=backend))
        for capability in (100, 120):
            for backend in (None, FLASHINFER_V4):
                settings.append(Setting(model, 131_072, "fp8", 8, capability=capability,
                                        attention_backend=backend))
        settings.append(Setting(model, 1_048_576, "auto", 4, prefix_caching=False))
        settings.append(Setting(model, 131_072, "auto", 1, block_size=512))
        settings.append(Setting(model, 65_536, "bfloat16", 1, attention_backend=FLASHINFER_V4))
        settings.append(Setting(model, 131_072, "auto", 8, num_speculative_tokens=3,
                                speculative_method="mtp"))
    for model in HYBRIDS:
        for length in (8_192, 131_072):
            for dtype in ("auto", "fp8"):
                for tp in (1, 4):
                    for prefix in (True, False):
                        settings.append(Setting(model, length, dtype, tp, prefix))
        settings.append(Setting(model, 32_768, "auto", 2, num_speculative_tokens=2))
        if model != HYBRIDS[-1]:  # Nemotron-H: no MTP drafter modelled
            for prefix in (True, False):
                settings.append(Setting(model, 32_768, "auto", 2, prefix,
                                        num_speculative_tokens=2, speculative_method="mtp"))
        settings.append(Setting(model, 32_768, "auto", 2, block_size=64))
        settings.append(Setting(model, 32_768, "auto", 1, mamba_ssm_cache_dtype="bfloat16"))
    return settings


MATRIX = _matrix()


def _config(model: str) -> dict[str, Any]:
    raw: dict[str, Any] = json.loads((DATA / f"{model}.json").read_text())
    return raw


@cache
def vllm_plans() -> dict[str, dict[str, Any]]:
    """vLLM's planner on the whole matrix, in one run of the vLLM python."""
    request = [
        {"config": _config(s.model), "tp": s.tp, "max_model_len": s.max_model_len,
         "kv_cache_dtype": s.kv_cache_dtype, "block_size": s.block_size,
         "prefix_caching": s.prefix_caching, "capability": s.capability,
         "num_speculative_tokens": s.num_speculative_tokens,
         "mamba_ssm_cache_dtype": s.mamba_ssm_cache_dtype,
         "attention_backend": s.attention_backend,
         "speculative_method": s.speculative_method,
         "available_bytes": BUDGET, "max_num_batched_tokens": 8192}
        for s in MATRIX
    ]
    proc = subprocess.run([vllm_python(), str(ORACLE)], input=json.dumps(request),
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    plans: list[dict[str, Any]] = json.loads(proc.stdout)
    return {s.id: plan for s, plan in zip(MATRIX, plans, strict=True)}


def kvgate(setting: Setting) -> ServedModel:
    arch = read_architecture(DATA / f"{setting.model}.json")
    deployment = Deployment(
        tp=setting.tp, kv_cache_dtype=setting.kv_cache_dtype,
        max_model_len=setting.max_model_len, block_size=setting.block_size,
        max_num_batched_tokens=8192, available_kv_bytes=BUDGET,
        enable_prefix_caching=setting.prefix_caching,
        num_speculative_tokens=setting.num_speculative_tokens,
        mamba_ssm_cache_dtype=setting.mamba_ssm_cache_dtype,
        attention_backend=setting.attention_backend,
        speculative_method=setting.speculative_method,
    )
    return ServedModel(arch, deployment, gpu_of_capability(setting.capability))


def gpu_of_capability(capability: int) -> Gpu:
    """A catalogue GPU of that compute capability; SM12x (no datacentre part in the
    catalogue) as a B200 with SM 12.0: only the capability matters with a given budget."""
    if capability in GPU_BY_CAPABILITY:
        return find_gpu(GPU_BY_CAPABILITY[capability])
    return replace(find_gpu("B200"), compute_capability=(capability // 10, capability % 10))


def test_the_matrix_covers_what_the_issue_asks() -> None:
    assert {s.model for s in MATRIX} == set(SPARSE_MLA + COMPRESSED + HYBRIDS)
    for model in SPARSE_MLA + COMPRESSED + HYBRIDS:
        rows = [s for s in MATRIX if s.model == model]
        assert len({s.max_model_len for s in rows}) >= 2
        assert {s.kv_cache_dtype for s in rows} >= {"auto", "fp8"}
        assert {s.tp > 1 for s in rows} == {True, False}
        assert {s.prefix_caching for s in rows} == {True, False}


@pytest.mark.parametrize("setting", MATRIX, ids=lambda s: s.id)
def test_capacity_equals_vllms_planner(setting: Setting) -> None:
    expected = vllm_plans()[setting.id]
    served = kvgate(setting)
    capacity = served.capacity
    assert capacity is not None
    got = {
        "block_size": served.block_size,
        # Layers per group differ only by padding: kvgate counts the padding layers
        # of the last group of a kind, vLLM lists the real ones.
        "groups": sorted((g.block_size, g.page_bytes,
                          g.budgeted_blocks(served.max_model_len, served.in_flight_tokens))
                         for g in served.layout.groups),
        "num_gpu_blocks": capacity.num_blocks,
        "blocks_per_request": capacity.blocks_per_request,
        "kv_capacity_tokens": capacity.kv_capacity_tokens,
        "max_concurrency": capacity.max_concurrency,
    }
    want = {
        "block_size": expected["block_size"],
        "groups": sorted((g["block_size"], g["page_bytes"],
                          g["blocks_per_request"]) for g in expected["groups"]),
        "num_gpu_blocks": expected["num_gpu_blocks"],
        "blocks_per_request": expected["blocks_per_request"],
        "kv_capacity_tokens": expected["kv_capacity_tokens"],
        "max_concurrency": expected["max_concurrency"],
    }
    assert got == want, asdict(setting)
