"""Benchmark: the Spark catch-up report against the same per-destination backlog as one SQL query.

    python bench/spark_report.py --dsn postgresql://postgres@127.0.0.1:5432/tributary_spark_bench
    python bench/spark_report.py --dsn postgresql://postgres@127.0.0.1:5432/NEW_DB --generate

``--generate`` first fills a new database with bench/gen_federation_dataset.py's
shape at the issue's size (about 1,000,000 destination_rooms rows and
5,000,000 events). Then it times (1) PostgreSQL computing each destination's
pending rooms and pending PDUs in one query (``per_destination_backlog_txn``,
best of two runs) and (2) the whole Spark report (every table, chart and the
HTML page; the Spark session's start-up is timed separately), checks that the
two agree on every destination, and prints both times and their ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path

if __package__ in (None, ""):
    # Run as a file: make the repository root importable (for bench.gen_federation_dataset).
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gen_federation_dataset import DatasetShape, create_database, generate_dataset, run_with_database  # noqa: E402
from storage.database import Database  # noqa: E402
from bench.dataset import DatasetStore, DestinationBacklog  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--generate", action="store_true", help="create and fill the database first")
    parser.add_argument("--events", type=int, default=5_000_000)
    parser.add_argument("--destination-rooms", type=int, default=1_000_000)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--driver-memory", default="4g")
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--jdbc-jar", type=Path, default=Path("/usr/share/java/postgresql.jar"))
    parser.add_argument("--out", type=Path, default=Path("reports/bench"))
    args = parser.parse_args()

    now_ms = int(time.time() * 1000)
    if args.generate:
        create_database(args.dsn)
    shape = DatasetShape(
        destinations=3000, rooms=20_000, events=args.events, destination_rooms=args.destination_rooms, now_ms=now_ms
    )

    async def reference(db: Database) -> tuple[dict[str, int], list[DestinationBacklog], float]:
        if args.generate:
            from storage.prepare import prepare_database

            await prepare_database(db)
            started = time.monotonic()
            await generate_dataset(db, shape, lambda line: print(f"generate: {line}", file=sys.stderr, flush=True))
            print(f"generated in {time.monotonic() - started:.0f}s", file=sys.stderr)
        store = DatasetStore(db)
        sizes = await store.table_sizes()
        times = []
        result: list[DestinationBacklog] = []
        for _ in range(2):
            started = time.monotonic()
            result = await store.per_destination_backlog()
            times.append(time.monotonic() - started)
        return sizes, result, min(times)

    sizes, expected, sql_seconds = run_with_database(args.dsn, reference)
    print(
        f"dataset: {sizes['events']:,} events, {sizes['destination_rooms']:,} destination_rooms rows, "
        f"{sizes['destinations']:,} destinations"
    )
    print(f"PostgreSQL, one query: per-destination backlog of {len(expected):,} destinations in {sql_seconds:.2f}s")

    from spark_jobs.catch_up.job import Progress, ReportSettings, build_session, check_jdbc_driver, jdbc_source_from_url, run_report

    with ExitStack() as stack:
        started = time.monotonic()
        spark = build_session(master=args.master, jdbc_jar=args.jdbc_jar.resolve(), driver_memory=args.driver_memory)
        stack.callback(spark.stop)
        check_jdbc_driver(spark, args.jdbc_jar)
        startup = time.monotonic() - started
        source = jdbc_source_from_url(args.dsn, stack)
        started = time.monotonic()
        outcome = run_report(
            spark, source, ReportSettings(out_dir=args.out, now_ms=now_ms, partitions=args.partitions), Progress(sys.stderr)
        )
        report_seconds = time.monotonic() - started
        got = {
            r["destination"]: (int(r["pending_rooms"]), int(r["pending_pdus"]))
            for r in spark.read.parquet(str((args.out / "destinations.parquet").resolve())).collect()
            if r["pending_rooms"]
        }
    agree = got == {b.destination: (b.pending_rooms, b.pending_pdus) for b in expected}
    cores = os.cpu_count()
    print(f"Spark session start ({args.master}, {cores} cores): {startup:.1f}s")
    print(
        f"Spark report: {report_seconds:.1f}s for {outcome.replayed_events:,} replayed events, "
        f"{outcome.pending_pairs:,} pending (destination, room) pairs, {outcome.totals.pending_pdus:,} pending PDUs; "
        f"outputs in {args.out}"
    )
    print(
        f"ratio Spark report / PostgreSQL query: {report_seconds / sql_seconds:.1f}x "
        f"({(report_seconds + startup) / sql_seconds:.1f}x with session start); results agree: {agree}"
    )
    if not agree:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
