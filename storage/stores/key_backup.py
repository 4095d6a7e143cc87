"""Server-side key backup: a user's backup versions and the room keys backed up in them (schema 0014).

A user's current version is the newest not deleted; versions are numbered per
user and never reused. Writes to one user's backup are serialised by a
transaction-scoped advisory lock, so the etag (a per-version counter moved on
by every change of its keys) and the replacement decision (the caller's pure
``should_replace``) see one consistent state. It knows nothing of the rules
themselves, nor of the HTTP answers.
"""

# tests: tests/integration/test_client_e2e.py

from __future__ import annotations

from collections.abc import Callable, Collection

import attrs

from storage.database import Database, Transaction


@attrs.frozen
class BackupVersion:
    version: int
    algorithm: str
    auth_data: str
    etag: int
    count: int


@attrs.frozen
class RoomKey:
    room_id: str
    session_id: str
    first_message_index: int
    forwarded_count: int
    is_verified: bool
    session_data: str


@attrs.frozen
class KeysWritten:
    """The version's key count and etag after a write; ``current``: the user's current version
    when the write named another (nothing written)."""

    count: int
    etag: int
    current: int | None = None


def _lock_txn(txn: Transaction, user_id: str) -> None:
    txn.execute("SELECT pg_advisory_xact_lock(hashtextextended('room_keys:' || %s, 0))", (user_id,))


def _current_txn(txn: Transaction, user_id: str) -> int | None:
    txn.execute(
        "SELECT MAX(version) FROM e2e_room_keys_versions WHERE user_id = %s AND NOT deleted", (user_id,)
    )
    row = txn.fetchone()
    return None if row is None or row[0] is None else int(row[0])


def _written_txn(txn: Transaction, user_id: str, version: int, changed: bool) -> KeysWritten:
    """After a write to a backup's keys: its etag moves on when a key ``changed``; the count
    and etag as they now are."""
    if changed:
        txn.execute(
            "UPDATE e2e_room_keys_versions SET etag = etag + 1 WHERE user_id = %s AND version = %s",
            (user_id, version),
        )
    count, etag = _count_txn(txn, user_id, version)
    return KeysWritten(count, etag)


def _count_txn(txn: Transaction, user_id: str, version: int) -> tuple[int, int]:
    txn.execute("SELECT COUNT(*) FROM e2e_room_keys WHERE user_id = %s AND version = %s", (user_id, version))
    count_row = txn.fetchone()
    txn.execute("SELECT etag FROM e2e_room_keys_versions WHERE user_id = %s AND version = %s", (user_id, version))
    etag_row = txn.fetchone()
    return int(count_row[0]) if count_row else 0, int(etag_row[0]) if etag_row else 0


def _where(room_id: str | None, session_id: str | None) -> tuple[str, list[object]]:
    sql, params = "", list[object]()
    if room_id is not None:
        sql, params = " AND room_id = %s", [room_id]
        if session_id is not None:
            sql, params = sql + " AND session_id = %s", [room_id, session_id]
    return sql, params


class KeyBackupStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def create_version(self, user_id: str, algorithm: str, auth_data: str) -> int:
        def txn_fn(txn: Transaction) -> int:
            _lock_txn(txn, user_id)
            txn.execute("SELECT COALESCE(MAX(version), 0) FROM e2e_room_keys_versions WHERE user_id = %s", (user_id,))
            row = txn.fetchone()
            version = (int(row[0]) if row else 0) + 1
            txn.execute(
                "INSERT INTO e2e_room_keys_versions (user_id, version, algorithm, auth_data) VALUES (%s, %s, %s, %s)",
                (user_id, version, algorithm, auth_data),
            )
            return version

        return await self._db.run_interaction("create_room_keys_version", txn_fn)

    async def get_version(self, user_id: str, version: int | None) -> BackupVersion | None:
        """``version`` (None: the current one), unless deleted."""

        def txn_fn(txn: Transaction) -> BackupVersion | None:
            wanted = _current_txn(txn, user_id) if version is None else version
            if wanted is None:
                return None
            txn.execute(
                "SELECT algorithm, auth_data FROM e2e_room_keys_versions WHERE user_id = %s AND version = %s "
                "AND NOT deleted",
                (user_id, wanted),
            )
            row = txn.fetchone()
            if row is None:
                return None
            count, etag = _count_txn(txn, user_id, wanted)
            return BackupVersion(wanted, str(row[0]), str(row[1]), etag, count)

        return await self._db.run_interaction("get_room_keys_version", txn_fn)

    async def update_version(self, user_id: str, version: int, auth_data: str) -> bool:
        def txn_fn(txn: Transaction) -> bool:
            txn.execute(
                "UPDATE e2e_room_keys_versions SET auth_data = %s WHERE user_id = %s AND version = %s AND NOT deleted",
                (auth_data, user_id, version),
            )
            return txn.rowcount > 0

        return await self._db.run_interaction("update_room_keys_version", txn_fn)

    async def delete_version(self, user_id: str, version: int) -> bool:
        def txn_fn(txn: Transaction) -> bool:
            _lock_txn(txn, user_id)
            txn.execute(
                "UPDATE e2e_room_keys_versions SET deleted = TRUE WHERE user_id = %s AND version = %s AND NOT deleted",
                (user_id, version),
            )
            if txn.rowcount == 0:
                return False
            txn.execute("DELETE FROM e2e_room_keys WHERE user_id = %s AND version = %s", (user_id, version))
            return True

        return await self._db.run_interaction("delete_room_keys_version", txn_fn)

    async def get_keys(self, user_id: str, version: int, room_id: str | None, session_id: str | None) -> list[RoomKey]:
        where, params = _where(room_id, session_id)

        def txn_fn(txn: Transaction) -> list[RoomKey]:
            txn.execute(
                "SELECT room_id, session_id, first_message_index, forwarded_count, is_verified, session_data "
                f"FROM e2e_room_keys WHERE user_id = %s AND version = %s{where} ORDER BY room_id, session_id",
                (user_id, version, *params),
            )
            return [RoomKey(str(r[0]), str(r[1]), int(r[2]), int(r[3]), bool(r[4]), str(r[5])) for r in txn.fetchall()]

        return await self._db.run_interaction("get_room_keys", txn_fn)

    async def put_keys(
        self, user_id: str, version: int, keys: Collection[RoomKey], should_replace: Callable[[RoomKey, RoomKey], bool]
    ) -> KeysWritten | None:
        """Store each key unless ``should_replace(stored, new)`` says to keep the stored one.
        None: ``version`` does not exist (or was deleted)."""

        def txn_fn(txn: Transaction) -> KeysWritten | None:
            _lock_txn(txn, user_id)
            current = _current_txn(txn, user_id)
            if current is None:
                return None
            if current != version:
                txn.execute(
                    "SELECT 1 FROM e2e_room_keys_versions WHERE user_id = %s AND version = %s AND NOT deleted",
                    (user_id, version),
                )
                return None if txn.fetchone() is None else KeysWritten(0, 0, current)
            changed = False
            for key in keys:
                txn.execute(
                    "SELECT room_id, session_id, first_message_index, forwarded_count, is_verified, session_data "
                    "FROM e2e_room_keys WHERE user_id = %s AND version = %s AND room_id = %s AND session_id = %s",
                    (user_id, version, key.room_id, key.session_id),
                )
                r = txn.fetchone()
                stored = None if r is None else RoomKey(str(r[0]), str(r[1]), int(r[2]), int(r[3]), bool(r[4]), str(r[5]))
                if stored is not None and not should_replace(stored, key):
                    continue
                txn.execute(
                    "INSERT INTO e2e_room_keys (user_id, version, room_id, session_id, first_message_index, "
                    "forwarded_count, is_verified, session_data) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) "
                    "ON CONFLICT (user_id, version, room_id, session_id) DO UPDATE SET "
                    "first_message_index = EXCLUDED.first_message_index, forwarded_count = EXCLUDED.forwarded_count, "
                    "is_verified = EXCLUDED.is_verified, session_data = EXCLUDED.session_data",
                    (user_id, version, key.room_id, key.session_id, key.first_message_index, key.forwarded_count,
                     key.is_verified, key.session_data),
                )
                changed = True
            return _written_txn(txn, user_id, version, changed)

        return await self._db.run_interaction("put_room_keys", txn_fn)

    async def delete_keys(self, user_id: str, version: int, room_id: str | None,
                          session_id: str | None) -> KeysWritten | None:
        where, params = _where(room_id, session_id)

        def txn_fn(txn: Transaction) -> KeysWritten | None:
            _lock_txn(txn, user_id)
            txn.execute(
                "SELECT 1 FROM e2e_room_keys_versions WHERE user_id = %s AND version = %s AND NOT deleted",
                (user_id, version),
            )
            if txn.fetchone() is None:
                return None
            txn.execute(f"DELETE FROM e2e_room_keys WHERE user_id = %s AND version = %s{where}",
                        (user_id, version, *params))
            return _written_txn(txn, user_id, version, txn.rowcount > 0)

        return await self._db.run_interaction("delete_room_keys", txn_fn)
