"""``EventPersister.persist_remote_batch`` on the real PostgreSQL: a planned batch of received events
(messages, a state event, a rejected one) ends exactly as persisting them one by one does, in one
database transaction; a batch containing an event stored meanwhile writes nothing."""

# tests: homeserver/handlers/rooms/event_persistence.py storage/stores/events.py storage/database.py

from __future__ import annotations

import pytest

from homeserver.events import FrozenEvent
from homeserver.events import constants as C
from homeserver.federation.batching import BatchPlanner, wanted_prevs
from homeserver.federation.pdus import auth_state_keys
from homeserver.handlers.rooms.event_persistence import EventPersister, RemoteBatchEvent
from storage.database import Database, Transaction
from storage.stores.events import EventAlreadyPersisted, EventsStore
from tests.integration.test_persist_events import V12, _events_in_order, new_persister
from tests.unit.events.helpers import ALICE, BOB, RoomBuilder


def _room(tag: str) -> RoomBuilder:
    """Alice's public room (its ID differs by ``tag``) that Bob joined."""
    room = RoomBuilder(V12)
    room.create(ALICE, tag=tag)
    room.join(ALICE)
    room.power_levels(ALICE, {})
    room.join_rules(ALICE, C.PUBLIC)
    room.join(BOB)
    return room


def _remote_line(room: RoomBuilder) -> list[FrozenEvent]:
    """Bob's messages, a topic of Bob's (marked rejected), a name of Alice's, Bob's display name."""
    return [
        room.add("m.room.message", BOB, {"msgtype": "m.text", "body": "one"}),
        room.add("m.room.topic", BOB, {"topic": "bob's"}, ""),
        room.add("m.room.message", BOB, {"msgtype": "m.text", "body": "two"}),
        room.add("m.room.name", ALICE, {"name": "named"}, ""),
        room.member(BOB, BOB, "join", displayname="Bobby"),
        room.add("m.room.message", BOB, {"msgtype": "m.text", "body": "three"}),
    ]


async def _rows(database: Database, room_id: str, order: list[str]) -> dict[str, object]:
    """What persisting changed, by position in ``order`` (event IDs differ between the rooms)."""
    position = {event_id: i for i, event_id in enumerate(order)}

    def query(txn: Transaction) -> dict[str, object]:
        out: dict[str, object] = {}
        txn.execute("SELECT event_id, rejection_reason IS NOT NULL, soft_failed FROM events WHERE room_id = %s "
                    "ORDER BY stream_ordering", (room_id,))
        out["events"] = [(position.get(e, e if e in position else "creation"), r, s) for e, r, s in txn.fetchall()]
        txn.execute("SELECT event_id FROM event_forward_extremities WHERE room_id = %s", (room_id,))
        out["extremities"] = sorted(position.get(row[0], -1) for row in txn.fetchall())
        txn.execute("SELECT type, state_key, event_id, membership FROM current_state_events WHERE room_id = %s "
                    "ORDER BY type, state_key", (room_id,))
        out["current"] = [(t, k.replace(room_id, ""), position.get(e, "creation"), m) for t, k, e, m in txn.fetchall()]
        txn.execute("SELECT e.event_id, g.state_group_before = g.state_group_after FROM events e "
                    "JOIN event_state_groups g USING (event_id) WHERE e.room_id = %s ORDER BY e.stream_ordering",
                    (room_id,))
        out["same_group"] = [(position.get(e, "creation"), same) for e, same in txn.fetchall()]
        txn.execute("SELECT m.event_id, m.display_name FROM room_memberships m WHERE m.room_id = %s "
                    "ORDER BY m.stream_ordering", (room_id,))
        out["memberships"] = [(position.get(e, "creation"), name) for e, name in txn.fetchall()]
        return out

    return await database.run_interaction("rows", query)


async def _state_after(store: EventsStore, order: list[str], line: list[FrozenEvent]) -> list[dict[object, object]]:
    """The state after each event of ``line``, event IDs as positions in ``order``."""
    position = {event_id: i for i, event_id in enumerate(order)}
    groups = await store.get_state_groups_after([e.event_id for e in line])
    return [{k: position.get(v, "creation") for k, v in (await store.get_state_for_group(groups[e.event_id])).items()}
            for e in line]


async def test_a_planned_batch_ends_as_one_persist_per_event_does(database: Database) -> None:
    """Two rooms of the same shape, each created as usual; then six received events each: room A's
    planned and persisted as one batch, room B's one ``persist`` each, the topic marked rejected in
    both. Position by position, the stored rows (events, rejection, extremities, current state
    and memberships, which events made a state group, the state after each) are the same."""
    store = EventsStore(database)
    persister = await new_persister(database, store, server_name="c.test")
    shapes = []
    for tag, batched in (("a", True), ("b", False)):
        room = _room(tag)
        for event in _events_in_order(room):
            await persister.persist(V12, event, is_local=False)
        line = _remote_line(room)
        order = [e.event_id for e in line]
        rejected = {line[1].event_id: "Bob may not set the topic"}
        assert room.room_id is not None
        if batched:
            await _persist_planned(persister, store, room.room_id, line, rejected)
        else:
            for event in line:
                await persister.persist(V12, event, is_local=False, rejection_reason=rejected.get(event.event_id))
        rows = await _rows(database, room.room_id, order)
        rows["state_after"] = await _state_after(store, order, line)
        shapes.append(rows)
    assert shapes[0] == shapes[1]
    assert shapes[0]["extremities"] == [5]
    assert ("m.room.topic", "", 1, None) not in shapes[0]["current"]


async def test_a_batch_with_an_event_stored_meanwhile_writes_nothing(database: Database) -> None:
    """One event of the planned batch is persisted by another path before the batch commits:
    ``EventAlreadyPersisted``, and none of the batch's other events is stored."""
    store = EventsStore(database)
    persister = await new_persister(database, store, server_name="c.test")
    room = _room("c")
    for event in _events_in_order(room):
        await persister.persist(V12, event, is_local=False)
    line = _remote_line(room)
    assert room.room_id is not None
    batch = await _plan(store, room.room_id, line, {})
    await persister.persist(V12, line[0], is_local=False)
    with pytest.raises(EventAlreadyPersisted):
        async with persister.room_lock(room.room_id):
            await persister.persist_remote_batch(V12, batch)
    stored = await store.get_events([e.event_id for e in line])
    assert set(stored) == {line[0].event_id}


async def _plan(store: EventsStore, room_id: str, line: list[FrozenEvent],
                rejected: dict[str, str]) -> list[RemoteBatchEvent]:
    start = await store.get_batch_start(room_id, [e.event_id for e in line], wanted_prevs(line),
                                        auth_state_keys(V12, line))
    planner = BatchPlanner(start)
    batch = []
    for event in line:
        plan = planner.plan(event)
        assert plan is not None and plan.linear
        reason = rejected.get(event.event_id)
        delta = planner.record(event, plan, rejected=reason is not None, soft_failed=False)
        batch.append(RemoteBatchEvent(event, reason, False, plan.prev_group,
                                      plan.prev if plan.prev_group is None else None, delta))
    return batch


async def _persist_planned(persister: EventPersister, store: EventsStore, room_id: str, line: list[FrozenEvent],
                           rejected: dict[str, str]) -> None:
    batch = await _plan(store, room_id, line, rejected)
    async with persister.room_lock(room_id):
        await persister.persist_remote_batch(V12, batch)


async def test_a_batch_reads_only_the_state_its_checks_read(database: Database) -> None:
    """In a room with many members, a batch of Bob's messages starts from the state its checks read
    (the create event, the power levels, Bob's membership: each message's auth rules, against the
    state before it and the current state), both current and after the prev event, and not from
    every member: a big room's whole state is not read for each received transaction."""
    store = EventsStore(database)
    persister = await new_persister(database, store, server_name="c.test")
    room = _room("d")
    for i in range(40):
        room.join(f"@m{i}:other.test")
    for event in _events_in_order(room):
        await persister.persist(V12, event, is_local=False)
    line = [room.add("m.room.message", BOB, {"msgtype": "m.text", "body": str(i)}) for i in range(3)]
    assert room.room_id is not None
    assert len(await store.get_current_state_ids(room.room_id)) > 40
    start = await store.get_batch_start(room.room_id, [e.event_id for e in line], wanted_prevs(line),
                                        auth_state_keys(V12, line))
    read = {(C.CREATE, ""), (C.POWER_LEVELS, ""), (C.MEMBER, BOB)}
    assert set(start.current_state) == read
    assert [set(state) for state in start.state_after.values()] == [read]
