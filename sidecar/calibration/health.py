"""What a calibration says about the server: the efficiencies it implies against the
named device, and a warning when they are implausible.

The fit learns effective rates, which no catalogue figure bounds. Measured against the
device kvgate was told about (`--gpu`, the custom figures, or the generic device):

- an efficiency above 1: the server runs faster than that device's peak can, so the
  server is not that device (or its figures are wrong);
- prefill computing `SLOWER`x or more slower than that device usually does (its
  compute efficiency against the model's default), or a decode step (batch 1, 512
  tokens of context) taking `SLOWER`x or more the time the analytical model predicts
  for that device: a shared device (MIG slice, other tenants), a power cap, or
  another device than named. (A decode step is compared whole: on one model the
  weights' streaming time and the engine's per-step cost cannot be told apart.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sidecar.model import DEFAULT_EFFICIENCY, ServedModel

SLOWER = 4.0
REFERENCE_PROMPT = 512  # tokens of context of the decode step the check compares
MIN_OBSERVATIONS = 20


@dataclass(frozen=True)
class Health:
    device: str
    compute_efficiency: float
    bandwidth_efficiency: float
    prefill_slowdown: float  # usual / fitted compute efficiency on the device
    decode_slowdown: float  # fitted / expected time of a decode step at batch 1
    warnings: tuple[str, ...]

    def as_dict(self) -> dict[str, object]:
        return {
            "device": self.device,
            "implied_efficiency": {"compute": self.compute_efficiency,
                                   "bandwidth": self.bandwidth_efficiency},
            "slowdown_vs_device": {"prefill": self.prefill_slowdown,
                                   "decode": self.decode_slowdown},
            "warnings": list(self.warnings),
        }


def warning_kind(warning: str) -> str:
    """A warning without its figures: what it is about, the same however far the fit
    moves (so that a log says it once)."""
    return re.sub(r"\d+(?:\.\d+)?x", "Nx", warning)


def health(fitted: ServedModel, observations: int, *, device_named: bool = True
           ) -> Health | None:
    """The calibrated model against the analytical one on the same device; warnings only
    once `MIN_OBSERVATIONS` back the fit, and only about a device the operator named
    (not the generic stand-in kvgate uses without --gpu)."""
    gpu = fitted.gpu
    if gpu is None:
        return None
    expected = fitted.with_efficiency(DEFAULT_EFFICIENCY)
    context = (REFERENCE_PROMPT,)
    ours, theirs = fitted.tpot(context), expected.tpot(context)
    if ours is None or theirs is None or theirs.seconds <= 0:
        return None
    efficiency = fitted.efficiency
    slowdowns = [DEFAULT_EFFICIENCY.compute / efficiency.compute, ours.seconds / theirs.seconds]
    warnings: list[str] = []
    if device_named and observations >= MIN_OBSERVATIONS:
        # The bandwidth one server's contexts identify is the KV cache's (the weights'
        # time moves with the cost per step): past the peak is past it for that share.
        for name, value in (("compute", efficiency.compute),
                            ("bandwidth", efficiency.bandwidth * efficiency.kv_bandwidth_ratio)):
            if value > 1.0:
                warnings.append(
                    f"the server reaches {value:.1f}x the {name} peak of {gpu.name}: it is "
                    "not that device, or the device's figures are too low (--gpu)")
        for phase, slowdown in zip(("prefill", "decode"), slowdowns, strict=True):
            if slowdown >= SLOWER:
                warnings.append(
                    f"the server's {phase} runs {slowdown:.1f}x slower than {gpu.name} usually "
                    "does: a shared or capped device (MIG slice, other tenants, power cap), "
                    "or another device than named")
    return Health(gpu.name, efficiency.compute, efficiency.bandwidth, slowdowns[0],
                  slowdowns[1], tuple(warnings))
