"""The service link's decisions, driven by hand: what it reads, records and sends, what a
failure and a restart do. Time is an argument; the jitter is fixed."""

from __future__ import annotations

from typing import Any

import pytest

from federation_sender.backoff import HEALTHY, BackoffPolicy, RetryState
from federation_sender.link import ProtocolViolation, ScheduleWake
from homeserver.appservice.core import (
    Advance,
    Failed,
    Pending,
    PersistRetry,
    ReadEvents,
    RecordTransaction,
    Recovered,
    SendTransaction,
    Sent,
    ServiceLink,
    Transaction,
)

POLICY = BackoffPolicy(initial=1000, multiplier=2, maximum=8000)


def link(**kw: Any) -> ServiceLink:
    options: dict[str, Any] = dict(position=10, last_txn_id=4, pending=None, retry=HEALTHY, policy=POLICY,
                                   jitter=lambda low, high: 1.0, max_events=3)
    options.update(kw)
    return ServiceLink("irc", **options)


def event(n: int) -> dict[str, Any]:
    return {"event_id": f"$e{n}", "type": "m.room.message"}


def only(actions: list[Any], kind: type) -> Any:
    found = [a for a in actions if isinstance(a, kind)]
    assert len(found) == 1, actions
    return found[0]


def test_events_are_read_recorded_sent_then_the_position_advances() -> None:
    """Start-up reads above the stored position; the events it wants are recorded under the
    next transaction ID before being sent; acceptance stores the position the read covered."""
    ln = link()
    read = only(ln.on_wake(0), ReadEvents)
    assert read == ReadEvents(after=10, upto=None, limit=3)
    assert ln.on_wake(0) == []  # one request at a time
    record = only(ln.on_events_read([event(11), event(13)], covered=13, more=False, now_ms=0), RecordTransaction)
    assert record.txn == Transaction(5, (event(11), event(13)), upto=13)
    send = only(ln.on_recorded(0), SendTransaction)
    assert send.txn is record.txn
    actions = ln.on_sent(0)
    assert only(actions, Sent).txn is record.txn
    assert only(actions, Advance) == Advance(13, clear_retry=False)
    assert ln.on_advanced(0) == []  # nothing more: the read did not stop at its limit
    assert ln.position == 13
    # Nothing of interest: the position moves without a transaction.
    only(ln.on_new_events(0), ReadEvents)
    assert only(ln.on_events_read([], covered=20, more=True, now_ms=0), Advance) == Advance(20, clear_retry=False)
    assert only(ln.on_advanced(0), ReadEvents) == ReadEvents(after=20, upto=None, limit=3)  # it stopped at the limit


def test_a_failure_backs_off_and_resends_the_same_transaction() -> None:
    ln = link()
    ln.on_wake(0)
    ln.on_events_read([event(11)], covered=11, more=False, now_ms=0)
    txn = only(ln.on_recorded(0), SendTransaction).txn
    failed = ln.on_send_failed(None, "connection refused", 100)
    assert only(failed, Failed).retry == RetryState(100, 1000, 100)
    assert only(failed, PersistRetry).retry.retry_interval == 1000
    assert ln.on_retry_persisted(100) == [ScheduleWake(1100)]
    assert ln.on_new_events(500) == []  # backing off: the wake is already set
    resend = only(ln.on_wake(1100), SendTransaction)
    assert resend.txn == txn  # same ID, same events
    failed = ln.on_send_failed(503, "HTTP 503", 1200)
    assert only(failed, Failed).retry.retry_interval == 2000
    ln.on_retry_persisted(1200)
    assert only(ln.on_wake(3200), SendTransaction).txn == txn
    actions = ln.on_sent(3300)
    assert [type(a) for a in actions] == [Sent, Recovered, Advance]
    assert only(actions, Advance).clear_retry  # the advance clears the stored backoff
    assert ln.retry.healthy
    # New events came while it backed off: read now.
    assert only(ln.on_advanced(3300), ReadEvents).after == 11


def test_a_restart_with_a_recorded_transaction_resends_exactly_it() -> None:
    """The row says transaction 7 covering up to 15 was recorded, maybe sent: its events are
    read again up to 15 only and resent as transaction 7; then reading goes on above 15."""
    ln = link(pending=Pending(7, 15), last_txn_id=7)
    assert only(ln.on_wake(0), ReadEvents) == ReadEvents(after=10, upto=15, limit=3)
    send = only(ln.on_events_read([event(12)], covered=15, more=False, now_ms=0), SendTransaction)
    assert send.txn == Transaction(7, (event(12),), upto=15)
    assert only(ln.on_sent(0), Advance).upto == 15
    assert only(ln.on_advanced(0), ReadEvents) == ReadEvents(after=15, upto=None, limit=3)
    only(ln.on_events_read([event(16)], covered=16, more=False, now_ms=0), RecordTransaction)
    assert only(ln.on_recorded(0), SendTransaction).txn.txn_id == 8


def test_ephemeral_events_ride_along_or_go_alone() -> None:
    ln = link()
    ln.on_wake(0)
    ln.on_events_read([], covered=10, more=False, now_ms=0)  # nothing new
    record = only(ln.on_ephemeral([{"type": "m.typing"}], 0), RecordTransaction)
    assert record.txn == Transaction(5, (), ({"type": "m.typing"},), upto=None)
    assert record.txn.body() == {"events": [], "ephemeral": [{"type": "m.typing"}],
                                 "de.sorunome.msc2409.ephemeral": [{"type": "m.typing"}]}
    ln.on_recorded(0)
    assert only(ln.on_sent(0), Advance) == Advance(None, clear_retry=False)
    ln.on_advanced(0)
    assert ln.on_to_device(0) == [], "a service that takes no to-device messages reads none"


MESSAGE = {"type": "m.test", "to_user_id": "@irc_a:hs", "to_device_id": "D"}


def test_to_device_messages_are_read_above_the_service_s_position_and_move_it_once_accepted() -> None:
    ln = link(to_device_position=100)
    read = only(ln.on_wake(0), ReadEvents)
    assert read == ReadEvents(after=10, upto=None, limit=3, to_device_after=100), "start-up reads both"
    assert ln.on_events_read([], covered=10, more=False, now_ms=0, to_device=[], to_device_covered=100) == []
    read = only(ln.on_to_device(0), ReadEvents)
    assert read == ReadEvents(after=10, upto=10, limit=3, to_device_after=100), "no event read it needs"
    record = only(ln.on_events_read([], covered=10, more=False, now_ms=0, to_device=[MESSAGE],
                                    to_device_covered=104), RecordTransaction)
    assert record.txn == Transaction(5, (), to_device=(MESSAGE,), upto=None, to_device_upto=104)
    assert record.txn.body() == {"events": [], "de.sorunome.msc2409.to_device": [MESSAGE]}
    send = only(ln.on_recorded(0), SendTransaction)
    assert only(ln.on_send_failed(None, "down", 10), Failed)
    ln.on_retry_persisted(10)
    assert ln.on_wake(1010) == [send], "resent as it was"
    assert only(ln.on_sent(1020), Advance) == Advance(None, clear_retry=True, to_device_upto=104)
    ln.on_advanced(1020)
    assert ln.to_device_position == 104
    # Messages not for the service's users move the position without a transaction.
    only(ln.on_to_device(1030), ReadEvents)
    assert only(ln.on_events_read([], covered=10, more=False, now_ms=1030, to_device=[], to_device_covered=110),
                Advance) == Advance(None, clear_retry=False, to_device_upto=110)


def test_a_restart_with_recorded_to_device_messages_rereads_and_resends_exactly_them() -> None:
    ln = link(to_device_position=100, pending=Pending(7, None, 104), last_txn_id=7)
    assert only(ln.on_wake(0), ReadEvents) == ReadEvents(after=10, upto=10, limit=3, to_device_after=100,
                                                         to_device_upto=104)
    send = only(ln.on_events_read([], covered=10, more=False, now_ms=0, to_device=[MESSAGE], to_device_covered=104),
                SendTransaction)
    assert send.txn == Transaction(7, (), to_device=(MESSAGE,), upto=None, to_device_upto=104)
    assert only(ln.on_sent(0), Advance).to_device_upto == 104
    assert only(ln.on_advanced(0), ReadEvents) == ReadEvents(after=10, upto=None, limit=3, to_device_after=104)


def test_crashes_rest_then_redo_and_wrong_answers_are_bugs() -> None:
    ln = link()
    ln.on_wake(0)
    with pytest.raises(ProtocolViolation):
        ln.on_sent(0)
    assert ln.on_crashed(0) == [ScheduleWake(1000)]
    assert ln.on_wake(500) == []
    assert only(ln.on_wake(1000), ReadEvents).after == 10
    ln.on_events_read([event(11)], covered=11, more=False, now_ms=1000)
    assert ln.on_crashed(1000) == [ScheduleWake(2000)]  # a request was answered between: not in a row
    record = only(ln.on_wake(2000), RecordTransaction)  # the record is redone
    assert ln.on_crashed(2000) == [ScheduleWake(4000)]  # crashed again in a row: twice as long
    assert only(ln.on_wake(4000), RecordTransaction) == record
