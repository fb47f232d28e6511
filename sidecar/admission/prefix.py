"""Prefix caching as vLLM does it: which prompt blocks a request shares with the
requests already admitted, and which the server has cached.

vLLM cuts each prompt into full blocks and keys each block by its parent's key and
its own token ids (plus the LoRA adapter, a `cache_salt`, multimodal inputs: where
kvgate cannot know what vLLM adds, the request gets no keys and shares nothing).
A new request reuses the longest run of leading blocks the server has cached, up
to its prompt less one token (the last prompt token is always computed).

What this module decides, for the admission core (no I/O):

- `block_keys`: kvgate's own chain of keys for a prompt's token ids. They are not
  vLLM's hashes (vLLM seeds its hashes at random per process); the server's events
  are mapped onto them by their token ids (`EventCache`).
- Which blocks the server has cached (`ServerCache`): from vLLM's KV cache events
  when they flow (`EventCache`), else from a model of the server's cache fed by
  kvgate's own traffic (`TrafficCache`).
- `PrefixIndex.plan`: for one request, the leading prompt blocks it will really
  share with admitted requests, the blocks it will hold a reference on, and the
  prompt tokens the server will not prefill again.

When vLLM really shares: it registers a block for reuse when it schedules the chunk
that fills it, and a request scheduled later (in the same step or after) reuses it.
With vLLM's first-come-first-served scheduling a waiting request gets tokens only
once the requests ahead of it have had their whole prompts scheduled (a running
prefill takes the token budget first; if the budget runs out, nothing behind it is
scheduled in that step). So two admitted requests with a common prefix hold one copy
of it, whichever of them vLLM schedules first: a block held by an admitted request is
shared, whether or not its holder has been prefilled yet. Measured on vLLM 0.32 CPU:
16 requests with a new 960-token prefix sent at once, 15 x 960 prefix-hit tokens in
vLLM's own counter (bench/prefix_burst.py). A block beyond a request's last
possible hit (its last prompt token is always computed) is a copy of its own.

With vLLM's --long-prefill-token-threshold T, a prefill takes at most T tokens a step
while others are eligible, and the budget left goes to the requests behind it: a
request behind a holder not yet prefilled is sure to find only the holder's first chunk,
or the blocks running requests hold filled where they reach further
(`PrefixIndex.prefill_chunk_tokens`), and holds its own copy of the rest.

Sharing saves blocks only in the KV cache groups that keep a request's prompt blocks
for its whole life (full attention, MLA); sliding-window and state groups are
charged per request.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from sidecar.admission.quick_init import quick_init

ROOT_KEY = b"kvgate-prefix-root"
_KEY_BYTES = 16
TOKEN_BYTES = 8  # each token id as a signed 64-bit integer ("q")


def block_keys(token_ids: Sequence[int], block_size: int, salt: bytes = b"") -> tuple[bytes, ...]:
    """One key per full block of `token_ids`, each chained on its parent's key."""
    if block_size < 1:
        raise ValueError("block size must be >= 1")
    return extend_keys((), token_bytes(token_ids), block_size, salt)


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """The ids as the bytes block keys hash (every block's from one conversion)."""
    return array("q", token_ids).tobytes()


def extend_keys(known: tuple[bytes, ...], data: bytes, block_size: int,
                salt: bytes = b"") -> tuple[bytes, ...]:
    """The keys of every full block of `data` (`token_bytes` of a prompt), given
    `known`, the keys of its first len(known) blocks: only the rest are hashed."""
    keys = list(known)
    parent = known[-1] if known else (salt or ROOT_KEY)
    step = block_size * TOKEN_BYTES
    for start in range(len(known) * step, len(data) - step + 1, step):
        parent = _chained(parent, data[start:start + step])
        keys.append(parent)
    return tuple(keys)


def chain_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    return _chained(parent, array("q", tokens).tobytes())


def _chained(parent: bytes, block: bytes) -> bytes:
    """A block's key: its parent's key and its token ids' bytes."""
    return hashlib.blake2b(parent + block, digest_size=_KEY_BYTES).digest()


class ServerCache(Protocol):
    """Which prompt blocks the server holds in its prefix cache (running or free)."""

    @property
    def source(self) -> str: ...

    def cached(self, key: bytes) -> bool: ...


class EventCache:
    """The server's cache as its KV cache events describe it.

    vLLM's `BlockStored` events carry the blocks' token ids and the parent's hash;
    each block is mapped to kvgate's key of the same tokens under the parent's key.
    A block whose parent is unknown (events missed) cannot be keyed and is ignored
    until the server stores it again. A block counts as cached when every KV cache
    group that reported events holds it. Size is bounded by `max_blocks` (oldest
    first out), in case removals were missed.
    """

    source = "events"

    def __init__(self, block_size: int, max_blocks: int = 1 << 20) -> None:
        self.block_size = block_size
        self.max_blocks = max(1, max_blocks)
        self._by_hash: OrderedDict[tuple[int, Hashable], bytes] = OrderedDict()
        self._groups: dict[bytes, set[int]] = {}
        self._seen_groups: set[int] = set()
        self.unkeyed_blocks = 0  # stored blocks that could not be keyed

    def cached(self, key: bytes) -> bool:
        groups = self._groups.get(key)
        return groups is not None and len(groups) >= len(self._seen_groups)

    def __len__(self) -> int:
        return len(self._groups)

    def stored(
        self,
        block_hashes: Sequence[Hashable],
        parent_hash: Hashable | None,
        token_ids: Sequence[int],
        block_size: int,
        group: int = 0,
        *,
        salted: bool = False,
    ) -> None:
        """Blocks the server registered for reuse. Salted blocks (LoRA, cache salt,
        multimodal) are never shared with kvgate's keys and are skipped."""
        self._seen_groups.add(group)
        if salted or block_size != self.block_size or len(token_ids) < (
            len(block_hashes) * block_size
        ):
            self.unkeyed_blocks += len(block_hashes)
            return
        if parent_hash is None:
            parent = ROOT_KEY
        else:
            found = self._by_hash.get((group, parent_hash))
            if found is None:
                self.unkeyed_blocks += len(block_hashes)
                return
            parent = found
        for index, block_hash in enumerate(block_hashes):
            parent = chain_key(parent, token_ids[index * block_size:(index + 1) * block_size])
            self._by_hash[(group, block_hash)] = parent
            self._by_hash.move_to_end((group, block_hash))
            self._groups.setdefault(parent, set()).add(group)
        while len(self._by_hash) > self.max_blocks:
            (old_group, _), old_key = self._by_hash.popitem(last=False)
            self._drop(old_key, old_group)

    def removed(self, block_hashes: Iterable[Hashable], group: int = 0) -> None:
        for block_hash in block_hashes:
            key = self._by_hash.pop((group, block_hash), None)
            if key is not None:
                self._drop(key, group)

    def cleared(self) -> None:
        """The server dropped its whole cache, or events were missed: forget it all."""
        self._by_hash.clear()
        self._groups.clear()
        self._seen_groups.clear()

    def _drop(self, key: bytes, group: int) -> None:
        groups = self._groups.get(key)
        if groups is None:
            return
        groups.discard(group)
        if not groups:
            del self._groups[key]


class TrafficCache:
    """A model of the server's prefix cache fed by kvgate's own traffic, for a
    server without KV cache events.

    A block enters when a request holding it has been prefilled. When its last
    holder finishes it stays cached at the tail of vLLM's free queue, and is evicted
    once as many blocks have been allocated as were free ahead of it then.
    """

    source = "traffic"

    def __init__(self, max_blocks: int = 1 << 20) -> None:
        self.max_blocks = max(1, max_blocks)
        self._allocated = 0  # blocks allocated so far (a clock in blocks)
        # key -> allocation count at which it is evicted (None: held, not evictable)
        self._entries: OrderedDict[bytes, int | None] = OrderedDict()

    def cached(self, key: bytes) -> bool:
        if key not in self._entries:
            return False
        evicted_at = self._entries[key]
        if evicted_at is not None and self._allocated >= evicted_at:
            del self._entries[key]
            return False
        return True

    def __len__(self) -> int:
        return len(self._entries)

    def filled(self, keys: Iterable[bytes]) -> None:
        """A holder of these blocks has been prefilled: they are on the server."""
        for key in keys:
            self._entries[key] = None
            self._entries.move_to_end(key)
        while len(self._entries) > self.max_blocks:
            self._entries.popitem(last=False)

    def freed(self, keys: Iterable[bytes], free_blocks: int) -> None:
        """The last holder of these blocks finished; `free_blocks` were free before."""
        evict_at = self._allocated + max(0, free_blocks)
        for key in keys:
            if key in self._entries:
                self._entries[key] = evict_at

    def allocated(self, blocks: int) -> None:
        self._allocated += max(0, blocks)

    def cleared(self) -> None:
        self._entries.clear()


@quick_init
@dataclass(frozen=True)
class PrefixPlan:
    """How one request's prompt blocks relate to the admitted requests' and the
    server's: `shared` leading blocks held by admitted requests (free for this
    request), `keys` the blocks it will hold a reference on (shared ones and those
    no admitted request holds yet), `private` blocks it must allocate a copy of
    (held by another request, past its own last possible hit), and `cached_tokens`
    of its prompt the server will not prefill (cached there, or prefilled by an
    admitted holder before this request is scheduled)."""

    shared: int
    keys: tuple[bytes, ...]
    private: int
    cached_tokens: int

    @staticmethod
    def none() -> PrefixPlan:
        return PrefixPlan(0, (), 0, 0)


class HeldBlocks(Protocol):
    @property
    def holder_counts(self) -> Mapping[bytes, int]: ...

    @property
    def filled_holder_counts(self) -> Mapping[bytes, int]: ...


class PrefixIndex:
    """Plans prompt-block sharing against the ledger's holders and the server's cache."""

    def __init__(self, block_size: int, server: ServerCache,
                 drops_last_hit: bool = False, prefill_chunk_tokens: int = 0) -> None:
        self.block_size = block_size
        self.server = server
        # With an MTP drafter vLLM gives up the last block of every hit (it computes
        # that block's tokens again, into a block of its own).
        self.drops_last_hit = drops_last_hit
        # vLLM's --long-prefill-token-threshold (0: none). A step schedules at most this
        # many of one request's prompt tokens while others are eligible, so the budget
        # left goes to the requests behind it before it has scheduled the rest of the
        # prompt, and they compute their own copy of the rest. A request behind an
        # admitted holder is sure to find the longer of: the holder's first chunk (from
        # wherever the holder started), and the leading blocks running requests hold
        # filled (the server cannot evict those; a block merely cached can be gone by
        # the time it is scheduled, and a holder already under way may have started
        # before those blocks were filled).
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.query_tokens = 0  # prompt tokens planned, for the hit ratio
        self.hit_tokens = 0  # of which predicted prefix hits

    def plan(self, keys: Sequence[bytes], prompt_tokens: int, held: HeldBlocks) -> PrefixPlan:
        if not keys:
            return PrefixPlan.none()
        # vLLM always computes the last prompt token: hits stop one token short.
        max_hits = max(0, (prompt_tokens - 1) // self.block_size)
        counts = held.holder_counts
        # Held blocks past `sure` are not found: the holder has not scheduled them yet
        # (a long-prefill threshold; the server's cached blocks are found regardless).
        sure = len(keys)
        if self.prefill_chunk_tokens > 0:
            filled = held.filled_holder_counts
            pinned = 0
            while pinned < min(max_hits, len(keys)) and filled.get(keys[pinned], 0) > 0:
                pinned += 1
            sure = max(pinned, self.prefill_chunk_tokens // self.block_size)
        if self.drops_last_hit:
            run = 0  # the leading blocks the server would find: held, or cached
            while run < min(max_hits, len(keys)) and (
                    (run < sure and counts.get(keys[run], 0) > 0)
                    or self.server.cached(keys[run])):
                run += 1
            max_hits = min(max_hits, max(0, run - 1))
        shared = 0
        cached = 0
        leading = True
        in_cached_run = True
        refs: list[bytes] = []
        private = 0
        for index, key in enumerate(keys):
            holders = counts.get(key, 0)
            hit = index < max_hits
            found = holders > 0 and index < sure
            if in_cached_run and hit and (found or self.server.cached(key)):
                cached += 1
            else:
                in_cached_run = False
            if leading and hit and found:
                shared += 1
                refs.append(key)
                continue
            leading = False
            if holders > 0:
                private += 1  # past its last sure hit: it computes its own copy
            else:
                refs.append(key)
        return PrefixPlan(shared, tuple(refs), private, cached * self.block_size)

    def count(self, plan: PrefixPlan, prompt_tokens: int) -> None:
        """Record a planned request for the predicted hit ratio."""
        self.query_tokens += prompt_tokens
        self.hit_tokens += plan.cached_tokens
