"""Push notifications' tables (schema 0013): notification records and pushers.

``event_push_actions`` holds one row per (local user, event) that notifies the user,
written by the events writer inside the event's own transaction
(``PersistRequest.push_actions``, ``get_push_context_txn``, ``push_actions_sql``), so that /sync's unread counts,
``GET /notifications`` and the pusher's deliveries are all read from the same facts.
``pushers`` holds where each user's notifications go and how far each pusher has
delivered (``last_stream_ordering``, an events stream position). This store knows
nothing of push rules or HTTP.
"""

# tests: tests/integration/test_push.py

from __future__ import annotations

import sys
from collections.abc import Collection, Sequence
from typing import Any, Final

import attrs

from storage.database import Database, Prepared, SqlValue, Transaction


@attrs.frozen
class PushAction:
    """One notification: ``event`` notifies ``user_id`` (highlighted or not) with ``actions``
    (JSON); ``thread_id``: the event's thread root, None in the main timeline."""

    user_id: str
    highlight: bool
    actions_json: str
    thread_id: str | None = None


@attrs.frozen
class PushContextRow:
    """What evaluating a room's event needs: its joined member count, its power levels (JSON
    text of the event, or None), and per local recipient their room display name and stored
    ``m.push_rules`` (JSON text, or None). ``http_pushers``: the recipients with an ``http``
    pusher (read in the same statement, so the persister need not ask ``any_http_pusher_txn``).
    ``version``: ``push_context_version`` as the statement saw it (0028_push_context_version), which
    a copy kept in memory is checked against (``push_context_as_expected``)."""

    member_count: int
    power_levels_json: str | None
    recipients: dict[str, tuple[str | None, str | None]]
    http_pushers: frozenset[str] = frozenset()
    version: int = 0


@attrs.frozen
class Notification:
    user_id: str
    room_id: str
    event_id: str
    stream_ordering: int
    highlight: bool
    actions_json: str
    received_ts: int


@attrs.frozen
class PusherRow:
    id: int
    user_id: str
    access_token_id: int | None
    kind: str
    app_id: str
    pushkey: str
    app_display_name: str
    device_display_name: str
    profile_tag: str | None
    lang: str
    data_json: str
    created_ts: int
    last_stream_ordering: int
    failing_since: int | None


_PUSHER_COLUMNS = ("id, user_id, access_token_id, kind, app_id, pushkey, app_display_name, device_display_name, "
                   "profile_tag, lang, data, created_ts, last_stream_ordering, failing_since")
_NOTIFICATION_COLUMNS = "user_id, room_id, event_id, stream_ordering, highlight, actions, received_ts"


def _pusher(r: Sequence[Any]) -> PusherRow:
    return PusherRow(int(r[0]), str(r[1]), None if r[2] is None else int(r[2]), str(r[3]), str(r[4]), str(r[5]),
                     str(r[6]), str(r[7]), None if r[8] is None else str(r[8]), str(r[9]), str(r[10]), int(r[11]),
                     int(r[12]), None if r[13] is None else int(r[13]))


def _notification(r: Sequence[Any]) -> Notification:
    return Notification(str(r[0]), str(r[1]), str(r[2]), int(r[3]), bool(r[4]), str(r[5]), int(r[6]))


_INSERT_PUSH_ACTIONS: Final = Prepared("""
    INSERT INTO event_push_actions (user_id, room_id, event_id, stream_ordering, highlight, actions, received_ts,
                                    thread_id)
    SELECT u, %s::text, %s::text, %s::bigint, h, a, (extract(epoch FROM clock_timestamp()) * 1000)::bigint, t
    FROM unnest(%s::text[], %s::boolean[], %s::text[], %s::text[]) AS x(u, h, a, t)
    ON CONFLICT DO NOTHING
    """)


def push_actions_sql(room_id: str, event_id: str, stream_ordering: int | SqlValue,
                     actions: Sequence[PushAction]) -> tuple[str, Sequence[object]]:
    """The statement the event's persist transaction runs to record its notifications
    (``stream_ordering``: the event's, or the SQL that names it in the transaction)."""
    return (
        _INSERT_PUSH_ACTIONS,
        (room_id, event_id, stream_ordering, [a.user_id for a in actions],
         [a.highlight for a in actions], [a.actions_json for a in actions], [a.thread_id for a in actions]),
    )


_ANY_HTTP_PUSHER: Final = Prepared(
    "SELECT EXISTS (SELECT 1 FROM pushers WHERE kind = 'http' AND user_id = ANY(%s::text[]))")


def any_http_pusher_txn(txn: Transaction, user_ids: Collection[str]) -> bool:
    """Whether any of ``user_ids`` has an ``http`` pusher (a new event's persist transaction asks,
    for the users it notifies: ``storage/kernel/written_events.py``)."""
    txn.execute(_ANY_HTTP_PUSHER, (sorted(user_ids),))
    row = txn.fetchone()
    return bool(row and row[0])


# The local members come from the index of a room's joined members by server (their display
# names looked up one by one: a join with room_memberships was planned as a scan of it), and
# the count from room_joined_counts (0026_room_joined_counts): nothing here reads the other
# servers' members, so a send in a room of 50,000 costs what one in a room of 5 does (it read and
# counted every member: 25 ms of PostgreSQL's time a send at 50,000).
_PUSH_CONTEXT: Final = Prepared("""
    WITH locals AS (
        SELECT c.state_key AS user_id,
               (SELECT m.display_name FROM room_memberships m WHERE m.event_id = c.event_id) AS display_name
        FROM current_state_events c
        WHERE c.room_id = %s AND c.type = 'm.room.member' AND c.membership = 'join'
          AND substring(c.state_key FROM position(':' IN c.state_key) + 1) = %s
        UNION ALL SELECT u, NULL FROM unnest(%s::text[]) AS x(u)
    )
    SELECT 'count', NULL, NULL, (SELECT joined FROM room_joined_counts WHERE room_id = %s)::text, FALSE
    UNION ALL
    SELECT 'version', NULL, NULL, (SELECT version FROM push_context_version)::text, FALSE
    UNION ALL
    SELECT 'levels', NULL, NULL, (
        SELECT e.json FROM current_state_events c JOIN events e ON e.event_id = c.event_id
        WHERE c.room_id = %s AND c.type = 'm.room.power_levels' AND c.state_key = ''), FALSE
    UNION ALL
    SELECT 'user', l.user_id, l.display_name, a.content,
           l.user_id IN (SELECT p.user_id FROM pushers p WHERE p.kind = 'http')
    FROM locals l
    LEFT JOIN account_data a ON a.user_id = l.user_id AND a.room_id IS NULL
         AND a.account_data_type = 'm.push_rules'
    """)


def get_push_context_txn(txn: Transaction, room_id: str, server_name: str,
                         extra_users: Collection[str]) -> PushContextRow:
    """The room as push rules see it (run by the event's persist transaction before the event is
    written): its joined member count, its power levels, and the local joined members (and
    ``extra_users``, e.g. a local invitee) with their display names and stored rules. One
    statement: one round trip on the hot path."""
    txn.execute(_PUSH_CONTEXT, (room_id, server_name, sorted(extra_users), room_id, room_id))
    count, levels, version = 0, None, 0
    recipients: dict[str, tuple[str | None, str | None]] = {}
    pushers: set[str] = set()
    for kind, user_id, display_name, value, has_pusher in txn.fetchall():
        if kind == "count":
            count = 0 if value is None else int(value)
        elif kind == "version":
            version = int(value)
        elif kind == "levels":
            levels = None if value is None else str(value)
        else:
            known = recipients.get(str(user_id))
            name = display_name if display_name is not None else (known[0] if known else None)
            # The rules text interned: a user's copies in the rooms' kept reads are one string.
            recipients[str(user_id)] = (None if name is None else str(name),
                                        None if value is None else sys.intern(str(value)))
            if has_pusher:
                pushers.add(str(user_id))
    return PushContextRow(count, levels, recipients, frozenset(pushers), version)



# The user's notifications in the rooms that are not yet read, as the spec's threaded read
# receipts say: a notification is read when it is at or before the user's unthreaded receipt
# in its room (m.read or m.read.private, no thread_id), or at or before their receipt for its
# thread (thread_id the thread root, or "main" for an event outside any thread). Parameters:
# (user_id, room_ids, user_id, room_ids), as unread_params makes. Shared by /sync's counts,
# the push badge and prune_read, so they agree.
UNREAD_PUSH_ACTIONS: Final = """
    read_up_to AS (
        SELECT rc.room_id, rc.thread_id, max(seen.stream_ordering) AS stream_ordering
        FROM receipts rc JOIN events seen ON seen.event_id = rc.event_id
        WHERE rc.user_id = %s AND rc.room_id = ANY(%s::text[])
          AND rc.receipt_type IN ('m.read', 'm.read.private')
        GROUP BY rc.room_id, rc.thread_id
    ), unread AS (
        SELECT p.room_id, p.thread_id, p.stream_ordering, p.highlight, p.event_id
        FROM event_push_actions p
        LEFT JOIN read_up_to unthreaded ON unthreaded.room_id = p.room_id AND unthreaded.thread_id IS NULL
        LEFT JOIN read_up_to threaded ON threaded.room_id = p.room_id
             AND threaded.thread_id = COALESCE(p.thread_id, 'main')
        WHERE p.user_id = %s AND p.room_id = ANY(%s::text[])
          AND p.stream_ordering > COALESCE(unthreaded.stream_ordering, -9223372036854775808)
          AND p.stream_ordering > COALESCE(threaded.stream_ordering, -9223372036854775808)
    )
"""


# Every /sync that shows a room runs it: Prepared.
_UNREAD_COUNTS: Final = Prepared(f"""
    WITH {UNREAD_PUSH_ACTIONS}
    SELECT room_id, thread_id, count(*), count(*) FILTER (WHERE highlight)
    FROM unread WHERE stream_ordering <= %s::bigint GROUP BY room_id, thread_id
    """)


def unread_params(user_id: str, room_ids: list[str]) -> tuple[object, ...]:
    return (user_id, room_ids, user_id, room_ids)


class PushStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    # --- reading notifications -------------------------------------------------------------

    async def get_unread_counts(
        self, user_id: str, room_ids: Collection[str], *, upto: int
    ) -> dict[str, dict[str | None, tuple[int, int]]]:
        """Per room, per thread (its root's event ID; None for the main timeline): the user's
        unread notifications (and highlights of them) up to stream position ``upto``, as
        ``UNREAD_PUSH_ACTIONS`` decides which are read. Only rooms and threads with some."""
        if not room_ids:
            return {}

        def txn_fn(txn: Transaction) -> dict[str, dict[str | None, tuple[int, int]]]:
            txn.execute(_UNREAD_COUNTS, (*unread_params(user_id, sorted(room_ids)), upto))
            out: dict[str, dict[str | None, tuple[int, int]]] = {}
            for room_id, thread_id, count, highlights in txn.fetchall():
                out.setdefault(str(room_id), {})[None if thread_id is None else str(thread_id)] = (
                    int(count), int(highlights))
            return out

        return await self._db.run_reads("get_unread_push_counts", txn_fn)

    async def get_badge_count(self, user_id: str) -> int:
        """The user's unread notifications over all their joined rooms (the push badge)."""

        def txn_fn(txn: Transaction) -> int:
            txn.execute(
                "SELECT room_id FROM current_state_events "
                "WHERE type = 'm.room.member' AND state_key = %s AND membership = 'join'",
                (user_id,),
            )
            room_ids = [str(r[0]) for r in txn.fetchall()]
            txn.execute(
                f"WITH {UNREAD_PUSH_ACTIONS} SELECT count(*) FROM unread",
                unread_params(user_id, room_ids),
            )
            row = txn.fetchone()
            return 0 if row is None else int(row[0])

        return await self._db.run_interaction("get_push_badge_count", txn_fn)

    async def get_notifications(self, user_id: str, *, before: int | None, limit: int,
                                only_highlight: bool) -> list[tuple[Notification, bool]]:
        """The user's notifications newest first, below stream position ``before``; each with
        whether it is read (at or before the user's unthreaded read receipt in its room, or
        their receipt in its thread, as ``UNREAD_PUSH_ACTIONS``). Read ones are
        left out unless they highlight."""

        def txn_fn(txn: Transaction) -> list[tuple[Notification, bool]]:
            txn.execute(
                f"""
                SELECT * FROM (
                    SELECT {', '.join('p.' + c.strip() for c in _NOTIFICATION_COLUMNS.split(','))},
                        p.stream_ordering <= COALESCE((
                            SELECT max(seen.stream_ordering) FROM receipts rc
                            JOIN events seen ON seen.event_id = rc.event_id
                            WHERE rc.room_id = p.room_id AND rc.user_id = p.user_id
                              AND rc.receipt_type IN ('m.read', 'm.read.private')
                              AND (rc.thread_id IS NULL OR rc.thread_id = COALESCE(p.thread_id, 'main'))
                        ), -9223372036854775808) AS read
                    FROM event_push_actions p
                    WHERE p.user_id = %s AND p.stream_ordering < %s AND (p.highlight OR NOT %s)
                ) n
                WHERE n.highlight OR NOT n.read
                ORDER BY n.stream_ordering DESC LIMIT %s
                """,
                (user_id, 2**63 - 1 if before is None else before, only_highlight, limit),
            )
            return [(_notification(r[:7]), bool(r[7])) for r in txn.fetchall()]

        return await self._db.run_interaction("get_notifications", txn_fn)

    async def get_notifications_between(self, user_id: str, after: int, upto: int, limit: int) -> list[Notification]:
        """The user's notifications in (after, upto], oldest first: what a pusher delivers next."""

        def txn_fn(txn: Transaction) -> list[Notification]:
            txn.execute(
                f"SELECT {_NOTIFICATION_COLUMNS} FROM event_push_actions WHERE user_id = %s "
                "AND stream_ordering > %s AND stream_ordering <= %s ORDER BY stream_ordering LIMIT %s",
                (user_id, after, upto, limit),
            )
            return [_notification(r) for r in txn.fetchall()]

        return await self._db.run_interaction("get_notifications_to_push", txn_fn)

    # --- pushers ---------------------------------------------------------------------------

    async def get_pushers(self, user_id: str | None = None) -> list[PusherRow]:
        """A user's pushers, or every pusher (None)."""

        def txn_fn(txn: Transaction) -> list[PusherRow]:
            if user_id is None:
                txn.execute(f"SELECT {_PUSHER_COLUMNS} FROM pushers ORDER BY id")
            else:
                txn.execute(f"SELECT {_PUSHER_COLUMNS} FROM pushers WHERE user_id = %s ORDER BY id", (user_id,))
            return [_pusher(r) for r in txn.fetchall()]

        return await self._db.run_interaction("get_pushers", txn_fn)

    async def get_pushers_with_pending(self, upto: int) -> list[PusherRow]:
        """The ``http`` pushers with notifications above their position and at or below ``upto``."""

        def txn_fn(txn: Transaction) -> list[PusherRow]:
            txn.execute(
                f"""
                SELECT {_PUSHER_COLUMNS} FROM pushers p
                WHERE p.kind = 'http' AND p.last_stream_ordering < %s AND EXISTS (
                    SELECT 1 FROM event_push_actions a WHERE a.user_id = p.user_id
                      AND a.stream_ordering > p.last_stream_ordering AND a.stream_ordering <= %s)
                ORDER BY p.id
                """,
                (upto, upto),
            )
            return [_pusher(r) for r in txn.fetchall()]

        return await self._db.run_interaction("get_pushers_with_pending", txn_fn)

    async def get_pushers_of(self, user_ids: Collection[str]) -> list[PusherRow]:
        """The ``http`` pushers of these users."""

        def txn_fn(txn: Transaction) -> list[PusherRow]:
            txn.execute(f"SELECT {_PUSHER_COLUMNS} FROM pushers WHERE kind = 'http' AND user_id = ANY(%s) ORDER BY id",
                        (sorted(user_ids),))
            return [_pusher(r) for r in txn.fetchall()]

        return await self._db.run_interaction("get_pushers_of", txn_fn)

    async def add_pusher(self, row: PusherRow, *, append: bool) -> None:
        """Create or update the user's pusher of (app_id, pushkey); without ``append``, the same
        (app_id, pushkey) of other users is removed, as the spec asks. A new pusher starts at
        ``row.last_stream_ordering`` (now): it never sends what happened before it existed."""

        def txn_fn(txn: Transaction) -> None:
            if not append:
                txn.execute("DELETE FROM pushers WHERE app_id = %s AND pushkey = %s AND user_id <> %s",
                            (row.app_id, row.pushkey, row.user_id))
            txn.execute(
                """
                INSERT INTO pushers (user_id, access_token_id, kind, app_id, pushkey, app_display_name,
                                     device_display_name, profile_tag, lang, data, created_ts, last_stream_ordering)
                VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)
                ON CONFLICT (app_id, pushkey, user_id) DO UPDATE SET
                    access_token_id = EXCLUDED.access_token_id, kind = EXCLUDED.kind,
                    app_display_name = EXCLUDED.app_display_name, device_display_name = EXCLUDED.device_display_name,
                    profile_tag = EXCLUDED.profile_tag, lang = EXCLUDED.lang, data = EXCLUDED.data,
                    failing_since = NULL
                """,
                (row.user_id, row.access_token_id, row.kind, row.app_id, row.pushkey, row.app_display_name,
                 row.device_display_name, row.profile_tag, row.lang, row.data_json, row.created_ts,
                 row.last_stream_ordering),
            )

        await self._db.run_interaction("add_pusher", txn_fn)

    async def count_pushers(self, user_id: str) -> int:
        def txn_fn(txn: Transaction) -> int:
            txn.execute("SELECT count(*) FROM pushers WHERE user_id = %s", (user_id,))
            row = txn.fetchone()
            return 0 if row is None else int(row[0])

        return await self._db.run_interaction("count_pushers", txn_fn)

    async def delete_pusher(self, user_id: str, app_id: str, pushkey: str) -> bool:
        def txn_fn(txn: Transaction) -> bool:
            txn.execute("DELETE FROM pushers WHERE user_id = %s AND app_id = %s AND pushkey = %s",
                        (user_id, app_id, pushkey))
            return bool(txn.rowcount)

        return await self._db.run_interaction("delete_pusher", txn_fn)

    async def delete_pusher_by_id(self, pusher_id: int) -> None:
        def txn_fn(txn: Transaction) -> None:
            txn.execute("DELETE FROM pushers WHERE id = %s", (pusher_id,))

        await self._db.run_interaction("delete_pusher_by_id", txn_fn)

    async def advance_pusher(self, pusher_id: int, stream_ordering: int, *, failing_since: int | None) -> None:
        """Record that the pusher delivered everything up to ``stream_ordering`` (never backwards)."""

        def txn_fn(txn: Transaction) -> None:
            txn.execute(
                "UPDATE pushers SET last_stream_ordering = GREATEST(last_stream_ordering, %s), failing_since = %s "
                "WHERE id = %s",
                (stream_ordering, failing_since, pusher_id),
            )

        await self._db.run_interaction("advance_pusher", txn_fn)

    async def set_pusher_failing(self, pusher_id: int, failing_since: int | None) -> None:
        def txn_fn(txn: Transaction) -> None:
            txn.execute("UPDATE pushers SET failing_since = %s WHERE id = %s", (failing_since, pusher_id))

        await self._db.run_interaction("set_pusher_failing", txn_fn)

    async def prune_read(self, user_id: str, room_id: str) -> int:
        """Drop the user's notifications in the room that are read (``UNREAD_PUSH_ACTIONS``: at
        or before their unthreaded receipt or their receipt in its thread) and do not highlight:
        nothing reads them any more. Highlights stay, for ``GET /notifications``."""

        def txn_fn(txn: Transaction) -> int:
            txn.execute(
                f"WITH {UNREAD_PUSH_ACTIONS} "
                "DELETE FROM event_push_actions WHERE user_id = %s AND room_id = %s AND NOT highlight "
                "AND event_id NOT IN (SELECT event_id FROM unread)",
                (*unread_params(user_id, [room_id]), user_id, room_id),
            )
            return int(txn.rowcount)

        return await self._db.run_interaction("prune_read_push_actions", txn_fn)

    async def get_read_receipts_after(self, after: int, upto: int) -> list[tuple[str, str]]:
        """(user, room) of ``m.read``/``m.read.private`` receipts in receipts stream (after, upto]."""

        def txn_fn(txn: Transaction) -> list[tuple[str, str]]:
            txn.execute(
                "SELECT DISTINCT user_id, room_id FROM receipts WHERE stream_id > %s AND stream_id <= %s "
                "AND receipt_type IN ('m.read', 'm.read.private')",
                (after, upto),
            )
            return [(str(u), str(r)) for u, r in txn.fetchall()]

        return await self._db.run_interaction("get_read_receipts_after", txn_fn)
