"""The default push rules, evaluated: what notifies and what highlights."""

from __future__ import annotations

from typing import Any

from homeserver.events.push_evaluator import Outcome, PushContext, evaluate
from homeserver.events.push_rules import default_push_rules

ALICE = "@alice:example.org"
RULES = default_push_rules(ALICE)
NOTIFY, HIGHLIGHT, SILENT = Outcome(True, False), Outcome(True, True), Outcome(False, False)


def message(body: str, **content: Any) -> dict[str, Any]:
    return {"type": "m.room.message", "sender": "@bob:example.org", "room_id": "!r:example.org",
            "content": {"msgtype": "m.text", "body": body, **content}}


def ctx(members: int = 3, power: int = 0, name: str | None = "Alice Liddell") -> PushContext:
    return PushContext(ALICE, name, members, power)


def test_messages_notify_and_mentions_highlight() -> None:
    assert evaluate(RULES, message("lunch?"), ctx()) == NOTIFY
    assert evaluate(RULES, message("hey alice, lunch?"), ctx()) == HIGHLIGHT  # user name, as a word
    assert evaluate(RULES, message("malicelike"), ctx()) == NOTIFY  # not a word of its own
    assert evaluate(RULES, message("ask Alice Liddell"), ctx()) == HIGHLIGHT  # display name
    assert evaluate(RULES, message("x", **{"m.mentions": {"user_ids": [ALICE]}}), ctx()) == HIGHLIGHT


def test_room_mentions_need_the_sender_s_power() -> None:
    assert evaluate(RULES, message("@room meeting"), ctx(power=0)) == NOTIFY
    assert evaluate(RULES, message("@room meeting"), ctx(power=50)) == HIGHLIGHT
    mention = message("meeting", **{"m.mentions": {"room": True}})
    assert evaluate(RULES, mention, ctx(power=100)) == HIGHLIGHT
    assert evaluate(RULES, mention, ctx(power=0)) == NOTIFY


def test_silent_kinds() -> None:
    assert evaluate(RULES, message("fyi", msgtype="m.notice"), ctx()) == SILENT
    edit = message("* fixed", **{"m.relates_to": {"rel_type": "m.replace", "event_id": "$x"}})
    assert evaluate(RULES, edit, ctx()) == SILENT
    reaction = {"type": "m.reaction", "sender": "@bob:example.org", "content": {}}
    assert evaluate(RULES, reaction, ctx()) == SILENT
    joined = {"type": "m.room.member", "state_key": "@bob:example.org", "sender": "@bob:example.org",
              "content": {"membership": "join"}}
    assert evaluate(RULES, joined, ctx()) == SILENT
    assert evaluate(RULES, {"type": "m.room.topic", "sender": "@bob:example.org", "content": {}}, ctx()) == SILENT


def test_invites_for_me_encrypted_and_one_to_one() -> None:
    invite = {"type": "m.room.member", "state_key": ALICE, "sender": "@bob:example.org",
              "content": {"membership": "invite"}}
    assert evaluate(RULES, invite, ctx()) == NOTIFY
    encrypted = {"type": "m.room.encrypted", "sender": "@bob:example.org", "content": {"ciphertext": "x"}}
    assert evaluate(RULES, encrypted, ctx(members=2)) == NOTIFY
    assert evaluate(RULES, encrypted, ctx(members=10)) == NOTIFY


def test_disabled_rules_and_odd_input_are_harmless() -> None:
    rules = default_push_rules(ALICE)
    rules["underride"] = [dict(r, enabled=False) for r in rules["underride"]]
    assert evaluate(rules, message("lunch?"), ctx()) == SILENT
    odd = {"override": [{"rule_id": "x", "enabled": True, "conditions": [{"kind": "no_such_kind"}],
                         "actions": ["notify"]},
                        {"rule_id": "y", "conditions": [{"kind": "room_member_count", "is": ">=x"}],
                         "actions": ["notify"]}]}
    assert evaluate(odd, message("hi"), ctx()) == SILENT
    assert evaluate(RULES, {"type": "m.room.message", "content": {"body": 5}}, ctx()) == NOTIFY


def test_compiled_rules_read_frozen_events_as_plain_ones() -> None:
    """The persist path evaluates the frozen PDU (read-only mappings, tuples for arrays)."""
    from homeserver.events.canonical import freeze

    mention = message("x", **{"m.mentions": {"user_ids": [ALICE]}})
    for event in (message("lunch?"), message("hey alice"), mention, message("fyi", msgtype="m.notice")):
        assert evaluate(RULES, freeze(event), ctx()) == evaluate(RULES, event, ctx())  # type: ignore[arg-type]
    assert evaluate(RULES, freeze(mention), ctx()) == HIGHLIGHT  # type: ignore[arg-type]


def test_wildcard_free_globs_match_as_the_regex_does() -> None:
    """``event_match`` without wildcards is a case-insensitive whole match, also beyond ASCII."""
    rule = {"override": [{"rule_id": "k", "conditions": [{"kind": "event_match", "key": "content.msgtype",
                                                          "pattern": "kind"}], "actions": ["notify"]}]}
    assert evaluate(rule, message("x", msgtype="KIND"), ctx()) == NOTIFY
    assert evaluate(rule, message("x", msgtype="\u212aind"), ctx()) == NOTIFY  # Kelvin sign folds to k
    assert evaluate(rule, message("x", msgtype="kinds"), ctx()) == SILENT
    assert evaluate(rule, message("x", msgtype=5), ctx()) == SILENT


def test_malformed_stored_rules_never_match_and_spoil_nothing() -> None:
    odd: dict[str, Any] = {"override": ["not a rule", {"rule_id": "a", "conditions": "nope", "actions": ["notify"]},
                                        {"rule_id": "b", "conditions": [7], "actions": ["notify"]}],
                           "underride": [{"rule_id": "c", "conditions": [], "actions": ["notify"]}]}
    assert evaluate(odd, message("hi"), ctx()) == NOTIFY  # only the well-formed catch-all matched


def test_compiled_rules_follow_the_stored_text() -> None:
    """Rules are compiled once per text of ``m.push_rules``: new text is compiled afresh."""
    import json

    from homeserver.events.push_evaluator import compiled_rules
    from homeserver.events.push_rules import effective_rules

    assert compiled_rules(ALICE, None, effective_rules).evaluate(message("lunch?"), ctx()) == NOTIFY
    muted = effective_rules(None, ALICE)
    muted["underride"] = [dict(r, enabled=False) for r in muted["underride"]]
    text = json.dumps({"global": muted})
    assert compiled_rules(ALICE, text, effective_rules).evaluate(message("lunch?"), ctx()) == SILENT
    assert compiled_rules(ALICE, text, effective_rules) is compiled_rules(ALICE, text, effective_rules)
    assert compiled_rules(ALICE, "{not json", effective_rules).evaluate(message("lunch?"), ctx()) == NOTIFY
