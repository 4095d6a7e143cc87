"""The room version table: every version 1-12 exists and differs from its predecessor
exactly where the spec's room version pages say it does."""

import attrs
import pytest

from homeserver.events import KNOWN_ROOM_VERSIONS, UnsupportedRoomVersion, get_room_version
from homeserver.events.room_versions import (
    ALL_ROOM_VERSIONS,
    REDACTION_V1,
    REDACTION_V6,
    REDACTION_V8,
    REDACTION_V9,
    REDACTION_V11,
    V1,
    V2,
    V3,
    V4,
    V5,
    V6,
    V7,
    V8,
    V9,
    V10,
    V11,
    V12,
    EventFormat,
    RoomVersion,
    StateResAlgorithm,
)


def test_known_versions_are_1_to_12() -> None:
    assert sorted(KNOWN_ROOM_VERSIONS, key=int) == [str(n) for n in range(1, 13)]
    assert [v.identifier for v in ALL_ROOM_VERSIONS] == [str(n) for n in range(1, 13)]
    assert get_room_version("11") is V11
    assert get_room_version("1") is V1


@pytest.mark.parametrize("bad", ["0", "13", "01", " 1", "", None, 12, "org.example.custom", "1.0"])
def test_unknown_versions_raise_typed_error(bad: object) -> None:
    with pytest.raises(UnsupportedRoomVersion) as info:
        get_room_version(bad)
    assert info.value.version == bad


def _diff(a: RoomVersion, b: RoomVersion) -> set[str]:
    return {f.name for f in attrs.fields(RoomVersion) if getattr(a, f.name) != getattr(b, f.name)} - {"identifier"}


# What each version changes relative to the one before it (the spec's "builds on" sentences).
CHANGES = {
    "2": {"state_res"},
    "3": {"event_format"},
    "4": {"event_format"},
    "5": {"enforce_key_validity"},
    "6": {"redaction", "special_case_aliases_auth", "notifications_power_levels"},
    "7": {"knock_join_rule"},
    "8": {"redaction", "restricted_join_rule"},
    "9": {"redaction"},
    "10": {"knock_restricted_join_rule", "strict_integer_power_levels"},
    "11": {"redaction", "create_content_has_creator", "redacts_in_content"},
    "12": {"state_res", "room_id_is_create_event_id", "create_event_in_auth_events", "room_id_domain_checked",
          "privileged_creators"},
}


@pytest.mark.parametrize("version", ALL_ROOM_VERSIONS[1:], ids=lambda v: "v" + v.identifier)
def test_each_version_changes_only_what_the_spec_says(version: RoomVersion) -> None:
    before = ALL_ROOM_VERSIONS[ALL_ROOM_VERSIONS.index(version) - 1]
    assert _diff(before, version) == CHANGES[version.identifier]


def test_formats_algorithms_and_redaction_rules() -> None:
    assert [v.event_format for v in ALL_ROOM_VERSIONS[:4]] == [
        EventFormat.ORIGIN_ASSIGNED, EventFormat.ORIGIN_ASSIGNED, EventFormat.REFERENCE_HASH,
        EventFormat.URL_SAFE_REFERENCE_HASH,
    ]
    assert V1.state_res is StateResAlgorithm.V1 and V2.state_res is StateResAlgorithm.V2
    assert V11.state_res is StateResAlgorithm.V2 and V12.state_res is StateResAlgorithm.V2_1
    assert [v.redaction for v in (V5, V6, V7, V8, V9, V10, V11, V12)] == [
        REDACTION_V1, REDACTION_V6, REDACTION_V6, REDACTION_V8, REDACTION_V9, REDACTION_V9, REDACTION_V11,
        REDACTION_V11,
    ]
    assert V1.redaction_auth_rule and V2.redaction_auth_rule and not V3.redaction_auth_rule
    assert not V10.updated_redaction_rules and V11.updated_redaction_rules and V12.updated_redaction_rules
