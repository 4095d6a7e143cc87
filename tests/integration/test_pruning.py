"""Stream table pruning against PostgreSQL: what goes, and what a reader could still need stays."""

from __future__ import annotations

from twisted.internet.task import Clock

from storage.database import Database, Transaction
from storage.stores.pruning import PruningStore
from workers.pruning import (
    CACHE_INVALIDATIONS_KEPT_MS, RECEIVED_TRANSACTIONS_KEPT_MS, SLIDING_SYNC_CONNECTIONS_KEPT_MS, StreamPruner,
)

NOW_MS = 10 * CACHE_INVALIDATIONS_KEPT_MS


def _fill_txn(txn: Transaction) -> None:
    for stream_id, room, users in ((1, "!a", ["@x"]), (2, "!b", ["@y"]), (3, "!a", []), (4, "!a", ["@z"])):
        txn.execute("INSERT INTO typing_stream VALUES (%s, 'master', %s, %s)", (stream_id, room, users))
    for stream_id in range(1, 6):
        txn.execute("INSERT INTO federation_stream VALUES (%s, 'master', 'b.org', 'm.typing', '{}')", (stream_id,))
    for stream_id, ts in ((1, NOW_MS - CACHE_INVALIDATIONS_KEPT_MS - 1), (2, NOW_MS - 1000)):
        txn.execute("INSERT INTO cache_invalidation_stream (stream_id, instance_name, cache_name, keys, "
                    "invalidation_ts) VALUES (%s, 'master', 'c', NULL, %s)", (stream_id, ts))
    for txn_id, ts in (("old", NOW_MS - RECEIVED_TRANSACTIONS_KEPT_MS - 1), ("recent", NOW_MS - 60_000)):
        txn.execute("INSERT INTO received_transactions VALUES ('b.org', %s, '{}', %s)", (txn_id, ts))
    for conn_id, ts in (("stale", NOW_MS - SLIDING_SYNC_CONNECTIONS_KEPT_MS - 1), ("used", NOW_MS - 60_000)):
        txn.execute("INSERT INTO sliding_sync_connections (user_id, device_id, conn_id, created_ts, last_used_ts) "
                    "VALUES ('@u:x', 'D', %s, 0, %s) RETURNING connection_key", (conn_id, ts))
        row = txn.fetchone()
        assert row is not None
        txn.execute("INSERT INTO sliding_sync_positions (connection_key, token, created_ts) VALUES (%s, 's', 0)",
                    (row[0],))


def _connections_txn(txn: Transaction) -> tuple[list[str], int]:
    txn.execute("SELECT conn_id FROM sliding_sync_connections ORDER BY conn_id")
    conns = [str(r[0]) for r in txn.fetchall()]
    txn.execute("SELECT count(*) FROM sliding_sync_positions")
    row = txn.fetchone()
    assert row is not None
    return conns, int(row[0])


def _left_txn(txn: Transaction) -> tuple[list[tuple[int, str]], list[int], list[int]]:
    txn.execute("SELECT stream_id, room_id FROM typing_stream ORDER BY stream_id")
    typing = [(int(r[0]), str(r[1])) for r in txn.fetchall()]
    txn.execute("SELECT stream_id FROM federation_stream ORDER BY stream_id")
    federation = [int(r[0]) for r in txn.fetchall()]
    txn.execute("SELECT stream_id FROM cache_invalidation_stream ORDER BY stream_id")
    return typing, federation, [int(r[0]) for r in txn.fetchall()]


def _answers_txn(txn: Transaction) -> list[str]:
    txn.execute("SELECT transaction_id FROM received_transactions ORDER BY transaction_id")
    return [str(r[0]) for r in txn.fetchall()]


async def test_pruning_keeps_what_readers_need(database: Database) -> None:
    await database.run_interaction("fill", _fill_txn)
    clock = Clock()
    clock.advance(NOW_MS / 1000)
    pruner = StreamPruner(PruningStore(database), clock, federation_senders=["fs1", "fs2"], batch=1)

    pruner.on_federation_ack("fs1", 4)  # fs2 has not acknowledged anything yet: keep every EDU
    assert await pruner.run_once() == {"typing_stream": 2, "cache_invalidation_stream": 1, "received_transactions": 1,
                                       "sliding_sync_connections": 1}
    # A sliding sync connection unused for a week goes, with its positions.
    assert await database.run_interaction("connections", _connections_txn) == (["used"], 1)
    typing, federation, caches = await database.run_interaction("left", _left_txn)
    assert typing == [(2, "!b"), (4, "!a")]  # each room's newest typing set
    assert federation == [1, 2, 3, 4, 5] and caches == [2]
    assert await database.run_interaction("answers", _answers_txn) == ["recent"]

    pruner.on_federation_ack("fs2", 3)
    pruner.on_federation_ack("fs2", 2)  # older news changes nothing
    assert (await pruner.run_once())["federation_stream"] == 3  # up to the slower sender
    assert (await database.run_interaction("left", _left_txn))[1] == [4, 5]
