"""Packing catch-up into transactions: order, size, and never advancing past an unsent room."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from federation_sender.catch_up import CatchUpChunk, CatchUpRoom, plan_chunks
from federation_sender.queue import PendingPdu


def pdu(room: str, n: int) -> PendingPdu:
    return PendingPdu(f"${room}-{n}", room, n, b"{}", 0.0)


def room(name: str, position: int, missed: list[int], latest: list[int]) -> CatchUpRoom:
    return CatchUpRoom(name, position, tuple(pdu(name, n) for n in missed), tuple(pdu(name, n) for n in latest))


def test_missed_events_oldest_first_then_the_latest_not_among_them() -> None:
    r = room("a", 9, missed=[9, 3, 5], latest=[9, 12])
    assert [p.stream_ordering for p in r.pdus()] == [3, 5, 9, 12]


def test_rooms_share_transactions_and_each_chunk_advances_to_its_last_whole_room() -> None:
    chunks = plan_chunks([room("a", 1, [], [1]), room("b", 2, [], [2]), room("c", 3, [], [3])], max_pdus=2)
    assert [[p.room_id for p in c.pdus] for c in chunks] == [["a", "b"], ["c"]]
    assert [c.advance_to for c in chunks] == [2, 3]
    assert [c.completed for c in chunks] == [(("a", 1), ("b", 2)), (("c", 3),)]


def test_transactions_take_the_rooms_in_turn_so_the_receiver_can_work_on_them_side_by_side() -> None:
    chunks = plan_chunks([room("a", 9, [1, 2, 3], [9]), room("b", 10, [4, 5], [10])], max_pdus=4)
    assert [[(p.room_id, p.stream_ordering) for p in c.pdus] for c in chunks] == [
        [("a", 1), ("b", 4), ("a", 2), ("b", 5)],
        [("a", 3), ("b", 10), ("a", 9)],
    ]
    assert [c.advance_to for c in chunks] == [None, 10]


def test_a_big_room_spans_transactions_and_only_its_last_part_advances() -> None:
    chunks = plan_chunks([room("a", 1, [], [1]), room("b", 7, [1, 2, 3, 4, 5], [7])], max_pdus=2)
    assert [len(c.pdus) for c in chunks] == [2, 2, 2, 1]
    assert [c.advance_to for c in chunks] == [1, None, None, 7]


def test_a_room_with_nothing_to_send_still_advances() -> None:
    assert [c.advance_to for c in plan_chunks([room("a", 4, [], [])], max_pdus=50)] == [4]


@given(
    st.lists(st.tuples(st.integers(0, 60), st.integers(0, 3)), min_size=1, max_size=30),
    st.integers(1, 50),
)
def test_every_pdu_once_in_order_no_chunk_too_big_positions_never_pass_an_unsent_room(
    shape: list[tuple[int, int]], max_pdus: int
) -> None:
    rooms = []
    for i, (missed, latest) in enumerate(shape):
        position = (i + 1) * 1000
        rooms.append(room(f"r{i}", position, [position - 999 + k for k in range(missed)],
                          [position + 1 + k for k in range(latest)]))
    chunks = plan_chunks(rooms, max_pdus)
    sent = [p for c in chunks for p in c.pdus]
    assert sorted(p.event_id for p in sent) == sorted(p.event_id for r in rooms for p in r.pdus())
    for r in rooms:
        assert [p for p in sent if p.room_id == r.room_id] == r.pdus(), "each room in its own order"
    assert all(len(c.pdus) <= max_pdus for c in chunks)
    delivered: set[str] = set()
    for c in chunks:
        delivered.update(p.event_id for p in c.pdus)
        if c.advance_to is not None:
            for r in rooms:
                if r.stream_ordering <= c.advance_to:
                    assert {p.event_id for p in r.pdus()} <= delivered
    assert chunks[-1].advance_to == rooms[-1].stream_ordering
    assert sorted(room for c in chunks for room, _ in c.completed) == sorted(r.room_id for r in rooms)
    for c in chunks:  # a room is reported reached in the chunk that carries its last PDU
        for room_id, _ in c.completed:
            r = next(r for r in rooms if r.room_id == room_id)
            assert {p.event_id for p in r.pdus()} <= delivered_by(chunks, c)


def delivered_by(chunks: list[CatchUpChunk], last: CatchUpChunk) -> set[str]:
    delivered: set[str] = set()
    for c in chunks:
        delivered.update(p.event_id for p in c.pdus)
        if c is last:
            return delivered
    raise AssertionError("not one of the chunks")


def test_a_room_with_more_missed_events_sends_only_them_and_holds_the_position() -> None:
    """Issue 28: a room whose gap is longer than the bound sends its oldest missed events this
    round, not its latest ones (which the receiver could not attach), and stays behind: the
    position stops below it, and the chunk says how far it got."""
    big = CatchUpRoom("a", 90, tuple(pdu("a", n) for n in (10, 11, 12)), (pdu("a", 90),), more=True)
    assert [p.stream_ordering for p in big.pdus()] == [10, 11, 12]
    chunks = plan_chunks([room("z", 5, [4], [5]), big, room("b", 95, [93], [95])], max_pdus=3)
    assert [[(p.room_id, p.stream_ordering) for p in c.pdus] for c in chunks] == [
        [("z", 4), ("a", 10), ("b", 93)],
        [("z", 5), ("a", 11), ("b", 95)],
        [("a", 12)],
    ]
    assert [c.advance_to for c in chunks] == [None, 5, None]
    assert [c.completed for c in chunks] == [(), (("z", 5), ("b", 95)), (("a", 12),)]


def test_a_room_sent_in_rounds_is_complete_in_its_last_round() -> None:
    last = CatchUpRoom("a", 90, tuple(pdu("a", n) for n in (13, 90)), (pdu("a", 90),))
    chunks = plan_chunks([last], max_pdus=50)
    assert [[p.stream_ordering for p in c.pdus] for c in chunks] == [[13, 90]]
    assert [(c.advance_to, c.completed) for c in chunks] == [(90, (("a", 90),))]
