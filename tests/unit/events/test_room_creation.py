"""/createRoom: request parsing, the spec's event order, presets, and a full run through
the builder and auth rules for every preset and room version."""

from __future__ import annotations

from typing import Any

import pytest

from homeserver.events import (
    AuthError,
    InvalidCreateRoomRequest,
    build_template,
    check_auth_rules,
    initial_room_events,
    parse_create_room_request,
    sign_pdu,
)
from homeserver.events import constants as C
from homeserver.events.canonical import thaw
from homeserver.events.event import FrozenEvent, StateKey
from homeserver.events.builder import edge_hashes_of
from homeserver.events.room_versions import ALL_ROOM_VERSIONS, V10, V11, V12, RoomVersion

from .helpers import ALICE, BOB, CAROL, SIGNING_KEY


def _types(body: dict[str, Any], version: RoomVersion = V11) -> list[tuple[str, str | None]]:
    request = parse_create_room_request(body)
    return [(t.type, t.state_key) for t in initial_room_events(version, ALICE, request, server_name="a.test")]


def test_order_follows_the_spec() -> None:
    body = {
        "preset": "private_chat", "room_alias_name": "pub", "name": "N", "topic": "T",
        "invite": [BOB], "initial_state": [{"type": "m.room.encryption", "content": {"algorithm": "x"}}],
    }
    assert _types(body) == [
        (C.CREATE, ""), (C.MEMBER, ALICE), (C.POWER_LEVELS, ""), (C.CANONICAL_ALIAS, ""),
        (C.JOIN_RULES, ""), (C.HISTORY_VISIBILITY, ""), (C.GUEST_ACCESS, ""),
        ("m.room.encryption", ""), (C.NAME, ""), (C.TOPIC, ""), (C.MEMBER, BOB),
    ]


@pytest.mark.parametrize(
    ("body", "join_rule", "guest_access"),
    [({"preset": "private_chat"}, "invite", "can_join"),
     ({"preset": "trusted_private_chat"}, "invite", "can_join"),
     ({"preset": "public_chat"}, "public", "forbidden"),
     ({"visibility": "public"}, "public", "forbidden"),
     ({}, "invite", "can_join")],
)
def test_presets(body: dict[str, Any], join_rule: str, guest_access: str) -> None:
    templates = initial_room_events(V11, ALICE, parse_create_room_request(body), server_name="a.test")
    by_type = {t.type: t.content for t in templates}
    assert by_type[C.JOIN_RULES] == {"join_rule": join_rule}
    assert by_type[C.HISTORY_VISIBILITY] == {"history_visibility": "shared"}
    assert by_type[C.GUEST_ACCESS] == {"guest_access": guest_access}


def test_initial_state_beats_preset_and_name_beats_initial_state() -> None:
    body = {"preset": "public_chat", "name": "wins",
            "initial_state": [{"type": C.JOIN_RULES, "content": {"join_rule": "knock"}},
                              {"type": C.NAME, "content": {"name": "loses"}}]}
    templates = initial_room_events(V11, ALICE, parse_create_room_request(body), server_name="a.test")
    join_rules = [t.content for t in templates if t.type == C.JOIN_RULES]
    names = [t.content for t in templates if t.type == C.NAME]
    assert join_rules == [{"join_rule": "knock"}] and names == [{"name": "wins"}]


def _contents(version: RoomVersion, body: dict[str, Any]) -> dict[str, Any]:
    templates = initial_room_events(version, ALICE, parse_create_room_request(body), server_name="a.test")
    return {t.type: thaw(t.content) for t in templates}


def test_power_levels_per_version_and_override() -> None:
    body = {"preset": "trusted_private_chat", "invite": [BOB], "power_level_content_override": {"kick": 75}}
    v11 = _contents(V11, body)
    assert v11[C.POWER_LEVELS]["users"] == {ALICE: 100, BOB: 100}
    assert v11[C.POWER_LEVELS]["kick"] == 75 and v11[C.POWER_LEVELS]["events"][C.TOMBSTONE] == 100
    assert "creator" not in v11[C.CREATE] and v11[C.CREATE]["room_version"] == "11"

    v12 = _contents(V12, body)
    assert v12[C.POWER_LEVELS]["users"] == {}
    assert v12[C.POWER_LEVELS]["events"][C.TOMBSTONE] > v12[C.POWER_LEVELS]["state_default"]
    assert v12[C.CREATE]["additional_creators"] == [BOB]

    v10 = _contents(V10, {})
    assert v10[C.CREATE]["creator"] == ALICE


def test_creation_content_and_alias() -> None:
    body = {"creation_content": {"m.federate": False, "creator": "@evil:x", "room_version": "1"},
            "room_alias_name": "thepub", "is_direct": True, "invite": [BOB]}
    templates = initial_room_events(V11, ALICE, parse_create_room_request(body), server_name="a.test")
    by_type = {t.type: t for t in templates}
    assert dict(by_type[C.CREATE].content) == {"m.federate": False, "room_version": "11"}
    assert by_type[C.CANONICAL_ALIAS].content == {"alias": "#thepub:a.test"}
    assert templates[-1].content == {"membership": "invite", "is_direct": True}


@pytest.mark.parametrize(
    "body",
    [{"preset": "nope"}, {"visibility": "secret"}, {"name": 5}, {"invite": ["bob"]}, {"invite": "@b:x"},
     {"initial_state": [{"type": C.CREATE, "content": {}}]}, {"initial_state": [{"content": {}}]},
     {"initial_state": [{"type": "x", "content": {"f": 1.5}}]}, {"creation_content": []},
     {"room_alias_name": "a:b"}, {"is_direct": "yes"}, {"power_level_content_override": 3}],
)
def test_bad_requests(body: dict[str, Any]) -> None:
    with pytest.raises(InvalidCreateRoomRequest):
        parse_create_room_request(body)


def _create_room(version: RoomVersion, body: dict[str, Any]) -> dict[StateKey, FrozenEvent]:
    """Build every initial event like the handler will, checking each against the state."""
    request = parse_create_room_request(body)
    state: dict[StateKey, FrozenEvent] = {}
    room_id = None if version.room_id_is_create_event_id else "!new:a.test"
    last: dict[str, int] = {}
    made: list[FrozenEvent] = []
    for ts, template in enumerate(initial_room_events(version, ALICE, request, server_name="a.test")):
        pdu = build_template(
            version, template, sender=ALICE, room_id=room_id,
            current_state={k: e.event_id for k, e in state.items()}, forward_extremities=last,
            origin_server_ts=ts, edge_hashes=edge_hashes_of(version, made),
        )
        event = sign_pdu(version, pdu, "a.test", SIGNING_KEY)
        made.append(event)
        check_auth_rules(version, event, state)
        room_id = event.room_id
        assert event.state_key is not None
        state[(event.type, event.state_key)] = event
        last = {event.event_id: event.depth}
    return state


@pytest.mark.parametrize("version", ALL_ROOM_VERSIONS)
@pytest.mark.parametrize("preset", ["private_chat", "public_chat", "trusted_private_chat"])
def test_every_initial_event_passes_auth(version: RoomVersion, preset: str) -> None:
    state = _create_room(version, {"preset": preset, "name": "n", "topic": "t", "room_alias_name": "r",
                                   "invite": [BOB, CAROL]})
    assert state[(C.MEMBER, BOB)].membership == C.INVITE
    assert state[(C.MEMBER, ALICE)].membership == C.JOIN


def test_v12_override_listing_the_creator_fails_auth() -> None:
    with pytest.raises(AuthError, match="creators"):
        _create_room(V12, {"power_level_content_override": {"users": {ALICE: 100}}})
