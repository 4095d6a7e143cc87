"""The spec's server-default push rules, built for one user.

Pure data: ``default_push_rules(user_id)`` returns the ``global`` ruleset that
``GET /pushrules/`` serves, with the predefined override, content and underride
rules in the spec's order (Client-Server API, "Predefined Rules"). /sync's
unread counts evaluate them (``push_evaluator``); storing a user's own rules
comes later.
"""

# tests: tests/unit/handlers/test_push_rules.py

from __future__ import annotations

import re
from collections.abc import Mapping

import attrs
from typing import Any, Final

from homeserver.events.validation import check_text, dump_json_object
from storage.kernel.errors import MatrixError, bad_json, invalid_param, missing_param, not_found

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


# --- a user's rules: the stored ``m.push_rules`` account data merged with the defaults ------------

KINDS: Final = ("override", "content", "room", "sender", "underride")
# Bounds on what one user may store, so a ruleset stays cheap to evaluate for every event.
MAX_USER_RULES: Final = 500
MAX_CONDITIONS: Final = 20
MAX_ACTIONS: Final = 20
MAX_RULE_ID_LENGTH: Final = 255
MAX_PATTERN_LENGTH: Final = 1000
_SIMPLE_ACTIONS: Final = frozenset({"notify", "dont_notify", "coalesce"})
_MEMBER_COUNT_RE: Final = re.compile(r"(==|<=|>=|<|>)?[0-9]{1,9}")
_ATTRIBUTES: Final = ("enabled", "actions")
# Server-default override rules placed before the user's own (the rest come after them).
_PREPENDED_OVERRIDES: Final = frozenset({".m.rule.master"})


def is_server_default(rule_id: str) -> bool:
    return rule_id.startswith(".")


def effective_rules(stored: Any, user_id: str) -> JsonDict:
    """The user's ``global`` ruleset: the current server-default rules (with the ``enabled``
    and ``actions`` the user set on them) and the user's own rules from ``stored`` (the
    ``m.push_rules`` account data content, or None), in evaluation order: ``.m.rule.master``,
    then the user's rules of a kind before the server-default ones of that kind. Defaults
    come from the code, so a new spec version's rules reach users who changed something."""
    defaults = default_push_rules(user_id)
    saved = stored.get("global") if isinstance(stored, Mapping) else None
    saved = saved if isinstance(saved, Mapping) else {}
    result: JsonDict = {}
    for kind in KINDS:
        rules = saved.get(kind)
        rules = [r for r in rules if isinstance(r, Mapping)] if isinstance(rules, list) else []
        by_id = {r.get("rule_id"): r for r in rules}
        own = [dict(r, default=False) for r in rules
               if isinstance(r.get("rule_id"), str) and not is_server_default(r["rule_id"])]
        merged_defaults = []
        for rule in defaults[kind]:
            changed = by_id.get(rule["rule_id"])
            if changed is not None:
                if isinstance(changed.get("enabled"), bool):
                    rule["enabled"] = changed["enabled"]
                if isinstance(changed.get("actions"), list):
                    rule["actions"] = changed["actions"]
            merged_defaults.append(rule)
        first = [r for r in merged_defaults if r["rule_id"] in _PREPENDED_OVERRIDES]
        rest = [r for r in merged_defaults if r["rule_id"] not in _PREPENDED_OVERRIDES]
        result[kind] = first + own + rest
    return result


def find_rule(ruleset: Mapping[str, Any], kind: str, rule_id: str) -> JsonDict:
    """The rule, or 404 ``M_NOT_FOUND``."""
    check_kind(kind)
    for rule in ruleset[kind]:
        if rule["rule_id"] == rule_id:
            return dict(rule)
    raise not_found(f"No push rule {kind}/{rule_id}")


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise invalid_param(f"push rule kind must be one of {', '.join(KINDS)}, got {kind[:50]!r}")


def check_actions(actions: Any) -> list[Any]:
    """The rule's actions, or 400: a list of ``notify``/``dont_notify``/``coalesce`` and
    ``{"set_tweak": name, "value"?: ...}`` objects."""
    if not isinstance(actions, list):
        raise bad_json("'actions' must be a list")
    if len(actions) > MAX_ACTIONS:
        raise invalid_param(f"at most {MAX_ACTIONS} actions, got {len(actions)}")
    for action in actions:
        if isinstance(action, str):
            if action not in _SIMPLE_ACTIONS:
                raise invalid_param(f"unknown push rule action {action[:50]!r}")
        elif isinstance(action, dict):
            tweak = action.get("set_tweak")
            if not isinstance(tweak, str) or not tweak or len(tweak) > 100:
                raise invalid_param("a tweak action needs a 'set_tweak' string")
            if set(action) - {"set_tweak", "value"}:
                raise invalid_param(f"a tweak action has only 'set_tweak' and 'value', got {sorted(action)[:5]}")
            if tweak == "highlight" and "value" in action and not isinstance(action["value"], bool):
                raise invalid_param("the highlight tweak's value must be a boolean")
        else:
            raise invalid_param("each action must be a string or a set_tweak object")
    return list(actions)


def _check_condition(condition: Any) -> JsonDict:
    if not isinstance(condition, dict):
        raise invalid_param("each condition must be an object")
    kind = condition.get("kind")
    if not isinstance(kind, str) or not kind:
        raise invalid_param("each condition needs a 'kind' string")

    def string(name: str) -> None:
        value = condition.get(name)
        if not isinstance(value, str):
            raise invalid_param(f"a {kind} condition needs a '{name}' string")
        check_text(value, f"{kind}.{name}", max_length=MAX_PATTERN_LENGTH)

    if kind == "event_match":
        string("key")
        string("pattern")
    elif kind in ("event_property_is", "event_property_contains"):
        string("key")
        value = condition.get("value", _ABSENT)
        if value is _ABSENT or not (value is None or isinstance(value, (str, bool, int))) or isinstance(value, float):
            raise invalid_param(f"a {kind} condition's 'value' must be a string, integer, boolean or null")
    elif kind == "room_member_count":
        count = condition.get("is")
        if not isinstance(count, str) or _MEMBER_COUNT_RE.fullmatch(count) is None:
            raise invalid_param("a room_member_count condition's 'is' must look like '2', '>=10' or '<3'")
    elif kind == "sender_notification_permission":
        string("key")
    # contains_display_name has no fields; unknown kinds are kept (and never match, as the spec says).
    return dict(condition)


_ABSENT: Final = object()


def check_new_rule(kind: str, rule_id: str, body: Any) -> JsonDict:
    """A user-defined rule from ``PUT /pushrules/global/{kind}/{ruleId}``'s body, or 400."""
    check_kind(kind)
    check_text(rule_id, "ruleId", max_length=MAX_RULE_ID_LENGTH, allow_empty=False)
    if is_server_default(rule_id):
        raise invalid_param("a rule ID starting with '.' is reserved for server-default rules")
    if "/" in rule_id or "\\" in rule_id:
        raise invalid_param("a rule ID may not contain '/' or '\\'")
    if not isinstance(body, dict):
        raise bad_json("the rule must be a JSON object")
    rule: JsonDict = {"rule_id": rule_id, "default": False, "enabled": True,
                      "actions": check_actions(body.get("actions"))}
    if kind == "content":
        pattern = body.get("pattern")
        if not isinstance(pattern, str) or not pattern:
            raise missing_param("a content rule needs a 'pattern' string")
        rule["pattern"] = check_text(pattern, "pattern", max_length=MAX_PATTERN_LENGTH)
    elif kind in ("override", "underride"):
        conditions = body.get("conditions")
        if conditions is None:
            raise missing_param(f"an {kind} rule needs 'conditions' (a list, possibly empty)")
        if not isinstance(conditions, list) or len(conditions) > MAX_CONDITIONS:
            raise invalid_param(f"'conditions' must be a list of at most {MAX_CONDITIONS} conditions")
        rule["conditions"] = [_check_condition(c) for c in conditions]
    dump_json_object(rule)  # storable text throughout, bounded size
    return rule


def add_rule(ruleset: Mapping[str, Any], kind: str, rule: JsonDict, *, before: str | None,
             after: str | None) -> JsonDict:
    """``ruleset`` with ``rule`` added (or replacing the user's rule of the same ID in place),
    placed ``before``/``after`` another user-defined rule of the kind when asked, else first
    among the user's rules of the kind (404 if the named rule does not exist, 400 if it is a
    server default)."""
    rules = [r for r in ruleset[kind] if r["rule_id"] != rule["rule_id"]]
    replaced = len(rules) != len(ruleset[kind])
    anchor = before if before is not None else after
    if anchor is not None:
        if is_server_default(anchor):
            raise invalid_param("'before' and 'after' cannot name a server-default rule")
        index = next((i for i, r in enumerate(rules) if r["rule_id"] == anchor), None)
        if index is None:
            raise not_found(f"No push rule {kind}/{anchor} to place the rule {'before' if before else 'after'}")
        rules.insert(index if before is not None else index + 1, rule)
    elif replaced:
        old = [r["rule_id"] for r in ruleset[kind]].index(rule["rule_id"])
        rules.insert(old, rule)
    else:
        first_own = next((i for i, r in enumerate(rules) if not r.get("default")), None)
        if first_own is None:
            first_own = sum(1 for r in rules if r["rule_id"] in _PREPENDED_OVERRIDES)
        rules.insert(first_own, rule)
    if sum(len(v) for k, v in ruleset.items() if k != kind) + len(rules) > MAX_USER_RULES + 50:
        raise MatrixError(400, "M_RESOURCE_LIMIT_EXCEEDED", f"at most {MAX_USER_RULES} push rules per user")
    return {**ruleset, kind: rules}


def delete_rule(ruleset: Mapping[str, Any], kind: str, rule_id: str) -> JsonDict:
    rule = find_rule(ruleset, kind, rule_id)
    if rule.get("default"):
        raise invalid_param("server-default rules cannot be deleted (disable them instead)")
    return {**ruleset, kind: [r for r in ruleset[kind] if r["rule_id"] != rule_id]}


def set_rule_field(ruleset: Mapping[str, Any], kind: str, rule_id: str, field: str, value: Any) -> JsonDict:
    """``ruleset`` with ``field`` (``enabled`` or ``actions``, checked by the caller) of one rule set."""
    find_rule(ruleset, kind, rule_id)
    return {**ruleset, kind: [dict(r, **{field: value}) if r["rule_id"] == rule_id else r for r in ruleset[kind]]}


def apply_edit(ruleset: Mapping[str, Any], edit: Mapping[str, Any]) -> JsonDict:
    """One change a client asked for (``op``: put, delete, enabled, actions), as the account
    data writer applies it; the result is what is stored as ``{"global": ...}``."""
    op, kind, rule_id = edit.get("op"), str(edit.get("kind")), str(edit.get("rule_id"))
    check_kind(kind)
    if op == "put":
        rule = check_new_rule(kind, rule_id, edit.get("body"))
        return add_rule(ruleset, kind, rule, before=edit.get("before"), after=edit.get("after"))
    if op == "delete":
        return delete_rule(ruleset, kind, rule_id)
    if op == "enabled":
        body = edit.get("body")
        if not isinstance(body, dict) or not isinstance(body.get("enabled"), bool):
            raise bad_json("the body must be {\"enabled\": true|false}")
        return set_rule_field(ruleset, kind, rule_id, "enabled", body["enabled"])
    if op == "actions":
        body = edit.get("body")
        if not isinstance(body, dict):
            raise bad_json("the body must be {\"actions\": [...]}")
        return set_rule_field(ruleset, kind, rule_id, "actions", check_actions(body.get("actions")))
    raise invalid_param(f"unknown push rule change {op!r}")


@attrs.frozen
class RulePath:
    """What a ``/pushrules...`` path names: everything (``scope`` None), the global ruleset,
    one kind's rules, one rule, or one attribute of a rule."""

    scope: str | None = None
    kind: str | None = None
    rule_id: str | None = None
    attribute: str | None = None


def parse_rule_path(rest: str, *, write: bool) -> RulePath:
    """The part of the path after ``/pushrules`` (percent-decoded), or 400: the spec's paths
    end in a slash when they name a collection (``/pushrules/``, ``/pushrules/global/``,
    ``/pushrules/global/{kind}/``); the only scope is ``global``; attributes are ``enabled``
    and ``actions``. Writes (``write``) need a rule ID."""
    if not rest.startswith("/"):
        raise invalid_param("push rule paths start with /pushrules/")
    parts = rest[1:].split("/")
    if parts == [""]:
        if write:
            raise invalid_param("name a rule: /pushrules/global/{kind}/{ruleId}")
        return RulePath()
    if parts[0] != "global":
        raise invalid_param(f"the only push rule scope is 'global', got {parts[0][:50]!r}")
    if len(parts) == 1:
        raise invalid_param("/pushrules/global needs a trailing slash")
    if len(parts) == 2 and parts[1] == "" and not write:
        return RulePath("global")
    check_kind(parts[1])
    if len(parts) == 2:
        raise invalid_param(f"/pushrules/global/{parts[1]} needs a trailing slash")
    if len(parts) == 3 and parts[2] == "":
        if write:
            raise invalid_param("the rule ID must not be empty")
        return RulePath("global", parts[1])
    if parts[2] == "":
        raise invalid_param("the rule ID must not be empty")
    if len(parts) == 3:
        return RulePath("global", parts[1], parts[2])
    if len(parts) == 4 and parts[3] in _ATTRIBUTES:
        return RulePath("global", parts[1], parts[2], parts[3])
    if len(parts) == 4:
        raise invalid_param(f"a rule's attributes are {' and '.join(_ATTRIBUTES)}, got {parts[3][:50]!r}")
    raise invalid_param("a rule ID may not contain '/'")
