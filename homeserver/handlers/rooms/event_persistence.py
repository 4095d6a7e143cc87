"""The one path every new event takes into the database, local or remote.

``EventPersister.persist`` works out the state before the event (its
predecessor's state group, or state resolution across forks), what the event
changes, the room's new current state over its forward extremities, reserves
a stream ordering on the ``events`` stream, writes it all in one transaction
through the events store, completes the ID and tells listeners (notifier,
federation sender). It does not check auth rules: callers do, against the
state the loader reads (``EventLoader.state_before_event``), and pass a
rejection reason. Persisting the same event twice is a no-op.

It writes and does not serve reads: events are read through the
``EventLoader`` it is given, which it primes with every event it stored, so
that an event this process built or verified is never read back. A
redaction's target is recorded (``event_redactions``) in the redaction's own
transaction, so no process sees a redaction without its effect.

Local sends read the room through ``send_context``, served from a per-room
snapshot this process keeps while it is the room's only writer (see
``_RoomSnapshot``), so a send in a quiet room costs one transaction. That transaction also reads the room's
local members and their push rules and records whom the event notifies (``push``,
homeserver/handlers/push/push.py).
"""

# tests: tests/integration/test_persist_events.py

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Concatenate, Final, ParamSpec, Protocol, TypeVar

import attrs
from prometheus_client import CollectorRegistry, Counter, Histogram
from twisted.internet.defer import Deferred

from homeserver.events import FrozenEvent, RoomVersion
from homeserver.events import constants as C
from homeserver.events.canonical import encode_compact
from homeserver.events.errors import MissingEventsError
from homeserver.events.identifiers import server_name_of
from homeserver.events.server_acl import ACL_KEY, server_allowed
from homeserver.handlers.rooms.event_loader import EventLoader
from storage.database import Transaction
from storage.kernel.written_events import WrittenEvent, WrittenEvents
from storage.metrics import Children
from storage.stores.events import (
    BatchedPersist,
    EventAlreadyPersisted,
    EventsStore,
    PersistContext,
    PersistRequest,
    PersistResult,
    SendContext,
    SendTxn,
    StateKey,
    persist_event_txn,
    persist_events_txn,
)
from storage.stores.push import PushAction, PushContextRow, any_http_pusher_txn, get_push_context_txn
from storage.stores.partial_state import CompletedState, complete_partial_state_txn, mark_partial_state_txn
from storage.stores.room_state import BulkEventRow, store_join_state_txn
from storage.stores.streams import IdInStatements

PushContextReader = Callable[[Transaction, str, str, Collection[str]], PushContextRow]

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


class PushActionsSource(Protocol):
    """Whom a new event notifies (``homeserver/handlers/push/push.py``): a function the event's
    transaction calls, whose answer it records with the event."""

    def actions_txn(
        self, event: FrozenEvent, *, read_room: PushContextReader = ...
    ) -> Callable[[Transaction], Sequence[PushAction]]: ...


class StreamIdAllocator(Protocol):
    """The events stream's ID generator: a transaction in which IDs can be reserved.

    ``run_interaction(name, func, *args)`` runs ``func(txn, *args)``; inside it
    ``get_next_txn(txn)`` reserves an ID, which completes once the transaction
    has ended (``storage.id_generators.StreamIdGenerator``); ``get_next_in_statements_txn``
    one that the transaction's statements take from the sequence themselves.
    """

    async def run_interaction(
        self, name: str, func: Callable[Concatenate[Transaction, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> R: ...

    def get_next_txn(self, txn: Transaction) -> int: ...

    def get_next_mult_txn(self, txn: Transaction, count: int) -> list[int]: ...

    def get_next_in_statements_txn(self, txn: Transaction) -> IdInStatements: ...


@attrs.frozen
class PersistenceMetrics:
    persisted: Counter
    duration: Histogram

    @classmethod
    def create(cls, registry: CollectorRegistry) -> PersistenceMetrics:
        metrics = cls(
            persisted=Counter(
                "tributary_events_persisted_total",
                "Events persisted, by origin (local or remote).",
                ["origin"],
                registry=registry,
            ),
            duration=Histogram(
                "tributary_events_persist_duration_seconds",
                "Time to persist one event: state computation, the transaction and completing its stream ID.",
                buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
                registry=registry,
            ),
        )
        for origin in ("local", "remote"):
            metrics.persisted.labels(origin=origin)
        return metrics


@attrs.frozen
class RemoteBatchEvent:
    """One received event of ``persist_remote_batch``, checked by the caller against the state the
    batch gave it: the state group before it is ``state_before_group`` (stored) or the group after
    ``state_before_of`` (an earlier event of the batch). ``current_state_delta``: what it changes in
    the room's current state, as the only new forward extremity; None for a soft-failed event,
    which changes neither."""

    event: FrozenEvent
    rejection_reason: str | None
    soft_failed: bool
    state_before_group: int | None
    state_before_of: str | None
    current_state_delta: Mapping[StateKey, str] | None


PersistedListener = Callable[[FrozenEvent, PersistResult], None]

# Rooms whose send context (extremities, the state keys sends looked at, joined
# servers) is kept between sends; least recently used rooms are dropped first.
MAX_ROOM_SNAPSHOTS: Final = 10_000
# A room's push read is kept with its snapshot only while it names at most this many local
# recipients: memory stays bounded (the rule texts are shared between rooms, the per-member
# entries are not), and a bigger room's read, one statement, is read again each message.
MAX_KEPT_PUSH_RECIPIENTS: Final = 100


@attrs.define
class _RoomSnapshot:
    """A room as this process last read or wrote it, under the room lock.

    ``state`` holds the current state of the keys sends have looked at (None: no
    such state). Any persist in the room drops the snapshot; a local send on the
    room's only line of history puts it back, moved on by that event. The persist
    transaction checks the extremities are still these (``StaleRoomContext``), so a
    write this process did not see is caught, not built upon.

    ``push``: the room's push context as the last send's push rules saw it, kept after a
    message (which changes none of it) for the next send to evaluate on without reading it.
    Its room part is vouched for by the extremities check; its users' part (push rules,
    pushers), which other processes write, by the batch's check of the version it was read at
    (``PersistRequest.push_context_version``).
    """

    extremities: dict[str, int]
    extremity_groups: dict[str, int]
    state: dict[StateKey, str | None]
    joined_servers: set[str]
    push: PushContextRow | None = None


class EventPersister:
    def __init__(
        self,
        *,
        store: EventsStore,
        loader: EventLoader,
        stream_ids: StreamIdAllocator,
        server_name: str,
        instance_name: str,
        metrics: PersistenceMetrics,
        backfill_ids: StreamIdAllocator | None = None,
        push: PushActionsSource | None = None,
        written: WrittenEvents | None = None,
    ) -> None:
        self._push = push
        # Notes for this process's readers of the events stream (``storage/kernel/written_events.py``).
        self._written = written
        self._store = store
        self._loader = loader
        self._stream_ids = stream_ids
        # The backfill stream: history from other servers gets stream_ordering = -(its ID).
        self._backfill_ids = backfill_ids
        self._server_name = server_name
        self._instance_name = instance_name
        self._metrics = metrics
        self._persisted = Children(metrics.persisted)  # one child touched per event
        self._listeners: list[PersistedListener] = []
        # Events of one room are persisted one at a time (per process), so the
        # forward extremities and current state each transaction computes are
        # not raced by another event of the same room.
        self._room_locks: dict[str, _RoomLock] = {}
        self._snapshots: OrderedDict[str, _RoomSnapshot] = OrderedDict()

    def add_listener(self, listener: PersistedListener) -> None:
        """Call ``listener(event, result)`` after each new event's transaction committed."""
        self._listeners.append(listener)

    # --- the room as a local send builds on it ---------------------------------------------

    async def send_context(self, room_id: str, keys: Collection[StateKey]) -> SendContext:
        """What a local send in ``room_id`` builds on: extremities, the current state of ``keys``
        and the joined servers. The caller holds ``room_lock(room_id)``; usually served from
        memory, since this process wrote the room's last event."""
        snapshot = self._snapshots.get(room_id)
        if snapshot is None:
            context = await self._store.get_send_context(room_id, keys)
            self._snapshots[room_id] = _RoomSnapshot(
                dict(context.forward_extremities),
                dict(context.extremity_state_groups),
                {key: context.auth_state.get(key) for key in keys},
                set(context.joined_servers),
            )
            while len(self._snapshots) > MAX_ROOM_SNAPSHOTS:
                self._snapshots.popitem(last=False)
            return context
        self._snapshots.move_to_end(room_id)
        unknown = [key for key in keys if key not in snapshot.state]
        if unknown:
            found = await self._store.get_current_state_for_keys(room_id, unknown)
            for key in unknown:
                snapshot.state[key] = found.get(key)
        auth_state: dict[StateKey, str] = {}
        for key in keys:
            event_id = snapshot.state[key]
            if event_id is not None:
                auth_state[key] = event_id
        return SendContext(
            dict(snapshot.extremities), auth_state, dict(snapshot.extremity_groups), set(snapshot.joined_servers)
        )

    def _advance_snapshot(
        self, snapshot: _RoomSnapshot, event: FrozenEvent, result: PersistResult
    ) -> None:
        """Put back the room's snapshot, moved on by ``event``: a local event that followed
        every extremity, so it is now the only one and changed state by itself alone."""
        if result.state_group_after is None:
            return
        key = event.state_key_tuple
        if key is not None:
            if key[0] == "m.room.member":
                if event.membership != "join":
                    return  # the member's server may have left: read the joined servers again
                snapshot.joined_servers.add(server_name_of(key[1]))
            snapshot.state[key] = event.event_id
        snapshot.extremities = {event.event_id: event.depth}
        snapshot.extremity_groups = {event.event_id: result.state_group_after}
        self._snapshots[event.room_id] = snapshot

    # --- the write -------------------------------------------------------------------------

    async def persist(
        self,
        room_version: RoomVersion,
        event: FrozenEvent,
        *,
        is_local: bool,
        outlier: bool = False,
        rejection_reason: str | None = None,
        state_before: Mapping[StateKey, str] | None = None,
        destinations: frozenset[str] | None = None,
        soft_failed: bool = False,
    ) -> PersistResult:
        """Persist ``event``; see the module docstring.

        ``state_before``: the state the event was sent on, when the caller
        learned it elsewhere (joining a room over federation: the state from
        send_join) rather than from the event's predecessors, which we do not
        have. ``destinations``: the servers a local event is for, when the
        caller knows them better than the room's current members here.
        ``soft_failed``: a remote event that failed auth against current state
        (stored in the graph; not an extremity, no current-state change, hidden from clients).
        """
        async with self.room_lock(event.room_id):
            return await self.persist_locked(
                room_version, event, is_local=is_local, outlier=outlier, rejection_reason=rejection_reason,
                state_before=state_before, destinations=destinations, soft_failed=soft_failed,
            )

    async def persist_locked(
        self,
        room_version: RoomVersion,
        event: FrozenEvent,
        *,
        is_local: bool,
        outlier: bool = False,
        rejection_reason: str | None = None,
        state_before: Mapping[StateKey, str] | None = None,
        destinations: frozenset[str] | None = None,
        context: PersistContext | None = None,
        soft_failed: bool = False,
    ) -> PersistResult:
        """``persist``, for a caller already holding ``room_lock(event.room_id)``.

        ``context``: the room as the caller read it under that lock (a local
        send reads it while building the event), saving a second read.
        """
        start = time.perf_counter()
        result = await self._persist_locked(
            room_version, event, is_local, outlier, rejection_reason, state_before, destinations, context,
            soft_failed,
        )
        self._after_persist(event, result, "local" if is_local else "remote", start)
        return result

    async def persist_local_send(
        self, room_version: RoomVersion, event: FrozenEvent, *, context: PersistContext, send_txn: SendTxn | None
    ) -> PersistResult:
        """A local event built under ``room_lock`` on ``context`` (from ``send_context``), with
        the client's transaction ID recorded in the same transaction. Raises ``DuplicateTxnId``
        (that ID was used already) or ``StaleRoomContext`` (the room changed under us: build
        the event again); neither writes anything."""
        start = time.perf_counter()
        result = await self._persist_locked(
            room_version, event, True, False, None, None, None, context, False, send_txn
        )
        self._after_persist(event, result, "local", start)
        return result

    async def _persist_locked(
        self,
        room_version: RoomVersion,
        event: FrozenEvent,
        is_local: bool,
        outlier: bool,
        rejection_reason: str | None,
        given_state_before: Mapping[StateKey, str] | None,
        destinations: frozenset[str] | None,
        context: PersistContext | None = None,
        soft_failed: bool = False,
        send_txn: SendTxn | None = None,
        given_state_group: int | None = None,
    ) -> PersistResult:
        # Whatever happens next, the room's snapshot no longer describes it, unless
        # this turns out to be a local send on the room's only line of history.
        snapshot = self._snapshots.pop(event.room_id, None)
        ctx = context or await self._store.get_persist_context(event.room_id, event.event_id, event.prev_event_ids)
        if ctx.existing_stream_ordering is not None and (outlier or not ctx.existing_outlier):
            return PersistResult(ctx.existing_stream_ordering, None, already_persisted=True)
        # Held as an outlier (state fetched for a gap or a join) and now arriving in the room's
        # graph: the stored row is promoted into the timeline.
        promote = ctx.existing_stream_ordering is not None

        state_before_group: int | None = None
        linear = False
        delta: dict[StateKey, str] = {}
        new_current: Mapping[StateKey, str] | None = None
        current_delta: Mapping[StateKey, str] | None = None
        if not outlier:
            key = event.state_key_tuple
            if key is not None and rejection_reason is None:
                delta = {key: event.event_id}
            extremities = set(ctx.forward_extremities)
            prevs = set(event.prev_event_ids)
            if soft_failed and given_state_before is not None:
                state_before_group = await self._store.new_state_group(event.room_id, None, given_state_before)
            elif soft_failed:
                # In the graph (its state groups), but the room's current state is untouched.
                state_before_group, _ = await self._state_before(room_version, event, ctx)
            elif given_state_before is not None:
                # ``given_state_group``: the caller stored that state already, as the room's
                # current state too (``persist_join``).
                state_before_group = given_state_group if given_state_group is not None else (
                    await self._store.new_state_group(event.room_id, None, given_state_before))
                if given_state_group is not None and not extremities - prevs:
                    current_delta = delta  # nothing else to resolve with: the event changes it by itself
                else:
                    new_current = await self._new_current_state(
                        room_version, event, {**given_state_before, **delta}, extremities - prevs
                    )
            elif prevs and extremities == prevs:
                # The common, linear case: the event follows every extremity, so
                # the room's current state (resolved over exactly those) changes
                # by what this event changes, and no state map need be loaded.
                state_before_group = await self._group_before(room_version, event, ctx)
                current_delta = delta
                linear = True
            else:
                state_before_group, state_before = await self._state_before(room_version, event, ctx)
                new_current = await self._new_current_state(
                    room_version, event, {**state_before, **delta}, extremities - prevs
                )

        remote_servers: frozenset[str] = frozenset()
        if destinations is not None:
            remote_servers = destinations - {self._server_name}
        elif is_local and not outlier:
            servers = set(ctx.joined_servers)
            if event.type == "m.room.member" and event.state_key and event.membership in ("leave", "ban"):
                # The target of a kick or ban hears of it though no longer joined. Nothing else
                # goes to a server without a joined member: an invite reaches the invitee's
                # server by /invite, not in its transactions.
                servers.add(server_name_of(event.state_key))
            servers.discard(self._server_name)
            remote_servers = frozenset(servers)
            if remote_servers:
                remote_servers = await self._acl_allowed(event, snapshot, remote_servers)

        # The room's snapshot, when this is a local send on it (checked by its batch).
        on_snapshot = snapshot if linear and ctx.for_local_send and is_local else None
        push_actions = None
        # Whether the event notifies anyone with a pusher: found by the transaction, noted after it.
        pushes = [False]
        room_push: _KeptPushRead | None = None
        if self._push is not None and not outlier and rejection_reason is None and not soft_failed:
            if on_snapshot is not None:
                # A state event reads the room afresh (a local invite adds its invitee).
                room_push = _KeptPushRead(on_snapshot.push if event.state_key is None else None)
                push_actions = self._noting_pushes(event, pushes, reader=room_push.read)
            else:
                push_actions = self._noting_pushes(event, pushes)
        request = self._request(
            room_version,
            event,
            is_local=is_local,
            outlier=outlier,
            push_actions=push_actions,
            rejection_reason=rejection_reason,
            state_before=state_before_group,
            state_after_delta=delta,
            new_current_state=new_current,
            current_state_delta=current_delta,
            remote_servers=remote_servers,
            soft_failed=soft_failed,
            promote_outlier=promote,
            expected_extremity_count=len(ctx.forward_extremities) if ctx.for_local_send else None,
            send_txn=send_txn,
            push_context_version=None if room_push is None or room_push.kept is None else room_push.kept.version,
        )
        try:
            def written() -> WrittenEvent:
                return _written(event, bool(remote_servers), pushes[0])

            result = await self._stream_ids.run_interaction(
                "persist_event", persist_event_txn, request, self._allocator(written), self._in_statements(written),
            )
        except EventAlreadyPersisted:
            stream_ordering = await self._store.get_stream_ordering(event.event_id)
            if stream_ordering is None:
                raise
            return PersistResult(stream_ordering, None, already_persisted=True)
        self._loader.prime(event)
        if on_snapshot is not None and not result.already_persisted:
            on_snapshot.push = None if room_push is None else room_push.to_keep(event)
            self._advance_snapshot(on_snapshot, event, result)
        return result

    async def persist_remote_batch(
        self, room_version: RoomVersion, batch: Sequence[RemoteBatchEvent]
    ) -> list[PersistResult]:
        """Persist received events of one room, in order, in one transaction; the caller holds
        ``room_lock`` and planned the batch (``homeserver/federation/batching.py``): each event
        follows the one before or the extremity it read, so no state is resolved here.

        None of them may be stored already. Raises ``EventAlreadyPersisted`` (nothing written)
        when one was stored meanwhile: the caller then takes the events one by one.
        """
        if not batch:
            return []
        room_id = batch[0].event.room_id
        self._snapshots.pop(room_id, None)
        start = time.perf_counter()
        items: list[BatchedPersist] = []
        room_reads = _SharedRoomReads()
        # Whether each event notifies anyone with a pusher: found by the transaction, noted after it.
        pushes = [False] * len(batch)
        for i, b in enumerate(batch):
            event = b.event
            delta: dict[StateKey, str] = {}
            key = event.state_key_tuple
            if key is not None and b.rejection_reason is None:
                delta = {key: event.event_id}
            push_actions = None
            if self._push is not None and b.rejection_reason is None and not b.soft_failed:
                push_actions = self._noting_pushes(event, pushes, i, reader=room_reads.reader(event))
            request = self._request(
                room_version,
                event,
                is_local=False,
                push_actions=push_actions,
                rejection_reason=b.rejection_reason,
                state_before=b.state_before_group,
                state_after_delta=delta,
                current_state_delta=b.current_state_delta,
                soft_failed=b.soft_failed,
            )
            items.append(BatchedPersist(request, b.state_before_of))
        results = await self._stream_ids.run_interaction(
            "persist_event_batch", persist_events_txn, items,
            self._batch_allocator(lambda: [_written(b.event, False, pushes[i]) for i, b in enumerate(batch)]),
        )
        # The batch's time shared out, so the histogram stays "time to persist one event".
        per_event = time.perf_counter() - (time.perf_counter() - start) / len(results)
        for b, result in zip(batch, results):
            self._loader.prime(b.event)
            self._after_persist(b.event, result, "remote", per_event)
        return results

    def _allocator(self, written: Callable[[], WrittenEvent]) -> Callable[[Transaction], int]:
        """The events stream's ``get_next_txn``, noting ``written()`` at the position it reserves
        once the transaction commits (before the position completes, so a reader woken by it
        sees the note)."""
        written_events = self._written
        if written_events is None:
            return self._stream_ids.get_next_txn

        def allocate(txn: Transaction) -> int:
            position = self._stream_ids.get_next_txn(txn)
            txn.call_after(lambda: written_events.note(position, written()))
            return position

        return allocate

    def _in_statements(self, written: Callable[[], WrittenEvent]) -> Callable[[Transaction], IdInStatements]:
        """``_allocator`` for a stream ordering the persist batch takes itself
        (``get_next_in_statements_txn``), noted once the transaction commits."""
        written_events = self._written

        def allocate(txn: Transaction) -> IdInStatements:
            pending = self._stream_ids.get_next_in_statements_txn(txn)
            if written_events is not None:
                def note() -> None:
                    if pending.stream_id is not None:
                        written_events.note(pending.stream_id, written())
                txn.call_after(note)
            return pending

        return allocate

    def _batch_allocator(self, written: Callable[[], list[WrittenEvent]]) -> Callable[[Transaction, int], list[int]]:
        """``_allocator`` for a batch: the positions it reserves, in batch order, noted with
        ``written()`` (received events go to no other server from here: no fan-out)."""
        written_events = self._written
        if written_events is None:
            return self._stream_ids.get_next_mult_txn

        def allocate(txn: Transaction, count: int) -> list[int]:
            positions = self._stream_ids.get_next_mult_txn(txn, count)

            def note() -> None:
                for position, one in zip(positions, written()):
                    written_events.note(position, one)

            txn.call_after(note)
            return positions

        return allocate

    def _noting_pushes(self, event: FrozenEvent, pushes: list[bool], index: int = 0, *,
                       reader: PushContextReader = get_push_context_txn,
                       ) -> Callable[[Transaction], Sequence[PushAction]]:
        """The push actions of ``event`` (``PushActionsSource.actions_txn``, the room read with
        ``reader``), also setting ``pushes[index]`` when a user it notifies has an ``http`` pusher
        (only when this process keeps notes for its own pushers' scan). The room's push read says
        who has one; were the room not read (a push source reading it some other way), one more
        statement asks."""
        assert self._push is not None
        if self._written is None:
            pushes[index] = True
            return self._push.actions_txn(event, read_room=reader)
        rooms: list[PushContextRow] = []

        def read_room(txn: Transaction, room_id: str, server_name: str, extra: Collection[str]) -> PushContextRow:
            row = reader(txn, room_id, server_name, extra)
            rooms.append(row)
            return row

        actions_txn = self._push.actions_txn(event, read_room=read_room)

        def in_txn(txn: Transaction) -> Sequence[PushAction]:
            rooms.clear()  # a retried transaction reads the room again
            actions = actions_txn(txn)
            notified = {a.user_id for a in actions}
            if not notified:
                pushes[index] = False
            elif rooms:
                pushes[index] = not notified.isdisjoint(rooms[-1].http_pushers)
            else:
                pushes[index] = any_http_pusher_txn(txn, notified)
            return actions

        return in_txn

    async def _acl_allowed(
        self, event: FrozenEvent, snapshot: _RoomSnapshot | None, servers: frozenset[str]
    ) -> frozenset[str]:
        """The ``servers`` the room's server ACL (after ``event``) lets receive its events. The
        ACL's ID comes from the room's snapshot when it holds it (it does after the first send)."""
        if event.state_key_tuple == ACL_KEY:
            content: Mapping[str, Any] | None = event.content
        else:
            if snapshot is not None and ACL_KEY in snapshot.state:
                acl_id = snapshot.state[ACL_KEY]
            else:
                acl_id = (await self._store.get_current_state_for_keys(event.room_id, [ACL_KEY])).get(ACL_KEY)
                if snapshot is not None:
                    snapshot.state[ACL_KEY] = acl_id
            if acl_id is None:
                return servers
            acl = await self._loader.get_event(acl_id)
            content = None if acl is None else acl.content
        return frozenset(s for s in servers if server_allowed(s, content))

    def _request(self, room_version: RoomVersion, event: FrozenEvent, **fields: Any) -> PersistRequest:
        """The persist request of ``event``: what it says of itself, plus the caller's ``fields``."""
        membership = event.membership if event.type == "m.room.member" else None
        content = event.content
        display_name = content.get("displayname") if membership else None
        avatar_url = content.get("avatar_url") if membership else None
        return PersistRequest(
            event_id=event.event_id,
            room_id=event.room_id,
            type=event.type,
            state_key=event.state_key,
            sender=event.sender,
            depth=event.depth,
            origin_server_ts=event.origin_server_ts,
            prev_event_ids=event.prev_event_ids,
            auth_event_ids=event.auth_event_ids,
            pdu_json=encode_compact(event.pdu),  # as json.dumps of a thawed copy writes it, without the copy
            instance_name=self._instance_name,
            membership=membership,
            display_name=display_name if isinstance(display_name, str) else None,
            avatar_url=avatar_url if isinstance(avatar_url, str) else None,
            room_version=room_version.identifier if event.type == "m.room.create" and event.state_key == "" else None,
            redacts=event.redacts if event.type == C.REDACTION else None,
            **fields,
        )

    async def persist_join(
        self,
        room_version: RoomVersion,
        join: FrozenEvent,
        events: Sequence[FrozenEvent],
        rejected: Mapping[str, str],
        state_before: Mapping[StateKey, str],
        destinations: frozenset[str],
        partial_servers: Sequence[str] | None = None,
    ) -> PersistResult:
        """Our join of a room over federation, with what ``send_join`` brought: ``events`` (its
        state and auth chain, checked by the caller; ``rejected``: why, for those that failed)
        stored as outliers in bulk, ``state_before`` stored once (one state group, and the
        room's current state) in the same transaction, then the join on that state.
        ``partial_servers``: the answer left the members out (``members_omitted``); the room is
        marked partial-state in the same transaction, with these servers to fetch it from."""
        rows = [_bulk_row(e, rejected.get(e.event_id)) for e in events]
        memberships = {e.event_id: e.membership for e in events if e.type == C.MEMBER}
        create = next((e for e in events if e.type == C.CREATE and e.state_key == ""), None)
        room = None if create is None else (room_version.identifier, create.sender, create.origin_server_ts)

        def store(txn: Transaction) -> int:
            group = store_join_state_txn(
                txn, join.room_id, rows, self._stream_ids.get_next_mult_txn, instance_name=self._instance_name,
                room=room, state=state_before, memberships=memberships,
            )
            if partial_servers is not None:
                mark_partial_state_txn(txn, join.room_id, join.event_id, list(partial_servers), int(time.time() * 1000))
            return group

        async with self.room_lock(join.room_id):
            start = time.perf_counter()
            group = await self._stream_ids.run_interaction("persist_join_state", store)
            for event in events:
                if event.type != C.MEMBER:  # the few events auth reads; members are read when needed
                    self._loader.prime(event)
            stored = time.perf_counter()
            result = await self._persist_locked(
                room_version, join, True, False, None, state_before, destinations, given_state_group=group
            )
            self._after_persist(join, result, "local", start)
        logger.info("[%s] join state stored: %d events and %d state entries in %.2fs, then the join in %.2fs",
                    join.room_id, len(rows), len(state_before), stored - start, time.perf_counter() - stored)
        return result

    async def complete_partial_state(
        self, room_version: RoomVersion, room_id: str, join_event_id: str, events: Sequence[FrozenEvent],
        rejected: Mapping[str, str], state: Mapping[StateKey, str],
    ) -> CompletedState:
        """Make a partial-state room's state whole (``complete_partial_state_txn``): ``events``
        (the full state before our join ``join_event_id`` and its auth chain, checked by the caller;
        ``rejected``: why, for those that failed) and ``state``, that state. Under the room lock,
        so no event of the room is persisted on the partial state meanwhile."""
        rows = [_bulk_row(e, rejected.get(e.event_id)) for e in events]
        memberships = {e.event_id: e.membership for e in events if e.type == C.MEMBER}
        async with self.room_lock(room_id):
            self._snapshots.pop(room_id, None)
            start = time.perf_counter()
            done = await self._stream_ids.run_interaction(
                "complete_partial_state", complete_partial_state_txn, room_id, join_event_id, rows,
                self._stream_ids.get_next_mult_txn, self._stream_ids.get_next_txn, instance_name=self._instance_name,
                state=state, memberships=memberships,
            )
            self._snapshots.pop(room_id, None)
        logger.info("[%s] full state stored: %d new events, %d state entries filled in (%d in current state) in %.2fs",
                    room_id, done.new_events, done.group_entries, done.current_entries, time.perf_counter() - start)
        return done

    async def persist_backfilled(
        self,
        room_version: RoomVersion,
        event: FrozenEvent,
        *,
        state_group_before: int,
        state_group_after: int,
        rejection_reason: str | None = None,
    ) -> PersistResult:
        """Persist history fetched with ``/backfill``, with the state groups the caller planned.

        The event gets a negative stream ordering from the backfill stream (so it sorts
        before the room's timeline) and leaves forward extremities and current state
        alone. Callers persist a batch newest first, so that older events sort earlier.
        """
        if self._backfill_ids is None:
            raise RuntimeError("this persister was built without the backfill stream")
        backfill_ids = self._backfill_ids
        request = self._request(
            room_version,
            event,
            is_local=False,
            rejection_reason=rejection_reason,
            state_before=state_group_before,
            state_after=state_group_after,
            backfilled=True,
        )

        def allocate(txn: Transaction) -> int:
            return -backfill_ids.get_next_txn(txn)

        start = time.perf_counter()
        result = await backfill_ids.run_interaction("persist_backfilled_event", persist_event_txn, request, allocate)
        self._loader.prime(event)
        self._after_persist(event, result, "remote", start)
        return result

    def _after_persist(self, event: FrozenEvent, result: PersistResult, origin: str, start: float) -> None:
        """Count a newly stored event and tell the listeners (an event already stored: nothing)."""
        if result.already_persisted:
            return
        self._persisted[origin].inc()
        self._metrics.duration.observe(time.perf_counter() - start)
        for listener in self._listeners:
            try:
                listener(event, result)
            except Exception:
                logger.exception("persisted-event listener %r failed for %s", listener, event.event_id)

    # --- state -----------------------------------------------------------------------------

    async def _group_before(self, room_version: RoomVersion, event: FrozenEvent, ctx: PersistContext) -> int | None:
        """The state group before the event, loading state only when its predecessors fork."""
        groups = ctx.prev_state_groups
        distinct = set(groups.values())
        if len(groups) == len(event.prev_event_ids) and len(distinct) == 1:
            return distinct.pop()
        group, _ = await self._state_before(room_version, event, ctx)
        return group

    async def _state_before(
        self, room_version: RoomVersion, event: FrozenEvent, ctx: PersistContext | None = None
    ) -> tuple[int | None, dict[StateKey, str]]:
        prevs = event.prev_event_ids
        if not prevs:
            return None, {}
        groups = ctx.prev_state_groups if ctx is not None else await self._store.get_state_groups_after(prevs)
        missing = [p for p in prevs if p not in groups]
        if missing:
            raise MissingEventsError(frozenset(missing), f"persisting {event.event_id}: prev_events not known")
        distinct = sorted(set(groups.values()))
        if len(distinct) == 1:
            return distinct[0], await self._store.get_state_for_group(distinct[0])
        state_sets = [await self._store.get_state_for_group(g) for g in distinct]
        resolved = await self._loader.resolve(room_version, state_sets)
        # Stored as a delta on the first predecessor's group, which is usually
        # small; resolution keeps every key of every input, so no key is removed.
        base = state_sets[0]
        delta = {k: v for k, v in resolved.items() if base.get(k) != v}
        group = await self._store.new_state_group(event.room_id, distinct[0], delta) if delta else distinct[0]
        return group, resolved

    async def _new_current_state(
        self,
        room_version: RoomVersion,
        event: FrozenEvent,
        state_after: Mapping[StateKey, str],
        other_extremities: set[str],
    ) -> Mapping[StateKey, str]:
        """Current state once ``event`` is an extremity beside ``other_extremities``."""
        if not other_extremities:
            return state_after
        # The room forks: current state is the resolution of every extremity's state.
        groups = await self._store.get_state_groups_after(other_extremities)
        state_sets: list[Mapping[StateKey, str]] = [state_after]
        for group in sorted(set(groups.values())):
            state_sets.append(await self._store.get_state_for_group(group))
        return await self._loader.resolve(room_version, state_sets, pending=event)

    def room_lock(self, room_id: str) -> _RoomLock:
        """Serialises the events of one room in this process: held around
        reading the room's extremities and state, building and persisting."""
        lock = self._room_locks.get(room_id)
        if lock is None:
            lock = self._room_locks[room_id] = _RoomLock(self._room_locks, room_id)
        return lock


def _written(event: FrozenEvent, fanout: bool, pushes: bool) -> WrittenEvent:
    """The note of a committed event (``storage/kernel/written_events.py``)."""
    return WrittenEvent(event.is_state(), fanout, pushes, event.room_id,
                        event.state_key if event.type == C.MEMBER else None)


def _bulk_row(event: FrozenEvent, rejection_reason: str | None) -> BulkEventRow:
    """``event`` as the bulk store takes it."""
    return BulkEventRow(
        event_id=event.event_id, room_id=event.room_id, type=event.type, state_key=event.state_key,
        sender=event.sender, depth=event.depth, origin_server_ts=event.origin_server_ts,
        json=encode_compact(event.pdu), prev_event_ids=event.prev_event_ids, auth_event_ids=event.auth_event_ids,
        rejection_reason=rejection_reason, membership=event.membership if event.type == C.MEMBER else None,
    )


class _SharedRoomReads:
    """One push-rules read of the room for a run of a batch's events that change no state: a
    state event's read is its own, and the event after it reads the room again (as it then is).
    Keyed by the transaction too, so a retried transaction reads afresh."""

    def __init__(self) -> None:
        self._txn: Transaction | None = None  # held, so an identity check cannot match a new one
        self._key: tuple[str, str, tuple[str, ...]] | None = None
        self._row: PushContextRow | None = None

    def reader(self, event: FrozenEvent) -> PushContextReader:
        changes_state = event.state_key is not None

        def read(txn: Transaction, room_id: str, server_name: str, extra: Collection[str]) -> PushContextRow:
            key = (room_id, server_name, tuple(sorted(extra)))
            row = self._row
            if row is None or txn is not self._txn or key != self._key:
                row = get_push_context_txn(txn, room_id, server_name, extra)
            if changes_state:
                self._txn, self._key, self._row = None, None, None
            else:
                self._txn, self._key, self._row = txn, key, row
            return row

        return read


class _KeptPushRead:
    """The push context one local send evaluates on: ``kept``, the copy the room's snapshot
    holds (no read), or else the room read in the send's transaction. ``row``: the one the
    send evaluated on, for the snapshot to keep after it."""

    def __init__(self, kept: PushContextRow | None) -> None:
        self.kept = kept
        self.row: PushContextRow | None = None

    def read(self, txn: Transaction, room_id: str, server_name: str, extra: Collection[str]) -> PushContextRow:
        if self.kept is not None and not extra:
            row = self.kept
        else:
            row = get_push_context_txn(txn, room_id, server_name, extra)
        self.row = row
        return row

    def to_keep(self, event: FrozenEvent) -> PushContextRow | None:
        """What the room's snapshot keeps after ``event``: nothing after a state event (its
        members or levels may have changed) or for a room with many local members."""
        row = self.row
        if event.state_key is not None or row is None or len(row.recipients) > MAX_KEPT_PUSH_RECIPIENTS:
            return None
        return row


class _RoomLock:
    """A FIFO lock per room that removes itself from its table when idle."""

    def __init__(self, table: dict[str, _RoomLock], room_id: str) -> None:
        self._table = table
        self._room_id = room_id
        self._locked = False
        self._waiters: list[Deferred[None]] = []

    async def __aenter__(self) -> None:
        if self._locked:
            waiter: Deferred[None] = Deferred()
            self._waiters.append(waiter)
            await waiter
        self._locked = True

    async def __aexit__(self, *exc: object) -> None:
        if self._waiters:
            self._waiters.pop(0).callback(None)  # ownership passes straight to the next waiter
            return
        self._locked = False
        if self._table.get(self._room_id) is self:
            del self._table[self._room_id]

