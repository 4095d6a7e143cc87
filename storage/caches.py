"""In-process caches: bounded dictionaries keyed by tuples of strings, and this process's registry of them.

``DictCache`` holds values and counts its invalidations (``sequence``), so a
filler can tell that one happened during its query. ``CacheRegistry`` names
this process's caches, so an invalidation can target a cache by name and a key
(or the whole cache). Pure: no database, no streams; how an invalidation
reaches every process is ``storage.cache_invalidation``.
"""

# tests: tests/unit/storage/test_caches.py, tests/integration/test_streams_caches.py

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Generic, Protocol, TypeVar, overload

logger = logging.getLogger(__name__)

K = tuple[str, ...]
V = TypeVar("V")
D = TypeVar("D")


class InvalidatableCache(Protocol):
    """What the invalidation stream needs of a cache."""

    @property
    def name(self) -> str: ...

    def invalidate(self, key: K) -> None: ...

    def invalidate_all(self) -> None: ...


def check_key(key: object) -> K:
    """``key`` itself, once checked to be a tuple of strings (the one form of a cache key)."""
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
        check_key(key)
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
