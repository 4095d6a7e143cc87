"""The federation sender: fans new local events out to destination queues and runs each queue's loop.

I/O lives here: reading new events and catch-up data from the store, sending
``PUT /send`` through an injected transport, timers on an injected clock.
What each destination sends next, how it backs off and when it catches up is
decided by ``queue.py`` and ``catch_up.py``.

Flow: ``notify_new_events(upto)`` reads the local events in (position, upto]
in stream order (``events.destinations`` says who each is for) and hands each
to its destinations' queues. A queue with work runs one loop, which holds at
most one transaction in flight; every loop takes a slot of a global
semaphore per transaction, so the number of requests in flight is bounded and
destinations take turns (the semaphore is first come, first served). A loop
that raises is logged and restarted with its own backoff; it never touches
other destinations. Queues touched before ``start()`` wait and start with it.
"""

# tests: tests/unit/federation_sender/test_sender.py, tests/integration/test_federation_sender.py

from __future__ import annotations

import itertools
import json
import logging
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from twisted.internet.defer import CancelledError, Deferred, DeferredSemaphore
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.task import LoopingCall
from twisted.python.failure import Failure

from federation_sender.backoff import HEALTHY, Jitter, RetryState, is_unhealthy, policy_from_config
from federation_sender.config import FederationSenderConfig
from federation_sender.catch_up import CatchUpChunk, CatchUpRoom, plan_chunks
from federation_sender.metrics import FederationSenderMetrics
from federation_sender.transport import TransactionFailed, Transport
from federation_sender.queue import (
    TO_DEVICE_EDU_TYPE,
    Added,
    Edu,
    PendingPdu,
    PerDestinationQueue,
    PlannedTransaction,
)
from storage.kernel.logcontext import log_context
from storage.stores.federation_sender import CatchUpEvent, FederationSenderStore

logger = logging.getLogger(__name__)

FANOUT_BATCH = 1000
# A loop that raised waits this long before restarting, doubling per crash in a row.
SUPERVISION_FIRST_DELAY = 1.0
SUPERVISION_MAX_DELAY = 300.0


def _pending(event: CatchUpEvent, now: float) -> PendingPdu:
    return PendingPdu(event.event_id, event.room_id, event.stream_ordering, json.loads(event.pdu_json), now)


class FederationSender:
    def __init__(
        self,
        *,
        server_name: str,
        config: FederationSenderConfig,
        store: FederationSenderStore,
        transport: Transport,
        clock: IReactorTime,
        current_position: Callable[[], int],
        metrics: FederationSenderMetrics,
        joined_servers: Callable[[str], Awaitable[set[str]]] | None = None,
        should_handle: Callable[[str], bool] = lambda destination: True,
        jitter: Jitter = random.uniform,
    ) -> None:
        self._server_name = server_name
        self._config = config
        self._store = store
        self._transport = transport
        self._clock = clock
        self._current_position = current_position
        self._metrics = metrics
        self._joined_servers = joined_servers
        self._should_handle = should_handle
        self._jitter = jitter
        self._policy = policy_from_config(config.backoff)
        self._threshold_ms = int(config.catch_up.threshold.total_seconds() * 1000)
        self._semaphore = DeferredSemaphore(config.max_concurrent_transactions)

        self._started = False
        self._stopping = False
        self._queues: dict[str, PerDestinationQueue] = {}
        self._loops: dict[str, Deferred[None]] = {}
        self._retry_timers: dict[str, IDelayedCall] = {}
        # Backoff of destinations that have no queue (a queue carries its own).
        self._retry: dict[str, RetryState] = {}
        # Destinations to start in catch-up when their queue is next created.
        self._needs_catch_up: set[str] = set()
        # Destinations whose to-device outbox may hold messages.
        self._outbox: set[str] = set()
        self._catch_up_chunks: dict[str, deque[CatchUpChunk]] = {}
        # Per destination, destinations.last_successful_stream_ordering as last read or written.
        self._last_successful: dict[str, int] = {}
        # Per destination in catch-up: where it began (destinations.catch_up_from), and the rooms
        # it has finished since, with their positions (their missed events start there).
        self._catch_up_from: dict[str, int] = {}
        self._catch_up_done: dict[str, dict[str, int]] = {}

        self._position = 0
        self._fanout_target = 0
        self._fanout: Deferred[None] | None = None

        self._wake_queue: deque[str] = deque()
        self._waker: LoopingCall | None = None
        self._scanner: LoopingCall | None = None
        self._background: set[Deferred[Any]] = set()
        self._receipts: dict[str, tuple[set[str], dict[str, Any]]] = {}
        self._receipt_timer: IDelayedCall | None = None

        self._txn_ids = itertools.count()
        self._txn_prefix = str(int(clock.seconds() * 1000))

        metrics.pending_pdus.set_function(lambda: sum(len(q.pdus) for q in self._queues.values()))
        metrics.pending_edus.set_function(lambda: sum(q.pending_edu_count for q in self._queues.values()))
        metrics.catching_up.set_function(
            lambda: sum(1 for q in self._queues.values() if q.catching_up) + len(self._needs_catch_up)
        )
        metrics.backing_off.set_function(
            lambda: sum(1 for q in self._queues.values() if not q.retry.healthy) + len(self._retry)
        )
        metrics.oldest_pending_age.set_function(self._oldest_pending_age)

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Load backoffs, find destinations to catch up, and start every queue that waits."""
        self._position = self._fanout_target = max(self._fanout_target, self._current_position())
        self._metrics.position.set(self._position)
        for row in await self._store.get_backing_off():
            if self._should_handle(row.destination):
                state = RetryState(row.retry_last_ts, row.retry_interval, row.failure_ts)
                queue = self._queues.get(row.destination)
                if queue is not None:
                    queue.retry = state
                else:
                    self._retry[row.destination] = state
        self._outbox.update(d for d in await self._store.get_outbox_destinations() if self._should_handle(d))
        needing = await self._find_catch_up(reason="startup")
        logger.info(
            "federation sender started at position %d: %d destinations to catch up, %d backing off",
            self._position, needing, len(self._retry),
        )
        self._started = True
        for destination in sorted(self._outbox):
            self._schedule_wake(destination)
        for queue in list(self._queues.values()):
            self._kick(queue)
        self._scanner = LoopingCall(self._scan)
        self._scanner.clock = self._clock
        self._scanner.start(self._config.catch_up.scan_interval.total_seconds(), now=False).addErrback(
            lambda f: logger.error("catch-up scanner stopped: %s", f.getTraceback())
        )
        if self._fanout_target > self._position:
            self._start_fanout()

    async def stop(self) -> None:
        self._stopping = True
        for call in (self._scanner, self._waker):
            if call is not None and call.running:
                call.stop()
        for timer in list(self._retry_timers.values()) + ([self._receipt_timer] if self._receipt_timer else []):
            if timer.active():
                timer.cancel()
        self._retry_timers.clear()
        pending = [d for d in [*self._loops.values(), *self._background, self._fanout] if d is not None]
        for d in pending:
            d.cancel()
        for d in pending:
            try:
                await d
            except (CancelledError, Exception):
                pass

    async def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until no loop runs and the fan-out is done (tests and benchmarks)."""
        deadline = self._clock.seconds() + timeout
        while self._loops or self._fanout is not None or self._fanout_target > self._position:
            if self._clock.seconds() > deadline:
                raise TimeoutError(f"federation sender still busy: {sorted(self._loops)}")
            d: Deferred[None] = Deferred()
            self._clock.callLater(0.01, d.callback, None)
            await d

    # --- input: events ---------------------------------------------------------------------

    def notify_new_events(self, upto: int) -> None:
        """Local events up to ``upto`` are persisted (the events stream's current token): fan them out."""
        if upto <= self._fanout_target:
            return
        self._fanout_target = upto
        if self._started and self._fanout is None:
            self._start_fanout()

    def _start_fanout(self) -> None:
        d = Deferred.fromCoroutine(self._run_fanout())
        self._fanout = d

        def done(result: object) -> None:
            self._fanout = None

        d.addBoth(done)

    async def _run_fanout(self) -> None:
        while self._position < self._fanout_target and not self._stopping:
            target = self._fanout_target
            try:
                rows = await self._store.get_fanout_events(self._position, target, FANOUT_BATCH)
            except CancelledError:
                raise
            except Exception:
                logger.exception("reading new events to send failed; retrying in 1s")
                await self._sleep(1.0)
                continue
            now = self._clock.seconds()
            for row in rows:
                pdu = PendingPdu(row.event_id, row.room_id, row.stream_ordering, json.loads(row.pdu_json), now)
                for destination in row.destinations:
                    if destination != self._server_name and self._should_handle(destination):
                        self._enqueue_pdu(destination, pdu)
            self._position = rows[-1].stream_ordering if len(rows) == FANOUT_BATCH else target
            self._metrics.position.set(self._position)

    def send_pdu(self, pdu: Mapping[str, Any], destinations: Iterable[str]) -> None:
        """Send an event that is not one of our new local events (a remote server's join we
        accepted as the resident server); it does not move catch-up positions."""
        pending = PendingPdu(str(pdu.get("event_id", "")), str(pdu.get("room_id", "")), None, pdu,
                             self._clock.seconds())
        for destination in set(destinations):
            if destination != self._server_name and self._should_handle(destination):
                self._enqueue_pdu(destination, pending)

    def forward(self, event: Any, origin: str) -> None:
        """``send_join``/``send_leave`` hook: as the resident server, pass a remote member's event to
        the room's other servers (they have no other way to hear of it)."""
        if self._joined_servers is None:
            return
        lookup = self._joined_servers

        async def run() -> None:
            servers = await lookup(event.room_id)
            if event.type == "m.room.member" and event.state_key:
                servers.add(event.state_key.split(":", 1)[1])
            self.send_pdu(event.get_pdu_json(), servers - {origin, self._server_name})

        self._run_in_background(f"forward {event.event_id}", run())

    def _enqueue_pdu(self, destination: str, pdu: PendingPdu) -> None:
        queue = self._queue(destination, create=True)
        if queue is None:
            # Backing off with no queue: nothing is queued; catch-up finds it later.
            if destination not in self._needs_catch_up and pdu.stream_ordering is not None:
                self._needs_catch_up.add(destination)
                self._metrics.catch_up_entered.labels(reason="missed").inc()
            return
        added = queue.add_pdu(pdu)
        if added is Added.OVERFLOWED:
            self._catch_up_chunks.pop(destination, None)
            self._metrics.catch_up_entered.labels(reason="overflow").inc()
            logger.warning("TX [%s] more than %d PDUs waiting: dropped them, catching up instead",
                           destination, self._config.max_pending_pdus_per_destination)
        self._kick(queue)

    # --- input: EDUs -----------------------------------------------------------------------

    def send_edu(self, destinations: Iterable[str], edu_type: str, content: Mapping[str, Any],
                 key: tuple[str, ...] | None = None) -> None:
        """Queue an EDU for each destination. EDUs with the same ``key`` replace each other
        while waiting. A destination backing off gets no queue, so lossy EDUs for it are dropped."""
        edu = Edu(edu_type, content, key)
        for destination in set(destinations):
            if destination == self._server_name or not self._should_handle(destination):
                continue
            queue = self._queue(destination, create=True)
            if queue is None:
                logger.debug("TX [%s] backing off: %s not queued", destination, edu_type)
                continue
            queue.add_edu(edu)
            self._kick(queue)

    def send_typing(self, destinations: Iterable[str], room_id: str, user_id: str, typing: bool) -> None:
        self.send_edu(destinations, "m.typing", {"room_id": room_id, "user_id": user_id, "typing": typing},
                      key=("m.typing", room_id, user_id))

    def send_presence(self, destinations: Iterable[str], state: Mapping[str, Any]) -> None:
        self.send_edu(destinations, "m.presence", {"push": [dict(state)]}, key=("m.presence", str(state["user_id"])))

    def send_device_list_update(self, destinations: Iterable[str], content: Mapping[str, Any]) -> None:
        self.send_edu(destinations, "m.device_list_update", content)

    def send_receipt(self, destinations: Iterable[str], room_id: str, receipt_type: str, user_id: str,
                     event_ids: list[str], data: Mapping[str, Any]) -> None:
        """Receipts are gathered for ``receipt_delay`` and sent as one EDU per room."""
        servers, content = self._receipts.setdefault(room_id, (set(), {}))
        servers.update(destinations)
        content.setdefault(receipt_type, {})[user_id] = {"event_ids": event_ids, "data": dict(data)}
        if self._receipt_timer is None or not self._receipt_timer.active():
            self._receipt_timer = self._clock.callLater(
                self._config.receipt_delay.total_seconds(), self._flush_receipts
            )

    def _flush_receipts(self) -> None:
        self._receipt_timer = None
        receipts, self._receipts = self._receipts, {}
        for room_id, (servers, content) in receipts.items():
            self.send_edu(servers, "m.receipt", {room_id: content})

    def wake_destination(self, destination: str) -> None:
        """New to-device messages wait in the outbox for ``destination``."""
        if not self._should_handle(destination):
            return
        self._outbox.add(destination)
        queue = self._queue(destination, create=True)
        if queue is not None:
            queue.outbox_pending = True
            self._kick(queue)

    def notify_remote_server_up(self, destination: str) -> None:
        """``destination`` sent us a request: it is up. Forget its backoff and send what waits now."""
        if not self._should_handle(destination):
            return
        queue = self._queues.get(destination)
        was_backing_off = queue.on_remote_up() if queue is not None else self._retry.pop(destination, None) is not None
        if was_backing_off:
            logger.info("TX [%s] is up again (it sent us a request): backoff cleared", destination)
            timer = self._retry_timers.pop(destination, None)
            if timer is not None and timer.active():
                timer.cancel()
            self._run_in_background(f"clear backoff of {destination}",
                                    self._store.set_retry(destination, 0, 0, None))
        if queue is None and (was_backing_off or destination in self._needs_catch_up or destination in self._outbox):
            queue = self._queue(destination, create=True)
            if queue is not None and was_backing_off:
                queue.catching_up = True
        if queue is not None:
            self._kick(queue)

    # --- queues and loops ---------------------------------------------------------------------

    def _queue(self, destination: str, *, create: bool) -> PerDestinationQueue | None:
        queue = self._queues.get(destination)
        if queue is not None or not create:
            return queue
        retry = self._retry.get(destination, HEALTHY)
        if retry.backing_off(self._now_ms()):
            return None
        self._retry.pop(destination, None)
        queue = PerDestinationQueue(
            destination,
            retry=retry,
            catching_up=destination in self._needs_catch_up,
            max_pending_pdus=self._config.max_pending_pdus_per_destination,
        )
        self._needs_catch_up.discard(destination)
        queue.outbox_pending = destination in self._outbox
        self._queues[destination] = queue
        return queue

    def _kick(self, queue: PerDestinationQueue) -> None:
        """Start the destination's loop unless it runs, waits out a backoff, or the sender is not started."""
        if not self._started or self._stopping or queue.destination in self._loops:
            return
        if queue.retry.backing_off(self._now_ms()):
            self._arm_retry_timer(queue)
            return
        d = Deferred.fromCoroutine(self._supervised_loop(queue))
        if d.called:  # finished at once (nothing to do): nothing to track
            return
        self._loops[queue.destination] = d

    async def _supervised_loop(self, queue: PerDestinationQueue) -> None:
        destination = queue.destination
        try:
            with log_context(destination=destination):
                await self._transmission_loop(queue)
        except CancelledError:
            raise
        except Exception:
            queue.crashes += 1
            delay = min(SUPERVISION_FIRST_DELAY * 2 ** (queue.crashes - 1), SUPERVISION_MAX_DELAY)
            logger.exception("TX [%s] sending loop failed; restarting it in %.0fs", destination, delay)
            self._metrics.loop_restarts.inc()
            self._clock.callLater(delay, self._restart, destination)
        finally:
            self._loops.pop(destination, None)
            queue.in_flight = False
            if queue.is_idle() and self._queues.get(destination) is queue:
                del self._queues[destination]
                self._catch_up_chunks.pop(destination, None)

    def _restart(self, destination: str) -> None:
        queue = self._queues.get(destination)
        if queue is not None:
            self._kick(queue)

    async def _transmission_loop(self, queue: PerDestinationQueue) -> None:
        while not self._stopping:
            if queue.retry.backing_off(self._now_ms()):
                self._arm_retry_timer(queue)
                return
            txn = queue.retained or await self._next_transaction(queue)
            if txn is None:
                if queue.has_work():
                    continue  # work arrived while we were reading; or catch-up must look once more
                return
            await self._send(queue, txn)

    async def _next_transaction(self, queue: PerDestinationQueue) -> PlannedTransaction | None:
        destination = queue.destination
        pdus: tuple[PendingPdu, ...] = ()
        advance: int | None = None
        completed: tuple[tuple[str, int], ...] = ()
        catch_up = queue.catching_up
        if catch_up:
            chunk = await self._next_catch_up_chunk(queue)
            if chunk is not None:
                pdus, advance, completed = chunk.pdus, chunk.advance_to, chunk.completed
        else:
            taken = queue.take_pdus(self._config.max_pdus_per_transaction)
            pdus = tuple(taken)
            orderings = [p.stream_ordering for p in taken if p.stream_ordering is not None]
            advance = max(orderings) if orderings else None
        edus = queue.take_edus(self._config.max_edus_per_transaction)
        to_device_upto: int | None = None
        room = self._config.max_edus_per_transaction - len(edus)
        if queue.outbox_pending and room > 0:
            queue.outbox_pending = False
            rows = await self._store.get_outbox(destination, room)
            if len(rows) == room:
                queue.outbox_pending = True
            elif not queue.outbox_pending:
                self._outbox.discard(destination)
            for row in rows:
                edus.append(Edu(TO_DEVICE_EDU_TYPE, json.loads(row.messages_json)))
            if rows:
                to_device_upto = rows[-1].stream_id
        if not pdus and not edus and advance is None:
            return None
        return PlannedTransaction(
            txn_id=f"{self._txn_prefix}.{next(self._txn_ids)}",
            pdus=pdus,
            edus=tuple(edus),
            advance_to=advance,
            to_device_upto=to_device_upto,
            catch_up=catch_up,
            completed_rooms=completed,
        )

    async def _next_catch_up_chunk(self, queue: PerDestinationQueue) -> CatchUpChunk | None:
        """The next catch-up transaction's PDUs, reading the next batch of rooms when needed;
        None, with catch-up left, once nothing remains."""
        destination = queue.destination
        chunks = self._catch_up_chunks.get(destination)
        if chunks:
            return chunks.popleft()
        if destination not in self._catch_up_from:
            start, last = await self._store.begin_catch_up(destination)
            self._catch_up_from[destination] = start
            self._last_successful[destination] = last
            self._catch_up_done[destination] = {}
            logger.info("TX [%s] catching up from %d", destination, start)
        start = self._catch_up_from[destination]
        done = self._catch_up_done[destination]
        after = self._last_successful[destination]
        upto = self._current_position()
        rooms = await self._store.get_catch_up_rooms(
            destination, after, upto, self._config.catch_up.rooms_per_batch
        )
        if not rooms:
            if await self._store.get_catch_up_rooms(destination, after, None, 1):
                # A room's newest event is past the stream's position: persisted, but an older
                # event of another room is still being written. Wait for the position to pass it
                # (a room's row only ever holds its newest event, so leaving now could skip
                # that room's older events we did not queue).
                await self._sleep(0.05)
                return None
            if queue.skipped_upto <= upto:
                await self._store.end_catch_up(destination)
                self._catch_up_from.pop(destination, None)
                self._catch_up_done.pop(destination, None)
                queue.catching_up = False
                logger.info("TX [%s] caught up to %d", destination, after)
            return None
        data = await self._store.get_catch_up_data(
            destination,
            [(room_id, position, max(start, done.get(room_id, start))) for room_id, position in rooms],
            self._config.catch_up.missed_events_per_room,
        )
        now = self._clock.seconds()
        planned = plan_chunks(
            [
                CatchUpRoom(
                    room_id,
                    position,
                    tuple(_pending(e, now) for e in data.missed.get(room_id, ())),
                    tuple(_pending(e, now) for e in data.latest.get(room_id, ())),
                )
                for room_id, position in rooms
            ],
            self._config.max_pdus_per_transaction,
        )
        logger.debug("TX [%s] catching up %d rooms after %d in %d transactions",
                      destination, len(rooms), after, len(planned))
        chunks = deque(planned)
        self._catch_up_chunks[destination] = chunks
        return chunks.popleft() if chunks else None

    async def _send(self, queue: PerDestinationQueue, txn: PlannedTransaction) -> None:
        destination = queue.destination
        await self._semaphore.acquire()
        queue.in_flight = True
        self._metrics.in_flight.inc()
        start = time.perf_counter()
        failure: TransactionFailed | None = None
        response: Any = None
        try:
            response = await self._transport(
                destination, txn.txn_id, txn.body(self._server_name, self._now_ms()),
                self._config.transaction_timeout.total_seconds(),
            )
        except TransactionFailed as e:
            failure = e
        finally:
            self._metrics.transaction_duration.observe(time.perf_counter() - start)
            self._metrics.in_flight.dec()
            queue.in_flight = False
            self._semaphore.release()
        if failure is not None:
            await self._on_failed(queue, txn, failure)
        else:
            await self._on_sent(queue, txn, response)

    async def _on_sent(self, queue: PerDestinationQueue, txn: PlannedTransaction, response: Any) -> None:
        destination = queue.destination
        reset = queue.on_success() is not None
        if reset:
            logger.info("TX [%s] is up again: backoff cleared", destination)
        errors = _pdu_errors(response)
        await self._store.mark_sent(destination, txn.advance_to, reset_retry=reset, to_device_upto=txn.to_device_upto)
        if txn.advance_to is not None:
            self._last_successful[destination] = max(self._last_successful.get(destination, 0), txn.advance_to)
        done = self._catch_up_done.get(destination)
        if done is not None:
            done.update(txn.completed_rooms)
        if errors:
            logger.warning("TX [%s] rejected %d of %d PDUs in %s, e.g. %s", destination, len(errors), len(txn.pdus),
                           txn.txn_id, next(iter(errors.items())))
            self._metrics.pdu_errors.inc(len(errors))
            await self._store.record_pdu_errors(destination, errors, self._now_ms())
        self._metrics.transactions.labels(outcome="ok").inc()
        self._metrics.pdus_sent.inc(len(txn.pdus))
        if txn.catch_up:
            self._metrics.catch_up_pdus_sent.inc(len(txn.pdus))
        for edu in txn.edus:
            self._metrics.count_edu(edu.edu_type)
        logger.debug("TX [%s] %s: %d PDUs, %d EDUs accepted", destination, txn.txn_id, len(txn.pdus), len(txn.edus))

    async def _on_failed(self, queue: PerDestinationQueue, txn: PlannedTransaction, error: TransactionFailed) -> None:
        destination = queue.destination
        unhealthy = is_unhealthy(error.status)
        outcome = queue.on_failure(
            txn, now_ms=self._now_ms(), unhealthy=unhealthy, policy=self._policy, jitter=self._jitter,
            catch_up_threshold_ms=self._threshold_ms,
        )
        if not unhealthy:
            # A refusal about the request itself: resending would be refused again.
            logger.warning("TX [%s] %s refused (%s): dropped %d PDUs and %d EDUs", destination, txn.txn_id,
                           error, len(txn.pdus), len(txn.edus))
            self._metrics.transactions.labels(outcome="rejected").inc()
            await self._store.mark_sent(destination, txn.advance_to, reset_retry=False,
                                        to_device_upto=txn.to_device_upto)
            return
        self._metrics.transactions.labels(outcome="failed").inc()
        retry = outcome.retry
        logger.warning("TX [%s] %s failed (%s); backing off for %.0fs", destination, txn.txn_id, error,
                       retry.retry_interval / 1000)
        if outcome.entered_catch_up:
            self._catch_up_chunks.pop(destination, None)
            self._metrics.catch_up_entered.labels(reason="backoff").inc()
            logger.info("TX [%s] backing off past %.0fs: dropped %d waiting PDUs, will catch up", destination,
                        self._threshold_ms / 1000, outcome.dropped_pdus)
        elif txn.catch_up:
            # A catch-up transaction is rebuilt from the database next time; keep only its EDUs.
            queue.retained = None
            self._catch_up_chunks.pop(destination, None)
            queue.put_back_edus([e for e in txn.edus if e.edu_type != TO_DEVICE_EDU_TYPE])
            if txn.to_device_upto is not None:
                queue.outbox_pending = True
        await self._store.set_retry(destination, retry.retry_last_ts, retry.retry_interval, retry.failure_ts)

    def _arm_retry_timer(self, queue: PerDestinationQueue) -> None:
        """Try again when the backoff ends, if there is something to send then."""
        destination = queue.destination
        if not queue.has_work() or self._stopping:
            return
        timer = self._retry_timers.get(destination)
        if timer is not None and timer.active():
            return
        delay = max(0.0, (queue.retry.retry_at - self._now_ms()) / 1000)

        def fire() -> None:
            self._retry_timers.pop(destination, None)
            self._restart(destination)

        self._retry_timers[destination] = self._clock.callLater(delay, fire)

    # --- catch-up discovery ------------------------------------------------------------------

    async def _find_catch_up(self, reason: str) -> int:
        """Flag destinations with missed events (and no queue) to catch up; wake those not backing off.

        Only events the fan-out has handed to queues count: a newer event is on its way to
        its destinations' queues, not missed."""
        rows = await self._store.get_needing_catch_up(self._position)
        now = self._now_ms()
        found = 0
        for row in rows:
            destination = row.destination
            if not self._should_handle(destination):
                continue
            queue = self._queues.get(destination)
            if queue is not None:
                # A live queue looks after itself, unless it was made before start-up's look
                # (it has sent nothing yet, so what the table says it missed is real).
                if reason == "startup" and not queue.catching_up:
                    queue.catching_up = True
                    self._metrics.catch_up_entered.labels(reason=reason).inc()
                    found += 1
                continue
            found += 1
            if destination not in self._needs_catch_up:
                self._needs_catch_up.add(destination)
                self._metrics.catch_up_entered.labels(reason=reason).inc()
            if row.retry_interval == 0 or now >= row.retry_last_ts + row.retry_interval:
                self._schedule_wake(destination)
        return found

    def _scan(self) -> Deferred[None]:
        return Deferred.fromCoroutine(self._scan_once())

    async def _scan_once(self) -> None:
        try:
            await self._find_catch_up(reason="missed")
        except CancelledError:
            raise
        except Exception:
            logger.exception("looking for destinations to catch up failed")

    def _schedule_wake(self, destination: str) -> None:
        """Wake a destination soon, at most ``catch_up.wakes_per_second`` of them per second."""
        if destination in self._wake_queue:
            return
        self._wake_queue.append(destination)
        if self._waker is None or not self._waker.running:
            self._waker = LoopingCall(self._wake_next)
            self._waker.clock = self._clock
            self._waker.start(1.0 / self._config.catch_up.wakes_per_second, now=True)

    def _wake_next(self) -> None:
        if not self._wake_queue:
            if self._waker is not None and self._waker.running:
                self._waker.stop()
            return
        destination = self._wake_queue.popleft()
        queue = self._queue(destination, create=True)
        if queue is not None:
            self._kick(queue)

    # --- helpers -------------------------------------------------------------------------------

    def _now_ms(self) -> int:
        return int(self._clock.seconds() * 1000)

    def _oldest_pending_age(self) -> float:
        oldest = [t for q in self._queues.values() if (t := q.oldest_queued_at()) is not None]
        return self._clock.seconds() - min(oldest) if oldest else 0.0

    async def _sleep(self, seconds: float) -> None:
        d: Deferred[None] = Deferred()
        call = self._clock.callLater(seconds, d.callback, None)
        try:
            await d
        except CancelledError:
            if call.active():
                call.cancel()
            raise

    def _run_in_background(self, name: str, coro: Any) -> None:
        d: Deferred[Any] = Deferred.fromCoroutine(coro)
        self._background.add(d)

        def done(result: object) -> None:
            self._background.discard(d)
            if isinstance(result, Failure) and not result.check(CancelledError):
                logger.error("%s failed: %s", name, result.getTraceback())

        d.addBoth(done)


def _pdu_errors(response: Any) -> dict[str, str]:
    """The per-PDU errors of a ``/send`` answer: ``{"pdus": {event_id: {"error": ...}}}``."""
    if not isinstance(response, Mapping):
        return {}
    pdus = response.get("pdus")
    if not isinstance(pdus, Mapping):
        return {}
    return {
        str(event_id): str(result["error"])
        for event_id, result in pdus.items()
        if isinstance(result, Mapping) and "error" in result
    }
