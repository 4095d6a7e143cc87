"""The room directory (schema 0018's ``room_directory``) and what ``/publicRooms`` shows of
each published room (the user directory is storage/stores/user_directory.py).

Reads current state straight from ``current_state_events``; which rooms are listed, in
what order, and who may see which user is decided by the directory handlers.
"""

# tests: tests/integration/test_directory.py

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any, Final

import attrs

from storage.database import Database, Transaction

# The state a /publicRooms entry is made of (all with state key "").
DIRECTORY_STATE_TYPES: Final = (
    "m.room.name", "m.room.topic", "m.room.avatar", "m.room.canonical_alias", "m.room.join_rules",
    "m.room.history_visibility", "m.room.guest_access", "m.room.create",
)


@attrs.frozen
class PublicRoomRow:
    room_id: str
    joined_members: int
    # event type -> content, for DIRECTORY_STATE_TYPES present in the room
    state: dict[str, Any]


def _public_rooms_txn(txn: Transaction) -> list[PublicRoomRow]:
    txn.execute("SELECT room_id FROM room_directory")
    return _room_rows_txn(txn, [str(r[0]) for r in txn.fetchall()])


def _room_rows_txn(txn: Transaction, room_ids: list[str]) -> list[PublicRoomRow]:
    """Joined member counts and directory state of the rooms (those with any current state)."""
    if not room_ids:
        return []
    txn.execute(
        "SELECT c.room_id, c.type, e.json, c.membership FROM current_state_events c "
        "JOIN events e ON e.event_id = c.event_id "
        "WHERE c.room_id = ANY(%s) AND ((c.state_key = '' AND c.type = ANY(%s)) "
        "OR (c.type = 'm.room.member' AND c.membership = 'join'))",
        (room_ids, list(DIRECTORY_STATE_TYPES)),
    )
    counts: dict[str, int] = {}
    state: dict[str, dict[str, Any]] = {}
    for room_id, event_type, raw, membership in txn.fetchall():
        room_state = state.setdefault(str(room_id), {})
        counts.setdefault(str(room_id), 0)
        if event_type == "m.room.member":
            counts[str(room_id)] += 1
            continue
        content = json.loads(raw).get("content")
        if isinstance(content, dict):
            room_state[str(event_type)] = content
    return [PublicRoomRow(room_id, counts[room_id], state[room_id]) for room_id in room_ids if room_id in state]


@attrs.frozen
class SpaceChildRow:
    room_id: str
    child_id: str
    sender: str
    origin_server_ts: int
    content: dict[str, Any]


def _space_children_txn(txn: Transaction, room_ids: list[str]) -> list[SpaceChildRow]:
    txn.execute(
        "SELECT c.room_id, c.state_key, e.json FROM current_state_events c JOIN events e ON e.event_id = c.event_id "
        "WHERE c.room_id = ANY(%s) AND c.type = 'm.space.child' ORDER BY c.room_id, c.state_key",
        (room_ids,),
    )
    out = []
    for room_id, state_key, raw in txn.fetchall():
        pdu = json.loads(raw)
        content = pdu.get("content")
        ts = pdu.get("origin_server_ts")
        if isinstance(content, dict) and isinstance(ts, int) and isinstance(pdu.get("sender"), str):
            out.append(SpaceChildRow(str(room_id), str(state_key), pdu["sender"], ts, content))
    return out


class DirectoryStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def is_published(self, room_id: str) -> bool:
        def query(txn: Transaction) -> bool:
            txn.execute("SELECT 1 FROM room_directory WHERE room_id = %s", (room_id,))
            return txn.fetchone() is not None

        return await self._db.run_interaction("is_room_published", query)

    async def set_published(self, room_id: str, published: bool, now_ms: int) -> None:
        def write(txn: Transaction) -> None:
            if published:
                txn.execute(
                    "INSERT INTO room_directory (room_id, published_ts) VALUES (%s, %s) ON CONFLICT DO NOTHING",
                    (room_id, now_ms),
                )
            else:
                txn.execute("DELETE FROM room_directory WHERE room_id = %s", (room_id,))

        await self._db.run_interaction("set_room_published", write)

    async def get_public_rooms(self) -> list[PublicRoomRow]:
        """Every published room with its joined member count and directory state."""
        return await self._db.run_interaction("get_public_rooms", _public_rooms_txn)

    async def get_room_rows(self, room_ids: Collection[str]) -> list[PublicRoomRow]:
        """What a directory entry is made of, for any rooms (published or not) we have state of."""
        return await self._db.run_interaction("get_room_summaries", _room_rows_txn, sorted(room_ids))

    async def get_space_children(self, room_ids: Collection[str]) -> list[SpaceChildRow]:
        """The current ``m.space.child`` state of the rooms (all, even with empty content)."""
        if not room_ids:
            return []
        return await self._db.run_interaction("get_space_children", _space_children_txn, sorted(room_ids))

    async def known_rooms(self, room_ids: Collection[str]) -> set[str]:
        def query(txn: Transaction) -> set[str]:
            txn.execute("SELECT room_id FROM rooms WHERE room_id = ANY(%s)", (list(room_ids),))
            return {str(r[0]) for r in txn.fetchall()}

        return await self._db.run_interaction("known_rooms", query)
