"""State resolution on hand-built forked DAGs whose outcome we can reason about.

Each scenario forks a room into two branches, makes conflicting changes, and resolves the
two branch states; the expected result is worked out in the docstring. Every scenario
runs for v10/v11 (state res v2) and v12 (v2.1: empty start, conflicted subgraph).
"""

from __future__ import annotations

import itertools

import pytest

from homeserver.events import MissingEventsError, resolve_state
from homeserver.events import constants as C
from homeserver.events.room_versions import ALL_ROOM_VERSIONS, V10, V11, V12, RoomVersion, StateResAlgorithm
from homeserver.events.state_res import auth_chain, conflicted_state_subgraph, is_power_event

from .helpers import ALICE, BOB, CAROL, RoomBuilder, standard_room

ALL = [v for v in ALL_ROOM_VERSIONS if v.state_res is not StateResAlgorithm.V1]


def _users(version: RoomVersion, levels: dict[str, int]) -> dict[str, int]:
    return levels if version.privileged_creators else {ALICE: 100, **levels}


def _resolve(version: RoomVersion, *branches: RoomBuilder) -> dict[tuple[str, str], str]:
    event_map = branches[0].events
    results = [
        resolve_state(version, [b.state for b in order], event_map)
        for order in itertools.permutations(branches)
    ]
    assert all(r == results[0] for r in results), "resolution must not depend on the order of state sets"
    return results[0]


@pytest.mark.parametrize("version", ALL)
def test_no_conflict_returns_the_state(version: RoomVersion) -> None:
    room = standard_room(version)
    assert resolve_state(version, [room.state], room.events) == room.state
    assert resolve_state(version, [room.state, dict(room.state)], room.events) == room.state
    assert resolve_state(version, [], room.events) == {}


@pytest.mark.parametrize("version", ALL)
def test_ban_beats_concurrent_topic_from_the_banned_user(version: RoomVersion) -> None:
    """Alice (100) bans Bob (50) while Bob, on another branch, sets the topic.

    The ban is a power event and is applied first; Bob's topic (and his concurrent
    join event, which is on the losing side of the member conflict) then fail auth
    because Bob is banned. Result: Bob banned, no topic.
    """
    room = standard_room(version, bob_level=50)
    room.join(BOB)
    banning, topical = room, room.fork()
    ban = banning.member(ALICE, BOB, C.BAN)
    topical.add(C.TOPIC, BOB, {"topic": "bob was here"}, "")

    resolved = _resolve(version, banning, topical)
    assert resolved[(C.MEMBER, BOB)] == ban.event_id
    assert (C.TOPIC, "") not in resolved
    assert resolved[(C.MEMBER, ALICE)] == banning.state[(C.MEMBER, ALICE)]


@pytest.mark.parametrize("version", ALL)
def test_join_races_a_change_to_invite_only(version: RoomVersion) -> None:
    """Alice makes the public room invite-only while Bob joins on another branch.

    Both join-rules events are power events, sorted parents-first then by timestamp, so
    "invite" ends up applied last; Bob's join (not a power event) is checked afterwards
    against invite-only and fails. Result: join rule invite, Bob not a member.
    """
    room = standard_room(version, C.PUBLIC)
    closing, joining = room, room.fork()
    invite_only = closing.join_rules(ALICE, C.JR_INVITE)
    joining.join(BOB)

    resolved = _resolve(version, closing, joining)
    assert resolved[(C.JOIN_RULES, "")] == invite_only.event_id
    assert (C.MEMBER, BOB) not in resolved


@pytest.mark.parametrize("version", ALL)
def test_power_level_fork_higher_sender_wins(version: RoomVersion) -> None:
    """Alice (100) demotes Bob (50) to 0 while Bob promotes Carol to 50, and Carol,
    now at 50 on Bob's branch, sets the topic.

    Power events sort by their senders' power: Alice's change is applied first; Bob's is
    then checked against it (Bob at 0 may not send power levels) and dropped. Carol's
    topic is ordered by mainline and fails (Carol is at 0). Result: Alice's levels, no topic.
    """
    room = standard_room(version, bob_level=50)
    room.join(BOB)
    room.join(CAROL)
    demoting, promoting = room, room.fork()
    alice_pl = demoting.power_levels(ALICE, _users(version, {BOB: 0}))
    promoting.power_levels(BOB, _users(version, {BOB: 50, CAROL: 50}))
    promoting.add(C.TOPIC, CAROL, {"topic": "carol's"}, "")

    resolved = _resolve(version, demoting, promoting)
    assert resolved[(C.POWER_LEVELS, "")] == alice_pl.event_id
    assert (C.TOPIC, "") not in resolved


@pytest.mark.parametrize("version", ALL)
def test_topic_fork_same_power_levels_later_timestamp_wins(version: RoomVersion) -> None:
    """Two topics citing the same power levels: same mainline position, so the later
    ``origin_server_ts`` is applied last and wins."""
    room = standard_room(version, bob_level=50)
    room.join(BOB)
    first, second = room, room.fork()
    first.add(C.TOPIC, ALICE, {"topic": "early"}, "", ts=5_000_000)
    late = second.add(C.TOPIC, BOB, {"topic": "late"}, "", ts=6_000_000)
    assert _resolve(version, first, second)[(C.TOPIC, "")] == late.event_id


@pytest.mark.parametrize("version", ALL)
def test_topic_fork_resolved_by_mainline_not_timestamp(version: RoomVersion) -> None:
    """Branch 1: Alice sets topic A late (ts 9). Branch 2: Alice changes the power levels
    (P2), then Bob sets topic B early (ts 8), citing P2.

    The resolved power levels are P2 (it descends from the old levels), whose mainline is
    [P2, P1, ...]. Topic A cites P1 (position 1), topic B cites P2 (position 0); greater
    positions sort first, so A is applied before B and B wins despite its earlier timestamp.
    """
    room = standard_room(version, bob_level=50)
    room.join(BOB)
    branch_a, branch_b = room, room.fork()
    branch_a.add(C.TOPIC, ALICE, {"topic": "A"}, "", ts=9_000_000)
    p2 = branch_b.power_levels(ALICE, _users(version, {BOB: 50}), events_default=0, ts=7_000_000)
    topic_b = branch_b.add(C.TOPIC, BOB, {"topic": "B"}, "", ts=8_000_000)

    resolved = _resolve(version, branch_a, branch_b)
    assert resolved[(C.POWER_LEVELS, "")] == p2.event_id
    assert resolved[(C.TOPIC, "")] == topic_b.event_id


@pytest.mark.parametrize("version", ALL)
def test_unconflicted_state_survives(version: RoomVersion) -> None:
    """State both branches agree on is kept even when the resolution would drop it."""
    room = standard_room(version, bob_level=50)
    room.join(BOB)
    name = room.add(C.NAME, BOB, {"name": "shared name"}, "")
    banning, other = room, room.fork()
    banning.member(ALICE, BOB, C.BAN)
    other.add(C.TOPIC, ALICE, {"topic": "t"}, "")
    resolved = _resolve(version, banning, other)
    assert resolved[(C.NAME, "")] == name.event_id


def test_missing_conflicted_event_is_a_typed_error() -> None:
    room = standard_room(V11)
    a, b = room, room.fork()
    topic = a.add(C.TOPIC, ALICE, {"topic": "x"}, "")
    b.add(C.TOPIC, ALICE, {"topic": "y"}, "")
    events = {k: v for k, v in room.events.items() if k != topic.event_id}
    with pytest.raises(MissingEventsError):
        resolve_state(V11, [a.state, b.state], events)


def test_conflicted_state_subgraph_is_the_paths_between_conflicted_events() -> None:
    """Auth edges: pl2 -> bob_join -> pl1 -> alice_join, and pl2 -> alice_join. With
    conflicted {pl2, pl1} the subgraph is the path pl2 -> bob_join -> pl1; alice's join
    is reachable from both but leads to no conflicted event, so it is not between them."""
    room = RoomBuilder(V12)
    create = room.create(ALICE)
    join = room.join(ALICE)
    pl1 = room.power_levels(ALICE, {})
    bob_join = room.build(C.MEMBER, BOB, {"membership": C.JOIN}, BOB, auth_ids=[pl1.event_id, join.event_id])
    room.events[bob_join.event_id] = bob_join
    pl2 = room.build(C.POWER_LEVELS, ALICE, {"users": {}}, "", auth_ids=[bob_join.event_id, join.event_id])
    room.events[pl2.event_id] = pl2
    subgraph = conflicted_state_subgraph({pl2.event_id, pl1.event_id}, room.events)
    assert subgraph == {pl2.event_id, bob_join.event_id, pl1.event_id}
    assert create.event_id not in subgraph and join.event_id not in subgraph
    assert conflicted_state_subgraph({pl1.event_id}, room.events) == {pl1.event_id}
    assert auth_chain([pl2.event_id], room.events) == {bob_join.event_id, pl1.event_id, join.event_id}


def test_power_events() -> None:
    room = standard_room(V11)
    room.join(BOB)
    assert is_power_event(room.events[room.state[(C.POWER_LEVELS, "")]])
    assert is_power_event(room.build(C.MEMBER, ALICE, {"membership": C.LEAVE}, BOB))
    assert not is_power_event(room.build(C.MEMBER, BOB, {"membership": C.LEAVE}, BOB))
    assert not is_power_event(room.build(C.TOPIC, ALICE, {"topic": "t"}, ""))


@pytest.mark.parametrize("version", ALL)
def test_demotion_beats_an_earlier_ban_by_the_demoted_user(version: RoomVersion) -> None:
    """Bob (50, ban level 50) bans Carol at ts 5 while Alice (100), at ts 6, demotes Bob.

    Both are power events. Ordered by sender power (not timestamp), Alice's demotion is
    applied first; Bob's ban is then checked with Bob at 0 and dropped. Result: Carol
    stays joined, Alice's power levels win. (A timestamp order would keep the ban.)
    """
    room = standard_room(version, bob_level=50)
    room.join(BOB)
    carol_join = room.join(CAROL)
    demoting, banning = room, room.fork()
    banning.member(BOB, CAROL, C.BAN, ts=5_000_000)
    alice_pl = demoting.power_levels(ALICE, _users(version, {BOB: 0}), ts=6_000_000)

    resolved = _resolve(version, demoting, banning)
    assert resolved[(C.POWER_LEVELS, "")] == alice_pl.event_id
    assert resolved[(C.MEMBER, CAROL)] == carol_join.event_id


@pytest.mark.parametrize("version", ALL)
def test_unconflicted_leave_does_not_reset_an_earlier_power_event_in_v12(version: RoomVersion) -> None:
    """Bob (100) changes the power levels (PL1) while, concurrently, he leaves the room.

    State sets: A = {old levels PL0, Bob left}, B = {PL1, Bob left}; Bob's leave is
    unconflicted. v2 runs the iterative auth checks from the unconflicted state, where
    Bob has already left, so his PL1 is rejected and PL0 stays. v2.1 (room v12) gets PL1
    applied by either of its two changes: it starts from empty state (PL1 is checked with
    Bob's membership from its own auth events: joined), and Bob's join lies on the auth
    path PL1 -> join -> PL0, so the conflicted state subgraph re-applies it before PL1.
    """
    room = standard_room(version, bob_level=100)
    room.join(BOB)
    room.join(CAROL)
    pl0 = room.state[(C.POWER_LEVELS, "")]
    leaving, changing = room, room.fork()
    leave = leaving.member(BOB, BOB, C.LEAVE)
    pl1 = changing.power_levels(BOB, _users(version, {BOB: 100, CAROL: 50}))
    state_b = dict(changing.state)
    state_b[(C.MEMBER, BOB)] = leave.event_id

    resolved = resolve_state(version, [leaving.state, state_b], room.events)
    assert resolved[(C.MEMBER, BOB)] == leave.event_id
    expected = pl1.event_id if version is V12 else pl0
    assert resolved[(C.POWER_LEVELS, "")] == expected
