"""The notes a process keeps of the events it persisted: a range may be skipped only when
every position in it was noted and none is of interest."""

# tests: storage/kernel/written_events.py

from __future__ import annotations

from collections.abc import Callable

import pytest

from storage.kernel.written_events import (
    KeyNotes,
    QuietWatch,
    ReplicatedEventNotes,
    ReplicatedKeyNotes,
    WrittenEvent,
    WrittenEvents,
    events_concern,
    is_fanout,
    is_push,
    is_state,
    rooms_concern,
    user_concerns,
)

MESSAGE = WrittenEvent(state=False, fanout=False)
REMOTE_MESSAGE = WrittenEvent(state=False, fanout=True)
MEMBER = WrittenEvent(state=True, fanout=False)


def test_a_range_of_noted_uninteresting_positions_is_skippable() -> None:
    written = WrittenEvents()
    for position in (1, 2, 3):
        written.note(position, MESSAGE)
    assert written.nothing_for(0, 3, is_state) and written.nothing_for(0, 3, is_fanout)
    assert written.nothing_for(3, 3, is_state)  # an empty range holds nothing


def test_an_interesting_position_or_a_gap_means_read_the_database() -> None:
    written = WrittenEvents()
    written.note(1, MESSAGE)
    written.note(2, REMOTE_MESSAGE)
    written.note(4, MESSAGE)  # 3: another writer's, or a rolled-back transaction's
    assert not written.nothing_for(0, 2, is_fanout) and written.nothing_for(0, 2, is_state)
    assert written.nothing_for(3, 4, is_state)
    assert not written.nothing_for(2, 4, is_state)  # 3 unknown
    assert not written.nothing_for(4, 5, is_state)  # 5 not written yet
    written.note(5, MEMBER)
    assert not written.nothing_for(4, 5, is_state) and written.nothing_for(4, 5, is_fanout)


def test_only_the_last_capacity_positions_are_remembered() -> None:
    written = WrittenEvents(capacity=3)
    for position in range(1, 6):
        written.note(position, MESSAGE)
    assert written.nothing_for(2, 5, is_state)
    assert not written.nothing_for(1, 5, is_state)  # 2 was forgotten
    with pytest.raises(ValueError, match="capacity"):
        WrittenEvents(capacity=0)


def test_a_waiting_sync_is_quiet_through_other_rooms_and_other_users_memberships() -> None:
    written = WrittenEvents()
    watch = QuietWatch(written, events_concern("@bob:hs", frozenset({"!mine:hs"})), 10)
    written.note(11, WrittenEvent(False, False, room_id="!other:hs"))
    written.note(12, WrittenEvent(True, False, room_id="!other:hs", member="@carol:hs"))
    assert watch.quiet_upto(12) and watch.quiet_upto(10)
    written.note(13, WrittenEvent(False, False, room_id="!mine:hs"))
    assert not watch.quiet_upto(13)
    assert not watch.quiet_upto(13)  # still not: the sync must look


def test_a_waiting_sync_wakes_for_its_users_membership_an_unknown_room_or_position() -> None:
    written = WrittenEvents()
    written.note(1, WrittenEvent(True, False, room_id="!other:hs", member="@bob:hs"))  # an invite, say
    written.note(2, WrittenEvent(False, False))  # a note without its room
    written.note(4, WrittenEvent(False, False, room_id="!other:hs"))  # 3: another writer's
    for after, upto in ((0, 1), (1, 2), (2, 4)):
        assert not QuietWatch(written, events_concern("@bob:hs", frozenset()), after).quiet_upto(upto), (after, upto)
    assert QuietWatch(written, events_concern("@bob:hs", frozenset()), 3).quiet_upto(4)


class CountingNotes(WrittenEvents):
    """Notes that record how many positions each look covered."""

    def __init__(self) -> None:
        super().__init__()
        self.looked: list[int] = []

    def nothing_for(self, after: int, upto: int, wanted: Callable[[WrittenEvent], bool]) -> bool:
        self.looked.append(upto - after)
        return super().nothing_for(after, upto, wanted)


def test_a_quiet_watch_looks_at_each_position_once() -> None:
    written = CountingNotes()
    watch = QuietWatch(written, events_concern("@bob:hs", frozenset({"!mine:hs"})), 0)
    for position in range(1, 101):
        written.note(position, WrittenEvent(False, False, room_id=f"!r{position}:hs"))
        assert watch.quiet_upto(position)
    assert written.looked == [1] * 100  # not the whole wait's range again at every event


def test_another_writers_event_rows_are_noted_as_far_as_they_tell() -> None:
    written = WrittenEvents()
    notes = ReplicatedEventNotes(written)
    notes.on_rows("events", "persister1", 1, [("$a", "!other:hs", "m.room.message", None, "@carol:hs")])
    notes.on_rows("events", "persister1", 2, [["$b", "!other:hs", "m.room.member", "@dave:hs", "@dave:hs"]])
    watch = QuietWatch(written, events_concern("@bob:hs", frozenset({"!mine:hs"})), 0)
    assert watch.quiet_upto(2)
    assert written.nothing_for(0, 1, is_state) and not written.nothing_for(1, 2, is_state)
    # Whether they went to other servers or notified a pusher, rows do not say: read as before.
    assert not written.nothing_for(0, 1, is_fanout) and not written.nothing_for(0, 1, is_push)
    notes.on_rows("events", "persister1", 3, [("$c", "!mine:hs", "m.room.message", None, "@carol:hs")])
    assert not watch.quiet_upto(3)


def test_rows_that_do_not_tell_leave_their_position_unknown() -> None:
    written = WrittenEvents()
    notes = ReplicatedEventNotes(written)
    message = ("$a", "!other:hs", "m.room.message", None, "@carol:hs")
    notes.on_rows("typing", "persister1", 1, [message])  # another stream
    notes.on_rows("events", "persister1", 2, [message, message])  # two rows at one position
    notes.on_rows("events", "persister1", 3, [("$a", "!other:hs")])  # short
    notes.on_rows("events", "persister1", 4, [("$a", 7, "m.room.message", None, "@carol:hs")])  # not a room ID
    notes.on_rows("events", "persister1", 5, [])  # a position without rows
    for position in range(1, 6):
        assert not written.nothing_for(position - 1, position, is_state), position


def test_a_keyed_stream_is_quiet_through_other_rooms_or_users_only() -> None:
    notes = KeyNotes()
    rooms = QuietWatch(notes, rooms_concern(frozenset({"!mine:hs"})), 0)
    users = QuietWatch(notes, user_concerns("@bob:hs"), 0)
    notes.note(1, frozenset({"!other:hs", "@carol:hs"}))
    notes.note(2, frozenset())  # a to-device message only for other servers
    assert rooms.quiet_upto(2) and users.quiet_upto(2)
    assert not rooms.quiet_upto(3) and not users.quiet_upto(3)  # 3 not noted (yet)
    notes.note(3, frozenset({"!mine:hs", "!other:hs"}))
    assert not rooms.quiet_upto(3)
    notes.note(4, frozenset({"@carol:hs", "@bob:hs"}))
    assert not QuietWatch(notes, user_concerns("@bob:hs"), 3).quiet_upto(4)


def test_another_writers_keyed_rows_are_noted_by_their_first_column() -> None:
    typing, receipts, to_device = KeyNotes(), KeyNotes(), KeyNotes()
    handlers = [ReplicatedKeyNotes("typing", typing), ReplicatedKeyNotes("receipts", receipts),
                ReplicatedKeyNotes("to_device", to_device)]
    for handler in handlers:
        handler.on_rows("typing", "g1", 1, [("!a:hs", ("@carol:hs",))])
        handler.on_rows("receipts", "g1", 1, [("!b:hs", "m.read", "@carol:hs", None, "$e", "{}")])
        handler.on_rows("to_device", "g1", 1, [("@carol:hs",), ("other.example",)])  # one position, two rows
        handler.on_rows("typing", "g1", 2, [(7, ())])  # not a room ID: left unknown
        handler.on_rows("to_device", "g1", 2, [("@carol:hs",), ()])  # one row without a key: unknown
        handler.on_rows("receipts", "g1", 2, [])  # a position without rows: unknown
    assert typing.nothing_for(0, 1, rooms_concern(frozenset({"!b:hs"})))
    assert not typing.nothing_for(0, 1, rooms_concern(frozenset({"!a:hs"})))
    assert receipts.nothing_for(0, 1, rooms_concern(frozenset({"!a:hs"})))
    assert to_device.nothing_for(0, 1, user_concerns("@bob:hs"))
    assert not to_device.nothing_for(0, 1, user_concerns("@carol:hs"))
    for notes in (typing, receipts, to_device):
        assert not notes.nothing_for(1, 2, lambda _: False)
