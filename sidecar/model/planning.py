"""Capacity planning: latency at a steady concurrency, Little's law, recommended
vLLM flags and replica counts, and multi-call chains (agents, RAG).

Little's law: requests in the system = arrival rate x time in system. Seed example:
a request decodes 500 tokens at 50 tokens/s (10 s); at 2 requests/s, 20 requests are
in flight, and each holds its KV cache for the whole time.

Prefix caching follows the admission core's rules (`admission.prefix`): a request
reuses the full blocks of a prefix the server holds, up to its prompt less one token;
requests running together hold a shared prefix's blocks once, in the groups that keep
prompt blocks for a request's life (full attention, MLA). A request holds its KV at
the peak of its life (`model.lifecycle`): for sliding windows that is less than the
window cap vLLM sizes its pool with.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from sidecar.model.latency import Bound
from sidecar.model.served import ServedModel

# Plan to fill at most this share of the KV cache: request lengths vary around
# their means (the seeds recommend 70-80%).
DEFAULT_KV_MARGIN = 0.8


@dataclass(frozen=True)
class LatencyEstimate:
    ttft_s: float
    tpot_s: float
    e2e_s: float
    prefill_bound: Bound
    decode_bound: Bound


def prefix_hit_tokens(cached_tokens: int, prompt_tokens: int, block_size: int, *,
                      drops_last_block: bool = False) -> int:
    """Prompt tokens a request finds in the prefix cache when the server holds its
    first `cached_tokens` tokens: whole blocks, never the last prompt token, and with
    an MTP drafter (`drops_last_block`) one block fewer (vLLM computes the last block of
    a hit again, for the drafter)."""
    usable = min(cached_tokens, prompt_tokens - 1)
    hit = max(0, usable) // block_size * block_size
    return max(0, hit - block_size) if drops_last_block else hit


def shared_prefix_blocks(served: ServedModel, shared_prefix_tokens: int,
                         prompt_tokens: int) -> int:
    """Blocks of a request that concurrent requests with the same prefix hold once."""
    block_size = served.layout.prefix_block_size
    if block_size is None or shared_prefix_tokens <= 0:
        return 0
    hit = prefix_hit_tokens(shared_prefix_tokens, prompt_tokens, block_size,
                            drops_last_block=served.deployment.drops_last_prefix_hit)
    return hit // block_size * served.layout.prefix_groups


def steady_latency(
    served: ServedModel, prompt_tokens: int, output_tokens: int, concurrency: int,
    cached_tokens: int = 0,
) -> LatencyEstimate | None:
    """Latency of one request while `concurrency` requests (itself included) run.

    The others are taken halfway through their output: context = prompt + output/2.
    TTFT: the others' steps it waits for first, then its prefill (`ServedModel.ttft`);
    E2E = TTFT + (output - 1) x TPOT. `cached_tokens` of the prompt are prefix-cache hits.
    """
    if served.roofline is None:
        return None
    concurrency = max(1, concurrency)
    mid_context = prompt_tokens + output_tokens // 2
    others = (mid_context,) * (concurrency - 1)
    cached = prefix_hit_tokens(cached_tokens, prompt_tokens, served.block_size,
                               drops_last_block=served.deployment.drops_last_prefix_hit)
    prefill = served.ttft(prompt_tokens - cached, others, cached)
    decode = served.tpot((mid_context,) * concurrency)
    assert prefill is not None and decode is not None
    return LatencyEstimate(
        ttft_s=prefill.seconds,
        tpot_s=decode.seconds,
        # The prefill's step gives the first token; each decode step one more.
        e2e_s=prefill.seconds + max(0, output_tokens - 1) * decode.seconds,
        prefill_bound=prefill.bound,
        decode_bound=decode.bound,
    )


def concurrency_by_littles_law(arrival_rate_per_s: float, time_in_system_s: float) -> float:
    return arrival_rate_per_s * time_in_system_s


def kv_concurrency_limit(served: ServedModel, sequence_tokens: int,
                         margin: float = DEFAULT_KV_MARGIN, *, output_tokens: int | None = None,
                         shared_prefix_tokens: int = 0) -> int | None:
    """Requests that fit in `margin` of the KV cache at once: sequences of
    `sequence_tokens` tokens (`output_tokens` of them output), each at the peak of its
    life, a shared prefix's blocks held once."""
    capacity = served.capacity
    if capacity is None:
        return None
    output = sequence_tokens // 2 if output_tokens is None else output_tokens
    prompt = max(1, sequence_tokens - output)
    per_request = served.lifecycle.peak_blocks(prompt, output)
    if per_request == 0:
        return served.max_num_seqs
    shared = shared_prefix_blocks(served, shared_prefix_tokens, prompt)
    room = capacity.usable_blocks * margin - shared
    own = per_request - shared
    if own <= 0:
        return served.max_num_seqs
    return max(0, int(room // own))


@dataclass(frozen=True)
class Recommendation:
    max_num_seqs: int
    limited_by: str  # "kv-cache", "tpot-slo", "ttft-slo", "max-num-seqs"
    concurrency_needed: float | None  # by Little's law, when an arrival rate is given
    replicas: int | None
    latency_at_max: LatencyEstimate | None


def recommend(
    served: ServedModel,
    prompt_tokens: int,
    output_tokens: int,
    arrival_rate_per_s: float | None = None,
    ttft_slo_s: float | None = None,
    tpot_slo_s: float | None = None,
    margin: float = DEFAULT_KV_MARGIN,
    shared_prefix_tokens: int = 0,
) -> Recommendation:
    """The largest concurrency one replica sustains within the KV margin and SLOs."""
    limit = served.max_num_seqs
    limited_by = "max-num-seqs"
    kv_limit = kv_concurrency_limit(served, prompt_tokens + output_tokens, margin,
                                    output_tokens=output_tokens,
                                    shared_prefix_tokens=shared_prefix_tokens)
    if kv_limit is not None and kv_limit < limit:
        limit, limited_by = max(kv_limit, 1), "kv-cache"

    def slo_violation(concurrency: int) -> str | None:
        estimate = steady_latency(served, prompt_tokens, output_tokens, concurrency,
                                  shared_prefix_tokens)
        if estimate is None:
            return None
        if tpot_slo_s is not None and estimate.tpot_s > tpot_slo_s:
            return "tpot-slo"
        if ttft_slo_s is not None and estimate.ttft_s > ttft_slo_s:
            return "ttft-slo"
        return None

    violation = slo_violation(limit) if (ttft_slo_s or tpot_slo_s) else None
    if violation is not None:
        low, high = 1, limit
        reason = violation
        while low < high:
            mid = (low + high + 1) // 2
            if slo_violation(mid) is None:
                low = mid
            else:
                high = mid - 1
        limit, limited_by = low, reason
    latency = steady_latency(served, prompt_tokens, output_tokens, limit, shared_prefix_tokens)
    needed = None
    replicas = None
    if arrival_rate_per_s is not None and latency is not None:
        # Time in system at the recommended operating point sizes the concurrency.
        needed = concurrency_by_littles_law(arrival_rate_per_s, latency.e2e_s)
        replicas = max(1, math.ceil(needed / limit))
    return Recommendation(limit, limited_by, needed, replicas, latency)


@dataclass(frozen=True)
class ChainCall:
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class ChainCallEstimate:
    call: ChainCall
    cached_tokens: int
    ttft_s: float
    decode_s: float


@dataclass(frozen=True)
class ChainEstimate:
    calls: tuple[ChainCallEstimate, ...]
    prefix_cache: bool

    @property
    def total_s(self) -> float:
        return sum(call.ttft_s + call.decode_s for call in self.calls)

    @property
    def prefill_tokens(self) -> int:
        return sum(c.call.input_tokens - c.cached_tokens for c in self.calls)


def chain(
    served: ServedModel, calls: Sequence[ChainCall], prefix_cache: bool, concurrency: int = 1
) -> ChainEstimate | None:
    """Sum of prefill and decode over a chain of calls that re-send a growing context.

    With a prefix cache, call i reuses the previous call's input plus output when its
    own input starts with them (it is at least as long), in whole blocks and never its
    last input token (as vLLM reuses them); only the rest is prefilled. The previous
    call's last output token was sampled and never computed: it holds no KV.
    """
    if served.roofline is None:
        return None
    estimates: list[ChainCallEstimate] = []
    previous_context = 0
    block_size = served.block_size
    for call in calls:
        cached = 0
        if prefix_cache and previous_context and call.input_tokens > previous_context:
            cached = prefix_hit_tokens(
                previous_context, call.input_tokens, block_size,
                drops_last_block=served.deployment.drops_last_prefix_hit)
        new_tokens = max(1, call.input_tokens - cached)
        mid = call.input_tokens + call.output_tokens // 2
        others = (mid,) * (max(1, concurrency) - 1)
        prefill = served.ttft(new_tokens, others, cached)
        decode = served.tpot((mid,) * max(1, concurrency))
        assert prefill is not None and decode is not None
        estimates.append(
            ChainCallEstimate(call, cached, prefill.seconds,
                              max(0, call.output_tokens - 1) * decode.seconds)
        )
        previous_context = call.input_tokens + call.output_tokens - 1
    return ChainEstimate(tuple(estimates), prefix_cache)
