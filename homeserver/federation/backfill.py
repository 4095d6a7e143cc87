"""Calling ``/backfill``: fetching a room's older history from another server when ours runs out.

``BackfillHandler.backfill(room_id)`` asks the servers in the room, up to three at
once, for the events
before our backward extremities (events our timeline points back at that we do
not have, or hold only as outliers), verifies them, works out the state before
each (from its predecessors in the batch or in our database; when those are
unknown or fork, the server's ``GET /state`` at that event, stored as outliers),
checks the auth rules against it (failure: stored as rejected) and persists the
batch newest first through ``EventPersister.persist_backfilled``, so that older
events get more negative stream orderings. Serving backfill is history.py's job.
"""

# tests: tests/integration/test_federation.py

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Final
from urllib.parse import quote

from homeserver.events import FrozenEvent, RoomVersion, get_room_version
from homeserver.events import constants as C
from homeserver.events.errors import AuthError, EventsError, MissingEventsError
from homeserver.remote.client import FederationClient, FederationClientError
from homeserver.federation.keys import Keyring
from homeserver.federation.pdus import (
    by_depth,
    check_against_auth_events,
    check_against_state,
    parse_and_verify,
    verified_in_room,
)
from homeserver.handlers.rooms.event_loader import EventLoader
from homeserver.handlers.rooms.event_persistence import EventPersister
from storage.kernel.concurrency import map_concurrently
from storage.stores.events import EventsStore, StateKey

logger = logging.getLogger(__name__)

MAX_EXTREMITIES: Final = 20
"""Backward extremities named in one ``/backfill`` request (its ``v`` parameter)."""

MAX_BACKFILL_EVENTS: Final = 100
"""Events asked for (and accepted) in one ``/backfill`` response."""

BACKFILL_CONCURRENCY: Final = 3
"""Servers asked for the same history at once."""


class BackfillError(EventsError):
    """The history a server sent cannot be placed (e.g. its state lacks a create event)."""


class BackfillHandler:
    def __init__(self, *, server_name: str, store: EventsStore, persister: EventPersister, loader: EventLoader, keyring: Keyring,
                 client: FederationClient) -> None:
        self._server_name = server_name
        self._store = store
        self._persister = persister
        self._loader = loader
        self._keyring = keyring
        self._client = client
        self._running: set[str] = set()

    async def backfill(self, room_id: str, limit: int = 50) -> int:
        """Fetch up to ``limit`` older events of the room; how many new ones were stored.

        0 when the room's history is complete here, no server answered, or a
        backfill of the room is already running (the caller then serves what it has).
        """
        if room_id in self._running:
            return 0
        self._running.add(room_id)
        try:
            return await self._backfill(room_id, max(1, min(limit, MAX_BACKFILL_EVENTS)))
        finally:
            self._running.discard(room_id)

    async def _backfill(self, room_id: str, limit: int) -> int:
        identifier = await self._store.get_room_version(room_id)
        if identifier is None:
            return 0
        room_version = get_room_version(identifier)
        servers = sorted(await self._store.get_joined_servers(room_id) - {self._server_name})
        if not servers:
            return 0
        extremities = await self._store.get_backward_extremities(room_id, MAX_EXTREMITIES)
        if not extremities:
            return 0
        async def attempt(server: str) -> list[FrozenEvent]:
            try:
                response = await self._client.get_json(
                    server, f"/_matrix/federation/v1/backfill/{quote(room_id, safe='')}",
                    query={"v": extremities, "limit": str(limit)},
                )
                return await self._verified(room_version, room_id, server, response, limit)
            except (FederationClientError, EventsError) as e:
                logger.warning("[%s] backfill from %s failed: %s", room_id, server, e)
                return []

        # Up to BACKFILL_CONCURRENCY servers are asked at once (each request bounded by the
        # client's timeouts); the first of them, in order, whose answer verifies is stored.
        for start in range(0, len(servers), BACKFILL_CONCURRENCY):
            batch = servers[start:start + BACKFILL_CONCURRENCY]
            answers = await map_concurrently(attempt, batch, limit=BACKFILL_CONCURRENCY)
            for server, events in zip(batch, answers):
                if not events:
                    continue
                try:
                    stored = await self._persist_batch(room_version, room_id, server, events)
                except (FederationClientError, EventsError) as e:
                    logger.warning("[%s] backfill from %s failed: %s", room_id, server, e)
                    continue
                logger.info("[%s] backfilled %d events from %s", room_id, stored, server)
                return stored
        return 0

    async def _verified(self, room_version: RoomVersion, room_id: str, server: str, response: Any,
                        limit: int) -> list[FrozenEvent]:
        """The PDUs of a backfill response that verify, belong to the room and are new to our timeline."""
        raw = response.get("pdus") if isinstance(response, dict) else None
        if not isinstance(raw, list):
            raise BackfillError(f"{server} sent a backfill response without a 'pdus' list")
        events = await verified_in_room(self._keyring, room_version, room_id, raw[:limit],
                                        source=f"{server}'s backfill", logger=logger)
        stored = await self._store.get_events(list(events))
        return [e for i, e in events.items() if i not in stored or stored[i].outlier]

    async def _persist_batch(self, room_version: RoomVersion, room_id: str, server: str,
                             events: list[FrozenEvent]) -> int:
        batch = {e.event_id: e for e in events}
        after: dict[str, tuple[int, dict[StateKey, str]]] = {}
        plan: list[tuple[FrozenEvent, int, int, str | None]] = []
        for event in by_depth(events):
            group, state = await self._state_before(room_version, room_id, server, event, after)
            rejection: str | None = None
            try:
                try:
                    await check_against_auth_events(self._loader, room_version, event, batch)
                except MissingEventsError:
                    pass  # auth events older than what we hold: the state check below decides
                if event.type != C.CREATE:  # the create event has no state before it to check against
                    await check_against_state(self._loader, room_version, event, state, batch)
            except AuthError as e:
                rejection = str(e)
                logger.warning("[%s] backfilled %s from %s fails auth: %s", room_id, event.event_id, server, e)
            key = event.state_key_tuple
            if key is not None and rejection is None:
                after_state = {**state, key: event.event_id}
                after_group = await self._store.new_state_group(room_id, group, {key: event.event_id})
            else:
                after_state, after_group = state, group
            after[event.event_id] = (after_group, after_state)
            plan.append((event, group, after_group, rejection))
        stored = 0
        for event, before_group, after_group, rejection in reversed(plan):  # newest first
            result = await self._persister.persist_backfilled(
                room_version, event, state_group_before=before_group, state_group_after=after_group,
                rejection_reason=rejection,
            )
            stored += 0 if result.already_persisted else 1
        return stored

    async def _state_before(
        self, room_version: RoomVersion, room_id: str, server: str, event: FrozenEvent,
        planned: Mapping[str, tuple[int, dict[StateKey, str]]],
    ) -> tuple[int, dict[StateKey, str]]:
        """(state group, state) before ``event``: its predecessors' when we know them and they
        agree, else the server's ``/state`` at the event."""
        prevs = event.prev_event_ids
        if not prevs:
            return await self._store.new_state_group(room_id, None, {}), {}
        unplanned = [p for p in prevs if p not in planned]
        groups = await self._store.get_state_groups_after(unplanned) if unplanned else {}
        found: dict[int, dict[StateKey, str] | None] = {}
        for prev in prevs:
            if prev in planned:
                found[planned[prev][0]] = planned[prev][1]
            elif prev in groups:
                found.setdefault(groups[prev], None)
        if len(found) == 1 and len(groups) + sum(p in planned for p in prevs) == len(prevs):
            group, state = next(iter(found.items()))
            return group, dict(state) if state is not None else await self._store.get_state_for_group(group)
        state = await self._fetch_state(room_version, room_id, server, event)
        return await self._store.new_state_group(room_id, None, state), state

    async def _fetch_state(self, room_version: RoomVersion, room_id: str, server: str,
                           event: FrozenEvent) -> dict[StateKey, str]:
        """The state before ``event`` as ``server`` has it (``GET /state``), its events stored as outliers."""
        response = await self._client.get_json(
            server, f"/_matrix/federation/v1/state/{quote(room_id, safe='')}", query={"event_id": event.event_id}
        )
        if not isinstance(response, dict):
            raise BackfillError(f"{server} sent a /state response that is not an object")
        fetched: dict[str, FrozenEvent] = {}
        state: dict[StateKey, str] = {}
        for field in ("auth_chain", "pdus"):
            raw = response.get(field)
            if not isinstance(raw, list):
                raise BackfillError(f"{server} sent a /state response without a '{field}' list")
            for pdu in raw:
                try:
                    verified = await parse_and_verify(self._keyring, room_version, pdu)
                except EventsError as e:
                    logger.warning("[%s] dropping a state event from %s: %s", room_id, server, e)
                    continue
                if verified.room_id != room_id:
                    raise BackfillError(f"{server}'s /state holds event {verified.event_id} of another room")
                fetched[verified.event_id] = verified
                key = verified.state_key_tuple
                if field == "pdus" and key is not None:
                    state[key] = verified.event_id
        if (C.CREATE, "") not in state:
            raise BackfillError(f"{server}'s state at {event.event_id} has no create event")
        for outlier in by_depth(fetched.values()):
            await self._persister.persist(room_version, outlier, is_local=False, outlier=True)
        return state
