"""A bounded cache whose entries expire: what outbound federation remembers about other servers.

``TtlCache`` holds at most ``max_entries`` values, each for ``ttl`` seconds after
it was set; past the bound the least recently set entry goes first. Time is
passed in (``now``), so it is pure and tested with numbers. Used for resolved
server names and for remote profile and directory answers; it deliberately
knows nothing of what it holds.
"""

# tests: tests/unit/federation/test_ttl_cache.py

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class TtlCache(Generic[K, V]):
    def __init__(self, *, ttl: float, max_entries: int) -> None:
        if ttl <= 0 or max_entries < 1:
            raise ValueError(f"need ttl > 0 and max_entries >= 1, got {ttl}, {max_entries}")
        self.ttl = ttl
        self.max_entries = max_entries
        self._entries: OrderedDict[K, tuple[float, V]] = OrderedDict()

    def get(self, key: K, now: float) -> V | None:
        """The value set for ``key`` less than ``ttl`` seconds before ``now``, else None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        expires, value = entry
        if now >= expires:
            del self._entries[key]
            return None
        return value

    def set(self, key: K, value: V, now: float, *, ttl: float | None = None) -> None:
        """Remember ``value`` for ``ttl`` seconds (the cache's own by default, never longer)."""
        lifetime = self.ttl if ttl is None else min(ttl, self.ttl)
        self._entries.pop(key, None)
        self._entries[key] = (now + lifetime, value)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)
