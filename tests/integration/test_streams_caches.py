"""The cache invalidation stream on a real PostgreSQL: the fact is written in the same
transaction as the change, the local cache is invalidated after commit (before the
position moves), and another process applies the rows it reads."""

from __future__ import annotations

import pytest

from storage.cache_invalidation import CacheInvalidationStream
from storage.caches import CacheRegistry, DictCache
from storage.database import Transaction
from storage.id_generators import StreamIdError
from storage.streams import STREAMS, CacheInvalidationRow, StreamName
from tests.integration.test_streams_support import (  # noqa: F401 (fixtures)
    StreamEnv,
    module_database,
    module_database_dsn,
    streams_env,
)
from tests.twisted_plugin import reactor

CACHES = STREAMS[StreamName.CACHES]


async def make_process(env: StreamEnv, instance: str, writers: tuple[str, ...]) -> tuple[CacheInvalidationStream, DictCache[str]]:
    """One process's caches: a registry with a profile cache, and its invalidation stream."""
    registry = CacheRegistry()
    profiles: DictCache[str] = DictCache("get_profile")
    registry.register(profiles)
    generator = await env.make(CACHES, instance=instance, writers=writers)
    return CacheInvalidationStream(generator, registry, reactor), profiles


def setup_profiles_txn(txn: Transaction) -> None:
    txn.execute("CREATE TABLE IF NOT EXISTS test_profiles (user_id TEXT PRIMARY KEY, name TEXT)")
    txn.execute("TRUNCATE test_profiles")
    txn.execute("INSERT INTO test_profiles VALUES ('@a:hs', 'Alice')")


async def test_invalidation_is_written_with_the_change_and_applied_after_commit(streams_env: StreamEnv) -> None:
    await streams_env.db.run_interaction("setup", setup_profiles_txn)
    caches, profiles = await make_process(streams_env, "main", ("main",))
    profiles.set(("@a:hs",), "Alice")
    seen_at_advance: list[bool] = []
    caches.generator.add_position_listener(lambda *_: seen_at_advance.append(("@a:hs",) in profiles))

    def rename_txn(txn: Transaction, user_id: str, name: str) -> None:
        txn.execute("UPDATE test_profiles SET name = %s WHERE user_id = %s", (name, user_id))
        caches.invalidate_cache_and_stream_txn(txn, "get_profile", (user_id,))
        assert (user_id,) in profiles  # not before commit

    await caches.run_interaction("rename", rename_txn, "@a:hs", "Alicia")
    assert ("@a:hs",) not in profiles
    assert seen_at_advance == [False]  # invalidated before the position moved
    position = caches.generator.get_current_token()
    rows, _, _ = await CACHES.get_updates_between(streams_env.db, "main", 0, position, 10)
    assert [row for _, row in rows] == [CacheInvalidationRow("get_profile", ("@a:hs",), rows[0][1].invalidation_ts)]


async def test_a_failed_change_writes_no_invalidation(streams_env: StreamEnv) -> None:
    caches, profiles = await make_process(streams_env, "main", ("main",))
    profiles.set(("@a:hs",), "Alice")

    def failing_txn(txn: Transaction) -> None:
        caches.invalidate_cache_and_stream_txn(txn, "get_profile", ("@a:hs",))
        raise RuntimeError("the change failed")

    with pytest.raises(RuntimeError):
        await caches.run_interaction("failing", failing_txn)
    assert profiles.get(("@a:hs",)) == "Alice"
    position = caches.generator.get_current_token()
    assert position > 0  # the reserved ID completed: nothing is wedged
    assert (await CACHES.get_updates_between(streams_env.db, "main", 0, position, 10))[0] == []


async def test_bulk_invalidation_is_one_fact(streams_env: StreamEnv) -> None:
    caches, profiles = await make_process(streams_env, "main", ("main",))
    for user in ("@a:hs", "@b:hs", "@c:hs"):
        profiles.set((user,), user)

    def bulk_txn(txn: Transaction) -> None:
        caches.invalidate_caches_and_stream_txn(txn, "get_profile", [("@a:hs",), ("@b:hs",)])

    await caches.run_interaction("bulk", bulk_txn)
    assert len(profiles) == 1
    rows, _, _ = await CACHES.get_updates_between(streams_env.db, "main", 0, caches.generator.get_current_token(), 10)
    assert len(rows) == 2 and len({sid for sid, _ in rows}) == 1

    await caches.invalidate_and_stream("get_profile", None)
    assert len(profiles) == 0


async def test_invalidating_outside_a_stream_transaction_is_refused(streams_env: StreamEnv) -> None:
    caches, _ = await make_process(streams_env, "main", ("main",))

    def plain_txn(txn: Transaction) -> None:
        caches.invalidate_cache_and_stream_txn(txn, "get_profile", ("@a:hs",))

    with pytest.raises(StreamIdError):
        await streams_env.db.run_interaction("plain", plain_txn)


async def test_another_process_applies_what_it_reads(streams_env: StreamEnv) -> None:
    """Writer "a" invalidates; process "b" (standing in for a replication reader) hears a's
    new position, reads a's rows between its old view and the new position, and applies
    them to its own caches. Its own rows it ignores: they were applied at commit."""
    writers = ("a", "b")
    a, a_profiles = await make_process(streams_env, "a", writers)
    b, b_profiles = await make_process(streams_env, "b", writers)
    b_profiles.set(("@a:hs",), "Alice")
    b_profiles.set(("@z:hs",), "Zed")

    before = b.generator.get_position("a")
    await a.invalidate_and_stream("get_profile", ("@a:hs",))
    b.generator.advance("a", a.generator.get_local_position())
    rows, _, _ = await CACHES.get_updates_between(streams_env.db, "a", before, b.generator.get_position("a"), 100)
    for _, row in rows:
        b.process_replicated_row("a", row)
    assert ("@a:hs",) not in b_profiles and ("@z:hs",) in b_profiles

    b.process_replicated_row("b", CacheInvalidationRow("get_profile", ("@z:hs",), 0))
    assert ("@z:hs",) in b_profiles
