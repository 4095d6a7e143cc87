"""SyncTracker: what a process tells the presence writer about its users' /sync requests."""

from __future__ import annotations

from twisted.internet.task import Clock

from homeserver.handlers.ephemeral.presence import SyncTracker


def tracker() -> tuple[SyncTracker, Clock, list[tuple[str, bool]]]:
    clock, reports = Clock(), []
    return SyncTracker(clock, lambda user, syncing: reports.append((user, syncing)), linger=30), clock, reports


def test_back_to_back_long_polls_are_one_start_and_no_stop() -> None:
    t, clock, reports = tracker()
    for _ in range(5):
        t.begin("@a:x")
        clock.advance(29)  # the long-poll
        t.end("@a:x")
        clock.advance(0.01)  # the client's next request follows at once
    assert reports == [("@a:x", True)]
    clock.advance(30)
    assert reports == [("@a:x", True), ("@a:x", False)]


def test_overlapping_requests_stop_only_after_the_last_one() -> None:
    t, clock, reports = tracker()
    t.begin("@a:x")
    t.begin("@a:x")
    t.end("@a:x")
    clock.advance(60)
    assert reports == [("@a:x", True)]
    t.end("@a:x")
    clock.advance(30)
    assert reports == [("@a:x", True), ("@a:x", False)]
    t.begin("@a:x")
    assert reports[-1] == ("@a:x", True)


def test_stop_returns_the_users_still_syncing_and_fires_nothing_later() -> None:
    t, clock, reports = tracker()
    t.begin("@a:x")
    t.begin("@b:x")
    t.end("@b:x")
    assert t.stop() == ["@a:x", "@b:x"]
    clock.advance(100)
    assert reports == [("@a:x", True), ("@b:x", True)]
