"""Devices: a user's logged-in sessions, each holding one access token.

This store owns the ``devices`` table. Deleting a device deletes its access
tokens in the same transaction and hands back their hashes, so the caller can
drop them from any token cache once the transaction has committed. It knows
nothing of end-to-end keys or to-device messages; their stores clean up after
a device through the device handler's hooks.
"""

# tests: tests/integration/test_accounts_store.py

from __future__ import annotations

from collections.abc import Sequence

import attrs

from storage.database import Database, Transaction


@attrs.frozen
class DeviceRow:
    user_id: str
    device_id: str
    display_name: str | None
    created_ts: int
    last_seen_ts: int | None
    last_seen_ip: str | None


_COLUMNS = "user_id, device_id, display_name, created_ts, last_seen_ts, last_seen_ip"


def upsert_device_txn(
    txn: Transaction, user_id: str, device_id: str, display_name: str | None, now_ms: int, ip: str | None
) -> bool:
    """Create the device unless it exists (keeping its name); True when created."""
    txn.execute(
        "INSERT INTO devices (user_id, device_id, display_name, created_ts, last_seen_ts, last_seen_ip) "
        "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (user_id, device_id) DO NOTHING RETURNING device_id",
        (user_id, device_id, display_name, now_ms, now_ms, ip),
    )
    return txn.fetchone() is not None


def delete_devices_txn(txn: Transaction, user_id: str, device_ids: Sequence[str]) -> list[bytes]:
    """Delete the devices and their access tokens; return the deleted tokens' hashes."""
    if not device_ids:
        return []
    ids = list(device_ids)
    txn.execute(
        "DELETE FROM access_tokens WHERE user_id = %s AND device_id = ANY(%s) RETURNING token_sha256",
        (user_id, ids),
    )
    hashes = [bytes(row[0]) for row in txn.fetchall()]
    txn.execute("DELETE FROM devices WHERE user_id = %s AND device_id = ANY(%s)", (user_id, ids))
    return hashes


@attrs.frozen
class DeletedDevices:
    device_ids: tuple[str, ...]
    token_hashes: tuple[bytes, ...]


def _delete_devices_txn(txn: Transaction, user_id: str, device_ids: Sequence[str]) -> DeletedDevices:
    txn.execute(
        "SELECT device_id FROM devices WHERE user_id = %s AND device_id = ANY(%s)", (user_id, list(device_ids))
    )
    existing = tuple(sorted(row[0] for row in txn.fetchall()))
    return DeletedDevices(existing, tuple(delete_devices_txn(txn, user_id, existing)))


def _delete_all_devices_txn(txn: Transaction, user_id: str) -> DeletedDevices:
    txn.execute("SELECT device_id FROM devices WHERE user_id = %s", (user_id,))
    existing = tuple(sorted(row[0] for row in txn.fetchall()))
    return DeletedDevices(existing, tuple(delete_devices_txn(txn, user_id, existing)))


def _get_devices_txn(txn: Transaction, user_id: str) -> list[DeviceRow]:
    txn.execute(f"SELECT {_COLUMNS} FROM devices WHERE user_id = %s ORDER BY device_id", (user_id,))
    return [DeviceRow(*row) for row in txn.fetchall()]


def _get_device_txn(txn: Transaction, user_id: str, device_id: str) -> DeviceRow | None:
    txn.execute(f"SELECT {_COLUMNS} FROM devices WHERE user_id = %s AND device_id = %s", (user_id, device_id))
    row = txn.fetchone()
    return None if row is None else DeviceRow(*row)


def _set_display_name_txn(txn: Transaction, user_id: str, device_id: str, display_name: str | None) -> bool:
    txn.execute(
        "UPDATE devices SET display_name = %s WHERE user_id = %s AND device_id = %s",
        (display_name, user_id, device_id),
    )
    return txn.rowcount > 0


def _update_last_seen_txn(txn: Transaction, user_id: str, device_id: str, now_ms: int, ip: str | None) -> None:
    txn.execute(
        "UPDATE devices SET last_seen_ts = %s, last_seen_ip = %s WHERE user_id = %s AND device_id = %s",
        (now_ms, ip, user_id, device_id),
    )


class DeviceStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def get_devices(self, user_id: str) -> list[DeviceRow]:
        return await self._db.run_interaction("get_devices", _get_devices_txn, user_id)

    async def get_device(self, user_id: str, device_id: str) -> DeviceRow | None:
        return await self._db.run_interaction("get_device", _get_device_txn, user_id, device_id)

    async def set_display_name(self, user_id: str, device_id: str, display_name: str | None) -> bool:
        """Rename the device; False when it does not exist."""
        return await self._db.run_interaction(
            "set_device_display_name", _set_display_name_txn, user_id, device_id, display_name
        )

    async def delete_devices(self, user_id: str, device_ids: Sequence[str]) -> DeletedDevices:
        """Delete those of ``device_ids`` that exist, with their tokens."""
        return await self._db.run_interaction("delete_devices", _delete_devices_txn, user_id, device_ids)

    async def delete_all_devices(self, user_id: str) -> DeletedDevices:
        return await self._db.run_interaction("delete_all_devices", _delete_all_devices_txn, user_id)

    async def update_last_seen(self, user_id: str, device_id: str, now_ms: int, ip: str | None) -> None:
        await self._db.run_interaction("update_device_last_seen", _update_last_seen_txn, user_id, device_id, now_ms, ip)
