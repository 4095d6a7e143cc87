"""Invites of local users to rooms this server is not in (schema 0010)."""

# tests: tests/integration/test_federation_invite_state.py

from __future__ import annotations

from typing import Any, Final

import attrs

from storage.database import Database, Prepared, Transaction, json_rows


@attrs.frozen
class RemoteInviteRow:
    user_id: str
    room_id: str
    membership: str  # "invite" or "knock", or "leave" once rejected or withdrawn
    event_id: str
    room_version: str
    event_json: str
    invite_state: str  # JSON list of stripped state events
    stream_ordering: int
    instance_name: str


_COLUMNS = ("user_id, room_id, membership, event_id, room_version, event_json, invite_state, "
            "stream_ordering, instance_name")
# Every /sync runs it: Prepared.
_FOR_USER_FROM: Final = "FROM remote_invites WHERE user_id = %s"
_FOR_USER: Final = Prepared(f"SELECT {_COLUMNS} {_FOR_USER_FROM} ORDER BY room_id")


# The same rows as one JSON array of arrays (NULL: none), a subquery of /sync's one read of
# the user's rooms (storage/stores/timeline.py); ``remote_invites_from_json`` reads it.
FOR_USER_JSON: Final = json_rows(_COLUMNS, _FOR_USER_FROM, "room_id")


def get_remote_invites_txn(txn: Transaction, user_id: str) -> list[RemoteInviteRow]:
    txn.execute(_FOR_USER, (user_id,))
    return [_row(r) for r in txn.fetchall()]


def remote_invites_from_json(rows: list[Any] | None) -> list[RemoteInviteRow]:
    return [_row(r) for r in rows or ()]


def _row(r: Any) -> RemoteInviteRow:
    return RemoteInviteRow(str(r[0]), str(r[1]), str(r[2]), str(r[3]), str(r[4]), str(r[5]), str(r[6]),
                           int(r[7]), str(r[8]))


class RemoteInviteStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def put(self, row: RemoteInviteRow) -> None:
        def txn_fn(txn: Transaction) -> None:
            txn.execute(
                f"INSERT INTO remote_invites ({_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) "
                "ON CONFLICT (user_id, room_id) DO UPDATE SET membership = EXCLUDED.membership, "
                "event_id = EXCLUDED.event_id, room_version = EXCLUDED.room_version, "
                "event_json = EXCLUDED.event_json, invite_state = EXCLUDED.invite_state, "
                "stream_ordering = EXCLUDED.stream_ordering, instance_name = EXCLUDED.instance_name",
                attrs.astuple(row),
            )

        await self._db.run_interaction("put_remote_invite", txn_fn)

    async def get(self, room_id: str, user_id: str) -> RemoteInviteRow | None:
        def txn_fn(txn: Transaction) -> RemoteInviteRow | None:
            txn.execute(f"SELECT {_COLUMNS} FROM remote_invites WHERE user_id = %s AND room_id = %s",
                        (user_id, room_id))
            row = txn.fetchone()
            return None if row is None else _row(row)

        return await self._db.run_interaction("get_remote_invite", txn_fn)

    async def delete(self, room_id: str, user_id: str) -> None:
        def txn_fn(txn: Transaction) -> None:
            txn.execute("DELETE FROM remote_invites WHERE user_id = %s AND room_id = %s", (user_id, room_id))

        await self._db.run_interaction("delete_remote_invite", txn_fn)
