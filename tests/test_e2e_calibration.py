"""kvgate calibrates its predictions against a real vLLM CPU server: after a warm-up of
a few hundred requests of varied lengths and concurrency its predicted TTFT and TPOT
are within 25% of what clients observe at the median, and after the server restarts
with other settings (CPU threads) the error returns under that bound after a bounded
number of requests. The same scenario, longer, is `bench/calibration.py`."""

from __future__ import annotations

import asyncio

import pytest

from bench.calibration import BOUND, scenario

pytestmark = [pytest.mark.vllm]


def test_predictions_calibrate_and_follow_a_change() -> None:
    result = asyncio.run(scenario(smoke=False, seed=11))
    before, after = result["before"], result["after"]
    print(f"before calibration: {before}\nafter calibration: {after}\n"
          f"after the restart: {result['windows_after_change']}")
    assert after["requests"] >= 50
    assert after["ttft_ape_p50"] < BOUND, after
    assert after["tpot_ape_p50"] < BOUND, after
    assert result["recovered_after_requests"] is not None, result["windows_after_change"]
    assert result["recovered_after_requests"] <= 200
    calibration = result["calibration"]
    assert calibration["decode_observations"] > 100 and calibration["prefill_observations"] > 100
