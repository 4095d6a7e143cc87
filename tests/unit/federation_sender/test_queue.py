"""One destination's queue: batching, keyed EDUs, retries with the same transaction, and the drop to catch-up."""

from __future__ import annotations

from federation_sender.backoff import policy_from_config
from federation_sender.queue import Added, Edu, PendingPdu, PerDestinationQueue, PlannedTransaction, encode_pdu
from federation_sender.config import BackoffConfig

POLICY = policy_from_config(BackoffConfig())
HOUR = 3_600_000


def pdu(n: int, room: str = "!r:a") -> PendingPdu:
    return PendingPdu(f"$e{n}", room, n, encode_pdu({"event_id": f"$e{n}"}), float(n))


def txn(q: PerDestinationQueue, **kwargs: object) -> PlannedTransaction:
    return PlannedTransaction("t1", tuple(q.take_pdus(50)), tuple(q.take_edus(100)), **kwargs)  # type: ignore[arg-type]


def fail(q: PerDestinationQueue, t: PlannedTransaction, now: int, *, unhealthy: bool = True):  # type: ignore[no-untyped-def]
    return q.on_failure(t, now_ms=now, unhealthy=unhealthy, policy=POLICY, jitter=lambda a, b: 1.0,
                        catch_up_threshold_ms=HOUR)


def test_takes_in_order_and_at_most_the_limit() -> None:
    q = PerDestinationQueue("b")
    for n in range(120):
        assert q.add_pdu(pdu(n)) is Added.QUEUED
    first = q.take_pdus(50)
    assert [p.stream_ordering for p in first] == list(range(50))
    assert len(q.take_pdus(50)) == 50 and len(q.take_pdus(50)) == 20
    assert q.take_pdus(50) == []


def test_keyed_edus_keep_only_the_newest() -> None:
    q = PerDestinationQueue("b")
    q.add_edu(Edu("m.typing", {"typing": True}, key=("m.typing", "!r", "@u")))
    q.add_edu(Edu("m.device_list_update", {"n": 1}))
    q.add_edu(Edu("m.typing", {"typing": False}, key=("m.typing", "!r", "@u")))
    assert q.pending_edu_count == 2
    taken = q.take_edus(100)
    assert [e.content for e in taken] == [{"n": 1}, {"typing": False}]


def test_failure_keeps_the_transaction_for_a_resend_with_the_same_id() -> None:
    q = PerDestinationQueue("b")
    q.add_pdu(pdu(1))
    t = txn(q)
    outcome = fail(q, t, now=0)
    assert outcome.backed_off and not outcome.entered_catch_up
    assert q.retained is t
    assert q.retry.backing_off(1)
    assert q.has_work()
    assert q.on_success() is not None, "the success after a failure clears the stored backoff"
    assert q.retained is None and q.retry.healthy


def test_a_refusal_drops_the_transaction_without_backoff() -> None:
    q = PerDestinationQueue("b")
    q.add_pdu(pdu(1))
    outcome = fail(q, txn(q), now=0, unhealthy=False)
    assert not outcome.backed_off
    assert q.retained is None and q.retry.healthy and not q.has_work()


def test_backoff_past_the_threshold_drops_to_catch_up_but_keeps_device_lists() -> None:
    q = PerDestinationQueue("b")
    q.add_pdu(pdu(1))
    t = txn(q)
    q.add_pdu(pdu(2))
    q.add_edu(Edu("m.typing", {}, key=("m.typing", "!r", "@u")))
    q.add_edu(Edu("m.device_list_update", {"n": 1}))
    now = 0
    outcome = fail(q, t, now)
    while not outcome.entered_catch_up:  # 10, 20, 40, 80 minutes: the fourth crosses an hour
        now = q.retry.retry_at
        outcome = fail(q, q.retained or t, now)
    assert q.retry.retry_interval == 80 * 60_000
    assert outcome.dropped_pdus == 2
    assert q.catching_up and not q.pdus and q.retained is None
    assert [e.edu_type for e in q.take_edus(100)] == ["m.device_list_update"]


def test_while_catching_up_new_pdus_are_skipped_and_remembered() -> None:
    q = PerDestinationQueue("b", catching_up=True)
    assert q.add_pdu(pdu(7)) is Added.SKIPPED
    assert q.add_pdu(pdu(5)) is Added.SKIPPED
    assert q.skipped_upto == 7 and not q.pdus
    forwarded = PendingPdu("$f", "!r:a", None, b"{}", 0.0)
    assert q.add_pdu(forwarded) is Added.QUEUED, "a forwarded PDU is not in destination_rooms: it is queued"


def test_too_many_waiting_pdus_overflow_into_catch_up() -> None:
    q = PerDestinationQueue("b", max_pending_pdus=3)
    for n in range(3):
        assert q.add_pdu(pdu(n)) is Added.QUEUED
    assert q.add_pdu(pdu(3)) is Added.OVERFLOWED
    assert q.catching_up and not q.pdus
