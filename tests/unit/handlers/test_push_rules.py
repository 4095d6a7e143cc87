"""The default push rule set, capabilities and the client well-known document."""

from __future__ import annotations

from pathlib import Path

from homeserver.config import parse_config
from homeserver.events.push_rules import default_push_rules
from homeserver.handlers.server_info import capabilities, client_well_known

USER = "@alice:example.org"


def test_every_kind_is_present_and_rules_are_in_spec_order() -> None:
    rules = default_push_rules(USER)
    assert list(rules) == ["override", "content", "room", "sender", "underride"]
    assert [r["rule_id"] for r in rules["override"]] == [
        ".m.rule.master",
        ".m.rule.suppress_notices",
        ".m.rule.invite_for_me",
        ".m.rule.member_event",
        ".m.rule.is_user_mention",
        ".m.rule.contains_display_name",
        ".m.rule.is_room_mention",
        ".m.rule.roomnotif",
        ".m.rule.tombstone",
        ".m.rule.reaction",
        ".m.rule.room.server_acl",
        ".m.rule.suppress_edits",
    ]
    assert [r["rule_id"] for r in rules["content"]] == [".m.rule.contains_user_name"]
    assert rules["room"] == [] and rules["sender"] == []
    assert [r["rule_id"] for r in rules["underride"]] == [
        ".m.rule.call",
        ".m.rule.encrypted_room_one_to_one",
        ".m.rule.room_one_to_one",
        ".m.rule.message",
        ".m.rule.encrypted",
    ]


def test_rule_shapes() -> None:
    rules = default_push_rules(USER)
    for kind in ("override", "underride"):
        for rule in rules[kind]:
            assert set(rule) == {"rule_id", "default", "enabled", "conditions", "actions"}
            assert rule["default"] is True and rule["rule_id"].startswith(".")
            for condition in rule["conditions"]:
                assert isinstance(condition["kind"], str)
    content_rule = rules["content"][0]
    assert set(content_rule) == {"rule_id", "default", "enabled", "pattern", "actions"}
    enabled = {r["rule_id"]: r["enabled"] for kind in rules.values() for r in kind}
    assert enabled.pop(".m.rule.master") is False
    assert all(enabled.values())


def test_rules_name_the_user() -> None:
    rules = default_push_rules(USER)
    by_id = {r["rule_id"]: r for r in rules["override"]}
    assert {"kind": "event_match", "key": "state_key", "pattern": USER} in by_id[".m.rule.invite_for_me"]["conditions"]
    assert by_id[".m.rule.is_user_mention"]["conditions"] == [
        {"kind": "event_property_contains", "key": "content.m\\.mentions.user_ids", "value": USER}
    ]
    assert by_id[".m.rule.is_user_mention"]["actions"] == [
        "notify",
        {"set_tweak": "sound", "value": "default"},
        {"set_tweak": "highlight"},
    ]
    assert rules["content"][0]["pattern"] == "alice"
    call = rules["underride"][0]
    assert call["actions"] == ["notify", {"set_tweak": "sound", "value": "ring"}]


def test_each_call_returns_a_fresh_structure() -> None:
    first = default_push_rules(USER)
    first["override"][2]["actions"][1]["value"] = "changed"
    first["underride"].clear()
    second = default_push_rules(USER)
    assert second["override"][2]["actions"][1]["value"] == "default"
    assert len(second["underride"]) == 5


def test_capabilities_follow_the_config() -> None:
    config = parse_config({"server_name": "hs", "default_room_version": 11}, config_path=Path("/x/homeserver.yaml"))
    caps = capabilities(config)
    assert caps["m.room_versions"] == {"default": "11", "available": {str(n): "stable" for n in range(1, 13)}}
    assert caps["m.change_password"] == {"enabled": True}
    assert caps["m.set_displayname"] == {"enabled": True}
    assert caps["m.set_avatar_url"] == {"enabled": True}
    assert caps["m.3pid_changes"] == {"enabled": False}


def test_well_known_only_with_public_baseurl() -> None:
    path = Path("/x/homeserver.yaml")
    assert client_well_known(parse_config({"server_name": "hs"}, config_path=path)) is None
    config = parse_config({"server_name": "hs", "public_baseurl": "https://matrix.example.org"}, config_path=path)
    assert client_well_known(config) == {"m.homeserver": {"base_url": "https://matrix.example.org"}}
