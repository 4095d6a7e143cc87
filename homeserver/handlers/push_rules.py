"""The spec's server-default push rules, built for one user.

Pure data: ``default_push_rules(user_id)`` returns the ``global`` ruleset that
``GET /pushrules/`` serves, with the predefined override, content and underride
rules in the spec's order (Client-Server API, "Predefined Rules"). /sync's
unread counts evaluate them (``push_evaluator``); storing a user's own rules
comes later.
"""

# tests: tests/unit/handlers/test_push_rules.py

from __future__ import annotations

from typing import Any

JsonDict = dict[str, Any]

_SOUND_DEFAULT: JsonDict = {"set_tweak": "sound", "value": "default"}
_HIGHLIGHT: JsonDict = {"set_tweak": "highlight"}


def _match(key: str, pattern: str) -> JsonDict:
    return {"kind": "event_match", "key": key, "pattern": pattern}


def _rule(rule_id: str, conditions: list[JsonDict], actions: list[Any], *, enabled: bool = True) -> JsonDict:
    return {"rule_id": rule_id, "default": True, "enabled": enabled, "conditions": conditions, "actions": actions}


def _override_rules(user_id: str) -> list[JsonDict]:
    return [
        _rule(".m.rule.master", [], [], enabled=False),
        _rule(".m.rule.suppress_notices", [_match("content.msgtype", "m.notice")], []),
        _rule(
            ".m.rule.invite_for_me",
            [_match("type", "m.room.member"), _match("content.membership", "invite"), _match("state_key", user_id)],
            ["notify", dict(_SOUND_DEFAULT)],
        ),
        _rule(".m.rule.member_event", [_match("type", "m.room.member")], []),
        _rule(
            ".m.rule.is_user_mention",
            [{"kind": "event_property_contains", "key": "content.m\\.mentions.user_ids", "value": user_id}],
            ["notify", dict(_SOUND_DEFAULT), dict(_HIGHLIGHT)],
        ),
        _rule(
            ".m.rule.contains_display_name",
            [{"kind": "contains_display_name"}],
            ["notify", dict(_SOUND_DEFAULT), dict(_HIGHLIGHT)],
        ),
        _rule(
            ".m.rule.is_room_mention",
            [
                {"kind": "event_property_is", "key": "content.m\\.mentions.room", "value": True},
                {"kind": "sender_notification_permission", "key": "room"},
            ],
            ["notify", dict(_HIGHLIGHT)],
        ),
        _rule(
            ".m.rule.roomnotif",
            [_match("content.body", "@room"), {"kind": "sender_notification_permission", "key": "room"}],
            ["notify", dict(_HIGHLIGHT)],
        ),
        _rule(
            ".m.rule.tombstone",
            [_match("type", "m.room.tombstone"), _match("state_key", "")],
            ["notify", dict(_HIGHLIGHT)],
        ),
        _rule(".m.rule.reaction", [_match("type", "m.reaction")], []),
        _rule(".m.rule.room.server_acl", [_match("type", "m.room.server_acl"), _match("state_key", "")], []),
        _rule(
            ".m.rule.suppress_edits",
            [{"kind": "event_property_is", "key": "content.m\\.relates_to.rel_type", "value": "m.replace"}],
            [],
        ),
    ]


def _content_rules(user_id: str) -> list[JsonDict]:
    localpart = user_id[1:].partition(":")[0]
    return [
        {
            "rule_id": ".m.rule.contains_user_name",
            "default": True,
            "enabled": True,
            "pattern": localpart,
            "actions": ["notify", dict(_SOUND_DEFAULT), dict(_HIGHLIGHT)],
        }
    ]


def _underride_rules() -> list[JsonDict]:
    return [
        _rule(".m.rule.call", [_match("type", "m.call.invite")], ["notify", {"set_tweak": "sound", "value": "ring"}]),
        _rule(
            ".m.rule.encrypted_room_one_to_one",
            [{"kind": "room_member_count", "is": "2"}, _match("type", "m.room.encrypted")],
            ["notify", dict(_SOUND_DEFAULT)],
        ),
        _rule(
            ".m.rule.room_one_to_one",
            [{"kind": "room_member_count", "is": "2"}, _match("type", "m.room.message")],
            ["notify", dict(_SOUND_DEFAULT)],
        ),
        _rule(".m.rule.message", [_match("type", "m.room.message")], ["notify"]),
        _rule(".m.rule.encrypted", [_match("type", "m.room.encrypted")], ["notify"]),
    ]


def default_push_rules(user_id: str) -> JsonDict:
    """The ``global`` ruleset of a user who has changed nothing: a fresh structure on every call."""
    return {
        "override": _override_rules(user_id),
        "content": _content_rules(user_id),
        "room": [],
        "sender": [],
        "underride": _underride_rules(),
    }
