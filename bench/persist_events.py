"""Event persistence throughput and latency against a real PostgreSQL. Run by hand:

    .venv/bin/python bench/persist_events.py [--events 2000] [--dsn postgresql://postgres@127.0.0.1:5432/postgres]

Creates a scratch database, then measures local message events created and
persisted (build, sign, auth check, one transaction, stream ID completion) per
second into one room, and into 16 rooms in parallel, with p50/p99 latency of
each send. Drops the scratch database afterwards.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from homeserver.reactor import install_reactor  # noqa: E402

reactor = install_reactor()

import psycopg2  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402
from signedjson.key import generate_signing_key  # noqa: E402
from twisted.internet.defer import Deferred, gatherResults  # noqa: E402

from homeserver.events import EventTemplate, parse_create_room_request  # noqa: E402
from homeserver.handlers.rooms.event_loader import EventLoader  # noqa: E402
from homeserver.handlers.rooms.event_persistence import EventPersister, PersistenceMetrics  # noqa: E402
from homeserver.handlers.rooms.room_events import RoomEventCreator  # noqa: E402
from storage.database import Database  # noqa: E402
from storage.metrics import StorageMetrics  # noqa: E402
from storage.prepare import prepare_database  # noqa: E402
from storage.streams import StreamName, create_id_generator, get_stream  # noqa: E402

SERVER = "bench.test"
ALICE = f"@alice:{SERVER}"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def txn_breakdown(registry: CollectorRegistry) -> dict[str, tuple[float, float]]:
    """Transaction name -> (count, total seconds) so far."""
    result: dict[str, tuple[float, float]] = {}
    for metric in registry.collect():
        if metric.name == "tributary_storage_txn_duration_seconds":
            sums = {s.labels["txn"]: s.value for s in metric.samples if s.name.endswith("_sum")}
            counts = {s.labels["txn"]: s.value for s in metric.samples if s.name.endswith("_count")}
            result = {txn: (counts[txn], sums[txn]) for txn in sums}
    return result


def print_breakdown(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]], events: int) -> None:
    print("  database time per event, by transaction:")
    rows = []
    for txn, (count, total) in after.items():
        count -= before.get(txn, (0, 0))[0]
        total -= before.get(txn, (0, 0))[1]
        if count:
            rows.append((total, txn, count))
    for total, txn, count in sorted(rows, reverse=True)[:6]:
        print(f"    {txn:28} {count / events:5.2f} per event, {total / count * 1000:6.2f} ms each")


async def run(dsn: str, events: int) -> None:
    registry = CollectorRegistry()
    db = Database(reactor, dsn, metrics=StorageMetrics.create(registry), max_connections=10)
    db.start()
    try:
        await prepare_database(db)
        stream_ids = await create_id_generator(
            db, reactor, get_stream(StreamName.EVENTS), instance_name="master", writers=["master"]
        )
        from storage.stores.events import EventsStore

        store = EventsStore(db)
        loader = EventLoader(store)
        persister = EventPersister(
            store=store, loader=loader, stream_ids=stream_ids, server_name=SERVER, instance_name="master",
            metrics=PersistenceMetrics.create(CollectorRegistry()),
        )
        creator = RoomEventCreator(
            persister=persister, loader=loader, store=store, server_name=SERVER, signing_key=generate_signing_key("b"),
            default_room_version="12", clock_ms=lambda: int(time.time() * 1000),
        )

        async def send_many(room_id: str, count: int, latencies: list[float]) -> None:
            for i in range(count):
                start = time.perf_counter()
                await creator.send(room_id, EventTemplate(type="m.room.message", content={"msgtype": "m.text", "body": f"message {i}"}), ALICE)
                latencies.append(time.perf_counter() - start)

        room = await creator.create_room(ALICE, parse_create_room_request({"preset": "public_chat"}))
        await send_many(room, 50, [])  # warm up
        latencies: list[float] = []
        before = txn_breakdown(registry)
        start = time.perf_counter()
        await send_many(room, events, latencies)
        elapsed = time.perf_counter() - start
        print(f"one room, sequential: {events / elapsed:,.0f} events/s; "
              f"p50 {percentile(latencies, 0.5) * 1000:.2f} ms, p99 {percentile(latencies, 0.99) * 1000:.2f} ms")
        print_breakdown(before, txn_breakdown(registry), events)

        rooms = [await creator.create_room(ALICE, parse_create_room_request({})) for _ in range(16)]
        latencies = []
        per_room = max(1, events // 16)
        start = time.perf_counter()
        await gatherResults([Deferred.fromCoroutine(send_many(r, per_room, latencies)) for r in rooms])
        elapsed = time.perf_counter() - start
        print(f"16 rooms in parallel: {per_room * 16 / elapsed:,.0f} events/s; "
              f"p50 {percentile(latencies, 0.5) * 1000:.2f} ms, p99 {percentile(latencies, 0.99) * 1000:.2f} ms")
        print(f"(median of all sends {statistics.median(latencies) * 1000:.2f} ms; {os.cpu_count()} cores)")
    finally:
        db.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/postgres")
    args = parser.parse_args()
    name = f"tributary_bench_{os.getpid()}"
    admin = psycopg2.connect(args.dsn)
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute(f'CREATE DATABASE "{name}"')
    base = args.dsn.rpartition("/")[0]
    outcome: list[BaseException] = []

    def done(result: object) -> None:
        if hasattr(result, "value"):
            outcome.append(result.value)  # type: ignore[union-attr]
        reactor.stop()

    reactor.callWhenRunning(lambda: Deferred.fromCoroutine(run(f"{base}/{name}", args.events)).addBoth(done))
    try:
        reactor.run()
    finally:
        with admin.cursor() as cur:
            cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()
    if outcome:
        raise outcome[0]


if __name__ == "__main__":
    main()
