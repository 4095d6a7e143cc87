"""Content hashes, reference hashes, event IDs and (v12) room IDs.

All take the PDU as a mapping and never modify it. Event IDs are ``$`` plus the
URL-safe unpadded base64 of the reference hash (room versions 4+); in room version 12
the room ID is the create event's ID with the sigil ``!``.
"""

# tests: tests/unit/events/test_hashing.py

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from unpaddedbase64 import decode_base64, encode_base64

from homeserver.events.canonical import encode_canonical
from homeserver.events.redaction import prune_event_dict
from homeserver.events.room_versions import RoomVersion


def compute_content_hash(pdu: Mapping[str, object]) -> bytes:
    """SHA-256 over the canonical JSON of the full event minus unsigned/signatures/hashes."""
    stripped = {k: v for k, v in pdu.items() if k not in ("unsigned", "signatures", "hashes")}
    return hashlib.sha256(encode_canonical(stripped)).digest()


def compute_reference_hash(room_version: RoomVersion, pdu: Mapping[str, object]) -> bytes:
    """SHA-256 over the redacted event minus signatures, age_ts and unsigned."""
    pruned = prune_event_dict(room_version, pdu)
    for key in ("signatures", "age_ts", "unsigned"):
        pruned.pop(key, None)
    return hashlib.sha256(encode_canonical(pruned)).digest()


def compute_event_id(room_version: RoomVersion, pdu: Mapping[str, object]) -> str:
    """The event ID of ``pdu``: ``$`` + URL-safe unpadded base64 of its reference hash."""
    return "$" + encode_base64(compute_reference_hash(room_version, pdu), urlsafe=True)


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
