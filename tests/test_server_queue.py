"""vLLM's own admission (--max-num-queued-reqs / --max-num-queued-tokens): kvgate keeps
the requests it forwards within the server's limits, and tells the server's refusals
apart from every other answer."""

from __future__ import annotations

import asyncio
import glob
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from sidecar.admission import (
    AdmissionRequest,
    Mode,
    Outcome,
    QueueLimits,
    Rejected,
    ServerQueueLimits,
)
from sidecar.admission.server_queue import REASONS
from sidecar.server.errors import rejection_response
from sidecar.upstream.refusals import (
    REFUSAL_MESSAGES,
    REFUSAL_REASONS,
    RefusalWatch,
    classify_refusal,
)

from support.admission_fixtures import FakeClock, controller
from support.env import MissingPiece, vllm_python

# The body vLLM 0.32.0 answers a refused request with (as measured on its CPU build by
# tests/test_e2e_server_queue.py).
BUSY = json.dumps({"error": {
    "message": "The engine is currently busy and cannot accept new requests. Please try "
               "again later or on a different instance.",
    "type": "Service Unavailable", "code": 503, "param": None}}).encode()
BACKLOG = json.dumps({"error": {
    "message": "The engine has reached its prefill token backlog limit. Please try again "
               "later or on a different instance.",
    "type": "Service Unavailable", "code": 503, "param": None}}).encode()


def _vllm_source(relative: str) -> str:
    """A file of the installed vLLM's source, read as text (vLLM is not imported)."""
    try:
        python = Path(vllm_python())
    except MissingPiece as exc:
        pytest.skip(f"no vLLM environment: {exc}")
    found = glob.glob(str(python.parent.parent / "lib" / "python3*" / "site-packages" /
                          "vllm" / relative))
    if not found:
        pytest.skip(f"vllm/{relative} not found beside {python}")
    return Path(found[0]).read_text(encoding="utf-8")


# ---- the limits, as vLLM checks them ------------------------------------------------------


def test_request_limit_counts_the_new_requests_sequences() -> None:
    limits = ServerQueueLimits(max_requests=4)
    assert limits.refusal(requests=3, prefill_tokens=10**6, sequences=1) is None
    assert limits.refusal(requests=4, prefill_tokens=0, sequences=1) == "max_num_queued_reqs"
    assert limits.refusal(requests=2, prefill_tokens=0, sequences=3) == "max_num_queued_reqs"
    assert limits.refusal(requests=2, prefill_tokens=0, sequences=2) is None
    assert limits.never_admits(5) == "max_num_queued_reqs"
    assert limits.never_admits(4) is None


def test_token_limit_counts_only_the_backlog_not_the_new_prompt() -> None:
    limits = ServerQueueLimits(max_prefill_tokens=300)
    # vLLM: refused when the prompts in prefill already hold the limit; the new prompt,
    # however long, is not counted.
    assert limits.refusal(requests=50, prefill_tokens=299, sequences=1) is None
    assert limits.refusal(requests=0, prefill_tokens=300, sequences=1) == (
        "max_num_queued_tokens")
    assert ServerQueueLimits(max_prefill_tokens=0).never_admits(1) == "max_num_queued_tokens"
    assert not ServerQueueLimits().active
    with pytest.raises(ValueError, match="--max-num-queued-reqs"):
        ServerQueueLimits(max_requests=-1)


def test_the_check_mirrors_vllms_own_source() -> None:
    source = _vllm_source("v1/engine/async_llm.py")
    check = source[source.index("def check_admission"):source.index("def _record_admission")]
    assert "current_requests + n > max_num_reqs" in check
    assert "current_tokens >= max_queued_tokens" in check
    assert "req.prompt_len for req in self.request_states.values() if req.is_prefilling" in (
        _vllm_source("v1/engine/output_processor.py"))


# ---- telling the server's refusals apart ---------------------------------------------------


def test_refusals_are_classified_by_vllms_messages() -> None:
    assert classify_refusal(503, BUSY) == "max_num_queued_reqs"
    assert classify_refusal(503, BACKLOG) == "max_num_queued_tokens"
    # kvgate's own 503 and any other answer are not the server's admission.
    assert classify_refusal(503, b'{"error": {"message": "the sidecar is shutting down"}}') is None
    assert classify_refusal(200, BUSY) is None
    assert classify_refusal(500, BACKLOG) is None


def watch(status: int, *chunks: bytes) -> str | None:
    watcher = RefusalWatch(status)
    for chunk in chunks:
        watcher.feed(chunk)
    return watcher.reason()


def test_a_stream_whose_first_event_is_the_refusal_is_one() -> None:
    # vLLM takes a streamed request at arrival, then refuses it when it adds it to the
    # engine: 200, the error as the first event, then [DONE].
    event = b"data: " + BACKLOG + b"\n\n"
    assert watch(200, event[:20], event[20:], b"data: [DONE]\n\n") == "max_num_queued_tokens"
    assert watch(503, BUSY[:10], BUSY[10:]) == "max_num_queued_reqs"
    # A stream that generated text is not, even if the text quotes the message.
    quoted = json.dumps({"choices": [{"text": REFUSAL_MESSAGES["max_num_queued_reqs"]}]})
    assert watch(200, b"data: " + quoted.encode() + b"\n\n", event) is None
    assert watch(502, BUSY) is None


def test_reasons_and_messages_are_vllms() -> None:
    assert REFUSAL_REASONS == REASONS
    loggers = _vllm_source("v1/metrics/loggers.py")
    assert re.search(r'ADMISSION_REASONS = \("max_num_queued_reqs", "max_num_queued_tokens"\)',
                     loggers)
    assert 'name="vllm:admission_rejections"' in loggers
    exceptions = _vllm_source("exceptions.py")
    for message in REFUSAL_MESSAGES.values():
        assert message in exceptions

# ---- the admission core keeps within them --------------------------------------------------


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_requests_beyond_the_servers_request_limit_wait_for_one_to_finish() -> None:
    ctl = controller(num_blocks=1024, server_limits=ServerQueueLimits(max_requests=2))

    async def scenario() -> None:
        first = await ctl.admit(AdmissionRequest(prompt_tokens=50, max_tokens=20))
        second = await ctl.admit(AdmissionRequest(prompt_tokens=50, max_tokens=20))
        third = asyncio.ensure_future(ctl.admit(AdmissionRequest(prompt_tokens=50,
                                                                 max_tokens=20)))
        await asyncio.sleep(0)
        assert not third.done(), "the server would refuse a third request"
        assert len(ctl.queue) == 1 and ctl.server_queue() == (2, 100)
        assert ctl.ledger.headroom_blocks > 100  # KV is not what holds it back
        first.finish()
        ticket = await asyncio.wait_for(third, 1)
        assert ctl.server_queue()[0] == 2
        second.finish()
        ticket.finish()
        assert ctl.server_queue() == (0, 0)

    run(scenario())


def test_a_waiting_request_stays_queued_while_any_server_limit_is_reached() -> None:
    ctl = controller(num_blocks=1024, server_limits=ServerQueueLimits(
        max_requests=2, max_prefill_tokens=1000))

    async def scenario() -> None:
        first = await ctl.admit(AdmissionRequest(prompt_tokens=50, max_tokens=20))
        second = await ctl.admit(AdmissionRequest(prompt_tokens=50, max_tokens=20))
        third = asyncio.ensure_future(ctl.admit(AdmissionRequest(prompt_tokens=50,
                                                                 max_tokens=20)))
        await asyncio.sleep(0)
        first.first_token()  # lets queued requests be looked at: the request limit holds
        await asyncio.sleep(0)
        assert not third.done() and ctl.server_queue() == (2, 50)
        second.finish()
        ticket = await asyncio.wait_for(third, 1)
        first.finish()
        ticket.finish()

    run(scenario())


def test_sequences_count_as_vllm_counts_them() -> None:
    ctl = controller(num_blocks=1024, server_limits=ServerQueueLimits(max_requests=4))

    async def scenario() -> None:
        held = await ctl.admit(AdmissionRequest(prompt_tokens=20, max_tokens=10, sequences=3))
        with pytest.raises(Rejected) as rejected:
            await ctl.admit(AdmissionRequest(prompt_tokens=20, max_tokens=10, sequences=5))
        decision = rejected.value.decision
        assert decision.outcome is Outcome.NEVER_FITS
        assert "--max-num-queued-reqs 4" in decision.reason
        # The client's answer names `n` (its sequences), not max_tokens.
        body = json.loads(rejection_response(decision).text or "")
        assert body["error"]["param"] == "n"
        waiting = asyncio.ensure_future(ctl.admit(AdmissionRequest(
            prompt_tokens=20, max_tokens=10, sequences=2)))
        await asyncio.sleep(0)
        assert not waiting.done()  # 3 + 2 > 4
        held.finish()
        (await asyncio.wait_for(waiting, 1)).finish()

    run(scenario())


def test_the_wait_for_the_request_limit_walks_the_requests_queued_ahead() -> None:
    """A newcomer waits until the server's count leaves it a seat behind the requests
    queued before it: with two of 2 sequences running (4 of 4) and one of 2 queued, the
    queued one takes the 2 seats the first running one frees, and the newcomer the first
    seat freed after that: the queued one's end (it is short) or the long one's,
    whichever comes first. Counting the running requests alone, it would wait for both
    (as if the queued one never ended)."""
    clock = FakeClock()
    ctl = controller(num_blocks=1024, clock=clock,
                     server_limits=ServerQueueLimits(max_requests=4))

    async def scenario() -> None:
        short = await ctl.admit(AdmissionRequest(prompt_tokens=20, max_tokens=20,
                                                 sequences=2))
        long = await ctl.admit(AdmissionRequest(prompt_tokens=20, max_tokens=400,
                                                sequences=2))
        views = dict(zip(ctl._running, ctl.running_requests(), strict=True))
        first_s, last_s = views[short].finish_in_s, views[long].finish_in_s
        assert 0 < first_s < last_s
        ahead = asyncio.ensure_future(ctl.admit(AdmissionRequest(
            prompt_tokens=20, max_tokens=10, sequences=2)))
        await asyncio.sleep(0)
        assert not ahead.done()  # 4 + 2 > 4; the first to finish makes room for it
        (entry,) = ctl.queue.entries()
        queued_cost = entry.payload.cost  # type: ignore[attr-defined]
        expected_s = min(last_s, first_s + queued_cost.prefill_s + queued_cost.decode_s)
        assert expected_s < last_s  # the walk is what gives it
        # A queue that waits less than that: the newcomer is refused at once, its wait
        # predicted by the walk.
        ctl.settings = replace(ctl.settings, limits=QueueLimits(max_wait_s=(
            first_s + expected_s) / 2))
        with pytest.raises(Rejected) as rejected:
            await ctl.admit(AdmissionRequest(prompt_tokens=20, max_tokens=10))
        decision = rejected.value.decision
        assert decision.outcome is Outcome.QUEUE_TIMEOUT, decision
        predicted = decision.details["predicted_ttft_s"] - decision.details[
            "predicted_prefill_s"]
        assert predicted == pytest.approx(expected_s, abs=1e-4), (predicted, expected_s)
        short.finish()
        (await asyncio.wait_for(ahead, 1)).finish()
        long.finish()

    run(scenario())


def test_prompts_in_prefill_hold_back_the_next_until_a_first_token() -> None:
    ctl = controller(num_blocks=1024, server_limits=ServerQueueLimits(max_prefill_tokens=150))

    async def scenario() -> None:
        first = await ctl.admit(AdmissionRequest(prompt_tokens=100, max_tokens=20))
        second = await ctl.admit(AdmissionRequest(prompt_tokens=100, max_tokens=20))  # 100 < 150
        third = asyncio.ensure_future(ctl.admit(AdmissionRequest(prompt_tokens=100,
                                                                 max_tokens=20)))
        await asyncio.sleep(0)
        assert not third.done() and ctl.server_queue() == (2, 200)
        first.first_token()  # its prompt left the prefill: 100 tokens remain
        ticket = await asyncio.wait_for(third, 1)
        assert ctl.server_queue() == (3, 200)
        for t in (first, second, ticket):
            t.finish()

    run(scenario())


def test_a_full_queue_names_the_servers_limit_with_a_computed_retry_after() -> None:
    clock = FakeClock()
    ctl = controller(num_blocks=1024, clock=clock, limits=QueueLimits(max_length=0),
                     server_limits=ServerQueueLimits(max_requests=1))

    async def scenario() -> None:
        running = await ctl.admit(AdmissionRequest(prompt_tokens=50, max_tokens=200))
        with pytest.raises(Rejected) as rejected:
            await ctl.admit(AdmissionRequest(prompt_tokens=50, max_tokens=200))
        decision = rejected.value.decision
        assert decision.outcome is Outcome.QUEUE_FULL
        assert "--max-num-queued-reqs 1 is reached" in decision.reason
        # Retry when the running request is predicted to finish: its 200 tokens at the
        # predicted time per output token, at least the 1 s floor.
        predicted = running.cost.prefill_s + 200 * running.predicted_tpot_s
        assert decision.retry_after_s == max(1.0, float(int(predicted) + (predicted % 1 > 0)))
        running.finish()

    run(scenario())


def test_shadow_mode_reports_the_wait_it_would_have_imposed() -> None:
    ctl = controller(num_blocks=1024, mode=Mode.SHADOW,
                     server_limits=ServerQueueLimits(max_requests=1))
    seen: list[tuple[Outcome, str]] = []

    class Listener:
        def decided(self, decision: Any, *, shadow: bool) -> None:
            if shadow:
                seen.append((decision.outcome, decision.reason))

        def queue_wait(self, seconds: float) -> None:
            return None

    ctl.listener = Listener()

    async def scenario() -> None:
        tickets = [await ctl.admit(AdmissionRequest(prompt_tokens=50, max_tokens=20))
                   for _ in range(2)]
        assert seen[0][0] is Outcome.ADMITTED
        assert seen[1] == (Outcome.QUEUED,
                           "waiting for room in the server's --max-num-queued-reqs 1")
        for t in tickets:
            t.finish()

    run(scenario())
