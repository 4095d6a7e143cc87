"""The read side of events: stored events by ID, parsed once and cached, and the state before an event.

``EventLoader`` owns this process's cache of ``FrozenEvent``s; one is built per
process and every reader (client API, federation, the persister's own state
resolution) shares it. A cached event is the PDU as stored, which never changes
once written (a de-outliered or backfilled copy keeps its JSON), so entries need
no invalidation, here or from other processes. Redaction does not change the
stored PDU: it changes how the event is *served*, and readers apply it at serve
time from ``event_redactions`` (``ClientEvents.serialize``), which the redaction's
own persist transaction fills; the loader therefore can never serve an event
stale after a redaction. The one value derived from something else, the room
version an event is parsed with, is only cached when the room's version is known.

It does not write: the persister stores events and then ``prime``s the loader
with each one it stored (or that the room's writer stored for it), so an event
this process built or verified is never read back. It knows nothing of
redaction, visibility or HTTP. Its metrics (``EventCacheMetrics``) count
hits and misses and the cache's size.
"""

# tests: tests/unit/handlers/test_event_loader.py, tests/integration/test_metrics_doc.py

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Final, Protocol

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge

from homeserver.events import FrozenEvent, RoomVersion, edge_hashes_of, make_event, resolve_state
from homeserver.events.errors import MissingEventsError
from homeserver.events.room_versions import get_room_version
from storage.caches import DictCache
from storage.metrics import Children
from storage.stores.events import StateKey, StoredEvent

# Parsed events kept per process; least recently used are dropped first. About a
# kilobyte or two each, so the cache stays under ~100 MB.
MAX_CACHED_EVENTS: Final = 50_000

# The version an event is parsed with when its room is unknown here (an outlier of a
# room whose create event this server has not stored). Such events are not cached.
FALLBACK_ROOM_VERSION: Final = "10"


@attrs.frozen
class EventCacheMetrics:
    lookups: Counter
    entries: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry) -> EventCacheMetrics:
        metrics = cls(
            lookups=Counter(
                "tributary_events_cache_lookups_total",
                "Events asked of the event cache, by outcome: hit (served from memory) or miss (read from "
                "the database, when stored).",
                ["outcome"],
                registry=registry,
            ),
            entries=Gauge(
                "tributary_events_cache_entries",
                f"Parsed events held in the event cache (at most {MAX_CACHED_EVENTS}).",
                registry=registry,
            ),
        )
        for outcome in ("hit", "miss"):
            metrics.lookups.labels(outcome=outcome)
        return metrics


class EventSource(Protocol):
    """The reads the loader makes (``storage.stores.events.EventsStore``)."""

    async def get_events(self, event_ids: Collection[str]) -> dict[str, StoredEvent]: ...

    async def get_room_versions(self, room_ids: Collection[str]) -> dict[str, str]: ...

    async def get_state_groups_after(self, event_ids: Collection[str]) -> dict[str, int]: ...

    async def get_state_for_group(self, state_group: int) -> dict[StateKey, str]: ...

    async def get_auth_chain_ids(self, event_ids: Collection[str]) -> set[str]: ...


class EventLoader:
    def __init__(
        self, store: EventSource, *, max_entries: int = MAX_CACHED_EVENTS, metrics: EventCacheMetrics | None = None
    ) -> None:
        self._store = store
        self._events = DictCache[FrozenEvent]("events", max_entries=max_entries)
        self._lookups = Children(metrics.lookups) if metrics is not None else None
        if metrics is not None:
            metrics.entries.set_function(lambda: len(self._events))

    @property
    def cached(self) -> int:
        """How many events the cache holds (not ``__len__``: an empty loader is still a loader)."""
        return len(self._events)

    # --- events ----------------------------------------------------------------------------

    async def get_event(self, event_id: str) -> FrozenEvent | None:
        """The event, if stored."""
        return (await self.load_events([event_id])).get(event_id)

    async def load_events(self, event_ids: Collection[str]) -> dict[str, FrozenEvent]:
        """Parsed events by ID (those stored), from the cache or the database.

        Cancellation-safe: the cache is only written after both reads returned, in
        one synchronous step, so a cancelled load leaves nothing behind. Two
        concurrent loads of the same missing event both read it; both store the same
        (immutable) value.
        """
        result: dict[str, FrozenEvent] = {}
        missing: list[str] = []
        for event_id in event_ids:
            cached = self._events.get((event_id,))
            if cached is None:
                missing.append(event_id)
            else:
                result[event_id] = cached
        if self._lookups is not None:
            self._lookups["hit"].inc(len(result))
            self._lookups["miss"].inc(len(missing))
        if not missing:
            return result
        stored = await self._store.get_events(missing)
        if not stored:
            return result
        versions = await self._store.get_room_versions({row.room_id for row in stored.values()})
        for event_id, row in stored.items():
            known = versions.get(row.room_id)
            event = make_event(
                get_room_version(known or FALLBACK_ROOM_VERSION), row.pdu(), trusted_event_id=event_id
            )
            if known is not None:
                self._events.set((event_id,), event)
            result[event_id] = event
        return result

    async def edge_hashes(self, room_version: RoomVersion, event_ids: Iterable[str]) -> dict[str, dict[str, str]]:
        """The reference hashes a new event of room version 1 or 2 cites beside the IDs of its
        prev and auth events (the builder's ``edge_hashes`` argument), for the stored ones of
        ``event_ids``; nothing is loaded in later versions."""
        if not room_version.event_ids_are_origin_assigned:
            return {}
        return edge_hashes_of(room_version, (await self.load_events(set(event_ids))).values())

    def prime(self, event: FrozenEvent) -> None:
        """Cache an event this server has stored (the persister calls this after each
        commit, a non-writer after the room's writer stored it), so reading it is free."""
        self._events.set((event.event_id,), event)

    # --- state -----------------------------------------------------------------------------

    async def state_before_event(self, room_version: RoomVersion, event: FrozenEvent) -> dict[StateKey, str]:
        """The state ``event`` was sent on: its predecessors' state, resolved if they fork.

        Reads only: a fork's resolution is not stored (persisting the event stores it).
        Raises ``MissingEventsError`` if a predecessor is not stored here.
        """
        prevs = event.prev_event_ids
        if not prevs:
            return {}
        groups = await self._store.get_state_groups_after(prevs)
        missing = [p for p in prevs if p not in groups]
        if missing:
            raise MissingEventsError(frozenset(missing), f"state before {event.event_id}: prev_events not known")
        distinct = sorted(set(groups.values()))
        state_sets = [await self._store.get_state_for_group(group) for group in distinct]
        if len(state_sets) == 1:
            return state_sets[0]
        return await self.resolve(room_version, state_sets)

    async def resolve(
        self,
        room_version: RoomVersion,
        state_sets: Sequence[Mapping[StateKey, str]],
        pending: FrozenEvent | None = None,
    ) -> dict[StateKey, str]:
        """State resolution over ``state_sets``, whose events (and their auth chains) are
        stored, except ``pending``: an event not stored yet that they may name."""
        wanted: set[str] = set()
        for state in state_sets:
            wanted.update(state.values())
        extra: dict[str, FrozenEvent] = {}
        if pending is not None and pending.event_id in wanted:
            wanted.discard(pending.event_id)
            wanted.update(pending.auth_event_ids)
            extra[pending.event_id] = pending
        event_map = await self.load_events(await self._store.get_auth_chain_ids(wanted) | wanted)
        event_map.update(extra)
        return dict(resolve_state(room_version, state_sets, event_map))
