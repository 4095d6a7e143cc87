"""``GET/PUT /presence/{userId}/status``: a user's own presence, stored on the presence stream.

Also applies remote users' presence from ``m.presence`` EDUs (``apply_remote``)
and reads the changes ``/sync`` shows (``presence_for_sync``: the user and those
sharing a room with them). Anyone authenticated may read a user's status.

Syncing makes a user online: ``SyncTracker`` counts each process's ``/sync``
requests per user and reports when a user starts syncing there and, once no
sync has been seen for ``SYNC_LINGER_S``, when they stopped. The presence
writer hears of it directly, or from workers through ``USER_SYNC`` (and
``CLEAR_USER_SYNC`` when a worker shuts down); ``user_syncing`` marks a user
online when they start syncing anywhere (unless they set themselves
``unavailable``) and offline once they sync nowhere.
"""

# tests: tests/integration/test_client_e2e.py, tests/integration/test_client_legacy.py, tests/integration/test_client_peeking.py, tests/integration/test_client_sync_state.py

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from twisted.internet.defer import Deferred

from homeserver.handlers.ephemeral.federation_edus import OutboundEdus
from homeserver.handlers.accounts.auth import Requester
from storage.kernel.errors import forbidden
from storage.id_generators import StreamIdGenerator
from homeserver.events.presence import presence_content, presence_event
from storage.stores.presence import PresenceStore
from storage.kernel.background import run_in_background

T = TypeVar("T")

logger = logging.getLogger(__name__)

PRESENCE_STATES = frozenset({"online", "offline", "unavailable"})
# How long after its last /sync a user still counts as syncing on a process
# (clients long-poll back to back; a brief gap is not going offline).
SYNC_LINGER_S = 30.0


class PresenceHandler:
    def __init__(self, *, store: PresenceStore, stream: StreamIdGenerator, clock_ms: Callable[[], int],
                 federation: OutboundEdus | None = None) -> None:
        self._store = store
        self._stream = stream
        self._clock_ms = clock_ms
        # Servers sharing a room hear of changes through this; None in a process that sends no EDUs.
        self._federation = federation
        # user -> the processes where the user syncs now (only in the presence writer).
        self._syncing: dict[str, set[str]] = {}

    async def set_status(self, requester: Requester, user_id: str, state: str, status_msg: str | None) -> None:
        if requester.user_id != user_id:
            raise forbidden("You can only set your own presence")
        await self._set(user_id, state, status_msg)

    async def user_syncing(self, process: str, user_id: str, syncing: bool) -> None:
        """``user_id`` started (or, a while ago, stopped) syncing on ``process``."""
        processes = self._syncing.setdefault(user_id, set())
        was_syncing = bool(processes)
        if syncing:
            processes.add(process)
        else:
            processes.discard(process)
        if not processes:
            del self._syncing[user_id]
        if syncing and not was_syncing:
            current = await self._store.get_presence(user_id)
            if current is None or current.state == "offline":
                await self._set(user_id, "online", None if current is None else current.status_msg)
        elif was_syncing and not processes:
            current = await self._store.get_presence(user_id)
            if current is not None and current.state != "offline":
                await self._set(user_id, "offline", current.status_msg)

    async def clear_process(self, process: str) -> None:
        """``process`` shut down (``CLEAR_USER_SYNC``): its users stop syncing there."""
        for user_id in [u for u, processes in self._syncing.items() if process in processes]:
            await self.user_syncing(process, user_id, False)

    async def _set(self, user_id: str, state: str, status_msg: str | None) -> None:
        async with self._stream.get_next() as stream_id:
            await self._store.set_presence(
                stream_id, self._stream.instance_name or "master", user_id, state, status_msg, self._clock_ms()
            )
        if self._federation is not None:
            push: dict[str, Any] = {"user_id": user_id, "presence": state, "last_active_ago": 0,
                                    "currently_active": state == "online"}
            if status_msg is not None:
                push["status_msg"] = status_msg
            await self._federation.presence(push)

    async def apply_remote(
        self, user_id: str, state: str, status_msg: str | None, last_active_ago: int, currently_active: bool
    ) -> None:
        """An ``m.presence`` EDU entry: a remote user's presence (checked by the caller)."""
        async with self._stream.get_next() as stream_id:
            await self._store.set_presence(
                stream_id, self._stream.instance_name or "master", user_id, state, status_msg,
                self._clock_ms() - max(0, last_active_ago), currently_active=currently_active,
            )

    async def presence_for_sync(self, user_id: str, after: int, upto: int) -> list[dict[str, Any]]:
        """``m.presence`` events for ``/sync``: changes in (after, upto] of the user and those
        sharing a room with them."""
        rows = await self._store.get_presence_changes(user_id, after, upto)
        now = self._clock_ms()
        return [presence_event(row, now) for row in rows]

    async def room_presence_for_stream(self, room_id: str, after: int, upto: int) -> list[dict[str, Any]]:
        """``m.presence`` events of the members joined to ``room_id`` whose presence changed in
        (after, upto]: the older ``/events?room_id=`` (peeking)."""
        rows = await self._store.get_room_presence_changes(room_id, after, upto)
        now = self._clock_ms()
        return [presence_event(row, now) for row in rows]

    async def presence_events(self, user_ids: Iterable[str]) -> list[dict[str, Any]]:
        """The current ``m.presence`` event of each of ``user_ids`` whose presence is known
        (the older ``/rooms/{roomId}/initialSync``: the room's members)."""
        now = self._clock_ms()
        return [presence_event(row, now) for row in await self._store.get_presences(set(user_ids))]

    async def get_status(self, requester: Requester, user_id: str) -> dict[str, Any]:
        """``GET /presence/{userId}/status``: visible to the user and to those sharing a joined
        room with them (else 403, as Synapse). A user who never set a status nor synced is
        ``offline`` with nothing else known (Synapse's initial state), rather than a 404."""
        if requester.user_id != user_id and not await self._store.shares_joined_room(requester.user_id, user_id):
            raise forbidden("You are not allowed to see their presence")
        row = await self._store.get_presence(user_id)
        if row is None:
            return {"presence": "offline"}
        return presence_content(row, self._clock_ms())


async def while_syncing(tracker: SyncTracker | None, user_id: str, set_presence: str,
                        work: Callable[[], Awaitable[T]]) -> T:
    """Run a sync request's ``work`` counted by ``tracker`` as the user syncing here (online),
    unless ``set_presence`` says otherwise (``/sync`` and sliding sync)."""
    if tracker is None or set_presence != "online":
        return await work()
    started = tracker.begin(user_id)
    if started is not None:
        await started
    try:
        return await work()
    finally:
        tracker.end(user_id)


class SyncTracker:
    """This process's ``/sync`` requests per user, reported to the presence writer as
    "started syncing here" (the first request) and "stopped" (``linger`` seconds after
    the last one ended, unless another began)."""

    def __init__(self, clock: Any, report: Callable[[str, bool], Any], *, linger: float = SYNC_LINGER_S) -> None:
        self._clock = clock
        self._report = report
        self._linger = linger
        self._active: dict[str, int] = {}
        self._reported: set[str] = set()
        self._timers: dict[str, Any] = {}

    def begin(self, user_id: str) -> Deferred[Any] | None:
        """A /sync of ``user_id`` starts. When that makes them start syncing here and the
        presence writer is this process, the Deferred of its update: await it, so the sync's
        answer (and token) includes the change rather than being woken by it at once."""
        self._active[user_id] = self._active.get(user_id, 0) + 1
        timer = self._timers.pop(user_id, None)
        if timer is not None and timer.active():
            timer.cancel()
        if user_id not in self._reported:
            self._reported.add(user_id)
            return self._call(user_id, True)
        return None

    def end(self, user_id: str) -> None:
        count = self._active.get(user_id, 0) - 1
        if count > 0:
            self._active[user_id] = count
            return
        self._active.pop(user_id, None)
        self._timers[user_id] = self._clock.callLater(self._linger, self._stopped, user_id)

    def stop(self) -> list[str]:
        """Cancel the timers (shutdown); the users still reported as syncing here."""
        for timer in self._timers.values():
            if timer.active():
                timer.cancel()
        self._timers.clear()
        users, self._reported = sorted(self._reported), set()
        return users

    def _stopped(self, user_id: str) -> None:
        self._timers.pop(user_id, None)
        if user_id in self._active or user_id not in self._reported:
            return
        self._reported.discard(user_id)
        self._call(user_id, False)

    def _call(self, user_id: str, syncing: bool) -> Deferred[Any] | None:
        result = self._report(user_id, syncing)
        if not isinstance(result, Deferred):
            return None
        run_in_background("report_user_sync", result)
        return result
