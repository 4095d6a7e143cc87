"""The initial events of ``/createRoom``, in the order the spec prescribes, as templates.

``parse_create_room_request`` turns the request body into a typed ``CreateRoomRequest``
(``InvalidCreateRoomRequest`` on bad input); ``initial_room_events`` returns the event
templates to build, sign, auth-check and persist one after another. Third-party invites
(``invite_3pid``) need an identity server and are left to the handler.
"""

# tests: tests/unit/events/test_room_creation.py

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import attrs

from homeserver.events import constants as C
from homeserver.events.builder import EventTemplate
from homeserver.events.canonical import JsonDict, JsonMapping, check_canonical, freeze, thaw
from homeserver.events.errors import InvalidCreateRoomRequest, InvalidEvent
from homeserver.events.identifiers import is_valid_user_id
from homeserver.events.room_versions import RoomVersion

PRIVATE_CHAT: Final = "private_chat"
TRUSTED_PRIVATE_CHAT: Final = "trusted_private_chat"
PUBLIC_CHAT: Final = "public_chat"


@attrs.frozen(slots=True)
class Preset:
    """The state a preset sets (the table in the ``/createRoom`` description)."""

    join_rule: str
    history_visibility: str
    guest_access: str
    invitees_are_admins: bool
    invite_level: int
    """Our choice (the spec leaves the default power levels to the server)."""


PRESETS: Final[Mapping[str, Preset]] = {
    PRIVATE_CHAT: Preset(C.JR_INVITE, C.SHARED, "can_join", False, 0),
    TRUSTED_PRIVATE_CHAT: Preset(C.JR_INVITE, C.SHARED, "can_join", True, 0),
    PUBLIC_CHAT: Preset(C.PUBLIC, C.SHARED, "forbidden", False, 50),
}


def _frozen_mapping(value: Mapping[str, object]) -> JsonMapping:
    frozen = freeze(value)
    assert isinstance(frozen, Mapping)
    return frozen


@attrs.frozen(slots=True)
class CreateRoomRequest:
    """A parsed ``/createRoom`` body."""

    preset: str | None = None
    visibility: str = "private"
    name: str | None = None
    topic: str | None = None
    room_alias_name: str | None = None
    invite: tuple[str, ...] = ()
    invite_3pid: tuple[JsonMapping, ...] = ()
    initial_state: tuple[EventTemplate, ...] = ()
    creation_content: JsonMapping = attrs.field(factory=dict, converter=_frozen_mapping)
    power_level_content_override: JsonMapping | None = None
    is_direct: bool = False
    room_version: str | None = None

    @property
    def effective_preset(self) -> str:
        """The preset, or the one implied by ``visibility`` when none was given."""
        if self.preset is not None:
            return self.preset
        return PUBLIC_CHAT if self.visibility == "public" else PRIVATE_CHAT


def _opt_str(body: Mapping[str, object], key: str) -> str | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidCreateRoomRequest(key, f"expected a string, got {type(value).__name__}")
    return value


def _object(value: object, key: str) -> JsonMapping:
    if not isinstance(value, Mapping):
        raise InvalidCreateRoomRequest(key, f"expected an object, got {type(value).__name__}")
    try:
        check_canonical(value, what=key)
    except InvalidEvent as e:
        raise InvalidCreateRoomRequest(key, str(e)) from None
    return _frozen_mapping(value)


def parse_create_room_request(body: Mapping[str, object]) -> CreateRoomRequest:
    """Check the types of a ``/createRoom`` body; raise ``InvalidCreateRoomRequest`` when wrong."""
    preset = _opt_str(body, "preset")
    if preset is not None and preset not in PRESETS:
        raise InvalidCreateRoomRequest("preset", f"unknown preset {preset!r}")
    visibility = _opt_str(body, "visibility") or "private"
    if visibility not in ("public", "private"):
        raise InvalidCreateRoomRequest("visibility", f"expected 'public' or 'private', got {visibility!r}")
    alias = _opt_str(body, "room_alias_name")
    if alias is not None and (not alias or ":" in alias or any(c.isspace() for c in alias)):
        raise InvalidCreateRoomRequest("room_alias_name", f"not a valid alias localpart: {alias!r}")

    invite_raw = body.get("invite", [])
    if not isinstance(invite_raw, list) or not all(is_valid_user_id(u) for u in invite_raw):
        raise InvalidCreateRoomRequest("invite", "expected an array of user IDs")
    invite_3pid_raw = body.get("invite_3pid", [])
    if not isinstance(invite_3pid_raw, list):
        raise InvalidCreateRoomRequest("invite_3pid", "expected an array of objects")

    initial_state: list[EventTemplate] = []
    raw_state = body.get("initial_state", [])
    if not isinstance(raw_state, list):
        raise InvalidCreateRoomRequest("initial_state", "expected an array of state events")
    for index, item in enumerate(raw_state):
        where = f"initial_state[{index}]"
        if not isinstance(item, Mapping):
            raise InvalidCreateRoomRequest(where, "expected an object")
        event_type, state_key = item.get("type"), item.get("state_key", "")
        if not isinstance(event_type, str) or not isinstance(state_key, str):
            raise InvalidCreateRoomRequest(where, "needs a string 'type' and string 'state_key'")
        if event_type == C.CREATE:
            raise InvalidCreateRoomRequest(where, "m.room.create cannot be given in initial_state")
        content = _object(item.get("content"), f"{where}.content")
        initial_state.append(EventTemplate(type=event_type, state_key=state_key, content=content))

    override_raw = body.get("power_level_content_override")
    is_direct = body.get("is_direct", False)
    if not isinstance(is_direct, bool):
        raise InvalidCreateRoomRequest("is_direct", "expected a boolean")
    return CreateRoomRequest(
        preset=preset,
        visibility=visibility,
        name=_opt_str(body, "name"),
        topic=_opt_str(body, "topic"),
        room_alias_name=alias,
        invite=tuple(str(u) for u in invite_raw),
        invite_3pid=tuple(_object(i, "invite_3pid") for i in invite_3pid_raw),
        initial_state=tuple(initial_state),
        creation_content=_object(body.get("creation_content", {}), "creation_content"),
        power_level_content_override=(
            None if override_raw is None else _object(override_raw, "power_level_content_override")
        ),
        is_direct=is_direct,
        room_version=_opt_str(body, "room_version"),
    )


def create_event_content(
    room_version: RoomVersion, creator: str, request: CreateRoomRequest
) -> JsonDict:
    """``m.room.create`` content: ``creation_content`` with ``room_version`` (and, in v10,
    ``creator``) overwritten; in v12 with ``trusted_private_chat``, invitees are added to
    ``additional_creators`` (deduplicated)."""
    content: JsonDict = thaw(request.creation_content)
    content["room_version"] = room_version.identifier
    if room_version.create_content_has_creator:
        content["creator"] = creator
    else:
        content.pop("creator", None)
    if room_version.privileged_creators and request.effective_preset == TRUSTED_PRIVATE_CHAT:
        existing = content.get(C.ADDITIONAL_CREATORS, [])
        if not isinstance(existing, list):
            raise InvalidCreateRoomRequest("creation_content.additional_creators", "expected an array")
        merged = list(dict.fromkeys([*existing, *request.invite]))
        content[C.ADDITIONAL_CREATORS] = [u for u in merged if u != creator]
    return content


def default_power_levels(room_version: RoomVersion, creator: str, request: CreateRoomRequest) -> JsonDict:
    """Our default ``m.room.power_levels`` content, before ``power_level_content_override``.

    v10/v11 list the creator (and, for ``trusted_private_chat``, the invitees) at 100;
    v12 lists nobody, since creators are implicitly infinite and may not be listed, and
    raises the ``m.room.tombstone`` level above ``state_default`` as the spec requires.
    """
    preset = PRESETS[request.effective_preset]
    users: JsonDict = {}
    if not room_version.privileged_creators:
        users[creator] = 100
        if preset.invitees_are_admins:
            for invitee in request.invite:
                users[invitee] = 100
    return {
        "users": users,
        "users_default": 0,
        "events": {
            C.NAME: 50,
            C.POWER_LEVELS: 100,
            C.HISTORY_VISIBILITY: 100,
            C.CANONICAL_ALIAS: 50,
            "m.room.avatar": 50,
            C.TOMBSTONE: 150 if room_version.privileged_creators else 100,
            "m.room.server_acl": 100,
            "m.room.encryption": 100,
        },
        "events_default": 0,
        "state_default": 50,
        "ban": 50,
        "kick": 50,
        "redact": 50,
        "invite": preset.invite_level,
        "notifications": {"room": 50},
    }


def initial_room_events(
    room_version: RoomVersion,
    creator: str,
    request: CreateRoomRequest,
    *,
    server_name: str,
    creator_join_content: Mapping[str, object] | None = None,
) -> list[EventTemplate]:
    """The events ``/createRoom`` sends, in the spec's order:

    1. ``m.room.create``; 2. the creator's join; 3. power levels (defaults, then
    ``power_level_content_override`` applied on top, key by key; skipped when
    ``initial_state`` carries its own); 4. ``m.room.canonical_alias`` for
    ``room_alias_name``; 5. the preset's join rules, history visibility and guest access
    (each skipped when ``initial_state`` sets it); 6. ``initial_state`` in order (name and
    topic entries skipped when ``name``/``topic`` are given); 7. name, topic; 8. invites.
    """
    preset = PRESETS[request.effective_preset]
    initial_keys = {(t.type, t.state_key) for t in request.initial_state}
    templates: list[EventTemplate] = [
        EventTemplate(type=C.CREATE, state_key="", content=create_event_content(room_version, creator, request))
    ]
    join_content: JsonDict = thaw(creator_join_content or {})
    join_content["membership"] = C.JOIN
    templates.append(EventTemplate(type=C.MEMBER, state_key=creator, content=join_content))

    if (C.POWER_LEVELS, "") not in initial_keys:
        power_levels = default_power_levels(room_version, creator, request)
        if request.power_level_content_override is not None:
            power_levels.update(thaw(request.power_level_content_override))
        templates.append(EventTemplate(type=C.POWER_LEVELS, state_key="", content=power_levels))

    if request.room_alias_name is not None:
        alias = f"#{request.room_alias_name}:{server_name}"
        templates.append(EventTemplate(type=C.CANONICAL_ALIAS, state_key="", content={"alias": alias}))

    for event_type, content in (
        (C.JOIN_RULES, {"join_rule": preset.join_rule}),
        (C.HISTORY_VISIBILITY, {"history_visibility": preset.history_visibility}),
        (C.GUEST_ACCESS, {"guest_access": preset.guest_access}),
    ):
        if (event_type, "") not in initial_keys:
            templates.append(EventTemplate(type=event_type, state_key="", content=content))

    overridden = set()
    if request.name is not None:
        overridden.add((C.NAME, ""))
    if request.topic is not None:
        overridden.add((C.TOPIC, ""))
    templates.extend(t for t in request.initial_state if (t.type, t.state_key) not in overridden)

    if request.name is not None:
        templates.append(EventTemplate(type=C.NAME, state_key="", content={"name": request.name}))
    if request.topic is not None:
        topic_content = {
            "topic": request.topic,
            "m.topic": {"m.text": [{"mimetype": "text/plain", "body": request.topic}]},
        }
        templates.append(EventTemplate(type=C.TOPIC, state_key="", content=topic_content))

    for invitee in request.invite:
        invite_content: JsonDict = {"membership": C.INVITE}
        if request.is_direct:
            invite_content["is_direct"] = True
        templates.append(EventTemplate(type=C.MEMBER, state_key=invitee, content=invite_content))
    return templates
