"""The public measurements in tests/data/groundtruth, mapped onto the model's inputs.

Every row of `kv_capacity.csv` and `latency.csv` becomes a case: the model config
(the row's own, or the architecture-equivalent base where the row names a fine-tune
or a re-packaging), the GPU from the catalogue, TP, dtype / quantization,
max_model_len, gpu_memory_utilization and the engine (vLLM V0 or V1, TensorRT-LLM).
Each value comes from the row's columns or, where a column is empty, from what the
row's notes state (`gpu_memory_utilization not set (default 0.9)`), by general rules
(vLLM's defaults for its version, the benchmark's warm-up request) - never a value
set for one row. A row the model cannot be run on keeps a `skip` reason.

The start-up figures that latency.csv quotes in its notes (`KV 5.01 GiB (93,872
tokens)` for one deployment) are KV-capacity measurements too; they become extra
KV cases, one per distinct deployment.

Shared by `bench/model_accuracy.py` and `tests/test_groundtruth.py`, so the benchmark
and the tests judge the model on exactly the same inputs.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from sidecar.model import (
    Deployment,
    Gpu,
    ModelArchitecture,
    ServedModel,
    find_gpu,
    parse_config,
    steady_latency,
)
from sidecar.model.gpu import over_network
from sidecar.model.latency import DEFAULT_EFFICIENCY, Efficiency
from sidecar.model.units import GIB

DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "groundtruth"
CONFIG_DIR = DATA_DIR / "configs"

# vLLM logs GiB figures rounded to two decimals.
LOG_ROUNDING_GIB = 0.005
BLOCK_SIZE = 16

# ---- model configs -------------------------------------------------------------------

# Rows that name a fine-tune or another packaging of an architecture whose config is in
# tests/data/groundtruth/configs: (config of the equivalent base, why it is equivalent).
EQUIVALENT_CONFIG: dict[str, tuple[str, str]] = {
    "meta-llama/Llama-3.1-8B-Instruct": (
        "meta-llama/Meta-Llama-3.1-8B", "instruct fine-tune of Llama-3.1-8B"),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B": (
        "Qwen/Qwen2.5-14B", "R1 distilled into Qwen2.5-14B"),
    "meta-llama/Llama-2-7b": ("meta-llama/Llama-2-7b-hf", "the same model in HF format"),
    "meta-llama/Llama-2-13b": ("meta-llama/Llama-2-13b-hf", "the same model in HF format"),
    "meta-llama/Llama-2-70b": ("meta-llama/Llama-2-70b-hf", "the same model in HF format"),
    "meta-llama/Meta-Llama-3.1-405B-Instruct-FP8": (
        "meta-llama/Meta-Llama-3.1-405B",
        "instruct fine-tune of Llama-3.1-405B, with the FP8 checkpoint's quantization_config"),
    "deepseek-ai/DeepSeek-Coder-V2-Lite-Instruct": (
        "deepseek-ai/DeepSeek-V2-Lite", "coder fine-tune of DeepSeek-V2-Lite"),
    "Qwen/Qwen3-14B-AWQ": (
        "Qwen/Qwen3-14B", "AWQ 4-bit weights of Qwen3-14B (the row's quantization column)"),
    "meta-llama/Meta-Llama-3.1-8B-Instruct": (
        "meta-llama/Meta-Llama-3.1-8B", "instruct fine-tune of Llama-3.1-8B"),
    "meta-llama/Meta-Llama-3-8B-Instruct": (
        "meta-llama/Meta-Llama-3.1-8B", "Llama 3 8B: the layers, heads and vocabulary of "
        "Llama 3.1 8B, with an 8,192-token context and no RoPE scaling (the row's "
        "max_model_len)"),
    "meta-llama/Llama-3.3-70B-Instruct": (
        "meta-llama/Meta-Llama-3.1-70B", "Llama 3.3 70B: the layers, heads and vocabulary "
        "of Llama 3.1 70B"),
    "Qwen/Qwen3-235B-A22B-Instruct-2507": (
        "Qwen/Qwen3-235B-A22B", "the July 2025 instruct update of Qwen3-235B-A22B: the same "
        "layers, experts and heads, its context extended from 40,960 to 262,144 tokens"),
}

# The quantization_config of checkpoints whose own config.json is not in the data:
# Meta's FP8 405B (fbgemm_fp8, FP8 rowwise) keeps lm_head, every self_attn and the
# first and last decoder layers in bf16 (as transformers' conversion script for it
# lists them).
CHECKPOINT_QUANTIZATION: dict[str, dict[str, Any]] = {
    "meta-llama/Meta-Llama-3.1-405B-Instruct-FP8": {
        "quant_method": "fbgemm_fp8",
        "activation_scale_ub": 1200.0,
        "modules_to_not_convert": [
            "model.layers.0", "model.layers.125", "lm_head",
            *(f"model.layers.{i}.self_attn" for i in range(1, 125)),
        ],
    },
}


def model_name(raw: str) -> str:
    """`meta-llama/Llama-2-13b (benchmark name "LLaMA v2 13B")` -> `meta-llama/Llama-2-13b`."""
    return raw.split(" (", maxsplit=1)[0].strip()


def _config_path(hf_id: str) -> Path:
    return CONFIG_DIR / (hf_id.replace("/", "__", 1) + ".json")


@dataclass(frozen=True)
class ModelChoice:
    """The config a row is run on, or why there is none."""

    config: str | None  # the HF id of the config used
    note: str
    arch: ModelArchitecture | None = field(default=None, compare=False, repr=False)

    @property
    def skip(self) -> str | None:
        return None if self.arch is not None else self.note


@cache
def choose_model(raw_model: str) -> ModelChoice:
    name = model_name(raw_model)
    if _config_path(name).is_file():
        hf_id, note = name, "own config"
    elif name in EQUIVALENT_CONFIG:
        hf_id, why = EQUIVALENT_CONFIG[name]
        note = f"config of {hf_id} ({why})"
    else:
        return ModelChoice(None, f"no config for {name} or an architecture-equivalent base "
                                 "in tests/data/groundtruth/configs")
    raw = json.loads(_config_path(hf_id).read_text(encoding="utf-8"))
    if name in CHECKPOINT_QUANTIZATION:
        raw["quantization_config"] = CHECKPOINT_QUANTIZATION[name]
    return ModelChoice(hf_id, note, parse_config(raw, name))


# ---- GPUs ----------------------------------------------------------------------------

# Ordered (pattern, catalogue name): the first pattern found in the row's GPU text wins.
_GPU_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"\bGH200\b", "GH200"),
    (r"\bH200\b", "H200"),
    (r"\bH100 NVL\b", "H100-NVL"),
    (r"\bH100\b", "H100-SXM"),
    (r"\bA100\b.*\b40 ?GB\b", "A100-40GB"),
    (r"\bA100\b.*\b80 ?GB\b", "A100-80GB"),
    (r"\bL40S\b", "L40S"),
    (r"\bL40\b", "L40"),
    (r"\bL4\b", "L4"),
    (r"\bA10G\b", "A10G"),
    (r"\bA10\b", "A10"),
    (r"\bRTX 6000 Ada\b", "RTX-6000-Ada"),
    (r"\bRTX A5000\b", "RTX-A5000"),
    (r"\bRTX 4090\b", "RTX-4090"),
    (r"\bRTX 3090\b", "RTX-3090"),
    (r"\bT4\b", "T4"),
)


@dataclass(frozen=True)
class GpuChoice:
    gpu: Gpu | None
    note: str
    cross_node: bool = False  # TP ranks on different nodes, linked by the network


def choose_gpu(text: str, memory_hint_gib: float | None = None) -> GpuChoice:
    """The catalogue GPU a row's free-text GPU column names.

    An "A100" of unstated size is the 80 GB part when the row's own figures (weights
    plus KV, `memory_hint_gib`) would not fit in 40 GB.
    """
    cross_node = "different nodes" in text
    for pattern, name in _GPU_PATTERNS:
        if re.search(pattern, text):
            return GpuChoice(find_gpu(name), name, cross_node)
    if re.search(r"\bA100\b", text):
        if memory_hint_gib is not None and memory_hint_gib > 40:
            return GpuChoice(find_gpu("A100-80GB"),
                             f"A100-80GB (size not stated; {memory_hint_gib:.1f} GiB of "
                             "weights + KV do not fit in 40 GB)", cross_node)
        return GpuChoice(None, "A100 of unstated memory size", cross_node)
    return GpuChoice(None, f"GPU {text!r} not identified")


# ---- small parsers -------------------------------------------------------------------

_NUMBER = re.compile(r"^\s*(-?[\d,]*\.?\d+)")


def number(cell: str) -> float | None:
    """The leading number of a cell (`0.9764 (as printed)` -> 0.9764); None when the
    cell is empty or approximate (`~50`)."""
    if not cell.strip() or cell.strip().startswith("~"):
        return None
    found = _NUMBER.match(cell)
    return float(found.group(1).replace(",", "")) if found else None


def integer(cell: str) -> int | None:
    value = number(cell)
    return None if value is None else int(value)


def _version(text: str) -> tuple[int, ...] | None:
    found = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not found:
        return None
    return tuple(int(part) for part in found.groups() if part is not None)


def _note_float(notes: str, pattern: str) -> float | None:
    found = re.search(pattern, notes)
    return float(found.group(1).replace(",", "")) if found else None


def _utilization(cell: str, notes: str) -> float | None:
    """The row's gpu_memory_utilization, or vLLM's default 0.9 where the notes say it
    was not set (`gpu_memory_utilization not set (default 0.9)`). vLLM >= 0.21
    subtracts its CUDA graph estimate from the budget at that utilization, and so does
    the model (`ServedModel.cudagraph_bytes`)."""
    value = number(cell)
    if value is not None:
        return value
    if re.search(r"gpu_memory_utilization not set.{0,40}default|"
                 r"gpu_memory_utilization = default", notes):
        return 0.9
    return _note_float(notes, r"gpu_memory_utilization ([\d.]+)")


def vllm_version(version_cell: str, notes: str) -> tuple[int, ...] | None:
    """The vLLM version of a row: its column, else one its notes state (`vLLM ~0.5.x`)."""
    version = _version(version_cell)
    if version is None:
        stated = re.search(r"vLLM ~?(\d+\.\d+)", notes)
        version = _version(stated.group(1)) if stated else None
    return version


# Rows that state no vLLM version predate 0.21 (by their dates), the first version that
# takes its CUDA graphs out of the KV budget; other engines' rows take none either.
_BEFORE_GRAPH_PROFILING = (0, 20)


def _accounting_version(version: tuple[int, ...] | None) -> tuple[int, int]:
    """The vLLM version whose memory accounting models a row."""
    if version is None:
        return _BEFORE_GRAPH_PROFILING
    return (version[0], version[1] if len(version) > 1 else 0)


def vllm_generation(version_cell: str, notes: str) -> str:
    """"v0" or "v1": which vLLM engine printed the row's log.

    V0 printed `# GPU blocks` and sized the profile run by max_model_len; V1 (the
    default from 0.8) prints tokens and concurrency.
    """
    if re.search(r"\bV0\b|VLLM_USE_V1=0", notes):
        return "v0"
    if re.search(r"\bV1 engine\b", notes):
        return "v1"
    version = vllm_version(version_cell, notes)
    if version is not None:
        return "v0" if version < (0, 8) else "v1"
    return "v1"


# ---- KV capacity cases ---------------------------------------------------------------


@dataclass(frozen=True)
class KvCase:
    """One start-up log: what vLLM was given and what it printed."""

    ref: str  # where the row is: "kv_capacity.csv:3" (data line 3)
    model: str
    choice: ModelChoice
    gpu: GpuChoice
    tp: int
    engine: str  # "v0" or "v1"
    version: tuple[int, ...] | None
    utilization: float | None
    max_model_len: int | None
    max_num_batched_tokens: int | None  # as given on the command line, else None
    weights_gib: float | None
    available_kv_gib: float | None
    kv_tokens: int | None
    gpu_blocks: int | None
    block_size: int
    notes: str
    skip: str | None = None  # the row is not usable at all

    @property
    def arch(self) -> ModelArchitecture:
        assert self.choice.arch is not None, self.choice.note
        return self.choice.arch

    @property
    def usable(self) -> bool:
        return self.skip is None and self.choice.arch is not None

    def profile_tokens(self, max_model_len: int) -> int | None:
        """Tokens of the profile run's dummy batch (max_num_batched_tokens).

        V1 uses the server default (ServedModel's, per GPU) unless given. V0 profiled
        max(max_model_len, 2048) tokens unless chunked prefill was on, which V0 (from
        0.5) turned on by itself above 32K context, with a 2,048-token budget.
        """
        if self.max_num_batched_tokens is not None or self.engine == "v1":
            return self.max_num_batched_tokens
        chunked_by_default = self.version is None or self.version >= (0, 5)
        if chunked_by_default and max_model_len > 32768:
            return 2048
        return max(max_model_len, 2048)

    def served(self, available_kv_gib: float | None = None) -> ServedModel:
        """The deployment as `kvgate plan` would model it: with the logged KV budget
        (`--available-kv-gib`) when given, else estimating it from the GPU."""
        arch = self.arch
        max_len = self.max_model_len or arch.context.default
        deployment = Deployment(
            tp=self.tp,
            # Unknown utilization only occurs where it does not matter (weights, or a
            # logged budget); vLLM's default stands in.
            gpu_memory_utilization=self.utilization or 0.9,
            max_model_len=max_len,
            block_size=self.block_size,
            max_num_batched_tokens=self.profile_tokens(max_len),
            available_kv_bytes=None if available_kv_gib is None
            else int(available_kv_gib * GIB),
            vllm_version=_accounting_version(self.version),
        )
        return ServedModel(arch, deployment, self.gpu.gpu)

    # What the row lets us check ---------------------------------------------------

    @property
    def checks_weights(self) -> bool:
        return self.usable and self.weights_gib is not None

    @property
    def checks_kv_exact(self) -> bool:
        return (self.usable and self.available_kv_gib is not None
                and self.available_kv_gib > 0
                and (self.kv_tokens is not None or self.gpu_blocks is not None))

    @property
    def checks_kv_budget(self) -> bool:
        return (self.usable and self.gpu.gpu is not None and self.utilization is not None
                and self.available_kv_gib is not None)

    @property
    def checks_kv_tokens_estimated(self) -> bool:
        return (self.usable and self.gpu.gpu is not None and self.utilization is not None
                and (self.kv_tokens is not None or self.gpu_blocks is not None))


# Rows whose logged KV tokens are not expected to follow from their logged budget, with
# the reason. The figures are per TP worker: each worker logs its own budget, vLLM sizes
# the shared pool by the smallest, and a report that quotes one worker's line may quote
# a larger one.
KV_EXACT_EXCEPTIONS: dict[str, str] = {
    "kv_capacity.csv:20": (
        "TP=2: the 8.69 GiB budget is quoted for one worker and vLLM sizes the pool by "
        "the minimum over workers (the row's notes say so); 81,536 tokens need 7.46 GiB"),
    "kv_capacity.csv:3": (
        "TP=4: the issue quotes one of the four workers' 'Available KV cache memory' "
        "lines; vLLM sizes the pool by the minimum over workers, and 178,880 tokens "
        "(11,180 blocks of 770,048 B) is 8.02 GiB"),
}

# Rows that describe a bug or give approximate figures: reported as skipped.
_UNUSABLE_NOTES = (
    ("do not use to fit", "a profiling-regression bug data point (per its notes)"),
    ("APPROXIMATE", "approximate figures only (~)"),
    ("before MLA-specific KV cache support",
     "vLLM ~0.5 stored MLA's KV as full per-head K/V; the model follows vLLM's MLA layout"),
)


def _kv_skip(notes: str) -> str | None:
    for marker, reason in _UNUSABLE_NOTES:
        if marker in notes:
            return reason
    return None


def _tp(cell: str, gpu_text: str) -> int:
    value = integer(cell)
    if value is not None:
        return value
    found = re.search(r"\((\d+)x", gpu_text)
    return int(found.group(1)) if found else 1


def _kv_case_from_row(line: int, row: dict[str, str]) -> KvCase:
    notes = row["notes"]
    weights = number(row["weights_gib"])
    available = number(row["available_kv_gib"])
    hint = weights + available if weights is not None and available is not None else None
    max_batched = _note_float(notes, r"--max-num-batched-tokens (\d+)")
    return KvCase(
        ref=f"kv_capacity.csv:{line}",
        model=model_name(row["model"]),
        choice=choose_model(row["model"]),
        gpu=choose_gpu(row["gpu"], hint),
        tp=_tp(row["tp"], row["gpu"]),
        engine=vllm_generation(row["vllm_version"], notes),
        version=vllm_version(row["vllm_version"], notes),
        utilization=_utilization(row["gpu_memory_utilization"], notes),
        max_model_len=integer(row["max_model_len"]),
        max_num_batched_tokens=None if max_batched is None else int(max_batched),
        weights_gib=weights,
        available_kv_gib=available,
        kv_tokens=integer(row["kv_cache_tokens"]),
        gpu_blocks=integer(row["gpu_blocks"]),
        block_size=integer(row["block_size"]) or BLOCK_SIZE,
        notes=notes,
        skip=_kv_skip(notes),
    )


def _kv_cases_from_latency_notes(rows: list[dict[str, str]]) -> Iterator[KvCase]:
    """KV figures that latency.csv's notes quote from the servers' start-up logs, one
    case per distinct deployment (model, GPU, TP, utilization, budget)."""
    seen: set[tuple[str, ...]] = set()
    for line, row in enumerate(rows, start=1):
        notes = row["notes"]
        found = re.search(r"KV ([\d.]+) GiB(?:/GPU)?(?: \(([\d,]+) tokens\))?", notes)
        utilization = _note_float(notes, r"gpu_memory_utilization ([\d.]+)")
        if not found or utilization is None:
            continue
        key = (row["model"], row["gpu"], row["tp"], str(utilization), found.group(1))
        if key in seen:
            continue
        seen.add(key)
        max_len = _note_float(notes, r"max_model_len (\d+)")
        yield KvCase(
            ref=f"latency.csv:{line} (notes)",
            model=model_name(row["model"]),
            choice=choose_model(row["model"]),
            gpu=choose_gpu(row["gpu"]),
            tp=_tp(row["tp"], row["gpu"]),
            engine=vllm_generation(row["engine_version"], notes),
            version=_version(row["engine_version"]),
            utilization=utilization,
            max_model_len=None if max_len is None else int(max_len),
            max_num_batched_tokens=None,
            weights_gib=None,
            available_kv_gib=float(found.group(1)),
            kv_tokens=integer(found.group(2)) if found.group(2) else None,
            gpu_blocks=None,
            block_size=BLOCK_SIZE,
            notes=notes,
        )


def _read_csv(name: str) -> list[dict[str, str]]:
    with (DATA_DIR / name).open(encoding="utf-8", newline="") as handle:
        return list(csv.DictReader(handle))


@cache
def kv_cases() -> tuple[KvCase, ...]:
    rows = _read_csv("kv_capacity.csv")
    cases = [_kv_case_from_row(line, row) for line, row in enumerate(rows, start=1)]
    cases.extend(_kv_cases_from_latency_notes(_read_csv("latency.csv")))
    return tuple(cases)


@dataclass(frozen=True)
class TokenInterval:
    """KV blocks and tokens that a budget logged as `budget_gib` (rounded) allows."""

    blocks_low: int
    blocks_high: int
    tokens_low: int
    tokens_high: int
    tokens_at_logged: int
    blocks_at_logged: int

    def has_tokens(self, tokens: int) -> bool:
        return self.tokens_low <= tokens <= self.tokens_high

    def has_blocks(self, blocks: int) -> bool:
        return self.blocks_low <= blocks <= self.blocks_high


def tokens_reported(served: ServedModel, engine: str) -> int:
    """The token figure vLLM prints: V0 blocks x block_size, V1 int(concurrency x
    max_model_len) (the model's `kv_capacity_tokens`)."""
    capacity = served.capacity
    assert capacity is not None
    if engine == "v0":
        return capacity.num_blocks * served.block_size
    return capacity.kv_capacity_tokens


def token_interval(case: KvCase) -> TokenInterval:
    """Blocks and tokens for every budget that prints as the logged figure."""
    assert case.available_kv_gib is not None
    figures = []
    for budget in (case.available_kv_gib - LOG_ROUNDING_GIB, case.available_kv_gib,
                   case.available_kv_gib + LOG_ROUNDING_GIB):
        served = case.served(available_kv_gib=budget)
        capacity = served.capacity
        assert capacity is not None
        figures.append((capacity.num_blocks, tokens_reported(served, case.engine)))
    (b_low, t_low), (b_mid, t_mid), (b_high, t_high) = figures
    return TokenInterval(b_low, b_high, t_low, t_high, t_mid, b_mid)


# ---- latency cases -------------------------------------------------------------------

# How a row's dtype/quantization columns map onto `--dtype` for a config without that
# quantization (a config that carries it, e.g. gpt-oss's mxfp4, keeps "auto").
_DTYPES = (("fp8", "fp8"), ("fp16", "float16"), ("float16", "float16"),
           ("bfloat16", "bfloat16"), ("awq", "int4"))


def _dtype(dtype_cell: str, quantization_cell: str, arch: ModelArchitecture | None) -> str:
    if arch is not None and arch.quantization:
        return "auto"
    for cell in (quantization_cell, dtype_cell):
        for marker, dtype in _DTYPES:
            if cell.strip().lower().startswith(marker):
                return dtype
    return "auto"


@dataclass(frozen=True)
class LatencyCase:
    """One latency measurement and the deployment it was taken on."""

    ref: str
    model: str
    choice: ModelChoice
    gpu: GpuChoice
    tp: int
    engine: str  # "vllm" or "tensorrt-llm"
    engine_version: str
    dtype: str
    input_len: int
    output_len: int
    # "steady" (one request at a time), "burst" (N sent at once) or "closed" (C clients
    # in a closed loop)
    kind: str
    num_prompts: int  # prompts sent; for a closed loop, its clients
    utilization: float | None
    max_model_len: int | None
    enforce_eager: bool  # the server ran with --enforce-eager (no CUDA graphs)
    available_kv_gib: float | None  # per GPU, where the notes quote the start-up log
    ttft_ms: float | None  # the mean, or the median where the row gives only that
    tpot_ms: float | None  # as ttft_ms
    notes: str
    skip: str | None = None
    itl_ms: float | None = None  # the median inter-token latency, where a row gives it
    medians: bool = False  # the row gives medians only (its mean columns are empty)
    max_num_batched_tokens: int | None = None  # a server's token budget, where it was not
    # vLLM's default for the GPU (the notes' `server budget: max_num_batched_tokens N`)
    # A closed loop's client pausing before each request, for up to `pause_s` drawn
    # uniformly (up to `first_pause_s` before a client's first), where the notes say so
    # (`client pause: uniform 0-A ms before each request, 0-B ms before the first`).
    pause_s: float = 0.0
    first_pause_s: float = 0.0

    @property
    def statistic(self) -> str:
        """What ttft_ms and tpot_ms are over the row's requests: closed-loop rows give
        medians (their sources print percentiles), and so do rows whose source gives
        nothing else; the others means. One request at a time with fixed lengths the
        two coincide to within the source's spread."""
        return _statistic(self.medians)

    @property
    def arch(self) -> ModelArchitecture:
        assert self.choice.arch is not None, self.choice.note
        return self.choice.arch

    @property
    def usable(self) -> bool:
        return self.skip is None

    @property
    def prefill_measured(self) -> bool:
        """Whether the row's TTFT measures a prefill: not when its only prompt was
        the benchmark's warm-up one, found cached."""
        return not self.cached_tokens or self.num_prompts > 1

    @property
    def tpot_priced(self) -> bool:
        """Whether the model prices what the row's TPOT measured: not under
        --enforce-eager, whose kernel launches in every decode step (no CUDA graphs) it
        has no term for. Such a row's TTFT, a long prefill, barely feels them and
        counts; its TPOT is neither fitted nor scored."""
        return not self.enforce_eager

    @property
    def prefix_warmed(self) -> bool:
        """vLLM's benchmark_serving.py first sends the first prompt once as a test run,
        and V1 keeps prefix caching on by default: that prompt's measured prefill
        finds all its full blocks but the last token's cached. The data bear it out:
        Qwen2-7B's 1,024-token TTFT of 36 ms on one A100 would be 13.6 TFLOP of
        prefill, 119% of the A100's 312 TFLOP/s peak."""
        return (self.engine == "vllm" and "benchmark_serving" in self.notes
                and (_version(self.engine_version) or (0,)) >= (0, 8))

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the warmed prompt's measured prefill finds in the prefix cache
        (one of the `num_prompts` measured one at a time: the first, which the warm-up
        sent; random prompts leave the others nothing to find)."""
        if not (self.prefix_warmed and self.kind == "steady"):
            return 0
        return (self.input_len - 1) // BLOCK_SIZE * BLOCK_SIZE

    def served(self) -> ServedModel:
        gpu = self.gpu.gpu
        assert gpu is not None
        deployment = Deployment(
            tp=self.tp,
            dtype=self.dtype,
            gpu_memory_utilization=self.utilization or 0.9,
            max_model_len=self.max_model_len,
            # TensorRT-LLM's static-batch benchmark runs a whole prompt in one step.
            max_num_batched_tokens=max(self.input_len, 2048)
            if self.engine == "tensorrt-llm" else self.max_num_batched_tokens,
            available_kv_bytes=None if self.available_kv_gib is None
            else int(self.available_kv_gib * GIB),
            vllm_version=_accounting_version(
                _version(self.engine_version) if self.engine == "vllm" else None),
            enforce_eager=self.enforce_eager,
        )
        return ServedModel(self.arch, deployment, over_network(gpu) if self.gpu.cross_node else gpu)


def _engine(cell: str) -> str | None:
    text = cell.lower()
    if text.startswith("vllm"):
        return "vllm"
    if text.startswith("tensorrt-llm"):
        return "tensorrt-llm"
    return None


def _load(cell: str, batch_cell: str) -> tuple[str, int] | None:
    """("steady" | "burst" | "closed", prompts or clients) from the concurrency/batch
    columns: `num_prompts=N` sent at once (one alone is steady), `max_concurrency=1` with
    `N prompts` (or `num_prompts=N`) sent one at a time, or `max_concurrency=C (closed
    loop ...)`: C clients, each sending its next request when its last one ends (rows
    that give medians, which the number of prompts barely moves); None when it is not
    clear."""
    closed = re.search(r"max_concurrency=(\d+) \(closed loop", cell)
    if closed:
        return "closed", int(closed.group(1))
    if re.search(r"max_concurrency=1\b", cell):
        prompts = re.search(r"(\d+) prompts|num_prompts=(\d+)", cell)
        if prompts is None:
            return None  # the mean over how many prompts, one of them cached, is unknown
        return "steady", int(prompts.group(1) or prompts.group(2))
    found = re.search(r"num_prompts=(\d+)", cell)
    if found:
        prompts = int(found.group(1))
        return ("steady" if prompts == 1 else "burst"), prompts
    if re.search(r"concurrency=1\b", cell) or integer(batch_cell) == 1:
        return "steady", 1
    return None


def _statistic(medians: bool) -> str:
    """The columns a row's figures are read from: its medians, or its means."""
    return "median" if medians else "mean"


def _latency_case(line: int, row: dict[str, str]) -> LatencyCase:
    notes = row["notes"]
    choice = choose_model(row["model"])
    engine = _engine(row["engine"])
    load = _load(row["concurrency_or_rate"], row["batch_size"])
    tp = integer(row["tp"])
    skip = choice.skip
    if skip is None and engine is None:
        skip = "engine not stated"
    if skip is None and tp is None:
        skip = "TP not stated"
    if skip is None and load is None:
        skip = f"load {row['concurrency_or_rate']!r} not understood"
    gpu = choose_gpu(row["gpu"])
    if skip is None and gpu.gpu is None:
        skip = gpu.note
    kind, prompts = load or ("steady", 1)
    max_len = _note_float(notes, r"max_model_len (\d+)")
    budget = _note_float(notes, r"server budget: max_num_batched_tokens (\d+)")
    pause = re.search(r"client pause: uniform 0-(\d+) ms before each request, "
                      r"0-(\d+) ms before the first", notes)
    # A closed loop's source gives percentiles; a row with only the median columns
    # filled gives medians too.
    medians = kind == "closed" or not (row["mean_ttft_ms"] or row["mean_tpot_ms"])
    statistic = _statistic(medians)
    return LatencyCase(
        ref=f"latency.csv:{line}",
        model=model_name(row["model"]),
        choice=choice,
        gpu=gpu,
        tp=tp or 1,
        engine=engine or "",
        engine_version=row["engine_version"],
        dtype=_dtype(row["dtype"], row["quantization"], choice.arch),
        input_len=int(row["input_len"]),
        output_len=int(row["output_len"]),
        kind=kind,
        num_prompts=prompts,
        utilization=_utilization("", notes),
        max_model_len=None if max_len is None else int(max_len),
        enforce_eager=re.search(r"vllm serve [^;]*--enforce-eager", notes) is not None,
        available_kv_gib=_note_float(notes, r"KV ([\d.]+) GiB"),
        ttft_ms=number(row[f"{statistic}_ttft_ms"]),
        tpot_ms=number(row[f"{statistic}_tpot_ms"]),
        notes=notes,
        skip=skip,
        itl_ms=_note_float(notes, r"ITL p50 ([\d.]+) ms"),
        medians=medians,
        max_num_batched_tokens=None if budget is None else int(budget),
        pause_s=int(pause.group(1)) / 1000 if pause else 0.0,
        first_pause_s=int(pause.group(2)) / 1000 if pause else 0.0,
    )


@cache
def latency_cases() -> tuple[LatencyCase, ...]:
    rows = _read_csv("latency.csv")
    return tuple(_latency_case(line, row) for line, row in enumerate(rows, start=1))


def steady_cases() -> tuple[LatencyCase, ...]:
    """Rows measured one request at a time, with a usable config and both figures."""
    return tuple(c for c in latency_cases() if c.usable and c.kind == "steady"
                 and c.ttft_ms is not None and c.tpot_ms is not None)


def predict_steady(case: LatencyCase, efficiency: Efficiency | None = None) -> tuple[float, float]:
    """TTFT and TPOT (s) of one request alone, as `kvgate plan --concurrency 1` gives
    them (`steady_latency`), with the engine's own fixed costs; a prompt that the
    benchmark's warm-up already sent finds its prefix cached (`served.ttft` with the
    cached tokens, the path `kvgate plan --chain` takes), and the TTFT is the mean over
    the row's prompts: that one and the others' whole prefills."""
    served = case.served().with_efficiency(
        efficiency or DEFAULT_EFFICIENCY.for_engine(case.engine))
    estimate = steady_latency(served, case.input_len, case.output_len, 1)
    assert estimate is not None
    ttft = estimate.ttft_s
    if case.cached_tokens:
        prefill = served.ttft(case.input_len - case.cached_tokens, (), case.cached_tokens)
        assert prefill is not None
        # The mean over the prompts: the warmed one, and the others' whole prefills.
        ttft = (prefill.seconds + (case.num_prompts - 1) * ttft) / case.num_prompts
    return ttft, estimate.tpot_s

