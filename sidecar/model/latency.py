"""Time of one engine step by roofline, and TTFT / TPOT built from steps.

One vLLM step runs a batch of tokens: new prompt tokens of prefilling requests
(with their causal attention over what they have so far) and one token for each
decoding request (attending to its whole context). Its time is

    max(compute_s, memory_s) + serial_fraction x min(compute_s, memory_s)
      + tensor-parallel all-reduces + per-layer and per-step overheads

with compute_s = FLOPs / (eta_compute x peak) and memory_s = (weight bytes + KV bytes /
kv_bandwidth_ratio) / (eta_bandwidth x bandwidth), where the weights are streamed once
per step (routed experts only in the share the batch touches), the KV bytes are the
cache the batch reads and writes, and FLOPs are 2 x active parameters per token plus
attention. The KV cache is read in blocks scattered over the pool, by the engine's
attention kernels, at a lower share of peak than one long weight stream: the ratio is
an engine's term. The phase is "compute"-bound when the FLOP term is the larger one.

The serial fraction is the part of the shorter term that does not hide under the
longer one: 0 is the ideal roofline, 1 no overlap at all. Decode (memory_s >>
compute_s) and long prefills (compute_s >> memory_s) barely notice it; a prefill of
a few hundred tokens, where both terms are of a size, does: measured, a 128-token
prompt takes ~1.2-1.6 decode steps where max() would give ~1.

A request's TTFT adds the engine's fixed cost per request (`per_request_s`: API
server, tokenizer, scheduling, detokenizing and streaming the first token), each
step the engine's host work (`per_step_s`, plus `per_sequence_s` for each sequence
in the step: sampling, output processing, detokenizing and streaming its token - 0 by
default, learned by calibration where it shows, as on CPU servers), and each TP
all-reduce the fixed cost of the engine's collective (`allreduce_latency_s`:
TensorRT-LLM's all-reduce plugin, vLLM's custom all-reduce or NCCL). These are
properties of the serving engine, not of the model or GPU, and so is the share of
peak FLOP/s its kernels reach: `ENGINE_TERMS` holds them for vLLM (the default, what
kvgate guards) and for TensorRT-LLM (whose public measurements calibrate the hardware
terms too).

The efficiency factors are not per-model or per-GPU constants: their defaults were
fitted once to the public measurements in the project's test data (see
`DEFAULT_EFFICIENCY`), and a live sidecar refits them against the server it guards
(calibration).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from sidecar.model.architecture import ModelArchitecture, Role
from sidecar.model.gpu import Gpu
from sidecar.model.kv_spec import KVSpec
from sidecar.model.precision import ComputeRate
from sidecar.model.weights import WeightFootprint, expert_fraction_read

Bound = Literal["compute", "memory"]

# Per-GPU link used for all-reduce when the catalogue has no NVLink figure (PCIe 4 x16).
_PCIE_GBPS = 25.0


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of peak and fixed costs; see DEFAULT_EFFICIENCY."""

    # Fractions of the named device's peaks. Calibration fits effective rates, which no
    # catalogue figure bounds: above 1 the server runs faster than the named device's
    # peak (a wrong or generic --gpu), far below the device's usual share a slower one.
    compute: float  # fraction of dense peak FLOP/s reached by large matmuls
    bandwidth: float  # fraction of peak memory bandwidth reached streaming weights/KV
    per_layer_s: float  # kernel launch and small-op cost per layer per step
    per_step_s: float  # scheduling, sampling and host work per engine step
    allreduce_latency_s: float = 8e-6  # fixed cost of one TP all-reduce
    per_request_s: float = 0.0  # engine work per request before its first token
    serial_fraction: float = 0.0  # share of min(compute, memory) time not overlapped
    per_sequence_s: float = 0.0  # host work per sequence in a step (outputs, streaming)
    # The KV cache's reads and writes, in blocks scattered over the pool, reach this share
    # of the bandwidth the weights stream at (see ENGINE_TERMS).
    kv_bandwidth_ratio: float = 1.0

    def __post_init__(self) -> None:
        for name in ("compute", "bandwidth", "kv_bandwidth_ratio"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0.0):
                raise ValueError(f"efficiency {name} must be a positive number, got {value}")
        for name in ("per_layer_s", "per_step_s", "allreduce_latency_s", "per_request_s",
                     "per_sequence_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"efficiency {name} must be a number >= 0, got {value}")
        if not 0.0 <= self.serial_fraction <= 1.0:
            raise ValueError(
                f"efficiency serial_fraction must be in [0, 1], got {self.serial_fraction}"
            )

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in _EFFICIENCY_FIELDS}

    @staticmethod
    def from_mapping(data: Mapping[str, object], base: Efficiency | None = None) -> Efficiency:
        """Efficiency from a mapping (a saved calibration); missing keys keep `base`."""
        values = (base or DEFAULT_EFFICIENCY).as_dict()
        for name in _EFFICIENCY_FIELDS:
            if name in data:
                value = data[name]
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise ValueError(f"efficiency {name} must be a number, got {value!r}")
                values[name] = float(value)
        return Efficiency(**values)

    def for_engine(self, engine: str) -> Efficiency:
        """These hardware efficiencies with a serving engine's fitted terms."""
        terms = ENGINE_TERMS.get(engine)
        if terms is None:
            raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINE_TERMS)}")
        return self.with_engine(terms)

    def with_engine(self, terms: EngineTerms) -> Efficiency:
        """These hardware efficiencies with `terms` for the engine's own."""
        return replace(self, compute=terms.compute, per_step_s=terms.per_step_s,
                       per_request_s=terms.per_request_s,
                       allreduce_latency_s=terms.allreduce_latency_s,
                       kv_bandwidth_ratio=terms.kv_bandwidth_ratio)


_EFFICIENCY_FIELDS = (
    "compute",
    "bandwidth",
    "per_layer_s",
    "per_step_s",
    "allreduce_latency_s",
    "per_request_s",
    "serial_fraction",
    "per_sequence_s",
    "kv_bandwidth_ratio",
)


@dataclass(frozen=True)
class EngineTerms:
    """What a serving engine adds to the hardware, independent of model and GPU: the
    share of peak FLOP/s its kernels reach, and its host costs."""

    compute: float  # fraction of dense peak FLOP/s its matmul and attention kernels reach
    per_step_s: float  # scheduler, sampler, Python/C++ runtime work per step
    per_request_s: float  # API server, tokenizer, detokenizer: once per request
    allreduce_latency_s: float  # fixed cost of one TP all-reduce in its collective
    # Its attention kernels' KV cache traffic (paged: blocks scattered over the pool)
    # against the bandwidth its weights stream at.
    kv_bandwidth_ratio: float = 1.0


VLLM = "vllm"
TENSORRT_LLM = "tensorrt-llm"

# Fitted with the hardware terms below; see DEFAULT_EFFICIENCY. vLLM's figures come
# from its OpenAI server measured by its benchmark client over HTTP (tokenizing the
# prompt, a separate engine-core process, detokenizing and streaming the first
# token); TensorRT-LLM's from its C++ static-batch benchmark, without a server.
ENGINE_TERMS: Mapping[str, EngineTerms] = {
    VLLM: EngineTerms(compute=0.684, per_step_s=1.41e-3, per_request_s=24.0e-3,
                      allreduce_latency_s=28.1e-6, kv_bandwidth_ratio=0.382),
    TENSORRT_LLM: EngineTerms(compute=0.500, per_step_s=0.625e-3, per_request_s=2.00e-3,
                              allreduce_latency_s=12.5e-6),
}

# Fitted by `python bench/model_cv.py --fit`: the fit each fold of the cross-validation
# runs (a coordinate search from a fixed prior, the best of three starts of each
# engine's cost per request, minimising averaged over the two engines the median
# |log(model / measured)| of TTFT and TPOT), here on the one-request rows of every
# usable row of tests/data/groundtruth/latency.csv: TensorRT-LLM 0.9's static-batch
# rows (Llama-2, Mistral-7B, Mixtral-8x7B on A100, H100, H200, GH200, L40, L40S) and
# vLLM's (Qwen2, Qwen2.5, gpt-oss, Llama 3 on A100, H100 NVL, L4). The engine average
# keeps vLLM's own terms answerable to vLLM's rows. bandwidth, per_layer_s and
# serial_fraction are shared by all rows, and each engine fits its ENGINE_TERMS; no
# per-model or per-GPU constant. The figures are that fit's, to three digits, and
# tests/test_groundtruth.py checks that the fit still gives them. Their errors on
# those rows are training errors; the accuracy is the cross-validation's, out of fold
# (bench/model_cv.py, docs/model.md#accuracy).
DEFAULT_EFFICIENCY = Efficiency(
    compute=ENGINE_TERMS[VLLM].compute,
    bandwidth=0.700,
    per_layer_s=24.0e-6,
    per_step_s=ENGINE_TERMS[VLLM].per_step_s,
    allreduce_latency_s=ENGINE_TERMS[VLLM].allreduce_latency_s,
    per_request_s=ENGINE_TERMS[VLLM].per_request_s,
    serial_fraction=0.0909,
    kv_bandwidth_ratio=ENGINE_TERMS[VLLM].kv_bandwidth_ratio,
)


# observed / predicted at the 90th percentile before any calibration: the p90 |error|
# above (TTFT 45%, TPOT 18%). Calibration replaces them with the server's own spread.
PRIOR_P90_RATIO = {"ttft": 1.45, "tpot": 1.18}
# How the spread of observed / predicted is kept apart by the load a request meets: the
# requests running when it is admitted, 0, 1, 2-3, 4 or more (a request's wait for the
# others' steps and prefills grows with them, and the model prices it only on average).
LOAD_BUCKETS = 4


def load_bucket(running: int) -> int:
    """0 for 0 running requests, 1 for 1, 2 for 2-3, 3 for 4 or more."""
    return min(LOAD_BUCKETS - 1, max(0, running).bit_length())


@dataclass(frozen=True)
class Prefill:
    """A prefill chunk: `new_tokens` prompt tokens after `cached_tokens` already cached."""

    new_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True)
class StepCost:
    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    communication_s: float
    overhead_s: float
    serial_fraction: float = 0.0

    @property
    def seconds(self) -> float:
        busy = max(self.compute_s, self.memory_s) + self.serial_fraction * min(
            self.compute_s, self.memory_s
        )
        return busy + self.communication_s + self.overhead_s

    @property
    def bound(self) -> Bound:
        return "compute" if self.compute_s >= self.memory_s else "memory"


@dataclass(frozen=True)
class Roofline:
    arch: ModelArchitecture
    weights: WeightFootprint
    kv_specs: Sequence[KVSpec]
    gpu: Gpu
    tp: int
    compute_rate: ComputeRate
    efficiency: Efficiency = DEFAULT_EFFICIENCY
    # Active parameters multiplied per token in the layers (no embeddings/lm_head): set
    # once when made (a `cached_property` would be recomputed at each use compiled).
    _matmul_params: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        skip = (Role.EMBEDDING, Role.LM_HEAD, Role.VISION, Role.NORM)
        object.__setattr__(self, "_matmul_params", float(sum(
            n for role, n in self.arch.active_params_by_role().items() if role not in skip)))

    def _kv_bytes(self, tokens: int) -> float:
        return sum(spec.sequence_bytes(tokens) for spec in self.kv_specs)

    def _kv_token_bytes(self) -> float:
        return sum(spec.token_bytes for spec in self.kv_specs)

    def step(
        self, prefills: Sequence[Prefill] = (), decode_contexts: Sequence[int] = ()
    ) -> StepCost:
        """Cost of one engine step over the given prefill chunks and decoding sequences."""
        arch = self.arch
        new_tokens = sum(p.new_tokens for p in prefills) + len(decode_contexts)
        if new_tokens <= 0:
            return StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        # vLLM computes logits only for the last token of each sequence in the step.
        logit_rows = len(decode_contexts) + len(prefills)
        linear_flops = 2.0 * self._matmul_params * new_tokens + (
            2.0 * arch.hidden_size * arch.vocab_size * logit_rows
        )
        attention_flops = 0.0
        kv_read = 0.0
        for chunk in prefills:
            middle = chunk.cached_tokens + chunk.new_tokens // 2
            attention_flops += chunk.new_tokens * arch.context_flops_per_token(middle)
            kv_read += self._kv_bytes(chunk.cached_tokens)
        # Batches share context lengths (a simulated batch is one length): each
        # distinct length is priced once.
        for context, count in Counter(decode_contexts).items():
            attention_flops += count * arch.context_flops_per_token(context)
            kv_read += count * self._kv_bytes(context)
        flops = (linear_flops + attention_flops) / self.tp
        kv_write = new_tokens * self._kv_token_bytes()
        weight_bytes = self.weights.bytes_read_per_step(expert_fraction_read(arch, new_tokens))
        total_bytes = weight_bytes + kv_read + kv_write
        eff = self.efficiency
        compute_s = flops / (eff.compute * self.gpu.peak_flops(self.compute_rate))
        memory_s = (weight_bytes + (kv_read + kv_write) / eff.kv_bandwidth_ratio) / (
            eff.bandwidth * self.gpu.bandwidth_bytes_per_s)
        return StepCost(
            flops=flops,
            bytes=total_bytes,
            compute_s=compute_s,
            memory_s=memory_s,
            communication_s=self._allreduce_s(new_tokens),
            overhead_s=eff.per_step_s + eff.per_layer_s * arch.num_layers
            + eff.per_sequence_s * logit_rows,
            serial_fraction=eff.serial_fraction,
        )

    def _allreduce_s(self, tokens: int) -> float:
        """Two ring all-reduces per layer (after attention and after the MLP).

        A ring over p ranks takes 2(p - 1) steps, each moving payload/p per GPU: a
        fixed cost per all-reduce, the bytes over the link, and - when the TP peers
        sit on other nodes - the network's latency for every step of the ring.
        """
        if self.tp <= 1:
            return 0.0
        link = (self.gpu.interconnect_gbps or _PCIE_GBPS) * 1e9
        payload = tokens * self.arch.hidden_size * 2  # bf16 activations
        ring_steps = 2 * (self.tp - 1)
        ring = ring_steps / self.tp * payload / link
        latency = self.efficiency.allreduce_latency_s + ring_steps * self.gpu.hop_latency_s
        return 2 * (latency + ring) * self.arch.num_layers

    # ---- request-level views ---------------------------------------------------

    def prefill(
        self,
        prompt_tokens: int,
        running_contexts: Sequence[int] = (),
        chunk_tokens: int | None = None,
        cached_tokens: int = 0,
        cap_tokens: int = 0,
    ) -> PhaseCost:
        """The steps that prefill one prompt while `running_contexts` keep decoding.

        With chunked prefill a long prompt runs in chunks of `chunk_tokens` (vLLM's
        max_num_batched_tokens less the decode tokens sharing each step), and of at most
        `cap_tokens` (its --long-prefill-token-threshold where other requests are
        eligible; 0: no cap).
        """
        budget = max(1, (chunk_tokens or prompt_tokens) - len(running_contexts))
        if cap_tokens > 0:
            budget = min(budget, cap_tokens)
        steps: list[StepCost] = []
        done = 0
        while done < max(prompt_tokens, 1):
            size = max(1, min(budget, prompt_tokens - done))
            steps.append(self.step([Prefill(size, cached_tokens + done)], running_contexts))
            done += size
        return PhaseCost.of(steps, self.efficiency.per_request_s)

    def prefill_in_steps(self, prompt_tokens: int, steps: int,
                         running_contexts: Sequence[int] = (),
                         cached_tokens: int = 0) -> PhaseCost:
        """`prompt_tokens` (several prompts' chunks together) prefilled over `steps`
        steps of as even a size as they divide into, while `running_contexts` decode."""
        tokens, count = max(prompt_tokens, 1), max(1, min(steps, max(prompt_tokens, 1)))
        size, extra = divmod(tokens, count)
        parts: list[StepCost] = []
        done = 0
        for index in range(count):
            chunk = size + (1 if index < extra else 0)
            parts.append(self.step([Prefill(chunk, cached_tokens + done)], running_contexts))
            done += chunk
        return PhaseCost.of(parts, self.efficiency.per_request_s)

    def decode(self, contexts: Sequence[int]) -> PhaseCost:
        """One decode step for a batch of sequences with these context lengths."""
        return PhaseCost.of([self.step((), contexts)])


@dataclass(frozen=True)
class PhaseCost:
    """Several steps: their total time and which resource bounded most of it."""

    seconds: float
    compute_s: float
    memory_s: float

    @property
    def bound(self) -> Bound:
        return "compute" if self.compute_s >= self.memory_s else "memory"

    def times(self, factor: float) -> PhaseCost:
        """`factor` x this phase (e.g. half a step)."""
        return PhaseCost(factor * self.seconds, factor * self.compute_s,
                         factor * self.memory_s)

    def plus(self, other: PhaseCost) -> PhaseCost:
        """This phase, then `other`."""
        return PhaseCost(self.seconds + other.seconds, self.compute_s + other.compute_s,
                         self.memory_s + other.memory_s)

    @staticmethod
    def of(steps: Sequence[StepCost], fixed_s: float = 0.0) -> PhaseCost:
        """The steps' total, plus `fixed_s` spent outside them (per-request work)."""
        return PhaseCost(
            fixed_s + sum(step.seconds for step in steps),
            sum(step.compute_s for step in steps),
            sum(step.memory_s for step in steps),
        )
