"""SQL for events: the one transaction that persists an event, and the reads around it.

``persist_event_txn`` writes everything an event changes in one transaction:
the event and its JSON, its edges, the room's forward extremities, the state
groups before and after it, current state, memberships and the
``destination_rooms`` rows that federation catch-up reads, and a local send's
client transaction ID; the writes go to the server as one batch. It is idempotent on
event ID. What the state should *be* (resolution over forks, auth) is decided
by the caller; this module only stores it.
"""

# tests: tests/integration/test_persist_events.py

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, Final

import attrs
import psycopg2.errors

from storage.caches import DictCache
from storage.database import Database, DeferredStatements, Prepared, SqlValue, Transaction, on_reactor
from storage.stores.push import PushAction, push_actions_sql
from storage.stores.streams import IdInStatements

StateKey = tuple[str, str]
StateMap = Mapping[StateKey, str]

# A state group is stored as a delta on its predecessor until this many deltas
# pile up; then a full snapshot starts a new chain, so reading any group walks
# at most this many rows of groups.
MAX_STATE_DELTA_DEPTH: Final = 64


@attrs.frozen
class StoredEvent:
    event_id: str
    room_id: str
    stream_ordering: int
    instance_name: str
    depth: int
    is_local: bool
    outlier: bool
    rejection_reason: str | None
    redacted_by: str | None
    json: str

    def pdu(self) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(self.json)
        return value


@attrs.frozen
class SendTxn:
    """A client's transaction ID for a send, scoped to its access token."""

    access_token_id: int
    txn_id: str
    user_id: str
    inserted_ts: int


class StaleRoomContext(Exception):
    """The room's forward extremities are not those the event was built on (another writer)."""

    def __init__(self, room_id: str, detail: str) -> None:
        super().__init__(detail)
        self.room_id = room_id


# What send_extremities_as_expected (0027_send_extremities_check, 0029) raises: StaleRoomContext.
STALE_ROOM_SQLSTATE: Final = "TQ001"


class DuplicateTxnId(Exception):
    """The client transaction ID already names an event; nothing was written."""

    def __init__(self, access_token_id: int, txn_id: str) -> None:
        super().__init__(f"transaction {txn_id!r} of access token {access_token_id} was already used")
        self.access_token_id = access_token_id
        self.txn_id = txn_id


class EventAlreadyPersisted(Exception):
    """The event was stored meanwhile (a concurrent persist); nothing was written."""

    def __init__(self, event_id: str) -> None:
        super().__init__(f"event {event_id} is already stored")
        self.event_id = event_id


@attrs.frozen
class PersistRequest:
    """Everything the store needs to persist one event.

    ``state_before`` is the state group the event was built or received on
    (None for outliers, which have no place in the graph yet);
    ``state_after_delta`` is what the event itself changes (empty for message
    and rejected events). The room's current state changes either to
    ``new_current_state`` (the whole state, after a fork) or by
    ``current_state_delta`` (the linear case); neither set leaves it unchanged.
    ``remote_servers`` are the other servers in the room at this event, for
    ``destination_rooms``.
    """

    event_id: str
    room_id: str
    type: str
    state_key: str | None
    sender: str
    depth: int
    origin_server_ts: int
    prev_event_ids: tuple[str, ...]
    auth_event_ids: tuple[str, ...]
    pdu_json: str
    instance_name: str
    is_local: bool
    outlier: bool = False
    rejection_reason: str | None = None
    membership: str | None = None
    display_name: str | None = None
    avatar_url: str | None = None
    state_before: int | None = None
    state_after_delta: StateMap = attrs.field(factory=dict)
    new_current_state: StateMap | None = None
    current_state_delta: StateMap | None = None
    remote_servers: frozenset[str] = frozenset()
    room_version: str | None = None  # set for m.room.create: registers the room
    # An m.room.redaction's target, recorded in ``event_redactions`` by the same transaction,
    # so that whoever sees the redaction (any process) also serves its target pruned.
    redacts: str | None = None
    # History fetched from another server (``/backfill``): stored with a negative stream
    # ordering (``allocate`` returns it), before the timeline; forward extremities, current
    # state and destination rows are left alone. An outlier copy of the event is promoted.
    backfilled: bool = False
    # The event is stored as an outlier and now joins the room's graph (not by backfill): its
    # row is updated in place (new stream ordering, no longer an outlier), the rest as for a new event.
    promote_outlier: bool = False
    # The state group after the event, when the caller made it (backfill plans a batch's state).
    state_after: int | None = None
    # Passed auth at its own state but not at the current state: stored in the graph, but no
    # forward extremity, current state or membership change, and hidden from clients.
    soft_failed: bool = False
    # A local event built on a snapshot of the room (possibly a cached one) that had exactly
    # this many forward extremities, all of ``prev_event_ids`` among them: the transaction
    # checks that the room still looks so and raises ``StaleRoomContext`` if not.
    expected_extremity_count: int | None = None
    # The client transaction this event answers (``PUT /send/.../{txnId}``), recorded in the
    # same transaction; a transaction ID already recorded raises ``DuplicateTxnId``.
    send_txn: SendTxn | None = None
    # Whom the event notifies under their push rules: called inside the transaction, before
    # the event is written (so it reads the room as it was before the event), and its
    # answer recorded in ``event_push_actions`` by the same transaction.
    push_actions: Callable[[Transaction], Sequence[PushAction]] | None = None
    # A local send whose ``push_actions`` evaluate on a copy of the room's push context kept in
    # memory, read at this ``push_context_version`` (0028): the batch's room check also checks the
    # version is unchanged and raises ``StaleRoomContext`` if not.
    push_context_version: int | None = None


@attrs.frozen
class PersistContext:
    """What persisting an event must know of its room, read in one transaction."""

    existing_stream_ordering: int | None
    forward_extremities: dict[str, int]
    prev_state_groups: dict[str, int]
    joined_servers: set[str]
    # Read for a local send under the room lock: the persist checks the extremities are unchanged.
    for_local_send: bool = False
    # The event is stored already, as an outlier (``existing_stream_ordering`` is set).
    existing_outlier: bool = False


@attrs.frozen
class SendContext:
    """What building and persisting a local event must know of its room, in one read:
    the extremities it will follow (with their state groups), the auth state, and
    the servers joined to the room."""

    forward_extremities: dict[str, int]
    auth_state: dict[StateKey, str]
    extremity_state_groups: dict[str, int]
    joined_servers: set[str]

    def persist_context(self, prev_event_ids: Collection[str]) -> PersistContext:
        """The persist context of a new event built on these extremities."""
        return PersistContext(
            None,
            dict(self.forward_extremities),
            {e: g for e, g in self.extremity_state_groups.items() if e in prev_event_ids},
            set(self.joined_servers),
            for_local_send=True,
        )


@attrs.frozen
class PersistResult:
    stream_ordering: int
    state_group_after: int | None
    already_persisted: bool
    # The remote servers this (local) event is for, as recorded in destination_rooms.
    destinations: frozenset[str] = frozenset()


@attrs.frozen
class BatchStart:
    """What checking and persisting a batch of received events of one room starts from, read in one
    transaction (``get_batch_start``): the forward extremities, the current state, the state after
    (and state group of) each stored prev event the batch builds on, and which of the batch's own
    events are stored already. The two states hold only the keys the batch's checks read."""

    extremities: frozenset[str]
    current_state: StateMap
    state_after: Mapping[str, StateMap]
    groups: Mapping[str, int]
    stored: frozenset[str]


@attrs.frozen
class BatchedPersist:
    """One event of ``persist_events_txn``: its request, and when its state before is the state
    group after an earlier event of the same batch (made in the same transaction), that event."""

    request: PersistRequest
    state_before_of: str | None = None


_EVENT_COLUMNS = (
    "event_id, room_id, stream_ordering, instance_name, depth, is_local, outlier, "
    "rejection_reason, redacted_by, json"
)


def _event_from_row(row: tuple[Any, ...]) -> StoredEvent:
    return StoredEvent(*row)


class EventsStore:
    def __init__(self, db: Database) -> None:
        self._db = db
        # A room's version never changes: cached without invalidation.
        self._room_versions = DictCache[str]("room_versions", max_entries=100_000)

    # --- reads --------------------------------------------------------------------

    async def get_event(self, event_id: str) -> StoredEvent | None:
        events = await self.get_events([event_id])
        return events.get(event_id)

    async def get_events(self, event_ids: Collection[str]) -> dict[str, StoredEvent]:
        if not event_ids:
            return {}
        return await self._db.run_interaction("get_events", get_events_txn, list(event_ids))

    async def get_room_version(self, room_id: str) -> str | None:
        return (await self.get_room_versions([room_id])).get(room_id)

    async def get_room_versions(self, room_ids: Collection[str]) -> dict[str, str]:
        """Room ID -> room version for the rooms this server knows."""
        found: dict[str, str] = {}
        missing = []
        for room_id in room_ids:
            version = self._room_versions.get((room_id,))
            if version is None:
                missing.append(room_id)
            else:
                found[room_id] = version
        if missing:

            def query(txn: Transaction) -> dict[str, str]:
                txn.execute("SELECT room_id, room_version FROM rooms WHERE room_id = ANY(%s)", (missing,))
                return {row[0]: str(row[1]) for row in txn.fetchall()}

            for room_id, version in (await self._db.run_interaction("get_room_versions", query)).items():
                self._room_versions.set((room_id,), version)
                found[room_id] = version
        return found

    async def get_persist_context(self, room_id: str, event_id: str, prev_event_ids: Collection[str]) -> PersistContext:
        return await self._db.run_interaction(
            "get_persist_context", get_persist_context_txn, room_id, event_id, list(prev_event_ids)
        )

    async def get_send_context(self, room_id: str, keys: Collection[StateKey]) -> SendContext:
        def query(txn: Transaction) -> SendContext:
            extremities = get_forward_extremities_txn(txn, room_id)
            return SendContext(
                extremities,
                get_current_state_for_keys_txn(txn, room_id, keys),
                get_state_groups_txn(txn, extremities),
                get_joined_servers_txn(txn, room_id),
            )

        return await self._db.run_interaction("get_send_context", query)

    async def get_forward_extremities(self, room_id: str) -> dict[str, int]:
        """The room's forward extremities, event ID -> depth."""
        return await self._db.run_interaction("get_forward_extremities", get_forward_extremities_txn, room_id)

    async def get_state_groups_after(self, event_ids: Collection[str]) -> dict[str, int]:
        return await self._db.run_interaction("get_state_groups_after", get_state_groups_txn, event_ids)

    async def get_state_groups_before(self, event_ids: Collection[str]) -> dict[str, int]:
        return await self._db.run_interaction(
            "get_state_groups_before", get_state_groups_txn, event_ids, after=False
        )

    async def get_state_for_group(self, state_group: int) -> dict[StateKey, str]:
        return await self._db.run_interaction("get_state_for_group", get_state_for_group_txn, state_group)

    async def get_current_state_ids(self, room_id: str) -> dict[StateKey, str]:
        return await self._db.run_interaction("get_current_state_ids", get_current_state_ids_txn, room_id)

    async def get_current_state_for_keys(self, room_id: str, keys: Collection[StateKey]) -> dict[StateKey, str]:
        """The current state events of just ``keys`` (for auth: a few rows, not the member list)."""
        return await self._db.run_interaction("get_current_state_for_keys", get_current_state_for_keys_txn, room_id, keys)

    async def get_destination_rooms(self, destination: str) -> dict[str, int]:
        def query(txn: Transaction) -> dict[str, int]:
            txn.execute("SELECT room_id, stream_ordering FROM destination_rooms WHERE destination = %s", (destination,))
            return {row[0]: int(row[1]) for row in txn.fetchall()}

        return await self._db.run_interaction("get_destination_rooms", query)

    async def get_servers_sharing_rooms(self, user_id: str) -> set[str]:
        """The servers that hear of ``user_id``'s presence and device changes."""
        return await self._db.run_interaction("get_servers_sharing_rooms", get_servers_sharing_rooms_txn, user_id)

    async def get_joined_servers(self, room_id: str) -> set[str]:
        """The servers of the room's currently joined members."""
        return await self._db.run_interaction("get_joined_servers", get_joined_servers_txn, room_id)

    async def get_auth_chain_ids(self, event_ids: Collection[str]) -> set[str]:
        """Every event reachable from ``event_ids`` through auth_events (not including them)."""

        def query(txn: Transaction) -> set[str]:
            txn.execute(
                """
                WITH RECURSIVE chain(event_id) AS (
                    SELECT auth_id FROM event_auth WHERE event_id = ANY(%s)
                    UNION
                    SELECT a.auth_id FROM event_auth a JOIN chain c ON a.event_id = c.event_id
                )
                SELECT event_id FROM chain
                """,
                (list(event_ids),),
            )
            return {row[0] for row in txn.fetchall()}

        return await self._db.run_interaction("get_auth_chain_ids", query)

    async def get_backward_extremities(self, room_id: str, limit: int) -> list[str]:
        """Events the room's timeline points back at that we do not have (or hold only as
        outliers): where ``/backfill`` should start. Oldest first, at most ``limit``."""

        def query(txn: Transaction) -> list[str]:
            txn.execute(
                """
                SELECT g.prev_event_id, MIN(e.stream_ordering) AS so
                FROM events e JOIN event_edges g ON g.event_id = e.event_id
                WHERE e.room_id = %s AND NOT e.outlier
                  AND NOT EXISTS (SELECT 1 FROM events p WHERE p.event_id = g.prev_event_id AND NOT p.outlier)
                GROUP BY g.prev_event_id ORDER BY so LIMIT %s
                """,
                (room_id, limit),
            )
            return [str(row[0]) for row in txn.fetchall()]

        return await self._db.run_interaction("get_backward_extremities", query)

    async def get_txn_event(self, access_token_id: int, txn_id: str) -> str | None:
        """The event a client transaction ID was used for, if any."""
        return await self._db.run_interaction("get_txn_event", get_txn_event_txn, access_token_id, txn_id)

    async def get_stream_ordering(self, event_id: str) -> int | None:
        def query(txn: Transaction) -> int | None:
            txn.execute("SELECT stream_ordering FROM events WHERE event_id = %s", (event_id,))
            row = txn.fetchone()
            return None if row is None else int(row[0])

        return await self._db.run_interaction("get_stream_ordering", query)

    async def get_current_state_for_keys_in_rooms(
        self, room_ids: Collection[str], keys: Collection[StateKey]
    ) -> dict[str, dict[StateKey, str]]:
        """``get_current_state_for_keys`` of several rooms in one query: room ID -> key -> event ID
        (rooms with none of ``keys`` are absent)."""
        if not room_ids or not keys:
            return {}

        def query(txn: Transaction) -> dict[str, dict[StateKey, str]]:
            txn.execute(
                """
                SELECT c.room_id, c.type, c.state_key, c.event_id FROM current_state_events c
                JOIN unnest(%s::text[], %s::text[]) AS k(type, state_key)
                  ON c.type = k.type AND c.state_key = k.state_key
                WHERE c.room_id = ANY(%s)
                """,
                ([k[0] for k in keys], [k[1] for k in keys], sorted(room_ids)),
            )
            found: dict[str, dict[StateKey, str]] = {}
            for room_id, kind, state_key, event_id in txn.fetchall():
                found.setdefault(room_id, {})[(kind, state_key)] = event_id
            return found

        return await self._db.run_interaction("get_current_state_for_keys_in_rooms", query)

    async def get_batch_start(self, room_id: str, event_ids: Collection[str], prev_event_ids: Collection[str],
                              keys: Collection[StateKey], *, max_groups: int = 8) -> BatchStart:
        """``BatchStart`` of ``room_id`` for a batch of ``event_ids`` whose prev events outside the
        batch are ``prev_event_ids``, with the state (current, and after each of those prev events)
        of ``keys`` only: the keys the batch's checks read. The state of at most ``max_groups``
        distinct groups is read (a prev event beyond them is left out, so what builds on it takes
        the one-event path)."""
        return await self._db.run_interaction(
            "get_batch_start", get_batch_start_txn, room_id, list(event_ids), list(prev_event_ids), sorted(keys),
            max_groups,
        )

    async def new_state_group(self, room_id: str, prev_group: int | None, delta: StateMap) -> int:
        return await self._db.run_interaction("new_state_group", store_state_group_txn, room_id, prev_group, delta)



def get_state_groups_txn(txn: Transaction, event_ids: Collection[str], *, after: bool = True) -> dict[str, int]:
    """Event ID -> the state group after (or before) it, for the events that have one."""
    column = "state_group_after" if after else "state_group_before"
    txn.execute(f"SELECT event_id, {column} FROM event_state_groups WHERE event_id = ANY(%s)", (list(event_ids),))
    return {row[0]: int(row[1]) for row in txn.fetchall()}


def get_current_state_ids_txn(txn: Transaction, room_id: str) -> dict[StateKey, str]:
    txn.execute("SELECT type, state_key, event_id FROM current_state_events WHERE room_id = %s", (room_id,))
    return {(row[0], row[1]): row[2] for row in txn.fetchall()}


def get_current_state_for_keys_txn(txn: Transaction, room_id: str, keys: Collection[StateKey]) -> dict[StateKey, str]:
    if not keys:
        return {}
    txn.execute(
        """
        SELECT c.type, c.state_key, c.event_id FROM current_state_events c
        JOIN unnest(%s::text[], %s::text[]) AS k(type, state_key)
          ON c.type = k.type AND c.state_key = k.state_key
        WHERE c.room_id = %s
        """,
        ([k[0] for k in keys], [k[1] for k in keys], room_id),
    )
    return {(row[0], row[1]): row[2] for row in txn.fetchall()}


def get_joined_servers_txn(txn: Transaction, room_id: str) -> set[str]:
    """Servers of the joined members: the part of each user ID after the first colon; while
    the room's state is partial (``partial_state_rooms``), also the servers the join's answer
    named (our member list lacks most of them until the resync)."""
    txn.execute(
        """
        SELECT DISTINCT substring(state_key FROM position(':' IN state_key) + 1)
        FROM current_state_events
        WHERE room_id = %s AND type = 'm.room.member' AND membership = 'join'
        UNION
        SELECT unnest(servers) FROM partial_state_rooms WHERE room_id = %s AND completed_stream IS NULL
        """,
        (room_id, room_id),
    )
    return {row[0] for row in txn.fetchall()}


def get_servers_sharing_rooms_txn(txn: Transaction, user_id: str) -> set[str]:
    """Servers with a member joined to any room ``user_id`` is joined to (its own included)."""
    txn.execute(
        """
        SELECT DISTINCT substring(m.state_key FROM position(':' IN m.state_key) + 1)
        FROM current_state_events u
        JOIN current_state_events m ON m.room_id = u.room_id AND m.type = 'm.room.member' AND m.membership = 'join'
        WHERE u.type = 'm.room.member' AND u.state_key = %s AND u.membership = 'join'
        """,
        (user_id,),
    )
    return {row[0] for row in txn.fetchall()}


def get_persist_context_txn(txn: Transaction, room_id: str, event_id: str, prev_event_ids: list[str]) -> PersistContext:
    txn.execute("SELECT stream_ordering, outlier FROM events WHERE event_id = %s", (event_id,))
    row = txn.fetchone()
    if row is not None and not row[1]:
        return PersistContext(int(row[0]), {}, {}, set())
    existing = None if row is None else int(row[0])
    groups = get_state_groups_txn(txn, prev_event_ids) if prev_event_ids else {}
    return PersistContext(existing, get_forward_extremities_txn(txn, room_id), groups,
                          get_joined_servers_txn(txn, room_id), existing_outlier=existing is not None)


def get_batch_start_txn(txn: Transaction, room_id: str, event_ids: list[str], prev_event_ids: list[str],
                        keys: list[StateKey], max_groups: int) -> BatchStart:
    # One round trip for the rows, one per distinct state group for its state (usually one). Only
    # ``keys`` of the state are read: a big room's whole state (every member) would be read and
    # mapped for each received transaction, for the few keys its events' auth rules read.
    types, state_keys = [k[0] for k in keys], [k[1] for k in keys]
    txn.execute(
        """
        SELECT 's', event_id, NULL, NULL FROM events WHERE event_id = ANY(%s)
        UNION ALL
        SELECT 'g', event_id, state_group_after::text, NULL FROM event_state_groups WHERE event_id = ANY(%s)
        UNION ALL
        SELECT 'x', event_id, NULL, NULL FROM event_forward_extremities WHERE room_id = %s
        UNION ALL
        SELECT 'c', c.type, c.state_key, c.event_id FROM current_state_events c
        JOIN unnest(%s::text[], %s::text[]) AS k(type, state_key) ON c.type = k.type AND c.state_key = k.state_key
        WHERE c.room_id = %s
        """,
        (event_ids, prev_event_ids, room_id, types, state_keys, room_id),
    )
    stored: set[str] = set()
    groups: dict[str, int] = {}
    extremities: set[str] = set()
    current: dict[StateKey, str] = {}
    for kind, a, b, c in txn.fetchall():
        if kind == "s":
            stored.add(a)
        elif kind == "g":
            groups[a] = int(b)
        elif kind == "x":
            extremities.add(a)
        else:
            current[(a, b)] = c
    kept = sorted(set(groups.values()))[:max_groups]
    states = {group: get_state_for_group_txn(txn, group, keys) for group in kept}
    groups = {event_id: group for event_id, group in groups.items() if group in states}
    return BatchStart(
        frozenset(extremities),
        current,
        {event_id: states[group] for event_id, group in groups.items()},
        groups,
        frozenset(stored),
    )


def get_events_txn(txn: Transaction, event_ids: list[str]) -> dict[str, StoredEvent]:
    txn.execute(f"SELECT {_EVENT_COLUMNS} FROM events WHERE event_id = ANY(%s)", (event_ids,))
    return {row[0]: _event_from_row(row) for row in txn.fetchall()}


def get_forward_extremities_txn(txn: Transaction, room_id: str) -> dict[str, int]:
    txn.execute(
        """
        SELECT f.event_id, e.depth FROM event_forward_extremities f
        JOIN events e USING (event_id) WHERE f.room_id = %s
        """,
        (room_id,),
    )
    return {row[0]: int(row[1]) for row in txn.fetchall()}


def get_state_for_group_txn(txn: Transaction, state_group: int,
                            keys: Collection[StateKey] | None = None) -> dict[StateKey, str]:
    """The full state of a group, or its state of just ``keys``: walk its delta chain, nearest
    entry wins."""
    chain = """
        WITH RECURSIVE chain(id, prev_group, distance) AS (
            SELECT id, prev_group, 0 FROM state_groups WHERE id = %s
            UNION ALL
            SELECT g.id, g.prev_group, c.distance + 1
            FROM state_groups g JOIN chain c ON g.id = c.prev_group
        )
        """
    if keys is None:
        txn.execute(
            chain + """
            SELECT DISTINCT ON (s.type, s.state_key) s.type, s.state_key, s.event_id
            FROM state_groups_state s JOIN chain c ON s.state_group = c.id
            ORDER BY s.type, s.state_key, c.distance
            """,
            (state_group,),
        )
    elif not keys:
        return {}
    else:
        # Each key looked up in the chain's groups, nearest first (a join of the keys with the
        # chain's rows was planned as a read of every row of the groups: a big room's snapshot).
        txn.execute(
            chain + """
            SELECT k.type, k.state_key, (
                SELECT s.event_id FROM chain c JOIN state_groups_state s
                  ON s.state_group = c.id AND s.type = k.type AND s.state_key = k.state_key
                ORDER BY c.distance LIMIT 1)
            FROM unnest(%s::text[], %s::text[]) AS k(type, state_key)
            """,
            (state_group, [k[0] for k in keys], [k[1] for k in keys]),
        )
    return {(row[0], row[1]): row[2] for row in txn.fetchall() if row[2] is not None}


def _state_group_depth_txn(txn: Transaction, state_group: int) -> int:
    txn.execute("SELECT delta_depth FROM state_groups WHERE id = %s", (state_group,))
    row = txn.fetchone()
    if row is None:
        raise ValueError(f"unknown state group {state_group}")
    return int(row[0])


def store_state_group_txn(
    txn: Transaction, room_id: str, prev_group: int | None, delta: StateMap
) -> int:
    """A new state group: ``delta`` on ``prev_group``, or a snapshot when the chain is long."""
    full: StateMap | None = None
    depth = 0
    if prev_group is not None:
        depth = _state_group_depth_txn(txn, prev_group) + 1
        if depth > MAX_STATE_DELTA_DEPTH:
            full = {**get_state_for_group_txn(txn, prev_group), **delta}
    else:
        full = delta
    txn.execute("SELECT nextval('state_group_id_seq')")
    row = txn.fetchone()
    assert row is not None
    group = int(row[0])
    if full is not None:
        txn.execute(
            "INSERT INTO state_groups (id, room_id, prev_group, delta_depth) VALUES (%s, %s, NULL, 0)",
            (group, room_id),
        )
        entries: Iterable[tuple[StateKey, str]] = full.items()
    else:
        txn.execute(
            "INSERT INTO state_groups (id, room_id, prev_group, delta_depth) VALUES (%s, %s, %s, %s)",
            (group, room_id, prev_group, depth),
        )
        entries = delta.items()
    txn.execute_values(
        "INSERT INTO state_groups_state (state_group, type, state_key, event_id) VALUES %s",
        [(group, key[0], key[1], event_id) for key, event_id in entries],
    )
    return group


# The statements of an event's persist batch, prepared once per connection (``Prepared``).
_INSERT_EVENT: Final = Prepared("""
    INSERT INTO events (stream_ordering, instance_name, event_id, room_id, type, state_key, sender,
                        depth, origin_server_ts, is_local, outlier, rejection_reason, json, destinations,
                        soft_failed)
    VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)
    """)
_INSERT_EDGES: Final = Prepared(
    "INSERT INTO event_edges (event_id, prev_event_id, room_id) "
    "SELECT %s::text, unnest(%s::text[]), %s::text ON CONFLICT DO NOTHING")
_INSERT_AUTH: Final = Prepared(
    "INSERT INTO event_auth (event_id, auth_id, room_id) "
    "SELECT %s::text, unnest(%s::text[]), %s::text ON CONFLICT DO NOTHING")
_INSERT_TXN_ID: Final = Prepared(
    "INSERT INTO event_txn_ids (access_token_id, txn_id, room_id, event_id, user_id, inserted_ts) "
    "VALUES (%s, %s, %s, %s, %s, %s)")
_INSERT_EVENT_STATE_GROUPS: Final = Prepared(
    "INSERT INTO event_state_groups (event_id, state_group_before, state_group_after) VALUES (%s, %s, %s)")
# An event becomes a forward extremity unless a stored event cites it. Planned afresh each time,
# not Prepared: a connection that prepared it while event_edges was empty kept a sequential scan
# as its plan until the table's next ANALYZE, reading every edge of every room each time.
_INSERT_EXTREMITY: Final = """
    INSERT INTO event_forward_extremities (room_id, event_id)
    SELECT %s::text, %s::text WHERE NOT EXISTS (SELECT 1 FROM event_edges WHERE prev_event_id = %s)
    ON CONFLICT DO NOTHING
    """
# A local send's event, made here just now: nothing stored can cite it (nobody else has seen its
# ID yet), so it becomes an extremity without the look-up.
_INSERT_LOCAL_EXTREMITY: Final = Prepared(
    "INSERT INTO event_forward_extremities (room_id, event_id) VALUES (%s, %s) ON CONFLICT DO NOTHING")
_INSERT_DESTINATIONS: Final = Prepared(
    "INSERT INTO destinations (destination) SELECT unnest(%s::text[]) ON CONFLICT DO NOTHING")
_UPSERT_DESTINATION_ROOMS: Final = Prepared("""
    INSERT INTO destination_rooms (destination, room_id, stream_ordering)
    SELECT unnest(%s::text[]), %s::text, %s::bigint
    ON CONFLICT (destination, room_id) DO UPDATE SET stream_ordering = EXCLUDED.stream_ordering
    WHERE destination_rooms.stream_ordering < EXCLUDED.stream_ordering
    """)
# A local send's last statement: its prev events stop being extremities, and the room's
# extremities must be those the event was built on (send_extremities_as_expected raises
# STALE_ROOM_SQLSTATE otherwise), checked in SQL so that the COMMIT goes in the same round trip.
# The extremities are counted (as the statement began: the event's own is in, its prev events
# not yet out) up to a limit, one more than the send expects being enough to see too many, in
# index order, inside the function (0029), whose settings leave an index scan the only plan: it
# marks the index entries of deleted extremities dead as it passes them (so later scans skip
# them and a page split drops them). A bitmap scan marks nothing: every send in a busy room
# walked every extremity deleted since the last vacuum (4,000 sends in one room: 0.4 ms a
# count). As a subquery of this statement the count was a bitmap scan on a new database.
# The same statement checks the push context the send evaluated on, when it was a kept copy
# (push_context_as_expected, 0028; NULL: read by this transaction, nothing to check): a
# statement of its own would cost PostgreSQL more than the read it saves.
_DELETE_EXTREMITIES_CHECKED: Final = Prepared("""
    WITH gone AS (
        DELETE FROM event_forward_extremities WHERE room_id = %s AND event_id = ANY(%s::text[]) RETURNING 1
    )
    SELECT send_extremities_as_expected(
        %s::text, (SELECT count(*) FROM gone), %s::bigint, %s::int, %s::bigint),
           push_context_as_expected(%s::text, %s::bigint, (SELECT version FROM push_context_version))
    """)
_DELETE_EXTREMITIES: Final = Prepared(
    "DELETE FROM event_forward_extremities WHERE room_id = %s AND event_id = ANY(%s::text[])")


@on_reactor
def persist_event_txn(txn: Transaction, r: PersistRequest, allocate: Callable[[Transaction], int],
                      allocate_in_statements: Callable[[Transaction], IdInStatements] | None = None) -> PersistResult:
    """Write the event; ``allocate(txn)`` reserves its stream ordering (only when it is new).

    The writes go to the server in one batch (a round trip, not one per table);
    only backfill (which may promote an outlier) and new state groups read first.
    A local send's batch carries the COMMIT; given ``allocate_in_statements``, it takes the
    stream ordering from the sequence itself too, saving ``allocate``'s round trip.
    Raises ``EventAlreadyPersisted`` if a concurrent transaction stored the event,
    ``DuplicateTxnId`` if ``r.send_txn`` is already recorded and ``StaleRoomContext``
    if ``r.expected_extremity_count`` no longer describes the room; each rolls back.
    """
    promote = r.promote_outlier
    if r.backfilled:
        txn.execute("SELECT stream_ordering, outlier FROM events WHERE event_id = %s", (r.event_id,))
        existing = txn.fetchone()
        promote = existing is not None and bool(existing[1])
        if existing is not None and not promote:
            return PersistResult(int(existing[0]), None, already_persisted=True)
    moves_extremities = not r.backfilled and not r.soft_failed
    # A local send on the room's one line of history has nothing to write after its batch: the
    # batch carries the COMMIT (its last round trip; the checked statement is last in it).
    commit = (moves_extremities and not r.outlier and bool(r.prev_event_ids)
              and r.expected_extremity_count is not None and r.new_current_state is None)
    # A kept push context is checked by the statement only a committing local send's batch has.
    assert r.push_context_version is None or commit, "a kept push context is a local send's"
    in_statements = allocate_in_statements(txn) if commit and allocate_in_statements is not None else None
    stream_ordering: int | SqlValue = allocate(txn) if in_statements is None else in_statements.value
    # The servers the federation sender fans this event out to (see 0007_federation_sender).
    fanout = sorted(r.remote_servers) if r.is_local and not r.outlier and r.remote_servers else None
    batch: list[tuple[str, Sequence[object] | None]] = [] if in_statements is None else [in_statements.take]

    if r.room_version is not None:
        batch.append((
            """
            INSERT INTO rooms (room_id, room_version, creator, created_ts) VALUES (%s, %s, %s, %s)
            ON CONFLICT (room_id) DO NOTHING
            """,
            (r.room_id, r.room_version, r.sender, r.origin_server_ts),
        ))
    if promote:
        # Known as an outlier (e.g. state from send_join): now placed in the timeline, by backfill.
        batch.append((
            "UPDATE events SET stream_ordering = %s, instance_name = %s, outlier = FALSE, rejection_reason = %s, "
            "soft_failed = %s WHERE event_id = %s AND outlier",
            (stream_ordering, r.instance_name, r.rejection_reason, r.soft_failed, r.event_id),
        ))
    else:
        # No ON CONFLICT: an event stored meanwhile fails the batch (EventAlreadyPersisted).
        batch.append((
            _INSERT_EVENT,
            (
                stream_ordering, r.instance_name, r.event_id, r.room_id, r.type, r.state_key, r.sender,
                r.depth, r.origin_server_ts, r.is_local, r.outlier, r.rejection_reason, r.pdu_json,
                fanout, r.soft_failed,
            ),
        ))
    if r.prev_event_ids:
        batch.append((
            _INSERT_EDGES,
            (r.event_id, list(r.prev_event_ids), r.room_id),
        ))
    if r.auth_event_ids:
        batch.append((
            _INSERT_AUTH,
            (r.event_id, list(r.auth_event_ids), r.room_id),
        ))
    if r.redacts is not None:
        # Rejected, soft-failed or outlier redactions are recorded too; reads ignore them.
        batch.append((
            "INSERT INTO event_redactions (redaction_id, redacts, room_id) VALUES (%s, %s, %s) "
            "ON CONFLICT DO NOTHING",
            (r.event_id, r.redacts, r.room_id),
        ))
    if r.send_txn is not None:
        # No ON CONFLICT: a transaction ID already used fails the batch (DuplicateTxnId).
        batch.append((
            _INSERT_TXN_ID,
            (r.send_txn.access_token_id, r.send_txn.txn_id, r.room_id, r.event_id, r.send_txn.user_id,
             r.send_txn.inserted_ts),
        ))
    if r.outlier:
        assert isinstance(stream_ordering, int)
        _run_batch(txn, r, batch)
        return PersistResult(stream_ordering, None, already_persisted=False)

    # State: before is given; after is the event's delta on top (or the same group).
    # New groups read their predecessor's depth, so they are written ahead of the batch.
    if r.state_before is None:
        before = store_state_group_txn(txn, r.room_id, None, {})
    else:
        before = r.state_before
    if r.state_after is not None:
        after = r.state_after
    elif r.state_after_delta:
        after = store_state_group_txn(txn, r.room_id, before, r.state_after_delta)
    else:
        after = before
    batch.append((
        _INSERT_EVENT_STATE_GROUPS,
        (r.event_id, before, after),
    ))

    # Forward extremities: the event replaces the extremities it points at, and
    # becomes one unless something already persisted points at it. Backfilled
    # history lies behind the extremities and never changes them, and a soft-failed
    # event is never one (nothing new is built on it here).
    if moves_extremities:
        if r.expected_extremity_count is not None and not promote:  # a local send
            batch.append((_INSERT_LOCAL_EXTREMITY, (r.room_id, r.event_id)))
        else:
            batch.append((_INSERT_EXTREMITY, (r.room_id, r.event_id, r.event_id)))

    if (r.type == "m.room.member" and r.state_key is not None and r.membership is not None
            and r.rejection_reason is None and not r.soft_failed):
        batch.append((
            """
            INSERT INTO room_memberships (event_id, room_id, user_id, sender, membership, stream_ordering,
                                          display_name, avatar_url)
            VALUES (%s, %s, %s, %s, %s, %s, %s, %s)
            """,
            (r.event_id, r.room_id, r.state_key, r.sender, r.membership, stream_ordering, r.display_name,
             r.avatar_url),
        ))

    if r.push_actions is not None and not r.backfilled and not r.soft_failed and r.rejection_reason is None:
        notified = r.push_actions(txn)
        if notified:
            batch.append(push_actions_sql(r.room_id, r.event_id, stream_ordering, notified))

    if moves_extremities:
        if r.new_current_state is None and r.current_state_delta:
            # This event's own membership is known, so the upsert needs no read and joins the batch.
            own = {r.event_id: r.membership} if r.type == "m.room.member" and r.rejection_reason is None else {}
            batch.append(_upsert_current_state_sql(txn, r.room_id, r.current_state_delta, own))
        if r.is_local and r.remote_servers:
            destinations = sorted(r.remote_servers)
            batch.append((
                _INSERT_DESTINATIONS,
                (destinations,),
            ))
            batch.append((
                _UPSERT_DESTINATION_ROOMS,
                (destinations, r.room_id, stream_ordering),
            ))
        if r.prev_event_ids and r.expected_extremity_count is not None:
            # Last in the batch: a local send's check that the room is as it was built on.
            batch.append((
                _DELETE_EXTREMITIES_CHECKED,
                (r.room_id, list(r.prev_event_ids), r.room_id, len(set(r.prev_event_ids)),
                 r.expected_extremity_count + 2, r.expected_extremity_count + 1, r.room_id, r.push_context_version),
            ))
        elif r.prev_event_ids:
            batch.append((
                _DELETE_EXTREMITIES,
                (r.room_id, list(r.prev_event_ids)),
            ))
    if in_statements is not None:
        _run_batch(txn, r, batch, commit=True, then=in_statements.read)
        row = txn.fetchone()
        assert row is not None
        stream_ordering = in_statements.recorded(int(row[0]))
    else:
        _run_batch(txn, r, batch, commit=commit)
    assert isinstance(stream_ordering, int)
    if r.backfilled or r.soft_failed:
        return PersistResult(stream_ordering, after, already_persisted=False)
    if r.new_current_state is not None:
        _update_current_state_txn(txn, r.room_id, r.new_current_state)
    return PersistResult(stream_ordering, after, already_persisted=False, destinations=r.remote_servers)


@on_reactor
def persist_events_txn(
    txn: Transaction, batch: Sequence[BatchedPersist], allocate_many: Callable[[Transaction, int], list[int]]
) -> list[PersistResult]:
    """Write a batch of new events of one room, in order, in one transaction (``persist_event_txn``
    for each); their stream orderings are reserved together, ascending in batch order.

    None of them may be stored already (the caller checked): one that was stored meanwhile
    raises ``EventAlreadyPersisted`` and rolls the whole batch back. Safe to retry: every
    attempt starts afresh.
    """
    if not batch:
        return []
    orderings = iter(allocate_many(txn, len(batch)))
    groups_after: dict[str, int] = {}
    results: list[PersistResult] = []
    # The events' writes go to the server together, up to the next read (a new state group,
    # a push-rules read): one round trip for a run of messages rather than one per event.
    held = DeferredStatements(txn)
    try:
        i = 0
        while i < len(batch):
            # A run of events that change no state is written with one statement per table.
            j = i
            while j < len(batch) and _in_bulk_run(batch[j]):
                j += 1
            if j - i >= 2:
                run: list[tuple[PersistRequest, int, int]] = []
                for item in batch[i:j]:
                    group = groups_after[item.state_before_of] if item.state_before_of is not None else item.request.state_before
                    assert group is not None  # _in_bulk_run
                    groups_after[item.request.event_id] = group  # it changes no state
                    run.append((item.request, next(orderings), group))
                for request, stream_ordering, group in run:
                    results.append(PersistResult(stream_ordering, group, already_persisted=False))
                _persist_run_txn(held, run)
                i = j
                continue
            one = batch[i]
            r = one.request
            if one.state_before_of is not None:
                r = attrs.evolve(r, state_before=groups_after[one.state_before_of])
            result = persist_event_txn(held, r, lambda _txn: next(orderings))
            if result.state_group_after is not None:
                groups_after[r.event_id] = result.state_group_after
            results.append(result)
            i += 1
        held.flush()
    except psycopg2.errors.UniqueViolation as e:
        if e.diag.table_name == "events":
            raise EventAlreadyPersisted(", ".join(item.request.event_id for item in batch)) from e
        raise
    return results


def _in_bulk_run(item: BatchedPersist) -> bool:
    """Whether ``persist_events_txn`` may write ``item`` with its neighbours (``_persist_run_txn``): a
    received event new to the room's graph that changes no state (no state key, no redaction),
    whose state group before is given or made earlier in the batch."""
    r = item.request
    return ((r.state_before is not None or item.state_before_of is not None) and r.state_key is None and not r.is_local and not r.outlier and not r.backfilled and not r.promote_outlier
            and r.room_version is None and r.redacts is None and r.send_txn is None and r.state_after is None
            and not r.state_after_delta and r.new_current_state is None and not r.current_state_delta
            and r.expected_extremity_count is None and r.membership is None and not r.remote_servers)


# The statements of a run of received events (``_persist_run_txn``): one per table, for the run.
_INSERT_RUN_EVENTS: Final = Prepared("""
    INSERT INTO events (stream_ordering, instance_name, event_id, room_id, type, state_key, sender, depth,
                        origin_server_ts, is_local, outlier, rejection_reason, json, destinations, soft_failed)
    SELECT o, %s::text, e, %s::text, t, NULL, s, d, ts, FALSE, FALSE, rr, j, NULL, sf
    FROM unnest(%s::bigint[], %s::text[], %s::text[], %s::text[], %s::bigint[], %s::bigint[], %s::text[],
                %s::text[], %s::boolean[]) AS x(o, e, t, s, d, ts, rr, j, sf)
    """)
# Planned afresh each time, as _INSERT_EXTREMITY is (it runs once for a whole run).
_INSERT_RUN_EXTREMITIES: Final = """
    INSERT INTO event_forward_extremities (room_id, event_id)
    SELECT %s::text, e FROM unnest(%s::text[]) AS e
    WHERE NOT EXISTS (SELECT 1 FROM event_edges WHERE prev_event_id = e)
    ON CONFLICT DO NOTHING
    """
_INSERT_RUN_EDGES: Final = Prepared(
    "INSERT INTO event_edges (event_id, prev_event_id, room_id) SELECT e, p, %s::text "
    "FROM unnest(%s::text[], %s::text[]) AS x(e, p) ON CONFLICT DO NOTHING")
_INSERT_RUN_AUTH: Final = Prepared(
    "INSERT INTO event_auth (event_id, auth_id, room_id) SELECT e, p, %s::text "
    "FROM unnest(%s::text[], %s::text[]) AS x(e, p) ON CONFLICT DO NOTHING")
_INSERT_RUN_STATE_GROUPS: Final = Prepared(
    "INSERT INTO event_state_groups (event_id, state_group_before, state_group_after) "
    "SELECT e, g, g FROM unnest(%s::text[], %s::bigint[]) AS x(e, g)")
_INSERT_RUN_PUSH_ACTIONS: Final = Prepared("""
    INSERT INTO event_push_actions (user_id, room_id, event_id, stream_ordering, highlight, actions,
                                    received_ts, thread_id)
    SELECT u, %s::text, e, o, h, a, (extract(epoch FROM clock_timestamp()) * 1000)::bigint, t
    FROM unnest(%s::text[], %s::text[], %s::bigint[], %s::boolean[], %s::text[], %s::text[]) AS x(u, e, o, h, a, t)
    ON CONFLICT DO NOTHING
    """)


def _persist_run_txn(txn: Transaction, run: Sequence[tuple[PersistRequest, int, int]]) -> None:
    """Write a run of one room's events as ``persist_event_txn`` writes each in turn, with one
    statement per table: ``(request, stream ordering, state group before and after)`` in batch
    order, each event's prev events stored or earlier in the run (parents first), none of them
    changing state (``_in_bulk_run``).

    Forward extremities end as the events one at a time leave them: an event that moves them
    (not soft-failed) becomes one unless an event stored before the run cites it (checked before
    the run's own edges are written, as each event's check in turn could not see the edges of
    the events after it), and the prev events of those that move them stop being ones. Push
    actions are evaluated first: the events change no state, so each reads the room as it is."""
    room_id = run[0][0].room_id
    notified: list[tuple[PushAction, str, int]] = []
    for r, stream_ordering, _ in run:
        if r.push_actions is not None and not r.soft_failed and r.rejection_reason is None:
            notified.extend((action, r.event_id, stream_ordering) for action in r.push_actions(txn))
    rows = [r for r, _, _ in run]
    # The prev events of the events that move the extremities stop being extremities (the DELETE
    # below); an event of the run among them is not inserted only to be deleted in the same
    # transaction (a dead index entry per event, which every read of the room's extremities
    # walks until a vacuum).
    prevs = sorted({p for r in rows if not r.soft_failed for p in r.prev_event_ids})
    replaced = set(prevs)
    moving = [r.event_id for r in rows if not r.soft_failed and r.event_id not in replaced]
    statements: list[tuple[str, Sequence[object]]] = [(
        _INSERT_RUN_EVENTS,
        (rows[0].instance_name, room_id, [o for _, o, _ in run], [r.event_id for r in rows], [r.type for r in rows],
         [r.sender for r in rows], [r.depth for r in rows], [r.origin_server_ts for r in rows],
         [r.rejection_reason for r in rows], [r.pdu_json for r in rows], [r.soft_failed for r in rows]),
    )]
    if moving:
        statements.append((_INSERT_RUN_EXTREMITIES, (room_id, moving)))
    for sql, edges in ((_INSERT_RUN_EDGES, [(r.event_id, p) for r in rows for p in r.prev_event_ids]),
                       (_INSERT_RUN_AUTH, [(r.event_id, a) for r in rows for a in r.auth_event_ids])):
        if edges:
            statements.append((sql, (room_id, [e for e, _ in edges], [p for _, p in edges])))
    statements.append((_INSERT_RUN_STATE_GROUPS, ([r.event_id for r in rows], [g for _, _, g in run])))
    if notified:
        statements.append((
            _INSERT_RUN_PUSH_ACTIONS,
            (room_id, [a.user_id for a, _, _ in notified], [e for _, e, _ in notified], [o for _, _, o in notified],
             [a.highlight for a, _, _ in notified], [a.actions_json for a, _, _ in notified],
             [a.thread_id for a, _, _ in notified]),
        ))
    if prevs:
        statements.append((_DELETE_EXTREMITIES, (room_id, prevs)))
    txn.execute_statements(statements)


def _run_batch(txn: Transaction, r: PersistRequest, batch: Sequence[tuple[str, Sequence[object] | None]], *,
               commit: bool = False, then: tuple[str, None] | None = None) -> None:
    """Send the persist batch (``commit``: with the transaction's COMMIT, and ``then``); turn the
    errors it expects into their exceptions."""
    try:
        txn.execute_statements(batch, commit=commit, then=then)
    except psycopg2.errors.UniqueViolation as e:
        table = e.diag.table_name
        if table == "event_txn_ids" and r.send_txn is not None:
            raise DuplicateTxnId(r.send_txn.access_token_id, r.send_txn.txn_id) from e
        if table == "events":
            raise EventAlreadyPersisted(r.event_id) from e
        raise
    except psycopg2.Error as e:
        if e.pgcode == STALE_ROOM_SQLSTATE:
            raise StaleRoomContext(r.room_id, e.diag.message_primary or str(e)) from e
        raise


def get_txn_event_txn(txn: Transaction, access_token_id: int, txn_id: str) -> str | None:
    txn.execute(
        "SELECT event_id FROM event_txn_ids WHERE access_token_id = %s AND txn_id = %s", (access_token_id, txn_id)
    )
    row = txn.fetchone()
    return None if row is None else str(row[0])


def _update_current_state_txn(txn: Transaction, room_id: str, new_state: StateMap) -> None:
    """Make ``current_state_events`` equal ``new_state``, touching only what changed."""
    old = get_current_state_ids_txn(txn, room_id)
    removed = [key for key in old if key not in new_state]
    changed = {key: event_id for key, event_id in new_state.items() if old.get(key) != event_id}
    if removed:
        txn.execute_batch(
            "DELETE FROM current_state_events WHERE room_id = %s AND type = %s AND state_key = %s",
            [(room_id, key[0], key[1]) for key in removed],
        )
    if changed:
        _upsert_current_state_txn(txn, room_id, changed)


def _upsert_current_state_txn(txn: Transaction, room_id: str, changed: StateMap) -> None:
    sql, params = _upsert_current_state_sql(txn, room_id, changed, {})
    txn.execute(sql, params)


def _upsert_current_state_sql(
    txn: Transaction, room_id: str, changed: StateMap, known: Mapping[str, str | None]
) -> tuple[str, Sequence[object]]:
    """The upsert of ``changed`` into current state; ``known``: memberships of member events
    already known (the event being persisted), the others are read here."""
    memberships: dict[str, str | None] = dict(known)
    member_ids = [event_id for key, event_id in changed.items() if key[0] == "m.room.member" and event_id not in known]
    if member_ids:
        txn.execute("SELECT event_id, membership FROM room_memberships WHERE event_id = ANY(%s)", (member_ids,))
        memberships.update({row[0]: row[1] for row in txn.fetchall()})
        missing = [event_id for event_id in member_ids if event_id not in memberships]
        if missing:
            # Member events without a room_memberships row (outliers, rejected): read the JSON.
            txn.execute("SELECT event_id, json FROM events WHERE event_id = ANY(%s)", (missing,))
            for event_id, raw in txn.fetchall():
                content = json.loads(raw).get("content", {})
                membership = content.get("membership") if isinstance(content, dict) else None
                memberships[event_id] = membership if isinstance(membership, str) else None
    keys = list(changed.items())
    return (
        """
        INSERT INTO current_state_events (room_id, type, state_key, event_id, membership)
        SELECT %s, * FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[])
        ON CONFLICT (room_id, type, state_key) DO UPDATE
        SET event_id = EXCLUDED.event_id, membership = EXCLUDED.membership
        """,
        (
            room_id,
            [key[0] for key, _ in keys],
            [key[1] for key, _ in keys],
            [event_id for _, event_id in keys],
            [memberships.get(event_id) if key[0] == "m.room.member" else None for key, event_id in keys],
        ),
    )
