"""Weight memory per GPU and the bytes a forward pass streams from it."""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.model.architecture import ModelArchitecture, MoeMlp, Role
from sidecar.model.quantization import WeightPrecision
from sidecar.model.units import round_up


@dataclass(frozen=True)
class WeightFootprint:
    """Bytes of weights one TP rank holds, by parameter role."""

    bytes_by_role: dict[Role, float]
    tied_embeddings: bool

    @property
    def total_bytes(self) -> int:
        return round(sum(self.bytes_by_role.values()))

    def bytes_read_per_step(self, expert_fraction: float) -> float:
        """Bytes one forward step streams: every layer weight once, the routed experts
        only in the share the batch touches, the embedding table only as lm_head
        when tied (an embedding lookup reads a few rows), the vision tower not at all."""
        total = 0.0
        for role, size in self.bytes_by_role.items():
            if role in (Role.VISION,) or (role is Role.EMBEDDING and not self.tied_embeddings):
                continue
            total += size * expert_fraction if role is Role.EXPERTS else size
        return total


def weight_footprint(
    arch: ModelArchitecture, precision: WeightPrecision, tp: int
) -> WeightFootprint:
    per_rank = arch.params_per_rank_by_role(tp)
    # Layers kept whole at full precision weigh in at the default precision.
    kept = len([i for i in precision.unconverted_layers if i < arch.num_layers])
    share = kept / arch.num_layers if arch.num_layers else 0.0
    default = precision.default.bytes_per_weight
    by_role = {
        role: count * ((1 - share) * precision.of(role).bytes_per_weight + share * default)
        if role in precision.by_role else count * precision.of(role).bytes_per_weight
        for role, count in per_rank.items()
    }
    if precision.expert_padding and Role.EXPERTS in by_role:
        by_role[Role.EXPERTS] *= _expert_padding_factor(arch, tp, *precision.expert_padding)
    return WeightFootprint(by_role, arch.tie_word_embeddings)


def _expert_padding_factor(
    arch: ModelArchitecture, tp: int, hidden_multiple: int, intermediate_multiple: int
) -> float:
    """Growth of expert matrices padded to kernel tiles: (H' x I') / (H x I) per rank."""
    moe = next((layer.mlp for layer in arch.layers if isinstance(layer.mlp, MoeMlp)), None)
    if moe is None:
        return 1.0
    hidden = arch.hidden_size
    intermediate = moe.expert_intermediate_size // tp
    padded_hidden = round_up(hidden, hidden_multiple)
    padded_intermediate = round_up(intermediate, intermediate_multiple)
    return (padded_hidden * padded_intermediate) / (hidden * intermediate)


def expert_fraction_read(arch: ModelArchitecture, tokens: int) -> float:
    """Share of routed-expert weights a step over `tokens` tokens reads (1.0 if dense)."""
    fractions = [
        layer.mlp.experts_touched(tokens) / layer.mlp.num_experts
        for layer in arch.layers
        if isinstance(layer.mlp, MoeMlp)
    ]
    return sum(fractions) / len(fractions) if fractions else 1.0
