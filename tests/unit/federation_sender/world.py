"""A fake world around one destination's core, for its unit and property tests (no tests here).

The clock is a number of milliseconds the test moves by hand; the store is a
few dicts with the same meaning as the real tables (``events`` for one
destination, ``destination_rooms`` derived from them, the ``destinations``
row, the to-device outbox, the device_lists stream); the transport is the test itself, answering each
transaction when it chooses. No sockets, no reactor, no sleeps.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TypeVar

import attrs

from federation_sender.backoff import HEALTHY, RetryState
from federation_sender.catch_up import CatchUpRoom
from federation_sender.config import BackoffConfig, CatchUpConfig, FederationSenderConfig
from federation_sender.core import (
    Action,
    BeginCatchUp,
    Destination,
    EndCatchUp,
    OutboxMessage,
    PersistPosition,
    PersistRetry,
    QueueWake,
    ReadCatchUpEvents,
    ReadCatchUpRooms,
    ReadDeviceLists,
    ReadOutbox,
    Refusal,
    Request,
    ScheduleWake,
    SendTransaction,
    TransactionIds,
    WaitForPosition,
)
from federation_sender.queue import PendingPdu, PlannedTransaction, encode_pdu

N = TypeVar("N")
NAME = "b.example"
MINUTE = 60_000
HOUR = 60 * MINUTE
CONFIG = FederationSenderConfig(
    backoff=BackoffConfig(initial=timedelta(minutes=10), multiplier=2.0, max=timedelta(days=7), jitter=(1.0, 1.0)),
    catch_up=CatchUpConfig(threshold=timedelta(hours=1)),
)
REQUESTS = (
    ReadOutbox, ReadDeviceLists, BeginCatchUp, ReadCatchUpRooms, ReadCatchUpEvents, EndCatchUp, SendTransaction, PersistPosition,
    PersistRetry,
)


def pdu(ordering: int, room: str) -> PendingPdu:
    return PendingPdu(f"$e{ordering}", room, ordering, encode_pdu({"event_id": f"$e{ordering}", "room_id": room}), 0.0)


@attrs.define
class DestinationsRow:
    last_successful: int | None = None
    catch_up_from: int | None = None
    retry: RetryState = HEALTHY
    device_lists_position: int = 0


class World:
    def __init__(self, config: FederationSenderConfig = CONFIG) -> None:
        self.config = config
        self.now_ms = 0
        # The events stream: ordering -> room, all of them for this destination.
        self.events: dict[int, str] = {}
        self.written = 0  # the newest ordering written
        self.position = 0  # the stream's position (everything up to it is persisted)
        self.row = DestinationsRow()
        self.outbox: list[OutboxMessage] = []
        # The device_lists stream: (stream_id, user) of local users sharing a room with the destination.
        self.device_changes: list[tuple[int, str]] = []
        self.refusals: list[Refusal] = []
        self.txn_ids = TransactionIds("t")
        self.dest = self._new_destination()
        self.request: Request | None = None
        self.notices: list[Action] = []
        self.wakes: list[int] = []
        self.awaiting_position: int | None = None
        self.queued_wakes = 0
        self.attempts: list[PlannedTransaction] = []  # every transaction put on the wire
        self.answered: set[str] = set()  # event IDs of PDUs in transactions the destination answered
        self.persisted_after: list[tuple[str, int | None]] = []  # (txn ID, advance) in order of writing

    def _new_destination(self) -> Destination:
        return Destination(NAME, config=self.config, txn_ids=self.txn_ids, jitter=lambda low, high: 1.0)

    # --- carrying out actions, as the loop does -----------------------------------------------

    def feed(self, actions: Sequence[Action]) -> None:
        for action in actions:
            if isinstance(action, REQUESTS):
                assert self.request is None, f"a second request {action!r} while {self.request!r} is outstanding"
                self.request = action
                if isinstance(action, SendTransaction):
                    self.attempts.append(action.txn)
            elif isinstance(action, ScheduleWake):
                self.wakes.append(action.at_ms)
            elif isinstance(action, WaitForPosition):
                if self.position > action.above:
                    self.feed(self.dest.on_position(self.position, self.now_ms))
                else:
                    self.awaiting_position = action.above
            elif isinstance(action, QueueWake):
                self.queued_wakes += 1
            else:
                self.notices.append(action)

    def notices_of(self, kind: type[N]) -> list[N]:
        return [n for n in self.notices if isinstance(n, kind)]

    # --- what happens around the destination -------------------------------------------------------

    def write(self, room: str, *, advance_position: bool = True) -> PendingPdu:
        """Persist a local event for the destination (it raises destination_rooms)."""
        self.written += 1
        self.events[self.written] = room
        if advance_position:
            self.advance_position(self.written)
        return pdu(self.written, room)

    def advance_position(self, position: int) -> None:
        self.position = position
        if self.awaiting_position is not None and position > self.awaiting_position:
            self.awaiting_position = None
            self.feed(self.dest.on_position(position, self.now_ms))

    def new_event(self, room: str = "!r") -> PendingPdu:
        """An event is written and fanned out to the destination."""
        event = self.write(room)
        self.feed(self.dest.on_pdus([event], self.now_ms))
        return event

    def to_device(self, content: dict[str, object]) -> None:
        stream_id = (self.outbox[-1].stream_id if self.outbox else 0) + 1
        self.outbox.append(OutboxMessage(stream_id, content))
        self.feed(self.dest.on_outbox_wake(self.now_ms))

    def device_change(self, user: str = "@u:a.example") -> int:
        """A local user's devices change; the sender is told (a wake-up)."""
        stream_id = (self.device_changes[-1][0] if self.device_changes else 0) + 1
        self.device_changes.append((stream_id, user))
        self.feed(self.dest.on_device_lists_wake(self.now_ms))
        return stream_id

    def device_updates(self, upto: int | None = None) -> dict[str, int]:
        """Per user, the newest change above the destination's position (up to ``upto``)."""
        newest: dict[str, int] = {}
        for stream_id, user in self.device_changes:
            if stream_id > self.row.device_lists_position and (upto is None or stream_id <= upto):
                newest[user] = stream_id
        return newest

    def advance_time(self, to_ms: int) -> None:
        """Move the clock; fire the wake-ups that are due."""
        self.now_ms = max(self.now_ms, to_ms)
        due = sorted(w for w in self.wakes if w <= self.now_ms)
        self.wakes = [w for w in self.wakes if w > self.now_ms]
        for _ in due:
            self.feed(self.dest.on_wake(self.now_ms))

    def wake_queued(self) -> None:
        """The loop's rate-limited wake-up comes round."""
        self.queued_wakes = 0
        self.feed(self.dest.on_wake(self.now_ms))

    # --- the store ----------------------------------------------------------------------------

    def rooms_above(self, after: int, upto: int | None) -> list[tuple[str, int]]:
        newest: dict[str, int] = {}
        for ordering, room in self.events.items():
            newest[room] = max(newest.get(room, 0), ordering)
        return sorted(
            ((room, pos) for room, pos in newest.items() if pos > after and (upto is None or pos <= upto)),
            key=lambda row: row[1],
        )

    def step(self) -> Request:
        """Carry out the outstanding store request and answer it."""
        request, self.request = self.request, None
        dest, now = self.dest, self.now_ms
        match request:
            case ReadOutbox(limit=limit):
                self.feed(dest.on_outbox_read(self.outbox[:limit], now))
            case ReadDeviceLists(limit=limit):
                upto = self.device_changes[-1][0] if self.device_changes else 0
                newest = sorted(self.device_updates().items(), key=lambda item: item[1])
                more = len(newest) > limit
                if more:
                    newest = newest[:limit]
                    upto = newest[-1][1]
                contents = [{"user_id": user, "stream_id": stream_id} for user, stream_id in newest]
                self.feed(dest.on_device_lists_read(contents, upto, more, now))
            case BeginCatchUp():
                if self.row.catch_up_from is None:
                    self.row.catch_up_from = self.row.last_successful or 0
                self.feed(dest.on_catch_up_begun(self.row.catch_up_from, self.row.last_successful or 0, now))
            case ReadCatchUpRooms(after=after, limit=limit):
                rooms = self.rooms_above(after, self.position)[:limit]
                ahead = not rooms and bool(self.rooms_above(after, None))
                self.feed(dest.on_catch_up_rooms(rooms, self.position, ahead, now))
            case ReadCatchUpEvents(rooms=reads, missed_per_room=limit):
                planned = []
                for room, position, after in reads:
                    missed = [o for o, r in sorted(self.events.items()) if r == room and after < o <= position]
                    more = bool(limit) and len(missed) > limit
                    missed = missed[:limit] if limit else []
                    planned.append(CatchUpRoom(room, position, tuple(pdu(o, room) for o in missed),
                                               (pdu(position, room),), more=more))
                self.feed(dest.on_catch_up_events(planned, now))
            case EndCatchUp():
                self.row.catch_up_from = None
                self.feed(dest.on_catch_up_ended(now))
            case PersistPosition():
                self.refusals.extend(request.refusals)
                if request.advance_to is not None:
                    self.row.last_successful = max(self.row.last_successful or 0, request.advance_to)
                if request.clear_retry:
                    self.row.retry = HEALTHY
                if request.to_device_upto is not None:
                    self.outbox = [m for m in self.outbox if m.stream_id > request.to_device_upto]
                if request.device_lists_upto is not None:
                    self.row.device_lists_position = max(self.row.device_lists_position, request.device_lists_upto)
                self.persisted_after.append((request.txn_id, request.advance_to))
                self.feed(dest.on_persisted(now))
            case PersistRetry(retry=retry):
                self.row.retry = retry
                self.feed(dest.on_persisted(now))
            case _:
                raise AssertionError(f"not a store request: {request!r}")
        assert request is not None
        return request

    def settle(self) -> PlannedTransaction | None:
        """Carry out store requests until a transaction is to be sent (returned) or nothing is left."""
        while self.request is not None and not isinstance(self.request, SendTransaction):
            self.step()
        return self.request.txn if isinstance(self.request, SendTransaction) else None

    # --- the destination's answers ---------------------------------------------------------------

    def answer(self, status: int | None = 200, errors: Sequence[tuple[str, str]] = ()) -> PlannedTransaction:
        request, self.request = self.request, None
        assert isinstance(request, SendTransaction), f"nothing in flight: {request!r}"
        txn = request.txn
        if status == 200:
            self.answered.update(p.event_id for p in txn.pdus)
            self.feed(self.dest.on_transaction_accepted(errors, self.now_ms))
        else:
            if status is not None and 400 <= status < 500 and status not in (401, 429):
                self.answered.update(p.event_id for p in txn.pdus)  # a definite refusal is an answer
            self.feed(self.dest.on_transaction_failed(status, f"answered {status}", self.now_ms))
        return txn

    def crash_request(self) -> None:
        """Carrying out the outstanding request raised."""
        self.request = None
        self.feed(self.dest.on_crashed(self.now_ms))

    def restart(self) -> None:
        """The process is killed and started again: only the store survives."""
        self.dest = self._new_destination()
        self.request = None
        self.wakes = []
        self.awaiting_position = None
        self.queued_wakes = 0
        if not self.row.retry.healthy:
            self.dest.on_backoff_restored(self.row.retry)
        if self.rooms_above(self.row.last_successful or 0, None):  # as sender.start() asks
            self.feed(self.dest.on_catch_up_found(self.now_ms, startup=True))
        if self.outbox:
            self.feed(self.dest.on_outbox_found(self.now_ms))
        if self.device_updates():
            self.feed(self.dest.on_device_lists_found(self.now_ms))

    # --- the guarantee ------------------------------------------------------------------------------

    def restart_floor(self) -> int:
        """Where a restarted sender looks for missed events from: no unanswered event is at or below it."""
        if self.row.catch_up_from is not None:
            return self.row.catch_up_from
        return self.row.last_successful or 0

    def unanswered(self) -> list[int]:
        return sorted(o for o in self.events if f"$e{o}" not in self.answered)
