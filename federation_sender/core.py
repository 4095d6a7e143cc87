"""One destination's sending state machine, sans I/O: events in, actions out.

A ``Destination`` holds everything about one remote server: what waits for it
in memory (``queue.py``), its backoff, its catch-up progress, the transaction
in flight and the one request the loop is carrying out for it. The loop
(``sender.py``) calls an ``on_<event>(..., now_ms)`` method when something
happens — new PDUs, a wake-up, a store read's result, the destination's
answer — and carries out the actions returned, in order.

Rules: at most one *request* (``ReadOutbox``, ``ReadDeviceLists``, ``BeginCatchUp``,
``ReadCatchUpRooms``, ``ReadCatchUpEvents``, ``EndCatchUp``,
``SendTransaction``, ``PersistPosition``, ``PersistRetry``) is outstanding at a
time, and the loop answers each with exactly one call (its result method, or
``on_crashed`` if carrying it out raised). Every other action
(``ScheduleWake``, ``WaitForPosition``, ``QueueWake`` and the notices) needs no
answer. ``last_successful_stream_ordering`` is only ever written by a
``PersistPosition`` made from the destination's answer to the transaction
that carried the events (see docs/federation-sender.md, "Guarantee").

It does not read the clock, log, count metrics or know about Twisted,
Postgres or HTTP; it does not know about other destinations (the global cap on
transactions and the wake-up rate are the loop's).
"""

# tests: tests/unit/federation_sender/test_core.py, tests/unit/federation_sender/test_core_machine.py

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, Final, TypeAlias

import attrs

from federation_sender.backoff import HEALTHY, Jitter, RetryState, is_unhealthy, policy_from_config
from federation_sender.catch_up import CatchUpChunk, CatchUpRoom, plan_chunks
from federation_sender.config import FederationSenderConfig
from federation_sender.link import ProtocolViolation as ProtocolViolation
from federation_sender.link import RequestLink
from federation_sender.link import ScheduleWake as ScheduleWake
from federation_sender.queue import (
    DATABASE_EDU_TYPES,
    DEVICE_LIST_EDU_TYPE,
    SIGNING_KEY_EDU_TYPE,
    TO_DEVICE_EDU_TYPE,
    Added,
    Edu,
    PendingPdu,
    PerDestinationQueue,
    PlannedTransaction,
)

# Why a destination refused a PDU, as a closed set (a metric label): the error text of a
# ``/send`` answer's ``pdus`` map is free text, so it is classified by what it mentions.
REFUSAL_REASONS: Final = ("forbidden", "signature", "format", "other", "transaction_rejected")


def refusal_reason(error: str) -> str:
    """The ``REFUSAL_REASONS`` class of a per-PDU error text."""
    text = error.lower()
    if any(word in text for word in ("signature", "hash", "key")):
        return "signature"
    if any(word in text for word in ("forbidden", "not allowed", "auth", "permission", "denied")):
        return "forbidden"
    if any(word in text for word in ("invalid", "malformed", "format", "too large", "bad ")):
        return "format"
    return "other"


def pdu_errors(response: Any) -> list[tuple[str, str]]:
    """The per-PDU errors of a ``/send`` answer (``{"pdus": {event_id: {"error": ...}}}``), in its order."""
    if not isinstance(response, Mapping):
        return []
    pdus = response.get("pdus")
    if not isinstance(pdus, Mapping):
        return []
    return [
        (str(event_id), str(result["error"]))
        for event_id, result in pdus.items()
        if isinstance(result, Mapping) and "error" in result
    ]


class TransactionIds:
    """Transaction IDs unique to this sender's run: a start-up prefix and a counter."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._counter = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}.{next(self._counter)}"


@attrs.frozen
class Refusal:
    """A PDU the destination answered about but did not take."""

    event_id: str
    error: str
    reason: str  # one of REFUSAL_REASONS


@attrs.frozen
class OutboxMessage:
    """A row of ``device_federation_outbox``: an ``m.direct_to_device`` EDU's content."""

    stream_id: int
    content: Mapping[str, Any]


# --- requests: the loop carries each out and answers with one call ------------------------------


@attrs.frozen
class ReadOutbox:
    """Read up to ``limit`` to-device messages from the outbox, oldest first → ``on_outbox_read``."""

    limit: int


@attrs.frozen
class ReadDeviceLists:
    """Up to ``limit`` device-list updates above the destination's ``device_lists_position``
    (the newest per local user sharing a room with it) → ``on_device_lists_read``."""

    limit: int


@attrs.frozen
class BeginCatchUp:
    """``store.begin_catch_up`` → ``on_catch_up_begun(catch_up_from, last_successful)``."""


@attrs.frozen
class ReadCatchUpRooms:
    """The ``limit`` oldest ``destination_rooms`` rows above ``after`` and not above the events
    stream's position ``upto`` (read it now), and whether any row lies beyond ``upto``
    → ``on_catch_up_rooms(rooms, upto, ahead)``."""

    after: int
    limit: int


@attrs.frozen
class ReadCatchUpEvents:
    """``store.get_catch_up_data`` for (room, its position, missed events start after)
    → ``on_catch_up_events(rooms)``."""

    rooms: tuple[tuple[str, int, int], ...]
    missed_per_room: int


@attrs.frozen
class EndCatchUp:
    """``store.end_catch_up`` → ``on_catch_up_ended``; nothing was left up to ``upto``."""

    upto: int
    position: int


@attrs.frozen
class SendTransaction:
    """``PUT /send/{txn_id}`` → ``on_transaction_accepted(pdu_errors)`` for a 2xx answer, else
    ``on_transaction_failed(status)`` (None: no answer)."""

    txn: PlannedTransaction


@attrs.frozen
class PersistPosition:
    """After the destination answered ``txn_id``: record ``refusals`` (``destination_pdu_errors``),
    then in one database transaction advance ``last_successful_stream_ordering`` to
    ``advance_to`` (None: unchanged), clear the backoff if ``clear_retry``, delete outbox rows
    up to ``to_device_upto``, advance ``device_lists_position`` to ``device_lists_upto``
    → ``on_persisted``."""

    txn_id: str
    advance_to: int | None
    clear_retry: bool
    to_device_upto: int | None
    refusals: tuple[Refusal, ...] = ()
    completed_rooms: tuple[tuple[str, int], ...] = ()
    device_lists_upto: int | None = None


@attrs.frozen
class PersistRetry:
    """Store the backoff in ``destinations`` → ``on_persisted``."""

    retry: RetryState


Request: TypeAlias = (
    ReadOutbox | ReadDeviceLists | BeginCatchUp | ReadCatchUpRooms | ReadCatchUpEvents | EndCatchUp | SendTransaction
    | PersistPosition | PersistRetry
)


# --- actions that need no answer ------------------------------------------------------------


@attrs.frozen
class WaitForPosition:
    """Call ``on_position`` once the events stream's position is above ``above``."""

    above: int


@attrs.frozen
class QueueWake:
    """Call ``on_wake`` soon, through the rate-limited wake-up queue (catch-up discovery)."""


@attrs.frozen
class EnteredCatchUp:
    """Notice: the destination entered catch-up (``reason``: a ``CATCH_UP_REASONS`` value)."""

    reason: str
    dropped_pdus: int = 0


@attrs.frozen
class CaughtUp:
    """Notice: catch-up is over; everything up to ``position`` is acknowledged."""

    position: int


@attrs.frozen
class BackingOff:
    """Notice: a transaction failed in a way that says the destination is unhealthy."""

    txn_id: str
    status: int | None
    error: str
    retry: RetryState


@attrs.frozen
class ResendingAfterContact:
    """Notice: a transaction failed, but the destination contacted us while it was out, so it
    is resent at once instead of backing off."""

    txn_id: str
    status: int | None
    error: str


@attrs.frozen
class TransactionRejected:
    """Notice: the destination refused a transaction as a whole (a 4xx about the request)."""

    txn_id: str
    status: int | None
    error: str
    pdus: int
    edus: int


@attrs.frozen
class BackoffCleared:
    """Notice: the destination is healthy again (``because``: "answered" or "contacted us")."""

    because: str


@attrs.frozen
class Accepted:
    """Notice: the destination took ``txn`` (for metrics and logs)."""

    txn: PlannedTransaction


Notice: TypeAlias = (
    EnteredCatchUp | CaughtUp | BackingOff | ResendingAfterContact | TransactionRejected | BackoffCleared | Accepted
)
Action: TypeAlias = Request | ScheduleWake | WaitForPosition | QueueWake | Notice


class Destination(RequestLink[Request]):
    """Everything about sending to one destination (see the module docstring)."""

    def __init__(
        self,
        name: str,
        *,
        config: FederationSenderConfig,
        txn_ids: TransactionIds,
        jitter: Jitter,
        retry: RetryState = HEALTHY,
    ) -> None:
        super().__init__(name)
        self._config = config
        self._txn_ids = txn_ids
        self._jitter = jitter
        self._policy = policy_from_config(config.backoff)
        self._threshold_ms = int(config.catch_up.threshold.total_seconds() * 1000)
        self._queue = PerDestinationQueue(
            name, retry=retry, max_pending_pdus=config.max_pending_pdus_per_destination
        )
        # False while the destination backs off with a backoff restored from the database and
        # nothing sent to it since: it has no in-memory queue yet, so what comes for it is left
        # to catch-up (PDUs) or dropped (EDUs) instead of piling up.
        self._has_queue = retry.healthy
        self._in_flight: PlannedTransaction | None = None
        # The destination, backing off, contacted us while the transaction in flight was out: a
        # failure of that transaction may be older news than the contact, so it is resent at once.
        self._contacted_while_sending = False
        # To-device messages read for the next transaction.
        self._outbox: tuple[OutboxMessage, ...] | None = None
        # Device-list updates read for the next transaction, and the stream position they cover.
        self._device_lists: tuple[Edu, ...] | None = None
        self._device_lists_upto: int | None = None
        # Catch-up progress: where it began (destinations.catch_up_from, None: not begun),
        # destinations.last_successful_stream_ordering as last read or written, the rooms
        # finished since it began (their missed events start there), the planned transactions,
        # and the stream position it waits to be passed before looking again.
        self._catch_up_from: int | None = None
        self._acked = 0
        self._done_rooms: dict[str, int] = {}
        self._chunks: deque[CatchUpChunk] = deque()
        self._awaiting_position: int | None = None

    # --- what the loop may look at -----------------------------------------------------------

    @property
    def catching_up(self) -> bool:
        return self._queue.catching_up

    @property
    def retry(self) -> RetryState:
        return self._queue.retry

    @property
    def pending_pdus(self) -> int:
        return len(self._queue.pdus)

    @property
    def pending_edus(self) -> int:
        return self._queue.pending_edu_count

    @property
    def in_flight(self) -> PlannedTransaction | None:
        return self._in_flight

    @property
    def acked_position(self) -> int:
        """``last_successful_stream_ordering`` as this destination last read or persisted it."""
        return self._acked

    def oldest_queued_at(self) -> float | None:
        return self._queue.oldest_queued_at()

    def is_idle(self) -> bool:
        """Nothing waits, nothing is outstanding, nothing to remember: the loop may forget it."""
        return (
            self._step is None and self._resume is None and not self._queue.has_work() and self._queue.retry.healthy
            and self._crashes == 0 and not self._retry_dirty and self._outbox is None
            and self._device_lists is None
        )

    # --- events from outside -----------------------------------------------------------------

    def on_pdus(self, pdus: Sequence[PendingPdu], now_ms: int) -> list[Action]:
        """New PDUs for this destination, in stream order."""
        notices: list[Action] = []
        for pdu in pdus:
            if not self._has_queue and self._queue.retry.backing_off(now_ms):
                # No queue while backing off: nothing piles up; catch-up finds it in destination_rooms.
                if pdu.stream_ordering is not None:
                    self._queue.skipped_upto = max(self._queue.skipped_upto, pdu.stream_ordering)
                    if not self._queue.catching_up:
                        self._queue.catching_up = True
                        notices.append(EnteredCatchUp("missed"))
                continue
            self._has_queue = True
            if self._queue.add_pdu(pdu) is Added.OVERFLOWED:
                self._forget_catch_up_plan()
                notices.append(EnteredCatchUp("overflow", self._config.max_pending_pdus_per_destination + 1))
        return notices + self._next(now_ms)

    def on_edu(self, edu: Edu, now_ms: int) -> list[Action]:
        if not self._has_queue and self._queue.retry.backing_off(now_ms):
            return []  # no queue while backing off: an EDU is not kept for an unknown time
        self._has_queue = True
        self._queue.add_edu(edu)
        return self._next(now_ms)

    def on_outbox_wake(self, now_ms: int) -> list[Action]:
        """To-device messages for this destination wait in the outbox."""
        self._queue.outbox_pending = True
        return self._next(now_ms)

    def on_device_lists_wake(self, now_ms: int) -> list[Action]:
        """A local user sharing a room with it changed devices: the change is on the device_lists
        stream, above this destination's position, until a transaction carrying it is accepted.
        Kept as a flag even while backing off with no queue: nothing piles up in memory."""
        self._queue.device_lists_pending = True
        return self._next(now_ms)

    def on_device_lists_found(self, now_ms: int) -> list[Action]:
        """Start-up: device-list changes wait above its position; woken at the bounded rate."""
        self._queue.device_lists_pending = True
        if self._queue.retry.backing_off(now_ms):
            return self._next(now_ms)  # woken when the backoff ends
        return [QueueWake()]

    def on_catch_up_found(self, now_ms: int, *, startup: bool) -> list[Action]:
        """The database says this destination has rows above its acknowledged position.

        At start-up that is always true catch-up work. Later (the periodic scan) a destination
        with work of its own in hand looks after itself: what it has not been told about is in
        its queue or its transaction in flight."""
        if self._queue.catching_up:
            return []
        busy = self._step is not None or self._queue.retained is not None or bool(self._queue.pdus)
        if busy and not startup:
            return []
        self._queue.catching_up = True
        actions: list[Action] = [EnteredCatchUp("startup" if startup else "missed")]
        if self._queue.retry.backing_off(now_ms):
            return actions + self._next(now_ms)  # woken when the backoff ends
        return [*actions, QueueWake()]

    def on_backoff_restored(self, retry: RetryState) -> None:
        """Start-up: the backoff ``destinations`` holds for it. With nothing queued yet it has no
        queue until the backoff ends (see ``on_pdus``)."""
        self._queue.retry = retry
        if not retry.healthy and self._step is None and not self._queue.has_work():
            self._has_queue = False

    def on_outbox_found(self, now_ms: int) -> list[Action]:
        """Start-up: to-device messages wait for it in the outbox; woken at the bounded rate."""
        self._queue.outbox_pending = True
        if self._queue.retry.backing_off(now_ms):
            return self._next(now_ms)  # woken when the backoff ends
        return [QueueWake()]

    def on_wake(self, now_ms: int) -> list[Action]:
        self._woken(now_ms)
        return self._next(now_ms)

    def on_position(self, position: int, now_ms: int) -> list[Action]:
        """The events stream's position moved to ``position``."""
        if self._awaiting_position is None:
            return []
        if position <= self._awaiting_position:
            # Not past what catch-up saw yet (another writer moved, the linear position did not):
            # the loop forgets a waiter it has woken, so ask again, or nothing ever wakes it.
            return [WaitForPosition(self._awaiting_position)]
        self._awaiting_position = None
        return self._next(now_ms)

    def on_remote_up(self, now_ms: int) -> list[Action]:
        """The destination sent us a request: it is up. Its backoff goes and what waits goes out."""
        actions: list[Action] = []
        if self._queue.on_remote_up():
            # Only a contact that ends a backoff counts: a healthy server that talks to us all
            # the time and fails every transaction must not be resent to in a loop.
            self._contacted_while_sending = isinstance(self.outstanding, SendTransaction)
            self._retry_dirty = True
            actions.append(BackoffCleared("contacted us"))
            if not self._has_queue:
                # It had no queue: what it missed meanwhile is only in destination_rooms.
                self._has_queue = True
                self._queue.catching_up = True
        return actions + self._next(now_ms)

    def on_crashed(self, now_ms: int) -> list[Action]:
        """Carrying out the outstanding request raised unexpectedly (a bug or a lost database).
        It is redone, or decided afresh, after a delay that doubles per crash in a row."""
        step, wake = self._crashed(now_ms)
        if isinstance(step, SendTransaction):
            # No answer is known: resend it as it was (same ID), so the receiver can deduplicate.
            self._in_flight = None
            self._queue.retained = step.txn
        elif isinstance(step, PersistPosition):
            self._resume = step
        elif isinstance(step, PersistRetry):
            self._retry_dirty = True
        elif isinstance(step, ReadOutbox):
            self._queue.outbox_pending = True
        elif isinstance(step, ReadDeviceLists):
            self._queue.device_lists_pending = True
        return wake

    # --- answers to requests -------------------------------------------------------------------

    def on_outbox_read(self, messages: Sequence[OutboxMessage], now_ms: int) -> list[Action]:
        step = self._answer(ReadOutbox)
        if len(messages) >= step.limit:
            self._queue.outbox_pending = True  # more may wait
        self._outbox = tuple(messages)
        return self._next(now_ms)

    def on_device_lists_read(
        self, updates: Sequence[Mapping[str, Any]], upto: int | None, more: bool, now_ms: int,
        signing: Sequence[Mapping[str, Any]] = (),
    ) -> list[Action]:
        """``updates``: ``m.device_list_update`` contents, in stream order; ``signing``:
        ``m.signing_key_update`` contents; ``upto``: the position they cover (None: nothing to
        move it to); ``more``: the read stopped at its limit."""
        self._answer(ReadDeviceLists)
        if more:
            self._queue.device_lists_pending = True
        if updates or signing:
            self._device_lists = (tuple(Edu(DEVICE_LIST_EDU_TYPE, content) for content in updates)
                                  + tuple(Edu(SIGNING_KEY_EDU_TYPE, content) for content in signing))
            self._device_lists_upto = upto
        return self._next(now_ms)

    def on_catch_up_begun(self, catch_up_from: int, last_successful: int, now_ms: int) -> list[Action]:
        self._answer(BeginCatchUp)
        self._catch_up_from = catch_up_from
        self._acked = max(self._acked, last_successful)
        self._done_rooms = {}
        return self._next(now_ms)

    def on_catch_up_rooms(
        self, rooms: Sequence[tuple[str, int]], upto: int, ahead: bool, now_ms: int
    ) -> list[Action]:
        """``rooms``: (room, destination_rooms position) in ascending position, all in (after, upto];
        ``ahead``: rows exist above ``upto`` (persisted, but the stream's position has not passed
        them: an older event of another room is still being written)."""
        self._answer(ReadCatchUpRooms)
        start = self._catch_up_from if self._catch_up_from is not None else self._acked
        if rooms:
            reads = tuple(
                (room_id, position, max(start, self._done_rooms.get(room_id, start))) for room_id, position in rooms
            )
            return self._begin(ReadCatchUpEvents(reads, self._config.catch_up.missed_events_per_room))
        if ahead or self._queue.skipped_upto > upto:
            # Leaving now could skip a room's older events that were never queued: wait for the
            # position to pass what is there (meanwhile EDUs still go out).
            self._awaiting_position = upto
            return [WaitForPosition(upto), *self._next(now_ms)]
        return self._begin(EndCatchUp(upto, self._acked))

    def on_catch_up_events(self, rooms: Sequence[CatchUpRoom], now_ms: int) -> list[Action]:
        """Per room read: its missed events and its latest ones (see ``catch_up.py``)."""
        self._answer(ReadCatchUpEvents)
        self._chunks = deque(plan_chunks(rooms, self._config.max_pdus_per_transaction))
        return self._next(now_ms)

    def on_catch_up_ended(self, now_ms: int) -> list[Action]:
        step = self._answer(EndCatchUp)
        self._catch_up_from = None
        self._done_rooms = {}
        self._forget_catch_up_plan()
        if self._queue.skipped_upto > step.upto:
            # Events came (and were not queued) while the end was being written: look again.
            return self._next(now_ms)
        self._queue.catching_up = False
        return [CaughtUp(step.position), *self._next(now_ms)]

    def on_transaction_accepted(self, errors: Sequence[tuple[str, str]], now_ms: int) -> list[Action]:
        """A 2xx answer; ``errors``: (event ID, error) for each PDU it refused (``pdu_errors``)."""
        step = self._answer(SendTransaction)
        txn = step.txn
        self._in_flight = None
        self._contacted_while_sending = False
        cleared = self._queue.on_success() is not None
        actions: list[Action] = [Accepted(txn)]
        if cleared:
            self._retry_dirty = False  # the position's write clears it
            actions.append(BackoffCleared("answered"))
        refusals = tuple(Refusal(event_id, error, refusal_reason(error)) for event_id, error in errors)
        return actions + self._after_answer(txn, refusals, clear_retry=cleared, now_ms=now_ms)

    def on_transaction_failed(self, status: int | None, error: str, now_ms: int) -> list[Action]:
        """No 2xx answer: ``status`` is the HTTP status, None when no answer came at all."""
        step = self._answer(SendTransaction)
        txn = step.txn
        self._in_flight = None
        contacted, self._contacted_while_sending = self._contacted_while_sending, False
        if not is_unhealthy(status):
            # A refusal of the request itself: resending it would be refused again. The
            # destination did answer about these events, so they count as refused, not lost.
            self._queue.on_rejected()
            refusals = tuple(Refusal(p.event_id, error, "transaction_rejected") for p in txn.pdus)
            rejected = TransactionRejected(txn.txn_id, status, error, len(txn.pdus), len(txn.edus))
            return [rejected, *self._after_answer(txn, refusals, clear_retry=False, now_ms=now_ms)]
        if contacted:
            # It said it is up after this request left (its answer may have been on the way, or
            # the request failed before it came back): a backoff now would keep a server that is
            # up waiting for the whole first interval. Resend the same transaction at once; a
            # second failure backs off as usual.
            self._queue.retained = txn
            return [ResendingAfterContact(txn.txn_id, status, error), *self._next(now_ms)]
        was_catching_up = self._queue.catching_up
        outcome = self._queue.on_failure(
            txn, now_ms=now_ms, unhealthy=True, policy=self._policy, jitter=self._jitter,
            catch_up_threshold_ms=self._threshold_ms,
        )
        self._retry_dirty = True
        actions: list[Action] = [BackingOff(txn.txn_id, status, error, outcome.retry)]
        if outcome.entered_catch_up:
            self._forget_catch_up_plan()
            if not was_catching_up:
                actions.append(EnteredCatchUp("backoff", outcome.dropped_pdus))
        elif txn.catch_up:
            # A catch-up transaction is planned afresh from the database after the backoff
            # (the room's latest events may have moved); keep only its EDUs.
            self._queue.retained = None
            self._forget_catch_up_plan()
            self._queue.put_back_edus([e for e in txn.edus if e.edu_type not in DATABASE_EDU_TYPES])
            if txn.to_device_upto is not None:
                self._queue.outbox_pending = True
            if txn.device_lists_upto is not None:
                self._queue.device_lists_pending = True
        return actions + self._next(now_ms)

    def on_persisted(self, now_ms: int) -> list[Action]:
        step = self._answer(PersistPosition, PersistRetry)
        if isinstance(step, PersistPosition) and step.advance_to is not None:
            self._acked = max(self._acked, step.advance_to)
        return self._next(now_ms)

    # --- deciding what to do next -----------------------------------------------------------------

    def _after_answer(
        self, txn: PlannedTransaction, refusals: tuple[Refusal, ...], *, clear_retry: bool, now_ms: int
    ) -> list[Action]:
        if self._catch_up_from is not None:
            # How far each room got is kept in memory only: the destination answered for these
            # events, so the next round of a room sent in rounds starts after them. A restart
            # starts every room again from catch_up_from (the receiver drops what it has by ID).
            self._done_rooms.update(txn.completed_rooms)
        persist = PersistPosition(txn.txn_id, txn.advance_to, clear_retry, txn.to_device_upto, refusals,
                                  txn.completed_rooms, txn.device_lists_upto)
        if (persist.advance_to is None and not clear_retry and persist.to_device_upto is None and not refusals
                and persist.device_lists_upto is None):
            return self._next(now_ms)
        return self._begin(persist)

    def _persist_retry(self) -> Request:
        return PersistRetry(self._queue.retry)

    def _next(self, now_ms: int) -> list[Action]:
        """What to do now that nothing is outstanding (nothing, while something is)."""
        first = self._before_deciding(now_ms)
        if first is not None:
            return first
        queue = self._queue
        if queue.retry.backing_off(now_ms):
            return self._schedule_wake(queue.retry.retry_at) if queue.has_work() else []
        if queue.retained is not None:
            return self._send(queue.retained)
        if queue.catching_up and not self._chunks and self._awaiting_position is None:
            if self._catch_up_from is None:
                return self._begin(BeginCatchUp())
            return self._begin(ReadCatchUpRooms(self._acked, self._config.catch_up.rooms_per_batch))
        max_edus = self._config.max_edus_per_transaction
        if queue.outbox_pending and self._outbox is None:
            room = max_edus - min(queue.pending_edu_count, max_edus)
            if room > 0:
                queue.outbox_pending = False
                return self._begin(ReadOutbox(room))
        if queue.device_lists_pending and self._device_lists is None:
            room = max_edus - min(queue.pending_edu_count + len(self._outbox or ()), max_edus)
            if room > 0:
                queue.device_lists_pending = False
                return self._begin(ReadDeviceLists(room))
        return self._build(now_ms)

    def _build(self, now_ms: int) -> list[Action]:
        queue = self._queue
        pdus: tuple[PendingPdu, ...] = ()
        advance: int | None = None
        completed: tuple[tuple[str, int], ...] = ()
        catch_up = queue.catching_up
        if catch_up:
            if self._chunks:
                chunk = self._chunks.popleft()
                pdus, advance, completed = chunk.pdus, chunk.advance_to, chunk.completed
        else:
            pdus = tuple(queue.take_pdus(self._config.max_pdus_per_transaction))
            orderings = [p.stream_ordering for p in pdus if p.stream_ordering is not None]
            advance = max(orderings) if orderings else None
        outbox, self._outbox = self._outbox or (), None
        device_lists, self._device_lists = self._device_lists or (), None
        device_lists_upto, self._device_lists_upto = self._device_lists_upto, None
        edus = queue.take_edus(self._config.max_edus_per_transaction - len(outbox) - len(device_lists))
        edus.extend(Edu(TO_DEVICE_EDU_TYPE, message.content) for message in outbox)
        edus.extend(device_lists)
        if not pdus and not edus and advance is None:
            return []
        return self._send(PlannedTransaction(
            txn_id=self._txn_ids.next(),
            pdus=pdus,
            edus=tuple(edus),
            advance_to=advance,
            to_device_upto=outbox[-1].stream_id if outbox else None,
            device_lists_upto=device_lists_upto,
            catch_up=catch_up,
            completed_rooms=completed,
        ))

    def _send(self, txn: PlannedTransaction) -> list[Action]:
        self._in_flight = txn
        return self._begin(SendTransaction(txn))

    def _forget_catch_up_plan(self) -> None:
        self._chunks.clear()
        self._awaiting_position = None
