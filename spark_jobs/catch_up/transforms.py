"""The catch-up report's steps: pure DataFrame to DataFrame, no I/O, no configuration.

Each function takes the DataFrames it needs (with the columns named in its
docstring) and the numbers it depends on (``now_ms``, the catch-up threshold,
batch sizes) as arguments, so the same steps run on JDBC reads in the job and
on small hand-made frames in tests. The model of what the federation sender
sends follows docs/spark-reports.md:

- naive replay: every pending local event, ``pdus_per_transaction`` per transaction;
- forward-extremity catch-up: ``rooms_per_batch`` pending rooms at a time, oldest
  first, each sending the room's local forward extremities newer than what the
  destination acknowledged (or, when there is none, the room's newest event for
  it): one PDU per room unless the room's graph has forked; each batch split
  into transactions of at most ``pdus_per_transaction`` PDUs.
"""

# tests: tests/spark/test_catch_up_report.py

from __future__ import annotations

from typing import Final

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from spark_jobs.catch_up.schemas import (
    BACKLOG_OVER_TIME_SCHEMA,
    DESTINATIONS_SCHEMA,
    WRITER_LAG_SCHEMA,
    conform,
)

PDUS_PER_TRANSACTION: Final = 50
ROOMS_PER_BATCH: Final = 50

#: Bucket widths for backlog-over-time, smallest first: the first giving at most MAX_BUCKETS wins.
BUCKET_WIDTHS_MS: Final = tuple(
    m * 60_000 for m in (1, 5, 15, 30, 60, 3 * 60, 6 * 60, 12 * 60, 24 * 60, 7 * 24 * 60)
)
MAX_BUCKETS: Final = 120


def pending_events(events: DataFrame, pending_rooms: DataFrame, *, broadcast_rooms: bool = False) -> DataFrame:
    """Every (destination, pending local event) pair: the replay of the events stream.

    ``events``: stream_ordering, room_id, origin_server_ts (local, non-outlier events).
    ``pending_rooms``: destination, room_id, stream_ordering (the room's newest event
    for the destination), acked_stream_ordering. An event is pending for a destination
    when it is in one of the destination's pending rooms, after what the destination
    acknowledged and no later than the room's newest event for it.
    Returns destination, room_id, stream_ordering, origin_server_ts.
    """
    e = events.alias("e")
    p = (F.broadcast(pending_rooms) if broadcast_rooms else pending_rooms).alias("p")
    joined = e.join(
        p,
        (F.col("e.room_id") == F.col("p.room_id"))
        & (F.col("e.stream_ordering") > F.col("p.acked_stream_ordering"))
        & (F.col("e.stream_ordering") <= F.col("p.stream_ordering")),
    )
    return joined.select(
        F.col("p.destination").alias("destination"),
        F.col("e.room_id").alias("room_id"),
        F.col("e.stream_ordering").alias("stream_ordering"),
        F.col("e.origin_server_ts").alias("origin_server_ts"),
    )


def destination_backlog(pending: DataFrame) -> DataFrame:
    """Per destination: pending_pdus, oldest_pending_ts, oldest_pending_stream_ordering."""
    return pending.groupBy("destination").agg(
        F.count(F.lit(1)).alias("pending_pdus"),
        F.min("origin_server_ts").alias("oldest_pending_ts"),
        F.min("stream_ordering").alias("oldest_pending_stream_ordering"),
    )


def catch_up_cost(
    pending_rooms: DataFrame,
    local_extremities: DataFrame,
    *,
    rooms_per_batch: int = ROOMS_PER_BATCH,
    pdus_per_transaction: int = PDUS_PER_TRANSACTION,
) -> DataFrame:
    """Per destination with pending rooms: catch_up_pdus and catch_up_transactions.

    ``local_extremities``: room_id, stream_ordering (a forward extremity that is a
    local event). A room sends its local extremities in (acked, newest-for-destination],
    at least one PDU. Rooms go in batches of ``rooms_per_batch`` ordered by the
    room's newest event for the destination (oldest first, room_id breaking ties).
    """
    p = pending_rooms.alias("p")
    x = local_extremities.alias("x")
    per_room = (
        p.join(
            x,
            (F.col("p.room_id") == F.col("x.room_id"))
            & (F.col("x.stream_ordering") > F.col("p.acked_stream_ordering"))
            & (F.col("x.stream_ordering") <= F.col("p.stream_ordering")),
            "left",
        )
        .groupBy(F.col("p.destination"), F.col("p.room_id"), F.col("p.stream_ordering"))
        .agg(F.count(F.col("x.stream_ordering")).alias("extremities"))
        .select(
            F.col("destination"),
            F.col("room_id"),
            F.col("stream_ordering"),
            F.greatest(F.col("extremities"), F.lit(1)).alias("pdus"),
        )
    )
    order = Window.partitionBy("destination").orderBy("stream_ordering", "room_id")
    batches = (
        per_room.withColumn("batch", F.floor((F.row_number().over(order) - 1) / rooms_per_batch))
        .groupBy("destination", "batch")
        .agg(F.sum("pdus").alias("pdus"))
        .withColumn("transactions", _ceil_div(F.col("pdus"), pdus_per_transaction))
    )
    return batches.groupBy("destination").agg(
        F.sum("pdus").cast("long").alias("catch_up_pdus"),
        F.sum("transactions").cast("long").alias("catch_up_transactions"),
    )


def destinations_report(
    destination_stats: DataFrame,
    backlog: DataFrame,
    cost: DataFrame,
    *,
    now_ms: int,
    catch_up_threshold_ms: int,
    pdus_per_transaction: int = PDUS_PER_TRANSACTION,
) -> DataFrame:
    """One row per destination (DESTINATIONS_SCHEMA), most pending PDUs first.

    ``destination_stats``: destination, retry_last_ts, retry_interval, failure_ts,
    last_successful_stream_ordering, rooms, pending_rooms, latest_stream_ordering.
    Backing off: retry_last_ts + retry_interval > now. In catch-up: a pending room,
    or a retry interval past the catch-up threshold.
    """
    now = F.lit(now_ms)
    retry_until = F.col("retry_last_ts") + F.col("retry_interval")
    pending_pdus = F.coalesce(F.col("pending_pdus"), F.lit(0))
    joined = destination_stats.join(backlog, "destination", "left").join(cost, "destination", "left")
    report = joined.select(
        F.col("destination"),
        F.col("rooms"),
        F.col("pending_rooms"),
        pending_pdus.alias("pending_pdus"),
        F.col("oldest_pending_ts"),
        ((now - F.col("oldest_pending_ts")) / 1000.0).alias("oldest_pending_age_s"),
        F.col("last_successful_stream_ordering"),
        F.col("latest_stream_ordering"),
        F.coalesce(retry_until > now, F.lit(False)).alias("backing_off"),
        F.col("failure_ts"),
        F.col("retry_last_ts"),
        F.col("retry_interval").alias("retry_interval_ms"),
        retry_until.alias("retry_until_ts"),
        ((F.col("pending_rooms") > 0) | F.coalesce(F.col("retry_interval") > F.lit(catch_up_threshold_ms), F.lit(False))).alias(
            "in_catch_up"
        ),
        F.coalesce(F.col("catch_up_transactions"), F.lit(0)).alias("catch_up_transactions"),
        F.coalesce(F.col("catch_up_pdus"), F.lit(0)).alias("catch_up_pdus"),
        _ceil_div(pending_pdus, pdus_per_transaction).alias("naive_transactions"),
        pending_pdus.alias("naive_pdus"),
    )
    # One row per destination: small enough for one sorted partition (no sampling job, as orderBy has).
    return (
        conform(report, DESTINATIONS_SCHEMA)
        .coalesce(1)
        .sortWithinPartitions(F.desc("pending_pdus"), F.desc("pending_rooms"), "destination")
    )


def backlog_over_time(pending: DataFrame, *, origin_ms: int, bucket_ms: int) -> DataFrame:
    """Each destination's backlog at the end of every time bucket in which it grew (BACKLOG_OVER_TIME_SCHEMA).

    Buckets are ``bucket_ms`` wide from ``origin_ms``, by the events' origin_server_ts;
    a destination's backlog holds its value until its next row.
    """
    bucket = F.floor((F.col("origin_server_ts") - F.lit(origin_ms)) / F.lit(bucket_ms)).cast("long")
    per_bucket = (
        pending.withColumn("bucket", bucket)
        .groupBy("destination", "bucket")
        .agg(F.count(F.lit(1)).alias("new_pdus"), F.max("stream_ordering").alias("last_stream_ordering"))
    )
    running = Window.partitionBy("destination").orderBy("bucket").rowsBetween(Window.unboundedPreceding, 0)
    result = per_bucket.select(
        F.col("destination"),
        (F.lit(origin_ms) + F.col("bucket") * F.lit(bucket_ms)).alias("bucket_start_ts"),
        (F.lit(origin_ms) + (F.col("bucket") + 1) * F.lit(bucket_ms)).alias("bucket_end_ts"),
        F.col("new_pdus"),
        F.sum("new_pdus").over(running).alias("backlog_pdus"),
        F.col("last_stream_ordering"),
    )
    # Already partitioned by destination (the window): sorting within partitions needs no shuffle.
    return conform(result, BACKLOG_OVER_TIME_SCHEMA).sortWithinPartitions("destination", "bucket_start_ts")


def writer_lag(stream_positions: DataFrame) -> DataFrame:
    """Per stream and writer: its position and how far it is behind the stream's furthest writer.

    ``stream_positions``: stream_name, instance_name, stream_id.
    """
    per_stream = Window.partitionBy("stream_name")
    result = stream_positions.select(
        F.col("stream_name"),
        F.col("instance_name"),
        F.col("stream_id").alias("position"),
        F.max("stream_id").over(per_stream).alias("furthest_position"),
    ).withColumn("lag", F.col("furthest_position") - F.col("position"))
    return conform(result, WRITER_LAG_SCHEMA).coalesce(1).sortWithinPartitions("stream_name", "instance_name")


def choose_bucket_ms(span_ms: int) -> int:
    """The narrowest bucket width that covers ``span_ms`` in at most MAX_BUCKETS buckets."""
    for width in BUCKET_WIDTHS_MS:
        if span_ms <= width * MAX_BUCKETS:
            return width
    return BUCKET_WIDTHS_MS[-1]


def _ceil_div(value: Column, divisor: int) -> Column:
    return F.floor((value + F.lit(divisor - 1)) / F.lit(divisor)).cast("long")
