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
from typing import Any, Final

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


MAX_INDEXED_TYPES: Final = 64
"""Event types (lower-cased) a compiled ruleset keeps the rules of (``CompiledRuleset.for_type``):
the types a server sees often are few; the rest, any text a sender picks, are not kept."""


@attrs.frozen
class CompiledRuleset:
    """A ruleset turned into ``(matcher, outcome)`` pairs, in evaluation order, its disabled rules
    left out: built once per ruleset (``compiled_rules`` keeps them per stored rules), then
    each event costs only the matchers it reaches, with globs already compiled to regexes.

    ``types``: for each rule, the event type it requires, lower-cased (an ``event_match`` of
    ``type`` against an ASCII pattern without wildcards, which matches an ASCII type exactly
    when the lower-cased strings are equal), or None. An event is tried only against the rules
    whose type is None or its own: most default rules name a type (an invite, a tombstone, a
    call...), and a message passes over them without a look."""

    rules: tuple[tuple[_Matcher, Outcome], ...]
    types: tuple[str | None, ...]
    _by_type: dict[str, tuple[tuple[_Matcher, Outcome], ...]] = attrs.field(
        factory=dict, init=False, eq=False, repr=False)

    def evaluate(self, event: Mapping[str, Any], context: PushContext) -> Outcome:
        for matches, outcome in self.for_type(event.get("type")):
            if matches(event, context):
                return outcome
        return SILENT

    def for_type(self, event_type: object) -> tuple[tuple[_Matcher, Outcome], ...]:
        """The rules an event of ``event_type`` can match, in order (all of them for a type that
        is not an ASCII string)."""
        if type(event_type) is not str or not event_type.isascii():
            return self.rules
        lowered = event_type.lower()
        found = self._by_type.get(lowered)
        if found is None:
            found = tuple(rule for rule, wanted in zip(self.rules, self.types) if wanted is None or wanted == lowered)
            if len(self._by_type) < MAX_INDEXED_TYPES:
                self._by_type[lowered] = found
        return found


def compile_ruleset(ruleset: Mapping[str, Sequence[Mapping[str, Any]]]) -> CompiledRuleset:
    """``ruleset`` as matchers. A malformed rule or condition (stored rules are the user's) never
    matches, rather than failing the whole evaluation."""
    compiled: list[tuple[_Matcher, Outcome]] = []
    types: list[str | None] = []
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
            types.append(_required_type(kind, rule))
    return CompiledRuleset(tuple(compiled), tuple(types))


def _required_type(kind: str, rule: Mapping[str, Any]) -> str | None:
    """The event type, lower-cased, that ``rule`` matches only (``CompiledRuleset.types``), or None."""
    if kind not in ("override", "underride"):
        return None
    conditions = rule.get("conditions", ())
    if not isinstance(conditions, Sequence) or isinstance(conditions, str):
        return None
    for condition in conditions:
        if (isinstance(condition, Mapping) and condition.get("kind") == "event_match"
                and condition.get("key") == "type"):
            pattern = condition.get("pattern")
            if isinstance(pattern, str) and pattern.isascii() and "*" not in pattern and "?" not in pattern:
                return pattern.lower()
    return None


# The server-default rules name the user they are for (an invite for them, a mention of them,
# their localpart in a body). A ruleset is compiled for this stand-in user instead, and its
# matchers compare with the user being evaluated (``PushContext.user_id``) where the rules name
# the stand-in: so one compiled ruleset serves every user with the same stored rules (all
# those who changed nothing share one), where one per user had to be compiled again for each
# event once a room's local members outnumbered the cache (50,000 local members: 11 s of a
# join). No user ID can be it: it holds NULs.
_ANY_USER: Final = "@\x00user\x00:\x00"
_ANY_LOCALPART: Final = _ANY_USER[1:].partition(":")[0]


def compiled_rules(user_id: str, stored_json: str | None,
                   effective: Callable[[Any, str], Mapping[str, Sequence[Mapping[str, Any]]]]) -> CompiledRuleset:
    """The compiled ``effective(stored, user_id)`` of a user whose ``m.push_rules`` account data is
    ``stored_json`` (None: never set; unreadable JSON counts as never set), to evaluate with a
    ``PushContext`` of ``user_id``. Cached by the stored text, so an edit of the rules (new text)
    is compiled afresh and an unchanged one never again."""
    return _compiled_for_any_user(stored_json, effective)


@lru_cache(maxsize=1024)  # each entry: about 40 compiled rules (tens of kB)
def _compiled_for_any_user(stored_json: str | None,
                           effective: Callable[[Any, str], Mapping[str, Sequence[Mapping[str, Any]]]]) -> CompiledRuleset:
    stored = None
    if stored_json is not None:
        try:
            stored = json.loads(stored_json)
        except ValueError:
            logger.warning("ignoring unreadable m.push_rules (%d characters)", len(stored_json))
    return compile_ruleset(effective(stored, _ANY_USER))


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
        pattern = str(rule.get("pattern", ""))
        if pattern == _ANY_LOCALPART:
            return lambda event, context: _localpart_in_body(context.user_id, event)
        word = _word_glob(pattern)
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


def _localpart_in_body(user_id: str, event: Mapping[str, Any]) -> bool:
    """``.m.rule.contains_user_name`` for ``user_id``: its localpart as a glob, a whole word of
    the body (``_word_glob``'s match), found without compiling a regex per user where the
    localpart and the body are ASCII and the localpart has no wildcard."""
    localpart = user_id[1:].partition(":")[0]
    content = event.get("content")
    body = content.get("body") if isinstance(content, Mapping) else None
    if not isinstance(body, str):
        return False
    if not localpart or not localpart.isascii() or not body.isascii() or "*" in localpart or "?" in localpart:
        return _word_glob(localpart).search(body) is not None
    return _has_word(body, localpart)


def _has_word(text: str, word: str) -> bool:
    r"""Whether ``word`` stands in ``text`` with no word character (``\w``) just before or after
    it, ignoring case: ``(?<!\w)word(?!\w)`` with IGNORECASE, for ASCII ``text`` and ``word``,
    found without compiling a regex (a user's name or localpart: one per user, each event)."""
    lowered, word = text.lower(), word.lower()
    start = lowered.find(word)
    while start >= 0:
        end = start + len(word)
        if (start == 0 or not _is_word_char(lowered[start - 1])) and (end == len(lowered) or not _is_word_char(lowered[end])):
            return True
        start = lowered.find(word, start + 1)
    return False


def _is_word_char(char: str) -> bool:
    return char.isalnum() or char == "_"


def _condition_matcher(condition: object) -> _Matcher:
    if not isinstance(condition, Mapping):
        return _never
    kind = condition.get("kind")
    if kind == "event_match":
        key, pattern = condition.get("key"), condition.get("pattern")
        if not isinstance(pattern, str):
            return _never
        path = _split_key(str(key))
        if pattern == _ANY_USER:
            # The user's own ID (``.m.rule.invite_for_me``): a glob of it, matched as a whole.
            return lambda event, context: _is_user(_property_at(event, path), context.user_id)
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

        if wanted == _ANY_USER:  # the user's own ID (``.m.rule.is_user_mention``)
            return lambda event, context: _contains(_property_at(event, path), context.user_id)
        return lambda event, context: _contains(_property_at(event, path), wanted)
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


def _contains(value: Any, wanted: Any) -> bool:
    return isinstance(value, (list, tuple)) and wanted in value


def _is_user(value: Any, user_id: str) -> bool:
    """``value`` matches ``user_id`` taken as an ``event_match`` glob on the whole value (without
    compiling it where a comparison of lower-cased ASCII gives the same answer)."""
    if not isinstance(value, str):
        return False
    if "*" in user_id or "?" in user_id or not user_id.isascii() or not value.isascii():
        return _whole_glob(user_id).fullmatch(value) is not None
    return value.lower() == user_id.lower()


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
    if not isinstance(body, str):
        return False
    if name.isascii() and body.isascii():
        return _has_word(body, name)
    return _display_name_pattern(name).search(body) is not None


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
