"""The ledger with data parallelism: one pool per engine, a request in one pool."""

from __future__ import annotations

from typing import Any

import pytest

from sidecar.admission.ledger import Ledger, LedgerError


def test_a_request_never_spans_the_pools_of_two_engines() -> None:
    ledger = Ledger(100, target_ratio=1.0, engines=2)
    ledger.reserve(60, engine=0)
    ledger.reserve(60, engine=1)
    # 80 blocks are free in all, but no engine has 50.
    assert ledger.headroom_blocks == 40
    assert not ledger.fits(50)
    assert ledger.place(50) is None
    assert ledger.fits(40)
    assert ledger.place(40) == 0


def test_every_engines_pool_is_used() -> None:
    one_pool = Ledger(100, target_ratio=1.0)
    two_pools = Ledger(100, target_ratio=1.0, engines=2)
    admitted_one = admitted_two = 0
    for _ in range(6):
        if one_pool.fits(45):
            one_pool.reserve(45)
            admitted_one += 1
        if two_pools.fits(45):
            two_pools.reserve(45)
            admitted_two += 1
    assert (admitted_one, admitted_two) == (2, 4)
    assert sorted(r.engine for r in two_pools.held()) == [0, 0, 1, 1]
    assert two_pools.snapshot().engine_used_blocks == (90, 90)
    assert two_pools.reserved_blocks == 180


def test_placement_prefers_the_engine_holding_the_prompt_blocks() -> None:
    ledger = Ledger(100, target_ratio=1.0, engines=2)
    ledger.blocks_per_key = 2
    keys = (b"a", b"b", b"c")
    first = ledger.reserve(10, keys=keys, engine=1)
    # Engine 0 has more headroom, but engine 1 already holds the prompt.
    assert ledger.place(10, keys) == 1
    second = ledger.reserve(10, keys=keys)
    assert second.engine == 1
    assert ledger.snapshot().engine_used_blocks == (0, 10 + 10 + 3 * 2)
    # On another engine the same prompt blocks are held (and counted) again.
    third = ledger.reserve(10, keys=keys, engine=0)
    assert ledger.held_prompt_blocks == 2 * 3 * 2
    assert ledger.snapshot().engine_used_blocks == (10 + 6, 26)
    for reservation in (first, second, third):
        assert reservation.release()
    assert ledger.held_prompt_blocks == 0
    assert ledger.snapshot().engine_used_blocks == (0, 0)


def test_a_prompt_the_holding_engine_has_no_room_for_goes_elsewhere() -> None:
    ledger = Ledger(100, target_ratio=1.0, engines=2)
    keys = (b"p", b"q")
    ledger.reserve(90, keys=keys, engine=0)
    # Engine 0 would charge 50 (it holds the prompt): no room; engine 1 charges 52.
    assert ledger.place(50, keys) == 1
    assert ledger.place(99, keys) is None


def test_release_and_resize_settle_on_the_reservations_engine() -> None:
    ledger = Ledger(100, target_ratio=1.0, engines=3)
    reservations = [ledger.reserve(20) for _ in range(3)]
    assert sorted(r.engine for r in reservations) == [0, 1, 2]
    grown = reservations[1]
    grown.resize(70)
    used = list(ledger.snapshot().engine_used_blocks)
    assert used[grown.engine] == 70 and sorted(used) == [20, 20, 70]
    assert grown.release() and not grown.release()
    used = list(ledger.snapshot().engine_used_blocks)
    assert used[grown.engine] == 0
    assert ledger.reserved_blocks == 40


def test_the_observed_use_is_read_per_engine() -> None:
    ledger = Ledger(100, target_ratio=1.0, engines=2)
    ledger.reserve(10, engine=0)
    ledger.observe(used_blocks=50, growth_blocks=20)  # the engines' average
    # Engine 1 holds nothing of kvgate's, but the server says 50 + 20 / 2 are in use.
    assert ledger.snapshot().engine_used_blocks == (60, 60)
    assert ledger.headroom_blocks == 40


def test_one_engine_keeps_the_single_pool_accounting() -> None:
    ledger = Ledger(100, target_ratio=0.9)
    reservation = ledger.reserve(30, keys=(b"k",))
    assert reservation.engine == 0
    snapshot = ledger.snapshot()
    assert snapshot.engine_used_blocks == ()
    assert (snapshot.reserved_blocks, snapshot.headroom_blocks) == (31, 90 - 31)


def test_bad_engines_are_refused() -> None:
    with pytest.raises(ValueError, match="data-parallel size"):
        Ledger(100, engines=0)
    ledger = Ledger(100, engines=2)
    with pytest.raises(LedgerError, match="engine 2"):
        ledger.reserve(1, engine=2)


# ---- the controller with data parallelism --------------------------------------------


def test_the_controller_places_each_request_on_one_engine() -> None:
    import asyncio

    from sidecar.admission import AdmissionRequest, Outcome, Rejected

    from support.admission_fixtures import controller

    async def scenario() -> None:
        # Each engine: 63 usable blocks x 0.95 = 59 blocks of 16 tokens.
        two = controller(num_blocks=64, engines=2)
        big = AdmissionRequest(prompt_tokens=500, max_tokens=300)  # 50 blocks
        first = await two.admit(big)
        second = await two.admit(big)
        # Two such requests fit, one on each engine (one engine's pool holds one).
        assert {first.reservation.engine, second.reservation.engine} == {0, 1}
        assert two.ledger.reserved_blocks == 100
        # A request larger than one engine's pool never fits, whatever both hold.
        with pytest.raises(Rejected) as never:
            await two.admit(AdmissionRequest(prompt_tokens=900, max_tokens=200))
        assert never.value.decision.outcome is Outcome.NEVER_FITS
        first.finish()
        second.finish()
        assert two.ledger.reserved_blocks == 0

    asyncio.run(scenario())


@pytest.mark.pure_python  # a stand-in for Services
def test_the_proxy_pins_the_request_to_its_engine() -> None:
    from types import SimpleNamespace

    from sidecar.server.proxy import _engine_pinned

    def services(engines: int) -> Any:
        return SimpleNamespace(controller=SimpleNamespace(ledger=Ledger(100, engines=engines)))

    ticket: Any = SimpleNamespace(reservation=SimpleNamespace(engine=1))
    client = [("Content-Type", "application/json")]
    assert _engine_pinned(list(client), services(2), ticket) == [
        *client, ("x-data-parallel-rank", "1")]
    assert _engine_pinned(list(client), services(1), ticket) == client
    assert _engine_pinned(list(client), services(2), None) == client


def test_what_kvgate_reserves_or_releases_counts_before_the_next_observation() -> None:
    ledger = Ledger(100, target_ratio=1.0)
    first = ledger.reserve(30)
    second = ledger.reserve(10)
    ledger.observe(used_blocks=35, growth_blocks=15)  # 50 at the peak: 10 held by others
    assert ledger.effective_used_blocks == 50
    second.release()
    assert ledger.effective_used_blocks == 40  # gone now, not at the next observation
    third = ledger.reserve(20)
    assert ledger.effective_used_blocks == 60  # the others' 10 beside kvgate's 50
    assert ledger.headroom_blocks == 40
    ledger.observe(used_blocks=20, growth_blocks=0)  # below the reservations (prefix hits)
    assert ledger.effective_used_blocks == ledger.reserved_blocks == 50
    first.release()
    third.release()
    assert ledger.effective_used_blocks == 0
    ledger.observe(used_blocks=None)
    assert ledger.effective_used_blocks == 0


def test_each_engines_use_follows_its_reservations_between_observations() -> None:
    ledger = Ledger(100, target_ratio=1.0, engines=2)
    held = ledger.reserve(10, engine=0)
    ledger.observe(used_blocks=50, growth_blocks=20)
    assert ledger.snapshot().engine_used_blocks == (60, 60)
    held.release()  # engine 0's 10 were kvgate's: the others' 50 stay until observed again
    assert ledger.snapshot().engine_used_blocks == (50, 60)
    assert ledger.place(45) == 0


@pytest.mark.parametrize(("capacity", "ratio", "target"),
                         [(90, 0.7, 63), (170, 0.7, 119), (100, 0.95, 95), (63, 0.95, 59),
                          (1, 1.0, 1)])
def test_the_target_is_the_ratio_of_the_capacity_rounded_down(capacity: int, ratio: float,
                                                               target: int) -> None:
    # 90 x 0.7 is 62.99... in floating point: the target is still 63 blocks.
    assert Ledger(capacity, ratio).target_blocks == target
