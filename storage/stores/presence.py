"""Presence rows of local users: the latest state per user, on the presence stream's table."""

# tests: tests/integration/test_client_e2e.py

from __future__ import annotations

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
        self, stream_id: int, instance_name: str, user_id: str, state: str, status_msg: str | None, now_ms: int
    ) -> None:
        await self._db.run_interaction(
            "set_presence",
            upsert_presence_txn,
            stream_id,
            instance_name,
            user_id,
            state,
            status_msg,
            now_ms,
            state == "online",
        )

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
