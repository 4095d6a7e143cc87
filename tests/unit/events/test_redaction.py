"""The redaction algorithm per room version: v10 (the v9 rules) against v11/v12."""

from __future__ import annotations

import pytest

from homeserver.events.redaction import prune_event_dict
from homeserver.events.room_versions import V10, V11, V12, RoomVersion

BASE = {
    "event_id": "$e", "type": "m.room.message", "room_id": "!r:x", "sender": "@a:x",
    "content": {"body": "hi"}, "hashes": {"sha256": "h"}, "signatures": {"x": {"ed25519:1": "s"}},
    "depth": 3, "prev_events": ["$p"], "auth_events": ["$a"], "origin_server_ts": 1,
    "origin": "x", "membership": "join", "prev_state": [], "unsigned": {"age": 1}, "extra": 1,
}


def _pruned(version: RoomVersion, **overrides: object) -> dict[str, object]:
    return prune_event_dict(version, {**BASE, **overrides})


def test_v10_keeps_origin_membership_prev_state() -> None:
    pruned = _pruned(V10)
    assert {"origin", "membership", "prev_state"} <= pruned.keys()
    assert "unsigned" not in pruned and "extra" not in pruned
    assert pruned["content"] == {}


@pytest.mark.parametrize("version", [V11, V12])
def test_v11_drops_origin_membership_prev_state(version: RoomVersion) -> None:
    pruned = _pruned(version)
    assert not {"origin", "membership", "prev_state", "unsigned", "extra"} & pruned.keys()
    assert {"event_id", "type", "room_id", "sender", "content", "hashes", "signatures", "depth",
            "prev_events", "auth_events", "origin_server_ts"} == pruned.keys()


CONTENT_CASES = [
    # (type, content, kept in v10, kept in v11+)
    ("m.room.member",
     {"membership": "join", "displayname": "A", "join_authorised_via_users_server": "@b:y"},
     {"membership": "join", "join_authorised_via_users_server": "@b:y"},
     {"membership": "join", "join_authorised_via_users_server": "@b:y"}),
    ("m.room.member",
     {"membership": "invite", "third_party_invite": {"display_name": "d", "signed": {"mxid": "@a:x"}}},
     {"membership": "invite"},
     {"membership": "invite", "third_party_invite": {"signed": {"mxid": "@a:x"}}}),
    ("m.room.member",
     {"membership": "invite", "third_party_invite": {"display_name": "d"}},
     {"membership": "invite"},
     {"membership": "invite", "third_party_invite": {}}),
    ("m.room.create",
     {"creator": "@a:x", "room_version": "10", "m.federate": False},
     {"creator": "@a:x"},
     {"creator": "@a:x", "room_version": "10", "m.federate": False}),
    ("m.room.join_rules",
     {"join_rule": "restricted", "allow": [{"type": "m.room_membership"}], "x": 1},
     {"join_rule": "restricted", "allow": [{"type": "m.room_membership"}]},
     {"join_rule": "restricted", "allow": [{"type": "m.room_membership"}]}),
    ("m.room.power_levels",
     {"ban": 1, "events": {}, "events_default": 2, "invite": 3, "kick": 4, "redact": 5,
      "state_default": 6, "users": {}, "users_default": 7, "notifications": {"room": 8}},
     {"ban": 1, "events": {}, "events_default": 2, "kick": 4, "redact": 5, "state_default": 6,
      "users": {}, "users_default": 7},
     {"ban": 1, "events": {}, "events_default": 2, "invite": 3, "kick": 4, "redact": 5,
      "state_default": 6, "users": {}, "users_default": 7}),
    ("m.room.history_visibility", {"history_visibility": "joined", "x": 1},
     {"history_visibility": "joined"}, {"history_visibility": "joined"}),
    ("m.room.redaction", {"redacts": "$x", "reason": "spam"}, {}, {"redacts": "$x"}),
    ("m.room.name", {"name": "n"}, {}, {}),
]


@pytest.mark.parametrize(("event_type", "content", "v10", "v11"), CONTENT_CASES)
def test_content_kept_per_type_and_version(event_type: str, content: dict[str, object],
                                          v10: dict[str, object], v11: dict[str, object]) -> None:
    assert _pruned(V10, type=event_type, content=content)["content"] == v10
    assert _pruned(V11, type=event_type, content=content)["content"] == v11
    assert _pruned(V12, type=event_type, content=content)["content"] == v11


def test_v10_strips_top_level_redacts() -> None:
    assert "redacts" not in _pruned(V10, type="m.room.redaction", redacts="$x")


def test_pruning_is_idempotent_and_leaves_input_alone() -> None:
    source = {**BASE, "type": "m.room.member", "content": {"membership": "join", "avatar_url": "u"}}
    once = prune_event_dict(V11, source)
    assert prune_event_dict(V11, once) == once
    assert source["content"] == {"membership": "join", "avatar_url": "u"}
