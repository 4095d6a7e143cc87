"""The pure core of checking a send_join response in bulk: auth order, one auth pass, the state map."""

# tests of: homeserver/federation/join_state.py

from __future__ import annotations

import random

import pytest

from homeserver.events import constants as C
from homeserver.events.room_versions import get_room_version
from homeserver.federation.join_state import auth_order, check_auth_in_order, state_map
from tests.unit.events.helpers import ALICE, BOB, CAROL, EVE, standard_room

VERSIONS = ["1", "10", "11", "12"]


@pytest.mark.parametrize("version", VERSIONS)
def test_auth_order_puts_every_auth_event_first_whatever_the_input_order(version: str) -> None:
    """Members, a changed power level and a later member: shuffled, the order still has each
    event after all of its auth events that are in the batch."""
    room = standard_room(get_room_version(version))
    room.join(BOB)
    room.power_levels(ALICE, {ALICE: 100, BOB: 50} if not room.room_version.privileged_creators else {BOB: 50})
    room.join(CAROL)
    events = list(room.events.values())
    for seed in range(5):
        random.Random(seed).shuffle(events)
        ordered = auth_order(events)
        assert sorted(e.event_id for e in ordered) == sorted(room.events)
        position = {e.event_id: i for i, e in enumerate(ordered)}
        for event in ordered:
            for auth_id in event.auth_event_ids:
                assert position[auth_id] < position[event.event_id]


def test_auth_order_ties_go_by_depth_then_event_id() -> None:
    room = standard_room(get_room_version("11"))
    members = [room.join(user) for user in (BOB, CAROL, EVE)]
    ordered = auth_order(reversed(list(room.events.values())))
    # The three joins cite the same auth events: they come last, by depth.
    assert [e.event_id for e in ordered[-3:]] == [e.event_id for e in sorted(members, key=lambda e: e.depth)]


def test_auth_order_keeps_events_of_a_cycle_without_looping() -> None:
    """A server could cite an event's own descendant as its auth event; ordering still ends
    and keeps every event (the auth pass then rejects the cycle)."""
    room = standard_room(get_room_version("11"))
    join = room.join(BOB)
    cyclic = room.build(C.MEMBER, CAROL, {"membership": C.JOIN}, CAROL,
                        auth_ids=[*room.state.values(), "$later"])
    ordered = auth_order([cyclic, *room.events.values()])
    assert len(ordered) == len(room.events) + 1 and ordered[-1].event_id in {cyclic.event_id, join.event_id}


@pytest.mark.parametrize("version", VERSIONS)
def test_one_pass_accepts_a_valid_room(version: str) -> None:
    room = standard_room(get_room_version(version))
    for user in (BOB, CAROL, EVE):
        room.join(user)
    events = list(room.events.values())
    random.Random(1).shuffle(events)
    assert check_auth_in_order(room.room_version, auth_order(events)) == {}


def test_one_pass_rejects_a_forbidden_event_and_whatever_cites_it() -> None:
    """An invite-only room: Eve's join is not allowed; an event citing Eve's join as an auth
    event is rejected because of it; an event citing an event not in the batch is rejected."""
    room = standard_room(get_room_version("11"), C.INVITE)
    bad_join = room.build(C.MEMBER, EVE, {"membership": C.JOIN}, EVE)
    state_before = dict(room.state)
    room.events[bad_join.event_id] = bad_join
    room.state[(C.MEMBER, EVE)] = bad_join.event_id
    room.last = [bad_join.event_id]
    leave = room.add(C.MEMBER, EVE, {"membership": C.LEAVE}, EVE)
    orphan = room.build(C.MEMBER, ALICE, {"membership": C.INVITE}, BOB,
                        auth_ids=[state_before[(C.CREATE, "")], "$not-in-the-batch"]) \
        if room.room_version.create_event_in_auth_events else room.build(
            C.MEMBER, ALICE, {"membership": C.INVITE}, BOB, auth_ids=["$not-in-the-batch"])
    events = [*room.events.values(), orphan]
    rejected = check_auth_in_order(room.room_version, auth_order(events))
    assert set(rejected) == {bad_join.event_id, leave.event_id, orphan.event_id}
    assert "rejected" in rejected[leave.event_id]
    # Known events (stored already) stand in for auth events the batch lacks.
    without_alice = [e for e in events if e.event_id != state_before[(C.MEMBER, ALICE)]]
    known = {state_before[(C.MEMBER, ALICE)]: room.events[state_before[(C.MEMBER, ALICE)]]}
    assert set(check_auth_in_order(room.room_version, auth_order(without_alice), known)) == set(rejected)
    # The state leaves the rejected out.
    state = state_map(events, rejected)
    assert (C.MEMBER, EVE) not in state and state[(C.MEMBER, ALICE)] == state_before[(C.MEMBER, ALICE)]


def test_state_map_prefers_the_deeper_of_two_events_for_one_key() -> None:
    room = standard_room(get_room_version("11"))
    first = room.join(BOB)
    second = room.add(C.MEMBER, BOB, {"membership": C.JOIN, "displayname": "Bob"}, BOB)
    assert state_map([second, first], {})[(C.MEMBER, BOB)] == second.event_id
    assert state_map([first, second], {second.event_id: "no"})[(C.MEMBER, BOB)] == first.event_id
