"""SQL of partial-state rooms: rooms joined with the state minus its members (``omit_members``).

A partial join stores what the resident sent (``store_join_state_txn``) and a
``partial_state_rooms`` row in the same transaction. The resync later brings the whole
state at the join; ``complete_partial_state_txn`` stores it by filling in what the partial
state lacked: the keys missing from the state groups the room got since the join (its
snapshots: every later group is a delta on one of them, so it inherits the fill) and from
the room's current state. A key already there is left alone: it was in the partial state or
an event since the join set it, and either is newer than, or the same as, the state at the
join. Which events are valid and what the state is, the caller decides
(``homeserver/federation/partial_state.py``).
"""

# tests: tests/integration/test_federation_partial_join.py

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Final

import attrs

from storage.database import Database, Prepared, Transaction, json_rows
from storage.stores.events import StateMap
from storage.stores.room_state import CHUNK_ROWS, BulkEventRow, existing_event_ids_txn, insert_events_bulk_txn

# The most servers a partial-state row keeps (``servers_in_room`` is bounded before it gets here).
MAX_SERVERS: Final = 10_000


@attrs.frozen(slots=True)
class PartialStateRow:
    """A room joined with partial state; ``completed``: (instance, events stream position) of the
    write that made its state whole, None while it is partial."""

    room_id: str
    join_event_id: str
    servers: tuple[str, ...]
    joined_ts: int
    completed: tuple[str, int] | None

    @property
    def partial(self) -> bool:
        return self.completed is None


def mark_partial_state_txn(txn: Transaction, room_id: str, join_event_id: str, servers: Sequence[str],
                           joined_ts: int) -> None:
    """Record ``room_id`` as joined with partial state by ``join_event_id`` (a row of an earlier
    join is replaced)."""
    txn.execute(
        "INSERT INTO partial_state_rooms (room_id, join_event_id, servers, joined_ts) VALUES (%s, %s, %s, %s) "
        "ON CONFLICT (room_id) DO UPDATE SET join_event_id = EXCLUDED.join_event_id, servers = EXCLUDED.servers, "
        "joined_ts = EXCLUDED.joined_ts, completed_instance = NULL, completed_stream = NULL",
        (room_id, join_event_id, list(servers[:MAX_SERVERS]), joined_ts),
    )


def _row(r: Sequence[object]) -> PartialStateRow:
    instance, stream = r[4], r[5]
    completed = (str(instance), int(str(stream))) if instance is not None and stream is not None else None
    servers = r[2]
    return PartialStateRow(str(r[0]), str(r[1]), tuple(str(s) for s in servers) if isinstance(servers, list) else (),
                           int(str(r[3])), completed)


_COLUMNS: Final = "room_id, join_event_id, servers, joined_ts, completed_instance, completed_stream"
# The rows a sync needs: the rooms partial now, and those made whole at an events stream
# position after the parameter (the smallest position of the sync's ``since``, or of its end
# for an initial sync); older ones change nothing for it. Sliding sync reads them alone
# (``get_rows_for_sync``); /sync as a part of its one read of the user's rooms
# (``ROWS_FOR_SYNC_JSON``, read back by ``rows_from_json``; storage/stores/timeline.py).
_ROWS_FOR_SYNC_FROM: Final = "FROM partial_state_rooms WHERE completed_stream IS NULL OR completed_stream > %s::bigint"
_ROWS_FOR_SYNC: Final = Prepared(f"SELECT {_COLUMNS} {_ROWS_FOR_SYNC_FROM}")
ROWS_FOR_SYNC_JSON: Final = json_rows(_COLUMNS, _ROWS_FOR_SYNC_FROM)


def rows_from_json(rows: list[Any] | None) -> dict[str, PartialStateRow]:
    return {str(r[0]): _row(r) for r in rows or ()}


def get_partial_state_rows_txn(txn: Transaction, room_ids: Collection[str] | None) -> dict[str, PartialStateRow]:
    if room_ids is None:
        txn.execute(f"SELECT {_COLUMNS} FROM partial_state_rooms")
    else:
        txn.execute(f"SELECT {_COLUMNS} FROM partial_state_rooms WHERE room_id = ANY(%s)", (list(room_ids),))
    return {str(r[0]): _row(r) for r in txn.fetchall()}


@attrs.frozen(slots=True)
class CompletedState:
    """What ``complete_partial_state_txn`` did: events newly stored, state entries filled in (in
    the state groups, in the current state); ``position`` is None when the room was not partial
    any more (or was joined again since)."""

    new_events: int
    group_entries: int
    current_entries: int
    position: int | None


def complete_partial_state_txn(
    txn: Transaction,
    room_id: str,
    join_event_id: str,
    rows: Sequence[BulkEventRow],
    allocate_many: Callable[[Transaction, int], list[int]],
    allocate_one: Callable[[Transaction], int],
    *,
    instance_name: str,
    state: StateMap,
    memberships: Mapping[str, str | None],
) -> CompletedState:
    """Make the partial state of ``room_id`` (joined by ``join_event_id``) whole with ``state``,
    the full state before the join: ``rows`` (its events and their auth chain, checked by the
    caller) stored as outliers unless stored already, the keys the room's state groups since the
    join and its current state lack filled in (see the module docstring), and the row marked
    complete at a new events stream position (``allocate_one``), so /sync readers wake up."""
    txn.execute(
        "SELECT 1 FROM partial_state_rooms WHERE room_id = %s AND join_event_id = %s AND completed_stream IS NULL "
        "FOR UPDATE",
        (room_id, join_event_id),
    )
    if txn.fetchone() is None:
        return CompletedState(0, 0, 0, None)
    existing = existing_event_ids_txn(txn, [r.event_id for r in rows])
    new = [r for r in rows if r.event_id not in existing]
    if new:
        insert_events_bulk_txn(txn, new, allocate_many(txn, len(new)), instance_name=instance_name, is_local=False,
                               outlier=True)
    txn.execute("SELECT state_group_before FROM event_state_groups WHERE event_id = %s", (join_event_id,))
    found = txn.fetchone()
    entries = sorted(state.items())
    group_entries = 0
    if found is not None:
        for start in range(0, len(entries), CHUNK_ROWS):
            chunk = entries[start : start + CHUNK_ROWS]
            txn.execute(
                """
                INSERT INTO state_groups_state (state_group, type, state_key, event_id)
                SELECT g.id, f.type, f.state_key, f.event_id
                FROM state_groups g
                CROSS JOIN unnest(%s::text[], %s::text[], %s::text[]) AS f(type, state_key, event_id)
                WHERE g.room_id = %s AND g.prev_group IS NULL AND g.id >= %s
                ON CONFLICT (state_group, type, state_key) DO NOTHING
                """,
                ([k[0] for k, _ in chunk], [k[1] for k, _ in chunk], [e for _, e in chunk], room_id, int(found[0])),
            )
            group_entries += max(txn.rowcount, 0)
    current_entries = 0
    for start in range(0, len(entries), CHUNK_ROWS):
        chunk = entries[start : start + CHUNK_ROWS]
        txn.execute(
            """
            INSERT INTO current_state_events (room_id, type, state_key, event_id, membership)
            SELECT %s, f.type, f.state_key, f.event_id, f.membership
            FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[]) AS f(type, state_key, event_id, membership)
            ON CONFLICT (room_id, type, state_key) DO NOTHING
            """,
            (room_id, [k[0] for k, _ in chunk], [k[1] for k, _ in chunk], [e for _, e in chunk],
             [memberships.get(e) if k[0] == "m.room.member" else None for k, e in chunk]),
        )
        current_entries += max(txn.rowcount, 0)
    position = allocate_one(txn)
    txn.execute(
        "UPDATE partial_state_rooms SET completed_instance = %s, completed_stream = %s WHERE room_id = %s",
        (instance_name, position, room_id),
    )
    return CompletedState(len(new), group_entries, current_entries, position)


class PartialStateStore:
    """Reads of ``partial_state_rooms``."""

    def __init__(self, db: Database) -> None:
        self._db = db

    async def get_rows(self, room_ids: Collection[str] | None = None) -> dict[str, PartialStateRow]:
        """The rows of ``room_ids`` (all rows when None); partial or completed."""
        return await self._db.run_interaction("get_partial_state_rows", get_partial_state_rows_txn,
                                              None if room_ids is None else list(room_ids))

    async def get_rows_for_sync(self, after: int) -> dict[str, PartialStateRow]:
        """The rows a sync needs (``_ROWS_FOR_SYNC``) in a read of their own, for sliding sync;
        ``/sync`` reads them in ``TimelineStore.get_sync_rooms``."""

        def txn_fn(txn: Transaction) -> dict[str, PartialStateRow]:
            txn.execute(_ROWS_FOR_SYNC, (after,))
            return {str(r[0]): _row(r) for r in txn.fetchall()}

        return await self._db.run_reads("get_partial_state_rows_for_sync", txn_fn)

    async def partial_rooms(self) -> dict[str, PartialStateRow]:
        """The rooms whose state is partial now."""
        return {r: row for r, row in (await self.get_rows()).items() if row.partial}

    async def is_partial(self, room_id: str) -> bool:
        row = (await self.get_rows([room_id])).get(room_id)
        return row is not None and row.partial
