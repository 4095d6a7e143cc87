"""The application service sender's tables (schema 0021) and the reads it makes of events.

One row per service in ``appservice_stream_positions``: how far along the events stream (and,
schema 0024, the to_device stream) its transactions have got, the transaction recorded before
it is sent (so that a restart resends it with the same ID), and its backoff. The event reads give what decides whether a service
wants an event (sender, membership target, the room's aliases and members); the decision is
``homeserver/appservice/registration.py``'s.
"""

# tests: tests/integration/test_appservice.py

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

import attrs

from storage.database import Database, Transaction
from storage.stores.presence import PresenceRow


@attrs.frozen
class AppServiceState:
    """A service's row."""

    stream_ordering: int
    last_txn_id: int
    # The transaction recorded but not yet accepted: its ID and the positions it covers.
    pending_txn_id: int | None
    pending_upto: int | None
    pending_to_device_upto: int | None
    retry_last_ts: int
    retry_interval: int
    failure_ts: int | None
    # How far along the to_device stream its messages have gone.
    to_device_position: int


@attrs.frozen
class StreamEvent:
    """An event of the events stream, as the sender reads it."""

    stream_ordering: int
    event_id: str
    room_id: str
    sender: str
    # The user a membership event is about.
    member: str | None


@attrs.frozen
class Ephemeral:
    """A typing or receipt event (the client format of ``/sync``'s ephemeral events) and its room."""

    room_id: str
    event: dict[str, Any]


@attrs.frozen
class PresenceChange:
    """A user's presence as it stands after a change, and the rooms the user is joined to."""

    presence: PresenceRow
    rooms: tuple[str, ...]


@attrs.frozen
class RoomFacts:
    aliases: tuple[str, ...]
    members: tuple[str, ...]


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _load_state_txn(txn: Transaction, as_id: str, initial_position: int,
                    initial_to_device_position: int) -> AppServiceState:
    txn.execute(
        "INSERT INTO appservice_stream_positions (as_id, stream_ordering, to_device_position) VALUES (%s, %s, %s) "
        "ON CONFLICT (as_id) DO UPDATE SET to_device_position = "
        "COALESCE(appservice_stream_positions.to_device_position, EXCLUDED.to_device_position)",
        (as_id, initial_position, initial_to_device_position),
    )
    txn.execute(
        "SELECT stream_ordering, last_txn_id, pending_txn_id, pending_upto, pending_to_device_upto, "
        "retry_last_ts, retry_interval, failure_ts, to_device_position "
        "FROM appservice_stream_positions WHERE as_id = %s",
        (as_id,),
    )
    row = txn.fetchone()
    assert row is not None
    return AppServiceState(int(row[0]), int(row[1]), _int(row[2]), _int(row[3]), _int(row[4]), int(row[5]),
                           int(row[6]), _int(row[7]), int(row[8]))


def _read_events_txn(txn: Transaction, after: int, upto: int, limit: int) -> list[tuple[StreamEvent, bool]]:
    """Events in (after, upto], oldest first, each with whether clients may see it (not an
    outlier, rejected or soft-failed)."""
    txn.execute(
        "SELECT stream_ordering, event_id, room_id, sender, type, state_key, "
        "NOT outlier AND rejection_reason IS NULL AND NOT soft_failed FROM events "
        "WHERE stream_ordering > %s AND stream_ordering <= %s ORDER BY stream_ordering LIMIT %s",
        (after, upto, limit),
    )
    return [
        (StreamEvent(int(r[0]), str(r[1]), str(r[2]), str(r[3]), str(r[5]) if r[4] == "m.room.member" else None),
         bool(r[6]))
        for r in txn.fetchall()
    ]


def _room_facts_txn(txn: Transaction, room_ids: list[str]) -> dict[str, RoomFacts]:
    aliases: dict[str, list[str]] = {room_id: [] for room_id in room_ids}
    members: dict[str, list[str]] = {room_id: [] for room_id in room_ids}
    txn.execute("SELECT room_id, room_alias FROM room_aliases WHERE room_id = ANY(%s)", (room_ids,))
    for room_id, alias in txn.fetchall():
        aliases[room_id].append(alias)
    txn.execute(
        "SELECT c.room_id, e.json FROM current_state_events c JOIN events e ON e.event_id = c.event_id "
        "WHERE c.room_id = ANY(%s) AND c.type = 'm.room.canonical_alias' AND c.state_key = ''",
        (room_ids,),
    )
    for room_id, text in txn.fetchall():
        content = json.loads(text).get("content")
        if isinstance(content, dict):
            named = [content.get("alias"), *(content.get("alt_aliases") or [])]
            aliases[room_id].extend(a for a in named if isinstance(a, str))
    txn.execute(
        "SELECT room_id, state_key FROM current_state_events WHERE room_id = ANY(%s) AND type = 'm.room.member' "
        "AND membership IN ('join', 'invite')",
        (room_ids,),
    )
    for room_id, user_id in txn.fetchall():
        members[room_id].append(user_id)
    return {room_id: RoomFacts(tuple(aliases[room_id]), tuple(members[room_id])) for room_id in room_ids}


def _record_txn_txn(txn: Transaction, as_id: str, txn_id: int, upto: int | None, to_device_upto: int | None) -> None:
    pending = upto is not None or to_device_upto is not None
    txn.execute(
        "UPDATE appservice_stream_positions SET last_txn_id = GREATEST(last_txn_id, %s), "
        "pending_txn_id = %s, pending_upto = %s, pending_to_device_upto = %s WHERE as_id = %s",
        (txn_id, txn_id if pending else None, upto, to_device_upto, as_id),
    )


def _advance_txn(txn: Transaction, as_id: str, upto: int | None, to_device_upto: int | None,
                 clear_retry: bool) -> None:
    txn.execute(
        "UPDATE appservice_stream_positions SET stream_ordering = GREATEST(stream_ordering, COALESCE(%s, 0)), "
        "to_device_position = GREATEST(to_device_position, COALESCE(%s, 0)), "
        "pending_txn_id = NULL, pending_upto = NULL, pending_to_device_upto = NULL WHERE as_id = %s",
        (upto, to_device_upto, as_id),
    )
    if clear_retry:
        txn.execute(
            "UPDATE appservice_stream_positions SET retry_last_ts = 0, retry_interval = 0, failure_ts = NULL "
            "WHERE as_id = %s",
            (as_id,),
        )


def _set_retry_txn(txn: Transaction, as_id: str, last_ts: int, interval: int, failure_ts: int | None) -> None:
    txn.execute(
        "UPDATE appservice_stream_positions SET retry_last_ts = %s, retry_interval = %s, failure_ts = %s "
        "WHERE as_id = %s",
        (last_ts, interval, failure_ts, as_id),
    )


def _ephemeral_txn(txn: Transaction, typing: tuple[int, int], receipts: tuple[int, int]) -> list[Ephemeral]:
    out: list[Ephemeral] = []
    # A room's typing row is its whole typing set: only the newest in the range counts.
    txn.execute(
        "SELECT DISTINCT ON (room_id) room_id, user_ids, stream_id FROM typing_stream "
        "WHERE stream_id > %s AND stream_id <= %s ORDER BY room_id, stream_id DESC",
        typing,
    )
    for room_id, user_ids, _ in txn.fetchall():
        out.append(Ephemeral(str(room_id), {"type": "m.typing", "room_id": room_id,
                                            "content": {"user_ids": list(user_ids)}}))
    txn.execute(
        "SELECT room_id, receipt_type, user_id, thread_id, event_id, data FROM receipts "
        "WHERE stream_id > %s AND stream_id <= %s ORDER BY stream_id",
        receipts,
    )
    for room_id, receipt_type, user_id, thread_id, event_id, data in txn.fetchall():
        info = json.loads(data) if data else {}
        if thread_id is not None and isinstance(info, dict):
            info = {**info, "thread_id": thread_id}
        out.append(Ephemeral(str(room_id), {"type": "m.receipt", "room_id": room_id,
                                            "content": {event_id: {receipt_type: {user_id: info}}}}))
    return out


def _presence_txn(txn: Transaction, after: int, upto: int) -> list[PresenceChange]:
    # presence_stream holds each user's newest state only: a row above ``after`` is a change.
    txn.execute(
        "SELECT p.user_id, p.state, p.status_msg, p.last_active_ts, p.currently_active, "
        "ARRAY(SELECT c.room_id FROM current_state_events c WHERE c.type = 'm.room.member' "
        "      AND c.state_key = p.user_id AND c.membership = 'join') "
        "FROM presence_stream p WHERE p.stream_id > %s AND p.stream_id <= %s ORDER BY p.stream_id",
        (after, upto),
    )
    return [PresenceChange(PresenceRow(str(r[0]), str(r[1]), r[2], int(r[3]), bool(r[4])), tuple(r[5] or ()))
            for r in txn.fetchall()]


def _read_to_device_txn(txn: Transaction, after: int, upto: int,
                        limit: int) -> tuple[list[tuple[str, str, dict[str, Any]]], int, bool]:
    # Whole stream positions only (one /sendToDevice is one position for many devices).
    txn.execute(
        "SELECT stream_id FROM device_inbox WHERE stream_id > %s AND stream_id <= %s "
        "GROUP BY stream_id ORDER BY stream_id LIMIT %s",
        (after, upto, limit),
    )
    positions = [int(r[0]) for r in txn.fetchall()]
    more = len(positions) >= limit
    covered = positions[-1] if more else upto
    txn.execute(
        "SELECT user_id, device_id, message_json FROM device_inbox WHERE stream_id > %s AND stream_id <= %s "
        "ORDER BY stream_id, user_id, device_id",
        (after, covered),
    )
    return [(str(r[0]), str(r[1]), json.loads(r[2])) for r in txn.fetchall()], covered, more


class AppServiceStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def load_state(self, as_id: str, initial_position: int, initial_to_device_position: int) -> AppServiceState:
        """The service's row; a service seen for the first time starts at ``initial_position``
        (the events stream's position now: it is not sent the server's history), and at
        ``initial_to_device_position`` on the to_device stream the first time it is followed."""
        return await self._db.run_interaction("appservice_load_state", _load_state_txn, as_id, initial_position,
                                              initial_to_device_position)

    async def read_events(self, after: int, upto: int, limit: int) -> tuple[list[StreamEvent], int, bool]:
        """Up to ``limit`` events in (after, upto] that clients may see, the position the read
        covers, and whether it stopped at the limit (more may follow)."""
        rows = await self._db.run_interaction("appservice_read_events", _read_events_txn, after, upto, limit)
        more = len(rows) >= limit
        covered = rows[-1][0].stream_ordering if more else upto
        return [event for event, usable in rows if usable], covered, more

    async def room_facts(self, room_ids: Collection[str]) -> dict[str, RoomFacts]:
        return await self._db.run_interaction("appservice_room_facts", _room_facts_txn, sorted(set(room_ids)))

    async def record_transaction(self, as_id: str, txn_id: int, upto: int | None, to_device_upto: int | None) -> None:
        """Before sending: the ID is used; with ``upto`` or ``to_device_upto``, the transaction is
        pending until accepted."""
        await self._db.run_interaction("appservice_record_txn", _record_txn_txn, as_id, txn_id, upto, to_device_upto)

    async def advance(self, as_id: str, upto: int | None, to_device_upto: int | None, *, clear_retry: bool) -> None:
        """The service accepted everything up to ``upto`` and ``to_device_upto`` (or nothing there
        was for it)."""
        await self._db.run_interaction("appservice_advance", _advance_txn, as_id, upto, to_device_upto, clear_retry)

    async def set_retry(self, as_id: str, last_ts: int, interval: int, failure_ts: int | None) -> None:
        await self._db.run_interaction("appservice_set_retry", _set_retry_txn, as_id, last_ts, interval, failure_ts)

    async def ephemeral(self, typing: tuple[int, int], receipts: tuple[int, int]) -> list[Ephemeral]:
        """Typing sets (the newest per room) and receipts written in the (after, upto] ranges."""
        return await self._db.run_interaction("appservice_ephemeral", _ephemeral_txn, typing, receipts)

    async def presence(self, after: int, upto: int) -> list[PresenceChange]:
        """The users whose presence changed in (after, upto], as it stands now."""
        return await self._db.run_interaction("appservice_presence", _presence_txn, after, upto)

    async def read_to_device(self, after: int, upto: int,
                             limit: int) -> tuple[list[tuple[str, str, dict[str, Any]]], int, bool]:
        """(user, device, message) of the local to-device messages in (after, upto], at most
        ``limit`` stream positions of them, the position the read covers, and whether it
        stopped at the limit."""
        return await self._db.run_interaction("appservice_read_to_device", _read_to_device_txn, after, upto, limit)
