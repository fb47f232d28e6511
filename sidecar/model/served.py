"""A model as one vLLM deployment serves it: the composition of everything else.

`ServedModel` joins an architecture, a deployment (TP, dtypes, vLLM flags), an
optional GPU and efficiency factors, and answers the questions the sidecar and
`kvgate plan` ask: weights per GPU, KV bytes and blocks per request, capacity as
vLLM logs it, and step latencies.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from sidecar.model.architecture import (
    CompressedAttention,
    KVSettings,
    MlaAttention,
    ModelArchitecture,
    dtype_bytes,
)
from sidecar.model.capacity import KVCapacity, KVLayout, build_layout, kv_capacity
from sidecar.model.errors import DeploymentError
from sidecar.model.gpu import Gpu
from sidecar.model.kv_spec import KVSpec
from sidecar.model.latency import DEFAULT_EFFICIENCY, Efficiency, PhaseCost, Roofline
from sidecar.model.lifecycle import KVLifecycle
from sidecar.model.memory_budget import (
    CUDAGRAPH_PROFILED_SINCE,
    MemoryBudget,
    activation_peak_bytes,
    cudagraph_bytes,
    cudagraph_counts,
    non_torch_bytes,
)
from sidecar.model.precision import kv_element_bytes, served_dtype
from sidecar.model.quantization import WeightPrecision, weight_precision
from sidecar.model.units import GIB
from sidecar.model.weights import WeightFootprint, weight_footprint

# fp8_ds_mla: what vLLM reports for an fp8 cache of sparse MLA on Hopper.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla", "bfloat16",
                   "float16")
MAMBA_CACHE_MODES = ("align", "none")
# --attention-backend values that change a KV cache layout kvgate models: DeepSeek-V4's
# FlashInfer backend stores plain bf16 / fp8 rows instead of fp8_ds_mla (not on SM12x).
ATTENTION_BACKENDS = ("FLASHMLA_SPARSE_DSV4", "FLASHINFER_MLA_SPARSE_DSV4")
# Speculative decoding methods whose drafter KV kvgate models: n-gram (no layers of its
# own) and mtp (the model's own MTP layers, whose caches join the target's).
SPECULATIVE_METHODS = ("ngram", "mtp")
STATE_DTYPES = ("auto", "float32", "bfloat16", "float16")
VLLM_VERSION = (0, 32)  # the vLLM release whose defaults and accounting kvgate follows


@dataclass(frozen=True)
class Deployment:
    """The vLLM flags that change memory and time. None means vLLM's default."""

    tp: int = 1
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    block_size: int | None = None  # None: vLLM's choice (16; 64 with DSA; hybrids align)
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    max_concurrent_batches: int = 1
    num_gpu_blocks_override: int | None = None
    available_kv_bytes: int | None = None  # as logged: "Available KV cache memory"
    enable_prefix_caching: bool = True
    mamba_cache_mode: str | None = None  # None: align with prefix caching, else none
    mamba_cache_dtype: str = "auto"  # conv state; auto = the model dtype
    mamba_ssm_cache_dtype: str = "auto"  # temporal state; auto = the family's default
    num_speculative_tokens: int = 0
    data_parallel_size: int = 1  # engines, each with its own KV pool
    attention_backend: str | None = None  # None: vLLM's choice for the GPU
    speculative_method: str | None = None  # None: a drafter without KV layers (n-gram)
    async_scheduling: bool = True  # vLLM's default on GPUs; off in its CPU build
    # vLLM's --long-prefill-token-threshold: the most prompt tokens a step schedules for
    # one request while others are eligible (0: no cap, vLLM's default).
    long_prefill_token_threshold: int = 0
    # vLLM's CPU build: the API server's work per request (`per_request_s`) runs on the
    # cores that compute the engine's steps, and lengthens the step it falls in.
    host_shares_device: bool = False
    enforce_eager: bool = False  # no CUDA graphs
    vllm_version: tuple[int, int] = VLLM_VERSION  # whose memory accounting to follow

    @property
    def schedules_async(self) -> bool:
        """Whether the server schedules each step while the last one runs: as
        `async_scheduling` says, except with an n-gram drafter, where vLLM turns it off
        (its config: asynchronous scheduling does not support that method)."""
        ngram = self.num_speculative_tokens > 0 and self.speculative_method in (None, "ngram")
        return self.async_scheduling and not ngram

    @property
    def drops_last_prefix_hit(self) -> bool:
        """Whether a prefix-cache hit gives up its last block: with an MTP drafter
        vLLM recomputes the tokens right before the generation point (0.32,
        `find_longest_cache_hit`'s `drop_eagle_block`)."""
        return self.num_speculative_tokens > 0 and self.speculative_method == "mtp"

    @property
    def resolved_mamba_cache_mode(self) -> str:
        """vLLM's MambaModelConfig: `align` when prefix caching is on, else `none`."""
        if not self.enable_prefix_caching:
            return "none"
        return self.mamba_cache_mode or "align"

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
        if self.long_prefill_token_threshold < 0:
            raise DeploymentError("--long-prefill-token-threshold must be 0 or more, got "
                                  f"{self.long_prefill_token_threshold}")
        if self.mamba_cache_mode is not None and self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise DeploymentError(
                f"--mamba-cache-mode must be one of {', '.join(MAMBA_CACHE_MODES)}, "
                f"got {self.mamba_cache_mode!r}"
            )
        for flag, state_dtype in (("--mamba-cache-dtype", self.mamba_cache_dtype),
                                  ("--mamba-ssm-cache-dtype", self.mamba_ssm_cache_dtype)):
            if state_dtype not in STATE_DTYPES:
                raise DeploymentError(
                    f"{flag} must be one of {', '.join(STATE_DTYPES)}, got {state_dtype!r}")
        if self.num_speculative_tokens < 0:
            raise DeploymentError("--num-speculative-tokens must not be negative")
        if self.data_parallel_size < 1:
            raise DeploymentError("--data-parallel-size must be a positive integer")
        if self.attention_backend is not None and self.attention_backend not in (
                ATTENTION_BACKENDS):
            raise DeploymentError(
                f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)} "
                f"(the backends whose KV layout kvgate models), got {self.attention_backend!r}")
        if self.speculative_method is not None:
            if self.speculative_method not in SPECULATIVE_METHODS:
                raise DeploymentError(
                    f"--speculative-method must be one of {', '.join(SPECULATIVE_METHODS)} "
                    "(the drafters whose KV layers kvgate models), got "
                    f"{self.speculative_method!r}")
            if self.num_speculative_tokens == 0:
                raise DeploymentError("--speculative-method needs --num-speculative-tokens")
            if self.speculative_method == "mtp" and not arch.drafter_mixers:
                raise DeploymentError(
                    f"--speculative-method mtp: kvgate does not know the MTP layers of "
                    f"{arch.name} ({arch.model_type})")
        max_model_len = self.max_model_len or arch.context.default
        if self.long_prefill_token_threshold > max_model_len:
            raise DeploymentError(
                f"--long-prefill-token-threshold {self.long_prefill_token_threshold} is above "
                f"--max-model-len {max_model_len}: vLLM refuses it")
        error = arch.tp_error(self.tp)
        if error is not None:
            raise DeploymentError(error)
        return self


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
        self._check_cache_dtype()

    def _check_cache_dtype(self) -> None:
        """vLLM refuses a non-fp8 --kv-cache-dtype for DeepSeek-V4 on its fp8_ds_mla
        backends (`_resolve_dsv4_kv_cache_dtype`), and fp8_ds_mla on a model without
        sparse MLA (no attention backend of a dense model stores it)."""
        compressed = any(isinstance(layer.mixer, CompressedAttention)
                         for layer in self.arch.layers)
        dtype = self.deployment.kv_cache_dtype
        sparse_mla = compressed or any(
            isinstance(layer.mixer, MlaAttention) and layer.mixer.sparse
            for layer in self.arch.layers)
        if dtype == "fp8_ds_mla" and not sparse_mla:
            raise DeploymentError(
                f"--kv-cache-dtype fp8_ds_mla is the cache layout of sparse MLA (DeepSeek "
                f"V3.2 and V4, GLM-5); {self.arch.name} has no sparse MLA layers: use fp8")
        if (compressed and self._v4_ds_layout and dtype != "auto"
                and not dtype.startswith("fp8")):
            raise DeploymentError(
                f"--kv-cache-dtype {dtype} is refused by vLLM for DeepSeek-V4 on its "
                "fp8_ds_mla attention backend (the default on every CUDA GPU): use auto "
                "or fp8, or --attention-backend FLASHINFER_MLA_SPARSE_DSV4")

    def with_efficiency(self, efficiency: Efficiency) -> ServedModel:
        return ServedModel(self.arch, self.deployment, self.gpu, efficiency)

    def with_deployment(self, **changes: object) -> ServedModel:
        return ServedModel(self.arch, replace(self.deployment, **changes), self.gpu,  # type: ignore[arg-type]
                           self.efficiency)

    # ---- deployment defaults -----------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.deployment.max_model_len or self.arch.context.default

    @property
    def max_num_batched_tokens(self) -> int:
        return self.deployment.max_num_batched_tokens or server_defaults(self.gpu)[0]

    @property
    def max_num_seqs(self) -> int:
        """As given, else vLLM's default for the GPU, lowered to max_num_batched_tokens
        (vLLM's `_set_default_max_num_seqs_and_batched_tokens_args`)."""
        if self.deployment.max_num_seqs:
            return self.deployment.max_num_seqs
        return min(server_defaults(self.gpu)[1], self.max_num_batched_tokens)

    @property
    def long_prefill_cap(self) -> int:
        """The most prompt tokens of one request a step schedules while other requests
        are eligible (vLLM's --long-prefill-token-threshold; 0: no cap beyond the
        budget). A request alone gets the whole budget."""
        return self.deployment.long_prefill_token_threshold

    def prefill_chunk_tokens(self, running: int, capped: bool | None = None) -> int:
        """Prompt tokens of one request a step schedules beside `running` decoding
        requests: the budget they leave, at most `long_prefill_cap` where other requests
        are eligible (`capped` None: where any run; True: others are, e.g. the request's
        own forks; False: the tokens of several prompts together, which the threshold
        caps one by one, not together)."""
        chunk = max(1, self.max_num_batched_tokens - running)
        cap = self.long_prefill_cap
        if capped is None:
            capped = running > 0
        return min(chunk, cap) if cap and capped else chunk

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

    @property
    def compute_capability_major(self) -> int | None:
        capability = None if self.gpu is None else self.gpu.compute_capability
        return None if capability is None else capability[0]

    @cached_property
    def kv_cache_dtype(self) -> str:
        """The KV cache dtype the server runs with: --kv-cache-dtype, where vLLM's
        family default for the GPU applies (GLM-5 on Blackwell: fp8)."""
        dtype = self.deployment.kv_cache_dtype
        if dtype == "auto" and self.compute_capability_major in self.arch.fp8_kv_default_on:
            return "fp8_e4m3"
        return dtype

    @cached_property
    def kv_element_bytes(self) -> int:
        return kv_element_bytes(self.kv_cache_dtype, served_dtype(self.arch.torch_dtype))

    @cached_property
    def kv_settings(self) -> KVSettings:
        deployment = self.deployment
        align = deployment.resolved_mamba_cache_mode == "align"
        spec_tokens = deployment.num_speculative_tokens
        return KVSettings(
            element_bytes=self.kv_element_bytes,
            tp=deployment.tp,
            fp8_cache=self.kv_cache_dtype.startswith("fp8"),
            # FlashMLA's sparse backend (Hopper, and the default without a GPU) stores
            # fp8 as fp8_ds_mla; Blackwell's FlashInfer sparse backend as plain fp8.
            ds_mla_fp8=(self.kv_cache_dtype == "fp8_ds_mla"
                        or self.compute_capability_major != 10),
            model_element_bytes=max(1, int(served_dtype(self.arch.torch_dtype)
                                           .bytes_per_weight)),
            state_element_bytes=dtype_bytes(deployment.mamba_cache_dtype),
            ssm_state_element_bytes=dtype_bytes(deployment.mamba_ssm_cache_dtype),
            state_blocks_per_request=(2 if align else 1) + spec_tokens,
            state_block_tokens=None if align else self.max_model_len,
            speculative_tokens=spec_tokens,
            v4_ds_layout=self._v4_ds_layout,
            mtp_drafter=deployment.speculative_method == "mtp",
        )

    @property
    def _v4_ds_layout(self) -> bool:
        """DeepSeek-V4 stores fp8_ds_mla unless the FlashInfer backend is asked for
        off SM12x (vLLM's `_select_dsv4_attn_cls`)."""
        return (self.deployment.attention_backend != "FLASHINFER_MLA_SPARSE_DSV4"
                or self.compute_capability_major == 12)

    @cached_property
    def kv_specs(self) -> list[KVSpec]:
        return self.arch.kv_specs(self.kv_settings)

    @cached_property
    def layout(self) -> KVLayout:
        return build_layout(self.kv_specs, self.deployment.block_size)

    @property
    def block_size(self) -> int:
        """The attention block size vLLM runs with (its cache_config.block_size)."""
        sizes = [group.block_size for group in self.layout.groups
                 if group.spec.state_page_bytes is None and group.spec.block_tokens is None]
        return min(sizes, default=self.deployment.block_size or 16)

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
            cudagraph_bytes=self.cudagraph_bytes,
        )

    @property
    def cudagraph_counts(self) -> tuple[int, int]:
        """(piecewise, full) CUDA graphs vLLM captures; none with --enforce-eager."""
        if self.deployment.enforce_eager:
            return 0, 0
        return cudagraph_counts(self.max_num_seqs, self.max_num_batched_tokens,
                                blackwell=self.compute_capability_major == 10,
                                model_type=self.arch.model_type)

    @property
    def cudagraph_bytes(self) -> int:
        """The CUDA graph pool vLLM subtracts from the KV budget: from 0.21 on, unless
        eager (earlier versions take it out of the headroom after the KV cache)."""
        if self.deployment.vllm_version < CUDAGRAPH_PROFILED_SINCE:
            return 0
        return cudagraph_bytes(self.arch, sum(self.cudagraph_counts))

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
        """Time to first token of one prompt from its arrival at the engine: the running
        requests' steps it waits for (`pickup`), then its prefill."""
        prefill = self.prefill(prompt_tokens, running_contexts, cached_tokens)
        pickup = self.pickup(running_contexts)
        if prefill is None or pickup is None:
            return None
        return pickup.plus(prefill)

    def prefill(
        self,
        prompt_tokens: int,
        running_contexts: tuple[int, ...] = (),
        cached_tokens: int = 0,
        capped: bool | None = None,
    ) -> PhaseCost | None:
        """The steps that prefill one prompt (after `cached_tokens` of prefix-cache hits)
        while `running_contexts` decode alongside, in chunks of at most
        `long_prefill_cap` where others are eligible (`capped`: see
        `prefill_chunk_tokens`)."""
        roofline = self.roofline
        if roofline is None:
            return None
        if capped is None:
            capped = bool(running_contexts)
        return roofline.prefill(
            prompt_tokens, running_contexts, self.max_num_batched_tokens, cached_tokens,
            self.long_prefill_cap if capped else 0,
        )

    def prefill_in_steps(self, prompt_tokens: int, steps: int,
                         running_contexts: tuple[int, ...] = (),
                         cached_tokens: int = 0) -> PhaseCost | None:
        """Several prompts' `prompt_tokens` prefilled over `steps` steps while
        `running_contexts` decode (`model.prefill_queue`: prompts behind others under
        the long-prefill threshold)."""
        roofline = self.roofline
        if roofline is None:
            return None
        return roofline.prefill_in_steps(prompt_tokens, steps, running_contexts, cached_tokens)

    def pickup(self, running_contexts: tuple[int, ...],
               steps: float | None = None) -> PhaseCost | None:
        """What a request arriving while `running_contexts` decode waits before vLLM
        schedules its first chunk: `steps` of their steps (default `pickup_steps`; none
        when nothing runs)."""
        if not running_contexts:
            return None if self.roofline is None else PhaseCost(0.0, 0.0, 0.0)
        step = self.tpot(running_contexts)  # one of their decode steps
        return None if step is None else step.times(
            self.pickup_steps if steps is None else steps)

    @property
    def pickup_steps(self) -> float:
        """Steps of the running requests a new request waits before vLLM schedules its
        first chunk: the rest of the step in flight (half of one, on average, for an
        arrival at a random moment), and with asynchronous scheduling the step already
        scheduled behind it (vLLM schedules the next step while one runs, and takes new
        requests in when it schedules)."""
        return 1.5 if self.deployment.schedules_async else 0.5

    def tpot(self, contexts: tuple[int, ...]) -> PhaseCost | None:
        roofline = self.roofline
        return None if roofline is None else roofline.decode(contexts)


def gib(value_bytes: float) -> float:
    return value_bytes / GIB
