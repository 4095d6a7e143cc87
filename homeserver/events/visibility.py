"""History visibility: may a user see an event, given the room state at that event.

Implements the server behaviour of the "Room History Visibility" module for ``/messages``
and ``/sync``. The caller supplies the state *before* the event (at least the
``m.room.history_visibility`` event and the user's ``m.room.member`` event) and whether
the user joined the room at any point after the event.
"""

# tests: tests/unit/events/test_visibility.py

from __future__ import annotations

from collections.abc import Mapping

from homeserver.events import constants as C
from homeserver.events.event import FrozenEvent, StateKey

_KNOWN = frozenset({C.WORLD_READABLE, C.SHARED, C.INVITED, C.JOINED})


def _visibility_of(event: FrozenEvent | None) -> str:
    value = None if event is None else event.content.get("history_visibility")
    # Unset or not understood: "shared".
    return value if isinstance(value, str) and value in _KNOWN else C.SHARED


def _membership_of(event: FrozenEvent | None) -> str | None:
    return None if event is None else event.membership


def _allowed(visibility: str, membership: str | None, joined_later: bool) -> bool:
    if visibility == C.WORLD_READABLE:
        return True
    if membership == C.JOIN:
        return True
    if visibility == C.SHARED and joined_later:
        return True
    return membership == C.INVITE and visibility == C.INVITED


def can_see_event(
    user_id: str,
    event: FrozenEvent,
    state_before: Mapping[StateKey, FrozenEvent],
    *,
    joined_after_event: bool,
) -> bool:
    """The spec's five rules, checked with the state at the event.

    ``joined_after_event``: the user's membership became ``join`` at some point after
    the event (a user who is joined now and was not at the event qualifies). The user's own
    ``leave`` event is always visible to them (as Synapse). For an
    ``m.room.history_visibility`` event, and for the user's own membership events, the
    user may see it if the state before *or* after the event would allow it.
    """
    if event.state_key_tuple == (C.MEMBER, user_id) and event.membership == C.LEAVE:
        # The user's own leave (a rejected invite, a retracted knock, a kick) is always theirs
        # to see, as Synapse: otherwise the room could not disappear from their client.
        return True
    hv_event = state_before.get((C.HISTORY_VISIBILITY, ""))
    member_event = state_before.get((C.MEMBER, user_id))
    visibilities = [_visibility_of(hv_event)]
    memberships = [_membership_of(member_event)]
    if event.state_key_tuple == (C.HISTORY_VISIBILITY, ""):
        visibilities.append(_visibility_of(event))
    if event.state_key_tuple == (C.MEMBER, user_id):
        memberships.append(event.membership)
    return any(
        _allowed(v, m, joined_after_event) for v in visibilities for m in memberships
    )
