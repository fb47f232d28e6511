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
    assert result["queued_requests"] == 10_000 and result["running_requests"] > 0
    for part in ("decision", "enqueue", "choose_next"):
        assert result[part]["samples"] == 1000
        assert 0 < result[part]["p50_us"] <= result[part]["p99_us"]
    assert [shape["shape"] for shape in result["churn"]] == ["long prompts", "short prompts"]
    for shape in result["churn"]:
        assert shape["running_requests"] > 1 and shape["prompt_blocks_per_request"] > 1
        assert shape["finish_and_admit"]["samples"] == 50
