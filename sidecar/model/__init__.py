"""The analytical model of a served model on its GPU. Pure: no I/O beyond reading a
config file, no asyncio; nothing else of the package is imported here."""

from sidecar.model.architecture import ModelArchitecture, Role
from sidecar.model.capacity import KVCapacity, KVLayout, build_layout, kv_capacity
from sidecar.model.errors import (
    ConfigError,
    DeploymentError,
    ModelError,
    UnknownGpuError,
    UnknownPresetError,
)
from sidecar.model.gpu import CATALOGUE, Gpu, custom_gpu, find_gpu, gpu_names
from sidecar.model.hf_config import load_config, parse_config, read_architecture
from sidecar.model.kv_spec import KVSpec
from sidecar.model.latency import DEFAULT_EFFICIENCY, Efficiency, PhaseCost, Roofline
from sidecar.model.planning import (
    ChainCall,
    LatencyEstimate,
    Recommendation,
    chain,
    recommend,
    steady_latency,
)
from sidecar.model.served import Deployment, ServedModel

__all__ = [
    "CATALOGUE",
    "DEFAULT_EFFICIENCY",
    "ChainCall",
    "ConfigError",
    "Deployment",
    "DeploymentError",
    "Efficiency",
    "Gpu",
    "KVCapacity",
    "KVLayout",
    "KVSpec",
    "LatencyEstimate",
    "ModelArchitecture",
    "ModelError",
    "PhaseCost",
    "Recommendation",
    "Role",
    "Roofline",
    "ServedModel",
    "UnknownGpuError",
    "UnknownPresetError",
    "build_layout",
    "chain",
    "custom_gpu",
    "find_gpu",
    "gpu_names",
    "kv_capacity",
    "load_config",
    "parse_config",
    "read_architecture",
    "recommend",
    "steady_latency",
]
