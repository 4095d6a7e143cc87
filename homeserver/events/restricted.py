"""Restricted join rules (room versions 8+): who may join through ``allow``, and who vouches.

A join under the ``restricted`` (or, v10+, ``knock_restricted``) rule by a user who is not
already invited or joined needs ``join_authorised_via_users_server``: a user of a resident
server who can invite. The resident server decides, before building the join, whether the
joiner meets one of the ``allow`` conditions (``m.room_membership``: joined to a given room)
and which of its users to name. These are pure decisions over state the caller loaded; the
membership lookups in other rooms are the caller's.
"""

# tests: tests/unit/events/test_restricted.py

from __future__ import annotations

from collections.abc import Iterable, Mapping

from homeserver.events import constants as C
from homeserver.events.auth import StateMap, get_named_level, get_user_power_level, restricted_join_rules
from homeserver.events.identifiers import is_valid_room_id, server_name_of
from homeserver.events.room_versions import RoomVersion

ROOM_MEMBERSHIP = "m.room_membership"
"""The one ``allow`` condition type the spec defines."""


def needs_authorisation(room_version: RoomVersion, state: StateMap, user_id: str) -> bool:
    """Whether a join of ``user_id`` against ``state`` must name an authorising user."""
    rules = restricted_join_rules(room_version)
    event = state.get((C.JOIN_RULES, ""))
    join_rule = None if event is None else event.content.get("join_rule")
    if join_rule not in rules:
        return False
    member = state.get((C.MEMBER, user_id))
    return member is None or member.membership not in (C.JOIN, C.INVITE)


def allowed_room_ids(state: StateMap) -> list[str]:
    """The rooms whose members may join: the ``m.room_membership`` entries of ``allow``
    (malformed and unknown entries are ignored, as the spec says)."""
    event = state.get((C.JOIN_RULES, ""))
    allow = None if event is None else event.content.get("allow")
    if not isinstance(allow, tuple):
        return []
    rooms: list[str] = []
    for entry in allow:
        if isinstance(entry, Mapping) and entry.get("type") == ROOM_MEMBERSHIP:
            room_id = entry.get("room_id")
            if is_valid_room_id(room_id) and isinstance(room_id, str) and room_id not in rooms:
                rooms.append(room_id)
    return rooms


def authoriser_candidates(state: StateMap) -> list[str]:
    """Users who may be able to vouch: those the power levels list (the only ones who can hold
    more than the default level), plus the create event's sender. The caller loads their
    membership events before ``choose_authoriser``."""
    users: list[str] = []
    pl = state.get((C.POWER_LEVELS, ""))
    listed = None if pl is None else pl.content.get("users")
    if isinstance(listed, Mapping):
        users.extend(u for u in listed if isinstance(u, str))
    create = state.get((C.CREATE, ""))
    if create is not None:
        users.append(create.sender)
    return list(dict.fromkeys(users))


def choose_authoriser(
    room_version: RoomVersion, state: StateMap, server_name: str, extra_users: Iterable[str] = ()
) -> str | None:
    """A joined user of ``server_name`` with at least the invite level, the most powerful first
    (ties by user ID, so every worker picks the same); ``None`` when there is none."""
    invite_level = get_named_level(state, "invite")
    candidates = []
    for user_id in dict.fromkeys([*authoriser_candidates(state), *extra_users]):
        if server_name_of(user_id) != server_name:
            continue
        member = state.get((C.MEMBER, user_id))
        if member is None or member.membership != C.JOIN:
            continue
        level = get_user_power_level(room_version, user_id, state)
        if level >= invite_level:
            candidates.append((-level, user_id))
    return min(candidates)[1] if candidates else None
