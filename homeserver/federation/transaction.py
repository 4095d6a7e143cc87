"""Inbound ``PUT /_matrix/federation/v1/send/{txnId}``.

A transaction is processed once per (origin, txnId): a repeat gets the stored
response (kept in the database) without reprocessing, and a repeat that arrives while the first is in
flight waits for it. Limits come first (at most 50 PDUs and 100 EDUs, else
400). Each PDU then goes through the checks in ``pdus``: format, signatures,
content hash, auth against its auth events (fail: stored as rejected), against
the state before it (fail: stored as rejected) and against the room's current
state (fail: soft-failed: stored in the room's graph but not as a forward
extremity, not in current state, never shown to clients; the PDU's result is
success, see docs/federation.md). Missing ``prev_events`` are fetched once with
``get_missing_events`` (at most ``MISSING_EVENTS_LIMIT``). EDUs go to hooks
registered by type; types nobody handles are dropped.
"""

# tests: tests/integration/test_federation.py

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, Protocol
from urllib.parse import quote

from twisted.internet.defer import Deferred, FirstError, gatherResults

from homeserver.events import FrozenEvent, RoomVersion, get_room_version
from homeserver.events.errors import AuthError, EventsError, MissingEventsError
from homeserver.events.identifiers import is_valid_room_id
from homeserver.federation.acl import ServerAcls
from homeserver.federation.client import FederationClient, FederationClientError
from homeserver.federation.edus import EduRejected
from homeserver.federation.keys import Keyring
from homeserver.federation.metrics import FederationMetrics
from homeserver.federation.pdus import by_depth, check_against_auth_events, check_against_state, parse_and_verify
from homeserver.handlers.event_loader import EventLoader
from homeserver.handlers.event_persistence import EventPersister
from storage.kernel.errors import MatrixError, bad_json
from storage.stores.events import EventsStore

logger = logging.getLogger(__name__)

MAX_PDUS: Final = 50
MAX_EDUS: Final = 100
MISSING_EVENTS_LIMIT: Final = 10
REMEMBERED_TRANSACTIONS: Final = 10_000

class TransactionStore(Protocol):
    """Where answered transactions are kept (``storage.stores.federation.FederationStore``)."""

    async def get_transaction_response(self, origin: str, transaction_id: str) -> dict[str, Any] | None: ...

    async def store_transaction_response(
        self, origin: str, transaction_id: str, response: dict[str, Any], now_ms: int
    ) -> None: ...


EduHandler = Callable[[str, Any], Awaitable[None]]
"""``(origin, content)``: one EDU of the type it was registered for."""


class TransactionHandler:
    def __init__(
        self,
        *,
        server_name: str,
        store: EventsStore,
        persister: EventPersister, loader: EventLoader,
        keyring: Keyring,
        client: FederationClient,
        txn_store: TransactionStore,
        clock_ms: Callable[[], int],
        metrics: FederationMetrics,
        acl: ServerAcls | None = None,
    ) -> None:
        self._metrics = metrics
        # Server ACLs: PDUs and EDUs of rooms whose ACL denies the origin are dropped.
        self._acl = acl
        self._txn_store = txn_store
        self._clock_ms = clock_ms
        self._server_name = server_name
        self._store = store
        self._persister = persister
        self._loader = loader
        self._keyring = keyring
        self._client = client
        self._edu_handlers: dict[str, EduHandler] = {}
        # (origin, txnId) -> response: the recent ones in memory, all of them in the database.
        self._responses: OrderedDict[tuple[str, str], dict[str, Any]] = OrderedDict()
        self._in_flight: dict[tuple[str, str], list[Deferred[dict[str, Any]]]] = {}

    def register_edu_handler(self, edu_type: str, handler: EduHandler) -> None:
        self._edu_handlers[edu_type] = handler

    async def on_send(self, origin: str, txn_id: str, body: Mapping[str, Any]) -> dict[str, Any]:
        key = (origin, txn_id)
        stored = self._responses.get(key)
        if stored is not None:
            logger.info("TX [%s] %s is a repeat; answering from the stored response", origin, txn_id)
            self._metrics.transactions.labels(outcome="repeat").inc()
            return stored
        waiters = self._in_flight.get(key)
        if waiters is not None:
            d: Deferred[dict[str, Any]] = Deferred()
            waiters.append(d)
            return await d
        self._in_flight[key] = []
        try:
            stored = await self._txn_store.get_transaction_response(origin, txn_id)
            if stored is not None:
                logger.info("TX [%s] %s is a repeat; answering from the stored response", origin, txn_id)
                self._metrics.transactions.labels(outcome="repeat").inc()
                response = stored
            else:
                try:
                    response = await self._process(origin, txn_id, body)
                except MatrixError:
                    self._metrics.transactions.labels(outcome="refused").inc()
                    raise
                self._metrics.transactions.labels(outcome="processed").inc()
                await self._txn_store.store_transaction_response(origin, txn_id, response, self._clock_ms())
        except BaseException:
            for waiter in self._in_flight.pop(key, []):
                waiter.errback(MatrixError(500, "M_UNKNOWN", "the first copy of this transaction failed"))
            raise
        self._responses[key] = response
        while len(self._responses) > REMEMBERED_TRANSACTIONS:
            self._responses.popitem(last=False)
        for waiter in self._in_flight.pop(key, []):
            waiter.callback(response)
        return response

    async def _process(self, origin: str, txn_id: str, body: Mapping[str, Any]) -> dict[str, Any]:
        pdus = body.get("pdus", [])
        edus = body.get("edus", [])
        if not isinstance(pdus, list) or not isinstance(edus, list):
            raise bad_json("'pdus' and 'edus' must be lists")
        if len(pdus) > MAX_PDUS or len(edus) > MAX_EDUS:
            raise bad_json(
                f"a transaction may carry at most {MAX_PDUS} PDUs and {MAX_EDUS} EDUs, "
                f"this one has {len(pdus)} and {len(edus)}"
            )
        if body.get("origin", origin) != origin:
            raise MatrixError(400, "M_FORBIDDEN", "transaction 'origin' differs from the authenticated origin")
        logger.info("TX [%s] %s: %d PDUs, %d EDUs", origin, txn_id, len(pdus), len(edus))
        results: dict[str, dict[str, str]] = {}
        # Rooms are independent: each room's PDUs are handled in order, the rooms side by side.
        by_room: dict[object, list[object]] = {}
        for pdu in pdus:
            by_room.setdefault(pdu.get("room_id") if isinstance(pdu, dict) else None, []).append(pdu)

        async def handle_room(room_pdus: list[object]) -> None:
            for pdu in room_pdus:
                event_id, error = await self._handle_pdu(origin, pdu)
                if event_id is not None:
                    results[event_id] = {"error": error} if error else {}

        try:
            await gatherResults([Deferred.fromCoroutine(handle_room(p)) for p in by_room.values()], consumeErrors=True)
        except FirstError as e:
            e.subFailure.raiseException()
        for edu in edus:
            await self._handle_edu(origin, edu)
        return {"pdus": results}

    async def _handle_pdu(self, origin: str, pdu: object) -> tuple[str | None, str | None]:
        if not isinstance(pdu, dict) or not is_valid_room_id(pdu.get("room_id")):
            return None, None  # unidentifiable (or a room ID no lookup should see): nothing to report it under
        room_id = pdu["room_id"]
        identifier = await self._store.get_room_version(room_id)
        if identifier is None:
            logger.warning("TX [%s] PDU for unknown room %s dropped", origin, room_id)
            return None, None
        room_version = get_room_version(identifier)
        if self._acl is not None and not await self._acl.allows(origin, room_id):
            logger.warning("TX [%s] PDU for %s dropped: the room's server ACL denies the origin", origin, room_id)
            return _event_id_guess(room_version, pdu), "M_FORBIDDEN: the room's server ACL denies this server"
        try:
            event = await parse_and_verify(self._keyring, room_version, pdu)
        except EventsError as e:
            logger.warning("TX [%s] PDU in %s failed verification: %s", origin, room_id, e)
            self._metrics.pdus.labels(outcome="invalid").inc()
            return _event_id_guess(room_version, pdu), f"verification failed: {e}"
        try:
            await self._process_event(origin, room_version, event, fetch_missing=True)
        except SoftFailed:
            # Accepted and stored (spec: "handled as normal" apart from clients and extremities).
            self._metrics.pdus.labels(outcome="soft_failed").inc()
            return event.event_id, None
        except EventsError as e:
            self._metrics.pdus.labels(outcome=_outcome(e)).inc()
            return event.event_id, str(e)
        self._metrics.pdus.labels(outcome="accepted").inc()
        return event.event_id, None

    async def _process_event(self, origin: str, room_version: RoomVersion, event: FrozenEvent, *,
                             fetch_missing: bool) -> None:
        known = await self._loader.load_events(event.prev_event_ids)
        missing = [e for e in event.prev_event_ids if e not in known]
        if missing and fetch_missing:
            await self._fetch_missing(origin, room_version, event)
            known = await self._loader.load_events(event.prev_event_ids)
            missing = [e for e in event.prev_event_ids if e not in known]
        if missing:
            raise MissingEventsError(frozenset(missing), f"prev_events of {event.event_id} are unknown")
        rejection: str | None = None
        try:
            await check_against_auth_events(self._loader, room_version, event)
            state_before = await self._loader.state_before_event(room_version, event)
            await check_against_state(self._loader, room_version, event, state_before)
        except AuthError as e:
            rejection = str(e)
            logger.warning("[%s] rejecting %s from %s: %s", event.room_id, event.event_id, origin, e)
        soft_failed = False
        if rejection is None:
            current = await self._store.get_current_state_ids(event.room_id)
            try:
                await check_against_state(self._loader, room_version, event, current)
            except AuthError as e:
                logger.warning("[%s] soft-failing %s from %s: %s", event.room_id, event.event_id, origin, e)
                soft_failed = True
        await self._persister.persist(
            room_version, event, is_local=False, rejection_reason=rejection, soft_failed=soft_failed
        )
        if rejection is not None:
            raise Rejected(f"rejected: {rejection}")
        if soft_failed:
            raise SoftFailed("soft-failed against the current state (stored, not shown to clients)")

    async def _fetch_missing(self, origin: str, room_version: RoomVersion, event: FrozenEvent) -> None:
        extremities = await self._store.get_forward_extremities(event.room_id)
        try:
            response = await self._client.post_json(
                origin,
                f"/_matrix/federation/v1/get_missing_events/{quote(event.room_id, safe='')}",
                {
                    "earliest_events": sorted(extremities),
                    "latest_events": [event.event_id],
                    "limit": MISSING_EVENTS_LIMIT,
                    "min_depth": min(extremities.values(), default=0),
                },
            )
        except FederationClientError as e:
            logger.warning("[%s] get_missing_events from %s failed: %s", event.room_id, origin, e)
            return
        raw = response.get("events") if isinstance(response, dict) else None
        if not isinstance(raw, list):
            return
        fetched = []
        for pdu in raw[:MISSING_EVENTS_LIMIT]:
            try:
                fetched.append(await parse_and_verify(self._keyring, room_version, pdu))
            except EventsError as e:
                logger.warning("[%s] missing event from %s failed verification: %s", event.room_id, origin, e)
        for missing in by_depth(fetched):
            if missing.room_id != event.room_id:
                continue
            try:
                await self._process_event(origin, room_version, missing, fetch_missing=False)
            except EventsError as e:
                logger.warning("[%s] missing event %s not stored: %s", event.room_id, missing.event_id, e)

    async def _handle_edu(self, origin: str, edu: object) -> None:
        if not isinstance(edu, dict) or not isinstance(edu.get("edu_type"), str):
            return
        handler = self._edu_handlers.get(edu["edu_type"])
        if handler is None:
            logger.debug("TX [%s] no handler for EDU %s", origin, edu["edu_type"])
            return
        content = edu.get("content")
        if self._acl is not None:
            content = await self._acl.filter_edu(origin, edu["edu_type"], content)
            if content is None:
                return
        try:
            await handler(origin, content)
        except EduRejected as e:
            logger.warning("TX [%s] %s EDU dropped: %s", origin, edu["edu_type"], e)
        except Exception:
            logger.exception("EDU handler for %s failed", edu["edu_type"])


class SoftFailed(AuthError):
    """The event passed auth at its own state but not at the room's current state."""


class Rejected(AuthError):
    """The event failed auth and was stored as rejected."""


def _outcome(error: EventsError) -> str:
    if isinstance(error, SoftFailed):
        return "soft_failed"
    if isinstance(error, MissingEventsError):
        return "missing_events"
    if isinstance(error, AuthError):
        return "rejected"
    return "invalid"


def _event_id_guess(room_version: RoomVersion, pdu: Mapping[str, Any]) -> str | None:
    from homeserver.events import compute_event_id

    try:
        return compute_event_id(room_version, pdu)
    except Exception:  # a PDU too broken to hash: no ID to report it under
        return None

