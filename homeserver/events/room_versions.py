"""Room versions 1 to 12: each one a record of the properties in which their rules differ.

Everything version-dependent in this package asks a ``RoomVersion`` property (an event
format, a state resolution algorithm, a set of redaction rules, an auth-rule flag) rather
than comparing identifiers, so the differences between versions are listed here, once,
in the table at the bottom. It knows nothing of configuration: the default for new rooms
is the caller's choice.
"""

# tests: tests/unit/events/test_room_versions.py

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

import attrs

from homeserver.events.errors import UnsupportedRoomVersion


class EventFormat(enum.Enum):
    """How events name themselves and each other."""

    ORIGIN_ASSIGNED = "v1"
    """v1, v2: ``event_id`` (``$localpart:origin``) is a key of the PDU, chosen by its origin;
    ``prev_events``/``auth_events`` are ``[event_id, {"sha256": hash}]`` pairs."""
    REFERENCE_HASH = "v2"
    """v3: the event ID is ``$`` + standard unpadded base64 of the reference hash; edges are IDs."""
    URL_SAFE_REFERENCE_HASH = "v3"
    """v4+: as v3 with URL-safe base64 (``-`` and ``_`` instead of ``+`` and ``/``)."""


class StateResAlgorithm(enum.Enum):
    """Which state resolution algorithm a version uses."""

    V1 = "v1"
    """Room version 1's algorithm (power levels, join rules, members, then depth order)."""
    V2 = "v2"
    """Room version 2's algorithm (iterative auth checks start from the unconflicted state)."""
    V2_1 = "v2.1"
    """Room version 12's revision: start from empty state, add the conflicted state subgraph."""


@attrs.frozen(slots=True)
class RedactionRules:
    """What the redaction algorithm keeps of an event in one family of room versions."""

    top_level: frozenset[str]
    """Top-level PDU keys kept."""
    content: Mapping[str, frozenset[str]]
    """Event type -> the content keys kept for it (other types keep an empty content)."""
    create_keeps_all_content: bool = False
    """v11+: ``m.room.create`` keeps its whole content."""
    member_keeps_signed_third_party_invite: bool = False
    """v11+: ``m.room.member`` keeps ``third_party_invite.signed``."""


_TOP_LEVEL_V1 = frozenset(
    {
        "event_id", "type", "room_id", "sender", "state_key", "content", "hashes",
        "signatures", "depth", "prev_events", "prev_state", "auth_events", "origin",
        "origin_server_ts", "membership",
    }
)
_POWER_LEVELS_V1 = frozenset(
    {"ban", "events", "events_default", "kick", "redact", "state_default", "users", "users_default"}
)
_CONTENT_V6: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        "m.room.member": frozenset({"membership"}),
        "m.room.create": frozenset({"creator"}),
        "m.room.join_rules": frozenset({"join_rule"}),
        "m.room.power_levels": _POWER_LEVELS_V1,
        "m.room.history_visibility": frozenset({"history_visibility"}),
    }
)

REDACTION_V1 = RedactionRules(
    top_level=_TOP_LEVEL_V1,
    content=MappingProxyType({**_CONTENT_V6, "m.room.aliases": frozenset({"aliases"})}),
)
"""v1-v5 (the v1 redaction rules)."""
REDACTION_V6 = RedactionRules(top_level=_TOP_LEVEL_V1, content=_CONTENT_V6)
"""v6, v7: ``m.room.aliases`` no longer keeps ``aliases`` (MSC2432)."""
REDACTION_V8 = attrs.evolve(
    REDACTION_V6,
    content=MappingProxyType({**_CONTENT_V6, "m.room.join_rules": frozenset({"join_rule", "allow"})}),
)
"""v8: ``m.room.join_rules`` keeps ``allow`` (restricted rooms)."""
REDACTION_V9 = attrs.evolve(
    REDACTION_V8,
    content=MappingProxyType(
        {**REDACTION_V8.content, "m.room.member": frozenset({"membership", "join_authorised_via_users_server"})}
    ),
)
"""v9, v10: ``m.room.member`` keeps ``join_authorised_via_users_server``."""
REDACTION_V11 = RedactionRules(
    top_level=_TOP_LEVEL_V1 - {"origin", "membership", "prev_state"},
    content=MappingProxyType(
        {
            **REDACTION_V9.content,
            "m.room.power_levels": _POWER_LEVELS_V1 | {"invite"},
            "m.room.redaction": frozenset({"redacts"}),
        }
    ),
    create_keeps_all_content=True,
    member_keeps_signed_third_party_invite=True,
)
"""v11+: MSC2176/MSC3821/MSC3989 (no top-level origin/membership/prev_state, and more content kept)."""


@attrs.frozen(slots=True)
class RoomVersion:
    """The rules of one room version, as properties."""

    identifier: str
    event_format: EventFormat
    state_res: StateResAlgorithm
    redaction: RedactionRules
    enforce_key_validity: bool
    """v5+: a signing key verifies only events whose origin_server_ts is within its validity."""
    special_case_aliases_auth: bool
    """v1-v5: the ``m.room.aliases`` auth rule (state_key must be the sender's server)."""
    notifications_power_levels: bool
    """v6+: the ``notifications`` object of power levels is checked like ``events``."""
    knock_join_rule: bool
    """v7+: the ``knock`` join rule and membership exist."""
    restricted_join_rule: bool
    """v8+: the ``restricted`` join rule and ``join_authorised_via_users_server`` exist."""
    knock_restricted_join_rule: bool
    """v10+: the ``knock_restricted`` join rule exists."""
    strict_integer_power_levels: bool
    """v10+: power level values must be integers; before, strings holding an integer count too."""
    create_content_has_creator: bool
    """v1-v10: ``content.creator`` is required on ``m.room.create`` and names the creator."""
    room_id_domain_checked: bool
    """v1-v11: the create event's room_id domain must match its sender's domain."""
    create_event_in_auth_events: bool
    """v1-v11: ``m.room.create`` is selected as an auth event; v12 forbids it."""
    redacts_in_content: bool
    """v11+: ``m.room.redaction`` carries ``redacts`` in content instead of at top level."""
    room_id_is_create_event_id: bool
    """v12: the room ID is the create event's ID with sigil ``!``; the create event has no room_id."""
    privileged_creators: bool
    """v12: creators (sender + ``additional_creators``) have infinite power level."""

    @property
    def event_ids_are_origin_assigned(self) -> bool:
        """v1, v2: event IDs are ``$localpart:server`` and travel in the PDU."""
        return self.event_format is EventFormat.ORIGIN_ASSIGNED

    @property
    def redaction_auth_rule(self) -> bool:
        """v1, v2: ``m.room.redaction`` has an auth rule (redact level, or same event ID domain);
        from v3 on redactions are checked when applied ("Handling redactions") instead."""
        return self.event_ids_are_origin_assigned

    @property
    def updated_redaction_rules(self) -> bool:
        """v11+: the MSC2176 redaction rules."""
        return self.redaction is REDACTION_V11


V1 = RoomVersion(
    identifier="1",
    event_format=EventFormat.ORIGIN_ASSIGNED,
    state_res=StateResAlgorithm.V1,
    redaction=REDACTION_V1,
    enforce_key_validity=False,
    special_case_aliases_auth=True,
    notifications_power_levels=False,
    knock_join_rule=False,
    restricted_join_rule=False,
    knock_restricted_join_rule=False,
    strict_integer_power_levels=False,
    create_content_has_creator=True,
    room_id_domain_checked=True,
    create_event_in_auth_events=True,
    redacts_in_content=False,
    room_id_is_create_event_id=False,
    privileged_creators=False,
)
V2 = attrs.evolve(V1, identifier="2", state_res=StateResAlgorithm.V2)
V3 = attrs.evolve(V2, identifier="3", event_format=EventFormat.REFERENCE_HASH)
V4 = attrs.evolve(V3, identifier="4", event_format=EventFormat.URL_SAFE_REFERENCE_HASH)
V5 = attrs.evolve(V4, identifier="5", enforce_key_validity=True)
V6 = attrs.evolve(
    V5, identifier="6", redaction=REDACTION_V6, special_case_aliases_auth=False, notifications_power_levels=True
)
V7 = attrs.evolve(V6, identifier="7", knock_join_rule=True)
V8 = attrs.evolve(V7, identifier="8", redaction=REDACTION_V8, restricted_join_rule=True)
V9 = attrs.evolve(V8, identifier="9", redaction=REDACTION_V9)
V10 = attrs.evolve(V9, identifier="10", knock_restricted_join_rule=True, strict_integer_power_levels=True)
V11 = attrs.evolve(
    V10, identifier="11", redaction=REDACTION_V11, create_content_has_creator=False, redacts_in_content=True
)
V12 = attrs.evolve(
    V11,
    identifier="12",
    state_res=StateResAlgorithm.V2_1,
    room_id_is_create_event_id=True,
    create_event_in_auth_events=False,
    room_id_domain_checked=False,
    privileged_creators=True,
)

ALL_ROOM_VERSIONS: tuple[RoomVersion, ...] = (V1, V2, V3, V4, V5, V6, V7, V8, V9, V10, V11, V12)

KNOWN_ROOM_VERSIONS: Mapping[str, RoomVersion] = MappingProxyType({v.identifier: v for v in ALL_ROOM_VERSIONS})

DEFAULT_ROOM_VERSION = V12


def get_room_version(identifier: object) -> RoomVersion:
    """Look up a room version by its identifier, e.g. ``"12"``.

    Raises ``UnsupportedRoomVersion`` for anything else, including non-strings.
    """
    if isinstance(identifier, str):
        version = KNOWN_ROOM_VERSIONS.get(identifier)
        if version is not None:
            return version
    raise UnsupportedRoomVersion(identifier)
