"""What the catch-up report reads (the JDBC pushdown queries) and writes (the output schemas).

The queries are the read side of the job: PostgreSQL runs them and Spark only
sees their results, so the aggregates PostgreSQL does well (one pass over
``destination_rooms`` with its index) never travel row by row over JDBC. The
only large read, the events to replay, is a plain range of ``events`` that
Spark splits into partitioned reads on ``stream_ordering``. Numbers put into
query text are formatted from ``int`` here and nowhere else.

A NULL ``last_successful_stream_ordering`` counts as 0: nothing acknowledged.
"Local" events are those with ``is_local`` (created by this server, so ours to
send), and outliers are never sent.
"""

# tests: tests/spark/test_catch_up_report.py

from __future__ import annotations

from typing import Final

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (
    BooleanType,
    DataType,
    DoubleType,
    LongType,
    StringType,
    StructField,
    StructType,
)

#: The tables the report needs; a database missing any of them is not a Tributary database.
REQUIRED_TABLES: Final = (
    "server_meta",
    "events",
    "event_forward_extremities",
    "destinations",
    "destination_rooms",
    "stream_positions",
)

_ACKED: Final = "COALESCE(d.last_successful_stream_ordering, 0)"

MISSING_TABLES_QUERY: Final = (
    "SELECT COALESCE(string_agg(t, ',' ORDER BY n), '') AS missing, "
    "EXISTS (SELECT 1 FROM information_schema.columns WHERE table_schema = current_schema() "
    "AND table_name = 'destinations' AND column_name = 'catch_up_from') AS has_catch_up_from "
    "FROM unnest(ARRAY["
    + ", ".join(f"'{t}'" for t in REQUIRED_TABLES)
    + "]::text[]) WITH ORDINALITY AS u(t, n) WHERE to_regclass(t) IS NULL"
)

OVERVIEW_QUERY: Final = """
SELECT (SELECT server_name FROM server_meta LIMIT 1) AS server_name,
       (SELECT COUNT(*) FROM destinations) AS destinations,
       (SELECT COUNT(*) FROM destination_rooms) AS destination_rooms,
       EXISTS (SELECT 1 FROM events) AS has_events
"""

#: Per destination: its retry state and its rooms, pending (above what it acknowledged) or not.
DESTINATION_STATS_QUERY: Final = f"""
SELECT d.destination, d.retry_last_ts, d.retry_interval, d.failure_ts,
       d.last_successful_stream_ordering,
       COUNT(dr.room_id) AS rooms,
       COUNT(dr.room_id) FILTER (WHERE dr.stream_ordering > {_ACKED}) AS pending_rooms,
       MAX(dr.stream_ordering) AS latest_stream_ordering
FROM destinations d
LEFT JOIN destination_rooms dr ON dr.destination = d.destination
GROUP BY d.destination, d.retry_last_ts, d.retry_interval, d.failure_ts, d.last_successful_stream_ordering
"""

_PENDING_FROM: Final = f"""
FROM destination_rooms dr
JOIN destinations d ON d.destination = dr.destination
WHERE dr.stream_ordering > {_ACKED}
"""


def _missed_from(has_catch_up_from: bool) -> str:
    """Where a pending room's missed events start.

    Catch-up advances the acknowledged position room by room, so a room still
    waiting can have missed events below it: when the federation sender records
    where catch-up began (``destinations.catch_up_from``, migration 0009), they
    start there.
    """
    if has_catch_up_from:
        return f"LEAST(COALESCE(d.catch_up_from, {_ACKED}), {_ACKED})"
    return _ACKED


def pending_bounds_query(has_catch_up_from: bool) -> str:
    """How many (destination, room) pairs are pending, and the stream range their events lie in."""
    return f"""
SELECT COUNT(*) AS pairs, MIN({_missed_from(has_catch_up_from)}) AS min_acked,
       MAX(dr.stream_ordering) AS max_stream_ordering
{_PENDING_FROM}"""


def pending_rooms_table(has_catch_up_from: bool) -> str:
    """Pending (destination, room) pairs: the room's newest event for the destination, and
    the position its missed events start after."""
    return f"""(
SELECT dr.destination, dr.room_id, dr.stream_ordering, {_missed_from(has_catch_up_from)} AS acked_stream_ordering
{_PENDING_FROM}) AS pending_rooms"""


#: Each room's forward extremities that are local events (what catch-up may send instead of history).
LOCAL_EXTREMITIES_QUERY: Final = """
SELECT fe.room_id, e.stream_ordering
FROM event_forward_extremities fe
JOIN events e ON e.event_id = fe.event_id
WHERE e.is_local AND NOT e.outlier
"""

STREAM_POSITIONS_TABLE: Final = "stream_positions"


def events_range_bounds_query(after: int, upto: int) -> str:
    """Count and bounds of the local events in ``(after, upto]``: what the replay will read."""
    return (
        "SELECT COUNT(*) AS events, MIN(stream_ordering) AS lo, MAX(stream_ordering) AS hi FROM events "
        f"WHERE is_local AND NOT outlier AND stream_ordering > {int(after)} AND stream_ordering <= {int(upto)}"
    )


def events_range_table(after: int, upto: int) -> str:
    """The local events in ``(after, upto]``, as a table Spark reads in stream_ordering partitions."""
    return (
        "(SELECT stream_ordering, room_id, origin_server_ts FROM events "
        f"WHERE is_local AND NOT outlier AND stream_ordering > {int(after)} AND stream_ordering <= {int(upto)}"
        ") AS replay_events"
    )


# --- output schemas ----------------------------------------------------------------------


def _schema(*fields: tuple[str, DataType, bool]) -> StructType:
    return StructType([StructField(name, kind, nullable) for name, kind, nullable in fields])


DESTINATIONS_SCHEMA: Final = _schema(
    ("destination", StringType(), False),
    ("rooms", LongType(), False),
    ("pending_rooms", LongType(), False),
    ("pending_pdus", LongType(), False),
    ("oldest_pending_ts", LongType(), True),
    ("oldest_pending_age_s", DoubleType(), True),
    ("last_successful_stream_ordering", LongType(), True),
    ("latest_stream_ordering", LongType(), True),
    ("backing_off", BooleanType(), False),
    ("failure_ts", LongType(), True),
    ("retry_last_ts", LongType(), True),
    ("retry_interval_ms", LongType(), True),
    ("retry_until_ts", LongType(), True),
    ("in_catch_up", BooleanType(), False),
    ("catch_up_transactions", LongType(), False),
    ("catch_up_pdus", LongType(), False),
    ("naive_transactions", LongType(), False),
    ("naive_pdus", LongType(), False),
)

BACKLOG_OVER_TIME_SCHEMA: Final = _schema(
    ("destination", StringType(), False),
    ("bucket_start_ts", LongType(), False),
    ("bucket_end_ts", LongType(), False),
    ("new_pdus", LongType(), False),
    ("backlog_pdus", LongType(), False),
    ("last_stream_ordering", LongType(), False),
)

WRITER_LAG_SCHEMA: Final = _schema(
    ("stream_name", StringType(), False),
    ("instance_name", StringType(), False),
    ("position", LongType(), False),
    ("furthest_position", LongType(), False),
    ("lag", LongType(), False),
)


def conform(df: DataFrame, schema: StructType) -> DataFrame:
    """``df``'s columns in ``schema``'s order and types (so the Parquet schema never drifts)."""
    return df.select(*(F.col(f.name).cast(f.dataType).alias(f.name) for f in schema.fields))
