"""Stateful property tests of the admission core over random interleavings of
arrive, finish, fail, cancel, engine steps, time passing and capacity changes.

The machine's server runs as vLLM does: every running request gains one token per
engine step (a request not prefilled yet is prefilled in the next step). From any
state the invariant replays the steps ahead with the blocks vLLM's allocator holds
(`model.lifecycle`): the admitted requests never hold more than the target at any
step, although their peaks added up may exceed it."""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from sidecar.admission import (
    AdmissionRequest,
    CostModel,
    Decision,
    Outcome,
    QueueLimits,
    Rejected,
    ServerState,
    Ticket,
)
from sidecar.admission.queue import Entry
from sidecar.admission.room import LAG_TOKENS

from support.admission_fixtures import FakeClock, FakeClockLoop, controller

BOUND_S = 20.0


_BLOCKS_NOW: dict[int, Callable[[int, int, int], int]] = {}


def _memoised(model: CostModel) -> Callable[[int, int, int], int]:
    """The cost model's blocks_now, memoised (the invariant replays every step ahead)."""
    found = _BLOCKS_NOW.get(id(model))
    if found is None:
        found = _BLOCKS_NOW[id(model)] = functools.lru_cache(maxsize=None)(model.blocks_now)
    return found


@dataclass
class Pending:
    task: asyncio.Task[Ticket]
    request: AdmissionRequest
    seq: int


class AdmissionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.loop = FakeClockLoop(self.clock)
        self.ctl = controller(
            num_blocks=41, clock=self.clock, starvation_bound_s=BOUND_S,
            limits=QueueLimits(max_length=4, max_wait_s=40.0),
        )
        self.pending: list[Pending] = []
        self.running: list[tuple[Ticket, Pending]] = []
        self.admitted: list[tuple[Ticket, Pending]] = []
        self.seq = itertools.count()
        # What the clients got (a ticket, a rejection, their own cancellation).
        self.client_outcomes: Counter[Outcome] = Counter()
        self.allowed_excess = 0
        self.starvation_violations: list[str] = []
        original_pop = self.ctl.queue.pop

        def checked_pop(now_s: float) -> Entry | None:
            entry = self.ctl.queue.peek(now_s)
            if entry is not None:
                starved = [e for e in self.ctl.queue.entries() if now_s - e.arrival_s > BOUND_S]
                if starved:
                    # The longest-starved band goes first; bands starved equally long
                    # (requests that arrived at the same instant) may go in either order.
                    oldest_s = min(e.arrival_s for e in starved)
                    longest = {e.band for e in starved if e.arrival_s == oldest_s}
                    if entry.band not in longest:
                        self.starvation_violations.append(
                            f"bands {sorted(longest)} waited {now_s - oldest_s:.1f}s but "
                            f"band {entry.band} went first")
            return original_pop(now_s)

        self.ctl.queue.pop = checked_pop  # type: ignore[method-assign]

    def settle(self) -> None:
        for _ in range(6):
            self.loop.run_until_complete(asyncio.sleep(0))
        still = []
        for item in self.pending:
            if not item.task.done():
                still.append(item)
            elif item.task.cancelled():
                self.client_outcomes[Outcome.CANCELLED] += 1
            elif item.task.exception() is None:
                ticket = item.task.result()
                self.running.append((ticket, item))
                self.admitted.append((ticket, item))
                self.client_outcomes[Outcome.ADMITTED] += 1
            else:
                error = item.task.exception()
                assert isinstance(error, Rejected)
                self.client_outcomes[error.decision.outcome] += 1
        self.pending = still

    @rule(prompt=st.integers(1, 500), output=st.none() | st.integers(1, 500),
          band=st.integers(0, 2), tenant=st.sampled_from("abc"),
          slo=st.none() | st.floats(0.5, 100))
    def arrive(self, prompt: int, output: int | None, band: int, tenant: str,
               slo: float | None) -> None:
        request = AdmissionRequest(prompt, output, band=band, tenant=tenant, ttft_slo_s=slo)
        task = self.loop.create_task(self.ctl.admit(request))
        self.pending.append(Pending(task, request, next(self.seq)))
        self.settle()

    @rule(count=st.integers(2, 6), prompt=st.integers(20, 200), output=st.integers(20, 200),
          band=st.integers(0, 2), tenant=st.sampled_from("abc"),
          slo=st.none() | st.floats(0.5, 100))
    def arrive_together(self, count: int, prompt: int, output: int, band: int, tenant: str,
                        slo: float | None) -> None:
        """Several requests that each fit, at once: the queue fills."""
        for _ in range(count):
            self.arrive(prompt, output, band, tenant, slo)

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100), completed=st.booleans(), tokens=st.integers(0, 600))
    def finish(self, index: int, completed: bool, tokens: int) -> None:
        ticket, _ = self.running.pop(index % len(self.running))
        assert ticket.finish(tokens, completed=completed) is True
        assert ticket.finish() is False
        assert ticket.reservation.released and ticket.reservation.release() is False
        self.settle()

    @precondition(lambda self: self.running)
    @rule(steps=st.integers(1, 300))
    def engine_steps(self, steps: int) -> None:
        """The server runs `steps` steps: each running request is prefilled (its first
        token) and gains a token per step; those at their end finish. kvgate hears of
        the tokens two steps at a time (it may be that far behind the server)."""
        for _ in range(-(-steps // LAG_TOKENS)):
            running = list(self.running)
            for ticket, _ in running:
                ticket.first_token()
                ticket.progress(self.output_limit(ticket, ticket.output_tokens + LAG_TOKENS))
            for ticket, item in running:
                if ticket.output_tokens >= self.end_tokens(ticket) and not ticket.finished:
                    self.running.remove((ticket, item))
                    assert ticket.finish() is True
            # A prefilled request shares its prompt blocks, one that finished frees
            # them: either can let a waiting request in.
            self.settle()

    def output_limit(self, ticket: Ticket, tokens: int) -> int:
        # The server stops at max_tokens, which the worst-case policy reserves.
        return min(tokens, ticket.reserved_output_tokens)

    def end_tokens(self, ticket: Ticket) -> int:
        """Output tokens at which the server ends the request."""
        return ticket.reserved_output_tokens

    def held_ahead(self) -> list[int]:
        """Blocks the running requests hold at each engine step ahead, as vLLM's
        allocator holds them, each request advancing one token per step until its end
        (its prompt blocks shared with others held until the last holder ends)."""
        blocks_now = _memoised(self.ctl.cost_model)
        per_key = self.ctl.ledger.blocks_per_key
        lives = []
        for ticket, _ in self.running:
            request = ticket.request
            started = ticket.first_token_s is not None
            produced = ticket.output_tokens if started else 0
            end = max(self.end_tokens(ticket), produced + 1)
            # Step k holds the slots of `produced + k` output tokens (k = 0 is the
            # prefill of a request not prefilled yet) and samples token produced+k+1.
            lives.append((request, produced, end - produced, ticket.reservation.keys))
        horizon = max((steps for _, _, steps, _ in lives), default=0)
        held = []
        for k in range(horizon):
            keys: set[bytes] = set()
            blocks = 0
            for request, produced, steps, own_keys in lives:
                if k < steps:
                    blocks += max(0, blocks_now(request.prompt_tokens, produced + k,
                                                request.sequences)
                                  - len(own_keys) * per_key)
                    keys.update(own_keys)
            held.append(blocks + len(keys) * per_key)
        return held

    @precondition(lambda self: self.pending)
    @rule(index=st.integers(0, 100))
    def cancel(self, index: int) -> None:
        self.pending[index % len(self.pending)].task.cancel()
        self.settle()

    @rule(num_blocks=st.integers(10, 80))
    def capacity_change(self, num_blocks: int) -> None:
        self.allowed_excess = max(self.allowed_excess, max(self.held_ahead(), default=0))
        self.ctl.update_server(ServerState(num_blocks=num_blocks))
        self.settle()

    @rule(seconds=st.floats(0.0, 30.0))
    def time_passes(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.settle()

    @invariant()
    def held_never_exceeds_target_at_any_step_ahead(self) -> None:
        target = self.ctl.ledger.target_blocks
        held = self.held_ahead()
        peak = max(held, default=0)
        assert peak <= max(target, self.allowed_excess), (peak, target, held[:8])
        # Requests admitted before a capacity cut drain away; new ones respect the target.
        self.allowed_excess = min(self.allowed_excess, peak)

    @invariant()
    def every_admitted_request_holds_exactly_one_reservation(self) -> None:
        assert self.ctl.ledger.reservations == len(self.running) == self.ctl.inflight
        assert self.ctl.ledger.reserved_blocks == sum(t.reservation.blocks
                                                      for t, _ in self.running)

    @invariant()
    def queue_matches_waiting_clients(self) -> None:
        assert len(self.ctl.queue) == len(self.pending)
        assert self.ctl.queue.blocks >= 0

    @invariant()
    def no_band_starves_beyond_its_bound(self) -> None:
        assert not self.starvation_violations, self.starvation_violations

    @invariant()
    def fcfs_within_band_and_tenant(self) -> None:
        groups: dict[tuple[int, str], list[tuple[int, int]]] = {}
        for ticket, item in self.admitted:
            groups.setdefault((item.request.band, item.request.tenant), []).append(
                (item.seq, ticket.key))
        for admitted in groups.values():
            by_arrival = [key for _, key in sorted(admitted)]
            assert by_arrival == sorted(by_arrival)

    def teardown(self) -> None:
        try:
            for item in self.pending:
                item.task.cancel()
            self.settle()
            for ticket, _ in self.running:
                ticket.finish(completed=False)
            self.running.clear()
            self.settle()
            # Nothing runs, nothing waits: the ledger is back at zero.
            assert self.ctl.ledger.reserved_blocks == 0
            assert self.ctl.ledger.reservations == 0
            assert self.ctl.ledger.overcommit_blocks == 0
            assert len(self.ctl.queue) == 0 and self.ctl.queue.blocks == 0
        finally:
            self.loop.close()


AdmissionMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAdmissionProperties = AdmissionMachine.TestCase


class QuantileMachine(AdmissionMachine):
    """The same invariants with the learned-quantile output policy (overcommit)."""

    def __init__(self) -> None:
        super().__init__()
        self.ctl = controller(
            num_blocks=41, clock=self.clock, starvation_bound_s=None,
            output_policy="quantile", max_overcommit_ratio=0.3,
            limits=QueueLimits(max_length=12, max_wait_s=60.0),
        )

    @invariant()
    def no_band_starves_beyond_its_bound(self) -> None:
        return None

    def output_limit(self, ticket: Ticket, tokens: int) -> int:
        # Without max_tokens the server may run past the learned reservation.
        if ticket.request.max_tokens is None:
            return tokens
        return min(tokens, ticket.request.max_tokens)

    @invariant()
    def held_never_exceeds_target_at_any_step_ahead(self) -> None:
        # Requests that outgrow a learned reservation may grow past the target;
        # admissions themselves never do.
        target = self.ctl.ledger.target_blocks
        grown = sum(max(0, t.reservation.blocks - t.cost.kv_blocks) for t, _ in self.running)
        peak = max(self.held_ahead(), default=0)
        assert peak - grown <= max(target, self.allowed_excess), (peak, grown, target)
        self.allowed_excess = min(self.allowed_excess, peak)


QuantileMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestQuantileProperties = QuantileMachine.TestCase


class OutcomeLog:
    """The controller's listener: the decisions it reports (what the metrics count)."""

    def __init__(self) -> None:
        self.reported: Counter[Outcome] = Counter()
        self.shadow: Counter[Outcome] = Counter()

    def decided(self, decision: Decision, *, shadow: bool) -> None:
        (self.shadow if shadow else self.reported)[decision.outcome] += 1

    def queue_wait(self, seconds: float) -> None:
        return None


def test_outcomes_seen_cover_the_decision_kinds() -> None:
    """The machine's world really produces every decision its clients can meet
    (admission, never fits, queue full, deadline, queue timeout, cancellation), and the
    controller reports each one, once per request, as the client met it."""
    log = OutcomeLog()
    seen: Counter[Outcome] = Counter()

    class Watched(AdmissionMachine):
        def __init__(self) -> None:
            super().__init__()
            self.ctl.listener = log

        def teardown(self) -> None:
            try:
                super().teardown()
            finally:
                seen.update(self.client_outcomes)

    run_state_machine_as_test(Watched, settings=settings(
        max_examples=60, stateful_step_count=40, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow]))
    produced = {Outcome.ADMITTED, Outcome.NEVER_FITS, Outcome.QUEUE_FULL, Outcome.DEADLINE,
                Outcome.QUEUE_TIMEOUT, Outcome.CANCELLED}
    missing = produced - {outcome for outcome, count in seen.items() if count}
    assert not missing, f"no client met {sorted(missing)}; met {dict(seen)}"
    # Every outcome a client met was reported once, and nothing else was.
    assert log.reported == seen, (dict(log.reported), dict(seen))
    assert not log.shadow


def family_keys(family: int, blocks: int, unique: int) -> tuple[bytes, ...]:
    """Prompt block keys: `blocks` shared by every prompt of the family, then a tail."""
    from sidecar.admission.prefix import block_keys

    tokens = [family * 1000 + i for i in range(blocks * 16)] + [
        7_000_000 + unique * 100 + i for i in range(32)]
    return block_keys(tokens, 16)


class PrefixMachine(AdmissionMachine):
    """The same invariants with prompts that share prefixes: shared prompt blocks are
    counted once, held by reference and freed with their last holder."""

    def __init__(self) -> None:
        super().__init__()
        self.unique = itertools.count()

    @rule(family=st.integers(0, 2), blocks=st.integers(0, 20), output=st.integers(1, 300),
          band=st.integers(0, 2), tenant=st.sampled_from("abc"))
    def arrive_with_prefix(self, family: int, blocks: int, output: int, band: int,
                           tenant: str) -> None:
        keys = family_keys(family, blocks, next(self.unique))
        request = AdmissionRequest(blocks * 16 + 40, output, band=band, tenant=tenant,
                                   block_keys=keys)
        task = self.loop.create_task(self.ctl.admit(request))
        self.pending.append(Pending(task, request, next(self.seq)))
        self.settle()

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100))
    def prefilled(self, index: int) -> None:
        ticket, _ = self.running[index % len(self.running)]
        ticket.first_token()
        self.settle()

    @invariant()
    def every_admitted_request_holds_exactly_one_reservation(self) -> None:
        ledger = self.ctl.ledger
        assert ledger.reservations == len(self.running) == self.ctl.inflight
        held: dict[bytes, int] = {}
        for ticket, _ in self.running:
            for key in ticket.reservation.keys:
                held[key] = held.get(key, 0) + 1
        # No shared block is freed while a running request holds it, and none is kept
        # once nothing holds it.
        assert all(ledger.holders(key) == count for key, count in held.items())
        assert ledger.shared_keys == len(held)
        # Of them, those whose holders' blocks the server has filled, exactly.
        filled: dict[bytes, int] = {}
        for ticket, _ in self.running:
            if ticket.reservation.filled:
                for key in ticket.reservation.keys:
                    filled[key] = filled.get(key, 0) + 1
        assert dict(ledger.filled_holder_counts) == filled
        own = sum(t.reservation.blocks for t, _ in self.running)
        assert ledger.reserved_blocks == own + len(held) * ledger.blocks_per_key

    @invariant()
    def the_room_knows_which_blocks_one_running_request_holds(self) -> None:
        # Kept as requests come and go; counted here from scratch.
        holders: dict[bytes, int] = {}
        for ticket, _ in self.running:
            for key in ticket.reservation.keys:
                holders[key] = holders.get(key, 0) + 1
        for ticket, _ in self.running:
            alone = sum(1 for key in ticket.reservation.keys if holders[key] == 1)
            assert self.ctl.room.exclusive_keys(ticket) == alone


PrefixMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPrefixProperties = PrefixMachine.TestCase


class ChunkedPrefixMachine(PrefixMachine):
    """The same with vLLM's --long-prefill-token-threshold (1 block and 7 tokens): a
    newcomer shares a held prefix only up to what the server has cached plus one chunk,
    and holds its own copy of the rest beside the holder's."""

    def __init__(self) -> None:
        super().__init__()
        from dataclasses import replace

        from sidecar.admission import CostModel

        from support.admission_fixtures import tiny_served

        served = tiny_served(41)
        served.deployment = replace(served.deployment, long_prefill_token_threshold=23)
        self.ctl.set_cost_model(CostModel(served))


ChunkedPrefixMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestChunkedPrefixProperties = ChunkedPrefixMachine.TestCase


SLIDING = {"model_type": "mistral", "hidden_size": 128, "intermediate_size": 256,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
           "head_dim": 32, "sliding_window": 64, "vocab_size": 1024,
           "max_position_embeddings": 1024, "torch_dtype": "bfloat16"}


class SlidingMachine(AdmissionMachine):
    """The same invariants on a sliding-window model, where a reservation shrinks from
    its prefill peak to its window once the request decodes."""

    def __init__(self) -> None:
        super().__init__()
        from sidecar.admission import AdmissionController, AdmissionSettings, CostModel

        from support.admission_fixtures import tiny_served

        self.ctl = AdmissionController(
            CostModel(tiny_served(41, config=SLIDING)),
            AdmissionSettings(starvation_bound_s=None,
                              limits=QueueLimits(max_length=12, max_wait_s=60.0)),
            clock=self.clock)
        self.ctl.update_server(ServerState(available=True))
        self.shrunk = 0

    @invariant()
    def no_band_starves_beyond_its_bound(self) -> None:
        return None

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100))
    def decodes(self, index: int) -> None:
        """Two engine steps (every running request gains two tokens), watching one
        request's reservation shrink past its prefill."""
        ticket, _ = self.running[index % len(self.running)]
        before = ticket.reservation.blocks
        self.engine_steps(2)
        if ticket.finished:
            return
        self.shrunk += ticket.reservation.blocks < before
        # Never below what the request holds from here on.
        request = ticket.request
        ahead = self.ctl.cost_model.peak_blocks(request.prompt_tokens,
                                                ticket.reserved_output_tokens,
                                                request.sequences, ticket.output_tokens)
        assert ticket.reservation.blocks >= ahead


SlidingMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSlidingProperties = SlidingMachine.TestCase


def test_sliding_reservations_do_shrink() -> None:
    """The sliding machine's world really shrinks reservations (not vacuous)."""
    machine = SlidingMachine()
    try:
        machine.arrive(300, 200, 1, "a", None)
        ticket, _ = machine.running[0]
        peak = ticket.reservation.blocks
        machine.decodes(0)
        assert ticket.reservation.blocks < peak and machine.shrunk == 1
    finally:
        machine.teardown()
