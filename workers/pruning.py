"""The periodic job that keeps append-only stream tables from growing without end.

Runs in one process of a deployment: the ``background`` worker when the config
has one, else the main process. Every ``interval`` seconds (and once at start) it
deletes, in batches of ``batch`` rows until none are left (``storage/stores/pruning.py``):
superseded typing rows, ``federation_stream`` EDUs that every configured federation
sender has acknowledged (``FEDERATION_ACK``; nothing while one of them has not
acknowledged since this process started), cache invalidations older than a day,
the stored answers to inbound federation transactions older than a day, and sliding sync
connections (MSC4186) unused for a week (their next request gets ``M_UNKNOWN_POS``).
"""

# tests: tests/integration/test_pruning.py

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Final

from twisted.internet.defer import Deferred
from twisted.internet.task import LoopingCall

from homeserver.roles import RoleContext
from storage.stores.pruning import PruningStore

logger = logging.getLogger(__name__)

PRUNE_INTERVAL_S: Final = 600.0
PRUNE_BATCH: Final = 10_000
CACHE_INVALIDATIONS_KEPT_MS: Final = 24 * 3600 * 1000
RECEIVED_TRANSACTIONS_KEPT_MS: Final = 24 * 3600 * 1000  # as Synapse keeps them
SLIDING_SYNC_CONNECTIONS_KEPT_MS: Final = 7 * 24 * 3600 * 1000


class StreamPruner:
    def __init__(self, store: PruningStore, clock: Any, *, federation_senders: Sequence[str],
                 interval: float = PRUNE_INTERVAL_S, batch: int = PRUNE_BATCH) -> None:
        self._store = store
        self._clock = clock
        self._senders = tuple(federation_senders)
        self._acks: dict[str, int] = {}
        self._interval = interval
        self._batch = batch
        self._loop: LoopingCall | None = None

    def on_federation_ack(self, instance: str, token: int) -> None:
        """A sender handled the federation stream up to ``token`` (replication's FEDERATION_ACK)."""
        if token > self._acks.get(instance, -1):
            self._acks[instance] = token

    def acknowledged(self) -> int | None:
        """The federation stream position every configured sender has handled, if known."""
        if not self._senders or any(sender not in self._acks for sender in self._senders):
            return None
        return min(self._acks[sender] for sender in self._senders)

    def start(self) -> None:
        loop = LoopingCall(lambda: Deferred.fromCoroutine(self._run_guarded()))
        loop.clock = self._clock
        loop.start(self._interval, now=True)
        self._loop = loop

    def stop(self) -> None:
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None

    async def _run_guarded(self) -> None:
        try:
            await self.run_once()
        except Exception:
            logger.exception("pruning stream tables failed; trying again in %.0fs", self._interval)

    async def run_once(self) -> dict[str, int]:
        """One pass; how many rows each table lost."""
        deleted = {"typing_stream": await self._drain(self._store.prune_typing)}
        acknowledged = self.acknowledged()
        if acknowledged is not None:
            deleted["federation_stream"] = await self._drain(
                lambda batch: self._store.prune_federation(acknowledged, batch))
        now_ms = int(self._clock.seconds() * 1000)
        deleted["cache_invalidation_stream"] = await self._drain(
            lambda batch: self._store.prune_cache_invalidations(now_ms - CACHE_INVALIDATIONS_KEPT_MS, batch))
        deleted["received_transactions"] = await self._drain(
            lambda batch: self._store.prune_received_transactions(now_ms - RECEIVED_TRANSACTIONS_KEPT_MS, batch))
        deleted["sliding_sync_connections"] = await self._drain(
            lambda batch: self._store.prune_sliding_sync_connections(now_ms - SLIDING_SYNC_CONNECTIONS_KEPT_MS,
                                                                     batch))
        if any(deleted.values()):
            logger.info("pruned stream tables: %s", ", ".join(f"{k} {v}" for k, v in deleted.items() if v))
        return deleted

    async def _drain(self, prune: Any) -> int:
        total = 0
        while True:
            count = int(await prune(self._batch))
            total += count
            if count < self._batch:
                return total


async def start_pruning(context: RoleContext) -> StreamPruner:
    """The ``background`` role's hook (also run by the main process when no background worker exists)."""
    pruner = StreamPruner(PruningStore(context.db), context.reactor,
                          federation_senders=context.config.federation_sender_instances)
    context.on_federation_ack(pruner.on_federation_ack)
    pruner.start()
    return pruner
