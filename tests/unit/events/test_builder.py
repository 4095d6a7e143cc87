"""The event builder: prev_events, depth, auth_events selection, size limit, signing."""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from unpaddedbase64 import encode_base64

from homeserver.events import (
    EventTemplate,
    EventTooLarge,
    FrozenEvent,
    InvalidEvent,
    UnsupportedRoomVersion,
    add_hashes_and_signature,
    add_signature,
    build_pdu,
    build_template,
    check_auth_events_list,
    check_auth_rules,
    compute_depth,
    compute_event_id,
    compute_reference_hash,
    encode_canonical,
    make_event,
    membership_from_template,
    parse_pdu,
    prune_event_dict,
    select_prev_events,
    sign_pdu,
    template_as_event,
    verify_event,
)
from homeserver.events import constants as C
from homeserver.events.builder import edge_hashes_of
from homeserver.events.canonical import thaw
from homeserver.events.room_versions import ALL_ROOM_VERSIONS, V1, V10, V11, V12, EventFormat, RoomVersion
from homeserver.events.signing import content_hash_matches

from .helpers import ALICE, BOB, SIGNING_KEY, RoomBuilder, keyring_for, standard_room


def test_select_prev_events_caps_at_ten_deepest_deterministically() -> None:
    extremities = {f"$e{i:02d}": i % 7 for i in range(25)}
    chosen = select_prev_events(extremities)
    assert len(chosen) == 10
    assert [extremities[e] for e in chosen] == sorted((extremities[e] for e in chosen), reverse=True)
    assert min(extremities[e] for e in chosen) >= max(extremities[e] for e in extremities if e not in chosen)
    assert select_prev_events(dict(reversed(list(extremities.items())))) == chosen
    assert select_prev_events({}) == []


def test_compute_depth() -> None:
    assert compute_depth([]) == 1
    assert compute_depth([3, 9, 4]) == 10
    assert compute_depth([C.MAX_DEPTH]) == C.MAX_DEPTH


@pytest.mark.parametrize("version", ALL_ROOM_VERSIONS)
def test_a_built_event_is_signed_and_passes_auth(version: RoomVersion) -> None:
    room = standard_room(version)
    extremities = {room.last[0]: room.events[room.last[0]].depth}
    pdu = build_template(
        version,
        EventTemplate(type="m.room.message", content={"body": "hello"}),
        sender=ALICE,
        room_id=room.room_id,
        current_state=room.state,
        forward_extremities=extremities,
        origin_server_ts=123,
        edge_hashes=edge_hashes_of(version, room.events.values()),
    )
    event = sign_pdu(version, pdu, "a.test", SIGNING_KEY)
    assert event.prev_event_ids == tuple(room.last)
    assert event.depth == room.events[room.last[0]].depth + 1
    assert event.origin_server_ts == 123
    check_auth_events_list(version, event, room.events)
    check_auth_rules(version, event, room.state_events())
    assert verify_event(event, keyring_for("a.test")) is event
    cited = {room.events[e].type for e in event.auth_event_ids}
    assert cited == ({C.POWER_LEVELS, C.MEMBER} | ({C.CREATE} if version.create_event_in_auth_events else set()))


def test_event_over_64k_is_refused_after_signing() -> None:
    room = standard_room(V11)
    pdu = build_template(
        V11, EventTemplate(type="m.room.message", content={"body": "x" * 65_400}),
        sender=ALICE, room_id=room.room_id, current_state=room.state,
        forward_extremities={room.last[0]: 4}, origin_server_ts=1,
    )
    with pytest.raises(EventTooLarge):
        sign_pdu(V11, pdu, "a.test", SIGNING_KEY)


def test_v12_create_event_has_no_room_id_and_defines_it() -> None:
    create = sign_pdu(V12, build_template(
        V12, EventTemplate(type=C.CREATE, state_key="", content={"room_version": "12"}),
        sender=ALICE, room_id=None, current_state={}, forward_extremities={}, origin_server_ts=1,
    ), "a.test", SIGNING_KEY)
    assert "room_id" not in create.pdu and create.depth == 1
    assert create.room_id == "!" + create.event_id[1:]
    assert create.auth_event_ids == () and create.prev_event_ids == ()


def _signed_the_long_way(version: RoomVersion, pdu: dict[str, object]) -> object:
    from homeserver.events import add_hashes_and_signature, make_event
    from homeserver.events.hashing import assign_event_id

    if version.event_ids_are_origin_assigned and "event_id" not in pdu:
        pdu = {**pdu, "event_id": assign_event_id(pdu, "test")}
    return make_event(version, add_hashes_and_signature(version, pdu, "test", SIGNING_KEY))


@pytest.mark.parametrize("version", ALL_ROOM_VERSIONS)
def test_sign_pdu_gives_what_hashing_signing_and_make_event_give(version: RoomVersion) -> None:
    """sign_pdu encodes the event twice; the spec's steps one after the other encode it four times."""
    from homeserver.events.builder import sign_pdu

    base: dict[str, object] = {
        "type": "m.room.member", "state_key": "@bob:other", "sender": "@bob:other", "room_id": "!r:test",
        "content": {"membership": "join", "displayname": "Bób ✓", "n": 2**53 - 1}, "depth": 3,
        "origin_server_ts": 1764300000000, "prev_events": [], "auth_events": [], "unsigned": {"age": 5},
        "hashes": {"sha256": "stale"},
    }
    if version.event_ids_are_origin_assigned:
        base["prev_events"] = [["$p:test", {"sha256": "x"}]]
    else:
        base["prev_events"] = ["$" + "a" * 43]
    signed_by_other = {**base, "signatures": {"other": {"ed25519:o": "c2ln"}, "test": {"ed25519:old": "b2xk"}}}
    for pdu in (base, signed_by_other):
        ours = sign_pdu(version, pdu, "test", SIGNING_KEY)
        assert ours == _signed_the_long_way(version, pdu)
        assert ours.event_id == _signed_the_long_way(version, pdu).event_id  # type: ignore[attr-defined]
    for bad in ({**base, "content": {"f": 1.5}}, {**base, "signatures": {"other": "c2ln"}}, {**base, "depth": "3"}):
        with pytest.raises(InvalidEvent):
            sign_pdu(version, bad, "test", SIGNING_KEY)
    with pytest.raises(EventTooLarge):
        sign_pdu(version, {**base, "content": {"body": "x" * C.MAX_PDU_SIZE}}, "test", SIGNING_KEY)


# --- one builder, every room version: templates, signing, cosigning, a resident's template ------


def _on_room(room: RoomBuilder) -> dict[str, Any]:
    """The arguments ``build_template`` takes from a hand-built room."""
    return {
        "room_id": room.room_id,
        "current_state": dict(room.state),
        "forward_extremities": {e: room.events[e].depth for e in room.last},
        "edge_hashes": edge_hashes_of(room.room_version, room.events.values()),
    }


def _encoded(value: object) -> bytes:
    return encode_canonical(value)


@pytest.mark.parametrize("version", ALL_ROOM_VERSIONS)
def test_template_then_sign_is_the_event_in_the_versions_format(version: RoomVersion) -> None:
    """A make_join template is unsigned, unhashed and has no event ID; signing it (the second
    step) gives an event that the project's own parsing, verification and hash check accept,
    with the event ID format and edge format of its room version."""
    room = standard_room(version)
    template = build_template(
        version, EventTemplate(C.MEMBER, {"membership": C.JOIN}, state_key=BOB), sender=BOB,
        origin_server_ts=5, origin="a.test", **_on_room(room),
    )
    assert not {"hashes", "signatures", "event_id", "unsigned"} & set(template)
    assert template["origin"] == "a.test"
    event = sign_pdu(version, template, "b.test", SIGNING_KEY)

    assert parse_pdu(version, event.canonical_json()) == event
    assert verify_event(event, keyring_for("b.test")) is event
    assert content_hash_matches(event)
    assert event.event_id == compute_event_id(version, event.pdu)
    if version.event_ids_are_origin_assigned:
        assert event.pdu["event_id"] == event.event_id and event.event_id.endswith(":b.test")
        assert all(isinstance(edge, list) and set(edge[1]) == {"sha256"} for edge in thaw(event.pdu["prev_events"]))
    else:
        assert "event_id" not in event.pdu
        urlsafe = version.event_format is not EventFormat.REFERENCE_HASH
        assert event.event_id == "$" + encode_base64(compute_reference_hash(version, event.pdu), urlsafe=urlsafe)
        assert all(isinstance(edge, str) for edge in thaw(event.pdu["prev_events"]))
    check_auth_events_list(version, event, room.events)
    check_auth_rules(version, event, room.state_events())


@pytest.mark.parametrize("version", ALL_ROOM_VERSIONS)
def test_redacts_is_placed_where_the_version_wants_it(version: RoomVersion) -> None:
    room = standard_room(version)
    target = room.last[0]
    pdu = build_template(version, EventTemplate(C.REDACTION, {"reason": "spam"}, redacts=target), sender=ALICE,
                         origin_server_ts=9, **_on_room(room))
    event = sign_pdu(version, pdu, "a.test", SIGNING_KEY)
    assert event.redacts == target
    if version.redacts_in_content:
        assert event.content == {"reason": "spam", "redacts": target} and "redacts" not in event.pdu
    else:
        assert event.content == {"reason": "spam"} and event.pdu["redacts"] == target
    # From v11 redaction keeps it (in content); before, it strips the top-level key.
    pruned = prune_event_dict(version, event.pdu)
    kept = pruned["content"].get("redacts") if version.redacts_in_content else pruned.get("redacts")
    assert kept == (target if version.redacts_in_content else None)


def test_unknown_room_version_is_a_clear_error() -> None:
    not_ours = attrs.evolve(V11, identifier="13")
    changed = attrs.evolve(V11, redacts_in_content=False)  # "11", but not the spec's 11
    pdu = build_pdu(V11, EventTemplate("m.room.message", {}), sender=ALICE, room_id="!r:a.test",
                    prev_event_ids=[], auth_event_ids=[], depth=1, origin_server_ts=1)
    for version in (not_ours, changed, "11"):
        with pytest.raises(UnsupportedRoomVersion, match="unsupported room version"):
            build_pdu(version, EventTemplate("m.room.message", {}), sender=ALICE,  # type: ignore[arg-type]
                      room_id="!r:a.test", prev_event_ids=[], auth_event_ids=[], depth=1, origin_server_ts=1)
        with pytest.raises(UnsupportedRoomVersion):
            sign_pdu(version, pdu, "a.test", SIGNING_KEY)  # type: ignore[arg-type]
        with pytest.raises(UnsupportedRoomVersion):
            add_signature(version, pdu, "a.test", SIGNING_KEY)  # type: ignore[arg-type]


def test_v1_v2_edges_need_their_hashes() -> None:
    with pytest.raises(ValueError, match=r"\$p:a.test"):
        build_pdu(V1, EventTemplate("m.room.message", {}), sender=ALICE, room_id="!r:a.test",
                  prev_event_ids=["$p:a.test"], auth_event_ids=[], depth=2, origin_server_ts=1)


def test_template_as_event_is_only_for_the_auth_rules() -> None:
    """make_join runs the auth rules on its unsigned template; in v1/v2 it needs an event ID,
    which names the joining server (it assigns the real one)."""
    for version in (V1, V11):
        room = standard_room(version)
        template = build_template(version, EventTemplate(C.MEMBER, {"membership": C.JOIN}, state_key=BOB),
                                  sender=BOB, origin_server_ts=5, origin="a.test",
                                  **_on_room(room))
        before = _encoded(template)
        candidate = template_as_event(version, template, joining_server="b.test")
        assert _encoded(template) == before
        assert candidate.hashes == {"sha256": ""} and candidate.signatures == {}
        assert candidate.event_id.endswith(":b.test") == version.event_ids_are_origin_assigned
        check_auth_rules(version, candidate, room.state_events())


MEMBERSHIPS = [(v, m) for v in ALL_ROOM_VERSIONS for m in (C.JOIN, C.LEAVE, C.KNOCK) if m != C.KNOCK or v.knock_join_rule]


@pytest.mark.parametrize(("version", "membership"), MEMBERSHIPS)
def test_a_residents_template_becomes_our_signed_membership(version: RoomVersion, membership: str) -> None:
    """The whole make_*/send_* exchange, pure: the resident (a.test) builds the template, the
    joining server (b.test) makes its event of it, the resident cosigns it; every step keeps
    the template's place in the room and passes the checks."""
    rule = C.JR_KNOCK if membership == C.KNOCK else C.PUBLIC
    room = standard_room(version, rule)
    if membership == C.LEAVE:
        room.join(BOB)
    made = build_template(version, EventTemplate(C.MEMBER, {"membership": membership}, state_key=BOB), sender=BOB,
                          origin_server_ts=5, origin="a.test", **_on_room(room))
    made_before = _encoded(made)
    ours = membership_from_template(
        version, made, user_id=BOB, room_id=str(made["room_id"]), membership=membership,
        content={"membership": "ban", "reason": "hello"}, origin_server_ts=77, server_name="b.test",
        signing_key=SIGNING_KEY,
    )
    assert _encoded(made) == made_before
    assert ours.content == {"reason": "hello", "membership": membership}
    assert ours.origin_server_ts == 77 and ours.pdu["origin"] == "a.test"
    assert {k: v for k, v in thaw(ours.pdu).items() if k not in ("content", "origin_server_ts", "hashes",
                                                                  "signatures", "event_id")} == \
        {k: v for k, v in made.items() if k not in ("content", "origin_server_ts")}
    assert set(ours.signatures) == {"b.test"}
    check_auth_rules(version, ours, room.state_events())

    cosigned = make_event(version, add_signature(version, ours.pdu, "a.test", SIGNING_KEY),
                          trusted_event_id=ours.event_id)
    assert set(cosigned.signatures) == {"a.test", "b.test"} and cosigned.hashes == ours.hashes
    assert compute_event_id(version, cosigned.pdu) == ours.event_id  # signatures are not in the ID
    assert verify_event(cosigned, keyring_for("a.test", "b.test")) is cosigned


@pytest.mark.parametrize("version", ALL_ROOM_VERSIONS)
def test_a_restricted_joins_authoriser_is_kept_from_v8(version: RoomVersion) -> None:
    room = standard_room(version)
    made = build_template(version, EventTemplate(C.MEMBER, {"membership": C.JOIN, C.AUTHORISING_USER: ALICE},
                                                 state_key=BOB),
                          sender=BOB, origin_server_ts=5, **_on_room(room))
    ours = membership_from_template(version, made, user_id=BOB, room_id=str(made["room_id"]), membership=C.JOIN,
                                    content={}, origin_server_ts=6, server_name="b.test", signing_key=SIGNING_KEY)
    assert (C.AUTHORISING_USER in ours.content) == version.restricted_join_rule
    leave = membership_from_template(version, made, user_id=BOB, room_id=str(made["room_id"]), membership=C.LEAVE,
                                     content={}, origin_server_ts=6, server_name="b.test", signing_key=SIGNING_KEY)
    assert leave.content == {"membership": C.LEAVE}


@pytest.mark.parametrize("field", ["type", "state_key", "sender", "room_id"])
def test_a_template_for_someone_else_is_refused(field: str) -> None:
    room = standard_room(V11)
    made = build_template(V11, EventTemplate(C.MEMBER, {"membership": C.JOIN}, state_key=BOB), sender=BOB,
                          origin_server_ts=5, **_on_room(room))
    with pytest.raises(InvalidEvent, match="not an m.room.member of @bob:b.test"):
        membership_from_template(V11, {**made, field: "@eve:e.test"}, user_id=BOB, room_id=str(made["room_id"]),
                                 membership=C.JOIN, content={}, origin_server_ts=6, server_name="b.test",
                                 signing_key=SIGNING_KEY)


def test_a_template_keeps_others_keys_but_not_its_hashes_signatures_or_event_id() -> None:
    room = standard_room(V1)
    made = build_template(V1, EventTemplate(C.MEMBER, {"membership": C.JOIN}, state_key=BOB), sender=BOB,
                          origin_server_ts=5, **_on_room(room))
    made = {**made, "event_id": "$theirs:a.test", "hashes": {"sha256": "x"}, "signatures": {"a.test": {"k": "s"}}}
    ours = membership_from_template(V1, made, user_id=BOB, room_id=str(made["room_id"]), membership=C.JOIN,
                                    content={}, origin_server_ts=6, server_name="b.test", signing_key=SIGNING_KEY)
    assert ours.event_id.endswith(":b.test") and set(ours.signatures) == {"b.test"}
    assert content_hash_matches(ours)


def test_add_signature_refuses_malformed_signatures() -> None:
    event = standard_room(V11).events
    pdu = thaw(next(iter(event.values())).pdu)
    for bad in ("x", {"a.test": "sig"}):
        with pytest.raises(InvalidEvent, match="signatures"):
            add_signature(V11, {**pdu, "signatures": bad}, "b.test", SIGNING_KEY)


# --- properties ---------------------------------------------------------------------------

_versions = st.sampled_from(ALL_ROOM_VERSIONS)
_text = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=12)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**53) + 1, max_value=2**53 - 1) | _text,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(_text, children, max_size=3),
    max_leaves=12,
)
_contents = st.dictionaries(_text, _json, max_size=5)
_localparts = st.text("abcdefghijklmnopqrstuvwxyz0123456789._=-", min_size=1, max_size=10)


@st.composite
def _templates(draw: st.DrawFn) -> EventTemplate:
    event_type = draw(st.sampled_from(["m.room.message", C.MEMBER, C.TOPIC, C.REDACTION, "org.example.x"]))
    return EventTemplate(
        type=event_type,
        content=draw(_contents),
        state_key=draw(st.none() | _text) if event_type != C.REDACTION else None,
        redacts=("$" + "r" * 43) if event_type == C.REDACTION else None,
    )


_Room = tuple[RoomVersion, dict[str, int], dict[tuple[str, str], str], dict[str, dict[str, str]]]


@st.composite
def _rooms(draw: st.DrawFn) -> _Room:
    """A room version, forward extremities (ID -> depth), a current state, and the edge hashes."""
    version = draw(_versions)
    ids = draw(st.lists(st.text("abcdefghij", min_size=1, max_size=6), min_size=0, max_size=14, unique=True))
    event_ids = [f"${i}:a.test" if version.event_ids_are_origin_assigned
                 else "$" + hashlib.sha256(i.encode()).hexdigest()[:43] for i in ids]
    depths = draw(st.lists(st.integers(min_value=1, max_value=C.MAX_DEPTH), min_size=len(ids), max_size=len(ids)))
    extremities = dict(zip(event_ids, depths))
    keys = [(C.CREATE, ""), (C.POWER_LEVELS, ""), (C.JOIN_RULES, ""), (C.MEMBER, ALICE)]
    state = {key: event_id for key, event_id in zip(keys, reversed(event_ids))}
    hashes = {e: {"sha256": "h" * 43} for e in event_ids}
    return version, extremities, state, hashes


def _event_of(template: EventTemplate, sender: str, room: _Room, ts: int) -> FrozenEvent:
    version, extremities, state, hashes = room
    pdu = build_template(version, template, sender=sender, room_id="!room:a.test", current_state=state,
                         forward_extremities=extremities, origin_server_ts=ts, edge_hashes=hashes)
    return sign_pdu(version, pdu, "a.test", SIGNING_KEY)


@settings(max_examples=150, deadline=None)
@given(_rooms(), _templates(), _localparts, st.integers(min_value=0, max_value=2**53 - 1))
def test_every_built_event_passes_our_own_checks(room: _Room, template: EventTemplate, localpart: str,
                                                 ts: int) -> None:
    """Whatever is built, in any room version: the event parses back from its canonical JSON
    to itself, its signature and content hash verify, its ID is the version's (the reference
    hash in v3+), and it cites at most 10 prev events, the deepest, one level below it."""
    version, extremities, state, _ = room
    sender = f"@{localpart}:a.test"
    event = _event_of(template, sender, room, ts)
    assert parse_pdu(version, event.canonical_json()) == event
    assert verify_event(event, keyring_for("a.test", valid_until_ts=2**53)) is event
    assert event.event_id == compute_event_id(version, event.pdu)
    assert ("event_id" in event.pdu) == version.event_ids_are_origin_assigned
    if not version.event_ids_are_origin_assigned:
        urlsafe = version.event_format is not EventFormat.REFERENCE_HASH
        assert event.event_id == "$" + encode_base64(compute_reference_hash(version, event.pdu), urlsafe=urlsafe)
    assert list(event.prev_event_ids) == select_prev_events(extremities)
    assert event.depth == compute_depth(extremities[e] for e in event.prev_event_ids)
    assert set(event.auth_event_ids) <= set(state.values())
    assert event.origin_server_ts == ts and "origin" not in event.pdu
    assert event.redacts == template.redacts


@settings(max_examples=100, deadline=None)
@given(_rooms(), _templates(), _contents, st.sampled_from([C.JOIN, C.LEAVE, C.KNOCK]))
def test_the_builder_never_changes_its_inputs(room: _Room, template: EventTemplate,
                                              content: dict[str, Any], membership: str) -> None:
    """Each step takes its inputs as they are and hands back new values: the template, state,
    extremities, hashes, a resident's template, the content and another server's PDU are
    unchanged afterwards (and the results share nothing with them). The template is frozen."""
    version, extremities, state, hashes = room
    inputs = (extremities, state, hashes, content)
    before = copy.deepcopy(inputs)
    made = build_template(version, EventTemplate(C.MEMBER, {"membership": membership}, state_key=BOB), sender=BOB,
                          room_id="!room:a.test", current_state=state, forward_extremities=extremities,
                          origin_server_ts=1, edge_hashes=hashes, origin="a.test")
    made_before = _encoded(made)
    _event_of(template, ALICE, room, 2)
    ours = membership_from_template(version, made, user_id=BOB, room_id="!room:a.test", membership=membership,
                                    content=content, origin_server_ts=3, server_name="b.test", signing_key=SIGNING_KEY)
    wire = ours.get_pdu_json()
    cosigned = add_signature(version, wire, "a.test", SIGNING_KEY)
    template_as_event(version, made, joining_server="b.test")
    sign_pdu(version, made, "b.test", SIGNING_KEY)
    add_hashes_and_signature(version, made, "b.test", SIGNING_KEY)
    assert inputs == before and _encoded(made) == made_before
    assert wire == ours.get_pdu_json() and set(wire["signatures"]) == {"b.test"}
    cosigned["content"]["zz"] = 1
    cosigned["signatures"]["b.test"]["ed25519:zz"] = "x"
    assert wire == ours.get_pdu_json()  # the cosigned copy shares nothing with what it signed
