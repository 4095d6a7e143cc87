"""Account data: per-user (and per-user-per-room) JSON objects clients keep on the server.

The rows live in ``account_data``, the backing table of the account_data stream
(created by 0002_streams.sql: one row per user, room and type, ``room_id`` NULL
for global data). Writes go through the stream's ``upsert_account_data_txn``
with a stream ID the caller reserved; this store does not allocate stream IDs
and wakes nobody. Content is the JSON text the handler produced, so it reads
back exactly as written.
"""

# tests: tests/integration/test_accounts_store.py

from __future__ import annotations

import attrs

from storage.database import Database, Transaction
from storage.stores.streams import upsert_account_data_txn


@attrs.frozen
class UserAccountData:
    """A user's account data as JSON text: global by type, and per room by room then type."""

    global_data: dict[str, str]
    rooms: dict[str, dict[str, str]]


def _get_txn(txn: Transaction, user_id: str, room_id: str | None, data_type: str) -> str | None:
    txn.execute(
        "SELECT content FROM account_data "
        "WHERE user_id = %s AND room_id IS NOT DISTINCT FROM %s AND account_data_type = %s",
        (user_id, room_id, data_type),
    )
    row = txn.fetchone()
    return None if row is None else str(row[0])


def _get_for_user_txn(txn: Transaction, user_id: str, after: int | None, upto: int | None) -> UserAccountData:
    txn.execute(
        "SELECT room_id, account_data_type, content FROM account_data "
        "WHERE user_id = %s AND stream_id > %s AND stream_id <= %s",
        (user_id, -1 if after is None else after, 2**63 - 1 if upto is None else upto),
    )
    global_data: dict[str, str] = {}
    rooms: dict[str, dict[str, str]] = {}
    for room_id, data_type, content in txn.fetchall():
        if room_id is None:
            global_data[data_type] = content
        else:
            rooms.setdefault(room_id, {})[data_type] = content
    return UserAccountData(global_data, rooms)


def _nextval_txn(txn: Transaction) -> int:
    txn.execute("SELECT nextval('account_data_stream_seq')")
    row = txn.fetchone()
    assert row is not None
    return int(row[0])


class AccountDataStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def put(
        self,
        user_id: str,
        room_id: str | None,
        data_type: str,
        content_json: str,
        *,
        stream_id: int,
        instance_name: str,
    ) -> None:
        """Store the latest content of ``data_type`` (``room_id`` None: global) at ``stream_id``."""
        await self._db.run_interaction(
            "put_account_data",
            upsert_account_data_txn,
            stream_id,
            instance_name,
            user_id,
            room_id,
            data_type,
            content_json,
        )

    async def get(self, user_id: str, room_id: str | None, data_type: str) -> str | None:
        """The JSON text stored for ``data_type`` (``room_id`` None: global); None when there is none."""
        return await self._db.run_interaction("get_account_data", _get_txn, user_id, room_id, data_type)

    async def get_for_user(self, user_id: str, *, after: int | None = None, upto: int | None = None) -> UserAccountData:
        """The user's account data written in ``(after, upto]`` (all of it by default): what /sync sends."""
        return await self._db.run_interaction("get_account_data_for_user", _get_for_user_txn, user_id, after, upto)

    async def next_stream_id_from_sequence(self) -> int:
        """A bare ``nextval`` on the account_data stream's sequence, with no position tracking.

        Only for a process that has no account_data ``StreamIdGenerator`` wired
        yet (see homeserver/wiring/accounts.py); the generator is the
        real allocator.
        """
        return await self._db.run_interaction("account_data_nextval", _nextval_txn)
