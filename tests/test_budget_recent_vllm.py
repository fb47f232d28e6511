"""The KV budget kvgate estimates from GPU figures (no logged budget given) against the
"Available KV cache memory" that vLLM 0.10 and later logged, on the public dev rows in
tests/data/groundtruth: within 1.5 GiB on at least 80% of them, and the rows that miss
or cannot be judged listed with their reasons."""

from __future__ import annotations

import re

from sidecar.model.units import GIB

from support.groundtruth import KvCase, kv_cases

TOLERANCE_GIB = 1.5
VLLM_0_10_RELEASED = "2025-07-24"

# Rows without a stated version, dated by their source.
DATED: dict[str, str] = {
    "kv_capacity.csv:16": "Gemma 4 is served from vLLM 0.19 on (same blog and A100 as the "
                          "0.19.0 row before it)",
    "kv_capacity.csv:19": "comment of 2025-10-31 (vLLM 0.11)",
}

# Budget rows of vLLM >= 0.10 the estimate misses, and why.
KNOWN_MISSES: dict[str, str] = {
    "kv_capacity.csv:19": (
        "gpt-oss-120b (mxfp4) on one H100 at utilization 0.95 with 1,024 batched tokens "
        "logged 1.71 GiB: 7.5-9 GiB of non-KV, non-weight memory (with the 64.4-66.0 GiB "
        "of weights other logs of it show), which neither the activations of 1,024 "
        "tokens nor the sampler come near; not reproduced"),
}

# Rows from vLLM >= 0.10 that cannot be judged.
NOT_JUDGED: dict[str, str] = {
    "kv_capacity.csv:14": "Qwen3-14B on vLLM 0.10.2: gpu_memory_utilization not shown",
    "kv_capacity.csv:17": "gpt-oss-120b, 2025-08-20: a negative budget (the engine failed) "
                          "and no utilization in the excerpt",
    "kv_capacity.csv:18": "gpt-oss-120b on vLLM 0.14.1: no budget in the excerpt (OOM)",
    "kv_capacity.csv:3": "Qwen3-235B-A22B-FP8: issue of 2025-07-22, before vLLM 0.10.0",
}


def _recent(case: KvCase) -> bool:
    if case.version is not None:
        return case.version >= (0, 10)
    if case.ref in DATED:
        return True
    dates = re.findall(r"20\d\d-\d\d-\d\d", case.notes)
    return bool(dates) and min(dates) >= VLLM_0_10_RELEASED


def _error_gib(case: KvCase) -> float:
    served = case.served()
    assert served.kv_budget_bytes is not None and case.available_kv_gib is not None
    return served.kv_budget_bytes / GIB - case.available_kv_gib


def judged_rows() -> list[KvCase]:
    return [case for case in kv_cases()
            if case.engine == "v1" and case.checks_kv_budget and _recent(case)]


def test_budget_within_1_5_gib_on_80_percent_of_recent_rows() -> None:
    rows = judged_rows()
    assert len(rows) >= 8
    misses = {case.ref for case in rows if abs(_error_gib(case)) > TOLERANCE_GIB}
    assert misses <= set(KNOWN_MISSES), {ref: _error_gib(c) for c in rows
                                         if (ref := c.ref) in misses}
    assert (len(rows) - len(misses)) / len(rows) >= 0.8


def test_rows_left_out_are_listed_with_reasons() -> None:
    judged = {case.ref for case in judged_rows()}
    assert not judged & set(NOT_JUDGED)
    assert set(KNOWN_MISSES) <= judged
