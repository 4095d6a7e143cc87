"""In-process caches and their registry (the stream side is in tests/integration/test_streams_caches.py)."""

from __future__ import annotations

import pytest

from storage.caches import CacheRegistry, DictCache


def test_dict_cache_get_set_invalidate() -> None:
    cache: DictCache[str] = DictCache("get_profile")
    assert cache.get(("@a:hs",)) is None
    assert cache.get(("@a:hs",), "missing") == "missing"
    assert cache.set(("@a:hs",), "Alice")
    assert cache.get(("@a:hs",)) == "Alice" and ("@a:hs",) in cache
    cache.invalidate(("@a:hs",))
    assert cache.get(("@a:hs",)) is None
    cache.set(("@a:hs",), "Alice")
    cache.set(("@b:hs",), "Bob")
    cache.invalidate_all()
    assert len(cache) == 0


def test_dict_cache_evicts_least_recently_used() -> None:
    cache: DictCache[int] = DictCache("c", max_entries=2)
    cache.set(("a",), 1)
    cache.set(("b",), 2)
    cache.get(("a",))
    cache.set(("c",), 3)
    assert ("a",) in cache and ("c",) in cache and ("b",) not in cache


def test_filling_after_an_invalidation_is_refused() -> None:
    """A reader reads the sequence, queries the database (stale), and meanwhile the
    row changes and the cache is invalidated: the stale value must not be stored."""
    cache: DictCache[str] = DictCache("get_profile")
    sequence = cache.sequence
    cache.invalidate(("@a:hs",))  # the writer's after-commit invalidation
    assert not cache.set(("@a:hs",), "stale", sequence=sequence)
    assert cache.get(("@a:hs",)) is None
    assert cache.set(("@a:hs",), "fresh", sequence=cache.sequence)


def test_keys_are_tuples_of_strings() -> None:
    cache: DictCache[int] = DictCache("c")
    with pytest.raises(TypeError):
        cache.set("a", 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        cache.set((1,), 1)  # type: ignore[arg-type]


def test_registry_targets_caches_by_name() -> None:
    registry = CacheRegistry()
    profiles: DictCache[str] = DictCache("get_profile")
    rooms: DictCache[str] = DictCache("get_room")
    registry.register(profiles)
    registry.register(rooms)
    profiles.set(("@a:hs",), "Alice")
    profiles.set(("@b:hs",), "Bob")
    rooms.set(("!r:hs",), "room")
    registry.invalidate("get_profile", ("@a:hs",))
    assert ("@a:hs",) not in profiles and ("@b:hs",) in profiles
    registry.invalidate("get_profile", None)
    assert len(profiles) == 0 and len(rooms) == 1
    registry.invalidate("not_here", ("x",))  # another process's cache: ignored
    assert registry.names() == ["get_profile", "get_room"]
    with pytest.raises(ValueError, match="already registered"):
        registry.register(DictCache("get_room"))
