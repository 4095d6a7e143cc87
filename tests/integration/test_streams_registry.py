"""The stream registry on a real PostgreSQL: every stream's table, sequence, rows and
``get_updates_between`` (limits, multi-row facts, writers); the instance map."""

from __future__ import annotations

from typing import Any

import pytest
from twisted.internet.defer import Deferred, gatherResults

from storage.database import Transaction
from storage.id_generators import StreamIdGenerator
from storage.stores import streams as sql
from storage.stores.instance_map import InstanceMap, get_or_create_instance_id_txn
from storage.stores.streams import table_exists_txn
from storage.streams import (
    STREAMS,
    AccountDataStreamRow,
    BoundStream,
    CacheInvalidationRow,
    DeviceListsStreamRow,
    FederationStreamRow,
    PresenceStreamRow,
    ReceiptsStreamRow,
    StreamName,
    StreamNotAvailableError,
    StreamRowError,
    ToDeviceStreamRow,
    TypingStreamRow,
    get_stream,
)
from tests.integration.test_streams_support import (  # noqa: F401 (fixtures)
    StreamEnv,
    module_database,
    module_database_dsn,
    streams_env,
)


def test_every_stream_named_in_the_design_is_registered() -> None:
    assert {name.value for name in STREAMS} == {
        "events", "backfill", "caches", "typing", "receipts", "presence",
        "to_device", "account_data", "device_lists", "federation",
    }  # fmt: skip
    for name, stream in STREAMS.items():
        assert stream.name is name
        assert get_stream(name.value) is stream
    with pytest.raises(KeyError, match="known streams"):
        get_stream("nope")


async def write(gen: StreamIdGenerator, func: Any, *args: Any) -> int:
    """Write one fact with ``func(txn, stream_id, instance, *args)``; return its ID."""

    def txn_func(txn: Transaction) -> int:
        stream_id = gen.get_next_txn(txn)
        assert gen.instance_name is not None
        func(txn, stream_id, gen.instance_name, *args)
        return stream_id

    return await gen.run_interaction("write_fact", txn_func)


# One fact per stream, and the row each should come back as.
FACTS: list[tuple[StreamName, Any, tuple[Any, ...], list[Any]]] = [
    (
        StreamName.CACHES,
        sql.insert_cache_invalidations_txn,
        ("get_profile", [("@a:hs",), None], 123),
        [CacheInvalidationRow("get_profile", ("@a:hs",), 123), CacheInvalidationRow("get_profile", None, 123)],
    ),
    (
        StreamName.TYPING,
        sql.insert_typing_txn,
        ("!r:hs", ["@a:hs", "@b:hs"]),
        [TypingStreamRow("!r:hs", ("@a:hs", "@b:hs"))],
    ),
    (
        StreamName.RECEIPTS,
        sql.upsert_receipt_txn,
        ("!r:hs", "m.read", "@a:hs", None, "$e", "{}"),
        [ReceiptsStreamRow("!r:hs", "m.read", "@a:hs", None, "$e", "{}")],
    ),
    (
        StreamName.PRESENCE,
        sql.upsert_presence_txn,
        ("@a:hs", "online", None, 1000, True),
        [PresenceStreamRow("@a:hs", "online", None, 1000, True)],
    ),
    (
        StreamName.TO_DEVICE,
        sql.insert_device_inbox_txn,
        ([("@a:hs", "DEV", "{}")],),
        [ToDeviceStreamRow("@a:hs")],
    ),
    (
        StreamName.ACCOUNT_DATA,
        sql.upsert_account_data_txn,
        ("@a:hs", None, "m.direct", "{}"),
        [AccountDataStreamRow("@a:hs", None, "m.direct")],
    ),
    (
        StreamName.DEVICE_LISTS,
        sql.insert_device_list_changes_txn,
        ([("@a:hs", "DEV")],),
        [DeviceListsStreamRow("@a:hs", "DEV")],
    ),
    (
        StreamName.FEDERATION,
        sql.insert_federation_edu_txn,
        ("other.example", "m.typing", "{}"),
        [FederationStreamRow("other.example", "m.typing", "{}")],
    ),
]


@pytest.mark.parametrize(("name", "insert", "args", "expected"), FACTS, ids=[f[0].value for f in FACTS])
async def test_each_stream_round_trips_a_fact(
    streams_env: StreamEnv, name: StreamName, insert: Any, args: tuple[Any, ...], expected: list[Any]
) -> None:
    stream = STREAMS[name]
    gen = await streams_env.make(stream)
    stream_id = await write(gen, insert, *args)
    assert gen.get_current_token() == stream_id
    rows, upto, limited = await stream.get_updates_between(streams_env.db, "main", 0, stream_id, 100)
    assert sorted((r for _, r in rows), key=repr) == sorted(expected, key=repr)
    assert {sid for sid, _ in rows} == {stream_id}
    assert (upto, limited) == (stream_id, False)
    for _, row in rows:
        assert stream.row_from_json(stream.row_to_json(row)) == row
        assert stream.row_from_tuple(stream.row_to_tuple(row)) == row
    # Nothing from another writer, nothing outside the range.
    assert (await stream.get_updates_between(streams_env.db, "other", 0, stream_id, 100))[0] == []
    assert (await stream.get_updates_between(streams_env.db, "main", stream_id, stream_id + 5, 100))[0] == []


async def test_limits_never_split_a_fact(streams_env: StreamEnv) -> None:
    """Facts of 1, 3 and 1 rows; asking for 2 rows at a time returns the 3-row fact whole."""
    stream = STREAMS[StreamName.TO_DEVICE]
    gen = await streams_env.make(stream)
    first = await write(gen, sql.insert_device_inbox_txn, [("@a:hs", "D1", "{}")])
    second = await write(gen, sql.insert_device_inbox_txn, [("@b:hs", "D", "{}"), ("@c:hs", "D", "{}"), ("@d:hs", "D", "{}")])
    third = await write(gen, sql.insert_device_inbox_txn, [("@e:hs", "D", "{}")])

    rows, upto, limited = await stream.get_updates_between(streams_env.db, "main", 0, third, 2)
    assert [sid for sid, _ in rows] == [first, second, second, second]
    assert (upto, limited) == (second, True)
    rows, upto, limited = await stream.get_updates_between(streams_env.db, "main", upto, third, 2)
    assert [(sid, r.entity) for sid, r in rows] == [(third, "@e:hs")]
    assert (upto, limited) == (third, False)
    rows, upto, limited = await stream.get_updates_between(streams_env.db, "main", 0, third, 1)
    assert [sid for sid, _ in rows] == [first] and (upto, limited) == (first, True)


async def test_to_device_merges_both_tables_in_id_order(streams_env: StreamEnv) -> None:
    stream = STREAMS[StreamName.TO_DEVICE]
    gen = await streams_env.make(stream)
    a = await write(gen, sql.insert_device_federation_outbox_txn, "remote.example", "m1", "{}", 0)
    b = await write(gen, sql.insert_device_inbox_txn, [("@a:hs", "D", "{}")])
    c = await write(gen, sql.insert_device_federation_outbox_txn, "other.example", "m2", "{}", 0)
    rows, _, _ = await stream.get_updates_between(streams_env.db, "main", 0, c, 10)
    assert [(sid, r.entity) for sid, r in rows] == [(a, "remote.example"), (b, "@a:hs"), (c, "other.example")]


async def test_an_updated_receipt_moves_to_its_new_stream_id(streams_env: StreamEnv) -> None:
    stream = STREAMS[StreamName.RECEIPTS]
    gen = await streams_env.make(stream)
    await write(gen, sql.upsert_receipt_txn, "!r:hs", "m.read", "@a:hs", None, "$1", "{}")
    second = await write(gen, sql.upsert_receipt_txn, "!r:hs", "m.read", "@a:hs", None, "$2", "{}")
    rows, _, _ = await stream.get_updates_between(streams_env.db, "main", 0, second, 10)
    assert [(sid, r.event_id) for sid, r in rows] == [(second, "$2")]


def insert_event_txn(txn: Transaction, stream_ordering: int, instance: str, event_id: str) -> None:
    txn.execute(
        "INSERT INTO events (stream_ordering, instance_name, event_id, room_id, type, state_key, sender, "
        "depth, origin_server_ts, is_local, json) VALUES (%s, %s, %s, '!r:hs', 'm.room.message', NULL, "
        "'@a:hs', 1, 0, TRUE, '{}')",
        (stream_ordering, instance, event_id),
    )


async def test_events_and_backfill_read_the_events_table(streams_env: StreamEnv) -> None:
    """Events are stored with stream_ordering = events stream ID; backfilled ones with
    stream_ordering = -(backfill stream ID), so both streams' positions increase."""
    db = streams_env.db
    if not await db.run_interaction("exists", table_exists_txn, "events"):
        for name in (StreamName.EVENTS, StreamName.BACKFILL):
            with pytest.raises(StreamNotAvailableError, match="does not exist yet"):
                await STREAMS[name].get_updates_between(db, "main", 0, 10, 10)
        return
    events_gen = await streams_env.make(STREAMS[StreamName.EVENTS])
    backfill_gen = await streams_env.make(STREAMS[StreamName.BACKFILL])
    live = [await write(events_gen, insert_event_txn, f"$live{i}") for i in range(3)]
    old = [await write(backfill_gen, lambda txn, sid, inst: insert_event_txn(txn, -sid, inst, f"$old{sid}"))
           for _ in range(3)]  # fmt: skip
    rows, upto, limited = await STREAMS[StreamName.EVENTS].get_updates_between(db, "main", 0, live[-1], 2)
    assert [(sid, row.event_id) for sid, row in rows] == [(live[0], "$live0"), (live[1], "$live1")]
    assert (upto, limited) == (live[1], True)
    rows, upto, limited = await STREAMS[StreamName.BACKFILL].get_updates_between(db, "main", 0, old[-1], 10)
    assert [sid for sid, _ in rows] == old and [r.event_id for _, r in rows] == [f"$old{i}" for i in old]
    assert (upto, limited) == (old[-1], False)
    rows, _, _ = await STREAMS[StreamName.BACKFILL].get_updates_between(db, "main", old[0], old[1], 10)
    assert [sid for sid, _ in rows] == [old[1]]


async def test_a_table_from_a_later_migration_is_reported_clearly(streams_env: StreamEnv) -> None:
    source = sql.TableSource("no_such_table_yet", ("x",), may_be_missing=True)
    with pytest.raises(StreamNotAvailableError, match="does not exist yet"):
        await streams_env.db.run_interaction("read", sql.get_updates_between_txn, (source,), "main", 0, 10, 10)
    assert await streams_env.db.run_interaction("max", sql.get_max_stream_id_txn, source) == 0


async def test_bound_stream_is_what_replication_reads(streams_env: StreamEnv) -> None:
    stream = STREAMS[StreamName.CACHES]
    gen = await streams_env.make(stream)
    stream_id = await write(gen, sql.insert_cache_invalidations_txn, "get_profile", [("@a:hs",)], 7)
    bound = BoundStream(stream, streams_env.db, gen)
    assert bound.name == "caches"
    assert bound.current_position("main") == stream_id
    rows, upto, limited = await bound.get_updates_between("main", 0, stream_id, 100)
    assert rows == [(stream_id, ("get_profile", ("@a:hs",), 7))]
    assert stream.row_from_tuple(rows[0][1]) == CacheInvalidationRow("get_profile", ("@a:hs",), 7)


def test_rows_from_json_are_checked() -> None:
    caches = STREAMS[StreamName.CACHES]
    row = caches.row_from_json({"cache_name": "c", "keys": ["a", "b"], "invalidation_ts": 5})
    assert row == CacheInvalidationRow("c", ("a", "b"), 5)
    assert caches.row_to_json(row) == {"cache_name": "c", "keys": ("a", "b"), "invalidation_ts": 5}
    assert caches.row_to_tuple(row) == ("c", ("a", "b"), 5)
    assert caches.row_from_tuple(["c", None, 5]) == CacheInvalidationRow("c", None, 5)
    with pytest.raises(StreamRowError, match="expected 3 values"):
        caches.row_from_tuple(["c"])
    with pytest.raises(StreamRowError, match="missing fields"):
        caches.row_from_json({"cache_name": "c"})
    with pytest.raises(StreamRowError, match="unexpected fields"):
        caches.row_from_json({"cache_name": "c", "keys": None, "invalidation_ts": 5, "x": 1})


async def test_instance_ids_are_dense_stable_and_race_safe(streams_env: StreamEnv) -> None:
    """Many connections ask at once for IDs of overlapping names: every name gets one
    ID, the same on every ask, and the IDs are 1..n."""
    db = streams_env.db
    names = [f"worker{i % 6}" for i in range(30)]
    ids = await gatherResults(
        [
            Deferred.fromCoroutine(db.run_interaction("get_or_create", get_or_create_instance_id_txn, name))
            for name in names
        ]
    )
    by_name: dict[str, set[int]] = {}
    for name, instance_id in zip(names, ids, strict=True):
        by_name.setdefault(name, set()).add(instance_id)
    assert all(len(v) == 1 for v in by_name.values())
    assert sorted(next(iter(v)) for v in by_name.values()) == list(range(1, 7))

    instances = InstanceMap(db)
    await instances.load()
    assert instances.get_id("worker3") == next(iter(by_name["worker3"]))
    assert await instances.get_or_create_id("new") == 7
    assert await instances.get_name(7) == "new"
    assert await instances.get_name(99) is None
