"""Which received PDUs of a room can be checked and persisted together, and the state each sees.

Rule 1: a PDU joins the batch when its only prev event is one whose state after it is known:
stored in the room's graph (its state was loaded once, when the batch started) or earlier in
the batch. Its state before is that state; nothing is resolved.
Rule 2: the planner tracks the room's forward extremities and current state as the batch moves
them. A PDU that follows every extremity (the one-line case) moves both by what it changes; a
soft-failed PDU moves neither. A PDU that forks the room (not soft-failed) needs state
resolution, so it is not batched: the caller persists the batch so far, takes that PDU on its
own, and starts a new batch after it.

This module is pure: it knows no database, no signatures and no auth rules. The caller
(``transaction.TransactionHandler``) loads the room's starting point (``BatchStart``, one read), runs the
checks on the state the planner hands out and reports each outcome back.
"""

# tests: tests/unit/federation/test_batching.py

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs

from homeserver.events import FrozenEvent
from storage.stores.events import BatchStart

StateKey = tuple[str, str]
StateMap = Mapping[StateKey, str]


@attrs.frozen
class Plan:
    """What a batched PDU is checked against and how it is stored.

    ``state_before``: the state it was sent on. ``prev``: its one prev event. ``prev_group``: the
    state group after ``prev`` when that is stored (None: ``prev`` is earlier in the batch and its
    group is made in the batch's transaction). ``linear``: it follows every forward extremity.
    """

    state_before: StateMap
    prev: str
    prev_group: int | None
    linear: bool


def wanted_prevs(events: Iterable[FrozenEvent]) -> set[str]:
    """The prev events whose stored state a batch of ``events`` may start from: the single prev
    event of each that is not itself among ``events``."""
    listed = list(events)
    ids = {e.event_id for e in listed}
    return {e.prev_event_ids[0] for e in listed
            if len(set(e.prev_event_ids)) == 1 and e.prev_event_ids[0] not in ids}


class BatchPlanner:
    """Hands out the state each PDU of one room is checked against, in the order given."""

    def __init__(self, start: BatchStart) -> None:
        self._start = start
        self._extremities = set(start.extremities)
        self._current: dict[StateKey, str] = dict(start.current_state)
        self._state_after: dict[str, StateMap] = dict(start.state_after)
        self._in_batch: set[str] = set()

    @property
    def current_state(self) -> StateMap:
        """The room's current state as the batch so far leaves it."""
        return self._current

    @property
    def extremities(self) -> frozenset[str]:
        return frozenset(self._extremities)

    def plan(self, event: FrozenEvent) -> Plan | None:
        """The plan for ``event``, or None when it must take the one-event path (stored already,
        several prev events, no prev events, a prev event whose state is not known here)."""
        if event.event_id in self._start.stored or event.event_id in self._in_batch:
            return None
        prevs = set(event.prev_event_ids)
        if len(prevs) != 1:
            return None
        [prev] = prevs
        state = self._state_after.get(prev)
        if state is None:
            return None
        group = None if prev in self._in_batch else self._start.groups.get(prev)
        if group is None and prev not in self._in_batch:
            return None
        return Plan(state, prev, group, self._extremities == {prev})

    def batchable(self, plan: Plan, *, soft_failed: bool) -> bool:
        """Whether an event so planned and checked can be stored in the batch: only a fork that
        is not soft-failed cannot (the room's new current state needs state resolution)."""
        return plan.linear or soft_failed

    def record(self, event: FrozenEvent, plan: Plan, *, rejected: bool, soft_failed: bool) -> dict[StateKey, str]:
        """``event`` is in the batch with this outcome; returns what it changes in state (its
        delta: empty for a message or a rejected event)."""
        if not self.batchable(plan, soft_failed=soft_failed):
            raise ValueError(f"{event.event_id} forks the room and is not soft-failed: it cannot be batched")
        key = event.state_key_tuple
        delta = {key: event.event_id} if key is not None and not rejected else {}
        self._state_after[event.event_id] = {**plan.state_before, **delta} if delta else plan.state_before
        self._in_batch.add(event.event_id)
        if not soft_failed:
            # Linear: the event replaces the extremities (all of them were its prev events).
            self._extremities = {event.event_id}
            self._current.update(delta)
        return delta
