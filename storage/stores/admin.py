"""What the admin API reads and changes that no other store covers.

This store owns the ``users.admin`` flag, ``registration_tokens``, ``blocked_rooms`` and
``server_notice_rooms`` (migration 0015), and the admin's views over other tables: paginated user and room
lists with their sort orders, destination details, and purging a room's rows. It knows
nothing of HTTP or of the reference server's JSON shapes (homeserver/admin/ builds those).
Sort columns and directions come only from the code constants below, never from a request.
"""

# tests: tests/integration/test_admin_api.py

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from storage.database import Database, Transaction

# order_by value -> SQL expression over the user list below.
USER_ORDERS: Final[Mapping[str, str]] = {
    "name": "u.user_id",
    "is_guest": "u.is_guest",
    "admin": "u.admin",
    "deactivated": "u.deactivated",
    "displayname": "p.displayname",
    "avatar_url": "p.avatar_url",
    "creation_ts": "u.created_ts",
}

# order_by value -> column of the room summary below.
ROOM_ORDERS: Final[Mapping[str, str]] = {
    name: name for name in (
        "name", "canonical_alias", "joined_members", "joined_local_members", "version", "creator",
        "encryption", "federatable", "public", "join_rules", "guest_access", "history_visibility",
        "state_events",
    )
}

DESTINATION_ORDERS: Final[Mapping[str, str]] = {
    "destination": "destination",
    "retry_last_ts": "retry_last_ts",
    "retry_interval": "retry_interval",
    "failure_ts": "failure_ts",
    "last_successful_stream_ordering": "last_successful_stream_ordering",
}

# Tables purged with a room (delete room with "purge"), keyed by the column naming the room.
# Tables keyed by event come first (they are found through the room's events).
_PURGED_BY_EVENT: Final = ("event_state_groups", "event_txn_ids")
_PURGED_BY_ROOM: Final = (
    "event_edges", "event_auth", "event_forward_extremities", "event_redactions", "current_state_events", "room_memberships",
    "room_aliases", "destination_rooms", "receipts", "room_forgotten", "remote_invites", "typing_stream",
)


def _like(text: str) -> str:
    """``text`` as a literal inside an ILIKE pattern (``%`` ``_`` and ``\\`` escaped)."""
    return "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


@attrs.frozen
class AdminUserRow:
    user_id: str
    is_guest: bool
    admin: bool
    deactivated: bool
    displayname: str | None
    avatar_url: str | None
    created_ts: int
    has_password: bool
    # Deactivated with erasure (``erased_users``): their events are served redacted to newcomers.
    erased: bool


@attrs.frozen
class DestinationDetails:
    destination: str
    retry_last_ts: int
    retry_interval: int
    failure_ts: int | None
    last_successful_stream_ordering: int | None
    catch_up_from: int | None
    # destination_rooms rows above last_successful_stream_ordering: what catch-up would walk.
    rooms_behind: int


_USER_COLUMNS: Final = ("u.user_id, u.is_guest, u.admin, u.deactivated, p.displayname, p.avatar_url, u.created_ts, "
                        "u.password_hash IS NOT NULL, "
                        "EXISTS (SELECT 1 FROM erased_users e WHERE e.user_id = u.user_id)")
_USER_FIELDS: Final = 9


def _user(row: Sequence[Any]) -> AdminUserRow:
    return AdminUserRow(*row[:_USER_FIELDS])


_ROOM_SUMMARY: Final = """
    WITH summary AS (
        SELECT r.room_id, r.room_version AS version, r.creator, r.is_public AS public, r.created_ts,
            (SELECT (e.json::jsonb)->'content' FROM current_state_events c JOIN events e USING (event_id)
              WHERE c.room_id = r.room_id AND c.type = 'm.room.create' AND c.state_key = '') AS create_content,
            (SELECT (e.json::jsonb)->'content'->>'name' FROM current_state_events c JOIN events e USING (event_id)
              WHERE c.room_id = r.room_id AND c.type = 'm.room.name' AND c.state_key = '') AS name,
            (SELECT (e.json::jsonb)->'content'->>'alias' FROM current_state_events c JOIN events e USING (event_id)
              WHERE c.room_id = r.room_id AND c.type = 'm.room.canonical_alias' AND c.state_key = '')
              AS canonical_alias,
            (SELECT (e.json::jsonb)->'content'->>'topic' FROM current_state_events c JOIN events e USING (event_id)
              WHERE c.room_id = r.room_id AND c.type = 'm.room.topic' AND c.state_key = '') AS topic,
            (SELECT (e.json::jsonb)->'content'->>'url' FROM current_state_events c JOIN events e USING (event_id)
              WHERE c.room_id = r.room_id AND c.type = 'm.room.avatar' AND c.state_key = '') AS avatar,
            (SELECT (e.json::jsonb)->'content'->>'join_rule' FROM current_state_events c JOIN events e USING (event_id)
              WHERE c.room_id = r.room_id AND c.type = 'm.room.join_rules' AND c.state_key = '') AS join_rules,
            (SELECT (e.json::jsonb)->'content'->>'guest_access' FROM current_state_events c
              JOIN events e USING (event_id)
              WHERE c.room_id = r.room_id AND c.type = 'm.room.guest_access' AND c.state_key = '') AS guest_access,
            (SELECT (e.json::jsonb)->'content'->>'history_visibility' FROM current_state_events c
              JOIN events e USING (event_id)
              WHERE c.room_id = r.room_id AND c.type = 'm.room.history_visibility' AND c.state_key = '')
              AS history_visibility,
            (SELECT (e.json::jsonb)->'content'->>'algorithm' FROM current_state_events c JOIN events e USING (event_id)
              WHERE c.room_id = r.room_id AND c.type = 'm.room.encryption' AND c.state_key = '') AS encryption,
            (SELECT count(*) FROM current_state_events c
              WHERE c.room_id = r.room_id AND c.type = 'm.room.member' AND c.membership = 'join') AS joined_members,
            (SELECT count(*) FROM current_state_events c
              WHERE c.room_id = r.room_id AND c.type = 'm.room.member' AND c.membership = 'join'
                AND right(c.state_key, %s) = %s) AS joined_local_members,
            (SELECT count(*) FROM current_state_events c WHERE c.room_id = r.room_id) AS state_events
        FROM rooms r
    )
    SELECT room_id, version, creator, public, name, canonical_alias, topic, avatar, join_rules, guest_access,
        history_visibility, encryption, joined_members, joined_local_members, state_events,
        COALESCE(create_content->>'m.federate', 'true') <> 'false' AS federatable,
        create_content->>'type' AS room_type, count(*) OVER () AS total
    FROM summary
"""

ROOM_FIELDS: Final = (
    "room_id", "version", "creator", "public", "name", "canonical_alias", "topic", "avatar", "join_rules",
    "guest_access", "history_visibility", "encryption", "joined_members", "joined_local_members", "state_events",
    "federatable", "room_type",
)


class AdminStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    # --- users ------------------------------------------------------------------------------

    async def is_admin(self, user_id: str) -> bool:
        def query(txn: Transaction) -> bool:
            txn.execute("SELECT admin FROM users WHERE user_id = %s AND NOT deactivated", (user_id,))
            row = txn.fetchone()
            return bool(row and row[0])

        return await self._db.run_interaction("admin_is_admin", query)

    async def set_admin(self, user_id: str, admin: bool) -> bool:
        """Set the flag; False when there is no such user."""
        def write(txn: Transaction) -> bool:
            txn.execute("UPDATE users SET admin = %s WHERE user_id = %s", (admin, user_id))
            return bool(txn.rowcount)

        return await self._db.run_interaction("admin_set_admin", write)

    async def get_user(self, user_id: str) -> AdminUserRow | None:
        def query(txn: Transaction) -> AdminUserRow | None:
            txn.execute(f"SELECT {_USER_COLUMNS} FROM users u LEFT JOIN profiles p USING (user_id) "
                        "WHERE u.user_id = %s", (user_id,))
            row = txn.fetchone()
            return None if row is None else _user(row)

        return await self._db.run_interaction("admin_get_user", query)

    async def list_users(
        self, *, offset: int, limit: int, name: str | None, user_id: str | None, guests: bool,
        deactivated: bool, admins: bool | None, order_by: str, descending: bool,
    ) -> tuple[list[AdminUserRow], int]:
        """One page of users and the total matching; ``order_by`` is a key of ``USER_ORDERS``."""
        order = USER_ORDERS[order_by]
        direction = "DESC" if descending else "ASC"
        clauses: list[str] = []
        args: list[Any] = []
        if name is not None:
            clauses.append("(u.user_id ILIKE %s OR p.displayname ILIKE %s)")
            args += [_like(name), _like(name)]
        if user_id is not None:
            clauses.append("u.user_id ILIKE %s")
            args.append(_like(user_id))
        if not guests:
            clauses.append("NOT u.is_guest")
        if not deactivated:
            clauses.append("NOT u.deactivated")
        if admins is not None:
            clauses.append("u.admin = %s")
            args.append(admins)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""

        def query(txn: Transaction) -> tuple[list[AdminUserRow], int]:
            txn.execute(
                f"SELECT {_USER_COLUMNS}, count(*) OVER () FROM users u LEFT JOIN profiles p USING (user_id) {where} "
                f"ORDER BY {order} {direction} NULLS LAST, u.user_id {direction} LIMIT %s OFFSET %s",
                (*args, limit, offset),
            )
            rows = txn.fetchall()
            if rows:
                return [_user(row) for row in rows], int(rows[0][_USER_FIELDS])
            txn.execute(f"SELECT count(*) FROM users u LEFT JOIN profiles p USING (user_id) {where}", tuple(args))
            total = txn.fetchone()
            return [], int(total[0]) if total else 0

        return await self._db.run_interaction("admin_list_users", query)

    async def get_sessions(self, user_id: str) -> list[tuple[str, str | None, int | None]]:
        """(device_id, last_seen_ip, last_seen_ts) of every device, for whois."""
        def query(txn: Transaction) -> list[tuple[str, str | None, int | None]]:
            txn.execute("SELECT device_id, last_seen_ip, last_seen_ts FROM devices WHERE user_id = %s "
                        "ORDER BY device_id", (user_id,))
            return [(row[0], row[1], row[2]) for row in txn.fetchall()]

        return await self._db.run_interaction("admin_get_sessions", query)

    # --- rooms ------------------------------------------------------------------------------

    async def list_rooms(
        self, *, server_name: str, offset: int, limit: int, order_by: str, descending: bool,
        search_term: str | None, room_id: str | None = None,
    ) -> tuple[list[dict[str, Any]], int]:
        """Room summaries (``ROOM_FIELDS``) and the total matching; ``order_by`` is a key of ``ROOM_ORDERS``."""
        column = ROOM_ORDERS[order_by]
        direction = "DESC" if descending else "ASC"
        base: list[Any] = [len(server_name) + 1, f":{server_name}"]
        where = ""
        if room_id is not None:
            where = "WHERE room_id = %s"
            base.append(room_id)
        elif search_term is not None:
            where = "WHERE name ILIKE %s OR canonical_alias ILIKE %s OR room_id = %s"
            base += [_like(search_term), _like(search_term), search_term]
        # Rooms without a name sort by room ID among themselves, after the named ones.
        sql = f"{_ROOM_SUMMARY} {where} ORDER BY {column} {direction} NULLS LAST, room_id ASC LIMIT %s OFFSET %s"

        def query(txn: Transaction) -> tuple[list[dict[str, Any]], int]:
            txn.execute(sql, (*base, limit, offset))
            rows = txn.fetchall()
            total = int(rows[0][-1]) if rows else 0
            if not rows and offset:
                txn.execute(f"SELECT count(*) FROM ({_ROOM_SUMMARY} {where}) AS s", tuple(base))
                counted = txn.fetchone()
                total = int(counted[0]) if counted else 0
            return [dict(zip(ROOM_FIELDS, row[:-1], strict=True)) for row in rows], total

        return await self._db.run_interaction("admin_list_rooms", query)

    async def get_room_state(self, room_id: str) -> list[str]:
        """The room's current state as event JSON texts."""
        def query(txn: Transaction) -> list[str]:
            txn.execute("SELECT e.json FROM current_state_events c JOIN events e USING (event_id) "
                        "WHERE c.room_id = %s ORDER BY c.type, c.state_key", (room_id,))
            return [row[0] for row in txn.fetchall()]

        return await self._db.run_interaction("admin_get_room_state", query)

    async def get_room_members(self, room_id: str) -> list[str]:
        def query(txn: Transaction) -> list[str]:
            txn.execute("SELECT state_key FROM current_state_events WHERE room_id = %s AND type = 'm.room.member' "
                        "AND membership = 'join' ORDER BY state_key", (room_id,))
            return [row[0] for row in txn.fetchall()]

        return await self._db.run_interaction("admin_get_room_members", query)

    async def get_local_members(self, room_id: str, server_name: str) -> list[tuple[str, str]]:
        """(user_id, membership) of local users joined, invited or knocking."""
        def query(txn: Transaction) -> list[tuple[str, str]]:
            txn.execute("SELECT state_key, membership FROM current_state_events WHERE room_id = %s "
                        "AND type = 'm.room.member' AND membership IN ('join', 'invite', 'knock') "
                        "AND right(state_key, %s) = %s ORDER BY state_key",
                        (room_id, len(server_name) + 1, f":{server_name}"))
            return [(row[0], row[1]) for row in txn.fetchall()]

        return await self._db.run_interaction("admin_get_local_members", query)

    async def get_local_aliases(self, room_id: str) -> list[str]:
        def query(txn: Transaction) -> list[str]:
            txn.execute("SELECT room_alias FROM room_aliases WHERE room_id = %s ORDER BY room_alias", (room_id,))
            return [row[0] for row in txn.fetchall()]

        return await self._db.run_interaction("admin_get_local_aliases", query)

    async def room_exists(self, room_id: str) -> bool:
        def query(txn: Transaction) -> bool:
            txn.execute("SELECT 1 FROM rooms WHERE room_id = %s", (room_id,))
            return txn.fetchone() is not None

        return await self._db.run_interaction("admin_room_exists", query)

    async def block_room(self, room_id: str, user_id: str, block: bool, now_ms: int) -> None:
        def write(txn: Transaction) -> None:
            if block:
                txn.execute("INSERT INTO blocked_rooms (room_id, user_id, blocked_ts) VALUES (%s, %s, %s) "
                            "ON CONFLICT (room_id) DO NOTHING", (room_id, user_id, now_ms))
            else:
                txn.execute("DELETE FROM blocked_rooms WHERE room_id = %s", (room_id,))

        await self._db.run_interaction("admin_block_room", write)

    async def get_block(self, room_id: str) -> str | None:
        """Who blocked the room, or None when it is not blocked."""
        def query(txn: Transaction) -> str | None:
            txn.execute("SELECT user_id FROM blocked_rooms WHERE room_id = %s", (room_id,))
            row = txn.fetchone()
            return None if row is None else str(row[0])

        return await self._db.run_interaction("admin_get_block", query)

    async def purge_room(self, room_id: str) -> None:
        """Delete every row of the room: its events, state, memberships, aliases, receipts and
        the federation sender's catch-up rows. One transaction."""
        def write(txn: Transaction) -> None:
            for table in _PURGED_BY_EVENT:
                txn.execute(f"DELETE FROM {table} WHERE event_id IN (SELECT event_id FROM events WHERE room_id = %s)",
                            (room_id,))
            for table in _PURGED_BY_ROOM:
                txn.execute(f"DELETE FROM {table} WHERE room_id = %s", (room_id,))
            txn.execute("DELETE FROM state_groups_state WHERE state_group IN "
                        "(SELECT id FROM state_groups WHERE room_id = %s)", (room_id,))
            txn.execute("UPDATE state_groups SET prev_group = NULL WHERE room_id = %s", (room_id,))
            txn.execute("DELETE FROM state_groups WHERE room_id = %s", (room_id,))
            txn.execute("DELETE FROM events WHERE room_id = %s", (room_id,))
            txn.execute("DELETE FROM rooms WHERE room_id = %s", (room_id,))

        await self._db.run_interaction("admin_purge_room", write)

    async def get_event_position(self, room_id: str, event_id: str) -> int | None:
        """The stream ordering of one of the room's events, or None when it has no such event."""
        def query(txn: Transaction) -> int | None:
            txn.execute("SELECT stream_ordering FROM events WHERE room_id = %s AND event_id = %s", (room_id, event_id))
            row = txn.fetchone()
            return None if row is None else int(row[0])

        return await self._db.run_interaction("admin_get_event_position", query)

    async def purge_history(self, room_id: str, *, before_stream: int | None, before_ts: int | None,
                            delete_local_events: bool) -> int:
        """Delete the room's message events (never state events, nor its forward extremities)
        older than ``before_stream`` (stream ordering) or ``before_ts`` (origin_server_ts), only
        remote ones unless ``delete_local_events``. Returns how many events went."""
        clauses = ["room_id = %s", "state_key IS NULL",
                   "event_id NOT IN (SELECT event_id FROM event_forward_extremities WHERE room_id = %s)"]
        args: list[Any] = [room_id, room_id]
        if before_stream is not None:
            clauses.append("stream_ordering < %s")
            args.append(before_stream)
        if before_ts is not None:
            clauses.append("origin_server_ts < %s")
            args.append(before_ts)
        if not delete_local_events:
            clauses.append("NOT is_local")

        def write(txn: Transaction) -> int:
            txn.execute("CREATE TEMPORARY TABLE purged_events ON COMMIT DROP AS "
                        f"SELECT event_id FROM events WHERE {' AND '.join(clauses)}", tuple(args))
            for table, column in (("event_edges", "event_id"), ("event_auth", "event_id"),
                                  ("event_state_groups", "event_id"), ("event_txn_ids", "event_id"),
                                  ("event_redactions", "redaction_id")):
                txn.execute(f"DELETE FROM {table} WHERE {column} IN (SELECT event_id FROM purged_events)")
            txn.execute("DELETE FROM events WHERE event_id IN (SELECT event_id FROM purged_events)")
            return int(txn.rowcount)

        return await self._db.run_interaction("admin_purge_history", write)

    # --- federation destinations ------------------------------------------------------------

    async def list_destinations(
        self, *, offset: int, limit: int, order_by: str, descending: bool, search: str | None,
    ) -> tuple[list[DestinationDetails], int]:
        column = DESTINATION_ORDERS[order_by]
        direction = "DESC" if descending else "ASC"
        where, args = ("WHERE d.destination ILIKE %s", [_like(search)]) if search else ("", [])

        def query(txn: Transaction) -> tuple[list[DestinationDetails], int]:
            txn.execute(
                "SELECT d.destination, COALESCE(d.retry_last_ts, 0), COALESCE(d.retry_interval, 0), d.failure_ts, "
                "d.last_successful_stream_ordering, d.catch_up_from, "
                "(SELECT count(*) FROM destination_rooms r WHERE r.destination = d.destination "
                " AND r.stream_ordering > COALESCE(d.last_successful_stream_ordering, 0)), count(*) OVER () "
                f"FROM destinations d {where} ORDER BY {column} {direction} NULLS LAST, d.destination "
                "LIMIT %s OFFSET %s", (*args, limit, offset))
            rows = txn.fetchall()
            total = int(rows[0][7]) if rows else 0
            if not rows and offset:
                txn.execute(f"SELECT count(*) FROM destinations d {where}", tuple(args))
                counted = txn.fetchone()
                total = int(counted[0]) if counted else 0
            return [DestinationDetails(*row[:7]) for row in rows], total

        return await self._db.run_interaction("admin_list_destinations", query)

    async def get_destination(self, destination: str) -> DestinationDetails | None:
        def query(txn: Transaction) -> DestinationDetails | None:
            txn.execute(
                "SELECT d.destination, COALESCE(d.retry_last_ts, 0), COALESCE(d.retry_interval, 0), d.failure_ts, "
                "d.last_successful_stream_ordering, d.catch_up_from, "
                "(SELECT count(*) FROM destination_rooms r WHERE r.destination = d.destination "
                " AND r.stream_ordering > COALESCE(d.last_successful_stream_ordering, 0)) "
                "FROM destinations d WHERE d.destination = %s", (destination,))
            row = txn.fetchone()
            return None if row is None else DestinationDetails(*row)

        return await self._db.run_interaction("admin_get_destination", query)

    async def get_destination_rooms(self, destination: str, *, offset: int, limit: int,
                                    descending: bool) -> tuple[list[tuple[str, int]], int]:
        direction = "DESC" if descending else "ASC"

        def query(txn: Transaction) -> tuple[list[tuple[str, int]], int]:
            txn.execute("SELECT room_id, stream_ordering, count(*) OVER () FROM destination_rooms "
                        f"WHERE destination = %s ORDER BY room_id {direction} LIMIT %s OFFSET %s",
                        (destination, limit, offset))
            rows = txn.fetchall()
            return [(row[0], int(row[1])) for row in rows], int(rows[0][2]) if rows else 0

        return await self._db.run_interaction("admin_get_destination_rooms", query)

    async def reset_backoff(self, destination: str) -> bool:
        """Forget the destination's backoff (as an inbound request from it would); False if unknown."""
        def write(txn: Transaction) -> bool:
            txn.execute("UPDATE destinations SET retry_last_ts = 0, retry_interval = 0, failure_ts = NULL "
                        "WHERE destination = %s", (destination,))
            return bool(txn.rowcount)

        return await self._db.run_interaction("admin_reset_backoff", write)

    # --- registration tokens ----------------------------------------------------------------

    async def list_registration_tokens(self, valid: bool | None, now_ms: int) -> list[tuple[Any, ...]]:
        clause = ""
        if valid is True:
            clause = ("WHERE (uses_allowed IS NULL OR pending + completed < uses_allowed) "
                      "AND (expiry_time IS NULL OR expiry_time > %s)")
        elif valid is False:
            clause = ("WHERE NOT ((uses_allowed IS NULL OR pending + completed < uses_allowed) "
                      "AND (expiry_time IS NULL OR expiry_time > %s))")

        def query(txn: Transaction) -> list[tuple[Any, ...]]:
            txn.execute("SELECT token, uses_allowed, pending, completed, expiry_time FROM registration_tokens "
                        f"{clause} ORDER BY token", (now_ms,) if clause else ())
            return [tuple(row) for row in txn.fetchall()]

        return await self._db.run_interaction("admin_list_registration_tokens", query)

    async def get_registration_token(self, token: str) -> tuple[Any, ...] | None:
        def query(txn: Transaction) -> tuple[Any, ...] | None:
            txn.execute("SELECT token, uses_allowed, pending, completed, expiry_time FROM registration_tokens "
                        "WHERE token = %s", (token,))
            row = txn.fetchone()
            return None if row is None else tuple(row)

        return await self._db.run_interaction("admin_get_registration_token", query)

    async def create_registration_token(self, token: str, uses_allowed: int | None, expiry_time: int | None) -> bool:
        """False when the token exists already."""
        def write(txn: Transaction) -> bool:
            txn.execute("INSERT INTO registration_tokens (token, uses_allowed, expiry_time) VALUES (%s, %s, %s) "
                        "ON CONFLICT (token) DO NOTHING", (token, uses_allowed, expiry_time))
            return bool(txn.rowcount)

        return await self._db.run_interaction("admin_create_registration_token", write)

    async def update_registration_token(self, token: str, changes: Mapping[str, int | None]) -> bool:
        columns = [name for name in ("uses_allowed", "expiry_time") if name in changes]
        if not columns:
            return await self.get_registration_token(token) is not None

        def write(txn: Transaction) -> bool:
            assignments = ", ".join(f"{name} = %s" for name in columns)
            txn.execute(f"UPDATE registration_tokens SET {assignments} WHERE token = %s",
                        (*(changes[name] for name in columns), token))
            return bool(txn.rowcount)

        return await self._db.run_interaction("admin_update_registration_token", write)

    async def delete_registration_token(self, token: str) -> bool:
        def write(txn: Transaction) -> bool:
            txn.execute("DELETE FROM registration_tokens WHERE token = %s", (token,))
            return bool(txn.rowcount)

        return await self._db.run_interaction("admin_delete_registration_token", write)

    async def use_registration_token(self, token: str, now_ms: int) -> bool:
        """Count one registration against the token if it is still valid; False when it is not."""
        def write(txn: Transaction) -> bool:
            txn.execute("UPDATE registration_tokens SET completed = completed + 1 WHERE token = %s "
                        "AND (uses_allowed IS NULL OR pending + completed < uses_allowed) "
                        "AND (expiry_time IS NULL OR expiry_time > %s)", (token, now_ms))
            return bool(txn.rowcount)

        return await self._db.run_interaction("admin_use_registration_token", write)

    async def registration_token_valid(self, token: str, now_ms: int) -> bool:
        def query(txn: Transaction) -> bool:
            txn.execute("SELECT 1 FROM registration_tokens WHERE token = %s "
                        "AND (uses_allowed IS NULL OR pending + completed < uses_allowed) "
                        "AND (expiry_time IS NULL OR expiry_time > %s)", (token, now_ms))
            return txn.fetchone() is not None

        return await self._db.run_interaction("admin_registration_token_valid", query)

    # --- server notices ---------------------------------------------------------------------

    async def get_notice_room(self, user_id: str) -> str | None:
        def query(txn: Transaction) -> str | None:
            txn.execute("SELECT room_id FROM server_notice_rooms WHERE user_id = %s", (user_id,))
            row = txn.fetchone()
            return None if row is None else str(row[0])

        return await self._db.run_interaction("admin_get_notice_room", query)

    async def set_notice_room(self, user_id: str, room_id: str) -> None:
        def write(txn: Transaction) -> None:
            txn.execute("INSERT INTO server_notice_rooms (user_id, room_id) VALUES (%s, %s) "
                        "ON CONFLICT (user_id) DO UPDATE SET room_id = EXCLUDED.room_id", (user_id, room_id))

        await self._db.run_interaction("admin_set_notice_room", write)


# --- admin tasks (schema 0025) --------------------------------------------------------------


@attrs.frozen
class AdminTaskRow:
    id: str
    action: str
    resource_id: str
    params: str
    status: str
    timestamp_ms: int
    result: str | None
    error: str | None


_TASK_COLUMNS = "id, action, resource_id, params, status, timestamp_ms, result, error"


def _task_row(row: Sequence[Any]) -> AdminTaskRow:
    return AdminTaskRow(str(row[0]), str(row[1]), str(row[2]), str(row[3]), str(row[4]), int(row[5]),
                        None if row[6] is None else str(row[6]), None if row[7] is None else str(row[7]))


class AdminTaskStore:
    """``admin_tasks``: the admin API's background tasks (homeserver/admin/tasks.py)."""

    def __init__(self, db: Database) -> None:
        self._db = db

    async def _fetch(self, name: str, sql: str, *args: object) -> list[tuple[Any, ...]]:
        def txn_fn(txn: Transaction) -> list[tuple[Any, ...]]:
            txn.execute(sql, args)
            return txn.fetchall()

        return await self._db.run_interaction(name, txn_fn)

    async def _write(self, name: str, sql: str, *args: object) -> None:
        def txn_fn(txn: Transaction) -> None:
            txn.execute(sql, args)

        await self._db.run_interaction(name, txn_fn)

    async def insert_task(self, task_id: str, action: str, resource_id: str, params: str, timestamp_ms: int, *,
                          keep: int) -> None:
        """A new scheduled task; finished tasks beyond the newest ``keep`` are forgotten."""

        def txn_fn(txn: Transaction) -> None:
            txn.execute(
                "INSERT INTO admin_tasks (id, action, resource_id, params, status, timestamp_ms) "
                "VALUES (%s, %s, %s, %s, 'scheduled', %s)",
                (task_id, action, resource_id, params, timestamp_ms),
            )
            txn.execute(
                "DELETE FROM admin_tasks WHERE status IN ('complete', 'failed') AND id NOT IN "
                "(SELECT id FROM admin_tasks ORDER BY timestamp_ms DESC, id LIMIT %s)",
                (keep,),
            )

        await self._db.run_interaction("admin_insert_task", txn_fn)

    async def set_task_status(self, task_id: str, status: str) -> None:
        await self._write("admin_task_status", "UPDATE admin_tasks SET status = %s WHERE id = %s",
                               status, task_id)

    async def finish_task(self, task_id: str, status: str, result: str | None, error: str | None) -> None:
        await self._write("admin_finish_task",
                               "UPDATE admin_tasks SET status = %s, result = %s, error = %s WHERE id = %s",
                               status, result, error, task_id)

    async def get_task(self, task_id: str) -> AdminTaskRow | None:
        rows = await self._fetch("admin_get_task", f"SELECT {_TASK_COLUMNS} FROM admin_tasks WHERE id = %s",
                                      task_id)
        return _task_row(rows[0]) if rows else None

    async def list_tasks(self, action: str | None, status: str | None, resource_id: str | None) -> list[AdminTaskRow]:
        rows = await self._fetch(
            "admin_list_tasks",
            f"SELECT {_TASK_COLUMNS} FROM admin_tasks WHERE (%s::text IS NULL OR action = %s) "
            "AND (%s::text IS NULL OR status = %s) AND (%s::text IS NULL OR resource_id = %s) "
            "ORDER BY timestamp_ms DESC, id",
            action, action, status, status, resource_id, resource_id,
        )
        return [_task_row(row) for row in rows]

    async def unfinished_tasks(self) -> list[AdminTaskRow]:
        rows = await self._fetch(
            "admin_unfinished_tasks",
            f"SELECT {_TASK_COLUMNS} FROM admin_tasks WHERE status IN ('scheduled', 'active') ORDER BY timestamp_ms, id",
        )
        return [_task_row(row) for row in rows]
