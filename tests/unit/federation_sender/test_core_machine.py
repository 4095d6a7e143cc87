"""Random histories of one destination: events, answers, failures, crashes, restarts.

A Hypothesis state machine drives one ``Destination`` in the fake world of
``world.py``: local events in three rooms (some written ahead of the stream's
position), EDUs and to-device messages, the destination answering 200 (with
or without per-PDU refusals), 4xx, 5xx, 429 or not at all, the loop crashing
while carrying out a request, the process being killed and restarted from
what the store holds, the destination contacting us, and time passing.

Checked after every step:
- the restart floor (``catch_up_from`` while catching up, else
  ``last_successful_stream_ordering``) never passes an event the destination
  has not answered for, and a room whose newest event is at or below
  ``last_successful_stream_ordering`` has had every event answered — so a
  sender killed right now would miss nothing;
- a position is only ever written for a transaction the destination answered;
- no transaction carries more than 50 PDUs or 100 EDUs, and each room's PDUs
  are in stream order within it;
- a catch-up transaction leaves the destination no gap: every older event of a
  room it carries was answered before, or comes earlier in it (issue 28: a
  crash-made gap must never need more than the receiver's get_missing_events).
And at the end, once the destination is healthy and time runs on: every event
and every to-device message was delivered, with catch-up's per-room bound
small (7) so rooms with longer gaps are sent in rounds.
"""

from __future__ import annotations

import attrs
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from federation_sender.core import SendTransaction
from federation_sender.queue import Edu
from tests.unit.federation_sender.world import CONFIG, World, pdu

ROOMS = ("!a", "!b", "!c")
STATUSES = (200, 200, 200, 500, None, 429, 400)
# A bound far below the gaps the rules make (up to 60 events at once), so rooms are caught up in rounds.
SMALL_ROUNDS = attrs.evolve(CONFIG, catch_up=attrs.evolve(CONFIG.catch_up, missed_events_per_room=7))


class DestinationMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.w = World(SMALL_ROUNDS)
        self.fanned_out = 0  # events up to here were handed to the destination's core
        self.answered_txns: set[str] = set()
        self.last_persisted = 0

    # --- the world moves ------------------------------------------------------------------------

    @rule(room=st.sampled_from(ROOMS), count=st.integers(1, 60))
    def events(self, room: str, count: int) -> None:
        w = self.w
        ahead = w.written > w.position
        pdus = [w.write(room, advance_position=False) for _ in range(count)]
        if not ahead:  # nothing written ahead of the position: persisted and fanned out at once
            w.advance_position(w.written)
            self.fanned_out = w.written
            w.feed(w.dest.on_pdus(pdus, w.now_ms))

    @rule(room=st.sampled_from(ROOMS))
    def event_ahead_of_the_position(self, room: str) -> None:
        """Persisted while an older event is still being written: the position waits."""
        self.w.write(room, advance_position=False)

    @precondition(lambda self: self.w.written > self.w.position)
    @rule()
    def position_catches_up(self) -> None:
        w = self.w
        start = self.fanned_out
        w.advance_position(w.written)
        self.fanned_out = w.written
        pdus = [pdu(o, w.events[o]) for o in range(start + 1, w.written + 1)]
        w.feed(w.dest.on_pdus(pdus, w.now_ms))

    @rule(n=st.integers(0, 5))
    def edu(self, n: int) -> None:
        self.w.feed(self.w.dest.on_edu(Edu("m.device_list_update", {"n": n}), self.w.now_ms))

    @rule()
    def to_device(self) -> None:
        self.w.to_device({"ping": len(self.w.outbox)})

    @precondition(lambda self: self.w.request is not None and not isinstance(self.w.request, SendTransaction))
    @rule()
    def store_answers(self) -> None:
        self.w.step()

    @precondition(lambda self: isinstance(self.w.request, SendTransaction))
    @rule(status=st.sampled_from(STATUSES), refuse=st.booleans())
    def destination_answers(self, status: int | None, refuse: bool) -> None:
        w = self.w
        assert isinstance(w.request, SendTransaction)
        txn = w.request.txn
        errors = [(p.event_id, "not allowed") for p in txn.pdus[:1]] if refuse and status == 200 else []
        if status == 200 or status == 400:
            self.answered_txns.add(txn.txn_id)
        w.answer(status, errors)

    @precondition(lambda self: self.w.request is not None)
    @rule()
    def loop_crashes(self) -> None:
        self.w.crash_request()

    @rule()
    def process_restarts(self) -> None:
        w = self.w
        w.restart()
        # The new process fans out only from the stream's position on.
        self.fanned_out = w.position

    @rule()
    def destination_contacts_us(self) -> None:
        self.w.feed(self.w.dest.on_remote_up(self.w.now_ms))

    @rule(ms=st.integers(1, 3 * 60 * 60 * 1000))
    def time_passes(self, ms: int) -> None:
        self.w.advance_time(self.w.now_ms + ms)

    @precondition(lambda self: self.w.queued_wakes > 0)
    @rule()
    def rate_limited_wake_up(self) -> None:
        self.w.wake_queued()

    @rule()
    def periodic_scan(self) -> None:
        w = self.w
        if w.rooms_above(w.row.last_successful or 0, self.fanned_out):
            w.feed(w.dest.on_catch_up_found(w.now_ms, startup=False))

    # --- what must hold ---------------------------------------------------------------------------

    @invariant()
    def a_restart_now_would_miss_nothing(self) -> None:
        w = self.w
        floor = w.restart_floor()
        assert all(o > floor for o in w.unanswered()), (floor, w.unanswered()[:5], w.row)
        acked = w.row.last_successful or 0
        for room, newest in w.rooms_above(-1, None):
            if newest <= acked:
                missing = [o for o in w.unanswered() if w.events[o] == room]
                assert not missing, f"{room} (newest {newest}) counted done at {acked} but {missing} unanswered"

    @invariant()
    def positions_come_only_from_answers(self) -> None:
        for txn_id, _ in self.w.persisted_after:
            assert txn_id in self.answered_txns, f"a position written for {txn_id}, which was never answered"
        assert (self.w.row.last_successful or 0) >= self.last_persisted
        self.last_persisted = self.w.row.last_successful or 0

    @invariant()
    def transactions_are_bounded_and_ordered_per_room(self) -> None:
        for txn in self.w.attempts[-3:]:
            assert len(txn.pdus) <= 50 and len(txn.edus) <= 100
            for room in ROOMS:
                orderings = [p.stream_ordering or 0 for p in txn.pdus if p.room_id == room]
                assert orderings == sorted(orderings), (txn.txn_id, room, orderings)

    @invariant()
    def catch_up_leaves_no_gap(self) -> None:
        w = self.w
        if not isinstance(w.request, SendTransaction) or not w.request.txn.catch_up:
            return
        carried: set[int] = set()
        for p in w.request.txn.pdus:
            ordering = p.stream_ordering or 0
            gap = [o for o in w.unanswered() if o < ordering and w.events[o] == p.room_id and o not in carried]
            assert not gap, f"{w.request.txn.txn_id} sends {p.event_id} while {gap[:5]} of its room are unsent"
            carried.add(ordering)

    def teardown(self) -> None:
        """The destination comes back for good: everything ends up delivered."""
        w = self.w
        if w.written > w.position:
            self.position_catches_up()
        w.feed(w.dest.on_remote_up(w.now_ms))
        for _ in range(10_000):
            if isinstance(w.request, SendTransaction):
                self.answered_txns.add(w.request.txn.txn_id)
                w.answer(200)
            elif w.request is not None:
                w.step()
            elif w.queued_wakes:
                w.wake_queued()
            elif w.wakes:
                w.advance_time(min(w.wakes))
            else:
                break
        else:
            raise AssertionError("never settled")
        assert w.unanswered() == [], f"never delivered: {w.unanswered()[:10]} (row {w.row})"
        assert w.outbox == [], "to-device messages left in the outbox"
        assert w.dest.is_idle()


DestinationMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
TestDestinationMachine = DestinationMachine.TestCase
