"""The persister's per-room send snapshot: a room's second send reads nothing from the database."""

from __future__ import annotations

from collections.abc import Collection
from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry

from homeserver.handlers.rooms.event_loader import EventLoader
from homeserver.handlers.rooms.event_persistence import (
    MAX_KEPT_PUSH_RECIPIENTS,
    EventPersister,
    PersistenceMetrics,
    _KeptPushRead,
)
from storage.stores.events import SendContext, StateKey
from storage.stores.push import PushContextRow

ROOM = "!r:hs"
CREATE: StateKey = ("m.room.create", "")
POWER: StateKey = ("m.room.power_levels", "")
ALICE: StateKey = ("m.room.member", "@alice:hs")
TOPIC: StateKey = ("m.room.topic", "")


class FakeStore:
    """Just the reads ``send_context`` makes, counting them."""

    def __init__(self) -> None:
        self.state = {CREATE: "$create", POWER: "$power", ALICE: "$alice"}
        self.calls: list[tuple[str, frozenset[StateKey]]] = []

    async def get_send_context(self, room_id: str, keys: Collection[StateKey]) -> SendContext:
        self.calls.append(("get_send_context", frozenset(keys)))
        return SendContext(
            {"$last": 5}, {k: v for k, v in self.state.items() if k in keys}, {"$last": 9}, {"hs", "other.example"}
        )

    async def get_current_state_for_keys(self, room_id: str, keys: Collection[StateKey]) -> dict[StateKey, str]:
        self.calls.append(("get_current_state_for_keys", frozenset(keys)))
        return {k: v for k, v in self.state.items() if k in keys}


def _persister(store: FakeStore) -> EventPersister:
    fake: Any = store
    return EventPersister(
        store=fake, loader=EventLoader(fake), stream_ids=fake, server_name="hs", instance_name="master",
        metrics=PersistenceMetrics.create(CollectorRegistry()),
    )


async def test_second_send_in_a_room_is_served_from_memory() -> None:
    """Alice sends twice with the same auth keys: one read of the room, not two."""
    store = FakeStore()
    persister = _persister(store)
    first = await persister.send_context(ROOM, {CREATE, POWER, ALICE})
    second = await persister.send_context(ROOM, {CREATE, POWER, ALICE})
    assert store.calls == [("get_send_context", frozenset({CREATE, POWER, ALICE}))]
    assert second == first
    assert second.forward_extremities == {"$last": 5}
    assert second.extremity_state_groups == {"$last": 9}
    assert second.joined_servers == {"hs", "other.example"}


async def test_only_state_keys_not_seen_before_are_read_and_absence_is_remembered() -> None:
    """A send needing a key the snapshot has not looked at reads just that key; a key the
    room has no state for is remembered as absent, not read again."""
    store = FakeStore()
    persister = _persister(store)
    await persister.send_context(ROOM, {CREATE, POWER})
    context = await persister.send_context(ROOM, {CREATE, ALICE, TOPIC})
    assert context.auth_state == {CREATE: "$create", ALICE: "$alice"}
    again = await persister.send_context(ROOM, {TOPIC, ALICE})
    assert again.auth_state == {ALICE: "$alice"}
    assert store.calls == [
        ("get_send_context", frozenset({CREATE, POWER})),
        ("get_current_state_for_keys", frozenset({ALICE, TOPIC})),
    ]


async def test_callers_cannot_change_the_snapshot_through_what_they_are_given() -> None:
    store = FakeStore()
    persister = _persister(store)
    await persister.send_context(ROOM, {CREATE})
    context = await persister.send_context(ROOM, {CREATE})
    context.forward_extremities.clear()
    context.joined_servers.add("evil.example")
    again = await persister.send_context(ROOM, {CREATE})
    assert again.forward_extremities == {"$last": 5}
    assert "evil.example" not in again.joined_servers


class NoQueries:
    """A transaction that must not be used."""

    def execute(self, *args: object) -> None:
        raise AssertionError("the kept push read was read again")


def _row(recipients: int) -> PushContextRow:
    return PushContextRow(2, None, {f"@u{i}:hs": (None, None) for i in range(recipients)}, version=7)


def test_a_kept_push_read_is_used_without_a_query_and_kept_after_messages_only() -> None:
    message: Any = SimpleNamespace(state_key=None)
    topic: Any = SimpleNamespace(state_key="")
    kept = _row(3)
    reads = _KeptPushRead(kept)
    no_queries: Any = NoQueries()
    assert reads.read(no_queries, ROOM, "hs", ()) is kept
    assert reads.to_keep(message) is kept
    assert reads.to_keep(topic) is None  # a state event: the room is read again next time
    assert _KeptPushRead(None).to_keep(message) is None  # nothing read, nothing kept


def test_a_push_read_naming_many_local_members_is_not_kept() -> None:
    message: Any = SimpleNamespace(state_key=None)
    small, big = _KeptPushRead(_row(MAX_KEPT_PUSH_RECIPIENTS)), _KeptPushRead(_row(MAX_KEPT_PUSH_RECIPIENTS + 1))
    no_queries: Any = NoQueries()
    small.read(no_queries, ROOM, "hs", ())
    big.read(no_queries, ROOM, "hs", ())
    assert small.to_keep(message) is small.kept
    assert big.to_keep(message) is None
