"""``MembershipPrecondition``: the client API's kick/unban rules on current state, and their JSON form."""

from __future__ import annotations

import pytest

from homeserver.events import AuthError
from homeserver.events import constants as C
from homeserver.events.room_versions import V11
from homeserver.handlers.rooms.room_events import MembershipPrecondition
from homeserver.handlers.rooms.rooms import ACTION_TARGET_MEMBERSHIPS
from tests.unit.events.helpers import ALICE, BOB, standard_room

KICK = MembershipPrecondition(BOB, *ACTION_TARGET_MEMBERSHIPS["kick"])
UNBAN = MembershipPrecondition(BOB, *ACTION_TARGET_MEMBERSHIPS["unban"])


@pytest.mark.parametrize(
    ("bob", "kick_ok", "unban_ok"),
    [
        (None, False, False),
        (C.JOIN, True, False),
        (C.INVITE, True, False),
        (C.LEAVE, False, False),
        (C.BAN, False, True),
    ],
)
def test_kick_needs_a_target_in_the_room_and_unban_a_banned_one(bob: str | None, kick_ok: bool, unban_ok: bool) -> None:
    room = standard_room(V11)
    if bob == C.JOIN:
        room.join(BOB)
    elif bob == C.LEAVE:
        room.join(BOB)
        room.member(BOB, BOB, C.LEAVE)
    elif bob is not None:
        room.member(ALICE, BOB, bob)
    state = room.state_events()
    for rule, allowed in ((KICK, kick_ok), (UNBAN, unban_ok)):
        if allowed:
            rule.check(state)
        else:
            with pytest.raises(AuthError, match=rule.message):
                rule.check(state)


def test_json_round_trip_and_malformed_input() -> None:
    assert MembershipPrecondition.from_json(KICK.to_json()) == KICK
    for bad in (None, [], {"user_id": BOB, "allowed": "join", "message": "m"},
                {"user_id": 1, "allowed": [], "message": "m"}, {"user_id": BOB, "allowed": [3], "message": "m"},
                {"allowed": [], "message": "m"}):
        with pytest.raises(ValueError):
            MembershipPrecondition.from_json(bad)
