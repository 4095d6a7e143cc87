"""SQL for generated datasets: bulk inserts of rooms, events and federation rows.

``bench/gen_federation_dataset.py`` fills a database with a synthetic but
realistically shaped federation backlog through these functions, so that the
Spark catch-up report (``spark_jobs/catch_up``) can be tried on data of any
size. Rows go in as whole columns: one ``INSERT ... SELECT FROM unnest(...)``
statement per chunk, with every column a single array parameter, so a chunk
of 20,000 events is one round trip and one statement to plan. (COPY would be
faster still, but ``Transaction`` deliberately exposes no raw cursor.)

This module also holds the reference query the benchmark times against Spark:
the per-destination backlog as one SQL statement, and the creating and dropping
of the benchmarks' throwaway databases. It knows nothing of how the data is
shaped; the generator decides that.

Why this SQL is here and not in ``storage/``, where the project keeps all SQL: no
process of the server runs it. Only the benchmarks do, and the Spark report's
tests, which build on the benchmark's generator. It writes the server's tables
wholesale, stream positions and the events sequence included, without the stores
and ID generators that keep them consistent while a server runs: right for a
synthetic dataset loaded before any server starts, wrong anywhere else. In
``bench/`` it is not part of the installed package, and no server code can come
to depend on it.
"""

# tests: tests/spark/test_catch_up_report.py

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Final, TypeVar

import attrs
import psycopg2

from storage.database import Database, Transaction

T = TypeVar("T")

#: Rows per INSERT statement in the async wrappers.
CHUNK_ROWS: Final = 20_000


@attrs.frozen(slots=True)
class RoomRow:
    room_id: str
    room_version: str
    creator: str
    created_ts: int


@attrs.frozen(slots=True)
class EventRow:
    stream_ordering: int
    instance_name: str
    event_id: str
    room_id: str
    type: str
    state_key: str | None
    sender: str
    depth: int
    origin_server_ts: int
    is_local: bool
    json: str
    outlier: bool = False


@attrs.frozen(slots=True)
class DestinationRow:
    destination: str
    retry_last_ts: int | None
    retry_interval: int | None
    failure_ts: int | None
    last_successful_stream_ordering: int | None


@attrs.frozen(slots=True)
class DestinationRoomRow:
    destination: str
    room_id: str
    stream_ordering: int


@attrs.frozen(slots=True)
class ForwardExtremityRow:
    room_id: str
    event_id: str


@attrs.frozen(slots=True)
class StreamPositionRow:
    stream_name: str
    instance_name: str
    stream_id: int


@attrs.frozen(slots=True)
class DestinationBacklog:
    """One destination's backlog as the reference SQL computes it."""

    destination: str
    pending_rooms: int
    pending_pdus: int


# --- _txn functions -------------------------------------------------------------------


def set_server_name_txn(txn: Transaction, server_name: str, created_ts: int) -> None:
    """Record which server the database belongs to (refuses a different existing name)."""
    txn.execute("SELECT server_name FROM server_meta")
    row = txn.fetchone()
    if row is None:
        txn.execute("INSERT INTO server_meta (server_name, created_ts) VALUES (%s, %s)", (server_name, created_ts))
    elif row[0] != server_name:
        raise ValueError(f"the database belongs to server {row[0]!r}, not {server_name!r}")


def insert_rooms_txn(txn: Transaction, rows: Sequence[RoomRow]) -> None:
    txn.execute(
        """
        INSERT INTO rooms (room_id, room_version, creator, created_ts)
        SELECT * FROM unnest(%s::text[], %s::text[], %s::text[], %s::bigint[])
        """,
        (
            [r.room_id for r in rows],
            [r.room_version for r in rows],
            [r.creator for r in rows],
            [r.created_ts for r in rows],
        ),
    )


def insert_events_txn(txn: Transaction, rows: Sequence[EventRow]) -> None:
    txn.execute(
        """
        INSERT INTO events (stream_ordering, instance_name, event_id, room_id, type, state_key, sender,
                            depth, origin_server_ts, is_local, outlier, json)
        SELECT * FROM unnest(%s::bigint[], %s::text[], %s::text[], %s::text[], %s::text[], %s::text[],
                             %s::text[], %s::bigint[], %s::bigint[], %s::boolean[], %s::boolean[], %s::text[])
        """,
        (
            [r.stream_ordering for r in rows],
            [r.instance_name for r in rows],
            [r.event_id for r in rows],
            [r.room_id for r in rows],
            [r.type for r in rows],
            [r.state_key for r in rows],
            [r.sender for r in rows],
            [r.depth for r in rows],
            [r.origin_server_ts for r in rows],
            [r.is_local for r in rows],
            [r.outlier for r in rows],
            [r.json for r in rows],
        ),
    )


def insert_destinations_txn(txn: Transaction, rows: Sequence[DestinationRow]) -> None:
    txn.execute(
        """
        INSERT INTO destinations (destination, retry_last_ts, retry_interval, failure_ts,
                                  last_successful_stream_ordering)
        SELECT * FROM unnest(%s::text[], %s::bigint[], %s::bigint[], %s::bigint[], %s::bigint[])
        """,
        (
            [r.destination for r in rows],
            [r.retry_last_ts for r in rows],
            [r.retry_interval for r in rows],
            [r.failure_ts for r in rows],
            [r.last_successful_stream_ordering for r in rows],
        ),
    )


def insert_destination_rooms_txn(txn: Transaction, rows: Sequence[DestinationRoomRow]) -> None:
    """Insert (destination, room) rows; an existing pair keeps the larger stream ordering."""
    txn.execute(
        """
        INSERT INTO destination_rooms (destination, room_id, stream_ordering)
        SELECT * FROM unnest(%s::text[], %s::text[], %s::bigint[])
        ON CONFLICT (destination, room_id) DO UPDATE SET stream_ordering = EXCLUDED.stream_ordering
        WHERE destination_rooms.stream_ordering < EXCLUDED.stream_ordering
        """,
        ([r.destination for r in rows], [r.room_id for r in rows], [r.stream_ordering for r in rows]),
    )


def insert_forward_extremities_txn(txn: Transaction, rows: Sequence[ForwardExtremityRow]) -> None:
    txn.execute(
        """
        INSERT INTO event_forward_extremities (room_id, event_id)
        SELECT * FROM unnest(%s::text[], %s::text[]) ON CONFLICT DO NOTHING
        """,
        ([r.room_id for r in rows], [r.event_id for r in rows]),
    )


def upsert_stream_positions_txn(txn: Transaction, rows: Sequence[StreamPositionRow]) -> None:
    txn.execute(
        """
        INSERT INTO stream_positions (stream_name, instance_name, stream_id)
        SELECT * FROM unnest(%s::text[], %s::text[], %s::bigint[])
        ON CONFLICT (stream_name, instance_name) DO UPDATE SET stream_id = EXCLUDED.stream_id
        """,
        ([r.stream_name for r in rows], [r.instance_name for r in rows], [r.stream_id for r in rows]),
    )


def advance_events_sequence_txn(txn: Transaction, stream_ordering: int) -> None:
    """Make the events stream's next ID come after ``stream_ordering`` (never moves it back)."""
    txn.execute(
        """
        SELECT setval('events_stream_seq', GREATEST(%s, (SELECT last_value FROM events_stream_seq)))
        """,
        (stream_ordering,),
    )


def analyze_txn(txn: Transaction) -> None:
    """Refresh the planner's statistics of the tables a bulk load filled."""
    for table in ("rooms", "events", "destinations", "destination_rooms", "event_forward_extremities"):
        txn.execute(f"ANALYZE {table}")


def table_sizes_txn(txn: Transaction) -> dict[str, int]:
    """Row counts of the tables the catch-up report reads."""
    sizes = {}
    for table in ("events", "destination_rooms", "destinations", "event_forward_extremities"):
        txn.execute(f"SELECT COUNT(*) FROM {table}")
        row = txn.fetchone()
        sizes[table] = int(row[0]) if row else 0
    return sizes


def per_destination_backlog_txn(txn: Transaction) -> list[DestinationBacklog]:
    """Per destination with a backlog: rooms above its acknowledged position and the local
    events it has not acknowledged in them. A NULL position counts as nothing acknowledged.
    (Generated datasets have no catch-up in progress, so ``catch_up_from`` plays no part.)"""
    txn.execute(
        """
        WITH pending AS (
            SELECT dr.destination, dr.room_id, dr.stream_ordering AS upto,
                   COALESCE(d.last_successful_stream_ordering, 0) AS acked
            FROM destination_rooms dr
            JOIN destinations d ON d.destination = dr.destination
            WHERE dr.stream_ordering > COALESCE(d.last_successful_stream_ordering, 0)
        )
        -- LATERAL, so that both ends of each pair's range are index conditions.
        SELECT p.destination, COUNT(*), SUM(n)
        FROM pending p
        CROSS JOIN LATERAL (
            SELECT COUNT(*) AS n FROM events e
            WHERE e.room_id = p.room_id AND e.stream_ordering > p.acked AND e.stream_ordering <= p.upto
              AND e.is_local AND NOT e.outlier
        ) pdus
        GROUP BY p.destination
        """
    )
    return [DestinationBacklog(str(d), int(rooms), int(pdus)) for d, rooms, pdus in txn.fetchall()]


_DATABASE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


def create_database(admin_dsn: str, name: str) -> None:
    """Create an empty database ``name`` through the maintenance database ``admin_dsn``."""
    if not _DATABASE_NAME.match(name):
        raise ValueError(f"database names here are letters, digits and underscores, got {name!r}")
    admin = psycopg2.connect(admin_dsn)
    admin.autocommit = True
    try:
        with admin.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{name}"')
    finally:
        admin.close()


def drop_database(admin_dsn: str, name: str) -> None:
    """Drop the database ``name`` (closing its connections) through ``admin_dsn``."""
    if not _DATABASE_NAME.match(name):
        raise ValueError(f"database names here are letters, digits and underscores, got {name!r}")
    admin = psycopg2.connect(admin_dsn)
    admin.autocommit = True
    try:
        with admin.cursor() as cur:
            cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.close()


# --- async wrappers -----------------------------------------------------------------------


class DatasetStore:
    """Bulk loading for generated datasets, chunked into transactions of ``CHUNK_ROWS`` rows."""

    def __init__(self, db: Database) -> None:
        self._db = db

    async def set_server_name(self, server_name: str, created_ts: int) -> None:
        await self._db.run_interaction("dataset_server_name", set_server_name_txn, server_name, created_ts)

    async def _insert(self, name: str, insert_txn: Callable[[Transaction, Sequence[T]], None], rows: Sequence[T]) -> None:
        for chunk in _chunks(rows):
            await self._db.run_interaction(name, insert_txn, chunk)

    async def insert_rooms(self, rows: Sequence[RoomRow]) -> None:
        await self._insert("dataset_insert_rooms", insert_rooms_txn, rows)

    async def insert_events(self, rows: Sequence[EventRow]) -> None:
        await self._insert("dataset_insert_events", insert_events_txn, rows)

    async def insert_destinations(self, rows: Sequence[DestinationRow]) -> None:
        await self._insert("dataset_insert_destinations", insert_destinations_txn, rows)

    async def insert_destination_rooms(self, rows: Sequence[DestinationRoomRow]) -> None:
        await self._insert("dataset_insert_destination_rooms", insert_destination_rooms_txn, rows)

    async def insert_forward_extremities(self, rows: Sequence[ForwardExtremityRow]) -> None:
        await self._insert("dataset_insert_extremities", insert_forward_extremities_txn, rows)

    async def upsert_stream_positions(self, rows: Sequence[StreamPositionRow]) -> None:
        await self._db.run_interaction("dataset_stream_positions", upsert_stream_positions_txn, rows)

    async def advance_events_sequence(self, stream_ordering: int) -> None:
        await self._db.run_interaction("dataset_events_sequence", advance_events_sequence_txn, stream_ordering)

    async def analyze(self) -> None:
        await self._db.run_autocommit("dataset_analyze", analyze_txn)

    async def table_sizes(self) -> dict[str, int]:
        return await self._db.run_interaction("dataset_table_sizes", table_sizes_txn)

    async def per_destination_backlog(self) -> list[DestinationBacklog]:
        return await self._db.run_interaction("per_destination_backlog", per_destination_backlog_txn)


def _chunks(rows: Sequence[T]) -> list[Sequence[T]]:
    return [rows[i : i + CHUNK_ROWS] for i in range(0, len(rows), CHUNK_ROWS)]
