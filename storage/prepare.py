"""Schema migrations: numbered SQL files in storage/schema/, applied in order.

Each file ``NNNN_name.sql`` runs in its own transaction and is recorded in
``schema_version``. Concurrent starters serialise on an advisory lock, so two
processes starting together apply each migration once. A database whose schema
is newer than this code is refused: running old code against it could corrupt it.
"""

# tests: tests/integration/test_process.py

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from importlib import resources
from typing import Final

import attrs

from storage.database import Database, Transaction

logger = logging.getLogger(__name__)

# An arbitrary constant naming the advisory lock that guards migrations.
_MIGRATION_LOCK_ID: Final = 0x7472_6962  # "trib"

_FILE_RE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


class SchemaError(Exception):
    """The database schema cannot be used by this version of the code."""


@attrs.frozen
class Migration:
    version: int
    name: str
    sql: str


def load_migrations() -> tuple[Migration, ...]:
    """Every migration shipped with the code, in order; refuses gaps and duplicates."""
    found: dict[int, Migration] = {}
    for entry in resources.files("storage.schema").iterdir():
        match = _FILE_RE.match(entry.name)
        if not match:
            continue
        version = int(match.group(1))
        if version in found:
            raise SchemaError(f"two migrations numbered {version:04d}: {found[version].name} and {match.group(2)}")
        found[version] = Migration(version, match.group(2), entry.read_text(encoding="utf-8"))
    ordered = tuple(found[v] for v in sorted(found))
    for expected, migration in enumerate(ordered, start=1):
        if migration.version != expected:
            raise SchemaError(f"migration {expected:04d} is missing (next is {migration.version:04d}_{migration.name})")
    return ordered


def code_schema_version() -> int:
    migrations = load_migrations()
    return migrations[-1].version if migrations else 0


def _ensure_version_table_txn(txn: Transaction) -> None:
    txn.execute(
        """
        CREATE TABLE IF NOT EXISTS schema_version (
            version INTEGER PRIMARY KEY,
            name TEXT NOT NULL,
            applied_ts BIGINT NOT NULL
        )
        """
    )


def _applied_versions_txn(txn: Transaction) -> set[int]:
    txn.execute("SELECT version FROM schema_version")
    return {row[0] for row in txn.fetchall()}


def _apply_txn(txn: Transaction, migration: Migration) -> bool:
    txn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK_ID,))
    if migration.version in _applied_versions_txn(txn):
        return False  # another process applied it while we waited for the lock
    txn.execute(migration.sql)
    txn.execute(
        "INSERT INTO schema_version (version, name, applied_ts) VALUES (%s, %s, %s)",
        (migration.version, migration.name, int(time.time() * 1000)),
    )
    return True


async def current_schema_version(db: Database) -> int:
    await db.run_interaction("ensure_schema_version_table", _with_lock(_ensure_version_table_txn))
    versions = await db.run_interaction("get_schema_versions", _applied_versions_txn)
    return max(versions, default=0)


def _with_lock(func: Callable[[Transaction], None]) -> Callable[[Transaction], None]:
    def locked(txn: Transaction) -> None:
        txn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK_ID,))
        func(txn)

    return locked


async def prepare_database(db: Database) -> int:
    """Apply every pending migration; return how many were applied.

    Raises SchemaError when the database is newer than the code.
    """
    return len(await apply_migrations(db))


async def apply_migrations(db: Database) -> tuple[Migration, ...]:
    """Apply every pending migration; return those this call applied, in order.

    Raises SchemaError when the database is newer than the code.
    """
    migrations = load_migrations()
    newest_known = migrations[-1].version if migrations else 0
    current = await current_schema_version(db)
    if current > newest_known:
        raise SchemaError(
            f"the database schema is at version {current}, but this Tributary only knows up to "
            f"{newest_known}: it was used by a newer release. Run that release (or newer) instead."
        )
    applied: list[Migration] = []
    for migration in migrations:
        if migration.version <= current:
            continue
        if await db.run_interaction(f"migration_{migration.version:04d}", _apply_txn, migration):
            logger.info("applied schema migration %04d_%s", migration.version, migration.name)
            applied.append(migration)
    return tuple(applied)


def _check_server_name_txn(txn: Transaction, server_name: str) -> None:
    txn.execute("SELECT server_name FROM server_meta")
    row = txn.fetchone()
    if row is None:
        txn.execute(
            "INSERT INTO server_meta (server_name, created_ts) VALUES (%s, %s) ON CONFLICT (lock) DO NOTHING",
            (server_name, int(time.time() * 1000)),
        )
        return
    if row[0] != server_name:
        raise SchemaError(
            f"this database belongs to server {row[0]!r}, but the config says server_name {server_name!r}; "
            "a server's name cannot change once it has data"
        )


async def check_server_name(db: Database, server_name: str) -> None:
    """Record the server's name on first start; refuse a database of another server."""
    await db.run_interaction("check_server_name", _check_server_name_txn, server_name)
