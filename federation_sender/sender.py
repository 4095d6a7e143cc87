"""The federation sender's loop: carries out what each destination's core decides.

Every decision about a destination — what goes in its next transaction, when
it backs off, when it catches up and how far its acknowledged position moves —
is made by its ``core.Destination``. This module does the I/O those decisions
ask for: store reads and writes, ``PUT /send`` through the injected
``Transport``, timers on the injected clock. It feeds each result back to the
core as an event and carries out the actions returned, so it holds no
per-destination state of its own beyond the one ``Destination`` object each.

What is global lives here: the fan-out (``notify_new_events(upto)`` reads the
local events in (position, upto] in stream order — ``events.destinations``
says who each is for — and hands each destination its PDUs), receipt
batching, the semaphore that caps transactions in flight across destinations
(first come, first served), the rate-limited wake-up queue for catch-up at
start-up, and the periodic scan for destinations that missed events. Requests
made before ``start()`` wait and are carried out by it.
"""

# tests: tests/unit/federation_sender/test_sender.py, tests/integration/test_federation_sender.py

from __future__ import annotations

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

from federation_sender.backoff import Jitter, RetryState
from federation_sender.catch_up import CatchUpRoom
from federation_sender.config import FederationSenderConfig
from federation_sender.core import (
    Accepted,
    Action,
    BackingOff,
    BackoffCleared,
    BeginCatchUp,
    CaughtUp,
    Destination,
    EndCatchUp,
    EnteredCatchUp,
    OutboxMessage,
    PersistPosition,
    PersistRetry,
    QueueWake,
    ReadCatchUpEvents,
    ReadCatchUpRooms,
    ReadDeviceLists,
    ReadOutbox,
    Request,
    ResendingAfterContact,
    ScheduleWake,
    SendTransaction,
    TransactionIds,
    TransactionRejected,
    WaitForPosition,
    pdu_errors,
)
from federation_sender.device_lists import plan_updates
from federation_sender.metrics import FederationSenderMetrics
from federation_sender.queue import DEVICE_LIST_EDU_TYPE, SIGNING_KEY_EDU_TYPE, Edu, PendingPdu, encode_pdu
from federation_sender.store import SenderStore
from federation_sender.transport import TransactionFailed, Transport
from storage.kernel.background import run_in_background
from storage.kernel.logcontext import log_context
from storage.kernel.written_events import WrittenEvents, is_fanout
from storage.stores.federation_sender import CatchUpEvent, SentMark

logger = logging.getLogger(__name__)

FANOUT_BATCH = 1000
_EVERYTHING = 2**63 - 1  # the largest bigint: no stream position is above it
_REQUESTS = (
    ReadOutbox, ReadDeviceLists, BeginCatchUp, ReadCatchUpRooms, ReadCatchUpEvents, EndCatchUp, SendTransaction, PersistPosition,
    PersistRetry,
)


def _encoded(pdu_json: str) -> bytes:
    """A stored PDU's canonical JSON (the events table's text is not necessarily canonical)."""
    return encode_pdu(json.loads(pdu_json))


def _pending(event: CatchUpEvent, now: float) -> PendingPdu:
    return PendingPdu(event.event_id, event.room_id, event.stream_ordering, _encoded(event.pdu_json), now)


class FederationSender:
    def __init__(
        self,
        *,
        server_name: str,
        config: FederationSenderConfig,
        store: SenderStore,
        transport: Transport,
        clock: IReactorTime,
        current_position: Callable[[], int],
        device_lists_position: Callable[[], int],
        metrics: FederationSenderMetrics,
        joined_servers: Callable[[str], Awaitable[set[str]]] | None = None,
        should_handle: Callable[[str], bool] = lambda destination: True,
        jitter: Jitter = random.uniform,
        written: WrittenEvents | None = None,
    ) -> None:
        self._server_name = server_name
        # What this process persisted: a range of events for no other server needs no read.
        self._written = written
        self._config = config
        self._store = store
        self._transport = transport
        self._clock = clock
        self._current_position = current_position
        self._device_lists_position = device_lists_position
        self._metrics = metrics
        self._joined_servers = joined_servers
        self._should_handle = should_handle
        self._jitter = jitter
        self._semaphore = DeferredSemaphore(config.max_concurrent_transactions)
        self._txn_ids = TransactionIds(str(int(clock.seconds() * 1000)))

        self._started = False
        self._stopping = False
        # The one object per destination: all of its state.
        self._destinations: dict[str, Destination] = {}
        # I/O machinery, not destination state: requests made before start(), the running
        # request chains, armed timers, destinations waiting for the events stream to move.
        self._held: list[tuple[Destination, Request]] = []
        self._drivers: set[Deferred[None]] = set()
        self._timers: set[IDelayedCall] = set()
        self._position_waiters: set[str] = set()
        # Destinations that saw device-list changes the device_lists stream had not passed yet.
        self._device_list_waiters: set[str] = set()

        self._position = 0
        self._fanout_target = 0
        self._fanout: Deferred[None] | None = None

        self._wake_queue: deque[str] = deque()
        self._waker: LoopingCall | None = None
        self._scanner: LoopingCall | None = None
        self._background: set[Deferred[Any]] = set()
        self._receipts: dict[str, tuple[set[str], dict[str, Any]]] = {}
        self._receipt_timer: IDelayedCall | None = None
        # Accepted transactions' marks waiting for the write under way to end (``_mark_sent``).
        self._marks: list[tuple[SentMark, Deferred[None]]] = []
        self._marking: Deferred[None] | None = None
        # Destinations whose position was written while a periodic catch-up scan was reading.
        self._acked_during_scan: set[str] | None = None

        metrics.pending_pdus.set_function(lambda: sum(d.pending_pdus for d in self._destinations.values()))
        metrics.pending_edus.set_function(lambda: sum(d.pending_edus for d in self._destinations.values()))
        metrics.catching_up.set_function(lambda: sum(1 for d in self._destinations.values() if d.catching_up))
        metrics.backing_off.set_function(
            lambda: sum(1 for d in self._destinations.values() if not d.retry.healthy)
        )
        metrics.oldest_pending_age.set_function(self._oldest_pending_age)

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Load backoffs, find destinations to catch up, and carry out what waited for the start."""
        self._position = self._fanout_target = max(self._fanout_target, self._current_position())
        self._metrics.position.set(self._position)
        backing_off = 0
        for row in await self._store.get_backing_off():
            if self._should_handle(row.destination):
                backing_off += 1
                retry = RetryState(row.retry_last_ts, row.retry_interval, row.failure_ts)
                self._destination(row.destination).on_backoff_restored(retry)
        for name in await self._store.get_outbox_destinations():
            if self._should_handle(name):
                dest = self._destination(name)
                self._carry_out(dest, dest.on_outbox_found(self._now_ms()))
        for name in await self._store.get_device_lists_destinations(self._server_name):
            if self._should_handle(name):
                dest = self._destination(name)
                self._carry_out(dest, dest.on_device_lists_found(self._now_ms()))
        needing = await self._find_catch_up(startup=True)
        logger.info(
            "federation sender started at position %d: %d destinations to catch up, %d backing off",
            self._position, needing, backing_off,
        )
        self._started = True
        held, self._held = self._held, []
        for dest, request in held:
            self._start_driver(dest, request)
        self._ensure_waker()
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
        for timer in [*self._timers, *([self._receipt_timer] if self._receipt_timer else [])]:
            if timer.active():
                timer.cancel()
        self._timers.clear()
        pending = [d for d in [*self._drivers, *self._background, self._fanout] if d is not None]
        for d in pending:
            d.cancel()
        for d in pending:
            try:
                await d
            except (CancelledError, Exception):
                pass

    async def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until no request is being carried out and the fan-out is done (tests and benchmarks)."""
        deadline = self._clock.seconds() + timeout
        while self._drivers or self._fanout is not None or self._fanout_target > self._position:
            if self._clock.seconds() > deadline:
                busy = sorted(d.name for d in self._destinations.values() if d.outstanding is not None)
                raise TimeoutError(f"federation sender still busy: {busy}")
            d: Deferred[None] = Deferred()
            self._clock.callLater(0.01, d.callback, None)
            await d

    # --- input: events ---------------------------------------------------------------------

    def notify_new_events(self, upto: int) -> None:
        """Local events up to ``upto`` are persisted (the events stream's current token): fan them
        out, and wake catch-ups that waited for the position to pass what they saw."""
        if self._position_waiters:
            position = self._current_position()
            waiters, self._position_waiters = self._position_waiters, set()
            for name in sorted(waiters):
                dest = self._destinations.get(name)
                if dest is not None:
                    self._event(dest, dest.on_position(position, self._now_ms()))
        if upto <= self._fanout_target:
            return
        self._fanout_target = upto
        if not self._started or self._fanout is not None:
            return
        if self._written is not None and self._written.nothing_for(self._position, upto, is_fanout):
            # The common case of a server without peers in the room: no coroutine, no read.
            self._position = upto
            self._metrics.position.set(upto)
            return
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
            if self._written is not None and self._written.nothing_for(self._position, target, is_fanout):
                self._position = target
                self._metrics.position.set(target)
                continue
            try:
                rows = await self._store.get_fanout_events(self._position, target, FANOUT_BATCH)
            except CancelledError:
                raise
            except Exception:
                logger.exception("reading new events to send failed; retrying in 1s")
                await self._sleep(1.0)
                continue
            now = self._clock.seconds()
            batches: dict[str, list[PendingPdu]] = {}
            for row in rows:
                # Encoded once here; every destination's transaction joins the same bytes.
                pdu = PendingPdu(row.event_id, row.room_id, row.stream_ordering, _encoded(row.pdu_json), now)
                for name in row.destinations:
                    if name != self._server_name and self._should_handle(name):
                        batches.setdefault(name, []).append(pdu)
            # Each destination gets the batch's PDUs at once (in stream order), so they share transactions.
            for name, pdus in batches.items():
                dest = self._destination(name)
                self._event(dest, dest.on_pdus(pdus, self._now_ms()))
            self._position = rows[-1].stream_ordering if len(rows) == FANOUT_BATCH else target
            self._metrics.position.set(self._position)

    def send_pdu(self, pdu: Mapping[str, Any], destinations: Iterable[str]) -> None:
        """Send an event that is not one of our new local events (a remote server's join we
        accepted as the resident server); it does not move catch-up positions."""
        pending = PendingPdu(str(pdu.get("event_id", "")), str(pdu.get("room_id", "")), None, encode_pdu(pdu),
                             self._clock.seconds())
        for name in sorted(set(destinations)):
            if name != self._server_name and self._should_handle(name):
                dest = self._destination(name)
                self._event(dest, dest.on_pdus([pending], self._now_ms()))

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

        d = run_in_background("federation_sender_forward", run())
        self._background.add(d)
        d.addBoth(lambda _: self._background.discard(d))

    # --- input: EDUs -----------------------------------------------------------------------

    def send_edu(self, destinations: Iterable[str], edu_type: str, content: Mapping[str, Any],
                 key: tuple[str, ...] | None = None) -> None:
        """Queue an EDU for each destination. EDUs with the same ``key`` replace each other
        while waiting. A destination backing off with no queue drops it. A device-list update
        is only a wake-up: what is sent is read from the device_lists stream."""
        if edu_type in (DEVICE_LIST_EDU_TYPE, SIGNING_KEY_EDU_TYPE):
            self.send_device_list_update(destinations, content)
            return
        edu = Edu(edu_type, content, key)
        for name in sorted(set(destinations)):
            if name == self._server_name or not self._should_handle(name):
                continue
            dest = self._destination(name)
            self._event(dest, dest.on_edu(edu, self._now_ms()))

    def send_typing(self, destinations: Iterable[str], room_id: str, user_id: str, typing: bool) -> None:
        self.send_edu(destinations, "m.typing", {"room_id": room_id, "user_id": user_id, "typing": typing},
                      key=("m.typing", room_id, user_id))

    def send_presence(self, destinations: Iterable[str], state: Mapping[str, Any]) -> None:
        self.send_edu(destinations, "m.presence", {"push": [dict(state)]}, key=("m.presence", str(state["user_id"])))

    def send_device_list_update(self, destinations: Iterable[str], content: Mapping[str, Any]) -> None:
        """A local user's devices changed (``content`` is the update; the change is on the
        device_lists stream, and ``destinations`` have a position below it): each destination
        reads its changes above its position for its next transaction, so an update outlives
        backoff, catch-up and restarts like a PDU does."""
        for name in sorted(set(destinations)):
            if name == self._server_name or not self._should_handle(name):
                continue
            dest = self._destination(name)
            self._event(dest, dest.on_device_lists_wake(self._now_ms()))

    def notify_device_lists(self) -> None:
        """The device_lists stream's position moved: destinations that saw changes beyond it read again."""
        waiters, self._device_list_waiters = self._device_list_waiters, set()
        for name in sorted(waiters):
            dest = self._destination(name)  # an idle one may have been forgotten meanwhile
            self._event(dest, dest.on_device_lists_wake(self._now_ms()))

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
        if self._should_handle(destination):
            dest = self._destination(destination)
            self._event(dest, dest.on_outbox_wake(self._now_ms()))

    def notify_remote_server_up(self, destination: str) -> None:
        """``destination`` sent us a request: it is up. Forget its backoff and send what waits now."""
        dest = self._destinations.get(destination)
        if dest is not None and self._should_handle(destination):
            self._event(dest, dest.on_remote_up(self._now_ms()))

    def snapshot(self) -> list[dict[str, Any]]:
        """Each destination this sender holds in memory: its queue, backoff and catch-up state
        (the admin console shows it)."""
        now = self._now_ms()
        return [{"destination": name, "pending_pdus": dest.pending_pdus, "pending_edus": dest.pending_edus,
                 "catching_up": dest.catching_up, "in_flight": dest.in_flight is not None,
                 "backing_off": dest.retry.backing_off(now), "retry_interval": dest.retry.retry_interval,
                 "retry_at": dest.retry.retry_at if dest.retry.retry_interval else None}
                for name, dest in sorted(self._destinations.items())]

    # --- carrying out actions ------------------------------------------------------------------

    def _destination(self, name: str) -> Destination:
        dest = self._destinations.get(name)
        if dest is None:
            dest = Destination(name, config=self._config, txn_ids=self._txn_ids, jitter=self._jitter)
            self._destinations[name] = dest
        return dest

    def _event(self, dest: Destination, actions: list[Action]) -> None:
        """Carry out the actions of an event from outside; start the request it made, if any."""
        request = self._carry_out(dest, actions)
        if request is not None:
            self._start_driver(dest, request)

    def _carry_out(self, dest: Destination, actions: list[Action]) -> Request | None:
        """Carry out every action that needs no answer; return the request (at most one), if any."""
        request: Request | None = None
        todo = deque(actions)
        now_ms = self._now_ms()
        while todo:
            action = todo.popleft()
            if isinstance(action, _REQUESTS):
                assert request is None, f"[{dest.name}] two requests at once: {request!r}, {action!r}"
                request = action
                continue
            match action:
                case ScheduleWake(at_ms=at_ms):
                    self._arm_timer(dest.name, at_ms, now_ms)
                case WaitForPosition(above=above):
                    position = self._current_position()
                    if position > above:
                        todo.extend(dest.on_position(position, now_ms))
                    else:
                        self._position_waiters.add(dest.name)
                case QueueWake():
                    self._queue_wake(dest.name)
                case Accepted(txn=txn):
                    self._metrics.transactions.labels(outcome="ok").inc()
                    self._metrics.pdus_sent.inc(len(txn.pdus))
                    if txn.catch_up:
                        self._metrics.catch_up_pdus_sent.inc(len(txn.pdus))
                    for edu in txn.edus:
                        self._metrics.count_edu(edu.edu_type)
                    logger.debug("TX [%s] %s: %d PDUs, %d EDUs accepted", dest.name, txn.txn_id, len(txn.pdus),
                                 len(txn.edus))
                case BackingOff(txn_id=txn_id, error=error, retry=retry):
                    self._metrics.transactions.labels(outcome="failed").inc()
                    logger.warning("TX [%s] %s failed (%s); backing off for %.0fs", dest.name, txn_id, error,
                                   retry.retry_interval / 1000)
                case ResendingAfterContact(txn_id=txn_id, error=error):
                    self._metrics.transactions.labels(outcome="failed").inc()
                    logger.info("TX [%s] %s failed (%s), but it contacted us meanwhile: resending at once",
                                dest.name, txn_id, error)
                case TransactionRejected(txn_id=txn_id, error=error, pdus=pdus, edus=edus):
                    self._metrics.transactions.labels(outcome="rejected").inc()
                    logger.warning("TX [%s] %s refused (%s): dropped %d PDUs and %d EDUs", dest.name, txn_id,
                                   error, pdus, edus)
                case EnteredCatchUp(reason=reason, dropped_pdus=dropped):
                    self._metrics.catch_up_entered.labels(reason=reason).inc()
                    if reason == "backoff":
                        logger.info("TX [%s] backing off past %.0fs: dropped %d waiting PDUs, will catch up",
                                    dest.name, self._config.catch_up.threshold.total_seconds(), dropped)
                    elif reason == "overflow":
                        logger.warning("TX [%s] more than %d PDUs waiting: dropped them, catching up instead",
                                       dest.name, self._config.max_pending_pdus_per_destination)
                    else:
                        logger.debug("TX [%s] will catch up (%s)", dest.name, reason)
                case CaughtUp(position=position):
                    logger.info("TX [%s] caught up to %d", dest.name, position)
                case BackoffCleared(because=because):
                    logger.info("TX [%s] is up again (%s): backoff cleared", dest.name, because)
        if request is None and dest.is_idle() and self._destinations.get(dest.name) is dest:
            del self._destinations[dest.name]
        return request

    def _start_driver(self, dest: Destination, request: Request) -> None:
        if self._stopping:
            return
        if not self._started:
            self._held.append((dest, request))
            return
        d = Deferred.fromCoroutine(self._drive(dest, request))
        if d.called:
            return
        self._drivers.add(d)
        d.addBoth(lambda _: self._drivers.discard(d))

    async def _drive(self, dest: Destination, request: Request) -> None:
        """Carry out ``request`` and whatever request each answer leads to, one at a time."""
        step: Request | None = request
        while step is not None and not self._stopping:
            with log_context(destination=dest.name):
                try:
                    actions = await self._perform(dest, step)
                except CancelledError:
                    raise
                except Exception:
                    logger.exception("TX [%s] carrying out %s failed; going on after a pause", dest.name,
                                     type(step).__name__)
                    self._metrics.loop_restarts.inc()
                    actions = dest.on_crashed(self._now_ms())
            step = self._carry_out(dest, actions)

    async def _perform(self, dest: Destination, step: Request) -> list[Action]:
        """Do the I/O one request asks for; return the core's actions for the result."""
        name = dest.name
        match step:
            case ReadOutbox(limit=limit):
                rows = await self._store.get_outbox(name, limit)
                messages = [OutboxMessage(r.stream_id, json.loads(r.messages_json)) for r in rows]
                return dest.on_outbox_read(messages, self._now_ms())
            case ReadDeviceLists(limit=limit):
                upto = self._device_lists_position()
                read = await self._store.get_device_list_updates(name, self._server_name, upto, limit)
                if read.ahead:
                    self._device_list_waiters.add(name)
                batch = plan_updates(read.devices, upto=upto, limit=limit, signing=read.signing)
                return dest.on_device_lists_read(batch.contents, batch.upto, batch.more, self._now_ms(),
                                                 signing=batch.signing)
            case BeginCatchUp():
                start, last = await self._store.begin_catch_up(name)
                logger.info("TX [%s] catching up from %d", name, start)
                return dest.on_catch_up_begun(start, last, self._now_ms())
            case ReadCatchUpRooms(after=after, limit=limit):
                upto = self._current_position()
                rooms = await self._store.get_catch_up_rooms(name, after, upto, limit)
                ahead = not rooms and bool(await self._store.get_catch_up_rooms(name, after, None, 1))
                return dest.on_catch_up_rooms(rooms, upto, ahead, self._now_ms())
            case ReadCatchUpEvents(rooms=reads, missed_per_room=missed_per_room):
                data = await self._store.get_catch_up_data(name, list(reads), missed_per_room)
                now = self._clock.seconds()
                planned = [
                    CatchUpRoom(
                        room_id, position,
                        tuple(_pending(e, now) for e in data.missed.get(room_id, ())),
                        tuple(_pending(e, now) for e in data.latest.get(room_id, ())),
                        more=room_id in data.more,
                    )
                    for room_id, position, _ in reads
                ]
                logger.debug("TX [%s] catching up %d rooms", name, len(planned))
                return dest.on_catch_up_events(planned, self._now_ms())
            case EndCatchUp():
                await self._store.end_catch_up(name)
                return dest.on_catch_up_ended(self._now_ms())
            case SendTransaction():
                return await self._send(dest, step)
            case PersistPosition():
                if step.refusals:
                    for refusal in step.refusals:
                        self._metrics.pdus_refused.labels(reason=refusal.reason).inc()
                    first = step.refusals[0]
                    logger.warning("TX [%s] refused %d PDUs of %s (%s), e.g. %s: %s", name, len(step.refusals),
                                   step.txn_id, ", ".join(sorted({r.reason for r in step.refusals})),
                                   first.event_id, first.error)
                    await self._store.record_pdu_errors(name, {r.event_id: r.error for r in step.refusals},
                                                        self._now_ms())
                await self._mark_sent(SentMark(name, step.advance_to, step.clear_retry, step.to_device_upto,
                                               step.device_lists_upto))
                if self._acked_during_scan is not None:
                    self._acked_during_scan.add(name)
                return dest.on_persisted(self._now_ms())
            case PersistRetry(retry=retry):
                await self._store.set_retry(name, retry.retry_last_ts, retry.retry_interval, retry.failure_ts)
                return dest.on_persisted(self._now_ms())
        raise AssertionError(f"unknown request {step!r}")

    async def _send(self, dest: Destination, step: SendTransaction) -> list[Action]:
        txn = step.txn
        await self._semaphore.acquire()
        self._metrics.in_flight.inc()
        start = time.perf_counter()
        try:
            response = await self._transport(
                dest.name, txn.txn_id, txn.body(self._server_name, self._now_ms()),
                self._config.transaction_timeout.total_seconds(),
            )
        except TransactionFailed as e:
            return dest.on_transaction_failed(e.status, str(e), self._now_ms())
        finally:
            self._metrics.transaction_duration.observe(time.perf_counter() - start)
            self._metrics.in_flight.dec()
            self._semaphore.release()
        return dest.on_transaction_accepted(pdu_errors(response), self._now_ms())

    async def _mark_sent(self, mark: SentMark) -> None:
        """Write what an accepted transaction moves, together with the marks of every other
        destination answered meanwhile: one database transaction at a time, for all of them
        (at 1,000 destinations, one write per answer was a thread hop and a commit each)."""
        done: Deferred[None] = Deferred()
        self._marks.append((mark, done))
        if self._marking is None:
            marking = Deferred.fromCoroutine(self._write_marks())
            if not marking.called:
                self._marking = marking
                self._background.add(marking)
                marking.addBoth(lambda _: self._background.discard(marking))
        await done

    async def _write_marks(self) -> None:
        try:
            while self._marks:
                batch, self._marks = self._marks, []
                try:
                    await self._store.mark_sent_many([mark for mark, _ in batch])
                except CancelledError:
                    for _, done in batch:
                        done.cancel()
                    raise
                except Exception as e:  # each destination's loop reports it and pauses
                    for _, done in batch:
                        done.errback(e)
                else:
                    for _, done in batch:
                        done.callback(None)
        finally:
            self._marking = None

    def _arm_timer(self, name: str, at_ms: int, now_ms: int) -> None:
        # One millisecond late rather than early: the core compares whole milliseconds.
        delay = max(0, at_ms - now_ms + 1) / 1000
        call: IDelayedCall | None = None

        def fire() -> None:
            if call is not None:
                self._timers.discard(call)
            dest = self._destinations.get(name)
            if dest is not None and not self._stopping:
                self._event(dest, dest.on_wake(self._now_ms()))

        call = self._clock.callLater(delay, fire)
        self._timers.add(call)

    # --- catch-up discovery ------------------------------------------------------------------

    async def _find_catch_up(self, *, startup: bool) -> int:
        """Tell destinations with missed events so. Returns how many.

        Later scans count only events the fan-out has handed out (a newer one is on its way to
        its destinations, not missed). At start-up every row above the acknowledged position
        counts, even one past the stream's position: a room's row holds only its newest event,
        so an older event of that room that was in flight when the process died is behind it,
        and the fan-out (which starts at the position) will never hand it out again."""
        if not startup:
            self._acked_during_scan = set()
        try:
            rows = await self._store.get_needing_catch_up(_EVERYTHING if startup else self._position)
        finally:
            acked, self._acked_during_scan = self._acked_during_scan, None
        found = 0
        for row in rows:
            if not self._should_handle(row.destination):
                continue
            if acked is not None and row.destination in acked:
                # Its position moved while the scan read the old one: the rows it saw were
                # in flight, not missed (catching up would send them a second time).
                continue
            found += 1
            dest = self._destination(row.destination)
            self._event(dest, dest.on_catch_up_found(self._now_ms(), startup=startup))
        return found

    def _scan(self) -> Deferred[None]:
        return Deferred.fromCoroutine(self._scan_once())

    async def _scan_once(self) -> None:
        try:
            await self._find_catch_up(startup=False)
        except CancelledError:
            raise
        except Exception:
            logger.exception("looking for destinations to catch up failed")

    def _queue_wake(self, name: str) -> None:
        """Wake a destination soon, at most ``catch_up.wakes_per_second`` of them per second."""
        if name in self._wake_queue:
            return
        self._wake_queue.append(name)
        self._ensure_waker()

    def _ensure_waker(self) -> None:
        if self._started and self._wake_queue and (self._waker is None or not self._waker.running):
            self._waker = LoopingCall(self._wake_next)
            self._waker.clock = self._clock
            self._waker.start(1.0 / self._config.catch_up.wakes_per_second, now=True)

    def _wake_next(self) -> None:
        if not self._wake_queue:
            if self._waker is not None and self._waker.running:
                self._waker.stop()
            return
        dest = self._destinations.get(self._wake_queue.popleft())
        if dest is not None:
            self._event(dest, dest.on_wake(self._now_ms()))

    # --- helpers -------------------------------------------------------------------------------

    def _now_ms(self) -> int:
        return int(self._clock.seconds() * 1000)

    def _oldest_pending_age(self) -> float:
        oldest = [t for d in self._destinations.values() if (t := d.oldest_queued_at()) is not None]
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
