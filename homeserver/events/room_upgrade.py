"""What a room upgrade sends, as pure functions: no store, no network, no clock.

``parse_upgrade_request`` checks a ``POST /rooms/{roomId}/upgrade`` body; ``plan_upgrade``
turns the old room's current state into the new room's initial events (the create event
with ``predecessor``, the upgrader's join, power levels, the transferable state, the
old room's bans, the canonical alias) plus the power levels to restore once they are sent;
``locked_power_levels`` is the old room's power levels with sending and inviting raised;
``users_to_invite`` names who needs an invite into the new room. Sending these events,
moving aliases and the tombstone are ``homeserver.handlers.rooms.room_upgrade``'s.
"""

# tests: tests/unit/events/test_room_upgrade.py

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import attrs

from homeserver.events import constants as C
from homeserver.events.auth import power_level_value, room_creators
from homeserver.events.builder import EventTemplate
from homeserver.events.canonical import JsonDict, thaw
from homeserver.events.errors import InvalidCreateRoomRequest
from homeserver.events.event import FrozenEvent, StateKey
from homeserver.events.identifiers import is_valid_user_id
from homeserver.events.room_creation import CreateRoomRequest, default_power_levels
from homeserver.events.room_versions import RoomVersion, get_room_version

ENCRYPTION: Final = "m.room.encryption"
AVATAR: Final = "m.room.avatar"
RELATED_GROUPS: Final = "m.room.related_groups"
SPACE_CHILD: Final = "m.space.child"
SPACE: Final = "m.space"
FEDERATE: Final = "m.federate"

TRANSFERABLE_STATE: Final = (
    C.SERVER_ACL,
    ENCRYPTION,
    C.NAME,
    AVATAR,
    C.TOPIC,
    C.GUEST_ACCESS,
    C.HISTORY_VISIBILITY,
    C.JOIN_RULES,
    RELATED_GROUPS,
)
"""State (state key ``""``) copied to the new room: the spec's recommended list, plus the
legacy ``m.room.related_groups`` as the reference server does. Power levels and the canonical
alias are handled on their own; memberships are never copied (a server cannot sign for
another server's users), nor events outside the ``m.`` namespace (their sender matters)."""

MAX_ADDITIONAL_CREATORS: Final = 100

TOMBSTONE_BODY: Final = "This room has been replaced"

_PL_LEVEL_KEYS: Final = ("users_default", "events_default", "state_default", "ban", "kick", "redact", "invite")
_PL_MAP_KEYS: Final = ("users", "events", "notifications")


@attrs.frozen(slots=True)
class UpgradeRequest:
    new_version: RoomVersion
    additional_creators: tuple[str, ...] = ()


def parse_upgrade_request(body: Mapping[str, object]) -> UpgradeRequest:
    """``{"new_version", "additional_creators"?}``: ``UnsupportedRoomVersion`` for a version we
    do not know, ``InvalidCreateRoomRequest`` for a malformed body. ``additional_creators``
    is checked always and used only by versions with privileged creators (v12), as the spec says."""
    version = body.get("new_version")
    if not isinstance(version, str):
        raise InvalidCreateRoomRequest("new_version", "expected a room version string")
    new_version = get_room_version(version)
    raw = body.get(C.ADDITIONAL_CREATORS, [])
    if raw is None:
        raw = []
    if not isinstance(raw, list) or not all(is_valid_user_id(u) for u in raw):
        raise InvalidCreateRoomRequest(C.ADDITIONAL_CREATORS, "expected an array of user IDs")
    if len(raw) > MAX_ADDITIONAL_CREATORS:
        raise InvalidCreateRoomRequest(C.ADDITIONAL_CREATORS, f"at most {MAX_ADDITIONAL_CREATORS} user IDs")
    creators = tuple(dict.fromkeys(str(u) for u in raw)) if new_version.privileged_creators else ()
    return UpgradeRequest(new_version=new_version, additional_creators=creators)


@attrs.frozen(slots=True)
class UpgradePlan:
    """The new room's events in order (``templates[0]`` is the create event), and the
    power levels to send after them when the upgrader was raised to send them."""

    templates: tuple[EventTemplate, ...]
    restore_power_levels: JsonDict | None


def _int_or_none(old_version: RoomVersion, value: object) -> int | None:
    return power_level_value(old_version, value)


def convert_power_levels(old_version: RoomVersion, content: Mapping[str, Any]) -> JsonDict:
    """The old room's power levels as the new room's version accepts them: values the old
    version read as levels (v1-v9 allow strings holding integers) become integers; anything
    the old version did not read as a level is dropped (it had no effect there either)."""
    out: JsonDict = {}
    for key, value in thaw(content).items():
        if key in _PL_LEVEL_KEYS:
            level = _int_or_none(old_version, value)
            if level is not None:
                out[key] = level
        elif key in _PL_MAP_KEYS:
            if isinstance(value, dict):
                levels = {k: _int_or_none(old_version, v) for k, v in value.items()}
                out[key] = {k: v for k, v in levels.items() if v is not None}
        else:
            out[key] = value
    return out


def _needed_level(power_levels: Mapping[str, Any]) -> int:
    """The level that can send every state event (and ban) the new room gets at creation."""
    levels = [50, 100]  # the defaults of state_default / power levels, when absent
    for key in ("state_default", "ban", "kick", "redact", "invite"):
        value = power_levels.get(key)
        if isinstance(value, int):
            levels.append(value)
    events = power_levels.get("events")
    if isinstance(events, dict):
        levels.extend(v for v in events.values() if isinstance(v, int))
    return max(levels)


CREATOR_LEVEL: Final = 2**63
"""Stands for a v12 creator's infinite power when comparing levels here."""


def _level_of(power_levels: Mapping[str, Any], user_id: str) -> int:
    users = power_levels.get("users")
    level = users.get(user_id) if isinstance(users, dict) else None
    if not isinstance(level, int):
        level = power_levels.get("users_default", 0)
    return level if isinstance(level, int) else 0


def _join_rules_content(new_version: RoomVersion, content: Mapping[str, Any]) -> JsonDict:
    """The old join rules, or ``invite`` where the new version does not know the rule."""
    rule = content.get("join_rule")
    supported = {C.PUBLIC, C.JR_INVITE, C.PRIVATE}
    if new_version.knock_join_rule:
        supported.add(C.JR_KNOCK)
    if new_version.restricted_join_rule:
        supported.add(C.RESTRICTED)
    if new_version.knock_restricted_join_rule:
        supported.add(C.KNOCK_RESTRICTED)
    if rule in supported:
        kept: JsonDict = thaw(content)
        return kept
    return {"join_rule": C.JR_INVITE}


def create_content(
    old_version: RoomVersion,
    new_version: RoomVersion,
    old_create: FrozenEvent | None,
    *,
    upgrader: str,
    old_room_id: str,
    last_event_id: str | None,
    additional_creators: tuple[str, ...],
) -> JsonDict:
    """The new ``m.room.create`` content: ``room_version``, ``predecessor`` (``event_id``, the
    old room's last event, only for versions whose room IDs are not the create event's: v12
    rooms are created before the tombstone can name them), ``creator`` where the version
    has it, the old room's ``type`` and ``m.federate: false``, and v12's additional creators."""
    predecessor: JsonDict = {"room_id": old_room_id}
    if last_event_id is not None and not new_version.room_id_is_create_event_id:
        predecessor["event_id"] = last_event_id
    content: JsonDict = {"room_version": new_version.identifier, "predecessor": predecessor}
    if new_version.create_content_has_creator:
        content["creator"] = upgrader
    if old_create is not None:
        room_type = old_create.content.get("type")
        if isinstance(room_type, str):
            content["type"] = room_type
        if old_create.content.get(FEDERATE) is False:
            content[FEDERATE] = False
    extra = [u for u in additional_creators if u != upgrader]
    if new_version.privileged_creators and extra:
        content[C.ADDITIONAL_CREATORS] = extra
    return content


def plan_upgrade(
    old_version: RoomVersion,
    new_version: RoomVersion,
    old_state: Mapping[StateKey, FrozenEvent],
    *,
    upgrader: str,
    old_room_id: str,
    last_event_id: str | None,
    additional_creators: tuple[str, ...] = (),
    upgrader_join_content: Mapping[str, object] | None = None,
) -> UpgradePlan:
    """The new room's events, in the order they are sent (see the module docstring)."""
    old_create = old_state.get((C.CREATE, ""))
    create = create_content(
        old_version, new_version, old_create, upgrader=upgrader, old_room_id=old_room_id,
        last_event_id=last_event_id, additional_creators=additional_creators,
    )
    templates = [EventTemplate(type=C.CREATE, state_key="", content=create)]
    join: JsonDict = thaw(upgrader_join_content or {})
    join["membership"] = C.JOIN
    templates.append(EventTemplate(type=C.MEMBER, state_key=upgrader, content=join))

    old_pl = old_state.get((C.POWER_LEVELS, ""))
    if old_pl is not None:
        power_levels = convert_power_levels(old_version, old_pl.content)
    else:
        power_levels = default_power_levels(new_version, upgrader, CreateRoomRequest())
    users = power_levels.setdefault("users", {})
    if new_version.privileged_creators:
        # v12 creators have infinite power and may not be listed.
        for creator in {upgrader, *additional_creators}:
            users.pop(creator, None)
    elif old_version.privileged_creators and old_create is not None:
        if upgrader in room_creators(old_version, old_create):
            users[upgrader] = 100  # an old room's creator, unlisted there, is its new room's admin
    restore: JsonDict | None = None
    if not new_version.privileged_creators:
        needed = _needed_level(power_levels)
        current = users.get(upgrader, power_levels.get("users_default", 0))
        if not isinstance(current, int) or current < needed:
            # Raised while the copied state is sent, restored after (the old levels may
            # let the upgrader send a tombstone but not, say, the server ACL).
            restore = power_levels
            power_levels = {**power_levels, "users": {**users, upgrader: needed}}
    templates.append(EventTemplate(type=C.POWER_LEVELS, state_key="", content=power_levels))

    for event_type in TRANSFERABLE_STATE:
        event = old_state.get((event_type, ""))
        if event is None:
            continue
        content = thaw(event.content)
        if event_type == C.JOIN_RULES:
            content = _join_rules_content(new_version, content)
        templates.append(EventTemplate(type=event_type, state_key="", content=content))
    if old_create is not None and old_create.content.get("type") == SPACE:
        # A space keeps its children.
        for (event_type, state_key), event in sorted(old_state.items()):
            if event_type == SPACE_CHILD and event.content:
                templates.append(EventTemplate(type=SPACE_CHILD, state_key=state_key, content=thaw(event.content)))
    # Bans carry over (sent by the upgrader, so no one is impersonated): a user banned from
    # the old room must not walk into the new one. Only those the upgrader outranks there.
    upgrader_level = CREATOR_LEVEL if new_version.privileged_creators else _level_of(power_levels, upgrader)
    for (event_type, state_key), event in sorted(old_state.items()):
        if event_type == C.MEMBER and event.membership == C.BAN and state_key != upgrader:
            if new_version.privileged_creators and state_key in additional_creators:
                continue
            if _level_of(power_levels, state_key) < upgrader_level:
                ban: JsonDict = {"membership": C.BAN}
                reason = event.content.get("reason")
                if isinstance(reason, str):
                    ban["reason"] = reason
                templates.append(EventTemplate(type=C.MEMBER, state_key=state_key, content=ban))
    canonical = old_state.get((C.CANONICAL_ALIAS, ""))
    if canonical is not None and canonical.content:
        templates.append(EventTemplate(type=C.CANONICAL_ALIAS, state_key="", content=thaw(canonical.content)))
    return UpgradePlan(templates=tuple(templates), restore_power_levels=restore)


def locked_power_levels(old_version: RoomVersion, content: Mapping[str, Any] | None) -> JsonDict | None:
    """The old room's power levels with ``events_default`` and ``invite`` raised to the greater
    of 50 and ``users_default + 1`` (the spec's example), so ordinary users can no longer
    send or invite; ``None`` when they are that high already."""
    levels = convert_power_levels(old_version, content or {})
    users_default = levels.get("users_default", 0)
    restricted = max(50, users_default + 1)
    changed = False
    for key, default in (("events_default", 0), ("invite", 0)):
        if levels.get(key, default) < restricted:
            levels[key] = restricted
            changed = True
    if not changed:
        return None
    # Written back with the old room's own values for everything else (string levels in
    # v1-v9 rooms included), changing only the two keys.
    out: JsonDict = thaw(content or {})
    out["events_default"] = levels["events_default"]
    out["invite"] = levels["invite"]
    return out


def users_to_invite(
    new_version: RoomVersion, old_state: Mapping[StateKey, FrozenEvent], upgrader: str, join_rule: str | None
) -> list[str]:
    """Who is invited into the new room: the old room's joined members (not the upgrader,
    nor v12 creators, who may join anyway) when the new room's join rule needs an invite
    (anything but ``public``), as the reference server does for invite-only rooms."""
    if join_rule in (None, C.PUBLIC):
        return []
    members = sorted(
        key[1] for key, event in old_state.items() if key[0] == C.MEMBER and event.membership == C.JOIN
    )
    return [user for user in members if user != upgrader]
