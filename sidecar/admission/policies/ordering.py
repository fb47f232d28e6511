"""Ordering: which request of one tenant's queue goes next?

- `Fcfs` (first come, first served): by arrival. Inputs: arrival sequence number.
  Trade-off: simple and predictable; a request with a tight TTFT target can wait
  behind relaxed ones.
- `EarliestDeadline` (EDF): by deadline (arrival + TTFT target), requests without a
  target after all those with one, FCFS among equals. Inputs: deadline, sequence.
  Trade-off: meets more deadlines under load; requests without targets wait longer
  while tight ones keep arriving.

A policy returns a sort key; smaller goes first. Keys must be fixed at arrival.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol


@dataclass(frozen=True)
class EntryView:
    seq: int  # arrival order, unique
    arrival_s: float
    deadline_s: float | None


class OrderingPolicy(Protocol):
    name: ClassVar[str]

    def key(self, entry: EntryView) -> tuple[float, int]: ...


@dataclass(frozen=True)
class Fcfs:
    name: ClassVar[str] = "fcfs"

    def key(self, entry: EntryView) -> tuple[float, int]:
        return (float(entry.seq), entry.seq)


@dataclass(frozen=True)
class EarliestDeadline:
    name: ClassVar[str] = "edf"

    def key(self, entry: EntryView) -> tuple[float, int]:
        deadline = float("inf") if entry.deadline_s is None else entry.deadline_s
        return (deadline, entry.seq)
