"""SQL for streams: sequences, persisted positions, start-up barrier, backing-table reads and writes.

Every statement the stream machinery runs is here; ``storage.id_generators``,
``storage.streams`` and ``storage.cache_invalidation`` call these ``_txn``
functions through ``Database.run_interaction``. Table, column and sequence
names are code constants (checked against a strict pattern); values always go
through placeholders. This module knows no stream semantics beyond "rows with a
stream_id, written by an instance".
"""

# tests: tests/integration/test_streams_registry.py, tests/integration/test_streams_generators.py

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Sequence
from typing import Any, Final

import attrs

from storage.database import Prepared, SqlValue, Transaction

_IDENTIFIER: Final = re.compile(r"^[a-z_][a-z0-9_]*$")


class StreamNotAvailableError(RuntimeError):
    """A stream's backing table does not exist (yet): it comes with a later migration."""


def _identifier(name: str) -> str:
    if not _IDENTIFIER.match(name):
        raise ValueError(f"SQL identifiers here are lower-case code constants, got {name!r}")
    return name


@attrs.frozen
class TableSource:
    """One backing table of a stream, described as data so the SQL stays here.

    ``columns`` are the row-type fields' columns, in the row type's field order.
    ``negated`` tables store ``-stream_id`` in ``id_column`` (the convention for
    backfilled events), so positions still increase. ``may_be_missing`` tables
    are created by a later migration: reading them before it ran raises
    ``StreamNotAvailableError`` instead of a database error.
    """

    table: str = attrs.field(validator=lambda _i, _a, v: _identifier(v))
    columns: tuple[str, ...] = attrs.field(validator=lambda _i, _a, v: [_identifier(c) for c in v])
    id_column: str = attrs.field(default="stream_id", validator=lambda _i, _a, v: _identifier(v))
    instance_column: str = attrs.field(default="instance_name", validator=lambda _i, _a, v: _identifier(v))
    negated: bool = False
    may_be_missing: bool = False

    def select_sql(self) -> str:
        cols = ", ".join(self.columns)
        if self.negated:
            return (
                f"SELECT -{self.id_column}, {cols} FROM {self.table} "
                f"WHERE {self.instance_column} = %s AND {self.id_column} < -%s AND {self.id_column} >= -%s "
                f"ORDER BY {self.id_column} DESC LIMIT %s"
            )
        return (
            f"SELECT {self.id_column}, {cols} FROM {self.table} "
            f"WHERE {self.instance_column} = %s AND {self.id_column} > %s AND {self.id_column} <= %s "
            f"ORDER BY {self.id_column} LIMIT %s"
        )

    def max_id_sql(self) -> str:
        expr = f"-MIN({self.id_column})" if self.negated else f"MAX({self.id_column})"
        return f"SELECT COALESCE({expr}, 0) FROM {self.table}"


# --- sequences -----------------------------------------------------------------------


def nextval_txn(txn: Transaction, sequence: str, count: int) -> list[int]:
    """Reserve ``count`` IDs in one round trip; ascending (not necessarily contiguous)."""
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    one, many = _nextval_statements(_identifier(sequence))
    if count == 1:
        txn.execute(one)
        row = txn.fetchone()
        assert row is not None
        return [int(row[0])]
    txn.execute(many, (count,))
    row = txn.fetchone()
    assert row is not None
    return sorted(int(v) for v in row[0])


@functools.lru_cache(maxsize=64)
def sequence_in_statements(sequence: str) -> tuple[tuple[str, None], SqlValue, tuple[str, None]]:
    """The SQL of one ID of ``sequence`` taken by the statements of one round trip themselves:
    the statement that takes it (``nextval``), the ID as a parameter of those after it
    (``currval``) and the statement that reads it afterwards (``IdInStatements``)."""
    seq = _identifier(sequence)
    return ((_nextval_statements(seq)[0], None), SqlValue(f"currval('{seq}'::regclass)"),
            (Prepared(f"SELECT currval('{seq}'::regclass)"), None))


@attrs.define
class IdInStatements:
    """A stream ID taken by a transaction's statements themselves
    (``StreamIdGenerator.get_next_in_statements_txn``): ``take`` goes first among them, the
    others name the ID as ``value`` (an SQL expression, ``currval``), ``read`` runs after the
    COMMIT in the same round trip, and ``recorded(id)`` reserves the ID it read."""

    take: tuple[str, None]
    value: SqlValue
    read: tuple[str, None]
    _ids: list[int]
    stream_id: int | None = None

    def recorded(self, stream_id: int) -> int:
        """Note the ID ``read`` gave (on the pool thread, as ``get_next_txn`` notes its IDs)."""
        self._ids.append(stream_id)
        self.stream_id = stream_id
        return stream_id


@functools.lru_cache(maxsize=64)
def _nextval_statements(seq: str) -> tuple[Prepared, Prepared]:
    """``nextval`` of one ID and of several, Prepared: every event persisted runs one of them.
    The regclass cast is resolved once per statement, not once per value; one array is cheaper
    to ship than ``count`` rows."""
    return (Prepared(f"SELECT nextval('{seq}'::regclass)"),
            Prepared(f"SELECT array_agg(nextval('{seq}'::regclass)) FROM generate_series(1, %s::int)"))


def get_sequence_last_value_txn(txn: Transaction, sequence: str) -> int:
    """The largest ID the sequence has handed out (0 if none)."""
    txn.execute(f"SELECT last_value, is_called FROM {_identifier(sequence)}")
    row = txn.fetchone()
    assert row is not None
    last_value, is_called = int(row[0]), bool(row[1])
    return last_value if is_called else last_value - 1


def advance_sequence_txn(txn: Transaction, sequence: str, value: int) -> None:
    """Make the sequence's next value ``value + 1`` unless it is already past it."""
    seq = _identifier(sequence)
    # Serialise starters; GREATEST in one statement keeps the window in which a
    # concurrent nextval could be moved back over as small as it can be. (A
    # sequence behind its rows is an operator's repair situation anyway.)
    txn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"tributary_sequence:{seq}",))
    txn.execute(
        f"SELECT setval('{seq}'::regclass, GREATEST(%s, (SELECT CASE WHEN is_called THEN last_value "
        f"ELSE last_value - 1 END FROM {seq})), true)",
        (value,),
    )


def get_max_stream_id_txn(txn: Transaction, source: TableSource) -> int:
    """The largest stream ID in a backing table (0 if empty or not created yet)."""
    if source.may_be_missing and not table_exists_txn(txn, source.table):
        return 0
    txn.execute(source.max_id_sql())
    row = txn.fetchone()
    assert row is not None
    return int(row[0])


def table_exists_txn(txn: Transaction, table: str) -> bool:
    txn.execute("SELECT to_regclass(%s) IS NOT NULL", (_identifier(table),))
    row = txn.fetchone()
    assert row is not None
    return bool(row[0])


# --- persisted positions -----------------------------------------------------------


def get_stream_positions_txn(txn: Transaction, stream_name: str) -> dict[str, int]:
    """Every writer's persisted position in one stream."""
    txn.execute("SELECT instance_name, stream_id FROM stream_positions WHERE stream_name = %s", (stream_name,))
    return {str(name): int(pos) for name, pos in txn.fetchall()}


def persist_stream_position_txn(txn: Transaction, stream_name: str, instance_name: str, stream_id: int) -> None:
    """Record a writer's position; never moves a persisted position backwards.

    Committed without waiting for the WAL flush: a persisted position is only a
    lower bound (readers catch up from it; a restarted writer recovers from the
    sequence), so losing the last few to a database crash costs nothing, while
    an fsync per position change would cost the writer most of its throughput.
    """
    txn.execute("SET LOCAL synchronous_commit = off")
    txn.execute(
        """
        INSERT INTO stream_positions (stream_name, instance_name, stream_id) VALUES (%s, %s, %s)
        ON CONFLICT (stream_name, instance_name)
        DO UPDATE SET stream_id = GREATEST(stream_positions.stream_id, EXCLUDED.stream_id)
        """,
        (stream_name, instance_name, stream_id),
    )


# --- start-up barrier --------------------------------------------------------------


def get_writing_transactions_txn(txn: Transaction) -> set[tuple[int, str]]:
    """``(pid, xid)`` of every other transaction in this database that has written something.

    A transaction can only commit new rows if it holds a transaction ID already:
    a backend whose client died can finish its current statement but never
    receive another (so never a COMMIT), unless the COMMIT was already sent,
    and then the transaction has written and holds an xid.
    """
    txn.execute(
        """
        SELECT pid, backend_xid::text FROM pg_stat_activity
        WHERE datname = current_database() AND backend_xid IS NOT NULL AND pid <> pg_backend_pid()
        """
    )
    return {(int(pid), str(xid)) for pid, xid in txn.fetchall()}


# --- reading backing tables --------------------------------------------------------


_checked_tables: set[str] = set()


def _fetch_txn(
    txn: Transaction, sources: Sequence[TableSource], instance: str, after: int, upto: int, limit: int
) -> list[tuple[int, int, tuple[Any, ...]]]:
    """``(stream_id, source index, column values)`` with after < id <= upto, ascending, at most ``limit``."""
    rows: list[tuple[int, int, tuple[Any, ...]]] = []
    for index, source in enumerate(sources):
        if source.may_be_missing and source.table not in _checked_tables:
            if not table_exists_txn(txn, source.table):
                raise StreamNotAvailableError(
                    f"table {source.table!r} does not exist yet: it is created by the migration that "
                    "introduces it (see docs/streams.md), so this stream has no rows to serve"
                )
            _checked_tables.add(source.table)
        txn.execute(source.select_sql(), (instance, after, upto, limit))
        rows.extend((int(r[0]), index, tuple(r[1:])) for r in txn.fetchall())
    rows.sort(key=lambda r: r[0])
    return rows[:limit]


def get_updates_between_txn(
    txn: Transaction, sources: Sequence[TableSource], instance: str, from_id: int, to_id: int, limit: int
) -> tuple[list[tuple[int, int, tuple[Any, ...]]], int, bool]:
    """Rows written by ``instance`` with ``from_id < stream_id <= to_id``.

    Returns ``(rows, upto_id, limited)``. When more than ``limit`` rows match,
    ``upto_id`` is the last stream ID returned and ``limited`` is True; the rows
    of that last ID are all returned even if that exceeds ``limit`` (a fact is
    never split), so calling again from ``upto_id`` continues exactly.
    """
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    if to_id <= from_id:
        return [], to_id, False
    rows = _fetch_txn(txn, sources, instance, from_id, to_id, limit)
    if len(rows) < limit:
        return rows, to_id, False
    last_id = rows[-1][0]
    rows = [r for r in rows if r[0] != last_id]
    rows.extend(_fetch_txn(txn, sources, instance, last_id - 1, last_id, 2**31 - 1))
    return rows, last_id, last_id < to_id


# --- writing backing tables (one helper per stream) --------------------------------


def insert_cache_invalidations_txn(
    txn: Transaction,
    stream_id: int,
    instance_name: str,
    cache_name: str,
    keys: Iterable[tuple[str, ...] | None],
    invalidation_ts: int,
) -> None:
    """One invalidation fact: one row per key (a key of None: the whole cache)."""
    txn.execute_values(
        "INSERT INTO cache_invalidation_stream (stream_id, instance_name, cache_name, keys, invalidation_ts) "
        "VALUES %s",
        [(stream_id, instance_name, cache_name, None if k is None else list(k), invalidation_ts) for k in keys],
    )


def insert_typing_txn(
    txn: Transaction, stream_id: int, instance_name: str, room_id: str, user_ids: Sequence[str]
) -> None:
    txn.execute(
        "INSERT INTO typing_stream (stream_id, instance_name, room_id, user_ids) VALUES (%s, %s, %s, %s)",
        (stream_id, instance_name, room_id, list(user_ids)),
    )


def upsert_receipt_txn(
    txn: Transaction,
    stream_id: int,
    instance_name: str,
    room_id: str,
    receipt_type: str,
    user_id: str,
    thread_id: str | None,
    event_id: str,
    data_json: str,
) -> None:
    txn.execute(
        """
        INSERT INTO receipts (stream_id, instance_name, room_id, receipt_type, user_id, thread_id, event_id, data)
        VALUES (%s, %s, %s, %s, %s, %s, %s, %s)
        ON CONFLICT (room_id, receipt_type, user_id, thread_id) DO UPDATE SET
            stream_id = EXCLUDED.stream_id, instance_name = EXCLUDED.instance_name,
            event_id = EXCLUDED.event_id, data = EXCLUDED.data
        """,
        (stream_id, instance_name, room_id, receipt_type, user_id, thread_id, event_id, data_json),
    )


def upsert_presence_txn(
    txn: Transaction,
    stream_id: int,
    instance_name: str,
    user_id: str,
    state: str,
    status_msg: str | None,
    last_active_ts: int,
    currently_active: bool,
) -> None:
    txn.execute(
        """
        INSERT INTO presence_stream
            (stream_id, instance_name, user_id, state, status_msg, last_active_ts, currently_active)
        VALUES (%s, %s, %s, %s, %s, %s, %s)
        ON CONFLICT (user_id) DO UPDATE SET
            stream_id = EXCLUDED.stream_id, instance_name = EXCLUDED.instance_name, state = EXCLUDED.state,
            status_msg = EXCLUDED.status_msg, last_active_ts = EXCLUDED.last_active_ts,
            currently_active = EXCLUDED.currently_active
        """,
        (stream_id, instance_name, user_id, state, status_msg, last_active_ts, currently_active),
    )


def insert_device_inbox_txn(
    txn: Transaction, stream_id: int, instance_name: str, messages: Iterable[tuple[str, str, str]]
) -> None:
    """To-device messages for local devices: ``(user_id, device_id, message_json)`` rows of one fact."""
    txn.execute_values(
        "INSERT INTO device_inbox (stream_id, instance_name, user_id, device_id, message_json) VALUES %s",
        [(stream_id, instance_name, user_id, device_id, body) for user_id, device_id, body in messages],
    )


def insert_device_federation_outbox_txn(
    txn: Transaction,
    stream_id: int,
    instance_name: str,
    destination: str,
    message_id: str,
    messages_json: str,
    queued_ts: int,
) -> None:
    txn.execute(
        "INSERT INTO device_federation_outbox "
        "(stream_id, instance_name, destination, message_id, messages_json, queued_ts) "
        "VALUES (%s, %s, %s, %s, %s, %s)",
        (stream_id, instance_name, destination, message_id, messages_json, queued_ts),
    )


def upsert_account_data_txn(
    txn: Transaction,
    stream_id: int,
    instance_name: str,
    user_id: str,
    room_id: str | None,
    account_data_type: str,
    content_json: str,
) -> None:
    txn.execute(
        """
        INSERT INTO account_data (stream_id, instance_name, user_id, room_id, account_data_type, content)
        VALUES (%s, %s, %s, %s, %s, %s)
        ON CONFLICT (user_id, room_id, account_data_type) DO UPDATE SET
            stream_id = EXCLUDED.stream_id, instance_name = EXCLUDED.instance_name, content = EXCLUDED.content
        """,
        (stream_id, instance_name, user_id, room_id, account_data_type, content_json),
    )


def insert_device_list_changes_txn(
    txn: Transaction, stream_id: int, instance_name: str, changes: Iterable[tuple[str, str]]
) -> None:
    """``(user_id, device_id)`` rows of one "these devices changed" fact."""
    txn.execute_values(
        "INSERT INTO device_lists_stream (stream_id, instance_name, user_id, device_id) VALUES %s",
        [(stream_id, instance_name, user_id, device_id) for user_id, device_id in changes],
    )


def insert_federation_edu_txn(
    txn: Transaction, stream_id: int, instance_name: str, destination: str, edu_type: str, content_json: str
) -> None:
    txn.execute(
        "INSERT INTO federation_stream (stream_id, instance_name, destination, edu_type, content) "
        "VALUES (%s, %s, %s, %s, %s)",
        (stream_id, instance_name, destination, edu_type, content_json),
    )
