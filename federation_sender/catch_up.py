"""Catch-up: what to send a destination that missed events, in which transactions.

Pure. The sender reads a batch of ``destination_rooms`` rows (the oldest rooms
whose newest event for this destination is above its
``last_successful_stream_ordering``) and, per room, two lists: the events it
missed there (local events fanned out to it, newest ``missed_events_per_room``
of them) and the room's latest events (its forward extremities when the
destination can still see them, else the newest event we sent it). This module
turns those into transactions, and says how far each one lets
``last_successful_stream_ordering`` advance.

Sending the missed events, oldest first, before the extremities is what spares
a recovering destination its ``get_missing_events`` round trips: it receives
the gap in order and each event's predecessors are already there. The bound
keeps a long outage from turning into a replay of everything.
"""

# tests: tests/unit/federation_sender/test_catch_up.py

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import attrs

from federation_sender.queue import PendingPdu


@attrs.frozen
class CatchUpRoom:
    room_id: str
    # The destination_rooms row: the newest of our events in this room the destination should have.
    stream_ordering: int
    missed: tuple[PendingPdu, ...]
    latest: tuple[PendingPdu, ...]

    def pdus(self) -> list[PendingPdu]:
        """What to send for this room: the missed events oldest first, then the latest ones not among them."""
        seen = {p.event_id for p in self.missed}
        ordered = sorted(self.missed, key=lambda p: (p.stream_ordering or 0))
        return ordered + [p for p in self.latest if p.event_id not in seen]


@attrs.frozen
class CatchUpChunk:
    pdus: tuple[PendingPdu, ...]
    # Once accepted, every room up to this destination_rooms position is done (None: no room finished).
    advance_to: int | None
    # The rooms this chunk finishes, with their positions.
    completed: tuple[tuple[str, int], ...] = ()


def plan_chunks(rooms: Sequence[CatchUpRoom], max_pdus: int) -> list[CatchUpChunk]:
    """Pack the rooms' PDUs into transactions of at most ``max_pdus``.

    Each transaction takes the rooms' PDUs in turn, one room after another (each
    room's own order kept), so a transaction carries many rooms and the receiver,
    which handles the rooms of a transaction side by side, is not held to one
    room at a time. ``rooms`` must be in ascending ``stream_ordering`` (the order
    they were read): a chunk advances the position only past the rooms that are
    complete *and* follow only complete rooms, so a failure part-way never skips
    a room.
    """
    if max_pdus < 1:
        raise ValueError(f"max_pdus must be at least 1, got {max_pdus}")
    queues = [deque(room.pdus()) for room in rooms]
    chunks: list[CatchUpChunk] = []
    finished = 0  # rooms[:finished] are complete
    while True:
        current: list[PendingPdu] = []
        while len(current) < max_pdus and any(queues[finished:]):
            for queue in queues[finished:]:
                if queue and len(current) < max_pdus:
                    current.append(queue.popleft())
        completed: list[tuple[str, int]] = []
        while finished < len(rooms) and not queues[finished]:
            completed.append((rooms[finished].room_id, rooms[finished].stream_ordering))
            finished += 1
        if not current and not completed:
            return chunks
        chunks.append(_chunk(current, completed))


def _chunk(pdus: list[PendingPdu], completed: list[tuple[str, int]]) -> CatchUpChunk:
    return CatchUpChunk(tuple(pdus), completed[-1][1] if completed else None, tuple(completed))
