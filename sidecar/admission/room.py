"""Room in the KV cache over the engine steps ahead: the question admission asks
before a request goes to the server.

The ledger holds each admitted request's reservation: the peak it will still reach.
Those peaks do not coincide: a request reaches its peak at its last step, and
requests that finish sooner free their blocks before a newcomer has grown to its
own. vLLM gives every running request one token per engine step, so the steps ahead
are a clock shared by all of them, whatever a step lasts. `KVRoom` turns each running
request into a `forecast.Holding` (what it holds now, one block per group at most
each time its token count crosses a block boundary, never more than its reservation,
nothing after its last reserved token), and a newcomer fits when the sum with its
own holding stays within the target at every step ahead.

What the sum leaves out is held throughout: prompt blocks that several running
requests hold (freed only with their last holder) and the blocks the server reports
in use that kvgate's requests do not explain (traffic that bypasses kvgate; measured
at each metrics scrape). A prompt block only one running request holds goes with
that request, or with the newcomer when the newcomer shares it and ends later.

Safety: each holding bounds what the request's blocks can be at every step, given
that the server has generated at most `progress + LAG_TOKENS` of its tokens (the
progress estimate is the larger of what kvgate forwarded and what the predicted step
time allows) and that it runs until its reserved output; a request that stops early
(EOS) only frees blocks sooner.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from sidecar.admission.cost import CostModel, RequestCost
from sidecar.admission.forecast import Holding, RoomProfile, holdings_peak
from sidecar.admission.ledger import Ledger
from sidecar.admission.prefix import PrefixPlan
from sidecar.admission.running import AdmissionRequest, Ticket

# Tokens the server may be ahead of kvgate's estimate of a request's progress: the step
# in flight (vLLM allocates the next step's slots while the last one is streamed) and
# one token on its way to kvgate.
LAG_TOKENS = 2
# How far apart kvgate's view and its estimate of the server may be for the holdings
# now to be looked up token by token (beyond: the request's peak ahead).
_SCAN_TOKENS = 64
# Starts (the running requests' last steps) tried in order for a newcomer's first fit,
# before a binary search over the rest.
SCANNED_STARTS = 8

Progress = Callable[[Ticket, float], int]


@dataclass
class RunningHoldings:
    """The running requests' holdings (in `tickets` order) and the blocks held
    throughout."""

    tickets: tuple[Ticket, ...]
    holdings: tuple[Holding, ...]
    base_blocks: float
    prefill_steps: int  # before a request admitted now is prefilled
    mean_duration_s: float = 0.0  # predicted prefill + decode, mean over the tickets
    _profile: RoomProfile | None = None

    def peak_blocks(self) -> float:
        return holdings_peak(self.holdings, self.base_blocks)

    @property
    def profile(self) -> RoomProfile:
        if self._profile is None:
            self._profile = RoomProfile.of(self.holdings, self.base_blocks)
        return self._profile


class KVRoom:
    def __init__(self, ledger: Ledger, cost_model: CostModel) -> None:
        self.ledger = ledger
        self.cost_model = cost_model
        # Whether a request's blocks can fall as it advances (sliding windows).
        self._recycles = cost_model.lifecycle.layout.recycles_blocks
        # The server's --long-prefill-token-threshold (0: none): see `prefill_end`.
        self._long_prefill_cap = cost_model.served.long_prefill_cap
        # Server-reported use that the running requests do not explain (last scrape).
        self.untracked_blocks = 0
        self._version = 0
        # Who holds each prompt block among the running requests, kept as they come and
        # go (a look-up per block of the request that came or went, not per block of
        # every running request).
        self._holding: dict[bytes, dict[int, Ticket]] = {}
        self._owners: dict[bytes, Ticket] = {}  # prompt blocks one running request holds
        self._exclusive: dict[int, int] = {}  # ticket key -> prompt blocks only it holds

    def set_cost_model(self, cost_model: CostModel) -> None:
        self.cost_model = cost_model
        self._recycles = cost_model.lifecycle.layout.recycles_blocks
        self._long_prefill_cap = cost_model.served.long_prefill_cap

    def admitted(self, ticket: Ticket) -> None:
        """`ticket` runs now; its reservation (already in the ledger) holds its prompt
        blocks."""
        self._version += 1
        mine = ticket.key
        by_key, owners = self._holding, self._owners
        counts = self.ledger.holder_counts
        alone = 0  # blocks it is the only one to hold
        for key in ticket.reservation.keys:
            holding = by_key.get(key)
            if holding is None:
                # No running request holds it: it owns it unless a reservation outside
                # the running requests holds it too.
                by_key[key] = {mine: ticket}
                if counts.get(key) == 1:
                    owners[key] = ticket
                    alone += 1
                continue
            holding[mine] = ticket
            if key in owners:  # shared now: whoever owned it no longer does
                self._settle_owner(key, holding)
        self._exclusive[mine] = alone

    def finished(self, ticket: Ticket) -> None:
        """`ticket` ended; its reservation is already released from the ledger."""
        self._version += 1
        mine = ticket.key
        by_key, owners = self._holding, self._owners
        for key in ticket.reservation.keys:
            holding = by_key.get(key)
            if holding is None:
                continue
            holding.pop(mine, None)
            if not holding:
                del by_key[key]
                owners.pop(key, None)  # only it ran with the block: it was the owner
            elif len(holding) == 1 or key in owners:
                self._settle_owner(key, holding)  # one left may own it now
        self._exclusive.pop(mine, None)

    def _settle_owner(self, key: bytes, holding: dict[int, Ticket]) -> None:
        """The running request that alone holds `key` now, if one does (`holding`: the
        running requests holding it)."""
        owner = None
        if len(holding) == 1 and self.ledger.holder_counts.get(key) == 1:
            owner = next(iter(holding.values()))
        previous = self._owners.get(key)
        if previous is owner:
            return
        if previous is not None:
            self._exclusive[previous.key] -= 1
        if owner is None:
            del self._owners[key]
        else:
            self._owners[key] = owner
            self._exclusive[owner.key] = self._exclusive.get(owner.key, 0) + 1

    @property
    def version(self) -> int:
        """Changes whenever a request is admitted or finishes."""
        return self._version

    def exclusive_keys(self, ticket: Ticket) -> int:
        """Prompt blocks only `ticket` holds among the running requests."""
        return self._exclusive.get(ticket.key, 0)

    # ---- the running requests -------------------------------------------------------

    def prefill_steps(self, prefill_tokens: int) -> int:
        """Engine steps the server takes to prefill `prefill_tokens` (every fork's tokens
        it does not find cached: `RequestCost.server_prefill_tokens`), in chunks."""
        return self.cost_model.lifecycle.prefill_step_count(max(1, prefill_tokens))

    def prefill_end(self, before_steps: int, prefill_tokens: int, prompt_tokens: int) -> int:
        """Steps until a request whose forks prefill `prefill_tokens` (each at most
        `prompt_tokens`) is prefilled, behind prefills of `before_steps` steps at the
        whole budget: those and its own; with the server's long-prefill threshold, no
        fewer than its longest prompt takes in chunks of the threshold (it caps each
        prompt, and the prompts share the budget)."""
        steps = before_steps + self.prefill_steps(prefill_tokens)
        cap = self._long_prefill_cap
        if cap:
            longest = max(1, min(prefill_tokens, prompt_tokens))
            steps = max(steps, -(-longest // cap))
        return steps

    def holding(self, ticket: Ticket, progress: int, exclusive_keys: int,
                prefill_steps: int) -> Holding:
        """What `ticket` holds over the steps ahead: its server-side progress estimated
        at `progress` output tokens, `exclusive_keys` prompt blocks only it holds and,
        when its first token has not come yet, `prefill_steps` steps before it decodes
        (its prefill and those of the requests admitted before it, as vLLM schedules
        prefills first come first served)."""
        request = ticket.request
        model = self.cost_model
        per_key = self.ledger.blocks_per_key
        started = ticket.first_token_s is not None
        seen = ticket.output_tokens if started else 0
        ahead = max(seen, progress) + LAG_TOKENS if started else 0
        # Where the server is between what kvgate saw and `ahead`: sliding windows hold
        # more at some of those points (the prefill's blocks until the first steps
        # settle) than at the last, so take the most over them (or the peak ahead, when
        # kvgate's view lags far behind).
        # Groups that only grow hold the most at the last of those points.
        if ahead - seen > _SCAN_TOKENS:
            held = ticket.reservation.blocks + len(ticket.reservation.keys) * per_key
        elif not self._recycles:
            held = model.blocks_now(request.prompt_tokens, ahead, request.sequences,
                                    forks_share=request.forks_share)
        else:
            held = max(model.blocks_now(request.prompt_tokens, produced, request.sequences,
                                        forks_share=request.forks_share)
                       for produced in range(seen, ahead + 1))
        own_now = max(0, held - len(ticket.reservation.keys) * per_key)
        offset, per_token = model.lifecycle.growth_bound(request.prompt_tokens + ahead)
        keys = exclusive_keys * per_key
        # Its last step: the reserved output from what kvgate has seen of it (the
        # server may be further on, which only ends it sooner).
        remaining = max(1, ticket.cost.output_tokens - (ticket.output_tokens if started
                                                        else 0))
        return Holding(
            start_blocks=own_now + request.sequences * offset + keys,
            blocks_per_step=request.sequences * per_token,
            cap_blocks=ticket.reservation.blocks + keys,
            end_steps=(0 if started else prefill_steps) + remaining + 1,
        )

    def running(self, tickets: Sequence[Ticket], progress: Progress,
                now: float) -> RunningHoldings:
        exclusive = self._exclusive
        holdings = []
        prefills = 0
        for ticket in tickets:  # in the order they were admitted
            own = prefills
            if ticket.first_token_s is None:
                tokens = ticket.cost.server_prefill_tokens
                own = self.prefill_end(prefills, tokens, ticket.request.prompt_tokens)
                prefills += self.prefill_steps(tokens)
            holdings.append(self.holding(ticket, progress(ticket, now),
                                         exclusive.get(ticket.key, 0), own))
        shared_keys = self.ledger.shared_keys - sum(exclusive.get(t.key, 0) for t in tickets)
        base = max(0, shared_keys) * self.ledger.blocks_per_key + self.untracked_blocks
        duration = (sum(t.cost.prefill_s + t.cost.decode_s for t in tickets) / len(tickets)
                    if tickets else 0.0)
        return RunningHoldings(tuple(tickets), tuple(holdings), base, prefills, duration)

    def observe(self, used_blocks: int | None, tickets: Sequence[Ticket],
                progress: Progress, now: float, finished_blocks: int = 0) -> None:
        """The server's reported KV use at a scrape: what kvgate's running requests,
        and those that finished since the scrape was sent (`finished_blocks`), do not
        explain is held by others until the next scrape."""
        if used_blocks is None:
            self.untracked_blocks = 0
            return
        per_key = self.ledger.blocks_per_key
        tracked = self.ledger.held_prompt_blocks + finished_blocks
        for ticket in tickets:
            request = ticket.request
            if ticket.first_token_s is not None:
                produced = progress(ticket, now)
            else:
                # No token seen (not streamed, or not yet): the server may be generating
                # since admission. Counting only the prompt would take this request's
                # output for other traffic, on top of its reservation.
                tpot_s = max(ticket.predicted_tpot_s, 1e-6)
                produced = min(ticket.cost.output_tokens,
                               max(0, int((now - ticket.admitted_s) / tpot_s)))
            tracked += max(0, self.cost_model.blocks_now(
                request.prompt_tokens, produced, request.sequences, forks_share=request.forks_share)
                - len(ticket.reservation.keys) * per_key)
        self.untracked_blocks = max(0, used_blocks - tracked)

    # ---- a newcomer -------------------------------------------------------------------

    def newcomer(self, request: AdmissionRequest, cost: RequestCost, plan: PrefixPlan,
                 prefill_steps: int = 0) -> Holding:
        """What `request` would hold from the next step on if admitted now (its own
        blocks and the prompt blocks no running request holds yet), after
        `prefill_steps` steps of the prefills admitted before it."""
        model = self.cost_model
        per_key = self.ledger.blocks_per_key
        keys = len(plan.keys) * per_key
        sequences = request.sequences
        own_prefill = max(0, model.blocks_now(request.prompt_tokens, 0, sequences,
                                              forks_share=request.forks_share) - keys)
        own_peak = max(0, model.peak_blocks(request.prompt_tokens, cost.output_tokens,
                                            sequences, forks_share=request.forks_share) - keys)
        brought = (len(plan.keys) - plan.shared) * per_key
        offset, per_token = model.lifecycle.growth_bound(request.prompt_tokens)
        # Priced on what it finds cached now (a queued request: nothing).
        steps = self.prefill_end(prefill_steps, model.server_prefill_tokens(
            request.prompt_tokens, sequences, plan.cached_tokens,
            forks_share=request.forks_share), request.prompt_tokens)
        return Holding(
            start_blocks=own_prefill + sequences * offset + brought,
            blocks_per_step=sequences * per_token,
            cap_blocks=own_peak + brought,
            end_steps=steps + max(1, cost.output_tokens) + 1,
        )

    def with_newcomer(self, running: RunningHoldings, request: AdmissionRequest,
                      cost: RequestCost, plan: PrefixPlan) -> list[Holding]:
        """The holdings once `request` runs too: prompt blocks it shares with the one
        running request that holds them go with whichever of the two ends later."""
        mine = self.newcomer(request, cost, plan, running.prefill_steps)
        holdings = list(running.holdings)
        if plan.shared and self._owners:
            index = {t.key: i for i, t in enumerate(running.tickets)}
            moved: dict[int, int] = {}
            for key in plan.keys:
                owner = self._owners.get(key)
                if owner is not None and owner.key in index:
                    moved[index[owner.key]] = moved.get(index[owner.key], 0) + 1
            per_key = self.ledger.blocks_per_key
            extra = 0
            for i, count in moved.items():
                h = holdings[i]
                if h.end_steps < mine.end_steps:
                    blocks = count * per_key
                    holdings[i] = Holding(h.start_blocks - blocks, h.blocks_per_step,
                                          h.cap_blocks - blocks, h.end_steps)
                    extra += blocks
            if extra:
                mine = Holding(mine.start_blocks + extra, mine.blocks_per_step,
                               mine.cap_blocks + extra, mine.end_steps)
        holdings.append(mine)
        return holdings

    def fits(self, running: RunningHoldings, request: AdmissionRequest, cost: RequestCost,
             plan: PrefixPlan, limit_blocks: float) -> bool:
        """Whether `request`, admitted now, keeps the holdings within `limit_blocks` at
        every step ahead."""
        holdings = self.with_newcomer(running, request, cost, plan)
        return holdings_peak(holdings, running.base_blocks) <= limit_blocks + 1e-9

    def steps_until_fits(self, running: RunningHoldings, request: AdmissionRequest,
                         cost: RequestCost, plan: PrefixPlan, limit_blocks: float) -> float:
        """The first step at which `request`, admitted then (just after a running
        request's last step), keeps the holdings within `limit_blocks` at every step
        after; inf when it does not fit even once every running request has ended.
        The first `SCANNED_STARTS` are tried in order: a later start finds fewer
        requests running, but those left larger, so a start that fits can come before
        one that does not. Past them, a binary search (cheaper with many running
        requests) finds a start that fits, if perhaps not the first."""
        ends = sorted({h.end_steps for h in running.holdings if h.end_steps > 0})
        starts = [0, *ends]

        def fits_from(step: int) -> bool:
            shifted = tuple(
                Holding(min(h.cap_blocks, h.start_blocks + h.blocks_per_step * step),
                        h.blocks_per_step, h.cap_blocks, h.end_steps - step)
                for h in running.holdings)
            later = RunningHoldings(running.tickets, shifted, running.base_blocks, 0)
            return self.fits(later, request, cost, plan, limit_blocks)

        for start in starts[:SCANNED_STARTS]:
            if fits_from(start):
                return float(start)
        rest = starts[SCANNED_STARTS:]
        if not rest or not fits_from(rest[-1]):
            return math.inf
        low, high = 0, len(rest) - 1
        while low < high:
            mid = (low + high) // 2
            if fits_from(rest[mid]):
                high = mid
            else:
                low = mid + 1
        return float(rest[low])

    def queued(self, request: AdmissionRequest, cost: RequestCost) -> Holding:
        """What a queued request will hold once admitted (prompt sharing not counted)."""
        return self.newcomer(request, cost, PrefixPlan.none())

    def steps_until_room(self, running: RunningHoldings, blocks: float,
                         limit_blocks: float) -> float:
        """Steps until `blocks` more blocks fit for good (inf: not even once every
        running request has finished)."""
        return running.profile.steps_until_room(blocks, limit_blocks)


class QueueWalk:
    """The queue's requests admitted in turn as room frees beside the running ones
    (`profile`): each, in order, at the first step (not before the one ahead of it) from
    which its peak stays within the limit at every step until its last, beside the
    running requests then and the queued ones admitted before it (each holding its peak
    until its last step). Those admitted before it hold no more after its start than at
    it, and the running requests' most over its steps (`RoomProfile.most_over`) can
    only fall when one of their last steps leaves the window: the steps to try are
    where the walk stands, those last steps and the ends of those admitted, each passed
    once: O((running + queued) log) in all. A request the queue refuses before room
    comes for it (`latest_steps`) holds nothing, and the walk goes on from the step it
    is refused at. The walk keeps where it stands, so that a newcomer behind the same
    queue is priced from there (`steps_until_admitted`) without walking the queue
    again, and the steps each admitted one runs over (`spans`), which the time of the
    steps ahead depends on (`step_clock`)."""

    __slots__ = ("_ends", "_held", "_profile", "spans", "step")

    def __init__(self, profile: RoomProfile) -> None:
        self._profile = profile
        self._ends: list[tuple[int, float]] = []  # (the step after its last, peak)
        # (first step, the step after its last) of each admitted: they run then.
        self.spans: list[tuple[int, int]] = []
        self._held = 0.0
        self.step = 0

    def copy(self) -> QueueWalk:
        other = QueueWalk(self._profile)
        other._ends, other._held, other.step = list(self._ends), self._held, self.step
        other.spans = list(self.spans)
        return other

    def admit_all(self, holdings: Iterable[Holding], limit_blocks: float,
                  latest_steps: Sequence[float] = ()) -> bool:
        """Admit each in turn at the first step it fits from where the walk stands (its
        loop kept in local variables: a long queue is walked for every arrival); False
        when one without a latest step never fits, or the running requests alone
        exceed the limit for good (the walk is then over).

        `latest_steps[i]`, when given, is the last step the i-th can be let in at (the
        queue refuses it then: its deadline, or the queue's maximum wait; below 0: it is
        refused now). One that fits only later holds nothing: it is refused at that
        step, and those behind it wait for it until then at most.

        Admission lets nobody in while the running requests alone would exceed the
        limit at a later step (`KVRoom.fits` checks every step ahead): nobody is let in
        before they stay within it for good."""
        ends = self._ends
        step, held = self.step, self._held
        alone_fit_from = self._profile.steps_until_room(0.0, limit_blocks)
        if math.isinf(alone_fit_from):
            return False
        step = max(step, int(alone_fit_from))
        most_over = self._profile.most_over
        heappop, heappush = heapq.heappop, heapq.heappush
        spans = self.spans
        limit = limit_blocks + 1e-9
        fits = True
        bounded = len(latest_steps)
        for index, holding in enumerate(holdings):
            cap = holding.cap_blocks
            length = max(1, holding.end_steps)
            latest = latest_steps[index] if index < bounded else math.inf
            refused = False
            while True:
                while ends and ends[0][0] <= step:
                    held -= heappop(ends)[1]
                most, changes = most_over(step, step + length - 1)
                if most + held + cap <= limit:
                    refused = step > latest
                    break
                if ends:
                    first_end = ends[0][0]
                    after = first_end if changes is None or first_end < changes else changes
                elif changes is None:
                    after = -1  # never
                else:
                    after = changes
                if after < 0 or after > latest:
                    # Refused before room comes for it (at once if that step has passed).
                    refused = latest < math.inf
                    fits = refused
                    break
                step = after
            if refused:
                if latest > step:
                    step = math.ceil(latest)
                continue
            if not fits:
                break
            heappush(ends, (step + length, cap))
            spans.append((step, step + length))
            held += cap
        self.step, self._held = step, held
        return fits

    def steps_until_admitted(self, holding: Holding, limit_blocks: float) -> float:
        """The step `holding` is admitted at after those walked (inf: never); the walk
        takes it."""
        return float(self.step) if self.admit_all((holding,), limit_blocks) else math.inf
