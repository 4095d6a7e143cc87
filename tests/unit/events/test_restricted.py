"""Restricted joins: when a join needs an authoriser, which rooms admit, who vouches."""

from __future__ import annotations

import pytest

from homeserver.events import constants as C
from homeserver.events.restricted import allowed_room_ids, choose_authoriser, needs_authorisation
from homeserver.events.room_versions import ALL_ROOM_VERSIONS, V7, V8, V9, V10, RoomVersion

from .helpers import ALICE, BOB, CAROL, standard_room

RESTRICTED = [v for v in ALL_ROOM_VERSIONS if v.restricted_join_rule]
ALLOW = [{"type": "m.room_membership", "room_id": "!other:a.test"}, {"type": "org.unknown"},
         {"type": "m.room_membership", "room_id": 5}, "junk", {"type": "m.room_membership", "room_id": "!two:b.test"}]


@pytest.mark.parametrize("version", RESTRICTED)
def test_restricted_join_needs_an_authoriser_unless_invited_or_joined(version: RoomVersion) -> None:
    room = standard_room(version, C.RESTRICTED)
    room.join_rules(ALICE, C.RESTRICTED, allow=ALLOW)
    state = room.state_events()
    assert needs_authorisation(version, state, BOB)
    assert not needs_authorisation(version, state, ALICE)
    room.member(ALICE, BOB, C.INVITE)
    assert not needs_authorisation(version, room.state_events(), BOB)
    assert allowed_room_ids(state) == ["!other:a.test", "!two:b.test"]


def test_knock_restricted_from_v10_only_and_nothing_before_v8() -> None:
    for version, expected in ((V7, False), (V8, False), (V9, False), (V10, True)):
        room = standard_room(version, C.KNOCK_RESTRICTED)
        assert needs_authorisation(version, room.state_events(), BOB) is expected
    room = standard_room(V7, C.RESTRICTED)
    assert not needs_authorisation(V7, room.state_events(), BOB)


@pytest.mark.parametrize("version", RESTRICTED)
def test_the_authoriser_is_the_most_powerful_local_member_who_can_invite(version: RoomVersion) -> None:
    room = standard_room(version, C.RESTRICTED)
    room.join(BOB)
    room.join(CAROL)
    users = {BOB: 60} if version.privileged_creators else {ALICE: 100, BOB: 60}
    room.power_levels(ALICE, users, invite=50)
    state = room.state_events()
    assert choose_authoriser(version, state, "a.test") == ALICE  # the creator (100, or infinite in v12)
    assert choose_authoriser(version, state, "b.test") == BOB
    assert choose_authoriser(version, state, "c.test") is None  # Carol is below the invite level
    room.member(ALICE, BOB, C.BAN)
    assert choose_authoriser(version, room.state_events(), "b.test") is None  # not joined any more
