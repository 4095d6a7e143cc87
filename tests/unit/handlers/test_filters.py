"""Filter shape validation and filter IDs."""

from __future__ import annotations

from typing import Any

import pytest

from homeserver.handlers.accounts.filters import parse_filter_id, validate_filter
from storage.kernel.errors import MatrixError


def test_a_full_filter_is_accepted_unchanged() -> None:
    spec_example: dict[str, Any] = {
        "event_fields": ["type", "content", "sender"],
        "event_format": "client",
        "presence": {"not_senders": ["@alice:example.com"], "types": ["m.presence"]},
        "account_data": {"limit": 0},
        "room": {
            "ephemeral": {"not_rooms": ["!726s6s6q:example.com"], "not_senders": ["@spam:example.com"]},
            "state": {"types": ["m.room.*"], "lazy_load_members": True},
            "timeline": {"limit": 10, "types": ["m.room.message"], "contains_url": False},
            "include_leave": False,
            "rooms": ["!a:hs"],
        },
        "org.example.unknown": {"anything": [1, 2]},
    }
    assert validate_filter(spec_example) is spec_example
    assert validate_filter({}) == {}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([], "must be a JSON object"),
        ("x", "must be a JSON object"),
        ({"event_fields": "type"}, "event_fields"),
        ({"event_fields": [1]}, "event_fields"),
        ({"event_format": "xml"}, "event_format"),
        ({"presence": []}, "presence must be an object"),
        ({"account_data": {"types": "m.x"}}, "account_data.types"),
        ({"room": {"timeline": {"limit": "10"}}}, "room.timeline.limit"),
        ({"room": {"timeline": {"limit": -1}}}, "room.timeline.limit"),
        ({"room": {"timeline": {"limit": True}}}, "room.timeline.limit"),
        ({"room": {"state": {"lazy_load_members": "yes"}}}, "room.state.lazy_load_members"),
        ({"room": {"include_leave": 1}}, "room.include_leave"),
        ({"room": {"not_rooms": [None]}}, "room.not_rooms"),
        ({"room": 5}, "room must be an object"),
    ],
)
def test_bad_shapes_name_the_field(value: Any, message: str) -> None:
    with pytest.raises(MatrixError) as caught:
        validate_filter(value)
    assert caught.value.errcode == "M_BAD_JSON"
    assert message in caught.value.error


def test_filter_ids() -> None:
    assert parse_filter_id("0") == 0
    assert parse_filter_id("12345") == 12345
    for bad in ["", "-1", "1.5", "abc", "{}", "١٢", "9" * 19]:
        assert parse_filter_id(bad) is None
