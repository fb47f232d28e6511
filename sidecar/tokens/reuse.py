"""Encode a long prompt that extends a recent one by encoding only what is new.

Long prompts repeat what earlier prompts said: the system prompt or tool definitions of
every request of an application, a document asked about several times, an agent
session whose every turn is the previous turn's prompt plus its answer plus new text.
Encoding each from its first character costs kvgate's one event-loop thread ~0.5 ms
per 1,000 tokens, again and again for the same text.

`PrefixReuse` keeps the token ids of recent long texts. For a new text it finds the
recent one with the longest common prefix (`L` characters), keeps that text's tokens
up to a point well before `L`, and encodes the new text only from a window that starts
`OVERLAP_CHARS` before that point. Tokenizers decide a token from a bounded stretch of
text around it, so inside the overlap the window's tokens and the kept text's tokens
agree once the window's missing left context stops mattering; the two are joined at
the first token boundary where they agree through to the end of the overlap. No
agreement: the whole text is encoded.

This rests on the tokenizer being local, which the files do not promise. So the first
`FIRST_CHECKS` joined encodings, and one in `CHECK_EVERY` after them, are compared
with the whole text encoded (at once, or by the caller off its event loop:
`check_inline`, `pending_checks`); one difference turns reuse off for the process.
The server's /tokenize checks compare local counts with the server's as before.

Pure and synchronous; safe to call from several threads (the cache is locked, the
encodings run outside the lock).
"""

from __future__ import annotations

import bisect
import threading
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# Texts shorter than this are encoded whole (and not kept).
MIN_CHARS = 1_024
# A common prefix shorter than this is not worth joining.
MIN_REUSE_CHARS = 512
# Recent texts are found by their first characters.
ANCHOR_CHARS = 128
# The kept text's tokens ending within this many characters of where the texts diverge
# are encoded again (the new text's next characters may change them).
MARGIN_CHARS = 64
# The window starts this many characters before the end of the kept tokens.
OVERLAP_CHARS = 128
MAX_PER_ANCHOR = 16
MAX_TEXTS = 256
MAX_TOTAL_CHARS = 2_000_000
FIRST_CHECKS = 4
CHECK_EVERY = 64
MAX_PENDING_CHECKS = 16
# Where the window and the kept tokens agree, the join is made this many agreeing
# tokens before the end of the kept tokens used (any point of an agreeing stretch gives
# the same ids, so the walk back stops there).
JOIN_AGREEMENT_TOKENS = 16

Ids = tuple[int, ...]
Offsets = Sequence[tuple[int, int]]
EncodeIds = Callable[[str, bool], Ids]
EncodeWithOffsets = Callable[[str, bool], tuple[Ids, Offsets]]

RESULTS = ("spliced", "checked", "mismatch")


@dataclass
class _Kept:
    text: str
    special: bool
    ids: Ids
    # Token starts and ends in characters, read on the first reuse (encoding with
    # offsets costs ~40% more than without).
    starts: array[int] | None = None
    ends: array[int] | None = None
    # A joined text's offsets, made on its first reuse: the kept text's starts and ends
    # (never changed once made), how many of them it keeps, the window's offsets past
    # the joint, and where the window starts.
    pending: tuple[array[int], array[int], int, Offsets, int] | None = None
    anchor: tuple[bool, str] = field(init=False)

    def __post_init__(self) -> None:
        self.anchor = (self.special, self.text[:ANCHOR_CHARS])

    def offsets_from_join(self) -> bool:
        """Make `starts` and `ends` from a join's parts; False when there are none."""
        if self.pending is None:
            return False
        kept_starts, kept_ends, joint, window, window_start = self.pending
        starts, ends = kept_starts[:joint], kept_ends[:joint]
        starts.extend([start + window_start for start, _ in window])
        ends.extend([end + window_start for _, end in window])
        self.starts, self.ends, self.pending = starts, ends, None
        return True


def common_prefix_chars(a: str, b: str) -> int:
    """Length of the longest common prefix of `a` and `b`."""
    if a.startswith(b):
        return len(b)
    if b.startswith(a):
        return len(a)
    step = 1024
    start = 0
    while a.startswith(b[start:start + step], start):
        start += step  # both are longer than start + step: neither starts with the other
    low, high = start, start + step  # a[:low] == b[:low]; they differ before high
    while high - low > 1:
        middle = (low + high) // 2
        if a.startswith(b[low:middle], low):
            low = middle
        else:
            high = middle
    return low


class PrefixReuse:
    def __init__(self, encode_ids: EncodeIds, encode_with_offsets: EncodeWithOffsets,
                 listener: Callable[[str], None] | None = None, *,
                 check_inline: bool = True) -> None:
        self._encode_ids = encode_ids
        self._encode_with_offsets = encode_with_offsets
        self.listener = listener
        # False: joins due a check are used at once and queued here (the oldest dropped
        # beyond MAX_PENDING_CHECKS) for the caller to `verify` off its hot path.
        self.check_inline = check_inline
        self.pending_checks: deque[tuple[str, bool, Ids]] = deque(maxlen=MAX_PENDING_CHECKS)
        self.enabled = True
        self.counts = dict.fromkeys(RESULTS, 0)
        self._lock = threading.Lock()
        self._texts: OrderedDict[int, _Kept] = OrderedDict()  # by id(): least recent first
        self._by_anchor: dict[tuple[bool, str], list[_Kept]] = {}
        self._chars = 0

    def encode(self, text: str, add_special_tokens: bool) -> Ids:
        if not self.enabled or len(text) < MIN_CHARS:
            return self._encode_ids(text, add_special_tokens)
        found = self._longest_common_prefix(text, add_special_tokens)
        if found is not None:
            kept, common = found
            if common == len(text) == len(kept.text):
                with self._lock:
                    if id(kept) in self._texts:
                        self._texts.move_to_end(id(kept))
                return kept.ids
            joined = self._joined(kept, common, text)
            if joined is not None and self._checked(joined.ids, text, add_special_tokens):
                self._keep(joined)
                return joined.ids
        ids = self._encode_ids(text, add_special_tokens)
        self._keep(_Kept(text, add_special_tokens, ids))
        return ids

    # ---- finding and joining -----------------------------------------------------------

    def _longest_common_prefix(self, text: str, special: bool) -> tuple[_Kept, int] | None:
        with self._lock:
            candidates = list(self._by_anchor.get((special, text[:ANCHOR_CHARS]), ()))
        best: tuple[_Kept, int] | None = None
        for kept in candidates:
            if best is not None and not text.startswith(kept.text[:best[1] + 1]):
                continue  # differs within the best common prefix found so far
            common = common_prefix_chars(text, kept.text)
            if best is None or common > best[1] or (
                    # As long a prefix: one whose offsets are made already.
                    common == best[1] and best[0].starts is None and kept.starts is not None):
                best = (kept, common)
        if best is None or best[1] < MIN_REUSE_CHARS:
            return None
        return best

    def _joined(self, kept: _Kept, common: int, text: str) -> _Kept | None:
        """The new text's tokens: the kept text's up to a boundary where a window of
        the new text encoded alone agrees with them; None when they never agree."""
        if (kept.starts is None or kept.ends is None) and not kept.offsets_from_join():
            ids, offsets = self._encode_with_offsets(kept.text, kept.special)
            if ids != kept.ids:
                # The two ways of encoding disagree: nothing is joined from then on.
                self._mismatch()
                return None
            kept.starts = array("q", (start for start, _ in offsets))
            kept.ends = array("q", (end for _, end in offsets))
        starts, ends = kept.starts, kept.ends
        assert starts is not None and ends is not None
        if kept.special and len(ends) and ends[-1] == 0:
            return None  # the tokenizer adds tokens at the end: not joinable
        settled = common - MARGIN_CHARS  # kept tokens ending by here are the new text's too
        if settled < OVERLAP_CHARS + MARGIN_CHARS:
            return None
        first = bisect.bisect_left(starts, settled - OVERLAP_CHARS)
        last = bisect.bisect_right(ends, settled, lo=first)  # kept tokens [first, last)
        if first >= last or ends[first] == 0:
            return None
        window_start = starts[first]
        window_ids, window_offsets = self._encode_with_offsets(text[window_start:], False)
        # The window's tokens that end by `settled`, against the kept ones: walk back from
        # the last of each while they agree (same id, same place).
        w = bisect.bisect_right(window_offsets, settled - window_start,
                                key=lambda offset: offset[1])
        k = last
        agreed = 0
        while w > 0 and k > first and agreed < JOIN_AGREEMENT_TOKENS:
            w_start, w_end = window_offsets[w - 1]
            if (window_ids[w - 1] != kept.ids[k - 1] or w_start + window_start != starts[k - 1]
                    or w_end + window_start != ends[k - 1]):
                break
            w -= 1
            k -= 1
            agreed += 1
        if agreed == 0:
            return None
        if w == 0:
            # They agree from the window's first token: join one token later, so the
            # joint is never where the window had no left context.
            if agreed == 1:
                return None
            w, k = 1, k + 1
        return _Kept(text, kept.special, kept.ids[:k] + tuple(window_ids[w:]),
                     pending=(starts, ends, k, window_offsets[w:], window_start))

    def _checked(self, ids: Ids, text: str, special: bool) -> bool:
        """Whether joined `ids` may be used: the first joins, and one in `CHECK_EVERY`
        after them, are compared with the whole text encoded (here, or later by whoever
        takes `pending_checks`)."""
        with self._lock:
            self.counts["spliced"] += 1
            spliced = self.counts["spliced"]
        self._tell("spliced")
        if spliced > FIRST_CHECKS and spliced % CHECK_EVERY:
            return True
        if not self.check_inline:
            self.pending_checks.append((text, special, ids))
            return True
        return self.verify(text, special, ids)

    def verify(self, text: str, special: bool, ids: Ids) -> bool:
        """Compare joined `ids` with `text` encoded whole; a difference turns reuse off."""
        whole = self._encode_ids(text, special)
        with self._lock:
            self.counts["checked"] += 1
        self._tell("checked")
        if whole != ids:
            self._mismatch()
            return False
        return True

    def _mismatch(self) -> None:
        with self._lock:
            self.counts["mismatch"] += 1
            self.enabled = False
            self._forget_all()
        self._tell("mismatch")

    def _tell(self, result: str) -> None:
        if self.listener is not None:
            self.listener(result)

    # ---- the kept texts -----------------------------------------------------------------

    def _keep(self, kept: _Kept) -> None:
        with self._lock:
            if not self.enabled:
                return
            peers = self._by_anchor.setdefault(kept.anchor, [])
            peers.insert(0, kept)
            self._texts[id(kept)] = kept
            self._chars += len(kept.text)
            if len(peers) > MAX_PER_ANCHOR:
                self._drop(peers[-1])
            while self._texts and (len(self._texts) > MAX_TEXTS
                                   or self._chars > MAX_TOTAL_CHARS):
                self._drop(next(iter(self._texts.values())))

    def _drop(self, kept: _Kept) -> None:
        if self._texts.pop(id(kept), None) is None:
            return
        self._chars -= len(kept.text)
        peers = self._by_anchor.get(kept.anchor)
        if peers is not None:
            peers[:] = [peer for peer in peers if peer is not kept]
            if not peers:
                del self._by_anchor[kept.anchor]

    def _forget_all(self) -> None:
        self._texts.clear()
        self._by_anchor.clear()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._texts)
