"""In-process caches and the cache invalidation stream that keeps every process's caches right.

``CacheRegistry`` names this process's caches; an invalidation (local, or from
another process via the ``caches`` stream) targets a cache by name and a key
(a tuple of strings) or the whole cache. ``CacheInvalidationStream`` writes an
invalidation fact in the same transaction as the change that caused it, and
invalidates locally once that transaction has committed. It does not know
what the caches hold, nor how rows reach other processes (replication does).
"""

# tests: tests/unit/storage/test_caches.py, tests/integration/test_streams_caches.py

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Concatenate, Generic, ParamSpec, Protocol, TypeVar, overload

from twisted.internet.interfaces import IReactorTime

from storage.database import Transaction
from storage.id_generators import StreamIdGenerator
from storage.stores.streams import insert_cache_invalidations_txn
from storage.streams import CacheInvalidationRow

logger = logging.getLogger(__name__)

K = tuple[str, ...]
V = TypeVar("V")
D = TypeVar("D")
P = ParamSpec("P")
R = TypeVar("R")


class InvalidatableCache(Protocol):
    """What the invalidation stream needs of a cache."""

    @property
    def name(self) -> str: ...

    def invalidate(self, key: K) -> None: ...

    def invalidate_all(self) -> None: ...


def _check_key(key: object) -> K:
    if not isinstance(key, tuple) or not all(isinstance(part, str) for part in key):
        raise TypeError(f"cache keys are tuples of strings, got {key!r}")
    return key


class DictCache(Generic[V]):
    """A bounded cache keyed by tuples of strings; evicts the least recently used entry.

    ``sequence`` counts invalidations. To fill the cache from the database without
    racing an invalidation, read ``sequence`` before the query and pass it to
    ``set``: if an invalidation happened meanwhile, the (possibly stale) value is
    not stored.
    """

    def __init__(self, name: str, max_entries: int = 10_000) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self._name = name
        self._max_entries = max_entries
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._sequence = 0

    @property
    def name(self) -> str:
        return self._name

    @property
    def sequence(self) -> int:
        return self._sequence

    @overload
    def get(self, key: K) -> V | None: ...

    @overload
    def get(self, key: K, default: D) -> V | D: ...

    def get(self, key: K, default: object = None) -> object:
        try:
            value = self._entries[key]
        except KeyError:
            return default
        self._entries.move_to_end(key)
        return value

    def __contains__(self, key: K) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def set(self, key: K, value: V, *, sequence: int | None = None) -> bool:
        """Store ``value``; with ``sequence``, only if no invalidation happened since it was read."""
        _check_key(key)
        if sequence is not None and sequence != self._sequence:
            return False
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)
        return True

    def invalidate(self, key: K) -> None:
        self._sequence += 1
        self._entries.pop(key, None)

    def invalidate_all(self) -> None:
        self._sequence += 1
        self._entries.clear()


class CacheRegistry:
    """This process's caches, by name."""

    def __init__(self) -> None:
        self._caches: dict[str, InvalidatableCache] = {}

    def register(self, cache: InvalidatableCache) -> None:
        if cache.name in self._caches:
            raise ValueError(f"a cache named {cache.name!r} is already registered")
        self._caches[cache.name] = cache

    def get(self, name: str) -> InvalidatableCache | None:
        return self._caches.get(name)

    def names(self) -> list[str]:
        return sorted(self._caches)

    def invalidate(self, cache_name: str, keys: K | None) -> None:
        """Drop ``keys`` (None: everything) from the named cache, if this process has it."""
        cache = self._caches.get(cache_name)
        if cache is None:
            # Other processes may have caches this one does not.
            logger.debug("no cache %r here to invalidate", cache_name)
            return
        if keys is None:
            cache.invalidate_all()
        else:
            cache.invalidate(keys)


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
        keys = [None if k is None else _check_key(k) for k in key_list]
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
