"""Filters uploaded with ``POST /user/{userId}/filter``, kept as the JSON text sent.

This store owns ``user_filters``. The same filter uploaded again by the same
user gets its earlier ID back (clients upload their filter at every start), so
the table grows with distinct filters, not with logins. What a filter means is
/sync's business, not this store's.
"""

# tests: tests/integration/test_accounts_store.py

from __future__ import annotations

import hashlib

from storage.database import Database, Transaction


def _add_filter_txn(txn: Transaction, user_id: str, filter_json: str) -> int:
    digest = hashlib.sha256(filter_json.encode("utf-8")).digest()
    txn.execute(
        "INSERT INTO user_filters (user_id, filter_json, filter_sha256) VALUES (%s, %s, %s) "
        "ON CONFLICT (user_id, filter_sha256) DO NOTHING RETURNING filter_id",
        (user_id, filter_json, digest),
    )
    row = txn.fetchone()
    if row is None:
        txn.execute(
            "SELECT filter_id FROM user_filters WHERE user_id = %s AND filter_sha256 = %s", (user_id, digest)
        )
        row = txn.fetchone()
        assert row is not None, "conflicting filter row vanished inside the transaction"
    return int(row[0])


def _get_filter_txn(txn: Transaction, user_id: str, filter_id: int) -> str | None:
    txn.execute("SELECT filter_json FROM user_filters WHERE user_id = %s AND filter_id = %s", (user_id, filter_id))
    row = txn.fetchone()
    return None if row is None else str(row[0])


class FilterStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def add_filter(self, user_id: str, filter_json: str) -> int:
        """Store the filter (or find the identical one stored before); return its ID."""
        return await self._db.run_interaction("add_user_filter", _add_filter_txn, user_id, filter_json)

    async def get_filter(self, user_id: str, filter_id: int) -> str | None:
        """The filter's JSON text; None when this user has no filter with that ID."""
        return await self._db.run_interaction("get_user_filter", _get_filter_txn, user_id, filter_id)
