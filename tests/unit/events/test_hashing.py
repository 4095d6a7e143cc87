"""The appendix's cryptographic test vectors, plus event and room ID derivation.

The event-signing vectors predate room version 11 (they keep ``origin``), so they are
checked with the version 10 redaction rules; the JSON-signing vectors need no version.
"""

from __future__ import annotations

import hashlib

from unpaddedbase64 import encode_base64

from homeserver.events import (
    add_hashes_and_signature,
    compute_event_id,
    compute_reference_hash,
    make_event,
    room_id_from_create_event_id,
)
from homeserver.events.redaction import prune_event_dict
from homeserver.events.room_versions import V10, V11, V12
from homeserver.events.signing import sign_json_object

from .helpers import ALICE, SIGNING_KEY, RoomBuilder


def test_json_signing_vector_empty_object() -> None:
    assert sign_json_object({}, "domain", SIGNING_KEY) == {
        "signatures": {
            "domain": {
                "ed25519:1": "K8280/U9SSy9IVtjBuVeLr+HpOB4BQFWbg+UZaADMtTdGYI7Geitb76LTrr5QV/7Xg4ahLwYGYZzuHGZKM5ZAQ"
            }
        }
    }


def test_json_signing_vector_with_data() -> None:
    assert sign_json_object({"one": 1, "two": "Two"}, "domain", SIGNING_KEY) == {
        "one": 1,
        "signatures": {
            "domain": {
                "ed25519:1": "KqmLSbO39/Bzb0QIYE82zqLwsA+PDzYIpIRA2sRQ4sL53+sN6/fpNSoqE7BP7vBZhG6kYdD13EIMJpvhJI+6Bw"
            }
        },
        "two": "Two",
    }


def test_event_signing_vector_minimal_event() -> None:
    event = {
        "room_id": "!x:domain", "sender": "@a:domain", "origin": "domain",
        "origin_server_ts": 1000000, "signatures": {}, "hashes": {}, "type": "X",
        "content": {}, "prev_events": [], "auth_events": [], "depth": 3,
        "unsigned": {"age_ts": 1000000},
    }
    assert add_hashes_and_signature(V10, event, "domain", SIGNING_KEY) == {
        "auth_events": [],
        "content": {},
        "depth": 3,
        "hashes": {"sha256": "5jM4wQpv6lnBo7CLIghJuHdW+s2CMBJPUOGOC89ncos"},
        "origin": "domain",
        "origin_server_ts": 1000000,
        "prev_events": [],
        "room_id": "!x:domain",
        "sender": "@a:domain",
        "signatures": {
            "domain": {
                "ed25519:1": "KxwGjPSDEtvnFgU00fwFz+l6d2pJM6XBIaMEn81SXPTRl16AqLAYqfIReFGZlHi5KLjAWbOoMszkwsQma+lYAg"
            }
        },
        "type": "X",
        "unsigned": {"age_ts": 1000000},
    }


def test_event_signing_vector_redactable_event() -> None:
    event = {
        "content": {"body": "Here is the message content"}, "event_id": "$0:domain",
        "origin": "domain", "origin_server_ts": 1000000, "type": "m.room.message",
        "room_id": "!r:domain", "sender": "@u:domain", "signatures": {},
        "unsigned": {"age_ts": 1000000},
    }
    signed = add_hashes_and_signature(V10, event, "domain", SIGNING_KEY)
    assert signed["hashes"] == {"sha256": "onLKD1bGljeBWQhWZ1kaP9SorVmRQNdN5aM2JYU2n/g"}
    assert signed["signatures"] == {
        "domain": {
            "ed25519:1": "Wm+VzmOUOz08Ds+0NTWb1d4CZrVsJSikkeRxh6aCcUwu6pNC78FunoD7KNWzqFn241eYHYMGCA5McEiVPdhzBA"
        }
    }
    assert signed["content"] == event["content"] and signed["unsigned"] == event["unsigned"]


def test_signing_does_not_modify_its_input() -> None:
    event = {"type": "X", "content": {"a": 1}, "signatures": {}}
    add_hashes_and_signature(V11, event, "domain", SIGNING_KEY)
    assert event == {"type": "X", "content": {"a": 1}, "signatures": {}}


def test_event_id_is_urlsafe_unpadded_reference_hash() -> None:
    room = RoomBuilder(V11)
    create = room.create(ALICE)
    pdu = create.get_pdu_json()
    pruned = prune_event_dict(V11, pdu)
    for key in ("signatures", "unsigned"):
        pruned.pop(key, None)
    from homeserver.events.canonical import encode_canonical

    digest = hashlib.sha256(encode_canonical(pruned)).digest()
    assert compute_reference_hash(V11, pdu) == digest
    assert create.event_id == "$" + encode_base64(digest, urlsafe=True)
    assert len(create.event_id) == 44 and "=" not in create.event_id and "+" not in create.event_id


def test_reference_hash_ignores_unsigned_signatures_and_redactable_content() -> None:
    room = RoomBuilder(V11)
    room.create(ALICE)
    message = room.build("m.room.message", ALICE, {"body": "hi"})
    pdu = message.get_pdu_json()
    pdu["unsigned"] = {"age": 5}
    pdu["signatures"] = {"other.test": {"ed25519:x": "abc"}}
    pdu["content"] = {"body": "changed"}  # the reference hash covers only the redacted form
    assert compute_event_id(V11, pdu) == message.event_id


def test_v12_room_id_is_the_create_event_id_with_bang() -> None:
    room = RoomBuilder(V12)
    create = room.create(ALICE)
    assert "room_id" not in create.pdu
    assert create.room_id == "!" + create.event_id[1:] == room_id_from_create_event_id(create.event_id)
    join = room.join(ALICE)
    assert join.room_id == create.room_id
    assert make_event(V12, create.get_pdu_json()).event_id == create.event_id
