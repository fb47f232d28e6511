"""The admission controller's decisions, one behaviour at a time."""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Callable
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.admission import (
    AdmissionController,
    AdmissionRequest,
    AdmissionSettings,
    CostModel,
    Decision,
    Mode,
    Outcome,
    QueueLimits,
    Rejected,
    ServerState,
)
from sidecar.admission.forecast import Holding, RoomProfile, holdings_peak, steps_until_room
from sidecar.admission.ledger import Ledger
from sidecar.admission.prefix import PrefixPlan
from sidecar.admission.queue import Entry
from sidecar.admission.room import KVRoom, QueueWalk, RunningHoldings
from sidecar.admission.server_queue import ServerQueueLimits
from sidecar.admission.wait_ratio import MIN_SAMPLES
from sidecar.model import ServedModel
from sidecar.model.prefill_queue import PrefillBehind, prefill_behind

from support.admission_fixtures import (
    TINY_LLAMA,
    FakeClock,
    FakeClockLoop,
    controller,
    tiny_served,
)


class Recorder:
    def __init__(self) -> None:
        self.decisions: list[tuple[Outcome, bool]] = []
        self.waits: list[float] = []

    def decided(self, decision: Decision, *, shadow: bool) -> None:
        self.decisions.append((decision.outcome, shadow))

    def queue_wait(self, seconds: float) -> None:
        self.waits.append(seconds)


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


async def admit(ctl: object, **kwargs: object) -> object:
    return await ctl.admit(AdmissionRequest(**kwargs))  # type: ignore[attr-defined]


def test_admit_reserves_blocks_as_vllm_allocates_and_finish_releases() -> None:
    ctl = controller(num_blocks=64)

    async def scenario() -> None:
        ticket = await admit(ctl, prompt_tokens=100, max_tokens=60)
        # 160 tokens in blocks of 16: 10 blocks.
        assert ticket.cost.kv_blocks == 10  # type: ignore[attr-defined]
        assert ctl.ledger.reserved_blocks == 10
        assert ticket.finish() is True  # type: ignore[attr-defined]
        assert ticket.finish() is False  # type: ignore[attr-defined]
        assert ctl.ledger.reserved_blocks == 0 and ctl.ledger.reservations == 0

    run(scenario())


def test_never_fits_tells_the_largest_max_tokens() -> None:
    ctl = controller(num_blocks=64)

    async def scenario() -> None:
        # 63 usable blocks x 0.95 = 59 blocks of 16 = 944 tokens held for one request;
        # the last output token is never fed back, so prompt + max_tokens - 1 <= 944.
        with pytest.raises(Rejected) as too_big:
            await admit(ctl, prompt_tokens=900, max_tokens=200)
        decision = too_big.value.decision
        assert decision.outcome is Outcome.NEVER_FITS
        # max_model_len allows 124 more tokens (vLLM clamps max_tokens to them), the
        # cache only 45.
        assert decision.details["largest_max_tokens"] == 45
        assert "1 x (900 prompt + 124 output) tokens (max_tokens 200 clamped" in decision.reason
        assert "64 KV blocks at their peak, more than the 59" in decision.reason
        assert decision.retry_after_s is None
        # Without prefix caching (forks then share no prompt block), 4 sequences of 300
        # tokens need 76 blocks; 4 x (200 + 25 - 1) tokens fit in 56.
        ctl.set_prefix_caching(False)
        with pytest.raises(Rejected) as too_big:
            await admit(ctl, prompt_tokens=200, max_tokens=100, sequences=4)
        assert too_big.value.decision.outcome is Outcome.NEVER_FITS
        assert too_big.value.decision.details["largest_max_tokens"] == 25
        # A prompt that leaves no room for output is refused as vLLM refuses it.
        with pytest.raises(Rejected) as too_long:
            await admit(ctl, prompt_tokens=1024, max_tokens=10)
        assert too_long.value.decision.outcome is Outcome.NEVER_FITS
        assert "max_model_len (1024)" in too_long.value.decision.reason

    run(scenario())


def test_the_forks_of_one_prompt_hold_its_full_blocks_once() -> None:
    ctl = controller(num_blocks=64)  # 59 blocks of 16 tokens to reserve

    async def scenario() -> None:
        # n = 4 forks of a 200-token prompt, 100 output tokens each: 19 blocks apiece on
        # their own; with prefix caching the 12 full prompt blocks (199 tokens: vLLM
        # computes the last token itself) are held once: 4 x 19 - 3 x 12 = 40.
        ticket = await admit(ctl, prompt_tokens=200, max_tokens=100, sequences=4,
                             forks_share=True)
        assert ticket.cost.kv_blocks == 40  # type: ignore[attr-defined]
        assert ctl.ledger.reserved_blocks == 40
        # As it runs, what it holds is priced the same way.
        ticket.first_token()  # type: ignore[attr-defined]
        ticket.progress(50)  # type: ignore[attr-defined]
        assert ctl.ledger.reserved_blocks == 40
        assert ctl.cost_model.blocks_now(200, 50, 4, forks_share=True) == 4 * 16 - 3 * 12
        # A prompt of a whole number of blocks: its last block is each fork's own.
        assert ctl.cost_model.peak_blocks(192, 100, 4, forks_share=True) == 4 * 19 - 3 * 11
        assert ticket.finish() is True  # type: ignore[attr-defined]
        assert ctl.ledger.reserved_blocks == 0
        # Forks that do not share (a batch of prompts, a request that asks for its
        # prompt's logprobs): charged in full, 76 blocks, more than the cache gives.
        with pytest.raises(Rejected) as unshared:
            await admit(ctl, prompt_tokens=200, max_tokens=100, sequences=4)
        assert unshared.value.decision.outcome is Outcome.NEVER_FITS
        assert "76 KV blocks" in unshared.value.decision.reason
        # Prefix caching off on the server: nothing shared either.
        ctl.set_prefix_caching(False)
        with pytest.raises(Rejected) as off:
            await admit(ctl, prompt_tokens=200, max_tokens=100, sequences=4, forks_share=True)
        assert off.value.decision.outcome is Outcome.NEVER_FITS
        ctl.set_prefix_caching(True)
        again = await admit(ctl, prompt_tokens=200, max_tokens=100, sequences=4,
                            forks_share=True)
        assert again.cost.kv_blocks == 40  # type: ignore[attr-defined]

    run(scenario())


def test_forks_share_no_prompt_block_where_a_group_frees_or_keeps_state() -> None:
    # Sliding windows free prompt blocks as each fork advances: each is charged in full.
    sliding = {"model_type": "mistral", "hidden_size": 128, "intermediate_size": 256,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
               "head_dim": 32, "sliding_window": 256, "vocab_size": 1024,
               "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}
    model = CostModel(tiny_served(num_blocks=512, config=sliding))
    assert model.fork_shared_blocks(600, 4, forks_share=True) == 0
    assert model.peak_blocks(600, 100, 4, forks_share=True) == 4 * model.peak_blocks(600, 100)
    full = CostModel(tiny_served(num_blocks=512))
    assert full.fork_shared_blocks(600, 4, forks_share=True) == 3 * (599 // 16)
    assert full.fork_shared_blocks(600, 4, forks_share=False) == 0
    assert full.fork_shared_blocks(600, 1, forks_share=True) == 0
    assert full.blocks_now(600, 10, 4, forks_share=True) == (4 * full.blocks_now(600, 10)
                                                             - 3 * (599 // 16))


def test_max_tokens_beyond_the_context_is_clamped_as_vllm_clamps_it() -> None:
    ctl = controller(num_blocks=128)

    async def scenario() -> None:
        # vLLM 0.32 serves prompt + max_tokens > max_model_len up to the context limit.
        ticket = await admit(ctl, prompt_tokens=1000, max_tokens=500)
        assert ticket.reserved_output_tokens == 24  # type: ignore[attr-defined]
        assert ticket.cost.kv_blocks == 64  # type: ignore[attr-defined]

    run(scenario())


def test_no_max_tokens_reserves_up_to_max_model_len_by_default() -> None:
    ctl = controller(num_blocks=128)

    async def scenario() -> None:
        ticket = await admit(ctl, prompt_tokens=100)
        assert ticket.reserved_output_tokens == 924  # type: ignore[attr-defined]
        assert ticket.cost.kv_blocks == 64  # type: ignore[attr-defined]

    run(scenario())


def test_queue_then_admit_when_kv_frees_in_fcfs_order() -> None:
    clock = FakeClock()
    ctl = controller(num_blocks=41, clock=clock)  # 40 usable, target 38
    loop = FakeClockLoop(clock)
    try:
        first = loop.run_until_complete(admit(ctl, prompt_tokens=500, max_tokens=12))  # 32 blk
        # (held from its prefill on: only its end makes room)
        queued = [loop.create_task(admit(ctl, prompt_tokens=100, max_tokens=60 + i))
                  for i in range(3)]
        loop.run_until_complete(asyncio.sleep(0))
        assert len(ctl.queue) == 3 and not any(t.done() for t in queued)
        clock.advance(2.0)
        first.finish()  # type: ignore[attr-defined]
        loop.run_until_complete(asyncio.sleep(0))
        done = [t for t in queued if t.done()]
        # 38 blocks of headroom: three requests of 10-11 blocks fit.
        assert len(done) == 3
        keys = [t.result().key for t in queued]
        assert keys == sorted(keys)
        assert queued[0].result().queue_wait_s == pytest.approx(2.0)
    finally:
        loop.close()


def full_queue(queued: int) -> tuple[AdmissionController, FakeClockLoop,
                                    list[asyncio.Task[object]]]:
    """A 41-block cache with a 500-token request running (its first token seen) and
    `queued` requests of 100 tokens waiting behind it: the queue full."""
    clock = FakeClock()
    ctl = controller(num_blocks=41, clock=clock, limits=QueueLimits(max_length=queued))
    loop = FakeClockLoop(clock)
    running = loop.run_until_complete(admit(ctl, prompt_tokens=500, max_tokens=12))
    running.first_token()  # type: ignore[attr-defined]
    waiting = [loop.create_task(admit(ctl, prompt_tokens=100, max_tokens=60 + i))
               for i in range(queued)]
    loop.run_until_complete(asyncio.sleep(0))
    assert len(ctl.queue) == queued
    return ctl, loop, waiting


def test_queue_full_carries_a_computed_retry_after() -> None:
    ctl, loop, _ = full_queue(1)
    try:
        with pytest.raises(Rejected) as full:
            loop.run_until_complete(admit(ctl, prompt_tokens=100, max_tokens=60))
        decision = full.value.decision
        assert decision.outcome is Outcome.QUEUE_FULL
        # The running request has 12 tokens left (13 engine steps until its blocks are
        # free) at the predicted TPOT: retry then.
        tpot = ctl.cost_model.tpot_s(1, 500)
        assert decision.retry_after_s == max(1.0, float(int(-(-13 * tpot // 1))))
        assert decision.details["kv_blocks"] == 10
    finally:
        loop.close()


def test_arrivals_refused_by_a_full_queue_are_priced_from_one_walk_of_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With the queue full, each arrival is refused with a Retry-After from its
    predicted wait behind the queue: the queue is walked once for all of them, until it
    or the running requests change, and gives what a walk from scratch gives."""
    ctl, loop, waiting = full_queue(3)
    try:
        walks: list[tuple[int, str]] = []
        ahead_of = ctl.queue.ahead_of

        def counted(band: int, tenant: str, key: tuple[float, int] | None = None
                    ) -> list[Entry]:
            walks.append((band, tenant))
            return ahead_of(band, tenant, key)

        monkeypatch.setattr(ctl.queue, "ahead_of", counted)

        def refused(**kwargs: object) -> Decision:
            with pytest.raises(Rejected) as caught:
                loop.run_until_complete(admit(ctl, prompt_tokens=100, max_tokens=60,
                                              **kwargs))
            return caught.value.decision

        full = [refused() for _ in range(3)]
        assert all(d.outcome is Outcome.QUEUE_FULL for d in full)
        assert len(walks) == 1
        wait = full[0].details["predicted_wait_s"]
        assert wait is not None and wait > 0
        assert all(d.details["predicted_wait_s"] == wait for d in full)
        ctl._walk_memo = None  # type: ignore[attr-defined]
        assert refused().details["predicted_wait_s"] == wait
        assert len(walks) == 2
        # The last one queued leaves: the queue is walked again, one fewer ahead.
        waiting[2].cancel()
        loop.run_until_complete(asyncio.sleep(0))
        assert len(ctl.queue) == 2
        late = refused(ttft_slo_s=1e-6)
        assert late.outcome is Outcome.DEADLINE and len(walks) == 3
        shorter = late.details["predicted_wait_s"]
        assert shorter is not None and shorter <= wait  # type: ignore[operator]
        ctl._walk_memo = None  # type: ignore[attr-defined]
        assert refused(ttft_slo_s=1e-6).details["predicted_wait_s"] == shorter
        for task in waiting:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*waiting, return_exceptions=True))
    finally:
        loop.close()


def test_deadline_rejects_when_predicted_ttft_exceeds_target() -> None:
    clock = FakeClock()
    ctl = controller(num_blocks=41, clock=clock)
    loop = FakeClockLoop(clock)
    try:
        loop.run_until_complete(admit(ctl, prompt_tokens=500, max_tokens=12))
        with pytest.raises(Rejected) as late:
            loop.run_until_complete(admit(ctl, prompt_tokens=100, max_tokens=60,
                                          ttft_slo_s=0.001))
        assert late.value.decision.outcome is Outcome.DEADLINE
        assert late.value.decision.retry_after_s is not None
        assert late.value.decision.details["predicted_ttft_s"] > 0.001  # type: ignore[operator]
    finally:
        loop.close()


def test_a_queued_request_past_its_deadline_is_refused_not_admitted_when_room_frees() -> None:
    """Room frees after a queued request's deadline has passed, before its timer ran (a
    busy event loop runs timers late): it is refused by deadline, not admitted to miss
    its target on room the next request could use. Its wait until room came still
    teaches the wait ratio, as the admitted one's does."""
    clock = FakeClock()
    ctl = controller(num_blocks=41, clock=clock)
    loop = FakeClockLoop(clock)
    try:
        blocker = loop.run_until_complete(admit(ctl, prompt_tokens=500, max_tokens=60))
        late = loop.create_task(admit(ctl, prompt_tokens=500, max_tokens=12,
                                      ttft_slo_s=10.0))
        on_time = loop.create_task(admit(ctl, prompt_tokens=500, max_tokens=12))
        loop.run_until_complete(asyncio.sleep(0))
        assert len(ctl.queue) == 2
        clock.advance(10.0)
        blocker.finish()  # type: ignore[attr-defined]
        with pytest.raises(Rejected) as refused:
            loop.run_until_complete(late)
        assert refused.value.decision.outcome is Outcome.DEADLINE
        ticket = loop.run_until_complete(on_time)  # the room went to the next one
        assert ctl.ledger.reservations == 1 and len(ctl.queue) == 0
        assert ctl.wait_ratio.samples == 2
        ticket.finish()  # type: ignore[attr-defined]
        assert ctl.ledger.reserved_blocks == 0 and ctl.ledger.reservations == 0
    finally:
        loop.close()


def test_a_queued_request_is_priced_again_with_the_prompts_let_in_just_before_it() -> None:
    """Room frees for three queued requests at once. The first two go in; their
    prompts are then ahead of the third, whose first token they delay. Priced at
    arrival (nothing ahead) the third would still make its target; priced as room
    frees it cannot, so it is refused instead of admitted to miss it."""
    clock = FakeClock()
    recorder = Recorder()
    ctl = controller(num_blocks=200, clock=clock)
    ctl.listener = recorder
    loop = FakeClockLoop(clock)
    try:
        blockers = [loop.run_until_complete(admit(ctl, prompt_tokens=1000, max_tokens=12))
                    for _ in range(2)]
        for blocker in blockers:
            blocker.first_token()  # type: ignore[attr-defined]  # their prompts are done
        firsts = [loop.create_task(admit(ctl, prompt_tokens=1000, max_tokens=12))
                  for _ in range(2)]
        last = loop.create_task(admit(ctl, prompt_tokens=200, max_tokens=12, ttft_slo_s=10.0))
        loop.run_until_complete(asyncio.sleep(0))
        (entry,) = [e for e in ctl.queue.entries() if e.deadline_s is not None]
        at_arrival_s = entry.payload.cost.deadline_prefill_s  # type: ignore[attr-defined]
        assert entry.payload.cost.model_inputs.ahead_tokens == 0  # type: ignore[attr-defined]
        # Room frees just before the last moment its arrival price would make it.
        assert entry.deadline_s is not None
        clock.advance(entry.deadline_s - clock.now - at_arrival_s - 1e-6)
        for blocker in blockers:
            blocker.finish()  # type: ignore[attr-defined]
        admitted = [loop.run_until_complete(first) for first in firsts]
        with pytest.raises(Rejected) as refused:
            loop.run_until_complete(last)
        decision = refused.value.decision
        assert decision.outcome is Outcome.DEADLINE
        assert decision.details["predicted_prefill_s"] > at_arrival_s  # type: ignore[operator]
        assert recorder.decisions.count((Outcome.DEADLINE, False)) == 1
        assert len(ctl.queue) == 0
        for ticket in admitted:
            ticket.finish()  # type: ignore[attr-defined]
        assert ctl.ledger.reserved_blocks == 0 and ctl.ledger.reservations == 0
    finally:
        loop.close()


def test_a_prompt_ahead_never_makes_a_first_token_sooner() -> None:
    """With prompts ahead, the steps a request waits for are theirs: its TTFT is its
    prefill with theirs, but never less than its own after the steps in flight."""
    model = CostModel(tiny_served(256))
    for running, ahead in itertools.product((0, 1, 4, 16), (1, 16, 200, 1000, 4000)):
        alone = model.cost(200, 12, running=running, mean_context=600)
        behind = model.cost(200, 12, running=running, mean_context=600, ahead=(ahead,))
        assert behind.prefill_model_s >= alone.prefill_model_s
    # A long prompt ahead costs its prefill, not the steps in flight on top of it.
    behind = model.cost(200, 12, running=4, mean_context=600, ahead=(4000,))
    assert behind.prefill_model_s == pytest.approx(model.prefill_s(4200, 4, 600))


def test_a_request_admitted_beside_running_ones_waits_for_their_steps_first() -> None:
    """The predicted TTFT counts the running requests' steps a request waits for before
    vLLM schedules it (`ServedModel.pickup`: a step and a half with asynchronous
    scheduling, half a step without); its prefill work (the load it adds) does not."""
    costs = {}
    for asynchronous in (True, False):
        served = tiny_served(256)
        served = ServedModel(served.arch, replace(served.deployment,
                                                  async_scheduling=asynchronous), served.gpu)
        model = CostModel(served)
        costs[asynchronous] = (model, model.cost(400, 8, running=6, mean_context=600))
    (busy, with_async), (_, without) = costs[True], costs[False]
    step_s = busy.tpot_s(6, 600)
    assert with_async.prefill_model_s - without.prefill_model_s == pytest.approx(step_s)
    assert busy.pickup_s(6, 600) == pytest.approx(1.5 * step_s)
    assert with_async.prefill_model_s == pytest.approx(
        busy.prefill_s(400, 6, 600) + 1.5 * step_s)
    assert with_async.prefill_work_s == pytest.approx(without.prefill_work_s)
    alone = busy.cost(400, 8)
    assert alone.prefill_model_s == pytest.approx(busy.prefill_s(400))
    # With prompts ahead of it, the steps it waits for are theirs: no wait on top,
    # and never sooner than its own prefill after the steps in flight.
    behind = busy.cost(400, 8, running=6, mean_context=600, ahead=(300,))
    assert behind.prefill_model_s == pytest.approx(
        max(busy.prefill_s(700, 6, 600), with_async.prefill_model_s))
    long_behind = busy.cost(400, 8, running=6, mean_context=600, ahead=(3000,))
    assert long_behind.prefill_model_s == pytest.approx(busy.prefill_s(3400, 6, 600))
    assert long_behind.prefill_model_s > with_async.prefill_model_s
    # The fairness charge is its own work: not the wait, nor the prompts ahead of it.
    capacity = 256
    assert with_async.gpu_seconds(capacity) == pytest.approx(without.gpu_seconds(capacity))
    assert behind.gpu_seconds(capacity) == pytest.approx(with_async.gpu_seconds(capacity))


def test_a_prefill_is_priced_whole_at_every_prompt_length() -> None:
    """Prefills are priced at bucket boundaries and interpolated: a short tail (a turn
    whose history is cached) keeps the whole of the fixed costs per request and per
    step, and the price never falls as the prompt grows."""
    model = CostModel(tiny_served(256))
    running, context = 3, 600
    prices = [model.prefill_s(p, running, context) for p in range(1, 700)]
    assert all(b >= a for a, b in itertools.pairwise(prices))
    for p in (1, 40, 64, 65, 100, 129, 200, 450, 699):
        exact = model.served.prefill(p, (context,) * running)
        assert exact is not None
        assert model.prefill_s(p, running, context) == pytest.approx(exact.seconds, rel=1e-3)


def test_a_prefill_beside_running_requests_is_priced_in_chunks_of_the_long_prefill_threshold(
) -> None:
    """With the server's --long-prefill-token-threshold a prompt gets at most that many
    tokens a step while others run: more steps, each with its fixed costs and the
    running requests' decodes. Alone, it gets the whole budget, as without one."""
    plain = CostModel(tiny_served(256))
    served = plain.served
    capped = CostModel(ServedModel(served.arch, replace(
        served.deployment, long_prefill_token_threshold=128), served.gpu))
    prices = []
    for prompt in range(1, 1000):
        exact = capped.served.prefill(prompt, (512,) * 3)
        assert exact is not None
        # priced whole however the chunk boundaries (every 128 tokens) cut the buckets
        prices.append(capped.prefill_s(prompt, 3, 600))
        assert prices[-1] == pytest.approx(exact.seconds, rel=1e-3)
        if prompt > 128:
            assert prices[-1] > plain.prefill_s(prompt, 3, 600)
        assert capped.prefill_s(prompt) == pytest.approx(plain.prefill_s(prompt), rel=1e-12)
    assert all(b >= a for a, b in itertools.pairwise(prices))
    assert capped.prefill_s(100, 3, 600) == pytest.approx(plain.prefill_s(100, 3, 600),
                                                          rel=1e-12)
    # Prompts ahead advance beside it, each in chunks of at most the threshold, within
    # the steps' budget (`prefill_behind`). A short prompt behind a long one gets its
    # chunk at once: its time to first token is its own, where without a threshold it
    # comes after the long one.
    short = capped.cost(100, 8, running=3, mean_context=600, ahead=(5000,))
    alone = capped.cost(100, 8, running=3, mean_context=600)
    assert short.prefill_model_s == pytest.approx(alone.prefill_model_s, rel=1e-12)
    # ... and it is priced (and learned by calibration) as its own prefill alone.
    assert short.model_inputs is not None and alone.model_inputs is not None
    assert short.model_inputs == alone.model_inputs
    assert prefill_behind((5000,), 100, 2048 - 3, 128) == PrefillBehind(1, 228)
    assert plain.cost(100, 8, running=3, mean_context=600,
                      ahead=(5000,)).prefill_model_s > short.prefill_model_s
    # Behind twenty prompts of 640 (16 chunks of 128 fill the budget), its own chunks
    # wait for room: the steps and tokens of the walk, priced together.
    own = capped.cost(640, 8, running=3, mean_context=600)
    burst = capped.cost(640, 8, running=3, mean_context=600, ahead=(640,) * 20)
    walk = prefill_behind((640,) * 20, 640, 2048 - 3, 128)
    assert burst.model_inputs is not None
    assert (burst.model_inputs.ahead_steps, burst.model_inputs.ahead_tokens) == (
        walk.steps, walk.tokens - 640)
    assert walk.steps > 5  # not its own five chunks of 128
    assert burst.prefill_model_s == pytest.approx(max(
        own.prefill_model_s, capped.prefill_in_steps_s(walk.tokens, walk.steps, 3, 600)))
    assert burst.prefill_model_s > own.prefill_model_s
    # Re-priced from its inputs (as calibration does when the fit moves): the same.
    assert capped.model_s("ttft", burst.model_inputs) == pytest.approx(burst.prefill_model_s)
    # Its work (the fairness charge) is its tokens at the whole budget, as without one.
    assert own.prefill_work_s == pytest.approx(
        plain.cost(640, 8, running=3, mean_context=600).prefill_work_s, rel=1e-12)
    # With n = 4 its forks are requests of their own, eligible together: capped on an
    # idle server too. Alone it gets the whole budget.
    assert capped.prefill_s(640, capped=True) > capped.prefill_s(640)
    assert capped.cost(640, 8, 4).prefill_model_s == pytest.approx(
        capped.prefill_s(640, capped=True), rel=1e-12)
    assert capped.cost(640, 8).prefill_model_s == pytest.approx(capped.prefill_s(640),
                                                                rel=1e-12)


def test_prompts_admitted_before_and_not_yet_prefilled_are_ahead_in_the_ttft() -> None:
    """vLLM prefills first come, first served: three prompts sent together see their
    first tokens after the prompts before them. A request's predicted time to first
    token covers the prompts admitted before it that have no first token yet, less
    as their predicted prefill runs; its own prefill work (the load it adds) does not."""
    clock = FakeClock()
    ctl = controller(num_blocks=256, clock=clock)
    loop = FakeClockLoop(clock)
    try:
        tickets = [loop.run_until_complete(admit(ctl, prompt_tokens=400, max_tokens=8))
                   for _ in range(3)]
        first, second, third = (t.cost for t in tickets)  # type: ignore[attr-defined]
        assert first.model_inputs.ahead_tokens == 0
        assert second.model_inputs.ahead_tokens == 400
        assert third.model_inputs.ahead_tokens == 800
        assert first.prefill_model_s < second.prefill_model_s < third.prefill_model_s
        assert third.prefill_work_s == pytest.approx(first.prefill_work_s, rel=0.05)
        # Half of the first's predicted time later, half of its prompt is still ahead,
        # and of the others what their predicted times leave.
        elapsed = first.prefill_s / 2
        clock.now += elapsed
        later = loop.run_until_complete(admit(ctl, prompt_tokens=400, max_tokens=8))
        ahead = later.cost.model_inputs.ahead_tokens  # type: ignore[attr-defined]
        left = [400 * (1 - elapsed / c.prefill_s) for c in (first, second, third)]
        assert left[0] == pytest.approx(200)
        assert ahead == pytest.approx(sum(left), abs=1)
        # Past the first two predicted prefills (not the third's, nor the fourth's),
        # only those two count for nothing, now and at every later decision.
        passed = second.prefill_s + 1e-6 - elapsed
        clock.now += passed
        elapsed += passed
        assert elapsed < third.prefill_s
        running = ctl._running  # type: ignore[attr-defined]
        still = [400 * (1 - elapsed / c.prefill_s) for c in (third,)] + [
            400 * (1 - passed / later.cost.prefill_s)]  # type: ignore[attr-defined]
        assert running.prefill_ahead(clock.now) == pytest.approx(still, abs=1)
        clock.now += 0.25 * (third.prefill_s - elapsed)
        elapsed_later = elapsed + 0.25 * (third.prefill_s - elapsed)
        still = [400 * (1 - elapsed_later / third.prefill_s),
                 400 * (1 - (elapsed_later - first.prefill_s / 2) / later.cost.prefill_s)]  # type: ignore[attr-defined]
        assert running.prefill_ahead(clock.now) == pytest.approx(
            [s for s in still if s > 0], abs=1)
        # A request that waits in kvgate's queue is priced as it starts: what was ahead
        # of it at its arrival has been prefilled meanwhile.
        small = controller(num_blocks=41, clock=clock)
        big = loop.run_until_complete(admit(small, prompt_tokens=500, max_tokens=12))
        waiting = loop.create_task(admit(small, prompt_tokens=100, max_tokens=60))
        loop.run_until_complete(asyncio.sleep(0))
        assert len(small.queue) == 1
        clock.advance(2.0)
        big.first_token()  # type: ignore[attr-defined]
        big.finish()  # type: ignore[attr-defined]
        started = loop.run_until_complete(waiting)
        assert started.cost.model_inputs.ahead_tokens == 0  # type: ignore[attr-defined]
        assert started.queue_wait_s == pytest.approx(2.0)  # type: ignore[attr-defined]
        started.finish()  # type: ignore[attr-defined]
        # First tokens came for all of them: nothing is ahead any more.
        for ticket in (*tickets, later):
            ticket.first_token()  # type: ignore[attr-defined]
        alone = loop.run_until_complete(admit(ctl, prompt_tokens=400, max_tokens=8))
        assert alone.cost.model_inputs.ahead_tokens == 0  # type: ignore[attr-defined]
        # A request's forks are prompts of their own to the server, one after another:
        # 3 forks that do not share, then 3 that share all but the 16-token tail.
        alone.first_token()  # type: ignore[attr-defined]
        forked = [loop.run_until_complete(admit(ctl, prompt_tokens=400, max_tokens=8,
                                                sequences=3, forks_share=share))
                  for share in (False, True)]
        assert running.prefill_ahead(clock.now) == (400, 400, 400, 400, 16, 16)
        for ticket in (*tickets, later, alone, *forked):
            ticket.finish()  # type: ignore[attr-defined]
        assert ctl.ledger.reserved_blocks == 0
    finally:
        loop.close()


def test_queue_timeout_after_max_wait() -> None:
    clock = FakeClock()
    recorder = Recorder()
    ctl = controller(num_blocks=41, clock=clock, limits=QueueLimits(max_wait_s=5.0))
    ctl.listener = recorder
    loop = FakeClockLoop(clock)
    try:
        running = loop.run_until_complete(admit(ctl, prompt_tokens=500, max_tokens=12))
        waiting = loop.create_task(admit(ctl, prompt_tokens=100, max_tokens=60))
        loop.run_until_complete(asyncio.sleep(0))
        clock.advance(5.1)
        loop.run_until_complete(asyncio.sleep(0))
        loop.run_until_complete(asyncio.sleep(0))
        assert waiting.done()
        exc = waiting.exception()
        assert isinstance(exc, Rejected) and exc.decision.outcome is Outcome.QUEUE_TIMEOUT
        assert len(ctl.queue) == 0
        # Its wait is one of the queue's waits (a stalled queue's are the longest).
        assert recorder.waits == [pytest.approx(5.1)]
        running.finish()  # type: ignore[attr-defined]
        assert ctl.ledger.reserved_blocks == 0
    finally:
        loop.close()


def test_cancelled_while_queued_leaves_nothing_behind() -> None:
    clock = FakeClock()
    recorder = Recorder()
    ctl = controller(num_blocks=41, clock=clock)
    ctl.listener = recorder
    loop = FakeClockLoop(clock)
    try:
        running = loop.run_until_complete(admit(ctl, prompt_tokens=500, max_tokens=12))
        waiting = loop.create_task(admit(ctl, prompt_tokens=100, max_tokens=60))
        loop.run_until_complete(asyncio.sleep(0))
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            loop.run_until_complete(waiting)
        assert len(ctl.queue) == 0 and ctl.queue.blocks == 0
        assert (Outcome.CANCELLED, False) in recorder.decisions
        assert recorder.waits == [0.0]  # a wait too, however short
        running.finish()  # type: ignore[attr-defined]
        assert ctl.ledger.reservations == 0
    finally:
        loop.close()


def test_unavailable_and_draining() -> None:
    ctl = controller()

    async def scenario() -> None:
        ctl.update_server(ServerState(available=False))
        with pytest.raises(Rejected) as down:
            await admit(ctl, prompt_tokens=10, max_tokens=10)
        assert down.value.decision.outcome is Outcome.UNAVAILABLE
        assert down.value.decision.retry_after_s == 5.0
        ctl.update_server(ServerState(available=True))
        ctl.drain(timeout_s=12)
        with pytest.raises(Rejected) as draining:
            await admit(ctl, prompt_tokens=10, max_tokens=10)
        assert draining.value.decision.outcome is Outcome.DRAINING
        assert draining.value.decision.retry_after_s == 12.0

    run(scenario())


def test_a_finished_request_leaves_the_effective_use_at_once() -> None:
    ctl = controller(num_blocks=64)

    async def scenario() -> None:
        ticket = await admit(ctl, prompt_tokens=100, max_tokens=60)
        # A scrape: the server holds 20 blocks more than kvgate's request explains.
        ctl.update_server(ServerState(available=True, used_blocks=20))
        ledger = ctl.state()["ledger"]
        before = ledger["effective_used_blocks"]  # type: ignore[index]
        held = ticket.reserved_blocks  # type: ignore[attr-defined]
        assert before >= held + 10
        ticket.finish()  # type: ignore[attr-defined]
        after = ctl.state()["ledger"]["effective_used_blocks"]  # type: ignore[index]
        assert after == before - held  # not at the next scrape
        assert ctl.ledger.reserved_blocks == 0 and after > 0  # the others' use stays

    run(scenario())


def test_server_capacity_overrides_the_model_and_observed_use_is_pessimistic() -> None:
    ctl = controller(num_blocks=64)

    async def scenario() -> None:
        ctl.update_server(ServerState(num_blocks=21))  # 20 usable -> target 19
        assert ctl.ledger.target_blocks == 19
        ticket = await admit(ctl, prompt_tokens=100, max_tokens=60)  # 10 blocks
        # The server reports 15 blocks in use (traffic that bypasses the sidecar).
        ctl.update_server(ServerState(num_blocks=21, used_blocks=15))
        assert ctl.ledger.effective_used_blocks >= 15
        task = asyncio.create_task(admit(ctl, prompt_tokens=100, max_tokens=60))
        await asyncio.sleep(0)
        assert not task.done()  # 19 - (15 + growth) < 10
        ticket.finish()  # type: ignore[attr-defined]
        ctl.update_server(ServerState(num_blocks=21, used_blocks=0))
        for _ in range(5):
            await asyncio.sleep(0)
        assert task.done()
        task.result().finish()

    run(scenario())


def test_retry_after_stays_computed_when_only_the_servers_own_use_blocks() -> None:
    """Nothing kvgate admitted is running, yet the server's observed use (metrics that
    lag, traffic that bypasses kvgate) leaves no room: the Retry-After comes from the
    cache's turnover at the last known request duration, not the 600 s cap."""
    ctl = controller(num_blocks=21, limits=QueueLimits(max_length=0))

    async def scenario() -> None:
        ctl.update_server(ServerState(num_blocks=21))
        ticket = await admit(ctl, prompt_tokens=100, max_tokens=60)  # 10 blocks
        ctl.update_server(ServerState(num_blocks=21, used_blocks=10))
        ticket.first_token()  # type: ignore[attr-defined]
        ticket.finish()  # type: ignore[attr-defined]
        assert ctl.ledger.reserved_blocks == 0
        ctl.update_server(ServerState(num_blocks=21, used_blocks=19))
        with pytest.raises(Rejected) as full:
            await admit(ctl, prompt_tokens=100, max_tokens=60)
        decision = full.value.decision
        assert decision.outcome is Outcome.QUEUE_FULL
        duration = ticket.cost.prefill_s + ticket.cost.decode_s  # type: ignore[attr-defined]
        # 10 blocks needed at 19 target blocks per `duration` seconds of turnover.
        assert decision.retry_after_s == max(1.0, float(-(-10 * duration / 19 // 1)))
        assert decision.retry_after_s < ctl.settings.retry_after_max_s

    run(scenario())


def test_an_unknown_wait_queues_until_the_next_scrape_instead_of_rejecting() -> None:
    """Nothing kvgate admitted has run yet, and the server's last scrape shows its cache
    full (requests that went to it directly, finishing as the scrape was taken): the
    wait cannot be predicted, so the request waits for the next scrape rather than
    being refused as if it could never be served."""
    ctl = controller(num_blocks=21)

    async def scenario() -> None:
        ctl.update_server(ServerState(num_blocks=21, used_blocks=19))
        task = asyncio.create_task(admit(ctl, prompt_tokens=100, max_tokens=60,
                                         ttft_slo_s=5.0))
        await asyncio.sleep(0)
        assert not task.done()
        assert len(ctl.queue) == 1
        ctl.update_server(ServerState(num_blocks=21, used_blocks=0))
        for _ in range(5):
            await asyncio.sleep(0)
        assert task.done()
        ticket = task.result()
        assert ticket.cost.kv_blocks == 10
        ticket.finish()
        assert ctl.ledger.reserved_blocks == 0 and len(ctl.queue) == 0

    run(scenario())


def test_priority_bands_go_first_and_starvation_is_bounded() -> None:
    clock = FakeClock()
    ctl = controller(num_blocks=41, clock=clock, starvation_bound_s=10.0)
    loop = FakeClockLoop(clock)
    try:
        blocker = loop.run_until_complete(admit(ctl, prompt_tokens=500, max_tokens=12))
        low = loop.create_task(admit(ctl, prompt_tokens=500, max_tokens=12, band=2))
        loop.run_until_complete(asyncio.sleep(0))
        clock.advance(1.0)
        high = loop.create_task(admit(ctl, prompt_tokens=500, max_tokens=12, band=0))
        loop.run_until_complete(asyncio.sleep(0))
        blocker.finish()  # type: ignore[attr-defined]
        loop.run_until_complete(asyncio.sleep(0))
        assert high.done() and not low.done()  # the important band went first
        clock.advance(20.0)  # low has now waited beyond the bound
        again = loop.create_task(admit(ctl, prompt_tokens=500, max_tokens=12, band=0))
        loop.run_until_complete(asyncio.sleep(0))
        high.result().finish()
        loop.run_until_complete(asyncio.sleep(0))
        assert low.done() and not again.done()  # the starved band went first
        low.result().finish()
        loop.run_until_complete(asyncio.sleep(0))
        again.result().finish()
    finally:
        loop.close()


def test_cost_fairness_between_tenants() -> None:
    clock = FakeClock()
    ctl = controller(num_blocks=41, clock=clock, limits=QueueLimits(max_wait_s=1e6))
    loop = FakeClockLoop(clock)
    try:
        # 37 blocks from its prefill on, 38 at its end: nothing else fits while it runs.
        blocker = loop.run_until_complete(admit(ctl, prompt_tokens=590, max_tokens=10))
        heavy = [loop.create_task(admit(ctl, prompt_tokens=300, max_tokens=200, tenant="a"))
                 for _ in range(3)]
        light = [loop.create_task(admit(ctl, prompt_tokens=50, max_tokens=30, tenant="b"))
                 for _ in range(3)]
        loop.run_until_complete(asyncio.sleep(0))
        order: list[str] = []
        blocker.finish()  # type: ignore[attr-defined]
        for _ in range(12):
            loop.run_until_complete(asyncio.sleep(0))
            for name, tasks in (("a", heavy), ("b", light)):
                for task in tasks:
                    if task.done() and not getattr(task, "_seen", False):
                        task._seen = True  # type: ignore[attr-defined]
                        order.append(name)
                        task.result().finish()
        # Tenant b's cheap requests are not starved behind a's expensive ones.
        assert order.index("b") < 2
        assert sorted(order) == ["a"] * 3 + ["b"] * 3
    finally:
        loop.close()


def test_shadow_mode_admits_everything_and_records_verdicts() -> None:
    recorder = Recorder()
    ctl = controller(num_blocks=41, mode=Mode.SHADOW)
    ctl.listener = recorder

    async def scenario() -> None:
        tickets = [await admit(ctl, prompt_tokens=300, max_tokens=200) for _ in range(3)]
        assert ctl.ledger.reserved_blocks == 96  # beyond the 38-block target: shadow
        shadow = [o for o, s in recorder.decisions if s]
        assert shadow[0] is Outcome.ADMITTED and Outcome.QUEUED in shadow
        assert tickets[0].shadow_outcome is Outcome.ADMITTED  # type: ignore[attr-defined]
        for ticket in tickets:
            ticket.finish()  # type: ignore[attr-defined]
        assert ctl.ledger.reserved_blocks == 0

    run(scenario())


def test_learned_quantile_reserves_less_and_grows_when_outgrown() -> None:
    ctl = controller(num_blocks=1025, output_policy="quantile", max_overcommit_ratio=0.5)

    async def scenario() -> None:
        for _ in range(30):
            ticket = await admit(ctl, prompt_tokens=50)
            ticket.finish(output_tokens=100)  # type: ignore[attr-defined]
        ticket = await admit(ctl, prompt_tokens=50)
        assert ticket.reserved_output_tokens == 100  # type: ignore[attr-defined]
        before = ticket.reservation.blocks  # type: ignore[attr-defined]
        ticket.progress(400)  # type: ignore[attr-defined]
        assert ticket.reservation.blocks > before  # type: ignore[attr-defined]
        ticket.finish()  # type: ignore[attr-defined]
        assert ctl.ledger.reserved_blocks == 0 and ctl.ledger.overcommit_blocks == 0

    run(scenario())


def test_forecast_peak_ratio_and_exhaustion() -> None:
    ctl = controller(num_blocks=41, mode=Mode.SHADOW)

    async def scenario() -> None:
        tickets = [await admit(ctl, prompt_tokens=16, max_tokens=400) for _ in range(3)]
        forecast = ctl.forecast()
        # Three requests growing to 26 blocks each in a 40-block cache.
        assert forecast.peak_ratio == pytest.approx(78 / 40, rel=0.05)
        assert 0 < forecast.exhaustion_s < float("inf")
        for ticket in tickets:
            ticket.finish()  # type: ignore[attr-defined]
        calm = ctl.forecast()
        assert calm.peak_ratio == 0 and calm.exhaustion_s == float("inf")

    run(scenario())


def test_admits_when_holdings_over_time_fit_though_the_peaks_added_up_do_not() -> None:
    """A newcomer whose blocks fit beside what running requests hold at every step
    ahead is admitted although their peaks (reached at their last steps) add up to more
    than the target; one that would collide with a request's growth waits."""
    clock = FakeClock()
    ctl = controller(num_blocks=41, clock=clock)  # 40 usable, target 38
    loop = FakeClockLoop(clock)
    try:
        # 100 prompt tokens + 300 output: 7 blocks now, 25 at its last step.
        long = loop.run_until_complete(admit(ctl, prompt_tokens=100, max_tokens=300))
        long.first_token()  # type: ignore[attr-defined]
        # 14 blocks now, 15 at its end (20 steps away): 25 + 15 > 38, but while it
        # runs the long request holds at most 7 + 2 blocks.
        short = loop.run_until_complete(admit(ctl, prompt_tokens=220, max_tokens=20))
        assert ctl.ledger.reserved_blocks == 40 > ctl.ledger.target_blocks
        # The forecast (metrics, alerts) counts as admission does: no overflow ahead.
        forecast = ctl.forecast()
        assert forecast.peak_blocks <= ctl.ledger.target_blocks
        assert forecast.exhaustion_s == float("inf")
        # The state shows the room admission counts, not the peaks' negative headroom.
        ledger = ctl.state()["ledger"]
        assert ledger["headroom_blocks"] < 0  # type: ignore[index,operator]
        assert ledger["room_blocks"] == ctl.ledger.target_blocks - int(  # type: ignore[index]
            forecast.peak_blocks + 0.999)
        # Another 220 + 300: ends after the long one has grown; it does not fit.
        waiting = loop.create_task(admit(ctl, prompt_tokens=220, max_tokens=300))
        loop.run_until_complete(asyncio.sleep(0))
        assert not waiting.done() and len(ctl.queue) == 1
        short.finish()  # type: ignore[attr-defined]
        loop.run_until_complete(asyncio.sleep(0))
        assert not waiting.done()  # 25 + 33 blocks at their ends
        long.finish()  # type: ignore[attr-defined]
        loop.run_until_complete(asyncio.sleep(0))
        assert waiting.done()
        waiting.result().finish()
        assert ctl.ledger.reserved_blocks == 0 and ctl.ledger.reservations == 0
    finally:
        loop.close()


def test_server_use_that_kvgate_does_not_explain_is_held_until_the_next_scrape() -> None:
    clock = FakeClock()
    ctl = controller(num_blocks=41, clock=clock)
    loop = FakeClockLoop(clock)
    try:
        ticket = loop.run_until_complete(admit(ctl, prompt_tokens=100, max_tokens=60))
        # The server reports 30 blocks in use: 7 are the running request's prompt.
        ctl.update_server(ServerState(used_blocks=30))
        assert ctl.room.untracked_blocks == 23
        waiting = loop.create_task(admit(ctl, prompt_tokens=100, max_tokens=60))
        loop.run_until_complete(asyncio.sleep(0))
        assert not waiting.done()  # 10 + 23 + 10 > 38
        # The other traffic ended: the next scrape makes room.
        ctl.update_server(ServerState(used_blocks=7))
        loop.run_until_complete(asyncio.sleep(0))
        assert waiting.done() and ctl.room.untracked_blocks == 0
        for done in (ticket, waiting.result()):
            done.finish()  # type: ignore[attr-defined]
    finally:
        loop.close()


def test_requests_finished_after_the_scrape_was_sent_are_not_taken_for_others() -> None:
    """A scrape describes the server at a moment after it was sent: requests kvgate
    saw finish since may still be in its figure. Their blocks are not others' use held
    until the next scrape; those of requests that finished before it was sent are."""
    clock = FakeClock()
    ctl = controller(num_blocks=41, clock=clock)
    loop = FakeClockLoop(clock)
    try:
        # Two requests of 100 prompt tokens + 60 output: 7 blocks each now.
        first = loop.run_until_complete(admit(ctl, prompt_tokens=100, max_tokens=60))
        second = loop.run_until_complete(admit(ctl, prompt_tokens=100, max_tokens=60))
        clock.advance(0.01)
        sent = clock()
        clock.advance(0.01)
        first.finish()  # type: ignore[attr-defined]
        # The scrape's answer comes: both still on the server, 14 blocks.
        ctl.update_server(ServerState(used_blocks=14, running=2, waiting=0,
                                      scraped_from_s=sent))
        assert ctl.room.untracked_blocks == 0
        assert ctl.state()["ledger"]["others_blocks"] == 0  # type: ignore[index]
        assert ctl.ledger.snapshot().effective_used_blocks == ctl.ledger.reserved_blocks
        waiting = loop.create_task(admit(ctl, prompt_tokens=100, max_tokens=60))
        loop.run_until_complete(asyncio.sleep(0))
        assert waiting.done()  # 10 + 10 <= 38: the finished request's blocks are free
        # 30 blocks in use: as a scrape sent before the first request finished, and as
        # one sent after it (then its 7 blocks are others').
        clock.advance(0.01)
        ctl.update_server(ServerState(used_blocks=30, scraped_from_s=sent))
        early = ctl.room.untracked_blocks
        assert early > 0
        # The same scrape reporting no more requests than kvgate runs (2): the finished
        # one is not among them.
        ctl.update_server(ServerState(used_blocks=30, running=2, waiting=0,
                                      scraped_from_s=sent))
        assert ctl.room.untracked_blocks == early + 7
        ctl.update_server(ServerState(used_blocks=30, scraped_from_s=clock()))
        assert ctl.room.untracked_blocks == early + 7
        assert ctl.state()["ledger"]["others_blocks"] == early + 7  # type: ignore[index]
        # When the scrape does not say when it was sent: others' use.
        ctl.update_server(ServerState(used_blocks=30))
        assert ctl.room.untracked_blocks == early + 7
        for ticket in (second, waiting.result()):
            ticket.finish()  # type: ignore[attr-defined]
        assert ctl.ledger.reserved_blocks == 0
    finally:
        loop.close()


def test_a_request_without_streamed_tokens_is_not_taken_for_other_traffic() -> None:
    """A non-streamed request shows kvgate no token; the server generates for it all
    the same. Its output blocks are its own, not traffic kvgate does not see."""
    clock = FakeClock()
    ctl = controller(num_blocks=64, clock=clock)
    loop = FakeClockLoop(clock)
    try:
        ticket = loop.run_until_complete(admit(ctl, prompt_tokens=100, max_tokens=300))
        # Long after admission the server holds its prompt and most of its output:
        # 100 + 290 tokens = 25 blocks.
        clock.advance(300 * ticket.predicted_tpot_s)  # type: ignore[attr-defined]
        ctl.update_server(ServerState(used_blocks=25))
        assert ctl.room.untracked_blocks == 0
        ticket.finish()  # type: ignore[attr-defined]
    finally:
        loop.close()


holdings_st = st.lists(st.builds(
    Holding, start_blocks=st.floats(0, 40), blocks_per_step=st.floats(0, 2),
    cap_blocks=st.floats(0, 60), end_steps=st.integers(0, 60)), max_size=8)


@given(holdings=holdings_st, base=st.floats(0, 10), blocks=st.floats(0, 40),
       limit=st.floats(0, 150))
def test_holdings_peak_and_room_match_a_step_by_step_count(
        holdings: list[Holding], base: float, blocks: float, limit: float) -> None:
    def total(step: int) -> float:
        return base + sum(h.at(step) for h in holdings)

    horizon = max((h.end_steps for h in holdings), default=0) + 2
    assert holdings_peak(holdings, base) == pytest.approx(
        max(total(k) for k in range(horizon)), abs=1e-6)
    first = steps_until_room(holdings, blocks, limit, base)
    fits_from = [k for k in range(horizon)
                 if all(total(j) + blocks <= limit + 1e-9 for j in range(k, horizon))]
    if not fits_from:
        assert first == float("inf")
    else:
        # The first step from which it fits for good (the answer may be later by the
        # steps within one request's last stretch, never earlier).
        assert first >= fits_from[0]
        assert first in fits_from


@given(holdings=holdings_st, base=st.floats(0, 10), first=st.integers(0, 70),
       steps=st.integers(1, 70))
def test_the_most_held_over_some_steps_bounds_a_step_by_step_count(
        holdings: list[Holding], base: float, first: int, steps: int) -> None:
    """`RoomProfile.most_over`: never less than the sum at any step of the window, the
    sum itself where the window ends at a request's last step or covers the peak, and
    no less until the step it says it may fall from."""
    def total(step: int) -> float:
        return base + sum(h.at(step) for h in holdings)

    profile = RoomProfile.of(holdings, base)
    last = first + steps - 1
    most, falls_from = profile.most_over(first, last)
    exact = max(total(k) for k in range(first, last + 1))
    assert most >= exact - 1e-6
    if last in {h.end_steps - 1 for h in holdings} or exact == pytest.approx(
            holdings_peak(holdings, base), abs=1e-9):
        assert most == pytest.approx(exact, abs=1e-6)
    # A window from a step before the one it may fall from, as long or longer, holds
    # at least as much.
    if falls_from is None:
        assert most == pytest.approx(base, abs=1e-9)
    else:
        for later in range(first, falls_from):
            assert profile.most_over(later, last + later - first)[0] >= most - 1e-9


@given(running=holdings_st, queued=holdings_st, base=st.floats(0, 10),
       limit=st.floats(0, 150),
       latest=st.lists(st.one_of(st.just(math.inf), st.floats(0, 80)), max_size=8))
def test_the_wait_behind_queued_requests_matches_a_step_by_step_replay(
        running: list[Holding], queued: list[Holding], base: float, limit: float,
        latest: list[float]) -> None:
    """Each queued request (then the newcomer, the last) starts at the first step, not
    before the one ahead of it, from which its peak fits beside the running requests
    and those started before it (each holding its peak until its last step) at every
    step until its own last: replayed step by step, it starts no later than predicted, and at the
    predicted step it fits. One that would start after its latest step is refused
    there: it holds nothing, and the next one waits for it until then at most (the
    replay on the profile, as the walk counts). Nobody starts before the running
    requests alone stay within the limit for good."""
    held = RunningHoldings((), tuple(running), base, 0)
    *ahead, mine = queued or [Holding(1.0, 0.0, 1.0, 1)]
    walk = QueueWalk(held.profile)
    predicted = (walk.steps_until_admitted(mine, limit)
                 if walk.admit_all(ahead, limit, latest) else float("inf"))
    horizon = (max((h.end_steps for h in running), default=0)
               + sum(max(1, h.end_steps) for h in queued) + 2
               + max((math.ceil(step) for step in latest if step < math.inf), default=0))

    def total(step: int, started: list[tuple[int, Holding]]) -> float:
        return (base + sum(h.at(step) for h in running)
                + sum(h.cap_blocks for at, h in started if at <= step < at + max(1, h.end_steps)))

    def fits(step: int, holding: Holding, started: list[tuple[int, Holding]]) -> bool:
        return all(total(k, started) + holding.cap_blocks <= limit + 1e-9
                   for k in range(step, step + max(1, holding.end_steps)))

    def replay(exact: bool) -> float:
        started: list[tuple[int, Holding]] = []
        # Nobody goes in before the running requests alone stay within the limit for
        # good (admission checks every step ahead).
        alone_fit_from = held.profile.steps_until_room(0.0, limit)
        if alone_fit_from == math.inf:
            return math.inf
        step = int(alone_fit_from)
        for index, holding in enumerate((*ahead, mine)):
            last = latest[index] if index < min(len(ahead), len(latest)) else math.inf
            start = step
            # The prediction bounds the running requests by their profile at each
            # step, never less than they hold, and those started before by what they
            # hold at its start.
            while not (fits(start, holding, started) if exact
                       else max(held.profile.most_over(k, k)[0]
                                for k in range(start, start + max(1, holding.end_steps)))
                       + sum(h.cap_blocks for at, h in started
                             if at <= start < at + max(1, h.end_steps))
                       + holding.cap_blocks <= limit + 1e-9):
                start += 1
                if start > min(horizon, last):
                    break  # past its latest step, or never fits
            if start > last or (start > horizon and last < math.inf):
                step = max(step, math.ceil(last))  # refused at its latest step
                continue
            if start > horizon:
                return float("inf")
            step = start
            started.append((step, holding))
        return float(step)

    assert predicted == replay(exact=False)
    if all(step == math.inf for step in latest[:len(ahead)]):
        # A bound only when nobody is refused: one the profile lets in after its
        # latest step may find room sooner, get in and hold it.
        assert predicted >= replay(exact=True)


def test_predicted_wait_is_when_admission_would_let_the_request_in() -> None:
    """With nobody queued ahead, the wait a deadline is judged on is the step from which
    the request fits as it grows beside the running requests (not from its peak)."""
    clock = FakeClock()
    ctl = controller(num_blocks=41, clock=clock)  # target 38
    loop = FakeClockLoop(clock)
    try:
        # 27 blocks now and for its 40 steps: nothing of 12 blocks fits until it ends.
        blocker = loop.run_until_complete(admit(ctl, prompt_tokens=420, max_tokens=40))
        blocker.first_token()  # type: ignore[attr-defined]
        step_s = ctl._step_pricer(clock())(1)  # the blocker alone
        with pytest.raises(Rejected) as late:
            loop.run_until_complete(admit(ctl, prompt_tokens=150, max_tokens=30,
                                          ttft_slo_s=1e-6))
        waited_steps = late.value.decision.details["predicted_ttft_s"] / step_s
        # Its last step is 40 steps ahead (41 with the step in flight): then it fits.
        assert 40 <= waited_steps - late.value.decision.details[
            "predicted_prefill_s"] / step_s <= 42
        blocker.finish()  # type: ignore[attr-defined]
    finally:
        loop.close()


def with_host_work_per_sequence(ctl: AdmissionController, seconds: float = 2e-3) -> None:
    """Host work per sequence in a step (as on the CPU server): a larger batch steps
    slower."""
    served = ctl.cost_model.served
    ctl.set_cost_model(CostModel(served.with_efficiency(
        replace(served.efficiency, per_sequence_s=seconds))))


def by_step_s(step: int, spans: list[tuple[int, int]], step_s: Callable[[int], float]
              ) -> float:
    """The time until `step`, summed step by step (each at the batch of the `spans`
    covering it): the step clock's reference."""
    return sum(step_s(max(1, sum(first <= s < after for first, after in spans)))
               for s in range(step))


def test_a_wait_gets_faster_steps_as_the_running_requests_finish() -> None:
    """A wait for room is counted in engine steps; each lasts as long as a step of the
    batch running then: after the short request ends, the long one steps alone."""
    clock = FakeClock()
    ctl = controller(num_blocks=41, clock=clock)  # target 38 blocks of 16 tokens
    with_host_work_per_sequence(ctl)
    loop = FakeClockLoop(clock)
    try:
        # 27 blocks for 40 steps and 6 for 10: 12 more fit only once both have ended.
        long = loop.run_until_complete(admit(ctl, prompt_tokens=420, max_tokens=40))
        short = loop.run_until_complete(admit(ctl, prompt_tokens=80, max_tokens=10))
        for ticket in (long, short):
            ticket.first_token()  # type: ignore[attr-defined]
        ends = sorted(h.end_steps for h in ctl._running_holdings(clock()).holdings)
        alone_s, together_s = ctl._step_pricer(clock())(1), ctl._step_pricer(clock())(2)
        assert together_s > 1.2 * alone_s  # the premise: a batch of 2 steps slower
        with pytest.raises(Rejected) as late:
            loop.run_until_complete(admit(ctl, prompt_tokens=150, max_tokens=30,
                                          ttft_slo_s=1e-6))
        wait_s = late.value.decision.details["model_wait_s"]
        assert wait_s == pytest.approx(ends[0] * together_s + (ends[1] - ends[0]) * alone_s,
                                       abs=1e-6)  # the details keep 6 digits
        assert wait_s < ends[1] * together_s - (ends[1] - ends[0]) * (together_s - alone_s) / 2
        # The running requests' expected ends (the metrics' forecast, the server's
        # seats) on the same clock: the long one's last 30 steps are steps of 1.
        finish_s = sorted(view.finish_in_s for view in ctl.running_requests())
        assert finish_s[1] < 40 * together_s - 20 * (together_s - alone_s)
        # A model that prices steps differently (recalibrated) prices the next wait anew.
        with_host_work_per_sequence(ctl, 6e-3)
        with pytest.raises(Rejected) as again:
            loop.run_until_complete(admit(ctl, prompt_tokens=150, max_tokens=30,
                                          ttft_slo_s=1e-6))
        assert again.value.decision.details["model_wait_s"] > 1.5 * wait_s  # type: ignore[operator]
        for ticket in (long, short):
            ticket.finish()  # type: ignore[attr-defined]
    finally:
        loop.close()


def three_queued_behind_a_blocker(ctl: AdmissionController, loop: FakeClockLoop
                                  ) -> tuple[object, object, list[asyncio.Task[object]]]:
    """On a target of 38 blocks of 16 tokens: a long request (15 blocks growing to 22
    over 100 steps), a blocker beside it (20 blocks for 10 steps), and three requests of
    8 blocks for 8 steps queued: two fit beside the long one once the blocker has ended,
    the third once they have."""
    long = loop.run_until_complete(admit(ctl, prompt_tokens=240, max_tokens=100))
    blocker = loop.run_until_complete(admit(ctl, prompt_tokens=300, max_tokens=10))
    for ticket in (long, blocker):
        ticket.first_token()  # type: ignore[attr-defined]
    queued = [loop.create_task(admit(ctl, prompt_tokens=112, max_tokens=8)) for _ in range(3)]
    loop.run_until_complete(asyncio.sleep(0))
    assert len(ctl.queue) == 3
    return long, blocker, queued


def release(loop: FakeClockLoop, long: object, blocker: object,
            queued: list[asyncio.Task[object]]) -> None:
    """`three_queued_behind_a_blocker`'s requests, each finished once."""
    blocker.finish()  # type: ignore[attr-defined]
    for _ in range(5):
        loop.run_until_complete(asyncio.sleep(0))
    long.finish()  # type: ignore[attr-defined]
    for _ in range(5):
        loop.run_until_complete(asyncio.sleep(0))
    for task in queued:
        if not getattr(task.result(), "finished", False):
            task.result().finish()  # type: ignore[attr-defined]


def test_a_wait_behind_queued_requests_counts_them_in_the_steps_they_run() -> None:
    """Requests queued ahead are let in as room frees; from then on they are in the
    batch, and the steps of the wait behind them are slower for it."""
    clock = FakeClock()
    ctl = controller(num_blocks=41, clock=clock, limits=QueueLimits(max_wait_s=1e6))
    with_host_work_per_sequence(ctl)
    loop = FakeClockLoop(clock)
    try:
        long, blocker, queued = three_queued_behind_a_blocker(ctl, loop)
        with pytest.raises(Rejected) as late:
            loop.run_until_complete(admit(ctl, prompt_tokens=40, max_tokens=8,
                                          ttft_slo_s=1e-6))
        wait_s = late.value.decision.details["model_wait_s"]
        # Where the walk let the three in, and the step the newcomer follows them at.
        memo = ctl._walk_memo
        assert memo is not None and memo[2] is not None and memo[2].walk is not None
        walk = memo[2].walk.copy()
        step = int(walk.steps_until_admitted(ctl.room.queued(
            AdmissionRequest(40, 8), ctl._cost(AdmissionRequest(40, 8), PrefixPlan.none())),
            ctl.ledger.target_blocks))
        spans = walk.spans[:3]
        assert len({first for first, _ in spans}) > 1  # let in at different steps
        running = [(0, h.end_steps) for h in ctl._running_holdings(clock()).holdings]
        step_s = ctl._step_pricer(clock())
        assert wait_s == pytest.approx(by_step_s(step, running + spans, step_s), abs=1e-6)
        assert wait_s > by_step_s(step, running, step_s) + 1e-3  # not the running alone
        release(loop, long, blocker, queued)
    finally:
        loop.close()


def test_steps_are_priced_at_most_at_the_servers_max_num_seqs() -> None:
    """A batch the server never runs (more than its --max-num-seqs: the rest wait in
    its queue) is priced as its largest."""
    ctl = controller(server_limits=ServerQueueLimits(max_running=2))
    with_host_work_per_sequence(ctl)
    step_s = ctl._step_pricer(ctl.clock())
    assert step_s(5) == step_s(2) > step_s(1)


def test_the_walk_of_the_queue_keeps_the_steps_each_request_runs() -> None:
    """`QueueWalk.spans`: from the step each is let in to the step after its last."""
    first = Holding(10, 0, 10, end_steps=5)
    second = Holding(10, 0, 10, end_steps=3)
    roomy = QueueWalk(RoomProfile.of([]))
    assert roomy.admit_all([first, second], 20)
    assert roomy.spans == [(0, 5), (0, 3)]
    tight = QueueWalk(RoomProfile.of([]))  # room for one at a time
    assert tight.admit_all([first, second], 15)
    assert tight.spans == [(0, 5), (5, 8)]


def test_the_walk_passes_over_a_request_the_queue_refuses_before_room_comes() -> None:
    """Room for one at a time: the first runs for 5 steps. The second could start only
    then, after its latest step (3): it is refused at step 3 and holds nothing, and the
    third starts when the first ends, not after the second."""
    first = Holding(10, 0, 10, end_steps=5)
    refused = Holding(10, 0, 10, end_steps=20)
    third = Holding(10, 0, 10, end_steps=3)
    walk = QueueWalk(RoomProfile.of([]))
    assert walk.admit_all([first, refused, third], 15, [math.inf, 3.0])
    assert walk.spans == [(0, 5), (5, 8)]
    # With a later latest step it is let in, and the third waits for it.
    kept = QueueWalk(RoomProfile.of([]))
    assert kept.admit_all([first, refused, third], 15, [math.inf, 5.0])
    assert kept.spans == [(0, 5), (5, 25), (25, 28)]
    # One that never fits is refused at its latest step; those behind start from then.
    huge = Holding(100, 0, 100, end_steps=1)
    never = QueueWalk(RoomProfile.of([]))
    assert never.admit_all([huge, third], 15, [7.5])
    assert never.spans == [(8, 11)]
    assert not QueueWalk(RoomProfile.of([])).admit_all([huge, third], 15)


def test_the_walk_lets_nobody_in_while_the_running_requests_alone_will_exceed_the_limit(
        ) -> None:
    """A running request grows past the limit by itself (at step 16, until its last,
    19): admission checks every step ahead, so a short request that would fit at once
    over its own step is let in only after it ends."""
    grows = RoomProfile.of([Holding(0, 1.0, 30, end_steps=20)])
    walk = QueueWalk(grows)
    assert walk.admit_all([Holding(1, 0, 1, end_steps=1)], 15)
    assert walk.spans == [(20, 21)]
    assert not QueueWalk(RoomProfile.of([Holding(20, 0, 20, end_steps=5)], base_blocks=16)
                         ).admit_all([Holding(1, 0, 1, end_steps=1)], 15)


def test_a_wait_behind_short_queued_requests_is_their_turnover_not_the_longest_run() -> None:
    """Requests queued ahead are admitted in turn as room frees and leave when they
    finish: the wait behind them is not the time until all of them fit at once (here:
    only once a long request running alongside has ended)."""
    clock = FakeClock()
    ctl = controller(num_blocks=41, clock=clock, limits=QueueLimits(max_wait_s=1e6))
    loop = FakeClockLoop(clock)
    try:
        long, blocker, queued = three_queued_behind_a_blocker(ctl, loop)
        step_s = ctl._step_pricer(clock())(2)  # the blocker and the long one
        with pytest.raises(Rejected) as late:
            loop.run_until_complete(admit(ctl, prompt_tokens=40, max_tokens=8,
                                          ttft_slo_s=1e-6))
        waited_steps = late.value.decision.details["model_wait_s"] / step_s  # type: ignore[operator]
        # The blocker's end (11 steps), then the first two queued ones' (8 more); all
        # four fit at once only after the long request (100 steps).
        assert 20 <= waited_steps <= 30, waited_steps
        release(loop, long, blocker, queued)
    finally:
        loop.close()


def test_a_new_tenant_is_not_predicted_to_wait_behind_a_busy_tenants_backlog() -> None:
    clock = FakeClock()
    ctl = controller(num_blocks=41, clock=clock, limits=QueueLimits(max_wait_s=1e6))
    loop = FakeClockLoop(clock)
    try:
        blocker = loop.run_until_complete(admit(ctl, prompt_tokens=440, max_tokens=10))
        blocker.first_token()  # type: ignore[attr-defined]
        backlog = [loop.create_task(admit(ctl, prompt_tokens=300, max_tokens=200,
                                          tenant="busy")) for _ in range(4)]
        loop.run_until_complete(asyncio.sleep(0))
        waits = {}
        for tenant in ("busy", "new"):
            with pytest.raises(Rejected) as late:
                loop.run_until_complete(admit(ctl, prompt_tokens=40, max_tokens=8,
                                              tenant=tenant, ttft_slo_s=1e-6))
            waits[tenant] = late.value.decision.details["model_wait_s"]
        # The busy tenant's next request waits behind its own backlog; a new tenant's
        # goes first (cost fairness): it waits only for the blocker's room.
        assert waits["new"] < waits["busy"] / 4  # type: ignore[operator]
        blocker.finish()  # type: ignore[attr-defined]
        for _ in range(40):
            loop.run_until_complete(asyncio.sleep(0))
            for task in backlog:
                if task.done() and not getattr(task, "_seen", False):
                    task._seen = True  # type: ignore[attr-defined]
                    task.result().finish()
        assert all(task.done() for task in backlog)
    finally:
        loop.close()


WAIT_SAMPLES = MIN_SAMPLES + 4


def test_queue_waits_are_corrected_by_the_waits_requests_then_had() -> None:
    """Queued requests that get in sooner than predicted (clients that left, outputs
    that ended early) teach the controller to shorten its predictions."""
    clock = FakeClock()
    ctl = controller(num_blocks=41, clock=clock, limits=QueueLimits(max_wait_s=1e6))
    loop = FakeClockLoop(clock)
    try:
        for _ in range(WAIT_SAMPLES):
            blocker = loop.run_until_complete(admit(ctl, prompt_tokens=440, max_tokens=40))
            blocker.first_token()  # type: ignore[attr-defined]
            waiting = loop.create_task(admit(ctl, prompt_tokens=150, max_tokens=30))
            loop.run_until_complete(asyncio.sleep(0))
            assert len(ctl.queue) == 1
            # The blocker's client leaves after a quarter of the predicted wait.
            clock.advance(ctl._step_pricer(clock())(1) * 41 / 4)
            blocker.finish()  # type: ignore[attr-defined]
            loop.run_until_complete(asyncio.sleep(0))
            waiting.result().finish()
        assert ctl.wait_ratio.samples == WAIT_SAMPLES
        assert ctl.wait_ratio.factor == pytest.approx(0.25, rel=0.1)
        blocker = loop.run_until_complete(admit(ctl, prompt_tokens=440, max_tokens=40))
        blocker.first_token()  # type: ignore[attr-defined]
        with pytest.raises(Rejected) as late:
            loop.run_until_complete(admit(ctl, prompt_tokens=150, max_tokens=30,
                                          ttft_slo_s=1e-6))
        details = late.value.decision.details
        assert details["predicted_wait_s"] == pytest.approx(
            details["model_wait_s"] * ctl.wait_ratio.factor, rel=1e-3)  # type: ignore[operator]
        assert ctl.state()["queue"]["wait_ratio"]["samples"] == WAIT_SAMPLES
        blocker.finish()  # type: ignore[attr-defined]
    finally:
        loop.close()


@pytest.mark.parametrize("wait_ratio", [1.0, 2.0])
def test_a_queued_request_that_will_be_refused_holds_no_room_in_the_wait_behind_it(
        wait_ratio: float) -> None:
    """A low-priority request queued for room after a blocker; then a high-priority one
    goes ahead of it and holds the room until long after its target. The queue will
    refuse it at its target: a newcomer behind it waits for that refusal, not for room
    for it after the high-priority one. In the model's time: requests have waited
    `wait_ratio` times what the model said, so its refusal comes after as much less."""
    clock = FakeClock()
    ctl = controller(num_blocks=41, clock=clock, limits=QueueLimits(max_wait_s=1e6))
    for _ in range(MIN_SAMPLES):
        ctl.wait_ratio.observe(0.1, 0.1 * wait_ratio)
    assert ctl.wait_ratio.factor == pytest.approx(wait_ratio)
    loop = FakeClockLoop(clock)
    try:
        # On a target of 38 blocks: a blocker of 20 blocks for 10 steps.
        blocker = loop.run_until_complete(admit(ctl, prompt_tokens=300, max_tokens=10))
        blocker.first_token()  # type: ignore[attr-defined]
        step_s = ctl._step_pricer(clock())(1)
        prefill_s = ctl.cost_model.cost(300, 8).prefill_s
        # 20 blocks, let in once the blocker ends (about 11 steps): its target leaves 25.
        low = loop.create_task(admit(ctl, prompt_tokens=300, max_tokens=8, band=2,
                                     ttft_slo_s=prefill_s + 25 * step_s))
        # 30 blocks for 60 steps, ahead of it: nothing else of 20 blocks fits until it
        # ends (about step 72).
        high = loop.create_task(admit(ctl, prompt_tokens=420, max_tokens=60, band=0))
        loop.run_until_complete(asyncio.sleep(0))
        assert len(ctl.queue) == 2
        entry = next(e for e in ctl.queue.ahead_of(2, "default") if e.band == 2)
        until_refused_s = (entry.deadline_s - clock()  # type: ignore[operator]
                           - entry.payload.cost.deadline_prefill_s)
        # A newcomer of 1 block fits beside the high-priority one.
        with pytest.raises(Rejected) as late:
            loop.run_until_complete(admit(ctl, prompt_tokens=10, max_tokens=6, band=2,
                                          ttft_slo_s=1e-6))
        wait_s = late.value.decision.details["model_wait_s"]
        model_until_s = until_refused_s / wait_ratio
        assert model_until_s <= wait_s < model_until_s + 2 * step_s  # type: ignore[operator]
        assert wait_s < 60 * step_s  # type: ignore[operator]
        # And the queue refuses it so: room for it comes only after its target.
        blocker.finish()  # type: ignore[attr-defined]
        loop.run_until_complete(asyncio.sleep(0))
        assert high.done() and not low.done()
        clock.advance(until_refused_s)
        with pytest.raises(Rejected) as refused:
            loop.run_until_complete(low)
        assert refused.value.decision.outcome is Outcome.DEADLINE
        high.result().finish()  # type: ignore[attr-defined]
    finally:
        loop.close()


@pytest.mark.parametrize("fairness", ["cost", "none"])
def test_the_entries_ahead_of_a_newcomer_are_those_the_queue_takes_first(
        fairness: str) -> None:
    """What a predicted wait counts as ahead: the more important bands, the newcomer's
    own tenant, and of the other tenants in its band those fairness takes first; the
    queue then takes them in that order."""
    from sidecar.admission.policies import FAIRNESS, ORDERINGS, StrictPriority
    from sidecar.admission.queue import AdmissionQueue, Entry

    queue = AdmissionQueue(ORDERINGS["fcfs"](), FAIRNESS[fairness](), StrictPriority(None))
    pushed = [queue.push(Entry(float(i), band, tenant, 1, 1.0, payload=name))
              for i, (band, tenant, name) in enumerate([
                  (1, "busy", "busy-1"), (1, "busy", "busy-2"), (1, "busy", "busy-3"),
                  (0, "vip", "vip-1"), (1, "mine", "mine-1"), (2, "low", "low-1")])]
    ahead = {entry.payload for entry in queue.ahead_of(1, "mine")}
    if fairness == "cost":
        # Both tenants start at no cost; the newcomer's turn comes once mine-1 (cost 1)
        # is served: busy's first two are served by then (a tie goes to the older).
        assert ahead == {"vip-1", "mine-1", "busy-1", "busy-2"}
    else:  # arrival order: every request of the band and the more important ones
        assert ahead == {"vip-1", "mine-1", "busy-1", "busy-2", "busy-3"}
    # A newcomer of `mine` pushed now is taken after exactly those.
    newcomer = queue.push(Entry(9.0, 1, "mine", 1, 1.0, payload="new"))
    order = []
    while (entry := queue.pop(10.0)) is not None:
        order.append(entry.payload)
        if entry is newcomer:
            break
    assert set(order[:-1]) == ahead
    assert len(pushed) == 6


def test_the_entries_ahead_come_in_the_order_the_queue_serves_them() -> None:
    """The walk of the queue lets them in in this order: the more important bands
    first, whenever their requests came, and each tenant's in its own order."""
    from sidecar.admission.policies import FAIRNESS, ORDERINGS, StrictPriority
    from sidecar.admission.queue import AdmissionQueue, Entry

    queue = AdmissionQueue(ORDERINGS["fcfs"](), FAIRNESS["none"](), StrictPriority(None))
    for i, (band, name) in enumerate([(2, "low-1"), (1, "mine-1"), *(
            (1, f"mine-{n}") for n in range(2, 7)), (0, "vip-1"), (0, "vip-2")]):
        queue.push(Entry(float(i), band, "mine", 1, 1.0, payload=name))
    # Once the first have gone, a heap is no longer in order in its list.
    assert [queue.pop(0.0).payload for _ in range(3)] == [  # type: ignore[union-attr]
        "vip-1", "vip-2", "mine-1"]
    ahead = [entry.payload for entry in queue.ahead_of(2, "mine")]
    assert ahead == ["mine-2", "mine-3", "mine-4", "mine-5", "mine-6", "low-1"]
    # A newcomer's own tenant's, of its own band, in the same order.
    assert [entry.payload for entry in queue.ahead_of(1, "mine")] == ahead[:-1]
    served = [entry.payload for entry in iter(lambda: queue.pop(0.0), None)]
    assert served == ahead


def test_the_wait_for_room_is_the_first_start_that_fits_not_a_later_one() -> None:
    """Admitted later, a newcomer finds fewer requests running but those left larger:
    it fits right after a short request ends (step 5) and, the long one grown, not
    after the next ends. The wait is the first start that fits."""
    model = CostModel(tiny_served(4096))
    room = KVRoom(Ledger(4096), model)
    request = AdmissionRequest(prompt_tokens=160, max_tokens=8)
    cost = model.cost(160, 8)
    running = RunningHoldings(
        tickets=(),
        holdings=(Holding(40, 0, 40, 5),  # 40 blocks, its last step the 5th
                  Holding(10, 1, 48, 1000),  # grows a block a step to 48
                  Holding(0, 0, 0, 200), Holding(0, 0, 0, 300)),
        base_blocks=0.0, prefill_steps=0)
    plan = PrefixPlan.none()

    def fits_from(step: int) -> bool:
        later = tuple(Holding(min(h.cap_blocks, h.start_blocks + h.blocks_per_step * step),
                              h.blocks_per_step, h.cap_blocks, h.end_steps - step)
                      for h in running.holdings)
        return room.fits(RunningHoldings((), later, 0.0, 0), request, cost, plan, 55)

    assert [fits_from(step) for step in (0, 5, 200, 300, 1000)] == [
        False, True, False, False, True]
    assert room.steps_until_fits(running, request, cost, plan, 55) == 5
    assert cost.kv_blocks == 11  # not even alone within 10
    assert room.steps_until_fits(running, request, cost, plan, 10) == math.inf


@pytest.mark.parametrize("how", ["cancelled", "timed out"])
def test_requests_behind_a_head_that_leaves_the_queue_go_in_at_once(how: str) -> None:
    """The head does not fit and the request behind it does; when the head leaves
    (its client went away, or its wait ran out), the one behind goes in at once, not
    at the next scrape or finish."""
    clock = FakeClock()
    ctl = controller(num_blocks=41, clock=clock, limits=QueueLimits(max_wait_s=5.0))
    loop = FakeClockLoop(clock)
    try:
        running = loop.run_until_complete(admit(ctl, prompt_tokens=500, max_tokens=12))
        running.first_token()  # type: ignore[attr-defined]
        head = loop.create_task(admit(ctl, prompt_tokens=200, max_tokens=60))
        loop.run_until_complete(asyncio.sleep(0))
        if how == "timed out":
            clock.advance(2.0)  # the head's wait runs out first
        behind = loop.create_task(admit(ctl, prompt_tokens=50, max_tokens=20))
        loop.run_until_complete(asyncio.sleep(0))
        assert len(ctl.queue) == 2 and not behind.done()
        if how == "cancelled":
            head.cancel()
        else:
            clock.advance(3.01)
        for _ in range(3):
            loop.run_until_complete(asyncio.sleep(0))
        assert head.done() and behind.done() and len(ctl.queue) == 0
        behind.result().finish()  # type: ignore[attr-defined]
        running.finish()  # type: ignore[attr-defined]
        assert ctl.ledger.reserved_blocks == 0 and ctl.ledger.reservations == 0
        if how == "timed out":
            with pytest.raises(Rejected):
                head.result()
    finally:
        loop.close()


def test_a_request_starved_past_the_bound_goes_before_new_arrivals_that_fit() -> None:
    """Strict priority lets a band-0 arrival that fits in at once, ahead of a band-2
    request waiting for room; once that one has waited past the starvation bound it
    goes first, so arrivals queue behind it instead of taking the room it waits for."""
    clock = FakeClock()
    ctl = controller(num_blocks=201, clock=clock, starvation_bound_s=30.0,
                     limits=QueueLimits(max_wait_s=120.0))  # target 190 blocks
    loop = FakeClockLoop(clock)

    def arrive(band: int, prompt: int) -> asyncio.Task[object]:
        task = loop.create_task(admit(ctl, prompt_tokens=prompt, max_tokens=100, band=band))
        loop.run_until_complete(asyncio.sleep(0))
        return task

    try:
        running = [loop.run_until_complete(admit(ctl, prompt_tokens=400, max_tokens=100,
                                                 band=0)) for _ in range(5)]  # 32 blocks each
        low = arrive(2, 900)  # 63 blocks: no room
        assert len(ctl.queue) == 1
        running.pop().finish()  # type: ignore[attr-defined]
        early = arrive(0, 400)  # before the bound: in at once, ahead of the low band
        assert early.done() and len(ctl.queue) == 1
        running.append(early.result())
        clock.advance(31.0)
        running.pop().finish()  # type: ignore[attr-defined]  # 128 held: still no room for 63
        late = arrive(0, 400)  # it would fit, but the starved request goes first
        assert not late.done() and len(ctl.queue) == 2
        running.pop().finish()  # type: ignore[attr-defined]  # room for the starved one
        loop.run_until_complete(asyncio.sleep(0))
        assert low.done() and not late.done()
        low.result().finish()  # type: ignore[attr-defined]
        loop.run_until_complete(asyncio.sleep(0))
        assert late.done()
        for ticket in [*running, late.result()]:
            ticket.finish()  # type: ignore[attr-defined]
        assert ctl.ledger.reserved_blocks == 0 and ctl.ledger.reservations == 0
    finally:
        loop.close()


def test_under_edf_a_tight_deadline_is_not_priced_behind_its_tenants_later_deadlines() -> None:
    """Earliest deadline first serves a request with a deadline before its tenant's
    queued requests without one: its predicted wait counts only the running request,
    so it is queued (and goes in first), not refused for a wait it will not have."""
    clock = FakeClock()
    ctl = controller(num_blocks=41, clock=clock, ordering="edf", starvation_bound_s=None,
                     limits=QueueLimits(max_wait_s=1e6))
    loop = FakeClockLoop(clock)
    try:
        running = loop.run_until_complete(admit(ctl, prompt_tokens=300, max_tokens=200))
        running.first_token()  # type: ignore[attr-defined]
        probe = loop.create_task(admit(ctl, prompt_tokens=300, max_tokens=200))
        loop.run_until_complete(asyncio.sleep(0))
        (entry,) = ctl.queue.entries()
        alone_s = entry.payload.cost.deadline_prefill_s  # type: ignore[attr-defined]
        alone_s += ctl._kv_wait_s(entry.payload.request, entry.payload.cost, 1)  # type: ignore[attr-defined]
        others = [loop.create_task(admit(ctl, prompt_tokens=300, max_tokens=200))
                  for _ in range(4)]  # 5 without a deadline, each the cache's whole room
        tight = loop.create_task(admit(ctl, prompt_tokens=300, max_tokens=200,
                                       ttft_slo_s=1.5 * alone_s))
        loop.run_until_complete(asyncio.sleep(0))
        assert not tight.done() and len(ctl.queue) == 6
        running.finish()  # type: ignore[attr-defined]
        loop.run_until_complete(asyncio.sleep(0))
        assert tight.done() and not probe.done()
        tight.result().finish()  # type: ignore[attr-defined]
        for task in [probe, *others]:
            loop.run_until_complete(asyncio.sleep(0))
            task.cancel()
        loop.run_until_complete(asyncio.sleep(0))
        for task in [probe, *others]:
            if task.done() and not task.cancelled():
                task.result().finish()  # type: ignore[attr-defined]
        assert ctl.ledger.reserved_blocks == 0 and ctl.ledger.reservations == 0
    finally:
        loop.close()


def test_forks_after_the_first_prefill_only_what_the_cache_does_not_hold() -> None:
    model = CostModel(tiny_served(num_blocks=512))  # blocks of 16 tokens
    # 4 forks of 200 tokens: the first prefills 200, the others the 8 past 12 blocks.
    assert model.cost(200, 10, 4, forks_share=True).server_prefill_tokens == 200 + 3 * 8
    assert model.cost(200, 10, 4).server_prefill_tokens == 4 * 200
    # 100 tokens cached on the server (fewer than the forks' shared 192): the first
    # fork prefills 100, the others 8 each.
    assert model.cost(200, 10, 4, cached_tokens=100,
                      forks_share=True).server_prefill_tokens == 100 + 3 * 8
    assert model.cost(200, 10, 1).server_prefill_tokens == 200


def test_forks_that_do_not_share_hold_their_blocks_through_every_fork_s_prefill() -> None:
    """vLLM prefills each fork as a request of its own: forks that cannot share the
    prompt (prompt_logprobs, prefix caching off) take `sequences` prompts' chunks before
    they decode, and hold their blocks that much longer; shared, only the first fork's
    prompt and the later forks' tails. What the server has cached counts for every fork
    that does not share, and for the first one that does."""
    model = CostModel(tiny_served(num_blocks=4096))
    room = KVRoom(Ledger(4096), model)
    chunk = model.lifecycle.chunk_tokens
    prompt = 2 * chunk + 40  # three chunks alone
    tail = prompt % 16  # past the prompt's full blocks of 16
    for forks_share, cached, prefilled in (
            (False, 0, 4 * prompt), (True, 0, prompt + 3 * tail),
            (False, chunk, 4 * (prompt - chunk)), (True, chunk, prompt - chunk + 3 * tail)):
        request = AdmissionRequest(prompt_tokens=prompt, max_tokens=10, sequences=4,
                                   forks_share=forks_share)
        cost = model.cost(prompt, 10, 4, forks_share=forks_share, cached_tokens=cached)
        assert cost.server_prefill_tokens == prefilled
        steps = -(-prefilled // chunk)
        plan = PrefixPlan(0, (), 0, cached)
        assert room.newcomer(request, cost, plan).end_steps == steps + 10 + 1
        # Queued, nothing it shares is counted: its forks prefill their whole prompts.
        whole = model.cost(prompt, 10, 4, forks_share=forks_share).server_prefill_tokens
        assert room.newcomer(request, cost, PrefixPlan.none()).end_steps == (
            -(-whole // chunk) + 10 + 1)
    # Admitted and not prefilled yet, the same steps come before the requests after it.
    long = tiny_served(num_blocks=4096, max_model_len=8192,
                       config={**TINY_LLAMA, "max_position_embeddings": 8192})
    ctl = AdmissionController(CostModel(long), AdmissionSettings(), clock=FakeClock())
    ctl.update_server(ServerState(available=True))

    async def admitted() -> None:
        ticket = await admit(ctl, prompt_tokens=prompt, max_tokens=10, sequences=4)
        running = ctl.room.running([ticket], lambda _t, _now: 0, ctl.clock())
        assert running.prefill_steps == -(-4 * prompt // chunk)
        ticket.finish(10)

    asyncio.run(admitted())


def test_with_a_long_prefill_threshold_a_long_prompt_holds_its_blocks_through_its_chunks(
) -> None:
    """vLLM prefills a prompt in chunks of at most its long-prefill threshold while others
    run: a long prompt decodes, and frees its blocks, that many steps later. The prompts
    ahead of it share the budget with it: their steps at the whole budget and its own
    chunks are not added up."""
    base = tiny_served(num_blocks=4096)
    capped = ServedModel(base.arch, replace(base.deployment, long_prefill_token_threshold=64),
                         base.gpu)
    request = AdmissionRequest(prompt_tokens=640, max_tokens=10)
    for served, chunks in ((base, 1), (capped, 10)):
        model = CostModel(served)
        room = KVRoom(Ledger(4096), model)
        cost = model.cost(640, 10)
        assert room.newcomer(request, cost, PrefixPlan.none()).end_steps == chunks + 10 + 1
        for ahead in (3, 12):
            assert room.newcomer(request, cost, PrefixPlan.none(), ahead).end_steps == (
                max(ahead + 1, chunks) + 10 + 1)
        # Admitted, not prefilled yet: its own holding ends after its chunks; the
        # request after it waits for its steps at the whole budget.
        ctl = AdmissionController(model, AdmissionSettings(), clock=FakeClock())
        ctl.update_server(ServerState(available=True))

        async def admitted(ctl: AdmissionController = ctl, chunks: int = chunks) -> None:
            ticket = await admit(ctl, prompt_tokens=640, max_tokens=10)
            running = ctl.room.running([ticket], lambda _t, _now: 0, ctl.clock())
            assert running.prefill_steps == 1
            assert running.holdings[0].end_steps == chunks + 10 + 1
            ticket.finish(10)

        asyncio.run(admitted())


def test_a_forked_reservation_keeps_its_sharing_when_prefix_caching_flips() -> None:
    ctl = controller(num_blocks=64)

    async def scenario() -> None:
        shared = await admit(ctl, prompt_tokens=200, max_tokens=20, sequences=4,
                             forks_share=True)
        held = shared.cost.kv_blocks  # type: ignore[attr-defined]
        assert held == 4 * 14 - 3 * 12
        ctl.set_prefix_caching(False)
        # Admitted with sharing, it is priced so as it runs: its reservation neither
        # grows past what was admitted nor is freed twice.
        shared.first_token()  # type: ignore[attr-defined]
        shared.progress(10)  # type: ignore[attr-defined]
        assert ctl.ledger.reserved_blocks == held
        unshared = await admit(ctl, prompt_tokens=40, max_tokens=20, sequences=2,
                               forks_share=True)
        assert unshared.cost.kv_blocks == 2 * 4  # type: ignore[attr-defined]
        assert ctl.ledger.reserved_blocks == held + 8
        ctl.set_prefix_caching(True)
        unshared.progress(5)  # type: ignore[attr-defined]
        assert ctl.ledger.reserved_blocks == held + 8
        assert shared.finish() is True  # type: ignore[attr-defined]
        assert unshared.finish() is True  # type: ignore[attr-defined]
        assert shared.finish() is False  # type: ignore[attr-defined]
        assert ctl.ledger.reserved_blocks == 0 and ctl.ledger.reservations == 0

    run(scenario())


def test_with_a_long_prefill_threshold_forks_share_only_the_first_chunk() -> None:
    # vLLM's --long-prefill-token-threshold 100: the first fork's prompt is scheduled 100
    # tokens a step, and the later forks get the budget it leaves: each is sure to find
    # only the first chunk's 6 full blocks cached, and computes the rest itself.
    served = tiny_served(num_blocks=512)
    served.deployment = replace(served.deployment, long_prefill_token_threshold=100)
    model = CostModel(served)
    assert model.fork_shared_blocks(600, 4, forks_share=True) == 3 * (100 // 16)
    assert model.peak_blocks(600, 100, 4, forks_share=True) == (
        4 * model.peak_blocks(600, 100) - 3 * 6)
    assert model.server_prefill_tokens(600, 4, 0, forks_share=True) == 600 + 3 * (600 - 96)
    # A prompt within the threshold is scheduled whole, as without one.
    assert model.fork_shared_blocks(90, 4, forks_share=True) == 3 * (89 // 16)
    plain = CostModel(tiny_served(num_blocks=512))
    assert plain.fork_shared_blocks(600, 4, forks_share=True) == 3 * (599 // 16)


def test_forks_share_nothing_under_mtp_drafting() -> None:
    # vLLM drops the last hit block with an MTP drafter (its hits leave blocks out at
    # the end): kvgate counts no fork sharing then. (No full-attention model in the
    # test data has MTP layers: the setting is put on a tiny model directly.)
    served = tiny_served(num_blocks=512)
    served.deployment = replace(served.deployment, num_speculative_tokens=1,
                                speculative_method="mtp")
    assert CostModel(served).fork_shared_blocks(600, 4, forks_share=True) == 0
    assert CostModel(tiny_served(num_blocks=512)).fork_shared_blocks(
        600, 4, forks_share=True) == 3 * (599 // 16)
