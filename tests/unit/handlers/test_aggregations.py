"""The pure rules of relation aggregation: which edits are valid, and which one is bundled."""

from __future__ import annotations

from homeserver.events import FrozenEvent, get_room_version
from homeserver.events.event import make_event
from homeserver.handlers.rooms.aggregations import is_valid_edit, pick_edit, relation_of

V11 = get_room_version("11")


def _event(event_id: str, content: dict[str, object], *, sender: str = "@a:hs", ts: int = 1000,
           event_type: str = "m.room.message", state_key: str | None = None, room_id: str = "!r:hs") -> FrozenEvent:
    pdu: dict[str, object] = {
        "type": event_type, "room_id": room_id, "sender": sender, "content": content, "origin_server_ts": ts,
        "depth": 3, "prev_events": [], "auth_events": [], "hashes": {"sha256": "x"}, "signatures": {},
    }
    if state_key is not None:
        pdu["state_key"] = state_key
    return make_event(V11, pdu, trusted_event_id=event_id)


ORIGINAL = _event("$orig", {"msgtype": "m.text", "body": "hi"})


def _edit(event_id: str, **kwargs: object) -> FrozenEvent:
    content: dict[str, object] = {
        "msgtype": "m.text", "body": "* hey", "m.new_content": {"msgtype": "m.text", "body": "hey"},
        "m.relates_to": {"rel_type": "m.replace", "event_id": "$orig"},
    }
    new_content = kwargs.pop("new_content", content["m.new_content"])
    if new_content is None:
        del content["m.new_content"]
    else:
        content["m.new_content"] = new_content
    return _event(event_id, content, **kwargs)  # type: ignore[arg-type]


def test_relation_of_reads_rel_type_and_parent_and_ignores_malformed() -> None:
    assert relation_of(_edit("$e")) == ("m.replace", "$orig")
    assert relation_of(ORIGINAL) is None
    assert relation_of(_event("$x", {"m.relates_to": "nonsense"})) is None
    assert relation_of(_event("$y", {"m.relates_to": {"rel_type": 3, "event_id": "$orig"}})) is None


def test_an_edit_must_come_from_the_sender_with_the_same_type_and_new_content() -> None:
    assert is_valid_edit(ORIGINAL, _edit("$ok"))
    assert not is_valid_edit(ORIGINAL, _edit("$other", sender="@b:hs"))
    assert not is_valid_edit(ORIGINAL, _edit("$type", event_type="m.sticker"))
    assert not is_valid_edit(ORIGINAL, _edit("$room", room_id="!other:hs"))
    assert not is_valid_edit(ORIGINAL, _edit("$none", new_content=None))
    assert not is_valid_edit(ORIGINAL, _edit("$str", new_content="text"))
    state = _event("$state", {"topic": "t"}, event_type="m.room.topic", state_key="")
    assert not is_valid_edit(state, _edit("$s", event_type="m.room.topic", state_key=""))
    # An edit of an edit is not an edit.
    assert not is_valid_edit(_edit("$e1"), _edit("$e2"))


def test_the_latest_valid_edit_wins_ties_by_event_id() -> None:
    early, late, tie = _edit("$a", ts=1), _edit("$b", ts=5), _edit("$c", ts=5)
    forged = _edit("$z", ts=99, sender="@b:hs")
    assert pick_edit(ORIGINAL, [late, early, forged, tie]) == tie
    assert pick_edit(ORIGINAL, [forged]) is None
    assert pick_edit(ORIGINAL, []) is None
