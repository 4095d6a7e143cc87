# tests: tests/integration/test_streams_generators.py (the generator this measures)
"""Benchmark: stream IDs reserved and completed per second, against the local PostgreSQL.

Creates a scratch database (via ``--admin-dsn``, default
``postgresql://postgres@127.0.0.1:5432/postgres``), applies the migrations,
measures, and drops it. Uses the ``caches`` stream's generator exactly as a
writer does: ``nextval`` round trips on the thread pool, position tracking,
listeners, and the background persistence of the position. No fact rows are
written (except in the last, labelled line), so this is the cost of the ID
machinery itself.

    .venv/bin/python bench/stream_ids.py [--seconds 3] [--admin-dsn DSN]

Prints IDs per second for:

- a baseline: bare ``nextval`` transactions through ``Database.run_interaction``,
  one at a time (the database round trips every other figure is built on);
- one writer, one at a time, sequential: ``async with gen.get_next()`` in a loop
  (one nextval round trip each: a latency figure);
- one writer, one at a time, 64 concurrent requests: the same call from 64
  coroutines, as a busy server makes it (concurrent requests share round trips);
- one writer, batches of 100: ``async with gen.get_next_mult(100)`` in a loop,
  then from 8 concurrent coroutines (their requests share round trips);
- 4 writer processes together, one at a time (64 concurrent each) and batches
  of 100 (8 concurrent each);
- one writer, reserve + write a row + complete in one transaction, one at a time.

Targets (issue 3): >= 5,000/s one at a time, >= 100,000/s batched, on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TARGET_ONE_AT_A_TIME = 5_000
TARGET_BATCHED = 100_000
CONCURRENCY = 64
BATCH = 100
BATCH_CONCURRENCY = 8
WRITERS = 4


def _with_dbname(dsn: str, dbname: str) -> str:
    base, _, _ = dsn.rpartition("/")
    return f"{base}/{dbname}"


async def _measure(gen: Any, mode: str, seconds: float, concurrency: int) -> int:
    """IDs reserved and completed by ``concurrency`` loops running for ``seconds``."""
    from twisted.internet.defer import Deferred, gatherResults

    deadline = time.perf_counter() + seconds
    counts = [0] * concurrency

    async def loop(slot: int) -> None:
        while time.perf_counter() < deadline:
            if mode == "one":
                async with gen.get_next():
                    pass
                counts[slot] += 1
            else:
                async with gen.get_next_mult(BATCH):
                    pass
                counts[slot] += BATCH

    await gatherResults([Deferred.fromCoroutine(loop(i)) for i in range(concurrency)])
    return sum(counts)


async def _measure_baseline(db: Any, seconds: float) -> int:
    """The floor under every figure: bare ``nextval`` transactions, one at a time."""
    from storage.stores.streams import nextval_txn

    deadline = time.perf_counter() + seconds
    count = 0
    while time.perf_counter() < deadline:
        await db.run_interaction("bench_nextval", nextval_txn, "cache_invalidation_stream_seq", 1)
        count += 1
    return count


async def _measure_with_row(db: Any, gen: Any, seconds: float) -> int:
    from storage.database import Transaction
    from storage.stores.streams import insert_cache_invalidations_txn

    def write_txn(txn: Transaction) -> None:
        insert_cache_invalidations_txn(txn, gen.get_next_txn(txn), "bench", "bench", [None], 0)

    deadline = time.perf_counter() + seconds
    count = 0
    while time.perf_counter() < deadline:
        await gen.run_interaction("bench_write", write_txn)
        count += 1
    return count


def _run(coro_factory: Any) -> Any:
    """Run ``coro_factory(reactor)`` on a fresh asyncio reactor and return its result."""
    from homeserver.reactor import install_reactor

    reactor = install_reactor()
    from twisted.internet.defer import Deferred

    outcome: dict[str, Any] = {}

    def start() -> None:
        d = Deferred.fromCoroutine(coro_factory(reactor))
        d.addCallbacks(lambda r: outcome.setdefault("result", r), lambda f: outcome.setdefault("error", f))
        d.addBoth(lambda _: reactor.stop())

    reactor.callWhenRunning(start)
    reactor.run()
    if "error" in outcome:
        outcome["error"].raiseException()
    return outcome["result"]


def _database(reactor: Any, dsn: str) -> Any:
    from prometheus_client import CollectorRegistry

    from storage.database import Database
    from storage.metrics import StorageMetrics

    db = Database(reactor, dsn, metrics=StorageMetrics.create(CollectorRegistry()), max_connections=8)
    db.start()
    return db


async def _generator(reactor: Any, db: Any, instance: str, writers: list[str]) -> Any:
    from storage.streams import STREAMS, StreamName, create_id_generator

    return await create_id_generator(db, reactor, STREAMS[StreamName.CACHES], instance_name=instance, writers=writers)


def worker(dsn: str, instance: str, start_at: float, seconds: float) -> None:
    """One of the writer processes: two timed phases, starting at wall-clock ``start_at``."""

    async def main(reactor: Any) -> dict[str, int]:
        from twisted.internet.task import deferLater

        db = _database(reactor, dsn)
        gen = await _generator(reactor, db, instance, [f"w{i}" for i in range(WRITERS)])
        results = {}
        for phase, mode, concurrency in ((0, "one", CONCURRENCY), (1, "batch", BATCH_CONCURRENCY)):
            begin = start_at + phase * (seconds + 1.0)
            await deferLater(reactor, max(0.0, begin - time.time()), lambda: None)
            results[mode] = await _measure(gen, mode, seconds, concurrency)
        await gen.flush()
        db.close()
        return results

    print(json.dumps(_run(main)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each measurement")
    parser.add_argument("--admin-dsn", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--worker", nargs=3, metavar=("DSN", "INSTANCE", "START_AT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        dsn, instance, start_at = args.worker
        worker(dsn, instance, float(start_at), args.seconds)
        return

    import psycopg2

    name = f"tributary_bench_{uuid.uuid4().hex[:12]}"
    admin = psycopg2.connect(args.admin_dsn)
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute(f'CREATE DATABASE "{name}"')
    dsn = _with_dbname(args.admin_dsn, name)
    try:
        seconds = args.seconds

        async def single(reactor: Any) -> dict[str, int]:
            from storage.prepare import prepare_database

            db = _database(reactor, dsn)
            await prepare_database(db)
            gen = await _generator(reactor, db, "main", ["main"])
            results = {
                "baseline": await _measure_baseline(db, seconds),
                "sequential": await _measure(gen, "one", seconds, 1),
                "concurrent": await _measure(gen, "one", seconds, CONCURRENCY),
                "batch": await _measure(gen, "batch", seconds, 1),
                "batch_concurrent": await _measure(gen, "batch", seconds, BATCH_CONCURRENCY),
                "with_row": await _measure_with_row(db, gen, seconds),
            }
            await gen.flush()
            db.close()
            return results

        one = _run(single)
        start_at = time.time() + 3.0  # time for the processes to start and connect
        processes = [
            subprocess.Popen(
                [sys.executable, __file__, "--seconds", str(seconds), "--worker", dsn, f"w{i}", str(start_at)],
                stdout=subprocess.PIPE,
                text=True,
                env=dict(os.environ),
            )
            for i in range(WRITERS)
        ]
        many = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in processes]
        if any(p.returncode for p in processes):
            raise SystemExit("a writer process failed")
    finally:
        with admin.cursor() as cur:
            cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()

    def rate(count: int) -> str:
        return f"{count / seconds:>12,.0f} IDs/s"

    def verdict(count: int, target: int) -> str:
        return f"(target {target:,}/s: {'met' if count / seconds >= target else 'NOT met'})"

    print(f"stream IDs reserved + completed, {os.cpu_count()} CPUs, {seconds:g} s per figure")
    print(f"baseline: Database.run_interaction(nextval), one at a time  {rate(one['baseline'])}")
    print(f"one writer, one at a time, sequential     {rate(one['sequential'])}")
    print(
        f"one writer, one at a time, {CONCURRENCY} concurrent  {rate(one['concurrent'])}  "
        f"{verdict(one['concurrent'], TARGET_ONE_AT_A_TIME)}"
    )
    print(f"one writer, batches of {BATCH}              {rate(one['batch'])}  {verdict(one['batch'], TARGET_BATCHED)}")
    print(
        f"one writer, batches of {BATCH}, {BATCH_CONCURRENCY} concurrent   {rate(one['batch_concurrent'])}  "
        f"{verdict(one['batch_concurrent'], TARGET_BATCHED)}"
    )
    print(f"{WRITERS} writer processes, one at a time      {rate(sum(r['one'] for r in many))}")
    print(f"{WRITERS} writer processes, batches of {BATCH}     {rate(sum(r['batch'] for r in many))}")
    print(f"one writer, reserve + row + complete in one transaction  {rate(one['with_row'])}")


if __name__ == "__main__":
    main()
