"""A user's push rules: merged with the defaults, edited by the /pushrules API, validated;
pushers validated; a new event evaluated once per local recipient."""

from __future__ import annotations

import json
from typing import Any

import pytest

from homeserver.events.room_versions import KNOWN_ROOM_VERSIONS
from homeserver.handlers.push.push import check_gateway_url, evaluate_for_room
from homeserver.events.push_evaluator import PushContext, evaluate
from homeserver.events.push_rules import RulePath, apply_edit, effective_rules, parse_rule_path
from storage.kernel.errors import MatrixError
from storage.stores.push import PushContextRow
from tests.unit.events.helpers import ALICE, RoomBuilder

BOB = "@bob:example.org"


def ids(ruleset: dict[str, Any], kind: str) -> list[str]:
    return [r["rule_id"] for r in ruleset[kind]]


def put(ruleset: dict[str, Any], kind: str, rule_id: str, body: Any, **where: str) -> dict[str, Any]:
    return apply_edit(ruleset, {"op": "put", "kind": kind, "rule_id": rule_id, "body": body, **where})


def test_nothing_stored_is_the_defaults_and_user_rules_come_before_them() -> None:
    rules = effective_rules(None, BOB)
    assert ids(rules, "override")[0] == ".m.rule.master" and ids(rules, "room") == []
    rules = put(rules, "override", "mine", {"actions": ["notify"], "conditions": []})
    rules = put(rules, "underride", "late", {"actions": [], "conditions": []})
    assert ids(rules, "override")[:2] == [".m.rule.master", "mine"]
    assert ids(rules, "underride")[0] == "late"
    # Stored and read back: the same ruleset.
    assert effective_rules({"global": rules}, BOB) == rules


def test_before_after_replace_and_delete() -> None:
    rules = effective_rules(None, BOB)
    for rule_id in ("a", "b"):
        rules = put(rules, "sender", f"@{rule_id}:example.org", {"actions": []})
    assert ids(rules, "sender") == ["@b:example.org", "@a:example.org"]  # newest first
    rules = put(rules, "sender", "@c:example.org", {"actions": []}, after="@a:example.org")
    rules = put(rules, "sender", "@d:example.org", {"actions": []}, before="@b:example.org")
    assert ids(rules, "sender") == ["@d:example.org", "@b:example.org", "@a:example.org", "@c:example.org"]
    rules = put(rules, "sender", "@a:example.org", {"actions": ["notify"]})  # replaced in place
    assert ids(rules, "sender")[2] == "@a:example.org" and rules["sender"][2]["actions"] == ["notify"]
    rules = apply_edit(rules, {"op": "delete", "kind": "sender", "rule_id": "@d:example.org"})
    assert ids(rules, "sender") == ["@b:example.org", "@a:example.org", "@c:example.org"]


def test_defaults_keep_their_place_but_take_enabled_and_actions() -> None:
    rules = apply_edit(effective_rules(None, BOB), {"op": "enabled", "kind": "override",
                                                   "rule_id": ".m.rule.master", "body": {"enabled": True}})
    rules = apply_edit(rules, {"op": "actions", "kind": "underride", "rule_id": ".m.rule.message",
                               "body": {"actions": ["dont_notify"]}})
    again = effective_rules({"global": rules}, BOB)
    assert again["override"][0]["enabled"] is True
    assert next(r for r in again["underride"] if r["rule_id"] == ".m.rule.message")["actions"] == ["dont_notify"]
    message = {"type": "m.room.message", "sender": "@x:example.org", "content": {"body": "hi"}}
    assert not evaluate(again, message, PushContext(BOB, None, 3, 0)).notify  # master on: silence


@pytest.mark.parametrize(("kind", "rule_id", "body", "where", "status"), [
    ("override", "x", {"actions": ["explode"]}, {}, 400),
    ("override", "x", {}, {}, 400),
    ("override", "x", {"actions": [{"set_tweak": "highlight", "value": "yes"}]}, {}, 400),
    ("override", "x", {"actions": [], "conditions": "no"}, {}, 400),
    ("override", "x", {"actions": [], "conditions": [{"kind": "event_match", "key": "type"}]}, {}, 400),
    ("override", "x", {"actions": [], "conditions": [{"kind": "event_property_is", "key": "k", "value": 1.5}]},
     {}, 400),
    ("override", "x", {"actions": [], "conditions": [{"kind": "room_member_count", "is": "=2"}]}, {}, 400),
    ("override", "x", {"actions": [], "conditions": [{}] * 21}, {}, 400),
    ("override", ".m.rule.x", {"actions": [], "conditions": []}, {}, 400),
    ("override", "a/b", {"actions": [], "conditions": []}, {}, 400),
    ("room", "#fo\\o:example.com", {"actions": []}, {}, 400),
    ("content", "x", {"actions": []}, {}, 400),
    ("underride", "x", {"actions": []}, {}, 400),
    ("weird", "x", {"actions": []}, {}, 400),
    ("override", "x", {"actions": [], "conditions": []}, {"before": "nope"}, 404),
    ("override", "x", {"actions": [], "conditions": []}, {"after": ".m.rule.master"}, 400),
    ("override", "x", {"actions": ["notify"], "conditions": [{"kind": "event_match", "key": "k", "pattern": "\x00"}]},
     {}, 400),
])
def test_bad_rules_are_refused(kind: str, rule_id: str, body: Any, where: dict[str, str], status: int) -> None:
    with pytest.raises(MatrixError) as raised:
        put(effective_rules(None, BOB), kind, rule_id, body, **where)
    assert raised.value.status == status


def test_unknown_condition_kinds_are_kept_and_never_match() -> None:
    rules = put(effective_rules(None, BOB), "override", "x", {"actions": ["notify"], "conditions": [
        {"kind": "org.example.future"}]})
    event = {"type": "m.room.topic", "sender": "@x:example.org", "content": {}}
    assert not evaluate(rules, event, PushContext(BOB, None, 3, 0)).notify


def test_default_rules_cannot_be_deleted_and_missing_rules_are_404() -> None:
    rules = effective_rules(None, BOB)
    with pytest.raises(MatrixError) as raised:
        apply_edit(rules, {"op": "delete", "kind": "override", "rule_id": ".m.rule.master"})
    assert raised.value.status == 400
    for op in ("delete", "enabled", "actions"):
        with pytest.raises(MatrixError) as raised:
            apply_edit(rules, {"op": op, "kind": "override", "rule_id": "nope", "body": {"enabled": True, "actions": []}})
        assert raised.value.status == 404


@pytest.mark.parametrize("url", [
    "https://push.example.org/_matrix/push/v1/notify",
    "http://127.0.0.1:5000/_matrix/push/v1/notify",
])
def test_gateway_urls_that_are_accepted(url: str) -> None:
    assert check_gateway_url(url) == url


@pytest.mark.parametrize("url", [
    None, 5, "", "push.example.org/_matrix/push/v1/notify", "ftp://x/_matrix/push/v1/notify",
    "https://push.example.org/_matrix/push/v1/notify/", "https://push.example.org/notify",
    "https://push.example.org/_matrix/push/v1/notify?x=1", "https:///_matrix/push/v1/notify",
])
def test_gateway_urls_that_are_refused(url: Any) -> None:
    with pytest.raises(MatrixError) as raised:
        check_gateway_url(url)
    assert raised.value.status == 400


@pytest.mark.parametrize(("rest", "write", "expected"), [
    ("/", False, RulePath()),
    ("/global/", False, RulePath("global")),
    ("/global/room/", False, RulePath("global", "room")),
    ("/global/room/!r:x", True, RulePath("global", "room", "!r:x")),
    ("/global/override/.m.rule.master/enabled", True, RulePath("global", "override", ".m.rule.master", "enabled")),
    ("/global/underride/a/actions", False, RulePath("global", "underride", "a", "actions")),
])
def test_rule_paths(rest: str, write: bool, expected: RulePath) -> None:
    assert parse_rule_path(rest, write=write) == expected


@pytest.mark.parametrize(("rest", "write"), [
    ("", False), ("/", True), ("/global", False), ("/global/", True), ("/global/room", False),
    ("/global/room/", True), ("/device/room/x", True), ("/not_a_scope/", False), ("/global/nope/", False),
    ("/global/override/x/colour", False), ("/global/override/x/enabled/more", True), ("/global/room//enabled", True),
])
def test_bad_rule_paths(rest: str, write: bool) -> None:
    with pytest.raises(MatrixError) as raised:
        parse_rule_path(rest, write=write)
    assert raised.value.status == 400


# --- one event, the room's local recipients ----------------------------------------------------

CAROL_LOCAL = "@carol:b.test"


def room_event(content: dict[str, Any]) -> Any:
    room = RoomBuilder(KNOWN_ROOM_VERSIONS["10"])
    room.create()
    return room.build("m.room.message", ALICE, content)


def test_the_sender_is_never_notified_and_each_recipient_has_their_own_rules() -> None:
    """Bob muted the room (a room rule without actions); Carol did not; a mention of Bob
    still notifies him (an override rule comes first); Alice, the sender, gets nothing."""
    event = room_event({"msgtype": "m.text", "body": "hello"})
    muted = effective_rules(None, BOB)
    muted = put(muted, "room", event.room_id, {"actions": []})
    room = PushContextRow(3, None, {ALICE: (None, None), BOB: ("Bob", json.dumps({"global": muted})),
                                    CAROL_LOCAL: (None, "not json")})
    assert [a.user_id for a in evaluate_for_room(event, room)] == [CAROL_LOCAL]
    mention = room_event({"msgtype": "m.text", "body": "hey", "m.mentions": {"user_ids": [BOB]}})
    mention_room = PushContextRow(3, None, {**room.recipients})
    notified = {a.user_id: a for a in evaluate_for_room(mention, mention_room)}
    assert set(notified) == {BOB, CAROL_LOCAL} and notified[BOB].highlight and not notified[CAROL_LOCAL].highlight
    assert json.loads(notified[BOB].actions_json)[0] == "notify"


def test_room_mentions_follow_the_power_levels_in_the_room() -> None:
    event = room_event({"msgtype": "m.text", "body": "all", "m.mentions": {"room": True}})
    levels = json.dumps({"content": {"users": {ALICE: 100}, "notifications": {"room": 101}}})
    room = PushContextRow(5, levels, {BOB: (None, None)})
    assert not evaluate_for_room(event, room)[0].highlight  # 100 < 101
    room = PushContextRow(5, json.dumps({"content": {"users": {ALICE: 100}}}), {BOB: (None, None)})
    assert evaluate_for_room(event, room)[0].highlight


def test_a_thread_reply_is_recorded_with_its_thread() -> None:
    reply = room_event({"msgtype": "m.text", "body": "in thread",
                        "m.relates_to": {"rel_type": "m.thread", "event_id": "$root"}})
    plain = room_event({"msgtype": "m.text", "body": "main"})
    room = PushContextRow(3, None, {BOB: (None, None)})
    assert evaluate_for_room(reply, room)[0].thread_id == "$root"
    assert evaluate_for_room(plain, room)[0].thread_id is None
