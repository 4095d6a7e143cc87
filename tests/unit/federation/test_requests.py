"""Federation query parameters and bodies: typed values out, or a 400 naming the field."""

# tests: homeserver/federation/requests.py

from __future__ import annotations

from typing import Any

import pytest

from homeserver.events.identifiers import is_valid_event_id, is_valid_user_id
from homeserver.federation.requests import (
    body_object,
    invite_body,
    missing_events_body,
    query_int,
    query_list,
    query_one,
    query_required,
    query_values,
)
from storage.kernel.errors import MatrixError


def _fails(call: Any, *args: Any, **kwargs: Any) -> MatrixError:
    with pytest.raises(MatrixError) as info:
        call(*args, **kwargs)
    assert info.value.status == 400
    return info.value


def test_query_values_are_strict_text() -> None:
    assert query_values({b"v": [b"$a", b"$b"]}, "v") == ["$a", "$b"]
    assert query_values({}, "v") == []
    for raw in (b"\xff", b"a\x00b", b"a\nb", b"x" * 300):
        assert _fails(query_values, {b"v": [raw]}, "v").errcode == "M_INVALID_PARAM"
    assert _fails(query_values, {b"v": [b"$a"] * 51}, "v").errcode == "M_INVALID_PARAM"


def test_query_ids_and_ints() -> None:
    args = {b"user_id": [b"@u:hs"], b"limit": [b"500"], b"v": [b"$a", b"nope"]}
    assert query_required(args, "user_id", is_valid_user_id, "user ID") == "@u:hs"
    assert query_one(args, "missing") is None
    assert _fails(query_required, args, "missing").errcode == "M_MISSING_PARAM"
    assert _fails(query_required, {b"user_id": [b"u:hs"]}, "user_id", is_valid_user_id, "user ID").errcode \
        == "M_INVALID_PARAM"
    assert "'v'" in _fails(query_list, args, "v", is_valid_event_id, "event ID").error
    assert query_int(args, "limit", default=10, minimum=1, maximum=100) == 100
    assert query_int({}, "limit", default=10, minimum=1, maximum=100) == 10
    assert query_int({b"limit": [b"0"]}, "limit", default=10, minimum=1, maximum=100) == 1
    for bad in (b"-1", b"1.5", b"ten", b"9" * 40, "٣".encode()):
        assert _fails(query_int, {b"limit": [bad]}, "limit", default=10, minimum=1, maximum=100).errcode \
            == "M_INVALID_PARAM"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ([], "request body"),
        ({"earliest_events": "$a", "latest_events": ["$b"]}, "earliest_events"),
        ({"earliest_events": [], "latest_events": {"$b": 1}}, "latest_events"),
        ({"earliest_events": [], "latest_events": [1]}, "latest_events"),
        ({"earliest_events": ["$a\x00"], "latest_events": []}, "earliest_events"),
        ({"earliest_events": [], "latest_events": ["$b"] * 21}, "latest_events"),
        ({"latest_events": ["$b"]}, "earliest_events"),
        ({"earliest_events": [], "latest_events": [], "limit": "10"}, "limit"),
        ({"earliest_events": [], "latest_events": [], "limit": True}, "limit"),
        ({"earliest_events": [], "latest_events": [], "min_depth": 1.5}, "min_depth"),
    ],
)
def test_missing_events_body_names_the_bad_field(body: Any, field: str) -> None:
    error = _fails(missing_events_body, body, is_valid_event_id)
    assert error.errcode == "M_BAD_JSON" and field in error.error


def test_missing_events_body_defaults() -> None:
    assert missing_events_body({"earliest_events": ["$a"], "latest_events": ["$b"]}, is_valid_event_id) == {
        "earliest_events": ["$a"], "latest_events": ["$b"], "limit": 10, "min_depth": 0}


def test_invite_bodies() -> None:
    assert invite_body({"event": {}, "room_version": "12"})["room_version"] == "12"
    for bad in ({"event": [], "room_version": "12"}, {"event": {}, "room_version": 12},
                {"event": {}, "room_version": "12", "invite_room_state": [1]}, None):
        assert _fails(invite_body, bad).errcode == "M_BAD_JSON"
    assert _fails(body_object, [1]).errcode == "M_BAD_JSON"
