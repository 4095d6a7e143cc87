"""The event builder: prev_events, depth, auth_events selection, size limit, signing."""

from __future__ import annotations

import pytest

from homeserver.events import (
    EventTemplate,
    EventTooLarge,
    check_auth_events_list,
    check_auth_rules,
    compute_depth,
    create_local_event,
    select_prev_events,
    verify_event,
)
from homeserver.events import constants as C
from homeserver.events.builder import edge_hashes_of
from homeserver.events.room_versions import ALL_ROOM_VERSIONS, V10, V11, V12, RoomVersion

from .helpers import ALICE, SIGNING_KEY, keyring_for, standard_room


def test_select_prev_events_caps_at_ten_deepest_deterministically() -> None:
    extremities = {f"$e{i:02d}": i % 7 for i in range(25)}
    chosen = select_prev_events(extremities)
    assert len(chosen) == 10
    assert [extremities[e] for e in chosen] == sorted((extremities[e] for e in chosen), reverse=True)
    assert min(extremities[e] for e in chosen) >= max(extremities[e] for e in extremities if e not in chosen)
    assert select_prev_events(dict(reversed(list(extremities.items())))) == chosen
    assert select_prev_events({}) == []


def test_compute_depth() -> None:
    assert compute_depth([]) == 1
    assert compute_depth([3, 9, 4]) == 10
    assert compute_depth([C.MAX_DEPTH]) == C.MAX_DEPTH


@pytest.mark.parametrize("version", ALL_ROOM_VERSIONS)
def test_create_local_event_is_signed_and_passes_auth(version: RoomVersion) -> None:
    room = standard_room(version)
    extremities = {room.last[0]: room.events[room.last[0]].depth}
    event = create_local_event(
        version,
        EventTemplate(type="m.room.message", content={"body": "hello"}),
        sender=ALICE,
        room_id=room.room_id,
        current_state=room.state,
        forward_extremities=extremities,
        origin_server_ts=123,
        server_name="a.test",
        signing_key=SIGNING_KEY,
        edge_hashes=edge_hashes_of(version, room.events.values()),
    )
    assert event.prev_event_ids == tuple(room.last)
    assert event.depth == room.events[room.last[0]].depth + 1
    assert event.origin_server_ts == 123
    check_auth_events_list(version, event, room.events)
    check_auth_rules(version, event, room.state_events())
    assert verify_event(event, keyring_for("a.test")) is event
    cited = {room.events[e].type for e in event.auth_event_ids}
    assert cited == ({C.POWER_LEVELS, C.MEMBER} | ({C.CREATE} if version.create_event_in_auth_events else set()))


def test_event_over_64k_is_refused_after_signing() -> None:
    room = standard_room(V11)
    with pytest.raises(EventTooLarge):
        create_local_event(
            V11,
            EventTemplate(type="m.room.message", content={"body": "x" * 65_400}),
            sender=ALICE, room_id=room.room_id, current_state=room.state,
            forward_extremities={room.last[0]: 4}, origin_server_ts=1,
            server_name="a.test", signing_key=SIGNING_KEY,
        )


def test_v12_create_event_has_no_room_id_and_defines_it() -> None:
    create = create_local_event(
        V12, EventTemplate(type=C.CREATE, state_key="", content={"room_version": "12"}),
        sender=ALICE, room_id=None, current_state={}, forward_extremities={},
        origin_server_ts=1, server_name="a.test", signing_key=SIGNING_KEY,
    )
    assert "room_id" not in create.pdu and create.depth == 1
    assert create.room_id == "!" + create.event_id[1:]
    assert create.auth_event_ids == () and create.prev_event_ids == ()
