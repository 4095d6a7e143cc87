"""The one place that knows the shape of an event this server makes, in every room version.

Building is two pure steps. ``build_pdu`` gives the unsigned PDU dict: type, sender,
content, ``prev_events``/``auth_events`` in the version's format (IDs, or ``[id, hashes]``
pairs in v1/v2), depth, timestamp, state key, ``redacts`` where the version puts it and,
when asked, ``origin``; ``build_template`` first places the event on a room's forward
extremities and current state (``select_prev_events``, ``compute_depth``,
``select_auth_event_ids``). That unsigned PDU is what make_join/make_leave/make_knock
hand out. ``sign_pdu`` is the second step: the v1/v2 event ID, the content hash, our
signature, the format and size checks, a ``FrozenEvent``. An event of ours is
``sign_pdu(build_template(...))``; ``membership_from_template`` is the second step on a
resident server's template; ``add_signature`` cosigns another server's event.

It reads no clock and does no I/O: timestamps, keys, the state and extremities it builds
on and the reference hashes v1/v2 edges cite are arguments, and no input is modified.
Whether the event passes the auth rules is the caller's next question.
"""

# tests: tests/unit/events/test_builder.py

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence

import attrs
from signedjson.types import SigningKey
from unpaddedbase64 import encode_base64

from homeserver.events import constants as C
from homeserver.events.auth import auth_types_for
from homeserver.events.canonical import JsonDict, JsonMapping, check_canonical, encode_canonical, freeze, thaw
from homeserver.events.errors import InvalidEvent, UnsupportedRoomVersion
from homeserver.events.event import (
    FrozenEvent,
    StateKey,
    check_edge_caps,
    check_size,
    hashed_part,
    make_event,
    validate_pdu,
)
from homeserver.events.hashing import (
    assign_event_id,
    compute_event_id,
    edge_hash,
    encode_hash,
    event_id_from_reference_bytes,
    redacted_bytes,
)
from homeserver.events.room_versions import KNOWN_ROOM_VERSIONS, RoomVersion


def _freeze_mapping(value: Mapping[str, object]) -> JsonMapping:
    frozen = freeze(value)
    if not isinstance(frozen, Mapping):
        raise TypeError(f"event content must be a mapping, got {type(value).__name__}")
    return frozen


@attrs.frozen(slots=True)
class EventTemplate:
    """What a client (or room creation) asks for: type, optional state key, content.

    ``redacts`` is only for ``m.room.redaction``; the builder puts it where the room
    version wants it (top level in v10, ``content.redacts`` in v11+).
    """

    type: str
    content: JsonMapping = attrs.field(converter=_freeze_mapping)
    state_key: str | None = None
    redacts: str | None = None
    # The event's ``origin_server_ts`` when not now: an application service's ``ts`` (the time
    # a bridged message was sent on its network).
    origin_server_ts: int | None = None


def _known(room_version: RoomVersion) -> RoomVersion:
    """``room_version`` when it is one of ``KNOWN_ROOM_VERSIONS``, else ``UnsupportedRoomVersion``
    (a record made elsewhere, or not a record at all: the builder knows only the spec's)."""
    identifier = getattr(room_version, "identifier", room_version)
    known = KNOWN_ROOM_VERSIONS.get(identifier) if isinstance(identifier, str) else None
    if known is None or (known is not room_version and known != room_version):
        raise UnsupportedRoomVersion(identifier)
    return known


def select_prev_events(forward_extremities: Mapping[str, int]) -> list[str]:
    """Pick at most 10 forward extremities (event ID -> depth): the deepest, ties by ID.

    Deterministic, so two workers building on the same extremities agree.
    """
    ordered = sorted(forward_extremities.items(), key=lambda item: (-item[1], item[0]))
    return [event_id for event_id, _ in ordered[: C.MAX_PREV_EVENTS]]


def compute_depth(prev_depths: Iterable[int]) -> int:
    """One more than the deepest prev event (1 for the create event), capped at 2**53-1."""
    deepest = max(prev_depths, default=0)
    return min(deepest + 1, C.MAX_DEPTH)


def select_auth_event_ids(
    room_version: RoomVersion,
    template: EventTemplate,
    sender: str,
    current_state: Mapping[StateKey, str],
) -> list[str]:
    """The auth_events of a new event: the current state events the selection algorithm names."""
    keys = auth_types_for(room_version, template.type, template.state_key, sender, template.content)
    return [current_state[k] for k in keys if k in current_state]


EdgeHashes = Mapping[str, Mapping[str, str]]
"""Event ID -> its ``{"sha256": reference hash}``: what v1/v2 events cite beside each ID."""


def edge_hashes_of(room_version: RoomVersion, events: Iterable[FrozenEvent]) -> dict[str, dict[str, str]]:
    """``EdgeHashes`` for ``events`` (empty unless the version's edges carry hashes)."""
    if not room_version.event_ids_are_origin_assigned:
        return {}
    return {e.event_id: edge_hash(room_version, e.pdu) for e in events}


def format_edges(room_version: RoomVersion, event_ids: Iterable[str], hashes: EdgeHashes) -> list[object]:
    """``prev_events``/``auth_events`` in the version's format: IDs (v3+) or ``[id, hashes]`` (v1, v2).

    Raises ``ValueError`` when a v1/v2 edge's hash is not in ``hashes`` (a caller bug:
    it must load the events it cites).
    """
    if not room_version.event_ids_are_origin_assigned:
        return list(event_ids)
    edges: list[object] = []
    for event_id in event_ids:
        if event_id not in hashes:
            raise ValueError(f"no reference hash given for {event_id}, which a v1/v2 event must cite with one")
        edges.append([event_id, dict(hashes[event_id])])
    return edges


def build_pdu(
    room_version: RoomVersion,
    template: EventTemplate,
    *,
    sender: str,
    room_id: str | None,
    prev_event_ids: Sequence[str],
    auth_event_ids: Sequence[str],
    depth: int,
    origin_server_ts: int,
    edge_hashes: EdgeHashes | None = None,
    origin: str | None = None,
) -> JsonDict:
    """The unsigned PDU dict (no hashes or signatures yet; in v1/v2 no ``event_id`` yet either:
    ``sign_pdu`` assigns it). A new dict: nothing in it is shared with the arguments.

    ``room_id`` is ``None`` only for a v12 create event. ``edge_hashes`` must cover every
    prev and auth event in room versions 1 and 2 (see ``edge_hashes_of``). ``origin``: the
    top-level ``origin`` key, which only the templates of make_join and the like carry
    (the spec's redaction drops it from v11). ``UnsupportedRoomVersion`` for a version
    not in ``KNOWN_ROOM_VERSIONS``.
    """
    room_version = _known(room_version)
    hashes = edge_hashes or {}
    pdu: JsonDict = {
        "type": template.type,
        "sender": sender,
        "content": thaw(template.content),
        "prev_events": format_edges(room_version, prev_event_ids, hashes),
        "auth_events": format_edges(room_version, auth_event_ids, hashes),
        "depth": depth,
        "origin_server_ts": origin_server_ts,
    }
    if room_id is not None:
        pdu["room_id"] = room_id
    if template.state_key is not None:
        pdu["state_key"] = template.state_key
    if template.redacts is not None:
        if room_version.redacts_in_content:
            pdu["content"]["redacts"] = template.redacts
        else:
            pdu["redacts"] = template.redacts
    if origin is not None:
        pdu["origin"] = origin
    return pdu


def build_template(
    room_version: RoomVersion,
    template: EventTemplate,
    *,
    sender: str,
    room_id: str | None,
    current_state: Mapping[StateKey, str],
    forward_extremities: Mapping[str, int],
    origin_server_ts: int,
    edge_hashes: EdgeHashes | None = None,
    origin: str | None = None,
) -> JsonDict:
    """``build_pdu`` on a room: prev_events (≤10) from the forward extremities (event ID ->
    depth), depth one more than theirs, auth_events from the current state ((type, state_key)
    -> event ID). Unsigned and unhashed: what make_join/make_leave/make_knock answer with,
    and what ``sign_pdu`` makes an event. ``edge_hashes`` (v1/v2 only) must cover the
    extremities and state events it may cite."""
    prev_event_ids = select_prev_events(forward_extremities)
    return build_pdu(
        room_version,
        template,
        sender=sender,
        room_id=room_id,
        prev_event_ids=prev_event_ids,
        auth_event_ids=select_auth_event_ids(room_version, template, sender, current_state),
        depth=compute_depth(forward_extremities[e] for e in prev_event_ids),
        origin_server_ts=origin_server_ts,
        edge_hashes=edge_hashes,
        origin=origin,
    )


def template_as_event(room_version: RoomVersion, pdu: Mapping[str, object], *, joining_server: str) -> FrozenEvent:
    """An unsigned template (``build_template``'s) as an event, only so the auth rules can run
    on it before it is handed out: empty hashes and signatures and, in v1/v2, an event ID of
    ``joining_server``'s (which assigns its own). Never to be sent or stored."""
    room_version = _known(room_version)
    placeholder: JsonDict = {"hashes": {"sha256": ""}, "signatures": {}}
    if room_version.event_ids_are_origin_assigned:
        placeholder["event_id"] = assign_event_id(pdu, joining_server)
    return make_event(room_version, {**pdu, **placeholder})


def _with_signature(
    pdu: Mapping[str, object], signed_bytes: bytes, server_name: str, signing_key: SigningKey
) -> JsonDict:
    """``pdu``'s signatures (a copy) with ``server_name``'s over ``signed_bytes`` (its
    ``redacted_bytes``) added; the others' kept, as signing JSON does."""
    signatures = thaw(pdu.get("signatures", {}))
    if not isinstance(signatures, dict) or not all(isinstance(sigs, dict) for sigs in signatures.values()):
        raise InvalidEvent("PDU signatures must map server names to objects")
    signatures.setdefault(server_name, {})[f"{signing_key.alg}:{signing_key.version}"] = encode_base64(
        signing_key.sign(signed_bytes).signature)
    return signatures


def add_signature(
    room_version: RoomVersion, pdu: Mapping[str, object], server_name: str, signing_key: SigningKey
) -> JsonDict:
    """A copy of another server's ``pdu`` with ``server_name``'s signature added beside the
    others' (cosigning a join, leave, knock or invite): hashes, event ID and the rest unchanged.

    Checks nothing of the event's format, so an untrusted body may be signed before it is
    parsed (``InvalidEvent`` for malformed ``signatures``, ``TypeError``/``ValueError`` for what
    is not JSON)."""
    room_version = _known(room_version)
    signatures = _with_signature(pdu, redacted_bytes(room_version, pdu), server_name, signing_key)
    signed: JsonDict = thaw(pdu)
    signed["signatures"] = signatures
    return signed


def _hash_and_sign(
    room_version: RoomVersion, pdu: Mapping[str, object], server_name: str, signing_key: SigningKey
) -> tuple[JsonDict, bytes, bytes]:
    """``pdu`` with its content hash and our signature, the canonical JSON of its hashed part
    and of its redacted form: each encoding made once."""
    check_canonical(pdu, what="PDU")  # before any of it is encoded
    hashed = encode_canonical(hashed_part(pdu))
    event: JsonDict = {**pdu, "hashes": {"sha256": encode_hash(hashlib.sha256(hashed).digest())}}
    signed_bytes = redacted_bytes(room_version, event)
    event["signatures"] = _with_signature(pdu, signed_bytes, server_name, signing_key)
    return event, hashed, signed_bytes


def add_hashes_and_signature(
    room_version: RoomVersion,
    pdu: Mapping[str, object],
    server_name: str,
    signing_key: SigningKey,
) -> JsonDict:
    """A copy of ``pdu`` with ``hashes.sha256`` set and ``server_name``'s signature added (others'
    kept: they cover the same redacted form only if the content hash did not change): what
    ``sign_pdu`` does, without its format and size checks or the v1/v2 event ID. For the
    spec's signing vectors, and tests that need a PDU ``make_event`` would refuse."""
    event, _, _ = _hash_and_sign(_known(room_version), pdu, server_name, signing_key)
    signed: JsonDict = thaw(event)
    return signed


def sign_pdu(
    room_version: RoomVersion, pdu: Mapping[str, object], server_name: str, signing_key: SigningKey
) -> FrozenEvent:
    """Hash and sign a PDU we built and make it an event: what ``make_event`` of
    ``add_hashes_and_signature`` gives (a test holds them equal), with the event encoded
    twice rather than four times. In room versions 1 and 2 a PDU without an ``event_id``
    first gets one of ``server_name`` (``assign_event_id``).

    Raises ``InvalidEvent`` for a malformed PDU (a make_join template is another server's);
    ``EventTooLarge`` when the signed event is over 65,536 bytes of canonical JSON
    (or a size-limited key is over 255 bytes): the client API answers ``M_TOO_LARGE``.
    """
    room_version = _known(room_version)
    if room_version.event_ids_are_origin_assigned and "event_id" not in pdu:
        pdu = {**pdu, "event_id": assign_event_id(pdu, server_name)}
    # The hashed part gives the content hash and the size; the redacted form is what the
    # signature covers and, in v3+, what the event ID hashes.
    event, hashed, signed_bytes = _hash_and_sign(room_version, pdu, server_name, signing_key)
    validate_pdu(room_version, event, canonical=False)
    check_edge_caps(event)
    check_size(hashed, event)
    event_id = (compute_event_id(room_version, event) if room_version.event_ids_are_origin_assigned
                else event_id_from_reference_bytes(room_version, signed_bytes))
    frozen = freeze(event)
    assert isinstance(frozen, Mapping)
    return FrozenEvent(room_version=room_version, event_id=event_id, pdu=frozen)


_TEMPLATE_ONLY = frozenset({"hashes", "signatures", "event_id"})
"""What a resident's template may carry that the joining server makes its own (v1/v2: the event ID)."""


def membership_from_template(
    room_version: RoomVersion,
    made: Mapping[str, object],
    *,
    user_id: str,
    room_id: str,
    membership: str,
    content: Mapping[str, object],
    origin_server_ts: int,
    server_name: str,
    signing_key: SigningKey,
) -> FrozenEvent:
    """Our join, knock or leave from a resident server's make_join/make_knock/make_leave
    template ``made`` (not modified): its room, edges, depth and ``origin`` kept; ``content``
    ours, with ``membership`` set (a restricted join, v8+, also keeps the resident's
    ``join_authorised_via_users_server``: the auth rules need it); our ``origin_server_ts``;
    its hashes, signatures and event ID dropped; then ``sign_pdu``.

    Raises ``InvalidEvent`` when ``made`` is not an ``m.room.member`` event of ``user_id``
    about itself in ``room_id``, or is malformed.
    """
    room_version = _known(room_version)
    found = (made.get("type"), made.get("state_key"), made.get("sender"), made.get("room_id"))
    if found != (C.MEMBER, user_id, user_id, room_id):
        raise InvalidEvent(f"the {membership} template is not an {C.MEMBER} of {user_id} about itself in "
                           f"{room_id} (type, state_key, sender, room_id: {str(found)[:300]})")
    new_content: JsonDict = {**{k: v for k, v in content.items() if k != "membership"}, "membership": membership}
    made_content = made.get("content")
    if membership == C.JOIN and room_version.restricted_join_rule and isinstance(made_content, Mapping):
        authoriser = made_content.get(C.AUTHORISING_USER)
        if isinstance(authoriser, str):
            new_content[C.AUTHORISING_USER] = authoriser
    pdu: JsonDict = {k: v for k, v in made.items() if k not in _TEMPLATE_ONLY}
    pdu["content"] = new_content
    pdu["origin_server_ts"] = origin_server_ts
    return sign_pdu(room_version, pdu, server_name, signing_key)
