"""To-device inboxes and end-to-end keys: device keys and one-time keys of local devices.

Writes to ``device_inbox`` go through ``insert_device_inbox_txn`` (the
to_device stream's table); this store adds the reads and deletes ``/sync``
needs, send idempotency, and the key tables of schema 0005.
"""

# tests: tests/integration/test_client_e2e.py

from __future__ import annotations

from collections.abc import Collection, Mapping

from storage.database import Database, Transaction
from storage.stores.streams import insert_device_inbox_txn, insert_device_list_changes_txn


class E2eStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    # --- to-device --------------------------------------------------------------------------

    async def claim_to_device_txn(self, user_id: str, device_id: str, txn_id: str) -> bool:
        """True the first time (user, device, txn_id) is seen."""

        def txn_fn(txn: Transaction) -> bool:
            txn.execute(
                "INSERT INTO to_device_txn_ids (user_id, device_id, txn_id) VALUES (%s, %s, %s) "
                "ON CONFLICT DO NOTHING RETURNING txn_id",
                (user_id, device_id, txn_id),
            )
            return txn.fetchone() is not None

        return await self._db.run_interaction("claim_to_device_txn", txn_fn)

    async def add_to_device(
        self, stream_id: int, instance_name: str, messages: Collection[tuple[str, str, str]]
    ) -> None:
        await self._db.run_interaction(
            "add_to_device", insert_device_inbox_txn, stream_id, instance_name, list(messages)
        )

    async def get_to_device(self, user_id: str, device_id: str, after: int, upto: int) -> list[str]:
        """Message JSON for the device with ``after < stream_id <= upto``, deleting those ``<= after``."""

        def txn_fn(txn: Transaction) -> list[str]:
            txn.execute(
                "DELETE FROM device_inbox WHERE user_id = %s AND device_id = %s AND stream_id <= %s",
                (user_id, device_id, after),
            )
            txn.execute(
                "SELECT message_json FROM device_inbox WHERE user_id = %s AND device_id = %s "
                "AND stream_id > %s AND stream_id <= %s ORDER BY stream_id",
                (user_id, device_id, after, upto),
            )
            return [str(r[0]) for r in txn.fetchall()]

        return await self._db.run_interaction("get_to_device", txn_fn)

    # --- keys -------------------------------------------------------------------------------

    async def set_device_keys(self, user_id: str, device_id: str, key_json: str) -> None:
        def txn_fn(txn: Transaction) -> None:
            txn.execute(
                "INSERT INTO e2e_device_keys (user_id, device_id, key_json) VALUES (%s, %s, %s) "
                "ON CONFLICT (user_id, device_id) DO UPDATE SET key_json = EXCLUDED.key_json",
                (user_id, device_id, key_json),
            )

        await self._db.run_interaction("set_device_keys", txn_fn)

    async def delete_device_keys(self, user_id: str, device_id: str) -> None:
        def txn_fn(txn: Transaction) -> None:
            txn.execute("DELETE FROM e2e_device_keys WHERE user_id = %s AND device_id = %s", (user_id, device_id))

        await self._db.run_interaction("delete_device_keys", txn_fn)

    async def add_device_list_change(self, stream_id: int, instance_name: str, user_id: str, device_id: str) -> None:
        await self._db.run_interaction(
            "add_device_list_change", insert_device_list_changes_txn, stream_id, instance_name, [(user_id, device_id)]
        )

    async def get_device_list_changes(self, user_id: str, after: int, upto: int) -> list[str]:
        """Users (other than ``user_id``) joined to a room with it whose devices changed in (after, upto]."""

        def txn_fn(txn: Transaction) -> list[str]:
            txn.execute(
                """
                SELECT DISTINCT d.user_id FROM device_lists_stream d
                WHERE d.stream_id > %s AND d.stream_id <= %s AND d.user_id <> %s AND EXISTS (
                    SELECT 1 FROM current_state_events mine
                    JOIN current_state_events theirs ON theirs.room_id = mine.room_id
                    WHERE mine.type = 'm.room.member' AND mine.state_key = %s AND mine.membership = 'join'
                      AND theirs.type = 'm.room.member' AND theirs.state_key = d.user_id
                      AND theirs.membership = 'join'
                )
                ORDER BY d.user_id
                """,
                (after, upto, user_id, user_id),
            )
            return [str(r[0]) for r in txn.fetchall()]

        return await self._db.run_interaction("get_device_list_changes", txn_fn)

    async def add_one_time_keys(
        self, user_id: str, device_id: str, keys: Collection[tuple[str, str, str]]
    ) -> None:
        """``(algorithm, key_id, key_json)`` rows; a key ID already stored is left as it is."""
        if not keys:
            return

        def txn_fn(txn: Transaction) -> None:
            txn.execute_values(
                "INSERT INTO e2e_one_time_keys (user_id, device_id, algorithm, key_id, key_json) VALUES %s "
                "ON CONFLICT DO NOTHING",
                [(user_id, device_id, alg, key_id, key_json) for alg, key_id, key_json in keys],
            )

        await self._db.run_interaction("add_one_time_keys", txn_fn)

    async def count_one_time_keys(self, user_id: str, device_id: str) -> dict[str, int]:
        def txn_fn(txn: Transaction) -> dict[str, int]:
            txn.execute(
                "SELECT algorithm, COUNT(*) FROM e2e_one_time_keys WHERE user_id = %s AND device_id = %s "
                "GROUP BY algorithm",
                (user_id, device_id),
            )
            return {str(r[0]): int(r[1]) for r in txn.fetchall()}

        return await self._db.run_interaction("count_one_time_keys", txn_fn)

    async def get_device_keys(self, query: Mapping[str, Collection[str]]) -> dict[str, dict[str, str]]:
        """user -> device -> key JSON, for the devices named (all of the user's when none are)."""

        def txn_fn(txn: Transaction) -> dict[str, dict[str, str]]:
            out: dict[str, dict[str, str]] = {}
            for user_id, device_ids in query.items():
                if device_ids:
                    txn.execute(
                        "SELECT device_id, key_json FROM e2e_device_keys WHERE user_id = %s AND device_id = ANY(%s)",
                        (user_id, list(device_ids)),
                    )
                else:
                    txn.execute("SELECT device_id, key_json FROM e2e_device_keys WHERE user_id = %s", (user_id,))
                out[user_id] = {str(r[0]): str(r[1]) for r in txn.fetchall()}
            return out

        return await self._db.run_interaction("get_device_keys", txn_fn)

    async def claim_one_time_keys(
        self, query: Collection[tuple[str, str, str]]
    ) -> list[tuple[str, str, str, str, str]]:
        """For each (user, device, algorithm), remove and return one key: (user, device, alg, key_id, json)."""

        def txn_fn(txn: Transaction) -> list[tuple[str, str, str, str, str]]:
            out = []
            for user_id, device_id, algorithm in query:
                txn.execute(
                    "DELETE FROM e2e_one_time_keys WHERE ctid IN (SELECT ctid FROM e2e_one_time_keys "
                    "WHERE user_id = %s AND device_id = %s AND algorithm = %s ORDER BY key_id LIMIT 1 "
                    "FOR UPDATE SKIP LOCKED) RETURNING key_id, key_json",
                    (user_id, device_id, algorithm),
                )
                row = txn.fetchone()
                if row is not None:
                    out.append((user_id, device_id, algorithm, str(row[0]), str(row[1])))
            return out

        return await self._db.run_interaction("claim_one_time_keys", txn_fn)
