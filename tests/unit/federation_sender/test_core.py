"""One destination's core against a fake world: numbers for time, dicts for the store, the test as transport."""

from __future__ import annotations

from datetime import timedelta

import attrs

from federation_sender.backoff import HEALTHY, RetryState
from federation_sender.config import CatchUpConfig
from federation_sender.core import (
    Accepted,
    BackingOff,
    BackoffCleared,
    BeginCatchUp,
    CaughtUp,
    EndCatchUp,
    EnteredCatchUp,
    PersistPosition,
    PersistRetry,
    ReadCatchUpRooms,
    ReadDeviceLists,
    ReadOutbox,
    Refusal,
    ResendingAfterContact,
    SendTransaction,
    TransactionRejected,
    pdu_errors,
    refusal_reason,
)
from federation_sender.queue import Edu, PlannedTransaction
from tests.unit.federation_sender.world import CONFIG, HOUR, MINUTE, World, pdu


def ids(txn: PlannedTransaction | None) -> list[str]:
    assert txn is not None
    return [p.event_id for p in txn.pdus]


def test_one_transaction_in_flight_of_at_most_50_pdus_and_100_edus() -> None:
    """120 PDUs and 150 EDUs arrive at once: the first transaction takes 50 and 100; nothing else
    goes out until it is answered; then the rest follow in order, 50, 20 PDUs."""
    w = World()
    w.new_event()
    assert ids(w.settle()) == ["$e1"], "an idle link sends at once"
    for n in range(150):
        w.feed(w.dest.on_edu(Edu("m.device_list_update", {"n": n}), w.now_ms))
    w.feed(w.dest.on_pdus([w.write("!r") for _ in range(120)], w.now_ms))
    assert len(w.attempts) == 1, "a second transaction while the first is in flight"
    w.answer()
    second = w.settle()
    assert second is not None and len(second.pdus) == 50 and len(second.edus) == 100
    assert ids(second) == [f"$e{n}" for n in range(2, 52)]
    assert [e.content["n"] for e in second.edus] == list(range(100))
    w.answer()
    third = w.settle()
    assert ids(third) == [f"$e{n}" for n in range(52, 102)]
    assert third is not None and len(third.edus) == 50
    w.answer()
    assert ids(w.settle()) == [f"$e{n}" for n in range(102, 122)]
    w.answer()
    assert w.settle() is None and w.row.last_successful == 121
    assert w.dest.is_idle()


def test_the_position_moves_only_after_the_answer_and_only_to_the_transaction_s_newest() -> None:
    w = World()
    w.feed(w.dest.on_pdus([w.write("!r"), w.write("!s")], w.now_ms))
    txn = w.settle()
    assert txn is not None and txn.advance_to == 2
    assert w.row.last_successful is None, "nothing is written before the destination answers"
    w.answer()
    assert isinstance(w.request, PersistPosition) and w.request.advance_to == 2
    assert w.row.last_successful is None
    w.step()
    assert w.row.last_successful == 2 and w.dest.acked_position == 2


def test_a_failed_transaction_backs_off_and_is_resent_with_the_same_id_once_the_interval_passed() -> None:
    """500: the backoff (10 minutes) is persisted, the core asks to be woken then, and nothing goes
    out before; at the wake-up the very same transaction (same ID, same PDUs) is resent, new
    PDUs waiting behind it; the success after it clears the stored backoff with the position."""
    w = World()
    w.new_event()
    txn = w.settle()
    w.now_ms = 1_000
    w.answer(500)
    assert [n.retry.retry_interval for n in w.notices_of(BackingOff)] == [10 * MINUTE]
    assert isinstance(w.request, PersistRetry)
    w.step()
    assert w.row.retry == RetryState(1_000, 10 * MINUTE, 1_000)
    assert w.wakes == [1_000 + 10 * MINUTE]
    w.new_event()
    w.advance_time(1_000 + 10 * MINUTE - 1)
    assert w.request is None
    w.advance_time(1_000 + 10 * MINUTE)
    resent = w.settle()
    assert resent == txn, "the retry is the same transaction, with its ID"
    w.answer()
    assert isinstance(w.request, PersistPosition) and w.request.clear_retry
    assert ids(w.settle()) == ["$e2"]
    assert w.row.retry == HEALTHY


def test_backoff_doubles_per_failure_up_to_the_maximum() -> None:
    config = attrs.evolve(CONFIG, catch_up=CatchUpConfig(threshold=timedelta(days=30)))
    w = World(config)
    w.new_event()
    w.settle()
    intervals = []
    for _ in range(12):
        w.answer(None)
        w.settle()
        intervals.append(w.row.retry.retry_interval)
        w.advance_time(w.row.retry.retry_at)
        w.settle()
    assert intervals[:4] == [10 * MINUTE, 20 * MINUTE, 40 * MINUTE, 80 * MINUTE]
    assert intervals[-1] == 7 * 24 * HOUR
    assert w.row.retry.failure_ts == 0, "failure_ts stays the first failure of the run"


def test_a_4xx_about_the_request_is_not_retried_and_its_pdus_count_as_refused() -> None:
    w = World()
    w.new_event()
    w.settle()
    w.answer(400)
    rejected = w.notices_of(TransactionRejected)
    assert len(rejected) == 1 and rejected[0].pdus == 1
    w.settle()
    assert w.refusals == [Refusal("$e1", "answered 400", "transaction_rejected")]
    assert w.row.retry == HEALTHY and w.row.last_successful == 1
    w.new_event()
    assert ids(w.settle()) == ["$e2"], "the next event goes out at once"


def test_pdus_the_destination_refuses_are_logged_by_reason_not_dropped_silently() -> None:
    w = World()
    w.feed(w.dest.on_pdus([w.write("!r"), w.write("!s")], w.now_ms))
    w.settle()
    w.answer(200, errors=[("$e1", "Event not allowed by auth rules"), ("$e2", "signature check failed")])
    assert isinstance(w.request, PersistPosition)
    assert [(r.event_id, r.reason) for r in w.request.refusals] == [("$e1", "forbidden"), ("$e2", "signature")]
    w.settle()
    assert w.row.last_successful == 2


def test_pdu_errors_and_their_reasons() -> None:
    answer = {"pdus": {"$a": {}, "$b": {"error": "Invalid event: malformed JSON"}, "$c": {"error": "boom"}}}
    assert pdu_errors(answer) == [("$b", "Invalid event: malformed JSON"), ("$c", "boom")]
    assert pdu_errors(None) == [] and pdu_errors({"pdus": []}) == []
    assert refusal_reason("Invalid event: malformed JSON") == "format"
    assert refusal_reason("boom") == "other"


def test_backoff_past_the_threshold_drops_the_queue_and_catches_up_oldest_first_per_room() -> None:
    """Four failures in a row take the interval past an hour: the waiting PDUs are dropped and the
    destination catches up from destination_rooms. When it answers again, each room's missed
    events go out oldest first, the position moves only after each 200, and catch-up ends."""
    w = World()
    for n in range(6):
        w.new_event(f"!room{n % 2}")
    w.settle()
    while True:
        w.answer(503)
        w.settle()
        if w.notices_of(EnteredCatchUp):
            break
        w.advance_time(w.row.retry.retry_at)
        w.settle()
    entered = w.notices_of(EnteredCatchUp)[0]
    assert entered == EnteredCatchUp("backoff", 6)
    assert w.row.retry.retry_interval == 80 * MINUTE and w.dest.catching_up and w.dest.pending_pdus == 0
    w.new_event("!room0")  # not queued: catch-up will find it
    assert w.dest.pending_pdus == 0 and w.request is None
    w.advance_time(w.row.retry.retry_at)
    assert isinstance(w.request, BeginCatchUp)
    txn = w.settle()
    assert txn is not None and txn.catch_up and txn.txn_id not in {t.txn_id for t in w.attempts[:-1]}
    by_room: dict[str, list[int]] = {}
    for p in txn.pdus:
        by_room.setdefault(p.room_id, []).append(p.stream_ordering or 0)
    assert by_room == {"!room1": [2, 4, 6], "!room0": [1, 3, 5, 7]}
    assert w.row.last_successful is None and w.row.catch_up_from == 0
    w.answer()
    w.settle()
    assert isinstance(w.notices[-1], CaughtUp) and not w.dest.catching_up
    assert w.row.last_successful == 7 and w.row.catch_up_from is None and w.row.retry == HEALTHY
    assert w.unanswered() == []


def test_a_failed_catch_up_transaction_does_not_move_the_position() -> None:
    config = attrs.evolve(CONFIG, max_pdus_per_transaction=2)
    w = World(config)
    w.restart()
    for room in ("!a", "!b", "!c"):
        w.write(room)
    w.restart()
    w.wake_queued()
    first = w.settle()
    assert ids(first) == ["$e1", "$e2"]
    w.answer()
    w.settle()
    assert w.row.last_successful == 2, "the rooms the first transaction finished"
    w.answer(500)
    w.settle()
    assert w.row.last_successful == 2
    w.advance_time(w.row.retry.retry_at)
    assert ids(w.settle()) == ["$e3"]
    w.answer()
    w.settle()
    assert w.row.last_successful == 3 and not w.dest.catching_up


def test_restart_resumes_from_the_persisted_position_and_backoff() -> None:
    """The sender is killed with a transaction in flight. Restarted, it knows only the
    destinations row: it keeps the stored backoff, then catches up from the last acknowledged
    position and sends every event the destination has not answered for."""
    w = World()
    w.new_event("!a")
    w.settle()
    w.answer()
    w.settle()
    w.new_event("!a")
    w.new_event("!b")
    w.settle()
    w.answer(None)
    w.settle()
    w.new_event("!b")  # queued behind the retained transaction
    w.advance_time(w.row.retry.retry_at)
    w.settle()
    w.answer(None)  # failed again: 20 minutes now
    w.settle()
    retry_at = w.row.retry.retry_at
    w.restart()
    assert w.dest.retry == w.row.retry and w.dest.catching_up
    assert w.request is None and w.wakes == [retry_at], "the stored backoff is honoured"
    w.new_event("!c")
    assert w.request is None, "no queue while the restored backoff runs: left to catch-up"
    w.advance_time(retry_at)
    w.settle()
    w.answer()
    w.settle()
    assert w.unanswered() == [] and w.row.last_successful == 5 and not w.dest.catching_up


def test_a_pdu_arriving_while_the_end_of_catch_up_is_written_is_not_lost() -> None:
    w = World()
    w.write("!a")
    w.restart()
    w.wake_queued()
    w.settle()
    w.answer()
    while not isinstance(w.request, EndCatchUp):
        w.step()
    w.new_event("!a")  # skipped by the queue: catch-up is still on
    w.step()
    assert w.dest.catching_up and not w.notices_of(CaughtUp)
    assert ids(w.settle()) == ["$e2"]
    w.answer()
    w.settle()
    assert w.notices_of(CaughtUp) and w.unanswered() == []


def test_catch_up_waits_for_the_stream_position_instead_of_polling() -> None:
    """A room's newest event is persisted but the stream's position has not passed it (an older
    event of another room is still being written): catch-up must not end (it would skip that
    older event). It asks to be woken when the position moves, and meanwhile sends nothing."""
    w = World()
    w.write("!a")
    w.restart()
    w.wake_queued()
    w.settle()
    w.answer()
    w.settle()
    w.write("!b", advance_position=False)
    w.write("!c", advance_position=False)
    w.feed(w.dest.on_catch_up_found(w.now_ms, startup=True))
    w.wake_queued()
    w.settle()
    assert w.request is None and w.awaiting_position == 1 and w.dest.catching_up
    w.advance_position(3)
    assert ids(w.settle()) == ["$e2", "$e3"]
    w.answer()
    w.settle()
    assert not w.dest.catching_up and w.unanswered() == []


def test_to_device_messages_are_not_held_back_by_catch_up() -> None:
    config = attrs.evolve(CONFIG, max_pdus_per_transaction=1)
    w = World(config)
    for room in ("!a", "!b", "!c"):
        w.write(room)
    w.restart()
    w.to_device({"ping": 1})
    w.wake_queued()
    first = w.settle()
    assert first is not None and first.catch_up
    assert [e.edu_type for e in first.edus] == ["m.direct_to_device"] and first.to_device_upto == 1
    w.answer()
    w.settle()
    assert w.outbox == []


def test_an_outbox_wake_up_reads_the_outbox_and_sends_at_once() -> None:
    w = World()
    w.to_device({"n": 1})
    assert w.request == ReadOutbox(100)
    txn = w.settle()
    assert txn is not None and txn.edus[0].content == {"n": 1}
    w.to_device({"n": 2})
    assert len(w.attempts) == 1 and isinstance(w.request, SendTransaction), "nothing else while one is in flight"
    w.answer()
    w.step()
    assert [m.content for m in w.outbox] == [{"n": 2}]
    txn2 = w.settle()
    assert txn2 is not None and [e.content for e in txn2.edus] == [{"n": 2}]
    w.answer()
    w.settle()
    assert w.outbox == [] and w.dest.is_idle()


def test_a_server_that_contacts_us_clears_its_backoff_and_gets_what_waits() -> None:
    w = World()
    w.new_event()
    w.settle()
    w.answer(500)
    w.settle()
    assert not w.dest.retry.healthy
    w.now_ms = 5_000
    w.feed(w.dest.on_remote_up(w.now_ms))
    assert w.notices_of(BackoffCleared)
    assert w.request == PersistRetry(HEALTHY)
    assert ids(w.settle()) == ["$e1"]
    assert w.row.retry == HEALTHY


def test_a_contact_while_a_retry_is_out_resends_at_once_when_that_retry_fails() -> None:
    """The retry left before the server came back, and its 500 arrives after the server said it
    is up: waiting out a fresh backoff would leave a server that is up waiting ten minutes."""
    w = World()
    w.new_event()
    w.settle()
    w.answer(500)
    w.settle()
    w.advance_time(w.dest.retry.retry_at)
    retry = w.settle()
    assert ids(retry) == ["$e1"] and isinstance(w.request, SendTransaction)
    w.feed(w.dest.on_remote_up(w.now_ms))
    assert w.notices_of(BackoffCleared)
    w.answer(500)
    assert w.notices_of(ResendingAfterContact)
    w.settle()
    assert w.dest.retry == HEALTHY and w.wakes[-1:] != [w.now_ms + 10 * MINUTE]
    resent = w.settle()
    assert resent is not None and resent.txn_id == retry.txn_id, "the same transaction, at once"
    w.answer(500)
    w.settle()
    assert not w.dest.retry.healthy, "a second failure backs off as usual"
    assert len(w.notices_of(ResendingAfterContact)) == 1


def test_a_healthy_server_that_contacts_us_is_not_resent_to_in_a_loop() -> None:
    w = World()
    w.new_event()
    w.settle()
    w.feed(w.dest.on_remote_up(w.now_ms))
    w.answer(500)
    w.settle()
    assert not w.notices_of(ResendingAfterContact) and not w.dest.retry.healthy


def test_a_restored_backoff_means_no_queue_until_it_ends() -> None:
    w = World()
    w.row.retry = RetryState(0, HOUR, 0)
    w.restart()
    w.new_event()
    w.feed(w.dest.on_edu(Edu("m.typing", {}), w.now_ms))
    assert w.dest.pending_pdus == 0 and w.dest.pending_edus == 0
    assert w.notices_of(EnteredCatchUp) == [EnteredCatchUp("missed")]
    assert w.wakes == [HOUR]
    w.advance_time(HOUR)
    w.settle()
    w.answer()
    w.settle()
    assert w.unanswered() == [] and w.row.retry == HEALTHY


def test_a_crash_resends_the_same_transaction_after_a_growing_pause() -> None:
    w = World()
    w.new_event()
    txn = w.settle()
    w.crash_request()
    assert w.wakes == [1_000]
    w.advance_time(1_000)
    assert w.settle() == txn
    w.crash_request()
    assert w.wakes == [3_000], "two seconds after the second crash in a row"
    w.advance_time(3_000)
    w.settle()
    w.answer()
    w.crash_request()  # writing the position failed: it is written again, not forgotten
    w.advance_time(4_000)
    assert isinstance(w.request, PersistPosition)
    w.settle()
    assert w.row.last_successful == 1 and w.dest.is_idle()


def test_startup_catch_up_goes_through_the_rate_limited_wake_up() -> None:
    w = World()
    w.write("!a")
    w.restart()
    assert w.dest.catching_up and w.queued_wakes == 1 and w.request is None
    assert w.notices_of(EnteredCatchUp) == [EnteredCatchUp("startup")]
    w.wake_queued()
    assert isinstance(w.request, BeginCatchUp)
    w.step()
    assert w.request == ReadCatchUpRooms(0, 50)


def test_accepted_transactions_are_announced_for_metrics() -> None:
    w = World()
    w.new_event()
    txn = w.settle()
    w.answer()
    assert txn is not None and w.notices_of(Accepted) == [Accepted(txn)]
    assert txn.pdus == (pdu(1, "!r"),)


# --- device-list updates: read from the device_lists stream, acknowledged like PDUs --------------


def device_users(txn: PlannedTransaction | None) -> list[tuple[str, int]]:
    assert txn is not None
    return [(e.content["user_id"], e.content["stream_id"]) for e in txn.edus if e.edu_type == "m.device_list_update"]


def test_a_device_change_is_read_sent_and_acknowledged_only_after_the_answer() -> None:
    w = World()
    w.device_change("@a:x")
    assert w.request == ReadDeviceLists(100)
    txn = w.settle()
    assert device_users(txn) == [("@a:x", 1)] and txn is not None and txn.device_lists_upto == 1
    w.device_change("@a:x")
    assert isinstance(w.request, SendTransaction), "nothing else while one is in flight"
    assert w.row.device_lists_position == 0
    w.answer()
    assert isinstance(w.request, PersistPosition) and w.request.device_lists_upto == 1
    assert device_users(w.settle()) == [("@a:x", 2)]
    assert w.row.device_lists_position == 1
    w.answer()
    assert w.settle() is None and w.row.device_lists_position == 2 and w.dest.is_idle()


def test_a_device_change_while_backing_off_with_no_queue_is_sent_when_the_backoff_ends() -> None:
    """The backoff was restored from the database and nothing was queued: a typing EDU is dropped,
    but the device change waits (as a flag, in the database) and goes out once it ends."""
    w = World()
    w.row.retry = RetryState(0, 10 * MINUTE, 0)
    w.restart()
    w.feed(w.dest.on_edu(Edu("m.typing", {"t": 1}), w.now_ms))
    w.device_change("@a:x")
    w.device_change("@b:x")
    w.device_change("@a:x")
    assert w.request is None and w.wakes == [10 * MINUTE]
    w.advance_time(10 * MINUTE)
    txn = w.settle()
    assert device_users(txn) == [("@b:x", 2), ("@a:x", 3)], "the newest change per user, in stream order"
    assert txn is not None and [e.edu_type for e in txn.edus] == ["m.device_list_update"] * 2
    w.answer()
    w.settle()
    assert w.row.device_lists_position == 3


def test_device_changes_survive_a_long_outage_and_its_catch_up() -> None:
    """The transaction carrying a change fails until the destination is caught up: entering catch-up
    drops the retained transaction but not the change, which is read again and sent afterwards."""
    w = World()
    w.device_change("@a:x")
    w.new_event()
    first = w.settle()
    assert device_users(first) == [("@a:x", 1)]
    w.answer(None)
    w.settle()
    for _ in range(4):  # 10, 20, 40, 80 minutes: past the one-hour threshold
        w.advance_time(w.row.retry.retry_at)
        w.settle()
        w.answer(None)
        w.settle()
    assert w.notices_of(EnteredCatchUp) and w.row.device_lists_position == 0
    w.device_change("@b:x")
    w.advance_time(w.row.retry.retry_at)
    sent: list[tuple[str, int]] = []
    while (txn := w.settle()) is not None:
        sent += device_users(txn)
        w.answer()
    assert sorted(sent) == [("@a:x", 1), ("@b:x", 2)]
    assert w.row.device_lists_position == 2 and not w.dest.catching_up


def test_a_device_change_not_yet_acknowledged_is_sent_after_a_restart() -> None:
    w = World()
    w.device_change("@a:x")
    w.settle()
    w.restart()  # killed with the transaction in flight
    assert w.queued_wakes == 1
    w.wake_queued()
    assert device_users(w.settle()) == [("@a:x", 1)]
    w.answer()
    w.settle()
    assert w.row.device_lists_position == 1
    w.restart()
    assert w.queued_wakes == 0, "nothing left to send"


def test_a_failed_read_of_the_device_lists_is_tried_again() -> None:
    w = World()
    w.device_change("@a:x")
    assert isinstance(w.request, ReadDeviceLists)
    w.crash_request()
    assert w.request is None
    w.advance_time(w.wakes[-1])
    assert device_users(w.settle()) == [("@a:x", 1)]


def test_more_device_changes_than_a_transaction_holds_go_out_in_several() -> None:
    w = World(attrs.evolve(CONFIG, max_edus_per_transaction=2))
    for n in range(5):
        w.device_change(f"@u{n}:x")
    sent = []
    while (txn := w.settle()) is not None:
        assert len(txn.edus) <= 2
        sent.append(device_users(txn))
        w.answer()
    assert sent == [[("@u0:x", 1), ("@u1:x", 2)], [("@u2:x", 3), ("@u3:x", 4)], [("@u4:x", 5)]]
    assert w.row.device_lists_position == 5
