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

import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from types import MappingProxyType
from typing import Any

import attrs

logger = logging.getLogger(__name__)

_KINDS = ("override", "content", "room", "sender", "underride")
_MISSING = object()
_MAPPINGS = (dict, MappingProxyType)


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
    # ``actions`` as the JSON array stored with a notification (made once, with the outcome).
    actions_json: str = attrs.field(eq=False, repr=False)

    @actions_json.default
    def _actions_json(self) -> str:
        return json.dumps(list(self.actions), separators=(",", ":"))


SILENT = Outcome(False, False)


def evaluate(ruleset: Mapping[str, Sequence[Mapping[str, Any]]], event: Mapping[str, Any],
             context: PushContext) -> Outcome:
    """The outcome of the first enabled rule of ``ruleset`` that matches ``event`` (a PDU, plain or
    frozen) for ``context``."""
    return compile_ruleset(ruleset).evaluate(event, context)


_Matcher = Callable[[Mapping[str, Any], PushContext], bool]


@attrs.frozen
class CompiledRuleset:
    """A ruleset turned into ``(matcher, outcome)`` pairs, in evaluation order, its disabled rules
    left out: built once per ruleset (``compiled_rules`` keeps them per user and stored rules), then
    each event costs only the matchers it reaches, with globs already compiled to regexes."""

    rules: tuple[tuple[_Matcher, Outcome], ...]

    def evaluate(self, event: Mapping[str, Any], context: PushContext) -> Outcome:
        for matches, outcome in self.rules:
            if matches(event, context):
                return outcome
        return SILENT


def compile_ruleset(ruleset: Mapping[str, Sequence[Mapping[str, Any]]]) -> CompiledRuleset:
    """``ruleset`` as matchers. A malformed rule or condition (stored rules are the user's) never
    matches, rather than failing the whole evaluation."""
    compiled: list[tuple[_Matcher, Outcome]] = []
    for kind in _KINDS:
        rules = ruleset.get(kind, ())
        if not isinstance(rules, Sequence) or isinstance(rules, str):
            continue
        for rule in rules:
            if not isinstance(rule, Mapping) or not rule.get("enabled", True):
                continue
            actions = rule.get("actions", ())
            outcome = _outcome(actions if isinstance(actions, Sequence) and not isinstance(actions, str) else ())
            compiled.append((_rule_matcher(kind, rule), outcome))
    return CompiledRuleset(tuple(compiled))


@lru_cache(maxsize=1024)  # each entry: about 40 compiled rules (tens of kB)
def compiled_rules(user_id: str, stored_json: str | None,
                   effective: Callable[[Any, str], Mapping[str, Sequence[Mapping[str, Any]]]]) -> CompiledRuleset:
    """The compiled ``effective(stored, user_id)`` of a user whose ``m.push_rules`` account data is
    ``stored_json`` (None: never set; unreadable JSON counts as never set). Cached by the stored
    text, so an edit of the rules (new text) is compiled afresh and an unchanged one never again."""
    stored = None
    if stored_json is not None:
        try:
            stored = json.loads(stored_json)
        except ValueError:
            logger.warning("ignoring unreadable m.push_rules of %s", user_id)
    return compile_ruleset(effective(stored, user_id))


def _outcome(actions: Sequence[Any]) -> Outcome:
    notify = "notify" in actions
    highlight = False
    for action in actions:
        if isinstance(action, Mapping) and action.get("set_tweak") == "highlight":
            highlight = action.get("value", True) is True
    return Outcome(notify, notify and highlight, tuple(actions) if notify else ())


def _never(event: Mapping[str, Any], context: PushContext) -> bool:
    return False


def _rule_matcher(kind: str, rule: Mapping[str, Any]) -> _Matcher:
    if kind == "content":
        word = _word_glob(str(rule.get("pattern", "")))
        return lambda event, context: _word_in_body(word, event)
    if kind in ("room", "sender"):
        key, wanted = ("room_id" if kind == "room" else "sender"), rule.get("rule_id")
        return lambda event, context: event.get(key) == wanted
    conditions = rule.get("conditions", ())
    if not isinstance(conditions, Sequence) or isinstance(conditions, str):
        return _never
    matchers = tuple(_condition_matcher(c) for c in conditions)
    if _never in matchers:
        return _never
    if len(matchers) == 1:
        return matchers[0]
    return lambda event, context: all(m(event, context) for m in matchers)


def _word_in_body(word: re.Pattern[str], event: Mapping[str, Any]) -> bool:
    content = event.get("content")
    body = content.get("body") if isinstance(content, Mapping) else None
    return isinstance(body, str) and word.search(body) is not None


def _condition_matcher(condition: object) -> _Matcher:
    if not isinstance(condition, Mapping):
        return _never
    kind = condition.get("kind")
    if kind == "event_match":
        key, pattern = condition.get("key"), condition.get("pattern")
        if not isinstance(pattern, str):
            return _never
        path = _split_key(str(key))
        if key == "content.body":
            word = _word_glob(pattern)
            return lambda event, context: _match_text(_property_at(event, path), word.search)
        whole = _whole_glob(pattern)
        if "*" not in pattern and "?" not in pattern and pattern.isascii():
            # A glob without wildcards (most default rules): between ASCII strings the regex's
            # case-insensitive match is a comparison of the lower-cased strings.
            lowered = pattern.lower()
            return lambda event, context: _equal_ignoring_case(_property_at(event, path), lowered, whole)
        return lambda event, context: _match_text(_property_at(event, path), whole.fullmatch)
    if kind == "event_property_is":
        path, wanted = _split_key(str(condition.get("key"))), condition.get("value")

        def property_is(event: Mapping[str, Any], context: PushContext) -> bool:
            value = _property_at(event, path)
            return value is not _MISSING and type(value) is type(wanted) and value == wanted

        return property_is
    if kind == "event_property_contains":
        path, wanted = _split_key(str(condition.get("key"))), condition.get("value")

        def property_contains(event: Mapping[str, Any], context: PushContext) -> bool:
            value = _property_at(event, path)
            return isinstance(value, (list, tuple)) and wanted in value

        return property_contains
    if kind == "contains_display_name":
        return _contains_display_name
    if kind == "room_member_count":
        spec = str(condition.get("is", ""))
        return lambda event, context: _count_matches(spec, context.member_count)
    if kind == "sender_notification_permission":
        level_key = str(condition.get("key"))
        return lambda event, context: (
            context.sender_power_level >= context.notification_power_levels.get(level_key, 50))
    return _never


def _match_text(value: Any, match: Callable[[str], re.Match[str] | None]) -> bool:
    return isinstance(value, str) and match(value) is not None


def _equal_ignoring_case(value: Any, lowered: str, whole: re.Pattern[str]) -> bool:
    if not isinstance(value, str):
        return False
    if value.isascii():
        return value.lower() == lowered
    return whole.fullmatch(value) is not None  # e.g. the Kelvin sign matches "k"


def _contains_display_name(event: Mapping[str, Any], context: PushContext) -> bool:
    name = context.display_name
    if not name:
        return False
    body = _property_at(event, ("content", "body"))
    return isinstance(body, str) and _display_name_pattern(name).search(body) is not None


@lru_cache(maxsize=1024)
def _display_name_pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"(?<![\w]){re.escape(name)}(?![\w])", re.IGNORECASE)


def _property_at(event: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    """The value at ``path`` (keys from ``_split_key``), or _MISSING."""
    value: Any = event
    for part in path:
        if type(value) not in _MAPPINGS and not isinstance(value, Mapping):
            return _MISSING
        value = value.get(part, _MISSING)
        if value is _MISSING:
            return _MISSING
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
