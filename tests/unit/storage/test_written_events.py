"""The notes a process keeps of the events it persisted: a range may be skipped only when
every position in it was noted and none is of interest."""

# tests: storage/kernel/written_events.py

from __future__ import annotations

import pytest

from storage.kernel.written_events import WrittenEvent, WrittenEvents, is_fanout, is_state

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
