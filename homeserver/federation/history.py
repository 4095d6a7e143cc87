"""Serving room history to other servers: /event, /state, /state_ids, backfill, get_missing_events.

A server may read a room's events only while it has a member joined (checked
against current state); finer history visibility is not applied yet. Rejected
events are never served (404 ``M_NOT_FOUND`` on ``/event``, left out of walks),
as Synapse does; an outlier is served by ``/event`` (the state a join or a gap
fill brought in is outliers here, and other servers fetch it from us), but
``/state`` and ``/state_ids`` at an outlier or a rejected event answer 404: we
hold no state at it.
"""

# tests: tests/integration/test_federation.py

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Final

from homeserver.events import FrozenEvent
from homeserver.handlers.rooms.event_loader import EventLoader
from storage.kernel.errors import forbidden, not_found
from storage.stores.events import EventsStore

MAX_BACKFILL: Final = 100
MAX_MISSING: Final = 20


class HistoryHandler:
    def __init__(self, *, server_name: str, store: EventsStore, loader: EventLoader,
                 clock_ms: Callable[[], int], is_partial: Callable[[str], Awaitable[bool]] | None = None) -> None:
        # Whether a room is joined with partial state here: its state is not served until whole.
        self._is_partial = is_partial
        self._server_name = server_name
        self._store = store
        self._loader = loader
        self._clock_ms = clock_ms

    async def _check_in_room(self, origin: str, room_id: str) -> None:
        if await self._store.get_room_version(room_id) is None:
            raise not_found(f"Room {room_id} is not known to this server")
        if origin not in await self._store.get_joined_servers(room_id):
            raise forbidden(f"{origin} has no user in room {room_id}")

    def _envelope(self, pdus: Iterable[FrozenEvent]) -> dict[str, Any]:
        return {"origin": self._server_name, "origin_server_ts": self._clock_ms(),
                "pdus": [e.get_pdu_json() for e in pdus]}

    async def get_event(self, origin: str, event_id: str) -> dict[str, Any]:
        row = (await self._store.get_events([event_id])).get(event_id)
        event = await self._loader.get_event(event_id) if row is not None and row.rejection_reason is None else None
        if event is None:
            raise not_found(f"Event {event_id} is not known to this server")
        await self._check_in_room(origin, event.room_id)
        return self._envelope([event])

    async def _state_at(self, origin: str, room_id: str, event_id: str) -> tuple[set[str], set[str]]:
        await self._check_in_room(origin, room_id)
        if self._is_partial is not None and await self._is_partial(room_id):
            raise not_found(f"this server is still fetching the state of room {room_id} (a partial-state join)")
        row = (await self._store.get_events([event_id])).get(event_id)
        if row is None or row.room_id != room_id:
            raise not_found(f"Event {event_id} is not known in room {room_id}")
        if row.outlier or row.rejection_reason is not None:
            raise not_found(f"No state is known at {event_id} (an outlier or a rejected event)")
        group = (await self._store.get_state_groups_before([event_id])).get(event_id)
        if group is None:
            raise not_found(f"No state is known at {event_id}")
        state = set((await self._store.get_state_for_group(group)).values())
        chain = await self._store.get_auth_chain_ids(state)
        return state, chain

    async def state_ids(self, origin: str, room_id: str, event_id: str) -> dict[str, Any]:
        state, chain = await self._state_at(origin, room_id, event_id)
        return {"pdu_ids": sorted(state), "auth_chain_ids": sorted(chain)}

    async def state(self, origin: str, room_id: str, event_id: str) -> dict[str, Any]:
        state, chain = await self._state_at(origin, room_id, event_id)
        loaded = await self._loader.load_events(state | chain)
        return {
            "pdus": [loaded[i].get_pdu_json() for i in sorted(state) if i in loaded],
            "auth_chain": [loaded[i].get_pdu_json() for i in sorted(chain) if i in loaded],
        }

    async def _walk_back(self, starts: Iterable[str], stop: set[str], limit: int, min_depth: int = 0) -> list[FrozenEvent]:
        """Breadth-first through prev_events from ``starts`` (excluded), deepest first, up to ``limit``."""
        seen = set(stop)
        frontier = [s for s in starts]
        seen.update(frontier)
        found: list[FrozenEvent] = []
        first = await self._loader.load_events(frontier)
        queue = [e for s in frontier if (e := first.get(s)) is not None]
        while queue and len(found) < limit:
            next_ids = [p for e in queue for p in e.prev_event_ids if p not in seen]
            seen.update(next_ids)
            loaded = await self._loader.load_events(next_ids)
            queue = sorted((e for e in loaded.values() if e.depth >= min_depth), key=lambda e: -e.depth)
            # Walked through, but never served: rejected events.
            rejected = await self._rejected([e.event_id for e in queue])
            found.extend([e for e in queue if e.event_id not in rejected][: limit - len(found)])
        return found

    async def _rejected(self, event_ids: list[str]) -> set[str]:
        rows = await self._store.get_events(event_ids) if event_ids else {}
        return {i for i, row in rows.items() if row.rejection_reason is not None}

    async def backfill(self, origin: str, room_id: str, from_ids: list[str], limit: int) -> dict[str, Any]:
        await self._check_in_room(origin, room_id)
        limit = max(1, min(limit, MAX_BACKFILL))
        starts = await self._loader.load_events(from_ids)
        rejected = await self._rejected(list(starts))
        events = [e for e in starts.values() if e.room_id == room_id and e.event_id not in rejected][:limit]
        events += await self._walk_back([e.event_id for e in events], set(), limit - len(events))
        return self._envelope(events)

    async def get_missing_events(self, origin: str, room_id: str, body: dict[str, Any]) -> dict[str, Any]:
        await self._check_in_room(origin, room_id)
        earliest = [e for e in body.get("earliest_events", []) if isinstance(e, str)]
        latest = [e for e in body.get("latest_events", []) if isinstance(e, str)]
        limit = body.get("limit", 10)
        limit = max(1, min(limit if isinstance(limit, int) else 10, MAX_MISSING))
        min_depth = body.get("min_depth", 0)
        events = await self._walk_back(latest, set(earliest), limit, min_depth if isinstance(min_depth, int) else 0)
        events = [e for e in events if e.room_id == room_id]
        return {"events": [e.get_pdu_json() for e in sorted(events, key=lambda e: e.depth)]}
