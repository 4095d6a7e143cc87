"""What this process wrote at recent positions of the events stream, for its own readers.

Each time the events stream moves, readers in the same process (the federation sender's
fan-out, the user directory's updater) look at what the new positions hold, and each look is
a database round trip: for a message in a room with no other server, two round trips that
find nothing. The persister notes, for each event it commits, the facts those readers
need (is it a state event; does it go to other servers; did it notify anyone with a pusher;
its room, and whose membership it is), before its position completes, and a
reader (also the pushers' scan) skips its query over a range every position of which this
process noted and none of which is of interest to it. A waiting ``/sync`` sleeps through
events that are neither in its user's rooms nor about its user (``QuietWatch``): without it,
every event on the server woke every long-poll, which then read the database to find nothing.

It knows the positions this process wrote, and those of other writers whose replication rows
it received (``ReplicatedEventNotes``: a row tells the room, the type and the state key, so
what it cannot tell, fan-out and pushes, is noted as "yes"). A position whose transaction
rolled back, one only a ``POSITION`` covered, or one older than the last ``capacity`` notes
is unknown, and a range with any unknown position is read from the database as before. So a
skip is never wrong, only sometimes missed. Pure: no I/O, no clock; noted and read on the
reactor thread.
"""

# tests: tests/unit/storage/test_written_events.py

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Final

import attrs

DEFAULT_CAPACITY: Final = 10_000


@attrs.frozen(slots=True)
class WrittenEvent:
    """What one committed event is, as far as the stream's readers care."""

    # It has a state key (the user directory rewrites its room's rows).
    state: bool
    # It is a local event for other servers (``events.destinations`` is set: the fan-out reads it).
    fanout: bool
    # It notified a user with an ``http`` pusher, or that is not known (the pushers' scan reads it).
    pushes: bool = True
    # Its room; None: not known (a waiting /sync wakes for it).
    room_id: str | None = None
    # The user an ``m.room.member`` event is about (its state key), else None.
    member: str | None = None


class WrittenEvents:
    """The notes of the last ``capacity`` positions this process wrote."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self._capacity = capacity
        self._notes: OrderedDict[int, WrittenEvent] = OrderedDict()

    def note(self, position: int, written: WrittenEvent) -> None:
        """The event at ``position`` committed; call before the position completes."""
        self._notes[position] = written
        while len(self._notes) > self._capacity:
            self._notes.popitem(last=False)

    def nothing_for(self, after: int, upto: int, wanted: Callable[[WrittenEvent], bool]) -> bool:
        """True when every position in (after, upto] was noted here and none is ``wanted``:
        a reader looking for ``wanted`` events in that range would find none."""
        if upto <= after:
            return True
        if upto - after > len(self._notes):
            return False
        for position in range(after + 1, upto + 1):
            written = self._notes.get(position)
            if written is None or wanted(written):
                return False
        return True


def is_state(written: WrittenEvent) -> bool:
    return written.state


def is_fanout(written: WrittenEvent) -> bool:
    return written.fanout


def is_push(written: WrittenEvent) -> bool:
    return written.pushes


class QuietWatch:
    """For a ``/sync`` waiting from events position ``after``: whether the events stream moved
    only by events that cannot change its answer, those this process noted in rooms other than
    ``rooms`` (the user's joined rooms, as the sync that found nothing read them) and about
    another user's membership. Any position not noted here (a rolled-back transaction's, one
    forgotten, another writer's whose row has not come) counts as a change, so the sync never
    sleeps through one.
    Positions found quiet are not looked at again: each move costs the new positions only."""

    def __init__(self, written: WrittenEvents, user_id: str, rooms: frozenset[str], after: int) -> None:
        self._written = written
        self._user_id = user_id
        self._rooms = rooms
        self._checked = after

    def _concerns(self, written: WrittenEvent) -> bool:
        return written.room_id is None or written.room_id in self._rooms or written.member == self._user_id

    def quiet_upto(self, upto: int) -> bool:
        """True when nothing in (after, upto] concerns the user."""
        if upto <= self._checked:
            return True
        if not self._written.nothing_for(self._checked, upto, self._concerns):
            return False
        self._checked = upto
        return True


class ReplicatedEventNotes:
    """A replication ``RowHandler`` (register it before the one that advances the stream's
    generator): another writer's event rows noted at their positions, so a waiting ``/sync``
    here sleeps through those not for its user in a worker layout too. A position that came
    with other than one well-formed ``EventsStreamRow`` (event_id, room_id, type, state_key,
    sender) is left unknown."""

    def __init__(self, written: WrittenEvents) -> None:
        self._written = written

    def on_rows(self, stream: str, instance: str, token: int, rows: Sequence[object]) -> None:
        if stream != "events" or len(rows) != 1:
            return
        row = rows[0]
        if not isinstance(row, (list, tuple)) or len(row) != 5:
            return
        _, room_id, event_type, state_key, _ = row
        if type(room_id) is not str or type(event_type) is not str or not (state_key is None or type(state_key) is str):
            return
        member = state_key if event_type == "m.room.member" else None
        # Whether it went to other servers or notified a pusher, the row does not say: "yes",
        # so the readers that care (fan-out, pushers) read the database for it as before.
        self._written.note(token, WrittenEvent(state_key is not None, True, True, room_id, member))
