"""Requests kvgate saw finish, as a scrape sent before they finished may still count them."""

from __future__ import annotations

from sidecar.admission.finished import KEEP_S, RecentlyFinished


def test_only_requests_finished_after_the_scrape_was_sent_count() -> None:
    finished = RecentlyFinished()
    finished.add(1.0, 5)
    finished.add(2.0, 7)
    finished.add(3.0, 11)
    assert finished.since(2.0, now=3.5) == [18]
    # Those before it are forgotten: later scrapes are sent later.
    assert len(finished) == 2
    assert finished.since(None, now=3.5) == [0]  # not known when it was sent: none


def test_at_most_the_latest_the_server_still_counts() -> None:
    finished = RecentlyFinished()
    for at_s, blocks in ((1.0, 5), (2.0, 7), (3.0, 11)):
        finished.add(at_s, blocks)
    # The server reported 2 requests more than kvgate runs: the 2 latest.
    assert finished.since(0.5, now=4.0, count=2) == [18]
    assert finished.since(0.5, now=4.0, count=0) == [0]
    assert finished.since(0.5, now=4.0, count=9) == [23]


def test_blocks_are_counted_per_engine_and_kept_for_a_bounded_time() -> None:
    finished = RecentlyFinished(engines=2)
    finished.add(1.0, 5, engine=0)
    finished.add(1.5, 7, engine=1)
    finished.add(1.6, 0, engine=1)  # held nothing: not kept
    assert finished.since(0.0, now=2.0) == [5, 7]
    finished.add(1.0 + KEEP_S + 1, 3, engine=1)  # no scrape for long: the old ones go
    assert len(finished) == 1
    assert finished.since(0.0, now=1.0 + KEEP_S + 1) == [0, 3]
