"""Key backup's pure rules: which backed-up key wins, and what an upload must look like."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from homeserver.handlers.e2e.key_backup import parse_key, parse_rooms, parse_version, should_replace
from storage.kernel.errors import MatrixError
from storage.stores.key_backup import RoomKey


def key(verified: bool, first: int, forwarded: int) -> RoomKey:
    return RoomKey("!r:x", "s", first, forwarded, verified, "{}")


def test_the_spec_s_order_verified_then_first_index_then_forwards() -> None:
    assert should_replace(key(False, 0, 0), key(True, 9, 9))
    assert not should_replace(key(True, 9, 9), key(False, 0, 0))
    assert should_replace(key(True, 5, 0), key(True, 4, 9))
    assert not should_replace(key(True, 4, 0), key(True, 5, 0))
    assert should_replace(key(True, 4, 3), key(True, 4, 2))
    assert not should_replace(key(True, 4, 2), key(True, 4, 2))  # the same key changes nothing


keys = st.builds(key, st.booleans(), st.integers(0, 5), st.integers(0, 5))


@given(keys, keys)
def test_at_most_one_of_two_keys_replaces_the_other(a: RoomKey, b: RoomKey) -> None:
    assert not (should_replace(a, b) and should_replace(b, a))
    if (a.is_verified, a.first_message_index, a.forwarded_count) != (b.is_verified, b.first_message_index,
                                                                      b.forwarded_count):
        assert should_replace(a, b) or should_replace(b, a)


def test_uploads_are_checked() -> None:
    good = {"first_message_index": 1, "forwarded_count": 0, "is_verified": False, "session_data": {"c": "x"}}
    assert parse_key("!r:x", "s", good).first_message_index == 1
    for bad in ({**good, "first_message_index": -1}, {**good, "is_verified": "yes"}, {**good, "session_data": "x"},
                {**good, "forwarded_count": True}, "junk"):
        with pytest.raises(MatrixError):
            parse_key("!r:x", "s", bad)
    assert len(parse_rooms({"rooms": {"!r:x": {"sessions": {"a": good, "b": good}}}})) == 2
    with pytest.raises(MatrixError):
        parse_rooms({"rooms": {"!r:x": {"sessions": []}}})


def test_versions_are_decimal_strings() -> None:
    assert parse_version("12") == 12
    for bad, status in (("x", 404), ("-1", 404), ("9" * 30, 404), (None, 400)):
        with pytest.raises(MatrixError) as e:
            parse_version(bad)
        assert e.value.status == status
