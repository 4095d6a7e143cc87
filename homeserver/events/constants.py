"""Names the spec gives to event types, memberships, join rules and history visibilities.

Plain string constants (the wire values), so that they compare equal to what arrives
over federation without conversion.
"""

# tests: tests/unit/events/test_auth.py

from __future__ import annotations

from typing import Final

# Canonical JSON's integer range lives with the strict decoder in the kernel.
from storage.kernel.json_input import CANONICAL_INT_MAX as CANONICAL_INT_MAX
from storage.kernel.json_input import CANONICAL_INT_MIN as CANONICAL_INT_MIN

# Event types that the authorization rules and room creation care about.
CREATE: Final = "m.room.create"
MEMBER: Final = "m.room.member"
POWER_LEVELS: Final = "m.room.power_levels"
JOIN_RULES: Final = "m.room.join_rules"
THIRD_PARTY_INVITE: Final = "m.room.third_party_invite"
HISTORY_VISIBILITY: Final = "m.room.history_visibility"
GUEST_ACCESS: Final = "m.room.guest_access"
REDACTION: Final = "m.room.redaction"
NAME: Final = "m.room.name"
TOPIC: Final = "m.room.topic"
CANONICAL_ALIAS: Final = "m.room.canonical_alias"
TOMBSTONE: Final = "m.room.tombstone"
SERVER_ACL: Final = "m.room.server_acl"

# Memberships.
JOIN: Final = "join"
INVITE: Final = "invite"
LEAVE: Final = "leave"
BAN: Final = "ban"
KNOCK: Final = "knock"

# Join rules.
PUBLIC: Final = "public"
JR_INVITE: Final = "invite"
JR_KNOCK: Final = "knock"
RESTRICTED: Final = "restricted"
KNOCK_RESTRICTED: Final = "knock_restricted"
PRIVATE: Final = "private"

# History visibility values.
WORLD_READABLE: Final = "world_readable"
SHARED: Final = "shared"
INVITED: Final = "invited"
JOINED: Final = "joined"

# Content keys with protocol meaning.
AUTHORISING_USER: Final = "join_authorised_via_users_server"
ADDITIONAL_CREATORS: Final = "additional_creators"

# Limits from the spec (client-server "Size limits", PDU depth, canonical JSON).
MAX_PDU_SIZE: Final = 65536
MAX_ID_BYTES: Final = 255
MAX_DEPTH: Final = 2**53 - 1
MAX_PREV_EVENTS: Final = 10
# Caps on a received PDU's edges, the same for every room version we know. The spec's PDU
# format sets no number; these are Synapse's (event_auth's "too many prev_events/auth_events").
MAX_RECEIVED_PREV_EVENTS: Final = 20
MAX_RECEIVED_AUTH_EVENTS: Final = 10
