"""Filling the gaps in front of received PDUs: ``get_missing_events`` walks, then ``/state_ids``.

A PDU whose ``prev_events`` are not in our timeline has a gap behind it. The
``GapFiller`` first walks back with ``POST /get_missing_events`` (earliest: our
forward extremities, latest: the PDUs at the gap's edge), ``per_call`` events a
call, until every fetched event's prev events are known or ``max_events`` were
fetched; the caller persists what it fetched, oldest first. Where an event's prev
events are still unknown after that (the gap is longer than the walk, or the origin
refuses to walk), ``state_before`` takes the state after each unknown prev event from
the origin's ``/state_ids``, fetches the events it names that we lack with ``/event``
(verified, stored as outliers) and resolves the prev events' states, so the event
is placed in the room with the state it was sent on; the history in between stays
a hole that ``/backfill`` fills when a client pages back. Every remote request of
gap filling spends one unit of the origin's ``rc_missing_events`` budget; when it
is spent the transaction is answered 429, to be sent again later.

The ordering helpers at the top are pure; the filler does the I/O and knows
nothing of transactions (the caller checks auth and persists).
"""

# tests: tests/unit/federation/test_gaps.py, tests/integration/test_federation.py

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, Final
from urllib.parse import quote

import attrs
from twisted.internet.defer import DeferredLock

from homeserver.events import FrozenEvent, RoomVersion
from homeserver.events import constants as C
from homeserver.events.errors import AuthError, EventsError, MissingEventsError
from homeserver.remote.client import FederationClient, FederationClientError
from homeserver.federation.keys import Keyring
from homeserver.remote.metrics import FederationMetrics
from homeserver.federation.pdus import check_against_auth_events, parse_and_verify, verified_in_room
from homeserver.handlers.rooms.event_loader import EventLoader
from homeserver.handlers.rooms.event_persistence import EventPersister
from storage.kernel.ratelimit import Ratelimiter
from storage.kernel.concurrency import map_concurrently
from storage.kernel.errors import MatrixError
from storage.stores.events import EventsStore, StateKey

logger = logging.getLogger(__name__)

MAX_STATE_IDS: Final = 20_000
"""Event IDs one ``/state_ids`` answer may name (state plus auth chain); more is refused."""

MAX_EVENT_FETCHES: Final = 100
"""Missing state events fetched one by one with ``/event``; more are taken from one ``/state``."""

MAX_LATEST_EVENTS: Final = 20
"""``latest_events`` named in one ``get_missing_events`` call (the oldest of the gap's edge)."""

MAX_UNKNOWN_PREVS: Final = 5
"""Unknown prev events of one event whose state is taken from ``/state_ids`` (one request each)."""


# --- pure ordering ----------------------------------------------------------------------


def _prev_events(event: FrozenEvent) -> Iterable[str]:
    return event.prev_event_ids


def topological_order(events: Iterable[FrozenEvent],
                      edges: Callable[[FrozenEvent], Iterable[str]] = _prev_events) -> list[FrozenEvent]:
    """``events`` (one copy per ID) with every event after those of its prev events (or of
    the IDs ``edges`` gives, such as its auth events) that are among them; otherwise oldest
    first, by (depth, event ID). A claimed depth never puts a child before its parent."""
    by_id: dict[str, FrozenEvent] = {}
    for event in events:
        by_id.setdefault(event.event_id, event)
    waiting: dict[str, int] = {}
    children: dict[str, list[str]] = {}
    for event in by_id.values():
        parents = {p for p in edges(event) if p in by_id and p != event.event_id}
        waiting[event.event_id] = len(parents)
        for parent in parents:
            children.setdefault(parent, []).append(event.event_id)
    ready = [(e.depth, e.event_id) for e in by_id.values() if waiting[e.event_id] == 0]
    heapq.heapify(ready)
    ordered: list[FrozenEvent] = []
    while ready:
        _, event_id = heapq.heappop(ready)
        ordered.append(by_id[event_id])
        for child in children.get(event_id, ()):
            waiting[child] -= 1
            if waiting[child] == 0:
                heapq.heappush(ready, (by_id[child].depth, child))
    if len(ordered) < len(by_id):  # a cycle (impossible for hashed IDs): the rest by depth
        placed = {e.event_id for e in ordered}
        ordered.extend(sorted((e for e in by_id.values() if e.event_id not in placed),
                              key=lambda e: (e.depth, e.event_id)))
    return ordered


def unknown_prevs(events: Iterable[FrozenEvent], known: Collection[str]) -> set[str]:
    """Prev events of ``events`` that are neither ``known`` nor among ``events``."""
    listed = list(events)
    ids = {e.event_id for e in listed}
    return {p for e in listed for p in e.prev_event_ids if p not in ids and p not in known}


def gap_edge(events: Iterable[FrozenEvent], known: Collection[str]) -> list[FrozenEvent]:
    """Those of ``events`` with a prev event that is neither ``known`` nor among ``events``:
    where a walk back must continue from. Oldest first."""
    listed = list(events)
    ids = {e.event_id for e in listed}
    edge = [e for e in listed if any(p not in ids and p not in known for p in e.prev_event_ids)]
    return sorted(edge, key=lambda e: (e.depth, e.event_id))


# --- the filler -------------------------------------------------------------------------


@attrs.frozen
class GapLimits:
    """How far one gap fill may go (``federation_limits``, docs/configuration.md)."""

    max_events: int = 100      # events one get_missing_events walk fetches in all
    per_call: int = 10         # events asked for in one get_missing_events call (Synapse's 10)
    concurrency: int = 10      # /event fetches at once while taking state from /state_ids


class GapFillError(EventsError):
    """The state before an event could not be taken from its origin."""


class GapFiller:
    def __init__(self, *, store: EventsStore, loader: EventLoader, persister: EventPersister, keyring: Keyring,
                 client: FederationClient, metrics: FederationMetrics, limiter: Ratelimiter,
                 clock: Callable[[], float], limits: GapLimits = GapLimits()) -> None:
        self._store = store
        self._loader = loader
        self._persister = persister
        self._keyring = keyring
        self._client = client
        self._metrics = metrics
        self._limiter = limiter
        self._clock = clock
        self._limits = limits
        self._locks: dict[str, tuple[DeferredLock, list[int]]] = {}

    # --- one fill per room at a time ----------------------------------------------------

    def room_lock(self, room_id: str) -> _RoomGapLock:
        """Held around handling one transaction's PDUs of a room: concurrent transactions for
        the same room wait, then find the gap the first one filled already closed."""
        entry = self._locks.get(room_id)
        if entry is None:
            entry = self._locks[room_id] = (DeferredLock(), [0])
        return _RoomGapLock(self._locks, room_id, entry)

    def _spend(self, origin: str, what: str, room_id: str) -> None:
        """One remote request of gap filling for ``origin``. When its budget is spent, the whole
        transaction is answered ``429 M_LIMIT_EXCEEDED``: the origin sends it again later (as
        Synapse's and our sender do), so a PDU is slowed down, never refused for it."""
        result = self._limiter.check(origin, self._clock())
        if result.allowed:
            return
        logger.warning("[%s] %s from %s deferred: rc_missing_events budget spent", room_id, what, origin)
        raise MatrixError(429, "M_LIMIT_EXCEEDED",
                          f"too many missing-event fetches for {origin}; send this transaction again later",
                          retry_after_ms=max(1, int(result.retry_after * 1000)))

    async def timeline_ids(self, event_ids: Collection[str]) -> set[str]:
        """Those of ``event_ids`` that are in the room's graph here (not outliers, not unknown)."""
        return set(await self._store.get_state_groups_after(event_ids)) if event_ids else set()

    # --- get_missing_events ---------------------------------------------------------------

    async def walk(self, origin: str, room_version: RoomVersion, room_id: str,
                   batch: Sequence[FrozenEvent], *, known: Collection[str] = frozenset()) -> list[FrozenEvent]:
        """The events between our timeline and ``batch`` (one transaction's PDUs of the room),
        fetched from ``origin`` with ``get_missing_events`` in steps, verified, oldest first
        (parents before children). Empty when nothing in front of the batch is missing.

        Each call names our forward extremities as ``earliest_events`` and, as
        ``latest_events``, the events (of the batch or fetched so far) whose prev events
        are still unknown, so one walk serves every orphan of the batch. Stops when every
        prev event is known, after ``max_events``, or when a call fails or brings nothing new;
        raises ``MatrixError`` 429 when the origin's budget is spent. Nothing is stored: the caller checks and
        persists the events in the order given. ``known``: prev events the caller read in the
        timeline already (they stay there); the others are read here.
        """
        edge = gap_edge(batch, known)
        if edge:
            known = await self.timeline_ids({p for e in batch for p in e.prev_event_ids})
            edge = gap_edge(batch, known)
        known = set(known)
        if not edge:
            return []
        extremities = await self._store.get_forward_extremities(room_id)
        min_depth = min(extremities.values(), default=0)
        ours = {e.event_id for e in batch}
        fetched: dict[str, FrozenEvent] = {}
        calls = 0
        while edge and len(fetched) < self._limits.max_events:
            self._spend(origin, "get_missing_events", room_id)
            calls += 1
            limit = min(self._limits.per_call, self._limits.max_events - len(fetched))
            new = await self._missing_events_call(origin, room_version, room_id, sorted(extremities),
                                                  [e.event_id for e in edge][:MAX_LATEST_EVENTS], limit, min_depth)
            if not new:
                break
            stored = await self._store.get_events(list(new))
            new = {i: e for i, e in new.items()
                   if i not in fetched and i not in ours and (i not in stored or stored[i].outlier)}
            if not new:
                break
            fetched.update(new)
            wanted = {p for e in new.values() for p in e.prev_event_ids if p not in fetched}
            known |= await self.timeline_ids(wanted)
            edge = gap_edge([*batch, *fetched.values()], known)
        if not edge and fetched:
            self._metrics.gaps_filled.labels(method="get_missing_events").inc()
        logger.info("[%s] get_missing_events from %s: %d calls, %d events, gap %s", room_id, origin, calls,
                    len(fetched), "still open" if edge else "closed")
        return topological_order(fetched.values())

    async def _missing_events_call(self, origin: str, room_version: RoomVersion, room_id: str,
                                   earliest: list[str], latest: list[str], limit: int,
                                   min_depth: int) -> dict[str, FrozenEvent]:
        try:
            response = await self._client.post_json(
                origin, f"/_matrix/federation/v1/get_missing_events/{quote(room_id, safe='')}",
                {"earliest_events": earliest, "latest_events": latest, "limit": limit, "min_depth": min_depth},
            )
        except FederationClientError as e:
            logger.warning("[%s] get_missing_events from %s failed: %s", room_id, origin, e)
            return {}
        raw = response.get("events") if isinstance(response, dict) else None
        if not isinstance(raw, list):
            logger.warning("[%s] get_missing_events answer from %s has no 'events' list", room_id, origin)
            return {}
        return await verified_in_room(self._keyring, room_version, room_id, raw[:limit],
                                      source=f"{origin}'s get_missing_events", logger=logger)

    # --- /state_ids -------------------------------------------------------------------------

    async def state_before(self, origin: str, room_version: RoomVersion, event: FrozenEvent) -> dict[StateKey, str]:
        """The state ``event`` was sent on, when some of its prev events are not in our timeline:
        the state after each known prev event from our state groups, after each unknown one from
        ``origin``'s ``/state_ids`` (the events it names stored as outliers), resolved together.

        Raises ``GapFillError``, or ``MatrixError`` 429 when the origin's budget is spent."""
        prevs = list(dict.fromkeys(event.prev_event_ids))
        groups = await self._store.get_state_groups_after(prevs)
        unknown = [p for p in prevs if p not in groups]
        if len(unknown) > MAX_UNKNOWN_PREVS:
            raise GapFillError(f"{event.event_id} has {len(unknown)} unknown prev events, "
                               f"more than the {MAX_UNKNOWN_PREVS} whose state is fetched")
        state_sets: list[Mapping[StateKey, str]] = [
            await self._store.get_state_for_group(g) for g in sorted(set(groups.values()))
        ]
        for prev in unknown:
            self._spend(origin, "state_ids", event.room_id)
            state_sets.append(await self._state_after(origin, room_version, event.room_id, prev))
        self._metrics.gaps_filled.labels(method="state_ids").inc()
        if len(state_sets) == 1:
            return dict(state_sets[0])
        return await self._loader.resolve(room_version, state_sets)

    async def _state_after(self, origin: str, room_version: RoomVersion, room_id: str,
                           prev_id: str) -> dict[StateKey, str]:
        """The state after ``prev_id`` as ``origin`` has it: ``/state_ids`` at it (the state before
        it) plus the event itself when it is a state event."""
        try:
            response = await self._client.get_json(
                origin, f"/_matrix/federation/v1/state_ids/{quote(room_id, safe='')}", query={"event_id": prev_id}
            )
        except FederationClientError as e:
            raise GapFillError(f"/state_ids at {prev_id} from {origin} failed: {e}") from None
        if not isinstance(response, dict):
            raise GapFillError(f"{origin} sent a /state_ids answer that is not an object")
        ids: dict[str, list[str]] = {}
        for field in ("pdu_ids", "auth_chain_ids"):
            raw = response.get(field)
            if not isinstance(raw, list) or not all(isinstance(i, str) for i in raw):
                raise GapFillError(f"{origin} sent a /state_ids answer whose '{field}' is not a list of event IDs")
            ids[field] = raw
        if len(ids["pdu_ids"]) + len(ids["auth_chain_ids"]) > MAX_STATE_IDS:
            raise GapFillError(f"{origin}'s state at {prev_id} names more than {MAX_STATE_IDS} events")
        events = await self._fetch_outliers(origin, room_version, room_id, prev_id,
                                            {*ids["pdu_ids"], *ids["auth_chain_ids"], prev_id})
        state: dict[StateKey, str] = {}
        for event_id in ids["pdu_ids"]:
            found = events.get(event_id)
            key = found.state_key_tuple if found is not None else None
            if key is None:
                raise GapFillError(f"{origin}'s state at {prev_id} names {event_id}, which is not a state event "
                                   "we could fetch")
            state[key] = event_id
        prev = events.get(prev_id)
        if prev is None:
            raise GapFillError(f"{origin} did not serve {prev_id}")
        key = prev.state_key_tuple
        if key is not None:
            state[key] = prev_id
        if (C.CREATE, "") not in state:
            raise GapFillError(f"{origin}'s state at {prev_id} has no create event")
        return state

    async def fetch_missing_auth_events(self, origin: str, room_version: RoomVersion, room_id: str,
                                        events: Sequence[FrozenEvent]) -> None:
        """Fetch from ``origin`` the auth events of ``events`` that are neither among them nor
        stored here, and store them as outliers (``_fetch_outliers``). For a room joined with
        partial state, whose members' events we lack and most events cite."""
        if not events:
            return
        listed = {e.event_id for e in events}
        wanted = {a for e in events for a in e.auth_event_ids} - listed
        loaded = await self._loader.load_events(wanted) if wanted else {}
        missing = wanted - set(loaded)
        if missing:
            await self._fetch_outliers(origin, room_version, room_id, events[-1].event_id, missing)

    async def _fetch_outliers(self, origin: str, room_version: RoomVersion, room_id: str, prev_id: str,
                              wanted: set[str]) -> dict[str, FrozenEvent]:
        """``wanted`` events: those stored here (not rejected), and the others fetched from
        ``origin``, verified and stored as outliers (those that pass their auth events). A few are fetched with ``/event`` (at most ``concurrency`` at
        once); more than ``MAX_EVENT_FETCHES`` with one ``/state`` at ``prev_id`` (as Synapse
        does when much of the state is missing), which also carries ``prev_id``'s state."""
        loaded = await self._loader.load_events(wanted)
        rows = await self._store.get_events(list(loaded)) if loaded else {}
        # Rejected events never count as state, whoever names them.
        have = {i: e for i, e in loaded.items()
                if e.room_id == room_id and i in rows and rows[i].rejection_reason is None}
        missing = sorted(wanted - set(loaded))
        if len(missing) > MAX_EVENT_FETCHES:
            fetched = await self._fetch_by_state(origin, room_version, room_id, prev_id, set(missing))
        else:
            fetched = await self._fetch_by_event(origin, room_version, room_id, missing)
        for outlier in topological_order(fetched.values()):
            rejection: str | None = None
            try:
                await check_against_auth_events(self._loader, room_version, outlier, fetched)
            except MissingEventsError:
                pass  # its auth chain reaches past what we hold: stored, its own checks decide later
            except AuthError as e:
                rejection = str(e)
                logger.warning("[%s] outlier %s from %s fails auth: %s", room_id, outlier.event_id, origin, e)
            await self._persister.persist(room_version, outlier, is_local=False, outlier=True,
                                          rejection_reason=rejection)
            if rejection is None:
                have[outlier.event_id] = outlier
        return have

    async def _fetch_by_state(self, origin: str, room_version: RoomVersion, room_id: str, prev_id: str,
                              missing: set[str]) -> dict[str, FrozenEvent]:
        try:
            response = await self._client.get_json(
                origin, f"/_matrix/federation/v1/state/{quote(room_id, safe='')}", query={"event_id": prev_id})
        except FederationClientError as e:
            raise GapFillError(f"/state at {prev_id} from {origin} failed: {e}") from None
        raw: list[Any] = []
        for field in ("pdus", "auth_chain"):
            value = response.get(field) if isinstance(response, dict) else None
            if not isinstance(value, list):
                raise GapFillError(f"{origin} sent a /state answer without a '{field}' list")
            raw.extend(value)
        if len(raw) > MAX_STATE_IDS:
            raise GapFillError(f"{origin}'s /state at {prev_id} holds more than {MAX_STATE_IDS} events")
        verified = await verified_in_room(self._keyring, room_version, room_id, raw, source=f"{origin}'s /state",
                                          logger=logger)
        fetched = {i: e for i, e in verified.items() if i in missing}
        if prev_id in missing and prev_id not in fetched:
            fetched.update(await self._fetch_by_event(origin, room_version, room_id, [prev_id]))
        return fetched

    async def _fetch_by_event(self, origin: str, room_version: RoomVersion, room_id: str,
                              missing: list[str]) -> dict[str, FrozenEvent]:

        async def fetch(event_id: str) -> FrozenEvent | None:
            try:
                response = await self._client.get_json(
                    origin, f"/_matrix/federation/v1/event/{quote(event_id, safe='')}")
                raw = response.get("pdus") if isinstance(response, dict) else None
                if not isinstance(raw, list) or len(raw) != 1:
                    raise GapFillError(f"{origin}'s /event answer for {event_id} holds no single PDU")
                event = await parse_and_verify(self._keyring, room_version, raw[0])
            except (FederationClientError, EventsError) as e:
                logger.warning("[%s] fetching %s from %s failed: %s", room_id, event_id, origin, e)
                return None
            if event.event_id != event_id or event.room_id != room_id:
                logger.warning("[%s] %s served another event for %s", room_id, origin, event_id)
                return None
            return event

        return {e.event_id: e for e in await map_concurrently(fetch, missing, limit=self._limits.concurrency)
                if e is not None}


class _RoomGapLock:
    """``room_lock``'s context manager: drops the room's lock from the table when idle."""

    def __init__(self, table: dict[str, tuple[DeferredLock, list[int]]], room_id: str,
                 entry: tuple[DeferredLock, list[int]]) -> None:
        self._table = table
        self._room_id = room_id
        self._lock, self._users = entry

    async def __aenter__(self) -> None:
        self._users[0] += 1
        try:
            await self._lock.acquire()
        except BaseException:
            self._release_user()
            raise

    async def __aexit__(self, *exc: Any) -> None:
        self._lock.release()
        self._release_user()

    def _release_user(self) -> None:
        self._users[0] -= 1
        if self._users[0] == 0 and self._table.get(self._room_id, (None,))[0] is self._lock:
            del self._table[self._room_id]
