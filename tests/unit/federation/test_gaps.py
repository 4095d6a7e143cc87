"""The pure ordering behind gap filling: parents before children, and where a walk back continues."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st
from signedjson.key import generate_signing_key

from homeserver.events import DEFAULT_ROOM_VERSION, FrozenEvent, sign_pdu
from homeserver.federation.gaps import gap_edge, topological_order, unknown_prevs

KEY = generate_signing_key("k1")
ROOM = "!room:a.test"


def _event(n: int, prevs: list[str], depth: int) -> FrozenEvent:
    pdu = {"room_id": ROOM, "sender": "@u:a.test", "type": "m.room.message", "content": {"body": str(n)},
           "prev_events": prevs, "auth_events": [], "depth": depth, "origin_server_ts": n}
    return sign_pdu(DEFAULT_ROOM_VERSION, pdu, "a.test", KEY)


def _chain(n: int, first_prev: str = "$before") -> list[FrozenEvent]:
    events: list[FrozenEvent] = []
    prev = first_prev
    for i in range(n):
        events.append(_event(i, [prev], 10 + i))
        prev = events[-1].event_id
    return events


def test_a_shuffled_chain_comes_back_in_order() -> None:
    chain = _chain(8)
    shuffled = list(chain)
    random.Random(4).shuffle(shuffled)
    assert topological_order(shuffled) == chain


def test_parents_come_first_even_when_a_child_claims_less_depth() -> None:
    """A sender's depth is a claim: a child that says it is shallower than its parent still comes after it."""
    parent = _event(1, ["$x"], 50)
    child = _event(2, [parent.event_id], 3)
    assert topological_order([child, parent]) == [parent, child]


def test_duplicates_are_kept_once() -> None:
    chain = _chain(3)
    assert topological_order(chain + chain) == chain


def test_gap_edge_is_the_events_whose_prevs_are_unknown() -> None:
    chain = _chain(5)
    assert gap_edge(chain, known=set()) == [chain[0]]
    assert gap_edge(chain, known={"$before"}) == []
    assert unknown_prevs(chain, known=set()) == {"$before"}
    # Two orphans on separate branches, one of them behind a known event.
    other = _event(9, ["$elsewhere"], 3)
    joined = _event(10, [chain[-1].event_id, "$known"], 20)
    assert gap_edge([*chain, other, joined], known={"$known"}) == [other, chain[0]]
    assert unknown_prevs([*chain, other, joined], known={"$known"}) == {"$before", "$elsewhere"}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(min_value=0, max_value=30), max_size=3), min_size=1, max_size=12),
       st.randoms(use_true_random=False))
def test_every_event_follows_its_parents_in_the_batch(parent_choices: list[list[int]], rnd: random.Random) -> None:
    """Any DAG (each event's parents drawn among the earlier ones), shuffled: the order puts
    each event after every parent of it that is in the batch, and keeps every event once."""
    events: list[FrozenEvent] = []
    for i, choices in enumerate(parent_choices):
        parents = sorted({events[c % i].event_id for c in choices}) if i else ["$root"]
        events.append(_event(i, parents or ["$root"], rnd.randint(1, 100)))
    shuffled = list(events)
    rnd.shuffle(shuffled)
    ordered = topological_order(shuffled)
    assert sorted(e.event_id for e in ordered) == sorted(e.event_id for e in events)
    position = {e.event_id: i for i, e in enumerate(ordered)}
    for event in ordered:
        for prev in event.prev_event_ids:
            if prev in position:
                assert position[prev] < position[event.event_id]


def test_one_gap_fill_per_room_at_a_time() -> None:
    """Two transactions for the same room: the second waits for the first; another room does not
    wait; once nobody holds or waits for a room, its lock is gone from the table."""
    from twisted.internet.defer import Deferred

    from homeserver.federation.gaps import GapFiller

    filler = GapFiller(store=None, loader=None, persister=None, keyring=None, client=None,  # type: ignore[arg-type]
                       metrics=None, limiter=None, clock=lambda: 0.0)  # type: ignore[arg-type]
    log: list[str] = []
    release_first: Deferred[None] = Deferred()

    async def fill(room: str, name: str, wait: Deferred[None] | None = None) -> None:
        async with filler.room_lock(room):
            log.append(f"{name} in")
            if wait is not None:
                await wait
            log.append(f"{name} out")

    first = Deferred.fromCoroutine(fill("!a", "first", release_first))
    second = Deferred.fromCoroutine(fill("!a", "second"))
    other = Deferred.fromCoroutine(fill("!b", "other"))
    assert log == ["first in", "other in", "other out"]
    release_first.callback(None)
    assert log == ["first in", "other in", "other out", "first out", "second in", "second out"]
    assert first.called and second.called and other.called
    assert filler._locks == {}


def test_a_cancelled_waiter_does_not_wedge_the_room() -> None:
    from twisted.internet.defer import CancelledError, Deferred

    from homeserver.federation.gaps import GapFiller

    filler = GapFiller(store=None, loader=None, persister=None, keyring=None, client=None,  # type: ignore[arg-type]
                       metrics=None, limiter=None, clock=lambda: 0.0)  # type: ignore[arg-type]
    release: Deferred[None] = Deferred()
    entered: list[str] = []

    async def fill(name: str, wait: Deferred[None] | None = None) -> None:
        async with filler.room_lock("!a"):
            entered.append(name)
            if wait is not None:
                await wait

    holder = Deferred.fromCoroutine(fill("holder", release))
    waiter = Deferred.fromCoroutine(fill("cancelled"))
    waiter.cancel()
    failures: list[object] = []
    waiter.addErrback(lambda f: failures.append(f.trap(CancelledError)))
    release.callback(None)
    assert holder.called and entered == ["holder"] and len(failures) == 1
    after = Deferred.fromCoroutine(fill("after"))
    assert after.called and entered == ["holder", "after"]
    assert filler._locks == {}
