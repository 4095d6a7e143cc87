"""Room versions 10, 11 and 12: the flags in which their rules differ, and the lookup.

Everything version-dependent in this package asks a ``RoomVersion`` flag rather than
comparing identifiers, so the differences between versions are listed in one place.
It knows nothing of configuration: the default for new rooms is the caller's choice.
"""

# tests: tests/unit/events/test_room_versions.py

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

import attrs

from homeserver.events.errors import UnsupportedRoomVersion


class StateResAlgorithm(enum.Enum):
    """Which state resolution algorithm a version uses."""

    V2 = "v2"
    """Room version 2's algorithm (iterative auth checks start from the unconflicted state)."""
    V2_1 = "v2.1"
    """Room version 12's revision: start from empty state, add the conflicted state subgraph."""


@attrs.frozen(slots=True)
class RoomVersion:
    """The rules of one room version, as flags."""

    identifier: str
    state_res: StateResAlgorithm
    room_id_is_create_event_id: bool
    """v12: the room ID is the create event's ID with sigil ``!``; the create event has no room_id."""
    create_event_in_auth_events: bool
    """v10, v11: ``m.room.create`` is selected as an auth event; v12 forbids it."""
    create_content_has_creator: bool
    """v10: ``content.creator`` is required on ``m.room.create`` and names the creator."""
    room_id_domain_checked: bool
    """v10, v11: the create event's room_id domain must match its sender's domain."""
    updated_redaction_rules: bool
    """v11+: the MSC2176/MSC3821 redaction rules (no top-level origin/membership/prev_state...)."""
    redacts_in_content: bool
    """v11+: ``m.room.redaction`` carries ``redacts`` in content instead of at top level."""
    privileged_creators: bool
    """v12: creators (sender + ``additional_creators``) have infinite power level."""
    strict_integer_power_levels: bool = True
    """v10+: power level values must be integers (never strings)."""
    knock_restricted_join_rule: bool = True
    """v10+: the ``knock_restricted`` join rule exists."""


V10 = RoomVersion(
    identifier="10",
    state_res=StateResAlgorithm.V2,
    room_id_is_create_event_id=False,
    create_event_in_auth_events=True,
    create_content_has_creator=True,
    room_id_domain_checked=True,
    updated_redaction_rules=False,
    redacts_in_content=False,
    privileged_creators=False,
)
V11 = attrs.evolve(
    V10,
    identifier="11",
    create_content_has_creator=False,
    updated_redaction_rules=True,
    redacts_in_content=True,
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

KNOWN_ROOM_VERSIONS: Mapping[str, RoomVersion] = MappingProxyType(
    {v.identifier: v for v in (V10, V11, V12)}
)

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
