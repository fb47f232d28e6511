"""What one request will cost the server: KV blocks exactly as vLLM allocates them
over the request's life (its peak, less the prompt blocks it shares with requests
already admitted, and with `n` forks the prompt's full blocks held once), prefill FLOPs
and time (prefix-cache hits skipped), decode time per token.

`CostModel` wraps the analytical model (`ServedModel`) and memoises the few
functions the hot path calls, bucketing continuous inputs so that a decision costs
microseconds (the queue ahead of it is priced apart: `room`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, NamedTuple

from sidecar.admission.quick_init import quick_init
from sidecar.model import ServedModel
from sidecar.model.latency import LOAD_BUCKETS, PRIOR_P90_RATIO, load_bucket
from sidecar.model.prefill_queue import prefill_behind

DeadlineQuantile = Literal["p50", "p90"]

# Buckets for memoised latency predictions: coarse enough to hit the cache,
# fine enough to stay within a few percent.
_PROMPT_BUCKET = 64
_CONTEXT_BUCKET = 256


def _each(value: float) -> tuple[float, ...]:
    return (value,) * LOAD_BUCKETS


def own_prefill_capped(sequences: int) -> bool | None:
    """Whether vLLM's long-prefill threshold caps a request's own prefill: always with
    `n` above 1 (its forks are requests of their own, eligible together), else where
    others run (None: `ServedModel.prefill_chunk_tokens` decides)."""
    return True if sequences > 1 else None


@dataclass(frozen=True)
class LatencySpread:
    """Multipliers on the model's TTFT and TPOT for its median (p50) and 90th percentile
    (p90) predictions, one per load bucket (`model.latency.load_bucket`: the requests
    running at admission). Calibration measures them on the server
    (`calibration.spread`); without it, p50 is the model's own and p90 its prior
    error spread."""

    ttft_p50: tuple[float, ...] = _each(1.0)
    ttft_p90: tuple[float, ...] = _each(PRIOR_P90_RATIO["ttft"])
    tpot_p50: tuple[float, ...] = _each(1.0)
    tpot_p90: tuple[float, ...] = _each(PRIOR_P90_RATIO["tpot"])

    @staticmethod
    def uniform(ttft_p50: float = 1.0, ttft_p90: float = PRIOR_P90_RATIO["ttft"],
                tpot_p50: float = 1.0, tpot_p90: float = PRIOR_P90_RATIO["tpot"],
                ) -> LatencySpread:
        """The same factors at every load."""
        return LatencySpread(_each(ttft_p50), _each(ttft_p90), _each(tpot_p50),
                             _each(tpot_p90))


class ModelInputs(NamedTuple):
    """What the model's own TTFT and TPOT of one request were computed from: enough to
    price the same request again with another model (`CostModel.model_s`), as
    calibration's spread does when the fit moves."""

    prefilled_tokens: int
    cached_tokens: int
    running: int
    mean_context: int
    batch: int  # the decode batch it joins, itself included
    context_tokens: int  # the decode's mean context
    slowdown: float  # the others' prefill load at admission (see `load.PrefillLoad`)
    # Admitted prompts' tokens the server prefills before its first token: all of them,
    # first, at the whole budget; with the server's long-prefill threshold, those
    # scheduled in the `ahead_steps` steps until its own last chunk, side by side with
    # it (`model.prefill_queue`), and none where its own prefill after the steps in
    # flight takes longer (the TTFT was priced from that).
    ahead_tokens: int = 0
    ahead_steps: int = 0


@quick_init
@dataclass(frozen=True)
class RequestCost:
    prompt_tokens: int
    output_tokens: int  # reserved per sequence
    sequences: int  # n sequences forked from the prompt (times the prompts of a batch)
    kv_blocks: int  # reserved, all sequences
    worst_case_blocks: int  # if every sequence ran to max_model_len
    prefill_flops: float
    prefill_s: float  # predicted time to its first token, others' prefills included
    tpot_s: float  # per output token at the batch it will join
    prefill_work_s: float = 0.0  # its own prefill, as engine time (no slowdown)
    shared_blocks: int = 0  # blocks of its peak that admitted requests already hold
    cached_tokens: int = 0  # prompt tokens the server will not prefill (prefix hits)
    # prefill_s and tpot_s are p50 predictions; the model's own (before the spread's
    # factors) and the p90 beside them:
    prefill_model_s: float = 0.0
    tpot_model_s: float = 0.0
    prefill_p90_s: float = 0.0
    tpot_p90_s: float = 0.0
    deadline_prefill_s: float = 0.0  # the prefill deadlines are judged on (p50 or p90)
    load_bucket: int = 0  # of the requests running at admission (model.latency)
    model_inputs: ModelInputs | None = None  # what the model's own times came from
    # Prompt tokens the server prefills for all its sequences: the first fork's tokens
    # not cached, and each later fork's not found in the cache (the prompt's full
    # blocks, where forks share them).
    server_prefill_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    @property
    def decode_s(self) -> float:
        return self.output_tokens * self.tpot_s

    def gpu_seconds(self, capacity_blocks: int) -> float:
        """The fairness charge, in GPU-seconds: its own prefill's engine time
        (`prefill_work_s`: not the prompts ahead of it, the steps it waits for or the
        API server's work) holds the whole GPU; decoding holds the request's share of
        the KV cache (its blocks over the capacity) for the time it runs. Prefill
        tokens and KV block-seconds, not request counts."""
        hold_s = self.prefill_work_s + self.decode_s
        return self.prefill_work_s + self.kv_blocks * hold_s / max(1, capacity_blocks)


class CostModel:
    def __init__(self, served: ServedModel, spread: LatencySpread | None = None,
                 deadline_quantile: DeadlineQuantile = "p50") -> None:
        self.served = served
        self.spread = spread or LatencySpread()
        self.deadline_quantile: DeadlineQuantile = deadline_quantile
        self._blocks = lru_cache(maxsize=65_536)(served.blocks_for_request)
        self.lifecycle = served.lifecycle
        self._prefill = lru_cache(maxsize=16_384)(self._prefill_uncached)
        self._prefill_in_steps = lru_cache(maxsize=16_384)(self._prefill_in_steps_uncached)
        self._chunk_tokens = lru_cache(maxsize=1_024)(served.prefill_chunk_tokens)
        self._tpot = lru_cache(maxsize=16_384)(self._tpot_uncached)
        self._pickup = lru_cache(maxsize=16_384)(self._pickup_uncached)
        self._flops_per_token = 2.0 * served.arch.params_active()
        # Read on every decision: the served model's, looked up once.
        self.max_model_len: int = served.max_model_len
        # The prompt blocks the sequences one request forks (n) share, with prefix
        # caching on (`fork_shared_blocks`): counted only where every group keeps its
        # prompt blocks for the request's whole life (full attention, MLA), and not
        # with MTP drafting, whose cache hits give up their last block.
        layout = served.layout
        shareable = (all(group.spec.prefix_shareable for group in layout.groups)
                     and not served.deployment.drops_last_prefix_hit)
        self._fork_block_size = layout.prefix_block_size if shareable else None
        self._fork_groups = layout.prefix_groups
        # vLLM's --long-prefill-token-threshold (0: none): see `_fork_hit_tokens`.
        self._prefill_chunk_tokens = served.deployment.long_prefill_token_threshold
        # What a request's shape alone decides (`_shape_uncached`), looked up once.
        self._shape = lru_cache(maxsize=65_536)(self._shape_uncached)

    @property
    def block_size(self) -> int:
        return self.served.block_size

    def blocks(self, tokens: int, sequences: int = 1) -> int:
        """KV blocks `sequences` sequences of `tokens` tokens hold once all of them are
        in the cache (windows capped as vLLM's planner caps them)."""
        if tokens <= 0:
            return 0
        return sequences * self._blocks(tokens)

    def peak_blocks(self, prompt_tokens: int, output_tokens: int, sequences: int = 1,
                    produced: int = 0, *, forks_share: bool = False) -> int:
        """The most `sequences` sequences hold from `produced` output tokens to their
        end (the reservation still needed; see `model.lifecycle`); `forks_share`: see
        `fork_shared_blocks`."""
        if prompt_tokens + output_tokens <= 0:
            return 0
        return (sequences * self.lifecycle.peak_blocks(prompt_tokens, output_tokens, produced)
                - self.fork_shared_blocks(prompt_tokens, sequences, forks_share=forks_share))

    def blocks_now(self, prompt_tokens: int, produced: int, sequences: int = 1, *,
                   forks_share: bool = False) -> int:
        """Blocks held now, `produced` output tokens into the request."""
        return (sequences * self.lifecycle.blocks_now(prompt_tokens, produced)
                - self.fork_shared_blocks(prompt_tokens, sequences, forks_share=forks_share))

    def fork_shared_blocks(self, prompt_tokens: int, sequences: int, *,
                           forks_share: bool) -> int:
        """Blocks that the `sequences` forks of one prompt would each hold but hold
        once, together, when the request's forks share (`forks_share`: prefix caching
        on and a request that shares, see `AdmissionRequest`). vLLM runs a request's
        forks as separate requests, and caches a block's key when it allocates the
        block (`allocate_slots` -> `cache_blocks`), before the step computes it. The
        first fork's prompt is scheduled before the others (with the default scheduler
        settings a later fork gets token budget only once it is), so each later fork
        finds the prompt's full blocks cached: all but the last token's, which vLLM
        always computes. On vLLM 0.32 CPU, blocks of 32 tokens
        (`tests/test_e2e_forks.py`): n = 4 forks of an 863-token prompt, 120 output
        tokens each, held 46 blocks (26 shared + 4 x 5), where 4 requests hold 124.
        With a long-prefill threshold, only its first chunk (`_fork_hit_tokens`)."""
        size = self._fork_block_size
        hit = self._fork_hit_tokens(prompt_tokens, sequences, forks_share)
        return (sequences - 1) * self._fork_groups * (hit // size) if size else 0

    def server_prefill_tokens(self, prompt_tokens: int, sequences: int, cached_tokens: int,
                              *, forks_share: bool) -> int:
        """Prompt tokens the server prefills for all `sequences` forks when it finds the
        first `cached_tokens` in its cache: the first fork's uncached tokens, and each
        later fork's not found cached (where forks share, the prompt's full blocks are)."""
        cached = max(0, min(cached_tokens, prompt_tokens - 1))
        fork_hit = self._fork_hit_tokens(prompt_tokens, sequences, forks_share)
        return prompt_tokens - cached + (sequences - 1) * (prompt_tokens - max(cached, fork_hit))

    def _fork_hit_tokens(self, prompt_tokens: int, sequences: int, forks_share: bool) -> int:
        """The prompt tokens each fork after the first is sure to find in the prefix
        cache. With vLLM's --long-prefill-token-threshold T a step schedules at most T
        of the first fork's prompt, and the token budget it leaves goes to the later
        forks, which start on the rest of the prompt themselves: each finds at least
        the first T tokens' full blocks (a later fork is scheduled only in a step where
        the budget outlasted the first fork's chunk)."""
        size = self._fork_block_size
        if not forks_share or size is None or sequences < 2:
            return 0
        limit = max(0, prompt_tokens - 1)
        if self._prefill_chunk_tokens > 0:
            limit = min(limit, self._prefill_chunk_tokens)
        return limit // size * size

    def cost(
        self,
        prompt_tokens: int,
        output_tokens: int,
        sequences: int = 1,
        running: int = 0,
        mean_context: int = 0,
        slowdown: float = 1.0,
        *,
        shared_blocks: int = 0,
        cached_tokens: int = 0,
        ahead: Sequence[int] = (),
        forks_share: bool = False,
    ) -> RequestCost:
        """`slowdown` (>= 1) stretches the times for the prefill work of others
        sharing the engine (see `load.PrefillLoad`). `shared_blocks` of the peak are
        held already by admitted requests with the same prefix; `cached_tokens` of
        the prompt are prefix-cache hits the server does not prefill again; `ahead`
        are the tokens admitted prompts still have to prefill, in the order the server
        took them (its time to first token covers them, its own prefill work does
        not); `forks_share`: see `fork_shared_blocks`."""
        total = prompt_tokens + output_tokens
        cached = max(0, min(cached_tokens, prompt_tokens - 1))
        ahead_tokens, ahead_steps = self._ahead(ahead, prompt_tokens - cached, running,
                                                sequences)
        inputs = ModelInputs(prompt_tokens - cached, cached, running, mean_context,
                             running + sequences, mean_context or total, slowdown,
                             ahead_tokens, ahead_steps)
        capped = own_prefill_capped(sequences)
        own_prefill = self.prefill_s(prompt_tokens - cached, running, mean_context, cached,
                                     capped)
        prefill, tpot, behind = self._model_s(inputs, own_prefill)
        if inputs.ahead_steps and not behind:
            # Under a long-prefill threshold its own prefill after the steps in flight
            # set the TTFT: what it was priced from (and what calibration learns it
            # as) is that alone.
            inputs = inputs._replace(ahead_tokens=0, ahead_steps=0)
        # Its work, as engine time: its tokens at the whole budget (a long-prefill
        # threshold spreads them over more steps, which other requests share).
        own_work = own_prefill if not self._prefill_chunk_tokens else self.prefill_s(
            prompt_tokens - cached, running, mean_context, cached, capped=False)
        peak, worst_peak, server_prefill = self._shape(prompt_tokens, output_tokens, sequences,
                                                       cached, forks_share)
        shared = min(shared_blocks, peak)
        spread, bucket = self.spread, load_bucket(running)
        prefill_model, tpot_model = prefill * slowdown, tpot * slowdown
        prefill_p50 = prefill_model * spread.ttft_p50[bucket]
        prefill_p90 = prefill_model * spread.ttft_p90[bucket]
        return RequestCost(
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            sequences=sequences,
            kv_blocks=peak - shared,
            worst_case_blocks=worst_peak - shared,
            prefill_flops=self._flops_per_token * (prompt_tokens - cached),
            prefill_s=prefill_p50,
            prefill_work_s=self._engine_work_s(own_work),
            tpot_s=tpot_model * spread.tpot_p50[bucket],
            shared_blocks=shared,
            cached_tokens=cached,
            prefill_model_s=prefill_model,
            tpot_model_s=tpot_model,
            prefill_p90_s=prefill_p90,
            tpot_p90_s=tpot_model * spread.tpot_p90[bucket],
            deadline_prefill_s=prefill_p90 if self.deadline_quantile == "p90" else prefill_p50,
            load_bucket=bucket,
            model_inputs=inputs,
            server_prefill_tokens=server_prefill,
        )

    def _shape_uncached(self, prompt_tokens: int, output_tokens: int, sequences: int,
                        cached: int, forks_share: bool) -> tuple[int, int, int]:
        """A request's peak blocks, its peak if every sequence ran to max_model_len, and
        the prompt tokens the server prefills for it (`cached` of them prefix hits)."""
        worst_output = max(output_tokens, self.max_model_len - prompt_tokens)
        return (self.peak_blocks(prompt_tokens, output_tokens, sequences,
                                 forks_share=forks_share),
                self.peak_blocks(prompt_tokens, worst_output, sequences,
                                 forks_share=forks_share),
                self.server_prefill_tokens(prompt_tokens, sequences, cached,
                                           forks_share=forks_share))

    def model_s(self, quantity: str, inputs: ModelInputs) -> float:
        """This model's own (p50 before the spread) TTFT ("ttft": the wait for the
        running requests' steps and the prefill) or TPOT ("tpot") of a request priced
        from `inputs`, the others' load included."""
        prefill, tpot, _ = self._model_s(inputs, self.prefill_s(
            inputs.prefilled_tokens, inputs.running, inputs.mean_context, inputs.cached_tokens,
            own_prefill_capped(inputs.batch - inputs.running)))
        return (prefill if quantity == "ttft" else tpot) * inputs.slowdown

    def _ahead(self, ahead: Sequence[int], own: int, running: int,
               sequences: int) -> tuple[int, int]:
        """The prompts ahead's tokens the server schedules before this request's first
        token, and (with a long-prefill threshold) the steps until then: `ModelInputs`'
        `ahead_tokens` and `ahead_steps`. Without a threshold, all of theirs first."""
        tokens = sum(max(0, a) for a in ahead)
        cap = self._prefill_chunk_tokens
        if not tokens or not cap:
            return tokens, 0
        budget = self._chunk_tokens(running, False)
        behind = prefill_behind(ahead, own, budget, cap, others=running > 0 or sequences > 1)
        return behind.tokens - own, behind.steps

    def _model_s(self, inputs: ModelInputs,
                 own_prefill_s: float) -> tuple[float, float, bool]:
        """The TTFT from the server's taking the request in (the running requests' steps
        it waits for, the prompts ahead, its own prefill) and the TPOT. With prompts
        ahead, the steps it waits for are theirs, in their prefill already: the TTFT is
        the longer of that prefill with theirs and its own after the steps in flight (a
        prompt ahead never makes a request's first token sooner). Theirs: all of their
        tokens, then its own, at the whole budget; with a long-prefill threshold, their
        chunks and its own side by side until its last (`ahead_steps`).
        `own_prefill_s`: `prefill_s` of its own inputs. The third value: whether the
        prefill with the prompts ahead set the TTFT."""
        own_s = self.pickup_s(inputs.running, inputs.mean_context) + own_prefill_s
        behind_s = 0.0
        if inputs.ahead_tokens:
            together = inputs.prefilled_tokens + inputs.ahead_tokens
            behind_s = self.prefill_in_steps_s(
                together, inputs.ahead_steps, inputs.running, inputs.mean_context,
                inputs.cached_tokens) if inputs.ahead_steps else self.prefill_s(
                together, inputs.running, inputs.mean_context, inputs.cached_tokens,
                capped=False)
        return (max(own_s, behind_s), self.tpot_s(inputs.batch, inputs.context_tokens),
                behind_s > own_s)

    def prefill_in_steps_s(self, prompt_tokens: int, steps: int, running: int = 0,
                           mean_context: int = 0, cached_tokens: int = 0) -> float:
        """Several prompts' `prompt_tokens` prefilled over `steps` steps
        (`ServedModel.prefill_in_steps`), the tokens rounded up to a bucket."""
        tokens = -(-max(1, prompt_tokens) // _PROMPT_BUCKET) * _PROMPT_BUCKET
        context = (mean_context // _CONTEXT_BUCKET) * _CONTEXT_BUCKET
        cached = (cached_tokens // _CONTEXT_BUCKET) * _CONTEXT_BUCKET
        return self._prefill_in_steps(tokens, max(1, steps), running, context, cached)

    def _prefill_in_steps_uncached(self, tokens: int, steps: int, running: int, context: int,
                                   cached: int) -> float:
        phase = self.served.prefill_in_steps(tokens, steps, (max(1, context),) * running,
                                             cached)
        return 0.0 if phase is None else phase.seconds

    def largest_output_that_fits(self, prompt_tokens: int, sequences: int, blocks: int, *,
                                 forks_share: bool = False) -> int:
        """The largest max_tokens whose reservation fits in `blocks` and max_model_len."""
        high = self.max_model_len - prompt_tokens
        if high <= 0 or self.peak_blocks(prompt_tokens, 1, sequences,
                                         forks_share=forks_share) > blocks:
            return 0
        low = 1
        while low < high:
            mid = (low + high + 1) // 2
            if self.peak_blocks(prompt_tokens, mid, sequences, forks_share=forks_share) <= blocks:
                low = mid
            else:
                high = mid - 1
        return low

    # ---- memoised latency ----------------------------------------------------------

    def prefill_work_s(self, prompt_tokens: int) -> float:
        """Engine time of one prompt's prefill alone (as `RequestCost.prefill_work_s`)."""
        return self._engine_work_s(self.prefill_s(prompt_tokens))

    def _engine_work_s(self, prefill_s: float) -> float:
        """A prefill's engine time: the API server's per-request work runs beside it."""
        return max(0.0, prefill_s - self.served.efficiency.per_request_s)

    def prefill_s(self, prompt_tokens: int, running: int = 0, mean_context: int = 0,
                  cached_tokens: int = 0, capped: bool | None = None) -> float:
        """Prefill of `prompt_tokens` new tokens after `cached_tokens` of prefix hits, in
        chunks of at most the server's long-prefill threshold where others are eligible
        (`capped`: `ServedModel.prefill_chunk_tokens`).

        Priced at the bucket boundaries either side and interpolated between them (exact
        below the first bucket and the first chunk): the fixed costs (per request, per
        step) stay whole at any length, where scaling one bucket's price by the share of
        it used would cut them too. Both ends take as many steps as the prompt (a bucket
        that a chunk boundary cuts is priced on the prompt's side of it), so each step's
        costs stay whole too."""
        context = (mean_context // _CONTEXT_BUCKET) * _CONTEXT_BUCKET
        cached = (cached_tokens // _CONTEXT_BUCKET) * _CONTEXT_BUCKET
        prompt = max(1, prompt_tokens)
        bucket = (prompt // _PROMPT_BUCKET) * _PROMPT_BUCKET
        chunk = self._chunk_tokens(running, capped)
        before = ((prompt - 1) // chunk) * chunk  # the tokens of the chunks before its last
        low = max(bucket, before + 1) if before else bucket
        if low == 0:
            return self._prefill(prompt, running, context, cached, capped)
        below = self._prefill(low, running, context, cached, capped)
        if low == prompt:
            return below
        high = min(bucket + _PROMPT_BUCKET, before + chunk)
        above = self._prefill(high, running, context, cached, capped)
        return below + (above - below) * (prompt - low) / (high - low)

    def pickup_s(self, running: int, mean_context: int) -> float:
        """What a request waits for the running requests' steps before its prefill
        (`ServedModel.pickup`)."""
        if running <= 0:
            return 0.0
        return self._pickup(running, max(1, (mean_context // _CONTEXT_BUCKET) * _CONTEXT_BUCKET))

    def tpot_s(self, batch: int, mean_context: int) -> float:
        context = max(1, (mean_context // _CONTEXT_BUCKET) * _CONTEXT_BUCKET)
        return self._tpot(max(1, batch), context)

    def _prefill_uncached(self, prompt: int, running: int, context: int, cached: int,
                          capped: bool | None) -> float:
        phase = self.served.prefill(prompt, (max(1, context),) * running, cached, capped)
        return 0.0 if phase is None else phase.seconds

    def _pickup_uncached(self, running: int, context: int) -> float:
        phase = self.served.pickup((context,) * running)
        return 0.0 if phase is None else phase.seconds

    def _tpot_uncached(self, batch: int, context: int) -> float:
        phase = self.served.tpot((context,) * batch)
        return 0.0 if phase is None else phase.seconds
