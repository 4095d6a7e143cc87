"""The cache invalidation stream, which keeps every process's caches right.

``CacheInvalidationStream`` writes an invalidation fact (a cache's name and a
key, or the whole cache) to the ``caches`` stream in the same transaction as
the change that caused it, and invalidates this process's cache (a
``storage.caches.CacheRegistry``) once that transaction has committed; rows
other processes wrote arrive through ``process_replicated_row``. It does not
know what the caches hold, nor how rows reach other processes (replication
does).
"""

# tests: tests/integration/test_streams_caches.py

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Concatenate, ParamSpec, TypeVar

from twisted.internet.interfaces import IReactorTime

from storage.caches import CacheRegistry, K, check_key
from storage.database import Transaction
from storage.id_generators import StreamIdGenerator
from storage.stores.streams import insert_cache_invalidations_txn
from storage.streams import CacheInvalidationRow

P = ParamSpec("P")
R = TypeVar("R")


class CacheInvalidationStream:
    """Writes cache invalidations to the ``caches`` stream and applies them here.

    Use in a transaction that changes what a cache holds::

        def set_name_txn(txn, user_id, name):
            txn.execute("UPDATE ...")
            caches.invalidate_cache_and_stream_txn(txn, "get_profile", (user_id,))

        await caches.run_interaction("set_name", set_name_txn, user_id, name)

    The fact is written in that transaction (with a stream ID reserved in it);
    this process's cache is invalidated after commit; the stream ID completes
    after that, so other processes hear of it only once it is durable. A
    transaction writing to other streams too uses
    ``run_interaction_with_streams(db, name, [other_gen, caches.generator], ...)``.
    """

    def __init__(self, generator: StreamIdGenerator, registry: CacheRegistry, clock: IReactorTime) -> None:
        if generator.instance_name is None:
            raise ValueError("the cache invalidation stream needs this process to be one of its writers")
        self.generator = generator
        self.registry = registry
        self._clock = clock
        self._instance_name = generator.instance_name

    async def run_interaction(
        self, name: str, func: Callable[Concatenate[Transaction, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> R:
        """``Database.run_interaction`` in which ``invalidate_*_txn`` may be used."""
        return await self.generator.run_interaction(name, func, *args, **kwargs)

    def invalidate_cache_and_stream_txn(self, txn: Transaction, cache_name: str, keys: K | None) -> None:
        """Invalidate one key of a cache (``keys``: the key's parts; None: the whole cache)."""
        self.invalidate_caches_and_stream_txn(txn, cache_name, (keys,))

    def invalidate_caches_and_stream_txn(
        self, txn: Transaction, cache_name: str, key_list: Iterable[K | None]
    ) -> None:
        """Invalidate several keys of one cache: one stream fact, one round trip."""
        if not cache_name:
            raise ValueError("cache_name must not be empty")
        keys = [None if k is None else check_key(k) for k in key_list]
        if not keys:
            return
        stream_id = self.generator.get_next_txn(txn)
        now_ms = int(self._clock.seconds() * 1000)
        insert_cache_invalidations_txn(txn, stream_id, self._instance_name, cache_name, keys, now_ms)
        for key in keys:
            txn.call_after(self.registry.invalidate, cache_name, key)

    async def invalidate_and_stream(self, cache_name: str, keys: K | None) -> None:
        """Invalidate (here and everywhere) without another change to make."""
        await self.run_interaction("invalidate_cache", self.invalidate_cache_and_stream_txn, cache_name, keys)

    def process_replicated_row(self, instance_name: str, row: CacheInvalidationRow) -> None:
        """An invalidation another process wrote (from replication, or a gap fill)."""
        if instance_name == self._instance_name:
            return  # ours: applied after our own commit already
        self.registry.invalidate(row.cache_name, row.keys)
