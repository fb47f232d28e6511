"""The ledger of KV reservations.

Ownership: `reserve` hands out a `Reservation`; its holder settles it exactly once
with `release()`. Releasing again does nothing and returns False, so a `finally`
block can always release; the ledger never settles a reservation on its own. A
reservation can grow or shrink (`resize`) while it is held.

Shared prompt blocks: a reservation may also hold references to prompt blocks
(`keys`, see `prefix`), each worth `blocks_per_key` blocks (one per KV cache group
that shares prompt blocks). A block counts once, however many reservations hold
it, and is freed when its last holder releases. `reserved_blocks` is the sum of the
reservations' own blocks plus the distinct shared blocks held. A reservation whose
request has been prefilled is marked `filled` (its blocks are then in the server's
prefix cache, which `prefix.TrafficCache` models).

Headroom reconciles what kvgate reserved with what the server reports it really
uses: at an observation, the effective use is the larger of the reservations and the
observed use plus the growth still to come for the running requests (prefix-cache hits
make the observed use lower; traffic that bypasses the sidecar makes it higher). The
excess of the second over the first is taken as held by others until the next
observation, while kvgate's own part follows its reservations as they are made and
released: the effective use is the reservations now plus that excess.

Data parallelism (`engines` > 1, vLLM's --data-parallel-size): every engine has its
own pool of `capacity_blocks` blocks and a request runs on one engine, so it must fit
in one engine's headroom; it never spans pools. A reservation is placed on an engine
(`Reservation.engine`): the one already holding most of its shared prompt blocks
(prefix caching is per engine), then the one with the most headroom. Shared prompt
blocks are counted per engine. The placement only holds if the request is sent to
that engine (vLLM's `X-data-parallel-rank` header): vLLM's own balancer picks engines
by load, not by KV room. The observed use is read as the engines' average.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


class LedgerError(Exception):
    """A broken invariant: a bug, never a user error. (An `Exception`: mypyc compiles
    no subclass of `RuntimeError`.)"""


class Reservation:
    __slots__ = ("_filled", "_ledger", "_released", "blocks", "engine", "key", "keys",
                 "worst_case_blocks")

    def __init__(self, ledger: Ledger, key: int, blocks: int, worst_case_blocks: int,
                 keys: tuple[bytes, ...] = (), engine: int = 0) -> None:
        self._ledger = ledger
        self._released = False
        self._filled = False
        self.key = key
        self.blocks = blocks  # its own, not counting the shared prompt blocks
        self.worst_case_blocks = worst_case_blocks
        self.keys = keys  # shared prompt blocks it holds a reference on
        self.engine = engine  # the data-parallel engine whose pool it draws on

    @property
    def filled(self) -> bool:
        return self._filled

    def mark_filled(self) -> bool:
        """Its prompt blocks are on the server now, and stay there while it runs. True
        the first time only."""
        if self._released or self._filled:
            return False
        self._filled = True
        self._ledger._fill(self)
        return True

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> bool:
        """Give the blocks back. True the first time, False (and nothing) after."""
        if self._released:
            return False
        self._released = True
        self._ledger._settle(self)
        return True

    def resize(self, blocks: int) -> None:
        """Hold `blocks` blocks from now on (a request that outgrew its reservation)."""
        if self._released:
            raise LedgerError(f"reservation {self.key} resized after release")
        if blocks < 0:
            raise LedgerError("a reservation cannot hold negative blocks")
        self._ledger._adjust(self, blocks)

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        return f"Reservation({self.key}, {self.blocks} blocks, {state})"


@dataclass(frozen=True)
class LedgerSnapshot:
    capacity_blocks: int
    target_blocks: int
    reserved_blocks: int
    observed_used_blocks: int | None
    effective_used_blocks: int
    headroom_blocks: int
    reservations: int
    overcommit_blocks: int
    held_prompt_blocks: int = 0
    engine_used_blocks: tuple[int, ...] = ()  # effective use per engine (DP > 1)


class Ledger:
    def __init__(self, capacity_blocks: int, target_ratio: float = 0.95,
                 engines: int = 1) -> None:
        """`capacity_blocks` is one engine's pool; `engines` the data-parallel size."""
        if not 0.0 < target_ratio <= 1.0:
            raise ValueError(f"KV target ratio must be in (0, 1], got {target_ratio}")
        if capacity_blocks < 0:
            raise ValueError("KV capacity cannot be negative")
        if engines < 1:
            raise ValueError(f"the data-parallel size must be at least 1, got {engines}")
        self.capacity_blocks = capacity_blocks
        self.target_ratio = target_ratio
        self.engines = engines
        self._keys = itertools.count(1)
        self._held: dict[int, Reservation] = {}
        self._reserved = 0
        self._reserved_by_engine = [0] * engines
        self._overcommit = 0
        self.observed_used_blocks: int | None = None
        self.observed_growth_blocks = 0
        # What the last observation showed beyond the reservations then (per engine).
        self._excess_by_engine = [0] * engines
        self.blocks_per_key = 1
        self._holders: dict[bytes, int] = {}
        # Of those, the holders whose prompt blocks the server has filled: running
        # requests, whose blocks vLLM cannot evict (all engines).
        self._filled_holders: dict[bytes, int] = {}
        # Per engine; with one engine, the same dictionary as `_holders`.
        self._engine_holders: list[dict[bytes, int]] = (
            [self._holders] if engines == 1 else [{} for _ in range(engines)])

    # ---- reservations --------------------------------------------------------------

    def reserve(self, blocks: int, worst_case_blocks: int | None = None,
                keys: tuple[bytes, ...] = (), engine: int | None = None) -> Reservation:
        """Hold `blocks` blocks (plus references on `keys`) on `engine`, or on the
        engine `place` picks (the one with the most headroom when none fits)."""
        if blocks < 0:
            raise LedgerError("cannot reserve negative blocks")
        if len(set(keys)) != len(keys):
            raise LedgerError("a reservation holds each shared block once")
        if engine is None and self.engines == 1:
            engine = 0
        elif engine is None:
            engine = self.place(blocks, keys)
            if engine is None:
                engine = max(range(self.engines), key=self._engine_headroom)
        if not 0 <= engine < self.engines:
            raise LedgerError(f"engine {engine} is not one of the {self.engines} engines")
        worst = blocks if worst_case_blocks is None else max(blocks, worst_case_blocks)
        reservation = Reservation(self, next(self._keys), blocks, worst, keys, engine)
        self._held[reservation.key] = reservation
        self._reserved += blocks
        self._reserved_by_engine[engine] += blocks
        self._overcommit += worst - blocks
        for holders in self._holders_of(engine):
            for key in keys:
                holders[key] = holders.get(key, 0) + 1
        return reservation

    def _holders_of(self, engine: int) -> tuple[dict[bytes, int], ...]:
        """The reference counts a reservation on `engine` moves: all engines' and its
        own (one dictionary with a single engine)."""
        if self.engines == 1:
            return (self._holders,)
        return (self._holders, self._engine_holders[engine])

    def place(self, blocks: int, keys: tuple[bytes, ...] = ()) -> int | None:
        """The engine a request of `blocks` own blocks and shared prompt blocks `keys`
        fits on now, or None: among those where it fits (its own blocks plus the
        prompt blocks that engine does not hold yet), the one holding most of its
        prompt blocks, then the one with the most headroom, then the lowest index."""
        best: tuple[int, int, int] | None = None
        for engine in range(self.engines):
            holders = self._engine_holders[engine]
            held = sum(1 for key in keys if key in holders)
            charge = blocks + (len(keys) - held) * self.blocks_per_key
            headroom = self._engine_headroom(engine)
            if charge <= headroom and (best is None or (held, headroom) > best[:2]):
                best = (held, headroom, engine)
        return None if best is None else best[2]

    def _settle(self, reservation: Reservation) -> None:
        if self._held.pop(reservation.key, None) is not reservation:
            raise LedgerError(f"{reservation!r} is not held by this ledger")
        self._reserved -= reservation.blocks
        self._reserved_by_engine[reservation.engine] -= reservation.blocks
        self._overcommit -= reservation.worst_case_blocks - reservation.blocks
        counted = self._holders_of(reservation.engine)
        if reservation.filled:
            counted += (self._filled_holders,)
        for holders in counted:
            for key in reservation.keys:
                left = holders[key] - 1
                if left < 0:
                    raise LedgerError("a shared block was released more often than held")
                if left:
                    holders[key] = left
                else:
                    del holders[key]

    def _fill(self, reservation: Reservation) -> None:
        if self._held.get(reservation.key) is not reservation:
            raise LedgerError(f"{reservation!r} is not held by this ledger")
        filled = self._filled_holders
        for key in reservation.keys:
            filled[key] = filled.get(key, 0) + 1

    def _adjust(self, reservation: Reservation, blocks: int) -> None:
        if self._held.get(reservation.key) is not reservation:
            raise LedgerError(f"{reservation!r} is not held by this ledger")
        self._overcommit -= reservation.worst_case_blocks - reservation.blocks
        self._reserved += blocks - reservation.blocks
        self._reserved_by_engine[reservation.engine] += blocks - reservation.blocks
        reservation.blocks = blocks
        reservation.worst_case_blocks = max(reservation.worst_case_blocks, blocks)
        self._overcommit += reservation.worst_case_blocks - blocks

    # ---- capacity and observation --------------------------------------------------

    def set_capacity(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError("KV capacity cannot be negative")
        self.capacity_blocks = capacity_blocks

    def observe(self, used_blocks: int | None, growth_blocks: int = 0,
                finished_blocks: Sequence[int] = ()) -> None:
        """The server's own KV use and the growth its running requests still have;
        `finished_blocks` (per engine): blocks the figure may still count for requests
        that finished since the scrape was sent, not others' use."""
        self.observed_used_blocks = used_blocks
        self.observed_growth_blocks = max(0, growth_blocks)
        if used_blocks is None:
            self._excess_by_engine = [0] * self.engines
            return
        growth = -(-self.observed_growth_blocks // self.engines)  # the engines' average
        finished = list(finished_blocks) + [0] * (self.engines - len(finished_blocks))
        self._excess_by_engine = [
            max(0, used_blocks + growth - finished[e] - self._engine_reserved(e))
            for e in range(self.engines)]

    # ---- questions -----------------------------------------------------------------

    def holders(self, key: bytes) -> int:
        """Admitted requests holding this prompt block (on any engine)."""
        return self._holders.get(key, 0)

    @property
    def holder_counts(self) -> Mapping[bytes, int]:
        """`holders` of every prompt block held (a block no request holds is absent):
        for loops over a prompt's blocks."""
        return self._holders

    @property
    def filled_holder_counts(self) -> Mapping[bytes, int]:
        """Of `holder_counts`, the holders the server has filled the prompt blocks of:
        blocks it keeps until they finish."""
        return self._filled_holders

    @property
    def held_prompt_blocks(self) -> int:
        """Distinct prompt blocks held by reference (each counted once per engine that
        holds it), in blocks."""
        return self.shared_keys * self.blocks_per_key

    @property
    def shared_keys(self) -> int:
        if self.engines == 1:
            return len(self._holders)
        return sum(len(holders) for holders in self._engine_holders)

    @property
    def reserved_blocks(self) -> int:
        return self._reserved + self.held_prompt_blocks

    @property
    def overcommit_blocks(self) -> int:
        """Blocks the learned-quantile policy did not reserve (worst case - reserved)."""
        return self._overcommit

    @property
    def reservations(self) -> int:
        return len(self._held)

    @property
    def target_blocks(self) -> int:
        # The tolerance keeps a product the float arithmetic leaves just short of an
        # integer (90 x 0.7 = 62.99...) at that integer.
        return int(self.capacity_blocks * self.target_ratio + 1e-9)

    @property
    def effective_used_blocks(self) -> int:
        """What the engine with the most headroom effectively uses (the only engine
        with data parallelism 1)."""
        if self.engines > 1:
            return self._engine_used(max(range(self.engines), key=self._engine_headroom))
        return self.reserved_blocks + self._excess_by_engine[0]

    def _engine_reserved(self, engine: int) -> int:
        return (self._reserved_by_engine[engine]
                + len(self._engine_holders[engine]) * self.blocks_per_key)

    def _engine_used(self, engine: int) -> int:
        return self._engine_reserved(engine) + self._excess_by_engine[engine]

    def _engine_headroom(self, engine: int) -> int:
        return self.target_blocks - self._engine_used(engine)

    @property
    def headroom_blocks(self) -> int:
        """The most one request can get now: one engine's headroom, never the sum."""
        return self.target_blocks - self.effective_used_blocks

    def fits(self, blocks: int) -> bool:
        return blocks <= self.headroom_blocks

    def held(self) -> list[Reservation]:
        return list(self._held.values())

    def snapshot(self) -> LedgerSnapshot:
        return LedgerSnapshot(
            capacity_blocks=self.capacity_blocks,
            target_blocks=self.target_blocks,
            reserved_blocks=self.reserved_blocks,
            observed_used_blocks=self.observed_used_blocks,
            effective_used_blocks=self.effective_used_blocks,
            headroom_blocks=self.headroom_blocks,
            reservations=len(self._held),
            overcommit_blocks=self._overcommit,
            held_prompt_blocks=self.held_prompt_blocks,
            engine_used_blocks=(tuple(self._engine_used(e) for e in range(self.engines))
                                if self.engines > 1 else ()),
        )
