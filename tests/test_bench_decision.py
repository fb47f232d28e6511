"""The admission-decision benchmark runs (its figures are checked by reading them, not
here: timings on a shared machine are not test assertions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_admission_decision_benchmark_smoke(tmp_path: Path) -> None:
    out = tmp_path / "decision.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "admission_decision.py"), "--smoke",
                    "--out", str(out)], check=True, timeout=300, capture_output=True)
    result = json.loads(out.read_text())
    assert [q["queued_requests"] for q in result["queues"]] == [1_000, 10_000]
    for queue, samples in zip(result["queues"], (1000, 100), strict=True):
        assert queue["running_requests"] > 0
        for part in ("decision", "decision_same_queue", "enqueue", "choose_next"):
            assert queue[part]["samples"] == samples
            assert 0 < queue[part]["p50_us"] <= queue[part]["p99_us"]
    assert [r["prompt_tokens"] for r in result["by_prompt_length"]] == [128, 2_000, 8_000]
    for length in result["by_prompt_length"]:
        assert length["prompt_blocks"] == length["prompt_tokens"] // 16
        assert length["admit_and_finish"]["samples"] == 200
    assert [shape["shape"] for shape in result["churn"]] == ["long prompts", "short prompts"]
    for shape in result["churn"]:
        assert shape["running_requests"] > 1 and shape["prompt_blocks_per_request"] > 1
        assert shape["finish_and_admit"]["samples"] == 50
