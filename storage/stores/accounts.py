"""Users and access tokens: creating accounts, logging in, looking tokens up.

This store owns the ``users`` and ``access_tokens`` tables. Registration and
login write a user, its profile, a device and a token in one transaction, so a
half-made account never exists. Tokens arrive here already hashed: this layer
never sees a usable access token, and knows nothing of bcrypt or HTTP.
"""

# tests: tests/integration/test_accounts_store.py, tests/integration/test_client_erasure.py

from __future__ import annotations

from collections.abc import Collection

import attrs

from storage.database import Database, Transaction
from storage.stores.devices import DeletedDevices, delete_devices_txn, upsert_device_txn


@attrs.frozen
class UserRow:
    user_id: str
    password_hash: str | None
    created_ts: int
    is_guest: bool
    deactivated: bool


@attrs.frozen
class TokenOwner:
    """Who an access token belongs to."""

    token_id: int
    user_id: str
    device_id: str
    is_guest: bool


@attrs.frozen
class NewLogin:
    """A device and token to create with an account or at login."""

    device_id: str
    initial_display_name: str | None
    token_sha256: bytes
    ip: str | None


def get_user_txn(txn: Transaction, user_id: str) -> UserRow | None:
    txn.execute(
        "SELECT user_id, password_hash, created_ts, is_guest, deactivated FROM users WHERE user_id = %s",
        (user_id,),
    )
    row = txn.fetchone()
    return None if row is None else UserRow(row[0], row[1], row[2], row[3], row[4])


def _add_login_txn(txn: Transaction, user_id: str, login: NewLogin, now_ms: int) -> list[bytes]:
    """Create (or reuse) the device and give it ``login``'s token; return hashes of tokens it replaced.

    A device holds one access token at a time: logging in again with a known
    device ID revokes the token that device had.
    """
    created = upsert_device_txn(txn, user_id, login.device_id, login.initial_display_name, now_ms, login.ip)
    replaced: list[bytes] = []
    if not created:
        txn.execute(
            "DELETE FROM access_tokens WHERE user_id = %s AND device_id = %s RETURNING token_sha256",
            (user_id, login.device_id),
        )
        replaced = [bytes(row[0]) for row in txn.fetchall()]
    txn.execute(
        "INSERT INTO access_tokens (token_sha256, user_id, device_id, created_ts) VALUES (%s, %s, %s, %s)",
        (login.token_sha256, user_id, login.device_id, now_ms),
    )
    return replaced


def _register_user_txn(
    txn: Transaction,
    user_id: str,
    password_hash: str | None,
    displayname: str | None,
    login: NewLogin | None,
    now_ms: int,
    is_guest: bool,
) -> bool:
    txn.execute(
        "INSERT INTO users (user_id, password_hash, created_ts, is_guest) VALUES (%s, %s, %s, %s) "
        "ON CONFLICT (user_id) DO NOTHING RETURNING user_id",
        (user_id, password_hash, now_ms, is_guest),
    )
    if txn.fetchone() is None:
        return False
    txn.execute(
        "INSERT INTO profiles (user_id, displayname, avatar_url) VALUES (%s, %s, NULL)",
        (user_id, displayname),
    )
    if login is not None:
        _add_login_txn(txn, user_id, login, now_ms)
    return True


def _upgrade_guest_txn(
    txn: Transaction, user_id: str, password_hash: str, login: NewLogin | None, now_ms: int
) -> list[bytes] | None:
    txn.execute(
        "UPDATE users SET password_hash = %s, is_guest = FALSE WHERE user_id = %s AND is_guest AND NOT deactivated "
        "RETURNING user_id",
        (password_hash, user_id),
    )
    if txn.fetchone() is None:
        return None
    txn.execute("SELECT token_sha256 FROM access_tokens WHERE user_id = %s", (user_id,))
    hashes = [bytes(row[0]) for row in txn.fetchall()]
    if login is not None:
        hashes.extend(_add_login_txn(txn, user_id, login, now_ms))
    return hashes


def _login_txn(txn: Transaction, user_id: str, login: NewLogin, now_ms: int) -> list[bytes]:
    return _add_login_txn(txn, user_id, login, now_ms)


def _get_token_owner_txn(txn: Transaction, token_sha256: bytes) -> TokenOwner | None:
    txn.execute(
        """
        SELECT t.id, t.user_id, t.device_id, u.is_guest
        FROM access_tokens AS t JOIN users AS u USING (user_id)
        WHERE t.token_sha256 = %s AND NOT u.deactivated
        """,
        (token_sha256,),
    )
    row = txn.fetchone()
    return None if row is None else TokenOwner(row[0], row[1], row[2], row[3])


def _set_password_hash_txn(
    txn: Transaction, user_id: str, password_hash: str, keep_device_id: str | None, logout_devices: bool
) -> DeletedDevices:
    txn.execute("UPDATE users SET password_hash = %s WHERE user_id = %s", (password_hash, user_id))
    if not logout_devices:
        return DeletedDevices((), ())
    txn.execute(
        "SELECT device_id FROM devices WHERE user_id = %s AND device_id IS DISTINCT FROM %s ORDER BY device_id",
        (user_id, keep_device_id),
    )
    others = tuple(row[0] for row in txn.fetchall())
    return DeletedDevices(others, tuple(delete_devices_txn(txn, user_id, others)))


def _deactivate_user_txn(txn: Transaction, user_id: str, erased_ts: int | None) -> None:
    txn.execute("UPDATE users SET deactivated = TRUE WHERE user_id = %s", (user_id,))
    # A closed account's devices get no more pushes (schema 0013).
    txn.execute("DELETE FROM pushers WHERE user_id = %s", (user_id,))
    if erased_ts is not None:
        txn.execute(
            "INSERT INTO erased_users (user_id, erased_ts) VALUES (%s, %s) ON CONFLICT (user_id) DO NOTHING",
            (user_id, erased_ts),
        )


class AccountStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def get_user(self, user_id: str) -> UserRow | None:
        return await self._db.run_interaction("get_user", get_user_txn, user_id)

    async def register_user(
        self,
        user_id: str,
        *,
        password_hash: str | None,
        displayname: str | None,
        login: NewLogin | None,
        now_ms: int,
        is_guest: bool = False,
    ) -> bool:
        """Create the user with its profile (and device and token); False when the ID is taken."""
        return await self._db.run_interaction(
            "register_user", _register_user_txn, user_id, password_hash, displayname, login, now_ms, is_guest
        )

    async def upgrade_guest(
        self, user_id: str, *, password_hash: str, login: NewLogin | None, now_ms: int
    ) -> list[bytes] | None:
        """Make guest ``user_id`` a full account with this password (and a new login).

        Returns the hashes of the user's tokens from before, whose cached owner still
        says guest; None when ``user_id`` is not a live guest (already upgraded).
        """
        return await self._db.run_interaction(
            "upgrade_guest", _upgrade_guest_txn, user_id, password_hash, login, now_ms
        )

    async def add_login(self, user_id: str, login: NewLogin, now_ms: int) -> list[bytes]:
        """Give ``user_id`` a new access token on ``login.device_id``; return hashes of revoked tokens."""
        return await self._db.run_interaction("add_login", _login_txn, user_id, login, now_ms)

    async def get_token_owner(self, token_sha256: bytes) -> TokenOwner | None:
        return await self._db.run_interaction("get_token_owner", _get_token_owner_txn, token_sha256)

    async def set_password_hash(
        self, user_id: str, password_hash: str, *, keep_device_id: str | None, logout_devices: bool
    ) -> DeletedDevices:
        """Change the password; with ``logout_devices`` delete every other device (returned)."""
        return await self._db.run_interaction(
            "set_password_hash", _set_password_hash_txn, user_id, password_hash, keep_device_id, logout_devices
        )

    async def deactivate_user(self, user_id: str, *, erased_ts: int | None = None) -> None:
        """Mark the account deactivated: its tokens stop resolving (``get_token_owner``) and the
        row stays, so the user ID is never registered again; its pushers are removed. With
        ``erased_ts``, also erased (``erase: true``), in the same transaction."""
        await self._db.run_interaction("deactivate_user", _deactivate_user_txn, user_id, erased_ts)

    async def get_erased_users(self, user_ids: Collection[str]) -> set[str]:
        """Those of ``user_ids`` whose account was erased on deactivation."""

        def txn_fn(txn: Transaction) -> set[str]:
            txn.execute("SELECT user_id FROM erased_users WHERE user_id = ANY(%s)", (sorted(user_ids),))
            return {str(row[0]) for row in txn.fetchall()}

        return await self._db.run_interaction("get_erased_users", txn_fn)
