"""Catch-up: what to send a destination that missed events, in which transactions.

Pure. The sender reads a batch of ``destination_rooms`` rows (the oldest rooms
whose newest event for this destination is above its
``last_successful_stream_ordering``) and, per room, two lists: the events it
missed there (local events fanned out to it, the oldest
``missed_events_per_room`` of them, and whether more follow) and the room's
latest events (its forward extremities when the destination can still see
them, else the newest event we sent it). This module turns those into
transactions, and says how far each one lets ``last_successful_stream_ordering``
advance and how far each room got.

Sending the missed events oldest first, and the latest events only once none
is left, is what spares a recovering destination its ``get_missing_events``
round trips: it receives the gap in order and each event's predecessors are
already there. A room with more missed events than the bound is sent in
rounds: each round its next oldest events, the room staying in catch-up (and
holding the position below it) until the last round, so a long gap never turns
into a newest-first batch the receiver cannot attach (issue 28); the bound keeps
each round's reads and memory small.
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
    # More missed events follow the ones read: this round sends only those, and the room is not done.
    more: bool = False

    def pdus(self) -> list[PendingPdu]:
        """What to send for this room: the missed events oldest first, then (once no missed event
        is left) the latest ones not among them."""
        seen = {p.event_id for p in self.missed}
        ordered = sorted(self.missed, key=lambda p: (p.stream_ordering or 0))
        if self.more:
            return ordered
        return ordered + [p for p in self.latest if p.event_id not in seen]

    @property
    def reached(self) -> int:
        """Where the room's missed events start next round once this round's are accepted."""
        if not self.more:
            return self.stream_ordering
        return max(p.stream_ordering or 0 for p in self.missed)


@attrs.frozen
class CatchUpChunk:
    pdus: tuple[PendingPdu, ...]
    # Once accepted, every room up to this destination_rooms position is done (None: no room finished).
    advance_to: int | None
    # The rooms whose last PDU of this round this chunk carries, with how far each got (``reached``):
    # its row's position when it is done, its last missed event sent when more follow.
    completed: tuple[tuple[str, int], ...] = ()


def plan_chunks(rooms: Sequence[CatchUpRoom], max_pdus: int) -> list[CatchUpChunk]:
    """Pack the rooms' PDUs into transactions of at most ``max_pdus``.

    Each transaction takes the rooms' PDUs in turn, one room after another (each
    room's own order kept), so a transaction carries many rooms and the receiver,
    which handles the rooms of a transaction side by side, is not held to one
    room at a time. ``rooms`` must be in ascending ``stream_ordering`` (the order
    they were read): a chunk advances the position only past the rooms that are
    done (no more missed events) *and* follow only done rooms, so a failure
    part-way, or a room sent in rounds, never skips a room.
    """
    if max_pdus < 1:
        raise ValueError(f"max_pdus must be at least 1, got {max_pdus}")
    queues = [deque(room.pdus()) for room in rooms]
    chunks: list[CatchUpChunk] = []
    recorded = [False] * len(rooms)
    finished = 0  # rooms[:finished] are done and sent
    while True:
        current: list[PendingPdu] = []
        while len(current) < max_pdus and any(queues):
            for queue in queues:
                if queue and len(current) < max_pdus:
                    current.append(queue.popleft())
        reached: list[tuple[str, int]] = []
        for i, room in enumerate(rooms):
            if not queues[i] and not recorded[i]:
                recorded[i] = True
                reached.append((room.room_id, room.reached))
        advance: int | None = None
        while finished < len(rooms) and not queues[finished] and not rooms[finished].more:
            advance = rooms[finished].stream_ordering
            finished += 1
        if not current and not reached and advance is None:
            return chunks
        chunks.append(CatchUpChunk(tuple(current), advance, tuple(reached)))
