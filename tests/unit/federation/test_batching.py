"""The pure planner of inbound batches: which PDUs of a room are checked and persisted together,
the state each is checked against, and how the room's extremities and current state move."""

# tests: homeserver/federation/batching.py

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from signedjson.key import generate_signing_key

from homeserver.events import DEFAULT_ROOM_VERSION, FrozenEvent, sign_pdu
from homeserver.federation.batching import BatchPlanner, wanted_prevs
from storage.stores.events import BatchStart

KEY = generate_signing_key("k1")
ROOM = "!room:a.test"
CREATE = ("m.room.create", "")
BASE = {CREATE: "$create", ("m.room.member", "@u:a.test"): "$join"}


def _event(n: int, prevs: list[str], *, state_key: str | None = None, kind: str = "m.room.message") -> FrozenEvent:
    pdu: dict[str, Any] = {"room_id": ROOM, "sender": "@u:a.test", "type": kind, "content": {"body": str(n)},
                           "prev_events": prevs, "auth_events": [], "depth": 10 + n, "origin_server_ts": n}
    if state_key is not None:
        pdu["state_key"] = state_key
    return sign_pdu(DEFAULT_ROOM_VERSION, pdu, "a.test", KEY)


def _start(extremities: set[str] = {"$top"}, groups: dict[str, int] | None = None,
           stored: frozenset[str] = frozenset()) -> BatchStart:
    groups = {"$top": 7} if groups is None else groups
    return BatchStart(frozenset(extremities), dict(BASE), {e: dict(BASE) for e in groups}, groups, stored)


def _chain(n: int, first_prev: str = "$top") -> list[FrozenEvent]:
    events: list[FrozenEvent] = []
    prev = first_prev
    for i in range(n):
        events.append(_event(i, [prev]))
        prev = events[-1].event_id
    return events


def test_a_line_of_messages_is_one_batch_on_the_stored_state() -> None:
    chain = _chain(5)
    planner = BatchPlanner(_start())
    plans = []
    for event in chain:
        plan = planner.plan(event)
        assert plan is not None and plan.linear
        plans.append(plan)
        assert planner.record(event, plan, rejected=False, soft_failed=False) == {}
    assert plans[0].prev_group == 7 and plans[0].prev == "$top"
    # Later events build on the one before, whose group the batch's transaction makes.
    assert [(p.prev, p.prev_group) for p in plans[1:]] == [(e.event_id, None) for e in chain[:-1]]
    assert all(p.state_before == BASE for p in plans)
    assert planner.extremities == {chain[-1].event_id}
    assert planner.current_state == BASE


def test_a_state_event_changes_the_state_its_successors_see_and_the_current_state() -> None:
    topic = _event(0, ["$top"], state_key="", kind="m.room.topic")
    after = _event(1, [topic.event_id])
    planner = BatchPlanner(_start())
    plan = planner.plan(topic)
    assert plan is not None
    assert planner.record(topic, plan, rejected=False, soft_failed=False) == {("m.room.topic", ""): topic.event_id}
    next_plan = planner.plan(after)
    assert next_plan is not None
    assert next_plan.state_before == {**BASE, ("m.room.topic", ""): topic.event_id}
    assert planner.current_state[("m.room.topic", "")] == topic.event_id


def test_a_rejected_state_event_changes_no_state_but_becomes_the_extremity() -> None:
    topic = _event(0, ["$top"], state_key="", kind="m.room.topic")
    after = _event(1, [topic.event_id])
    planner = BatchPlanner(_start())
    plan = planner.plan(topic)
    assert plan is not None
    assert planner.record(topic, plan, rejected=True, soft_failed=False) == {}
    next_plan = planner.plan(after)
    assert next_plan is not None and next_plan.linear and next_plan.state_before == BASE
    assert planner.current_state == BASE and planner.extremities == {topic.event_id}


def test_a_soft_failed_event_moves_neither_extremities_nor_current_state_so_its_child_forks() -> None:
    topic = _event(0, ["$top"], state_key="", kind="m.room.topic")
    child = _event(1, [topic.event_id])
    planner = BatchPlanner(_start())
    plan = planner.plan(topic)
    assert plan is not None
    planner.record(topic, plan, rejected=False, soft_failed=True)
    assert planner.extremities == {"$top"} and planner.current_state == BASE
    child_plan = planner.plan(child)
    assert child_plan is not None and not child_plan.linear
    # Its state before includes the soft-failed event's change (the state it was sent on).
    assert child_plan.state_before[("m.room.topic", "")] == topic.event_id
    # A fork that is itself soft-failed stays in the batch; one that is not needs resolution.
    assert planner.batchable(child_plan, soft_failed=True)
    assert not planner.batchable(child_plan, soft_failed=False)
    with pytest.raises(ValueError):
        planner.record(child, child_plan, rejected=False, soft_failed=False)


def test_events_the_batch_cannot_plan_take_the_one_event_path() -> None:
    merge = _event(0, ["$top", "$other"])
    orphan = _event(1, ["$unknown"])
    root = _event(2, [])
    stored = _event(3, ["$top"])
    planner = BatchPlanner(_start(stored=frozenset({stored.event_id})))
    assert planner.plan(merge) is None
    assert planner.plan(orphan) is None
    assert planner.plan(root) is None
    assert planner.plan(stored) is None


def test_a_pdu_on_an_older_stored_event_forks() -> None:
    planner = BatchPlanner(_start(extremities={"$top"}, groups={"$top": 7, "$older": 5}))
    plan = planner.plan(_event(0, ["$older"]))
    assert plan is not None and not plan.linear and plan.prev_group == 5


def test_wanted_prevs_are_the_single_prevs_outside_the_batch() -> None:
    chain = _chain(3)
    merge = _event(9, ["$a", "$b"])
    assert wanted_prevs([*chain, merge]) == {"$top"}


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.sampled_from(["ok", "rejected", "soft"])), min_size=1, max_size=12))
def test_the_planned_state_equals_replaying_the_chain(steps: list[tuple[bool, str]]) -> None:
    """Whatever mix of messages and state events, accepted, rejected or soft-failed, each
    batched event's state before is the stored state plus the changes of the accepted or
    soft-failed state events before it on its line, and current state only has the non
    soft-failed ones, as long as the line has not forked."""
    planner = BatchPlanner(_start())
    prev = "$top"
    line_state = dict(BASE)
    current = dict(BASE)
    forked = False
    for n, (is_state, verdict) in enumerate(steps):
        event = _event(n, [prev], state_key=f"k{n % 3}" if is_state else None,
                       kind="m.room.topic" if is_state else "m.room.message")
        plan = planner.plan(event)
        assert plan is not None
        assert dict(plan.state_before) == line_state
        assert plan.linear == (not forked)
        soft = verdict == "soft"
        if not planner.batchable(plan, soft_failed=soft):
            break
        planner.record(event, plan, rejected=verdict == "rejected", soft_failed=soft)
        if is_state and verdict != "rejected":
            line_state[("m.room.topic", f"k{n % 3}")] = event.event_id
            if not soft:
                current[("m.room.topic", f"k{n % 3}")] = event.event_id
        forked = forked or soft
        assert dict(planner.current_state) == current
        prev = event.event_id
