"""Stream IDs: reserving them, completing them, and the positions that follow from that.

``PositionTracker`` is pure bookkeeping of one stream as one process sees it (the
IDs its local writer has reserved and completed, the positions it has heard of
for other writers) and decides every position; it knows no database and no
Twisted. ``SequenceAllocator`` does ``nextval``; ``load_positions`` builds a
tracker's starting state; ``StreamIdGenerator`` glues them together for async
callers and persists the local writer's position. Which table a fact goes in,
and what it means, is the caller's business (``storage.streams``).

Definitions (docs/streams.md): a writer's position is the largest ID such that
every ID this writer reserved at or below it has completed; the linear position
(``get_current_token``) is the minimum over the configured writers.
"""

# tests: tests/unit/storage/test_position_tracker.py, tests/property/test_id_generators.py,
#        tests/integration/test_streams_generators.py, tests/integration/test_streams_multiprocess.py,
#        tests/integration/test_streams_restart.py

from __future__ import annotations

import heapq
import logging
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, Concatenate, Generic, ParamSpec, Self, TypeVar

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import deferLater
from twisted.python.failure import Failure

from storage.database import Database, Transaction, delay_cancellation, on_reactor, runs_on_reactor
from storage.stores.streams import (
    IdInStatements,
    TableSource,
    advance_sequence_txn,
    get_max_stream_id_txn,
    get_sequence_last_value_txn,
    get_stream_positions_txn,
    get_writing_transactions_txn,
    nextval_txn,
    persist_stream_position_txn,
    sequence_in_statements,
)

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

#: ``callback(stream_name, instance_name, old_position, new_position)``, on the reactor thread.
PositionListener = Callable[[str, str, int, int], None]
#: ``listener(stream_name, count)``: this process wrote ``count`` facts (completed IDs of committed writes).
WrittenListener = Callable[[str, int], None]

#: Seconds between background writes of a busy writer's position to ``stream_positions``.
DEFAULT_PERSIST_INTERVAL = 0.1


class StreamIdError(RuntimeError):
    """The stream ID bookkeeping was used in a way that would break its guarantees."""


class StreamStartupError(RuntimeError):
    """A stream writer cannot safely recover its position at start-up."""


@attrs.frozen(slots=True)
class PositionChange:
    """One writer's position moved forward, from ``old`` to ``new``."""

    instance: str
    old: int
    new: int


# --- the pure core -------------------------------------------------------------------


class PositionTracker:
    """Positions of one stream, as one process sees them. Pure: no I/O, no clock.

    The local writer (``local_instance``, or None in a process that only reads)
    reserves IDs in two steps, because the ``nextval`` round trip happens
    elsewhere: ``begin_reservation()`` before asking the sequence (the ticket's
    *floor* is the largest ID seen so far, and every ID the sequence hands out
    afterwards is above it), then ``allocated(ids, ticket)`` when the IDs arrive,
    or ``cancel_reservation(ticket)`` if they never do (IDs the sequence handed
    out for a cancelled ticket are never used, so they count as completed).
    ``finished(ids)`` completes IDs; ``finish_reservation`` allocates and
    completes at once (IDs reserved and written inside one transaction).

    The local writer's position is the largest value that is at most the
    largest ID seen, below every unfinished ID, and at most the floor of every
    pending ticket; it never goes down. With nothing in flight that is the
    largest ID seen anywhere: an idle writer may claim it, since every ID it
    reserves later comes from the sequence and is above it.

    Other writers' positions only move by ``advance(instance, position)``
    (from replication, or the database). Every mutating method returns the
    position changes it caused, oldest first.
    """

    def __init__(
        self,
        *,
        writers: Iterable[str],
        positions: Mapping[str, int] | None = None,
        local_instance: str | None = None,
        max_seen: int = 0,
    ) -> None:
        self._writers = tuple(dict.fromkeys(writers))
        if not self._writers:
            raise ValueError("a stream needs at least one writer")
        if local_instance is not None and local_instance not in self._writers:
            raise ValueError(f"local writer {local_instance!r} is not one of the writers {list(self._writers)}")
        self._positions: dict[str, int] = {writer: 0 for writer in self._writers}
        for instance, position in (positions or {}).items():
            self._positions[instance] = _check_id(position, f"the position of {instance!r}")
        self._local = local_instance
        self._max_seen = max(_check_id(max_seen, "max_seen"), *self._positions.values())
        # Unfinished IDs of the local writer: a min-heap with lazy deletion, and the live set.
        self._in_flight_heap: list[int] = []
        self._in_flight: set[int] = set()
        # Pending tickets: their floors never decrease with creation order, so the
        # oldest live ticket holds the smallest floor.
        self._ticket_floors: dict[int, int] = {}
        self._ticket_order: deque[int] = deque()
        self._next_ticket = 1
        self._recompute_local()

    # --- queries ---

    @property
    def local_instance(self) -> str | None:
        return self._local

    @property
    def writers(self) -> tuple[str, ...]:
        return self._writers

    @property
    def max_seen(self) -> int:
        """The largest stream ID this process knows the sequence has handed out."""
        return self._max_seen

    def get_position(self, instance: str) -> int:
        """A writer's position as this process knows it (0 for one never heard of)."""
        return self._positions.get(instance, 0)

    def get_positions(self) -> dict[str, int]:
        """Every known writer's position, including writers no longer configured."""
        return dict(self._positions)

    def get_current_token(self) -> int:
        """The linear position: every fact at or below it, from any writer, has completed."""
        return min(self._positions[writer] for writer in self._writers)

    def get_max_position(self) -> int:
        """The largest position of any configured writer."""
        return max(self._positions[writer] for writer in self._writers)

    def unfinished_ids(self) -> list[int]:
        """The local writer's reserved, not yet completed IDs, ascending."""
        return sorted(self._in_flight)

    @property
    def pending_reservations(self) -> int:
        return len(self._ticket_floors)

    # --- the local writer ---

    def _require_local(self) -> str:
        if self._local is None:
            raise StreamIdError("this process is not a writer of the stream; it cannot reserve IDs")
        return self._local

    def begin_reservation(self) -> int:
        """Start reserving IDs; returns a ticket for ``allocated``/``cancel_reservation``."""
        self._require_local()
        ticket = self._next_ticket
        self._next_ticket += 1
        self._ticket_floors[ticket] = self._max_seen
        self._ticket_order.append(ticket)
        return ticket

    def _end_ticket(self, ticket: int) -> int:
        try:
            return self._ticket_floors.pop(ticket)
        except KeyError:
            raise StreamIdError(f"reservation ticket {ticket} is not pending") from None

    def allocated(self, ids: Iterable[int], ticket: int | None = None) -> list[PositionChange]:
        """The sequence handed out ``ids`` to the local writer (for ``ticket``, if given)."""
        local = self._require_local()
        new_ids = [_check_id(i, "a stream ID") for i in ids]
        floor = self._end_ticket(ticket) if ticket is not None else None
        position = self._positions[local]
        for stream_id in new_ids:
            if stream_id <= position or (floor is not None and stream_id <= floor) or stream_id in self._in_flight:
                raise StreamIdError(
                    f"stream ID {stream_id} cannot be new: the position is {position}, the ticket's floor "
                    f"{floor}; is the stream's sequence shared with something else or was it reset?"
                )
        for stream_id in new_ids:
            self._in_flight.add(stream_id)
            heapq.heappush(self._in_flight_heap, stream_id)
            if stream_id > self._max_seen:
                self._max_seen = stream_id
        return self._recompute_local()

    def finished(self, ids: Iterable[int]) -> list[PositionChange]:
        """The local writer completed ``ids`` (committed, rolled back or abandoned alike)."""
        self._require_local()
        done = list(ids)
        for stream_id in done:
            if stream_id not in self._in_flight:
                raise StreamIdError(f"stream ID {stream_id} was not reserved, or was already completed")
            self._in_flight.discard(stream_id)
        return self._recompute_local()

    def cancel_reservation(self, ticket: int) -> list[PositionChange]:
        """The IDs for ``ticket`` never arrived (or arrived and will never be used)."""
        self._require_local()
        self._end_ticket(ticket)
        return self._recompute_local()

    def finish_reservation(self, ticket: int, ids: Iterable[int]) -> list[PositionChange]:
        """``ids`` (maybe none) were reserved for ``ticket`` and are all complete already."""
        done = list(ids)
        changes = self.allocated(done, ticket)
        return changes + self.finished(done)

    # --- everyone ---

    def advance(self, instance: str, position: int) -> list[PositionChange]:
        """We learned that ``instance`` is at ``position`` (older news is ignored).

        For the local writer itself (an echo) this only records that the
        position's IDs exist; its position is always computed here.
        """
        _check_id(position, f"the position of {instance!r}")
        changes: list[PositionChange] = []
        if position > self._max_seen:
            self._max_seen = position
        if instance != self._local:
            old = self._positions.get(instance, 0)
            if position > old:
                self._positions[instance] = position
                changes.append(PositionChange(instance, old, position))
        return changes + self._recompute_local()

    def note_seen(self, stream_id: int) -> list[PositionChange]:
        """The sequence has handed out ``stream_id`` (e.g. read from the sequence itself)."""
        if _check_id(stream_id, "a stream ID") > self._max_seen:
            self._max_seen = stream_id
        return self._recompute_local()

    def _recompute_local(self) -> list[PositionChange]:
        local = self._local
        if local is None:
            return []
        candidate = self._max_seen
        heap = self._in_flight_heap
        while heap and heap[0] not in self._in_flight:
            heapq.heappop(heap)
        if heap:
            candidate = min(candidate, heap[0] - 1)
        order = self._ticket_order
        while order and order[0] not in self._ticket_floors:
            order.popleft()
        if order:
            candidate = min(candidate, self._ticket_floors[order[0]])
        old = self._positions[local]
        if candidate > old:
            self._positions[local] = candidate
            return [PositionChange(local, old, candidate)]
        return []


def _check_id(value: object, what: str) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{what} must be a non-negative int, got {value!r}")
    return value


# --- Twisted helpers -----------------------------------------------------------------


def _run_in_background(name: str, coro: Coroutine[Any, Any, None]) -> Deferred[None]:
    """Run a coroutine on the reactor, logging (never raising) its failure."""

    def failed(failure: Failure) -> None:
        logger.error("background task %s failed: %s", name, failure.getTraceback())

    d = Deferred.fromCoroutine(coro)
    d.addErrback(failed)
    return d


# --- the sequence ----------------------------------------------------------------------


@attrs.define
class _AllocationRequest:
    count: int
    deferred: Deferred[list[int]]


class SequenceAllocator:
    """Reserves IDs from one PostgreSQL sequence with ``nextval``.

    Concurrent requests are coalesced: while one round trip is in flight, new
    requests queue and the next round trip serves them all
    (``nextval`` over ``generate_series``), so a burst of single-ID requests
    costs a few round trips, not one each.
    """

    def __init__(self, db: Database, sequence: str) -> None:
        self._db = db
        self.sequence = sequence
        self._queue: list[_AllocationRequest] = []
        self._running = False

    def allocate_txn(self, txn: Transaction, count: int) -> list[int]:
        """Reserve ``count`` IDs inside the caller's transaction."""
        return nextval_txn(txn, self.sequence, count)

    def allocate(self, count: int) -> Deferred[list[int]]:
        """Reserve ``count`` IDs (ascending); cancellable while queued."""
        if count < 1:
            raise ValueError(f"count must be at least 1, got {count}")

        def cancel(d: Deferred[list[int]]) -> None:
            self._queue = [r for r in self._queue if r.deferred is not d]

        request = _AllocationRequest(count, Deferred(canceller=cancel))
        self._queue.append(request)
        if not self._running:
            self._running = True
            _run_in_background(f"allocate {self.sequence}", self._serve())
        return request.deferred

    async def _serve(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                total = sum(r.count for r in batch)
                try:
                    # nextval is never rolled back, so it needs no transaction: one round trip.
                    ids = await self._db.run_autocommit("stream_nextval", nextval_txn, self.sequence, total)
                except Exception:
                    failure = Failure()
                    for request in batch:
                        if not request.deferred.called:
                            request.deferred.errback(failure)
                    continue
                start = 0
                for request in batch:
                    share = ids[start : start + request.count]
                    start += request.count
                    if not request.deferred.called:  # else: cancelled in flight; its IDs stay unused
                        request.deferred.callback(share)
        finally:
            self._running = False


# --- start-up --------------------------------------------------------------------------


async def wait_for_older_transactions(
    db: Database, clock: IReactorTime, *, timeout: float = 300.0, poll_interval: float = 0.05
) -> None:
    """Wait until every transaction that had written something when we were called has ended.

    This is what makes a restarted writer safe: the previous process's
    transactions may still be open (a backend whose client was killed notices at
    its next read) or committing (a COMMIT sent just before the kill). Only
    those that hold a transaction ID can still commit rows, and they are listed
    here. Read-only transactions are not waited for.
    """
    waiting = await db.run_interaction("stream_startup_barrier", get_writing_transactions_txn)
    started = clock.seconds()
    last_log = started
    while waiting:
        await deferLater(clock, poll_interval, lambda: None)
        waiting &= await db.run_interaction("stream_startup_barrier", get_writing_transactions_txn)
        now = clock.seconds()
        if waiting and now - started > timeout:
            raise StreamStartupError(
                f"{len(waiting)} transaction(s) that were open at start-up are still running after "
                f"{timeout:.0f}s (backend pids {sorted(p for p, _ in waiting)}); a stream writer cannot know "
                "its position until they end. Wait for them or end them with pg_terminate_backend(pid)."
            )
        if waiting and now - last_log >= 10:
            last_log = now
            logger.info("stream start-up waiting for %d older transaction(s) to end", len(waiting))


def _load_positions_txn(
    txn: Transaction, stream_name: str, sequence: str, tables: Sequence[TableSource], fix_sequence: bool
) -> tuple[dict[str, int], int]:
    positions = get_stream_positions_txn(txn, stream_name)
    last_value = get_sequence_last_value_txn(txn, sequence)
    if fix_sequence:
        highest = max([*positions.values(), *(get_max_stream_id_txn(txn, t) for t in tables)], default=0)
        if highest > last_value:
            logger.warning(
                "stream %s: sequence %s is at %d but IDs up to %d are in use; moving it forward",
                stream_name,
                sequence,
                last_value,
                highest,
            )
            advance_sequence_txn(txn, sequence, highest)
            last_value = highest
    return positions, last_value


async def load_positions(
    db: Database,
    clock: IReactorTime,
    *,
    stream_name: str,
    sequence: str,
    writers: Sequence[str],
    instance_name: str | None,
    tables: Sequence[TableSource] = (),
    barrier_timeout: float = 300.0,
) -> PositionTracker:
    """The starting state of a stream's tracker, from ``stream_positions`` and the sequence.

    Readers start from every writer's persisted position (a lower bound of the
    real one; replication brings them forward). A writer (``instance_name`` in
    ``writers``) first waits for every older writing transaction to end
    (``wait_for_older_transactions``): after that, every ID its previous
    incarnation reserved is either written or never will be, so it may claim the
    sequence's current value as its position, exactly like an idle writer.
    It also moves the sequence forward if it is behind the IDs in use
    (a restored dump, a hand edit).
    """
    is_writer = instance_name is not None and instance_name in writers
    if is_writer:
        await wait_for_older_transactions(db, clock, timeout=barrier_timeout)
    positions, last_value = await db.run_interaction(
        "load_stream_positions", _load_positions_txn, stream_name, sequence, tables, is_writer
    )
    return PositionTracker(
        writers=writers,
        positions=positions,
        local_instance=instance_name if is_writer else None,
        max_seen=max(last_value, 0),
    )


# --- the generator ---------------------------------------------------------------------


@attrs.define
class _TxnReservation:
    ticket: int
    ids: list[int] = attrs.Factory(list)


class _Reservation(Generic[T]):
    """``async with``: reserve on entry, complete on exit whatever happened inside."""

    def __init__(self, generator: StreamIdGenerator, count: int, result: Callable[[list[int]], T]) -> None:
        self._generator = generator
        self._count = count
        self._result = result
        self._ids: list[int] | None = None

    async def __aenter__(self) -> T:
        if self._ids is not None:
            raise StreamIdError("a reservation context cannot be entered twice")
        self._ids = await self._generator._reserve(self._count)
        return self._result(self._ids)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        ids, self._ids = self._ids, []
        if ids:
            self._generator._complete(ids)
            if exc_type is None:
                self._generator._note_written(len(ids))


class StreamIdGenerator:
    """Stream IDs and positions of one stream, in one process.

    Writers reserve with ``async with gen.get_next() as stream_id:`` (or
    ``get_next_mult(n)``) around writing the fact; the IDs complete when the
    block exits, also on error or cancellation. Alternatively reserve inside
    the transaction that writes the fact: ``gen.run_interaction(name, func)``
    with ``gen.get_next_txn(txn)`` in ``func``.

    Every position change is passed to the listeners added with
    ``add_position_listener`` (replication sends them on; the notifier wakes
    waiters). The local writer's position is persisted in ``stream_positions``
    in the background, coalesced: at most one write in flight, always of the
    newest position, and (given a clock) at most one per ``persist_interval``
    while the position keeps moving. ``flush()`` writes it now. Use ``create``
    to build one.
    """

    def __init__(
        self,
        *,
        db: Database,
        stream_name: str,
        sequence: str,
        tracker: PositionTracker,
        persisted_position: int = 0,
        persist: bool = True,
        clock: IReactorTime | None = None,
        persist_interval: float = DEFAULT_PERSIST_INTERVAL,
    ) -> None:
        self._db = db
        self._clock = clock
        self._persist_interval = persist_interval
        self.stream_name = stream_name
        self._tracker = tracker
        self._allocator = SequenceAllocator(db, sequence)
        self._listeners: list[PositionListener] = []
        self._written_listeners: list[WrittenListener] = []
        self._txn_reservations: dict[int, _TxnReservation] = {}
        self._persist = persist and tracker.local_instance is not None
        self._persisted = persisted_position
        self._persisting = False
        self._flushing = False
        self._persist_waiters: list[Deferred[None]] = []

    @classmethod
    async def create(
        cls,
        db: Database,
        clock: IReactorTime,
        *,
        stream_name: str,
        sequence: str,
        instance_name: str,
        writers: Sequence[str],
        tables: Sequence[TableSource] = (),
        persist: bool = True,
        barrier_timeout: float = 300.0,
        persist_interval: float = DEFAULT_PERSIST_INTERVAL,
    ) -> Self:
        """Load the stream's positions (see ``load_positions``) and, for a writer, persist its own."""
        tracker = await load_positions(
            db,
            clock,
            stream_name=stream_name,
            sequence=sequence,
            writers=writers,
            instance_name=instance_name,
            tables=tables,
            barrier_timeout=barrier_timeout,
        )
        persisted = await db.run_interaction("get_stream_positions", get_stream_positions_txn, stream_name)
        generator = cls(
            db=db,
            stream_name=stream_name,
            sequence=sequence,
            tracker=tracker,
            # -1 when the writer has no row yet: flush() then records its start.
            persisted_position=persisted.get(instance_name, -1),
            persist=persist,
            clock=clock,
            persist_interval=persist_interval,
        )
        if generator._persist:
            await generator.flush()
        return generator

    # --- introspection ---

    @property
    def instance_name(self) -> str | None:
        """The local writer, or None when this process only reads the stream."""
        return self._tracker.local_instance

    @property
    def writers(self) -> tuple[str, ...]:
        return self._tracker.writers

    @property
    def tracker(self) -> PositionTracker:
        return self._tracker

    # --- reading positions ---

    def get_current_token(self) -> int:
        """The linear position: every writer's facts at or below it have completed."""
        return self._tracker.get_current_token()

    def get_max_position(self) -> int:
        """The largest position of any writer."""
        return self._tracker.get_max_position()

    def get_position(self, instance: str) -> int:
        """One writer's position, as this process knows it."""
        return self._tracker.get_position(instance)

    def get_positions(self) -> dict[str, int]:
        """Every writer's position (the vector of a vector-clock token)."""
        return self._tracker.get_positions()

    def get_local_position(self) -> int:
        """The local writer's own position (what it announces in POSITION)."""
        local = self._tracker.local_instance
        if local is None:
            raise StreamIdError(f"this process does not write stream {self.stream_name}")
        return self._tracker.get_position(local)

    def advance(self, instance: str, position: int) -> None:
        """Replication (or a poll of ``stream_positions``) says ``instance`` is at ``position``."""
        self._apply(self._tracker.advance(instance, position))

    def add_position_listener(self, listener: PositionListener) -> None:
        """Call ``listener(stream_name, instance, old, new)`` whenever a position moves forward."""
        self._listeners.append(listener)

    def remove_position_listener(self, listener: PositionListener) -> None:
        self._listeners.remove(listener)

    def add_written_listener(self, listener: WrittenListener) -> None:
        """Call ``listener(stream_name, count)`` when IDs this process reserved complete
        after a successful write (a failed transaction or block counts nothing)."""
        self._written_listeners.append(listener)

    def _note_written(self, count: int) -> None:
        if not count:
            return
        for listener in list(self._written_listeners):
            try:
                listener(self.stream_name, count)
            except Exception:
                logger.exception("stream %s: written listener %r failed", self.stream_name, listener)

    # --- reserving ---

    def get_next(self) -> _Reservation[int]:
        """``async with gen.get_next() as stream_id:`` reserves one ID, completed on exit."""
        return _Reservation(self, 1, lambda ids: ids[0])

    def get_next_mult(self, count: int) -> _Reservation[list[int]]:
        """``async with gen.get_next_mult(n) as ids:`` reserves ``n`` ascending IDs."""
        if count < 1:
            raise ValueError(f"count must be at least 1, got {count}")
        return _Reservation(self, count, list)

    async def _reserve(self, count: int) -> list[int]:
        ticket = self._tracker.begin_reservation()
        try:
            ids = await self._allocator.allocate(count)
        except BaseException:
            self._apply(self._tracker.cancel_reservation(ticket))
            raise
        self._apply(self._tracker.allocated(ids, ticket))
        return ids

    def _complete(self, ids: list[int]) -> None:
        self._apply(self._tracker.finished(ids))

    async def run_interaction(
        self, name: str, func: Callable[Concatenate[Transaction, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> R:
        """Run ``func(txn, ...)`` in a transaction in which ``get_next_txn(txn)`` may reserve IDs.

        The IDs complete when the transaction has ended (after its ``call_after``
        callbacks), also when it fails, is retried, or our caller is cancelled
        (the call then returns only once the transaction has ended).
        """
        return await run_interaction_with_streams(self._db, name, (self,), func, *args, **kwargs)

    def get_next_txn(self, txn: Transaction) -> int:
        """One ID, reserved in ``txn`` (which must come from ``run_interaction``)."""
        return self.get_next_mult_txn(txn, 1)[0]

    def get_next_mult_txn(self, txn: Transaction, count: int) -> list[int]:
        """``count`` IDs, reserved in ``txn`` (which must come from ``run_interaction``)."""
        reservation = self._reservation_of(txn)
        ids = self._allocator.allocate_txn(txn, count)
        reservation.ids.extend(ids)  # on the pool thread; read on the reactor once the txn has ended
        return ids

    def get_next_in_statements_txn(self, txn: Transaction) -> IdInStatements:
        """One ID that ``txn``'s next round trip of statements takes from the sequence itself
        (``IdInStatements``), saving ``get_next_txn``'s round trip; ``txn`` must come from
        ``run_interaction``. The statements end with the COMMIT and ``read``, and the caller
        hands the ID read to ``recorded``: the ID is then reserved as ``get_next_txn``'s
        would be, completing when the transaction has ended. An ID the sequence gave to
        statements that failed is never used, and never recorded."""
        reservation = self._reservation_of(txn)
        return IdInStatements(*sequence_in_statements(self._allocator.sequence), reservation.ids)

    def _reservation_of(self, txn: Transaction) -> _TxnReservation:
        reservation = self._txn_reservations.get(id(txn))
        if reservation is None:
            raise StreamIdError(
                f"get_next_txn on stream {self.stream_name} needs a transaction started by "
                "run_interaction / run_interaction_with_streams including this stream, not Database.run_interaction"
            )
        return reservation

    def _begin_txn_reservation(self) -> _TxnReservation:
        return _TxnReservation(self._tracker.begin_reservation())

    def _bind(self, txn: Transaction, reservation: _TxnReservation) -> None:
        self._txn_reservations[id(txn)] = reservation

    def _unbind(self, txn: Transaction) -> None:
        self._txn_reservations.pop(id(txn), None)

    def _end_txn_reservation(self, reservation: _TxnReservation, *, committed: bool = False) -> None:
        self._apply(self._tracker.finish_reservation(reservation.ticket, reservation.ids))
        if committed:
            self._note_written(len(reservation.ids))

    # --- position changes ---

    def _apply(self, changes: list[PositionChange]) -> None:
        local = self._tracker.local_instance
        for change in changes:
            for listener in list(self._listeners):
                try:
                    listener(self.stream_name, change.instance, change.old, change.new)
                except Exception:
                    logger.exception("stream %s: position listener %r failed", self.stream_name, listener)
            if change.instance == local and self._persist and not self._persisting:
                self._persisting = True
                _run_in_background(f"persist {self.stream_name} position", self._persist_loop())

    async def _persist_loop(self) -> None:
        local = self._tracker.local_instance
        assert local is not None
        try:
            while (position := self._tracker.get_position(local)) > self._persisted:
                await self._db.run_interaction(
                    "persist_stream_position", persist_stream_position_txn, self.stream_name, local, position
                )
                self._persisted = position
                if self._clock is not None and self._persist_interval > 0 and not self._flushing:
                    # Space writes at least an interval apart: whatever the
                    # position does meanwhile is coalesced into the next one.
                    # (Waiting only when busy let a steady writer persist on
                    # every single fact.)
                    await deferLater(self._clock, self._persist_interval, lambda: None)
        except Exception as e:
            # The next position change (or flush) tries again; a stale persisted
            # position is only ever behind, never wrong.
            logger.warning("stream %s: could not persist position: %s", self.stream_name, e)
        finally:
            self._persisting = False
            waiters, self._persist_waiters = self._persist_waiters, []
            for waiter in waiters:
                waiter.callback(None)

    async def flush(self) -> None:
        """Persist the local writer's current position now (e.g. before shutting down)."""
        local = self._tracker.local_instance
        if local is None or not self._persist:
            return
        self._flushing = True  # a running background write skips its pause
        try:
            while self._persisting:
                waiter: Deferred[None] = Deferred()
                self._persist_waiters.append(waiter)
                await waiter
            position = self._tracker.get_position(local)
            if position > self._persisted:
                self._persisting = True
                await self._persist_loop()
                if position > self._persisted:
                    raise StreamIdError(f"stream {self.stream_name}: could not persist position {position}")
        finally:
            self._flushing = False


class MultiWriterIdGenerator(StreamIdGenerator):
    """A stream any of several configured instances may write (events, caches, receipts...)."""


class SingleWriterIdGenerator(StreamIdGenerator):
    """A stream with exactly one writer; other processes read it."""

    @classmethod
    async def create_single(
        cls,
        db: Database,
        clock: IReactorTime,
        *,
        stream_name: str,
        sequence: str,
        instance_name: str,
        writer: str,
        tables: Sequence[TableSource] = (),
        persist: bool = True,
        barrier_timeout: float = 300.0,
        persist_interval: float = DEFAULT_PERSIST_INTERVAL,
    ) -> Self:
        return await cls.create(
            db,
            clock,
            stream_name=stream_name,
            sequence=sequence,
            instance_name=instance_name,
            writers=(writer,),
            tables=tables,
            persist=persist,
            barrier_timeout=barrier_timeout,
            persist_interval=persist_interval,
        )

    def advance(self, instance: str, position: int) -> None:
        if instance != self.writers[0]:
            raise StreamIdError(
                f"stream {self.stream_name} has the single writer {self.writers[0]!r}; "
                f"got a position from {instance!r}"
            )
        super().advance(instance, position)


async def run_interaction_with_streams(
    db: Database,
    name: str,
    generators: Sequence[StreamIdGenerator],
    func: Callable[Concatenate[Transaction, P], R],
    *args: P.args,
    **kwargs: P.kwargs,
) -> R:
    """``db.run_interaction`` in which ``gen.get_next_txn(txn)`` works for every given generator.

    Each generator holds back its position (a pending reservation) while the
    transaction runs; the IDs the transaction reserved, in every attempt
    (retries included), complete once it has ended for good, after its
    ``call_after`` callbacks. If our caller is cancelled, we still wait for the
    transaction (``delay_cancellation``): its IDs must not complete while it
    could still commit.
    """
    if len({id(g) for g in generators}) != len(generators):
        raise ValueError("each generator may be given once")
    reservations: list[tuple[StreamIdGenerator, _TxnReservation]] = []
    try:
        for gen in generators:
            reservations.append((gen, gen._begin_txn_reservation()))
    except BaseException:
        for gen, reservation in reservations:
            gen._end_txn_reservation(reservation)
        raise

    def in_txn(txn: Transaction, /, *a: P.args, **kw: P.kwargs) -> R:
        for gen, reservation in reservations:
            gen._bind(txn, reservation)
        try:
            return func(txn, *a, **kw)
        finally:
            for gen, _ in reservations:
                gen._unbind(txn)

    if runs_on_reactor(func):
        on_reactor(in_txn)

    def complete(result: T) -> T:
        committed = not isinstance(result, Failure)
        for gen, reservation in reservations:
            gen._end_txn_reservation(reservation, committed=committed)
        return result

    d = Deferred.fromCoroutine(db.run_interaction(name, in_txn, *args, **kwargs))
    d.addBoth(complete)
    return await delay_cancellation(d)
