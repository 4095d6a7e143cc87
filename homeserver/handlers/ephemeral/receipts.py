"""Read receipts and read markers: stored per (room, type, user) on the receipts stream.

``m.read`` and ``m.read.private`` receipts are kept; ``m.read.private`` is only
ever shown to its owner. ``m.fully_read`` (from ``/read_markers``) is room
account data, written through the account data handler.
"""

# tests: tests/integration/test_client_rooms.py

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Collection
from typing import Any, Final

from homeserver.handlers.ephemeral.federation_edus import OutboundEdus
from homeserver.handlers.accounts.auth import Requester
from storage.kernel.errors import forbidden, invalid_param, not_found
from storage.id_generators import StreamIdGenerator
from storage.stores.account_data import AccountDataStore
from storage.stores.timeline import TimelineStore

RECEIPT_TYPES = frozenset({"m.read", "m.read.private"})



# A threaded receipt names the thread root's event ID, or this for the main timeline.
MAIN_THREAD: Final = "main"


def check_receipt_thread(receipt_type: str, thread_id: str | None) -> None:
    """A receipt's ``thread_id``: absent (unthreaded), ``main``, or a thread root's event ID;
    ``m.fully_read`` is a marker, not a receipt, and is never threaded."""
    if thread_id is None:
        return
    if receipt_type == "m.fully_read":
        raise invalid_param("m.fully_read cannot have a thread_id")
    if thread_id != MAIN_THREAD and not thread_id.startswith("$"):
        raise invalid_param("thread_id must be 'main' or the event ID of a thread root")

class ReceiptsHandler:
    def __init__(
        self,
        *,
        stream: StreamIdGenerator,
        timeline: TimelineStore,
        is_joined: Callable[[str, str], Awaitable[bool]],
        event_room: Callable[[str], Awaitable[str | None]],
        clock_ms: Callable[[], int],
        account_data: AccountDataStore,
        account_data_stream: StreamIdGenerator,
        federation: OutboundEdus | None = None,
        noted: Callable[[int, frozenset[str]], None] | None = None,
        account_data_noted: Callable[[int, frozenset[str]], None] | None = None,
    ) -> None:
        # Told each position this process writes and its room (for the fully-read marker, the
        # account data position and its user), before the position completes (``KeyNotes``: a
        # waiting /sync sleeps through what is not for its user).
        self._noted = noted
        self._account_data_noted = account_data_noted
        self._account_data = account_data
        self._account_data_stream = account_data_stream
        self._stream = stream
        self._timeline = timeline
        self._is_joined = is_joined
        self._event_room = event_room
        self._clock_ms = clock_ms
        # Set when this process sends federation traffic: other servers in the room hear of receipts.
        # Where receipts go to other servers; None in a process that sends no EDUs.
        self._federation = federation

    def current_position(self) -> int:
        return self._stream.get_current_token()

    async def receipt(
        self, requester: Requester, room_id: str, receipt_type: str, event_id: str, thread_id: str | None
    ) -> None:
        if receipt_type not in RECEIPT_TYPES:
            raise invalid_param(f"Unsupported receipt type {receipt_type[:100]!r}")
        check_receipt_thread(receipt_type, thread_id)
        if not await self._is_joined(requester.user_id, room_id):
            raise forbidden("You are not in this room")
        if await self._event_room(event_id) != room_id:
            raise not_found("Event not found in this room")
        data: dict[str, Any] = {"ts": self._clock_ms()}
        if thread_id is not None:
            data["thread_id"] = thread_id
        async with self._stream.get_next() as stream_id:
            await self._timeline.put_receipt(
                room_id,
                receipt_type,
                requester.user_id,
                thread_id,
                event_id,
                json.dumps(data),
                stream_id,
                self._stream.instance_name or "master",
            )
            if self._noted is not None:
                self._noted(stream_id, frozenset((room_id,)))
        if self._federation is not None:
            await self._federation.receipt(room_id, receipt_type, requester.user_id, event_id, data)

    async def apply_remote(
        self, room_id: str, receipt_type: str, user_id: str, event_id: str, data: dict[str, Any]
    ) -> bool:
        """An ``m.receipt`` EDU entry: a remote user's receipt. False (ignored) when the user is
        not joined to the room as we see it or the type is not one servers share."""
        if receipt_type != "m.read" or not await self._is_joined(user_id, room_id):
            return False
        thread_id = data.get("thread_id")
        thread = thread_id if isinstance(thread_id, str) else None
        async with self._stream.get_next() as stream_id:
            await self._timeline.put_receipt(
                room_id,
                receipt_type,
                user_id,
                thread,
                event_id,
                json.dumps(data),
                stream_id,
                self._stream.instance_name or "master",
            )
            if self._noted is not None:
                self._noted(stream_id, frozenset((room_id,)))
        return True

    async def set_fully_read(self, requester: Requester, room_id: str, event_id: str) -> None:
        """The ``m.fully_read`` marker: server-managed room account data, so written here, not via PUT."""
        if not await self._is_joined(requester.user_id, room_id):
            raise forbidden("You are not in this room")
        if await self._event_room(event_id) != room_id:
            raise not_found("Event not found in this room")
        async with self._account_data_stream.get_next() as stream_id:
            await self._account_data.put(
                requester.user_id,
                room_id,
                "m.fully_read",
                json.dumps({"event_id": event_id}),
                stream_id=stream_id,
                instance_name=self._account_data_stream.instance_name or "master",
            )
            if self._account_data_noted is not None:
                self._account_data_noted(stream_id, frozenset((requester.user_id,)))

    async def ephemeral_for(
        self, user_id: str, room_ids: Collection[str], since: int, upto: int
    ) -> dict[str, dict[str, Any]]:
        """room -> an ``m.receipt`` ephemeral event with the receipts that changed in (since, upto]."""
        rows = await self._timeline.get_receipts(room_ids, since, upto)
        out: dict[str, dict[str, Any]] = {}
        for row in rows:
            if row.receipt_type == "m.read.private" and row.user_id != user_id:
                continue
            content = out.setdefault(row.room_id, {"type": "m.receipt", "content": {}})["content"]
            content.setdefault(row.event_id, {}).setdefault(row.receipt_type, {})[row.user_id] = json.loads(row.data)
        return out
