"""Room timelines and client-API room bookkeeping: aliases, txn IDs, redactions, memberships, receipts.

Reads a room's events in stream order for ``/messages``, ``/context`` and
``/sync``, and keeps the small tables of schema 0005. It knows nothing of
visibility rules or the client event format; handlers decide those.

A bound in the events stream is a ``RoomPosition``: a room stream token with
writers named as in ``events.instance_name`` (what SQL can compare), which
renders itself as a SQL condition; every store that reads events up to a token
takes one. With one writer (one process, or one persister) it is a plain
``stream_ordering`` bound: the form and the query plans of a single process do
not change. Turning tokens into positions is ``storage.room_tokens``.
"""

# tests: tests/integration/test_client_rooms.py, tests/integration/test_client_legacy.py, tests/integration/test_client_sync.py,
#        tests/integration/test_room_tokens.py

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, Final

import attrs

from storage.database import Database, Prepared, Transaction, json_rows, one_statement, prepared
from storage.stores.partial_state import ROWS_FOR_SYNC_JSON, PartialStateRow, rows_from_json
from storage.stores.remote_invites import FOR_USER_JSON, RemoteInviteRow, remote_invites_from_json


@attrs.frozen
class RoomPosition:
    """Every writer at ``minimum``, except those in ``ahead`` (instance name -> position)."""

    minimum: int
    ahead: tuple[tuple[str, int], ...] = ()

    @classmethod
    def at(cls, position: int) -> RoomPosition:
        return cls(position)

    @classmethod
    def of(cls, minimum: int, ahead: Mapping[str, int]) -> RoomPosition:
        return cls(minimum, tuple(sorted((name, pos) for name, pos in ahead.items() if pos > minimum)))

    @property
    def maximum(self) -> int:
        return max((pos for _, pos in self.ahead), default=self.minimum)

    def get(self, instance_name: str) -> int:
        for name, position in self.ahead:
            if name == instance_name:
                return position
        return self.minimum

    def capped(self, position: int) -> RoomPosition:
        """No writer past ``position``."""
        return RoomPosition.of(min(self.minimum, position), {n: min(p, position) for n, p in self.ahead})

    def covers(self, instance_name: str, stream_ordering: int) -> bool:
        """Whether an event of ``instance_name`` at ``stream_ordering`` is at or before this position."""
        return stream_ordering <= self.get(instance_name)

    def sql_upto(self, alias: str = "") -> tuple[str, list[Any]]:
        """``stream_ordering`` at or before this position, as SQL (with its parameters)."""
        return self._sql(alias, "<=")

    def sql_after(self, alias: str = "") -> tuple[str, list[Any]]:
        """``stream_ordering`` after this position, as SQL (with its parameters)."""
        return self._sql(alias, ">")

    def _sql(self, alias: str, op: str) -> tuple[str, list[Any]]:
        so, instance = f"{alias}stream_ordering", f"{alias}instance_name"
        if not self.ahead:
            return f"{so} {op} %s", [self.minimum]
        # The plain range first (what the index serves), then each row against its writer's position.
        outer = self.maximum if op == "<=" else self.minimum
        per_writer = f"{so} {op} COALESCE((%s::jsonb ->> {instance})::bigint, %s)"
        return f"{so} {op} %s AND {per_writer}", [outer, json.dumps(dict(self.ahead)), self.minimum]


# A bound in the events stream: a plain stream ordering, or a position per writer.
Bound = RoomPosition | int


def _position(bound: Bound) -> RoomPosition:
    return bound if isinstance(bound, RoomPosition) else RoomPosition.at(bound)


@attrs.frozen
class MembershipRow:
    room_id: str
    user_id: str
    membership: str
    event_id: str
    stream_ordering: int


@attrs.frozen
class ReceiptRow:
    room_id: str
    receipt_type: str
    user_id: str
    event_id: str
    data: str
    stream_id: int


@attrs.frozen
class SyncRooms:
    """A user's rooms as one ``/sync`` sees them, read in one transaction.

    ``rooms_at``: room -> (membership, member event ID, its stream ordering);
    ``changes``: the user's membership events in the sync's range; ``full``: the
    joined rooms whose timeline starts from scratch; ``recent``: per joined room,
    the newest events (newest first) after the sync's start, or from scratch for
    ``full`` rooms; rooms with none are left out.
    """

    rooms_at: dict[str, tuple[str, str, int]]
    forgotten: set[str]
    changes: list[MembershipRow]
    full: set[str]
    recent: dict[str, list[tuple[str, int]]]
    # Invites to rooms this server is not in that changed in the sync's range (all pending
    # ones in an initial sync), by room; see storage/stores/remote_invites.py.
    remote_invites: dict[str, RemoteInviteRow] = attrs.Factory(dict)
    # Per room in ``changes``: the user's membership as of the sync's start (absent: none).
    memberships_at_since: dict[str, str] = attrs.Factory(dict)


@attrs.frozen
class RoomSummary:
    """A room's member counts and the first members by stream ordering, for /sync's ``summary``:
    ``members`` holds (user_id, membership), joined and invited ones first, then left and banned."""

    joined: int
    invited: int
    members: list[tuple[str, str]]


# Chooses the full rooms of a sync from the user's rooms, membership changes, the rooms
# whose membership event is past the sync's end (a race with the request), the user's
# membership at the sync's start of the rooms in the changes, and the partial-state rows.
FullRoomsRule = Callable[
    [Mapping[str, tuple[str, str, int]], Sequence[MembershipRow], set[str], Mapping[str, str],
     Mapping[str, PartialStateRow]],
    set[str],
]

# Events clients may see in timelines: in the graph, accepted, not soft-failed (schema 0008).
_LIVE = "NOT outlier AND rejection_reason IS NULL AND NOT soft_failed"


def _recent_events_txn(
    txn: Transaction, room_ids: Sequence[str], *, after: Bound, upto: Bound, limit: int
) -> dict[str, list[tuple[str, int]]]:
    """Per room, up to ``limit`` newest events with ``after < so <= upto``, newest first: one query."""
    if not room_ids:
        return {}
    lower, lower_params = _position(after).sql_after()
    upper, upper_params = _position(upto).sql_upto()
    txn.execute(
        prepared(f"""
        SELECT r.room_id, e.event_id, e.stream_ordering FROM unnest(%s::text[]) AS r(room_id)
        CROSS JOIN LATERAL (
            SELECT event_id, stream_ordering FROM events
            WHERE events.room_id = r.room_id AND {_LIVE} AND {lower} AND {upper}
            ORDER BY stream_ordering DESC LIMIT %s::int
        ) e
        ORDER BY r.room_id, e.stream_ordering DESC
        """),
        (list(room_ids), *lower_params, *upper_params, limit),
    )
    out: dict[str, list[tuple[str, int]]] = {}
    for room_id, event_id, stream_ordering in txn.fetchall():
        out.setdefault(str(room_id), []).append((str(event_id), int(stream_ordering)))
    return out


def _room_events_txn(
    txn: Transaction, room_id: str, *, start: Bound, end: Bound | None, limit: int, backwards: bool
) -> list[tuple[str, int]]:
    """Event IDs with stream orderings. Backwards: ``end < so <= start`` newest first; forwards: ``start < so <= end``."""
    if backwards:
        upper, upper_params = _position(start).sql_upto()
        lower, lower_params = _position(end if end is not None else -(2**62)).sql_after()
        order = "DESC"
    else:
        lower, lower_params = _position(start).sql_after()
        upper, upper_params = _position(end if end is not None else 2**62).sql_upto()
        order = "ASC"
    txn.execute(
        f"SELECT event_id, stream_ordering FROM events WHERE room_id = %s AND {_LIVE} "
        f"AND {upper} AND {lower} ORDER BY stream_ordering {order} LIMIT %s",
        (room_id, *upper_params, *lower_params, limit),
    )
    return [(str(row[0]), int(row[1])) for row in txn.fetchall()]


# The statements every incremental /sync runs are Prepared (storage/database.py): their
# planning was most of PostgreSQL's CPU for a /sync woken by one message.
_REDACTION_COLUMNS: Final = "r.redacts, r.redaction_id"
_REDACTIONS_FROM: Final = (
    "FROM event_redactions r "
    "JOIN events e ON e.event_id = r.redacts "
    "JOIN events red ON red.event_id = r.redaction_id "
    "WHERE r.redacts = ANY(%s::text[]) AND e.room_id = r.room_id "
    "AND red.rejection_reason IS NULL AND NOT red.outlier AND NOT red.soft_failed")
_REDACTIONS: Final = Prepared(f"SELECT {_REDACTION_COLUMNS} {_REDACTIONS_FROM} ORDER BY r.redaction_id")
_TXN_IDS_FROM: Final = "FROM event_txn_ids WHERE access_token_id = %s AND event_id = ANY(%s::text[])"
_TXN_IDS: Final = Prepared(f"SELECT event_id, txn_id {_TXN_IDS_FROM}")
# Both in one round trip (``get_redactions_and_txn_ids``: every /sync that serves events).
_REDACTIONS_AND_TXN_IDS: Final = one_statement(
    json_rows(_REDACTION_COLUMNS, _REDACTIONS_FROM, "r.redaction_id"), json_rows("event_id, txn_id", _TXN_IDS_FROM))
# /sync's one read of the user's rooms (``_user_rooms_sql``), each part a ``json_rows``.
_OWN_MEMBERSHIPS_JSON: Final = json_rows(
    "c.room_id, c.membership, c.event_id, e.stream_ordering, e.instance_name",
    "FROM current_state_events c JOIN events e ON e.event_id = c.event_id "
    "WHERE c.type = 'm.room.member' AND c.state_key = %s AND c.membership IS NOT NULL")
_FORGOTTEN_FROM: Final = "FROM room_forgotten WHERE user_id = %s"
_FORGOTTEN: Final = Prepared(f"SELECT room_id {_FORGOTTEN_FROM}")


def _user_rooms_sql(partial: bool, changes: tuple[str, str] | None) -> Prepared:
    """The statement of ``get_sync_rooms``'s first read: the user's memberships, its forgotten
    rooms, its invites to rooms this server is not in, the partial-state rows (``partial``) and
    its membership events in a range (``changes``: the range's conditions on ``e.``)."""
    in_range = None
    if changes is not None:
        lower, upper = changes
        in_range = json_rows("m.room_id, m.membership, m.event_id, m.stream_ordering",
                             "FROM room_memberships m JOIN events e ON e.event_id = m.event_id "
                             f"WHERE m.user_id = %s AND {lower} AND {upper}", "m.stream_ordering")
    return one_statement(_OWN_MEMBERSHIPS_JSON, json_rows("room_id", _FORGOTTEN_FROM), FOR_USER_JSON,
                         ROWS_FOR_SYNC_JSON if partial else None, in_range)


def _get_redactions_txn(txn: Transaction, event_ids: list[str]) -> dict[str, list[str]]:
    txn.execute(_REDACTIONS, (event_ids,))
    return _redactions_by_event(txn.fetchall())


def _redactions_by_event(rows: Iterable[Sequence[Any]]) -> dict[str, list[str]]:
    """Rows of (redacted event, redaction) as the redactions of each event, in the rows' order."""
    out: dict[str, list[str]] = {}
    for redacts, redaction_id in rows:
        out.setdefault(str(redacts), []).append(str(redaction_id))
    return out


def _get_txn_ids_txn(txn: Transaction, access_token_id: int, event_ids: list[str]) -> dict[str, str]:
    txn.execute(_TXN_IDS, (access_token_id, event_ids))
    return {str(row[0]): str(row[1]) for row in txn.fetchall()}


class TimelineStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    # --- aliases ------------------------------------------------------------------------

    async def create_alias(self, alias: str, room_id: str, creator: str) -> bool:
        """False when the alias is taken."""

        def txn_fn(txn: Transaction) -> bool:
            txn.execute(
                "INSERT INTO room_aliases (room_alias, room_id, creator) VALUES (%s, %s, %s) "
                "ON CONFLICT (room_alias) DO NOTHING RETURNING room_alias",
                (alias, room_id, creator),
            )
            return txn.fetchone() is not None

        return await self._db.run_interaction("create_room_alias", txn_fn)

    async def get_alias(self, alias: str) -> tuple[str, str] | None:
        """(room_id, creator) of the alias."""

        def txn_fn(txn: Transaction) -> tuple[str, str] | None:
            txn.execute("SELECT room_id, creator FROM room_aliases WHERE room_alias = %s", (alias,))
            row = txn.fetchone()
            return None if row is None else (str(row[0]), str(row[1]))

        return await self._db.run_interaction("get_room_alias", txn_fn)

    async def delete_alias(self, alias: str) -> bool:
        def txn_fn(txn: Transaction) -> bool:
            txn.execute("DELETE FROM room_aliases WHERE room_alias = %s RETURNING room_id", (alias,))
            return txn.fetchone() is not None

        return await self._db.run_interaction("delete_room_alias", txn_fn)

    async def move_room_aliases(self, old_room_id: str, new_room_id: str) -> list[str]:
        """Point every local alias of ``old_room_id`` at ``new_room_id`` (a room upgrade); the aliases moved."""

        def txn_fn(txn: Transaction) -> list[str]:
            txn.execute(
                "UPDATE room_aliases SET room_id = %s WHERE room_id = %s RETURNING room_alias",
                (new_room_id, old_room_id),
            )
            return sorted(str(row[0]) for row in txn.fetchall())

        return await self._db.run_interaction("move_room_aliases", txn_fn)

    # --- send idempotency ---------------------------------------------------------------

    async def get_txn_event(self, access_token_id: int, txn_id: str) -> str | None:
        def txn_fn(txn: Transaction) -> str | None:
            txn.execute(
                "SELECT event_id FROM event_txn_ids WHERE access_token_id = %s AND txn_id = %s",
                (access_token_id, txn_id),
            )
            row = txn.fetchone()
            return None if row is None else str(row[0])

        return await self._db.run_interaction("get_txn_event", txn_fn)

    async def get_txn_ids(self, access_token_id: int, event_ids: Collection[str]) -> dict[str, str]:
        """event_id -> txn_id for those of ``event_ids`` sent with this access token."""
        if not event_ids:
            return {}
        return await self._db.run_interaction("get_txn_ids", _get_txn_ids_txn, access_token_id, list(event_ids))

    async def store_txn_event(
        self, access_token_id: int, txn_id: str, room_id: str, event_id: str, user_id: str, now_ms: int
    ) -> None:
        def txn_fn(txn: Transaction) -> None:
            txn.execute(
                "INSERT INTO event_txn_ids (access_token_id, txn_id, room_id, event_id, user_id, inserted_ts) "
                "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
                (access_token_id, txn_id, room_id, event_id, user_id, now_ms),
            )

        await self._db.run_interaction("store_txn_event", txn_fn)

    # --- redactions ---------------------------------------------------------------------

    async def get_redactions(self, event_ids: Collection[str]) -> dict[str, list[str]]:
        """redacted event ID -> redaction event IDs (same room only)."""
        if not event_ids:
            return {}
        return await self._db.run_interaction("get_redactions", _get_redactions_txn, list(event_ids))

    # --- memberships --------------------------------------------------------------------

    async def get_rooms_for_user(self, user_id: str) -> dict[str, tuple[str, str]]:
        """room_id -> (membership, member event ID) from the rooms' current state."""

        def txn_fn(txn: Transaction) -> dict[str, tuple[str, str]]:
            txn.execute(
                "SELECT room_id, membership, event_id FROM current_state_events "
                "WHERE type = 'm.room.member' AND state_key = %s AND membership IS NOT NULL",
                (user_id,),
            )
            return {str(r[0]): (str(r[1]), str(r[2])) for r in txn.fetchall()}

        return await self._db.run_interaction("get_rooms_for_user", txn_fn)

    async def get_current_members(self, room_id: str) -> list[tuple[str, str, str]]:
        """(user_id, membership, event_id) of every member event in the room's current state."""

        def txn_fn(txn: Transaction) -> list[tuple[str, str, str]]:
            txn.execute(
                "SELECT state_key, membership, event_id FROM current_state_events "
                "WHERE room_id = %s AND type = 'm.room.member' ORDER BY state_key",
                (room_id,),
            )
            return [(str(r[0]), str(r[1]), str(r[2])) for r in txn.fetchall()]

        return await self._db.run_interaction("get_current_members", txn_fn)

    async def get_room_summaries(self, room_ids: Collection[str], *, candidates: int) -> dict[str, RoomSummary]:
        """Per room: its joined and invited counts and its first ``candidates`` members (joined or
        invited before left or banned, each group by the stream ordering of its member event).
        Two queries whatever the number of rooms."""

        def txn_fn(txn: Transaction) -> dict[str, RoomSummary]:
            rooms = sorted(room_ids)
            txn.execute(
                "SELECT room_id, membership, count(*) FROM current_state_events "
                "WHERE room_id = ANY(%s) AND type = 'm.room.member' AND membership IN ('join', 'invite') "
                "GROUP BY room_id, membership",
                (rooms,),
            )
            counts: dict[tuple[str, str], int] = {(str(r[0]), str(r[1])): int(r[2]) for r in txn.fetchall()}
            txn.execute(
                "SELECT room_id, state_key, membership FROM ("
                " SELECT c.room_id, c.state_key, c.membership, row_number() OVER ("
                "  PARTITION BY c.room_id"
                "  ORDER BY CASE WHEN c.membership IN ('join', 'invite') THEN 0 ELSE 1 END, e.stream_ordering"
                " ) AS position"
                " FROM current_state_events c JOIN events e ON e.event_id = c.event_id"
                " WHERE c.room_id = ANY(%s) AND c.type = 'm.room.member'"
                " AND c.membership IN ('join', 'invite', 'leave', 'ban')"
                ") ranked WHERE position <= %s ORDER BY room_id, position",
                (rooms, candidates),
            )
            members: dict[str, list[tuple[str, str]]] = {room_id: [] for room_id in rooms}
            for room_id, user_id, membership in txn.fetchall():
                members[str(room_id)].append((str(user_id), str(membership)))
            return {
                room_id: RoomSummary(counts.get((room_id, "join"), 0), counts.get((room_id, "invite"), 0), found)
                for room_id, found in members.items()
            }

        if not room_ids:
            return {}
        return await self._db.run_interaction("get_room_summaries", txn_fn)

    async def get_joined_profiles(self, room_id: str) -> dict[str, tuple[str | None, str | None]]:
        """user_id -> (displayname, avatar_url) of the room's joined members."""

        def txn_fn(txn: Transaction) -> dict[str, tuple[str | None, str | None]]:
            txn.execute(
                "SELECT c.state_key, m.display_name, m.avatar_url FROM current_state_events c "
                "LEFT JOIN room_memberships m ON m.event_id = c.event_id "
                "WHERE c.room_id = %s AND c.type = 'm.room.member' AND c.membership = 'join'",
                (room_id,),
            )
            return {str(r[0]): (r[1], r[2]) for r in txn.fetchall()}

        return await self._db.run_interaction("get_joined_profiles", txn_fn)

    async def forget_room(self, user_id: str, room_id: str) -> None:
        def txn_fn(txn: Transaction) -> None:
            txn.execute(
                "INSERT INTO room_forgotten (user_id, room_id) VALUES (%s, %s) ON CONFLICT DO NOTHING",
                (user_id, room_id),
            )

        await self._db.run_interaction("forget_room", txn_fn)

    async def get_forgotten_rooms(self, user_id: str) -> set[str]:
        def txn_fn(txn: Transaction) -> set[str]:
            txn.execute(_FORGOTTEN, (user_id,))
            return {str(r[0]) for r in txn.fetchall()}

        return await self._db.run_interaction("get_forgotten_rooms", txn_fn)

    async def unforget_room(self, user_id: str, room_id: str) -> None:
        def txn_fn(txn: Transaction) -> None:
            txn.execute("DELETE FROM room_forgotten WHERE user_id = %s AND room_id = %s", (user_id, room_id))

        await self._db.run_interaction("unforget_room", txn_fn)

    # --- timelines ----------------------------------------------------------------------

    async def get_room_events(
        self, room_id: str, *, start: Bound, end: Bound | None, limit: int, backwards: bool
    ) -> list[tuple[str, int]]:
        return await self._db.run_interaction(
            "get_room_events", _room_events_txn, room_id, start=start, end=end, limit=limit, backwards=backwards
        )

    async def get_recent_events(
        self, room_ids: Sequence[str], *, after: Bound, upto: Bound, limit: int
    ) -> dict[str, list[tuple[str, int]]]:
        """Per room, up to ``limit`` newest events in (after, upto], newest first (rooms with none
        left out): one query for all the rooms."""
        if not room_ids:
            return {}
        return await self._db.run_interaction(
            "get_recent_events", _recent_events_txn, room_ids, after=after, upto=upto, limit=limit
        )

    async def get_sync_rooms(
        self, user_id: str, *, since: Bound | None, upto: Bound, limit: int, full_rooms: FullRoomsRule,
        partial_after: int | None = None,
    ) -> SyncRooms:
        """What ``/sync`` needs of the user's rooms (see ``SyncRooms``), in one read.
        ``since`` None: an initial sync. ``full_rooms`` picks the joined rooms whose timeline
        is read from scratch (it is given the rooms, the membership changes, the rooms whose
        membership event is past ``upto`` and the partial-state rows). ``partial_after``: read
        the partial-state rows made whole after that events position, or partial now
        (``storage/stores/partial_state.py``); None: none are read. All but the timelines' reads
        are one statement (``_user_rooms_sql``)."""
        end = _position(upto)

        def txn_fn(txn: Transaction) -> SyncRooms:
            params: list[object] = [user_id, user_id, user_id]
            if partial_after is not None:
                params.append(partial_after)
            range_sql = None
            if since is not None:
                lower, lower_params = _position(since).sql_after("e.")
                upper, upper_params = end.sql_upto("e.")
                range_sql = (lower, upper)
                params += [user_id, *lower_params, *upper_params]
            txn.execute(_user_rooms_sql(partial_after is not None, range_sql), params)
            row = txn.fetchone()
            assert row is not None
            memberships, forgotten_rows, invites, partial_rows, change_rows = (
                row[0] or (), row[1] or (), row[2], row[3], row[4] or ())
            rooms_at = {str(r[0]): (str(r[1]), str(r[2]), int(r[3])) for r in memberships}
            late = {str(r[0]) for r in memberships if not end.covers(str(r[4]), int(r[3]))}
            forgotten = {str(r[0]) for r in forgotten_rows}
            partial = rows_from_json(partial_rows)
            changes = [MembershipRow(str(r[0]), user_id, str(r[1]), str(r[2]), int(r[3])) for r in change_rows]
            at_since: dict[str, str] = {}
            if since is not None and changes:
                # The membership each changed room had at the sync's start: a displayname change
                # of a joined user is a join "change" that must not send the room whole again.
                before, before_params = _position(since).sql_upto("e.")
                txn.execute(
                    prepared("SELECT DISTINCT ON (m.room_id) m.room_id, m.membership FROM room_memberships m "
                             "JOIN events e ON e.event_id = m.event_id WHERE m.user_id = %s "
                             f"AND m.room_id = ANY(%s::text[]) AND {before} ORDER BY m.room_id, m.stream_ordering DESC"),
                    (user_id, sorted({row.room_id for row in changes}), *before_params),
                )
                at_since = {str(r[0]): str(r[1]) for r in txn.fetchall()}
            full = full_rooms(rooms_at, changes, late, at_since, partial)
            joined = sorted(r for r, (m, _, _) in rooms_at.items() if m == "join")
            recent = _recent_events_txn(txn, sorted(full), after=0, upto=upto, limit=limit)
            incremental = [r for r in joined if r not in full]
            if incremental:
                recent.update(
                    _recent_events_txn(txn, incremental, after=since or 0, upto=upto, limit=limit)
                )
            start = None if since is None else _position(since)
            remote = {
                row.room_id: row for row in remote_invites_from_json(invites)
                if row.room_id not in rooms_at and end.covers(row.instance_name, row.stream_ordering)
                and (row.membership in ("invite", "knock") if start is None else not start.covers(row.instance_name,
                                                                                       row.stream_ordering))
            }
            return SyncRooms(rooms_at, forgotten, changes, full, recent, remote, at_since)

        return await self._db.run_reads("get_sync_rooms", txn_fn)

    async def get_redactions_and_txn_ids(
        self, event_ids: Collection[str], access_token_id: int | None
    ) -> tuple[dict[str, list[str]], dict[str, str]]:
        """``get_redactions`` and (with a token) ``get_txn_ids`` of ``event_ids``, in one transaction."""
        if not event_ids:
            return {}, {}
        ids = list(event_ids)

        def txn_fn(txn: Transaction) -> tuple[dict[str, list[str]], dict[str, str]]:
            if access_token_id is None:
                return _get_redactions_txn(txn, ids), {}
            txn.execute(_REDACTIONS_AND_TXN_IDS, (ids, access_token_id, ids))
            row = txn.fetchone()
            assert row is not None
            return _redactions_by_event(row[0] or ()), {str(event_id): str(txn_id) for event_id, txn_id in row[1] or ()}

        return await self._db.run_reads("get_redactions_and_txn_ids", txn_fn)

    async def get_hidden_events(self, event_ids: Collection[str]) -> set[str]:
        """Those of ``event_ids`` clients must not be served: outliers, rejected or soft-failed."""
        if not event_ids:
            return set()

        def txn_fn(txn: Transaction) -> set[str]:
            txn.execute(
                f"SELECT event_id FROM events WHERE event_id = ANY(%s) AND NOT ({_LIVE})", (list(event_ids),)
            )
            return {str(r[0]) for r in txn.fetchall()}

        return await self._db.run_interaction("get_hidden_events", txn_fn)

    async def get_stream_orderings(self, event_ids: Collection[str]) -> dict[str, int]:
        def txn_fn(txn: Transaction) -> dict[str, int]:
            txn.execute(
                "SELECT event_id, stream_ordering FROM events WHERE event_id = ANY(%s)", (list(event_ids),)
            )
            return {str(r[0]): int(r[1]) for r in txn.fetchall()}

        return await self._db.run_interaction("get_stream_orderings", txn_fn)

    async def get_event_positions(self, event_ids: Collection[str]) -> dict[str, tuple[str, int]]:
        """event ID -> (writer instance, stream ordering): its place on the events stream."""

        def txn_fn(txn: Transaction) -> dict[str, tuple[str, int]]:
            txn.execute(
                "SELECT event_id, instance_name, stream_ordering FROM events WHERE event_id = ANY(%s)",
                (list(event_ids),),
            )
            return {str(r[0]): (str(r[1]), int(r[2])) for r in txn.fetchall()}

        return await self._db.run_interaction("get_event_positions", txn_fn)

    # --- receipts -----------------------------------------------------------------------

    async def put_receipt(
        self,
        room_id: str,
        receipt_type: str,
        user_id: str,
        thread_id: str | None,
        event_id: str,
        data: str,
        stream_id: int,
        instance_name: str,
    ) -> None:
        def txn_fn(txn: Transaction) -> None:
            txn.execute(
                "INSERT INTO receipts (stream_id, instance_name, room_id, receipt_type, user_id, thread_id, "
                "event_id, data) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) "
                "ON CONFLICT (room_id, receipt_type, user_id, thread_id) DO UPDATE "
                "SET event_id = EXCLUDED.event_id, data = EXCLUDED.data, stream_id = EXCLUDED.stream_id, "
                "instance_name = EXCLUDED.instance_name",
                (stream_id, instance_name, room_id, receipt_type, user_id, thread_id, event_id, data),
            )

        await self._db.run_interaction("put_receipt", txn_fn)

    async def get_receipts(self, room_ids: Collection[str], after: int, upto: int,
                           user_id: str | None = None) -> list[ReceiptRow]:
        """The receipts of ``room_ids`` written in (after, upto]; only ``user_id``'s when given."""
        if not room_ids:
            return []

        def txn_fn(txn: Transaction) -> list[ReceiptRow]:
            txn.execute(
                "SELECT room_id, receipt_type, user_id, event_id, data, stream_id FROM receipts "
                "WHERE room_id = ANY(%s) AND stream_id > %s AND stream_id <= %s "
                "AND (%s::text IS NULL OR user_id = %s)",
                (list(room_ids), after, upto, user_id, user_id),
            )
            rows: list[Any] = txn.fetchall()
            return [ReceiptRow(str(r[0]), str(r[1]), str(r[2]), str(r[3]), str(r[4]), int(r[5])) for r in rows]

        return await self._db.run_interaction("get_receipts", txn_fn)
