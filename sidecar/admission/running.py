"""Admitted requests: their tickets and the set of those running.

A `Ticket` is what the admission controller hands out for an admitted request; its
holder reports the stream's progress and calls `finish()` once, however the request
ends. The ticket tells its owner (the controller) about each event; `RunningSet`
keeps the running tickets and the context they hold, for predictions.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from sidecar.admission.cost import RequestCost
from sidecar.admission.ledger import Ledger, Reservation
from sidecar.admission.outcomes import Outcome
from sidecar.admission.prefix import PrefixPlan
from sidecar.admission.quick_init import quick_init


@quick_init
@dataclass(frozen=True)
class AdmissionRequest:
    prompt_tokens: int
    max_tokens: int | None = None
    sequences: int = 1  # n (times the prompts of a batch)
    # Whether vLLM would share the prompt's full blocks between its forks (n > 1) with
    # prefix caching on: not for a batch of prompts, a request with media or one that
    # does not read the prefix cache (`server.prefix_keys.shares_prompt_blocks`). The
    # controller drops it when the server's prefix caching is off.
    forks_share: bool = False
    band: int = 1  # 0 is the most important
    tenant: str = "default"
    ttft_slo_s: float | None = None
    block_keys: tuple[bytes, ...] = ()  # its prompt's full blocks (`prompt_keys`)



class TicketOwner(Protocol):
    """What a ticket reports to (the admission controller)."""

    ledger: Ledger

    def clock(self) -> float: ...

    def _prefilled(self, ticket: Ticket) -> None: ...

    def _progressed(self, ticket: Ticket, added_tokens: int) -> None: ...

    def _grow(self, ticket: Ticket) -> None: ...

    def _shrink(self, ticket: Ticket) -> None: ...

    def _finished(self, ticket: Ticket, completed: bool) -> None: ...


class Ticket:
    """An admitted request. `finish()` settles it; calling it again does nothing."""

    def __init__(
        self,
        controller: TicketOwner,
        key: int,
        request: AdmissionRequest,
        cost: RequestCost,
        reservation: Reservation,
        admitted_s: float,
        queue_wait_s: float,
        predicted_ttft_s: float,
        shadow_outcome: Outcome | None,
        plan: PrefixPlan | None = None,
    ) -> None:
        self._controller = controller
        self.plan = plan or PrefixPlan.none()
        self.key = key
        self.request = request
        self.cost = cost
        self.reservation = reservation
        self.admitted_s = admitted_s
        self.queue_wait_s = queue_wait_s
        self.predicted_ttft_s = predicted_ttft_s
        self.predicted_tpot_s = cost.tpot_s
        self.shadow_outcome = shadow_outcome
        self.output_tokens = 0
        self.first_token_s: float | None = None
        self.finished = False
        self.past_prefill_peak = False

    @property
    def reserved_blocks(self) -> int:
        """What it holds in the ledger now: its own blocks plus the prompt blocks it
        brought (those no admitted request held before it)."""
        brought = (len(self.reservation.keys) - self.plan.shared) * (
            self._controller.ledger.blocks_per_key)
        return 0 if self.reservation.released else self.reservation.blocks + brought

    @property
    def reserved_output_tokens(self) -> int:
        return self.cost.output_tokens

    def first_token(self) -> None:
        if self.first_token_s is None:
            self.first_token_s = self._controller.clock()
            self._controller._prefilled(self)

    def progress(self, output_tokens: int) -> None:
        """Output tokens generated so far (per sequence). A request that outgrows its
        reservation (learned-quantile policy) grows it."""
        if output_tokens <= self.output_tokens or self.finished:
            return
        self._controller._progressed(self, output_tokens - self.output_tokens)
        self.output_tokens = output_tokens
        if self.output_tokens > self.cost.output_tokens:
            self._controller._grow(self)
        elif not self.past_prefill_peak and output_tokens >= 2:
            self._controller._shrink(self)

    def finish(self, output_tokens: int | None = None, *, completed: bool = True) -> bool:
        """Release the reservation. True the first time only."""
        if self.finished:
            return False
        if output_tokens is not None and output_tokens > self.output_tokens:
            self._controller._progressed(self, output_tokens - self.output_tokens)
            self.output_tokens = output_tokens
        self.finished = True
        self._controller._finished(self, completed)
        return True


class RunningSet:
    """The admitted requests not finished yet, oldest first, the tokens of context
    (prompt + output so far) they hold together, and those still waiting for their
    first token (their prompts are ahead of a new one in the server's prefill)."""

    def __init__(self) -> None:
        self._tickets: dict[int, Ticket] = {}
        self._prefilling: dict[int, Ticket] = {}
        self._context_tokens = 0

    def add(self, ticket: Ticket) -> None:
        self._tickets[ticket.key] = ticket
        if ticket.first_token_s is None:
            self._prefilling[ticket.key] = ticket
        self._context_tokens += ticket.request.prompt_tokens + ticket.output_tokens

    def remove(self, ticket: Ticket) -> bool:
        """False when it was not running (already removed)."""
        if self._tickets.pop(ticket.key, None) is None:
            return False
        self._prefilling.pop(ticket.key, None)
        self._context_tokens -= ticket.request.prompt_tokens + ticket.output_tokens
        return True

    def prefilled(self, ticket: Ticket) -> None:
        """Its first token came: its prompt is no longer ahead of anyone's (if it still
        counted)."""
        self._prefilling.pop(ticket.key, None)

    def prefill_ahead(self, now: float) -> tuple[int, ...]:
        """Prompt tokens the server still has to prefill for admitted requests before a
        new one's (vLLM schedules prefills first come, first served), prompt by prompt
        in the order they were admitted (a request's forks one after another): their
        new tokens (`RequestCost.server_prefill_tokens`) times the share of its
        predicted time to first token still to run.
        Called with a clock that never goes back: one whose predicted time has passed
        counts for nothing from then on, and is no longer looked at (a decision costs
        the prefills in flight, not every request waiting for its first token)."""
        ahead: list[int] = []
        over: list[int] = []
        for key, ticket in self._prefilling.items():
            cost = ticket.cost
            expected_s = cost.prefill_s
            left = 1.0 if expected_s <= 0 else 1.0 - (now - ticket.admitted_s) / expected_s
            if left <= 0:
                over.append(key)
                continue
            share = min(1.0, left)
            forks = cost.sequences
            if forks <= 1:
                ahead.append(round(cost.server_prefill_tokens * share))
                continue
            # Each fork is a prompt of its own to the server: the first's tokens not
            # cached, then the others' (their tails, where forks share the prompt).
            first = min(cost.server_prefill_tokens, cost.prompt_tokens - cost.cached_tokens)
            each = (cost.server_prefill_tokens - first) / (forks - 1)
            ahead.append(round(first * share))
            ahead.extend([round(each * share)] * (forks - 1))
        for key in over:
            del self._prefilling[key]
        return tuple(ahead)

    def progressed(self, ticket: Ticket, added_tokens: int) -> None:
        """Call before the ticket counts the tokens."""
        if ticket.key in self._tickets:
            self._context_tokens += added_tokens

    def mean_context(self) -> int:
        return self._context_tokens // len(self._tickets) if self._tickets else 0

    def __len__(self) -> int:
        return len(self._tickets)

    def __iter__(self) -> Iterator[Ticket]:
        return iter(self._tickets.values())

    def __bool__(self) -> bool:
        return bool(self._tickets)
