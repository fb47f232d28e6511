"""Prompt blocks shared between requests: the admission controller's one owner of
prefix caching.

`PromptSharing` knows whether the server shares prompt blocks at all, where its view
of the server's cache comes from (the server's KV cache events, or a model fed by
kvgate's own traffic when they are missing or stale), and what one request shares
with the requests already admitted (`prefix.PrefixIndex`). The ledger holds the
references; this class tells the controller what to reserve and keeps the views up
to date as requests are admitted, prefilled and finished.
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.admission.ledger import Ledger, Reservation
from sidecar.admission.prefix import (
    EventCache,
    PrefixIndex,
    PrefixPlan,
    ServerCache,
    TrafficCache,
)
from sidecar.admission.recent_keys import RecentKeys
from sidecar.model import KVLayout


class PromptSharing:
    def __init__(self, ledger: Ledger, layout: KVLayout, drops_last_hit: bool = False,
                 prefill_chunk_tokens: int = 0) -> None:
        self.ledger = ledger
        self.traffic_cache = TrafficCache()
        self.event_cache: EventCache | None = None
        self.index: PrefixIndex | None = None
        self.recent_keys: RecentKeys | None = None
        self._enabled = True
        self._layout = layout
        self._drops_last_hit = drops_last_hit  # an MTP drafter (`PrefixIndex`)
        self._prefill_chunk_tokens = prefill_chunk_tokens  # `PrefixIndex`
        # Since when kvgate has been waiting for KV cache events: it admitted a request
        # whose prompt blocks the server does not hold, and none came since (vLLM
        # publishes the blocks it stores when it schedules the request). None: no wait.
        self.expects_events_since_s: float | None = None
        self._configure()

    # ---- configuration ------------------------------------------------------------

    def set_layout(self, layout: KVLayout, drops_last_hit: bool = False,
                   prefill_chunk_tokens: int = 0) -> None:
        self._layout = layout
        self._drops_last_hit = drops_last_hit
        self._prefill_chunk_tokens = prefill_chunk_tokens
        self._configure()

    @property
    def enabled(self) -> bool:
        return self._enabled

    def set_enabled(self, enabled: bool) -> None:
        """Whether the server shares prompt blocks (vLLM's --enable-prefix-caching)."""
        if enabled != self._enabled:
            self._enabled = enabled
            self._configure()

    def use_events(self, cache: EventCache | None) -> None:
        """Take what the server has cached from its KV cache events (None: from
        kvgate's own traffic, when the events are missing or stale)."""
        if cache is not self.event_cache:
            self.event_cache = cache
            self._configure()

    def events_arrived(self) -> None:
        """A batch of KV cache events came: the stream is alive."""
        self.expects_events_since_s = None

    @property
    def source(self) -> str:
        """events | traffic | off: where the view of the server's cache comes from."""
        return "off" if self.index is None else self.index.server.source

    def _configure(self) -> None:
        block_size = self._layout.prefix_block_size
        self.ledger.blocks_per_key = max(1, self._layout.prefix_groups)
        if not self._enabled or block_size is None:
            self.index = None
            return
        if self.recent_keys is None or self.recent_keys.block_size != block_size:
            self.recent_keys = RecentKeys(block_size)
        server: ServerCache = self.traffic_cache
        if self.event_cache is not None and self.event_cache.block_size == block_size:
            server = self.event_cache
        counts = (self.index.query_tokens, self.index.hit_tokens) if self.index else (0, 0)
        self.index = PrefixIndex(block_size, server, self._drops_last_hit,
                                 self._prefill_chunk_tokens)
        self.index.query_tokens, self.index.hit_tokens = counts

    # ---- one request ------------------------------------------------------------------

    def keys(self, token_ids: Sequence[int], salt: bytes = b"") -> tuple[bytes, ...]:
        """Keys of a prompt's full blocks, or () when the server shares none."""
        if self.index is None or self.recent_keys is None:
            return ()
        return self.recent_keys.keys(token_ids, salt)

    def plan(self, keys: tuple[bytes, ...], prompt_tokens: int, sequences: int) -> PrefixPlan:
        """What a request shares now with the requests admitted (a request forking
        several sequences: nothing; its forks share among themselves,
        `CostModel.fork_shared_blocks`)."""
        if self.index is None or not keys or sequences != 1:
            return PrefixPlan.none()
        return self.index.plan(keys, prompt_tokens, self.ledger)

    def shared_blocks(self, plan: PrefixPlan) -> int:
        return plan.shared * self.ledger.blocks_per_key

    def own_blocks(self, peak_blocks: int, plan: PrefixPlan) -> int:
        """Blocks of a peak that are the request's own (not a prompt block it holds by
        reference)."""
        return max(0, peak_blocks - len(plan.keys) * self.ledger.blocks_per_key)

    def admitted(self, plan: PrefixPlan, keys: tuple[bytes, ...], prompt_tokens: int,
                 charged_blocks: int, now: float) -> None:
        self.traffic_cache.allocated(charged_blocks)
        if self.index is None or not keys:
            return
        self.index.count(plan, prompt_tokens)
        known = self.index.server if self.event_cache is None else self.event_cache
        if self.expects_events_since_s is None and any(not known.cached(k) for k in keys):
            self.expects_events_since_s = now

    def prefilled(self, reservation: Reservation) -> bool:
        """Its first token came: the server has filled (and cached) its prompt blocks.
        True when later requests may now share more."""
        if reservation.mark_filled() and reservation.keys:
            self.traffic_cache.filled(reservation.keys)
            return True
        return False

    def release(self, reservation: Reservation) -> None:
        """Settle a reservation; the prompt blocks it held last stay in the server's
        cache, free, until vLLM evicts them."""
        counts = self.ledger.holder_counts
        last_held = ([key for key in reservation.keys if counts.get(key) == 1]
                     if reservation.filled else [])
        if reservation.release() and last_held:
            free = self.ledger.capacity_blocks - self.ledger.effective_used_blocks
            self.traffic_cache.freed(last_held, free)

    # ---- introspection ------------------------------------------------------------------

    def state(self, saved_blocks: int) -> dict[str, object]:
        index = self.index
        cached = (len(self.event_cache) if self.source == "events" and self.event_cache
                  is not None else len(self.traffic_cache))
        return {
            "source": self.source,
            "block_size": index.block_size if index else None,
            "held_prompt_blocks": self.ledger.held_prompt_blocks,
            "saved_blocks": saved_blocks,
            "server_cached_blocks": cached,
            "query_tokens": index.query_tokens if index else 0,
            "predicted_hit_tokens": index.hit_tokens if index else 0,
        }
