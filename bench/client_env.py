"""The real clients' own environment: the OpenAI Python client, guidellm and
inference-perf at pinned versions, cached under $KVGATE_CACHE/clients-<versions>.

Never installed into the project's venv or vLLM's (their dependencies clash with
both); `vllm bench serve` runs from vLLM's own environment. The environment is marked
complete only after every step succeeded, so a failed install is retried next time.

    python bench/client_env.py          # build it (a few minutes once), print its path
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

# Pinned: the versions bench/results/clients.json was measured with.
CLIENTS = {
    "openai": "3.51.0",
    "guidellm": "0.8.1",
    "inference-perf": "0.7.0",
}
# Pythons tried in order (inference-perf needs 3.12 or newer); KVGATE_CLIENTS_PYTHON
# overrides, and interpreters pyenv installed are tried after those on PATH.
PYTHONS = ("python3.12", "python3.13", "python3.14", "python3")
MIN_PYTHON = (3, 12)

class ClientEnvError(RuntimeError):
    """The clients' environment could not be built."""


def cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvgate"
    return Path(os.environ.get("KVGATE_CACHE", default))


def env_path() -> Path:
    key = "-".join(f"{name}{version}" for name, version in CLIENTS.items())
    return cache_dir() / f"clients-{key}"


def _candidates() -> list[str]:
    if os.environ.get("KVGATE_CLIENTS_PYTHON"):
        return [os.environ["KVGATE_CLIENTS_PYTHON"]]
    found = [path for name in PYTHONS if (path := shutil.which(name))]
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found += sorted(str(p) for p in pyenv.glob("3.*/bin/python3"))
    return found


def _python() -> str:
    wanted = ".".join(map(str, MIN_PYTHON))
    for candidate in _candidates():
        probe = subprocess.run(
            [candidate, "-c", "import sys, venv, ensurepip; "
             f"raise SystemExit(sys.version_info < {MIN_PYTHON!r})"],
            capture_output=True, check=False)
        if probe.returncode == 0:
            return candidate
    raise ClientEnvError(f"no Python {wanted} or newer with venv found (tried "
                         f"{', '.join(_candidates()) or 'none'}); set KVGATE_CLIENTS_PYTHON")

def client_env(log: bool = True) -> Path:
    """The clients' venv, built when missing or incomplete; its path."""
    venv = env_path()
    if (venv / ".complete").exists():
        return venv
    python = _python()
    if log:
        print(f"==> installing {', '.join(f'{n}=={v}' for n, v in CLIENTS.items())} "
              f"into {venv}", file=sys.stderr)
    # guidellm pulls in PyTorch: PyTorch's CPU index keeps it to the CPU build.
    index = os.environ.get("KVGATE_TORCH_INDEX")
    extra = ["--extra-index-url", index] if index else []
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    steps = [
        [python, "-m", "venv", str(venv)],
        [str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
         *extra, *(f"{name}=={version}" for name, version in CLIENTS.items())],
    ]
    for step in steps:
        done = subprocess.run(step, check=False)
        if done.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            raise ClientEnvError(f"{' '.join(step[:4])} ... failed (exit {done.returncode}; "
                                 "pip's message is above); nothing was marked complete")
    (venv / ".complete").touch()
    return venv


if __name__ == "__main__":
    try:
        print(client_env())
    except ClientEnvError as exc:
        print(f"client_env: {exc}", file=sys.stderr)
        raise SystemExit(1) from exc
