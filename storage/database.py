"""PostgreSQL access: psycopg2 connections on a bounded thread pool, used from async code.

``Database.run_interaction(name, func, *args)`` runs ``func(txn, *args)`` in one
transaction on a pool thread and returns its result to the reactor thread; a function
marked ``on_reactor``, and every function of ``run_reads``, runs on the reactor thread
itself, over a non-blocking connection (``storage/on_reactor.py``). It
retries the whole function on serialization failures and deadlocks, reconnects
after a lost connection, times every transaction by name, and runs callbacks
registered with ``txn.call_after`` on the reactor thread once the transaction
has committed. This module knows nothing of any table: the SQL lives in the
stores.

Connections are in autocommit mode and transactions are begun by hand: ``BEGIN``
goes in front of a transaction's first statement, not in a round trip of its
own (as psycopg2 would send it), and ``COMMIT`` ends it.

Statements of the hot paths are ``Prepared``: each connection parses and plans
them once (``PREPARE``) and then sends ``EXECUTE name (values)``, which the
server neither parses nor plans again.
"""

# tests: tests/integration/test_database.py

from __future__ import annotations

import asyncio
import collections
import functools
import hashlib
import io
import logging
import queue
import random
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Concatenate, Final, ParamSpec, TypeVar

import attrs
import psycopg2
import psycopg2.errors
import psycopg2.extensions
import psycopg2.extras
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IReactorFromThreads, IReactorTime
from twisted.python.failure import Failure
from twisted.python.threadable import isInIOThread

from storage import on_reactor as reactor_side
from storage.availability import Availability, Transition
from storage.kernel.errors import Unavailable
from storage.metrics import Children, StorageMetrics

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

MAX_RETRIES = 5

_RETRYABLE = (psycopg2.errors.SerializationFailure, psycopg2.errors.DeadlockDetected)

# How Database._submit runs a function: in a transaction, its statements each on its own, or
# its reads each on their own.
_TXN: Final = "txn"
_AUTOCOMMIT: Final = "autocommit"
_READS: Final = "reads"

# The attribute ``on_reactor`` sets on a transaction function.
_ON_REACTOR: Final = "_tributary_on_reactor"


def on_reactor(func: F) -> F:
    """Mark ``func`` as a transaction function ``Database`` runs on the reactor thread
    (``storage/on_reactor.py``): one with little Python between its round trips and no
    ``copy_rows``, on a path where the two thread wake-ups of a pool thread's hand-off are a
    share of its cost worth saving. ``run_reads`` runs every function there."""
    setattr(func, _ON_REACTOR, True)
    return func


def runs_on_reactor(func: Callable[..., object]) -> bool:
    """Whether ``func`` is marked with ``on_reactor``."""
    return getattr(func, _ON_REACTOR, False) is True


def delay_cancellation(deferred: Deferred[T]) -> Deferred[T]:
    """A Deferred with ``deferred``'s result whose cancellation waits for ``deferred``.

    Cancelling the returned Deferred does not cancel ``deferred``; the canceller
    gets ``CancelledError`` only once ``deferred`` has finished. A pool thread
    cannot be stopped, so every interaction is awaited through this: a cancelled
    caller never goes on (completing a stream ID, say) while its transaction
    could still commit.
    """
    waiting = deferred

    def cancel(outer: Deferred[T]) -> None:
        outer.pause()
        outer.errback(Failure(CancelledError()))
        waiting.addBoth(_unpause, outer)

    result: Deferred[T] = Deferred(canceller=cancel)

    def relay(value: T | Failure) -> None:
        if result.called:
            if isinstance(value, Failure):
                logger.debug("result of a cancelled transaction: %s", value.getErrorMessage())
            return None
        if isinstance(value, Failure):
            result.errback(value)
        else:
            result.callback(value)
        return None

    deferred.addBoth(relay)
    return result


def _unpause(value: object, outer: Deferred[Any]) -> object:
    outer.unpause()
    return value



class DatabaseError(Exception):
    """The database could not be reached or used."""


class DatabaseUnavailable(DatabaseError, Unavailable):
    """The database cannot be reached now (no connection could be made, or the connection was
    lost again on the retry): an outage, not a bug (the kernel's ``Unavailable``: 503 with
    ``Retry-After``, no traceback)."""


class PoolClosed(DatabaseError, CancelledError):
    """Work given to a pool that was closed (the process is stopping): it is not run. It is
    a cancellation too, so background work cut short by a shutdown (``run_in_background``)
    ends quietly, as cancelled work does, and does not count as a failure."""


def _copy_value(value: object) -> str:
    """One value in COPY's text format: NULL as ``\\N``, booleans as t/f, backslash and the
    separators escaped (found by plain ``in`` scans first: most values have none)."""
    kind = type(value)
    if kind is str:
        text: str = value  # type: ignore[assignment]
        if "\\" in text or "\t" in text or "\n" in text or "\r" in text:
            text = text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")
        return text
    if value is None:
        return "\\N"
    if kind is bool:
        return "t" if value else "f"
    if kind is int:
        return str(value)
    if isinstance(value, bool):
        return "t" if value else "f"
    if isinstance(value, (int, str)):
        return _copy_value(int(value) if isinstance(value, int) else str(value))
    raise TypeError(f"copy_rows takes None, bool, int or str values, not {type(value).__name__}")


def array_literal(values: list[Any]) -> str | list[Any]:
    """``values`` as one PostgreSQL array literal (``{"a","b",NULL,7,t}``) where every element is
    None, a bool, an int or a str without NUL (quoted, its double quotes and backslashes
    escaped with a backslash as the array syntax has it); else ``values`` as they are, for
    psycopg2 to adapt (or, for a NUL, to refuse). psycopg2 sends a list as ``ARRAY[...]`` of
    elements adapted one by one (about 1.4 µs each, then an expression PostgreSQL parses);
    the literal is a single string to quote, about a tenth of that for short values. It has no
    type of its own: only for a parameter whose type the statement fixes (every parameter of a
    ``Prepared`` one, and one written with a cast to an array type, ``%s::text[]``:
    ``Transaction`` sends both so). Quoted as a string by psycopg2, or by ``_literals``."""
    parts: list[str] = []
    for value in values:
        kind = type(value)
        if kind is str:
            if "\x00" in value:
                return values
            if '"' in value or "\\" in value:
                value = value.replace("\\", "\\\\").replace('"', '\\"')
            parts.append(f'"{value}"')
        elif kind is int:
            parts.append(str(value))
        elif value is None:
            parts.append("NULL")
        elif kind is bool:
            parts.append("t" if value else "f")
        else:
            return values
    return "{" + ",".join(parts) + "}"


class SqlValue(str):
    """A parameter that is an SQL expression, written into the statement as it is: made only from
    code constants, never from input (``currval`` of a stream's sequence: an ID that the
    statements of one round trip take themselves, ``StreamIdGenerator.get_next_in_statements_txn``). ``_literals`` writes it
    into an ``EXECUTE``'s parameters, psycopg2 (the adapter registered below) into other SQL."""


psycopg2.extensions.register_adapter(SqlValue, lambda value: psycopg2.extensions.AsIs(str(value)))


def _literals(values: Sequence[object]) -> str | None:
    """``values`` as the SQL literals of an ``EXECUTE``'s parameter list, where each is None, a bool,
    an int, a str or a list ``array_literal`` writes; else None (psycopg2 then binds them all).
    A string is quoted as standard_conforming_strings has it (set on every connection:
    ``Database._connection``), its quotes doubled and backslashes left as they are. A str with a NUL
    is left to psycopg2, which refuses it; one that is not valid UTF-8 (a lone surrogate) fails the
    query's encoding as it does in psycopg2. About a fifth of psycopg2's cost for a send's batch
    (it adapts each value through its adapters' protocol)."""
    out: list[str] = []
    for value in values:
        kind = type(value)
        if kind is str:
            text: str = value  # type: ignore[assignment]
            if "\x00" in text:
                return None
            out.append("'" + text.replace("'", "''") + "'" if "'" in text else "'" + text + "'")
        elif kind is int:
            out.append(str(value))
        elif value is None:
            out.append("NULL")
        elif kind is bool:
            out.append("true" if value else "false")
        elif kind is SqlValue:
            out.append(value)  # type: ignore[arg-type]
        elif kind is list:
            array = array_literal(value)  # type: ignore[arg-type]
            if type(array) is not str:
                return None
            out.append("'" + array.replace("'", "''") + "'")
        else:
            return None
    return ", ".join(out)


_ARRAY_CAST: Final = re.compile(r"::\s*[a-z]+(?: [a-z]+)*\s*\[\]", re.IGNORECASE)


@functools.lru_cache(maxsize=2048)
def _array_casts(sql: str) -> frozenset[int]:
    """The positions of ``sql``'s ``%s`` placeholders written with a cast to an array type
    (``%s::text[]``): their lists may go as ``array_literal``s."""
    parts = sql.replace("%%", "\x00").split("%s")
    return frozenset(i for i, after in enumerate(parts[1:]) if _ARRAY_CAST.match(after))


class Prepared(str):
    """SQL (with ``%s`` placeholders) that a connection prepares the first time it runs it and
    runs with ``EXECUTE`` from then on, skipping PostgreSQL's parse, analysis and planning (most
    of the server's CPU for the short statements of a send).

    It is still the SQL text itself, so whatever does not know of preparation runs it as it is.
    The text is prepared as written, with ``$n`` for its placeholders: a placeholder whose type
    its context does not fix (a bare ``%s`` in a SELECT list put in a non-text column, say)
    needs a cast, or PREPARE takes it for text.
    """

    name: str
    server_sql: str
    execute_sql: str
    execute_bytes: bytes

    def __new__(cls, sql: str) -> Prepared:
        self = super().__new__(cls, sql)
        parts = sql.replace("%%", "\x00").split("%s")
        if any("%" in part for part in parts):
            raise ValueError(f"prepared SQL takes only %s placeholders: {sql[:200]!r}")
        count = len(parts) - 1
        numbered = parts[0] + "".join(f"${i}{part}" for i, part in enumerate(parts[1:], start=1))
        self.name = "tq_" + hashlib.sha1(sql.encode()).hexdigest()[:20]
        self.server_sql = numbered.replace("\x00", "%")
        self.execute_sql = f"EXECUTE {self.name}" + (f" ({', '.join(['%s'] * count)})" if count else "")
        self.execute_bytes = f"EXECUTE {self.name}".encode()
        return self


@functools.lru_cache(maxsize=512)
def prepared(sql: str) -> Prepared:
    """``Prepared(sql)``, made once per text: for a statement assembled from a few fragments
    (a stream position's condition has two forms), each form prepared on its own."""
    return Prepared(sql)


def json_rows(columns: str, rest: str, order_by: str | None = None) -> str:
    """A subquery whose one value is the rows of ``SELECT {columns} {rest}`` as one JSON array
    of arrays (NULL when there are none), for ``one_statement``. Text, numbers, booleans, NULL
    and text[] come back as psycopg2 would give them; bytea, timestamps and numerics would not."""
    order = f" ORDER BY {order_by}" if order_by else ""
    return f"SELECT json_agg(json_build_array({columns}){order}) {rest}"


def one_statement(*parts: str | None) -> Prepared:
    """Several independent reads in one statement, so one round trip: a row of one value per
    part, each part a ``json_rows`` subquery (a None part is a NULL, to keep the positions).
    Made once per text (``prepared``)."""
    return prepared("SELECT " + ", ".join("NULL" if part is None else f"({part})" for part in parts))


# Sent in front of a transaction's first statement (the isolation level named, whatever the
# server's default_transaction_isolation says).
_BEGIN: Final = "BEGIN ISOLATION LEVEL READ COMMITTED;\n"
_BEGIN_BYTES: Final = _BEGIN.encode()
_IDLE: Final = psycopg2.extensions.TRANSACTION_STATUS_IDLE


class Transaction:
    """One database transaction, handed to interaction functions.

    A thin layer over a psycopg2 cursor: parameters always go through
    placeholders, and callbacks that must only run once the change is durable
    are registered with ``call_after``.
    """

    __slots__ = ("name", "_cursor", "_after_callbacks", "_exception_callbacks", "_prepared", "_begins")

    def __init__(
        self, name: str, cursor: psycopg2.extensions.cursor, prepared: set[str] | None = None, *, begins: bool = False
    ) -> None:
        """``prepared``: the names of the ``Prepared`` statements the cursor's connection has
        prepared, kept with the connection (None: run them as plain SQL). ``begins``: the
        connection is in autocommit mode and this object begins the transaction, in front of
        the first statement it sends while the connection is idle; the caller commits."""
        self.name = name
        self._cursor = cursor
        self._after_callbacks: list[tuple[Callable[..., object], tuple[object, ...]]] = []
        self._exception_callbacks: list[tuple[Callable[..., object], tuple[object, ...]]] = []
        self._prepared = prepared
        self._begins = begins

    def _must_begin(self) -> bool:
        return self._begins and self._cursor.connection.get_transaction_status() == _IDLE

    def _begin_alone(self) -> None:
        """BEGIN in a round trip of its own, before a statement it cannot be put in front of."""
        if self._must_begin():
            self._cursor.execute(_BEGIN)

    def _bind(self, sql: str, params: Sequence[object] | None) -> bytes:
        """The bytes to send for ``sql`` with ``params``: ``EXECUTE`` for a ``Prepared`` statement
        (preparing it on this connection first, in a round trip of its own, once), else ``sql``
        bound by psycopg2. A prepared statement's parameters of the plain kinds are written as
        literals here (``_literals``: PREPARE typed them); the others, and other SQL's, psycopg2
        binds, with the list parameters whose type the statement fixes as array literals
        (``array_literal``): all of a prepared statement's, those of other SQL whose placeholders
        it casts to an array type. PREPARE outlives a rollback; a statement is noted as prepared
        only once PREPARE succeeded."""
        prepared = self._prepared
        cursor = self._cursor
        if prepared is None or not isinstance(sql, Prepared):
            if params and any(type(p) is list for p in params):
                cast = _array_casts(sql)
                params = [array_literal(p) if type(p) is list and i in cast else p for i, p in enumerate(params)]
            bound: bytes = cursor.mogrify(sql, params)
            return bound
        if sql.name not in prepared:
            cursor.execute(f"PREPARE {sql.name} AS {sql.server_sql}")
            prepared.add(sql.name)
        if not params:
            return sql.execute_bytes
        literals = _literals(params)
        if literals is not None:
            return f"EXECUTE {sql.name} ({literals})".encode()
        # A value of another kind: psycopg2 binds them all (lists as array literals: PREPARE typed each).
        bound = cursor.mogrify(sql.execute_sql, [array_literal(p) if type(p) is list else p for p in params])
        return bound

    def execute(self, sql: str, params: Sequence[object] | None = None) -> None:
        query = self._bind(sql, params)
        self._cursor.execute(_BEGIN_BYTES + query if self._must_begin() else query)

    def execute_statements(self, statements: Iterable[tuple[str, Sequence[object] | None]], *,
                           commit: bool = False, then: tuple[str, Sequence[object] | None] | None = None) -> None:
        """Run several statements in one round trip, in order.

        Each is bound client-side (as ``execute`` does) and they are sent joined
        by ``;``. Only the last statement's rows can be fetched; an error in any
        of them fails the call (and the transaction).

        ``commit``: end the transaction with them, its ``COMMIT`` in the same round trip (an
        error in a statement still fails the call before anything is committed). The function
        then runs nothing more in the transaction and fetches only the rows of ``then``: a
        statement sent after the COMMIT, in the same round trip, run on its own once the
        transaction has committed (a session's value, such as ``currval``). Only in a
        transaction this object begins (``Database.run_interaction``).
        """
        closing = self._closing(commit, then)
        parts = [self._bind(sql, params) for sql, params in statements] + closing
        if parts:
            joined = b";\n".join(parts)
            self._cursor.execute(_BEGIN_BYTES + joined if self._must_begin() else joined)

    def _closing(self, commit: bool, then: tuple[str, Sequence[object] | None] | None) -> list[bytes]:
        """What ``execute_statements`` sends after the statements: the COMMIT and ``then``;
        refused, before anything is bound, where the transaction is not this object's to end."""
        if commit and not self._begins:
            raise ValueError("commit=True needs a transaction begun by hand (run_interaction)")
        if then is not None and not commit:
            raise ValueError("a statement to run after the COMMIT needs commit=True")
        if not commit:
            return []
        return [b"COMMIT"] if then is None else [b"COMMIT", self._bind(*then)]

    def execute_values(self, sql: str, rows: Iterable[Sequence[object]], page_size: int = 1000) -> None:
        """Insert many rows in few round trips; ``sql`` has one ``VALUES %s``."""
        self._begin_alone()
        psycopg2.extras.execute_values(self._cursor, sql, rows, page_size=page_size)

    def copy_rows(self, table: str, columns: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
        """Load ``rows`` into ``table`` with ``COPY ... FROM STDIN`` (bulk loads: several times
        faster than INSERT). ``table`` and ``columns`` come from code constants, never input;
        values are None, bool, int or str (a str may hold anything but NUL). COPY has no ON
        CONFLICT: the caller leaves out rows that exist."""
        text = "".join("\t".join(_copy_value(v) for v in row) + "\n" for row in rows)
        if text:
            self._begin_alone()
            self._cursor.copy_expert(f"COPY {table} ({', '.join(columns)}) FROM STDIN", io.StringIO(text))

    def execute_batch(self, sql: str, rows: Iterable[Sequence[object]], page_size: int = 100) -> None:
        self._begin_alone()
        psycopg2.extras.execute_batch(self._cursor, sql, rows, page_size=page_size)

    def fetchone(self) -> tuple[Any, ...] | None:
        row: tuple[Any, ...] | None = self._cursor.fetchone()
        return row

    def fetchall(self) -> list[tuple[Any, ...]]:
        return self._cursor.fetchall()

    @property
    def rowcount(self) -> int:
        return int(self._cursor.rowcount)

    def call_after(self, callback: Callable[..., object], *args: object) -> None:
        """Run ``callback(*args)`` on the reactor thread after this transaction commits."""
        self._after_callbacks.append((callback, args))

    def call_on_exception(self, callback: Callable[..., object], *args: object) -> None:
        """Run ``callback(*args)`` on the reactor thread if this transaction fails for good."""
        self._exception_callbacks.append((callback, args))


# A statement run_reads lets through: its first keyword is one of a read's.
_READ_STATEMENT: Final = re.compile(r"\s*(?:SELECT|WITH|SHOW|VALUES|TABLE|EXPLAIN)\b", re.IGNORECASE)


class _Reads(Transaction):
    """The statements of a function run by ``Database.run_reads``: each on its own, with no
    transaction around them, so only reads are let through (a ``WITH`` is taken at its
    word: one that writes would go unnoticed)."""

    __slots__ = ()

    def _bind(self, sql: str, params: Sequence[object] | None) -> bytes:
        text = sql.server_sql if isinstance(sql, Prepared) else sql
        if _READ_STATEMENT.match(text) is None:
            raise ValueError(f"run_reads runs only reads, not {text.strip()[:60]!r}")
        return super()._bind(sql, params)

    def execute_values(self, sql: str, rows: Iterable[Sequence[object]], page_size: int = 1000) -> None:
        raise ValueError("run_reads runs only reads, not execute_values")

    def execute_batch(self, sql: str, rows: Iterable[Sequence[object]], page_size: int = 100) -> None:
        raise ValueError("run_reads runs only reads, not execute_batch")

    def copy_rows(self, table: str, columns: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
        raise ValueError("run_reads runs only reads, not copy_rows")


class DeferredStatements(Transaction):
    """A view of a transaction that holds back ``execute_statements`` until the next read.

    Statements are bound at once (as ``execute_statements`` binds them) and sent together,
    in order, by ``flush``, which every ``execute``/``execute_values``/``execute_batch`` and
    fetch calls first: so a function written for one event's writes, run for many events
    in a row, sends their writes in one round trip where nothing in between reads. An error
    of a held-back statement surfaces at that flush. ``call_after`` callbacks go to the
    underlying transaction.
    """

    __slots__ = ("_pending",)

    def __init__(self, txn: Transaction) -> None:
        super().__init__(txn.name, txn._cursor, txn._prepared, begins=txn._begins)
        self._after_callbacks = txn._after_callbacks
        self._exception_callbacks = txn._exception_callbacks
        self._pending: list[bytes] = []

    def flush(self) -> None:
        if self._pending:
            joined = b";\n".join(self._pending)
            self._pending.clear()
            self._cursor.execute(_BEGIN_BYTES + joined if self._must_begin() else joined)

    def execute_statements(self, statements: Iterable[tuple[str, Sequence[object] | None]], *,
                           commit: bool = False, then: tuple[str, Sequence[object] | None] | None = None) -> None:
        closing = self._closing(commit, then)
        self._pending.extend(self._bind(sql, params) for sql, params in statements)
        self._pending.extend(closing)
        if commit:
            self.flush()

    def execute(self, sql: str, params: Sequence[object] | None = None) -> None:
        self.flush()
        super().execute(sql, params)

    def execute_values(self, sql: str, rows: Iterable[Sequence[object]], page_size: int = 1000) -> None:
        self.flush()
        super().execute_values(sql, rows, page_size)

    def execute_batch(self, sql: str, rows: Iterable[Sequence[object]], page_size: int = 100) -> None:
        self.flush()
        super().execute_batch(sql, rows, page_size)

    def fetchone(self) -> tuple[Any, ...] | None:
        self.flush()
        return super().fetchone()

    def fetchall(self) -> list[tuple[Any, ...]]:
        self.flush()
        return super().fetchall()

    @property
    def rowcount(self) -> int:
        self.flush()
        return int(self._cursor.rowcount)


class _Workers:
    """Threads for blocking work, each handed its next piece by the reactor thread.

    Work goes to the thread that became idle last (a new thread only when none is idle, up
    to ``size``; beyond that it waits its turn in order). A database thread keeps its own
    connection, so one transaction after another runs on one connection and one server
    backend, whose caches are warm. Twisted's ``ThreadPool`` gives work to any idle thread:
    handed round ten connections in turn, a message send cost PostgreSQL 0.67 ms of CPU
    instead of 0.50 ms (bench/client_api.py). Sharing one stack of idle connections among
    the threads instead kept that gain but cost 8 concurrent senders 5 % of their rate, in
    the server's own CPU: a connection moving from thread to thread.
    """

    __slots__ = ("_reactor", "_size", "_name", "_lock", "_idle", "_waiting", "_threads", "_stopping")

    def __init__(self, reactor: IReactorFromThreads, size: int, name: str) -> None:
        self._reactor = reactor
        self._size = size
        self._name = name
        self._lock = threading.Lock()
        # The idle threads' inboxes, the one idle last at the end.
        self._idle: list[queue.SimpleQueue[_Work | None]] = []
        self._waiting: collections.deque[_Work] = collections.deque()
        self._threads: list[threading.Thread] = []
        self._stopping = False

    def start(self, count: int) -> None:
        """Start ``count`` threads ahead of any work (no more than ``size`` in all)."""
        with self._lock:
            for _ in range(min(count, self._size) - len(self._threads)):
                self._idle.append(self._spawn(None))

    def submit(self, func: Callable[..., T], *args: object) -> Deferred[T]:
        """Run ``func(*args)`` on a thread; its result (or failure) arrives on the reactor thread."""
        result: Deferred[T] = Deferred()
        work: _Work = (result, func, args)
        with self._lock:
            if self._stopping:
                raise PoolClosed(f"the {self._name} pool is closed")
            if self._idle:
                inbox = self._idle.pop()
            elif len(self._threads) < self._size:
                self._spawn(work)
                return result
            else:
                self._waiting.append(work)
                return result
        inbox.put(work)
        return result

    def stop(self) -> None:
        """Let the threads finish the work they have and the work waiting, then end them."""
        with self._lock:
            self._stopping = True
            idle, self._idle = self._idle, []
            threads = list(self._threads)
        for inbox in idle:
            inbox.put(None)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join()

    def _spawn(self, first: _Work | None) -> queue.SimpleQueue[_Work | None]:
        """(Under ``_lock``.) A new thread, its inbox holding ``first`` if given."""
        inbox: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        if first is not None:
            inbox.put(first)
        thread = threading.Thread(target=self._run, args=(inbox,), name=f"{self._name}-{len(self._threads)}",
                                  daemon=True)
        self._threads.append(thread)
        thread.start()
        return inbox

    def _run(self, inbox: queue.SimpleQueue[_Work | None]) -> None:
        work = inbox.get()
        while work is not None:
            result, func, args = work
            try:
                value = func(*args)
            except BaseException:
                self._reactor.callFromThread(result.errback, Failure())
            else:
                self._reactor.callFromThread(result.callback, value)
            del result, func, args, work
            with self._lock:
                if self._waiting:
                    work = self._waiting.popleft()
                    continue
                if self._stopping:
                    return
                self._idle.append(inbox)
            work = inbox.get()


_Work = tuple[Deferred[Any], Callable[..., Any], tuple[object, ...]]


@attrs.frozen
class _Outcome:
    result: Any
    callbacks: tuple[tuple[Callable[..., object], tuple[object, ...]], ...]


class _ThreadSide:
    """Where a pool thread runs a function: the thread's own blocking connection."""

    __slots__ = ("_db",)

    def __init__(self, db: Database) -> None:
        self._db = db

    def connection(self) -> tuple[psycopg2.extensions.connection, set[str]]:
        conn = self._db._connection()
        prepared: set[str] = self._db._local.prepared
        return conn, prepared

    def cursor(self, conn: psycopg2.extensions.connection) -> Any:
        return conn.cursor()

    def drop(self, conn: psycopg2.extensions.connection) -> None:
        self._db._drop_connection(conn)

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class _ReactorSide:
    """Where a task on the reactor thread runs a function (``storage/on_reactor.py``): the
    non-blocking connection the task holds, opened by the task when it had none."""

    __slots__ = ("_db", "_loop", "held")

    def __init__(self, db: Database, loop: asyncio.AbstractEventLoop, held: reactor_side.LoopConnection | None) -> None:
        self._db = db
        self._loop = loop
        self.held = held

    def connection(self) -> tuple[psycopg2.extensions.connection, set[str]]:
        if self.held is not None and self.held.conn.closed:
            self.held.close()  # psycopg2 closed it (a fatal error): its socket's watch goes too
            self.held = None
        if self.held is None:
            self.held = self._db._open_nonblocking(self._loop)
        return self.held.conn, self.held.prepared

    def cursor(self, conn: psycopg2.extensions.connection) -> Any:
        assert self.held is not None and self.held.conn is conn
        return self.held.cursor()

    def drop(self, conn: psycopg2.extensions.connection) -> None:
        if self.held is not None:
            self.held.close()
        self.held = None

    def sleep(self, seconds: float) -> None:
        reactor_side.sleep(self._loop, seconds)


_Side = _ThreadSide | _ReactorSide


class Database:
    """A pool of connections to one PostgreSQL database.

    ``dsn`` is a libpq connection string or URL. A transaction runs either on a pool
    thread, which keeps its own connection, opened on first use (a transaction goes to
    the thread idle last: ``_Workers``), or on the reactor thread in a task of its own
    (``storage/on_reactor.py``: ``run_reads`` and functions marked ``on_reactor``), on a
    non-blocking connection of at most ``max_connections`` more, the one idle last.
    """

    def __init__(
        self,
        reactor: IReactorFromThreads,
        dsn: str,
        *,
        metrics: StorageMetrics,
        min_connections: int = 1,
        max_connections: int = 10,
        application_name: str = "tributary",
    ) -> None:
        self._reactor = reactor
        self._dsn = dsn
        self._metrics = metrics
        self._application_name = application_name
        self._min_connections = min_connections
        self._workers = _Workers(reactor, max_connections, "db")
        self._thread_side = _ThreadSide(self)
        self._loop_connections = reactor_side.LoopConnections(max_connections)
        self._loop = reactor_side.reactor_loop(reactor)
        self._closed = False
        self._local = threading.local()
        self._connections: list[psycopg2.extensions.connection] = []
        self._connections_lock = threading.Lock()
        self._in_use = 0
        self._waiting = 0
        self._counts_lock = threading.Lock()
        # The txn metrics' children, by transaction name (and outcome), each made once.
        self._durations = Children(self._metrics.txn_duration)
        self._totals = Children(self._metrics.txn_total)
        self.max_connections = max_connections
        # Up or down, and when to try connecting again while down (storage/availability.py);
        # changed by pool threads and the reactor's tasks alike, under the lock.
        self._availability = Availability()
        self._availability_lock = threading.Lock()
        self._probe: Deferred[bool] | None = None
        self._metrics.database_up.set(1)

    @property
    def dsn(self) -> str:
        return self._dsn

    def start(self) -> None:
        self._workers.start(self._min_connections)

    async def check_connection(self) -> str:
        """Open a connection and return the server's version string; raises DatabaseError."""

        def version(txn: Transaction) -> str:
            txn.execute("SHOW server_version")
            row = txn.fetchone()
            assert row is not None
            return str(row[0])

        return await self.run_interaction("check_connection", version)

    def close(self) -> None:
        """Refuse new work, stop the pool (waiting for running transactions) and close every
        connection; the reactor thread's connections in use close when their transactions end.

        Callable from any thread (a blocking close is often run in one). The reactor thread's
        connections are closed on that thread: their sockets are registered with its loop,
        which is not to be touched from another thread while it runs."""
        self._closed = True
        if self._loop is not None and self._loop.is_running() and not isInIOThread():
            self._reactor.callFromThread(self._loop_connections.close)
        else:
            self._loop_connections.close()
        self._workers.stop()
        with self._connections_lock:
            for conn in self._connections:
                try:
                    conn.close()
                except psycopg2.Error:
                    pass
            self._connections.clear()

    async def run_interaction(
        self,
        name: str,
        func: Callable[Concatenate[Transaction, P], R],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> R:
        """Run ``func(txn, *args, **kwargs)`` in a transaction and return its result: on the
        reactor thread when ``func`` is marked ``on_reactor``, else on a pool thread."""
        result: R = await self._submit(name, func, args, kwargs, mode=_TXN, here=runs_on_reactor(func))
        return result

    async def run_reads(
        self,
        name: str,
        func: Callable[Concatenate[Transaction, P], R],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> R:
        """Run ``func``, which only reads, with no transaction around its statements, on the
        reactor thread.

        Under READ COMMITTED each statement of a transaction takes a snapshot of its own, so
        a transaction around reads adds nothing but its ``COMMIT``, a round trip of its own at
        the end (the reads of every ``/sync``). A statement that is not a read is refused.
        Retried once on a new connection when the connection is lost (a read is safe to
        repeat); ``call_after`` callbacks run once ``func`` has returned.
        """
        result: R = await self._submit(name, func, args, kwargs, mode=_READS, here=True)
        return result

    async def run_autocommit(
        self,
        name: str,
        func: Callable[Concatenate[Transaction, P], R],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> R:
        """Run ``func`` with every statement committing on its own: no BEGIN, no COMMIT.

        For work that needs no atomicity, such as ``nextval`` (which no rollback
        undoes anyway): one round trip per statement instead of three. On the reactor
        thread when ``func`` is marked ``on_reactor``.
        """
        result: R = await self._submit(name, func, args, kwargs, mode=_AUTOCOMMIT, here=runs_on_reactor(func))
        return result

    async def _submit(
        self,
        name: str,
        func: Callable[..., Any],
        args: tuple[object, ...],
        kwargs: dict[str, object],
        *,
        mode: str,
        here: bool,
    ) -> Any:
        """Run ``func`` on the reactor thread (``here``, and called from its main greenlet) or
        queue it on the pool; wait for it (cancellation-safely), run its after-callbacks."""
        with self._counts_lock:
            self._waiting += 1
            self._metrics.pool_waiting.set(self._waiting)
        try:
            if self._closed:
                raise PoolClosed("the database pool is closed")
            loop = self._loop
            if here and loop is not None and reactor_side.on_main_greenlet():
                queued = self._run_here(loop, name, func, args, kwargs, mode)
            else:
                queued = self._workers.submit(self._run, self._thread_side, name, func, args, kwargs, mode)
        except PoolClosed:  # nothing waits
            with self._counts_lock:
                self._waiting -= 1
                self._metrics.pool_waiting.set(self._waiting)
            logger.info("[%s] not run: the database pool is closed", name)
            raise
        outcome: _Outcome = await delay_cancellation(queued)
        for callback, cb_args in outcome.callbacks:
            try:
                callback(*cb_args)
            except Exception:
                logger.exception("[%s] after-commit callback %r failed", name, callback)
        return outcome.result

    def _run_here(
        self,
        loop: asyncio.AbstractEventLoop,
        name: str,
        func: Callable[..., Any],
        args: tuple[object, ...],
        kwargs: dict[str, object],
        mode: str,
    ) -> Deferred[_Outcome]:
        """``func`` in a task on the reactor thread, on a connection of the reactor's own
        (Deferred callbacks rather than a coroutine: this is on every such transaction's way)."""

        def start(held: reactor_side.LoopConnection | None) -> Deferred[_Outcome]:
            side = _ReactorSide(self, loop, held)

            def release(result: object) -> object:
                self._loop_connections.release(side.held)
                return result

            ran: Deferred[_Outcome] = reactor_side.start_task(loop, self._run, side, name, func, args, kwargs, mode)
            return ran.addBoth(release)

        return self._loop_connections.acquire().addCallback(start)

    # --- on pool threads, or in a task on the reactor thread -----------------------

    def _connection(self) -> psycopg2.extensions.connection:
        """The pool thread's connection, opened on first use."""
        conn: psycopg2.extensions.connection | None = getattr(self._local, "conn", None)
        if conn is not None and not conn.closed:
            return conn
        self._check_may_connect()
        try:
            conn = psycopg2.connect(self._dsn, application_name=self._application_name)
        except psycopg2.OperationalError as e:
            raise self._connect_failed(e) from e
        conn.autocommit = True  # transactions are begun by hand (module docstring)
        try:
            # What _literals writes strings for, whatever the server's or the DSN's defaults say.
            conn.set_client_encoding("UTF8")
            with conn.cursor() as cursor:
                cursor.execute("SET standard_conforming_strings = on")
        except psycopg2.Error as e:
            conn.close()
            raise DatabaseError(f"cannot set up a database connection: {str(e).strip()}") from e
        self._local.conn = conn
        self._local.prepared = set()
        with self._connections_lock:
            self._connections.append(conn)
        return conn

    def _open_nonblocking(self, loop: asyncio.AbstractEventLoop) -> reactor_side.LoopConnection:
        """A new connection in psycopg2's asynchronous mode (always autocommit), opened and set
        up as ``_connection``'s, the current task parked meanwhile (``storage/on_reactor.py``)."""
        self._check_may_connect()
        try:
            # The client encoding as a connection parameter: psycopg2 learns it at connect time
            # (set_client_encoding is for blocking connections only).
            conn = psycopg2.connect(self._dsn, application_name=self._application_name,
                                    client_encoding="UTF8", async_=True)
            reactor_side.wait_connected(conn, loop)
        except psycopg2.OperationalError as e:
            raise self._connect_failed(e) from e
        held = reactor_side.LoopConnection(conn, loop)
        try:
            with held.cursor() as cursor:
                cursor.execute("SET standard_conforming_strings = on")
        except psycopg2.Error as e:
            held.close()
            raise DatabaseError(f"cannot set up a database connection: {str(e).strip()}") from e
        return held

    # --- up or down ----------------------------------------------------------------

    def _check_may_connect(self) -> None:
        """Fail fast while the database is down and the backoff's wait is not over."""
        availability = self._availability
        if availability.up:
            return
        now = time.monotonic()
        with self._availability_lock:
            if availability.may_connect(now):
                return
            retry_after, reason = availability.retry_after(now), availability.reason
        raise DatabaseUnavailable(f"the database is unreachable: {reason}", retry_after)

    def _connect_failed(self, error: psycopg2.OperationalError) -> DatabaseUnavailable:
        """Note a connection that could not be made (logged once, when the outage starts)."""
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        now = time.monotonic()
        with self._availability_lock:
            transition = self._availability.failed(now, reason, random.uniform)
            retry_after = self._availability.retry_after(now)
        self._metrics.connection_failures.inc()
        if transition is Transition.DOWN:
            self._metrics.database_up.set(0)
            logger.warning("the database is unreachable (%s): requests fail with 503 until it is back", reason)
        return DatabaseUnavailable(f"cannot connect to the database: {reason}", retry_after)

    def _note_success(self, started: float) -> None:
        availability = self._availability
        now = time.monotonic()
        if availability.up:
            availability.last_success = now  # one attribute: no lock on every transaction's way
            return
        with self._availability_lock:
            down_since = availability.down_since
            transition = availability.succeeded(now, started)
        if transition is Transition.UP:
            self._metrics.database_up.set(1)
            logger.info("the database is reachable again after %.1fs", now - (down_since or now))

    @property
    def up(self) -> bool:
        """What the pool knows: no connection has failed since the last one that worked."""
        return self._availability.up

    async def is_available(self, clock: IReactorTime, timeout: float) -> bool:
        """Whether the database answers, for a health check: the pool's knowledge while it is
        fresh, else the answer of a ``SELECT 1`` probe (at most one a second, shared by every
        caller: ``Availability.should_probe``), waited for at most ``timeout`` seconds (a
        probe still running then counts as down)."""
        with self._availability_lock:
            start = self._availability.should_probe(time.monotonic())
        if start:
            self._probe = Deferred.fromCoroutine(self._run_probe())
        probe = self._probe
        if probe is None or probe.called:
            return self._availability.up
        answer: Deferred[bool] = Deferred()

        def give(up: bool) -> bool:
            if not answer.called:
                answer.callback(up)
            if timer.active():
                timer.cancel()
            return up

        timer = clock.callLater(timeout, give, False)
        probe.addCallback(give)
        return await answer

    async def _run_probe(self) -> bool:
        def select_one(txn: Transaction) -> None:
            txn.execute("SELECT 1")
            txn.fetchone()

        try:
            await self.run_reads("health_probe", select_one)
            return True
        except DatabaseError:
            return False
        finally:
            with self._availability_lock:
                self._availability.probe_finished()

    def _drop_connection(self, conn: psycopg2.extensions.connection) -> None:
        with self._connections_lock:
            if conn in self._connections:
                self._connections.remove(conn)
        try:
            conn.close()
        except psycopg2.Error:
            pass
        self._local.conn = None
        self._local.prepared = set()

    def _run(
        self,
        side: _Side,
        name: str,
        func: Callable[..., Any],
        args: tuple[object, ...],
        kwargs: dict[str, object],
        mode: str,
    ) -> _Outcome:
        with self._counts_lock:
            self._waiting -= 1
            self._in_use += 1
            self._metrics.pool_waiting.set(self._waiting)
            self._metrics.pool_in_use.set(self._in_use)
        start = time.perf_counter()
        started = time.monotonic()
        outcome = "error"
        try:
            if mode == _TXN:
                result = self._run_with_retries(side, name, func, args, kwargs)
            else:
                result = self._run_autocommit(side, name, func, args, kwargs, reads=mode == _READS)
            outcome = "ok"
            self._note_success(started)
            return result
        finally:
            duration = time.perf_counter() - start
            if name not in self._durations:
                self._totals[name, "error"]  # the error series exists at 0 from a name's first transaction
            self._durations[name].observe(duration)
            self._totals[name, outcome].inc()
            with self._counts_lock:
                self._in_use -= 1
                self._metrics.pool_in_use.set(self._in_use)

    def _run_with_retries(
        self,
        side: _Side,
        name: str,
        func: Callable[..., Any],
        args: tuple[object, ...],
        kwargs: dict[str, object],
    ) -> _Outcome:
        attempt = 0
        while True:
            attempt += 1
            conn, prepared = side.connection()
            txn: Transaction | None = None
            try:
                with side.cursor(conn) as cursor:
                    txn = Transaction(name, cursor, prepared, begins=True)
                    result = func(txn, *args, **kwargs)
                    if conn.get_transaction_status() != _IDLE:
                        cursor.execute("COMMIT")
                return _Outcome(result, tuple(txn._after_callbacks))
            except _RETRYABLE as e:
                self._rollback(side, conn)
                if attempt > MAX_RETRIES:
                    self._schedule_exception_callbacks(txn)
                    raise
                self._metrics.txn_retries.labels(txn=name).inc()
                logger.info("[%s] retrying after %s (attempt %d)", name, type(e).__name__, attempt)
                side.sleep(0.01 * attempt)
            except (psycopg2.OperationalError, psycopg2.InterfaceError) as e:
                # The connection is gone (server restart, network). Nothing was
                # committed; retry once on a fresh connection.
                side.drop(conn)
                if attempt > 1:
                    self._schedule_exception_callbacks(txn)
                    raise DatabaseUnavailable(f"database connection lost during {name}: {str(e).strip()}") from e
                # Info: an outage has its one warning, when no new connection can be made.
                logger.info("[%s] database connection lost (%s); reconnecting", name, str(e).strip())
            except BaseException:
                try:
                    self._rollback(side, conn)
                except psycopg2.Error:
                    side.drop(conn)
                self._schedule_exception_callbacks(txn)
                raise

    def _run_autocommit(
        self,
        side: _Side,
        name: str,
        func: Callable[..., Any],
        args: tuple[object, ...],
        kwargs: dict[str, object],
        *,
        reads: bool,
    ) -> _Outcome:
        kind = _Reads if reads else Transaction
        attempt = 0
        while True:
            attempt += 1
            conn, prepared = side.connection()
            try:
                with side.cursor(conn) as cursor:
                    txn = kind(name, cursor, prepared)
                    return _Outcome(func(txn, *args, **kwargs), tuple(txn._after_callbacks))
            except (psycopg2.OperationalError, psycopg2.InterfaceError) as e:
                side.drop(conn)
                if not reads or attempt > 1:
                    raise DatabaseUnavailable(f"database connection lost during {name}: {str(e).strip()}") from e
                logger.info("[%s] database connection lost (%s); reconnecting", name, str(e).strip())

    @staticmethod
    def _rollback(side: _Side, conn: psycopg2.extensions.connection) -> None:
        """End the transaction begun by hand, if any (a statement failed, or the function raised)."""
        if not conn.closed and conn.get_transaction_status() != _IDLE:
            with side.cursor(conn) as cursor:
                cursor.execute("ROLLBACK")

    def _schedule_exception_callbacks(self, txn: Transaction | None) -> None:
        if txn is None:
            return
        for callback, args in txn._exception_callbacks:
            self._reactor.callFromThread(callback, *args)
