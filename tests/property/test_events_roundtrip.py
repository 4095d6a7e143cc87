"""Round trip of events: build -> sign -> serialise (canonical JSON) -> parse -> verify.

Also: a tampered content fails the hash check (and verification hands back the redacted
copy), and arbitrary input to the parsers raises only ``InvalidEvent``.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from signedjson.key import decode_signing_key_base64, get_verify_key

from homeserver.events import (
    EventTemplate,
    InvalidEvent,
    ServerKey,
    build_pdu,
    EventTooLarge,
    SignatureError,
    make_event,
    parse_pdu,
    prune_event_dict,
    receive_pdu,
    sign_pdu,
    verify_event,
    verify_received,
)
from homeserver.events.room_versions import KNOWN_ROOM_VERSIONS, RoomVersion
from homeserver.events.signing import content_hash_matches

SIGNING_KEY = decode_signing_key_base64("ed25519", "1", "YJDBA9Xnr2sVqXD9Vj7XVUnmFZcZrlw8Md7kMW+3XA1")
KEYS = {"hs.test": {"ed25519:1": ServerKey(get_verify_key(SIGNING_KEY), 2**53)}}

versions = st.sampled_from(sorted(KNOWN_ROOM_VERSIONS.values(), key=lambda v: int(v.identifier)))
canonical_ints = st.integers(min_value=-(2**53) + 1, max_value=2**53 - 1)
json_text = st.text(st.characters(exclude_categories=["Cs"]), max_size=20)
json_values = st.recursive(
    st.none() | st.booleans() | canonical_ints | json_text,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(json_text, children, max_size=4),
    max_leaves=20,
)
contents = st.dictionaries(json_text, json_values, max_size=6)
# Any text but NUL, which a received PDU may not carry in its type or state key (PostgreSQL's TEXT
# cannot hold it).
state_keys = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=20)
event_types = st.sampled_from(
    ["m.room.message", "m.room.member", "m.room.power_levels", "m.room.join_rules", "m.room.topic",
     "m.room.history_visibility", "m.room.redaction", "org.example.custom"]
)


event_ids = st.text("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_", min_size=43, max_size=43).map(
    lambda s: "$" + s
)
localparts = st.text("abcdefghijklmnopqrstuvwxyz0123456789._=/+-", min_size=1, max_size=12)


@st.composite
def signed_events(draw: st.DrawFn) -> tuple[RoomVersion, Any]:
    version = draw(versions)
    template = EventTemplate(
        type=draw(event_types),
        content=draw(contents),
        state_key=draw(st.none() | state_keys),
    )
    prevs = draw(st.lists(event_ids, max_size=3))
    auths = draw(st.lists(event_ids, max_size=3))
    pdu = build_pdu(
        version,
        template,
        sender="@" + draw(localparts) + ":hs.test",
        room_id="!room:hs.test",
        prev_event_ids=prevs,
        auth_event_ids=auths,
        # v1/v2 cite each event with its reference hash; any well-formed hash will do here.
        edge_hashes={e: {"sha256": "a" * 43} for e in [*prevs, *auths]},
        depth=draw(st.integers(min_value=1, max_value=2**53 - 1)),
        origin_server_ts=draw(st.integers(min_value=0, max_value=2**53 - 1)),
    )
    return version, sign_pdu(version, pdu, "hs.test", SIGNING_KEY)


@settings(max_examples=100, deadline=None)
@given(signed_events())
def test_build_sign_serialise_parse_verify(case: tuple[RoomVersion, Any]) -> None:
    version, event = case
    wire = event.canonical_json()
    parsed = parse_pdu(version, wire)
    assert parsed == event and parsed.event_id == event.event_id
    assert parsed.canonical_json() == wire
    assert verify_event(parsed, KEYS) is parsed


@settings(max_examples=60, deadline=None)
@given(signed_events(), json_values)
def test_tampered_content_fails_the_hash_check(case: tuple[RoomVersion, Any], value: Any) -> None:
    version, event = case
    pdu = event.get_pdu_json()
    pdu["content"]["zz_tampered"] = value  # a key no redaction rule keeps
    tampered = parse_pdu(version, make_event(version, pdu).canonical_json())
    assert not content_hash_matches(tampered)
    checked = verify_event(tampered, KEYS)  # the signature covers only the redacted form
    assert checked.event_id == event.event_id
    assert checked.get_pdu_json() == prune_event_dict(version, tampered.pdu)


def _outcome(check: Any) -> Any:
    """What ``check()`` returns, or the type and text of the events error it raises."""
    try:
        return check()
    except (InvalidEvent, SignatureError) as e:
        return type(e), str(e)


@settings(max_examples=150, deadline=None)
@given(signed_events(), st.sampled_from(["none", "content", "unsigned", "signature", "big", "hashes"]), json_values)
def test_receive_pdu_agrees_with_make_event_and_verify_event(case: tuple[RoomVersion, Any], change: str,
                                                               value: Any) -> None:
    """The received-PDU path (each encoding made once) decides exactly as ``make_event`` then
    ``verify_event``: same event ID and PDU, same redaction on a bad content hash, same errors."""
    version, event = case
    pdu = event.get_pdu_json()
    if change == "content":
        pdu["content"]["zz_tampered"] = value
    elif change == "unsigned":
        pdu["unsigned"] = {"age": 5, "v": value}
    elif change == "signature":
        pdu["signatures"]["hs.test"]["ed25519:1"] = "A" * 86
    elif change == "big":  # at the size limit or one byte over, so the size sum must be exact
        pdu["unsigned"] = {"pad": ""}
        base = len(make_event(version, pdu).canonical_json())
        pdu["unsigned"]["pad"] = "x" * max(0, 65536 - base + len(str(value)) % 2)
    elif change == "hashes":
        pdu["hashes"]["sha256"] = "B" * 43
    expected = _outcome(lambda: verify_event(make_event(version, pdu), KEYS))
    got = _outcome(lambda: verify_received(receive_pdu(version, pdu), KEYS))
    assert got == expected
    if not isinstance(expected, tuple):
        assert got.event_id == expected.event_id and got.pdu == expected.pdu


def test_receive_pdu_size_is_that_of_the_whole_pdu() -> None:
    """The size ``receive_pdu`` sums from parts is the whole PDU's: one byte over the limit is
    refused, the limit itself is not."""
    version = KNOWN_ROOM_VERSIONS["10"]
    pdu = build_pdu(version, EventTemplate("m.room.message", {"body": "x"}), sender="@a:hs.test",
                    room_id="!room:hs.test", prev_event_ids=[], auth_event_ids=[], depth=1, origin_server_ts=1)
    signed = sign_pdu(version, pdu, "hs.test", SIGNING_KEY).get_pdu_json()
    signed["unsigned"] = {"pad": ""}
    base = len(make_event(version, signed).canonical_json())
    signed["unsigned"]["pad"] = "x" * (65536 - base)
    assert len(make_event(version, signed).canonical_json()) == 65536
    assert receive_pdu(version, signed).event.event_id == make_event(version, signed).event_id
    signed["unsigned"]["pad"] += "x"
    for make in (make_event, receive_pdu):
        try:
            make(version, signed)
        except EventTooLarge:
            continue
        raise AssertionError(f"{make.__name__} took a PDU over the size limit")


@settings(max_examples=200, deadline=None)
@given(versions, st.binary(max_size=300) | json_text.map(str.encode))
def test_parse_pdu_raises_only_invalid_event(version: RoomVersion, raw: bytes) -> None:
    try:
        parse_pdu(version, raw)
    except InvalidEvent:
        pass


@settings(max_examples=200, deadline=None)
@given(versions, st.dictionaries(st.sampled_from(
    ["type", "sender", "room_id", "content", "depth", "prev_events", "auth_events", "hashes",
     "signatures", "origin_server_ts", "state_key", "unsigned", "redacts"]), json_values | st.floats()))
def test_make_event_raises_only_invalid_event(version: RoomVersion, pdu: dict[str, Any]) -> None:
    for make in (make_event, receive_pdu):
        try:
            make(version, pdu)
        except InvalidEvent:
            pass


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80) | json_values, versions)
def test_power_level_values_never_raise(value: Any, version: RoomVersion) -> None:
    """Whatever a power levels event holds, reading a level gives an int or None (a v1-v9
    string is an int exactly when Python's int() agrees on its stripped ASCII form)."""
    from homeserver.events.auth import power_level_value

    level = power_level_value(version, value)
    assert level is None or isinstance(level, int)
    if isinstance(value, str) and level is not None:
        assert level == int(value.strip())
