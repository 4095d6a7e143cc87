"""The redaction algorithm of every room version, driven by its ``RedactionRules`` record.

``prune_event_dict`` returns the redacted copy of a PDU: the form that is signed, that the
reference hash covers, and that replaces an event whose content hash does not match.
Which keys survive is data (``room_versions.REDACTION_V1`` ... ``REDACTION_V11``); this
module only applies it.
"""

# tests: tests/unit/events/test_redaction.py

from __future__ import annotations

from collections.abc import Mapping

from homeserver.events import constants as C
from homeserver.events.canonical import JsonDict, thaw
from homeserver.events.room_versions import RoomVersion


def _share(value: object) -> object:
    return value


def prune_event_dict(room_version: RoomVersion, pdu: Mapping[str, object], *, deep_copy: bool = True) -> JsonDict:
    """Return a new dict holding only what the redaction algorithm keeps of ``pdu``.

    The input is not modified and may be frozen; the output is a plain dict, whose values
    are plain copies too unless ``deep_copy`` is false: then they are ``pdu``'s own (possibly
    frozen) values, for a caller that only encodes the result (the reference hash, the
    bytes a signature covers) and may change only its top level.
    """
    rules = room_version.redaction
    copy = thaw if deep_copy else _share
    pruned: JsonDict = {k: copy(v) for k, v in pdu.items() if k in rules.top_level}

    event_type = pdu.get("type")
    content = pdu.get("content")
    if not isinstance(content, Mapping):
        if "content" in pruned:
            pruned["content"] = {}
        return pruned

    new_content: JsonDict
    if event_type == C.CREATE and rules.create_keeps_all_content:
        new_content = thaw(content) if deep_copy else dict(content)
    else:
        kept = rules.content.get(str(event_type), frozenset())
        new_content = {k: copy(v) for k, v in content.items() if k in kept}
        if event_type == C.MEMBER and rules.member_keeps_signed_third_party_invite:
            # Keep only the `signed` key of `third_party_invite` (an empty object when the
            # invite object has no `signed`).
            tpi = content.get("third_party_invite")
            if isinstance(tpi, Mapping):
                new_content["third_party_invite"] = (
                    {"signed": copy(tpi["signed"])} if "signed" in tpi else {}
                )
    pruned["content"] = new_content
    return pruned
