"""State resolution v1 (room version 1) on hand-built forks, worked out from the spec's steps.

The algorithm: R = the states' union minus conflicting keys; then the conflicted power
levels, join rules and members, each by ascending depth (descending sha1 of the ID) as long
as each next event passes auth against R; then every other conflicted key by highest depth
(lowest sha1) among the candidates that pass against R.
"""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from homeserver.events import resolve_state
from homeserver.events import constants as C
from homeserver.events.room_versions import V1, V2
from homeserver.events.state_res import resolve_state_v1

from .helpers import ALICE, BOB, CAROL, RoomBuilder, standard_room


def _resolve(*branches: RoomBuilder) -> dict[tuple[str, str], str]:
    event_map = branches[0].events
    results = [resolve_state(V1, [b.state for b in order], event_map) for order in itertools.permutations(branches)]
    assert all(r == results[0] for r in results), "resolution must not depend on the order of state sets"
    return results[0]


def test_no_conflict_and_one_sided_keys_are_kept() -> None:
    """A key only one state has is not a conflict in v1 (v2 would treat it as one)."""
    room = standard_room(V1, bob_level=50)
    room.join(BOB)
    left, right = room, room.fork()
    topic = right.add(C.TOPIC, BOB, {"topic": "only here"}, "")
    assert resolve_state(V1, [room.state], room.events) == room.state
    resolved = _resolve(left, right)
    assert resolved[(C.TOPIC, "")] == topic.event_id
    assert resolved == right.state


def test_power_levels_apply_in_depth_order_while_allowed() -> None:
    """Alice raises Carol on one branch (depth d+1); on the other she sets two levels in a
    row (d+1, d+2). The candidates are the first branch's event and the second's latest:
    the shallower goes into R first, the deeper one is allowed (Alice has 100) and wins."""
    room = standard_room(V1)
    room.join(BOB)
    room.join(CAROL)
    one, two = room, room.fork()
    one.power_levels(ALICE, {ALICE: 100, CAROL: 10})
    two.power_levels(ALICE, {ALICE: 100, BOB: 10})
    latest = two.power_levels(ALICE, {ALICE: 100, BOB: 20})
    assert _resolve(one, two)[(C.POWER_LEVELS, "")] == latest.event_id


def test_power_levels_stop_at_the_first_event_not_allowed() -> None:
    """Alice demotes Bob (50 -> 0) while Bob, on another branch, makes two power level
    changes at his level. The demotion is shallower, so it goes into R first; Bob's deeper
    event fails against it (Bob now has 0), so the demotion stands."""
    room = standard_room(V1, bob_level=50)
    room.join(BOB)
    room.join(CAROL)
    demoting, bobs = room, room.fork()
    demotion = demoting.power_levels(ALICE, {ALICE: 100, BOB: 0})
    bobs.power_levels(BOB, {ALICE: 100, BOB: 50, CAROL: 10})
    bobs.power_levels(BOB, {ALICE: 100, BOB: 50, CAROL: 20})
    assert _resolve(demoting, bobs)[(C.POWER_LEVELS, "")] == demotion.event_id


def test_ban_wins_and_the_banned_users_deeper_topic_loses() -> None:
    """Alice sets a topic then bans Bob; Bob, on the other branch, sets two topics (deeper).
    The member conflict (Bob's join vs the ban) resolves to the ban (allowed in R); then
    the topic conflict picks the deepest topic that passes against R: not Bob's (banned),
    so Alice's."""
    room = standard_room(V1, bob_level=50)
    room.join(BOB)
    banning, bobs = room, room.fork()
    alices_topic = banning.add(C.TOPIC, ALICE, {"topic": "alice"}, "")
    ban = banning.member(ALICE, BOB, C.BAN)
    bobs.add(C.TOPIC, BOB, {"topic": "bob 1"}, "")
    bobs.add(C.TOPIC, BOB, {"topic": "bob 2"}, "")
    bobs.add(C.TOPIC, BOB, {"topic": "bob 3"}, "")
    resolved = _resolve(banning, bobs)
    assert resolved[(C.MEMBER, BOB)] == ban.event_id
    assert resolved[(C.TOPIC, "")] == alices_topic.event_id


def test_normal_conflicts_take_the_deepest_allowed_event() -> None:
    room = standard_room(V1, bob_level=50)
    room.join(BOB)
    one, two = room, room.fork()
    one.add(C.TOPIC, ALICE, {"topic": "shallow"}, "")
    two.add(C.NAME, BOB, {"name": "x"}, "")
    deep = two.add(C.TOPIC, BOB, {"topic": "deep"}, "")
    assert _resolve(one, two)[(C.TOPIC, "")] == deep.event_id


def test_v2_rooms_do_not_use_it() -> None:
    """The same one-sided key in a v2 room goes through v2's iterative checks instead."""
    room = standard_room(V2, bob_level=50)
    room.join(BOB)
    left, right = room, room.fork()
    left.member(ALICE, BOB, C.BAN)
    right.add(C.TOPIC, BOB, {"topic": "from a banned user"}, "")
    resolved = resolve_state(V2, [left.state, right.state], room.events)
    assert (C.TOPIC, "") not in resolved


# --- property: determinism -------------------------------------------------------------

_ACTIONS = st.lists(
    st.tuples(st.integers(0, 1), st.sampled_from(["topic", "name", "ban", "pl", "join_rules"]),
              st.sampled_from([ALICE, BOB, CAROL])),
    max_size=8,
)


@settings(max_examples=40, deadline=None)
@given(_ACTIONS)
def test_resolution_is_deterministic_and_only_picks_given_events(actions: list[tuple[int, str, str]]) -> None:
    """Random concurrent changes on two branches: the result does not depend on the order of
    the state sets or on repeating one, every value is one of the inputs' values for that
    key, and resolving the result with itself changes nothing."""
    room = standard_room(V1, bob_level=50)
    room.join(BOB)
    room.join(CAROL)
    branches = [room, room.fork()]
    for n, (branch_index, action, user) in enumerate(actions):
        branch = branches[branch_index]
        if action == "topic":
            branch.add(C.TOPIC, user, {"topic": str(n)}, "")
        elif action == "name":
            branch.add(C.NAME, user, {"name": str(n)}, "")
        elif action == "ban":
            branch.member(user, CAROL if user != CAROL else BOB, C.BAN)
        elif action == "pl":
            branch.power_levels(user, {ALICE: 100, BOB: 50, CAROL: n})
        else:
            branch.join_rules(user, C.PUBLIC if n % 2 else C.JR_INVITE)
    states = [b.state for b in branches]
    resolved = resolve_state_v1(V1, states, room.events)
    assert resolve_state_v1(V1, list(reversed(states)), room.events) == resolved
    assert resolve_state_v1(V1, [*states, states[0]], room.events) == resolved
    for key, event_id in resolved.items():
        assert event_id in {s.get(key) for s in states}
    assert resolve_state_v1(V1, [resolved, dict(resolved)], room.events) == resolved
