"""`kvgate` command dispatcher. Subcommands import their modules lazily, so that
`kvgate plan` never loads the server's dependencies."""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """\
usage: kvgate <command> [options]

KV-cache-aware admission control for vLLM.

commands:
  serve     run the sidecar in front of a vLLM server (admit, queue or reject by prediction)
  plan      plan a deployment offline: KV capacity as vLLM logs it, latency, max-num-seqs
  simulate  replay a trace in an engine simulator, vLLM alone vs through kvgate (what-if)
  presets   list the bundled model configs usable as --model / --model-config
  gpus      list the GPU catalogue and its figures

`kvgate <command> --help` explains each command's options.
"""


def _no_options(command: str, summary: str, argv: Sequence[str]) -> int | None:
    """`kvgate presets` and `kvgate gpus` take no options: --help explains the command,
    anything else is an error (exit 2). None: go on."""
    if not argv:
        return None
    if argv[0] in ("-h", "--help"):
        sys.stdout.write(f"usage: kvgate {command}\n\n{summary}\n")
        return 0
    sys.stderr.write(f"kvgate {command}: error: unexpected argument {argv[0]!r} "
                     f"(`kvgate {command}` takes no options)\n")
    return 2


PRESETS_HELP = ("List the model configs bundled with kvgate, one Hugging Face id per line, "
                "each usable\noffline as --model (kvgate plan, kvgate simulate) or "
                "--model-config (kvgate serve).")
GPUS_HELP = ("List the GPU catalogue: memory, bandwidth and dense bf16 / fp8 TFLOP/s per "
             "GPU, and where\neach figure comes from. A name or any of its other names "
             "(case-insensitive) is usable as `--gpu`.")


def _presets(argv: Sequence[str]) -> int:
    answer = _no_options("presets", PRESETS_HELP, argv)
    if answer is not None:
        return answer
    from sidecar.model import presets

    for name in presets.names():
        print(name)
    return 0


def _gpus(argv: Sequence[str]) -> int:
    answer = _no_options("gpus", GPUS_HELP, argv)
    if answer is not None:
        return answer
    from sidecar.cli.table import render
    from sidecar.model import CATALOGUE

    # Sources as numbered notes under the table: several GPUs share one, and a long one
    # would widen every row.
    sources: dict[str, int] = {}
    rows = [
        [gpu.name, ", ".join(a for a in gpu.aliases if a != gpu.name.lower()) or "-",
         f"{gpu.memory_gib:g}", f"{gpu.bandwidth_gbps:,.0f}", f"{gpu.bf16_tflops:,.0f}",
         f"{gpu.fp8_tflops:,.0f}" if gpu.fp8_tflops else "-",
         f"[{sources.setdefault(gpu.source, len(sources) + 1)}]"]
        for gpu in CATALOGUE
    ]
    print(render(rows, ["gpu", "also as --gpu", "memory GiB", "GB/s", "bf16 TFLOPS",
                        "fp8 TFLOPS", "source"]))
    print("\nsources:")
    for source, number in sources.items():
        print(f"  [{number}] {source}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _dispatch(list(sys.argv[1:] if argv is None else argv))
    except BrokenPipeError:
        # Output piped into `head` and the like: stop quietly.
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        return 130


def _dispatch(args: list[str]) -> int:
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(USAGE)
        return 0
    command, rest = args[0], args[1:]
    if command in ("--version", "version"):
        from sidecar import __version__

        print(f"kvgate {__version__}")
        return 0
    if command == "plan":
        from sidecar.cli.plan import run as run_plan

        return run_plan(rest)
    if command == "simulate":
        from sidecar.cli.simulate import run as run_simulate

        return run_simulate(rest)
    if command == "serve":
        from sidecar.cli.serve import run as run_serve

        return run_serve(rest)
    if command == "presets":
        return _presets(rest)
    if command == "gpus":
        return _gpus(rest)
    sys.stderr.write(f"kvgate: error: unknown command {command!r} (see `kvgate --help`)\n")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
