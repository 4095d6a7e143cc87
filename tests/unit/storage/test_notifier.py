"""The notifier with a fake clock: waking, timeouts, cancellation, no work while waiting."""

from __future__ import annotations

from typing import Any

import pytest
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import Clock

from storage.id_generators import PositionTracker, StreamIdGenerator
from storage.notifier import Notifier
from storage.tokens import MultiWriterStreamToken, RoomStreamToken, StreamToken, SyncStreamKey


def result_of(d: Deferred[Any]) -> Any:
    results: list[Any] = []
    d.addBoth(results.append)
    assert results, "the Deferred has not fired"
    return results[0]


class Position:
    """A condition with a counter: how often the notifier looked."""

    def __init__(self) -> None:
        self.value = 0
        self.checks = 0

    def past(self, token: int) -> Any:
        def check() -> bool:
            self.checks += 1
            return self.value > token

        return check


def test_a_waiter_wakes_when_its_stream_passes_its_token() -> None:
    notifier = Notifier(Clock())
    position = Position()
    d = notifier.wait_until(["events"], position.past(5), timeout=30)
    assert not d.called
    position.value = 5
    notifier.notify("events")
    assert not d.called
    position.value = 6
    notifier.notify("typing")  # not followed: not even checked
    checks = position.checks
    assert not d.called and position.checks == checks
    notifier.notify("events")
    assert result_of(d) is True
    assert notifier.waiter_count() == 0


def test_already_satisfied_returns_at_once() -> None:
    notifier = Notifier(Clock())
    assert result_of(notifier.wait_until(["events"], lambda: True, timeout=1)) is True
    assert notifier.waiter_count() == 0


def test_timeout_fires_false_and_removes_the_waiter() -> None:
    clock = Clock()
    notifier = Notifier(clock)
    position = Position()
    d = notifier.wait_until(["events", "typing"], position.past(0), timeout=30)
    assert notifier.waiter_count("events") == 1 and notifier.waiter_count("typing") == 1
    clock.advance(29.9)
    assert not d.called
    clock.advance(0.2)
    assert result_of(d) is False
    assert notifier.waiter_count() == 0
    assert clock.getDelayedCalls() == []


def test_no_work_while_waiting() -> None:
    """Time passing costs nothing: the condition is only checked on notify and at the timeout."""
    clock = Clock()
    notifier = Notifier(clock)
    position = Position()
    d = notifier.wait_until(["events"], position.past(0), timeout=60)
    checks = position.checks
    for _ in range(59):
        clock.advance(1)
    assert position.checks == checks
    assert len(clock.getDelayedCalls()) == 1
    clock.advance(1)
    assert result_of(d) is False


def test_cancelling_removes_the_waiter_and_its_timer() -> None:
    clock = Clock()
    notifier = Notifier(clock)
    d = notifier.wait_until(["events"], lambda: False, timeout=30)
    d.cancel()
    assert isinstance(result_of(d).value, CancelledError)
    assert notifier.waiter_count() == 0
    assert clock.getDelayedCalls() == []


def test_a_failing_condition_fails_only_its_waiter() -> None:
    notifier = Notifier(Clock())
    state = {"boom": False}

    def explosive() -> bool:
        if state["boom"]:
            raise RuntimeError("boom")
        return False

    bad = notifier.wait_until(["events"], explosive, timeout=None)
    position = Position()
    good = notifier.wait_until(["events"], position.past(0), timeout=None)
    state["boom"] = True
    position.value = 1
    notifier.notify("events")
    assert isinstance(result_of(bad).value, RuntimeError)
    assert result_of(good) is True


def test_a_woken_waiter_may_wait_again_during_notify() -> None:
    notifier = Notifier(Clock())
    position = Position()
    second: list[Deferred[bool]] = []
    d = notifier.wait_until(["events"], position.past(0), timeout=None)
    d.addCallback(lambda _: second.append(notifier.wait_until(["events"], position.past(1), timeout=None)))
    position.value = 1
    notifier.notify("events")
    assert second and not second[0].called
    position.value = 2
    notifier.notify("events")
    assert result_of(second[0]) is True


def make_generator(name: str, writers: list[str]) -> StreamIdGenerator:
    tracker = PositionTracker(writers=writers, local_instance=writers[0])
    return StreamIdGenerator(db=None, stream_name=name, sequence="unused", tracker=tracker, persist=False)  # type: ignore[arg-type]


def test_wait_for_position_follows_a_generator() -> None:
    """Completing IDs in the generator's tracker moves its position, which wakes the waiter."""
    clock = Clock()
    notifier = Notifier(clock)
    generator = make_generator("events", ["main"])
    notifier.add_stream(generator)
    d = notifier.wait_for_position("events", 2, timeout=10)
    generator._apply(generator.tracker.finish_reservation(generator.tracker.begin_reservation(), [1, 2]))
    assert not d.called
    generator._apply(generator.tracker.finish_reservation(generator.tracker.begin_reservation(), [3]))
    assert result_of(d) is True
    with pytest.raises(ValueError, match="not followed"):
        notifier.wait_for_position("typing", 0, timeout=1)


def test_wait_for_position_of_one_writer() -> None:
    notifier = Notifier(Clock())
    generator = make_generator("events", ["main", "persister"])
    notifier.add_stream(generator)
    d = notifier.wait_for_position("events", 4, timeout=10, instance="persister")
    generator.advance("persister", 5)
    assert result_of(d) is True


def test_wait_for_sync_token() -> None:
    notifier = Notifier(Clock())
    since = StreamToken(RoomStreamToken(3), typing=MultiWriterStreamToken(1))
    current = {"token": since}
    d = notifier.wait_for_sync_token(since, lambda: current["token"], timeout=30)
    current["token"] = since.advance(SyncStreamKey.RECEIPTS, MultiWriterStreamToken(1))
    notifier.notify("events")  # the condition looks at every stream it covers
    assert result_of(d) is True


def test_a_sync_sleeps_through_events_its_quiet_check_clears_but_not_other_streams() -> None:
    notifier = Notifier(Clock())
    since = StreamToken(RoomStreamToken(3))
    current = {"token": since}
    asked: list[int] = []

    def quiet(upto: int) -> bool:
        asked.append(upto)
        return upto < 6  # positions 4 and 5 hold nothing for this sync; 6 does

    d = notifier.wait_for_sync_token(since, lambda: current["token"], timeout=30, quiet={SyncStreamKey.EVENTS: quiet})
    current["token"] = since.advance(SyncStreamKey.EVENTS, RoomStreamToken(5))
    notifier.notify("events")
    assert not d.called and asked == [5]
    current["token"] = current["token"].advance(SyncStreamKey.TYPING, MultiWriterStreamToken(1))
    notifier.notify("typing")  # another stream moved: the sync looks, whatever the events hold
    assert result_of(d) is True and asked == [5]

    d = notifier.wait_for_sync_token(since, lambda: current["token"], timeout=30, quiet={SyncStreamKey.EVENTS: quiet})
    assert result_of(d) is True  # already ahead in typing: no wait
    current["token"] = StreamToken(RoomStreamToken(6))
    d = notifier.wait_for_sync_token(since, lambda: current["token"], timeout=30, quiet={SyncStreamKey.EVENTS: quiet})
    assert result_of(d) is True and asked == [5, 6]


def test_each_quiet_stream_is_checked_and_any_other_stream_wakes_at_once() -> None:
    notifier = Notifier(Clock())
    since = StreamToken(RoomStreamToken(3))
    current = {"token": since}
    asked: list[str] = []

    def quiet(name: str) -> Any:
        def check(upto: int) -> bool:
            asked.append(name)
            return True
        return check

    checks = {SyncStreamKey.EVENTS: quiet("events"), SyncStreamKey.TYPING: quiet("typing")}
    d = notifier.wait_for_sync_token(since, lambda: current["token"], timeout=30, quiet=checks)
    current["token"] = since.advance(SyncStreamKey.EVENTS, RoomStreamToken(4)).advance(
        SyncStreamKey.TYPING, MultiWriterStreamToken(2))
    notifier.notify("typing")
    assert not d.called and sorted(asked) == ["events", "typing"]
    current["token"] = current["token"].advance(SyncStreamKey.RECEIPTS, MultiWriterStreamToken(1))
    asked.clear()
    notifier.notify("receipts")
    assert result_of(d) is True and asked == []  # receipts have no check here: no other check runs


class Positions:
    """A handler's ``current_token``: a bound method, so each access is a new object."""

    def __init__(self, token: StreamToken) -> None:
        self.token = token
        self.reads = 0

    def current_token(self) -> StreamToken:
        self.reads += 1
        return self.token


def test_the_sync_waiters_of_one_notify_read_the_positions_once() -> None:
    notifier = Notifier(Clock())
    since = StreamToken(RoomStreamToken(3))
    positions = Positions(since)
    waiting = [notifier.wait_for_sync_token(since, positions.current_token, timeout=30, quiet={SyncStreamKey.EVENTS: lambda _: True})
               for _ in range(50)]
    assert positions.reads == 50  # each new waiter's first look reads afresh
    positions.token = since.advance(SyncStreamKey.EVENTS, RoomStreamToken(4))
    notifier.notify("events")
    assert positions.reads == 51 and not any(d.called for d in waiting)  # quiet: all sleep on
    positions.token = positions.token.advance(SyncStreamKey.TYPING, MultiWriterStreamToken(1))
    notifier.notify("typing")
    assert positions.reads == 52 and all(result_of(d) is True for d in waiting)


def test_shut_down_answers_every_waiter_now_and_every_later_wait_at_once() -> None:
    """Stopping the process: long-polls must not hold the shutdown until their timeouts."""
    clock = Clock()
    notifier = Notifier(clock)
    position = Position()
    waiting = [notifier.wait_until(["events"], position.past(0), timeout=30),
               notifier.wait_until(["typing"], position.past(0), timeout=None)]
    notifier.shut_down()
    assert [result_of(d) for d in waiting] == [False, False]
    assert notifier.waiter_count() == 0 and clock.getDelayedCalls() == []
    assert result_of(notifier.wait_until(["events"], position.past(0), timeout=30)) is False
    assert clock.getDelayedCalls() == []
    position.value = 1
    assert result_of(notifier.wait_until(["events"], position.past(0), timeout=30)) is True
