"""Presence rows of local users: the latest state per user, on the presence stream's table."""

# tests: tests/integration/test_client_e2e.py, tests/integration/test_client_peeking.py, tests/integration/test_client_sync_state.py

from __future__ import annotations

from collections.abc import Collection

import attrs

from storage.database import Database, Transaction
from storage.stores.streams import upsert_presence_txn


@attrs.frozen
class PresenceRow:
    user_id: str
    state: str
    status_msg: str | None
    last_active_ts: int
    currently_active: bool


class PresenceStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def set_presence(
        self,
        stream_id: int,
        instance_name: str,
        user_id: str,
        state: str,
        status_msg: str | None,
        now_ms: int,
        *,
        currently_active: bool | None = None,
    ) -> None:
        """``now_ms`` is the last-active time; ``currently_active`` defaults to ``state == "online"``."""
        await self._db.run_interaction(
            "set_presence",
            upsert_presence_txn,
            stream_id,
            instance_name,
            user_id,
            state,
            status_msg,
            now_ms,
            state == "online" if currently_active is None else currently_active,
        )

    async def get_presence_changes(self, user_id: str, after: int, upto: int) -> list[PresenceRow]:
        """Presence rows with ``after < stream_id <= upto`` of the user and of users joined to a
        room the user is joined to."""

        def txn_fn(txn: Transaction) -> list[PresenceRow]:
            txn.execute(
                """
                SELECT p.user_id, p.state, p.status_msg, p.last_active_ts, p.currently_active FROM presence_stream p
                WHERE p.stream_id > %s AND p.stream_id <= %s AND (
                    p.user_id = %s OR EXISTS (
                        SELECT 1 FROM current_state_events mine
                        JOIN current_state_events theirs ON theirs.room_id = mine.room_id
                        WHERE mine.type = 'm.room.member' AND mine.state_key = %s AND mine.membership = 'join'
                          AND theirs.type = 'm.room.member' AND theirs.state_key = p.user_id
                          AND theirs.membership = 'join'
                    )
                )
                ORDER BY p.stream_id
                """,
                (after, upto, user_id, user_id),
            )
            return [PresenceRow(str(r[0]), str(r[1]), r[2], int(r[3]), bool(r[4])) for r in txn.fetchall()]

        return await self._db.run_interaction("get_presence_changes", txn_fn)

    async def get_room_presence_changes(self, room_id: str, after: int, upto: int) -> list[PresenceRow]:
        """Presence rows with ``after < stream_id <= upto`` of the users joined to ``room_id``."""

        def txn_fn(txn: Transaction) -> list[PresenceRow]:
            txn.execute(
                """
                SELECT p.user_id, p.state, p.status_msg, p.last_active_ts, p.currently_active FROM presence_stream p
                WHERE p.stream_id > %s AND p.stream_id <= %s AND EXISTS (
                    SELECT 1 FROM current_state_events c
                    WHERE c.room_id = %s AND c.type = 'm.room.member' AND c.state_key = p.user_id
                      AND c.membership = 'join'
                )
                ORDER BY p.stream_id
                """,
                (after, upto, room_id),
            )
            return [PresenceRow(str(r[0]), str(r[1]), r[2], int(r[3]), bool(r[4])) for r in txn.fetchall()]

        return await self._db.run_interaction("get_room_presence_changes", txn_fn)

    async def shares_joined_room(self, user_id: str, other_user_id: str) -> bool:
        """Whether both users are joined to some room (by the rooms' current state)."""

        def txn_fn(txn: Transaction) -> bool:
            txn.execute(
                """
                SELECT 1 FROM current_state_events mine
                JOIN current_state_events theirs ON theirs.room_id = mine.room_id
                WHERE mine.type = 'm.room.member' AND mine.state_key = %s AND mine.membership = 'join'
                  AND theirs.type = 'm.room.member' AND theirs.state_key = %s AND theirs.membership = 'join'
                LIMIT 1
                """,
                (user_id, other_user_id),
            )
            return txn.fetchone() is not None

        return await self._db.run_interaction("shares_joined_room", txn_fn)

    async def get_presences(self, user_ids: Collection[str]) -> list[PresenceRow]:
        """The known presence of each of ``user_ids`` (unknown users left out), in one query."""

        def txn_fn(txn: Transaction) -> list[PresenceRow]:
            txn.execute(
                "SELECT user_id, state, status_msg, last_active_ts, currently_active FROM presence_stream "
                "WHERE user_id = ANY(%s) ORDER BY user_id",
                (sorted(user_ids),),
            )
            return [PresenceRow(str(r[0]), str(r[1]), r[2], int(r[3]), bool(r[4])) for r in txn.fetchall()]

        return await self._db.run_interaction("get_presences", txn_fn)

    async def get_presence(self, user_id: str) -> PresenceRow | None:
        def txn_fn(txn: Transaction) -> PresenceRow | None:
            txn.execute(
                "SELECT user_id, state, status_msg, last_active_ts, currently_active FROM presence_stream "
                "WHERE user_id = %s",
                (user_id,),
            )
            row = txn.fetchone()
            return None if row is None else PresenceRow(str(row[0]), str(row[1]), row[2], int(row[3]), bool(row[4]))

        return await self._db.run_interaction("get_presence", txn_fn)
