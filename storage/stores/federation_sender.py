"""SQL for the federation sender: fan-out reads, destination bookkeeping, catch-up, the to-device outbox.

``destinations`` holds each remote server's backoff and how far it has
acknowledged our events; ``destination_rooms`` (written by the persist
transaction) the newest of our events each of them should have per room;
``events.destinations`` the servers each local event was fanned out to.
"""

# tests: tests/integration/test_federation_sender.py

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import attrs

from storage.database import Database, Transaction


@attrs.frozen
class FanoutEvent:
    stream_ordering: int
    event_id: str
    room_id: str
    pdu_json: str
    destinations: tuple[str, ...]


@attrs.frozen
class DestinationRow:
    destination: str
    retry_last_ts: int
    retry_interval: int
    failure_ts: int | None
    last_successful_stream_ordering: int | None


@attrs.frozen
class CatchUpEvent:
    room_id: str
    stream_ordering: int
    event_id: str
    pdu_json: str


@attrs.frozen
class CatchUpData:
    """What catch-up sends for a batch of rooms (see federation_sender/catch_up.py)."""

    # Per room, the destination's missed events there, oldest ``limit`` of them.
    missed: Mapping[str, list[CatchUpEvent]]
    # Per room, the events to end on: forward extremities, or our newest event when
    # the destination cannot see the room's current state.
    latest: Mapping[str, list[CatchUpEvent]]
    # The rooms with more missed events than ``limit``: catch-up sends them in rounds.
    more: frozenset[str] = frozenset()


@attrs.frozen
class OutboxRow:
    stream_id: int
    message_id: str
    messages_json: str


def _destination_row(row: Sequence[object]) -> DestinationRow:
    destination, retry_last_ts, retry_interval, failure_ts, last_successful = row
    return DestinationRow(
        str(destination),
        int(retry_last_ts or 0),  # type: ignore[call-overload]
        int(retry_interval or 0),  # type: ignore[call-overload]
        None if failure_ts is None else int(failure_ts),  # type: ignore[call-overload]
        None if last_successful is None else int(last_successful),  # type: ignore[call-overload]
    )


_DESTINATION_COLUMNS = "destination, retry_last_ts, retry_interval, failure_ts, last_successful_stream_ordering"


def _like_server_suffix(destination: str) -> str:
    """A LIKE pattern for user IDs on ``destination`` (``@local:destination``)."""
    escaped = destination.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return "%:" + escaped


class FederationSenderStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    # --- fan-out ----------------------------------------------------------------------

    async def get_fanout_events(self, after: int, upto: int, limit: int) -> list[FanoutEvent]:
        """Local events in (after, upto] that other servers should receive, in stream order."""

        def query(txn: Transaction) -> list[FanoutEvent]:
            txn.execute(
                """
                SELECT stream_ordering, event_id, room_id, json, destinations FROM events
                WHERE destinations IS NOT NULL AND stream_ordering > %s AND stream_ordering <= %s
                ORDER BY stream_ordering LIMIT %s
                """,
                (after, upto, limit),
            )
            return [FanoutEvent(int(r[0]), r[1], r[2], r[3], tuple(r[4])) for r in txn.fetchall()]

        return await self._db.run_interaction("get_fanout_events", query)

    # --- destinations ---------------------------------------------------------------------

    async def get_destination(self, destination: str) -> DestinationRow | None:
        def query(txn: Transaction) -> DestinationRow | None:
            txn.execute(f"SELECT {_DESTINATION_COLUMNS} FROM destinations WHERE destination = %s", (destination,))
            row = txn.fetchone()
            return None if row is None else _destination_row(row)

        return await self._db.run_interaction("get_destination", query)

    async def get_backing_off(self) -> list[DestinationRow]:
        """Destinations with a retry interval set (backing off now or until their next success)."""

        def query(txn: Transaction) -> list[DestinationRow]:
            txn.execute(f"SELECT {_DESTINATION_COLUMNS} FROM destinations WHERE retry_interval > 0")
            return [_destination_row(r) for r in txn.fetchall()]

        return await self._db.run_interaction("get_backing_off_destinations", query)

    async def get_needing_catch_up(self, upto: int) -> list[DestinationRow]:
        """Destinations with ``destination_rooms`` rows above their last acknowledged position."""

        def query(txn: Transaction) -> list[DestinationRow]:
            txn.execute(
                f"""
                SELECT {_DESTINATION_COLUMNS} FROM destinations d
                WHERE EXISTS (
                    SELECT 1 FROM destination_rooms r
                    WHERE r.destination = d.destination
                      AND r.stream_ordering > COALESCE(d.last_successful_stream_ordering, 0)
                      AND r.stream_ordering <= %s
                )
                ORDER BY destination
                """,
                (upto,),
            )
            return [_destination_row(r) for r in txn.fetchall()]

        return await self._db.run_interaction("get_destinations_needing_catch_up", query)

    async def set_retry(
        self, destination: str, retry_last_ts: int, retry_interval: int, failure_ts: int | None
    ) -> None:
        def write(txn: Transaction) -> None:
            txn.execute(
                """
                INSERT INTO destinations (destination, retry_last_ts, retry_interval, failure_ts)
                VALUES (%s, %s, %s, %s)
                ON CONFLICT (destination) DO UPDATE SET retry_last_ts = EXCLUDED.retry_last_ts,
                    retry_interval = EXCLUDED.retry_interval, failure_ts = EXCLUDED.failure_ts
                """,
                (destination, retry_last_ts, retry_interval, failure_ts),
            )

        await self._db.run_interaction("set_destination_retry", write)

    async def mark_sent(
        self, destination: str, advance_to: int | None, *, reset_retry: bool, to_device_upto: int | None
    ) -> None:
        """A transaction was accepted: advance the position, clear the backoff, drop delivered
        to-device messages; one transaction, and none at all when there is nothing to write."""
        if advance_to is None and not reset_retry and to_device_upto is None:
            return

        def write(txn: Transaction) -> None:
            if advance_to is not None or reset_retry:
                txn.execute(
                    """
                    INSERT INTO destinations (destination, last_successful_stream_ordering,
                                              retry_last_ts, retry_interval, failure_ts)
                    VALUES (%s, %s, 0, 0, NULL)
                    ON CONFLICT (destination) DO UPDATE SET
                        last_successful_stream_ordering = GREATEST(
                            destinations.last_successful_stream_ordering, EXCLUDED.last_successful_stream_ordering),
                        retry_last_ts = CASE WHEN %s THEN 0 ELSE destinations.retry_last_ts END,
                        retry_interval = CASE WHEN %s THEN 0 ELSE destinations.retry_interval END,
                        failure_ts = CASE WHEN %s THEN NULL ELSE destinations.failure_ts END
                    """,
                    (destination, advance_to, reset_retry, reset_retry, reset_retry),
                )
            if to_device_upto is not None:
                txn.execute(
                    "DELETE FROM device_federation_outbox WHERE destination = %s AND stream_id <= %s",
                    (destination, to_device_upto),
                )

        await self._db.run_interaction("mark_transaction_sent", write)

    async def record_pdu_errors(self, destination: str, errors: Mapping[str, str], now_ms: int) -> None:
        def write(txn: Transaction) -> None:
            txn.execute_values(
                """
                INSERT INTO destination_pdu_errors (destination, event_id, error, reported_ts) VALUES %s
                ON CONFLICT (destination, event_id) DO UPDATE
                SET error = EXCLUDED.error, reported_ts = EXCLUDED.reported_ts
                """,
                [(destination, event_id, error[:1000], now_ms) for event_id, error in errors.items()],
            )

        await self._db.run_interaction("record_pdu_errors", write)

    # --- catch-up -----------------------------------------------------------------------------

    async def begin_catch_up(self, destination: str) -> tuple[int, int]:
        """Note where catch-up starts (unless a catch-up interrupted by a restart already did);
        returns (catch_up_from, last_successful_stream_ordering)."""

        def write(txn: Transaction) -> tuple[int, int]:
            txn.execute(
                """
                UPDATE destinations
                SET catch_up_from = COALESCE(catch_up_from, last_successful_stream_ordering, 0)
                WHERE destination = %s
                RETURNING catch_up_from, COALESCE(last_successful_stream_ordering, 0)
                """,
                (destination,),
            )
            row = txn.fetchone()
            return (0, 0) if row is None else (int(row[0]), int(row[1]))

        return await self._db.run_interaction("begin_catch_up", write)

    async def end_catch_up(self, destination: str) -> None:
        def write(txn: Transaction) -> None:
            txn.execute("UPDATE destinations SET catch_up_from = NULL WHERE destination = %s", (destination,))

        await self._db.run_interaction("end_catch_up", write)

    async def get_catch_up_rooms(
        self, destination: str, after: int, upto: int | None, limit: int
    ) -> list[tuple[str, int]]:
        """The ``limit`` rooms with the oldest pending newest-event for ``destination``, as (room, position),
        up to position ``upto`` (None: any)."""

        def query(txn: Transaction) -> list[tuple[str, int]]:
            txn.execute(
                """
                SELECT room_id, stream_ordering FROM destination_rooms
                WHERE destination = %s AND stream_ordering > %s AND (%s::bigint IS NULL OR stream_ordering <= %s)
                ORDER BY stream_ordering LIMIT %s
                """,
                (destination, after, upto, upto, limit),
            )
            return [(r[0], int(r[1])) for r in txn.fetchall()]

        return await self._db.run_interaction("get_catch_up_rooms", query)

    async def get_catch_up_data(
        self, destination: str, rooms: Sequence[tuple[str, int, int]], missed_per_room: int
    ) -> CatchUpData:
        """``rooms``: (room, its destination_rooms position, the position its missed events start after).
        Per room, the oldest ``missed_per_room`` missed events, and whether more follow them."""
        room_ids = [room_id for room_id, _, _ in rooms]
        positions = [position for _, position, _ in rooms]
        afters = [after for _, _, after in rooms]

        def query(txn: Transaction) -> CatchUpData:
            missed: dict[str, list[CatchUpEvent]] = {}
            more: set[str] = set()
            if missed_per_room > 0:
                txn.execute(
                    """
                    SELECT room_id, stream_ordering, event_id, json FROM (
                        SELECT e.room_id, e.stream_ordering, e.event_id, e.json,
                               row_number() OVER (PARTITION BY e.room_id ORDER BY e.stream_ordering) AS n
                        FROM events e
                        JOIN unnest(%s::text[], %s::bigint[], %s::bigint[]) AS r (room_id, upto, after)
                            ON e.room_id = r.room_id
                        WHERE e.stream_ordering > r.after AND e.stream_ordering <= r.upto
                          AND e.destinations @> ARRAY[%s]::text[]
                    ) m
                    WHERE n <= %s ORDER BY stream_ordering
                    """,
                    (room_ids, positions, afters, destination, missed_per_room + 1),
                )
                for row in txn.fetchall():
                    room_events = missed.setdefault(row[0], [])
                    if len(room_events) == missed_per_room:  # one past the bound: more follow
                        more.add(row[0])
                    else:
                        room_events.append(CatchUpEvent(row[0], int(row[1]), row[2], row[3]))
            # Rooms where the destination has a member joined now can see the room's latest events.
            txn.execute(
                """
                SELECT DISTINCT room_id FROM current_state_events
                WHERE room_id = ANY(%s) AND type = 'm.room.member' AND membership = 'join' AND state_key LIKE %s
                """,
                (room_ids, _like_server_suffix(destination)),
            )
            visible = {r[0] for r in txn.fetchall()}
            latest: dict[str, list[CatchUpEvent]] = {}
            if visible:
                txn.execute(
                    """
                    SELECT x.room_id, e.stream_ordering, e.event_id, e.json
                    FROM event_forward_extremities x JOIN events e ON e.event_id = x.event_id
                    WHERE x.room_id = ANY(%s) ORDER BY e.stream_ordering
                    """,
                    (list(visible),),
                )
                for row in txn.fetchall():
                    latest.setdefault(row[0], []).append(CatchUpEvent(row[0], int(row[1]), row[2], row[3]))
            fallback = [position for room_id, position, _ in rooms if room_id not in latest]
            if fallback:
                txn.execute(
                    "SELECT room_id, stream_ordering, event_id, json FROM events WHERE stream_ordering = ANY(%s)",
                    (fallback,),
                )
                for row in txn.fetchall():
                    latest.setdefault(row[0], []).append(CatchUpEvent(row[0], int(row[1]), row[2], row[3]))
            return CatchUpData(missed, latest, frozenset(more))

        return await self._db.run_interaction("get_catch_up_data", query)

    # --- the to-device outbox --------------------------------------------------------------

    async def add_to_outbox(
        self, stream_id: int, instance_name: str, rows: Collection[tuple[str, str, str]], now_ms: int
    ) -> None:
        """Queue to-device messages for other servers: (destination, message ID, messages JSON)."""

        def write(txn: Transaction) -> None:
            txn.execute_values(
                """
                INSERT INTO device_federation_outbox
                    (stream_id, instance_name, destination, message_id, messages_json, queued_ts)
                VALUES %s
                """,
                [(stream_id, instance_name, d, m, j, now_ms) for d, m, j in rows],
            )

        await self._db.run_interaction("add_to_device_outbox", write)

    async def get_outbox(self, destination: str, limit: int) -> list[OutboxRow]:
        def query(txn: Transaction) -> list[OutboxRow]:
            txn.execute(
                """
                SELECT stream_id, message_id, messages_json FROM device_federation_outbox
                WHERE destination = %s ORDER BY stream_id LIMIT %s
                """,
                (destination, limit),
            )
            return [OutboxRow(int(r[0]), r[1], r[2]) for r in txn.fetchall()]

        return await self._db.run_interaction("get_to_device_outbox", query)

    async def get_outbox_destinations(self) -> list[str]:
        def query(txn: Transaction) -> list[str]:
            txn.execute("SELECT DISTINCT destination FROM device_federation_outbox ORDER BY destination")
            return [r[0] for r in txn.fetchall()]

        return await self._db.run_interaction("get_to_device_outbox_destinations", query)
