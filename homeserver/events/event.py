"""The immutable event type and ``make_event``, the only way to build one from a PDU.

``make_event`` checks a PDU against the event format of its room version (field types,
strict canonical JSON, size limits, the shape of ``prev_events``/``auth_events`` and, in
v1/v2, the ``event_id`` the PDU carries) and computes or reads its event ID, so a malformed
federation PDU becomes an ``InvalidEvent`` and never a crash further in. It does not
check hashes, signatures or the auth rules: see ``signing`` and ``auth``.
"""

# tests: tests/unit/events/test_event.py

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import attrs

from homeserver.events import constants as C
from homeserver.events.canonical import (
    JsonDict,
    JsonMapping,
    JsonValue,
    check_canonical,
    encode_canonical,
    freeze,
    is_int,
    parse_json_object,
    thaw,
)
from homeserver.events.errors import EventTooLarge, InvalidEvent
from homeserver.events.hashing import (
    compute_event_id,
    event_id_from_reference_bytes,
    redacted_bytes,
    room_id_from_create_event_id,
)
from homeserver.events.identifiers import is_valid_event_id, is_valid_room_id, is_valid_user_id
from homeserver.events.room_versions import RoomVersion

StateKey = tuple[str, str]
"""``(event_type, state_key)``: the key of a room state map."""

_EMPTY: JsonMapping = MappingProxyType({})


@attrs.frozen(slots=True, eq=False)
class FrozenEvent:
    """One PDU of a known room version, read-only, with typed accessors.

    Built by ``make_event``; ``pdu`` is a frozen deep copy of the wire form (including
    ``unsigned`` as received). Equality is by event ID and PDU, hashing by event ID.
    """

    room_version: RoomVersion
    event_id: str
    pdu: JsonMapping = attrs.field(repr=False)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FrozenEvent):
            return NotImplemented
        return self.event_id == other.event_id and self.pdu == other.pdu

    def __hash__(self) -> int:
        return hash(self.event_id)

    # Typed accessors. make_event guaranteed the types, so the casts below are checks
    # of an invariant, not of input.

    @property
    def type(self) -> str:
        return _str(self.pdu["type"])

    @property
    def sender(self) -> str:
        return _str(self.pdu["sender"])

    @property
    def room_id(self) -> str:
        """The room ID; for a v12 create event (which has none), the one it defines."""
        room_id = self.pdu.get("room_id")
        if isinstance(room_id, str):
            return room_id
        return room_id_from_create_event_id(self.event_id)

    @property
    def state_key(self) -> str | None:
        state_key = self.pdu.get("state_key")
        return state_key if isinstance(state_key, str) else None

    def is_state(self) -> bool:
        return "state_key" in self.pdu

    @property
    def state_key_tuple(self) -> StateKey | None:
        """``(type, state_key)`` for state events, else ``None``."""
        sk = self.state_key
        return None if sk is None else (self.type, sk)

    @property
    def content(self) -> JsonMapping:
        content = self.pdu["content"]
        assert type(content) is MappingProxyType or isinstance(content, Mapping)  # frozen by make_event
        return content

    @property
    def membership(self) -> str | None:
        """``content.membership`` when it is a string."""
        value = self.content.get("membership")
        return value if isinstance(value, str) else None

    @property
    def prev_event_ids(self) -> tuple[str, ...]:
        return _edge_ids(self.pdu["prev_events"])

    @property
    def auth_event_ids(self) -> tuple[str, ...]:
        return _edge_ids(self.pdu["auth_events"])

    @property
    def depth(self) -> int:
        depth = self.pdu["depth"]
        assert is_int(depth)
        return depth

    @property
    def origin_server_ts(self) -> int:
        ts = self.pdu["origin_server_ts"]
        assert is_int(ts)
        return ts

    @property
    def redacts(self) -> str | None:
        """The event a redaction targets: ``content.redacts`` in v11+, top-level before."""
        if self.type != C.REDACTION:
            return None
        if self.room_version.redacts_in_content:
            value = self.content.get("redacts")
        else:
            value = self.pdu.get("redacts")
        return value if isinstance(value, str) else None

    @property
    def hashes(self) -> JsonMapping:
        hashes = self.pdu["hashes"]
        assert type(hashes) is MappingProxyType or isinstance(hashes, Mapping)  # frozen by make_event
        return hashes

    @property
    def signatures(self) -> JsonMapping:
        signatures = self.pdu["signatures"]
        assert type(signatures) is MappingProxyType or isinstance(signatures, Mapping)  # frozen by make_event
        return signatures

    @property
    def unsigned(self) -> JsonMapping:
        unsigned = self.pdu.get("unsigned")
        return unsigned if isinstance(unsigned, Mapping) else _EMPTY

    def get_pdu_json(self) -> JsonDict:
        """A fresh, mutable copy of the PDU as sent over federation."""
        result: JsonDict = thaw(self.pdu)
        return result

    def canonical_json(self) -> bytes:
        return encode_canonical(self.pdu)


def _str(value: JsonValue) -> str:
    assert isinstance(value, str)
    return value


def _edge_ids(value: JsonValue) -> tuple[str, ...]:
    """Event IDs of ``prev_events``/``auth_events``: plain IDs (v3+) or ``[id, hashes]`` pairs (v1, v2)."""
    assert isinstance(value, tuple)
    return tuple(_str(v[0]) if isinstance(v, tuple) else _str(v) for v in value)


def _require(
    pdu: Mapping[str, object], key: str, kind: type | tuple[type, ...], what: str
) -> Any:
    if key not in pdu:
        raise InvalidEvent(f"PDU is missing required key '{key}'")
    value = pdu[key]
    if kind is int:
        ok = is_int(value)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise InvalidEvent(f"PDU key '{key}' must be {what}, got {type(value).__name__}")
    return value


def _check_id_size(key: str, value: str) -> None:
    if len(value.encode("utf-8")) > C.MAX_ID_BYTES:
        raise EventTooLarge(f"PDU key '{key}' exceeds {C.MAX_ID_BYTES} bytes")
    if "\x00" in value:  # PostgreSQL cannot store it in a TEXT column
        raise InvalidEvent(f"PDU key '{key}' holds a NUL character")


def _check_edge_id(key: str, item: object) -> str:
    if not isinstance(item, str) or not item.startswith("$"):
        raise InvalidEvent(f"PDU key '{key}' must hold event IDs, got {str(item)[:80]!r}")
    _check_id_size(key, item)
    if not is_valid_event_id(item):
        raise InvalidEvent(f"PDU key '{key}' holds {item[:80]!r}, not a valid event ID")
    return item


def _check_event_id_list(room_version: RoomVersion, pdu: Mapping[str, object], key: str) -> None:
    """Plain event IDs (v3+), or ``[event_id, {"sha256": hash}]`` pairs (v1, v2)."""
    ids = _require(pdu, key, (list, tuple), "an array of event IDs")
    for item in ids:
        if not room_version.event_ids_are_origin_assigned:
            _check_edge_id(key, item)
            continue
        if not isinstance(item, (list, tuple)) or len(item) != 2 or not isinstance(item[1], Mapping):
            raise InvalidEvent(f"PDU key '{key}' must hold [event_id, hashes] pairs, got {str(item)[:80]!r}")
        _check_edge_id(key, item[0])
        if not all(isinstance(h, str) for h in item[1].values()):
            raise InvalidEvent(f"PDU key '{key}': the hashes of {str(item[0])[:80]!r} must be strings")


def validate_pdu(room_version: RoomVersion, pdu: Mapping[str, object], *, canonical: bool = True) -> None:
    """Raise ``InvalidEvent`` unless ``pdu`` has the event format of ``room_version``.
    ``canonical=False``: the caller checked ``check_canonical`` of it already."""
    if canonical:
        check_canonical(pdu, what="PDU")

    event_type = _require(pdu, "type", str, "a string")
    _check_id_size("type", event_type)
    sender = _require(pdu, "sender", str, "a string")
    if not is_valid_user_id(sender):
        raise InvalidEvent(f"PDU sender {sender[:80]!r} is not a valid user ID")
    _require(pdu, "origin_server_ts", int, "an integer")
    content = _require(pdu, "content", Mapping, "an object")
    depth = _require(pdu, "depth", int, "an integer")
    if not 0 <= depth <= C.MAX_DEPTH:
        raise InvalidEvent(f"PDU depth {depth} is outside [0, {C.MAX_DEPTH}]")
    _check_event_id_list(room_version, pdu, "prev_events")
    _check_event_id_list(room_version, pdu, "auth_events")
    if room_version.event_ids_are_origin_assigned:
        event_id = _require(pdu, "event_id", str, "a string")
        _check_edge_id("event_id", event_id)
        if ":" not in event_id:
            raise InvalidEvent(f"PDU event_id {event_id[:80]!r} has no server name (room versions 1 and 2)")

    hashes = _require(pdu, "hashes", Mapping, "an object")
    if not isinstance(hashes.get("sha256"), str):
        raise InvalidEvent("PDU hashes.sha256 must be a string")
    signatures = _require(pdu, "signatures", Mapping, "an object")
    for server, sigs in signatures.items():
        if not isinstance(sigs, Mapping) or not all(isinstance(s, str) for s in sigs.values()):
            raise InvalidEvent(f"PDU signatures.{server[:80]} must map key IDs to strings")
    if "unsigned" in pdu and not isinstance(pdu["unsigned"], Mapping):
        raise InvalidEvent("PDU key 'unsigned' must be an object")

    if "state_key" in pdu:
        state_key = _require(pdu, "state_key", str, "a string")
        _check_id_size("state_key", state_key)

    is_v12_create = room_version.room_id_is_create_event_id and event_type == C.CREATE
    if "room_id" in pdu or not is_v12_create:
        # v12 create events omit room_id; the auth rules reject one that has it.
        room_id = _require(pdu, "room_id", str, "a string")
        if not room_id.startswith("!"):
            raise InvalidEvent(f"PDU room_id {room_id[:80]!r} does not start with '!'")
        _check_id_size("room_id", room_id)
        if not is_valid_room_id(room_id):
            raise InvalidEvent(f"PDU room_id {room_id[:80]!r} is not a valid room ID")

    if "redacts" in pdu and not isinstance(pdu["redacts"], str):
        raise InvalidEvent("PDU key 'redacts' must be a string")
    content_redacts = content.get("redacts") if event_type == C.REDACTION else None
    for redacts in (pdu.get("redacts"), content_redacts):
        if isinstance(redacts, str):
            _check_id_size("redacts", redacts)


def check_edge_caps(pdu: Mapping[str, object]) -> None:
    """Raise ``InvalidEvent`` when a received PDU cites more prev or auth events than any room
    version allows (``MAX_RECEIVED_PREV_EVENTS``, ``MAX_RECEIVED_AUTH_EVENTS``).

    Events we load back from our own database skip this (``trusted_event_id``): they passed it,
    or were made here, when they arrived."""
    for key, cap in (("prev_events", C.MAX_RECEIVED_PREV_EVENTS), ("auth_events", C.MAX_RECEIVED_AUTH_EVENTS)):
        edges = pdu.get(key)
        if isinstance(edges, (list, tuple)) and len(edges) > cap:
            raise InvalidEvent(f"PDU has {len(edges)} {key}; at most {cap} are allowed")


def make_event(
    room_version: RoomVersion,
    pdu: Mapping[str, object],
    *,
    trusted_event_id: str | None = None,
) -> FrozenEvent:
    """Validate ``pdu`` for ``room_version`` and return it as a ``FrozenEvent``.

    Raises ``InvalidEvent`` (``EventTooLarge`` for size limits) for a malformed PDU.
    The event ID is the PDU's own ``event_id`` in room versions 1 and 2, else computed
    from the reference hash, unless ``trusted_event_id`` is given, which is only for
    events re-loaded from our own database.
    """
    if not isinstance(pdu, Mapping):
        raise InvalidEvent(f"a PDU must be a JSON object, got {type(pdu).__name__}")
    validate_pdu(room_version, pdu)
    if trusted_event_id is None:
        check_edge_caps(pdu)
    size = len(encode_canonical(pdu))
    if size > C.MAX_PDU_SIZE:
        raise EventTooLarge(f"event is {size} bytes of canonical JSON; the limit is {C.MAX_PDU_SIZE}")
    event_id = trusted_event_id or compute_event_id(room_version, pdu)
    frozen = freeze(pdu)
    assert isinstance(frozen, Mapping)
    return FrozenEvent(room_version=room_version, event_id=event_id, pdu=frozen)


@attrs.frozen(slots=True)
class ReceivedPdu:
    """A PDU from another server, validated, with the two encodings its checks need, each made
    once: ``signed_bytes``, the canonical JSON of its redacted form without ``signatures`` (what
    the signatures cover, and what the reference hash, hence a v3+ event ID, hashes), and
    ``content_hash``, the SHA-256 of its canonical JSON without ``unsigned``, ``signatures`` and
    ``hashes``. ``signing.verify_received`` checks them."""

    event: FrozenEvent
    signed_bytes: bytes = attrs.field(repr=False)
    content_hash: bytes = attrs.field(repr=False)


_UNHASHED = ("unsigned", "signatures", "hashes")


def hashed_part(pdu: Mapping[str, object]) -> dict[str, object]:
    """The PDU without the keys its content hash leaves out (``unsigned``, ``signatures``, ``hashes``)."""
    return {k: v for k, v in pdu.items() if k not in _UNHASHED}


def canonical_size(hashed: bytes, pdu: Mapping[str, object]) -> int:
    """The length of ``pdu``'s canonical JSON, given ``hashed``, that of its ``hashed_part``. An
    object's canonical JSON is its members' ``"key":value`` joined by commas in braces, whatever
    their order, so the two parts' encodings, each in its braces, make the whole less one byte
    (two braces gone, a comma come): only the small unhashed part is encoded again."""
    rest = {k: pdu[k] for k in _UNHASHED if k in pdu}
    if not rest:
        return len(hashed)
    if len(hashed) == 2:  # "{}": nothing but unhashed keys
        return len(encode_canonical(rest))
    return len(hashed) + len(encode_canonical(rest)) - 1


def check_size(hashed: bytes, pdu: Mapping[str, object]) -> None:
    """Raise ``EventTooLarge`` when ``pdu`` is over ``MAX_PDU_SIZE`` bytes of canonical JSON
    (``canonical_size``)."""
    size = canonical_size(hashed, pdu)
    if size > C.MAX_PDU_SIZE:
        raise EventTooLarge(f"event is {size} bytes of canonical JSON; the limit is {C.MAX_PDU_SIZE}")


def receive_pdu(room_version: RoomVersion, pdu: Mapping[str, object]) -> ReceivedPdu:
    """``make_event`` for a PDU received from another server (same checks, same errors, in the
    same order), encoding it twice rather than four times: the PDU without its unhashed keys
    gives the content hash and, with the sizes of those keys' values, the PDU's size; the
    redacted form gives the event ID and the bytes the signatures cover."""
    if not isinstance(pdu, Mapping):
        raise InvalidEvent(f"a PDU must be a JSON object, got {type(pdu).__name__}")
    validate_pdu(room_version, pdu)
    check_edge_caps(pdu)
    hashed = encode_canonical(hashed_part(pdu))
    check_size(hashed, pdu)
    signed_bytes = redacted_bytes(room_version, pdu)
    if room_version.event_ids_are_origin_assigned:
        event_id = compute_event_id(room_version, pdu)
    else:
        event_id = event_id_from_reference_bytes(room_version, signed_bytes)
    frozen = freeze(pdu)
    assert isinstance(frozen, Mapping)
    event = FrozenEvent(room_version=room_version, event_id=event_id, pdu=frozen)
    return ReceivedPdu(event, signed_bytes, hashlib.sha256(hashed).digest())


def parse_pdu(room_version: RoomVersion, raw: bytes | str) -> FrozenEvent:
    """Parse PDU JSON text from the wire and ``make_event`` it; only ``InvalidEvent`` escapes."""
    return make_event(room_version, parse_json_object(raw, max_bytes=4 * C.MAX_PDU_SIZE, what="PDU"))
