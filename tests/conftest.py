"""Shared fixtures. Session-scoped servers (vLLM, Prometheus) live in tests/support."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"

# scripts/check names a directory for the logs of the servers the tests start (kvgate,
# Prometheus; vLLM reads it itself), removed when the run passes, kept when it fails.
if os.environ.get("KVGATE_LOG_DIR"):
    tempfile.tempdir = os.environ["KVGATE_LOG_DIR"]

# tests/support and bench are plain folders of helpers, importable from tests.
for extra in (ROOT, ROOT / "tests"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))


import pytest  # noqa: E402

from support.env import free_port, model_dir, vllm_python  # noqa: E402
from support.fault_proxy import FaultProxy  # noqa: E402
from support.vllm_server import VllmServer  # noqa: E402

SMALL_KV = {"max_model_len": 1024, "block_size": 32, "num_gpu_blocks_override": 64}


@pytest.fixture(scope="session")
def small_kv_vllm() -> object:
    """One real vLLM CPU server with a deliberately small KV cache (64 blocks of 32
    tokens: 2,048 tokens), shared by the end-to-end tests of the session."""
    server = VllmServer(vllm_python(), str(model_dir("tiny-llama")), "tiny-llama",
                        free_port(), **SMALL_KV)
    server.start()
    yield server
    server.stop()


BIG_KV = {"max_model_len": 1024, "block_size": 32, "num_gpu_blocks_override": 1024}


@pytest.fixture(scope="session")
def big_kv_vllm() -> object:
    """A real vLLM CPU server with room for streams larger than the kernel's socket
    buffers (1,024 blocks of 32 tokens: 32 sequences of 900 tokens), for the slow-reader
    test. Never killed or restarted by a test."""
    server = VllmServer(vllm_python(), str(model_dir("tiny-llama")), "tiny-llama",
                        free_port(), **BIG_KV)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def proxy(small_kv_vllm: VllmServer) -> Iterator[FaultProxy]:
    """A fault proxy in front of the shared small-KV server, passing everything until a
    test tells it otherwise."""
    with FaultProxy(small_kv_vllm.url) as running:
        yield running
