"""SQL for the federation sender: fan-out reads, destination bookkeeping, catch-up, the to-device outbox,
device-list updates.

``destinations`` holds each remote server's backoff and how far it has
acknowledged our events; ``destination_rooms`` (written by the persist
transaction) the newest of our events each of them should have per room;
``events.destinations`` the servers each local event was fanned out to;
``destinations.device_lists_position`` how far along the ``device_lists``
stream each has acknowledged our users' changes.
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
class DeviceListRow:
    """One device named by a user's newest change above the destination's position."""

    user_id: str
    stream_id: int
    device_id: str
    deleted: bool
    prev_id: int | None  # the user's previous change (None: this is the first)
    display_name: str | None = None
    key_json: str | None = None
    # The user's own cross-signing signatures of the device: (signing key ID, signature).
    signatures: tuple[tuple[str, str], ...] = ()


@attrs.frozen
class SigningKeysRow:
    """A user whose master or self-signing key changed above the destination's position: its
    newest such change, and the keys as they are now."""

    user_id: str
    stream_id: int
    keys: tuple[tuple[str, str], ...]  # (key type: master / self_signing, key JSON)
    # The owner's signatures of its keys: (target public key, signing key ID, signature).
    signatures: tuple[tuple[str, str, str], ...] = ()


@attrs.frozen
class DeviceListRead:
    """What a destination's device-list read found (``get_device_list_updates``)."""

    devices: list[DeviceListRow]
    signing: list[SigningKeysRow]
    # A change lies above ``upto`` (written, but the stream has not passed it).
    ahead: bool


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


@attrs.frozen
class SentMark:
    """What one destination's accepted transaction moves (``FederationSenderStore.mark_sent``)."""

    destination: str
    advance_to: int | None
    reset_retry: bool
    to_device_upto: int | None
    device_lists_upto: int | None = None

    def is_empty(self) -> bool:
        return (self.advance_to is None and not self.reset_retry and self.to_device_upto is None
                and self.device_lists_upto is None)


def _mark_sent_txn(txn: Transaction, mark: SentMark) -> None:
    if mark.advance_to is not None or mark.reset_retry:
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
            (mark.destination, mark.advance_to, mark.reset_retry, mark.reset_retry, mark.reset_retry),
        )
    if mark.to_device_upto is not None:
        txn.execute(
            "DELETE FROM device_federation_outbox WHERE destination = %s AND stream_id <= %s",
            (mark.destination, mark.to_device_upto),
        )
    if mark.device_lists_upto is not None:
        txn.execute(
            """
            UPDATE destinations SET device_lists_position = GREATEST(device_lists_position, %s)
            WHERE destination = %s
            """,
            (mark.device_lists_upto, mark.destination),
        )


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
        self, destination: str, advance_to: int | None, *, reset_retry: bool, to_device_upto: int | None,
        device_lists_upto: int | None = None,
    ) -> None:
        """A transaction was accepted: advance the position, clear the backoff, drop delivered
        to-device messages, advance the device-list position; one transaction, and none at all
        when there is nothing to write."""
        await self.mark_sent_many([SentMark(destination, advance_to, reset_retry, to_device_upto, device_lists_upto)])

    async def mark_sent_many(self, marks: Sequence[SentMark]) -> None:
        """``mark_sent`` for the accepted transactions of several destinations (at most one
        mark a destination) in one database transaction: the sender writes the positions of
        the transactions answered while the previous write was under way together."""
        marks = sorted((m for m in marks if not m.is_empty()), key=lambda m: m.destination)
        if not marks:
            return

        def write(txn: Transaction) -> None:
            for mark in marks:
                _mark_sent_txn(txn, mark)

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

    # --- device-list updates -------------------------------------------------------------

    async def note_device_list_change(self, destinations: Collection[str], stream_id: int) -> None:
        """A local user's change at ``stream_id`` is meant for ``destinations``: a destination that
        has no device-list position yet starts just below it (written before the sender is told,
        so a crash cannot lose the change)."""
        if not destinations:
            return

        def write(txn: Transaction) -> None:
            txn.execute_values(
                """
                INSERT INTO destinations (destination, retry_last_ts, retry_interval, device_lists_position)
                VALUES %s
                ON CONFLICT (destination) DO UPDATE SET device_lists_position =
                    COALESCE(destinations.device_lists_position, EXCLUDED.device_lists_position)
                """,
                [(d, 0, 0, stream_id - 1) for d in sorted(set(destinations))],
            )

        await self._db.run_interaction("note_device_list_change", write)

    async def get_device_list_updates(
        self, destination: str, local_server: str, upto: int, limit: int
    ) -> DeviceListRead:
        """Per local user sharing a room with ``destination`` (oldest first, at most ``limit + 1``
        users), the devices its newest change in (``device_lists_position``, ``upto``] names; the
        same for changes of master and self-signing keys (rows naming a current such key's
        public key); and whether either lies above ``upto``."""

        def query(txn: Transaction) -> DeviceListRead:
            shared = (destination, _like_server_suffix(destination), _like_server_suffix(local_server))
            sharing = """
                WITH pos AS (
                    SELECT device_lists_position AS p FROM destinations
                    WHERE destination = %s AND device_lists_position IS NOT NULL
                ), sharing AS (
                    SELECT DISTINCT u.state_key AS user_id
                    FROM current_state_events u
                    JOIN current_state_events m ON m.room_id = u.room_id AND m.type = 'm.room.member'
                        AND m.membership = 'join' AND m.state_key LIKE %s
                    WHERE u.type = 'm.room.member' AND u.membership = 'join' AND u.state_key LIKE %s
                ), device_rows AS (
                    -- Rows about devices: deletions, and devices that exist (not cross-signing keys).
                    SELECT s.user_id, s.stream_id, s.device_id, s.deleted
                    FROM device_lists_stream s JOIN sharing ON sharing.user_id = s.user_id, pos
                    WHERE s.stream_id > pos.p AND (s.deleted OR EXISTS (
                        SELECT 1 FROM devices v WHERE v.user_id = s.user_id AND v.device_id = s.device_id))
                ), signing_rows AS (
                    -- Rows about a current master or self-signing key (the row names its public key).
                    SELECT s.user_id, s.stream_id
                    FROM device_lists_stream s JOIN sharing ON sharing.user_id = s.user_id, pos
                    WHERE s.stream_id > pos.p AND NOT s.deleted AND EXISTS (
                        SELECT 1 FROM e2e_cross_signing_keys c
                        WHERE c.user_id = s.user_id AND c.key_type IN ('master', 'self_signing')
                          AND (c.key_json::jsonb -> 'keys') ? ('ed25519:' || s.device_id))
                )
            """
            txn.execute(
                sharing + """
                , changed AS (
                    SELECT user_id, MAX(stream_id) AS stream_id FROM device_rows
                    WHERE stream_id <= %s GROUP BY user_id ORDER BY 2 LIMIT %s
                )
                SELECT c.user_id, c.stream_id, r.device_id, r.deleted,
                    (SELECT MAX(p.stream_id) FROM device_lists_stream p
                     WHERE p.user_id = c.user_id AND p.stream_id < c.stream_id),
                    v.display_name, k.key_json,
                    (SELECT array_agg(ARRAY[g.signing_key_id, g.signature] ORDER BY g.signing_key_id)
                     FROM e2e_cross_signing_signatures g
                     WHERE g.signer_user_id = r.user_id AND g.target_user_id = r.user_id
                       AND g.target_key_id = r.device_id)
                FROM changed c
                JOIN device_rows r ON r.user_id = c.user_id AND r.stream_id = c.stream_id
                LEFT JOIN devices v ON v.user_id = r.user_id AND v.device_id = r.device_id
                LEFT JOIN e2e_device_keys k ON k.user_id = r.user_id AND k.device_id = r.device_id
                ORDER BY c.stream_id, c.user_id, r.device_id
                """,
                (*shared, upto, limit + 1),
            )
            rows = [
                DeviceListRow(r[0], int(r[1]), r[2], bool(r[3]), None if r[4] is None else int(r[4]), r[5], r[6],
                              tuple((str(g[0]), str(g[1])) for g in r[7] or ()))
                for r in txn.fetchall()
            ]
            txn.execute(
                sharing + """
                , changed AS (
                    SELECT user_id, MAX(stream_id) AS stream_id FROM signing_rows
                    WHERE stream_id <= %s GROUP BY user_id ORDER BY 2 LIMIT %s
                )
                SELECT c.user_id, c.stream_id,
                    (SELECT array_agg(ARRAY[k.key_type, k.key_json] ORDER BY k.key_type)
                     FROM e2e_cross_signing_keys k
                     WHERE k.user_id = c.user_id AND k.key_type IN ('master', 'self_signing')),
                    (SELECT array_agg(ARRAY[g.target_key_id, g.signing_key_id, g.signature]
                                      ORDER BY g.target_key_id, g.signing_key_id)
                     FROM e2e_cross_signing_signatures g
                     WHERE g.signer_user_id = c.user_id AND g.target_user_id = c.user_id)
                FROM changed c ORDER BY c.stream_id, c.user_id
                """,
                (*shared, upto, limit + 1),
            )
            signing = [
                SigningKeysRow(r[0], int(r[1]), tuple((str(k[0]), str(k[1])) for k in r[2] or ()),
                               tuple((str(g[0]), str(g[1]), str(g[2])) for g in r[3] or ()))
                for r in txn.fetchall()
            ]
            txn.execute(
                sharing + """
                SELECT 1 FROM device_rows WHERE stream_id > %s
                UNION ALL SELECT 1 FROM signing_rows WHERE stream_id > %s LIMIT 1
                """,
                (*shared, upto, upto),
            )
            return DeviceListRead(rows, signing, txn.fetchone() is not None)

        return await self._db.run_interaction("get_device_list_updates", query)

    async def get_device_lists_destinations(self, local_server: str) -> list[str]:
        """Destinations with a local user's device change above their position, among the users
        sharing a room with them (start-up: what a crash left unsent)."""

        def query(txn: Transaction) -> list[str]:
            txn.execute(
                """
                SELECT d.destination FROM destinations d
                WHERE d.device_lists_position IS NOT NULL AND EXISTS (
                    SELECT 1 FROM device_lists_stream s
                    JOIN current_state_events u ON u.type = 'm.room.member' AND u.membership = 'join'
                        AND u.state_key = s.user_id
                    JOIN current_state_events m ON m.room_id = u.room_id AND m.type = 'm.room.member'
                        AND m.membership = 'join' AND m.state_key LIKE '%%:' || d.destination
                    WHERE s.stream_id > d.device_lists_position AND s.user_id LIKE %s
                      AND (s.deleted OR EXISTS (
                          SELECT 1 FROM devices v WHERE v.user_id = s.user_id AND v.device_id = s.device_id)
                        OR EXISTS (
                          SELECT 1 FROM e2e_cross_signing_keys c
                          WHERE c.user_id = s.user_id AND c.key_type IN ('master', 'self_signing')
                            AND (c.key_json::jsonb -> 'keys') ? ('ed25519:' || s.device_id)))
                )
                ORDER BY d.destination
                """,
                (_like_server_suffix(local_server),),
            )
            return [r[0] for r in txn.fetchall()]

        return await self._db.run_interaction("get_device_lists_destinations", query)
