"""Shadow mode end to end: `kvgate serve --mode shadow` in front of a real vLLM CPU
server lets every request through at once and counts, in
`kvgate_shadow_decisions_total`, what enforce mode would have done."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.concurrency import RunningSampler
from support.load import burst, most_streaming_at_once
from support.sidecar import Sidecar
from support.vllm_server import VllmServer

pytestmark = [pytest.mark.vllm]

BURST = 8


def by_outcome(text: str, family: str) -> dict[str, float]:
    """A counter family's samples by their `outcome` label."""
    for metric in text_string_to_metric_families(text):
        if metric.name == family:
            return {s.labels["outcome"]: s.value for s in metric.samples
                    if s.name == family + "_total"}
    raise KeyError(f"{family} not in kvgate's metrics")


async def test_shadow_mode_refuses_nothing_and_counts_what_enforce_would_do(
    small_kv_vllm: VllmServer,
) -> None:
    # With no queue, enforce mode would refuse what does not fit at once (queue_full).
    with Sidecar(small_kv_vllm.url, "--mode", "shadow", "--queue-max-length", "0") as sidecar:
        async with RunningSampler(small_kv_vllm.url) as running:
            results = await burst(sidecar.url, count=BURST, max_tokens=400)
        assert [r["status"] for r in results] == [200] * BURST, results
        assert all(r["text"] for r in results)
        text = sidecar.metrics_text()
        state = sidecar.wait_idle()

    shadow = by_outcome(text, "kvgate_shadow_decisions")
    served = by_outcome(text, "kvgate_requests")
    # Every request admitted and counted as such; nothing refused.
    assert served["admitted"] == BURST
    assert sum(served.values()) == BURST, served
    # One shadow verdict per request: the first ones fit, the rest enforce mode would
    # have refused for a full queue.
    assert sum(shadow.values()) == BURST, shadow
    assert shadow["admitted"] >= 1 and shadow["queue_full"] >= 1, shadow
    assert shadow["admitted"] + shadow["queue_full"] == BURST, shadow
    # Really let through: the server ran more at once than enforce mode would have sent
    # (seen in vLLM's gauge, or, when the sampler on a busy machine misses the burst, in
    # the tokens the clients received at the same time).
    at_once = max(running.max, most_streaming_at_once(results))
    assert at_once > shadow["admitted"], (running.samples, at_once, shadow)
    ledger = state["admission"]["ledger"]
    assert ledger["reserved_blocks"] == 0 and ledger["reservations"] == 0
    assert 'mode="shadow"' in next(line for line in text.splitlines()
                                   if line.startswith("kvgate_info{"))
