"""Shared fixtures: real PostgreSQL, real Redis, real tributary processes.

PostgreSQL: one migrated template database per test session (named after a
hash of the schema files, so it is rebuilt only when they change), cloned into
a fresh database for every test that asks for ``database`` or ``database_dsn``.
Redis: a dedicated logical database flushed before each test, and a unique
channel prefix. Neither is ever mocked; when a service is missing the fixture
fails with a message saying how to start it.
"""

from __future__ import annotations

import hashlib
import os
import signal
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg2
import psycopg2.extensions
import pytest
from prometheus_client import CollectorRegistry

from storage.database import Database
from storage.metrics import StorageMetrics
from storage.prepare import prepare_database
from tests.twisted_plugin import reactor, run_sync

PG_ADMIN_DSN = os.environ.get("TRIBUTARY_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("TRIBUTARY_TEST_REDIS", "redis://127.0.0.1:6379/9")
SCHEMA_DIR = Path(__file__).resolve().parent.parent / "storage" / "schema"


def _admin_connection() -> psycopg2.extensions.connection:
    try:
        conn = psycopg2.connect(PG_ADMIN_DSN, connect_timeout=5)
    except psycopg2.OperationalError as e:
        pytest.fail(
            f"PostgreSQL is not reachable at {PG_ADMIN_DSN} ({str(e).strip()}); "
            "run `make test`, which starts it, or set TRIBUTARY_TEST_POSTGRES",
            pytrace=False,
        )
    conn.autocommit = True
    return conn


def _with_dbname(dsn: str, dbname: str) -> str:
    base, _, _ = dsn.rpartition("/")
    return f"{base}/{dbname}"


def _schema_fingerprint() -> str:
    digest = hashlib.sha256()
    for path in sorted(SCHEMA_DIR.glob("*.sql")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


@pytest.fixture(scope="session")
def postgres_template() -> str:
    """The name of a database with every migration applied, to clone per test."""
    name = f"tributary_test_tmpl_{_schema_fingerprint()}"
    conn = _admin_connection()
    try:
        with conn.cursor() as cur:
            # Serialise template builds across concurrent pytest runs.
            cur.execute("SELECT pg_advisory_lock(hashtext(%s))", (name,))
            cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
            if cur.fetchone() is None:
                building = name + "_build"
                cur.execute(f'DROP DATABASE IF EXISTS "{building}"')
                cur.execute(f'CREATE DATABASE "{building}"')
                db = _new_database(_with_dbname(PG_ADMIN_DSN, building))
                try:
                    run_sync(prepare_database(db))
                finally:
                    db.close()
                cur.execute(f'ALTER DATABASE "{building}" RENAME TO "{name}"')
            cur.execute("SELECT pg_advisory_unlock(hashtext(%s))", (name,))
    finally:
        conn.close()
    return name


def _new_database(dsn: str) -> Database:
    db = Database(reactor, dsn, metrics=StorageMetrics.create(CollectorRegistry()), max_connections=8)
    db.start()
    return db


@contextmanager
def scratch_database(template: str | None) -> Iterator[str]:
    """A new database (a copy of ``template``, or empty), dropped on exit; yields its DSN."""
    name = f"tributary_test_{uuid.uuid4().hex[:16]}"
    conn = _admin_connection()
    with conn.cursor() as cur:
        cur.execute(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else ""))
    try:
        yield _with_dbname(PG_ADMIN_DSN, name)
    finally:
        with conn.cursor() as cur:
            cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.close()


@pytest.fixture
def database_dsn(postgres_template: str) -> Iterator[str]:
    """A fresh, fully migrated database for this test; dropped afterwards."""
    with scratch_database(postgres_template) as dsn:
        yield dsn


@pytest.fixture
def second_database_dsn(postgres_template: str) -> Iterator[str]:
    """Another fresh, migrated database, for a second server in the same test."""
    with scratch_database(postgres_template) as dsn:
        yield dsn


@pytest.fixture
def empty_database_dsn() -> Iterator[str]:
    """A fresh database with no schema at all (for migration tests)."""
    with scratch_database(None) as dsn:
        yield dsn


@pytest.fixture
def database(database_dsn: str) -> Iterator[Database]:
    """A started ``Database`` pool on a fresh migrated database."""
    db = _new_database(database_dsn)
    try:
        yield db
    finally:
        db.close()


@pytest.fixture
def redis_url() -> Iterator[str]:
    """A Redis URL on a logical database flushed for this test."""
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=5)
    try:
        client.flushdb()
    except redis.exceptions.ConnectionError as e:
        pytest.fail(
            f"Redis is not reachable at {REDIS_URL} ({e}); run `make test`, which starts it, "
            "or set TRIBUTARY_TEST_REDIS",
            pytrace=False,
        )
    try:
        yield REDIS_URL
    finally:
        client.close()


@pytest.fixture
def world_traversable_tmp() -> Iterator[Path]:
    """A temporary directory whose parents every user may enter.

    pytest's own tmp_path lives under a 0700 directory, which the unprivileged
    user that runs the embedded PostgreSQL (when the tests run as root) cannot enter.
    """
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="tributary-test-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        # A test that failed half-way may have left an embedded cluster running.
        for pid_file in path.rglob("postmaster.pid"):
            try:
                os.kill(int(pid_file.read_text().split()[0]), signal.SIGTERM)
            except (OSError, ValueError, IndexError):
                pass
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def unique_name() -> str:
    """A short unique name for channels, server names and instances in this test."""
    return f"t{uuid.uuid4().hex[:10]}"
