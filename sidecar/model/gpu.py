"""A catalogue of accelerators: memory, bandwidth and dense peak FLOPs.

Figures are the vendors' data-sheet numbers for dense (not sparse) math, as
reproduced by NVIDIA's aiconfigurator system files, llm-analysis and GenZ and
checked against the data sheets. `memory_gib` is what the runtime sees
(`torch.cuda.mem_get_info` total), which is below the marketing size: vLLM
multiplies it by `gpu_memory_utilization`. Where no start-up log gave the
runtime figure, it is the marketing size in bytes converted to GiB minus the
~0.6 GiB the driver reserves, marked `memory_measured=False`.

`interconnect_gbps` carries TP all-reduces between GPUs of one node (NVLink, or
PCIe where 0). `over_network` gives the same GPU with its TP peers on other nodes:
all-reduces then cross the data-centre network, whose every ring step adds latency.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sidecar.model.errors import DeploymentError, UnknownGpuError
from sidecar.model.precision import ComputeRate


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gib: float
    bandwidth_gbps: float  # memory bandwidth, GB/s
    bf16_tflops: float  # dense
    fp8_tflops: float | None = None  # dense; None where the GPU has no fp8 tensor cores
    fp4_tflops: float | None = None
    interconnect_gbps: float = 0.0  # per-GPU NVLink/Infinity Fabric bandwidth, one direction
    memory_measured: bool = False
    source: str = ""
    aliases: tuple[str, ...] = ()
    hop_latency_s: float = 0.0  # latency each all-reduce ring step adds (0 within a node)
    # CUDA compute capability (major, minor); None for non-NVIDIA GPUs or unknown ones.
    # vLLM picks attention backends by it: e.g. sparse MLA stores an fp8 cache as
    # fp8_ds_mla on Hopper (9.x) and as plain fp8 on Blackwell (10.x).
    compute_capability: tuple[int, int] | None = None

    def peak_flops(self, rate: ComputeRate) -> float:
        """Dense FLOP/s at the given rate, falling back to the best lower rate."""
        if rate is ComputeRate.FP4 and self.fp4_tflops:
            return self.fp4_tflops * 1e12
        if rate in (ComputeRate.FP4, ComputeRate.FP8) and self.fp8_tflops:
            return self.fp8_tflops * 1e12
        return self.bf16_tflops * 1e12

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 1024**3)

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9


_SHEETS = "vendor data sheet (dense), as in NVIDIA aiconfigurator / llm-analysis / GenZ"

CATALOGUE: tuple[Gpu, ...] = (
    Gpu("A10G", 22.06, 600, 70, None, None, 0, False,
        "AWS A10G: 24 GB GDDR6, 600 GB/s; ~70 TFLOPS bf16 dense (NVIDIA does not publish "
        "the A10G figure; A10 is 125)", ("a10g", "nvidia-a10g")),
    Gpu("A10", 22.06, 600, 125, None, None, 0, False, _SHEETS, ("a10", "nvidia-a10")),
    Gpu("L4", 22.03, 300, 121, 242, None, 0, False, _SHEETS, ("l4", "nvidia-l4")),
    Gpu("L40", 44.39, 864, 181, 362, None, 0, False, _SHEETS, ("l40", "nvidia-l40")),
    Gpu("L40S", 44.39, 864, 362, 733, None, 0, False, _SHEETS, ("l40s", "nvidia-l40s")),
    Gpu("A100-40GB", 39.38, 1555, 312, None, None, 300, True,
        "A100 40GB SXM data sheet; 39.38 GiB seen in vLLM start-up logs",
        ("a100-40gb", "a100-40g", "a100-sxm4-40gb", "a100 40gb")),
    Gpu("A100-80GB", 79.26, 2039, 312, None, None, 300, True,
        "A100 80GB SXM data sheet (PCIe: 1,935 GB/s); 79.26 GiB from two vLLM start-up "
        "logs of one deployment at utilization 0.25 and 0.5 (5.01 and 24.83 GiB of KV: "
        "0.25 x memory = 19.82 GiB; tests/data/groundtruth/latency.csv notes)",
        ("a100", "a100-80gb", "a100-80g", "a100-sxm4-80gb", "a100 80gb", "a100-sxm")),
    Gpu("A100-80GB-PCIe", 79.15, 1935, 312, None, None, 300, False, _SHEETS,
        ("a100-pcie", "a100-80gb-pcie")),
    Gpu("H100-SXM", 79.18, 3350, 989, 1979, None, 450, True,
        "H100 SXM5 data sheet; 79.18 GiB seen in vLLM start-up logs",
        ("h100", "h100-sxm", "h100-80gb", "h100-sxm5", "h100 80gb hbm3", "h100-80gb-hbm3")),
    Gpu("H100-PCIe", 79.18, 2000, 756, 1513, None, 300, False, _SHEETS,
        ("h100-pcie",)),
    Gpu("H100-NVL", 93.1, 3900, 835, 1671, None, 300, False, _SHEETS,
        ("h100-nvl", "h100 nvl")),
    Gpu("GH200", 94.5, 4000, 989, 1979, None, 450, False,
        "GH200 96 GB HBM3 module data sheet", ("gh200", "gh200-96gb", "gh200 120gb")),
    Gpu("H200", 139.8, 4800, 989, 1979, None, 450, False, _SHEETS,
        ("h200", "h200-141gb", "h200 141gb hbm3")),
    Gpu("B200", 178.4, 8000, 2250, 4500, 9000, 900, False,
        "B200 HGX data sheet (7.7-8 TB/s quoted)", ("b200",)),
    Gpu("MI300X", 191.5, 5300, 1307, 2615, None, 448, False,
        "AMD Instinct MI300X data sheet (192 GB HBM3)", ("mi300x", "mi300")),
    Gpu("RTX-4090", 23.65, 1008, 165, 330, None, 0, False,
        "GeForce RTX 4090 data sheet (dense, fp32 accumulate)", ("rtx4090", "4090", "rtx-4090")),
    Gpu("RTX-3090", 23.58, 936, 71, None, None, 0, True,
        "GeForce RTX 3090 data sheet; 23.58 GiB seen in vLLM logs", ("rtx3090", "3090")),
    Gpu("RTX-A5000", 23.57, 768, 111, None, None, 0, False, _SHEETS, ("a5000", "rtx-a5000")),
    Gpu("RTX-6000-Ada", 47.5, 960, 364, 728, None, 0, False, _SHEETS,
        ("rtx-6000-ada", "rtx6000ada")),
    Gpu("T4", 14.58, 320, 65, None, None, 0, False, "T4 data sheet (fp16 tensor)", ("t4",)),
)


# TP across nodes: NCCL over the data-centre network (TCP sockets, no RDMA). Per-GPU
# bandwidth of a 25 GbE link, and the latency one ring step adds. The two deployments
# with TP across nodes in tests/data/groundtruth/latency.csv agree on ~0.2 ms per
# step: gpt-oss-120b at TP4 decodes at 86.6 ms per token where one node would take
# ~5 ms (72 all-reduces of 6 steps each: 0.19 ms), and Qwen2-7B at TP2 decodes 10
# prompts 30.8 ms per token slower than on one node (56 all-reduces of 2 steps: 0.27
# ms with the payload). Their prefill times under load put the effective bandwidth
# between 10 and 25 GbE; the sources do not state the network.
NETWORK_GBPS = 3.125
NETWORK_HOP_LATENCY_S = 200e-6


def over_network(
    gpu: Gpu,
    bandwidth_gbps: float = NETWORK_GBPS,
    hop_latency_s: float = NETWORK_HOP_LATENCY_S,
) -> Gpu:
    """The GPU with its tensor-parallel peers on other nodes.

    Every all-reduce then runs over the network: a ring of p ranks takes 2(p - 1)
    steps, each paying `hop_latency_s` and moving its share of the payload at
    `bandwidth_gbps` (defaults: see NETWORK_HOP_LATENCY_S).
    """
    return replace(gpu, name=f"{gpu.name} (TP across nodes)", interconnect_gbps=bandwidth_gbps,
                   hop_latency_s=hop_latency_s)


# NVIDIA's CUDA GPU compute capability table (developer.nvidia.com/cuda-gpus).
_CAPABILITY: dict[str, tuple[int, int]] = {
    "A10G": (8, 6), "A10": (8, 6), "L4": (8, 9), "L40": (8, 9), "L40S": (8, 9),
    "A100-40GB": (8, 0), "A100-80GB": (8, 0), "A100-80GB-PCIe": (8, 0),
    "H100-SXM": (9, 0), "H100-PCIe": (9, 0), "H100-NVL": (9, 0), "GH200": (9, 0),
    "H200": (9, 0), "B200": (10, 0), "RTX-4090": (8, 9), "RTX-3090": (8, 6),
    "RTX-A5000": (8, 6), "RTX-6000-Ada": (8, 9), "T4": (7, 5),
}
CATALOGUE = tuple(replace(gpu, compute_capability=_CAPABILITY.get(gpu.name))
                  for gpu in CATALOGUE)


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "-")


_BY_NAME: dict[str, Gpu] = {}
for _gpu in CATALOGUE:
    for _alias in (_gpu.name, *_gpu.aliases):
        _BY_NAME.setdefault(_key(_alias), _gpu)


def gpu_names() -> list[str]:
    return [gpu.name for gpu in CATALOGUE]


def find_gpu(name: str) -> Gpu:
    gpu = _BY_NAME.get(_key(name))
    if gpu is None:
        raise UnknownGpuError(
            f"unknown GPU {name!r}; known: {', '.join(gpu_names())} "
            "(or give --gpu-memory-gib, --gpu-bandwidth-gbps and --gpu-tflops)"
        )
    return gpu


def custom_gpu(
    memory_gib: float,
    bandwidth_gbps: float,
    tflops: float,
    fp8_tflops: float | None = None,
    name: str = "custom",
) -> Gpu:
    for label, value in (
        ("--gpu-memory-gib", memory_gib),
        ("--gpu-bandwidth-gbps", bandwidth_gbps),
        ("--gpu-tflops", tflops),
    ):
        if not value > 0:
            raise DeploymentError(f"{label} must be positive, got {value}")
    return Gpu(name, memory_gib, bandwidth_gbps, tflops, fp8_tflops, memory_measured=True,
               source="given on the command line")


def with_overrides(
    gpu: Gpu,
    memory_gib: float | None = None,
    bandwidth_gbps: float | None = None,
    tflops: float | None = None,
) -> Gpu:
    """A catalogue GPU with some figures replaced (e.g. a measured bandwidth)."""
    return replace(
        gpu,
        memory_gib=gpu.memory_gib if memory_gib is None else memory_gib,
        bandwidth_gbps=gpu.bandwidth_gbps if bandwidth_gbps is None else bandwidth_gbps,
        bf16_tflops=gpu.bf16_tflops if tflops is None else tflops,
    )
