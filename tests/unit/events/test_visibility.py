"""History visibility: the spec's rules, one row each, plus the before-or-after cases."""

from __future__ import annotations

import pytest

from homeserver.events import can_see_event
from homeserver.events import constants as C
from homeserver.events.event import FrozenEvent, StateKey
from homeserver.events.room_versions import V11

from .helpers import ALICE, BOB, standard_room


def _state(visibility: str | None, bob_membership: str | None) -> tuple[dict[StateKey, FrozenEvent], FrozenEvent]:
    room = standard_room(V11)
    if visibility is not None:
        room.add(C.HISTORY_VISIBILITY, ALICE, {"history_visibility": visibility}, "")
    if bob_membership == C.JOIN:
        room.join(BOB)
    elif bob_membership is not None:
        room.member(ALICE if bob_membership in (C.INVITE, C.BAN) else BOB, BOB, bob_membership)
    message = room.build("m.room.message", ALICE, {"body": "x"})
    return room.state_events(), message


CASES = [
    # (history_visibility, bob's membership at the event, joined later, visible)
    (C.WORLD_READABLE, None, False, True),
    (C.JOINED, C.JOIN, False, True),
    (C.SHARED, None, True, True),
    (C.SHARED, None, False, False),
    (None, None, True, True),  # unset means shared
    ("bogus", None, True, True),  # not understood means shared
    (C.INVITED, C.INVITE, False, True),
    (C.JOINED, C.INVITE, False, False),
    (C.JOINED, None, True, False),
    (C.INVITED, C.LEAVE, True, False),
    (C.SHARED, C.BAN, False, False),
]


@pytest.mark.parametrize(("visibility", "membership", "joined_later", "visible"), CASES)
def test_rules(visibility: str | None, membership: str | None, joined_later: bool, visible: bool) -> None:
    state, message = _state(visibility, membership)
    assert can_see_event(BOB, message, state, joined_after_event=joined_later) is visible


def test_history_visibility_event_visible_if_before_or_after_allows() -> None:
    room = standard_room(V11)
    room.add(C.HISTORY_VISIBILITY, ALICE, {"history_visibility": C.JOINED}, "")
    to_world = room.build(C.HISTORY_VISIBILITY, ALICE, {"history_visibility": C.WORLD_READABLE}, "")
    assert can_see_event(BOB, to_world, room.state_events(), joined_after_event=False)
    to_joined = room.build(C.HISTORY_VISIBILITY, ALICE, {"history_visibility": C.JOINED}, "")
    assert not can_see_event(BOB, to_joined, room.state_events(), joined_after_event=False)


def test_own_membership_event_visible_if_before_or_after_allows() -> None:
    room = standard_room(V11)
    room.add(C.HISTORY_VISIBILITY, ALICE, {"history_visibility": C.JOINED}, "")
    own_join = room.build(C.MEMBER, BOB, {"membership": C.JOIN}, BOB)
    assert can_see_event(BOB, own_join, room.state_events(), joined_after_event=False)
    room.join(BOB)
    own_leave = room.build(C.MEMBER, BOB, {"membership": C.LEAVE}, BOB)
    assert can_see_event(BOB, own_leave, room.state_events(), joined_after_event=False)
    someone_else = room.build(C.MEMBER, "@x:x.test", {"membership": C.JOIN}, "@x:x.test")
    room.member(BOB, BOB, C.LEAVE)
    assert not can_see_event(BOB, someone_else, room.state_events(), joined_after_event=False)


def test_own_leave_is_always_visible() -> None:
    """Rejecting an invite under ``joined`` history: the leave is still the user's to see (as
    Synapse, so the room can leave their client), and another user's leave is not."""
    room = standard_room(V11)
    room.add(C.HISTORY_VISIBILITY, ALICE, {"history_visibility": C.JOINED}, "")
    room.member(ALICE, BOB, C.INVITE)
    rejection = room.build(C.MEMBER, BOB, {"membership": C.LEAVE}, BOB)
    assert can_see_event(BOB, rejection, room.state_events(), joined_after_event=False)
    assert not can_see_event("@carol:example.org", rejection, room.state_events(), joined_after_event=False)
