"""SQL for storing a whole room's state at once: the state and auth chain a join brings.

Joining a room over federation hands us its state (tens of thousands of member events
in a big room) and their auth chain. Written one event per transaction that takes
minutes; here the rows go in with ``COPY`` (``Transaction.copy_rows``), a few times
faster than even one multi-row INSERT per table, and the state is written once: one
snapshot state group, and the room's current state.

This module only stores; which events are valid, and what the state is, the caller
decides (``homeserver/federation/join_state.py``). Events already stored are left as
they are: ``store_join_state_txn`` copies only the others.
"""

# tests: tests/integration/test_federation_big_join.py

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Final

import attrs

from storage.database import Database, Transaction
from storage.stores.events import StateKey, StateMap

#: Rows per statement: big enough that 50,000 events are a handful of round trips,
#: small enough that one statement's parameters stay a few megabytes.
CHUNK_ROWS: Final = 5_000


@attrs.frozen(slots=True)
class BulkEventRow:
    """One event to store in bulk, with what its rows in other tables need."""

    event_id: str
    room_id: str
    type: str
    state_key: str | None
    sender: str
    depth: int
    origin_server_ts: int
    json: str
    prev_event_ids: tuple[str, ...]
    auth_event_ids: tuple[str, ...]
    rejection_reason: str | None = None
    #: ``content.membership`` of an ``m.room.member`` event (for current state).
    membership: str | None = None


def _chunks(rows: Sequence[object], size: int = CHUNK_ROWS) -> list[Sequence[object]]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]


_EVENT_COLUMNS: Final = (
    "stream_ordering", "instance_name", "event_id", "room_id", "type", "state_key", "sender", "depth",
    "origin_server_ts", "is_local", "outlier", "rejection_reason", "json",
)


def insert_events_bulk_txn(
    txn: Transaction, rows: Sequence[BulkEventRow], stream_orderings: Sequence[int], *, instance_name: str,
    is_local: bool, outlier: bool,
) -> None:
    """Insert ``rows`` (with these stream orderings, one each) into ``events``, ``event_edges``
    and ``event_auth`` by COPY. None of them may be stored already (``existing_event_ids_txn``
    finds those): COPY has no ON CONFLICT, and a duplicate fails the transaction."""
    if len(rows) != len(stream_orderings):
        raise ValueError(f"{len(rows)} events but {len(stream_orderings)} stream orderings")
    txn.copy_rows("events", _EVENT_COLUMNS, (
        (o, instance_name, r.event_id, r.room_id, r.type, r.state_key, r.sender, r.depth, r.origin_server_ts,
         is_local, outlier, r.rejection_reason, r.json)
        for r, o in zip(rows, stream_orderings)
    ))
    # dict.fromkeys: an event citing one ID twice gets one row (the primary key is the pair).
    txn.copy_rows("event_edges", ("event_id", "prev_event_id", "room_id"),
                  ((r.event_id, p, r.room_id) for r in rows for p in dict.fromkeys(r.prev_event_ids)))
    txn.copy_rows("event_auth", ("event_id", "auth_id", "room_id"),
                  ((r.event_id, a, r.room_id) for r in rows for a in dict.fromkeys(r.auth_event_ids)))


def register_room_txn(txn: Transaction, room_id: str, room_version: str, creator: str, created_ts: int) -> None:
    """Record the room (from its create event) unless it is known."""
    txn.execute(
        "INSERT INTO rooms (room_id, room_version, creator, created_ts) VALUES (%s, %s, %s, %s) "
        "ON CONFLICT (room_id) DO NOTHING",
        (room_id, room_version, creator, created_ts),
    )


def _insert_group_entries_txn(txn: Transaction, group_ids: Sequence[int], entries: Sequence[tuple[StateKey, str]]) -> None:
    txn.copy_rows("state_groups_state", ("state_group", "type", "state_key", "event_id"),
                  ((g, k[0], k[1], e) for g, (k, e) in zip(group_ids, entries)))


def store_state_snapshot_txn(txn: Transaction, room_id: str, state: StateMap) -> int:
    """A new state group holding all of ``state`` (no predecessor); its ID."""
    txn.execute("SELECT nextval('state_group_id_seq')")
    row = txn.fetchone()
    assert row is not None
    group = int(row[0])
    txn.execute(
        "INSERT INTO state_groups (id, room_id, prev_group, delta_depth) VALUES (%s, %s, NULL, 0)", (group, room_id)
    )
    entries = sorted(state.items())
    _insert_group_entries_txn(txn, [group] * len(entries), entries)
    return group


def store_state_chain_txn(txn: Transaction, room_id: str, prev_group: int, deltas: Sequence[tuple[StateKey, str]]) -> list[int]:
    """One state group per entry of ``deltas``, each the previous one plus that entry (a chain
    of one-entry deltas on ``prev_group``, as a linear run of state events makes); their IDs.

    The chain is as long as ``deltas``: reading a group late in it walks the whole chain,
    so the caller ends a long run on a snapshot (``store_state_snapshot_txn``)."""
    if not deltas:
        return []
    txn.execute("SELECT delta_depth FROM state_groups WHERE id = %s", (prev_group,))
    row = txn.fetchone()
    if row is None:
        raise ValueError(f"unknown state group {prev_group}")
    depth = int(row[0])
    txn.execute("SELECT nextval('state_group_id_seq') FROM generate_series(1, %s)", (len(deltas),))
    groups = [int(r[0]) for r in txn.fetchall()]
    prevs = [prev_group, *groups[:-1]]
    for start in range(0, len(groups), CHUNK_ROWS):
        txn.execute(
            "INSERT INTO state_groups (id, room_id, prev_group, delta_depth) "
            "SELECT g, %s, p, d FROM unnest(%s::bigint[], %s::bigint[], %s::int[]) AS u(g, p, d)",
            (room_id, groups[start : start + CHUNK_ROWS], prevs[start : start + CHUNK_ROWS],
             list(range(depth + 1 + start, depth + 1 + start + len(groups[start : start + CHUNK_ROWS])))),
        )
    _insert_group_entries_txn(txn, groups, list(deltas))
    return groups


def set_event_state_groups_txn(txn: Transaction, rows: Sequence[tuple[str, int, int]]) -> None:
    """(event ID, state group before, state group after) for events placed in the room's graph."""
    for start in range(0, len(rows), CHUNK_ROWS):
        chunk = rows[start : start + CHUNK_ROWS]
        txn.execute(
            "INSERT INTO event_state_groups (event_id, state_group_before, state_group_after) "
            "SELECT * FROM unnest(%s::text[], %s::bigint[], %s::bigint[])",
            ([r[0] for r in chunk], [r[1] for r in chunk], [r[2] for r in chunk]),
        )


def replace_current_state_txn(
    txn: Transaction, room_id: str, state: StateMap, memberships: Mapping[str, str | None]
) -> None:
    """Make the room's ``current_state_events`` exactly ``state``; ``memberships``: event ID ->
    membership of its member events (the others need none)."""
    txn.execute("DELETE FROM current_state_events WHERE room_id = %s", (room_id,))
    txn.copy_rows("current_state_events", ("room_id", "type", "state_key", "event_id", "membership"), (
        (room_id, k[0], k[1], e, memberships.get(e) if k[0] == "m.room.member" else None)
        for k, e in sorted(state.items())
    ))


def insert_memberships_txn(txn: Transaction, rows: Sequence[tuple[BulkEventRow, int]]) -> None:
    """``room_memberships`` rows of member events placed in the room's graph (with their stream
    orderings); display names and avatars are left out (they are read from the events)."""
    members = [(r, o) for r, o in rows if r.type == "m.room.member" and r.state_key is not None and r.membership]
    for start in range(0, len(members), CHUNK_ROWS):
        chunk = members[start : start + CHUNK_ROWS]
        txn.execute(
            "INSERT INTO room_memberships (event_id, room_id, user_id, sender, membership, stream_ordering) "
            "SELECT * FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[], %s::text[], %s::bigint[]) "
            "ON CONFLICT DO NOTHING",
            ([r.event_id for r, _ in chunk], [r.room_id for r, _ in chunk], [r.state_key for r, _ in chunk],
             [r.sender for r, _ in chunk], [r.membership for r, _ in chunk], [o for _, o in chunk]),
        )


def existing_event_ids_txn(txn: Transaction, event_ids: Sequence[str]) -> set[str]:
    """Which of ``event_ids`` are stored (as outliers or not)."""
    found: set[str] = set()
    for start in range(0, len(event_ids), CHUNK_ROWS * 4):
        txn.execute("SELECT event_id FROM events WHERE event_id = ANY(%s)", (list(event_ids[start : start + CHUNK_ROWS * 4]),))
        found.update(row[0] for row in txn.fetchall())
    return found


def store_join_state_txn(
    txn: Transaction,
    room_id: str,
    rows: Sequence[BulkEventRow],
    allocate: Callable[[Transaction, int], list[int]],
    *,
    instance_name: str,
    room: tuple[str, str, int] | None,
    state: StateMap,
    memberships: Mapping[str, str | None],
) -> int:
    """What a join over federation brings, in one transaction: ``rows`` (the state and auth
    chain; ``allocate(txn, n)`` reserves stream orderings for those not stored yet) as
    outliers, the room (``room``: version, creator, creation time from its create event),
    ``state`` as one snapshot state group (its ID is returned) and as the room's current
    state (``memberships``: event ID -> membership of the member events among it)."""
    existing = existing_event_ids_txn(txn, [r.event_id for r in rows])
    new = [r for r in rows if r.event_id not in existing]
    if new:
        orderings = allocate(txn, len(new))
        insert_events_bulk_txn(txn, new, orderings, instance_name=instance_name, is_local=False, outlier=True)
    if room is not None:
        register_room_txn(txn, room_id, *room)
    group = store_state_snapshot_txn(txn, room_id, state)
    replace_current_state_txn(txn, room_id, state, memberships)
    return group


def get_event_json_txn(txn: Transaction, event_ids: Sequence[str]) -> dict[str, str]:
    """Event ID -> the event's stored PDU JSON, for those of ``event_ids`` stored."""
    found: dict[str, str] = {}
    for start in range(0, len(event_ids), CHUNK_ROWS * 4):
        txn.execute("SELECT event_id, json FROM events WHERE event_id = ANY(%s)",
                    (list(event_ids[start : start + CHUNK_ROWS * 4]),))
        found.update((row[0], row[1]) for row in txn.fetchall())
    return found


def get_member_states_txn(txn: Transaction, event_ids: Sequence[str]) -> dict[str, tuple[str, str, int]]:
    """Member event ID -> (user ID, membership, stream ordering), for the member events among ``event_ids``:
    from ``room_memberships`` when the event is in a room's graph here, else from its JSON
    (an outlier, such as the state a join over federation brought)."""
    found: dict[str, tuple[str, str, int]] = {}
    ids = list(event_ids)
    txn.execute("SELECT event_id, user_id, membership, stream_ordering FROM room_memberships WHERE event_id = ANY(%s)",
                (ids,))
    found.update((row[0], (row[1], row[2], int(row[3]))) for row in txn.fetchall())
    rest = [i for i in ids if i not in found]
    if rest:
        txn.execute(
            """
            SELECT event_id, state_key, json::jsonb -> 'content' ->> 'membership', stream_ordering FROM events
            WHERE event_id = ANY(%s) AND type = 'm.room.member' AND state_key IS NOT NULL
            """,
            (rest,),
        )
        found.update((row[0], (row[1], row[2], int(row[3]))) for row in txn.fetchall() if isinstance(row[2], str))
    return found


class RoomStateStore:
    """Reads of a room's state in bulk, for the resident side of send_join."""

    def __init__(self, db: Database) -> None:
        self._db = db

    async def get_event_json(self, event_ids: Collection[str]) -> dict[str, str]:
        return await self._db.run_interaction("get_event_json", get_event_json_txn, list(event_ids))

    async def get_member_states(self, event_ids: Collection[str]) -> dict[str, tuple[str, str, int]]:
        return await self._db.run_interaction("get_member_states", get_member_states_txn, list(event_ids))
