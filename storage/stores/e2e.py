"""To-device inboxes, end-to-end keys and device lists, of local devices and cached remote ones.

Writes to ``device_inbox`` go through ``insert_device_inbox_txn`` (the
to_device stream's table); this store adds the reads and deletes ``/sync``
needs, send idempotency, and the key tables of schemas 0005 and 0014: device
keys (local devices' and remote devices' alike), one-time and fallback keys of
local devices, and the cache of remote users' device lists (``remote_device_lists``
with the stream ID of the last update applied, ``remote_devices`` with names).

The device-list stream (``device_lists_stream``) names every user whose devices
changed, local or remote. A local user's rows chain: ``record_device_change``
returns the user's previous stream ID, which federation sends as ``prev_id``;
one user's changes are serialised by a transaction-scoped advisory lock so the
chain has no forks.
"""

# tests: tests/integration/test_client_e2e.py

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Final

import attrs

from storage.database import Database, Transaction, json_rows, one_statement, prepared
from storage.stores.streams import insert_device_inbox_txn, insert_device_list_changes_txn
from storage.stores.timeline import RoomPosition

# Every /sync runs it (key_counts): a device's one-time key counts by algorithm and its unused
# fallback key types, in one round trip.
_KEY_COUNTS: Final = one_statement(
    json_rows("algorithm, n", "FROM (SELECT algorithm, COUNT(*) AS n FROM e2e_one_time_keys "
                              "WHERE user_id = %s AND device_id = %s GROUP BY algorithm) AS counts"),
    json_rows("algorithm", "FROM e2e_fallback_keys WHERE user_id = %s AND device_id = %s AND NOT used", "algorithm"))
# The rooms a user is or was in (a subquery of /sync's device-list changes' read).
_ROOMS_OF_MEMBER: Final = "SELECT room_id FROM current_state_events WHERE type = 'm.room.member' AND state_key = %s"


@attrs.frozen
class DeviceKeysRow:
    """A device's uploaded keys (JSON) and its display name, local or cached remote."""

    device_id: str
    key_json: str
    display_name: str | None


@attrs.frozen
class RemoteDevice:
    """One device of a remote user's list, as its server gave it (``/user/devices``)."""

    device_id: str
    display_name: str | None
    key_json: str | None


@attrs.frozen
class RemoteListState:
    """How far this server's copy of a remote user's device list goes."""

    stream_id: int
    stale: bool


@attrs.frozen
class MembershipDeviceChanges:
    """Users who began (``changed``) or stopped (``left``) sharing a room with the syncing user."""

    changed: frozenset[str]
    left: frozenset[str]


def _lock_user_txn(txn: Transaction, user_id: str) -> None:
    txn.execute("SELECT pg_advisory_xact_lock(hashtextextended('device_lists:' || %s, 0))", (user_id,))


def record_device_change_txn(
    txn: Transaction, stream_id: int, instance_name: str, user_id: str, device_ids: Sequence[str], deleted: bool
) -> int | None:
    """Write one device-list fact for ``user_id``; return the user's previous stream ID (None: first)."""
    _lock_user_txn(txn, user_id)
    txn.execute(
        "SELECT MAX(stream_id) FROM device_lists_stream WHERE user_id = %s AND stream_id < %s", (user_id, stream_id)
    )
    row = txn.fetchone()
    prev = None if row is None or row[0] is None else int(row[0])
    txn.execute_values(
        "INSERT INTO device_lists_stream (stream_id, instance_name, user_id, device_id, deleted) VALUES %s",
        [(stream_id, instance_name, user_id, device_id, deleted) for device_id in device_ids],
    )
    return prev


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
        messages, _ = await self.get_to_device_page(user_id, device_id, after, upto, limit=None)
        return messages

    async def get_to_device_page(
        self, user_id: str, device_id: str, after: int, upto: int, *, limit: int | None
    ) -> tuple[list[str], int]:
        """As ``get_to_device``, at most ``limit`` messages (None: all); and the position they
        reach: ``upto``, or the last message's when the limit cut the rest off."""

        def txn_fn(txn: Transaction) -> tuple[list[str], int]:
            txn.execute(
                "DELETE FROM device_inbox WHERE user_id = %s AND device_id = %s AND stream_id <= %s",
                (user_id, device_id, after),
            )
            txn.execute(
                "SELECT message_json, stream_id FROM device_inbox WHERE user_id = %s AND device_id = %s "
                "AND stream_id > %s AND stream_id <= %s ORDER BY stream_id LIMIT %s",
                (user_id, device_id, after, upto, limit),
            )
            rows = txn.fetchall()
            reached = int(rows[-1][1]) if limit is not None and len(rows) >= limit and rows else upto
            return [str(r[0]) for r in rows], reached

        return await self._db.run_interaction("get_to_device", txn_fn)

    # --- keys -------------------------------------------------------------------------------

    async def set_device_keys(self, user_id: str, device_id: str, key_json: str) -> bool:
        """Store a local device's keys; False when exactly these keys were stored already."""

        def txn_fn(txn: Transaction) -> bool:
            txn.execute(
                "SELECT key_json FROM e2e_device_keys WHERE user_id = %s AND device_id = %s", (user_id, device_id)
            )
            row = txn.fetchone()
            if row is not None and str(row[0]) == key_json:
                return False
            _set_keys_txn(txn, user_id, device_id, key_json)
            return True

        return await self._db.run_interaction("set_device_keys", txn_fn)

    async def get_device_key_json(self, user_id: str, device_id: str) -> str | None:
        def txn_fn(txn: Transaction) -> str | None:
            txn.execute(
                "SELECT key_json FROM e2e_device_keys WHERE user_id = %s AND device_id = %s", (user_id, device_id)
            )
            row = txn.fetchone()
            return None if row is None else str(row[0])

        return await self._db.run_interaction("get_device_key_json", txn_fn)

    async def delete_devices_keys(self, user_id: str, device_ids: Sequence[str]) -> None:
        """What deleted local devices leave: device, one-time and fallback keys, and their inboxes."""

        def txn_fn(txn: Transaction) -> None:
            for table in ("e2e_device_keys", "e2e_one_time_keys", "e2e_fallback_keys", "device_inbox"):
                txn.execute(f"DELETE FROM {table} WHERE user_id = %s AND device_id = ANY(%s)", (user_id, list(device_ids)))

        await self._db.run_interaction("delete_devices_keys", txn_fn)

    async def record_device_change(
        self, stream_id: int, instance_name: str, user_id: str, device_ids: Sequence[str], *, deleted: bool = False
    ) -> int | None:
        """A local user's devices changed: the stream row, and the user's previous stream ID."""
        return await self._db.run_interaction(
            "record_device_change", record_device_change_txn, stream_id, instance_name, user_id,
            list(device_ids), deleted,
        )

    async def latest_device_list_id(self, user_id: str) -> int:
        """The stream ID of ``user_id``'s newest device-list change (0: none yet)."""

        def txn_fn(txn: Transaction) -> int:
            txn.execute("SELECT MAX(stream_id) FROM device_lists_stream WHERE user_id = %s", (user_id,))
            row = txn.fetchone()
            return 0 if row is None or row[0] is None else int(row[0])

        return await self._db.run_interaction("latest_device_list_id", txn_fn)

    async def get_device_list_changes(self, user_id: str, after: int, upto: int) -> list[str]:
        """Users whose devices changed in (after, upto]: ``user_id`` itself and those joined to a
        room it is joined to."""

        def txn_fn(txn: Transaction) -> list[str]:
            txn.execute(
                """
                SELECT DISTINCT d.user_id FROM device_lists_stream d
                WHERE d.stream_id > %s AND d.stream_id <= %s AND (d.user_id = %s OR EXISTS (
                    SELECT 1 FROM current_state_events mine
                    JOIN current_state_events theirs ON theirs.room_id = mine.room_id
                    WHERE mine.type = 'm.room.member' AND mine.state_key = %s AND mine.membership = 'join'
                      AND theirs.type = 'm.room.member' AND theirs.state_key = d.user_id
                      AND theirs.membership = 'join'
                ))
                ORDER BY d.user_id
                """,
                (after, upto, user_id, user_id),
            )
            return [str(r[0]) for r in txn.fetchall()]

        return await self._db.run_interaction("get_device_list_changes", txn_fn)

    async def get_membership_device_changes(
        self, user_id: str, since: RoomPosition, upto: RoomPosition
    ) -> MembershipDeviceChanges:
        """Whose devices ``user_id`` must (re)learn or may forget after the membership changes in
        (since, upto] of the rooms it is or was in: the users of those changes (every member of a
        room the user itself joined or left) split by whether they now share a joined room with it."""

        def txn_fn(txn: Transaction) -> MembershipDeviceChanges:
            lower, lower_params = since.sql_after("e.")
            upper, upper_params = upto.sql_upto("e.")
            # The membership events in range of the rooms the user is or was in: one round trip.
            txn.execute(
                prepared("SELECT e.room_id, e.state_key FROM events e WHERE e.type = 'm.room.member' "
                         f"AND e.room_id IN ({_ROOMS_OF_MEMBER}) AND {lower} AND {upper}"),
                (user_id, *lower_params, *upper_params),
            )
            rows = [(str(r[0]), str(r[1])) for r in txn.fetchall()]
            if not rows:
                return MembershipDeviceChanges(frozenset(), frozenset())
            candidates = {member for _, member in rows if member != user_id}
            mine = sorted({room for room, member in rows if member == user_id})
            if mine:
                txn.execute(
                    "SELECT state_key FROM current_state_events WHERE type = 'm.room.member' "
                    "AND room_id = ANY(%s) AND state_key <> %s",
                    (mine, user_id),
                )
                candidates.update(str(r[0]) for r in txn.fetchall())
            if not candidates:
                return MembershipDeviceChanges(frozenset(), frozenset())
            txn.execute(
                """
                SELECT DISTINCT theirs.state_key FROM current_state_events mine
                JOIN current_state_events theirs ON theirs.room_id = mine.room_id
                WHERE mine.type = 'm.room.member' AND mine.state_key = %s AND mine.membership = 'join'
                  AND theirs.type = 'm.room.member' AND theirs.state_key = ANY(%s) AND theirs.membership = 'join'
                """,
                (user_id, sorted(candidates)),
            )
            sharing = frozenset(str(r[0]) for r in txn.fetchall())
            return MembershipDeviceChanges(sharing, frozenset(candidates - sharing))

        return await self._db.run_reads("get_membership_device_changes", txn_fn)

    # --- remote users' device lists ------------------------------------------------------------

    async def get_remote_list_state(self, user_ids: Collection[str]) -> dict[str, RemoteListState]:
        """The cached remote users among ``user_ids``."""
        if not user_ids:
            return {}

        def txn_fn(txn: Transaction) -> dict[str, RemoteListState]:
            txn.execute(
                "SELECT user_id, stream_id, stale FROM remote_device_lists WHERE user_id = ANY(%s)", (list(user_ids),)
            )
            return {str(r[0]): RemoteListState(int(r[1]), bool(r[2])) for r in txn.fetchall()}

        return await self._db.run_interaction("get_remote_list_state", txn_fn)

    async def apply_remote_device_update(
        self, stream_id: int, instance_name: str, user_id: str, remote_stream_id: int, device_id: str, *,
        deleted: bool, key_json: str | None, display_name: str | None,
    ) -> None:
        """One ``m.device_list_update`` that follows on what the cache holds: apply it, move the
        cache to ``remote_stream_id`` and write the local stream row."""

        def txn_fn(txn: Transaction) -> None:
            _lock_user_txn(txn, user_id)
            if deleted:
                txn.execute("DELETE FROM e2e_device_keys WHERE user_id = %s AND device_id = %s", (user_id, device_id))
                txn.execute("DELETE FROM remote_devices WHERE user_id = %s AND device_id = %s", (user_id, device_id))
            else:
                txn.execute(
                    "INSERT INTO remote_devices (user_id, device_id, display_name) VALUES (%s, %s, %s) "
                    "ON CONFLICT (user_id, device_id) DO UPDATE SET display_name = EXCLUDED.display_name",
                    (user_id, device_id, display_name),
                )
                if key_json is not None:
                    _set_keys_txn(txn, user_id, device_id, key_json)
            txn.execute(
                "INSERT INTO remote_device_lists (user_id, stream_id, stale) VALUES (%s, %s, FALSE) "
                "ON CONFLICT (user_id) DO UPDATE SET stream_id = EXCLUDED.stream_id, stale = FALSE",
                (user_id, remote_stream_id),
            )
            insert_device_list_changes_txn(txn, stream_id, instance_name, [(user_id, device_id)])

        await self._db.run_interaction("apply_remote_device_update", txn_fn)

    async def replace_remote_device_list(
        self, stream_id: int, instance_name: str, user_id: str, remote_stream_id: int,
        devices: Sequence[RemoteDevice],
    ) -> None:
        """A resync: ``devices`` is the whole list at ``remote_stream_id``; the local stream names the user."""

        def txn_fn(txn: Transaction) -> None:
            _lock_user_txn(txn, user_id)
            txn.execute("DELETE FROM e2e_device_keys WHERE user_id = %s", (user_id,))
            txn.execute("DELETE FROM remote_devices WHERE user_id = %s", (user_id,))
            if devices:
                txn.execute_values(
                    "INSERT INTO remote_devices (user_id, device_id, display_name) VALUES %s ON CONFLICT DO NOTHING",
                    [(user_id, d.device_id, d.display_name) for d in devices],
                )
                for device in devices:
                    if device.key_json is not None:
                        _set_keys_txn(txn, user_id, device.device_id, device.key_json)
            txn.execute(
                "INSERT INTO remote_device_lists (user_id, stream_id, stale) VALUES (%s, %s, FALSE) "
                "ON CONFLICT (user_id) DO UPDATE SET stream_id = EXCLUDED.stream_id, stale = FALSE",
                (user_id, remote_stream_id),
            )
            insert_device_list_changes_txn(
                txn, stream_id, instance_name, [(user_id, d.device_id) for d in devices] or [(user_id, "")]
            )

        await self._db.run_interaction("replace_remote_device_list", txn_fn)

    async def mark_remote_stale(self, user_id: str) -> None:
        """An update was missed and the resync failed: ``/keys/query`` asks the user's server."""

        def txn_fn(txn: Transaction) -> None:
            txn.execute("UPDATE remote_device_lists SET stale = TRUE WHERE user_id = %s", (user_id,))

        await self._db.run_interaction("mark_remote_stale", txn_fn)

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

    async def get_device_keys(self, query: Mapping[str, Collection[str]]) -> dict[str, dict[str, DeviceKeysRow]]:
        """user -> device -> keys and name, for the devices named (all of the user's when none are)."""

        def txn_fn(txn: Transaction) -> dict[str, dict[str, DeviceKeysRow]]:
            out: dict[str, dict[str, DeviceKeysRow]] = {}
            select = (
                "SELECT k.device_id, k.key_json, COALESCE(d.display_name, r.display_name) FROM e2e_device_keys k "
                "LEFT JOIN devices d ON d.user_id = k.user_id AND d.device_id = k.device_id "
                "LEFT JOIN remote_devices r ON r.user_id = k.user_id AND r.device_id = k.device_id "
                "WHERE k.user_id = %s"
            )
            for user_id, device_ids in query.items():
                if device_ids:
                    txn.execute(select + " AND k.device_id = ANY(%s)", (user_id, list(device_ids)))
                else:
                    txn.execute(select, (user_id,))
                out[user_id] = {
                    str(r[0]): DeviceKeysRow(str(r[0]), str(r[1]), None if r[2] is None else str(r[2]))
                    for r in txn.fetchall()
                }
            return out

        return await self._db.run_interaction("get_device_keys", txn_fn)

    async def set_fallback_keys(self, user_id: str, device_id: str, keys: Collection[tuple[str, str, str]]) -> None:
        """``(algorithm, key_id, key_json)``: each replaces the device's fallback key of its algorithm
        (unused again), unless it is the very key stored already."""

        def txn_fn(txn: Transaction) -> None:
            for algorithm, key_id, key_json in keys:
                txn.execute(
                    "INSERT INTO e2e_fallback_keys (user_id, device_id, algorithm, key_id, key_json, used) "
                    "VALUES (%s, %s, %s, %s, %s, FALSE) ON CONFLICT (user_id, device_id, algorithm) DO UPDATE SET "
                    "key_id = EXCLUDED.key_id, key_json = EXCLUDED.key_json, used = FALSE "
                    "WHERE e2e_fallback_keys.key_id <> EXCLUDED.key_id OR e2e_fallback_keys.key_json <> EXCLUDED.key_json",
                    (user_id, device_id, algorithm, key_id, key_json),
                )

        await self._db.run_interaction("set_fallback_keys", txn_fn)

    async def key_counts(self, user_id: str, device_id: str) -> tuple[dict[str, int], list[str]]:
        """``/sync``'s one-time key counts and unused fallback key types, in one statement."""

        def txn_fn(txn: Transaction) -> tuple[dict[str, int], list[str]]:
            txn.execute(_KEY_COUNTS, (user_id, device_id, user_id, device_id))
            row = txn.fetchone()
            assert row is not None
            return {str(r[0]): int(r[1]) for r in row[0] or ()}, [str(r[0]) for r in row[1] or ()]

        return await self._db.run_reads("get_key_counts", txn_fn)

    async def unused_fallback_key_types(self, user_id: str, device_id: str) -> list[str]:
        def txn_fn(txn: Transaction) -> list[str]:
            txn.execute(
                "SELECT algorithm FROM e2e_fallback_keys WHERE user_id = %s AND device_id = %s AND NOT used "
                "ORDER BY algorithm",
                (user_id, device_id),
            )
            return [str(r[0]) for r in txn.fetchall()]

        return await self._db.run_interaction("unused_fallback_key_types", txn_fn)

    async def claim_one_time_keys(
        self, query: Collection[tuple[str, str, str]]
    ) -> list[tuple[str, str, str, str, str]]:
        """For each (user, device, algorithm), remove and return one one-time key (each is handed
        out once, however many claims run at once), else the device's fallback key (marked used,
        kept): (user, device, alg, key_id, json)."""

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
                if row is None:
                    txn.execute(
                        "UPDATE e2e_fallback_keys SET used = TRUE WHERE user_id = %s AND device_id = %s "
                        "AND algorithm = %s RETURNING key_id, key_json",
                        (user_id, device_id, algorithm),
                    )
                    row = txn.fetchone()
                if row is not None:
                    out.append((user_id, device_id, algorithm, str(row[0]), str(row[1])))
            return out

        return await self._db.run_interaction("claim_one_time_keys", txn_fn)


def _set_keys_txn(txn: Transaction, user_id: str, device_id: str, key_json: str) -> None:
    txn.execute(
        "INSERT INTO e2e_device_keys (user_id, device_id, key_json) VALUES (%s, %s, %s) "
        "ON CONFLICT (user_id, device_id) DO UPDATE SET key_json = EXCLUDED.key_json",
        (user_id, device_id, key_json),
    )


@attrs.frozen
class SignatureRow:
    signer_user_id: str
    signing_key_id: str
    target_user_id: str
    target_key_id: str
    signature: str


class CrossSigningStore:
    """Cross-signing keys (``e2e_cross_signing_keys``) and uploaded signatures
    (``e2e_cross_signing_signatures``), of schema 0014."""

    def __init__(self, db: Database) -> None:
        self._db = db

    async def get_keys(self, user_ids: Collection[str]) -> dict[str, dict[str, str]]:
        """user -> key type -> key JSON."""
        if not user_ids:
            return {}

        def txn_fn(txn: Transaction) -> dict[str, dict[str, str]]:
            txn.execute(
                "SELECT user_id, key_type, key_json FROM e2e_cross_signing_keys WHERE user_id = ANY(%s)",
                (list(user_ids),),
            )
            out: dict[str, dict[str, str]] = {}
            for user_id, key_type, key_json in txn.fetchall():
                out.setdefault(str(user_id), {})[str(key_type)] = str(key_json)
            return out

        return await self._db.run_interaction("get_cross_signing_keys", txn_fn)

    async def set_keys(self, user_id: str, keys: Mapping[str, str]) -> None:
        """Key type -> key JSON; the other types are left as they are."""

        def txn_fn(txn: Transaction) -> None:
            for key_type, key_json in keys.items():
                txn.execute(
                    "INSERT INTO e2e_cross_signing_keys (user_id, key_type, key_json) VALUES (%s, %s, %s) "
                    "ON CONFLICT (user_id, key_type) DO UPDATE SET key_json = EXCLUDED.key_json",
                    (user_id, key_type, key_json),
                )

        await self._db.run_interaction("set_cross_signing_keys", txn_fn)

    async def add_signatures(self, rows: Collection[SignatureRow]) -> None:
        if not rows:
            return

        def txn_fn(txn: Transaction) -> None:
            txn.execute_values(
                "INSERT INTO e2e_cross_signing_signatures (signer_user_id, signing_key_id, target_user_id, "
                "target_key_id, signature) VALUES %s ON CONFLICT (signer_user_id, signing_key_id, target_user_id, "
                "target_key_id) DO UPDATE SET signature = EXCLUDED.signature",
                [(r.signer_user_id, r.signing_key_id, r.target_user_id, r.target_key_id, r.signature) for r in rows],
            )

        await self._db.run_interaction("add_cross_signing_signatures", txn_fn)

    async def get_signatures(self, target_user_ids: Collection[str]) -> list[SignatureRow]:
        if not target_user_ids:
            return []

        def txn_fn(txn: Transaction) -> list[SignatureRow]:
            txn.execute(
                "SELECT signer_user_id, signing_key_id, target_user_id, target_key_id, signature "
                "FROM e2e_cross_signing_signatures WHERE target_user_id = ANY(%s)",
                (list(target_user_ids),),
            )
            return [SignatureRow(*(str(v) for v in r)) for r in txn.fetchall()]

        return await self._db.run_interaction("get_cross_signing_signatures", txn_fn)
