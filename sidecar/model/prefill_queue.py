"""When a prompt's prefill ends behind others, under vLLM's long-prefill threshold.

vLLM 0.32 schedules prefills first come, first served within each step's token budget,
and with `--long-prefill-token-threshold T` gives no prompt more than `T` tokens of a
step while more than one request is eligible (`Scheduler.schedule`). Prompts admitted
together then advance side by side: a short prompt behind a long one gets a chunk of
its own in the first step with budget left, not after the long one ends.

`prefill_behind` walks those steps for one prompt behind others. An allocation (each
prompt's tokens in a step) repeats until a prompt ends or has fewer tokens left than it
was given, so the walk jumps from one such change to the next: at most two per prompt.

Example: budget 2,048, T = 256, ten prompts of 1,000 tokens ahead and one more of
1,000. Each step the first eight get 256 (the budget is spent), for three steps, then
232 each with 192 left for the ninth; from step 5 the ninth, tenth and eleventh get 256
each, and the eleventh's last chunk is scheduled in step 8.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillBehind:
    steps: int  # until the prompt's last token is scheduled (its first token then)
    tokens: int  # prompt tokens of all the prompts scheduled in those steps


def prefill_behind(ahead: Sequence[int], own: int, budget: int, cap: int,
                   others: bool = True) -> PrefillBehind:
    """Steps until a prompt of `own` tokens is prefilled behind prompts with `ahead`
    tokens left (in the order vLLM took them in), each step `budget` tokens (the token
    budget less the decodes beside), no prompt more than `cap` of them while another
    request is eligible (`others`: requests beside these prompts are, e.g. decoding
    ones; a prompt alone gets the whole budget)."""
    if budget < 1 or cap < 1:
        raise ValueError("budget and cap must be >= 1 token")
    left = [tokens for tokens in ahead if tokens > 0]
    left.append(max(1, own))
    steps = scheduled = 0
    while True:
        alone = len(left) == 1 and not others
        room = budget
        grants: list[int] = []  # the first prompts', until the budget is spent
        for tokens in left:
            if room == 0:
                break
            limit = tokens if alone or tokens < cap else cap
            grant = limit if limit < room else room
            grants.append(grant)
            room -= grant
        given = len(grants)
        mine = grants[-1] if given == len(left) else 0
        # The allocation repeats while every prompt given tokens has that many left.
        repeats = left[0] // grants[0]
        for index in range(1, given):
            repeats = min(repeats, left[index] // grants[index])
        if mine > 0 and left[-1] <= repeats * mine:
            last = -(-left[-1] // mine)
            taken = 0
            for index in range(given):
                taken += min(left[index], last * grants[index])
            return PrefillBehind(steps + last, scheduled + taken)
        steps += repeats
        spent = 0
        kept: list[int] = []
        for index in range(given):
            spent += grants[index]
            rest = left[index] - repeats * grants[index]
            if rest > 0:
                kept.append(rest)
        scheduled += repeats * spent
        kept.extend(left[given:])
        left = kept
