"""A typed description of a decoder-only model: layers of attention and MLP blocks.

Nothing here knows Hugging Face key names (that is `hf_config`). Each block answers
how many parameters it has, how they shard under tensor parallelism, the FLOPs it
spends per token and the KV cache spec it needs, so a new layer kind touches one
class.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar, Protocol

from sidecar.model.kv_spec import (
    CompressedLatentKV,
    FullAttentionKV,
    IndexerKV,
    KVSpec,
    LatentWindowKV,
    MlaKV,
    SlidingWindowKV,
    StateKV,
)
from sidecar.model.units import MIB


class Role(StrEnum):
    """What a parameter is for: decides its precision and how it shards over TP."""

    EMBEDDING = "embedding"
    LM_HEAD = "lm_head"
    ATTENTION = "attention"
    MLP = "mlp"
    EXPERTS = "experts"
    SHARED_EXPERTS = "shared_experts"
    ROUTER = "router"
    NORM = "norm"
    VISION = "vision"


ParamMap = dict[Role, float]

_VOCAB_PADDING = 64


def add_params(*maps: Mapping[Role, float]) -> ParamMap:
    total: ParamMap = {}
    for one in maps:
        for role, count in one.items():
            total[role] = total.get(role, 0.0) + count
    return total


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads each TP rank stores: split when tp <= heads, replicated beyond."""
    return max(1, num_kv_heads // tp)


@dataclass(frozen=True)
class KVSettings:
    """How the server stores caches: what a layer needs to build its KV specs.

    - `element_bytes`: bytes per KV element (the KV cache dtype; auto = model dtype);
    - `fp8_cache`: --kv-cache-dtype is an fp8 type;
    - `ds_mla_fp8`: the GPU's sparse-MLA backend stores an fp8 cache as `fp8_ds_mla`
      (FlashMLA on Hopper) rather than plain fp8 (FlashInfer on Blackwell);
    - `model_element_bytes`: the model dtype, which Mamba conv state follows;
    - `state_element_bytes` / `ssm_state_element_bytes`: --mamba-cache-dtype and
      --mamba-ssm-cache-dtype resolved to bytes (None: auto);
    - `state_blocks_per_request`, `state_block_tokens`: from the mamba cache mode;
    - `speculative_tokens`: --num-speculative-tokens (widens the conv state);
    - `mtp_drafter`: the drafter is the model's own MTP layers, whose caches join the
      target's (--speculative-config method mtp);
    - `v4_ds_layout`: DeepSeek-V4's attention backend stores its caches as fp8_ds_mla
      (FlashMLA, vLLM's default on every CUDA GPU; FlashInfer on SM12x) rather than
      plain bf16 / fp8 rows (--attention-backend FLASHINFER_MLA_SPARSE_DSV4).
    """

    element_bytes: int
    tp: int = 1
    fp8_cache: bool = False
    ds_mla_fp8: bool = True
    model_element_bytes: int = 2
    state_element_bytes: int | None = None
    ssm_state_element_bytes: int | None = None
    state_blocks_per_request: int = 1
    state_block_tokens: int | None = None
    speculative_tokens: int = 0
    v4_ds_layout: bool = True
    mtp_drafter: bool = False


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float": 4, "half": 2}


def dtype_bytes(name: str) -> int | None:
    """Bytes of a state dtype as configs and vLLM flags name it; None for auto."""
    return _DTYPE_BYTES.get(name.removeprefix("torch."))


class Mixer(Protocol):
    """The token-mixing half of a layer (attention or a state-space mixer)."""

    def params(self, hidden: int) -> ParamMap: ...

    def params_per_rank(self, hidden: int, tp: int) -> ParamMap: ...

    def kv_specs(self, settings: KVSettings) -> list[KVSpec]: ...

    def tp_error(self, tp: int) -> str | None:
        """Why this layer cannot be split over `tp` ranks, or None."""
        ...

    def context_flops_per_token(self, context_tokens: int) -> float:
        """FLOPs one new token spends attending to `context_tokens` cached tokens."""
        ...


@dataclass(frozen=True)
class GqaAttention:
    """Multi-head attention with grouped KV heads (MHA, GQA, MQA), optionally windowed."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    window: int | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    shared_kv: bool = False  # K = V projection (Gemma 4 global layers)

    def params(self, hidden: int) -> ParamMap:
        q = hidden * self.num_heads * self.head_dim
        k = hidden * self.num_kv_heads * self.head_dim
        v = 0 if self.shared_kv else hidden * self.num_kv_heads * self.v_head_dim
        o = self.num_heads * self.v_head_dim * hidden
        bias = 0
        if self.qkv_bias:
            bias += self.num_heads * self.head_dim + self.num_kv_heads * (
                self.head_dim + (0 if self.shared_kv else self.v_head_dim)
            )
        if self.o_bias:
            bias += hidden
        return {Role.ATTENTION: float(q + k + v + o + bias)}

    def params_per_rank(self, hidden: int, tp: int) -> ParamMap:
        kv_rank = kv_heads_per_rank(self.num_kv_heads, tp)
        q_and_o = hidden * self.num_heads * (self.head_dim + self.v_head_dim) / tp
        k = hidden * kv_rank * self.head_dim
        v = 0 if self.shared_kv else hidden * kv_rank * self.v_head_dim
        return {Role.ATTENTION: q_and_o + k + v}

    def kv_specs(self, settings: KVSettings) -> list[KVSpec]:
        heads = kv_heads_per_rank(self.num_kv_heads, settings.tp)
        element_bytes = settings.element_bytes
        if self.window is not None:
            return [
                SlidingWindowKV(heads, self.head_dim, self.v_head_dim, element_bytes, self.window)
            ]
        return [FullAttentionKV(heads, self.head_dim, self.v_head_dim, element_bytes)]

    def tp_error(self, tp: int) -> str | None:
        if self.num_heads % tp:
            return f"--tp {tp} does not divide the {self.num_heads} attention heads"
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            return f"--tp {tp} and the {self.num_kv_heads} KV heads do not divide one another"
        return None

    def context_flops_per_token(self, context_tokens: int) -> float:
        attended = context_tokens if self.window is None else min(context_tokens, self.window)
        # QK^T and AV: 2 FLOPs per multiply-add each.
        return 2.0 * self.num_heads * (self.head_dim + self.v_head_dim) * attended


@dataclass(frozen=True)
class MlaAttention:
    """Multi-head latent attention (DeepSeek V2/V3/R1, Kimi K2), optionally with a
    DSA indexer (DeepSeek V3.2, GLM-5)."""

    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_head_dim: int | None = None
    index_n_heads: int = 0
    sparse: bool = False  # DSA (config has index_topk): 64-token blocks, fp8_ds_mla
    indexer_cache: bool = True  # False where IndexCache shares another layer's indexer

    @property
    def _qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def _replicated(self, hidden: int) -> float:
        q_a = hidden * self.q_lora_rank + self.q_lora_rank if self.q_lora_rank else 0
        kv_a = hidden * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        indexer = 0
        if self.index_head_dim:
            q_in = self.q_lora_rank or hidden
            indexer = (
                q_in * self.index_n_heads * self.index_head_dim
                + hidden * self.index_head_dim
                + hidden * self.index_n_heads
            )
        return float(q_a + kv_a + indexer)

    def _split(self, hidden: int) -> float:
        q_in = self.q_lora_rank or hidden
        q_b = q_in * self.num_heads * self._qk_head_dim
        kv_b = self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
        o = self.num_heads * self.v_head_dim * hidden
        return float(q_b + kv_b + o)

    def params(self, hidden: int) -> ParamMap:
        return {Role.ATTENTION: self._replicated(hidden) + self._split(hidden)}

    def params_per_rank(self, hidden: int, tp: int) -> ParamMap:
        return {Role.ATTENTION: self._replicated(hidden) + self._split(hidden) / tp}

    def kv_specs(self, settings: KVSettings) -> list[KVSpec]:
        specs: list[KVSpec] = [
            MlaKV(
                self.kv_lora_rank,
                self.qk_rope_head_dim,
                settings.element_bytes,
                ds_fp8_layout=settings.fp8_cache and self.sparse and settings.ds_mla_fp8,
                sparse=self.sparse,
            )
        ]
        if self.index_head_dim is not None and self.indexer_cache:
            specs.append(IndexerKV(self.index_head_dim))
        return specs

    def tp_error(self, tp: int) -> str | None:
        if self.num_heads % tp:
            return f"--tp {tp} does not divide the {self.num_heads} attention heads"
        return None

    def context_flops_per_token(self, context_tokens: int) -> float:
        # Absorbed MLA decode attends in the latent space: QK over (latent + rope),
        # AV over the latent, for every head.
        return 2.0 * self.num_heads * (2 * self.kv_lora_rank + self.qk_rope_head_dim) * (
            context_tokens
        )


# DeepSeek-V4's sliding-window cache blocks (DeepseekV4SWACache's block_size).
_V4_WINDOW_BLOCK_TOKENS = 64


def _compressor_state(ratio: int, head_dim: int, alignment: int) -> LatentWindowKV:
    """DeepSeek-V4's CompressorStateCache: fp32 kv and score states over the tokens of
    the open compression window (2 windows overlap for ratio 4), in 4-token blocks for
    ratio 4 and 8-token blocks for ratio 128, the page sizes its kernels share."""
    overlap = 2 if ratio == 4 else 1
    return LatentWindowKV(window=overlap * ratio, entry_bytes=2 * overlap * head_dim * 4,
                          own_block_tokens=4 if ratio == 4 else 8, alignment=alignment,
                          label="compressor state")


@dataclass(frozen=True)
class CompressedAttention:
    """DeepSeek-V4 style attention with cross-token KV compression (shared K = V)."""

    num_heads: int
    head_dim: int
    ratio: int
    window: int
    index_head_dim: int
    q_lora_rank: int | None = None

    def params(self, hidden: int) -> ParamMap:
        q_in = self.q_lora_rank or hidden
        q = (hidden * self.q_lora_rank if self.q_lora_rank else 0) + (
            q_in * self.num_heads * self.head_dim
        )
        kv = hidden * self.head_dim
        o = self.num_heads * self.head_dim * hidden
        return {Role.ATTENTION: float(q + kv + o)}

    def params_per_rank(self, hidden: int, tp: int) -> ParamMap:
        replicated = hidden * self.head_dim + (
            hidden * self.q_lora_rank if self.q_lora_rank else 0
        )
        split = (self.q_lora_rank or hidden) * self.num_heads * self.head_dim + (
            self.num_heads * self.head_dim * hidden
        )
        return {Role.ATTENTION: replicated + split / tp}

    def kv_specs(self, settings: KVSettings) -> list[KVSpec]:
        """The caches vLLM 0.32's DeepseekV4Attention registers, in its order: for
        ratio 4 the indexer's keys (128 fp8 + 4 B scale per entry) and its compressor
        state, then the sliding-window cache, then for ratio > 1 the compressed latent
        and its compressor state (fp32, kv and score halves, doubled for the
        overlapping ratio-4 windows). fp8_ds_mla stores a latent in 584 B (448 B nope,
        128 B rope, 8 B scales) with pages aligned to 576 B; plain rows store
        head_dim elements (bf16 for auto) with pages aligned to 512 B."""
        ds = settings.v4_ds_layout
        alignment = 576 if ds else 512
        entry = 584 if ds else self.head_dim * (1 if settings.fp8_cache else 2)
        ratio = max(1, self.ratio)
        specs: list[KVSpec] = []
        if ratio == 4:
            specs.append(CompressedLatentKV(ratio, self.index_head_dim + self.index_head_dim
                                            // 128 * 4, alignment, "indexer",
                                            block_outermost=True))
            specs.append(_compressor_state(ratio, self.index_head_dim, alignment))
        specs.append(LatentWindowKV(self.window, entry, _V4_WINDOW_BLOCK_TOKENS, alignment))
        if ratio > 1:
            specs.append(CompressedLatentKV(ratio, entry, alignment))
            specs.append(_compressor_state(ratio, self.head_dim, alignment))
        return specs

    def tp_error(self, tp: int) -> str | None:
        if self.num_heads % tp:
            return f"--tp {tp} does not divide the {self.num_heads} attention heads"
        return None

    def context_flops_per_token(self, context_tokens: int) -> float:
        attended = min(context_tokens, self.window) + (
            context_tokens // self.ratio if self.ratio else 0
        )
        return 4.0 * self.num_heads * self.head_dim * attended


@dataclass(frozen=True)
class StateMixer:
    """A recurrent mixer with constant per-sequence state (Mamba-2, gated delta net).

    The state is two tensors, as vLLM's `MambaStateShapeCalculator` shapes them per
    TP rank: a conv state of (conv_kernel - 1 + speculative tokens) x conv_dim / tp
    in the conv dtype (--mamba-cache-dtype, auto = the model dtype), and a temporal
    state of (state_heads / tp) x state_head_elements in the SSM dtype
    (--mamba-ssm-cache-dtype, auto = `default_ssm_dtype`, else the conv dtype).
    conv_dim = conv_channels + n_groups x group_channels, where Mamba-2 replicates
    its groups up to tp when tp does not divide them.
    """

    mixer_params: int
    conv_channels: int
    conv_kernel: int
    state_heads: int
    state_head_elements: int
    n_groups: int = 0
    group_channels: int = 0
    default_ssm_dtype: str | None = None  # the family's default (Nemotron-H: float32)
    split_fraction: float = 1.0  # share of params that shards over TP

    @property
    def state_elements(self) -> int:
        """Conv + SSM state elements per sequence on one rank at TP 1."""
        return self.conv_elements(1, 0) + self.state_heads * self.state_head_elements

    def _groups(self, tp: int) -> int:
        if not self.n_groups or self.n_groups % tp == 0:
            return self.n_groups
        return self.n_groups + tp - self.n_groups

    def conv_elements(self, tp: int, speculative_tokens: int) -> int:
        conv_dim = self.conv_channels + self._groups(tp) * self.group_channels
        return (self.conv_kernel - 1 + speculative_tokens) * (conv_dim // tp)

    def params(self, hidden: int) -> ParamMap:
        return {Role.ATTENTION: float(self.mixer_params)}

    def params_per_rank(self, hidden: int, tp: int) -> ParamMap:
        split = self.mixer_params * self.split_fraction
        return {Role.ATTENTION: self.mixer_params - split + split / tp}

    def kv_specs(self, settings: KVSettings) -> list[KVSpec]:
        tp = settings.tp
        conv_bytes = settings.state_element_bytes or settings.model_element_bytes
        ssm_bytes = (settings.ssm_state_element_bytes
                     or (dtype_bytes(self.default_ssm_dtype) if self.default_ssm_dtype else None)
                     or conv_bytes)
        state = (self.conv_elements(tp, settings.speculative_tokens) * conv_bytes
                 + self.state_heads // tp * self.state_head_elements * ssm_bytes)
        return [StateKV(state, settings.state_blocks_per_request, settings.state_block_tokens)]

    def tp_error(self, tp: int) -> str | None:
        conv_dim = self.conv_channels + self._groups(tp) * self.group_channels
        if self.state_heads % tp or conv_dim % tp:
            return f"--tp {tp} does not divide the {self.state_heads} state heads"
        return None

    def context_flops_per_token(self, context_tokens: int) -> float:
        return 0.0


@dataclass(frozen=True)
class NoMixer:
    """A layer without token mixing (Nemotron-H's MLP-only layers): no KV cache."""

    def params(self, hidden: int) -> ParamMap:
        return {}

    def params_per_rank(self, hidden: int, tp: int) -> ParamMap:
        return {}

    def kv_specs(self, settings: KVSettings) -> list[KVSpec]:
        return []

    def tp_error(self, tp: int) -> str | None:
        return None

    def context_flops_per_token(self, context_tokens: int) -> float:
        return 0.0


@dataclass(frozen=True)
class DenseMlp:
    intermediate_size: int
    gated: bool = True  # SwiGLU/GeGLU: gate, up and down projections

    def params(self, hidden: int) -> ParamMap:
        matrices = 3 if self.gated else 2
        return {Role.MLP: float(matrices * hidden * self.intermediate_size)}

    def params_per_rank(self, hidden: int, tp: int) -> ParamMap:
        return {role: count / tp for role, count in self.params(hidden).items()}

    def active_params(self, hidden: int) -> ParamMap:
        return self.params(hidden)

    def weight_params_read(self, hidden: int, tokens: int) -> ParamMap:
        return self.params(hidden)

    def activation_width(self, tp: int) -> int:
        """Elements per token the MLP keeps live at its peak on one rank: the gate/up
        output and its activation."""
        return int(3 * self.intermediate_size / tp)

    # Bytes a captured CUDA graph keeps per layer of this kind (memory_budget's graph
    # term; fitted on vLLM 0.19 start-up logs, tests/data/groundtruth/cudagraph_memory.csv).
    cudagraph_bytes_per_graph: ClassVar[int] = int(0.26 * MIB)


@dataclass(frozen=True)
class MoeMlp:
    """Routed experts (each token uses `top_k` of `num_experts`) plus shared experts."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    shared_intermediate_size: int = 0
    gated: bool = True
    shared_gate: bool = False  # a scalar gate on the shared expert (Qwen2-MoE)
    dense_intermediate_size: int = 0  # a dense MLP beside the experts (Gemma 4, Arctic)

    def _expert(self, hidden: int, intermediate: int) -> float:
        return float((3 if self.gated else 2) * hidden * intermediate)

    def _fixed(self, hidden: int) -> ParamMap:
        fixed: ParamMap = {
            Role.ROUTER: float(hidden * self.num_experts + (hidden if self.shared_gate else 0))
        }
        if self.shared_intermediate_size:
            fixed[Role.SHARED_EXPERTS] = self._expert(hidden, self.shared_intermediate_size)
        if self.dense_intermediate_size:
            fixed[Role.MLP] = self._expert(hidden, self.dense_intermediate_size)
        return fixed

    def params(self, hidden: int) -> ParamMap:
        routed = self.num_experts * self._expert(hidden, self.expert_intermediate_size)
        return add_params({Role.EXPERTS: routed}, self._fixed(hidden))

    def params_per_rank(self, hidden: int, tp: int) -> ParamMap:
        per_rank = {}
        for role, count in self.params(hidden).items():
            per_rank[role] = count if role is Role.ROUTER else count / tp
        return per_rank

    def active_params(self, hidden: int) -> ParamMap:
        routed = self.top_k * self._expert(hidden, self.expert_intermediate_size)
        return add_params({Role.EXPERTS: routed}, self._fixed(hidden))

    def activation_width(self, tp: int) -> int:
        """Elements per token at the MLP's peak on one rank: the top-k experts' and the
        shared experts' gate/up outputs and activations, at most all experts'."""
        per_token = self.top_k * self.expert_intermediate_size + self.shared_intermediate_size
        width = min(3 * per_token / tp,
                    3 * self.num_experts * self.expert_intermediate_size / tp)
        return int(width)

    # Router, top-k and expert kernels: more graph nodes per layer than a dense MLP.
    cudagraph_bytes_per_graph: ClassVar[int] = int(0.47 * MIB)

    def experts_touched(self, tokens: int) -> float:
        """Expected distinct experts a batch of `tokens` tokens routes to (uniform routing)."""
        if tokens <= 0:
            return 0.0
        miss = (1.0 - self.top_k / self.num_experts) ** tokens
        return self.num_experts * (1.0 - miss)

    def weight_params_read(self, hidden: int, tokens: int) -> ParamMap:
        """Parameters a forward pass over `tokens` tokens reads from memory."""
        routed = self.experts_touched(tokens) * self._expert(hidden, self.expert_intermediate_size)
        return add_params({Role.EXPERTS: routed}, self._fixed(hidden))


Mlp = DenseMlp | MoeMlp


@dataclass(frozen=True)
class Layer:
    mixer: GqaAttention | MlaAttention | CompressedAttention | StateMixer | NoMixer
    mlp: Mlp


@dataclass(frozen=True)
class ContextLength:
    """The model's context length as vLLM derives it from the config.

    `limit` is the longest `--max-model-len` vLLM accepts (without
    VLLM_ALLOW_LONG_MAX_MODEL_LEN; None when the config gives no length and vLLM checks
    none), `default` what it serves without one (below the limit for LongRoPE models:
    their original context), `source` where the limit comes from, for messages
    ("max_position_embeddings x rope factor 4")."""

    limit: int | None
    default: int
    source: str


@dataclass(frozen=True)
class ModelArchitecture:
    """What the model is, independent of how it is deployed."""

    name: str
    model_type: str
    hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    layers: tuple[Layer, ...]
    context: ContextLength
    torch_dtype: str | None
    quantization: Mapping[str, object] | None = None
    vision_params: int = 0
    notes: tuple[str, ...] = field(default=())
    # GPU generations (compute capability majors) on which vLLM serves this family's
    # KV cache in fp8 when --kv-cache-dtype is auto (GLM-5 on Blackwell).
    fp8_kv_default_on: tuple[int, ...] = ()
    # The attention of the MTP layers vLLM loads as the drafter of speculative
    # decoding with method mtp (their caches count in the KV pool); () when unknown.
    drafter_mixers: tuple[GqaAttention | MlaAttention | CompressedAttention, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def is_moe(self) -> bool:
        return any(isinstance(layer.mlp, MoeMlp) for layer in self.layers)

    def _embedding_params(self) -> ParamMap:
        embed = float(self.vocab_size * self.hidden_size)
        params: ParamMap = {Role.EMBEDDING: embed}
        if not self.tie_word_embeddings:
            params[Role.LM_HEAD] = embed
        # Two norms per layer and a final norm.
        params[Role.NORM] = float((2 * self.num_layers + 1) * self.hidden_size)
        if self.vision_params:
            params[Role.VISION] = float(self.vision_params)
        return params

    def params_by_role(self) -> ParamMap:
        return add_params(
            self._embedding_params(),
            *(layer.mixer.params(self.hidden_size) for layer in self.layers),
            *(layer.mlp.params(self.hidden_size) for layer in self.layers),
        )

    def active_params_by_role(self) -> ParamMap:
        return add_params(
            self._embedding_params(),
            *(layer.mixer.params(self.hidden_size) for layer in self.layers),
            *(layer.mlp.active_params(self.hidden_size) for layer in self.layers),
        )

    def params_total(self) -> int:
        return round(sum(self.params_by_role().values()))

    def params_active(self) -> int:
        return round(sum(self.active_params_by_role().values()))

    def params_per_rank_by_role(self, tp: int) -> ParamMap:
        """Parameters one TP rank loads: vocab and heads split, norms/routers replicated.

        vLLM pads the vocabulary to a multiple of 64 before splitting it over ranks.
        """
        embedding = self._embedding_params()
        padded_vocab = -(-self.vocab_size // _VOCAB_PADDING) * _VOCAB_PADDING
        vocab_rows = -(-padded_vocab // tp)
        per_rank: ParamMap = {}
        for role, count in embedding.items():
            if role in (Role.EMBEDDING, Role.LM_HEAD):
                per_rank[role] = float(vocab_rows * self.hidden_size)
            else:
                per_rank[role] = count
        return add_params(
            per_rank,
            *(layer.mixer.params_per_rank(self.hidden_size, tp) for layer in self.layers),
            *(layer.mlp.params_per_rank(self.hidden_size, tp) for layer in self.layers),
        )

    def kv_specs(self, settings: KVSettings) -> list[KVSpec]:
        """One spec per cache-holding layer on one TP rank, in layer order; the MTP
        drafter's layers after the backbone's when it is the drafter."""
        specs: list[KVSpec] = []
        for layer in self.layers:
            specs.extend(layer.mixer.kv_specs(settings))
        if settings.mtp_drafter:
            for mixer in self.drafter_mixers:
                specs.extend(mixer.kv_specs(settings))
        return specs

    def tp_error(self, tp: int) -> str | None:
        """Why the model cannot be split over `tp` ranks, or None."""
        for layer in self.layers:
            error = layer.mixer.tp_error(tp)
            if error is not None:
                return f"{error} of {self.name}"
        return None

    def linear_params_read(self, tokens: int) -> ParamMap:
        """Layer weights (no embeddings) a forward pass over `tokens` tokens reads."""
        return add_params(
            *(layer.mixer.params(self.hidden_size) for layer in self.layers),
            *(layer.mlp.weight_params_read(self.hidden_size, tokens) for layer in self.layers),
        )

    def context_flops_per_token(self, context_tokens: int) -> float:
        return sum(layer.mixer.context_flops_per_token(context_tokens) for layer in self.layers)
