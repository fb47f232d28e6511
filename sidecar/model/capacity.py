"""vLLM-exact KV cache capacity: layer groups, blocks, tokens and concurrency.

This follows vLLM's v1 KV cache manager (`vllm/v1/core/kv_cache_utils.py`):

1. Every cache-holding layer has a spec (`kv_spec`). If all specs are equal, all
   layers form one group; if they differ but need the same blocks per request
   (full attention with different head sizes, MLA plus its indexer), they form one
   group whose page is the sum of their pages.
2. When a backend packs pages of different sizes side by side in a block (DeepSeek-V4's
   indexer: a block-outermost layout), layers are grouped as packed groups
   (`_packed_layout`). Otherwise (hybrid sliding/full, Mamba hybrids) pages are
   unified: a smaller page gets a larger block size when it divides the largest
   page, else it is padded.
   Layers are bucketed by spec; the group size is the smallest bucket (or the
   largest, when it is under 1.5x the smallest); each bucket splits into groups of
   that many layers, the last padded.
3. One block of the shared pool holds one page for every layer of a group:
   `bytes_per_block = max over groups of the sum of their layers' pages`, and
   `num_blocks = available_bytes // bytes_per_block` (or `--num-gpu-blocks-override`).
4. A request at `max_model_len` needs, in every group, the blocks the group's spec
   budgets (`cdiv(max_model_len, block_size)` for full attention; the window cap for
   sliding layers); the groups draw from one pool, so the blocks add up.
   `max_concurrency = num_blocks / blocks_per_request` and the start-up log's
   token figure is `int(max_concurrency x max_model_len)`.
   Worked example: 64 blocks of 32 tokens, one full-attention group,
   max_model_len 1024: 64 / 32 = 2.00x and 2 x 1024 = 2,048 tokens.

The pool also keeps one null block that is never handed to a request; `usable_blocks`
leaves it out (the admission ledger uses that).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from sidecar.model.kv_spec import CompositeKV, KVSpec
from sidecar.model.units import cdiv

# vLLM's default --block-size on CUDA, and the kernel block of its FlashAttention
# backend (sizes must be multiples of it): Mamba hybrids raise the attention block size
# in multiples of it.
DEFAULT_BLOCK_SIZE = 16
_ATTENTION_KERNEL_BLOCK = 16


@dataclass(frozen=True)
class KVGroup:
    """Layers sharing one block table: `num_layers` layers of `spec` (padding included)."""

    spec: KVSpec
    block_size: int
    num_layers: int

    @property
    def page_bytes(self) -> int:
        return self.spec.page_bytes(self.block_size)

    def blocks_held(self, tokens: int, in_flight_tokens: int) -> int:
        return self.spec.blocks_held(tokens, self.block_size, in_flight_tokens)

    def budgeted_blocks(self, max_model_len: int, in_flight_tokens: int) -> int:
        return self.spec.budgeted_blocks(max_model_len, self.block_size, in_flight_tokens)

    def blocks_in_step(self, computed_tokens: int, new_tokens: int, settled_tokens: int) -> int:
        return self.spec.blocks_in_step(computed_tokens, new_tokens, settled_tokens,
                                        self.block_size)


@dataclass(frozen=True)
class KVLayout:
    """How vLLM lays the model's KV cache out in blocks."""

    groups: tuple[KVGroup, ...]
    bytes_per_block: int

    @property
    def attention_free(self) -> bool:
        return not self.groups

    def blocks_for_request(self, tokens: int, in_flight_tokens: int) -> int:
        """Blocks one sequence of `tokens` tokens holds across all groups."""
        return sum(group.blocks_held(tokens, in_flight_tokens) for group in self.groups)

    def blocks_budgeted_per_request(self, max_model_len: int, in_flight_tokens: int) -> int:
        return sum(group.budgeted_blocks(max_model_len, in_flight_tokens) for group in self.groups)

    def blocks_in_step(self, computed_tokens: int, new_tokens: int, settled_tokens: int) -> int:
        """Blocks one sequence holds across all groups during one engine step."""
        return sum(group.blocks_in_step(computed_tokens, new_tokens, settled_tokens)
                   for group in self.groups)

    @property
    def recycles_blocks(self) -> bool:
        return any(group.spec.recycles_blocks for group in self.groups)

    @property
    def prefix_groups(self) -> int:
        """Groups whose prompt blocks requests with a common prefix share: a shared
        prompt block saves one block in each of them."""
        return sum(1 for group in self.groups if group.spec.prefix_shareable)

    @property
    def prefix_block_size(self) -> int | None:
        """Tokens per shared block, when every shareable group agrees on it."""
        sizes = {group.block_size for group in self.groups if group.spec.prefix_shareable}
        return sizes.pop() if len(sizes) == 1 else None

    @property
    def largest_block_size(self) -> int:
        return max((group.block_size for group in self.groups), default=1)

    def describe(self) -> list[str]:
        return [
            f"{group.num_layers} x {group.spec.kind} layers, block {group.block_size} tokens, "
            f"page {group.page_bytes:,} B"
            for group in self.groups
        ]


def resolve_block_size(specs: Sequence[KVSpec], block_size: int | None) -> int:
    """The attention block size vLLM 0.32 runs with (its `cache_config.block_size`).

    1. `--block-size` when given, else the block size the layer kinds' kernels need
       (64 with a DSA indexer), else 16.
    2. Mamba hybrids (`Platform._align_hybrid_block_size`, which overrides even a
       given --block-size): the smallest multiple of max(16, block size) whose
       attention page holds the largest state page, rounded up to a multiple of 16.
       Worked example, Qwen3-Next at TP 1 in bf16: a gated-delta-net state of
       3 x 8,192 x 2 B (conv) + 32 x 128 x 128 x 2 B (temporal) = 1,097,728 B, an
       attention token of 2 x 256 x 2 x 2 = 2,048 B: 16 x cdiv(1,097,728, 16 x 2,048)
       = 544 tokens.
    """
    if block_size is None:
        block_size = max((size for spec in specs if (size := spec.kernel_block_size)),
                         default=DEFAULT_BLOCK_SIZE)
    state_pages = [page for spec in specs if (page := spec.state_page_bytes) is not None]
    token_pages = [spec.page_bytes(1) for spec in specs if spec.state_page_bytes is None]
    if not state_pages or not token_pages:
        return block_size
    per_token = max(token_pages)
    alignment = max(_ATTENTION_KERNEL_BLOCK, block_size)
    needed = alignment * cdiv(max(state_pages), alignment * per_token)
    needed = _ATTENTION_KERNEL_BLOCK * cdiv(needed, _ATTENTION_KERNEL_BLOCK)
    return max(block_size, needed)


def build_layout(specs: Sequence[KVSpec], block_size: int | None) -> KVLayout:
    """Group per-layer specs as vLLM does and size one block of the shared pool.
    `block_size` is --block-size (None: vLLM's choice, see `resolve_block_size`)."""
    if not specs:
        return KVLayout((), 0)
    block_size = resolve_block_size(specs, block_size)
    first = specs[0]
    if all(spec == first for spec in specs):
        group = KVGroup(first, first.block_tokens or block_size, len(specs))
        return KVLayout((group,), group.page_bytes * len(specs))
    if (len({(spec.slot_class, spec.block_tokens) for spec in specs}) == 1
            and all(spec.state_page_bytes is None for spec in specs)):
        group = KVGroup(CompositeKV(tuple(specs)), first.block_tokens or block_size,
                        len(specs))
        return KVLayout((group,), group.page_bytes)
    sized = [(spec, spec.block_tokens or block_size) for spec in specs]
    if (any(spec.packs_pages for spec in specs)
            and len({spec.page_bytes(size) for spec, size in sized}) > 1):
        return _packed_layout(sized)
    return _hybrid_layout(specs, block_size)


def _approximate_gcd(values: Sequence[int], lower_bound: int) -> int:
    """vLLM's `_approximate_gcd`: the divisor d >= lower_bound that least pads the
    values up to multiples of d (ties: the larger d)."""
    best, best_pad = lower_bound, None
    for d in range(lower_bound, max(values) + 1):
        pad = sum((d - value % d) % d for value in values)
        if best_pad is None or pad <= best_pad:
            best, best_pad = d, pad
    return best


@dataclass(frozen=True)
class _Bucket:
    """Layers of one block size and slot class, by page size (layer order kept)."""

    block_size: int
    by_page: dict[int, list[KVSpec]]

    @property
    def count(self) -> int:
        return sum(len(specs) for specs in self.by_page.values())

    @property
    def repeats(self) -> int:
        """Layers of the most common page size: the pattern's repeats when balanced."""
        return max(len(specs) for specs in self.by_page.values())

    @property
    def balanced(self) -> bool:
        return len({len(specs) for specs in self.by_page.values()}) == 1

    def widest_group_bytes(self, groups: int) -> int:
        return sum(cdiv(len(specs), groups) * page for page, specs in self.by_page.items())


def _packed_layout(sized: Sequence[tuple[KVSpec, int]]) -> KVLayout:
    """vLLM's `_get_packed_kv_cache_groups`, for a block-outermost cache layout: pages
    of different sizes sit side by side in each block, so layers are not unified.

    Layers are bucketed by (block size, slot class); a balanced bucket (equal layer
    counts per page size) is a repeating pattern and splits into groups of the same
    number of repeats, chosen to pad least (at least the largest multi-page bucket's
    repeats); a state bucket (Mamba, or sliding windows when nothing repeats) splits
    further to fit the block the others already need. A block holds one page of every
    layer of the widest group. Worked example, DeepSeek-V4-Flash in fp8_ds_mla: 43
    sliding-window caches, 21 ratio-4 and 20 ratio-128 latents with 21 indexers at
    block 256, 21 + 21 ratio-4 compressor states, 20 ratio-128 ones; repeats
    approximate_gcd([43, 21, 20], >= 21) = 22, so the sliding windows split in 2
    groups; the latent group is the widest: 21 x 37,440 + 20 x 1,728 + 21 x 8,640 =
    1,002,240 B per block.
    """
    buckets: dict[tuple[int, Hashable], _Bucket] = {}
    for spec, size in sized:
        bucket = buckets.setdefault((size, spec.slot_class), _Bucket(size, {}))
        bucket.by_page.setdefault(spec.page_bytes(size), []).append(spec)
    min_repeats = max((b.repeats for b in buckets.values() if b.balanced and len(b.by_page) > 1),
                      default=0)
    repeats = (_approximate_gcd([b.repeats for b in buckets.values() if b.balanced],
                                min_repeats) if min_repeats else None)

    def groups_for(bucket: _Bucket) -> int:
        return cdiv(bucket.repeats, repeats) if bucket.balanced and repeats else 1

    def is_state(bucket: _Bucket) -> bool:
        first = next(iter(bucket.by_page.values()))[0]
        return first.state_page_bytes is not None or (repeats is None and first.recycles_blocks)

    anchor = max(b.widest_group_bytes(b.count if is_state(b) else groups_for(b))
                 for b in buckets.values())
    groups: list[KVGroup] = []
    for bucket in buckets.values():
        count = groups_for(bucket)
        if is_state(bucket):
            per_block = max(anchor // next(iter(bucket.by_page)), 1)
            count = max(count, cdiv(bucket.count, per_block))
        if count == 1:
            members = [spec for specs in bucket.by_page.values() for spec in specs]
            groups.append(_composite_group(members, bucket.block_size))
            continue
        pattern = list(zip(*bucket.by_page.values(), strict=False))
        for index in range(count):
            members = [spec for repeat in pattern[index::count] for spec in repeat]
            groups.append(_composite_group(members, bucket.block_size))
    return KVLayout(tuple(groups), max(group.page_bytes for group in groups))


def _composite_group(members: Sequence[KVSpec], block_size: int) -> KVGroup:
    spec = members[0] if len(members) == 1 else CompositeKV(tuple(members))
    return KVGroup(spec, block_size, len(members))


def _hybrid_layout(specs: Sequence[KVSpec], block_size: int) -> KVLayout:
    sized = [(spec, spec.block_tokens or block_size) for spec in specs]
    max_page = max(spec.page_bytes(size) for spec, size in sized)
    unified: list[tuple[KVSpec, int]] = []
    for spec, size in sized:
        page = spec.page_bytes(size)
        if page == max_page:
            unified.append((spec, size))
        elif spec.state_page_bytes is None and max_page % page == 0:
            unified.append((spec, size * (max_page // page)))
        else:
            unified.append((spec.with_padded_page(max_page), size))
    buckets: dict[tuple[KVSpec, int], int] = {}
    for key in unified:
        buckets[key] = buckets.get(key, 0) + 1
    smallest, largest = min(buckets.values()), max(buckets.values())
    group_size = largest if largest < smallest * 1.5 else smallest
    groups: list[KVGroup] = []
    for (spec, size), count in buckets.items():
        groups.extend(KVGroup(spec, size, group_size) for _ in range(cdiv(count, group_size)))
    return KVLayout(tuple(groups), group_size * max_page)


@dataclass(frozen=True)
class KVCapacity:
    """What vLLM logs at start-up, reproduced."""

    num_blocks: int
    bytes_per_block: int
    blocks_per_request: int
    max_model_len: int

    @property
    def usable_blocks(self) -> int:
        """Blocks a request can get: the pool keeps one null block."""
        return max(0, self.num_blocks - 1)

    @property
    def max_concurrency(self) -> float:
        if self.blocks_per_request == 0:
            return float("inf")
        return self.num_blocks / self.blocks_per_request

    @property
    def kv_capacity_tokens(self) -> int:
        """`GPU KV cache size: N tokens` (vLLM: int(max_concurrency x max_model_len))."""
        if self.blocks_per_request == 0:
            return 0
        return int(self.max_concurrency * self.max_model_len)

    @property
    def fits_one_request(self) -> bool:
        """vLLM refuses to start unless one max_model_len request fits (null block aside)."""
        return self.usable_blocks >= self.blocks_per_request


def kv_capacity(
    layout: KVLayout,
    available_bytes: int,
    max_model_len: int,
    in_flight_tokens: int,
    num_blocks_override: int | None = None,
) -> KVCapacity:
    if layout.attention_free:
        return KVCapacity(1, 0, 0, max_model_len)
    num_blocks = max(0, available_bytes) // layout.bytes_per_block
    if num_blocks_override is not None:
        num_blocks = num_blocks_override
    return KVCapacity(
        num_blocks=num_blocks,
        bytes_per_block=layout.bytes_per_block,
        blocks_per_request=layout.blocks_budgeted_per_request(max_model_len, in_flight_tokens),
        max_model_len=max_model_len,
    )
