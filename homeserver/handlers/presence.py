"""``GET/PUT /presence/{userId}/status``: a user's own presence, stored on the presence stream.

Also applies remote users' presence from ``m.presence`` EDUs (``apply_remote``)
and reads the changes ``/sync`` shows (``presence_for_sync``: the user and those
sharing a room with them). No idle timers; anyone authenticated may read a
user's status.
"""

# tests: tests/integration/test_client_e2e.py

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from homeserver.handlers.federation_edus import OutboundEdus
from homeserver.handlers.auth import Requester
from homeserver.http.errors import forbidden, not_found
from storage.id_generators import StreamIdGenerator
from storage.stores.presence import PresenceStore

PRESENCE_STATES = frozenset({"online", "offline", "unavailable"})


class PresenceHandler:
    def __init__(self, *, store: PresenceStore, stream: StreamIdGenerator, clock_ms: Callable[[], int]) -> None:
        self._store = store
        self._stream = stream
        self._clock_ms = clock_ms
        # Set when this process sends federation traffic: servers sharing a room hear of changes.
        self.federation: OutboundEdus | None = None

    async def set_status(self, requester: Requester, user_id: str, state: str, status_msg: str | None) -> None:
        if requester.user_id != user_id:
            raise forbidden("You can only set your own presence")
        async with self._stream.get_next() as stream_id:
            await self._store.set_presence(
                stream_id, self._stream.instance_name or "master", user_id, state, status_msg, self._clock_ms()
            )
        if self.federation is not None:
            push: dict[str, Any] = {"user_id": user_id, "presence": state, "last_active_ago": 0,
                                    "currently_active": state == "online"}
            if status_msg is not None:
                push["status_msg"] = status_msg
            await self.federation.presence(push)

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
        now = self._clock_ms()
        out = []
        for row in await self._store.get_presence_changes(user_id, after, upto):
            content: dict[str, Any] = {
                "presence": row.state,
                "last_active_ago": max(0, now - row.last_active_ts),
                "currently_active": row.currently_active,
            }
            if row.status_msg is not None:
                content["status_msg"] = row.status_msg
            out.append({"type": "m.presence", "sender": row.user_id, "content": content})
        return out

    async def get_status(self, user_id: str) -> dict[str, Any]:
        row = await self._store.get_presence(user_id)
        if row is None:
            raise not_found("No presence known for this user")
        out: dict[str, Any] = {
            "presence": row.state,
            "last_active_ago": max(0, self._clock_ms() - row.last_active_ts),
            "currently_active": row.currently_active,
        }
        if row.status_msg is not None:
            out["status_msg"] = row.status_msg
        return out
