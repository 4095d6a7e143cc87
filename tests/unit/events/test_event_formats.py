"""Event formats and redaction by room version: what the spec's room version pages change.

v1/v2: ``event_id`` in the PDU (``$localpart:origin``), edges as ``[id, {"sha256": ...}]``
pairs, the ID's server must sign; v3: ``$`` + standard base64 reference hash; v4+: URL-safe.
Redaction: v1-v5 keep ``m.room.aliases``' aliases, v8 adds join rules' ``allow``, v9 the
membership authoriser, v11 its own rules.
"""

from __future__ import annotations

import pytest
from unpaddedbase64 import encode_base64

from homeserver.events import (
    InvalidEvent,
    SignatureError,
    compute_reference_hash,
    make_event,
    prune_event_dict,
    required_signers,
    verify_event,
)
from homeserver.events import constants as C
from homeserver.events.hashing import assign_event_id, edge_hash
from homeserver.events.room_versions import ALL_ROOM_VERSIONS, V1, V2, V3, V4, V5, V6, V7, V8, V9, V10, V11, RoomVersion

from .helpers import ALICE, BOB, keyring_for, standard_room


@pytest.mark.parametrize("version", [V1, V2])
def test_v1_v2_events_carry_their_id_and_hashed_edges(version: RoomVersion) -> None:
    room = standard_room(version)
    message = room.add("m.room.message", ALICE, {"body": "hi"})
    assert message.pdu["event_id"] == message.event_id
    assert message.event_id.startswith("$") and message.event_id.endswith(":a.test")
    (prev,) = message.pdu["prev_events"]
    assert isinstance(prev, tuple) and prev[0] == message.prev_event_ids[0]
    assert dict(prev[1]) == edge_hash(version, room.events[prev[0]].pdu)
    assert all(isinstance(a, tuple) for a in message.pdu["auth_events"])
    assert set(message.auth_event_ids) <= set(room.events)
    assert verify_event(message, keyring_for("a.test")) is message
    # The event ID is part of what is hashed and signed: change it and the signature fails.
    forged = make_event(version, {**message.get_pdu_json(), "event_id": "$other:a.test"})
    with pytest.raises(SignatureError):
        verify_event(forged, keyring_for("a.test"))


@pytest.mark.parametrize("version", [V1, V2])
def test_v1_v2_format_is_enforced(version: RoomVersion) -> None:
    room = standard_room(version)
    pdu = room.add("m.room.message", ALICE, {"body": "hi"}).get_pdu_json()
    no_id = {k: v for k, v in pdu.items() if k != "event_id"}
    with pytest.raises(InvalidEvent, match="event_id"):
        make_event(version, no_id)
    with pytest.raises(InvalidEvent, match="server name"):
        make_event(version, {**pdu, "event_id": "$nodomain"})
    with pytest.raises(InvalidEvent, match="pairs"):
        make_event(version, {**pdu, "prev_events": [e[0] for e in pdu["prev_events"]]})
    with pytest.raises(InvalidEvent, match="pairs"):
        make_event(version, {**pdu, "auth_events": [[pdu["auth_events"][0][0]]]})
    with pytest.raises(InvalidEvent):
        make_event(version, {**pdu, "prev_events": [[pdu["prev_events"][0][0], {"sha256": 5}]]})


@pytest.mark.parametrize("version", ALL_ROOM_VERSIONS[2:])
def test_v3_onwards_refuse_pairs(version: RoomVersion) -> None:
    room = standard_room(version)
    pdu = room.add("m.room.message", ALICE, {"body": "hi"}).get_pdu_json()
    with pytest.raises(InvalidEvent):
        make_event(version, {**pdu, "prev_events": [[pdu["prev_events"][0], {"sha256": "x"}]]})


def test_v3_ids_are_standard_base64_and_v4_url_safe() -> None:
    for version, urlsafe in ((V3, False), (V4, True), (V11, True)):
        room = standard_room(version)
        event = room.add("m.room.message", ALICE, {"body": "hi"})
        digest = compute_reference_hash(version, event.pdu)
        assert event.event_id == "$" + encode_base64(digest, urlsafe=urlsafe)
        assert ":" not in event.event_id


def test_assigned_ids_differ_per_event_and_are_stable() -> None:
    pdu = {"type": "m.room.message", "content": {"body": "a"}, "origin_server_ts": 1}
    first = assign_event_id(pdu, "a.test")
    assert first == assign_event_id({**pdu, "signatures": {"x": {}}}, "a.test")
    assert first != assign_event_id({**pdu, "origin_server_ts": 2}, "a.test")
    assert first.endswith(":a.test") and len(first.split(":")[0]) == 25


def test_v1_the_event_id_server_must_sign() -> None:
    room = standard_room(V1)
    event = room.add("m.room.message", ALICE, {"body": "hi"})
    relayed = make_event(V1, {**event.get_pdu_json(), "event_id": "$abc:b.test"})
    assert required_signers(relayed) == {"a.test", "b.test"}
    assert required_signers(make_event(V3, standard_room(V3).add("m.x", ALICE, {}).pdu)) == {"a.test"}


def test_key_validity_is_enforced_from_v5() -> None:
    for version, enforced in ((V4, False), (V5, True)):
        event = standard_room(version).add("m.room.message", ALICE, {"body": "hi"})
        keys = keyring_for("a.test", valid_until_ts=event.origin_server_ts - 1)
        if enforced:
            with pytest.raises(SignatureError, match="valid until"):
                verify_event(event, keys)
        else:
            assert verify_event(event, keys) is event


def _pruned_content(version: RoomVersion, event_type: str, content: dict[str, object]) -> dict[str, object]:
    pdu = {"type": event_type, "content": content, "origin": "a.test", "membership": "join", "prev_state": []}
    pruned = prune_event_dict(version, pdu)
    return dict(pruned["content"])


def test_redaction_rules_by_version() -> None:
    aliases = {"aliases": ["#a:a.test"]}
    assert _pruned_content(V5, "m.room.aliases", aliases) == aliases
    assert _pruned_content(V6, "m.room.aliases", aliases) == {}
    join_rules = {"join_rule": "restricted", "allow": [{"type": "m.room_membership"}]}
    assert _pruned_content(V7, C.JOIN_RULES, join_rules) == {"join_rule": "restricted"}
    assert _pruned_content(V8, C.JOIN_RULES, join_rules) == join_rules
    member = {"membership": "join", C.AUTHORISING_USER: BOB, "displayname": "x"}
    assert _pruned_content(V8, C.MEMBER, member) == {"membership": "join"}
    assert _pruned_content(V9, C.MEMBER, member) == {"membership": "join", C.AUTHORISING_USER: BOB}
    create = {"creator": ALICE, "m.federate": False}
    assert _pruned_content(V10, C.CREATE, create) == {"creator": ALICE}
    assert _pruned_content(V11, C.CREATE, create) == create
    levels = {"invite": 5, "ban": 5}
    assert _pruned_content(V10, C.POWER_LEVELS, levels) == {"ban": 5}
    assert _pruned_content(V11, C.POWER_LEVELS, levels) == levels
    top = prune_event_dict(V10, {"type": "m.x", "content": {}, "origin": "a", "membership": "j", "prev_state": []})
    assert {"origin", "membership", "prev_state"} <= set(top)
    top = prune_event_dict(V11, {"type": "m.x", "content": {}, "origin": "a", "membership": "j", "prev_state": []})
    assert not {"origin", "membership", "prev_state"} & set(top)
