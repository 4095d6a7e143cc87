"""Signing our events and verifying others': required signers, keys, the content hash."""

from __future__ import annotations

import pytest
from signedjson.key import generate_signing_key, get_verify_key

from homeserver.events import (
    SignatureError,
    check_content_hash,
    make_event,
    redact_event,
    required_signers,
    verify_event,
    verify_event_signatures,
)
from homeserver.events.room_versions import ALL_ROOM_VERSIONS, V10, V11, V12, RoomVersion
from homeserver.events.builder import add_signature
from homeserver.events.signing import ServerKey

from .helpers import ALICE, BOB, SIGNING_KEY, RoomBuilder, keyring_for


@pytest.mark.parametrize("version", ALL_ROOM_VERSIONS)
def test_our_events_verify(version: RoomVersion) -> None:
    room = RoomBuilder(version)
    room.create(ALICE)
    join = room.join(ALICE)
    assert verify_event(join, keyring_for("a.test")) is join


def test_missing_signature_from_sender_server() -> None:
    room = RoomBuilder(V11)
    room.create(ALICE)
    event = room.build("m.room.message", BOB, {"body": "x"})  # signed by b.test
    pdu = event.get_pdu_json()
    pdu["signatures"] = {"a.test": pdu["signatures"]["b.test"]}
    forged = make_event(V11, pdu)
    with pytest.raises(SignatureError, match="b.test"):
        verify_event_signatures(forged, keyring_for("a.test", "b.test"))


def test_unknown_key_and_wrong_key() -> None:
    room = RoomBuilder(V11)
    create = room.create(ALICE)
    with pytest.raises(SignatureError, match="known key"):
        verify_event_signatures(create, {})
    other = get_verify_key(generate_signing_key("1"))
    with pytest.raises(SignatureError, match="does not verify"):
        verify_event_signatures(create, {"a.test": {"ed25519:1": ServerKey(other, 2**50)}})


def test_expired_key_is_refused() -> None:
    room = RoomBuilder(V11)
    create = room.create(ALICE)
    with pytest.raises(SignatureError, match="valid until"):
        verify_event_signatures(create, keyring_for("a.test", valid_until_ts=create.origin_server_ts - 1))


def test_signature_covers_redacted_form_so_redacted_copy_still_verifies() -> None:
    room = RoomBuilder(V11)
    room.create(ALICE)
    room.join(ALICE)
    message = room.build("m.room.message", ALICE, {"body": "secret"})
    redacted = redact_event(message)
    assert redacted.event_id == message.event_id and dict(redacted.content) == {}
    verify_event_signatures(redacted, keyring_for("a.test"))


def test_tampered_content_fails_hash_and_is_redacted() -> None:
    room = RoomBuilder(V11)
    room.create(ALICE)
    message = room.build("m.room.message", ALICE, {"body": "original"})
    pdu = message.get_pdu_json()
    pdu["content"]["body"] = "tampered"
    tampered = make_event(V11, pdu)
    assert tampered.event_id == message.event_id  # content is not in the reference hash
    checked = verify_event(tampered, keyring_for("a.test"))  # the signature still holds
    assert dict(checked.content) == {}
    assert check_content_hash(message) is message


def test_tampered_protected_key_breaks_the_signature() -> None:
    room = RoomBuilder(V11)
    room.create(ALICE)
    message = room.build("m.room.message", ALICE, {"body": "x"})
    pdu = message.get_pdu_json()
    pdu["origin_server_ts"] += 1
    with pytest.raises(SignatureError):
        verify_event_signatures(make_event(V11, pdu), keyring_for("a.test"))


def test_required_signers() -> None:
    room = RoomBuilder(V11)
    room.create(ALICE)
    join = room.build("m.room.member", BOB, {"membership": "join",
                                             "join_authorised_via_users_server": ALICE}, BOB)
    assert required_signers(join) == {"a.test", "b.test"}
    tpi_invite = room.build("m.room.member", ALICE, {"membership": "invite",
                                                     "third_party_invite": {"signed": {}}}, BOB)
    assert required_signers(tpi_invite) == frozenset()
    with pytest.raises(SignatureError, match="a.test"):
        verify_event_signatures(
            make_event(V11, {**join.get_pdu_json(), "signatures": {"b.test": join.signatures["b.test"]}}),
            keyring_for("a.test", "b.test"),
        )


def test_cosigning_keeps_existing_signatures() -> None:
    room = RoomBuilder(V11)
    room.create(ALICE)
    join = room.build("m.room.member", BOB, {"membership": "join",
                                             "join_authorised_via_users_server": ALICE}, BOB)
    cosigned = make_event(V11, add_signature(V11, join.pdu, "a.test", SIGNING_KEY))
    assert set(cosigned.signatures) == {"a.test", "b.test"}
    verify_event(cosigned, keyring_for("a.test", "b.test"))
