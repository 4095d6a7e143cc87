"""Inbound ``PUT /_matrix/federation/v1/send/{txnId}``.

A transaction is processed once per (origin, txnId): a repeat gets the stored
response (kept in the database) without reprocessing, and a repeat that arrives while the first is in
flight waits for it. Limits come first (at most 50 PDUs and 100 EDUs, else
400). Each PDU then goes through the checks in ``pdus``: format, signatures,
content hash, auth against its auth events (fail: stored as rejected), against
the state before it (fail: stored as rejected) and against the room's current
state (fail: soft-failed: stored in the room's graph but not as a forward
extremity, not in current state, never shown to clients; the PDU's result is
success, see docs/federation.md). A room's PDUs are taken parents first; a gap in
front of them is filled by ``gaps.GapFiller`` (a bounded ``get_missing_events``
walk, then ``/state_ids`` for what the walk could not reach), one fill per room at
a time. A room's PDUs are checked on state planned in memory and persisted in one
database transaction per batch (``batching.BatchPlanner``; docs/federation.md,
"Inbound batching"); what a batch cannot take goes through the one-event path.
A room runs one round of this at a time; transactions (from any server) that reach
it meanwhile are taken together by its next round (``_handle_room_coalesced``).
EDUs go to hooks registered by type; types nobody handles are dropped.
"""

# tests: tests/integration/test_federation.py, tests/integration/test_federation_batching.py

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Coroutine, Mapping, Sequence
from typing import Any, Final, Protocol

import attrs
from twisted.internet.defer import CancelledError, Deferred, FirstError, gatherResults
from twisted.python.failure import Failure

from homeserver.events import FrozenEvent, KeyRing, ReceivedPdu, RoomVersion, get_room_version
from homeserver.events.errors import AuthError, EventsError, InvalidEvent, MissingEventsError
from homeserver.events.identifiers import is_valid_room_id
from homeserver.events.server_acl import ServerAcls
from homeserver.federation.batching import BatchPlanner, wanted_prevs
from homeserver.remote.client import FederationClient
from homeserver.federation.edus import EduRejected
from homeserver.federation.gaps import GapFiller, topological_order
from homeserver.federation.keys import Keyring
from homeserver.remote.metrics import FederationMetrics
from homeserver.federation.pdus import (
    auth_state_ids,
    auth_state_keys,
    check_against_auth_events,
    check_against_state,
    parse_with_keys,
    verify_each,
)
from homeserver.handlers.rooms.event_loader import EventLoader
from homeserver.handlers.rooms.event_persistence import EventPersister, RemoteBatchEvent
from storage.kernel.errors import MatrixError, bad_json
from storage.metrics import Children
from storage.stores.events import EventAlreadyPersisted, EventsStore, StateKey

logger = logging.getLogger(__name__)

MAX_PDUS: Final = 50
MAX_EDUS: Final = 100
REMEMBERED_TRANSACTIONS: Final = 10_000
MIN_PDUS_TO_SPLIT: Final = 8
"""A room's PDUs in one transaction from which half their signatures are checked on a thread."""

RunInThread = Callable[..., Coroutine[Any, Any, Any]]
"""``(func, *args)``: ``func(*args)`` run on a thread pool, awaited."""

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
        gaps: GapFiller,
        acl: ServerAcls | None = None,
        partial_rooms: Callable[[str], Awaitable[bool]] | None = None,
        run_in_thread: RunInThread | None = None,
    ) -> None:
        # Where half of a transaction's signature checks run (None: all on the reactor thread).
        self._run_in_thread = run_in_thread
        self._gaps = gaps
        # Whether a room is joined with partial state: its PDUs are then checked against their
        # own auth events only (docs/federation.md, "Partial-state joins").
        self._partial_rooms = partial_rooms
        self._metrics = metrics
        self._pdu_outcomes = Children(metrics.pdus)  # one child touched per PDU
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
        # Room ID -> the transactions waiting for the room's next round; present while a round
        # runs (``_handle_room_coalesced``).
        self._room_rounds: dict[str, list[_RoomEntry]] = {}

    def register_edu_handler(self, edu_type: str, handler: EduHandler) -> None:
        self._edu_handlers[edu_type] = handler

    async def on_send(self, origin: str, txn_id: str, body: Mapping[str, Any],
                      refused: Mapping[tuple[str, int], str] | None = None) -> dict[str, Any]:
        """The transaction's answer. ``refused``: its PDUs and EDUs that are not canonical JSON, by
        (``"pdus"``/``"edus"``, index), and what each breaks (``decode_json_entries``): such a PDU
        gets that error in the answer and is not processed, such an EDU is dropped."""
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
                    response = await self._process(origin, txn_id, body, refused or {})
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

    async def _process(self, origin: str, txn_id: str, body: Mapping[str, Any],
                       refused: Mapping[tuple[str, int], str]) -> dict[str, Any]:
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
        # Rooms are independent: each room's PDUs are handled together, the rooms side by side.
        # Each PDU with what its JSON breaks (None: nothing), so a PDU that is not canonical JSON
        # is answered in its room's turn, under its ID, like any other invalid PDU.
        by_room: dict[str, list[tuple[dict[str, Any], str | None]]] = {}
        for index, pdu in enumerate(pdus):
            # Anything without a room ID string has no room or ID to report it under: dropped.
            if isinstance(pdu, dict) and isinstance(pdu.get("room_id"), str):
                by_room.setdefault(pdu["room_id"], []).append((pdu, refused.get(("pdus", index))))

        # Looked up once for all the transaction's rooms: versions and server ACLs; the rooms'
        # PDUs are then verified, and which of their prev events we have is read in one go.
        rooms = [room_id for room_id in by_room if is_valid_room_id(room_id)]  # no lookup sees the rest
        versions = await self._store.get_room_versions(rooms)
        denied = await self._acl.denied_rooms(origin, list(versions)) if self._acl is not None else set()
        verified: dict[str, tuple[RoomVersion, list[FrozenEvent]]] = {}

        async def verify_room(room_id: str) -> None:
            room_pdus = by_room[room_id]
            identifier = versions.get(room_id)
            if identifier is None:
                logger.warning("TX [%s] %d PDUs for unknown room %s dropped", origin, len(room_pdus), room_id)
                return
            room_version = get_room_version(identifier)
            if room_id in denied:
                logger.warning("TX [%s] %d PDUs for %s dropped: the room's server ACL denies the origin",
                               origin, len(room_pdus), room_id)
                for pdu, _ in room_pdus:
                    event_id = _event_id_guess(room_version, pdu)
                    if event_id is not None:
                        results[event_id] = {"error": "M_FORBIDDEN: the room's server ACL denies this server"}
                return
            # Independent of one another: parsed side by side (the keys they need are fetched
            # at once, each server's once), then their signatures checked, in the order they came.
            parsed = await gatherResults(
                [Deferred.fromCoroutine(self._parse_pdu(origin, room_version, pdu, not_canonical))
                 for pdu, not_canonical in room_pdus],
                consumeErrors=True,
            )
            verdicts = iter(await self._verify_all([item for item in parsed if not isinstance(item, str)]))
            events = []
            for (pdu, _), item in zip(room_pdus, parsed):
                if isinstance(item, str):
                    error = item
                else:
                    verdict = next(verdicts)
                    if isinstance(verdict, FrozenEvent):
                        events.append(verdict)
                        continue
                    error = self._refused(origin, verdict)
                event_id = _event_id_guess(room_version, pdu)
                if event_id is not None:
                    results[event_id] = {"error": error}
            if events:
                verified[room_id] = (room_version, events)

        await _each(verify_room, rooms)
        # A hint for each room's gap check: prev events only ever join the timeline, so one that
        # is in it now still is when the room's turn comes (one that is not is read again then).
        in_timeline = await self._gaps.timeline_ids(
            {p for _, events in verified.values() for e in events for p in e.prev_event_ids})

        async def handle_room(room_id: str) -> None:
            room_version, events = verified[room_id]
            outcomes = await self._handle_room_coalesced(origin, room_version, events, in_timeline)
            for event_id, error in outcomes.items():
                results[event_id] = {"error": error} if error else {}

        await _each(handle_room, list(verified))
        for index, edu in enumerate(edus):
            bad_edu = refused.get(("edus", index))
            if bad_edu is not None:
                logger.warning("TX [%s] EDU dropped: not canonical JSON: %s", origin, bad_edu)
                continue
            await self._handle_edu(origin, edu)
        return {"pdus": results}

    async def _parse_pdu(self, origin: str, room_version: RoomVersion, pdu: dict[str, Any],
                         not_canonical: str | None) -> tuple[ReceivedPdu, KeyRing] | str:
        """The PDU validated, with the keys its signatures need; or why it is refused
        (``not_canonical``: what its JSON breaks, found as the body was read)."""
        if not_canonical is not None:
            return self._refused(origin, InvalidEvent(f"the PDU is not canonical JSON: {not_canonical}"))
        try:
            return await parse_with_keys(self._keyring, room_version, pdu)
        except EventsError as e:
            return self._refused(origin, e)

    def _refused(self, origin: str, error: EventsError) -> str:
        logger.warning("TX [%s] PDU failed verification: %s", origin, error)
        self._pdu_outcomes["invalid"].inc()
        return f"verification failed: {error}"

    async def _verify_all(self, items: Sequence[tuple[ReceivedPdu, KeyRing]]) -> list[FrozenEvent | EventsError]:
        """``verify_each`` of the items, in order. With a thread to run on and enough of them, the
        first half is checked there while this thread checks the second: the ed25519 checks
        release the GIL, so on two free cores they run side by side."""
        if self._run_in_thread is None or len(items) < MIN_PDUS_TO_SPLIT:
            return verify_each(items)
        half = len(items) // 2
        first: Deferred[list[FrozenEvent | EventsError]] = Deferred.fromCoroutine(
            self._run_in_thread(verify_each, items[:half]))
        try:
            second = verify_each(items[half:])
        except BaseException:
            first.addErrback(lambda _: None)  # this failure is the one reported
            raise
        return [*(await first), *second]

    async def _handle_room_coalesced(self, origin: str, room_version: RoomVersion, events: list[FrozenEvent],
                                     in_timeline: Collection[str]) -> dict[str, str | None]:
        """``_handle_room_events`` of one transaction's PDUs of a room, coalesced with those of
        the transactions (from any server) that reach the same room meanwhile.

        A room has at most one round running. A transaction that finds one running waits for
        the next; when the round ends, the first transaction waiting leads the next round, which
        takes every transaction waiting by then, so concurrent transactions for a busy room are
        checked and persisted together (one walk per origin, one batch where their PDUs make
        one line) and no transaction leads more than the one round its own PDUs are in."""
        room_id = events[0].room_id
        entry = _RoomEntry(origin, events, in_timeline)
        waiting = self._room_rounds.get(room_id)
        if waiting is not None:
            waiting.append(entry)
            self._metrics.room_round_waiting.inc()
            try:
                handed = await entry.done
            except BaseException:
                # Cancelled while waiting (its request went away): it leaves the queue.
                queued = self._room_rounds.get(room_id)
                if queued is not None and entry in queued:
                    queued.remove(entry)
                raise
            finally:
                self._metrics.room_round_waiting.dec()
            if handed is not _LEAD:
                outcomes: dict[str, str | None] = handed
                return outcomes
        else:
            self._room_rounds[room_id] = [entry]
        taken = self._room_rounds[room_id]
        self._room_rounds[room_id] = []  # whoever comes now waits for the next round
        self._metrics.room_rounds.labels(transactions="one" if len(taken) == 1 else "several").inc()
        try:
            results = await self._handle_room_events(room_version, taken)
        except BaseException as e:
            failure = Failure(MatrixError(500, "M_UNKNOWN", "the transaction handling this room was cancelled")
                              if isinstance(e, CancelledError) else e)
            for other in taken:
                if other is not entry and not other.done.called:
                    other.done.errback(failure)
            raise
        finally:
            after = self._room_rounds[room_id]
            if after:
                after[0].done.callback(_LEAD)
            else:
                del self._room_rounds[room_id]
        mine: dict[str, str | None] | None = None
        for other, result in zip(taken, results):
            if other is entry:
                if isinstance(result, BaseException):
                    raise result
                mine = result
            elif other.done.called:  # its request went away meanwhile
                continue
            elif isinstance(result, BaseException):
                other.done.errback(Failure(result))
            else:
                other.done.callback(result)
        assert mine is not None
        return mine

    async def _handle_room_events(self, room_version: RoomVersion,
                                  entries: Sequence[_RoomEntry]) -> list[dict[str, str | None] | BaseException]:
        """Check and persist the verified PDUs of one room that one or more transactions
        (``entries``) carry; for each entry, event ID -> error, or what failed it alone.

        The PDUs are taken parents first whatever order they came in, so a transaction that
        carries a child before its parent is accepted whole. PDUs whose prev events are
        neither in our timeline nor among the round's PDUs are the gap's edge: one
        ``get_missing_events`` walk per transaction (from its origin) covers all of them, and
        what it brings is persisted oldest first. A PDU (or fetched event) whose prev events are
        still unknown after that gets the state it was sent on from its origin's ``/state_ids``
        (``GapFiller.state_before``). A PDU two transactions carry is taken once; both get its
        result. A walk that fails (the origin's budget is spent) fails its transaction alone.
        """
        room_id = entries[0].events[0].room_id
        outcomes: dict[str, str | None] = {}
        results: list[dict[str, str | None] | BaseException] = []
        async with self._gaps.room_lock(room_id):
            listed_ids = {e.event_id for entry in entries for e in entry.events}
            origins: dict[str, str] = {}
            taken: list[FrozenEvent] = []
            walked: list[bool] = []
            for entry in entries:
                ordered = topological_order(entry.events)
                try:
                    fetched = await self._gaps.walk(entry.origin, room_version, room_id, ordered,
                                                    known={*entry.in_timeline, *listed_ids} if len(entries) > 1
                                                    else entry.in_timeline)
                except (MatrixError, EventsError) as e:
                    if len(entries) == 1:
                        raise
                    walked.append(False)
                    results.append(e)
                    continue
                walked.append(True)
                results.append({})
                for event in [*fetched, *ordered]:
                    origins.setdefault(event.event_id, entry.origin)
                taken.extend(fetched)
                taken.extend(ordered)
            ours = {e.event_id for entry, ok in zip(entries, walked) if ok for e in entry.events}
            # The fetched events and the transactions' interleave (a fetched event may follow one
            # of a transaction's): all of them are taken parents first, together, once each.
            sequence = topological_order(taken) if len(entries) > 1 or len(taken) > len(ours) else taken
            if sequence:
                # Their auth events, read in one go (those among them are checked from memory).
                listed = {e.event_id for e in sequence}
                await self._loader.load_events({a for e in sequence for a in e.auth_event_ids} - listed)
                if await self._is_partial(room_id):
                    # Our state lacks the members' events these cite: fetched, as outliers, from
                    # the server that brought each.
                    by_origin: dict[str, list[FrozenEvent]] = {}
                    for event in sequence:
                        by_origin.setdefault(origins[event.event_id], []).append(event)
                    for event_origin, brought in by_origin.items():
                        await self._gaps.fetch_missing_auth_events(event_origin, room_version, room_id, brought)
            i = 0
            while i < len(sequence):
                i, one_next = await self._persist_batch(origins, room_version, sequence, i, ours, outcomes)
                if one_next:
                    await self._persist_one(origins[sequence[i].event_id], room_version, sequence[i], ours, outcomes)
                    i += 1
        for entry, result in zip(entries, results):
            if isinstance(result, dict):
                result.update((e.event_id, outcomes[e.event_id]) for e in entry.events if e.event_id in outcomes)
        return results

    async def _persist_batch(self, origins: Mapping[str, str], room_version: RoomVersion,
                             sequence: Sequence[FrozenEvent], i: int, ours: Collection[str],
                             outcomes: dict[str, str | None]) -> tuple[int, bool]:
        """Check ``sequence[i:]`` and persist it in one transaction as far as ``BatchPlanner`` lets
        it (docs/federation.md, "Inbound batching"). Returns where it stopped and whether the
        event there must take the one-event path (else it stopped at the end)."""
        rest = sequence[i:]
        room_id = rest[0].room_id
        verdicts: list[tuple[FrozenEvent, str | None, str]] = []  # event, error, metric outcome
        batch: list[RemoteBatchEvent] = []
        async with self._persister.room_lock(room_id):
            start = await self._store.get_batch_start(room_id, [e.event_id for e in rest], wanted_prevs(rest),
                                                      auth_state_keys(room_version, rest))
            planner = BatchPlanner(start)
            partial = await self._is_partial(room_id)
            known: dict[str, FrozenEvent] = {}
            stop = len(sequence)
            for j, event in enumerate(rest, start=i):
                origin = origins[event.event_id]  # the server whose transaction (or walk) brought it
                plan = planner.plan(event)
                if plan is None:
                    stop = j
                    break
                try:
                    rejection = await self._rejection(origin, room_version, event, plan.state_before, known,
                                                      partial=partial)
                    soft_failed = rejection is None and not partial and await self._soft_fails(
                        origin, room_version, event, planner.current_state, known, passed_on=plan.state_before)
                except EventsError as e:  # its auth events are unknown: nothing is stored
                    verdicts.append((event, str(e), _outcome(e)))
                    continue
                if not planner.batchable(plan, soft_failed=soft_failed):
                    stop = j
                    break
                delta = planner.record(event, plan, rejected=rejection is not None, soft_failed=soft_failed)
                known[event.event_id] = event
                batch.append(RemoteBatchEvent(
                    event, rejection, soft_failed, plan.prev_group, plan.prev if plan.prev_group is None else None,
                    None if soft_failed else delta,
                ))
                if rejection is not None:
                    verdicts.append((event, f"rejected: {rejection}", "rejected"))
                else:
                    verdicts.append((event, None, "soft_failed" if soft_failed else "accepted"))
            try:
                await self._persister.persist_remote_batch(room_version, batch)
            except EventAlreadyPersisted:
                # Stored meanwhile by another path: this one goes on one event at a time.
                logger.info("[%s] an event of a batch was stored meanwhile; taking them one by one", room_id)
                return i, True
        for event, error, outcome in verdicts:
            if event.event_id in ours:
                self._pdu_outcomes[outcome].inc()
                outcomes[event.event_id] = error
            elif error is not None and outcome != "rejected":
                logger.warning("[%s] missing event %s not stored: %s", room_id, event.event_id, error)
        return stop, stop < len(sequence)

    async def _persist_one(self, origin: str, room_version: RoomVersion, event: FrozenEvent,
                           ours: Collection[str], outcomes: dict[str, str | None]) -> None:
        """Check and persist one event on its own (the path batching falls back to)."""
        if event.event_id not in ours:
            try:
                await self._check_and_persist(origin, room_version, event)
            except SoftFailed:
                pass
            except EventsError as e:
                logger.warning("[%s] missing event %s not stored: %s", event.room_id, event.event_id, e)
            return
        try:
            await self._check_and_persist(origin, room_version, event)
        except SoftFailed:
            # Accepted and stored (spec: "handled as normal" apart from clients and extremities).
            self._pdu_outcomes["soft_failed"].inc()
            outcomes[event.event_id] = None
        except EventsError as e:
            self._pdu_outcomes[_outcome(e)].inc()
            outcomes[event.event_id] = str(e)
        else:
            self._pdu_outcomes["accepted"].inc()
            outcomes[event.event_id] = None

    async def _rejection(self, origin: str, room_version: RoomVersion, event: FrozenEvent,
                         state_before: Mapping[StateKey, str],
                         known: Mapping[str, FrozenEvent] | None = None, *, partial: bool = False) -> str | None:
        """Why the event is rejected (auth against its auth events, then against the state before
        it), or None. ``known``: events of the batch not stored yet. ``partial``: the room's state
        lacks its members (a partial-state join), so only the auth events are checked."""
        try:
            passed = await check_against_auth_events(self._loader, room_version, event, known)
            if not partial:
                await check_against_state(self._loader, room_version, event, state_before, known, passed=passed)
        except AuthError as e:
            logger.warning("[%s] rejecting %s from %s: %s", event.room_id, event.event_id, origin, e)
            return str(e)
        return None

    async def _is_partial(self, room_id: str) -> bool:
        return self._partial_rooms is not None and await self._partial_rooms(room_id)

    async def _soft_fails(self, origin: str, room_version: RoomVersion, event: FrozenEvent,
                          current: Mapping[StateKey, str], known: Mapping[str, FrozenEvent] | None = None,
                          *, passed_on: Mapping[StateKey, str] | None = None) -> bool:
        """Whether the event fails auth against the room's current state (it is soft-failed).
        ``passed_on``: a state it passed auth against; where the current state agrees with it on
        every key the rules read (always, on the room's one line of history), the verdict is the
        same and is not worked out again."""
        if passed_on is not None and (
                passed_on is current
                or auth_state_ids(room_version, event, passed_on) == auth_state_ids(room_version, event, current)):
            return False
        try:
            await check_against_state(self._loader, room_version, event, current, known)
        except AuthError as e:
            logger.warning("[%s] soft-failing %s from %s: %s", event.room_id, event.event_id, origin, e)
            return True
        return False

    async def _check_and_persist(self, origin: str, room_version: RoomVersion, event: FrozenEvent) -> None:
        """The spec's checks on receipt of a PDU, then persist it (rejected or soft-failed as they say).

        When a prev event is not in our timeline, the state before the event comes from
        the origin's ``/state_ids``; otherwise from our state groups. Raises ``Rejected``
        or ``SoftFailed`` after storing the event, ``MissingEventsError``/``GapFillError``
        (nothing stored) when its state cannot be known.
        """
        given_state: dict[StateKey, str] | None = None
        if event.prev_event_ids and len(await self._gaps.timeline_ids(event.prev_event_ids)) < len(
            set(event.prev_event_ids)
        ):
            given_state = await self._gaps.state_before(origin, room_version, event)
        # Every prev event is in the timeline unless ``given_state`` is set, so this read finds them.
        if given_state is None:
            state_before = await self._loader.state_before_event(room_version, event)
        else:
            state_before = given_state
        # A MissingEventsError (auth events unknown; not an AuthError) propagates: nothing is stored.
        partial = await self._is_partial(event.room_id)
        rejection = await self._rejection(origin, room_version, event, state_before, partial=partial)
        soft_failed = False
        if rejection is None and not partial:
            current = await self._store.get_current_state_ids(event.room_id)
            soft_failed = await self._soft_fails(origin, room_version, event, current)
        await self._persister.persist(
            room_version, event, is_local=False, rejection_reason=rejection, soft_failed=soft_failed,
            state_before=given_state,
        )
        if rejection is not None:
            raise Rejected(f"rejected: {rejection}")
        if soft_failed:
            raise SoftFailed("soft-failed against the current state (stored, not shown to clients)")

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


async def _each(handle: Callable[[str], Coroutine[Any, Any, None]], room_ids: list[str]) -> None:
    """``handle`` each room, the rooms side by side; the first failure is raised."""
    try:
        await gatherResults([Deferred.fromCoroutine(handle(r)) for r in room_ids], consumeErrors=True)
    except FirstError as e:
        e.subFailure.raiseException()


@attrs.define
class _RoomEntry:
    """One transaction's verified PDUs of a room, waiting for (or in) a round of the room."""

    origin: str
    events: list[FrozenEvent]
    in_timeline: Collection[str]
    # Fired with the entry's outcomes, its failure, or ``_LEAD``: it leads the next round.
    done: Deferred[Any] = attrs.Factory(Deferred)


_LEAD: Final = object()


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

