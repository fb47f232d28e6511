"""The KV blocks one request holds over its life, step by step, as vLLM's allocator
holds them (`KVCacheManager.allocate_slots` in vLLM v1).

A request is prefilled in chunks of at most `chunk_tokens` (vLLM's
max_num_batched_tokens), then decodes one token per step. Before each step vLLM
frees the blocks that fell out of a sliding window (on the basis of the tokens
already processed: with asynchronous scheduling, on by default, the previous step
is still in flight), then allocates blocks for the tokens of the step. So:

- full-attention groups grow to cdiv(prompt + output - 1, block) at the last step
  (the last sampled token is never fed back);
- sliding-window groups peak during the prefill (the whole chunk is written before
  anything is freed) and then hold about window / block + 1 blocks while decoding;
- state groups (Mamba) hold a constant number of blocks.

`peak_blocks(prompt, output, done)` is the most the request will hold from the
point where it has produced `done` output tokens to its end: the reservation still
needed. It is exact for one recycling group; with several recycling groups of
different block sizes it may exceed the true peak by at most one block per group.

Worked example (vLLM 0.32 CPU, a 256-token sliding window, blocks of 32 tokens,
a 450-token prompt in one chunk, 300 output tokens): the prefill step holds
cdiv(450, 32) = 15 blocks, the first decode step cdiv(451, 32) = 15 (the prefill is
still in flight, nothing is freed yet), and decoding then holds 9-10 blocks. A
full-attention model holds cdiv(749, 32) = 24 blocks at its last step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from sidecar.model.capacity import KVLayout


@dataclass(frozen=True)
class Step:
    computed_tokens: int
    new_tokens: int
    settled_tokens: int


class KVLifecycle:
    def __init__(self, layout: KVLayout, chunk_tokens: int, in_flight_steps: int = 1) -> None:
        if chunk_tokens < 1:
            raise ValueError("the chunk (max_num_batched_tokens) must be >= 1 token")
        self.layout = layout
        self.chunk_tokens = chunk_tokens
        self.in_flight_steps = max(0, in_flight_steps)
        self.peak_blocks = lru_cache(maxsize=65_536)(self._peak_blocks)
        # Where no group frees blocks as a request advances, what it holds depends only
        # on its tokens so far (`blocks_now`, read for every running request as room is
        # judged).
        self._growing = not layout.recycles_blocks
        self._held_by_tokens = lru_cache(maxsize=65_536)(self._held_for)

    def prefill_steps(self, prompt_tokens: int) -> list[Step]:
        steps: list[Step] = []
        done = 0
        previous: list[int] = []
        while done < prompt_tokens:
            size = min(self.chunk_tokens, prompt_tokens - done)
            steps.append(Step(done, size, done - sum(previous[-self.in_flight_steps:])
                              if self.in_flight_steps else done))
            previous.append(size)
            done += size
        return steps

    def decode_step(self, prompt_tokens: int, produced: int) -> Step:
        """The step that samples output token `produced + 1` (1 <= produced)."""
        computed = prompt_tokens + produced - 1
        if produced == 1:
            # The last prefill chunk may still be in flight.
            chunk = (prompt_tokens - 1) % self.chunk_tokens + 1 if prompt_tokens else 0
            in_flight = chunk if self.in_flight_steps else 0
        else:
            in_flight = min(self.in_flight_steps, produced - 1)
        return Step(computed, 1, max(0, computed - in_flight))

    def held(self, step: Step) -> int:
        return self.layout.blocks_in_step(step.computed_tokens, step.new_tokens,
                                          step.settled_tokens)

    def blocks_now(self, prompt_tokens: int, produced: int) -> int:
        """Blocks held once `produced` output tokens exist (0: the prompt is cached)."""
        if self._growing:
            tokens = prompt_tokens + max(0, produced)
            return self._held_by_tokens(tokens) if tokens else 0
        if produced <= 0:
            return self.held(Step(0, prompt_tokens, 0)) if prompt_tokens else 0
        return self.held(self.decode_step(prompt_tokens, produced))

    def _held_for(self, tokens: int) -> int:
        """What a sequence of `tokens` tokens holds in a layout that only grows: as the
        step that writes its last token holds (its prefill, or a decode step: every group
        holds its blocks for all the tokens written, whatever has been processed)."""
        return self.held(Step(0, tokens, 0))

    def growth_bound(self, allocated_tokens: int) -> tuple[float, float]:
        """(offset_blocks, blocks_per_token) per sequence: holding the slots of
        `allocated_tokens` tokens, `k` tokens later it holds at most
        offset + k x blocks_per_token more blocks.

        Every group takes a new block only when the token count crosses a multiple of
        its block size (sliding windows also free some, compressed and state groups take
        fewer), so k more tokens add at most cdiv(k - free, block) blocks to a group
        with `free` slots left in its last block, which is at most
        (k + block - 1 - free) / block. Worked example: blocks of 32 tokens, 40 tokens
        allocated (24 slots free): 24 more tokens add none, 25 add one; the bound gives
        7/32 + k/32."""
        offset = per_token = 0.0
        for group in self.layout.groups:
            size = group.block_size
            free = -allocated_tokens % size
            offset += (size - 1 - free) / size
            per_token += 1 / size
        return offset, per_token

    def prefill_step_count(self, prompt_tokens: int) -> int:
        """Engine steps the prefill of `prompt_tokens` tokens takes (chunks)."""
        return max(1, -(-prompt_tokens // self.chunk_tokens))

    def _peak_blocks(self, prompt_tokens: int, output_tokens: int, produced: int = 0) -> int:
        """The most the request holds from `produced` output tokens to its end, when it
        stops after `output_tokens` output tokens."""
        if prompt_tokens <= 0 and output_tokens <= 0:
            return 0
        peak = 0
        if produced <= 0:
            for step in self.prefill_steps(prompt_tokens):
                peak = max(peak, self.held(step))
        first = max(1, produced)
        last = output_tokens - 1  # the step that samples the last token
        if last < first:
            return peak
        candidates = {first, first + 1, last}
        if self.layout.recycles_blocks:
            # Growing groups peak at the end; recycling groups repeat with the period
            # of their block size: the last two periods hold the decode peak.
            span = 2 * self.layout.largest_block_size
            candidates.update(range(max(first, last - span), last + 1))
        for produced_at in candidates:
            if first <= produced_at <= last:
                peak = max(peak, self.held(self.decode_step(prompt_tokens, produced_at)))
        return peak
