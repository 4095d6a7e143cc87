"""make_event: the PDU format of v10-v12, typed accessors, and typed errors for bad input."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from homeserver.events import EventTooLarge, InvalidEvent, make_event, parse_pdu
from homeserver.events.identifiers import is_valid_user_id
from homeserver.events.room_versions import V10, V11, V12

from .helpers import ALICE, RoomBuilder


def _message_pdu() -> dict[str, Any]:
    room = RoomBuilder(V11)
    room.create(ALICE)
    room.join(ALICE)
    return room.build("m.room.message", ALICE, {"body": "hi"}).get_pdu_json()


def test_accessors() -> None:
    room = RoomBuilder(V11)
    create = room.create(ALICE)
    join = room.join(ALICE)
    assert join.type == "m.room.member" and join.state_key == ALICE and join.is_state()
    assert join.sender == ALICE and join.membership == "join"
    assert join.prev_event_ids == (create.event_id,) and join.auth_event_ids == (create.event_id,)
    assert join.depth == 2 and join.room_id == create.room_id
    assert join.state_key_tuple == ("m.room.member", ALICE)
    assert join.unsigned == {}
    redaction = room.build("m.room.redaction", ALICE, {}, redacts=join.event_id)
    assert redaction.redacts == join.event_id and redaction.content["redacts"] == join.event_id


def test_v10_redacts_is_top_level() -> None:
    room = RoomBuilder(V10)
    create = room.create(ALICE)
    redaction = room.build("m.room.redaction", ALICE, {}, redacts=create.event_id)
    assert redaction.pdu["redacts"] == create.event_id and redaction.redacts == create.event_id


def test_events_are_immutable_and_hashable() -> None:
    event = make_event(V11, _message_pdu())
    with pytest.raises(TypeError):
        event.content["body"] = "x"  # type: ignore[index]
    copy = event.get_pdu_json()
    copy["content"]["body"] = "changed"
    assert event.content["body"] == "hi"
    assert {event, make_event(V11, event.get_pdu_json())} == {event}


BAD_PDUS: list[tuple[str, Any]] = [
    ("missing type", lambda p: p.pop("type")),
    ("type not str", lambda p: p.update(type=1)),
    ("sender not a user id", lambda p: p.update(sender="alice")),
    ("sender bad server", lambda p: p.update(sender="@a:bad host")),
    ("content not object", lambda p: p.update(content=[])),
    ("depth negative", lambda p: p.update(depth=-1)),
    ("depth bool", lambda p: p.update(depth=True)),
    ("ts float", lambda p: p.update(origin_server_ts=1.5)),
    ("prev_events not list", lambda p: p.update(prev_events="$x")),
    ("prev_events holds non-id", lambda p: p.update(prev_events=[1])),
    ("auth_events holds non-$", lambda p: p.update(auth_events=["x"])),
    ("hashes missing sha256", lambda p: p.update(hashes={})),
    ("signatures wrong shape", lambda p: p.update(signatures={"x": "y"})),
    ("unsigned not object", lambda p: p.update(unsigned=[])),
    ("state_key not str", lambda p: p.update(state_key=5)),
    ("room_id missing", lambda p: p.pop("room_id")),
    ("room_id without !", lambda p: p.update(room_id="room:x")),
    ("big int", lambda p: p["content"].update(n=2**60)),
    ("float in content", lambda p: p["content"].update(n=0.5)),
    ("redacts not str", lambda p: p.update(redacts=5)),
]


@pytest.mark.parametrize(("name", "mutate"), BAD_PDUS, ids=[n for n, _ in BAD_PDUS])
def test_malformed_pdus_raise_invalid_event(name: str, mutate: Any) -> None:
    pdu = _message_pdu()
    mutate(pdu)
    with pytest.raises(InvalidEvent):
        make_event(V11, pdu)


def test_not_a_mapping() -> None:
    with pytest.raises(InvalidEvent):
        make_event(V11, ["not", "a", "dict"])  # type: ignore[arg-type]


def test_size_limits() -> None:
    pdu = _message_pdu()
    pdu["content"]["body"] = "x" * 65_536
    with pytest.raises(EventTooLarge, match="65536"):
        make_event(V11, pdu)
    pdu = _message_pdu()
    pdu["type"] = "t" * 256
    with pytest.raises(EventTooLarge):
        make_event(V11, pdu)
    pdu = _message_pdu()
    pdu["state_key"] = "s" * 256
    with pytest.raises(EventTooLarge):
        make_event(V11, pdu)


def test_v12_create_without_room_id_is_valid_but_other_events_need_one() -> None:
    room = RoomBuilder(V12)
    create = room.create(ALICE)
    assert "room_id" not in create.pdu
    join = room.join(ALICE).get_pdu_json()
    del join["room_id"]
    with pytest.raises(InvalidEvent):
        make_event(V12, join)
    v11_create = RoomBuilder(V11)
    pdu = v11_create.create(ALICE).get_pdu_json()
    del pdu["room_id"]
    with pytest.raises(InvalidEvent):
        make_event(V11, pdu)


def test_parse_pdu_round_trip_and_garbage() -> None:
    event = make_event(V11, _message_pdu())
    assert parse_pdu(V11, event.canonical_json()) == event
    for garbage in (b"", b"null", b"[]", b'{"type": 1.5}', b"{" * 5000):
        with pytest.raises(InvalidEvent):
            parse_pdu(V11, garbage)


@pytest.mark.parametrize(
    ("user_id", "valid"),
    [("@a:x.org", True), ("@a:x.org:8448", True), ("@:x", True), ("@A B:1.2.3.4", True),
     ("@a:[::1]:80", True), ("a:x", False), ("@a", False), ("@a:", False), ("@a:b c", False),
     ("@a\x00:x", False), ("@" + "a" * 250 + ":x.org", False), (5, False)],
)
def test_user_id_grammar(user_id: object, valid: bool) -> None:
    assert is_valid_user_id(user_id) is valid


@pytest.mark.parametrize(("key", "cap"), [("prev_events", 20), ("auth_events", 10)])
def test_received_pdus_are_capped_on_edges(key: str, cap: int) -> None:
    pdu = _message_pdu()
    pdu[key] = [f"$e{i}" for i in range(cap)]
    make_event(V11, pdu)  # at the cap: fine
    pdu[key] = [f"$e{i}" for i in range(cap + 1)]
    with pytest.raises(InvalidEvent, match=f"{cap + 1} {key}; at most {cap}"):
        make_event(V11, pdu)
    # An event loaded back from our own database is not re-judged.
    assert len(getattr(make_event(V11, pdu, trusted_event_id="$stored"), key.replace("events", "event_ids"))) == cap + 1
    # 1,300 of them (issue 18's finding) are refused before any hashing.
    pdu[key] = [f"$e{i}" for i in range(1300)]
    with pytest.raises(InvalidEvent):
        parse_pdu(V11, json.dumps(pdu))


@settings(derandomize=True, max_examples=200)
@given(st.dictionaries(st.sampled_from(["type", "content", "unsigned", "signatures", "hashes", "depth", "é"]),
                       st.recursive(st.none() | st.booleans() | st.integers(-(2**53) + 1, 2**53 - 1) | st.text(max_size=5),
                                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c, max_size=3),
                                    max_leaves=6)))
def test_the_canonical_size_from_the_hashed_part_is_the_whole_encodings(pdu: dict[str, object]) -> None:
    from homeserver.events import encode_canonical
    from homeserver.events.event import canonical_size, hashed_part

    assert canonical_size(encode_canonical(hashed_part(pdu)), pdu) == len(encode_canonical(pdu))
