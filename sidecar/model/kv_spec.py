"""KV cache format of one layer on one GPU: one small class per layer kind.

Each spec answers the same few questions, so callers never switch on the kind:

- `token_bytes`: bytes one token occupies in this layer while it is cached;
- `page_bytes(block_size)`: bytes of one block (page) of `block_size` tokens;
- `sequence_bytes(tokens)`: bytes one sequence of `tokens` tokens holds, unrounded;
- `blocks_held(tokens, block_size, in_flight_tokens)`: blocks vLLM's allocator holds
  for one sequence of `tokens` tokens (block-rounded, window-capped);
- `slot_class`: layers with the same slot class need the same number of blocks per
  request, so vLLM can put them in one KV cache group.

Specs are per GPU: the caller has already divided KV heads by tensor parallelism
where the layer kind splits across ranks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass

from sidecar.model.units import cdiv

# vLLM's DSA indexer kernels (DeepseekV32IndexerBackend) take only 64-token blocks on
# CUDA, so vLLM serves MLA + indexer models at block size 64 unless told otherwise.
SPARSE_MLA_BLOCK_TOKENS = 64


def _round_up(value: int, multiple: int) -> int:
    return cdiv(value, multiple) * multiple


def _window_cap_blocks(window: int, max_tokens: int, block_size: int,
                       in_flight_tokens: int) -> int:
    """vLLM's per-request cap for a sliding window (SlidingWindowSpec's
    max_admission_blocks_per_request)."""
    return cdiv(min(window - 1 + in_flight_tokens, max_tokens), block_size) + 1


@dataclass(frozen=True)
class KVSpec(ABC):
    @property
    @abstractmethod
    def kind(self) -> str:
        """A short label: full, sliding, mla, indexer, compressed, window, state."""

    @property
    @abstractmethod
    def token_bytes(self) -> float:
        """Bytes one cached token costs in this layer (0 for constant state)."""

    @abstractmethod
    def page_bytes(self, block_size: int) -> int:
        """Bytes of one block holding `block_size` tokens."""

    @abstractmethod
    def sequence_bytes(self, tokens: int) -> float:
        """Bytes one sequence of `tokens` tokens holds in this layer, not block-rounded."""

    @abstractmethod
    def blocks_held(self, tokens: int, block_size: int, in_flight_tokens: int) -> int:
        """Blocks one sequence of `tokens` tokens holds at most in this layer's group."""

    @property
    @abstractmethod
    def slot_class(self) -> Hashable:
        """Layers with equal slot classes need the same blocks per request."""

    def blocks_in_step(
        self, computed_tokens: int, new_tokens: int, settled_tokens: int, block_size: int
    ) -> int:
        """Blocks one sequence really holds while a step computes `new_tokens` tokens
        after `computed_tokens`, of which `settled_tokens` are processed (vLLM frees
        out-of-window blocks on the processed-token basis). Grows with the sequence
        unless the layer kind recycles blocks."""
        return self.blocks_held(computed_tokens + new_tokens, block_size, 0)

    @property
    def recycles_blocks(self) -> bool:
        """True when blocks are freed while the request runs (sliding windows)."""
        return False

    @property
    def kernel_block_size(self) -> int | None:
        """The block size this layer kind's kernels require when the server is started
        without --block-size (vLLM's backend preference), or None for vLLM's default."""
        return None

    @property
    def state_page_bytes(self) -> int | None:
        """The page of a constant-size state (independent of the block size), or None
        for caches that grow with the sequence."""
        return None

    @property
    def block_tokens(self) -> int | None:
        """Tokens per block when this kind keeps its own block size (vLLM's
        mamba_block_size), else None: the group's block size."""
        return None

    @property
    def prefix_shareable(self) -> bool:
        """True when vLLM shares this layer's prompt blocks between requests with a
        common prefix for the whole of their lives (full-length attention caches)."""
        return False

    @property
    def packs_pages(self) -> bool:
        """True when this layer's attention backend packs pages of different sizes side
        by side inside each block (a block-outermost cache layout): vLLM then groups the
        layers as packed groups instead of unifying their page sizes."""
        return False

    def budgeted_blocks(self, max_model_len: int, block_size: int, in_flight_tokens: int) -> int:
        """Blocks vLLM budgets per request at start-up (max_memory_usage_bytes / page).

        Equal to `blocks_held(max_model_len, ...)` except where vLLM budgets a cap
        that a short sequence never reaches (sliding windows).
        """
        return self.blocks_held(max_model_len, block_size, in_flight_tokens)

    def with_padded_page(self, page_bytes: int) -> KVSpec:
        """This spec with its page padded to `page_bytes` (hybrid page unification)."""
        return PaddedKV(self, page_bytes)


@dataclass(frozen=True)
class FullAttentionKV(KVSpec):
    """Full causal attention (MHA, GQA, MQA): K and V for every token of the sequence.

    page = block_size x kv_heads x (head_size_k + head_size_v) x element_bytes.
    """

    num_kv_heads: int
    head_size_k: int
    head_size_v: int
    element_bytes: int

    @property
    def kind(self) -> str:
        return "full"

    @property
    def token_bytes(self) -> float:
        return float(self.num_kv_heads * (self.head_size_k + self.head_size_v) * self.element_bytes)

    def page_bytes(self, block_size: int) -> int:
        return block_size * self.num_kv_heads * (self.head_size_k + self.head_size_v) * (
            self.element_bytes
        )

    def sequence_bytes(self, tokens: int) -> float:
        return tokens * self.token_bytes

    def blocks_held(self, tokens: int, block_size: int, in_flight_tokens: int) -> int:
        return cdiv(tokens, block_size)

    @property
    def slot_class(self) -> Hashable:
        return "full"

    @property
    def prefix_shareable(self) -> bool:
        return True


@dataclass(frozen=True)
class SlidingWindowKV(FullAttentionKV):
    """Attention over the last `window` tokens only (Mistral, Gemma 2/3 local layers).

    vLLM frees blocks that fall out of the window, so a request holds at most
    cdiv(min(window - 1 + in_flight_tokens, tokens), block_size) + 1 blocks.
    Worked example: block 4, window 4: the 4-token window [CDEF] of a 6-token
    sequence spans two blocks [XXCD][EF], hence the +1.
    """

    window: int = 0

    @property
    def kind(self) -> str:
        return "sliding"

    def sequence_bytes(self, tokens: int) -> float:
        return min(tokens, self.window) * self.token_bytes

    def window_cap_blocks(self, max_tokens: int, block_size: int, in_flight_tokens: int) -> int:
        """vLLM's admission cap for a request of up to `max_tokens` tokens."""
        return _window_cap_blocks(self.window, max_tokens, block_size, in_flight_tokens)

    def blocks_held(self, tokens: int, block_size: int, in_flight_tokens: int) -> int:
        return min(
            cdiv(tokens, block_size),
            self.window_cap_blocks(tokens, block_size, in_flight_tokens),
        )

    def budgeted_blocks(self, max_model_len: int, block_size: int, in_flight_tokens: int) -> int:
        return self.window_cap_blocks(max_model_len, block_size, in_flight_tokens)

    def blocks_in_step(
        self, computed_tokens: int, new_tokens: int, settled_tokens: int, block_size: int
    ) -> int:
        """The blocks from the first one the window of the next token still reads to
        the last one this step writes. Worked example: block 32, window 256, a
        750-token request decoding at 600 computed tokens with 599 settled: tokens
        before 599 - 255 = 344 are skipped, so blocks 0-9 (344 // 32 = 10) are freed
        and blocks 10-18 (cdiv(601, 32) = 19) are held: 9 blocks."""
        skipped_blocks = max(0, settled_tokens - self.window + 1) // block_size
        return max(0, cdiv(computed_tokens + new_tokens, block_size) - skipped_blocks)

    @property
    def recycles_blocks(self) -> bool:
        return True

    @property
    def prefix_shareable(self) -> bool:
        return False

    @property
    def slot_class(self) -> Hashable:
        return ("sliding", self.window)


@dataclass(frozen=True)
class MlaKV(KVSpec):
    """Multi-head latent attention (DeepSeek V2/V3/R1): one latent per token per layer.

    The latent has kv_lora_rank + qk_rope_head_dim elements and is the same on every
    tensor-parallel rank (it is not split).  DeepSeek-R1 in bf16:
    (512 + 64) x 2 B = 1,152 B per layer, x 61 layers = 70,272 B per token.
    With an fp8 cache vLLM's `fp8_ds_mla` layout for sparse MLA stores the latent in
    fp8 with one fp32 scale per 128 elements and the rope part in bf16:
    512 + 4 x 4 + 64 x 2 = 656 B.
    """

    kv_lora_rank: int
    rope_dim: int
    element_bytes: int
    ds_fp8_layout: bool = False
    sparse: bool = False  # DSA: the sparse MLA and indexer kernels take 64-token blocks

    @property
    def kernel_block_size(self) -> int | None:
        return SPARSE_MLA_BLOCK_TOKENS if self.sparse else None

    @property
    def kind(self) -> str:
        return "mla"

    @property
    def token_bytes(self) -> float:
        if self.ds_fp8_layout:
            return float(self.kv_lora_rank + cdiv(self.kv_lora_rank, 128) * 4 + self.rope_dim * 2)
        return float((self.kv_lora_rank + self.rope_dim) * self.element_bytes)

    def page_bytes(self, block_size: int) -> int:
        return block_size * int(self.token_bytes)

    def sequence_bytes(self, tokens: int) -> float:
        return tokens * self.token_bytes

    def blocks_held(self, tokens: int, block_size: int, in_flight_tokens: int) -> int:
        return cdiv(tokens, block_size)

    @property
    def slot_class(self) -> Hashable:
        return "full"

    @property
    def prefix_shareable(self) -> bool:
        return True


@dataclass(frozen=True)
class IndexerKV(KVSpec):
    """The key cache of a sparse-attention indexer (DeepSeek V3.2 / GLM-5 DSA).

    Stored in fp8 with one fp32 scale per 128 elements: index_head_dim 128 gives
    128 + 4 = 132 B per token per layer.
    """

    index_head_dim: int

    @property
    def kind(self) -> str:
        return "indexer"

    @property
    def kernel_block_size(self) -> int | None:
        return SPARSE_MLA_BLOCK_TOKENS

    @property
    def token_bytes(self) -> float:
        return float(self.index_head_dim + cdiv(self.index_head_dim, 128) * 4)

    def page_bytes(self, block_size: int) -> int:
        return block_size * int(self.token_bytes)

    def sequence_bytes(self, tokens: int) -> float:
        return tokens * self.token_bytes

    def blocks_held(self, tokens: int, block_size: int, in_flight_tokens: int) -> int:
        return cdiv(tokens, block_size)

    @property
    def slot_class(self) -> Hashable:
        return "full"

    @property
    def prefix_shareable(self) -> bool:
        return True


# DeepSeek-V4: the sparse MLA (FlashMLA / FlashInfer) and indexer kernels take 256-token
# blocks (block sizes count uncompressed tokens); vLLM picks 256 without --block-size.
COMPRESSED_MLA_BLOCK_TOKENS = 256


@dataclass(frozen=True)
class LatentWindowKV(KVSpec):
    """A sliding window of one vector per token, with its own block size and its page
    rounded up to an alignment (vLLM's SlidingWindowMLASpec as DeepSeek-V4 builds it):
    the sliding-window cache of every layer (window 128, 64-token blocks) and the fp32
    compressor states (window 8 in 4-token blocks for ratio 4, 128 in 8-token blocks for
    ratio 128).

    Worked example, the fp8_ds_mla sliding-window cache: 64 tokens x 584 B = 37,376 B,
    rounded up to a multiple of 576: 37,440 B per block.
    """

    window: int
    entry_bytes: int
    own_block_tokens: int
    alignment: int
    label: str = "window"

    @property
    def kind(self) -> str:
        return self.label

    @property
    def token_bytes(self) -> float:
        return float(self.entry_bytes)

    def page_bytes(self, block_size: int) -> int:
        return _round_up(block_size * self.entry_bytes, self.alignment)

    def sequence_bytes(self, tokens: int) -> float:
        return float(min(tokens, self.window) * self.entry_bytes)

    def blocks_held(self, tokens: int, block_size: int, in_flight_tokens: int) -> int:
        return min(cdiv(tokens, block_size),
                   _window_cap_blocks(self.window, tokens, block_size, in_flight_tokens))

    def budgeted_blocks(self, max_model_len: int, block_size: int, in_flight_tokens: int) -> int:
        return _window_cap_blocks(self.window, max_model_len, block_size, in_flight_tokens)

    def blocks_in_step(
        self, computed_tokens: int, new_tokens: int, settled_tokens: int, block_size: int
    ) -> int:
        skipped_blocks = max(0, settled_tokens - self.window + 1) // block_size
        return max(0, cdiv(computed_tokens + new_tokens, block_size) - skipped_blocks)

    @property
    def recycles_blocks(self) -> bool:
        return True

    @property
    def block_tokens(self) -> int | None:
        return self.own_block_tokens

    @property
    def slot_class(self) -> Hashable:
        return ("sliding", self.window)


@dataclass(frozen=True)
class CompressedLatentKV(KVSpec):
    """One stored entry per `ratio` tokens for the whole sequence (vLLM's
    MLAAttentionSpec with tokens_per_state = ratio): DeepSeek-V4's compressed latent
    (ratio 4 or 128) and the indexer keys of its ratio-4 layers. A block counts
    uncompressed tokens, so it stores block_size / ratio entries, rounded up to the
    alignment.

    Worked example, a ratio-128 latent in fp8_ds_mla at block 256: 2 entries x 584 B
    = 1,168 B, rounded up to a multiple of 576: 1,728 B per block. `block_outermost`:
    the layer's backend (the DeepSeek-V4 indexer) packs pages of different sizes side
    by side in each block, which makes vLLM group the model's layers as packed groups.
    """

    ratio: int
    entry_bytes: int
    alignment: int
    label: str = "compressed"
    block_outermost: bool = False

    @property
    def kind(self) -> str:
        return self.label

    @property
    def kernel_block_size(self) -> int | None:
        return COMPRESSED_MLA_BLOCK_TOKENS

    @property
    def token_bytes(self) -> float:
        return self.entry_bytes / self.ratio

    def page_bytes(self, block_size: int) -> int:
        return _round_up(block_size // self.ratio * self.entry_bytes, self.alignment)

    def sequence_bytes(self, tokens: int) -> float:
        return float(tokens // self.ratio * self.entry_bytes)

    def blocks_held(self, tokens: int, block_size: int, in_flight_tokens: int) -> int:
        return cdiv(tokens, block_size)

    @property
    def packs_pages(self) -> bool:
        return self.block_outermost

    @property
    def slot_class(self) -> Hashable:
        return "full"

    @property
    def prefix_shareable(self) -> bool:
        return True


@dataclass(frozen=True)
class StateKV(KVSpec):
    """Constant per-sequence state (Mamba-2, gated delta net): independent of length.

    vLLM holds `blocks_per_request` pages of it per request: 1 + speculative tokens
    with mamba cache mode `none`; 2 + speculative tokens in mode `align` (the default
    with prefix caching: the running state and the one at the last block boundary).
    `block_tokens` is vLLM's mamba_block_size (max_model_len in mode `none`), or None
    when it follows the attention block size (mode `align`).
    """

    state_bytes: int
    blocks_per_request: int = 1
    state_block_tokens: int | None = None

    @property
    def kind(self) -> str:
        return "state"

    @property
    def token_bytes(self) -> float:
        return 0.0

    def page_bytes(self, block_size: int) -> int:
        return self.state_bytes

    def sequence_bytes(self, tokens: int) -> float:
        return float(self.state_bytes)

    def blocks_held(self, tokens: int, block_size: int, in_flight_tokens: int) -> int:
        return self.blocks_per_request

    def blocks_in_step(
        self, computed_tokens: int, new_tokens: int, settled_tokens: int, block_size: int
    ) -> int:
        return self.blocks_per_request

    @property
    def state_page_bytes(self) -> int | None:
        return self.state_bytes

    @property
    def block_tokens(self) -> int | None:
        return self.state_block_tokens

    @property
    def slot_class(self) -> Hashable:
        return ("state", self.blocks_per_request)


@dataclass(frozen=True)
class PaddedKV(KVSpec):
    """Another spec whose page is padded to a common size (vLLM hybrid unification)."""

    inner: KVSpec
    padded_page_bytes: int

    @property
    def kind(self) -> str:
        return self.inner.kind

    @property
    def token_bytes(self) -> float:
        return self.inner.token_bytes

    def page_bytes(self, block_size: int) -> int:
        return self.padded_page_bytes

    def sequence_bytes(self, tokens: int) -> float:
        return self.inner.sequence_bytes(tokens)

    def blocks_held(self, tokens: int, block_size: int, in_flight_tokens: int) -> int:
        return self.inner.blocks_held(tokens, block_size, in_flight_tokens)

    def budgeted_blocks(self, max_model_len: int, block_size: int, in_flight_tokens: int) -> int:
        return self.inner.budgeted_blocks(max_model_len, block_size, in_flight_tokens)

    def blocks_in_step(
        self, computed_tokens: int, new_tokens: int, settled_tokens: int, block_size: int
    ) -> int:
        return self.inner.blocks_in_step(computed_tokens, new_tokens, settled_tokens,
                                         block_size)

    @property
    def recycles_blocks(self) -> bool:
        return self.inner.recycles_blocks

    @property
    def prefix_shareable(self) -> bool:
        return self.inner.prefix_shareable

    @property
    def kernel_block_size(self) -> int | None:
        return self.inner.kernel_block_size

    @property
    def state_page_bytes(self) -> int | None:
        return None if self.inner.state_page_bytes is None else self.padded_page_bytes

    @property
    def block_tokens(self) -> int | None:
        return self.inner.block_tokens

    @property
    def packs_pages(self) -> bool:
        return self.inner.packs_pages

    @property
    def slot_class(self) -> Hashable:
        return self.inner.slot_class


@dataclass(frozen=True)
class CompositeKV(KVSpec):
    """Layers of one slot class that share a block table: the page is the sum of
    their pages (vLLM's UniformTypeKVCacheSpecs, e.g. MLA plus its indexer, or full
    attention layers with different head sizes)."""

    parts: tuple[KVSpec, ...]

    @property
    def kind(self) -> str:
        return "+".join(dict.fromkeys(part.kind for part in self.parts))

    @property
    def token_bytes(self) -> float:
        return sum(part.token_bytes for part in self.parts)

    def page_bytes(self, block_size: int) -> int:
        return sum(part.page_bytes(block_size) for part in self.parts)

    def sequence_bytes(self, tokens: int) -> float:
        return sum(part.sequence_bytes(tokens) for part in self.parts)

    def blocks_held(self, tokens: int, block_size: int, in_flight_tokens: int) -> int:
        return max(part.blocks_held(tokens, block_size, in_flight_tokens) for part in self.parts)

    def budgeted_blocks(self, max_model_len: int, block_size: int, in_flight_tokens: int) -> int:
        return max(
            part.budgeted_blocks(max_model_len, block_size, in_flight_tokens)
            for part in self.parts
        )

    def blocks_in_step(
        self, computed_tokens: int, new_tokens: int, settled_tokens: int, block_size: int
    ) -> int:
        return max(part.blocks_in_step(computed_tokens, new_tokens, settled_tokens, block_size)
                   for part in self.parts)

    @property
    def recycles_blocks(self) -> bool:
        return any(part.recycles_blocks for part in self.parts)

    @property
    def prefix_shareable(self) -> bool:
        return all(part.prefix_shareable for part in self.parts)

    @property
    def kernel_block_size(self) -> int | None:
        return max((size for part in self.parts if (size := part.kernel_block_size)),
                   default=None)

    @property
    def block_tokens(self) -> int | None:
        return self.parts[0].block_tokens

    @property
    def packs_pages(self) -> bool:
        return any(part.packs_pages for part in self.parts)

    @property
    def slot_class(self) -> Hashable:
        return self.parts[0].slot_class
