"""The request discipline every sending link shares: one request at a time, answered once;
supervision after crashes; one pending wake-up."""

from __future__ import annotations

import pytest

from federation_sender.link import (
    SUPERVISION_FIRST_DELAY_MS,
    SUPERVISION_MAX_DELAY_MS,
    ProtocolViolation,
    RequestLink,
    ScheduleWake,
    supervision_delay_ms,
)


class Ping:
    pass


class Pong:
    pass


def test_supervision_doubles_per_crash_up_to_the_cap() -> None:
    assert [supervision_delay_ms(n) for n in range(1, 12)] == [
        1000, 2000, 4000, 8000, 16_000, 32_000, 64_000, 128_000, 256_000, 300_000, 300_000]
    assert supervision_delay_ms(1) == SUPERVISION_FIRST_DELAY_MS
    assert supervision_delay_ms(10_000) == SUPERVISION_MAX_DELAY_MS  # no overflow however many


def test_one_request_answered_once_and_crashes_in_a_row() -> None:
    link: RequestLink[object] = RequestLink("x")
    ping = Ping()
    assert link._begin(ping) == [ping] and link.outstanding is ping
    with pytest.raises(ProtocolViolation, match=r"\[x\] got an answer to Pong"):
        link._answer(Pong)
    step, wake = link._crashed(100)
    assert step is ping and link.outstanding is None and wake == [ScheduleWake(1100)]
    assert link._resting(1099) and not link._resting(1100)
    link._begin(ping)
    _, wake = link._crashed(1100)
    assert wake == [ScheduleWake(3100)]  # the second in a row rests twice as long
    link._begin(ping)
    assert link._answer(Ping) is ping  # answered: the next crash is the first in a row again
    link._begin(ping)
    assert link._crashed(5000)[1] == [ScheduleWake(6000)]


def test_a_wake_is_asked_for_once() -> None:
    link: RequestLink[object] = RequestLink("x")
    assert link._schedule_wake(50) == [ScheduleWake(50)]
    assert link._schedule_wake(50) == []
    link._woken(49)
    assert link._schedule_wake(50) == []  # not due yet: still pending
    link._woken(50)
    assert link._schedule_wake(50) == [ScheduleWake(50)]
