"""A writer killed with SIGKILL while it holds reserved IDs, some with rows written in
transactions that never committed; the restarted writer's position never covers an
ID whose row could still appear.

The killed process had, at the moment of the kill:
- facts committed (their rows must stay visible, and the position must cover them);
- IDs reserved with ``get_next_mult`` and no row written yet;
- a transaction that wrote its row and sits idle (the backend aborts it as soon as
  it sees the client gone);
- a transaction that wrote its row and is still running a statement (the backend
  only notices the dead client when the statement ends, then aborts).

"Never covers an ID whose row was not written" means: every row at or below the
restarted position is visible when the restarted writer starts, and no row at or
below it appears later. IDs that were reserved and never written are covered (they
are complete: their facts have no rows), exactly as the streams document defines.

Run as a module, this file is the writer process:
``python -m tests.integration.test_streams_restart DSN INSTANCE``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.task import deferLater

from storage.stores.streams import get_stream_positions_txn
from storage.streams import STREAMS, StreamName
from tests.integration.test_streams_support import (  # noqa: F401 (fixtures)
    StreamEnv,
    module_database,
    module_database_dsn,
    streams_env,
)
from tests.twisted_plugin import reactor

REPO = Path(__file__).resolve().parents[2]
CACHES = STREAMS[StreamName.CACHES]
#: How long the still-running transaction's statement lasts: long enough that it is still
#: running when the writer restarts, however slowly a loaded machine gets there.
BUSY_STATEMENT_SECONDS = 5


def writer_main(dsn: str, instance: str) -> None:
    from homeserver.reactor import install_reactor

    reactor = install_reactor()

    from prometheus_client import CollectorRegistry
    from twisted.internet.defer import Deferred
    from twisted.python.failure import Failure

    from storage.database import Database, Transaction
    from storage.metrics import StorageMetrics
    from storage.stores.streams import insert_cache_invalidations_txn
    from storage.streams import create_id_generator

    db = Database(reactor, dsn, metrics=StorageMetrics.create(CollectorRegistry()), max_connections=4)
    db.start()

    lock = threading.Lock()

    def say(what: str, value: object) -> None:
        # Called from pool threads too: one write per line, under a lock.
        with lock:
            sys.stdout.write(json.dumps([what, value]) + "\n")
            sys.stdout.flush()

    async def main() -> None:
        gen = await create_id_generator(db, reactor, CACHES, instance_name=instance, writers=[instance])

        def commit_txn(txn: Transaction, label: str) -> int:
            stream_id = gen.get_next_txn(txn)
            insert_cache_invalidations_txn(txn, stream_id, instance, label, [None], 0)
            return stream_id

        committed = [await gen.run_interaction("commit", commit_txn, f"committed{i}") for i in range(5)]
        say("committed", committed)

        # Reserved, nothing written: the block never ends.
        held = gen.get_next_mult(3)
        say("reserved", await held.__aenter__())

        def idle_txn(txn: Transaction) -> None:
            stream_id = commit_txn(txn, "idle_uncommitted")
            say("idle", stream_id)
            time.sleep(3600)  # idle in transaction, holding its row

        def busy_txn(txn: Transaction) -> None:
            stream_id = commit_txn(txn, "busy_uncommitted")
            txn.execute("SELECT pg_backend_pid()")
            row = txn.fetchone()
            assert row is not None
            say("busy_pid", row[0])
            say("busy", stream_id)
            txn.execute("SELECT pg_sleep(%s)", (BUSY_STATEMENT_SECONDS,))

        Deferred.fromCoroutine(gen.run_interaction("idle", idle_txn))
        Deferred.fromCoroutine(gen.run_interaction("busy", busy_txn))
        await gen.flush()
        say("position", gen.get_local_position())

    def failed(failure: Failure) -> None:
        say("error", failure.getTraceback())
        os._exit(1)

    Deferred.fromCoroutine(main()).addErrback(failed)
    reactor.run()


async def busy_transaction_open(db: Any, pid: int) -> bool:
    """Whether backend ``pid`` still has a transaction that has written (holds a transaction ID)."""
    def txn(txn: Any) -> bool:
        txn.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s AND backend_xid IS NOT NULL", (pid,))
        return txn.fetchone() is not None

    return bool(await db.run_interaction("busy_transaction_open", txn))


async def sleep(seconds: float) -> None:
    await deferLater(reactor, seconds, lambda: None)


@pytest.mark.timeout(60)
async def test_restarted_writer_never_covers_a_row_that_appears_later(streams_env: StreamEnv) -> None:
    db = streams_env.db
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.test_streams_restart", streams_env.dsn, "persister"],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    said: dict[str, object] = {}
    try:
        assert process.stdout is not None
        while not {"idle", "busy", "busy_pid", "position"} <= said.keys():
            line = process.stdout.readline()
            assert line, f"writer exited early:\n{process.stderr.read() if process.stderr else ''}"
            what, value = json.loads(line)
            assert what != "error", value
            said[what] = value
        # Let the busy statement get going before the kill.
        await sleep(0.2)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()

    committed: list[int] = said["committed"]  # type: ignore[assignment]
    reserved: list[int] = said["reserved"]  # type: ignore[assignment]
    uncommitted: list[int] = [said["idle"], said["busy"]]  # type: ignore[list-item]
    in_flight = reserved + uncommitted
    persisted = (await db.run_interaction("positions", get_stream_positions_txn, "caches"))["persister"]
    assert max(committed) <= persisted < min(in_flight)

    # Restart: the writer must wait for the busy transaction to end before claiming. Whether
    # it did is read from PostgreSQL (the busy backend's transaction is over by then), not
    # from a stopwatch: how long the kill and the restart took depends on the machine.
    busy_pid: int = said["busy_pid"]  # type: ignore[assignment]
    assert await busy_transaction_open(db, busy_pid), "the busy statement ended before the restart: nothing tested"
    restarted = await streams_env.make(CACHES, instance="persister", writers=("persister",))
    assert not await busy_transaction_open(db, busy_pid), "the writer restarted while the busy transaction ran"
    position = restarted.get_local_position()
    assert position >= persisted
    assert position >= max(in_flight)

    rows_at_start, _, _ = await CACHES.get_updates_between(db, "persister", 0, position, 1000)
    await sleep(0.3)
    rows_later, _, _ = await CACHES.get_updates_between(db, "persister", 0, position, 1000)
    assert rows_later == rows_at_start
    assert [(sid, row.cache_name) for sid, row in rows_at_start] == [
        (sid, f"committed{i}") for i, sid in enumerate(committed)
    ]

    # The restarted writer carries on above everything it covers.
    async with restarted.get_next() as stream_id:
        assert stream_id > position
    assert restarted.get_local_position() == stream_id


if __name__ == "__main__":
    writer_main(sys.argv[1], sys.argv[2])
