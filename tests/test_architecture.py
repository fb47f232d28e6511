"""The architecture stays visible: imports flow one way, the pure parts stay pure,
and the public surfaces are pinned.

    cli -> server -> {admission, upstream, calibration, metrics, tokens} -> model
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "sidecar"

# Which parts of the package each part may import (besides itself).
ALLOWED = {
    "model": set(),
    "admission": {"model"},
    "upstream": set(),
    "tokens": set(),
    "calibration": {"model", "upstream"},
    "metrics": {"admission", "model"},
    "server": {"admission", "upstream", "calibration", "metrics", "model", "tokens"},
    "cli": {"server", "model", "admission", "upstream", "calibration", "metrics", "tokens"},
    "": {"cli"},  # sidecar/__init__.py, sidecar/__main__.py
}
# Third-party or standard modules a part must not use.
FORBIDDEN = {
    # No network: Hub lookups live in sidecar/cli/model_source.py.
    "model": {"asyncio", "aiohttp", "prometheus_client", "pydantic", "torch", "vllm",
              "huggingface_hub", "urllib.request", "http.client", "socket", "requests"},
    "admission": {"aiohttp", "prometheus_client", "torch", "vllm"},
    "upstream": {"prometheus_client.registry", "torch", "vllm"},
    "calibration": {"aiohttp", "prometheus_client", "torch", "vllm"},
    # Local token counting: files in, token ids out.
    "tokens": {"asyncio", "aiohttp", "prometheus_client", "torch", "vllm", "transformers",
               "huggingface_hub", "socket", "urllib.request"},
}


def part_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    if len(relative.parts) == 1:
        return relative.stem if relative.stem in ("metrics",) else ""
    return relative.parts[0]


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


SOURCES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_flow_one_way(path: Path) -> None:
    part = part_of(path)
    for name in imports(path):
        top = name.split(".")[0]
        if top == "sidecar":
            target = name.split(".")[1] if "." in name else ""
            if target in ("", "__main__"):
                continue
            assert target == part or target in ALLOWED[part], (
                f"{path.relative_to(PACKAGE)} ({part or 'package'}) imports {name}")
        for banned in FORBIDDEN.get(part, set()):
            assert name != banned and not name.startswith(banned + "."), (
                f"{path.relative_to(PACKAGE)} must not use {name}")


def test_kvgate_plan_does_not_load_the_server_stack() -> None:
    code = ("import sys, io, contextlib\n"
            "from sidecar.cli.main import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    main(['plan', '--model', 'Qwen/Qwen3-8B', '--gpu', 'H100', '--json'])\n"
            "heavy = [m for m in ('aiohttp', 'prometheus_client', 'pydantic', 'yaml', 'asyncio')"
            " if m in sys.modules]\n"
            "print(','.join(heavy))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    assert proc.stdout.strip() == ""


def test_public_surfaces_are_pinned() -> None:
    import sidecar.admission
    import sidecar.model

    assert set(sidecar.model.__all__) == {
        "CATALOGUE", "DEFAULT_EFFICIENCY", "ChainCall", "ConfigError", "Deployment",
        "DeploymentError", "Efficiency", "Gpu", "KVCapacity", "KVLayout", "KVSpec",
        "LatencyEstimate", "ModelArchitecture", "ModelError", "PhaseCost", "Recommendation",
        "Role", "Roofline", "ServedModel", "UnknownGpuError", "UnknownPresetError",
        "build_layout", "chain", "custom_gpu", "find_gpu", "gpu_names", "kv_capacity",
        "load_config", "parse_config", "read_architecture", "recommend", "steady_latency",
    }
    assert set(sidecar.admission.__all__) == {
        "FINAL_OUTCOMES", "REJECTIONS", "SHADOW_OUTCOMES", "AdmissionController",
        "AdmissionRequest", "AdmissionSettings", "CostModel", "Decision", "DecisionListener",
        "Forecast", "Ledger", "Mode", "Outcome", "QueueLimits", "Rejected", "RequestCost",
        "Reservation", "ServerQueueLimits", "ServerState", "Ticket",
    }
    for module in (sidecar.model, sidecar.admission):
        for name in module.__all__:
            assert hasattr(module, name)
