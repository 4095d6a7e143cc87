"""``GET/PUT /presence/{userId}/status``: a user's own presence, stored on the presence stream.

Minimal: no presence in ``/sync``, no idle timers, no federation; anyone
authenticated may read a local user's status.
"""

# tests: tests/integration/test_client_e2e.py

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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

    async def set_status(self, requester: Requester, user_id: str, state: str, status_msg: str | None) -> None:
        if requester.user_id != user_id:
            raise forbidden("You can only set your own presence")
        async with self._stream.get_next() as stream_id:
            await self._store.set_presence(
                stream_id, self._stream.instance_name or "master", user_id, state, status_msg, self._clock_ms()
            )

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
