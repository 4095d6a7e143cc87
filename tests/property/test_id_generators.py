"""Random interleavings of reserve / complete / cancel / announce on 1..5 writers.

A shared counter plays the PostgreSQL sequence. Each writer process has its own
``PositionTracker`` (its view of every writer); a pure reader has another.
Reserving is split the way it happens for real: the ticket is taken, later the
sequence hands out IDs ("draw"), later still they reach the tracker
("deliver"), so the tracker never knows about drawn-but-undelivered IDs.
Writers announce positions to each other and to the reader, sometimes late
(stale), as replication would.

Checked after every step, against a plain model of the definitions:
- no view of any writer ever reaches an ID that writer has not completed, and
  the reader's linear position stays below every uncompleted ID;
- no position ever goes backwards;
- a writer's own position is the largest value allowed by the definition
  (below its unfinished IDs, at most what it has seen, at most the floor of a
  reservation still waiting for its IDs); other views are the latest news;
- at the end, once everything completes and positions are exchanged, every
  view agrees on the largest ID anyone saw.
"""

from __future__ import annotations

import attrs
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from storage.id_generators import PositionTracker

READER = "reader"


@attrs.define
class Ticket:
    floor: int
    ids: list[int] | None = None  # drawn from the sequence, not yet delivered


@attrs.define
class WriterModel:
    tickets: dict[int, Ticket] = attrs.Factory(dict)
    in_flight: set[int] = attrs.Factory(set)
    uncompleted: set[int] = attrs.Factory(set)  # drawn (delivered or not), not completed
    max_seen: int = 0
    announced: list[int] = attrs.Factory(list)


class TrackerMachine(RuleBasedStateMachine):
    @initialize(count=st.integers(1, 5), start=st.integers(0, 2**40))
    def setup(self, count: int, start: int) -> None:
        self.writers = [f"w{i}" for i in range(count)]
        self.seq = start
        self.start = start
        everyone = {w: start for w in self.writers}
        self.trackers = {
            w: PositionTracker(writers=self.writers, positions=everyone, local_instance=w, max_seen=start)
            for w in self.writers
        }
        self.trackers[READER] = PositionTracker(writers=self.writers, positions=everyone)
        self.model = {w: WriterModel(max_seen=start, announced=[start]) for w in self.writers}
        # What each viewer should know of each other writer: the newest news it got.
        self.news = {(v, w): start for v in self.trackers for w in self.writers if v != w}
        self.last = {(v, w): start for v in self.trackers for w in self.writers}
        self.last_linear = start

    # --- helpers ---

    def _tickets(self, drawn: bool | None) -> list[tuple[str, int]]:
        return [
            (w, t)
            for w in self.writers
            for t, ticket in self.model[w].tickets.items()
            if drawn is None or (ticket.ids is not None) == drawn
        ]

    def _complete(self, writer: str, ids: list[int]) -> None:
        self.model[writer].uncompleted.difference_update(ids)

    # --- rules ---

    @rule(data=st.data())
    def begin(self, data: st.DataObject) -> None:
        w = data.draw(st.sampled_from(self.writers))
        ticket = self.trackers[w].begin_reservation()
        self.model[w].tickets[ticket] = Ticket(self.model[w].max_seen)

    @precondition(lambda self: self._tickets(drawn=False))
    @rule(data=st.data(), count=st.integers(1, 3))
    def draw(self, data: st.DataObject, count: int) -> None:
        w, t = data.draw(st.sampled_from(self._tickets(drawn=False)))
        ids = list(range(self.seq + 1, self.seq + count + 1))
        self.seq += count
        self.model[w].tickets[t].ids = ids
        self.model[w].uncompleted.update(ids)

    @precondition(lambda self: self._tickets(drawn=True))
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        w, t = data.draw(st.sampled_from(self._tickets(drawn=True)))
        ticket = self.model[w].tickets.pop(t)
        assert ticket.ids is not None
        self.trackers[w].allocated(ticket.ids, t)
        self.model[w].in_flight.update(ticket.ids)
        self.model[w].max_seen = max(self.model[w].max_seen, *ticket.ids)

    @precondition(lambda self: self._tickets(drawn=True))
    @rule(data=st.data())
    def deliver_completed(self, data: st.DataObject) -> None:
        """IDs reserved and written inside one transaction arrive already complete."""
        w, t = data.draw(st.sampled_from(self._tickets(drawn=True)))
        ticket = self.model[w].tickets.pop(t)
        assert ticket.ids is not None
        self.trackers[w].finish_reservation(t, ticket.ids)
        self._complete(w, ticket.ids)
        self.model[w].max_seen = max(self.model[w].max_seen, *ticket.ids)

    @precondition(lambda self: self._tickets(drawn=None))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        """The caller went away: drawn IDs (if any) will never be written."""
        w, t = data.draw(st.sampled_from(self._tickets(drawn=None)))
        ticket = self.model[w].tickets.pop(t)
        self.trackers[w].cancel_reservation(t)
        if ticket.ids is not None:
            self._complete(w, ticket.ids)

    @precondition(lambda self: any(self.model[w].in_flight for w in self.writers))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        w = data.draw(st.sampled_from([w for w in self.writers if self.model[w].in_flight]))
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model[w].in_flight)), min_size=1, unique=True))
        self.trackers[w].finished(ids)
        self.model[w].in_flight.difference_update(ids)
        self._complete(w, ids)

    def _deliver_news(self, src: str, dst: str, position: int) -> None:
        self.trackers[dst].advance(src, position)
        self.news[(dst, src)] = max(self.news[(dst, src)], position)
        if dst != READER:
            self.model[dst].max_seen = max(self.model[dst].max_seen, position)

    @rule(data=st.data())
    def announce(self, data: st.DataObject) -> None:
        src = data.draw(st.sampled_from(self.writers))
        dst = data.draw(st.sampled_from([v for v in self.trackers if v != src]))
        position = self.trackers[src].get_position(src)
        self.model[src].announced.append(position)
        self._deliver_news(src, dst, position)

    @rule(data=st.data())
    def announce_stale(self, data: st.DataObject) -> None:
        """An old POSITION arrives late (another connection, a replay)."""
        src = data.draw(st.sampled_from(self.writers))
        dst = data.draw(st.sampled_from([v for v in self.trackers if v != src]))
        self._deliver_news(src, dst, data.draw(st.sampled_from(self.model[src].announced)))

    # --- the model of a writer's own position ---

    def expected_own_position(self, w: str) -> int:
        """The largest X the definition allows, never below the previous value: X is at
        most what w has seen, below every unfinished ID of w, and at most the floor of
        every reservation of w whose IDs have not been delivered (they may be X + 1)."""
        model = self.model[w]
        x = self.last[(w, w)]
        while (
            x + 1 <= model.max_seen
            and all(i > x + 1 for i in model.in_flight)
            and all(t.floor >= x + 1 for t in model.tickets.values())
        ):
            x += 1
        return x

    # --- invariants ---

    @invariant()
    def positions_are_safe_monotonic_and_as_modelled(self) -> None:
        if not hasattr(self, "writers"):
            return
        for viewer, tracker in self.trackers.items():
            for w in self.writers:
                position = tracker.get_position(w)
                uncompleted = self.model[w].uncompleted
                assert not uncompleted or position < min(uncompleted), (viewer, w, position, sorted(uncompleted))
                assert position <= self.seq
                assert position >= self.last[(viewer, w)], ("went backwards", viewer, w)
                if viewer == w:
                    assert position == self.expected_own_position(w)
                else:
                    assert position == self.news[(viewer, w)]
                self.last[(viewer, w)] = position
        linear = self.trackers[READER].get_current_token()
        all_uncompleted = set().union(*(self.model[w].uncompleted for w in self.writers))
        assert not all_uncompleted or linear < min(all_uncompleted)
        assert linear >= self.last_linear
        self.last_linear = linear

    def teardown(self) -> None:
        if not hasattr(self, "writers"):
            return
        # Everything completes; then two rounds of everyone telling everyone.
        for w in self.writers:
            for t in list(self.model[w].tickets):
                self.trackers[w].cancel_reservation(t)
            self.trackers[w].finished(sorted(self.model[w].in_flight))
        highest = max(self.model[w].max_seen for w in self.writers)
        for _ in range(2):
            for src in self.writers:
                for dst in self.trackers:
                    if dst != src:
                        self.trackers[dst].advance(src, self.trackers[src].get_position(src))
        for viewer, tracker in self.trackers.items():
            assert tracker.get_positions() == {w: highest for w in self.writers}, viewer
            assert tracker.get_current_token() == highest


TrackerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=35, deadline=None)
TestPositionTracker = TrackerMachine.TestCase
