"""The event builder: prev_events, depth, auth_events selection, size limit, signing."""

from __future__ import annotations

import pytest

from homeserver.events import (
    EventTemplate,
    EventTooLarge,
    InvalidEvent,
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


def _signed_the_long_way(version: RoomVersion, pdu: dict[str, object]) -> object:
    from homeserver.events import add_hashes_and_signature, make_event
    from homeserver.events.hashing import assign_event_id

    if version.event_ids_are_origin_assigned and "event_id" not in pdu:
        pdu = {**pdu, "event_id": assign_event_id(pdu, "test")}
    return make_event(version, add_hashes_and_signature(version, pdu, "test", SIGNING_KEY))


@pytest.mark.parametrize("version", ALL_ROOM_VERSIONS)
def test_sign_pdu_gives_what_hashing_signing_and_make_event_give(version: RoomVersion) -> None:
    """sign_pdu encodes the event twice; the spec's steps one after the other encode it four times."""
    from homeserver.events.builder import sign_pdu

    base: dict[str, object] = {
        "type": "m.room.member", "state_key": "@bob:other", "sender": "@bob:other", "room_id": "!r:test",
        "content": {"membership": "join", "displayname": "Bób ✓", "n": 2**53 - 1}, "depth": 3,
        "origin_server_ts": 1764300000000, "prev_events": [], "auth_events": [], "unsigned": {"age": 5},
        "hashes": {"sha256": "stale"},
    }
    if version.event_ids_are_origin_assigned:
        base["prev_events"] = [["$p:test", {"sha256": "x"}]]
    else:
        base["prev_events"] = ["$" + "a" * 43]
    signed_by_other = {**base, "signatures": {"other": {"ed25519:o": "c2ln"}, "test": {"ed25519:old": "b2xk"}}}
    for pdu in (base, signed_by_other):
        ours = sign_pdu(version, pdu, "test", SIGNING_KEY)
        assert ours == _signed_the_long_way(version, pdu)
        assert ours.event_id == _signed_the_long_way(version, pdu).event_id  # type: ignore[attr-defined]
    for bad in ({**base, "content": {"f": 1.5}}, {**base, "signatures": {"other": "c2ln"}}, {**base, "depth": "3"}):
        with pytest.raises(InvalidEvent):
            sign_pdu(version, bad, "test", SIGNING_KEY)
    with pytest.raises(EventTooLarge):
        sign_pdu(version, {**base, "content": {"body": "x" * C.MAX_PDU_SIZE}}, "test", SIGNING_KEY)
