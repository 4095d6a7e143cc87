"""Shared fixtures: real PostgreSQL, real Redis, real tributary processes.

PostgreSQL: one migrated template database per test session (named after a
hash of the schema files, so it is rebuilt only when they change), cloned into
a fresh database for every test that asks for ``database`` or ``database_dsn``
(the clones made ahead and dropped behind on threads: ``_ScratchDatabases``).
Redis: a dedicated logical database flushed before each test, and a unique
channel prefix. Neither is ever mocked; when a service is missing the fixture
fails with a message saying how to start it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import os
import signal
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import psycopg2
import psycopg2.extensions
import pytest
from prometheus_client import CollectorRegistry

from storage.database import Database
from storage.metrics import StorageMetrics
from storage.prepare import prepare_database
from tests.twisted_plugin import reactor, run_sync

T = TypeVar("T")

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


class _ScratchDatabases:
    """Copies of the migrated template made ahead and dropped behind the tests, on threads.

    A ``CREATE DATABASE`` from the template takes about a second on this machine (the copy
    writes the template's 10 MB through the WAL), and some 500 tests each waited for one and
    then for its ``DROP``. Here the next copies are made, several at once (four at once took
    2.2 s here, one alone 1.1 s), while tests run, and a test's copy is dropped while the next
    one runs. Each test still gets a database nobody else has used. Databases without a
    template, the rare case, are made in the caller."""

    AHEAD = 3

    def __init__(self) -> None:
        self._ahead: collections.deque[tuple[str, concurrent.futures.Future[str]]] = collections.deque()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def take(self, template: str) -> str:
        """The name of a new copy of ``template``, for the caller alone."""
        while self._ahead and self._ahead[0][0] != template:  # made for a template gone since
            self._drop_when_made(self._ahead.popleft()[1])
        made = self._ahead.popleft()[1] if self._ahead else self._submit(_create_copy, template)
        while len(self._ahead) < self.AHEAD:
            self._ahead.append((template, self._submit(_create_copy, template)))
        return made.result()

    def give_back(self, name: str) -> None:
        self._submit(_run_admin, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def close(self) -> None:
        """Drop the copies made ahead, and wait for every drop."""
        while self._ahead:
            self._drop_when_made(self._ahead.popleft()[1])
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _drop_when_made(self, made: concurrent.futures.Future[str]) -> None:
        if made.exception() is None:  # not made: nothing to drop (its error was the test's to see)
            self.give_back(made.result())

    def _submit(self, job: Callable[[str], T], arg: str) -> concurrent.futures.Future[T]:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.AHEAD, thread_name_prefix="scratch-databases")
        return self._pool.submit(job, arg)


def _create_copy(template: str) -> str:
    name = f"tributary_test_{uuid.uuid4().hex[:16]}"
    _run_admin(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    return name


def _run_admin(sql: str) -> None:
    """``sql`` on the admin connection (also on a thread of ``_ScratchDatabases``: a failure to
    connect reaches the test through the future)."""
    conn = _admin_connection()
    try:
        with conn.cursor() as cur:
            cur.execute(sql)
    finally:
        conn.close()


_SCRATCH = _ScratchDatabases()


def pytest_sessionfinish(session: pytest.Session) -> None:
    _SCRATCH.close()


@contextmanager
def scratch_database(template: str | None) -> Iterator[str]:
    """A new database (a copy of ``template``, or empty), dropped after; yields its DSN."""
    if template is None:
        name = f"tributary_test_{uuid.uuid4().hex[:16]}"
        _run_admin(f'CREATE DATABASE "{name}"')
    else:
        name = _SCRATCH.take(template)
    try:
        yield _with_dbname(PG_ADMIN_DSN, name)
    finally:
        _SCRATCH.give_back(name)


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
