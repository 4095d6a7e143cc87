"""The embedded PostgreSQL adapter on its own: both binary sources, version checks, ownership."""

from __future__ import annotations

from pathlib import Path

import psycopg2
import pytest

from storage.embedded import EmbeddedPostgres, EmbeddedPostgresError, find_binaries


def _query(dsn: str, sql: str) -> object:
    conn = psycopg2.connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute(sql)
            row = cur.fetchone()
            assert row is not None
            return row[0]
    finally:
        conn.close()


def test_system_binaries_and_a_version_mismatch_is_refused(world_traversable_tmp: Path) -> None:
    """A cluster made by the system's PostgreSQL runs with the system binaries,
    listens on no TCP port, and is refused (with a clear message) by the wheel's
    binaries of another major version."""
    system = find_binaries("system")
    wheel = find_binaries("wheel")
    assert system.source == "system" and wheel.source == "wheel"
    data_dir = world_traversable_tmp / "data"

    pg = EmbeddedPostgres(data_dir, system)
    dsn = pg.start()
    try:
        assert str(_query(dsn, "SHOW server_version")).startswith(str(system.major_version))
        assert _query(dsn, "SHOW listen_addresses") == ""
    finally:
        pg.stop()

    if wheel.major_version != system.major_version:
        with pytest.raises(EmbeddedPostgresError, match=f"made by PostgreSQL {system.major_version}"):
            EmbeddedPostgres(data_dir, wheel).start()


def test_a_second_owner_is_refused(world_traversable_tmp: Path) -> None:
    data_dir = world_traversable_tmp / "data"
    first = EmbeddedPostgres(data_dir, find_binaries("wheel"))
    first.start()
    try:
        with pytest.raises(EmbeddedPostgresError, match="in use by another Tributary process"):
            EmbeddedPostgres(data_dir, find_binaries("wheel")).start()
    finally:
        first.stop()
