"""Event persistence on the real PostgreSQL: graph, state groups, current state,
memberships, destination_rooms, idempotency, forks and concurrency."""

from __future__ import annotations

from collections.abc import Collection

import pytest
from prometheus_client import CollectorRegistry
from twisted.internet.defer import Deferred, gatherResults

from homeserver.events import FrozenEvent
from homeserver.events import constants as C
from homeserver.events.errors import MissingEventsError
from homeserver.events.room_versions import KNOWN_ROOM_VERSIONS
from homeserver.handlers.rooms.event_loader import EventLoader
from homeserver.handlers.rooms.event_persistence import EventPersister, PersistenceMetrics
from storage.database import Database, Transaction
from storage.stores.events import MAX_STATE_DELTA_DEPTH, EventsStore, StoredEvent
from storage.stores.timeline import TimelineStore
from storage.streams import StreamName, create_id_generator, get_stream
from tests.twisted_plugin import reactor, run_sync
from tests.unit.events.helpers import ALICE, BOB, RoomBuilder, standard_room

V12 = KNOWN_ROOM_VERSIONS["12"]
V11 = KNOWN_ROOM_VERSIONS["11"]
SERVER = "a.test"


@pytest.fixture
def store(database: Database) -> EventsStore:
    return EventsStore(database)


async def new_persister(
    database: Database, store: EventsStore, *, server_name: str = SERVER, loader: EventLoader | None = None
) -> EventPersister:
    """A persister writing the real events stream, as the main process does."""
    stream_ids = await create_id_generator(
        database, reactor, get_stream(StreamName.EVENTS), instance_name="master", writers=["master"]
    )
    return EventPersister(
        store=store,
        loader=EventLoader(store) if loader is None else loader,
        stream_ids=stream_ids,
        server_name=server_name,
        instance_name="master",
        metrics=PersistenceMetrics.create(CollectorRegistry()),
    )


@pytest.fixture
def persister(database: Database, store: EventsStore) -> EventPersister:
    return run_sync(new_persister(database, store))


async def _persist_all(persister: EventPersister, room: RoomBuilder, events: list[FrozenEvent], *, local: bool = True) -> None:
    for event in events:
        await persister.persist(room.room_version, event, is_local=local and event.sender.endswith(":" + SERVER))


def _events_in_order(room: RoomBuilder) -> list[FrozenEvent]:
    return sorted(room.events.values(), key=lambda e: (e.depth, e.origin_server_ts))


async def _count(database: Database, sql: str, *params: object) -> int:
    def query(txn: Transaction) -> int:
        txn.execute(sql, params)
        row = txn.fetchone()
        assert row is not None
        return int(row[0])

    return await database.run_interaction("count", query)


async def _assert_joined_counts_agree(database: Database) -> None:
    """``room_joined_counts`` (kept by triggers on ``current_state_events``) says what counting
    the rooms' joined members says, for every room."""
    def query(txn: Transaction) -> tuple[dict[str, int], dict[str, int]]:
        txn.execute("SELECT room_id, joined FROM room_joined_counts WHERE joined <> 0")
        kept = {str(r): int(n) for r, n in txn.fetchall()}
        txn.execute("SELECT room_id, count(*) FROM current_state_events WHERE type = 'm.room.member' "
                    "AND membership = 'join' GROUP BY room_id")
        return kept, {str(r): int(n) for r, n in txn.fetchall()}

    kept, counted = await database.run_interaction("joined_counts", query)
    assert kept == counted and counted


async def test_linear_room_state_extremities_and_memberships(persister: EventPersister, store: EventsStore, database: Database) -> None:
    """A room built event by event: each event's state is its predecessor's plus
    itself; a message adds no state group; the last event is the only extremity;
    current state and memberships follow."""
    room = standard_room(V12)
    message = room.add("m.room.message", ALICE, {"msgtype": "m.text", "body": "hello"})
    await _persist_all(persister, room, _events_in_order(room))
    assert room.room_id is not None

    assert await store.get_room_version(room.room_id) == "12"
    assert set(await store.get_forward_extremities(room.room_id)) == {message.event_id}
    assert await store.get_current_state_ids(room.room_id) == room.state

    before = await store.get_state_groups_before([message.event_id])
    after = await store.get_state_groups_after([message.event_id])
    assert before == after, "a message event must reuse its predecessor's state group"
    assert await store.get_state_for_group(after[message.event_id]) == room.state

    join = room.state[(C.MEMBER, ALICE)]
    assert await _count(database, "SELECT count(*) FROM room_memberships WHERE event_id = %s AND membership = 'join'", join) == 1
    assert await _count(
        database,
        "SELECT count(*) FROM current_state_events WHERE room_id = %s AND type = 'm.room.member' AND membership = 'join'",
        room.room_id,
    ) == 1
    await _assert_joined_counts_agree(database)


async def test_persisting_twice_is_a_no_op(persister: EventPersister, database: Database) -> None:
    room = standard_room(V11)
    events = _events_in_order(room)
    await _persist_all(persister, room, events)
    first = await persister.persist(V11, events[-1], is_local=True)
    assert first.already_persisted
    assert await _count(database, "SELECT count(*) FROM events") == len(events)
    assert await _count(database, "SELECT count(*) FROM event_state_groups") == len(events)


async def test_local_events_record_destination_rooms_for_remote_members(
    persister: EventPersister, store: EventsStore, database: Database
) -> None:
    """Bob of b.test joins (a remote event); Alice's next message is owed to b.test."""
    room = standard_room(V12)
    bob_join = room.join(BOB)
    msg = room.add("m.room.message", ALICE, {"msgtype": "m.text", "body": "hi bob"})
    await _persist_all(persister, room, _events_in_order(room))

    rows = await store.get_destination_rooms("b.test")
    stored = await store.get_event(msg.event_id)
    assert stored is not None and stored.is_local
    assert rows == {room.room_id: stored.stream_ordering}
    assert await store.get_destination_rooms(SERVER) == {}
    remote = await store.get_event(bob_join.event_id)
    assert remote is not None and not remote.is_local
    assert await _count(database, "SELECT count(*) FROM destinations WHERE destination = 'b.test'") == 1


async def test_kick_of_a_remote_user_is_owed_to_their_server(persister: EventPersister, store: EventsStore, database: Database) -> None:
    room = standard_room(V12)
    room.join(BOB)
    await _persist_all(persister, room, _events_in_order(room))
    kick = room.member(ALICE, BOB, C.LEAVE)
    await persister.persist(V12, kick, is_local=True)
    stored = await store.get_event(kick.event_id)
    assert stored is not None
    assert (await store.get_destination_rooms("b.test"))[room.room_id or ""] == stored.stream_ordering
    await _assert_joined_counts_agree(database)


async def test_fork_is_resolved_and_merged(persister: EventPersister, store: EventsStore, database: Database) -> None:
    """Two branches set different topics; an event on both resolves their state,
    and after it the room has one extremity again."""
    room = standard_room(V12)
    branch = room.fork()
    topic_a = room.add("m.room.topic", ALICE, {"topic": "from branch A"}, "")
    topic_b = branch.add("m.room.topic", ALICE, {"topic": "from branch B"}, "")
    await _persist_all(persister, room, _events_in_order(room))
    await persister.persist(V12, topic_b, is_local=True)
    assert room.room_id is not None
    assert set(await store.get_forward_extremities(room.room_id)) == {topic_a.event_id, topic_b.event_id}

    merge = room.build("m.room.message", ALICE, {"msgtype": "m.text", "body": "merge"},
                       prev=[topic_a.event_id, topic_b.event_id])
    state_before = await EventLoader(store).state_before_event(V12, merge)
    assert state_before[("m.room.topic", "")] in {topic_a.event_id, topic_b.event_id}
    await persister.persist(V12, merge, is_local=True)
    assert set(await store.get_forward_extremities(room.room_id)) == {merge.event_id}
    current = await store.get_current_state_ids(room.room_id)
    assert current[("m.room.topic", "")] == state_before[("m.room.topic", "")]
    await _assert_joined_counts_agree(database)


async def test_unknown_prev_events_are_reported(persister: EventPersister) -> None:
    room = standard_room(V12)
    events = _events_in_order(room)
    with pytest.raises(MissingEventsError):
        await persister.persist(V12, events[-1], is_local=True)


async def test_long_state_chains_are_snapshotted(persister: EventPersister, store: EventsStore, database: Database) -> None:
    room = standard_room(V12)
    for i in range(MAX_STATE_DELTA_DEPTH + 5):
        room.add("m.room.topic", ALICE, {"topic": f"topic {i}"}, "")
    await _persist_all(persister, room, _events_in_order(room))
    assert room.room_id is not None
    last = room.state[("m.room.topic", "")]
    group = (await store.get_state_groups_after([last]))[last]
    assert await store.get_state_for_group(group) == room.state
    deepest = await _count(database, "SELECT max(delta_depth) FROM state_groups")
    assert deepest <= MAX_STATE_DELTA_DEPTH


async def test_two_rooms_persist_concurrently(persister: EventPersister, store: EventsStore) -> None:
    rooms = [standard_room(V12), standard_room(V11)]
    for room in rooms:
        for i in range(20):
            room.add("m.room.message", ALICE, {"msgtype": "m.text", "body": f"m{i}"})

    async def persist_room(room: RoomBuilder) -> None:
        await _persist_all(persister, room, _events_in_order(room))

    await gatherResults([Deferred.fromCoroutine(persist_room(room)) for room in rooms])
    for room in rooms:
        assert room.room_id is not None
        assert set(await store.get_forward_extremities(room.room_id)) == set(room.last)
        assert await store.get_current_state_ids(room.room_id) == room.state


async def test_join_with_state_from_elsewhere(persister: EventPersister, store: EventsStore, database: Database) -> None:
    """Joining a room over federation: we have the room's state (from send_join)
    but not the join's predecessors; the join is stored on that state, becomes
    the only extremity, and its destinations are the ones we were given."""
    room = standard_room(V12)
    room.join(BOB)
    history = _events_in_order(room)
    # Only the state events are known here, as outliers, not the graph.
    for event in history:
        await persister.persist(V12, event, is_local=False, outlier=True)
    join = room.join("@carol:" + SERVER)
    state = {k: v for k, v in room.state.items() if k != ("m.room.member", "@carol:" + SERVER)}
    result = await persister.persist(V12, join, is_local=True, state_before=state,
                                     destinations=frozenset({"b.test", SERVER}))
    assert room.room_id is not None
    assert set(await store.get_forward_extremities(room.room_id)) == {join.event_id}
    assert await store.get_current_state_ids(room.room_id) == room.state
    assert await store.get_destination_rooms("b.test") == {room.room_id: result.stream_ordering}
    assert await store.get_destination_rooms(SERVER) == {}
    await _assert_joined_counts_agree(database)


class _CountingStore(EventsStore):
    """The events store, counting the event reads that reach the database."""

    def __init__(self, database: Database) -> None:
        super().__init__(database)
        self.read: list[str] = []

    async def get_events(self, event_ids: Collection[str]) -> dict[str, StoredEvent]:
        self.read.extend(event_ids)
        return await super().get_events(event_ids)


async def test_a_redaction_is_recorded_by_its_own_transaction_and_primes_the_loader(database: Database) -> None:
    """A redaction arrives over federation. When persist returns, its target is already
    recorded as redacted, so no process (this one or a worker reading the database) can
    serve the target unpruned once the redaction is visible; and the loader serves every
    event the persister stored without reading it back."""
    store = _CountingStore(database)
    loader = EventLoader(store)
    persister = await new_persister(database, store, loader=loader)
    room = standard_room(V12)
    message = room.add("m.room.message", BOB, {"msgtype": "m.text", "body": "oops"})
    redaction = room.add(C.REDACTION, ALICE, {}, redacts=message.event_id)
    await _persist_all(persister, room, _events_in_order(room), local=False)
    assert await TimelineStore(database).get_redactions([message.event_id]) == {
        message.event_id: [redaction.event_id]
    }
    assert await loader.load_events(list(room.events)) == room.events
    assert store.read == []
