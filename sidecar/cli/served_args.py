"""The flags that describe a served model, shared by `kvgate plan` and
`kvgate simulate`: the model, the GPU and how vLLM was started, and the
`ServedModel` they make."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from sidecar.calibration.store import CalibrationFileError, read_calibration
from sidecar.cli.args import (
    Parser,
    fraction,
    memory_gib,
    non_negative_int,
    positive_float,
    positive_int,
    vllm_version,
)
from sidecar.cli.model_source import read_model
from sidecar.model import (
    Deployment,
    Efficiency,
    Gpu,
    ModelError,
    ServedModel,
    custom_gpu,
    find_gpu,
)
from sidecar.model.architecture import MlaAttention, ModelArchitecture
from sidecar.model.gpu import with_overrides
from sidecar.model.quantization import DTYPE_CHOICES
from sidecar.model.served import (
    ATTENTION_BACKENDS,
    KV_CACHE_DTYPES,
    MAMBA_CACHE_MODES,
    SPECULATIVE_METHODS,
    STATE_DTYPES,
    VLLM_VERSION,
)
from sidecar.model.units import GIB


def add_served_model_args(parser: Parser) -> None:
    """The model, GPU and vLLM groups of flags."""
    model = parser.add_argument_group("model")
    model.add_argument("--model", required=True, metavar="M",
                       help="a config.json, a directory holding one, a Hugging Face id "
                            "(read from the local Hugging Face cache, a bundled preset or "
                            "the Hub, e.g. meta-llama/Llama-3.1-70B-Instruct) or a preset "
                            "name (`kvgate presets` lists them)")
    model.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                       help="weight precision: auto reads torch_dtype and quantization_config "
                            "(default: auto)")
    model.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                       help="KV cache element type: auto follows the model dtype (default: auto)")

    gpu = parser.add_argument_group("GPU (a catalogue name, or custom figures)")
    gpu.add_argument("--gpu", metavar="NAME", help="GPU from the catalogue, e.g. H100, A100-80GB")
    gpu.add_argument("--gpu-memory-gib", type=memory_gib, metavar="X",
                     help="runtime-visible memory per GPU in GiB (overrides the catalogue)")
    gpu.add_argument("--gpu-bandwidth-gbps", type=positive_float, metavar="Y",
                     help="memory bandwidth in GB/s (overrides the catalogue)")
    gpu.add_argument("--gpu-tflops", type=positive_float, metavar="Z",
                     help="dense bf16 TFLOP/s (overrides the catalogue)")
    gpu.add_argument("--tp", type=positive_int, default=1, metavar="N",
                     help="tensor-parallel size: GPUs per replica (default: 1)")

    vllm = parser.add_argument_group("vLLM settings")
    vllm.add_argument("--gpu-memory-utilization", type=fraction, default=0.9, metavar="F",
                      help="share of GPU memory vLLM may use (default: 0.9)")
    vllm.add_argument("--max-model-len", type=positive_int, metavar="N",
                      help="context length per request (default: vLLM's, from the "
                           "config: max_position_embeddings, times a linear or dynamic "
                           "rope scaling factor; a LongRoPE model's original length)")
    vllm.add_argument("--block-size", type=positive_int, metavar="N",
                      help="tokens per KV block (default: vLLM's choice for the model: 16, "
                           "64 with a DSA indexer, 256 for DeepSeek-V4's compressed caches, "
                           "raised for Mamba hybrids; vLLM on CPU uses 128)")
    vllm.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, metavar="NAME",
                      help="vLLM's --attention-backend where it changes the KV layout: "
                           "FLASHINFER_MLA_SPARSE_DSV4 stores DeepSeek-V4's caches as plain "
                           "bf16 / fp8 rows instead of fp8_ds_mla (not on SM12x) "
                           f"(one of {', '.join(ATTENTION_BACKENDS)}; default: vLLM's "
                           "choice for the GPU)")
    vllm.add_argument("--mamba-cache-mode", choices=("auto", *MAMBA_CACHE_MODES),
                      action=AutoIsNone, metavar="MODE",
                      help="Mamba / gated-delta-net state caching: align (2 state blocks "
                           "per request) or none (1); auto: align with prefix caching, "
                           "else none, as vLLM chooses (default: auto)")
    vllm.add_argument("--mamba-cache-dtype", choices=STATE_DTYPES, default="auto",
                      help="Mamba conv state dtype (default: auto, the model dtype)")
    vllm.add_argument("--mamba-ssm-cache-dtype", choices=STATE_DTYPES, default="auto",
                      help="Mamba temporal state dtype (default: auto, the family's "
                           "default: float32 for Nemotron-H, the config's mamba_ssm_dtype "
                           "for Qwen3.5, else the conv state dtype)")
    vllm.add_argument("--num-speculative-tokens", type=non_negative_int, default=0,
                      metavar="N", help="speculative tokens per step (MTP / EAGLE): more "
                      "state blocks per request on Mamba hybrids (default: 0)")
    vllm.add_argument("--speculative-method", choices=SPECULATIVE_METHODS, metavar="METHOD",
                      help="the drafter of speculative decoding: mtp (the model's own MTP "
                           "layers, whose KV caches join the model's) or ngram (no KV "
                           "layers) (default: a drafter without KV layers)")
    vllm.add_argument("--data-parallel-size", type=positive_int, default=1, metavar="N",
                      help="engines behind one server, each with its own KV pool; the "
                           "capacity figures are per engine (default: 1)")
    vllm.add_argument("--max-num-batched-tokens", type=positive_int, metavar="N",
                      help="tokens per engine step (default: vLLM's default for the GPU)")
    vllm.add_argument("--max-num-seqs", type=positive_int, metavar="N",
                      help="vLLM's cap on running sequences (default: vLLM's default)")
    vllm.add_argument("--long-prefill-token-threshold", type=non_negative_int, default=0,
                      metavar="N",
                      help="vLLM's flag of that name: while other requests are running or "
                           "waiting, a step gives one prompt at most N tokens (default: 0, "
                           "no cap)")
    vllm.add_argument("--num-gpu-blocks-override", type=positive_int, metavar="N",
                      help="a forced number of KV blocks, as vLLM's flag of that name")
    vllm.add_argument("--available-kv-gib", type=memory_gib, metavar="X",
                      help="the KV budget per GPU vLLM logged ('Available KV cache memory'); "
                           "capacity then follows exactly and no GPU is needed")
    vllm.add_argument("--prefix-caching", choices=("auto", "on", "off"), dest="no_prefix_cache",
                      action=PrefixCaching, default=False,
                      help="whether the server shares prompt blocks between requests "
                      "(vLLM's --enable-prefix-caching / --no-enable-prefix-caching; "
                      "`kvgate serve` takes the same flag); auto: vLLM's default, on "
                      "(default: auto)")
    vllm.add_argument("--no-prefix-cache", "--no-enable-prefix-caching",
                      dest="no_prefix_cache", action="store_true",
                      help="the same as --prefix-caching off: nothing is shared or found "
                      "cached")
    vllm.add_argument("--enforce-eager", action="store_true",
                      help="the server runs without CUDA graphs (vLLM's --enforce-eager): "
                      "no graph pool comes out of the KV budget; the kernel launches it "
                      "adds to every decode step are not priced, so TPOT reads low (half "
                      "of the one public row's: docs/model.md#accuracy)")
    vllm.add_argument("--vllm-version", type=vllm_version, default=VLLM_VERSION, metavar="X.Y",
                      help="the server's vLLM version, for its memory accounting: from 0.21 "
                      "vLLM takes its CUDA graphs out of the KV budget (default: "
                      f"{'.'.join(map(str, VLLM_VERSION))}, the version kvgate follows)")
    scheduling = vllm.add_mutually_exclusive_group()
    # None: not given (vLLM's default: on, off in its CPU build).
    scheduling.add_argument("--async-scheduling", dest="no_async_scheduling",
                            action="store_false", default=None,
                            help="the server schedules each step while the last one runs "
                            "(vLLM's default on GPUs; `kvgate serve` takes the same flag)")
    scheduling.add_argument("--no-async-scheduling", dest="no_async_scheduling",
                            action="store_true", default=None,
                            help="the server schedules each step after the last one's output "
                            "(vLLM's --no-async-scheduling; its CPU build always does): "
                            "finished requests free their blocks a step sooner and new ones "
                            "start a step sooner (see also --cpu-build; vLLM also turns it "
                            "off with an n-gram drafter)")
    vllm.add_argument("--cpu-build", action="store_true",
                      help="the server is vLLM's CPU build: no asynchronous scheduling, "
                      "and its API server's work per request (tokenizing, the HTTP "
                      "exchange) runs on the cores that compute the steps, so each new "
                      "request lengthens the step it starts in for every request in it; "
                      "and its block size: 128 unless --block-size is given (hybrids "
                      "aligned from it), always 16 with latent attention and 256 for "
                      "DeepSeek-V4, as the build's kernels require")


def gpu_from_args(args: argparse.Namespace) -> Gpu | None:
    if args.gpu:
        return with_overrides(
            find_gpu(args.gpu), args.gpu_memory_gib, args.gpu_bandwidth_gbps, args.gpu_tflops
        )
    figures = (args.gpu_memory_gib, args.gpu_bandwidth_gbps, args.gpu_tflops)
    if all(value is not None for value in figures):
        return custom_gpu(*figures)
    if any(value is not None for value in figures):
        raise ModelError(
            "a custom GPU needs all of --gpu-memory-gib, --gpu-bandwidth-gbps and --gpu-tflops"
        )
    return None


def load_efficiency(path: Path | None) -> Efficiency | None:
    """The efficiencies of a saved calibration, read and checked as `kvgate serve` reads
    its own (`sidecar.calibration.read_calibration`)."""
    if path is None:
        return None
    try:
        return read_calibration(path).efficiency
    except CalibrationFileError as exc:
        raise ModelError(f"--calibration {exc}") from exc


class AutoIsNone(argparse.Action):
    """A choice whose `auto` leaves the setting to vLLM's default (None)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, None if values == "auto" else values)


class PrefixCaching(argparse.Action):
    """`--prefix-caching auto|on|off`, kept as the `no_prefix_cache` the other spelling
    sets (auto: vLLM's default, on)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values == "off")


def deployment_from_args(args: argparse.Namespace) -> Deployment:
    if args.no_async_scheduling is False and args.cpu_build:
        raise ModelError("--async-scheduling with --cpu-build: vLLM's CPU build never "
                         "schedules asynchronously")
    if (args.no_async_scheduling is False and args.num_speculative_tokens > 0
            and args.speculative_method in (None, "ngram")):
        raise ModelError("--async-scheduling with an n-gram drafter (--speculative-method "
                         "ngram, or none given): vLLM refuses asynchronous scheduling with it")
    return Deployment(
        tp=args.tp,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        available_kv_bytes=round(args.available_kv_gib * GIB) if args.available_kv_gib else None,
        enable_prefix_caching=not args.no_prefix_cache,
        mamba_cache_mode=args.mamba_cache_mode,
        mamba_cache_dtype=args.mamba_cache_dtype,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        num_speculative_tokens=args.num_speculative_tokens,
        data_parallel_size=args.data_parallel_size,
        attention_backend=args.attention_backend,
        speculative_method=args.speculative_method,
        async_scheduling=not (bool(args.no_async_scheduling) or args.cpu_build),
        host_shares_device=args.cpu_build,
        enforce_eager=args.enforce_eager,
        vllm_version=args.vllm_version,
    )


def cpu_block_size(arch: ModelArchitecture, given: int | None) -> int:
    """The block size vLLM's CPU build runs `arch` with (`CpuPlatform.
    check_and_update_config`, vLLM 0.32): 256 for DeepSeek-V4 and 16 for latent
    attention (its reference kernel; a CPU with AMX tiles keeps the rest's), whatever
    was `given`; else `given`, or 128 (a hybrid's state layers align from it)."""
    if arch.model_type == "deepseek_v4":
        return 256
    if any(isinstance(layer.mixer, MlaAttention) for layer in arch.layers):
        return 16
    return given or 128


def served_model_from_args(args: argparse.Namespace,
                           note: Callable[[str], None] | None = None) -> ServedModel:
    """The served model the flags describe, calibrated when --calibration is given."""
    arch = read_model(args.model, note) if note is not None else read_model(args.model)
    deployment = deployment_from_args(args)
    if args.cpu_build:
        block = cpu_block_size(arch, args.block_size)
        if args.block_size is not None and block != args.block_size and note is not None:
            note(f"--block-size {args.block_size}: vLLM's CPU build runs this model with "
                 f"{block}-token blocks whatever is given")
        deployment = replace(deployment, block_size=block)
    served = ServedModel(arch, deployment, gpu_from_args(args))
    # vLLM lowers its default max_num_seqs to the batched tokens, but refuses a given one
    # above them.
    if args.max_num_seqs and served.max_num_batched_tokens < served.max_num_seqs:
        tokens = str(served.max_num_batched_tokens)
        if not args.max_num_batched_tokens:
            tokens += (", vLLM's default for the GPU" if served.gpu is not None
                       else ", the default kvgate assumes without --gpu")
        raise ModelError(f"--max-num-batched-tokens ({tokens}) must be at least "
                         f"--max-num-seqs ({served.max_num_seqs}), as vLLM requires")
    efficiency = load_efficiency(args.calibration)
    return served if efficiency is None else served.with_efficiency(efficiency)
