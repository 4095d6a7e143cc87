"""Room upgrades' pure part: which state the new room gets, and how power levels change.

The central check builds the planned events one by one on a ``RoomBuilder`` and runs the
new version's auth rules on each, for every pair of versions: a plan the rules would
refuse half-way would leave a broken room behind.
"""

# tests: homeserver/events/room_upgrade.py

from __future__ import annotations

import pytest

from homeserver.events import AuthError, EventsError, InvalidCreateRoomRequest, UnsupportedRoomVersion
from homeserver.events import constants as C
from homeserver.events.auth import check_auth_rules
from homeserver.events.room_upgrade import (
    TRANSFERABLE_STATE,
    convert_power_levels,
    locked_power_levels,
    parse_upgrade_request,
    plan_upgrade,
    users_to_invite,
)
from homeserver.events.canonical import thaw
from homeserver.events.room_versions import ALL_ROOM_VERSIONS, V1, V6, V9, V10, V11, V12, RoomVersion

from .helpers import ALICE, BOB, CAROL, RoomBuilder

PAIRS = [(old, new) for old in ALL_ROOM_VERSIONS for new in ALL_ROOM_VERSIONS]


def old_room(version: RoomVersion, *, join_rule: str = C.JR_INVITE, alice_level: int = 100) -> RoomBuilder:
    """Alice's room with Bob joined, every transferable state event, an alias and a custom event."""
    room = RoomBuilder(version)
    room.create(ALICE)
    room.join(ALICE)
    users = {BOB: 50} if version.privileged_creators else {ALICE: alice_level, BOB: 50}
    room.power_levels(ALICE, users, events={"m.room.server_acl": 100, C.TOMBSTONE: 100}, state_default=50)
    room.join_rules(ALICE, join_rule)
    room.add(C.HISTORY_VISIBILITY, ALICE, {"history_visibility": "joined"}, "")
    room.add(C.GUEST_ACCESS, ALICE, {"guest_access": "forbidden"}, "")
    room.add(C.NAME, ALICE, {"name": "Old"}, "")
    room.add(C.TOPIC, ALICE, {"topic": "a topic"}, "")
    room.add("m.room.avatar", ALICE, {"url": "mxc://a.test/x"}, "")
    room.add("m.room.encryption", ALICE, {"algorithm": "m.megolm.v1.aes-sha2"}, "")
    room.add(C.SERVER_ACL, ALICE, {"allow": ["*"], "deny": [], "allow_ip_literals": False}, "")
    room.add("m.room.related_groups", ALICE, {"groups": ["+g:a.test"]}, "")
    room.add(C.CANONICAL_ALIAS, ALICE, {"alias": "#old:a.test"}, "")
    room.add("org.example.custom", ALICE, {"x": 1}, "")
    room.member(ALICE, CAROL, C.BAN, reason="spam")
    if join_rule == C.PUBLIC:
        room.join(BOB)
    else:
        room.member(ALICE, BOB, C.INVITE)
        room.join(BOB)
    return room


def apply_plan(new: RoomVersion, plan_templates: tuple, restore: dict | None) -> RoomBuilder:  # type: ignore[type-arg]
    """Build the planned events on a fresh room, each checked by the new version's auth rules."""
    room = RoomBuilder(new)
    first, *rest = plan_templates
    room.create(ALICE, **{k: v for k, v in thaw(first.content).items() if k not in ("room_version", "creator")})
    templates = list(rest)
    if restore is not None:
        templates.append(type(first)(type=C.POWER_LEVELS, state_key="", content=restore))
    for template in templates:
        event = room.build(template.type, ALICE, thaw(template.content), template.state_key)
        check_auth_rules(new, event, room.state_events())
        room.events[event.event_id] = event
        room.state[(event.type, event.state_key or "")] = event.event_id
        room.last = [event.event_id]
    return room


@pytest.mark.parametrize(("old", "new"), PAIRS, ids=[f"{o.identifier}->{n.identifier}" for o, n in PAIRS])
def test_the_plan_passes_the_new_versions_auth_rules(old: RoomVersion, new: RoomVersion) -> None:
    source = old_room(old)
    assert source.room_id is not None
    plan = plan_upgrade(old, new, source.state_events(), upgrader=ALICE, old_room_id=source.room_id,
                        last_event_id=source.last[0])
    built = apply_plan(new, plan.templates, plan.restore_power_levels)
    state = built.state_events()
    for event_type in TRANSFERABLE_STATE:
        assert (event_type, "") in state, event_type
    assert state[(C.NAME, "")].content["name"] == "Old"
    assert state[(C.CANONICAL_ALIAS, "")].content["alias"] == "#old:a.test"
    assert ("org.example.custom", "") not in state  # not in the spec's list: its sender matters
    assert (C.MEMBER, BOB) not in state  # memberships are never copied, but bans are
    assert state[(C.MEMBER, CAROL)].content == {"membership": C.BAN, "reason": "spam"}
    create = state[(C.CREATE, "")].content
    assert create["predecessor"]["room_id"] == source.room_id
    assert ("event_id" in create["predecessor"]) is (not new.room_id_is_create_event_id)
    users = state[(C.POWER_LEVELS, "")].content["users"]
    assert users[BOB] == 50
    if new.privileged_creators:
        assert ALICE not in users
    else:
        assert users[ALICE] == 100


def test_create_content_keeps_type_and_unfederated_and_v12_creators() -> None:
    source = RoomBuilder(V11)
    source.create(ALICE, type="m.space", **{"m.federate": False})
    source.join(ALICE)
    assert source.room_id is not None
    plan = plan_upgrade(V11, V12, source.state_events(), upgrader=ALICE, old_room_id=source.room_id,
                        last_event_id=source.last[0], additional_creators=(CAROL, ALICE))
    create = thaw(plan.templates[0].content)
    assert create == {"room_version": "12", "predecessor": {"room_id": source.room_id}, "type": "m.space",
                      "m.federate": False, "additional_creators": [CAROL]}
    plan = plan_upgrade(V11, V10, source.state_events(), upgrader=ALICE, old_room_id=source.room_id,
                        last_event_id="$last", additional_creators=(CAROL,))
    create = thaw(plan.templates[0].content)
    assert create["creator"] == ALICE and "additional_creators" not in create
    assert create["predecessor"] == {"room_id": source.room_id, "event_id": "$last"}


def test_the_upgrader_is_raised_while_state_is_copied_then_restored() -> None:
    """Alice may send the tombstone (level 60) but not the server ACL (100): she is raised to
    100 in the new room while its state is sent, then put back to 60."""
    source = RoomBuilder(V10)
    source.create(ALICE)
    source.join(ALICE)
    source.power_levels(ALICE, {ALICE: 100}, events={C.SERVER_ACL: 100, C.TOMBSTONE: 60})
    source.add(C.SERVER_ACL, ALICE, {"allow": ["*"]}, "")
    source.power_levels(ALICE, {ALICE: 60}, events={C.SERVER_ACL: 100, C.TOMBSTONE: 60})
    assert source.room_id is not None
    plan = plan_upgrade(V10, V11, source.state_events(), upgrader=ALICE, old_room_id=source.room_id,
                        last_event_id=None)
    initial = next(t for t in plan.templates if t.type == C.POWER_LEVELS)
    assert thaw(initial.content)["users"][ALICE] == 100
    assert plan.restore_power_levels is not None and plan.restore_power_levels["users"][ALICE] == 60
    built = apply_plan(V11, plan.templates, plan.restore_power_levels)
    assert built.state_events()[(C.POWER_LEVELS, "")].content["users"][ALICE] == 60


def test_a_banned_user_who_outranks_the_upgrader_stays_out_of_the_plan() -> None:
    source = RoomBuilder(V10)
    source.create(ALICE)
    source.join(ALICE)
    source.power_levels(ALICE, {ALICE: 100, BOB: 100})
    source.member(ALICE, CAROL, C.BAN)
    # RoomBuilder runs no auth rules: a state (say after state resolution) where Bob, at
    # Alice's level, is banned. Alice could not ban him in the new room, so she does not try.
    source.member(ALICE, BOB, C.BAN)
    assert source.room_id is not None
    plan = plan_upgrade(V10, V11, source.state_events(), upgrader=ALICE, old_room_id=source.room_id,
                        last_event_id=None)
    banned = {t.state_key for t in plan.templates if t.type == C.MEMBER and t.content["membership"] == C.BAN}
    assert banned == {CAROL}


def test_string_power_levels_become_integers_and_junk_is_dropped() -> None:
    content = {"users": {ALICE: " +100 ", BOB: "x"}, "ban": "50", "kick": True, "events": {"m.x": "7"},
               "notifications": {"room": "20"}, "extra": "kept"}
    assert convert_power_levels(V1, content) == {
        "users": {ALICE: 100}, "ban": 50, "events": {"m.x": 7}, "notifications": {"room": 20}, "extra": "kept",
    }
    # v10 never read strings as levels: they had no effect, so they are not carried over.
    assert convert_power_levels(V10, {"ban": "50", "kick": 20}) == {"kick": 20}


def test_unknown_join_rules_of_the_new_version_become_invite() -> None:
    source = old_room(V9, join_rule=C.RESTRICTED)
    assert source.room_id is not None
    plan = plan_upgrade(V9, V6, source.state_events(), upgrader=ALICE, old_room_id=source.room_id, last_event_id=None)
    rules = next(t for t in plan.templates if t.type == C.JOIN_RULES)
    assert thaw(rules.content) == {"join_rule": C.JR_INVITE}
    plan = plan_upgrade(V9, V11, source.state_events(), upgrader=ALICE, old_room_id=source.room_id,
                        last_event_id=None)
    assert next(t for t in plan.templates if t.type == C.JOIN_RULES).content["join_rule"] == C.RESTRICTED


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ({}, {"events_default": 50, "invite": 50}),
        ({"users_default": 70, "events_default": 0, "invite": "0"}, {"users_default": 70, "events_default": 71,
                                                                     "invite": 71}),
        ({"events_default": 60, "invite": 50}, None),
        ({"events_default": 60, "invite": 10, "ban": "40"}, {"events_default": 60, "invite": 50, "ban": "40"}),
    ],
)
def test_the_old_room_is_locked(content: dict[str, object], expected: dict[str, object] | None) -> None:
    assert locked_power_levels(V1, content) == expected


def test_locked_power_levels_stop_ordinary_users_sending() -> None:
    source = old_room(V11)
    source.power_levels(ALICE, {})  # Bob at users_default, 0
    bob_message = source.build("m.room.message", BOB, {"body": "hi"})
    check_auth_rules(V11, bob_message, {k: source.events[v] for k, v in source.state.items()})
    locked = locked_power_levels(V11, source.state_events()[(C.POWER_LEVELS, "")].content)
    assert locked is not None
    source.add(C.POWER_LEVELS, ALICE, locked, "")
    bob_message = source.build("m.room.message", BOB, {"body": "hi"})
    with pytest.raises(AuthError):
        check_auth_rules(V11, bob_message, {k: source.events[v] for k, v in source.state.items()})


def test_members_are_invited_unless_the_room_is_public() -> None:
    source = old_room(V11)
    state = source.state_events()
    assert users_to_invite(V11, state, ALICE, C.JR_INVITE) == [BOB]
    assert users_to_invite(V11, state, ALICE, C.PUBLIC) == []
    assert users_to_invite(V11, state, BOB, C.JR_KNOCK) == [ALICE]


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({}, InvalidCreateRoomRequest),
        ({"new_version": 12}, InvalidCreateRoomRequest),
        ({"new_version": "13"}, UnsupportedRoomVersion),
        ({"new_version": "12", "additional_creators": "@a:b"}, InvalidCreateRoomRequest),
        ({"new_version": "12", "additional_creators": ["not a user"]}, InvalidCreateRoomRequest),
        ({"new_version": "12", "additional_creators": [f"@u{i}:a.test" for i in range(101)]},
         InvalidCreateRoomRequest),
    ],
)
def test_bad_requests(body: dict[str, object], error: type[EventsError]) -> None:
    with pytest.raises(error):
        parse_upgrade_request(body)


def test_additional_creators_only_count_where_the_version_has_them() -> None:
    assert parse_upgrade_request({"new_version": "12", "additional_creators": [BOB, BOB]}).additional_creators == (
        BOB,)
    assert parse_upgrade_request({"new_version": "11", "additional_creators": [BOB]}).additional_creators == ()
    assert parse_upgrade_request({"new_version": "12"}).new_version is V12
