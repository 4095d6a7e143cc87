"""What client reads do about rooms joined with partial state (docs/federation.md,
"Partial-state joins").

While a room's state lacks its members, a read that needs them (``/members``,
``/joined_members``, ``/state``, another user's member event) waits for the resync
instead of answering an incomplete list; the wait is bounded, and past it the client
gets a 503 ``M_UNKNOWN`` to retry rather than a wrong answer. The resync may run in
another process, so the wait polls ``partial_state_rooms``; a room that is not partial
costs one indexed read. ``sync_view`` is the pure rule /sync applies.
"""

# tests: tests/unit/federation/test_partial_state.py, tests/integration/test_federation_partial_join.py

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any, Final

import attrs
from twisted.internet.task import deferLater

from storage.kernel.errors import MatrixError
from storage.stores.partial_state import PartialStateRow, PartialStateStore
from storage.stores.timeline import RoomPosition

# How long a read waits for a room's members before it gives up (503): long enough for the
# resync of a big room, short enough for a client's HTTP timeout.
DEFAULT_WAIT_S: Final = 60.0
POLL_INTERVAL_S: Final = 0.25


class PartialStateWaiter:
    """``seen(instance, position)``: whether this process has seen the events stream of writer
    ``instance`` reach ``position``. A read waits for that too, once the room is whole, so a
    /sync the client makes next on this process already shows the room (it is sent from that
    position on)."""

    def __init__(self, store: PartialStateStore, clock: Any, *, seen: Callable[[str, int], bool] | None = None,
                 timeout: float = DEFAULT_WAIT_S, interval: float = POLL_INTERVAL_S) -> None:
        self._store = store
        self._clock = clock
        self._seen = seen
        self._timeout = timeout
        self._interval = interval

    async def _whole(self, room_id: str) -> bool:
        row = (await self._store.get_rows([room_id])).get(room_id)
        if row is None:
            return True
        return row.completed is not None and (self._seen is None or self._seen(*row.completed))

    async def wait_for_full_state(self, room_id: str) -> None:
        """Return once ``room_id``'s state is whole (at once when it never was partial); a 503
        ``M_UNKNOWN`` when it still is after the bounded wait."""
        deadline = self._clock.seconds() + self._timeout
        while not await self._whole(room_id):
            if self._clock.seconds() >= deadline:
                raise MatrixError(503, "M_UNKNOWN", f"the members of {room_id} are still being fetched from the "
                                  "servers in the room; try again shortly")
            await deferLater(self._clock, self._interval, lambda: None)


@attrs.frozen
class SyncView:
    """For one /sync: the joined rooms to leave out (partial state, a client not lazy-loading
    members), and those to send whole as newly joined (made whole between ``since`` and now)."""

    hidden: frozenset[str]
    newly_whole: frozenset[str]


def sync_view(rows: Mapping[str, PartialStateRow], joined: Collection[str], *, lazy_members: bool,
              since: RoomPosition | None, upto: RoomPosition) -> SyncView:
    """Which of ``joined`` a sync from ``since`` to ``upto`` hides or sends whole: as Synapse, a
    client that does not lazy-load members does not see a partial-state room (its member list
    would be wrong) until the resync is done, and then sees it as a room newly joined. A client
    lazy-loading members sees it at once, and nothing changes for it afterwards."""
    if lazy_members:
        return SyncView(frozenset(), frozenset())
    hidden: set[str] = set()
    newly: set[str] = set()
    for room_id in joined:
        row = rows.get(room_id)
        if row is None:
            continue
        if row.completed is None or not upto.covers(*row.completed):
            hidden.add(room_id)
        elif since is not None and not since.covers(*row.completed):
            newly.add(room_id)
    return SyncView(frozenset(hidden), frozenset(newly))


class PartialRooms:
    """Which rooms are joined with partial state now, for a check on every inbound PDU: the
    set is read (one small query) at most once per ``ttl`` seconds, and at once after
    ``invalidate`` (this process joined or resynced a room). Another process's change is seen
    within ``ttl``."""

    def __init__(self, store: PartialStateStore, clock: Any, *, ttl: float = 1.0) -> None:
        self._store = store
        self._clock = clock
        self._ttl = ttl
        self._rooms: frozenset[str] = frozenset()
        self._read_at: float | None = None

    def invalidate(self, room_id: str | None = None) -> None:
        self._read_at = None

    async def is_partial(self, room_id: str) -> bool:
        now = self._clock.seconds()
        if self._read_at is None or now - self._read_at >= self._ttl:
            self._rooms = frozenset(await self._store.partial_rooms())
            self._read_at = now
        return room_id in self._rooms
