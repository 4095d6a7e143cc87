import pytest

from homeserver.events import KNOWN_ROOM_VERSIONS, UnsupportedRoomVersion, get_room_version
from homeserver.events.room_versions import V10, V11, V12, StateResAlgorithm


def test_known_versions_are_10_11_12() -> None:
    assert sorted(KNOWN_ROOM_VERSIONS, key=int) == ["10", "11", "12"]
    assert get_room_version("11") is V11


@pytest.mark.parametrize("bad", ["9", "1", "13", "", None, 12, "org.example.custom"])
def test_unknown_versions_raise_typed_error(bad: object) -> None:
    with pytest.raises(UnsupportedRoomVersion) as info:
        get_room_version(bad)
    assert info.value.version == bad


def test_flags_differ_where_the_spec_says() -> None:
    assert V10.create_content_has_creator and not V11.create_content_has_creator
    assert not V10.updated_redaction_rules and V11.updated_redaction_rules and V12.updated_redaction_rules
    assert V11.create_event_in_auth_events and not V12.create_event_in_auth_events
    assert V12.privileged_creators and not V11.privileged_creators
    assert V12.room_id_is_create_event_id and not V11.room_id_is_create_event_id
    assert V11.state_res is StateResAlgorithm.V2 and V12.state_res is StateResAlgorithm.V2_1
