"""The user directory's tables (schema 0020): who may be found by ``/user_directory/search``.

The updater (``workers/user_directory.py``) asks which rooms' state changed on the events
stream since its stored position and rewrites those rooms' rows from current state, in one
transaction with the new position. The search reads only these tables (and, when every local
user may be found, ``users`` and ``profiles``); who sees whom is the handler's choice of query.
"""

# tests: tests/integration/test_directory.py

from __future__ import annotations

from collections.abc import Collection

import attrs

from storage.database import Database, Transaction

# Rooms rewritten per transaction while catching up.
ROOMS_PER_BATCH = 100


@attrs.frozen
class UserRow:
    user_id: str
    display_name: str | None
    avatar_url: str | None


def _get_position_txn(txn: Transaction) -> int:
    txn.execute("SELECT stream_id FROM user_directory_position")
    row = txn.fetchone()
    return int(row[0]) if row else 0


def _changed_rooms_txn(txn: Transaction, after: int, upto: int) -> list[str]:
    """Rooms with a state event on the events stream in (after, upto], oldest change first."""
    txn.execute(
        "SELECT room_id FROM events WHERE stream_ordering > %s AND stream_ordering <= %s "
        "AND state_key IS NOT NULL GROUP BY room_id ORDER BY min(stream_ordering)",
        (after, upto),
    )
    return [str(r[0]) for r in txn.fetchall()]


def _rebuild_rooms_txn(txn: Transaction, room_ids: list[str], position: int | None) -> None:
    txn.execute("DELETE FROM user_directory_members WHERE room_id = ANY(%s)", (room_ids,))
    txn.execute(
        "INSERT INTO user_directory_members (room_id, user_id, display_name, avatar_url) "
        "SELECT c.room_id, c.state_key, rm.display_name, rm.avatar_url FROM current_state_events c "
        "JOIN room_memberships rm ON rm.event_id = c.event_id "
        "WHERE c.room_id = ANY(%s) AND c.type = 'm.room.member' AND c.membership = 'join'",
        (room_ids,),
    )
    txn.execute("DELETE FROM user_directory_public_rooms WHERE room_id = ANY(%s)", (room_ids,))
    # The stored PDU JSON is canonical (compact), so the key and its value are adjacent.
    txn.execute(
        "INSERT INTO user_directory_public_rooms (room_id) "
        "SELECT c.room_id FROM current_state_events c JOIN events e ON e.event_id = c.event_id "
        "WHERE c.room_id = ANY(%s) AND c.type = 'm.room.join_rules' AND c.state_key = '' "
        "AND strpos(e.json, '\"join_rule\":\"public\"') > 0",
        (room_ids,),
    )
    if position is not None:
        txn.execute("UPDATE user_directory_position SET stream_id = GREATEST(stream_id, %s)", (position,))


def _search_users_txn(
    txn: Transaction, searcher: str, term: str, limit: int, search_all_local: bool
) -> list[UserRow]:
    like = "%" + term.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    # Who may be found: members of rooms the searcher is joined to, members of public rooms,
    # and, with search_all_local, every active local user (named by their profile).
    all_local = (
        "UNION ALL SELECT u.user_id, p.displayname, p.avatar_url FROM users u "
        "LEFT JOIN profiles p ON p.user_id = u.user_id WHERE NOT u.deactivated"
        if search_all_local else ""
    )
    txn.execute(
        f"""
        WITH visible AS (
            SELECT m.user_id, m.display_name, m.avatar_url FROM user_directory_members m
            WHERE m.room_id IN (SELECT room_id FROM user_directory_members WHERE user_id = %s)
               OR m.room_id IN (SELECT room_id FROM user_directory_public_rooms)
            {all_local}
        ), found AS (
            SELECT DISTINCT ON (user_id) user_id, display_name, avatar_url FROM visible
            WHERE user_id ILIKE %s OR display_name ILIKE %s
            ORDER BY user_id, display_name IS NULL, display_name
        )
        SELECT user_id, display_name, avatar_url FROM found
        ORDER BY display_name IS NULL, lower(coalesce(display_name, user_id)), user_id
        LIMIT %s
        """,
        (searcher, like, like, limit),
    )
    return [UserRow(str(r[0]), r[1], r[2]) for r in txn.fetchall()]


class UserDirectoryStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def get_position(self) -> int:
        return await self._db.run_interaction("user_directory_position", _get_position_txn)

    async def changed_rooms(self, after: int, upto: int) -> list[str]:
        return await self._db.run_interaction("user_directory_changed_rooms", _changed_rooms_txn, after, upto)

    async def rebuild_rooms(self, room_ids: Collection[str], position: int | None) -> None:
        """Rewrite the rooms' rows from current state; then, if given, store ``position``."""
        await self._db.run_interaction(
            "user_directory_rebuild_rooms", _rebuild_rooms_txn, sorted(room_ids), position
        )

    async def search_users(
        self, searcher: str, term: str, *, limit: int, search_all_local: bool
    ) -> list[UserRow]:
        return await self._db.run_interaction(
            "search_user_directory", _search_users_txn, searcher, term, limit, search_all_local
        )
