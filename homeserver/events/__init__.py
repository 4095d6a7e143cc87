"""Matrix events, rooms and state: the pure core (no I/O, no clock, no database).

Room versions 1-12, canonical JSON, content/reference hashes and IDs, redaction,
signing and verification, the authorization rules, state resolution v1 / v2 / v2.1, the
event builder, ``/createRoom`` templates and history visibility. Persistence lives in
``storage/``; this package is what it and the HTTP handlers call. See docs/events.md.
"""

# tests: tests/unit/events/, tests/property/test_events_roundtrip.py

from homeserver.events.auth import (
    CREATOR_POWER_LEVEL,
    StateMap,
    auth_state_from_auth_events,
    auth_types_for,
    auth_types_for_event,
    can_apply_redaction,
    check_auth_events_list,
    check_auth_rules,
    get_named_level,
    get_send_level,
    get_user_power_level,
    room_creators,
)
from homeserver.events.builder import (
    EventTemplate,
    add_hashes_and_signature,
    add_signature,
    build_pdu,
    build_template,
    EdgeHashes,
    compute_depth,
    edge_hashes_of,
    membership_from_template,
    select_auth_event_ids,
    select_prev_events,
    sign_pdu,
    template_as_event,
)
from homeserver.events.canonical import JsonDict, JsonMapping, JsonValue, encode_canonical
from homeserver.events.errors import (
    AuthError,
    EventsError,
    EventTooLarge,
    InvalidCreateRoomRequest,
    InvalidEvent,
    MissingEventsError,
    SignatureError,
    UnsupportedRoomVersion,
)
from homeserver.events.event import FrozenEvent, ReceivedPdu, StateKey, make_event, parse_pdu, receive_pdu
from homeserver.events.hashing import (
    compute_content_hash,
    assign_event_id,
    compute_event_id,
    compute_reference_hash,
    create_event_id_from_room_id,
    room_id_from_create_event_id,
)
from homeserver.events.redaction import prune_event_dict
from homeserver.events.room_creation import (
    CreateRoomRequest,
    initial_room_events,
    parse_create_room_request,
)
from homeserver.events.room_versions import (
    ALL_ROOM_VERSIONS,
    DEFAULT_ROOM_VERSION,
    KNOWN_ROOM_VERSIONS,
    RoomVersion,
    get_room_version,
)
from homeserver.events.signing import (
    KeyRing,
    ServerKey,
    check_content_hash,
    redact_event,
    required_signers,
    verify_event,
    verify_event_signatures,
    verify_received,
)
from homeserver.events.state_res import auth_chain, resolve_state
from homeserver.events.visibility import can_see_event

__all__ = [
    "ALL_ROOM_VERSIONS",
    "CREATOR_POWER_LEVEL",
    "DEFAULT_ROOM_VERSION",
    "KNOWN_ROOM_VERSIONS",
    "AuthError",
    "ReceivedPdu",
    "CreateRoomRequest",
    "EdgeHashes",
    "EventTemplate",
    "EventTooLarge",
    "EventsError",
    "FrozenEvent",
    "InvalidCreateRoomRequest",
    "InvalidEvent",
    "JsonDict",
    "JsonMapping",
    "JsonValue",
    "KeyRing",
    "MissingEventsError",
    "RoomVersion",
    "ServerKey",
    "SignatureError",
    "StateKey",
    "StateMap",
    "UnsupportedRoomVersion",
    "add_hashes_and_signature",
    "add_signature",
    "assign_event_id",
    "auth_chain",
    "auth_state_from_auth_events",
    "auth_types_for",
    "auth_types_for_event",
    "build_pdu",
    "build_template",
    "can_apply_redaction",
    "can_see_event",
    "check_auth_events_list",
    "check_auth_rules",
    "check_content_hash",
    "compute_content_hash",
    "compute_depth",
    "compute_event_id",
    "compute_reference_hash",
    "create_event_id_from_room_id",
    "edge_hashes_of",
    "encode_canonical",
    "get_named_level",
    "get_room_version",
    "get_send_level",
    "get_user_power_level",
    "initial_room_events",
    "make_event",
    "membership_from_template",
    "receive_pdu",
    "parse_create_room_request",
    "parse_pdu",
    "prune_event_dict",
    "redact_event",
    "required_signers",
    "resolve_state",
    "room_creators",
    "room_id_from_create_event_id",
    "select_auth_event_ids",
    "select_prev_events",
    "sign_pdu",
    "template_as_event",
    "verify_event",
    "verify_received",
    "verify_event_signatures",
]
