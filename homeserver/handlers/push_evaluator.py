"""Push rules applied to one event for one user: does it notify, does it highlight?

Pure: ``evaluate(ruleset, event, context)`` walks the ruleset's kinds in the
spec's order (override, content, room, sender, underride) and takes the actions
of the first enabled rule whose conditions all hold (Client-Server API, "Push
Rules"). ``/sync`` counts, per room, the unread events that notify
(``notification_count``) and those that also highlight (``highlight_count``).

Conditions: ``event_match`` (glob, case-insensitive; on ``content.body`` it
matches whole words), ``event_property_is``, ``event_property_contains``,
``contains_display_name``, ``room_member_count`` and
``sender_notification_permission``. Unknown kinds never match, as the spec asks.
"""

# tests: tests/unit/handlers/test_push_evaluator.py

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import attrs

_KINDS = ("override", "content", "room", "sender", "underride")
_MISSING = object()


@attrs.frozen
class PushContext:
    """What the rules need beyond the event: the user, the room, the sender's power."""

    user_id: str
    display_name: str | None
    member_count: int
    sender_power_level: int
    notification_power_levels: Mapping[str, int] = attrs.field(factory=lambda: {"room": 50})


@attrs.frozen
class Outcome:
    notify: bool
    highlight: bool
    # The matching rule's actions (tweaks such as ``sound``), as the push payload carries them.
    actions: tuple[Any, ...] = attrs.field(default=(), eq=False)


SILENT = Outcome(False, False)


def evaluate(ruleset: Mapping[str, Sequence[Mapping[str, Any]]], event: Mapping[str, Any],
             context: PushContext) -> Outcome:
    for kind in _KINDS:
        for rule in ruleset.get(kind, ()):
            if rule.get("enabled", True) and _rule_matches(kind, rule, event, context):
                return _outcome(rule.get("actions", ()))
    return SILENT


def _outcome(actions: Sequence[Any]) -> Outcome:
    notify = "notify" in actions
    highlight = False
    for action in actions:
        if isinstance(action, Mapping) and action.get("set_tweak") == "highlight":
            highlight = action.get("value", True) is True
    return Outcome(notify, notify and highlight, tuple(actions) if notify else ())


def _rule_matches(kind: str, rule: Mapping[str, Any], event: Mapping[str, Any], context: PushContext) -> bool:
    if kind == "content":
        body = _property(event, "content.body")
        return isinstance(body, str) and _word_glob(str(rule.get("pattern", ""))).search(body) is not None
    if kind == "room":
        return event.get("room_id") == rule.get("rule_id")
    if kind == "sender":
        return event.get("sender") == rule.get("rule_id")
    return all(_condition(c, event, context) for c in rule.get("conditions", ()))


def _condition(condition: Mapping[str, Any], event: Mapping[str, Any], context: PushContext) -> bool:
    kind = condition.get("kind")
    if kind == "event_match":
        key, pattern = condition.get("key"), condition.get("pattern")
        value = _property(event, str(key))
        if not isinstance(value, str) or not isinstance(pattern, str):
            return False
        if key == "content.body":
            return _word_glob(pattern).search(value) is not None
        return _whole_glob(pattern).fullmatch(value) is not None
    if kind == "event_property_is":
        value = _property(event, str(condition.get("key")))
        wanted = condition.get("value")
        return value is not _MISSING and type(value) is type(wanted) and value == wanted
    if kind == "event_property_contains":
        value = _property(event, str(condition.get("key")))
        return isinstance(value, list) and condition.get("value") in value
    if kind == "contains_display_name":
        body = _property(event, "content.body")
        name = context.display_name
        return bool(name) and isinstance(body, str) and re.search(
            rf"(?<![\w]){re.escape(name or '')}(?![\w])", body, re.IGNORECASE) is not None
    if kind == "room_member_count":
        return _count_matches(str(condition.get("is", "")), context.member_count)
    if kind == "sender_notification_permission":
        needed = context.notification_power_levels.get(str(condition.get("key")), 50)
        return context.sender_power_level >= needed
    return False


def _property(event: Mapping[str, Any], key: str) -> Any:
    """The value at a dotted ``key`` (``\\.`` is a literal dot, ``\\\\`` a backslash), or _MISSING."""
    value: Any = event
    for part in _split_key(key):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


@lru_cache(maxsize=256)
def _split_key(key: str) -> tuple[str, ...]:
    parts, current, escaped = [], [], False
    for char in key:
        if escaped:
            current.append(char)
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == ".":
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return tuple(parts)


def _glob_body(pattern: str) -> str:
    return "".join(".*?" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)


@lru_cache(maxsize=512)
def _whole_glob(pattern: str) -> re.Pattern[str]:
    return re.compile(_glob_body(pattern), re.IGNORECASE | re.DOTALL)


@lru_cache(maxsize=512)
def _word_glob(pattern: str) -> re.Pattern[str]:
    return re.compile(rf"(?<![\w]){_glob_body(pattern)}(?![\w])", re.IGNORECASE | re.DOTALL)


def _count_matches(spec: str, count: int) -> bool:
    match = re.fullmatch(r"(==|<=|>=|<|>)?(\d+)", spec)
    if match is None:
        return False
    op, number = match.group(1) or "==", int(match.group(2))
    return {"==": count == number, "<": count < number, ">": count > number,
            "<=": count <= number, ">=": count >= number}[op]
