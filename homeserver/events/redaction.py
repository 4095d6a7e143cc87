"""The redaction algorithm of room versions 10 (the v9 rules) and 11/12 (the MSC2176 rules).

``prune_event_dict`` returns the redacted copy of a PDU: the form that is signed, that the
reference hash covers, and that replaces an event whose content hash does not match.
It also answers whether a received redaction should be applied ("Handling redactions").
"""

# tests: tests/unit/events/test_redaction.py

from __future__ import annotations

from collections.abc import Mapping

from homeserver.events import constants as C
from homeserver.events.canonical import JsonDict, thaw
from homeserver.events.room_versions import RoomVersion

_KEPT_TOP_LEVEL_V10 = frozenset(
    {
        "event_id", "type", "room_id", "sender", "state_key", "content", "hashes",
        "signatures", "depth", "prev_events", "prev_state", "auth_events", "origin",
        "origin_server_ts", "membership",
    }
)
# v11 drops origin, membership and prev_state from the protected keys.
_KEPT_TOP_LEVEL_V11 = _KEPT_TOP_LEVEL_V10 - {"origin", "membership", "prev_state"}

_KEPT_CONTENT_V10: Mapping[str, frozenset[str]] = {
    C.MEMBER: frozenset({"membership", C.AUTHORISING_USER}),
    C.CREATE: frozenset({"creator"}),
    C.JOIN_RULES: frozenset({"join_rule", "allow"}),
    C.POWER_LEVELS: frozenset(
        {"ban", "events", "events_default", "kick", "redact", "state_default", "users",
         "users_default"}
    ),
    C.HISTORY_VISIBILITY: frozenset({"history_visibility"}),
}
_KEPT_CONTENT_V11: Mapping[str, frozenset[str]] = {
    **_KEPT_CONTENT_V10,
    C.POWER_LEVELS: _KEPT_CONTENT_V10[C.POWER_LEVELS] | {"invite"},
    C.REDACTION: frozenset({"redacts"}),
}


def prune_event_dict(room_version: RoomVersion, pdu: Mapping[str, object]) -> JsonDict:
    """Return a new dict holding only what the redaction algorithm keeps of ``pdu``.

    The input is not modified and may be frozen; the output is a plain dict.
    """
    v11 = room_version.updated_redaction_rules
    kept_top = _KEPT_TOP_LEVEL_V11 if v11 else _KEPT_TOP_LEVEL_V10
    pruned: JsonDict = {k: thaw(v) for k, v in pdu.items() if k in kept_top}

    event_type = pdu.get("type")
    content = pdu.get("content")
    if not isinstance(content, Mapping):
        if "content" in pruned:
            pruned["content"] = {}
        return pruned

    new_content: JsonDict
    if event_type == C.CREATE and v11:
        # v11+: the create event keeps its whole content.
        new_content = thaw(content)
    else:
        kept = (_KEPT_CONTENT_V11 if v11 else _KEPT_CONTENT_V10).get(str(event_type), frozenset())
        new_content = {k: thaw(v) for k, v in content.items() if k in kept}
        if event_type == C.MEMBER and v11:
            # v11+: keep only the `signed` key of `third_party_invite` (an empty object
            # when the invite object has no `signed`).
            tpi = content.get("third_party_invite")
            if isinstance(tpi, Mapping):
                new_content["third_party_invite"] = (
                    {"signed": thaw(tpi["signed"])} if "signed" in tpi else {}
                )
    pruned["content"] = new_content
    return pruned
