"""The application service sender: carries out what each service's ``ServiceLink`` asks.

Runs in one process of a deployment (the ``appservice`` worker when the config has one, else
the main process: ``workers/appservice.py``). It follows the events stream (a position
listener wakes every link), and for each link carries out its one outstanding request: read
the events above the service's position and keep those the service is interested in
(``registration.is_interested``), record a transaction, ``PUT`` it, store the new position or
the backoff. Metrics and logs come from the links' notices; the decisions are the links'.
"""

# tests: tests/integration/test_appservice.py, tests/unit/appservice/test_core.py

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from federation_sender.backoff import RetryState, policy_from_config
from federation_sender.link import ScheduleWake
from homeserver.appservice.client import AppServiceClient, ServiceUnreachable
from homeserver.appservice.config import AppServiceSenderConfig
from homeserver.appservice.core import (
    Action,
    Advance,
    Failed,
    PersistRetry,
    Pending,
    ReadEvents,
    RecordTransaction,
    Recovered,
    SendTransaction,
    Sent,
    ServiceLink,
)
from homeserver.appservice.metrics import AppServiceMetrics
from homeserver.appservice.registration import AppService, EventFacts, is_interested
from homeserver.events.presence import presence_event
from storage.kernel.background import run_in_background
from storage.stores.appservice import AppServiceStore, Ephemeral, PresenceChange

logger = logging.getLogger(__name__)

# Client-format events by ID (those that could be loaded).
FormatEvents = Callable[[Sequence[str]], Awaitable[Mapping[str, Mapping[str, Any]]]]


class AppServiceSender:
    def __init__(
        self,
        services: Sequence[AppService],
        *,
        store: AppServiceStore,
        client: AppServiceClient,
        format_events: FormatEvents,
        clock: Any,
        events_position: Callable[[], int],
        to_device_position: Callable[[], int],
        metrics: AppServiceMetrics,
        config: AppServiceSenderConfig,
        jitter: Callable[[float, float], float] = random.uniform,
    ) -> None:
        self._services = {s.id: s for s in services if s.url is not None}
        self._store = store
        self._client = client
        self._format = format_events
        self._clock = clock
        self._events_position = events_position
        self._to_device_position = to_device_position
        self._metrics = metrics
        self._config = config
        self._jitter = jitter
        self._links: dict[str, ServiceLink] = {}
        self._timers: dict[str, Any] = {}
        self._stopped = False
        # Ephemeral events: the typing, receipts and presence positions followed, and how far
        # they are read.
        self._ephemeral_streams: tuple[Callable[[], int], Callable[[], int], Callable[[], int]] | None = None
        self._ephemeral_at = (0, 0, 0)
        self._ephemeral_dirty = False
        self._ephemeral_reading = False

    def _now(self) -> int:
        return int(self._clock.seconds() * 1000)

    async def start(self) -> None:
        policy = policy_from_config(self._config.backoff)
        for service_id, service in self._services.items():
            state = await self._store.load_state(service_id, self._events_position(), self._to_device_position())
            pending = (None if state.pending_txn_id is None
                       else Pending(state.pending_txn_id, state.pending_upto, state.pending_to_device_upto))
            link = ServiceLink(
                service_id, position=state.stream_ordering, last_txn_id=state.last_txn_id, pending=pending,
                retry=RetryState(state.retry_last_ts, state.retry_interval, state.failure_ts),
                policy=policy, jitter=self._jitter, max_events=self._config.max_events_per_transaction,
                to_device_position=state.to_device_position if service.receive_to_device else None,
            )
            self._links[service_id] = link
            for label in ("sent", "failed", "events"):
                getattr(self._metrics, label).labels(service=service_id)
            self._metrics.pending.labels(service=service_id).set_function(self._lag_of(link))
            if pending is not None:
                logger.info("[%s] resending transaction %d after a restart", service_id, pending.txn_id)
            self._dispatch(link, link.on_wake(self._now()))

    def _lag_of(self, link: ServiceLink) -> Callable[[], float]:
        return lambda: max(0, self._events_position() - link.position)

    def on_new_events(self) -> None:
        for link in self._links.values():
            self._dispatch(link, link.on_new_events(self._now()))

    def on_new_to_device(self) -> None:
        """The to_device stream moved: services taking to-device messages read above their position."""
        for link in self._links.values():
            self._dispatch(link, link.on_to_device(self._now()))

    def follow_ephemeral(self, typing: Callable[[], int], receipts: Callable[[], int],
                         presence: Callable[[], int]) -> None:
        """Start following the typing, receipts and presence streams (their positions now), for
        the services with ``receive_ephemeral``; call ``on_new_ephemeral`` when one moves."""
        self._ephemeral_streams = (typing, receipts, presence)
        self._ephemeral_at = (typing(), receipts(), presence())

    def on_new_ephemeral(self) -> None:
        wanted = any(s.receive_ephemeral for s in self._services.values())
        if self._ephemeral_streams is None or not wanted:
            return
        self._ephemeral_dirty = True
        if not self._ephemeral_reading:
            run_in_background("appservice_ephemeral", self._read_ephemeral())

    async def _read_ephemeral(self) -> None:
        """Reads until nothing new is left; one read at a time, so rows are handed on in order."""
        assert self._ephemeral_streams is not None
        self._ephemeral_reading = True
        try:
            while self._ephemeral_dirty and not self._stopped:
                self._ephemeral_dirty = False
                upto = (self._ephemeral_streams[0](), self._ephemeral_streams[1](), self._ephemeral_streams[2]())
                after = self._ephemeral_at
                items = await self._store.ephemeral((after[0], upto[0]), (after[1], upto[1]))
                presence = await self._store.presence(after[2], upto[2]) if upto[2] > after[2] else []
                self._ephemeral_at = upto
                if items:
                    await self._hand_out_ephemeral(items)
                if presence:
                    await self._hand_out_presence(presence)
        finally:
            self._ephemeral_reading = False

    async def _hand_out_ephemeral(self, items: Sequence[Ephemeral]) -> None:
        facts = await self._store.room_facts({item.room_id for item in items})
        for service_id, link in self._links.items():
            service = self._services[service_id]
            if not service.receive_ephemeral:
                continue
            wanted = [
                item.event for item in items
                if is_interested(service, EventFacts("", item.room_id, None, facts[item.room_id].aliases,
                                                     facts[item.room_id].members))
            ]
            if wanted:
                self._dispatch(link, link.on_ephemeral(wanted, self._now()))

    async def _hand_out_presence(self, changes: Sequence[PresenceChange]) -> None:
        """``m.presence`` of a user in a service's namespace, or sharing a room with one of its
        users (what Synapse pushes: the presence its users could see)."""
        wanting = {sid: link for sid, link in self._links.items() if self._services[sid].receive_ephemeral}
        if not wanting:
            return
        facts = await self._store.room_facts({room for change in changes for room in change.rooms})
        now = self._now()
        for service_id, link in wanting.items():
            service = self._services[service_id]
            # Each room's members matched once per read, not once per change that names the room.
            shared = {room for room, fact in facts.items()
                      if any(service.is_interested_in_user(member) for member in fact.members)}
            wanted = [presence_event(change.presence, now) for change in changes
                      if service.is_interested_in_user(change.presence.user_id) or not shared.isdisjoint(change.rooms)]
            if wanted:
                self._dispatch(link, link.on_ephemeral(wanted, now))

    def stop(self) -> None:
        self._stopped = True
        for timer in self._timers.values():
            if timer.active():
                timer.cancel()
        self._timers.clear()
        run_in_background("appservice_client_close", self._client.close())

    # --- carrying out ------------------------------------------------------------------------

    def _dispatch(self, link: ServiceLink, actions: Sequence[Action]) -> None:
        if self._stopped:
            return
        for action in actions:
            match action:
                case ScheduleWake(at_ms=at_ms):
                    self._schedule(link, at_ms)
                case Sent(txn=txn):
                    self._metrics.sent.labels(service=link.name).inc()
                    self._metrics.events.labels(service=link.name).inc(len(txn.events))
                    logger.debug("[%s] transaction %d accepted (%d events)", link.name, txn.txn_id, len(txn.events))
                case Failed(txn=txn, status=status, error=error, retry=retry):
                    self._metrics.failed.labels(service=link.name).inc()
                    logger.warning("[%s] transaction %d failed (%s: %s); retrying in %.1fs", link.name, txn.txn_id,
                                   status, error, retry.retry_interval / 1000)
                case Recovered():
                    logger.info("[%s] application service is answering again", link.name)
                case ReadEvents() | RecordTransaction() | SendTransaction() | Advance() | PersistRetry():
                    run_in_background("appservice_request", self._carry_out(link, action))

    def _schedule(self, link: ServiceLink, at_ms: int) -> None:
        old = self._timers.pop(link.name, None)
        if old is not None and old.active():
            old.cancel()
        delay = max(0.0, (at_ms - self._now()) / 1000)

        def wake() -> None:
            self._timers.pop(link.name, None)
            self._dispatch(link, link.on_wake(self._now()))

        self._timers[link.name] = self._clock.callLater(delay, wake)

    async def _carry_out(self, link: ServiceLink, request: Action) -> None:
        service = self._services[link.name]
        try:
            actions = await self._answer(link, service, request)
        except Exception:
            if self._stopped:
                return  # shutting down: the database may be closed under it; the row says where to go on
            logger.exception("[%s] carrying out %r failed", link.name, request)
            actions = link.on_crashed(self._now())
        self._dispatch(link, actions)

    async def _answer(self, link: ServiceLink, service: AppService, request: Action) -> list[Action]:
        match request:
            case ReadEvents(after=after, upto=upto, limit=limit, to_device_after=td_after, to_device_upto=td_upto):
                events, covered, more = await self._read(service, after, upto, limit)
                if td_after is None:
                    return link.on_events_read(events, covered, more, self._now())
                messages, td_covered, td_more = await self._read_to_device(service, td_after, td_upto, limit)
                return link.on_events_read(events, covered, more, self._now(), to_device=messages,
                                           to_device_covered=td_covered, to_device_more=td_more)
            case RecordTransaction(txn=txn):
                await self._store.record_transaction(service.id, txn.txn_id, txn.upto, txn.to_device_upto)
                return link.on_recorded(self._now())
            case SendTransaction(txn=txn):
                try:
                    status = await self._client.send_transaction(service, txn.txn_id, txn.body())
                except ServiceUnreachable as e:
                    return link.on_send_failed(None, str(e), self._now())
                if 200 <= status < 300:
                    return link.on_sent(self._now())
                return link.on_send_failed(status, f"HTTP {status}", self._now())
            case Advance(upto=position, clear_retry=clear_retry, to_device_upto=td_position):
                await self._store.advance(service.id, position, td_position, clear_retry=clear_retry)
                return link.on_advanced(self._now())
            case PersistRetry(retry=retry):
                await self._store.set_retry(service.id, retry.retry_last_ts, retry.retry_interval, retry.failure_ts)
                return link.on_retry_persisted(self._now())
        raise AssertionError(f"not a request: {request!r}")

    async def _read(self, service: AppService, after: int, upto: int | None,
                    limit: int) -> tuple[list[Mapping[str, Any]], int, bool]:
        end = self._events_position() if upto is None else upto
        if end <= after:
            return [], after, False
        rows, covered, more = await self._store.read_events(after, end, limit)
        if not rows:
            return [], covered, more
        facts = await self._store.room_facts({row.room_id for row in rows})
        wanted = [
            row.event_id for row in rows
            if is_interested(service, EventFacts(row.sender, row.room_id, row.member,
                                                 facts[row.room_id].aliases, facts[row.room_id].members))
        ]
        formatted = await self._format(wanted) if wanted else {}
        return [formatted[event_id] for event_id in wanted if event_id in formatted], covered, more

    async def _read_to_device(self, service: AppService, after: int, upto: int | None,
                              limit: int) -> tuple[list[Mapping[str, Any]], int, bool]:
        """MSC2409: the messages in (after, upto] for devices of users the service may act as,
        each with its target, the position the read covers and whether it stopped at ``limit``."""
        end = self._to_device_position() if upto is None else upto
        if end <= after:
            return [], after, False
        rows, covered, more = await self._store.read_to_device(after, end, limit)
        return [{**message, "to_user_id": user_id, "to_device_id": device_id}
                for user_id, device_id, message in rows if service.may_act_as(user_id)], covered, more

