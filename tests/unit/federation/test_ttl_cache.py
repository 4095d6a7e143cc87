"""TtlCache: entries expire after their time to live and the oldest go first past the bound."""

from __future__ import annotations

import pytest

from homeserver.remote.ttl_cache import TtlCache


def test_entries_expire_after_their_ttl() -> None:
    cache: TtlCache[str, int] = TtlCache(ttl=60, max_entries=10)
    cache.set("a", 1, now=100)
    cache.set("b", 2, now=100, ttl=5)
    cache.set("c", 3, now=100, ttl=600)  # never longer than the cache's own ttl
    assert cache.get("a", 159.9) == 1 and cache.get("b", 104.9) == 2
    assert cache.get("b", 105) is None and cache.get("a", 160) is None and cache.get("c", 160) is None
    assert len(cache) == 0


def test_the_least_recently_set_entry_goes_first() -> None:
    cache: TtlCache[int, int] = TtlCache(ttl=60, max_entries=3)
    for n in range(3):
        cache.set(n, n, now=0)
    cache.set(0, 10, now=1)  # refreshed: now the newest
    cache.set(3, 3, now=2)
    assert len(cache) == 3 and cache.get(1, 2) is None and cache.get(0, 2) == 10


@pytest.mark.parametrize("ttl, size", [(0, 1), (1, 0)])
def test_refuses_nonsense(ttl: float, size: int) -> None:
    with pytest.raises(ValueError):
        TtlCache(ttl=ttl, max_entries=size)
