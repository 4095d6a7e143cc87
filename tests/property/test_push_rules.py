"""Properties of push rule evaluation and editing: glob and dotted-path rules, and edits
that fail only with a Matrix error."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from homeserver.events.push_evaluator import PushContext, evaluate
from homeserver.events.push_rules import apply_edit, effective_rules
from storage.kernel.errors import MatrixError

BOB = "@bob:example.org"
CTX = PushContext(BOB, None, 3, 0)
text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)


def matches(key: str, pattern: str, event: dict[str, Any]) -> bool:
    rules = {"override": [{"rule_id": "r", "enabled": True, "actions": ["notify"],
                           "conditions": [{"kind": "event_match", "key": key, "pattern": pattern}]}]}
    return evaluate(rules, event, CTX).notify


@given(text, st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=20))
def test_a_pattern_without_wildcards_matches_its_own_value_in_any_ascii_case(value: str, ascii_value: str) -> None:
    plain = value.replace("*", "").replace("?", "")
    assert matches("type", plain, {"type": plain})
    ascii_plain = ascii_value.replace("*", "").replace("?", "")
    assert matches("type", ascii_plain.upper(), {"type": ascii_plain.lower()})
    assert not matches("type", ascii_plain + "x", {"type": ascii_plain})  # the whole value, not a prefix


@given(text, text)
def test_star_matches_any_value_and_prefix_star_any_extension(prefix: str, rest: str) -> None:
    prefix = prefix.replace("*", "").replace("?", "")
    assert matches("type", "*", {"type": prefix + rest})
    assert matches("type", prefix + "*", {"type": prefix + rest})
    assert not matches("type", "*", {"type": 5})  # only strings match


@given(st.lists(st.text(max_size=5), min_size=1, max_size=4), text)
def test_dotted_keys_reach_nested_values_with_escaped_dots(parts: list[str], value: str) -> None:
    value = value.replace("*", "").replace("?", "")
    event: dict[str, Any] = {"type": "x"}
    nested: Any = value
    for part in reversed(parts):
        nested = {part: nested}
    event["content"] = nested
    key = "content." + ".".join(p.replace("\\", "\\\\").replace(".", "\\.") for p in parts)
    if key != "content.body":
        assert matches(key, value, event)


json_values = st.recursive(st.none() | st.booleans() | st.integers() | text,
                           lambda children: st.lists(children, max_size=3) | st.dictionaries(text, children, max_size=3),
                           max_leaves=8)


@settings(max_examples=200)
@given(st.sampled_from(["put", "delete", "enabled", "actions", "other"]),
       st.sampled_from(["override", "content", "room", "sender", "underride", "x"]),
       text, json_values, st.none() | text)
def test_edits_either_apply_or_raise_a_matrix_error(op: str, kind: str, rule_id: str, body: Any,
                                                   before: str | None) -> None:
    rules = effective_rules(None, BOB)
    try:
        changed = apply_edit(rules, {"op": op, "kind": kind, "rule_id": rule_id, "body": body, "before": before})
    except MatrixError as e:
        assert 400 <= e.status < 500
        return
    # Whatever was accepted is stored and read back unchanged, and evaluates without error.
    assert effective_rules({"global": changed}, BOB) == changed
    evaluate(changed, {"type": "m.room.message", "sender": "@x:y", "content": {"body": "hi"}}, CTX)


localpart = st.text(st.characters(min_codepoint=33, max_codepoint=0x17F, blacklist_characters=":"), min_size=1, max_size=12)
word_gap = st.sampled_from(["", " ", "_", "-", ".", "x", "1", "é", "!"])


@settings(max_examples=300)
@given(localpart, localpart, word_gap, word_gap, st.booleans(), st.booleans())
def test_the_shared_compiled_defaults_evaluate_as_each_users_own(
        own: str, other: str, before: str, after: str, upper: bool, mention: bool) -> None:
    """``compiled_rules`` compiles a ruleset once for every user with the same stored rules, the
    rules that name the user (an invite for them, a mention, their localpart as a word of the
    body) comparing with the evaluated user; for any user and event, the outcome is that of the
    user's own rules (``effective_rules(stored, user)``) compiled for them alone."""
    from homeserver.events.push_evaluator import compile_ruleset, compiled_rules

    user, someone = f"@{own}:example.org", f"@{other}:example.org"
    body = before + (own.upper() if upper else own) + after
    content: dict[str, Any] = {"msgtype": "m.text", "body": body}
    if mention:
        content["m.mentions"] = {"user_ids": [someone, user] if upper else [someone]}
    events = [
        {"type": "m.room.message", "sender": BOB, "content": content},
        {"type": "m.room.member", "sender": BOB, "state_key": user.upper() if upper else user,
         "content": {"membership": "invite"}},
        {"type": "m.room.member", "sender": BOB, "state_key": someone, "content": {"membership": "invite"}},
    ]
    stored = '{"global": {"override": [{"rule_id": ".m.rule.invite_for_me", "enabled": false}]}}'
    for stored_json in (None, stored):
        shared = compiled_rules(user, stored_json, effective_rules)
        own_rules = compile_ruleset(effective_rules(None if stored_json is None else {"global": {"override": [
            {"rule_id": ".m.rule.invite_for_me", "enabled": False}]}}, user))
        context = PushContext(user, None, 5, 0)
        for event in events:
            assert shared.evaluate(event, context) == own_rules.evaluate(event, context), (user, event)


ascii_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=30)


@settings(max_examples=500)
@given(st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=10), ascii_text, ascii_text,
       st.booleans())
def test_a_display_name_is_found_as_its_pattern_finds_it(name: str, before: str, after: str, upper: bool) -> None:
    """For ASCII names and bodies, ``contains_display_name`` is decided without a regex per name;
    it finds the name exactly where the name's pattern (a whole word, any case) does."""
    from homeserver.events.push_evaluator import _contains_display_name, _display_name_pattern

    for body in (before + (name.upper() if upper else name) + after, before + after):
        event = {"type": "m.room.message", "content": {"body": body}}
        found = _contains_display_name(event, PushContext(BOB, name, 3, 0))
        assert found == (_display_name_pattern(name).search(body) is not None), (name, body)


event_types = st.sampled_from(["m.room.message", "M.Room.Message", "m.room.member", "m.reaction", "m.call.invite",
                               "m.room.tombstone", "m.room.encrypted", "\u212a.room.message", "k.room.message",
                               "m.room.méssage", "m.room.meſſage", "x", ""]) | text
rule_types = st.sampled_from(["m.room.message", "M.ROOM.MESSAGE", "k.room.message", "m.room.*", "m.?oom.member",
                              "m.room.méssage", "", "x"]) | text


@settings(max_examples=300)
@given(st.lists(st.tuples(st.sampled_from(["override", "underride", "content"]), rule_types, st.booleans()),
                max_size=6),
       st.lists(st.one_of(st.none(), st.integers(), event_types), min_size=1, max_size=4),
       st.booleans())
def test_rules_skipped_by_event_type_are_rules_that_could_not_match(
        added: list[tuple[str, str, bool]], types: list[Any], defaults: bool) -> None:
    """A compiled ruleset tries an event only against the rules that can match its type
    (``CompiledRuleset.for_type``); the outcome is that of trying every rule in order."""
    from homeserver.events.push_evaluator import SILENT, compile_ruleset

    ruleset: dict[str, list[dict[str, Any]]] = effective_rules(None, BOB) if defaults else {}
    ruleset = {kind: list(rules) for kind, rules in ruleset.items()}
    for i, (kind, pattern, with_body) in enumerate(added):
        conditions: list[dict[str, Any]] = [{"kind": "event_match", "key": "type", "pattern": pattern}]
        if with_body:
            conditions.append({"kind": "event_match", "key": "content.body", "pattern": "hi"})
        rule: dict[str, Any] = {"rule_id": f"r{i}", "enabled": True, "actions": ["notify", {"set_tweak": "n", "value": i}]}
        rule.update({"pattern": pattern} if kind == "content" else {"conditions": conditions})
        ruleset.setdefault(kind, []).insert(0, rule)
    compiled = compile_ruleset(ruleset)
    for event_type in types:
        event: dict[str, Any] = {"sender": "@x:y", "content": {"body": "hi"}}
        if event_type is not None:
            event["type"] = event_type
        every_rule = next((outcome for matches, outcome in compiled.rules if matches(event, CTX)), SILENT)
        assert compiled.evaluate(event, CTX) == every_rule
        assert compiled.evaluate(event, CTX).actions == every_rule.actions
