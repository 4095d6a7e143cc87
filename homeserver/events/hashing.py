"""Content hashes, reference hashes, event IDs and (v12) room IDs.

All take the PDU as a mapping and never modify it. Event IDs depend on the room
version's ``EventFormat``: the PDU's own ``event_id`` (``$localpart:origin``, v1 and v2),
``$`` plus the standard (v3) or URL-safe (v4+) unpadded base64 of the reference hash. In
room version 12 the room ID is the create event's ID with the sigil ``!``.
"""

# tests: tests/unit/events/test_hashing.py

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from unpaddedbase64 import decode_base64, encode_base64

from homeserver.events.canonical import encode_canonical
from homeserver.events.errors import InvalidEvent
from homeserver.events.redaction import prune_event_dict
from homeserver.events.room_versions import EventFormat, RoomVersion

ORIGIN_ASSIGNED_LOCALPART_CHARS = 24
"""Length of the localpart of the v1/v2 event IDs we assign (144 bits of a hash)."""


def compute_content_hash(pdu: Mapping[str, object]) -> bytes:
    """SHA-256 over the canonical JSON of the full event minus unsigned/signatures/hashes."""
    stripped = {k: v for k, v in pdu.items() if k not in ("unsigned", "signatures", "hashes")}
    return hashlib.sha256(encode_canonical(stripped)).digest()


def redacted_bytes(room_version: RoomVersion, pdu: Mapping[str, object]) -> bytes:
    """Canonical JSON of the redacted event minus signatures, age_ts and unsigned: what the
    reference hash hashes and what signatures cover (redaction never keeps age_ts or unsigned)."""
    pruned = prune_event_dict(room_version, pdu, deep_copy=False)
    for key in ("signatures", "age_ts", "unsigned"):
        pruned.pop(key, None)
    return encode_canonical(pruned)


def compute_reference_hash(room_version: RoomVersion, pdu: Mapping[str, object]) -> bytes:
    """SHA-256 over the redacted event minus signatures, age_ts and unsigned."""
    return hashlib.sha256(redacted_bytes(room_version, pdu)).digest()


def event_id_from_reference_bytes(room_version: RoomVersion, reference_bytes: bytes) -> str:
    """A v3+ event ID from ``redacted_bytes`` of the event."""
    urlsafe = room_version.event_format is EventFormat.URL_SAFE_REFERENCE_HASH
    return "$" + encode_base64(hashlib.sha256(reference_bytes).digest(), urlsafe=urlsafe)


def compute_event_id(room_version: RoomVersion, pdu: Mapping[str, object]) -> str:
    """The event ID of ``pdu`` in ``room_version``'s event format.

    v1/v2: the PDU's ``event_id`` (``InvalidEvent`` when it has none); v3: ``$`` + standard
    unpadded base64 of the reference hash; v4+: the same in URL-safe base64.
    """
    if room_version.event_format is EventFormat.ORIGIN_ASSIGNED:
        event_id = pdu.get("event_id")
        if not isinstance(event_id, str):
            raise InvalidEvent("a room version 1/2 PDU must carry its 'event_id'")
        return event_id
    urlsafe = room_version.event_format is EventFormat.URL_SAFE_REFERENCE_HASH
    return "$" + encode_base64(compute_reference_hash(room_version, pdu), urlsafe=urlsafe)


def assign_event_id(pdu: Mapping[str, object], server_name: str) -> str:
    """A v1/v2 event ID for an event this server creates: ``$localpart:server_name``.

    The localpart is derived from the PDU (minus hashes, signatures, unsigned), so the
    builder stays pure and deterministic; two events differing in anything (timestamp,
    prev_events, content) get different IDs.
    """
    stripped = {k: v for k, v in pdu.items() if k not in ("event_id", "hashes", "signatures", "unsigned")}
    digest = hashlib.sha256(encode_canonical(stripped)).digest()
    return "$" + encode_base64(digest, urlsafe=True)[:ORIGIN_ASSIGNED_LOCALPART_CHARS] + ":" + server_name


def edge_hash(room_version: RoomVersion, pdu: Mapping[str, object]) -> dict[str, str]:
    """The ``{"sha256": ...}`` object a v1/v2 event puts beside an event ID it cites."""
    return {"sha256": encode_hash(compute_reference_hash(room_version, pdu))}


def room_id_from_create_event_id(create_event_id: str) -> str:
    """Room version 12: the room ID is the create event's ID with sigil ``!`` instead of ``$``."""
    return "!" + create_event_id[1:]


def create_event_id_from_room_id(room_id: str) -> str:
    """Room version 12: the create event's ID for a room ID (inverse of the above)."""
    return "$" + room_id[1:]


def encode_hash(digest: bytes) -> str:
    """Standard unpadded base64, the encoding of ``hashes.sha256``."""
    return encode_base64(digest)


def decode_hash(value: str) -> bytes | None:
    """Decode a base64 hash (standard or URL-safe, padded or not); ``None`` when malformed."""
    try:
        return decode_base64(value.rstrip("="))
    except (ValueError, UnicodeEncodeError):
        return None
