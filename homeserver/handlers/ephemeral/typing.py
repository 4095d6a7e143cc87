"""Typing notifications: who is typing in which room, held in memory, on the typing stream.

Each change takes the next ID of the ``typing`` stream, so ``/sync`` waiters
wake and a sync token's typing component says which rooms changed since.
Timeouts are timers on the injected clock; nothing here is persisted (typing
state does not survive a restart, by design).
"""

# tests: tests/integration/test_client_rooms.py, tests/integration/test_client_ephemeral.py

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any

from twisted.internet.interfaces import IDelayedCall

from homeserver.handlers.accounts.auth import Requester
from homeserver.handlers.ephemeral.federation_edus import OutboundEdus
from storage.kernel.errors import forbidden
from storage.id_generators import StreamIdGenerator
from storage.kernel.background import run_in_background

logger = logging.getLogger(__name__)

MAX_TYPING_TIMEOUT_S = 120.0
# A remote user's typing lasts this long unless their server renews or ends it.
REMOTE_TYPING_TIMEOUT_S = 60.0


class TypingHandler:
    def __init__(
        self,
        *,
        stream: StreamIdGenerator,
        clock: Any,
        is_joined: Callable[[str, str], Awaitable[bool]],
        record: Callable[[int, str, list[str]], Awaitable[None]] | None = None,
        federation: OutboundEdus | None = None,
        noted: Callable[[int, frozenset[str]], None] | None = None,
    ) -> None:
        self._stream = stream
        # Told each position this process writes and its room, before the position completes
        # (``KeyNotes``: a waiting /sync sleeps through typing in rooms not its user's).
        self._noted = noted
        # Writes (stream_id, room_id, typing users) to typing_stream, for other processes.
        self._record = record
        self._clock = clock
        self._is_joined = is_joined
        self._typing: dict[str, dict[str, float]] = {}
        self._serial: dict[str, int] = {}
        self._timers: dict[tuple[str, str], IDelayedCall] = {}
        self._stopped = False
        # Set when this process sends federation traffic: other servers in the room hear of changes.
        # Where typing changes go to other servers; None in a process that sends no EDUs.
        self._federation = federation

    def current_position(self) -> int:
        return self._stream.get_current_token()

    async def set_typing(
        self, requester: Requester, room_id: str, user_id: str, typing: bool, timeout_ms: int | None
    ) -> None:
        if requester.user_id != user_id:
            raise forbidden("You cannot set typing for another user")
        if not await self._is_joined(user_id, room_id):
            raise forbidden("You are not in this room")
        key = (room_id, user_id)
        timer = self._timers.pop(key, None)
        if timer is not None and timer.active():
            timer.cancel()
        if typing:
            timeout = min(max((timeout_ms or 30_000) / 1000.0, 0.0), MAX_TYPING_TIMEOUT_S)
            self._timers[key] = self._clock.callLater(timeout, self._expire, room_id, user_id)
            await self._change(room_id, user_id, True)
        else:
            await self._change(room_id, user_id, False)
        if self._federation is not None:
            await self._federation.typing(room_id, user_id, typing)

    async def apply_remote(self, room_id: str, user_id: str, typing: bool) -> bool:
        """An ``m.typing`` EDU: a remote user started or stopped typing. False (ignored)
        when the user is not joined to the room as we see it."""
        if not await self._is_joined(user_id, room_id):
            return False
        key = (room_id, user_id)
        timer = self._timers.pop(key, None)
        if timer is not None and timer.active():
            timer.cancel()
        if typing and not self._stopped:
            self._timers[key] = self._clock.callLater(REMOTE_TYPING_TIMEOUT_S, self._expire, room_id, user_id)
        await self._change(room_id, user_id, typing)
        return True

    def stop(self) -> None:
        """Cancel the expiry timers (on shutdown: they would write to a closed database)."""
        self._stopped = True
        for timer in self._timers.values():
            if timer.active():
                timer.cancel()
        self._timers.clear()

    def _expire(self, room_id: str, user_id: str) -> None:
        self._timers.pop((room_id, user_id), None)
        if self._stopped:
            return
        run_in_background("typing_expiry", self._change(room_id, user_id, False))

    async def _change(self, room_id: str, user_id: str, typing: bool) -> None:
        users = self._typing.setdefault(room_id, {})
        if not typing and user_id not in users:
            return
        async with self._stream.get_next() as stream_id:
            if typing:
                users[user_id] = self._clock.seconds()
            else:
                users.pop(user_id, None)
            self._serial[room_id] = stream_id
            if self._noted is not None:
                self._noted(stream_id, frozenset((room_id,)))
            if self._record is not None:
                await self._record(stream_id, room_id, sorted(users))

    def apply_replicated(self, stream_id: int, room_id: str, user_ids: Collection[str]) -> None:
        """The typing writer (another process) says these users type in ``room_id`` now."""
        now = self._clock.seconds()
        self._typing[room_id] = {user_id: now for user_id in user_ids}
        self._serial[room_id] = max(stream_id, self._serial.get(room_id, 0))

    def changed_rooms(self, room_ids: Collection[str], since: int) -> dict[str, list[str]]:
        """Rooms among ``room_ids`` whose typing set changed after ``since``: room -> typing users."""
        return {
            room_id: sorted(self._typing.get(room_id, {}))
            for room_id in room_ids
            if self._serial.get(room_id, 0) > since
        }

    def typing_in(self, room_id: str) -> list[str]:
        return sorted(self._typing.get(room_id, {}))


class ReplicatedTyping:
    """A replication ``RowHandler``: the typing writer's rows, applied to this process's view."""

    def __init__(self, typing: TypingHandler) -> None:
        self._typing = typing

    def on_rows(self, stream: str, instance: str, token: int, rows: Sequence[Any]) -> None:
        if stream != "typing":
            return
        for row in rows:
            self._typing.apply_replicated(token, str(row[0]), [str(u) for u in row[1]])
