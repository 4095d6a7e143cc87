"""Simplified sliding sync (MSC4186): the room list in recency order, and per-connection state.

Owns the SQL of ``homeserver/handlers/sync/sliding_sync.py``: a user's rooms filtered and ordered
by their newest "bump" event in one query (never every room loaded into Python), the state
reads a room result needs, and the connection tables of schema 0022 (which rooms each
``conn_id`` has been sent, as of each ``pos``). It knows nothing of request formats or of
what a room result holds.
"""

# tests: tests/integration/test_sliding_sync.py

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Final

import attrs

from storage.database import Database, Transaction
from storage.stores.events import StateKey
from storage.stores.remote_invites import RemoteInviteRow, get_remote_invites_txn
from storage.stores.timeline import RoomPosition

# MSC4186 ``bump_stamp``: the event types that count as activity in a room (the partial index
# ``events_room_bump`` of schema 0022 lists the same).
BUMP_TYPES: Final = (
    "m.room.create", "m.room.message", "m.room.encrypted", "m.sticker", "m.call.invite", "m.poll.start",
    "m.beacon_info",
)
_BUMP_SQL: Final = "(" + ", ".join(f"'{t}'" for t in BUMP_TYPES) + ")"
# Events clients may see (storage/stores/timeline.py's rule), as the partial index states it.
_LIVE: Final = "NOT outlier AND rejection_reason IS NULL AND NOT soft_failed"
# A room the user left or was banned from is theirs to see only when they were once joined
# (MSC4186: not a ban without a join, nor an invite withdrawn); ``m`` is the user's member row.
_EVER_JOINED: Final = (
    "(m.membership NOT IN ('leave', 'ban') OR EXISTS (SELECT 1 FROM room_memberships j "
    "WHERE j.user_id = m.state_key AND j.room_id = m.room_id AND j.membership = 'join'))"
)
# The memberships a room list holds (MSC4186 "Lists").
LIST_MEMBERSHIPS: Final = ("join", "invite", "knock", "leave", "ban")


@attrs.frozen
class RoomListQuery:
    """One list's filters, as SQL takes them. None: the filter is not set."""

    is_dm: bool | None = None
    dm_rooms: frozenset[str] = frozenset()
    is_encrypted: bool | None = None
    is_invite: bool | None = None
    # Room types (None inside: rooms without a type).
    room_types: tuple[str | None, ...] | None = None
    not_room_types: tuple[str | None, ...] = ()
    # The rooms of the spaces asked for (their m.space.child state), or None for no filter.
    space_rooms: frozenset[str] | None = None
    # Rooms the user left themselves are listed only when the connection already has them.
    sent_rooms: frozenset[str] = frozenset()
    # Room tags (m.tag room account data): any of ``tags`` (None: no filter), none of ``not_tags``.
    tags: tuple[str, ...] | None = None
    not_tags: tuple[str, ...] = ()
    # Rooms left out whatever else matches (joined with partial state, for a list that needs
    # their members).
    excluded: frozenset[str] = frozenset()


@attrs.frozen
class RoomListEntry:
    room_id: str
    membership: str
    # The user's member event, and the activity order: the newest bump event of a joined room,
    # the member event's stream ordering otherwise.
    event_id: str
    bump_stamp: int
    # The member event's stream ordering: a joined user sees every event of the room after it.
    member_stream_ordering: int
    # An invite (or knock) to a room this server is not in: only its remote_invites row is known.
    remote: bool = False


@attrs.frozen
class RoomStatus:
    """What a connection has of a room: ``live`` (everything up to the position's token) or
    sent up to ``last_token`` only; ``config`` is the room config it was sent with (JSON), and
    ``membership`` the user's membership then."""

    live: bool
    last_token: str | None
    config: str
    membership: str


@attrs.frozen
class ConnectionPosition:
    connection_key: int
    position_id: int
    token: str
    rooms: dict[str, RoomStatus]
    # The room subscriptions in force (JSON: room ID -> room config).
    subscriptions: str = "{}"


@attrs.frozen
class RoomStatusChange:
    room_id: str
    status: RoomStatus


class ConnectionGone(Exception):
    """The connection was replaced (a new request without ``pos``) or expired meanwhile."""


def _type_condition(types: Sequence[str | None], params: list[object], column: str) -> str:
    named = [t for t in types if t is not None]
    parts = []
    if named:
        parts.append(f"{column} = ANY(%s)")
        params.append(named)
    if any(t is None for t in types):
        parts.append(f"{column} IS NULL")
    # NULL (a room without a type against named types) counts as no match, also under NOT.
    return "COALESCE((" + " OR ".join(parts) + "), FALSE)" if parts else "FALSE"


def _room_list_txn(
    txn: Transaction, user_id: str, query: RoomListQuery, limit: int
) -> tuple[int, list[RoomListEntry]]:
    params: list[object] = [user_id, list(LIST_MEMBERSHIPS), user_id, user_id, sorted(query.sent_rooms)]
    where = ["TRUE"]
    if query.is_dm is not None:
        where.append(("" if query.is_dm else "NOT ") + "(m.room_id = ANY(%s))")
        params.append(sorted(query.dm_rooms))
    if query.is_encrypted is not None:
        where.append(("" if query.is_encrypted else "NOT ") + "EXISTS (SELECT 1 FROM current_state_events s "
                     "WHERE s.room_id = m.room_id AND s.type = 'm.room.encryption' AND s.state_key = '')")
    if query.is_invite is not None:
        where.append("m.membership " + ("=" if query.is_invite else "<>") + " 'invite'")
    room_type = ("(SELECT (ce.json::jsonb -> 'content' ->> 'type') FROM current_state_events s "
                 "JOIN events ce ON ce.event_id = s.event_id "
                 "WHERE s.room_id = m.room_id AND s.type = 'm.room.create' AND s.state_key = '')")
    if query.room_types is not None:
        where.append(_type_condition(query.room_types, params, room_type))
    if query.not_room_types:
        where.append("NOT " + _type_condition(query.not_room_types, params, room_type))
    if query.space_rooms is not None:
        where.append("m.room_id = ANY(%s)")
        params.append(sorted(query.space_rooms))
    if query.excluded:
        where.append("NOT (m.room_id = ANY(%s))")
        params.append(sorted(query.excluded))
    tagged = ("EXISTS (SELECT 1 FROM account_data ad WHERE ad.user_id = m.state_key AND ad.room_id = m.room_id "
              "AND ad.account_data_type = 'm.tag' AND jsonb_typeof(ad.content::jsonb -> 'tags') = 'object' "
              "AND (ad.content::jsonb -> 'tags') ?| %s::text[])")
    if query.tags is not None:
        where.append(tagged)
        params.append(list(query.tags))
    if query.not_tags:
        where.append("NOT " + tagged)
        params.append(list(query.not_tags))
    params.append(limit)
    # The user's member rows only (no event read) for all the rooms, the newest bump event of
    # each joined room by one probe of the partial index events_room_bump; the member event
    # itself is read only where needed: a room without a bump event, a left room's sender, and
    # the rows the range keeps.
    def member_so(alias: str) -> str:
        return f"(SELECT stream_ordering FROM events me WHERE me.event_id = {alias}.event_id)"

    txn.execute(
        f"""
        WITH m AS (
            SELECT c.room_id, c.state_key, c.membership, c.event_id, NULL::bigint AS stream_ordering,
                   FALSE AS remote
            FROM current_state_events c
            WHERE c.type = 'm.room.member' AND c.state_key = %s AND c.membership = ANY(%s)
            UNION ALL
            -- Invites (and knocks) to rooms this server is not in (storage/stores/remote_invites.py).
            SELECT ri.room_id, ri.user_id, ri.membership, ri.event_id, ri.stream_ordering, TRUE
            FROM remote_invites ri
            WHERE ri.user_id = %s AND ri.membership IN ('invite', 'knock') AND NOT EXISTS (
                SELECT 1 FROM current_state_events o WHERE o.room_id = ri.room_id AND o.type = 'm.room.member'
                AND o.state_key = ri.user_id)
        ), ranked AS (
            SELECT m.room_id, m.membership, m.event_id, m.remote, m.stream_ordering,
                   COALESCE(b.stream_ordering, m.stream_ordering, {member_so('m')}) AS bump,
                   count(*) OVER () AS total
            FROM m LEFT JOIN LATERAL (
                SELECT stream_ordering FROM events
                WHERE m.membership = 'join' AND events.room_id = m.room_id AND type IN {_BUMP_SQL} AND {_LIVE}
                ORDER BY stream_ordering DESC LIMIT 1
            ) b ON TRUE
            WHERE CASE WHEN m.membership = 'leave' AND NOT m.remote THEN
                    (SELECT me.sender FROM events me WHERE me.event_id = m.event_id) <> %s OR m.room_id = ANY(%s)
                  ELSE TRUE END
            AND {_EVER_JOINED} AND {' AND '.join(where)}
            ORDER BY bump DESC, m.room_id
            LIMIT %s
        )
        SELECT room_id, membership, event_id, bump, total, COALESCE(stream_ordering, {member_so("r")}),
               remote
        FROM ranked r ORDER BY bump DESC, room_id
        """,
        params,
    )
    rows = txn.fetchall()
    total = int(rows[0][4]) if rows else 0
    return total, [RoomListEntry(str(r[0]), str(r[1]), str(r[2]), int(r[3]), int(r[5]), bool(r[6])) for r in rows]


def _resume_txn(
    txn: Transaction, user_id: str, device_id: str, conn_id: str, position_id: int, now_ms: int
) -> ConnectionPosition | None:
    txn.execute(
        "SELECT c.connection_key, p.token, p.subscriptions FROM sliding_sync_connections c "
        "JOIN sliding_sync_positions p ON p.connection_key = c.connection_key "
        "WHERE c.user_id = %s AND c.device_id = %s AND c.conn_id = %s AND p.position_id = %s",
        (user_id, device_id, conn_id, position_id),
    )
    row = txn.fetchone()
    if row is None:
        return None
    key, token, subscriptions = int(row[0]), str(row[1]), str(row[2])
    # The client has processed ``position_id``: later answers were never used, earlier rows are
    # folded into it (each room keeps its newest row at or below it).
    txn.execute("DELETE FROM sliding_sync_rooms WHERE connection_key = %s AND position_id > %s", (key, position_id))
    txn.execute(
        "DELETE FROM sliding_sync_rooms r WHERE r.connection_key = %s AND EXISTS ("
        " SELECT 1 FROM sliding_sync_rooms n WHERE n.connection_key = r.connection_key"
        " AND n.room_id = r.room_id AND n.position_id > r.position_id)",
        (key,),
    )
    txn.execute("UPDATE sliding_sync_rooms SET position_id = %s WHERE connection_key = %s AND position_id < %s",
                (position_id, key, position_id))
    txn.execute("DELETE FROM sliding_sync_positions WHERE connection_key = %s AND position_id <> %s",
                (key, position_id))
    txn.execute("UPDATE sliding_sync_connections SET last_used_ts = %s WHERE connection_key = %s", (now_ms, key))
    txn.execute("SELECT room_id, status, last_token, config, membership FROM sliding_sync_rooms "
                "WHERE connection_key = %s", (key,))
    rooms = {str(r[0]): RoomStatus(r[1] == "live", r[2], str(r[3]), str(r[4])) for r in txn.fetchall()}
    return ConnectionPosition(key, position_id, token, rooms, subscriptions)


def _new_connection_txn(
    txn: Transaction, user_id: str, device_id: str, conn_id: str, now_ms: int, max_per_device: int
) -> int:
    txn.execute(
        "DELETE FROM sliding_sync_connections WHERE user_id = %s AND device_id = %s AND conn_id = %s",
        (user_id, device_id, conn_id),
    )
    # A device keeps at most ``max_per_device`` connections: the least recently used go first.
    txn.execute(
        "DELETE FROM sliding_sync_connections WHERE connection_key IN ("
        " SELECT connection_key FROM sliding_sync_connections WHERE user_id = %s AND device_id = %s"
        " ORDER BY last_used_ts DESC, connection_key DESC OFFSET %s)",
        (user_id, device_id, max_per_device - 1),
    )
    txn.execute(
        "INSERT INTO sliding_sync_connections (user_id, device_id, conn_id, created_ts, last_used_ts) "
        "VALUES (%s, %s, %s, %s, %s) RETURNING connection_key",
        (user_id, device_id, conn_id, now_ms, now_ms),
    )
    row = txn.fetchone()
    assert row is not None
    return int(row[0])


def _save_new_connection_txn(
    txn: Transaction, user_id: str, device_id: str, conn_id: str, token: str, subscriptions: str,
    changes: Sequence[RoomStatusChange], now_ms: int, max_per_device: int,
) -> int:
    key = _new_connection_txn(txn, user_id, device_id, conn_id, now_ms, max_per_device)
    return _save_position_txn(txn, key, token, subscriptions, changes, now_ms)


def _save_position_txn(
    txn: Transaction, connection_key: int, token: str, subscriptions: str, changes: Sequence[RoomStatusChange],
    now_ms: int,
) -> int:
    txn.execute(
        "INSERT INTO sliding_sync_positions (connection_key, token, subscriptions, created_ts) "
        "SELECT connection_key, %s, %s, %s FROM sliding_sync_connections WHERE connection_key = %s "
        "RETURNING position_id",
        (token, subscriptions, now_ms, connection_key),
    )
    row = txn.fetchone()
    if row is None:
        raise ConnectionGone(connection_key)
    position_id = int(row[0])
    if changes:
        txn.execute(
            "INSERT INTO sliding_sync_rooms (connection_key, position_id, room_id, status, last_token, config, "
            "membership) SELECT %s, %s, r, s, t, c, m "
            "FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[], %s::text[]) AS u(r, s, t, c, m)",
            (connection_key, position_id, [c.room_id for c in changes],
             ["live" if c.status.live else "previously" for c in changes],
             [c.status.last_token for c in changes], [c.status.config for c in changes],
             [c.status.membership for c in changes]),
        )
    return position_id


def prune_connections_txn(txn: Transaction, before_ts: int, batch: int) -> int:
    """Delete up to ``batch`` connections last used before ``before_ts``, with their state (the
    pruning job's, storage/stores/pruning.py)."""
    txn.execute(
        "DELETE FROM sliding_sync_connections WHERE connection_key IN "
        "(SELECT connection_key FROM sliding_sync_connections WHERE last_used_ts < %s LIMIT %s)",
        (before_ts, batch),
    )
    return int(txn.rowcount)


class SlidingSyncStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    # --- the room list ------------------------------------------------------------------------

    async def get_room_list(self, user_id: str, query: RoomListQuery, *, limit: int) -> tuple[int, list[RoomListEntry]]:
        """How many of the user's rooms pass ``query``, and the first ``limit`` of them, most
        recent activity first (ties by room ID): one query."""
        return await self._db.run_interaction("sliding_sync_room_list", _room_list_txn, user_id, query, limit)

    async def get_memberships(self, user_id: str, room_ids: Collection[str]) -> dict[str, RoomListEntry]:
        """The user's current membership in each of ``room_ids`` they have one in, with its bump stamp."""

        def txn_fn(txn: Transaction) -> dict[str, RoomListEntry]:
            txn.execute(
                f"""
                SELECT m.room_id, m.membership, m.event_id, COALESCE(b.stream_ordering, e.stream_ordering),
                       e.stream_ordering
                FROM current_state_events m JOIN events e ON e.event_id = m.event_id
                LEFT JOIN LATERAL (
                    SELECT stream_ordering FROM events
                    WHERE m.membership = 'join' AND events.room_id = m.room_id AND type IN {_BUMP_SQL} AND {_LIVE}
                    ORDER BY stream_ordering DESC LIMIT 1
                ) b ON TRUE
                WHERE m.room_id = ANY(%s) AND m.type = 'm.room.member' AND m.state_key = %s
                AND m.membership = ANY(%s) AND {_EVER_JOINED}
                """,
                (sorted(room_ids), user_id, list(LIST_MEMBERSHIPS)),
            )
            return {str(r[0]): RoomListEntry(str(r[0]), str(r[1]), str(r[2]), int(r[3]), int(r[4]))
                    for r in txn.fetchall()}

        if not room_ids:
            return {}
        return await self._db.run_interaction("sliding_sync_memberships", txn_fn)

    async def get_space_children(self, user_id: str, space_ids: Collection[str]) -> frozenset[str]:
        """The rooms named by ``m.space.child`` state (with a ``via``) of those of ``space_ids`` the
        user is joined to; subspaces are not followed (MSC4186)."""

        def txn_fn(txn: Transaction) -> frozenset[str]:
            txn.execute(
                "SELECT s.state_key FROM current_state_events s JOIN events e ON e.event_id = s.event_id "
                "JOIN current_state_events me ON me.room_id = s.room_id AND me.type = 'm.room.member' "
                "AND me.state_key = %s AND me.membership = 'join' "
                "WHERE s.room_id = ANY(%s) AND s.type = 'm.space.child' "
                "AND jsonb_typeof(e.json::jsonb -> 'content' -> 'via') = 'array' "
                "AND jsonb_array_length(e.json::jsonb -> 'content' -> 'via') > 0",
                (user_id, sorted(space_ids)),
            )
            return frozenset(str(r[0]) for r in txn.fetchall())

        if not space_ids:
            return frozenset()
        return await self._db.run_interaction("sliding_sync_space_children", txn_fn)

    async def get_remote_invite(self, user_id: str, room_id: str) -> RemoteInviteRow | None:
        """The user's invite (or knock) row for a room this server is not in."""

        def txn_fn(txn: Transaction) -> RemoteInviteRow | None:
            return next((row for row in get_remote_invites_txn(txn, user_id) if row.room_id == room_id), None)

        return await self._db.run_interaction("sliding_sync_remote_invite", txn_fn)

    # --- room state ---------------------------------------------------------------------------

    async def get_state_ids(
        self, room_ids: Collection[str], *, all_members: bool, members: Collection[str]
    ) -> dict[str, dict[StateKey, str]]:
        """Per room, its current state: every entry but member events, and of those all
        (``all_members``) or only the ones of ``members``."""

        def txn_fn(txn: Transaction) -> dict[str, dict[StateKey, str]]:
            txn.execute(
                "SELECT room_id, type, state_key, event_id FROM current_state_events WHERE room_id = ANY(%s) "
                "AND (type <> 'm.room.member' OR %s OR state_key = ANY(%s))",
                (sorted(room_ids), all_members, sorted(members)),
            )
            out: dict[str, dict[StateKey, str]] = {room_id: {} for room_id in room_ids}
            for room_id, kind, state_key, event_id in txn.fetchall():
                out[str(room_id)][(str(kind), str(state_key))] = str(event_id)
            return out

        if not room_ids:
            return {}
        return await self._db.run_interaction("sliding_sync_state_ids", txn_fn)

    async def get_state_changes(
        self, room_ids: Collection[str], *, after: RoomPosition, upto: RoomPosition
    ) -> dict[str, dict[StateKey, str]]:
        """Per room, the current state entries set by an event in (after, upto] (rooms with none
        left out)."""

        def txn_fn(txn: Transaction) -> dict[str, dict[StateKey, str]]:
            lower, lower_params = after.sql_after("e.")
            upper, upper_params = upto.sql_upto("e.")
            txn.execute(
                "SELECT c.room_id, c.type, c.state_key, c.event_id FROM current_state_events c "
                f"JOIN events e ON e.event_id = c.event_id WHERE c.room_id = ANY(%s) AND {lower} AND {upper}",
                (sorted(room_ids), *lower_params, *upper_params),
            )
            out: dict[str, dict[StateKey, str]] = {}
            for room_id, kind, state_key, event_id in txn.fetchall():
                out.setdefault(str(room_id), {})[(str(kind), str(state_key))] = str(event_id)
            return out

        if not room_ids:
            return {}
        return await self._db.run_interaction("sliding_sync_state_changes", txn_fn)

    async def get_member_profiles(
        self, members: Mapping[str, Collection[str]]
    ) -> dict[tuple[str, str], tuple[str | None, str | None]]:
        """(room, user) -> (displayname, avatar_url) of the user's current member event in the room."""

        def txn_fn(txn: Transaction) -> dict[tuple[str, str], tuple[str | None, str | None]]:
            pairs = [(room_id, user_id) for room_id, users in members.items() for user_id in users]
            txn.execute(
                "SELECT c.room_id, c.state_key, m.display_name, m.avatar_url "
                "FROM unnest(%s::text[], %s::text[]) AS p(room_id, user_id) "
                "JOIN current_state_events c ON c.room_id = p.room_id AND c.type = 'm.room.member' "
                "AND c.state_key = p.user_id LEFT JOIN room_memberships m ON m.event_id = c.event_id",
                ([p[0] for p in pairs], [p[1] for p in pairs]),
            )
            return {(str(r[0]), str(r[1])): (r[2], r[3]) for r in txn.fetchall()}

        if not any(members.values()):
            return {}
        return await self._db.run_interaction("sliding_sync_member_profiles", txn_fn)

    # --- connections --------------------------------------------------------------------------

    async def save_new_connection(
        self, user_id: str, device_id: str, conn_id: str, token: str, subscriptions: str,
        changes: Sequence[RoomStatusChange], *, now_ms: int, max_per_device: int,
    ) -> int:
        """Start (or restart) the connection with its first position (its earlier state is
        dropped; the device's least recently used connections beyond ``max_per_device`` too):
        the position's ID."""
        return await self._db.run_interaction(
            "sliding_sync_save_new_connection", _save_new_connection_txn, user_id, device_id, conn_id, token,
            subscriptions, changes, now_ms, max_per_device,
        )

    async def resume(
        self, user_id: str, device_id: str, conn_id: str, position_id: int, *, now_ms: int
    ) -> ConnectionPosition | None:
        """The connection's state as of ``position_id`` (None: no such position for this user,
        device and conn_id), dropping what came after it and folding what came before."""
        return await self._db.run_interaction(
            "sliding_sync_resume", _resume_txn, user_id, device_id, conn_id, position_id, now_ms
        )

    async def save_position(
        self, connection_key: int, token: str, subscriptions: str, changes: Sequence[RoomStatusChange], *,
        now_ms: int,
    ) -> int:
        """A new position of the connection, reaching ``token``, with the rooms whose status changed.
        Raises ``ConnectionGone`` when the connection no longer exists."""
        return await self._db.run_interaction(
            "sliding_sync_save_position", _save_position_txn, connection_key, token, subscriptions, changes, now_ms
        )
