"""The admission controller: the one entry point of the admission core.

`await controller.admit(request)` returns a `Ticket` (the request may go to the
server) or raises `Rejected` with a `Decision`. The holder of a ticket calls
`ticket.finish()` when the response ends, however it ends; that releases the KV
reservation exactly once and lets queued requests in.

Decision at arrival, in order:
1. draining / server unavailable / capacity unknown -> reject;
2. a prompt that leaves no room for output within max_model_len (vLLM refuses it too),
   or a peak of more blocks than kvgate ever admits (capacity x target) ->
   `never_fits`, naming the largest max_tokens that fits. A max_tokens beyond the
   context left is reserved as vLLM serves it: clamped (0.32 and later; releases that
   refuse it answer the client themselves);
3. room in the KV cache now (`room`: with it, what the running requests hold stays
   within the target at every engine step ahead), room in the server's own queue
   limits (`server_queue`: vLLM's --max-num-queued-reqs / --max-num-queued-tokens, when
   set) and nobody of the same or a more important band waiting -> admit;
4. queue full -> `queue_full`; predicted TTFT (wait + prefill) beyond the request's
   target -> `deadline`; else wait in the queue, until admitted, timed out
   (`queue_timeout`, or `deadline` once it can no longer make its target) or
   abandoned by the client (`cancelled`). A waiting request is priced again when room
   frees for it (the prompts then ahead of it, the running set); one with a target is
   refused instead of admitted when that price misses it (`deadline`, or
   `queue_timeout` once it has waited the queue's maximum).
Every rejection for capacity carries a Retry-After computed from when running
requests are predicted to release enough KV (the same holdings over the steps ahead).

In shadow mode every request is admitted at once; the decision enforce mode would
have taken is reported to the listener instead.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Protocol, cast

from sidecar.admission.blockage import KV_CACHE, QueueBlockage
from sidecar.admission.cost import CostModel, RequestCost
from sidecar.admission.finished import RecentlyFinished
from sidecar.admission.forecast import (
    Forecast,
    Holding,
    RunningRequest,
    holdings_profile,
    kv_forecast,
)
from sidecar.admission.ledger import Ledger
from sidecar.admission.load import PrefillLoad, slowdown_at
from sidecar.admission.outcomes import Decision, Detail, Outcome, Rejected
from sidecar.admission.output_policy import LearnedQuantile, OutputReservation, WorstCase
from sidecar.admission.policies import (
    FAIRNESS,
    ORDERINGS,
    QueueLimits,
    StrictPriority,
)
from sidecar.admission.prefix import PrefixPlan
from sidecar.admission.queue import AdmissionQueue, Entry
from sidecar.admission.room import KVRoom, QueueWalk, RunningHoldings
from sidecar.admission.running import AdmissionRequest, RunningSet, Ticket
from sidecar.admission.server_queue import ServerQueueLimits
from sidecar.admission.sharing import PromptSharing
from sidecar.admission.step_clock import StepClock
from sidecar.admission.wait_ratio import WaitRatio

Clock = Callable[[], float]
# Up to this many running requests, the wait of a request nobody is queued ahead of is
# predicted as admission will answer it (O(n log^2 n)); beyond, from its peak.
_EXACT_WAIT_RUNNING = 64
# The prompt whose predicted prefill work converts the prefill load between models.
_LOAD_REFERENCE_TOKENS = 512


class Mode(StrEnum):
    ENFORCE = "enforce"
    SHADOW = "shadow"


@dataclass(frozen=True)
class AdmissionSettings:
    mode: Mode = Mode.ENFORCE
    kv_target_ratio: float = 0.95
    limits: QueueLimits = field(default_factory=QueueLimits)
    ordering: str = "fcfs"
    fairness: str = "cost"
    priority_bands: int = 3
    starvation_bound_s: float | None = 30.0
    output_policy: str = "worst-case"
    output_quantile: float = 0.9
    max_overcommit_ratio: float = 0.1
    retry_after_min_s: float = 1.0
    retry_after_max_s: float = 600.0
    unavailable_retry_after_s: float = 5.0
    server_limits: ServerQueueLimits = field(default_factory=ServerQueueLimits)
    # vLLM's --data-parallel-size: engines with a KV pool each (the ledger places every
    # request on one; the proxy pins it there).
    engines: int = 1

    def __post_init__(self) -> None:
        if self.ordering not in ORDERINGS:
            raise ValueError(f"ordering must be one of {', '.join(ORDERINGS)}")
        if self.fairness not in FAIRNESS:
            raise ValueError(f"fairness must be one of {', '.join(FAIRNESS)}")
        if self.output_policy not in ("worst-case", "quantile"):
            raise ValueError("output policy must be worst-case or quantile")
        if self.priority_bands < 1:
            raise ValueError("priority bands must be >= 1")
        if not 0.0 <= self.max_overcommit_ratio <= 1.0:
            raise ValueError("max overcommit ratio must be in [0, 1]")


@dataclass(frozen=True)
class ServerState:
    """What the upstream client last learned from the server."""

    available: bool = True
    num_blocks: int | None = None  # the server's pool, as vLLM reports it
    used_blocks: int | None = None
    running: int | None = None
    waiting: int | None = None
    # When the scrape behind these figures was sent (the controller's clock): they
    # describe the server at a moment after it.
    scraped_from_s: float | None = None


class DecisionListener(Protocol):
    def decided(self, decision: Decision, *, shadow: bool) -> None: ...

    def queue_wait(self, seconds: float) -> None: ...


class _NoListener:
    def decided(self, decision: Decision, *, shadow: bool) -> None:
        return None

    def queue_wait(self, seconds: float) -> None:
        return None


@dataclass
class _Waiter:
    future: asyncio.Future[Ticket | Decision]
    request: AdmissionRequest
    cost: RequestCost
    holding: Holding  # what it will hold once admitted (`KVRoom.queued`)
    # When the queue refuses it unless let in before (`AdmissionController._refused_at_s`).
    refused_at_s: float = math.inf
    # Set when room came for it too late to make its target: the wait it had.
    room_after_s: float | None = None


@dataclass(frozen=True)
class _QueueAhead:
    """The requests queued ahead of a newcomer, walked through the room in turn."""

    # None: room never comes (for one of them without a latest step, or for anyone
    # while the running requests alone exceed the target for good).
    walk: QueueWalk | None
    blocks: int  # their reserved peaks together
    clock: StepClock | None  # the steps ahead, with them let in as the walk lets them


class AdmissionController:
    def __init__(
        self,
        cost_model: CostModel,
        settings: AdmissionSettings | None = None,
        *,
        clock: Clock = time.monotonic,
        listener: DecisionListener | None = None,
    ) -> None:
        self.settings = settings or AdmissionSettings()
        self.cost_model = cost_model
        self.clock = clock
        self.listener: DecisionListener = listener or _NoListener()
        self.server = ServerState()
        model_capacity = cost_model.served.capacity
        self._model_capacity = model_capacity.usable_blocks if model_capacity else None
        self.ledger = Ledger(self._model_capacity or 0, self.settings.kv_target_ratio,
                             engines=self.settings.engines)
        self.queue = AdmissionQueue(
            ORDERINGS[self.settings.ordering](),
            FAIRNESS[self.settings.fairness](),
            StrictPriority(self.settings.starvation_bound_s),
        )
        self.output_policy: OutputReservation = (
            LearnedQuantile(self.settings.output_quantile)
            if self.settings.output_policy == "quantile"
            else WorstCase()
        )
        self._outputs = LearnedQuantile(0.5, min_samples=20)
        self._keys = itertools.count(1)
        self._running = RunningSet()
        self._recently_finished = RecentlyFinished(self.settings.engines)
        self.prefill_load = PrefillLoad()
        # How long the last admitted request was predicted to hold its KV: when nothing
        # kvgate admitted is running but the server's observed use leaves no room, the
        # cache still turns over at about that rate.
        self._last_duration_s = 0.0
        self.wait_ratio = WaitRatio()
        self._draining = False
        self._drain_deadline_s: float | None = None
        deployment = cost_model.served.deployment
        self.sharing = PromptSharing(self.ledger, cost_model.served.layout,
                                     deployment.drops_last_prefix_hit,
                                     deployment.long_prefill_token_threshold)
        self.room = KVRoom(self.ledger, cost_model)
        self._room_cache: tuple[int, float, RunningHoldings] | None = None
        # What the queue waits on (its head's limit), and how long it has on each.
        self.blockage = QueueBlockage(clock())
        self._arrival_limit: str | None = None  # `_decide_at_arrival`'s, for `blockage`
        # The last walk of the queue (`_queue_ahead`): what it was computed from.
        self._walk_memo: tuple[tuple[int, int, str, int, tuple[float, int]],
                               RunningHoldings, _QueueAhead | None] | None = None
        # The running requests' step clock (`_running_clock`): whose holdings it is of.
        self._clock_memo: tuple[RunningHoldings, StepClock] | None = None

    # ---- prefix caching ---------------------------------------------------------------

    @property
    def prefix_source(self) -> str:
        """events | traffic | off: where the view of the server's cache comes from."""
        return self.sharing.source

    def prompt_keys(self, token_ids: list[int] | tuple[int, ...],
                    salt: bytes = b"") -> tuple[bytes, ...]:
        """Keys of a prompt's full blocks, or () when the server shares none."""
        return self.sharing.keys(token_ids, salt)

    def _plan(self, request: AdmissionRequest) -> PrefixPlan:
        return self.sharing.plan(request.block_keys, request.prompt_tokens, request.sequences)

    # ---- configuration from the outside ----------------------------------------------

    @property
    def capacity_blocks(self) -> int | None:
        """Usable KV blocks: the server's own figure when known, else the model's."""
        if self.server.num_blocks is not None:
            return max(0, self.server.num_blocks - 1)
        return self._model_capacity

    def update_server(self, state: ServerState) -> None:
        self.server = state
        capacity = self.capacity_blocks
        if capacity is not None and capacity != self.ledger.capacity_blocks:
            self.ledger.set_capacity(capacity)
        # The server's figure may still count requests kvgate saw finish since the
        # scrape was sent: as many as it reports beyond those kvgate runs.
        counted = _server_requests(state)
        finished = self._recently_finished.since(
            state.scraped_from_s, self.clock(),
            None if counted is None else max(0, counted - len(self._running)))
        self.ledger.observe(state.used_blocks, self._growth_blocks(), finished)
        self.room.observe(state.used_blocks, list(self._running), self._server_progress,
                          self.clock(), sum(finished))
        self._room_cache = None
        if not state.available:
            # Nothing can be sent until the server is back: tell the waiting clients now.
            for entry in list(self.queue.entries()):
                self.queue.remove(entry)
                self._resolve(entry, Decision(
                    Outcome.UNAVAILABLE, "the model server became unavailable while the "
                    "request was queued", self.settings.unavailable_retry_after_s))
        self._dispatch()

    def set_cost_model(self, cost_model: CostModel) -> None:
        """A recalibrated or re-learned model (e.g. the server came back different).
        The prefill load admitted so far was measured in the old model's seconds: it is
        rescaled to the new one's, so that a prior that was far off does not keep
        stretching (or shrinking) predictions through the load for its time constant."""
        before = self.cost_model.prefill_work_s(_LOAD_REFERENCE_TOKENS)
        after = cost_model.prefill_work_s(_LOAD_REFERENCE_TOKENS)
        if before > 0 and after > 0:
            self.prefill_load.rescale(after / before)
        self.cost_model = cost_model
        capacity = cost_model.served.capacity
        self._model_capacity = capacity.usable_blocks if capacity else None
        deployment = cost_model.served.deployment
        self.sharing.set_layout(cost_model.served.layout, deployment.drops_last_prefix_hit,
                                deployment.long_prefill_token_threshold)
        self.room.set_cost_model(cost_model)
        # Waits priced with the old model are not kept (nor the holdings they are of).
        self._clock_memo = self._walk_memo = self._room_cache = None
        self.update_server(self.server)

    def set_prefix_caching(self, enabled: bool) -> None:
        """Whether the server shares prompt blocks (vLLM's --enable-prefix-caching):
        between requests with a common prefix, and between the sequences one request
        forks (n), for the requests that arrive from now on."""
        self.sharing.set_enabled(enabled)

    def drain(self, timeout_s: float) -> None:
        """Stop admitting: new requests and waiting ones are refused."""
        self._draining = True
        self._drain_deadline_s = self.clock() + timeout_s
        for entry in list(self.queue.entries()):
            self.queue.remove(entry)
            self._resolve(entry, self._draining_decision())
        self.blockage.set(None, self.clock())

    @property
    def draining(self) -> bool:
        return self._draining

    # ---- the decision ------------------------------------------------------------------

    async def admit(self, request: AdmissionRequest) -> Ticket:
        now = self.clock()
        if request.forks_share and not self.sharing.enabled:
            # Decided once: the reservation and its re-pricing as it runs keep to it.
            request = replace(request, forks_share=False)
        # What it shares, looked up once: nothing changes until it starts or waits.
        plan = self._plan(request)
        cost, decision = self._decide_at_arrival(request, now, plan)
        if self.settings.mode is Mode.SHADOW:
            return self._admit_shadow(request, cost, decision, now, plan)
        if decision is not None and decision.outcome is not Outcome.QUEUED:
            self._report(decision)
            raise Rejected(decision)
        assert cost is not None
        if decision is None:
            ticket = self._start(request, cost, now, queue_wait_s=0.0,
                                 predicted_ttft_s=cost.prefill_s, plan=plan)
            self._report(self._admitted_decision(ticket))
            return ticket
        return await self._wait_in_queue(request, cost, now, decision)

    def _decide_at_arrival(
        self, request: AdmissionRequest, now: float, plan: PrefixPlan
    ) -> tuple[RequestCost | None, Decision | None]:
        """(cost, None) to admit now; (cost, QUEUED decision) to wait; else a rejection."""
        if self._draining:
            return None, self._draining_decision()
        capacity = self.capacity_blocks
        if not self.server.available or capacity is None:
            reason = ("the model server is unavailable" if not self.server.available
                      else "the KV cache capacity is not known yet")
            return None, Decision(Outcome.UNAVAILABLE, reason,
                                  self.settings.unavailable_retry_after_s)
        cost = self._cost(request, plan)
        never = self._never_fits(request, cost) or self._never_admitted_upstream(request, cost)
        if never is not None:
            return cost, never
        band = min(max(request.band, 0), self.settings.priority_bands - 1)
        ahead = self.queue.waiting_ahead_of(band, now)
        limit = self._server_refusal(request)
        fits = self._fits_now(request, cost, plan) if ahead == 0 or limit is not None else False
        if ahead == 0 and fits and limit is None:
            return cost, None
        blocked_by = (f"the KV cache has no room for {cost.kv_blocks} more blocks now"
                      if limit is None or not fits
                      else f"{self.settings.server_limits.describe(limit)} is reached")
        model_wait_s = self._kv_wait_s(request, cost, band, plan)
        wait_s = max(self.wait_ratio.scaled(model_wait_s), self._server_wait_s(request, band, now))
        # An infinite wait is an unknown one: nothing kvgate admitted is running to free
        # blocks, the room is taken by use the server reports (traffic that bypasses
        # kvgate, or a scrape from just before it finished). Such a request waits in the
        # queue for the next scrape; only its actual wait can time it out.
        known = math.isfinite(wait_s)
        predicted_ttft = wait_s + cost.prefill_s
        details = self._details(cost, predicted_ttft_s=predicted_ttft, queue_ahead=ahead)
        if known and math.isfinite(model_wait_s) and limit is None:
            details.update(predicted_wait_s=round(wait_s, 6), model_wait_s=round(model_wait_s, 6))
        if not self.settings.limits.has_room(len(self.queue)):
            return cost, Decision(
                Outcome.QUEUE_FULL,
                f"the queue is full ({len(self.queue)} waiting) and {blocked_by}",
                self._retry_after(wait_s),
                details,
            )
        # Deadlines are judged on the quantile the operator chose (--deadline-quantile).
        deadline_ttft = wait_s + cost.deadline_prefill_s
        if known and request.ttft_slo_s is not None and deadline_ttft > request.ttft_slo_s:
            return cost, Decision(
                Outcome.DEADLINE,
                f"predicted time to first token {deadline_ttft:.2f} s exceeds the requested "
                f"{request.ttft_slo_s:.2f} s ({ahead} requests waiting ahead; {blocked_by})",
                self._retry_after(max(0.0, deadline_ttft - request.ttft_slo_s)),
                details,
            )
        if known and wait_s > self.settings.limits.max_wait_s:
            return cost, Decision(
                Outcome.QUEUE_TIMEOUT,
                f"predicted wait {wait_s:.1f} s exceeds the queue's maximum wait of "
                f"{self.settings.limits.max_wait_s:g} s",
                self._retry_after(wait_s - self.settings.limits.max_wait_s),
                details,
            )
        waiting_for = ("KV headroom" if limit is None
                       else f"room in {self.settings.server_limits.describe(limit)}")
        # With nothing ahead of it, what it waits on at the head of the queue (`blockage`).
        self._arrival_limit = (KV_CACHE if not fits else limit) if ahead == 0 else None
        return cost, Decision(Outcome.QUEUED, f"waiting for {waiting_for}", None, details)

    def _cost(self, request: AdmissionRequest, plan: PrefixPlan) -> RequestCost:
        output = self.output_policy.reserve(
            request.prompt_tokens, request.max_tokens, self.cost_model.max_model_len,
            request.tenant,
        )
        # vLLM clamps max_tokens to the context left (see `_never_fits`).
        output = min(output, max(0, self.cost_model.max_model_len - request.prompt_tokens))
        now = self.clock()
        shared = self.sharing.shared_blocks(plan)
        cost = self._price(request, output, plan, shared, now)
        # The learned policy leaves part of the worst case unreserved; bound the total.
        unreserved = cost.worst_case_blocks - cost.kv_blocks
        if unreserved > 0 and request.max_tokens is None:
            allowed = self.settings.max_overcommit_ratio * self.ledger.capacity_blocks
            if self.ledger.overcommit_blocks + unreserved > allowed:
                worst = self.cost_model.max_model_len - request.prompt_tokens
                cost = self._price(request, max(worst, 0), plan, shared, now)
        return cost

    def _price(self, request: AdmissionRequest, output_tokens: int, plan: PrefixPlan,
               shared: int, now: float) -> RequestCost:
        """The request's cost if it started now: beside the running requests, after the
        prompts ahead of it, under the recent prefill load."""
        running = len(self._running)
        return self.cost_model.cost(
            request.prompt_tokens, output_tokens, request.sequences, running,
            self._mean_context(), self.prefill_load.slowdown(now, running),
            shared_blocks=shared, cached_tokens=plan.cached_tokens,
            ahead=self._running.prefill_ahead(now), forks_share=request.forks_share,
        )

    def _never_fits(self, request: AdmissionRequest, cost: RequestCost) -> Decision | None:
        max_len = self.cost_model.max_model_len
        target = self.ledger.target_blocks
        # vLLM refuses a prompt that leaves no room for output; a longer max_tokens it
        # clamps to the context left (0.32 and later) or refuses itself (older).
        too_long = request.prompt_tokens >= max_len
        too_big = cost.kv_blocks + cost.shared_blocks > target
        if not (too_long or too_big):
            return None
        largest = min(
            max_len - request.prompt_tokens,
            self.cost_model.largest_output_that_fits(request.prompt_tokens, request.sequences,
                                                     target, forks_share=request.forks_share),
        )
        largest = max(0, largest)
        if too_long:
            what = (f"prompt ({request.prompt_tokens} tokens) leaves no room for output within "
                    f"the model's max_model_len ({max_len})")
        else:
            clamped = (f" (max_tokens {request.max_tokens} clamped to the context left, as "
                       "vLLM clamps it)" if request.max_tokens is not None
                       and request.max_tokens > cost.output_tokens else "")
            fork_shared = self.cost_model.fork_shared_blocks(
                request.prompt_tokens, request.sequences, forks_share=request.forks_share)
            once = (f" ({fork_shared} fewer than apart: the forks share prompt blocks)"
                    if fork_shared else "")
            what = (f"{request.sequences} x ({request.prompt_tokens} prompt + "
                    f"{cost.output_tokens} output) tokens{clamped} need "
                    f"{cost.kv_blocks + cost.shared_blocks} KV blocks at their peak{once}, "
                    f"more than the {target} blocks the whole cache can give one request")
        hint = (f"; the largest max_tokens that fits is {largest}" if largest > 0 else
                "; the prompt alone does not fit")
        return Decision(
            Outcome.NEVER_FITS,
            what + hint,
            None,
            self._details(cost, largest_max_tokens=largest, max_model_len=max_len),
        )

    def _fits_now(self, request: AdmissionRequest, cost: RequestCost,
                  plan: PrefixPlan | None = None) -> bool:
        """Whether the KV cache has room for `request` now: with the peaks of every
        running request added up (the quick answer), or else at every engine step ahead
        as the running requests grow and finish (`room`)."""
        if not self.server.available:
            return False
        if plan is None:
            plan = self._plan(request)
        charge = self._charge(plan, cost)
        if self.ledger.engines > 1:
            # Data parallelism: one pool per engine, each request placed on one of them
            # by its peak (`ledger.place`); the holdings over time assume one pool.
            own = self.sharing.own_blocks(cost.kv_blocks + cost.shared_blocks, plan)
            return self.ledger.place(own, plan.keys) is not None
        target = self.ledger.target_blocks
        if self.ledger.reserved_blocks + self.room.untracked_blocks + charge <= target:
            return True
        running = self.room.running(list(self._running), self._server_progress,
                                    self.clock())
        return self.room.fits(running, request, cost, plan, target)

    def _running_holdings(self, now: float) -> RunningHoldings:
        """The running requests' holdings for predicted waits (rebuilt when requests
        come or go, and at least every 20 ms)."""
        cached = self._room_cache
        if cached is None or cached[0] != self.room.version or now - cached[1] > 0.02:
            cached = (self.room.version, now,
                      self.room.running(list(self._running), self._server_progress, now))
            self._room_cache = cached
        return cached[2]

    def _step_pricer(self, now: float) -> Callable[[int], float]:
        """The predicted time of one engine step of a batch of requests, now: at the
        running requests' mean context and the recent prefill load, for at most the
        server's --max-num-seqs (when told: the rest wait in its queue)."""
        context = self._mean_context()
        utilisation = self.prefill_load.utilisation(now)
        most = self.settings.server_limits.max_running
        tpot_s = self.cost_model.tpot_s

        def step_s(batch: int) -> float:
            batch = max(1, batch if most is None else min(batch, most))
            return tpot_s(batch, context) * slowdown_at(utilisation, batch - 1)

        return step_s

    def _step_clock(self, now: float, spans: Iterable[tuple[int, int]]) -> StepClock:
        """When each engine step ahead starts, each as long as a step of the batch then
        (`spans`: when each request runs, `StepClock`)."""
        return StepClock(spans, self._step_pricer(now))

    def _holdings_clock(self, now: float, running: RunningHoldings,
                        admitted: Sequence[tuple[int, int]] = ()) -> StepClock:
        """`_step_clock` of the running requests until the last step of their reserved
        output, plus `admitted` (requests queued ahead, from the step they are let in:
        `QueueWalk.spans`)."""
        return self._step_clock(now, [*((0, h.end_steps) for h in running.holdings),
                                      *admitted])

    def _running_clock(self, now: float, running: RunningHoldings) -> StepClock:
        """`_step_clock` of the running requests alone, kept with their holdings."""
        memo = self._clock_memo
        if memo is None or memo[0] is not running:
            memo = self._clock_memo = (running, self._holdings_clock(now, running))
        return memo[1]

    def _kv_wait_s(self, request: AdmissionRequest, cost: RequestCost, band: int,
                   plan: PrefixPlan | None = None) -> float:
        """Predicted time until the KV cache has room for `request`.

        Nobody queued ahead of it (as the queue's policies will order it: priority
        bands, fairness between tenants): the steps until the running requests'
        holdings leave it room for good, at the predicted time per step (the answer
        admission gives). Requests queued ahead: they do not wait for room all at
        once; each is admitted in turn as room frees over its own steps, holding its
        peak until its last step, and this request after them; one the queue will
        refuse before room comes for it holds nothing (`QueueWalk`)."""
        now = self.clock()
        running = self._running_holdings(now)
        target = self.ledger.target_blocks
        deadline = None if request.ttft_slo_s is None else now + request.ttft_slo_s
        ahead = self._queue_ahead(now, running, band, request.tenant, target,
                                  self.queue.newcomer_key(deadline))
        if plan is None:
            plan = self._plan(request)
        charge = self._charge(plan, cost)
        clock = None
        if ahead is None:
            if len(running.tickets) <= _EXACT_WAIT_RUNNING:
                steps = self.room.steps_until_fits(running, request, cost, plan, target)
            else:
                steps = self.room.steps_until_room(running, charge, target)
        else:
            steps = math.inf if ahead.walk is None else ahead.walk.copy().steps_until_admitted(
                self.room.queued(request, cost), target)
            charge += ahead.blocks
            clock = ahead.clock
        if steps <= 0:
            return 0.0
        if math.isfinite(steps):
            return (clock or self._running_clock(now, running)).seconds_until(steps)
        return self._unexplained_wait_s(running, charge, now)

    def _queue_ahead(self, now: float, running: RunningHoldings, band: int, tenant: str,
                     target: int, order: tuple[float, int]) -> _QueueAhead | None:
        """The requests queued ahead of a newcomer of `tenant` in `band` with the
        ordering key `order`, walked through the room in turn (`QueueWalk`); None when
        nobody is. Walked again only when the queue, the running requests' holdings or
        the target changed: a full queue refuses arrivals (each priced for its
        Retry-After) without walking it for every one."""
        key = (self.queue.version, band, tenant, target, order)
        memo = self._walk_memo
        if memo is not None and memo[0] == key and memo[1] is running:
            return memo[2]
        queued = [waiter for entry in self.queue.ahead_of(band, tenant, order)
                  if isinstance(waiter := entry.payload, _Waiter)]
        ahead: _QueueAhead | None = None
        if queued:
            walk = QueueWalk(running.profile)
            fits = walk.admit_all([waiter.holding for waiter in queued], target,
                                  self._latest_steps(now, running, queued))
            ahead = _QueueAhead(walk if fits else None,
                                sum(waiter.cost.kv_blocks for waiter in queued),
                                self._holdings_clock(now, running, walk.spans) if fits
                                else None)
        self._walk_memo = (key, running, ahead)
        return ahead

    def _refused_at_s(self, request: AdmissionRequest, cost: RequestCost,
                      now: float) -> float:
        """When the queue refuses `request`, queued at `now`, unless let in before: its
        TTFT target less its prefill (`deadline`), or the queue's maximum wait
        (`queue_timeout`)."""
        until = now + self.settings.limits.max_wait_s
        if request.ttft_slo_s is not None:
            until = min(until, now + request.ttft_slo_s - cost.deadline_prefill_s)
        return until

    def _latest_steps(self, now: float, running: RunningHoldings,
                      queued: Sequence[_Waiter]) -> list[float]:
        """The last engine step each queued request can be let in at before the queue
        refuses it (`_refused_at_s`), on the model's clock: the wait ratio scales the
        model's waits into the waits requests have. Counted at the steps of the running
        requests alone: requests let in meanwhile slow the steps, so it may come
        sooner, never later (one refused sooner only shortens the wait behind it)."""
        factor = self.wait_ratio.factor
        steps = self._running_clock(now, running).steps_at(
            [(waiter.refused_at_s - now) / factor for waiter in queued])
        # One whose time has passed is being refused (its timer is due): -1, before any
        # step it could be let in at.
        return [step if step > 0 else -1.0 for step in steps]

    def _unexplained_wait_s(self, running: RunningHoldings, blocks: float,
                            now: float) -> float:
        """The wait when the blocks held throughout (use the server reports that kvgate
        did not admit) leave no room even once the running requests end: past the last
        of them, the cache's turnover at the last known request duration (inf: none
        known yet, the request waits for the next scrape)."""
        duration = running.mean_duration_s if running.tickets else self._last_duration_s
        if duration <= 0:
            return math.inf
        last_s = self._running_clock(now, running).seconds_until(
            max((h.end_steps for h in running.holdings), default=0))
        excess = running.base_blocks + blocks - self.ledger.target_blocks
        return last_s + max(0.0, excess) * duration / max(1, self.ledger.capacity_blocks)

    # ---- the server's own limits: its queue limits (vLLM's admission), --max-num-seqs --

    def server_queue(self) -> tuple[int, int]:
        """(sequences, prompt tokens in prefill) of the requests kvgate forwarded that the
        server still counts against its queue limits and its --max-num-seqs
        (`server_queue` module)."""
        sequences = prefill_tokens = 0
        for ticket in self._running:
            sequences += ticket.request.sequences
            if ticket.first_token_s is None:
                prefill_tokens += ticket.request.prompt_tokens * ticket.request.sequences
        return sequences, prefill_tokens

    def _server_refusal(self, request: AdmissionRequest) -> str | None:
        """The server's limit that holds `request` back now (one it would be refused
        under, or its --max-num-seqs), or None."""
        limits = self.settings.server_limits
        if not limits.active:
            return None
        sequences, prefill_tokens = self.server_queue()
        return limits.holding_back(sequences, prefill_tokens, request.sequences)

    def _never_admitted_upstream(self, request: AdmissionRequest,
                                 cost: RequestCost) -> Decision | None:
        limits = self.settings.server_limits
        reason = limits.never_admits(request.sequences)
        if reason is None:
            return None
        return Decision(
            Outcome.NEVER_FITS,
            f"{request.sequences} sequences (n x prompts) are more than "
            f"{limits.describe(reason)} lets in at once: the server refuses the request "
            "however idle it is",
            None,
            self._details(cost, server_limit=reason),
        )

    def _server_wait_s(self, request: AdmissionRequest, band: int, now: float) -> float:
        """Predicted time until the server's limits take `request` (arriving at `now` in
        `band`) behind the requests waiting before it (in the queue's order, as
        `_kv_wait_s` walks them): the sequences the server counts at once
        (`--max-num-queued-reqs`, `--max-num-seqs`) free as running requests finish and
        the ones ahead, let in as seats free, finish in turn (`_seat_wait_s`); prompts
        prefill (`--max-num-queued-tokens`). 0 without limits, inf when unknown."""
        limits = self.settings.server_limits
        if not limits.active:
            return 0.0
        tickets = list(self._running)
        wait_s = 0.0
        if limits.max_requests is not None or limits.max_running is not None:
            finishes = [(view.finish_in_s, ticket.request.sequences)
                        for ticket, view in zip(tickets, self.running_requests(), strict=True)]
            deadline = None if request.ttft_slo_s is None else now + request.ttft_slo_s
            queued = [(waiter.request.sequences, waiter.cost.prefill_s + waiter.cost.decode_s)
                      for entry in self.queue.ahead_of(band, request.tenant,
                                                       self.queue.newcomer_key(deadline))
                      if isinstance(waiter := entry.payload, _Waiter)]
            if limits.max_requests is not None:
                wait_s = _seat_wait_s(finishes, queued, request.sequences,
                                      limits.max_requests, clamp=False)
            if limits.max_running is not None:
                wait_s = max(wait_s, _seat_wait_s(finishes, queued, request.sequences,
                                                  limits.max_running, clamp=True))
        if limits.max_prefill_tokens is not None:
            _, prefill_tokens = self.server_queue()
            prefills = sorted(
                (max(0.0, t.admitted_s + t.cost.prefill_s - now),
                 t.request.prompt_tokens * t.request.sequences)
                for t in tickets if t.first_token_s is None)
            excess = prefill_tokens - limits.max_prefill_tokens + 1
            wait_s = max(wait_s, _time_until(prefills, excess))
        return wait_s

    # ---- waiting -------------------------------------------------------------------------

    async def _wait_in_queue(
        self, request: AdmissionRequest, cost: RequestCost, now: float, queued: Decision
    ) -> Ticket:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Ticket | Decision] = loop.create_future()
        band = min(max(request.band, 0), self.settings.priority_bands - 1)
        deadline = None if request.ttft_slo_s is None else now + request.ttft_slo_s
        entry = self.queue.push(Entry(
            arrival_s=now,
            band=band,
            tenant=request.tenant,
            blocks=cost.kv_blocks,
            cost=cost.gpu_seconds(self.ledger.capacity_blocks),
            deadline_s=deadline,
            payload=_Waiter(future, request, cost, self.room.queued(request, cost),
                            self._refused_at_s(request, cost, now)),
        ))
        if self.queue.peek(now) is entry:  # a request behind the head changes nothing
            self.blockage.set(self._arrival_limit or self._queue_limit(now), now)
        timeout = max(0.0, cast(_Waiter, entry.payload).refused_at_s - now)
        try:
            result = await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            if future.done():
                result = future.result()
            else:
                left = self.queue.remove(entry)
                result = self._timed_out(request, cost, entry, deadline)
                future.set_result(result)
                if left:
                    self._dispatch()  # it may have been the head that did not fit
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                outcome = future.result()
                if isinstance(outcome, Ticket):
                    outcome.finish(completed=False)
            else:
                left = self.queue.remove(entry)
                future.cancel()
                if left:
                    self._dispatch()  # it may have been the head that did not fit
            self._report(Decision(Outcome.CANCELLED, "the client went away while queued",
                                  None, queued.details))
            self.listener.queue_wait(self.clock() - entry.arrival_s)
            raise
        model_wait_s = queued.details.get("model_wait_s")
        if isinstance(result, Decision):
            # Refused after waiting (its target or the queue's maximum wait): a wait too,
            # the longest ones when the server stalls.
            self.listener.queue_wait(self.clock() - entry.arrival_s)
            # Room came too late for it: that wait is as much a measure of the model's
            # waits as an admitted request's.
            waited_s = cast(_Waiter, entry.payload).room_after_s
            if isinstance(model_wait_s, float) and waited_s is not None:
                self.wait_ratio.observe(model_wait_s, waited_s)
            self._report(result)
            raise Rejected(result)
        self.listener.queue_wait(result.queue_wait_s)
        if isinstance(model_wait_s, float):
            self.wait_ratio.observe(model_wait_s, result.queue_wait_s)
        self._report(self._admitted_decision(result))
        return result

    def _timed_out(
        self, request: AdmissionRequest, cost: RequestCost, entry: Entry, deadline: float | None
    ) -> Decision:
        now = self.clock()
        waited = now - entry.arrival_s
        limit = self._server_refusal(request)
        wait_s = self.wait_ratio.scaled(self._kv_wait_s(request, cost, entry.band))
        if limit is not None:
            wait_s = max(wait_s, self._server_wait_s(request, entry.band, now))
        retry = self._retry_after(wait_s)
        details = self._details(cost, waited_s=round(waited, 3))
        if deadline is not None and now + cost.deadline_prefill_s >= deadline - 1e-9 and (
            waited < self.settings.limits.max_wait_s
        ):
            return Decision(
                Outcome.DEADLINE,
                f"still queued after {waited:.2f} s: the first token can no longer arrive "
                f"within the requested {request.ttft_slo_s:.2f} s",
                retry,
                details,
            )
        return Decision(
            Outcome.QUEUE_TIMEOUT,
            f"waited {waited:.1f} s in the queue (maximum {self.settings.limits.max_wait_s:g} s) "
            + ("without KV headroom" if limit is None
               else f"for room in {self.settings.server_limits.describe(limit)}"),
            retry,
            details,
        )

    def _dispatch(self) -> None:
        """Admit waiting requests, in policy order, while the head fits; a head that
        fits too late to make its TTFT target is refused instead."""
        if self.settings.mode is Mode.SHADOW or self._draining or not self.server.available:
            self.blockage.set(None, self.clock())  # nothing waits on a limit then
            return
        while len(self.queue):
            now = self.clock()
            entry = self.queue.peek(now)
            if entry is None:
                break
            head = cast(_Waiter, entry.payload)
            # What the head shares is looked up now: it may have changed while it waited.
            plan = self._plan(head.request)
            limit = self._head_limit(head, plan)
            if limit is not None:
                self.blockage.set(limit, now)
                return
            # Priced as it would start now: the prompts ahead and the running set
            # changed while it waited (a wave of requests let in together prefill in turn).
            cost = self._priced_now(head.request, head.cost, plan, now, waited=True)
            if entry.deadline_s is not None and now + cost.deadline_prefill_s > entry.deadline_s:
                # It can no longer make its target: the prompts now ahead of it push its
                # first token past it, or its timer (run late by a busy loop) has not
                # refused it yet. The room goes to the next one, not to a miss.
                head.room_after_s = now - entry.arrival_s
                self.queue.remove(entry)
                self._resolve(entry, self._timed_out(head.request, cost, entry,
                                                     entry.deadline_s))
                continue
            popped = self.queue.pop(now)
            assert popped is entry
            if head.future.done():
                continue
            waited = now - entry.arrival_s
            ticket = self._start(head.request, cost, now, queue_wait_s=waited,
                                 predicted_ttft_s=waited + cost.prefill_s, plan=plan,
                                 priced=True)
            head.future.set_result(ticket)
        self.blockage.set(None, self.clock())

    def _queue_limit(self, now: float) -> str | None:
        """The limit the queue's head waits on at `now` (`blockage`): None when the
        queue is empty or its head can go."""
        if (not len(self.queue) or self.settings.mode is Mode.SHADOW or self._draining
                or not self.server.available):
            return None
        entry = self.queue.peek(now)
        if entry is None:
            return None
        head = cast(_Waiter, entry.payload)
        return self._head_limit(head, self._plan(head.request))

    def _head_limit(self, head: _Waiter, plan: PrefixPlan) -> str | None:
        """What keeps the queue's head out now: the KV cache, a server limit, or None."""
        if not self._fits_now(head.request, head.cost, plan):
            return KV_CACHE
        return self._server_refusal(head.request)

    def _resolve(self, entry: Entry, decision: Decision) -> None:
        waiter = cast(_Waiter, entry.payload)
        if not waiter.future.done():
            waiter.future.set_result(decision)

    # ---- admitted requests ---------------------------------------------------------------

    def _start(
        self,
        request: AdmissionRequest,
        cost: RequestCost,
        now: float,
        *,
        queue_wait_s: float,
        predicted_ttft_s: float,
        shadow_outcome: Outcome | None = None,
        plan: PrefixPlan | None = None,
        priced: bool = False,
    ) -> Ticket:
        """Admit now. `plan`: what it shares, when looked up in this same step (a
        request that waited looks it up again); `priced`: `cost` is its price now."""
        if plan is None:
            plan = self._plan(request)
        if not priced:
            repriced = self._priced_now(request, cost, plan, now, waited=queue_wait_s > 0)
            if repriced is not cost:
                cost = repriced
                predicted_ttft_s = queue_wait_s + cost.prefill_s
        peak = cost.kv_blocks + cost.shared_blocks
        own = self.sharing.own_blocks(peak, plan)
        unreserved = max(0, cost.worst_case_blocks - cost.kv_blocks)
        reservation = self.ledger.reserve(own, own + unreserved, plan.keys)
        self.sharing.admitted(plan, request.block_keys, request.prompt_tokens, cost.kv_blocks,
                              now)
        ticket = Ticket(self, next(self._keys), request, cost, reservation, now, queue_wait_s,
                        predicted_ttft_s, shadow_outcome, plan)
        self._running.add(ticket)
        self.room.admitted(ticket)
        self._last_duration_s = cost.prefill_s + cost.decode_s
        self.prefill_load.add(now, cost.prefill_work_s)
        self._room_cache = None
        return ticket

    def _priced_now(self, request: AdmissionRequest, cost: RequestCost, plan: PrefixPlan,
                    now: float, *, waited: bool) -> RequestCost:
        """`cost` as the request would start now: repriced when it waited (the prompts
        ahead of it and the running set changed) or when what it shares changed (a
        holder filled its blocks); `cost` itself otherwise."""
        shared = self.sharing.shared_blocks(plan)
        if not waited and shared == cost.shared_blocks \
                and plan.cached_tokens == cost.cached_tokens:
            return cost
        peak = cost.kv_blocks + cost.shared_blocks
        unreserved = max(0, cost.worst_case_blocks - cost.kv_blocks)
        return replace(self._price(request, cost.output_tokens, plan, shared, now),
                       worst_case_blocks=peak - shared + unreserved)

    def _charge(self, plan: PrefixPlan, cost: RequestCost) -> int:
        """Blocks admitting a request of this prefix plan and cost would add to the
        ledger now."""
        return cost.kv_blocks + cost.shared_blocks - self.sharing.shared_blocks(plan)

    def _grow(self, ticket: Ticket) -> None:
        request = ticket.request
        peak = self.cost_model.peak_blocks(request.prompt_tokens, ticket.output_tokens + 1,
                                           request.sequences, ticket.output_tokens,
                                           forks_share=request.forks_share)
        blocks = self.sharing.own_blocks(peak, ticket.plan)
        if blocks > ticket.reservation.blocks:
            ticket.reservation.resize(blocks)
            ticket.cost = replace(ticket.cost, output_tokens=ticket.output_tokens,
                                  kv_blocks=peak - ticket.cost.shared_blocks)
            self._room_cache = None

    def _shrink(self, ticket: Ticket) -> None:
        """Past the prefill, a request on a model with sliding windows holds less than
        at its prefill peak: keep only the peak still ahead of it."""
        ticket.past_prefill_peak = True
        if not self.cost_model.served.layout.recycles_blocks:
            return
        request = ticket.request
        peak = self.cost_model.peak_blocks(request.prompt_tokens, ticket.cost.output_tokens,
                                           request.sequences, ticket.output_tokens,
                                           forks_share=request.forks_share)
        blocks = self.sharing.own_blocks(peak, ticket.plan)
        if blocks < ticket.reservation.blocks:
            ticket.reservation.resize(blocks)
            self._room_cache = None
            self._dispatch()

    def _prefilled(self, ticket: Ticket) -> None:
        """Its first token came: the server has filled (and cached) its prompt blocks."""
        self._running.prefilled(ticket)
        shared = self.sharing.prefilled(ticket.reservation)
        if shared or self.settings.server_limits.max_prefill_tokens is not None:
            self._dispatch()

    def _progressed(self, ticket: Ticket, added_tokens: int) -> None:
        self._running.progressed(ticket, added_tokens)

    def _finished(self, ticket: Ticket, completed: bool) -> None:
        self._running.remove(ticket)
        self.sharing.release(ticket.reservation)
        now = self.clock()
        self._recently_finished.add(now, self._last_blocks(ticket, now),
                                    ticket.reservation.engine)
        self.room.finished(ticket)
        if completed and ticket.output_tokens > 0:
            self.output_policy.observe(ticket.request.tenant, ticket.output_tokens)
            self._outputs.observe(ticket.request.tenant, ticket.output_tokens)
        self._room_cache = None
        self._dispatch()

    def _admit_shadow(
        self, request: AdmissionRequest, cost: RequestCost | None, decision: Decision | None,
        now: float, plan: PrefixPlan,
    ) -> Ticket:
        verdict = Outcome.ADMITTED if decision is None else decision.outcome
        reported = decision or Decision(Outcome.ADMITTED, "enough KV headroom", None,
                                        self._details(cost) if cost else {})
        self.listener.decided(reported, shadow=True)
        if cost is None:
            cost = self.cost_model.cost(request.prompt_tokens, max(0, (request.max_tokens or 0)),
                                        request.sequences, forks_share=request.forks_share)
        ticket = self._start(request, cost, now, queue_wait_s=0.0,
                             predicted_ttft_s=cost.prefill_s, shadow_outcome=verdict,
                             plan=plan)
        self._report(self._admitted_decision(ticket))
        return ticket

    # ---- predictions -------------------------------------------------------------------

    def _mean_context(self) -> int:
        return self._running.mean_context()

    def _expected_output(self, ticket: Ticket) -> int:
        typical = self._outputs.reserve(ticket.request.prompt_tokens, None,
                                        self.cost_model.max_model_len, ticket.request.tenant)
        reserved = ticket.cost.output_tokens
        if typical >= self.cost_model.max_model_len - ticket.request.prompt_tokens:
            typical = reserved  # too few observations: assume the reservation
        return max(ticket.output_tokens + 1, min(reserved, typical))

    def running_requests(self) -> list[RunningRequest]:
        """Each running request as it is expected to end (its expected output, not its
        reservation): its decode steps left priced by the step clock of all of them
        (the batch shrinks as they finish), after its first token."""
        now = self.clock()
        ends = []
        for ticket in self._running:
            progress = self._server_progress(ticket, now)
            expected = max(self._expected_output(ticket), progress)
            started = ticket.first_token_s or (ticket.admitted_s + ticket.cost.prefill_s)
            ends.append((progress, expected, max(0.0, started - now)))
        clock = self._step_clock(now, [(0, expected - progress)
                                       for progress, expected, _ in ends])
        views = []
        for ticket, (progress, expected, first_in_s) in zip(self._running, ends, strict=True):
            request = ticket.request
            shared = ticket.cost.shared_blocks
            views.append(RunningRequest(
                blocks_now=max(0, self._blocks_now(ticket, progress) - shared),
                blocks_final=max(0, self.cost_model.blocks_now(
                    request.prompt_tokens, max(1, expected), request.sequences,
                    forks_share=request.forks_share) - shared),
                blocks_reserved=ticket.reserved_blocks,
                finish_in_s=first_in_s + clock.seconds_until(expected - progress),
            ))
        return views

    def _server_progress(self, ticket: Ticket, now: float) -> int:
        """Output tokens the server has generated for a request, at least those kvgate
        has forwarded: a slow client reads behind the server, which keeps generating
        (estimated from the time since the first token at the predicted TPOT)."""
        started = ticket.first_token_s
        if started is None or ticket.predicted_tpot_s <= 0:
            return ticket.output_tokens
        by_time = 1 + int((now - started) / ticket.predicted_tpot_s)
        return min(ticket.cost.output_tokens, max(ticket.output_tokens, by_time))

    def _blocks_now(self, ticket: Ticket, produced: int) -> int:
        """Blocks the server holds for a running request now (its whole prompt is held
        once admitted: vLLM allocates a chunk's blocks when it schedules it)."""
        return self.cost_model.blocks_now(ticket.request.prompt_tokens, produced,
                                          ticket.request.sequences,
                                          forks_share=ticket.request.forks_share)

    @property
    def others_blocks(self) -> int:
        """The last scrape's use that kvgate's requests do not explain (traffic that
        bypasses kvgate), counted as held until the next scrape."""
        return self.room.untracked_blocks

    def _last_blocks(self, ticket: Ticket, now: float) -> int:
        """Blocks the server may have held for a request kvgate just saw finish: its
        own, and the prompt blocks no running request holds (once released)."""
        counts = self.ledger.holder_counts
        still_held = sum(map(counts.__contains__, ticket.reservation.keys))
        held = self._blocks_now(ticket, self._server_progress(ticket, now))
        return max(0, held - still_held * self.ledger.blocks_per_key)

    def _growth_blocks(self) -> int:
        """Blocks the running requests still add before they finish (their reservation
        less what the server already holds for them)."""
        now = self.clock()
        growth = 0
        for ticket in self._running:
            now_blocks = self._blocks_now(ticket, self._server_progress(ticket, now))
            held = max(0, now_blocks - ticket.cost.shared_blocks)
            growth += max(0, ticket.reserved_blocks - held)
        return growth

    def forecast(self) -> Forecast:
        """The most KV the running requests will hold together, and when it would pass
        the capacity: over the engine steps ahead, as admission counts them (one pool);
        with data parallelism, each request growing linearly until it finishes."""
        capacity = self.ledger.capacity_blocks
        if self.ledger.engines > 1 or not self._running:
            running = self.running_requests()
            tracked_now = sum(r.blocks_now for r in running)
            observed = self.ledger.observed_used_blocks
            others = max(0, observed - tracked_now) if observed is not None else 0
            return kv_forecast(running, capacity, others)
        now = self.clock()
        held = self._running_holdings(now)
        profile = holdings_profile(held.holdings, held.base_blocks)
        peak = max(blocks for _, blocks in profile)
        exhaustion = math.inf
        below = 0
        for step, blocks in profile:
            if blocks > capacity:
                # It crosses after the last step seen within capacity: the earliest time.
                exhaustion = self._running_clock(now, held).seconds_until(
                    below + 1 if step > 0 else 0)
                break
            below = step
        return Forecast(capacity, peak, exhaustion)

    def _retry_after(self, wait_s: float) -> float:
        if math.isinf(wait_s):
            return self.settings.retry_after_max_s
        return float(min(self.settings.retry_after_max_s,
                         max(self.settings.retry_after_min_s, math.ceil(wait_s))))

    # ---- reporting -------------------------------------------------------------------------

    def _details(self, cost: RequestCost | None, **extra: Detail) -> dict[str, Detail]:
        details: dict[str, Detail] = {
            "capacity_blocks": self.ledger.capacity_blocks,
            "target_blocks": self.ledger.target_blocks,
            "reserved_blocks": self.ledger.reserved_blocks,
            "headroom_blocks": self.ledger.headroom_blocks,
            "queue_length": len(self.queue),
        }
        if cost is not None:
            details.update(
                prompt_tokens=cost.prompt_tokens,
                reserved_output_tokens=cost.output_tokens,
                sequences=cost.sequences,
                kv_blocks=cost.kv_blocks,
                predicted_prefill_s=round(cost.prefill_s, 6),
                predicted_tpot_s=round(cost.tpot_s, 6),
            )
        details.update(extra)
        return details

    def _admitted_decision(self, ticket: Ticket) -> Decision:
        return Decision(
            Outcome.ADMITTED,
            "admitted",
            None,
            {"kv_blocks": ticket.cost.kv_blocks, "queue_wait_s": ticket.queue_wait_s,
             "predicted_ttft_s": ticket.predicted_ttft_s},
        )

    def _draining_decision(self) -> Decision:
        remaining = 0.0
        if self._drain_deadline_s is not None:
            remaining = max(0.0, self._drain_deadline_s - self.clock())
        return Decision(Outcome.DRAINING, "the sidecar is shutting down",
                        self._retry_after(remaining))

    def _report(self, decision: Decision) -> None:
        if self.settings.mode is Mode.SHADOW and decision.outcome is not Outcome.ADMITTED:
            return
        self.listener.decided(decision, shadow=False)

    # ---- introspection ----------------------------------------------------------------------

    def request_states(self, limit: int = 256) -> list[dict[str, object]]:
        """The running requests (oldest first, at most `limit`): what each holds in the
        ledger now and what the server holds for it."""
        now = self.clock()
        states: list[dict[str, object]] = []
        for ticket in itertools.islice(self._running, limit):
            produced = self._server_progress(ticket, now)
            states.append({
                "ticket": ticket.key,
                "prompt_tokens": ticket.request.prompt_tokens,
                "output_tokens": ticket.output_tokens,
                "reserved_output_tokens": ticket.cost.output_tokens,
                "reserved_blocks": ticket.reserved_blocks,
                "shared_blocks": ticket.cost.shared_blocks,
                "cached_tokens": ticket.cost.cached_tokens,
                "blocks_now": self._blocks_now(ticket, produced),
                "peak_blocks": ticket.reservation.blocks + len(ticket.reservation.keys)
                * self.ledger.blocks_per_key,
            })
        return states

    def _server_queue_state(self) -> dict[str, object]:
        limits = self.settings.server_limits
        sequences, prefill_tokens = self.server_queue()
        return {
            "max_num_queued_reqs": limits.max_requests,
            "max_num_queued_tokens": limits.max_prefill_tokens,
            "max_num_seqs": limits.max_running,
            "requests": sequences,
            "prefill_tokens": prefill_tokens,
        }

    @property
    def inflight(self) -> int:
        return len(self._running)

    def tickets(self) -> list[Ticket]:
        return list(self._running)

    def _room_blocks(self) -> int | None:
        """Blocks that fit beside the running requests at every step ahead (what
        admission counts; `headroom_blocks` is from their peaks added up). None with
        several engines (a pool each: see the ledger's engines)."""
        if self.ledger.engines > 1:
            return None
        running = self._running_holdings(self.clock())
        return max(0, math.floor(self.ledger.target_blocks - running.peak_blocks() + 1e-9))

    def state(self) -> dict[str, object]:
        forecast = self.forecast()
        snapshot = self.ledger.snapshot()
        oldest = self.queue.oldest()
        return {
            "mode": self.settings.mode.value,
            "draining": self._draining,
            "server": {
                "available": self.server.available,
                "num_blocks": self.server.num_blocks,
                "used_blocks": self.server.used_blocks,
                "running": self.server.running,
                "waiting": self.server.waiting,
            },
            "ledger": {
                "capacity_blocks": snapshot.capacity_blocks,
                "target_blocks": snapshot.target_blocks,
                "reserved_blocks": snapshot.reserved_blocks,
                "observed_used_blocks": snapshot.observed_used_blocks,
                "effective_used_blocks": snapshot.effective_used_blocks,
                "headroom_blocks": snapshot.headroom_blocks,
                "reservations": snapshot.reservations,
                "overcommit_blocks": snapshot.overcommit_blocks,
                "held_prompt_blocks": snapshot.held_prompt_blocks,
                "room_blocks": self._room_blocks(),
                "others_blocks": self.others_blocks,
            },
            "prefix": self.sharing.state(
                sum(t.cost.shared_blocks for t in self._running)),
            "requests": self.request_states(),
            "queue": {
                "length": len(self.queue),
                "blocks": self.queue.blocks,
                "oldest_wait_s": (self.clock() - oldest.arrival_s) if oldest else 0.0,
                "by_band_and_tenant": self.queue.summary(),
                "wait_ratio": {"factor": self.wait_ratio.factor,
                               "samples": self.wait_ratio.samples},
                "waiting_on": self.blockage.current,
                "blocked_s": self.blockage.seconds(self.clock()),
            },
            "inflight": len(self._running),
            "server_queue": self._server_queue_state(),
            "forecast": {
                "peak_blocks": forecast.peak_blocks,
                "peak_ratio": forecast.peak_ratio,
                "exhaustion_s": None if math.isinf(forecast.exhaustion_s)
                else forecast.exhaustion_s,
            },
        }


def _seat_wait_s(running: list[tuple[float, int]], queued: list[tuple[int, float]],
                 sequences: int, seats: int, *, clamp: bool) -> float:
    """Time until a request of `sequences` gets its seats among the server's `seats`
    (the sequences it counts at once): after the running requests (each one's predicted
    finish and sequences) and the requests queued ahead of it (sequences and predicted
    duration), each let in as enough seats free and holding them until it finishes.
    `clamp`: a request wider than `seats` takes them all (`--max-num-seqs`: vLLM runs
    its sequences in turns); else it never gets in (inf)."""
    occupied = [finish for finish, count in running for _ in range(count)]
    heapq.heapify(occupied)

    def start(count: int) -> float:
        need = min(count, seats) if clamp else count
        if need > seats:
            return math.inf
        begin = 0.0
        while len(occupied) + need > seats:
            begin = max(begin, heapq.heappop(occupied))
        return begin

    for count, duration_s in queued:
        begin = start(count)
        if not math.isfinite(begin):
            return math.inf
        for _ in range(min(count, seats) if clamp else count):
            heapq.heappush(occupied, begin + duration_s)
    return start(sequences)


def _time_until(releases: list[tuple[float, int]], needed: int) -> float:
    """Time until the releases (time, amount; sorted by time) add up to `needed`:
    0 if nothing is needed, inf if they never do."""
    if needed <= 0:
        return 0.0
    released = 0
    for at_s, amount in releases:
        released += amount
        if released >= needed:
            return at_s
    return math.inf


def _server_requests(state: ServerState) -> int | None:
    """The requests on the server (running and waiting) at its last scrape."""
    if state.running is None or state.waiting is None:
        return None
    return state.running + state.waiting
