"""Keeps the user directory's tables (``storage/stores/user_directory.py``) up to date.

One process runs it (the ``background`` worker when the config has one, else the main
process: ``workers/background.py``). It follows the events stream: each time the stream's
linear position moves, it rewrites from current state the rooms that had a state event since
its stored position, in batches, storing the new position with the last batch. A process that
starts from position 0 (a new table, or an old database) so builds the whole directory once.
The position is read once and then kept in memory: a stretch of the stream with no state
event (messages) costs one query and no write (none at all when this process persisted
them itself: ``storage/kernel/written_events.py``), and the stored position catches up with the
next rewrite or once it lags ``POSITION_WRITE_LAG`` behind (a restart looks through that
stretch again and finds nothing to do).
It does not know who may search for whom: that is the search query's business.
"""

# tests: tests/integration/test_directory.py, tests/unit/handlers/test_user_directory.py

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Final

from twisted.internet.defer import Deferred

from storage.kernel.background import run_in_background
from storage.kernel.written_events import WrittenEvents, is_state
from storage.stores.user_directory import ROOMS_PER_BATCH, UserDirectoryStore

logger = logging.getLogger(__name__)

RETRY_AFTER_FAILURE_S: Final = 5.0
POSITION_WRITE_LAG: Final = 1000
"""Stream positions the stored position may lag the one in memory while no state changes."""


def batches(room_ids: list[str], size: int = ROOMS_PER_BATCH) -> list[list[str]]:
    """The rooms in order, ``size`` at a time (the last batch carries the new position)."""
    return [room_ids[i:i + size] for i in range(0, len(room_ids), size)]


class UserDirectoryUpdater:
    def __init__(self, store: UserDirectoryStore, clock: Any, events_position: Callable[[], int], *,
                 written: WrittenEvents | None = None) -> None:
        self._store = store
        # What this process persisted: a range of its own messages needs no query.
        self._written = written
        self._clock = clock
        self._events_position = events_position
        self._running: Deferred[None] | None = None
        self._again = False
        self._stopping = False
        self._retry: Any = None
        # The position applied, and the one stored (both None until first read).
        self._position: int | None = None
        self._stored: int | None = None

    def on_new_events(self) -> None:
        """The events stream moved: apply what changed (once more after the pass in flight)."""
        if self._stopping:
            return
        if self._running is not None:
            self._again = True
            return
        if self._nothing_to_write():
            return
        run = run_in_background("user_directory_update", self._run())
        self._running = None if run.called else run

    def _nothing_to_write(self) -> bool:
        """Catch up at once, without a task, when this process's notes say the new events
        change no room's membership and the stored position need not move yet (most sends)."""
        if self._written is None or self._position is None or self._stored is None:
            return False
        upto = self._events_position()
        if upto - self._stored >= POSITION_WRITE_LAG or not self._written.nothing_for(self._position, upto, is_state):
            return False
        self._position = max(self._position, upto)
        return True

    def stop(self) -> Deferred[None] | None:
        self._stopping = True
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        return self._running

    async def _run(self) -> None:
        try:
            while not self._stopping:
                self._again = False
                await self.update_once()
                if not self._again:
                    break
        except Exception:
            logger.exception("updating the user directory failed; trying again in %.0fs", RETRY_AFTER_FAILURE_S)
            if not self._stopping:
                self._retry = self._clock.callLater(RETRY_AFTER_FAILURE_S, self.on_new_events)
        finally:
            self._running = None

    async def update_once(self) -> int:
        """Apply the events stream up to its current position; how many rooms were rewritten."""
        upto = self._events_position()
        if self._position is None or self._stored is None:
            self._position = self._stored = await self._store.get_position()
        after = self._position
        if upto <= after:
            return 0
        if self._written is not None and self._written.nothing_for(after, upto, is_state):
            rooms: list[str] = []
        else:
            rooms = await self._store.changed_rooms(after, upto)
        parts = batches(rooms)
        for i, part in enumerate(parts):
            await self._store.rebuild_rooms(part, upto if i == len(parts) - 1 else None)
        if parts or upto - self._stored >= POSITION_WRITE_LAG:
            if not parts:
                await self._store.rebuild_rooms([], upto)
            self._stored = upto
        self._position = upto
        if rooms:
            logger.debug("user directory: %d rooms rewritten up to %d", len(rooms), upto)
        return len(rooms)
