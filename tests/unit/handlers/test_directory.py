"""The pure parts of the room directory: entries, filters and pages."""

from __future__ import annotations

from typing import Any

import pytest

from homeserver.handlers.directory.directory import (
    PublicRoomsFilter,
    matches,
    page,
    parse_public_rooms_filter,
    parse_since,
    remote_public_rooms,
    room_entry,
)
from storage.kernel.errors import MatrixError
from storage.stores.directory import PublicRoomRow


def _row(room_id: str, joined: int, **state: dict[str, Any]) -> PublicRoomRow:
    """``m_room_join_rules=...`` is the ``m.room.join_rules`` content."""
    return PublicRoomRow(room_id, joined, {"m.room." + key[len("m_room_"):]: value for key, value in state.items()})


def test_an_entry_says_what_the_state_says_and_unlistable_rooms_have_none() -> None:
    row = _row("!a:hs", 3, m_room_join_rules={"join_rule": "public"}, m_room_name={"name": "A"},
               m_room_guest_access={"guest_access": "can_join"}, m_room_create={"type": "m.space"},
               m_room_topic={"topic": 7})
    assert room_entry(row) == {
        "room_id": "!a:hs", "num_joined_members": 3, "world_readable": False, "guest_can_join": True,
        "join_rule": "public", "name": "A", "room_type": "m.space",
    }
    assert room_entry(_row("!b:hs", 3, m_room_join_rules={"join_rule": "invite"})) is None
    assert room_entry(_row("!c:hs", 0, m_room_join_rules={"join_rule": "public"})) is None
    readable = room_entry(_row("!d:hs", 1, m_room_history_visibility={"history_visibility": "world_readable"}))
    assert readable is not None and readable["world_readable"] is True and readable["join_rule"] == "invite"


def test_filters_match_terms_case_insensitively_and_room_types_with_null_for_none() -> None:
    entry = {"room_id": "!a:hs", "name": "Chess Club", "num_joined_members": 1}
    assert matches(entry, PublicRoomsFilter("chess"))
    assert not matches(entry, PublicRoomsFilter("go"))
    assert matches(entry, PublicRoomsFilter(room_types=frozenset({None})))
    assert not matches(entry, PublicRoomsFilter(room_types=frozenset({"m.space"})))
    assert parse_public_rooms_filter({"generic_search_term": "  "}) == PublicRoomsFilter()
    for bad in ("x", {"room_types": "m.space"}, {"room_types": [1]}, {"generic_search_term": ["a"]}):
        with pytest.raises(MatrixError):
            parse_public_rooms_filter(bad)


def test_pages_cover_every_entry_once_in_order() -> None:
    entries = [{"room_id": f"!{i}:hs", "num_joined_members": i % 4} for i in range(10)]
    seen: list[str] = []
    since = 0
    while True:
        out = page(entries, since=since, limit=3)
        assert out["total_room_count_estimate"] == 10
        seen += [e["room_id"] for e in out["chunk"]]
        if "next_batch" not in out:
            break
        since = parse_since(out["next_batch"])
    assert seen == [e["room_id"] for e in sorted(entries, key=lambda e: (-e["num_joined_members"], e["room_id"]))]
    for bad in ("x1", "o", "o-1", "o99999999999"):
        with pytest.raises(MatrixError):
            parse_since(bad)


def test_a_remote_answer_is_kept_to_the_spec_shape() -> None:
    answer = {"chunk": [{"room_id": "!a:x", "num_joined_members": 1}, {"room_id": 3}, "junk"],
              "next_batch": "n", "total_room_count_estimate": "many"}
    assert remote_public_rooms(answer) == {"chunk": [{"room_id": "!a:x", "num_joined_members": 1}], "next_batch": "n"}
    with pytest.raises(MatrixError):
        remote_public_rooms({"chunk": "nope"})
