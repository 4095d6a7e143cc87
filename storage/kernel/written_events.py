"""What is at recent positions of the events stream (and what the positions of the
room- and user-keyed streams are about, ``KeyNotes``), for this process's own readers.

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
from typing import Final, Generic, TypeVar

import attrs

DEFAULT_CAPACITY: Final = 10_000

T = TypeVar("T")


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


class PositionNotes(Generic[T]):
    """A note for each of the last ``capacity`` positions of a stream that this process knows of."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self._capacity = capacity
        self._notes: OrderedDict[int, T] = OrderedDict()

    def note(self, position: int, value: T) -> None:
        """What is at ``position``; call before the position completes."""
        self._notes[position] = value
        while len(self._notes) > self._capacity:
            self._notes.popitem(last=False)

    def nothing_for(self, after: int, upto: int, wanted: Callable[[T], bool]) -> bool:
        """True when every position in (after, upto] was noted here and none is ``wanted``:
        a reader looking for ``wanted`` ones in that range would find none."""
        if upto <= after:
            return True
        if upto - after > len(self._notes):
            return False
        for position in range(after + 1, upto + 1):
            value = self._notes.get(position)
            if value is None or wanted(value):
                return False
        return True


class WrittenEvents(PositionNotes[WrittenEvent]):
    """The notes of the last ``capacity`` positions of the events stream this process knows."""


class KeyNotes(PositionNotes[frozenset[str]]):
    """What each recent position of a stream is about, by key: the rooms of ``receipts`` and
    ``typing`` positions, the users of ``to_device`` and ``account_data`` ones (the local
    recipients; none for a message only to other servers). Noted by the stream's writer in
    this process, or from its replication rows."""


def is_state(written: WrittenEvent) -> bool:
    return written.state


def is_fanout(written: WrittenEvent) -> bool:
    return written.fanout


def is_push(written: WrittenEvent) -> bool:
    return written.pushes


class QuietWatch(Generic[T]):
    """For a ``/sync`` waiting from position ``after`` of a stream: whether the stream moved
    only by what cannot change its answer, positions noted here none of which ``concerns`` it
    (``events_concern``, ``rooms_concern``, ``user_concerns``). Any position not noted here (a rolled-back
    transaction's, one forgotten, another writer's whose row has not come) counts as a
    change, so the sync never sleeps through one. Positions found quiet are not looked at
    again: each move costs the new positions only."""

    def __init__(self, notes: PositionNotes[T], concerns: Callable[[T], bool], after: int) -> None:
        self._notes = notes
        self._concerns = concerns
        self._checked = after

    def quiet_upto(self, upto: int) -> bool:
        """True when nothing in (after, upto] concerns the sync."""
        if upto <= self._checked:
            return True
        if not self._notes.nothing_for(self._checked, upto, self._concerns):
            return False
        self._checked = upto
        return True


def events_concern(user_id: str, rooms: frozenset[str]) -> Callable[[WrittenEvent], bool]:
    """Events that may change ``user_id``'s sync: in ``rooms`` (the user's), about the user's
    membership, or of a room not known."""
    def concerns(written: WrittenEvent) -> bool:
        return written.room_id is None or written.room_id in rooms or written.member == user_id

    return concerns


def rooms_concern(rooms: frozenset[str]) -> Callable[[frozenset[str]], bool]:
    """Positions of a room-keyed stream that may change a sync: those of ``rooms``."""
    def concerns(keys: frozenset[str]) -> bool:
        return not rooms.isdisjoint(keys)

    return concerns


def user_concerns(user_id: str) -> Callable[[frozenset[str]], bool]:
    """Positions of a user-keyed stream that may change ``user_id``'s sync: those of the user."""
    def concerns(keys: frozenset[str]) -> bool:
        return user_id in keys

    return concerns


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


class ReplicatedKeyNotes:
    """A replication ``RowHandler`` (registered before the generators advance): what each
    position of ``stream`` that another writer sends is about, the first column of its rows
    (typing's and receipts' ``room_id``, account data's ``user_id``, to-device's ``entity``: a
    local user, or another server, which no local sync waits for), noted in ``notes``. A
    position without rows, or with a row whose first column is not a string, is left unknown."""

    def __init__(self, stream: str, notes: KeyNotes) -> None:
        self._stream = stream
        self._notes = notes

    def on_rows(self, stream: str, instance: str, token: int, rows: Sequence[object]) -> None:
        if stream != self._stream or not rows:
            return
        keys = set()
        for row in rows:
            if not isinstance(row, (list, tuple)) or not row or type(row[0]) is not str:
                return
            keys.add(row[0])
        self._notes.note(token, frozenset(keys))
