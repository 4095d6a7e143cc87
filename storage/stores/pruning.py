"""Deleting stream rows nobody can need any more, in bounded batches.

- ``typing_stream``: each row is a room's whole typing set, so a row with a newer
  row for the same room is superseded: a reader filling a gap gets the newer one.
- ``federation_stream``: EDUs every federation sender has acknowledged.
- ``cache_invalidation_stream``: rows older than a day (a process that was away
  longer starts again with empty caches).
- ``received_transactions``: answers to inbound ``/send`` transactions older than a
  day; a sender repeats a transaction within seconds or minutes, not days.
- ``sliding_sync_connections``: connections (with their positions and room rows)
  last used before a cut-off (storage/stores/sliding_sync.py).
"""

# tests: tests/integration/test_pruning.py

from __future__ import annotations

from storage.database import Database, Transaction
from storage.stores.sliding_sync import prune_connections_txn


def _prune_typing_txn(txn: Transaction, batch: int) -> int:
    txn.execute(
        """
        DELETE FROM typing_stream WHERE ctid IN (
            SELECT t.ctid FROM typing_stream t
            WHERE EXISTS (SELECT 1 FROM typing_stream n WHERE n.room_id = t.room_id AND n.stream_id > t.stream_id)
            LIMIT %s
        )
        """,
        (batch,),
    )
    return int(txn.rowcount)


def _prune_federation_txn(txn: Transaction, acknowledged: int, batch: int) -> int:
    txn.execute(
        "DELETE FROM federation_stream WHERE ctid IN "
        "(SELECT ctid FROM federation_stream WHERE stream_id <= %s LIMIT %s)",
        (acknowledged, batch),
    )
    return int(txn.rowcount)


def _prune_cache_invalidations_txn(txn: Transaction, before_ts: int, batch: int) -> int:
    txn.execute(
        "DELETE FROM cache_invalidation_stream WHERE ctid IN "
        "(SELECT ctid FROM cache_invalidation_stream WHERE invalidation_ts < %s LIMIT %s)",
        (before_ts, batch),
    )
    return int(txn.rowcount)


def _prune_received_transactions_txn(txn: Transaction, before_ts: int, batch: int) -> int:
    txn.execute(
        "DELETE FROM received_transactions WHERE ctid IN "
        "(SELECT ctid FROM received_transactions WHERE received_ts < %s LIMIT %s)",
        (before_ts, batch),
    )
    return int(txn.rowcount)


class PruningStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def prune_typing(self, batch: int) -> int:
        return await self._db.run_interaction("prune_typing_stream", _prune_typing_txn, batch)

    async def prune_federation(self, acknowledged: int, batch: int) -> int:
        return await self._db.run_interaction("prune_federation_stream", _prune_federation_txn, acknowledged, batch)

    async def prune_cache_invalidations(self, before_ts: int, batch: int) -> int:
        return await self._db.run_interaction(
            "prune_cache_invalidations", _prune_cache_invalidations_txn, before_ts, batch
        )

    async def prune_received_transactions(self, before_ts: int, batch: int) -> int:
        return await self._db.run_interaction(
            "prune_received_transactions", _prune_received_transactions_txn, before_ts, batch
        )

    async def prune_sliding_sync_connections(self, before_ts: int, batch: int) -> int:
        return await self._db.run_interaction(
            "prune_sliding_sync_connections", prune_connections_txn, before_ts, batch
        )
