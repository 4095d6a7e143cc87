"""PositionTracker: the pure bookkeeping behind every stream position."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from storage.id_generators import PositionChange, PositionTracker, StreamIdError


def single_writer(position: int = 1) -> PositionTracker:
    return PositionTracker(writers=["w"], positions={"w": position}, local_instance="w", max_seen=position)


# The worked example of docs/development/synapse_architecture/streams.md (the streams
# seed): a single-writer stream initially at ID 1. Each step: action, current ID after it.
WORKED_EXAMPLE = [
    ("reserve", 2, 1),
    ("reserve", 3, 1),
    ("complete", 3, 1),  # waiting for 2 to complete
    ("complete", 2, 3),  # jumps from 1 to 3
    ("reserve", 4, 3),
    ("reserve", 5, 3),
    ("reserve", 6, 3),
    ("complete", 5, 3),
    ("complete", 4, 5),  # jumps 3 -> 5, even though 6 is pending
    ("complete", 6, 6),
]


def test_worked_example_from_the_streams_document() -> None:
    """The table in the streams document, step by step: reserving never moves the
    position; completing moves it to just below the smallest unfinished ID, or to
    the largest reserved ID when nothing is left in flight."""
    tracker = single_writer(1)
    assert tracker.get_current_token() == 1
    for action, stream_id, expected in WORKED_EXAMPLE:
        if action == "reserve":
            tracker.allocated([stream_id], tracker.begin_reservation())
        else:
            tracker.finished([stream_id])
        assert tracker.get_current_token() == expected, (action, stream_id)
        assert tracker.get_position("w") == expected


def test_the_streams_doc_shows_the_same_table() -> None:
    doc = (Path(__file__).resolve().parents[3] / "docs" / "streams.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| (reserve|complete) (\d+) \| (\d+) \|", doc, flags=re.MULTILINE)
    assert [(a, int(i), int(p)) for a, i, p in rows] == WORKED_EXAMPLE


def test_changes_are_reported_once_with_old_and_new() -> None:
    tracker = single_writer(1)
    assert tracker.allocated([2, 3], tracker.begin_reservation()) == []
    assert tracker.finished([3]) == []
    assert tracker.finished([2]) == [PositionChange("w", 1, 3)]


def test_a_pending_reservation_holds_the_position_at_its_floor() -> None:
    """Reservation 1 is asked for first but its IDs arrive last: reservation 2 got 11,
    so 10 may still be on its way to reservation 1; the position must wait at the
    floor (the largest ID seen when reservation 1 began)."""
    tracker = single_writer(9)
    first = tracker.begin_reservation()
    second = tracker.begin_reservation()
    tracker.allocated([11], second)
    tracker.finished([11])
    assert tracker.get_position("w") == 9
    assert tracker.allocated([10], first) == []
    assert tracker.finished([10]) == [PositionChange("w", 9, 11)]


def test_a_cancelled_reservation_releases_the_position() -> None:
    tracker = single_writer(5)
    ticket = tracker.begin_reservation()
    other = tracker.begin_reservation()
    tracker.finish_reservation(other, [7])
    assert tracker.get_position("w") == 5
    assert tracker.cancel_reservation(ticket) == [PositionChange("w", 5, 7)]


def test_finish_reservation_with_no_ids_just_ends_the_ticket() -> None:
    tracker = single_writer(5)
    ticket = tracker.begin_reservation()
    assert tracker.finish_reservation(ticket, []) == []
    assert tracker.pending_reservations == 0


def test_multi_writer_linear_position_is_the_minimum_and_idle_writers_catch_up() -> None:
    """Writer A writes 1..3; writer B is idle. B hears A is at 3 and, having nothing in
    flight, claims 3 too: every ID B reserves later is above 3."""
    a = PositionTracker(writers=["a", "b"], local_instance="a")
    b = PositionTracker(writers=["a", "b"], local_instance="b")
    reader = PositionTracker(writers=["a", "b"])
    a.finish_reservation(a.begin_reservation(), [1, 2, 3])
    assert a.get_position("a") == 3
    assert a.get_current_token() == 0  # b not heard from

    reader.advance("a", 3)
    assert reader.get_current_token() == 0
    assert reader.get_max_position() == 3

    assert b.advance("a", 3) == [PositionChange("a", 0, 3), PositionChange("b", 0, 3)]
    reader.advance("b", b.get_position("b"))
    assert reader.get_current_token() == 3
    assert reader.get_positions() == {"a": 3, "b": 3}


def test_a_writer_with_a_fact_in_flight_does_not_claim_past_it() -> None:
    b = PositionTracker(writers=["a", "b"], local_instance="b")
    b.allocated([4], b.begin_reservation())
    b.advance("a", 10)
    assert b.get_position("b") == 3
    b.finished([4])
    assert b.get_position("b") == 10


def test_old_news_never_moves_a_position_back() -> None:
    reader = PositionTracker(writers=["a"])
    assert reader.advance("a", 7) == [PositionChange("a", 0, 7)]
    assert reader.advance("a", 5) == []
    assert reader.get_position("a") == 7


def test_retired_writers_are_remembered_but_do_not_hold_back_the_linear_position() -> None:
    reader = PositionTracker(writers=["a"], positions={"a": 10, "old": 3})
    assert reader.get_current_token() == 10
    assert reader.get_positions() == {"a": 10, "old": 3}


def test_an_echo_of_our_own_position_is_harmless() -> None:
    tracker = single_writer(5)
    tracker.allocated([6], tracker.begin_reservation())
    assert tracker.advance("w", 9) == []
    assert tracker.get_position("w") == 5


def test_misuse_is_refused() -> None:
    reader = PositionTracker(writers=["a"])
    with pytest.raises(StreamIdError):
        reader.begin_reservation()
    tracker = single_writer(5)
    with pytest.raises(StreamIdError, match="cannot be new"):
        tracker.allocated([5], tracker.begin_reservation())
    with pytest.raises(StreamIdError, match="not reserved"):
        tracker.finished([42])
    with pytest.raises(StreamIdError, match="not pending"):
        tracker.cancel_reservation(999)
    with pytest.raises(ValueError, match="not one of the writers"):
        PositionTracker(writers=["a"], local_instance="b")
    with pytest.raises(ValueError, match="at least one writer"):
        PositionTracker(writers=[])
    with pytest.raises(ValueError, match="non-negative"):
        reader.advance("a", -1)


def test_a_restarted_writer_claims_the_largest_id_seen() -> None:
    """load_positions hands a restarted writer the sequence's value as max_seen (after
    every older transaction has ended): nothing of its own is in flight."""
    tracker = PositionTracker(writers=["a", "b"], positions={"a": 4, "b": 9}, local_instance="a", max_seen=12)
    assert tracker.get_position("a") == 12
    assert tracker.get_current_token() == 9
