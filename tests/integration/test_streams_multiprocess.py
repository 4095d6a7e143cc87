"""Four OS processes write 10,000 facts each into one multi-writer stream on PostgreSQL,
while a reader in the test process follows them and sees every fact exactly once,
in ascending stream ID order.

The writers mix the two ways of reserving (``get_next_mult`` around a separate
transaction, and ``get_next_mult_txn`` inside the writing transaction), with
several concurrent tasks each, so IDs complete out of order within and across
processes. There is no replication here: every process learns the others'
positions by polling ``stream_positions`` (what a reader could do at start-up),
which is the slowest, laziest news a writer can get, so it exercises idle
writers claiming positions from what they have seen. When done, each writer
waits for the others (a test-only table) and keeps exchanging positions until
all four agree.

The reader only trusts positions: for each writer it reads the rows between
its last view and the writer's persisted position (``get_updates_between``),
and releases rows up to the linear position (the minimum over writers) in ID
order. If any position ever covered a fact not yet committed, that fact would
be released late, out of order, or never: the test would see it.

Run as a module, this file is the writer process:
``python -m tests.integration.test_streams_multiprocess DSN INSTANCE WRITERS COUNT SEED``.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WRITERS = ("writer1", "writer2", "writer3", "writer4")
FACTS_PER_WRITER = 10_000
STREAM = "caches"


# --- the writer process ------------------------------------------------------------------


def writer_main(dsn: str, instance: str, writers: list[str], count: int, seed: int) -> None:
    from homeserver.reactor import install_reactor

    reactor = install_reactor()

    from prometheus_client import CollectorRegistry
    from twisted.internet.defer import Deferred, gatherResults
    from twisted.internet.task import deferLater
    from twisted.python.failure import Failure

    from storage.database import Database, Transaction
    from storage.id_generators import delay_cancellation
    from storage.metrics import StorageMetrics
    from storage.stores.streams import get_stream_positions_txn
    from storage.streams import STREAMS, StreamName, create_id_generator

    db = Database(reactor, dsn, metrics=StorageMetrics.create(CollectorRegistry()), max_connections=4)
    db.start()
    rng = random.Random(seed)
    outcome: list[BaseException] = []

    def insert_txn(txn: Transaction, ids: list[int], seqnos: list[int]) -> None:
        txn.execute_values(
            "INSERT INTO cache_invalidation_stream (stream_id, instance_name, cache_name, keys, invalidation_ts) "
            "VALUES %s",
            [(i, instance, instance, [str(n)], 0) for i, n in zip(ids, seqnos, strict=True)],
        )

    def mark_done_txn(txn: Transaction) -> None:
        txn.execute("INSERT INTO test_writers_done (instance_name) VALUES (%s)", (instance,))

    def count_done_txn(txn: Transaction) -> int:
        txn.execute("SELECT count(*) FROM test_writers_done")
        row = txn.fetchone()
        assert row is not None
        return int(row[0])

    async def main() -> None:
        gen = await create_id_generator(
            db, reactor, STREAMS[StreamName.CACHES], instance_name=instance, writers=writers
        )
        polling = True

        async def poll() -> None:
            while polling:
                positions = await db.run_interaction("poll", get_stream_positions_txn, STREAM)
                for other, position in positions.items():
                    if other != instance:
                        gen.advance(other, position)
                await deferLater(reactor, 0.02, lambda: None)

        poller = Deferred.fromCoroutine(poll())
        next_seqno = 0

        def in_txn(txn: Transaction, seqnos: list[int], dawdle: bool) -> None:
            ids = gen.get_next_mult_txn(txn, len(seqnos))
            insert_txn(txn, ids, seqnos)
            if dawdle:  # a slow commit: positions must wait for it
                txn.execute("SELECT pg_sleep(0.01)")

        async def task() -> None:
            nonlocal next_seqno
            while next_seqno < count:
                n = min(rng.choice((1, 1, 1, 2, 10, 40, 80)), count - next_seqno)
                seqnos = list(range(next_seqno, next_seqno + n))
                next_seqno += n
                dawdle = rng.random() < 0.15
                if rng.random() < 0.5:
                    async with gen.get_next_mult(n) as ids:
                        if dawdle:  # slow between reserving and writing
                            await deferLater(reactor, 0.01, lambda: None)
                        await delay_cancellation(
                            Deferred.fromCoroutine(db.run_interaction("write", insert_txn, ids, seqnos))
                        )
                else:
                    # Reserved inside the writing transaction (single IDs via get_next_mult_txn too).
                    await gen.run_interaction("write_in_txn", in_txn, seqnos, dawdle)

        await gatherResults([Deferred.fromCoroutine(task()) for _ in range(6)])
        deadline = time.monotonic() + 40
        await gen.flush()
        await db.run_interaction("done", mark_done_txn)
        # Once every writer is done, positions only move up to the largest ID: keep
        # exchanging them until every writer has persisted the same one. (Before
        # that, all four may agree for a moment on a value someone's in-flight IDs
        # hold back: a writer that stopped then would hold everyone back for good.)
        while True:
            await gen.flush()
            positions = await db.run_interaction("poll", get_stream_positions_txn, STREAM)
            if (
                await db.run_interaction("count_done", count_done_txn) == len(writers)
                and all(w in positions for w in writers)
                and len({positions[w] for w in writers}) == 1
            ):
                break
            if time.monotonic() > deadline:
                tracker = gen.tracker
                raise AssertionError(
                    f"{instance} did not converge: persisted {positions}, in memory {tracker.get_positions()}, "
                    f"max seen {tracker.max_seen}, unfinished {tracker.unfinished_ids()[:10]}, "
                    f"pending reservations {tracker.pending_reservations}"
                )
            await deferLater(reactor, 0.02, lambda: None)
        polling = False
        await poller

    def failed(failure: Failure) -> None:
        outcome.append(failure.value or RuntimeError(failure.getErrorMessage()))

    def run() -> None:
        d = Deferred.fromCoroutine(main())
        d.addErrback(failed)
        d.addBoth(lambda _: reactor.stop())

    reactor.callWhenRunning(run)
    reactor.run()
    db.close()
    if outcome:
        raise outcome[0]


# --- the test ----------------------------------------------------------------------------


@pytest.mark.timeout(90)
async def test_four_writer_processes_and_a_reader_see_every_fact_once_in_order(database_dsn: str) -> None:
    from prometheus_client import CollectorRegistry
    from twisted.internet.task import deferLater

    from storage.database import Database, Transaction
    from storage.metrics import StorageMetrics
    from storage.stores.streams import get_stream_positions_txn
    from storage.streams import STREAMS, StreamName, create_id_generator
    from tests.twisted_plugin import reactor

    caches = STREAMS[StreamName.CACHES]
    db = Database(reactor, database_dsn, metrics=StorageMetrics.create(CollectorRegistry()), max_connections=4)
    db.start()

    def create_barrier_txn(txn: Transaction) -> None:
        txn.execute("CREATE TABLE test_writers_done (instance_name TEXT PRIMARY KEY)")

    await db.run_interaction("create_barrier", create_barrier_txn)

    def rows_with_id_txn(txn: Transaction, stream_id: int) -> list[tuple[int, str, list[str]]]:
        txn.execute("SELECT stream_id, instance_name, keys FROM cache_invalidation_stream WHERE stream_id = %s",
                    (stream_id,))
        return [(int(r[0]), str(r[1]), list(r[2])) for r in txn.fetchall()]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.integration.test_streams_multiprocess", database_dsn, name,
             ",".join(WRITERS), str(FACTS_PER_WRITER), str(index)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        for index, name in enumerate(WRITERS)
    ]
    try:
        reader = await create_id_generator(db, reactor, caches, instance_name="reader", writers=WRITERS)
        fetched = {w: reader.get_position(w) for w in WRITERS}
        buffered: list[tuple[int, str, str]] = []
        fetches: dict[str, list[tuple[int, int, int, int]]] = {w: [] for w in WRITERS}
        released: list[int] = []
        seen: set[tuple[str, str]] = set()
        last_released = 0
        started = time.monotonic()

        async def follow() -> None:
            nonlocal last_released
            positions = await db.run_interaction("poll", get_stream_positions_txn, STREAM)
            for writer, position in positions.items():
                reader.advance(writer, position)
            for writer in WRITERS:
                target = reader.get_position(writer)
                while fetched[writer] < target:
                    rows, upto, _ = await caches.get_updates_between(db, writer, fetched[writer], target, 5000)
                    fetches[writer].append((fetched[writer], target, upto, len(rows)))
                    for stream_id, row in rows:
                        assert row.cache_name == writer
                        buffered.append((stream_id, writer, row.keys[0]))
                    fetched[writer] = upto
            linear = reader.get_current_token()
            assert linear >= last_released
            ready = sorted(r for r in buffered if r[0] <= linear)
            buffered[:] = [r for r in buffered if r[0] > linear]
            for stream_id, writer, seqno in ready:
                if stream_id <= (released[-1] if released else 0) or (writer, seqno) in seen:
                    # Say which it is: the same row fetched twice, or two rows stored with one ID.
                    stored = await db.run_interaction("diagnose", rows_with_id_txn, stream_id)
                    raise AssertionError(
                        f"fact {writer}/{seqno} with stream ID {stream_id} released after "
                        f"{released[-1] if released else 0} (seen before: {(writer, seqno) in seen}); rows stored "
                        f"with that ID: {stored}; the last fetches of {writer} (from, to, upto, rows): "
                        f"{fetches[writer][-5:]}; the reader's current token {linear}, last released {last_released}")
                seen.add((writer, seqno))
                released.append(stream_id)
            last_released = linear

        while any(p.poll() is None for p in processes):
            assert time.monotonic() - started < 80, "writers took too long"
            await follow()
            await deferLater(reactor, 0.01, lambda: None)
        # Every failed writer's error: one that fails holds the others back, and theirs is then
        # only "did not converge".
        failures = []
        for name, p in zip(WRITERS, processes):
            out, err = p.communicate()
            if p.returncode != 0:
                failures.append(f"{name} failed:\n{err.decode()[-2000:]}")
        assert not failures, "\n".join(failures)
        await follow()

        assert buffered == []
        assert len(seen) == len(WRITERS) * FACTS_PER_WRITER
        assert seen == {(w, str(n)) for w in WRITERS for n in range(FACTS_PER_WRITER)}
        assert reader.get_current_token() == released[-1]
        assert len(set(reader.get_positions().values())) == 1  # converged
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
        db.close()


def _main(argv: list[str]) -> None:
    dsn, instance, writers, count, seed = argv
    writer_main(dsn, instance, writers.split(","), int(count), int(seed))


if __name__ == "__main__":
    _main(sys.argv[1:])

