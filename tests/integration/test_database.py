"""The storage layer against a real PostgreSQL: transactions, retries, callbacks, metrics."""

from __future__ import annotations

import psycopg2
import pytest
from prometheus_client import CollectorRegistry
from twisted.internet.defer import Deferred, gatherResults

from storage.database import Database, DatabaseError, Transaction
from storage.metrics import StorageMetrics
from tests.twisted_plugin import reactor


async def test_interaction_commits_and_returns_result(database: Database) -> None:
    def create_and_insert(txn: Transaction, value: int) -> int:
        txn.execute("CREATE TABLE t (v INT)")
        txn.execute("INSERT INTO t VALUES (%s)", (value,))
        return value * 2

    assert await database.run_interaction("create", create_and_insert, 21) == 42

    def read(txn: Transaction) -> list[tuple[int, ...]]:
        txn.execute("SELECT v FROM t")
        return txn.fetchall()

    assert await database.run_interaction("read", read) == [(21,)]


async def test_failed_interaction_rolls_back_and_runs_no_after_callbacks(database: Database) -> None:
    ran: list[str] = []

    def setup(txn: Transaction) -> None:
        txn.execute("CREATE TABLE t (v INT PRIMARY KEY)")

    await database.run_interaction("setup", setup)

    def insert_then_fail(txn: Transaction) -> None:
        txn.call_after(ran.append, "after")
        txn.call_on_exception(ran.append, "on_exception")
        txn.execute("INSERT INTO t VALUES (1)")
        raise ValueError("boom")

    with pytest.raises(ValueError):
        await database.run_interaction("insert_then_fail", insert_then_fail)

    def count(txn: Transaction) -> int:
        txn.execute("SELECT count(*) FROM t")
        row = txn.fetchone()
        assert row is not None
        return int(row[0])

    assert await database.run_interaction("count", count) == 0
    # call_on_exception callbacks run on the reactor thread via callFromThread.
    await _next_reactor_turn()
    assert ran == ["on_exception"]


async def test_after_callbacks_run_after_commit_on_reactor_thread(database: Database) -> None:
    import threading

    seen: list[bool] = []

    def work(txn: Transaction) -> None:
        txn.call_after(lambda: seen.append(threading.current_thread() is threading.main_thread()))

    await database.run_interaction("work", work)
    assert seen == [True]


async def test_serialization_failures_are_retried(database: Database) -> None:
    """Two transactions increment one counter at REPEATABLE READ; the loser is retried, none is lost."""

    def setup(txn: Transaction) -> None:
        txn.execute("CREATE TABLE counter (n INT)")
        txn.execute("INSERT INTO counter VALUES (0)")

    await database.run_interaction("setup", setup)

    def increment(txn: Transaction) -> None:
        txn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        txn.execute("SELECT n FROM counter")
        txn.execute("SELECT pg_sleep(0.05)")
        txn.execute("UPDATE counter SET n = n + 1")

    await gatherResults([Deferred.fromCoroutine(database.run_interaction("increment", increment)) for _ in range(4)])

    def read(txn: Transaction) -> int:
        txn.execute("SELECT n FROM counter")
        row = txn.fetchone()
        assert row is not None
        return int(row[0])

    assert await database.run_interaction("read", read) == 4


async def test_transactions_are_timed_by_name(database_dsn: str) -> None:
    registry = CollectorRegistry()
    db = Database(reactor, database_dsn, metrics=StorageMetrics.create(registry))
    db.start()
    try:
        def noop(txn: Transaction) -> None:
            txn.execute("SELECT 1")

        await db.run_interaction("noop_txn", noop)
        await db.run_interaction("noop_txn", noop)
    finally:
        db.close()
    assert registry.get_sample_value("tributary_storage_txn_duration_seconds_count", {"txn": "noop_txn"}) == 2
    assert registry.get_sample_value("tributary_storage_txn_total", {"txn": "noop_txn", "outcome": "ok"}) == 2


async def test_unreachable_database_is_a_clear_error() -> None:
    db = Database(
        reactor,
        "postgresql://postgres@127.0.0.1:1/nowhere?connect_timeout=2",
        metrics=StorageMetrics.create(CollectorRegistry()),
    )
    db.start()
    try:
        with pytest.raises(DatabaseError, match="cannot connect to the database"):
            await db.check_connection()
    finally:
        db.close()


async def test_sql_errors_propagate_unchanged(database: Database) -> None:
    def bad(txn: Transaction) -> None:
        txn.execute("SELECT * FROM no_such_table")

    with pytest.raises(psycopg2.errors.UndefinedTable):
        await database.run_interaction("bad", bad)
    # The connection is still usable afterwards.
    assert await database.check_connection()


async def _next_reactor_turn() -> None:
    from twisted.internet.task import deferLater

    await deferLater(reactor, 0.01, lambda: None)


async def test_cancelled_caller_waits_for_its_transaction(database: Database) -> None:
    """A pool thread cannot be stopped: cancelling the caller must not return
    before the transaction has ended, or the caller could complete a stream ID
    whose row commits later."""
    from twisted.internet.defer import CancelledError

    def setup(txn: Transaction) -> None:
        txn.execute("CREATE TABLE t (v INT)")

    await database.run_interaction("setup", setup)

    def slow_insert(txn: Transaction) -> None:
        txn.execute("SELECT pg_sleep(0.3)")
        txn.execute("INSERT INTO t VALUES (1)")

    d = Deferred.fromCoroutine(database.run_interaction("slow_insert", slow_insert))
    await _next_reactor_turn()
    d.cancel()
    with pytest.raises(CancelledError):
        await d

    def count(txn: Transaction) -> int:
        txn.execute("SELECT count(*) FROM t")
        row = txn.fetchone()
        assert row is not None
        return int(row[0])

    # By the time the cancellation was delivered, the insert had committed.
    assert await database.run_interaction("count", count) == 1


async def test_autocommit_runs_statements_and_after_callbacks(database: Database) -> None:
    ran: list[str] = []

    def work(txn: Transaction) -> int:
        txn.execute("CREATE SEQUENCE s")
        txn.execute("SELECT nextval('s')")
        row = txn.fetchone()
        assert row is not None
        txn.call_after(ran.append, "after")
        return int(row[0])

    assert await database.run_autocommit("work", work) == 1
    assert ran == ["after"]
