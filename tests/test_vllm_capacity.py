"""`kvgate plan` predicts the KV capacity a real vLLM (CPU build) reports, exactly,
for tiny random-weight models of several architectures: dense (llama, qwen3 with an
explicit head_dim), sliding window (mistral), hybrid sliding/full (gemma2, gemma3,
gpt-oss) and MoE (qwen3-moe, mixtral).

vLLM logs `CPU KV cache size: N tokens, Maximum concurrency for L tokens per request:
X.XXx` and exposes the unrounded figures in `vllm:cache_config_info`."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

import pytest

from support.env import free_port, model_dir, vllm_python
from support.vllm_server import VllmServer, VllmServerError

pytestmark = [pytest.mark.vllm]

GIB = 1024**3


@dataclass(frozen=True)
class Setting:
    model: str
    max_model_len: int
    block_size: int
    kv_bytes: int | None = None
    num_blocks: int | None = None
    max_num_batched_tokens: int | None = None

    @property
    def id(self) -> str:
        size = f"{self.kv_bytes}B" if self.kv_bytes else f"{self.num_blocks}blocks"
        extra = f"-mnbt{self.max_num_batched_tokens}" if self.max_num_batched_tokens else ""
        return f"{self.model}-{size}-bs{self.block_size}-len{self.max_model_len}{extra}"


SETTINGS = [
    # 1 GiB of KV, vLLM's CPU block size, a max_model_len that is not a block multiple.
    *(Setting(m, 1000, 128, kv_bytes=GIB) for m in (
        "tiny-llama", "tiny-qwen3", "tiny-mistral", "tiny-gemma2", "tiny-gemma3",
        "tiny-gptoss", "tiny-qwen3moe", "tiny-mixtral")),
    # A budget that is not a whole number of blocks, and a smaller step for the windows.
    Setting("tiny-mistral", 1000, 64, kv_bytes=50_000_000, max_num_batched_tokens=256),
    Setting("tiny-gemma2", 1000, 64, kv_bytes=50_000_000),
    # A forced small cache (--num-gpu-blocks-override).
    Setting("tiny-qwen3", 1000, 32, num_blocks=64),
]


def plan(setting: Setting, *, blocks: int | None = None) -> dict[str, object]:
    args = [sys.executable, "-m", "sidecar", "plan", "--model",
            str(model_dir(setting.model)), "--block-size", str(setting.block_size),
            "--max-model-len", str(setting.max_model_len), "--json",
            "--max-num-batched-tokens", str(setting.max_num_batched_tokens or 2048)]
    if setting.kv_bytes:
        args += ["--available-kv-gib", repr(setting.kv_bytes / GIB)]
    if blocks or setting.num_blocks:
        args += ["--num-gpu-blocks-override", str(blocks or setting.num_blocks)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    # 0 when the deployment fits, 1 when vLLM would refuse to start it (not 2: bad input).
    assert proc.returncode in (0, 1), proc.stderr
    result: dict[str, object] = json.loads(proc.stdout)
    assert proc.returncode == (0 if result["fits"] is not False else 1), proc.stderr
    return result


def start(setting: Setting) -> VllmServer:
    kv = {}
    if setting.kv_bytes == GIB:
        kv["kv_cache_space_gib"] = 1
    elif setting.kv_bytes:
        kv["kv_cache_memory_bytes"] = setting.kv_bytes
    server = VllmServer(
        vllm_python(), str(model_dir(setting.model)), setting.model, free_port(),
        setting.max_model_len, block_size=setting.block_size,
        num_gpu_blocks_override=setting.num_blocks,
        max_num_batched_tokens=setting.max_num_batched_tokens, **kv,  # type: ignore[arg-type]
    )
    return server.start()


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.id)
def test_predicted_capacity_equals_what_vllm_reports(setting: Setting) -> None:
    predicted = plan(setting)
    server = start(setting)
    try:
        logged = server.kv_cache_info()
        labels = server.cache_config_info()
    finally:
        server.stop()
    assert predicted["kv_capacity_tokens"] == logged.tokens, logged.line
    concurrency = float(predicted["max_concurrency"])  # type: ignore[arg-type]
    assert f"{concurrency:.2f}" == logged.concurrency_text, logged.line
    assert concurrency == float(labels["kv_cache_max_concurrency"])
    assert predicted["num_gpu_blocks"] == int(labels["num_gpu_blocks"])
    assert predicted["kv_capacity_tokens"] == int(labels["kv_cache_size_tokens"])
    assert predicted["fits"] is True


def test_a_cache_too_small_for_one_request_is_refused_by_both() -> None:
    # gemma2 needs 32 + 33 = 65 blocks per 1,000-token request; 64 leave 63 usable.
    setting = Setting("tiny-gemma2", 1000, 32, num_blocks=64)
    predicted = plan(setting)
    assert predicted["fits"] is False
    assert predicted["blocks_per_max_len_request"] == 65
    with pytest.raises(VllmServerError):
        start(setting).stop()
