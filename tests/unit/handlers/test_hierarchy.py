"""The pure rules of space hierarchies: children, their order, who may see a room, remote answers."""

from __future__ import annotations

from typing import Any

from homeserver.handlers.directory.hierarchy import (
    child_order_key,
    children_state,
    may_see,
    parse_hierarchy_token,
    remote_hierarchy,
)
from storage.stores.directory import SpaceChildRow


def _row(child: str, ts: int, **content: Any) -> SpaceChildRow:
    return SpaceChildRow("!space:hs", child, "@a:hs", ts, {"via": ["hs"], **content})


def test_children_need_a_via_and_come_in_the_specs_order() -> None:
    rows = [
        _row("!late:hs", 5), _row("!early:hs", 1), _row("!ordered:hs", 9, order="a"),
        _row("!bad-order:hs", 0, order="\u00e9"), _row("!novia:hs", 0, via=[]), _row("!junkvia:hs", 0, via="hs"),
        _row("not-a-room", 0), _row("!sugg:hs", 7, order="b", suggested=True),
    ]
    assert [c["state_key"] for c in children_state(rows, False)] == [
        "!ordered:hs", "!sugg:hs", "!bad-order:hs", "!early:hs", "!late:hs"]
    assert [c["state_key"] for c in children_state(rows, True)] == ["!sugg:hs"]
    assert child_order_key({"content": {"order": "x" * 51}, "origin_server_ts": 3, "state_key": "!r"})[0] == 1


def test_who_may_see_a_room() -> None:
    public, invite = {"join_rule": "public"}, {"join_rule": "invite", "world_readable": False}
    assert may_see(public, None, set())
    assert may_see({"join_rule": "invite", "world_readable": True}, None, set())
    assert not may_see(invite, None, set()) and not may_see(invite, "leave", set())
    assert may_see(invite, "invite", set()) and may_see(invite, "join", set())
    restricted = {"join_rule": "restricted"}
    assert may_see(restricted, None, {"!a:hs"}, ["!a:hs"]) and not may_see(restricted, None, set(), ["!a:hs"])


def test_remote_answers_are_checked() -> None:
    room = {"room_id": "!r:x", "num_joined_members": 2, "children_state": [
        {"type": "m.space.child", "state_key": "!c:x", "content": {"via": ["x"]}, "origin_server_ts": 1},
        {"type": "m.space.child", "state_key": "!d:x", "content": {}}, "junk"]}
    parsed = remote_hierarchy({"room": room, "children": [{"room_id": "!c:x", "num_joined_members": 1}, {}]}, "!r:x")
    assert parsed is not None
    summary, children = parsed
    assert [c["state_key"] for c in summary["children_state"]] == ["!c:x"] and children == [
        {"room_id": "!c:x", "num_joined_members": 1}]
    assert remote_hierarchy({"room": room}, "!other:x") is None
    assert remote_hierarchy([], "!r:x") is None
    assert remote_hierarchy({"room": {"room_id": "!r:x"}}, "!r:x") is None
    assert parse_hierarchy_token(None) == 0 and parse_hierarchy_token("h12") == 12
