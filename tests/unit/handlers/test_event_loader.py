"""The event loader against a fake store: what it reads, what it caches, what it never keeps."""

from __future__ import annotations

import json
from collections.abc import Collection

import pytest
from prometheus_client import CollectorRegistry
from twisted.internet.defer import CancelledError, Deferred
from twisted.python.failure import Failure

from homeserver.events import FrozenEvent
from homeserver.events import constants as C
from homeserver.events.errors import MissingEventsError
from homeserver.events.room_versions import KNOWN_ROOM_VERSIONS
from homeserver.handlers.rooms.event_loader import FALLBACK_ROOM_VERSION, EventCacheMetrics, EventLoader
from storage.stores.events import StateKey, StoredEvent
from tests.unit.events.helpers import ALICE, RoomBuilder, standard_room

V12 = KNOWN_ROOM_VERSIONS["12"]
V11 = KNOWN_ROOM_VERSIONS["11"]
MESSAGE = "m.room.message"


class FakeStore:
    """Stored events and state groups in memory, recording every read."""

    def __init__(self, room: RoomBuilder, *, room_known: bool = True) -> None:
        self.events: dict[str, FrozenEvent] = dict(room.events)
        assert room.room_id is not None
        self.versions = {room.room_id: room.room_version.identifier} if room_known else {}
        self.groups_after: dict[str, int] = {}
        self.group_state: dict[int, dict[StateKey, str]] = {}
        self.reads: list[tuple[str, frozenset[str]]] = []
        # When set, get_events waits for it (a slow database).
        self.gate: Deferred[None] | None = None

    async def get_events(self, event_ids: Collection[str]) -> dict[str, StoredEvent]:
        self.reads.append(("get_events", frozenset(event_ids)))
        if self.gate is not None:
            await self.gate
        return {
            event_id: StoredEvent(event_id, event.room_id, 1, "master", event.depth, True, False, None, None,
                                  json.dumps(event.get_pdu_json()))
            for event_id in event_ids
            if (event := self.events.get(event_id)) is not None
        }

    async def get_room_versions(self, room_ids: Collection[str]) -> dict[str, str]:
        self.reads.append(("get_room_versions", frozenset(room_ids)))
        return {room_id: self.versions[room_id] for room_id in room_ids if room_id in self.versions}

    async def get_state_groups_after(self, event_ids: Collection[str]) -> dict[str, int]:
        return {e: self.groups_after[e] for e in event_ids if e in self.groups_after}

    async def get_state_for_group(self, state_group: int) -> dict[StateKey, str]:
        return dict(self.group_state[state_group])

    async def get_auth_chain_ids(self, event_ids: Collection[str]) -> set[str]:
        chain: set[str] = set()
        todo = [a for e in event_ids for a in self.events[e].auth_event_ids]
        while todo:
            event_id = todo.pop()
            if event_id not in chain:
                chain.add(event_id)
                todo.extend(self.events[event_id].auth_event_ids)
        return chain

    def event_reads(self) -> list[frozenset[str]]:
        return [ids for name, ids in self.reads if name == "get_events"]


def _room_with_message() -> tuple[RoomBuilder, FrozenEvent]:
    room = standard_room(V12)
    message = room.add(MESSAGE, ALICE, {"msgtype": "m.text", "body": "hello"})
    return room, message


async def test_events_are_read_once_then_served_from_the_cache() -> None:
    room, message = _room_with_message()
    store = FakeStore(room)
    loader = EventLoader(store)
    first = await loader.load_events([message.event_id, "$unknown"])
    assert first == {message.event_id: message}
    assert await loader.get_event(message.event_id) == message
    assert await loader.get_event("$unknown") is None
    # The message was read once; the unknown ID each time it was asked for (no negative caching).
    assert store.event_reads() == [frozenset({message.event_id, "$unknown"}), frozenset({"$unknown"})]


async def test_hits_misses_and_size_are_measured() -> None:
    room, message = _room_with_message()
    registry = CollectorRegistry()
    loader = EventLoader(FakeStore(room), metrics=EventCacheMetrics.create(registry))

    def lookups(outcome: str) -> float | None:
        return registry.get_sample_value("tributary_events_cache_lookups_total", {"outcome": outcome})

    assert (lookups("hit"), lookups("miss")) == (0, 0)
    await loader.load_events([message.event_id, "$unknown"])
    await loader.load_events([message.event_id])
    assert (lookups("hit"), lookups("miss")) == (1, 2)
    assert registry.get_sample_value("tributary_events_cache_entries") == 1


async def test_a_primed_event_is_never_read() -> None:
    """The persister primes the loader with what it just stored: reading it back is free."""
    room, message = _room_with_message()
    store = FakeStore(room)
    loader = EventLoader(store)
    loader.prime(message)
    assert await loader.load_events([message.event_id]) == {message.event_id: message}
    assert store.reads == []


async def test_an_event_of_an_unknown_room_is_served_but_not_cached() -> None:
    """Without the room's version (an outlier of a room we have no create event of) the event is
    parsed with a guess; a later read, once the room is known, must not get the guess."""
    room = standard_room(V11)
    message = room.add(MESSAGE, ALICE, {"msgtype": "m.text", "body": "hello"})
    store = FakeStore(room, room_known=False)
    loader = EventLoader(store)
    guessed = await loader.get_event(message.event_id)
    assert guessed is not None and guessed.room_version.identifier == FALLBACK_ROOM_VERSION
    assert loader.cached == 0
    assert room.room_id is not None
    store.versions[room.room_id] = "11"
    known = await loader.get_event(message.event_id)
    assert known is not None and known.room_version is V11
    assert loader.cached == 1


async def test_the_cache_is_bounded_least_recently_used_first() -> None:
    room, message = _room_with_message()
    store = FakeStore(room)
    loader = EventLoader(store, max_entries=2)
    create_id, member_id = list(room.events)[:2]
    await loader.load_events([create_id, member_id])
    await loader.get_event(create_id)  # the member event is now the least recently used
    await loader.get_event(message.event_id)
    assert loader.cached == 2
    store.reads.clear()
    await loader.load_events([create_id, message.event_id, member_id])
    assert store.event_reads() == [frozenset({member_id})]


def test_a_cancelled_load_leaves_nothing_behind() -> None:
    """A request cancelled while the database answers caches nothing and wedges nothing."""
    room, message = _room_with_message()
    store = FakeStore(room)
    store.gate = Deferred()
    loader = EventLoader(store)
    outcome: list[object] = []
    loading = Deferred.fromCoroutine(loader.load_events([message.event_id]))
    loading.addBoth(outcome.append)
    loading.cancel()
    assert len(outcome) == 1 and isinstance(outcome[0], Failure) and outcome[0].check(CancelledError)
    assert loader.cached == 0
    store.gate = None
    again: list[dict[str, FrozenEvent]] = []
    Deferred.fromCoroutine(loader.load_events([message.event_id])).addCallback(again.append)
    assert again == [{message.event_id: message}]
    assert loader.cached == 1


async def test_state_before_a_linear_event_is_its_predecessors_group() -> None:
    room, message = _room_with_message()
    store = FakeStore(room)
    store.groups_after = {message.prev_event_ids[0]: 7}
    store.group_state = {7: {(C.CREATE, ""): "$create"}}
    loader = EventLoader(store)
    assert await loader.state_before_event(V12, message) == {(C.CREATE, ""): "$create"}
    create = next(iter(room.events.values()))
    assert await loader.state_before_event(V12, create) == {}
    assert store.event_reads() == [], "one state group needs no events"


async def test_state_before_an_event_with_unknown_predecessors_raises() -> None:
    room, message = _room_with_message()
    loader = EventLoader(FakeStore(room))
    with pytest.raises(MissingEventsError) as raised:
        await loader.state_before_event(V12, message)
    assert raised.value.event_ids == frozenset(message.prev_event_ids)


async def test_state_before_a_merge_resolves_the_forks() -> None:
    """Two branches set different topics; the state before an event on both has one topic,
    every key of both branches, and is computed from reads alone (the fake store has no writes)."""
    room = standard_room(V12)
    branch = room.fork()
    topic_a = room.add(C.TOPIC, ALICE, {"topic": "A"}, "")
    topic_b = branch.add(C.TOPIC, ALICE, {"topic": "B"}, "")
    merge = room.build(MESSAGE, ALICE, {"msgtype": "m.text", "body": "merge"},
                       prev=[topic_a.event_id, topic_b.event_id])
    store = FakeStore(room)
    store.groups_after = {topic_a.event_id: 1, topic_b.event_id: 2}
    store.group_state = {1: dict(room.state), 2: dict(branch.state)}
    loader = EventLoader(store)
    state = await loader.state_before_event(V12, merge)
    assert set(state) == set(room.state) | set(branch.state)
    # Same sender and power: ordered by origin_server_ts, so the later topic is applied last.
    assert state[(C.TOPIC, "")] == topic_b.event_id
    assert state[(C.CREATE, "")] == room.state[(C.CREATE, "")]
    # Resolution loaded the events it needed, and they are now cached.
    assert topic_a.event_id in store.event_reads()[0] and loader.cached >= 2


async def test_resolution_may_name_an_event_not_stored_yet() -> None:
    """The persister resolves a fork with the event it is persisting in one of the state sets."""
    room = standard_room(V12)
    branch = room.fork()
    topic_a = room.add(C.TOPIC, ALICE, {"topic": "A"}, "")
    store = FakeStore(room)  # holds what was stored so far: not the pending event
    pending = branch.add(C.TOPIC, ALICE, {"topic": "B"}, "")
    loader = EventLoader(store)
    state = await loader.resolve(V12, [dict(room.state), dict(branch.state)], pending=pending)
    assert state[(C.TOPIC, "")] in {topic_a.event_id, pending.event_id}
    assert all(pending.event_id not in ids for ids in store.event_reads())
