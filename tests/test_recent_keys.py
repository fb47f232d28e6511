"""Block keys taken from recent prompts: always the keys `block_keys` gives, and only
the blocks past what a prompt shares with a recent one are hashed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.admission import prefix
from sidecar.admission.prefix import block_keys
from sidecar.admission.recent_keys import RecentKeys, common_blocks

BLOCK = 4
SYSTEM = list(range(100, 100 + 5 * BLOCK + 2))  # 5 full blocks and 2 tokens


class Hashes:
    """Counts the blocks hashed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        chained = prefix._chained

        def counted(parent: bytes, block: bytes) -> bytes:
            self.count += 1
            return chained(parent, block)

        monkeypatch.setattr(prefix, "_chained", counted)


@pytest.mark.pure_python  # counts calls of a module function compiled code calls directly
def test_a_prompt_extending_a_recent_one_hashes_only_its_new_blocks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    recent = RecentKeys(BLOCK)
    hashes = Hashes(monkeypatch)
    first = [*SYSTEM, 7, 8, 9, 10, 11, 12]  # 7 full blocks
    assert recent.keys(first) == block_keys(first, BLOCK)
    hashes.count = 0
    second = [*first, 13, 14, 15, 16, 17, 18, 19, 20]  # 9 full blocks, 7 in common
    keys = recent.keys(second)
    assert hashes.count == 2
    assert keys == block_keys(second, BLOCK)
    assert recent.reused_blocks == 7


@pytest.mark.pure_python  # counts calls of a module function compiled code calls directly
def test_prompts_that_part_within_a_block_share_the_blocks_before_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    recent = RecentKeys(BLOCK)
    a = [*SYSTEM, 1, 2, 3, 4, 5, 6]
    b = [*SYSTEM, 9, 9, 9, 9, 9, 9]  # parts in block 5 (tokens 20-23)
    recent.keys(a)
    hashes = Hashes(monkeypatch)
    keys = recent.keys(b)
    assert hashes.count == 2  # blocks 5 and 6
    assert keys == block_keys(b, BLOCK)
    assert keys[:5] == block_keys(a, BLOCK)[:5] and keys[5] != block_keys(a, BLOCK)[5]
    assert recent.reused_blocks == 5


def test_a_salt_shares_only_with_the_same_salt() -> None:
    recent = RecentKeys(BLOCK)
    tokens = [*SYSTEM, 1, 2]
    plain = recent.keys(tokens)
    salted = recent.keys(tokens, b"cache_salt:x")
    assert salted == block_keys(tokens, BLOCK, b"cache_salt:x") != plain
    assert recent.reused_blocks == 0
    assert recent.keys(tokens) == plain and recent.reused_blocks == 6


def test_prompts_shorter_than_a_block_have_no_keys_and_are_not_kept() -> None:
    recent = RecentKeys(BLOCK)
    assert recent.keys([1, 2, 3]) == ()
    assert len(recent) == 0


def test_what_is_kept_is_bounded_by_count_and_bytes() -> None:
    recent = RecentKeys(BLOCK, prompts=3, max_bytes=8 * 40)  # 40 tokens
    for first in range(10):
        recent.keys([first] * 8)
    assert len(recent) == 3
    recent.keys([99] * 30)  # 24 tokens kept + 30: the two oldest go
    assert len(recent) == 2
    recent.keys([98] * 200)  # larger than the limit alone: not kept
    assert len(recent) == 2


def test_common_blocks_counts_whole_leading_blocks() -> None:
    a = bytes(range(40))
    b = bytes(range(23)) + b"\xff" + bytes(range(24, 40))
    assert common_blocks(a, b, 8, 5) == 2
    assert common_blocks(a, a, 8, 5) == 5
    assert common_blocks(a, a, 8, 3) == 3
    assert common_blocks(a, b"\xff" + a[1:], 8, 5) == 0


_prompts = st.lists(
    st.tuples(st.integers(0, 2), st.lists(st.integers(0, 5), max_size=30),
              st.sampled_from([b"", b"cache_salt:a"])),
    min_size=1, max_size=25)


@given(block=st.integers(1, 6), prompts=_prompts, kept=st.integers(1, 4))
@settings(max_examples=200, deadline=None)
def test_keys_always_equal_block_keys(block: int, prompts: list[tuple[int, list[int], bytes]],
                                      kept: int) -> None:
    """Prompts from three shared starts and random tails (few token values, so that
    tails often agree for a while), salted or not, few kept: every answer is
    `block_keys`'."""
    starts = [SYSTEM, SYSTEM[:9], [7] * 11]
    recent = RecentKeys(block, prompts=kept)
    for start, tail, salt in prompts:
        tokens = starts[start] + tail
        assert recent.keys(tokens, salt) == block_keys(tokens, block, salt)
