"""The sender's loop with an in-memory store, a transport the test answers and Twisted's fake clock.

What is checked here is the loop's own work — fan-out, the global cap,
timers on the injected clock, waking on the stream's position, holding
requests until ``start()``, metrics — not the decisions (test_core.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import attrs
import pytest
from canonicaljson import encode_canonical_json
from prometheus_client import CollectorRegistry
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from federation_sender.config import BackoffConfig, FederationSenderConfig
from federation_sender.metrics import FederationSenderMetrics
from federation_sender.sender import FederationSender
from federation_sender.transport import TransactionFailed
from storage.kernel.written_events import WrittenEvent, WrittenEvents
from storage.stores.federation_sender import (
    CatchUpData,
    CatchUpEvent,
    DestinationRow,
    DeviceListRead,
    DeviceListRow,
    FanoutEvent,
    OutboxRow,
    SentMark,
)

CONFIG = FederationSenderConfig(
    max_concurrent_transactions=2,
    backoff=BackoffConfig(initial=timedelta(seconds=600), jitter=(1.0, 1.0)),
)


@attrs.define
class Row:
    retry: tuple[int, int, int | None] = (0, 0, None)
    last_successful: int | None = None
    catch_up_from: int | None = None
    device_lists_position: int | None = None


class MemoryStore:
    """The tables the sender reads and writes, as dicts."""

    def __init__(self) -> None:
        self.events: list[FanoutEvent] = []
        self.rows: dict[str, Row] = {}
        self.outbox: dict[str, list[OutboxRow]] = {}
        self.pdu_errors: dict[tuple[str, str], str] = {}
        self.fail_next: list[str] = []  # method names that raise once
        # The device_lists stream's rows (local users only), and who shares a room with each user.
        self.device_changes: list[DeviceListRow] = []
        self.sharing: dict[str, set[str]] = {}
        # The destinations of each mark_sent_many write; a write waits for hold_marks when set.
        self.mark_batches: list[list[str]] = []
        self.fanout_reads = 0
        self.hold_scan: Deferred[None] | None = None
        self.hold_marks: Deferred[None] | None = None

    def device_change(self, user_id: str, device_id: str, *destinations: str) -> int:
        """A local user's device changed, meant for ``destinations`` (the call site's note)."""
        stream_id = len(self.device_changes) + 1
        prev = max((c.stream_id for c in self.device_changes if c.user_id == user_id), default=None)
        self.device_changes.append(DeviceListRow(user_id, stream_id, device_id, False, prev, None, '{"k": 1}'))
        self.sharing.setdefault(user_id, set()).update(destinations)
        for name in destinations:
            row = self.row(name)
            if row.device_lists_position is None:
                row.device_lists_position = stream_id - 1
        return stream_id

    def _check(self, method: str) -> None:
        if method in self.fail_next:
            self.fail_next.remove(method)
            raise RuntimeError(f"{method}: database went away")

    def add_event(self, room: str, destinations: tuple[str, ...]) -> int:
        ordering = len(self.events) + 1
        pdu = {"event_id": f"$e{ordering}", "room_id": room}
        self.events.append(FanoutEvent(ordering, f"$e{ordering}", room, json.dumps(pdu), destinations))
        return ordering

    def row(self, destination: str) -> Row:
        return self.rows.setdefault(destination, Row())

    def _destination_row(self, name: str) -> DestinationRow:
        row = self.row(name)
        return DestinationRow(name, *row.retry, row.last_successful)

    def _rooms(self, destination: str) -> dict[str, int]:
        newest: dict[str, int] = {}
        for e in self.events:
            if destination in e.destinations:
                newest[e.room_id] = e.stream_ordering
        return newest

    async def get_fanout_events(self, after: int, upto: int, limit: int) -> list[FanoutEvent]:
        self.fanout_reads += 1
        return [e for e in self.events if after < e.stream_ordering <= upto][:limit]

    async def get_backing_off(self) -> list[DestinationRow]:
        return [self._destination_row(name) for name, row in sorted(self.rows.items()) if row.retry[1] > 0]

    async def get_needing_catch_up(self, upto: int) -> list[DestinationRow]:
        names = {d for e in self.events for d in e.destinations}
        rows = [
            self._destination_row(name) for name in sorted(names)
            if any((self.row(name).last_successful or 0) < pos <= upto for pos in self._rooms(name).values())
        ]
        if self.hold_scan is not None:  # the rows as they were when the query ran, answered later
            await self.hold_scan
        return rows

    async def set_retry(self, destination: str, retry_last_ts: int, retry_interval: int, failure_ts: int | None) -> None:
        self._check("set_retry")
        self.row(destination).retry = (retry_last_ts, retry_interval, failure_ts)

    def _mark_sent(self, mark: SentMark) -> None:
        destination, advance_to, reset_retry = mark.destination, mark.advance_to, mark.reset_retry
        to_device_upto, device_lists_upto = mark.to_device_upto, mark.device_lists_upto
        if device_lists_upto is not None:
            row = self.row(destination)
            row.device_lists_position = max(row.device_lists_position or 0, device_lists_upto)
        row = self.row(destination)
        if advance_to is not None:
            row.last_successful = max(row.last_successful or 0, advance_to)
        if reset_retry:
            row.retry = (0, 0, None)
        if to_device_upto is not None:
            self.outbox[destination] = [r for r in self.outbox.get(destination, []) if r.stream_id > to_device_upto]

    async def mark_sent_many(self, marks: Sequence[SentMark]) -> None:
        self._check("mark_sent")
        self.mark_batches.append(sorted(m.destination for m in marks))
        if self.hold_marks is not None:
            await self.hold_marks
        for mark in marks:
            self._mark_sent(mark)

    async def record_pdu_errors(self, destination: str, errors: Mapping[str, str], now_ms: int) -> None:
        self.pdu_errors.update({(destination, e): error for e, error in errors.items()})

    async def begin_catch_up(self, destination: str) -> tuple[int, int]:
        row = self.row(destination)
        if row.catch_up_from is None:
            row.catch_up_from = row.last_successful or 0
        return row.catch_up_from, row.last_successful or 0

    async def end_catch_up(self, destination: str) -> None:
        self.row(destination).catch_up_from = None

    async def get_catch_up_rooms(
        self, destination: str, after: int, upto: int | None, limit: int
    ) -> list[tuple[str, int]]:
        rooms = [(r, p) for r, p in self._rooms(destination).items() if p > after and (upto is None or p <= upto)]
        return sorted(rooms, key=lambda row: row[1])[:limit]

    async def get_catch_up_data(
        self, destination: str, rooms: Sequence[tuple[str, int, int]], missed_per_room: int
    ) -> CatchUpData:
        def event(e: FanoutEvent) -> CatchUpEvent:
            return CatchUpEvent(e.room_id, e.stream_ordering, e.event_id, e.pdu_json)

        missed = {
            room: [event(e) for e in self.events
                   if e.room_id == room and after < e.stream_ordering <= upto and destination in e.destinations]
            for room, upto, after in rooms
        }
        latest = {room: [event(e) for e in self.events if e.stream_ordering == upto] for room, upto, _ in rooms}
        return CatchUpData(missed, latest)

    async def get_outbox(self, destination: str, limit: int) -> list[OutboxRow]:
        return self.outbox.get(destination, [])[:limit]

    async def get_outbox_destinations(self) -> list[str]:
        return sorted(d for d, rows in self.outbox.items() if rows)

    def _device_rows(self, destination: str) -> list[DeviceListRow]:
        position = self.row(destination).device_lists_position
        if position is None:
            return []
        return [c for c in self.device_changes
                if c.stream_id > position and destination in self.sharing.get(c.user_id, set())]

    async def get_device_list_updates(
        self, destination: str, local_server: str, upto: int, limit: int
    ) -> DeviceListRead:
        self._check("get_device_list_updates")
        rows = self._device_rows(destination)
        newest: dict[str, DeviceListRow] = {}
        for row in rows:
            if row.stream_id <= upto:
                newest[row.user_id] = row
        return DeviceListRead(sorted(newest.values(), key=lambda r: r.stream_id)[:limit + 1], [],
                              any(r.stream_id > upto for r in rows))

    async def get_device_lists_destinations(self, local_server: str) -> list[str]:
        return sorted(name for name in self.rows if self._device_rows(name))


@attrs.frozen
class Call:
    destination: str
    txn_id: str
    body: dict[str, Any]
    answer: Deferred[Any]


class Harness:
    def __init__(self, config: FederationSenderConfig = CONFIG, store: MemoryStore | None = None,
                 written: WrittenEvents | None = None) -> None:
        self.clock = Clock()
        self.clock.advance(1_000)
        self.store = store or MemoryStore()
        self.calls: list[Call] = []
        self.registry = CollectorRegistry()
        self.position = 0
        self.device_position = 0
        self.sender = FederationSender(
            server_name="a.example",
            config=config,
            store=self.store,
            transport=self.transport,
            clock=self.clock,
            current_position=lambda: self.position,
            device_lists_position=lambda: self.device_position,
            metrics=FederationSenderMetrics.create(self.registry),
            jitter=lambda low, high: 1.0,
            written=written,
        )

    def transport(self, destination: str, txn_id: str, body: bytes, timeout: float) -> Deferred[Any]:
        # The body is canonical JSON, byte for byte what encoding it as a whole would give.
        parsed = json.loads(body)
        assert encode_canonical_json(parsed) == body
        call = Call(destination, txn_id, parsed, Deferred())
        self.calls.append(call)
        return call.answer

    def start(self) -> None:
        d = Deferred.fromCoroutine(self.sender.start())
        assert d.called

    def event(self, room: str, *destinations: str) -> int:
        self.position = self.store.add_event(room, destinations)
        self.sender.notify_new_events(self.position)
        return self.position

    def pending(self) -> list[Call]:
        return [c for c in self.calls if not c.answer.called]

    def metric(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


def event_ids(call: Call) -> list[str]:
    return [p["event_id"] for p in call.body["pdus"]]


def test_new_events_go_out_and_the_position_is_written_after_the_answer() -> None:
    h = Harness()
    h.start()
    h.event("!r", "b.example", "c.example")
    assert sorted((c.destination, tuple(event_ids(c))) for c in h.calls) == [
        ("b.example", ("$e1",)), ("c.example", ("$e1",))]
    assert h.store.row("b.example").last_successful is None
    h.calls[0].answer.callback({})
    assert h.store.row(h.calls[0].destination).last_successful == 1
    assert h.metric("tributary_federation_sender_transactions_total", outcome="ok") == 1


def test_the_global_cap_holds_transactions_back_first_come_first_served() -> None:
    h = Harness()
    h.start()
    h.event("!r", "b1", "b2", "b3")
    assert len(h.pending()) == 2
    assert h.metric("tributary_federation_sender_transactions_in_flight") == 2
    h.pending()[0].answer.callback({})
    assert len(h.pending()) == 2 and len(h.calls) == 3


def test_a_failure_is_retried_with_the_same_id_when_the_clock_says_so() -> None:
    h = Harness()
    h.start()
    h.event("!r", "b.example")
    first = h.calls[0]
    first.answer.errback(TransactionFailed(502, "bad gateway"))
    assert h.store.row("b.example").retry == (1_000_000, 600_000, 1_000_000)
    h.event("!r", "b.example")
    h.clock.advance(599)
    assert len(h.calls) == 1
    h.clock.advance(2)
    assert len(h.calls) == 2 and h.calls[1].txn_id == first.txn_id and event_ids(h.calls[1]) == ["$e1"]
    h.calls[1].answer.callback({})
    assert event_ids(h.calls[2]) == ["$e2"]
    assert h.store.row("b.example").retry == (0, 0, None)


def test_a_server_that_contacts_us_gets_what_waits_at_once() -> None:
    h = Harness()
    h.start()
    h.event("!r", "b.example")
    h.calls[0].answer.errback(TransactionFailed(None, "connection refused"))
    h.sender.notify_remote_server_up("b.example")
    assert len(h.calls) == 2 and h.calls[1].txn_id == h.calls[0].txn_id
    assert h.store.row("b.example").retry == (0, 0, None)


def test_requests_made_before_start_wait_for_it() -> None:
    h = Harness()
    h.sender.send_edu(["b.example"], "m.typing", {"n": 1})
    assert h.calls == []
    h.start()
    assert [c.body["edus"] for c in h.calls] == [[{"edu_type": "m.typing", "content": {"n": 1}}]]


def test_startup_catches_up_and_waits_for_the_position_without_polling() -> None:
    """The store has an event for b beyond the stream's position (persisted, but an older event is
    still being written). Catch-up starts, finds nothing it may send yet, and sends nothing however
    long the clock runs; the stream's position moving wakes it."""
    h = Harness()
    h.store.add_event("!r", ("b.example",))
    h.start()
    h.clock.advance(1)  # the rate-limited wake-up
    h.clock.pump([1.0] * 30)
    assert h.calls == []
    h.position = 1
    h.sender.notify_new_events(1)
    assert [event_ids(c) for c in h.calls] == [["$e1"]]
    h.calls[0].answer.callback({})
    assert h.store.row("b.example").last_successful == 1
    assert h.store.row("b.example").catch_up_from is None, "caught up"


def test_a_position_that_has_not_passed_yet_keeps_catch_up_waiting() -> None:
    """Issue 28, found by tests/integration/test_sender_crash.py: with two event persisters, one
    writer's announcement can leave the events stream's (linear) position where it was. Catch-up
    waiting for the position to pass what it saw is woken, finds it has not, and must still be
    woken by the later move that does; it used to be forgotten, and the destination stayed behind."""
    h = Harness()
    h.store.add_event("!r", ("b.example",))
    h.start()
    h.clock.advance(1)  # the rate-limited wake-up: catch-up begins and waits for the position
    h.sender.notify_new_events(0)  # a writer moved; the position did not
    h.clock.pump([1.0] * 5)
    assert h.calls == []
    h.position = 1
    h.sender.notify_new_events(1)
    assert [event_ids(c) for c in h.calls] == [["$e1"]]
    h.calls[0].answer.callback({})
    assert h.store.row("b.example").last_successful == 1


def test_refused_pdus_are_stored_and_counted_by_reason() -> None:
    h = Harness()
    h.start()
    h.event("!r", "b.example")
    h.calls[0].answer.callback({"pdus": {"$e1": {"error": "Invalid signature"}}})
    assert h.store.pdu_errors == {("b.example", "$e1"): "Invalid signature"}
    assert h.metric("tributary_federation_sender_pdus_refused_total", reason="signature") == 1
    assert h.store.row("b.example").last_successful == 1


def test_a_store_failure_is_counted_and_retried_after_a_pause() -> None:
    h = Harness()
    h.start()
    h.store.fail_next.append("mark_sent")
    h.event("!r", "b.example")
    h.calls[0].answer.callback({})
    assert h.metric("tributary_federation_sender_loop_restarts_total") == 1
    assert h.store.row("b.example").last_successful is None
    h.clock.advance(1.002)
    assert h.store.row("b.example").last_successful == 1


def test_positions_answered_during_a_write_are_written_together_by_the_next() -> None:
    """Three destinations get an event. b's answer starts a position write, which takes a
    while; c and d answer meanwhile. Their positions wait, and go in one write once b's ends:
    two database transactions for three answers, and every position lands."""
    h = Harness(attrs.evolve(CONFIG, max_concurrent_transactions=10))
    h.start()
    h.event("!r", "b.example", "c.example", "d.example")
    h.store.hold_marks = Deferred()
    answers = {c.destination: c.answer for c in h.calls}
    answers["b.example"].callback({})
    answers["c.example"].callback({})
    answers["d.example"].callback({})
    assert h.store.mark_batches == [["b.example"]]
    assert all(h.store.row(d).last_successful is None for d in ("b.example", "c.example", "d.example"))
    held, h.store.hold_marks = h.store.hold_marks, None
    held.callback(None)
    assert h.store.mark_batches == [["b.example"], ["c.example", "d.example"]]
    assert [h.store.row(d).last_successful for d in ("b.example", "c.example", "d.example")] == [1, 1, 1]


def test_events_this_process_wrote_for_no_other_server_are_not_read_again() -> None:
    """The persister noted events 1 and 2 as local-only: the fan-out moves past them without a
    query. Event 3 is for b (noted so): read and sent. Event 4 was written elsewhere (no note):
    read, to be sure."""
    written = WrittenEvents()
    h = Harness(written=written)
    h.start()
    for room in ("!a", "!b"):
        written.note(h.store.add_event(room, ()), WrittenEvent(state=False, fanout=False))
    h.position = 2
    h.sender.notify_new_events(2)
    assert h.store.fanout_reads == 0 and h.metric("tributary_federation_sender_fanout_position") == 2
    ordering = h.store.add_event("!c", ("b.example",))
    written.note(ordering, WrittenEvent(state=False, fanout=True))
    h.position = ordering
    h.sender.notify_new_events(ordering)
    assert h.store.fanout_reads == 1 and [event_ids(c) for c in h.calls] == [["$e3"]]
    h.event("!d")
    assert h.store.fanout_reads == 2 and h.metric("tributary_federation_sender_fanout_position") == 4


def test_a_scan_that_read_a_position_since_written_does_not_start_a_catch_up() -> None:
    """The periodic scan reads b's rows while b's transaction is in flight: the event looks
    missed. b's answer comes and its position is written before the scan's answer arrives, by
    which time b is idle. The scan must not send b into catch-up: that would send it the event
    a second time."""
    h = Harness()
    h.start()
    h.event("!r", "b.example")
    h.store.hold_scan = Deferred()
    h.clock.advance(CONFIG.catch_up.scan_interval.total_seconds())
    h.calls[0].answer.callback({})
    assert h.store.row("b.example").last_successful == 1
    held, h.store.hold_scan = h.store.hold_scan, None
    held.callback(None)
    h.clock.advance(1)
    assert len(h.calls) == 1
    assert h.metric("tributary_federation_sender_catch_up_entered_total", reason="missed") == 0


def test_stopping_during_a_position_write_leaves_no_error_behind() -> None:
    """The sender stops while a position write is under way: the stop does not wait for it,
    and the write's end afterwards raises nothing and counts no crashed loop."""
    h = Harness()
    h.start()
    h.event("!r", "b.example")
    h.store.hold_marks = Deferred()
    h.calls[0].answer.callback({})
    d = Deferred.fromCoroutine(h.sender.stop())
    assert d.called
    held, h.store.hold_marks = h.store.hold_marks, None
    held.callback(None)
    assert h.metric("tributary_federation_sender_loop_restarts_total") == 0


def test_stop_cancels_what_is_in_flight() -> None:
    h = Harness()
    h.start()
    h.event("!r", "b.example")
    d = Deferred.fromCoroutine(h.sender.stop())
    assert d.called and h.calls[0].answer.called


@pytest.mark.parametrize("status", [400, 404])
def test_a_refused_transaction_is_not_retried(status: int) -> None:
    h = Harness()
    h.start()
    h.event("!r", "b.example")
    h.calls[0].answer.errback(TransactionFailed(status, "no"))
    assert h.metric("tributary_federation_sender_pdus_refused_total", reason="transaction_rejected") == 1
    h.clock.advance(3600)
    assert len(h.calls) == 1
    assert h.store.row("b.example").retry == (0, 0, None)


def test_a_device_change_is_read_from_the_store_and_a_restart_sends_what_was_not_acknowledged() -> None:
    h = Harness()
    h.start()
    h.device_position = h.store.device_change("@a:a.example", "D1", "b.example")
    h.sender.send_edu(["b.example"], "m.device_list_update", {"ignored": True})
    assert [(e["content"]["user_id"], e["content"]["stream_id"], e["content"]["prev_id"])
            for e in h.calls[0].body["edus"]] == [("@a:a.example", 1, [])]
    # Killed before the answer: a new sender over the same store finds the change at start-up.
    store = h.store
    h2 = Harness(store=store)
    h2.device_position = 1
    h2.start()
    h2.clock.advance(1)  # the rate-limited wake-up
    assert [e["content"]["device_id"] for c in h2.calls for e in c.body["edus"]] == ["D1"]
    h2.calls[0].answer.callback({})
    assert store.row("b.example").device_lists_position == 1


def test_a_device_change_beyond_the_stream_s_position_waits_for_it() -> None:
    h = Harness()
    h.start()
    h.store.device_change("@a:a.example", "D1", "b.example")
    h.sender.send_device_list_update(["b.example"], {})
    assert h.calls == []
    h.device_position = 1
    h.sender.notify_device_lists()
    assert len(h.calls) == 1 and h.calls[0].body["edus"][0]["content"]["device_id"] == "D1"
