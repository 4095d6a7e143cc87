"""The storage layer against a real PostgreSQL: transactions, retries, callbacks, metrics."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import psycopg2
import psycopg2.errors
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from twisted.internet.defer import CancelledError, Deferred, gatherResults

from storage.database import (
    Database,
    DatabaseError,
    DeferredStatements,
    PoolClosed,
    Prepared,
    Transaction,
    array_literal,
    json_rows,
    one_statement,
    on_reactor,
)
from storage.kernel.background import FAILURES, run_in_background
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


@pytest.mark.parametrize("where", [lambda f: f, on_reactor], ids=["pool thread", "reactor thread"])
async def test_serialization_failures_are_retried(database: Database, where: Callable[[Any], Any]) -> None:
    """Four transactions increment one counter at REPEATABLE READ, side by side (on the reactor
    thread each parked in its round trips, on connections of its own); the losers are
    retried, none is lost."""

    def setup(txn: Transaction) -> None:
        txn.execute("CREATE TABLE counter (n INT)")
        txn.execute("INSERT INTO counter VALUES (0)")

    await database.run_interaction("setup", setup)

    @where
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


async def test_a_failing_statement_rolls_back_the_statements_before_it(database: Database) -> None:
    """BEGIN goes in front of a transaction's first statement rather than in a round trip of its
    own: the first statement is still inside the transaction, and the isolation level is named."""

    def setup(txn: Transaction) -> None:
        txn.execute("CREATE TABLE t (v INT)")

    await database.run_interaction("setup", setup)

    def insert_then_fail(txn: Transaction) -> None:
        txn.execute_statements([("INSERT INTO t VALUES (%s)", (1,))])
        txn.execute("INSERT INTO t VALUES (%s)", (2,))
        txn.execute("SELECT 1 / 0")

    with pytest.raises(psycopg2.errors.DivisionByZero):
        await database.run_interaction("insert_then_fail", insert_then_fail)

    def state(txn: Transaction) -> tuple[int, str, bool]:
        txn.execute("SELECT count(*), current_setting('transaction_isolation'), "
                    "now() < statement_timestamp() OR now() = statement_timestamp() FROM t")
        row = txn.fetchone()
        assert row is not None
        return int(row[0]), str(row[1]), bool(row[2])

    assert await database.run_interaction("state", state) == (0, "read committed", True)

    def in_transaction(txn: Transaction) -> bool:
        txn.execute_values("INSERT INTO t VALUES %s", [(3,), (4,)])
        txn.execute("SELECT pg_current_xact_id_if_assigned() IS NOT NULL")
        row = txn.fetchone()
        assert row is not None
        return bool(row[0])

    assert await database.run_interaction("in_transaction", in_transaction) is True


async def test_statements_can_carry_their_transactions_commit(database: Database) -> None:
    """``execute_statements(commit=True)`` ends the transaction in the same round trip: what it
    wrote is committed, a failing statement among them commits nothing, a statement after
    the COMMIT (``then``) gives its rows, and outside a transaction begun by hand it is refused."""

    def setup(txn: Transaction) -> None:
        txn.execute("CREATE TABLE c (v INT)")

    await database.run_interaction("setup", setup)

    def write(txn: Transaction, values: list[object]) -> None:
        txn.execute("INSERT INTO c VALUES (0)")
        txn.execute_statements([("INSERT INTO c VALUES (%s)", (v,)) for v in values], commit=True)

    await database.run_interaction("write", write, [1, 2])
    with pytest.raises(psycopg2.errors.InvalidTextRepresentation):
        await database.run_interaction("write", write, [3, "four"])

    def held(txn: Transaction) -> int:
        deferred = DeferredStatements(txn)
        deferred.execute_statements([("INSERT INTO c VALUES (%s)", (5,))], commit=True,
                                    then=("SELECT count(*) FROM c", None))
        row = deferred.fetchone()  # then's rows: run after the COMMIT, in the same round trip
        assert row is not None
        return int(row[0])

    assert await database.run_interaction("held", held) == 4

    def then_without_commit(txn: Transaction) -> None:
        txn.execute_statements([("SELECT 1", None)], then=("SELECT 2", None))

    with pytest.raises(ValueError):
        await database.run_interaction("then", then_without_commit)

    def values(txn: Transaction) -> list[int]:
        txn.execute("SELECT v FROM c ORDER BY v")
        return [int(row[0]) for row in txn.fetchall()]

    assert await database.run_interaction("values", values) == [0, 1, 2, 5]

    def autocommit(txn: Transaction) -> None:
        txn.execute_statements([("INSERT INTO c VALUES (%s)", (6,))], commit=True)

    with pytest.raises(ValueError):
        await database.run_autocommit("autocommit", autocommit)


def test_prepared_sql_numbers_its_placeholders() -> None:
    sql = Prepared("SELECT %s::int, 'a%%' LIKE %s, %s")
    assert sql == "SELECT %s::int, 'a%%' LIKE %s, %s"  # still the SQL itself
    assert sql.server_sql == "SELECT $1::int, 'a%' LIKE $2, $3"
    assert sql.execute_sql == f"EXECUTE {sql.name} (%s, %s, %s)"
    assert Prepared("SELECT 1").execute_sql == f"EXECUTE {Prepared('SELECT 1').name}"
    with pytest.raises(ValueError, match="only %s placeholders"):
        Prepared("SELECT %(name)s")


async def test_prepared_statements_survive_rollbacks_and_lost_connections(database: Database) -> None:
    """A Prepared statement is prepared once per connection. PREPARE outlives the rollback of
    the transaction it ran in, so a failed transaction must not make the next one prepare it
    again; a new connection (the old one was lost) prepares it afresh."""
    insert = Prepared("INSERT INTO t (v, label) SELECT %s::int, %s::text RETURNING v * 10")

    def setup(txn: Transaction) -> None:
        txn.execute("CREATE TABLE t (v INT PRIMARY KEY, label TEXT)")

    await database.run_interaction("setup", setup)

    def add(txn: Transaction, v: int, fail: bool) -> int:
        txn.execute(insert, (v, f"label {v}"))
        row = txn.fetchone()
        assert row is not None
        if fail:
            raise ValueError("boom")
        return int(row[0])

    with pytest.raises(ValueError):
        await database.run_interaction("add", add, 1, True)
    for v in range(2, 30):  # more rounds than the pool has connections, each in a transaction
        assert await database.run_interaction("add", add, v, False) == v * 10

    def batch(txn: Transaction) -> int:
        txn.execute_statements([(insert, (100, "x")), (insert, (101, "y"))])
        row = txn.fetchone()
        assert row is not None
        return int(row[0])

    assert await database.run_interaction("batch", batch) == 1010

    def lose_others(txn: Transaction) -> None:
        txn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()")

    await _backends_at_once(database, 4)  # the pool holds four connections: three are lost below
    await database.run_interaction("lose_others", lose_others)
    # At once, so the lost connections are taken too: each is found gone and replaced.
    added = await gatherResults([Deferred.fromCoroutine(database.run_interaction("add", add, v, False))
                                 for v in range(200, 215)])
    assert added == [v * 10 for v in range(200, 215)]
    for v in range(215, 230):
        assert await database.run_interaction("add", add, v, False) == v * 10

    def rows(txn: Transaction) -> list[tuple[int, str]]:
        txn.execute("SELECT v, label FROM t ORDER BY v")
        return [(int(r[0]), str(r[1])) for r in txn.fetchall()]

    stored = await database.run_interaction("rows", rows)
    assert [v for v, _ in stored] == [*range(2, 30), 100, 101, *range(200, 230)]
    assert stored[0] == (2, "label 2")


async def _backends_at_once(database: Database, count: int) -> set[int]:
    """The server backends of ``count`` transactions that run at the same time (each waits
    for the others before it ends): ``count`` connections of the pool."""
    barrier = threading.Barrier(count, timeout=10)

    def backend(txn: Transaction) -> int:
        txn.execute("SELECT pg_backend_pid()")
        row = txn.fetchone()
        assert row is not None
        barrier.wait()
        return int(row[0])

    pids = await gatherResults([Deferred.fromCoroutine(database.run_interaction("backend", backend))
                                for _ in range(count)])
    return set(pids)


async def test_sequential_transactions_keep_to_the_connection_used_last(database: Database) -> None:
    """One transaction after another runs on one connection, the one given back last (its
    server backend's caches are warm), not on each of the pool's in turn; transactions at
    the same time still get a connection each, and the pool opens no more than it needs."""
    four = await _backends_at_once(database, 4)
    assert len(four) == 4

    def backend(txn: Transaction) -> int:
        txn.execute("SELECT pg_backend_pid()")
        row = txn.fetchone()
        assert row is not None
        return int(row[0])

    sequential = [await database.run_interaction("backend", backend) for _ in range(20)]
    assert len(set(sequential)) == 1 and sequential[0] in four
    autocommitted = [await database.run_autocommit("backend", backend) for _ in range(5)]
    assert set(autocommitted) == {sequential[0]}
    with pytest.raises(ValueError):
        await database.run_interaction("fails", lambda txn: (backend(txn), _raise(ValueError("boom"))))
    assert await database.run_interaction("backend", backend) == sequential[0]  # rolled back, kept
    assert await _backends_at_once(database, 4) == four


def _raise(error: Exception) -> None:
    raise error


_TEXT_ELEMENTS = st.one_of(st.none(), st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                                              max_size=12),
                           st.sampled_from(["", "NULL", "null", "a,b", "{x}", " sp ", '"', "\\", 'q"\\', "é\u2028"]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(_TEXT_ELEMENTS, max_size=8),
       ints=st.lists(st.one_of(st.none(), st.integers(-2**63, 2**63 - 1)), max_size=8),
       flags=st.lists(st.one_of(st.none(), st.booleans()), max_size=8))
def test_prepared_statements_take_lists_as_they_were(database_dsn: str, texts: list[str | None],
                                                     ints: list[int | None], flags: list[bool | None]) -> None:
    """A Prepared statement's list parameters, and those another statement casts to an array
    type, go as one array literal (``array_literal``: quotes and backslashes escaped), a list
    of other values as psycopg2 adapts them (and so does a list without a cast): either way
    PostgreSQL gets the list."""
    sql = "SELECT %s::text[], %s::BIGINT[], %s::boolean[], cardinality(%s::text[]), %s = ANY(%s)"
    conn = psycopg2.connect(database_dsn)
    try:
        with conn.cursor() as cursor:
            for statement in (Prepared(sql.replace("ANY(%s)", "ANY(%s::text[])")), sql):
                txn = Transaction("lists", cursor, set())
                txn.execute(statement, (texts, ints, flags, texts, "x", texts))
                found = True if "x" in texts else None if None in texts else False  # SQL's ANY
                assert txn.fetchone() == (texts, ints, flags, len(texts), found)
    finally:
        conn.close()
    assert isinstance(array_literal(texts), str)  # quotes and backslashes escaped in the literal
    assert isinstance(array_literal(ints), str) and isinstance(array_literal(flags), str)
    assert array_literal([{"a": 1}]) == [{"a": 1}]
    assert array_literal(["a", "nul\x00"]) == ["a", "nul\x00"]  # left to psycopg2, which refuses it


_TEXTS = st.one_of(
    st.none(),
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40),
    st.sampled_from(["'", "''", "\\", "\\'", "%s", "%(x)s", "$1", "E'\\n'", "); DROP TABLE t; --", "é\u2028😀"]),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_TEXTS, number=st.one_of(st.none(), st.integers(-2**63, 2**63 - 1)),
       flag=st.one_of(st.none(), st.booleans()), texts=st.lists(_TEXT_ELEMENTS, max_size=4))
def test_prepared_statements_take_their_values_as_they_were(
    database_dsn: str, text: str | None, number: int | None, flag: bool | None, texts: list[str | None]
) -> None:
    """A Prepared statement's plain values (str, int, bool, None, lists) go as literals written
    by ``_literals``; a value of another kind (a float) hands the whole statement to psycopg2.
    Either way each comes back as it was sent, quotes, backslashes and placeholders included."""
    statement = Prepared("SELECT %s::text, %s::bigint, %s::boolean, %s::text[], %s::float8")
    conn = psycopg2.connect(database_dsn)
    try:
        with conn.cursor() as cursor:
            prepared: set[str] = set()
            for last in (None, 1.5):
                txn = Transaction("values", cursor, prepared)
                txn.execute_statements([(statement, (text, number, flag, texts, last))])
                assert cursor.fetchone() == (text, number, flag, texts, last)
    finally:
        conn.close()


async def test_literals_hold_whatever_the_servers_string_settings(database_dsn: str) -> None:
    """The pool's connections set standard_conforming_strings on (what ``_literals`` writes
    strings for) even where the DSN turns it off; a NUL or a lone surrogate is refused as
    psycopg2 refuses it, before anything is sent."""
    off = psycopg2.extensions.make_dsn(database_dsn, options="-c standard_conforming_strings=off")
    db = Database(reactor, off, metrics=StorageMetrics.create(CollectorRegistry()), max_connections=2)
    db.start()
    statement = Prepared("SELECT %s::text")
    try:
        def echo(txn: Transaction, value: str) -> object:
            txn.execute(statement, (value,))
            row = txn.fetchone()
            assert row is not None
            return row[0]

        for value in ("a\\'b", "\\\\", "it's", "\\x41"):
            assert await db.run_interaction("echo", echo, value) == value
        with pytest.raises(ValueError):
            await db.run_interaction("echo", echo, "nul\x00")

        def echo_list(txn: Transaction, values: list[str]) -> object:
            txn.execute(Prepared("SELECT %s::text[]"), (values,))
            row = txn.fetchone()
            assert row is not None
            return row[0]

        odd = ['a\\"b', "it's", "\\", '"', "{x,y}", "NULL"]
        assert await db.run_interaction("echo", echo_list, odd) == odd
        with pytest.raises(ValueError):  # never a NUL cutting the query short
            await db.run_interaction("echo", echo_list, ["ok", "nul\x00"])
        with pytest.raises(UnicodeEncodeError):
            await db.run_interaction("echo", echo, "lone \ud800")
        assert await db.run_interaction("echo", echo, "still usable") == "still usable"
    finally:
        db.close()


async def test_reads_run_without_a_transaction_and_refuse_writes(database: Database) -> None:
    """``run_reads`` sends a function's reads with no BEGIN and no COMMIT (a transaction around
    them adds only the COMMIT's round trip under READ COMMITTED) and refuses anything else,
    before it reaches the server."""

    def setup(txn: Transaction) -> None:
        txn.execute("CREATE TABLE r (v INT)")
        txn.execute("INSERT INTO r VALUES (1), (2)")

    await database.run_interaction("setup", setup)
    count = Prepared("SELECT count(*) FROM r WHERE v >= %s")

    def read(txn: Transaction) -> tuple[int, int, bool]:
        txn.execute(count, (1,))
        first = txn.fetchone()
        txn.execute("WITH x AS (SELECT v FROM r) SELECT sum(v) FROM x")
        second = txn.fetchone()
        # No transaction is open between the statements.
        txn.execute("SELECT now() = statement_timestamp()")
        alone = txn.fetchone()
        assert first is not None and second is not None and alone is not None
        return int(first[0]), int(second[0]), bool(alone[0])

    assert await database.run_reads("read", read) == (2, 3, True)

    def writes(txn: Transaction) -> None:
        txn.execute("SELECT 1")
        txn.execute("INSERT INTO r VALUES (3)")

    with pytest.raises(ValueError, match="only reads"):
        await database.run_reads("writes", writes)
    with pytest.raises(ValueError, match="only reads"):
        await database.run_reads("writes", lambda txn: txn.execute_values("INSERT INTO r (v) VALUES %s", [(4,)]))
    with pytest.raises(ValueError, match="only reads"):
        await database.run_reads("writes", lambda txn: txn.execute(Prepared("DELETE FROM r WHERE v = %s"), (1,)))
    assert await database.run_reads("read", read) == (2, 3, True)


async def test_reads_are_retried_once_on_a_new_connection_when_theirs_is_lost(database: Database) -> None:
    def backend(txn: Transaction) -> int:
        txn.execute("SELECT pg_backend_pid()")
        row = txn.fetchone()
        assert row is not None
        return int(row[0])

    lost = await database.run_reads("backend", backend)

    # From a connection of its own: the pool would run this on the very connection it ends.
    conn = psycopg2.connect(database.dsn)
    try:
        conn.autocommit = True
        with conn.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", (lost,))
    finally:
        conn.close()
    again = await database.run_reads("backend", backend)
    assert again != lost


async def test_a_closed_pool_refuses_work_with_a_database_error(database_dsn: str) -> None:
    registry = CollectorRegistry()
    db = Database(reactor, database_dsn, metrics=StorageMetrics.create(registry), max_connections=2)
    db.start()
    assert await db.run_reads("one", lambda txn: txn.execute("SELECT 1")) is None
    db.close()
    with pytest.raises(PoolClosed, match="closed") as refused:
        await db.run_interaction("after", lambda txn: None)
    # A DatabaseError, and a cancellation: background work cut short by a shutdown ends quietly.
    assert isinstance(refused.value, DatabaseError) and isinstance(refused.value, CancelledError)
    assert await run_in_background("cut short", db.run_interaction("after", lambda txn: None)) is None
    assert not [s for m in FAILURES.collect() for s in m.samples if s.labels.get("task") == "cut short"]
    assert registry.get_sample_value("tributary_storage_pool_transactions_waiting") == 0


async def test_one_statement_gives_each_read_rows_as_a_plain_select_would(database: Database) -> None:
    """``json_rows`` parts of ``one_statement`` come back as the rows of the same reads sent one
    by one, for the column types they are used with (text of every kind, bigint, NULL, text[]),
    in their order; a read with no rows and a None part are both None."""
    texts = ["", "it's", 'a "quote"', "back\\slash", "tab\tnew\nline", "ünïcödé ☃ 🎉", "\u2028", "NULL", "{a,b}"]

    def setup(txn: Transaction) -> None:
        txn.execute("CREATE TABLE j (k INT, t TEXT, n BIGINT, arr TEXT[])")
        for i, text in enumerate(texts):
            txn.execute("INSERT INTO j VALUES (%s, %s, %s, %s)",
                        (i, text, [2**62, -(2**62), None][i % 3], [[text, "x"], [], None][i % 3]))

    await database.run_interaction("setup", setup)
    rest = "FROM j WHERE k >= %s"

    def read(txn: Transaction) -> tuple[object, ...]:
        txn.execute(f"SELECT t, n, arr {rest} ORDER BY k", (0,))
        plain = txn.fetchall()
        txn.execute(one_statement(json_rows("t, n, arr", rest, "k"), None, json_rows("t", rest), json_rows("t", rest)),
                    (0, 0, 100))
        row = txn.fetchone()
        assert row is not None
        return plain, row

    plain, row = await database.run_reads("read", read)
    assert [tuple(r) for r in row[0]] == plain
    assert row[1] is None and row[3] is None
    assert sorted(r[0] for r in row[2]) == sorted(texts)


# --- transactions on the reactor thread (storage/on_reactor.py) -------------------------------


async def test_marked_transactions_run_on_the_reactor_thread_as_on_a_pool_thread(database: Database) -> None:
    ran: list[str] = []

    @on_reactor
    def setup(txn: Transaction) -> bool:
        txn.execute("CREATE TABLE t (v INT PRIMARY KEY)")
        txn.execute("INSERT INTO t VALUES (1)")
        txn.call_after(ran.append, "after setup")
        return threading.current_thread() is threading.main_thread()

    assert await database.run_interaction("setup", setup) is True
    assert ran == ["after setup"]

    @on_reactor
    def insert_then_fail(txn: Transaction) -> None:
        txn.call_after(ran.append, "after")
        txn.call_on_exception(ran.append, "on_exception")
        txn.execute("INSERT INTO t VALUES (2)")
        raise ValueError("boom")

    with pytest.raises(ValueError):
        await database.run_interaction("insert_then_fail", insert_then_fail)

    @on_reactor
    def duplicate(txn: Transaction) -> None:
        txn.execute("INSERT INTO t VALUES (3)")
        txn.execute("INSERT INTO t VALUES (1)")

    with pytest.raises(psycopg2.errors.UniqueViolation):
        await database.run_interaction("duplicate", duplicate)

    @on_reactor
    def read(txn: Transaction) -> list[tuple[int, ...]]:
        txn.execute("SELECT v FROM t ORDER BY v")
        return txn.fetchall()

    assert await database.run_interaction("read", read) == [(1,)]  # both rolled back
    await _next_reactor_turn()
    assert ran == ["after setup", "on_exception"]

    def on_thread(txn: Transaction) -> bool:
        return threading.current_thread() is threading.main_thread()

    assert await database.run_interaction("unmarked", on_thread) is False
    assert await database.run_reads("reads", on_thread) is True


@on_reactor
def _backend_after_a_nap(txn: Transaction) -> int:
    txn.execute("SELECT pg_backend_pid(), pg_sleep(0.05)")
    row = txn.fetchone()
    assert row is not None
    return int(row[0])


async def test_reactor_connections_are_bounded_and_the_one_idle_last_is_reused(database_dsn: str) -> None:
    db = Database(reactor, database_dsn, metrics=StorageMetrics.create(CollectorRegistry()), max_connections=2)
    db.start()
    try:
        at_once = await gatherResults(
            [Deferred.fromCoroutine(db.run_interaction("nap", _backend_after_a_nap)) for _ in range(6)])
        assert len(set(at_once)) == 2  # six transactions, two connections: the others waited their turn
        one = await db.run_interaction("nap", _backend_after_a_nap)
        assert await db.run_interaction("nap", _backend_after_a_nap) == one
    finally:
        db.close()


async def test_closing_from_another_thread_closes_the_reactor_connections_on_the_reactor_thread(
        database_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The homeserver closes its database from a thread (``deferToThread``): the reactor side's
    sockets, registered with the running loop, are let go on the reactor thread, and nothing
    more is taken meanwhile."""
    from twisted.internet.threads import deferToThread

    from storage import on_reactor as reactor_side

    closed_on: list[bool] = []
    close = reactor_side.LoopConnection.close

    def noting_close(held: reactor_side.LoopConnection) -> None:
        closed_on.append(threading.current_thread() is threading.main_thread())
        close(held)

    monkeypatch.setattr(reactor_side.LoopConnection, "close", noting_close)
    db = Database(reactor, database_dsn, metrics=StorageMetrics.create(CollectorRegistry()), max_connections=2)
    db.start()
    backends = await gatherResults(
        [Deferred.fromCoroutine(db.run_interaction("nap", _backend_after_a_nap)) for _ in range(2)])
    await deferToThread(db.close)
    with pytest.raises(PoolClosed):
        await db.run_interaction("nap", _backend_after_a_nap)
    await _next_reactor_turn()
    assert closed_on == [True, True]
    conn = psycopg2.connect(database_dsn)
    try:
        for _ in range(300):  # a backend ends a moment after its client closed the connection
            with conn.cursor() as cursor:
                cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", (backends,))
                if cursor.fetchone() == (0,):
                    break
            await _next_reactor_turn()
        else:
            raise AssertionError(f"the reactor side's backends {backends} outlived the close")
    finally:
        conn.close()


async def test_a_reactor_connection_the_server_closed_is_noticed_and_replaced(database: Database) -> None:
    import resource

    lost = await database.run_interaction("nap", _backend_after_a_nap)
    conn = psycopg2.connect(database.dsn)  # not the pool's: it would end its own connection
    try:
        conn.autocommit = True
        with conn.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", (lost,))
    finally:
        conn.close()
    # The idle connection's socket turns readable (end of file): it is closed, not polled
    # again and again, so the reactor idles on.
    before = resource.getrusage(resource.RUSAGE_SELF)
    nap: Deferred[None] = Deferred()
    reactor.callLater(0.5, nap.callback, None)
    await nap
    after = resource.getrusage(resource.RUSAGE_SELF)
    assert (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime) < 0.25
    again = await database.run_interaction("nap", _backend_after_a_nap)
    assert again != lost


@pytest.mark.timeout(20)
async def test_a_socket_the_loop_stopped_watching_costs_a_second_not_the_transaction(
        database: Database, caplog: pytest.LogCaptureFixture) -> None:
    """A registration the loop lost is made afresh after ``STALL_CHECK_SECONDS``, and the
    statement's result reaches the task. (The suite once hung for good with a reactor task
    never resumed; its cause was not found, and a lost registration is one way to get there.)"""
    import time

    from storage import on_reactor as reactor_side

    await database.run_interaction("nap", _backend_after_a_nap)
    [held] = database._loop_connections._idle
    reactor_side.reactor_loop(reactor).remove_reader(held.conn.fileno())  # behind its back
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="storage.on_reactor"):
        await database.run_interaction("nap", _backend_after_a_nap)
    assert reactor_side.STALL_CHECK_SECONDS <= time.monotonic() - started < reactor_side.STALL_CHECK_SECONDS + 5
    assert any("ended unseen by the loop" in r.getMessage() for r in caplog.records)
    # Watched again: the next statement is answered by the loop, not found done by a stall check
    # (which, unlike a stopwatch, a slow machine cannot trip: a check that finds the statement
    # still running just waits on).
    caplog.clear()
    with caplog.at_level("WARNING", logger="storage.on_reactor"):
        await database.run_interaction("nap", _backend_after_a_nap)
    assert not [r.getMessage() for r in caplog.records if "unseen by the loop" in r.getMessage()]


@pytest.mark.timeout(20)
async def test_a_connecting_socket_the_loop_stopped_watching_costs_a_second_not_the_task(
        database: Database, caplog: pytest.LogCaptureFixture) -> None:
    """The same while a task opens its connection: it is woken after ``STALL_CHECK_SECONDS``,
    polls, and watches the socket afresh; ``describe`` shows it waiting meanwhile."""
    import time

    from storage import on_reactor as reactor_side

    loop = reactor_side.reactor_loop(reactor)
    assert loop is not None
    await _next_reactor_turn()  # inside the loop from here on
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="storage.on_reactor"):
        reading = Deferred.fromCoroutine(database.run_reads("backend", _backend_after_a_nap))
        # The task began at once (this runs inside the loop) and waits to connect.
        [fd] = reactor_side._CONNECTING
        assert any(f"connecting on socket {fd}" in line for line in reactor_side.describe())
        loop.remove_reader(fd)  # behind its back, whichever it waits for
        loop.remove_writer(fd)
        assert await reading
    assert reactor_side.STALL_CHECK_SECONDS <= time.monotonic() - started < reactor_side.STALL_CHECK_SECONDS + 5
    assert any("went on unseen by the loop" in r.getMessage() for r in caplog.records)
    assert not reactor_side._CONNECTING
    assert any("idle" in line for line in reactor_side.describe())


async def test_copy_cannot_run_on_the_reactor_thread(database: Database) -> None:
    await database.run_interaction("setup", lambda txn: txn.execute("CREATE TABLE t (v INT)"))

    @on_reactor
    def copy(txn: Transaction) -> None:
        txn.execute("INSERT INTO t VALUES (1)")
        txn.copy_rows("t", ("v",), [(2,)])

    with pytest.raises(ValueError, match="COPY cannot run on the reactor thread"):
        await database.run_interaction("copy", copy)
    assert await database.run_reads("read", lambda txn: (txn.execute("SELECT count(*) FROM t"), txn.fetchone())[1]) == (0,)


async def test_a_statement_of_megabytes_runs_on_the_reactor_thread(database: Database) -> None:
    """An 8 MB statement and its error reach the task as a small one's do. (On loopback the
    server reads it as fast as it is sent: psycopg2 was not seen to ask to wait for writing.)"""
    text = "x" * 8_000_000

    @on_reactor
    def length(txn: Transaction, value: str) -> int:
        txn.execute("SELECT length(%s)", (value,))
        row = txn.fetchone()
        assert row is not None
        return int(row[0])

    @on_reactor
    def bad(txn: Transaction, value: str) -> None:
        txn.execute("SELECT length(%s) + 'not a number'", (value,))

    assert await database.run_interaction("length", length, text) == 8_000_000
    with pytest.raises(psycopg2.errors.InvalidTextRepresentation):
        await database.run_interaction("bad", bad, text)
    assert await database.run_interaction("length", length, text) == 8_000_000
