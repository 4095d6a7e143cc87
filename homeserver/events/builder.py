"""Building the events this server creates: prev_events, depth, auth_events, size limit.

The inputs are what storage already knows (forward extremities with their depths,
current state as (type, state_key) -> event ID); the output is a signed ``FrozenEvent``
ready for the auth checks and persistence. Nothing here reads the clock: the caller
passes ``origin_server_ts``.
"""

# tests: tests/unit/events/test_builder.py

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import attrs
from signedjson.types import SigningKey
from unpaddedbase64 import encode_base64

from homeserver.events import constants as C
from homeserver.events.auth import auth_types_for
from homeserver.events.canonical import JsonDict, JsonMapping, check_canonical, encode_canonical, freeze, thaw
from homeserver.events.errors import InvalidEvent
from homeserver.events.event import (
    FrozenEvent,
    StateKey,
    check_edge_caps,
    check_size,
    hashed_part,
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
from homeserver.events.room_versions import RoomVersion


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
    prev_event_ids: list[str],
    auth_event_ids: list[str],
    depth: int,
    origin_server_ts: int,
    edge_hashes: EdgeHashes | None = None,
) -> JsonDict:
    """The unsigned PDU dict (no hashes or signatures yet; in v1/v2 no ``event_id`` yet either:
    ``sign_pdu`` assigns it).

    ``room_id`` is ``None`` only for a v12 create event. ``edge_hashes`` must cover every
    prev and auth event in room versions 1 and 2 (see ``edge_hashes_of``).
    """
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
    return pdu


def sign_pdu(
    room_version: RoomVersion, pdu: Mapping[str, object], server_name: str, signing_key: SigningKey
) -> FrozenEvent:
    """Hash and sign a PDU we built and make it an event: what ``make_event`` of
    ``signing.add_hashes_and_signature`` gives (a test holds them equal), with the event
    encoded twice rather than four times. In room versions 1 and 2 a PDU without an
    ``event_id`` first gets one of ``server_name`` (``assign_event_id``).

    Raises ``InvalidEvent`` for a malformed PDU (a make_join template is another server's);
    ``EventTooLarge`` when the signed event is over 65,536 bytes of canonical JSON
    (or a size-limited key is over 255 bytes): the client API answers ``M_TOO_LARGE``.
    """
    if room_version.event_ids_are_origin_assigned and "event_id" not in pdu:
        pdu = {**pdu, "event_id": assign_event_id(pdu, server_name)}
    # The hashed part gives the content hash and the size; the redacted form is what the
    # signature covers and, in v3+, what the event ID hashes.
    check_canonical(pdu, what="PDU")  # before any of it is encoded
    hashed = encode_canonical(hashed_part(pdu))
    event: JsonDict = {**pdu, "hashes": {"sha256": encode_hash(hashlib.sha256(hashed).digest())}}
    signed_bytes = redacted_bytes(room_version, event)
    signatures = thaw(pdu.get("signatures", {}))  # others' (a template's) kept, as signing JSON does
    if not isinstance(signatures, dict) or not all(isinstance(sigs, dict) for sigs in signatures.values()):
        raise InvalidEvent("PDU signatures must map server names to objects")
    signatures.setdefault(server_name, {})[f"{signing_key.alg}:{signing_key.version}"] = encode_base64(
        signing_key.sign(signed_bytes).signature)
    event["signatures"] = signatures
    validate_pdu(room_version, event, canonical=False)
    check_edge_caps(event)
    check_size(hashed, event)
    event_id = (compute_event_id(room_version, event) if room_version.event_ids_are_origin_assigned
                else event_id_from_reference_bytes(room_version, signed_bytes))
    frozen = freeze(event)
    assert isinstance(frozen, Mapping)
    return FrozenEvent(room_version=room_version, event_id=event_id, pdu=frozen)



def create_local_event(
    room_version: RoomVersion,
    template: EventTemplate,
    *,
    sender: str,
    room_id: str | None,
    current_state: Mapping[StateKey, str],
    forward_extremities: Mapping[str, int],
    origin_server_ts: int,
    server_name: str,
    signing_key: SigningKey,
    edge_hashes: EdgeHashes | None = None,
) -> FrozenEvent:
    """Everything the event builder does, in order: prev_events (≤10) from the forward
    extremities (event ID -> depth), depth, auth_events from the current state, then
    hash, sign and enforce the size limit. The auth rules are the caller's next step.
    ``edge_hashes``: see ``build_pdu`` (needed in room versions 1 and 2 only)."""
    prev_event_ids = select_prev_events(forward_extremities)
    pdu = build_pdu(
        room_version,
        template,
        sender=sender,
        room_id=room_id,
        prev_event_ids=prev_event_ids,
        auth_event_ids=select_auth_event_ids(room_version, template, sender, current_state),
        depth=compute_depth(forward_extremities[e] for e in prev_event_ids),
        origin_server_ts=origin_server_ts,
        edge_hashes=edge_hashes,
    )
    return sign_pdu(room_version, pdu, server_name, signing_key)
