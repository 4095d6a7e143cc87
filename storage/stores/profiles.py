"""Profiles: the global display name and avatar URL of each local user.

This store owns the ``profiles`` table; a row is created with the user (see
accounts.py). Per-room display names live in membership events, which this
store knows nothing about.
"""

# tests: tests/integration/test_accounts_store.py

from __future__ import annotations

import attrs

from storage.database import Database, Transaction


@attrs.frozen
class ProfileRow:
    user_id: str
    displayname: str | None
    avatar_url: str | None


def _get_profile_txn(txn: Transaction, user_id: str) -> ProfileRow | None:
    txn.execute("SELECT user_id, displayname, avatar_url FROM profiles WHERE user_id = %s", (user_id,))
    row = txn.fetchone()
    return None if row is None else ProfileRow(row[0], row[1], row[2])


def _set_displayname_txn(txn: Transaction, user_id: str, value: str | None) -> ProfileRow | None:
    txn.execute(
        "UPDATE profiles SET displayname = %s WHERE user_id = %s RETURNING user_id, displayname, avatar_url",
        (value, user_id),
    )
    row = txn.fetchone()
    return None if row is None else ProfileRow(row[0], row[1], row[2])


def _set_avatar_url_txn(txn: Transaction, user_id: str, value: str | None) -> ProfileRow | None:
    txn.execute(
        "UPDATE profiles SET avatar_url = %s WHERE user_id = %s RETURNING user_id, displayname, avatar_url",
        (value, user_id),
    )
    row = txn.fetchone()
    return None if row is None else ProfileRow(row[0], row[1], row[2])


class ProfileStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def get_profile(self, user_id: str) -> ProfileRow | None:
        """The user's profile; None when there is no such local user."""
        return await self._db.run_interaction("get_profile", _get_profile_txn, user_id)

    async def set_displayname(self, user_id: str, value: str | None) -> ProfileRow | None:
        """Set (or, with None, clear) the display name; return the new profile, None for no such user."""
        return await self._db.run_interaction("set_displayname", _set_displayname_txn, user_id, value)

    async def set_avatar_url(self, user_id: str, value: str | None) -> ProfileRow | None:
        return await self._db.run_interaction("set_avatar_url", _set_avatar_url_txn, user_id, value)
