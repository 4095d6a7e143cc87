"""Creating rooms and sending local events on the real PostgreSQL."""

from __future__ import annotations

import pytest
from signedjson.key import generate_signing_key
from twisted.internet.defer import Deferred, gatherResults

from homeserver.events import AuthError, EventTemplate, parse_create_room_request
from homeserver.handlers.event_loader import EventLoader
from homeserver.handlers.room_events import RoomEventCreator, RoomNotFound
from storage.database import Database
from storage.stores.events import EventsStore
from tests.integration.test_persist_events import new_persister
from tests.twisted_plugin import run_sync

SERVER = "hs.test"
ALICE = f"@alice:{SERVER}"
BOB = f"@bob:{SERVER}"


@pytest.fixture
def store(database: Database) -> EventsStore:
    return EventsStore(database)


@pytest.fixture
def creator(database: Database, store: EventsStore) -> RoomEventCreator:
    loader = EventLoader(store)
    persister = run_sync(new_persister(database, store, server_name=SERVER, loader=loader))
    ticks = iter(range(1_700_000_000_000, 1_800_000_000_000, 1000))
    return RoomEventCreator(
        persister=persister, loader=loader, store=store, server_name=SERVER, signing_key=generate_signing_key("t1"),
        default_room_version="12", clock_ms=lambda: next(ticks),
    )


@pytest.mark.parametrize("version", ["10", "11", "12"])
async def test_create_room_with_preset_name_and_topic(creator: RoomEventCreator, store: EventsStore, version: str) -> None:
    request = parse_create_room_request(
        {"preset": "public_chat", "name": "Lobby", "topic": "hello", "room_version": version}
    )
    room_id = await creator.create_room(ALICE, request)
    state = await store.get_current_state_ids(room_id)
    assert {("m.room.create", ""), ("m.room.member", ALICE), ("m.room.power_levels", ""),
            ("m.room.join_rules", ""), ("m.room.history_visibility", ""), ("m.room.name", ""),
            ("m.room.topic", "")} <= set(state)
    assert await store.get_room_version(room_id) == version
    assert len(await store.get_forward_extremities(room_id)) == 1
    if version == "12":
        assert ":" not in room_id, "v12 room IDs are the create event's hash, with no server part"
    else:
        assert room_id.endswith(":" + SERVER)


async def test_join_send_and_auth_refusal(creator: RoomEventCreator, store: EventsStore) -> None:
    room_id = await creator.create_room(ALICE, parse_create_room_request({"preset": "private_chat"}))
    # Bob is not invited to a private room: his join is refused by the auth rules.
    with pytest.raises(AuthError):
        await creator.send(room_id, EventTemplate(type="m.room.member", state_key=BOB, content={"membership": "join"}), BOB)
    await creator.send(room_id, EventTemplate(type="m.room.member", state_key=BOB, content={"membership": "invite"}), ALICE)
    await creator.send(room_id, EventTemplate(type="m.room.member", state_key=BOB, content={"membership": "join"}), BOB)
    message = await creator.send(room_id, EventTemplate(type="m.room.message", content={"msgtype": "m.text", "body": "hi"}), BOB)
    assert set(await store.get_forward_extremities(room_id)) == {message.event_id}
    # Nobody outside this server is in the room: nothing is owed to other servers.
    stored = await store.get_event(message.event_id)
    assert stored is not None and stored.is_local


async def test_concurrent_sends_in_one_room_stay_linear(creator: RoomEventCreator, store: EventsStore) -> None:
    room_id = await creator.create_room(ALICE, parse_create_room_request({}))

    async def send(i: int) -> None:
        await creator.send(room_id, EventTemplate(type="m.room.message", content={"msgtype": "m.text", "body": str(i)}), ALICE)

    await gatherResults([Deferred.fromCoroutine(send(i)) for i in range(20)])
    assert len(await store.get_forward_extremities(room_id)) == 1


async def test_unknown_room(creator: RoomEventCreator) -> None:
    with pytest.raises(RoomNotFound):
        await creator.send("!nope:hs.test", EventTemplate(type="m.room.message", content={}), ALICE)


async def test_same_room_created_twice_in_one_millisecond_gets_two_room_ids(
        database: Database, store: EventsStore) -> None:
    """Room version 12's room ID is the create event's hash: the same creator asking for the
    same room twice in one millisecond gets two rooms, not the first one twice."""
    loader = EventLoader(store)
    persister = await new_persister(database, store, server_name=SERVER, loader=loader)
    frozen = RoomEventCreator(
        persister=persister, loader=loader, store=store, server_name=SERVER, signing_key=generate_signing_key("t1"),
        default_room_version="12", clock_ms=lambda: 1_700_000_000_000,
    )
    request = parse_create_room_request({"preset": "private_chat", "room_version": "12"})
    first = await frozen.create_room(ALICE, request)
    second = await frozen.create_room(ALICE, request)
    assert first != second
    for room_id in (first, second):
        assert (await store.get_current_state_ids(room_id))[("m.room.member", ALICE)]
