"""The pure parts of simplified sliding sync (MSC4186): request parsing in both shapes clients
send, required_state matching and combining, and range slicing over the ordered room list."""

from __future__ import annotations

from typing import Any

import pytest

from homeserver.handlers.sync.sliding_sync import dm_rooms
from homeserver.handlers.sync.sliding_sync_request import (
    MAX_TIMEOUT_MS, RoomConfig, StateSpec, in_ranges, parse_request, parse_required_state, range_limit,
)
from storage.kernel.errors import MatrixError

ME = "@me:x"


def test_synapse_shape_and_msc_shape_parse_alike() -> None:
    synapse = parse_request({
        "conn_id": "main",
        "lists": {"a": {"ranges": [[0, 19]], "timeline_limit": 1, "required_state": [["m.room.create", ""]],
                        "filters": {"is_invite": True}}},
        "extensions": {"e2ee": {"enabled": True}, "to_device": {"enabled": True, "since": "17"}},
    }, query_pos="42", query_timeout="30000")
    msc = parse_request({
        "conn_id": "main", "pos": "42", "timeout": 30000,
        "lists": {"a": {"range": [0, 19], "timeline_limit": 1,
                        "required_state": {"include": [{"type": "m.room.create", "state_key": ""}]},
                        "filters": {"is_invited": True}}},
        "extensions": {"e2ee": {"enabled": True}, "to_device": {"enabled": True, "since": "17"}},
    })
    assert synapse == msc
    assert synapse.pos == 42 and synapse.timeout_ms == 30000 and synapse.lists["a"].ranges == ((0, 19),)
    assert synapse.extensions.e2ee and synapse.extensions.to_device_since == 17 and not synapse.extensions.typing
    assert synapse.lists["a"].filters.is_invite is True


def test_the_body_wins_over_the_query_and_timeouts_are_capped() -> None:
    request = parse_request({"pos": "7", "timeout": 10**9}, query_pos="8", query_timeout="1")
    assert request.pos == 7 and request.timeout_ms == MAX_TIMEOUT_MS
    assert parse_request({}).pos is None and parse_request({}, query_pos="").pos is None


@pytest.mark.parametrize(("body", "errcode"), [
    ({"lists": {"a": {"ranges": [[3, 2]]}}}, "M_INVALID_PARAM"),
    ({"lists": {"a": {"ranges": [[0, 1, 2]]}}}, "M_BAD_JSON"),
    ({"lists": {"a": {"ranges": [[True, 1]]}}}, "M_BAD_JSON"),
    ({"lists": {"a": {"timeline_limit": 1.5}}}, "M_BAD_JSON"),
    ({"lists": {"a": {"required_state": {"include": [{"type": 5}]}}}}, "M_BAD_JSON"),
    ({"lists": {"a": {"filters": {"room_types": "m.space"}}}}, "M_BAD_JSON"),
    ({"lists": {"a": {"filters": {"spaces": ["nope"]}}}}, "M_INVALID_PARAM"),
    ({"lists": {str(i): {} for i in range(101)}}, "M_INVALID_PARAM"),
    ({"conn_id": 5}, "M_BAD_JSON"),
    ({"pos": "12x"}, "M_UNKNOWN_POS"),
    ({"timeout": -1}, "M_INVALID_PARAM"),
    ({"extensions": {"typing": {"enabled": "yes"}}}, "M_BAD_JSON"),
])
def test_bad_requests_name_the_field(body: dict[str, Any], errcode: str) -> None:
    with pytest.raises(MatrixError) as raised:
        parse_request(body)
    assert raised.value.errcode == errcode and raised.value.status == 400


def test_required_state_wildcards_me_lazy_and_exclude() -> None:
    spec = parse_required_state([["*", "*"], ["m.room.member", "$LAZY"], ["m.room.member", "$ME"]], "rs")
    assert spec.matches("m.room.name", "", ME) and spec.matches("m.custom", "k", ME)
    # A type named explicitly is matched by its own entries only: members lazily, and the user's own.
    assert spec.matches("m.room.member", ME, ME) and not spec.matches("m.room.member", "@other:x", ME)
    assert spec.lazy and not spec.all_members() and spec.member_keys(ME) == {ME}
    by_key = parse_required_state([["*", "@k:x"]], "rs")
    assert by_key.matches("m.room.member", "@k:x", ME) and not by_key.matches("m.room.member", "@j:x", ME)
    excluded = parse_required_state({"include": [{}], "exclude": [{"type": "m.room.create"}]}, "rs")
    assert excluded.matches("m.room.topic", "", ME) and not excluded.matches("m.room.create", "", ME)
    assert excluded.all_members()
    lazy = parse_required_state({"include": [], "lazy_members": True}, "rs")
    assert lazy.lazy and not lazy.matches("m.room.member", ME, ME)


def test_combined_configs_are_a_superset_and_expansion_is_seen() -> None:
    names = RoomConfig(1, frozenset({StateSpec(frozenset({("m.room.name", "")}))}))
    everything = RoomConfig(10, frozenset({StateSpec(frozenset({("*", "*"), ("m.room.member", "$LAZY")}))}))
    combined = names.combine(everything)
    assert combined.timeline_limit == 10
    assert combined.matches("m.room.topic", "", ME) and combined.lazy
    assert not combined.state_expanded_from(combined.to_json())
    assert combined.state_expanded_from(names.to_json())
    assert not names.state_expanded_from(combined.to_json())
    assert names.state_expanded_from("not json")
    assert combined.timeline_expanded_from(names.to_json()) and not names.timeline_expanded_from(combined.to_json())
    assert not combined.timeline_expanded_from(combined.to_json()) and not combined.timeline_expanded_from("{}")


def test_ranges_slice_the_ordered_list() -> None:
    rooms = [f"!{i}:x" for i in range(10)]
    assert in_ranges(rooms, ((0, 1), (5, 6))) == ["!0:x", "!1:x", "!5:x", "!6:x"]
    assert in_ranges(rooms, ((8, 20), (9, 9))) == ["!8:x", "!9:x"]
    assert in_ranges(rooms, None) == rooms
    assert range_limit(((0, 1), (5, 6)), 1000) == 7 and range_limit(None, 1000) == 1000
    assert range_limit(((0, 10**6),), 500) == 500


def test_dm_rooms_come_from_m_direct() -> None:
    assert dm_rooms('{"@a:x": ["!1:x", "!2:x"], "@b:x": ["!3:x", 5], "@c:x": "!4:x"}') == {"!1:x", "!2:x", "!3:x"}
    assert dm_rooms(None) == frozenset() and dm_rooms("[]") == frozenset() and dm_rooms("{bad") == frozenset()
