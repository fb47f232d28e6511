"""Block keys of recent prompts, so that a prompt extending one is hashed only past it.

A block's key depends only on the salt and the token ids up to the block's end
(`prefix.block_keys`), so a prompt that starts like a recent one (a shared system
prompt, an agent's previous turn) has the same keys for the full blocks the two have
in common: they are taken from the recent prompt, and only the blocks after them are
hashed. The recent prompt is found by the prompt's first full block (and the salt):
the most recent prompt that starts with it. Nothing is approximated: the keys are the
ones `block_keys` gives.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from sidecar.admission.prefix import TOKEN_BYTES, extend_keys, token_bytes

RECENT_PROMPTS = 64
# Bytes of token ids kept (TOKEN_BYTES per token): at most ~2 M tokens of recent prompts.
RECENT_BYTES = 16 << 20


def common_blocks(a: bytes, b: bytes, step: int, limit: int) -> int:
    """How many leading blocks of `step` bytes `a` and `b` have in common (at most
    `limit`): a binary search over whole-prefix comparisons (each one memcmp)."""
    low, high = 0, limit
    while low < high:
        middle = (low + high + 1) // 2
        end = middle * step
        if a[:end] == b[:end]:
            low = middle
        else:
            high = middle - 1
    return low


class RecentKeys:
    """`block_keys` for one block size, remembering the last prompts' keys."""

    def __init__(self, block_size: int, prompts: int = RECENT_PROMPTS,
                 max_bytes: int = RECENT_BYTES) -> None:
        if block_size < 1:
            raise ValueError("block size must be >= 1")
        self.block_size = block_size
        self.prompts = max(1, prompts)
        self.max_bytes = max_bytes
        self._step = block_size * TOKEN_BYTES
        # (salt, first block's bytes) -> (the prompt's bytes, its keys), oldest first.
        self._recent: OrderedDict[tuple[bytes, bytes], tuple[bytes, tuple[bytes, ...]]] = (
            OrderedDict())
        self._bytes = 0
        self.reused_blocks = 0  # keys taken from a recent prompt rather than hashed
        # The last ids converted, and their bytes: the same prompt's ids come back as the
        # same object while the tokenizer's cache holds them (held here, so never reused).
        self._last: tuple[tuple[int, ...], bytes] | None = None

    def keys(self, token_ids: Sequence[int], salt: bytes = b"") -> tuple[bytes, ...]:
        last = self._last
        if last is not None and last[0] is token_ids:
            data = last[1]
        else:
            data = token_bytes(token_ids)
            if isinstance(token_ids, tuple):  # a list may change under the same object
                self._last = (token_ids, data)
        step = self._step
        full = len(data) // step
        if full == 0:
            return ()
        first = (salt, data[:step])
        known: tuple[bytes, ...] = ()
        recent = self._recent.pop(first, None)
        if recent is not None:
            self._bytes -= len(recent[0])
            recent_data, recent_keys = recent
            if recent_data is data or recent_data == data:  # the same prompt again
                self.reused_blocks += len(recent_keys)
                self._remember(first, data, recent_keys)
                return recent_keys
            known = recent_keys[:common_blocks(recent_data, data, step,
                                               min(len(recent_keys), full))]
            self.reused_blocks += len(known)
        keys = extend_keys(known, data, self.block_size, salt)
        self._remember(first, data, keys)
        return keys

    def _remember(self, first: tuple[bytes, bytes], data: bytes,
                  keys: tuple[bytes, ...]) -> None:
        if len(data) > self.max_bytes:
            return
        self._recent[first] = (data, keys)
        self._bytes += len(data)
        while len(self._recent) > self.prompts or self._bytes > self.max_bytes:
            _, (old, _keys) = self._recent.popitem(last=False)
            self._bytes -= len(old)

    def __len__(self) -> int:
        return len(self._recent)
