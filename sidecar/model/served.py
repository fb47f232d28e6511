"""A model as one vLLM deployment serves it: the composition of everything else.

`ServedModel` joins an architecture, a deployment (TP, dtypes, vLLM flags), an
optional GPU and efficiency factors, and answers the questions the sidecar and
`kvgate plan` ask: weights per GPU, KV bytes and blocks per request, capacity as
vLLM logs it, and step latencies.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from sidecar.model.architecture import GqaAttention, MlaAttention, ModelArchitecture
from sidecar.model.capacity import KVCapacity, KVLayout, build_layout, kv_capacity
from sidecar.model.errors import DeploymentError
from sidecar.model.gpu import Gpu
from sidecar.model.kv_spec import KVSpec
from sidecar.model.latency import DEFAULT_EFFICIENCY, Efficiency, PhaseCost, Roofline
from sidecar.model.lifecycle import KVLifecycle
from sidecar.model.memory_budget import MemoryBudget, activation_peak_bytes, non_torch_bytes
from sidecar.model.precision import kv_element_bytes, served_dtype
from sidecar.model.quantization import WeightPrecision, weight_precision
from sidecar.model.units import GIB
from sidecar.model.weights import WeightFootprint, weight_footprint

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16")


@dataclass(frozen=True)
class Deployment:
    """The vLLM flags that change memory and time. None means vLLM's default."""

    tp: int = 1
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    block_size: int = 16
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    max_concurrent_batches: int = 1
    num_gpu_blocks_override: int | None = None
    available_kv_bytes: int | None = None  # as logged: "Available KV cache memory"

    def validated(self, arch: ModelArchitecture) -> Deployment:
        positive = {
            "--tp": self.tp,
            "--block-size": self.block_size,
            "--max-model-len": self.max_model_len,
            "--max-num-batched-tokens": self.max_num_batched_tokens,
            "--max-num-seqs": self.max_num_seqs,
        }
        for flag, value in positive.items():
            if value is not None and value <= 0:
                raise DeploymentError(f"{flag} must be a positive integer, got {value}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise DeploymentError(
                f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise DeploymentError(
                f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.available_kv_bytes is not None and self.available_kv_bytes <= 0:
            raise DeploymentError("--available-kv-gib must be positive")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override <= 0:
            raise DeploymentError("--num-gpu-blocks-override must be positive")
        _check_tp(arch, self.tp)
        return self


def _check_tp(arch: ModelArchitecture, tp: int) -> None:
    for layer in arch.layers:
        mixer = layer.mixer
        if isinstance(mixer, GqaAttention | MlaAttention) and mixer.num_heads % tp:
            raise DeploymentError(
                f"--tp {tp} does not divide the {mixer.num_heads} attention heads of {arch.name}"
            )
        if isinstance(mixer, GqaAttention):
            kv = mixer.num_kv_heads
            if kv % tp and tp % kv:
                raise DeploymentError(
                    f"--tp {tp} and the {kv} KV heads of {arch.name} do not divide one another"
                )


def server_defaults(gpu: Gpu | None) -> tuple[int, int]:
    """vLLM's OpenAI server defaults (max_num_batched_tokens, max_num_seqs) per GPU size."""
    if gpu is None:
        return 2048, 256
    if gpu.memory_gib >= 160:
        return 16384, 1024
    if gpu.memory_gib >= 70 and "a100" not in gpu.name.lower():
        return 8192, 1024
    return 2048, 256


class ServedModel:
    def __init__(
        self,
        arch: ModelArchitecture,
        deployment: Deployment | None = None,
        gpu: Gpu | None = None,
        efficiency: Efficiency = DEFAULT_EFFICIENCY,
    ) -> None:
        self.arch = arch
        self.deployment = (deployment or Deployment()).validated(arch)
        self.gpu = gpu
        self.efficiency = efficiency

    def with_efficiency(self, efficiency: Efficiency) -> ServedModel:
        return ServedModel(self.arch, self.deployment, self.gpu, efficiency)

    def with_deployment(self, **changes: object) -> ServedModel:
        return ServedModel(self.arch, replace(self.deployment, **changes), self.gpu,  # type: ignore[arg-type]
                           self.efficiency)

    # ---- deployment defaults -----------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.deployment.max_model_len or self.arch.max_position_embeddings

    @property
    def max_num_batched_tokens(self) -> int:
        return self.deployment.max_num_batched_tokens or server_defaults(self.gpu)[0]

    @property
    def max_num_seqs(self) -> int:
        return self.deployment.max_num_seqs or server_defaults(self.gpu)[1]

    @property
    def in_flight_tokens(self) -> int:
        """Tokens scheduled but not yet settled (vLLM's max_in_flight_tokens)."""
        return self.deployment.max_concurrent_batches * self.max_num_batched_tokens

    # ---- weights -----------------------------------------------------------------

    @cached_property
    def weight_precision(self) -> WeightPrecision:
        return weight_precision(self.arch.quantization, self.arch.torch_dtype,
                                self.deployment.dtype)

    @cached_property
    def weights(self) -> WeightFootprint:
        return weight_footprint(self.arch, self.weight_precision, self.deployment.tp)

    @property
    def weights_bytes(self) -> int:
        return self.weights.total_bytes

    # ---- KV cache ----------------------------------------------------------------

    @cached_property
    def kv_element_bytes(self) -> int:
        return kv_element_bytes(self.deployment.kv_cache_dtype, served_dtype(self.arch.torch_dtype))

    @cached_property
    def kv_specs(self) -> list[KVSpec]:
        return self.arch.kv_specs(
            self.kv_element_bytes,
            self.deployment.tp,
            fp8_cache=self.deployment.kv_cache_dtype.startswith("fp8"),
        )

    @cached_property
    def layout(self) -> KVLayout:
        return build_layout(self.kv_specs, self.deployment.block_size)

    @property
    def kv_bytes_per_token(self) -> float:
        """Per GPU: one token counted in every layer."""
        return sum(spec.token_bytes for spec in self.kv_specs)

    def kv_bytes_per_sequence(self, tokens: int) -> float:
        """Per GPU: one sequence of `tokens` tokens, windows and compression applied,
        not block-rounded."""
        return sum(spec.sequence_bytes(tokens) for spec in self.kv_specs)

    @cached_property
    def lifecycle(self) -> KVLifecycle:
        """Blocks a request holds step by step (one step in flight, as vLLM's
        asynchronous scheduling keeps it; an upper bound without it)."""
        return KVLifecycle(self.layout, self.max_num_batched_tokens, in_flight_steps=1)

    def blocks_for_request(self, tokens: int) -> int:
        """Blocks of the shared pool one sequence of `tokens` tokens holds at its peak."""
        return self.layout.blocks_for_request(tokens, self.in_flight_tokens)

    @cached_property
    def memory_budget(self) -> MemoryBudget | None:
        if self.gpu is None:
            return None
        tp = self.deployment.tp
        return MemoryBudget(
            total_bytes=self.gpu.memory_bytes,
            utilization=self.deployment.gpu_memory_utilization,
            weights_bytes=self.weights_bytes,
            activation_bytes=activation_peak_bytes(
                self.arch, self.max_num_batched_tokens, self.max_num_seqs, tp
            ),
            non_torch_bytes=non_torch_bytes(tp),
        )

    @property
    def kv_budget_bytes(self) -> int | None:
        """Available KV memory per GPU: as given, else estimated from the GPU."""
        if self.deployment.available_kv_bytes is not None:
            return self.deployment.available_kv_bytes
        budget = self.memory_budget
        return None if budget is None else budget.kv_budget_bytes

    @cached_property
    def capacity(self) -> KVCapacity | None:
        budget = self.kv_budget_bytes
        if budget is None and self.deployment.num_gpu_blocks_override is None:
            return None
        return kv_capacity(
            self.layout,
            budget or 0,
            self.max_model_len,
            self.in_flight_tokens,
            self.deployment.num_gpu_blocks_override,
        )

    # ---- time --------------------------------------------------------------------

    @cached_property
    def roofline(self) -> Roofline | None:
        if self.gpu is None:
            return None
        return Roofline(
            self.arch,
            self.weights,
            self.kv_specs,
            self.gpu,
            self.deployment.tp,
            self.weight_precision.compute,
            self.efficiency,
        )

    def ttft(
        self,
        prompt_tokens: int,
        running_contexts: tuple[int, ...] = (),
        cached_tokens: int = 0,
    ) -> PhaseCost | None:
        """Prefill of one prompt (after `cached_tokens` of prefix-cache hits) while
        `running_contexts` decode alongside."""
        roofline = self.roofline
        if roofline is None:
            return None
        return roofline.prefill(
            prompt_tokens, running_contexts, self.max_num_batched_tokens, cached_tokens
        )

    def tpot(self, contexts: tuple[int, ...]) -> PhaseCost | None:
        roofline = self.roofline
        return None if roofline is None else roofline.decode(contexts)


def gib(value_bytes: float) -> float:
    return value_bytes / GIB
