"""Verifying the hashes and signatures of events we receive, and signing plain JSON.

Signing the events we make ("Adding hashes and signatures to outgoing events": content
hash first, then an ed25519 signature over the *redacted* event) is the builder's second
step (``builder.sign_pdu``, ``builder.add_signature``), so that one module knows an event's
shape. Verification takes the keys as an argument; fetching them (and applying the 7-day
cap on ``valid_until_ts``) is the caller's job, so this module does no I/O.
"""

# tests: tests/unit/events/test_signing.py, tests/property/test_events_roundtrip.py

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs
from nacl.exceptions import CryptoError
from signedjson.key import decode_verify_key_bytes
from signedjson.sign import sign_json
from signedjson.types import SigningKey, VerifyKey
from unpaddedbase64 import decode_base64

from homeserver.events import constants as C
from homeserver.events.canonical import JsonDict, encode_canonical, thaw
from homeserver.events.errors import SignatureError
from homeserver.events.event import FrozenEvent, ReceivedPdu, make_event
from homeserver.events.hashing import compute_content_hash, decode_hash, redacted_bytes
from homeserver.events.identifiers import is_valid_user_id, server_name_of
from homeserver.events.redaction import prune_event_dict
from homeserver.events.room_versions import RoomVersion


@attrs.frozen(slots=True)
class ServerKey:
    """A server's public signing key and until when it may verify events (ms since epoch).

    For ``old_verify_keys`` use ``expired_ts``; for current keys, the lesser of
    ``valid_until_ts`` and seven days after the key was fetched (room versions 5+).
    """

    verify_key: VerifyKey
    valid_until_ts: int


KeyRing = Mapping[str, Mapping[str, ServerKey]]
"""server name -> key ID (e.g. ``ed25519:abc``) -> key."""


def sign_json_object(obj: Mapping[str, object], server_name: str, signing_key: SigningKey) -> JsonDict:
    """Sign a JSON object per the appendix ("Signing JSON"); returns a new dict."""
    copy: JsonDict = thaw(obj)
    signed: JsonDict = sign_json(copy, server_name, signing_key)
    return signed


def required_signers(event: FrozenEvent) -> frozenset[str]:
    """The servers whose signatures an event must carry ("Validating hashes and signatures").

    The sender's server, except for an invite created from a third-party invite; plus,
    for a membership event with ``join_authorised_via_users_server``, that user's server
    (auth rule "must be validly signed by the homeserver of the user ID denoted by the
    key"); plus, in room versions 1 and 2, the server named by the event ID (v3+ event
    IDs name no server).
    """
    servers: set[str] = set()
    if event.room_version.event_ids_are_origin_assigned:
        servers.add(server_name_of(event.event_id))
    content = event.content
    if not (
        event.type == C.MEMBER
        and event.membership == C.INVITE
        and "third_party_invite" in content
    ):
        servers.add(server_name_of(event.sender))
    if event.type == C.MEMBER and event.room_version.restricted_join_rule:
        authoriser = content.get(C.AUTHORISING_USER)
        if isinstance(authoriser, str) and is_valid_user_id(authoriser):
            servers.add(server_name_of(authoriser))
    return frozenset(servers)


def _signed_bytes(room_version: RoomVersion, event: FrozenEvent) -> bytes:
    return redacted_bytes(room_version, event.pdu)


def verify_event_signatures(event: FrozenEvent, keys: KeyRing, *, signed_bytes: bytes | None = None) -> None:
    """Raise ``SignatureError`` unless every required server validly signed ``event``.

    For each server in ``required_signers(event)``: its ed25519 signatures for which
    ``keys`` has a key (from v5 on: valid at the event's ``origin_server_ts``) are checked; at least
    one must exist and all of them must verify. Works on full and redacted copies alike.
    ``signed_bytes``: the event's ``redacted_bytes`` when the caller has them.
    """
    message = signed_bytes if signed_bytes is not None else _signed_bytes(event.room_version, event)
    ts = event.origin_server_ts
    for server in sorted(required_signers(event)):
        sigs = event.signatures.get(server)
        if not isinstance(sigs, Mapping):
            raise SignatureError(f"event {event.event_id} has no signature from {server}")
        server_keys = keys.get(server, {})
        checked = 0
        for key_id, sig_b64 in sigs.items():
            if not key_id.startswith("ed25519:") or not isinstance(sig_b64, str):
                continue  # algorithms we do not understand are ignored
            key = server_keys.get(key_id)
            if key is None:
                continue
            if event.room_version.enforce_key_validity and key.valid_until_ts < ts:
                raise SignatureError(
                    f"key {server} {key_id} was valid until {key.valid_until_ts}, "
                    f"before the event's origin_server_ts {ts} ({event.event_id})"
                )
            try:
                key.verify_key.verify(message, decode_base64(sig_b64))
            except (CryptoError, ValueError, TypeError) as e:
                raise SignatureError(
                    f"signature {server} {key_id} on {event.event_id} does not verify: "
                    f"{type(e).__name__}"
                ) from None
            checked += 1
        if checked == 0:
            raise SignatureError(
                f"event {event.event_id}: no signature from {server} with a known key "
                f"(key IDs on the event: {sorted(sigs)[:5]})"
            )


def content_hash_matches(event: FrozenEvent) -> bool:
    """True when ``hashes.sha256`` equals the content hash of the event as we hold it."""
    claimed = event.hashes.get("sha256")
    if not isinstance(claimed, str):
        return False
    return decode_hash(claimed) == compute_content_hash(event.pdu)


def redact_event(event: FrozenEvent) -> FrozenEvent:
    """The redacted copy of ``event`` (same event ID: the reference hash covers only kept keys)."""
    pruned = prune_event_dict(event.room_version, event.pdu)
    return make_event(event.room_version, pruned, trusted_event_id=event.event_id)


def check_content_hash(event: FrozenEvent) -> FrozenEvent:
    """``event`` if its content hash matches, else its redacted copy (per the spec)."""
    return event if content_hash_matches(event) else redact_event(event)


def verify_event(event: FrozenEvent, keys: KeyRing) -> FrozenEvent:
    """Checks 2 and 3 on receipt of a PDU: signatures (else ``SignatureError``), then the hash.

    Returns the event to process further: itself, or its redacted copy when the content
    hash does not match.
    """
    verify_event_signatures(event, keys)
    return check_content_hash(event)


def verify_received(received: ReceivedPdu, keys: KeyRing) -> FrozenEvent:
    """``verify_event`` of a ``receive_pdu`` result, on the encodings it made."""
    event = received.event
    verify_event_signatures(event, keys, signed_bytes=received.signed_bytes)
    claimed = event.hashes.get("sha256")
    if isinstance(claimed, str) and decode_hash(claimed) == received.content_hash:
        return event
    return redact_event(event)


def verify_third_party_signed(signed: Mapping[str, object], public_keys: Iterable[str]) -> bool:
    """True when any ed25519 signature in ``signed.signatures`` verifies with any public key.

    Used by the auth rules for invites from ``third_party_invite``; keys are
    base64 (standard or URL-safe, unpadded) as in ``m.room.third_party_invite``.
    """
    signatures = signed.get("signatures")
    if not isinstance(signatures, Mapping):
        return False
    body = {k: v for k, v in signed.items() if k not in ("signatures", "unsigned")}
    try:
        message = encode_canonical(body)
    except (TypeError, ValueError):
        return False
    verify_keys: list[VerifyKey] = []
    for public_key in public_keys:
        try:
            verify_keys.append(decode_verify_key_bytes("ed25519:tpi", decode_base64(public_key)))
        except (CryptoError, ValueError, TypeError):  # malformed key material: not a match
            continue
    for server_sigs in signatures.values():
        if not isinstance(server_sigs, Mapping):
            continue
        for key_id, sig_b64 in server_sigs.items():
            if not isinstance(key_id, str) or not key_id.startswith("ed25519:"):
                continue
            if not isinstance(sig_b64, str):
                continue
            try:
                sig = decode_base64(sig_b64)
            except ValueError:
                continue
            for verify_key in verify_keys:
                try:
                    verify_key.verify(message, sig)
                    return True
                except (CryptoError, ValueError, TypeError):  # try the next key
                    continue
    return False
