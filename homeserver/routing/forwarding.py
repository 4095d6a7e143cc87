"""Writes go to the process that owns them: room events to the room's event persister,
ephemeral and account data to their stream's writer.

One mechanism serves every write that a process may be asked for but does not
own: an operation registered on the owner's internal API
(``homeserver.routing.internal_api``) and, on every other process, a stand-in that calls
it. The owner runs the very same handler code a single process runs, so the
rules (auth, rate limits, idempotency) do not depend on which process a client
reached.

- Room events. ``ShardedRoomEventCreator.send`` builds, signs and persists an
  event on the room's owner (``Layout.events_writer_for_room``), under that
  process's room lock, so a room's events never fork. ``RoutedPersister``
  hands an already-built event (a remote PDU from federation, a room's create
  event, backfilled history) to the owner to persist. ``create_room`` needs
  nothing of its own: it persists the create event and sends the rest through
  these two.
- Stream writes (typing, receipts, presence, to-device, account data, remote
  users' EDUs) are not here: ``writers.py`` has a local and a remote
  implementation of each, chosen once by the composition root.
"""

# tests: tests/integration/test_workers.py

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from homeserver.events import EventTemplate, FrozenEvent, RoomVersion, get_room_version, make_event
from homeserver.events.canonical import thaw
from homeserver.handlers.rooms.event_persistence import EventPersister, RemoteBatchEvent
from homeserver.handlers.rooms.room_events import MembershipPrecondition, RoomEventCreator, RoomNotFound
from homeserver.handlers.rooms.rooms import send_error
from storage.kernel.errors import MatrixError, bad_json
from homeserver.events.errors import EventsError
from storage.stores.events import DuplicateTxnId, PersistResult, SendTxn, StateKey
from storage.stores.partial_state import CompletedState
from homeserver.routing.internal_api import InternalApiClient, InternalApiServer
from homeserver.routing.layout import Layout

logger = logging.getLogger(__name__)

# The largest ``persist_join`` body the events writer takes: a joined room's whole state and
# auth chain (tens of MB for 50,000 members), so the internal listener allows it on that path.
MAX_INTERNAL_JOIN_BYTES: Final = 512 * 1024 * 1024


# --- events on the wire ---------------------------------------------------------------------


def event_to_json(event: FrozenEvent) -> dict[str, Any]:
    return {"room_version": event.room_version.identifier, "event_id": event.event_id, "pdu": thaw(event.pdu)}


def event_from_json(data: Mapping[str, Any]) -> tuple[RoomVersion, FrozenEvent]:
    """An event another process of this server built or verified (trusted: the secret authenticated it)."""
    room_version = get_room_version(str(data["room_version"]))
    return room_version, make_event(room_version, data["pdu"], trusted_event_id=str(data["event_id"]))


def _result_to_json(result: PersistResult) -> dict[str, Any]:
    return {
        "stream_ordering": result.stream_ordering,
        "state_group_after": result.state_group_after,
        "already_persisted": result.already_persisted,
        "destinations": sorted(result.destinations),
    }


def _result_from_json(data: Mapping[str, Any]) -> PersistResult:
    return PersistResult(
        stream_ordering=int(data["stream_ordering"]),
        state_group_after=data["state_group_after"],
        already_persisted=bool(data["already_persisted"]),
        destinations=frozenset(data["destinations"]),
    )


def _send_error(error: Exception, room_id: str) -> MatrixError:
    """What ``RoomHandler`` would have answered had the send failed in this process; an unknown
    room is flagged so the caller raises ``RoomNotFound``, as a local send would."""
    answer = send_error(error, room_id)
    if isinstance(error, RoomNotFound):
        answer.extra["tributary_room_not_found"] = True
    return answer


# --- room events ----------------------------------------------------------------------------


class RoutedPersister(EventPersister):
    """An ``EventPersister`` that persists the rooms this process owns and hands every other
    room's events to its owner; everything else (reads, listeners) is the persister's own."""

    def __init__(self, *, layout: Layout, client: InternalApiClient, **persister_options: Any) -> None:
        super().__init__(**persister_options)
        self._layout = layout
        self._client = client

    async def persist(self, room_version: RoomVersion, event: FrozenEvent, **options: Any) -> PersistResult:
        owner = self._layout.events_writer_for_room(event.room_id)
        if owner == self._layout.instance_name:
            return await super().persist(room_version, event, **options)
        body = {"event": event_to_json(event), "options": _options_to_json(options)}
        result = _result_from_json(await self._client.call(owner, "persist_event", body))
        self._loader.prime(event)
        return result

    async def persist_join(self, room_version: RoomVersion, join: FrozenEvent, events: Sequence[FrozenEvent],
                           rejected: Mapping[str, str], state_before: Mapping[StateKey, str],
                           destinations: frozenset[str], partial_servers: Sequence[str] | None = None) -> PersistResult:
        owner = self._layout.events_writer_for_room(join.room_id)
        if owner == self._layout.instance_name:
            return await super().persist_join(room_version, join, events, rejected, state_before, destinations,
                                              partial_servers)
        body = {
            "join": event_to_json(join), "events": [event_to_json(e) for e in events], "rejected": dict(rejected),
            "state_before": [[t, k, e] for (t, k), e in state_before.items()], "destinations": sorted(destinations),
            "partial_servers": None if partial_servers is None else list(partial_servers),
        }
        result = _result_from_json(await self._client.call(owner, "persist_join", body))
        self._loader.prime(join)
        return result

    async def complete_partial_state(
        self, room_version: RoomVersion, room_id: str, join_event_id: str, events: Sequence[FrozenEvent],
        rejected: Mapping[str, str], state: Mapping[StateKey, str],
    ) -> CompletedState:
        owner = self._layout.events_writer_for_room(room_id)
        if owner == self._layout.instance_name:
            return await super().complete_partial_state(room_version, room_id, join_event_id, events, rejected, state)
        body = {
            "room_version": room_version.identifier, "room_id": room_id, "join_event_id": join_event_id,
            "events": [event_to_json(e) for e in events], "rejected": dict(rejected),
            "state": [[t, k, e] for (t, k), e in state.items()],
        }
        answer = await self._client.call(owner, "complete_partial_state", body)
        return CompletedState(int(answer["new_events"]), int(answer["group_entries"]), int(answer["current_entries"]),
                              None if answer["position"] is None else int(answer["position"]))

    async def persist_remote_batch(
        self, room_version: RoomVersion, batch: Sequence[RemoteBatchEvent]
    ) -> list[PersistResult]:
        """A batch of received events: in one transaction here when this process owns the room;
        otherwise handed to the owner one by one, in order, each with its verdict (rejected,
        soft-failed), and the owner works out each one's state under its own room lock, as it
        does for a PDU persisted on its own (the plan made here, without that lock, is not used)."""
        if not batch:
            return []
        owner = self._layout.events_writer_for_room(batch[0].event.room_id)
        if owner == self._layout.instance_name:
            return await super().persist_remote_batch(room_version, batch)
        results = []
        for b in batch:
            results.append(await self.persist(room_version, b.event, is_local=False,
                                              rejection_reason=b.rejection_reason, soft_failed=b.soft_failed))
        return results

    async def persist_backfilled(self, room_version: RoomVersion, event: FrozenEvent, **options: Any) -> PersistResult:
        owner = self._layout.events_writer_for_room(event.room_id)
        if owner == self._layout.instance_name:
            return await super().persist_backfilled(room_version, event, **options)
        body = {"event": event_to_json(event), "options": options}
        result = _result_from_json(await self._client.call(owner, "persist_backfilled", body))
        self._loader.prime(event)
        return result


def _options_to_json(options: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(options)
    if out.get("destinations") is not None:
        out["destinations"] = sorted(out["destinations"])
    if out.get("state_before") is not None:
        out["state_before"] = [[t, k, e] for (t, k), e in out["state_before"].items()]
    return out


def _options_from_json(options: Mapping[str, Any]) -> dict[str, Any]:
    allowed = {"is_local", "outlier", "rejection_reason", "state_before", "destinations", "soft_failed"}
    unknown = set(options) - allowed
    if unknown:
        raise bad_json(f"unknown persist options {sorted(unknown)}")
    out = dict(options)
    if out.get("destinations") is not None:
        out["destinations"] = frozenset(out["destinations"])
    if out.get("state_before") is not None:
        # JSON has no tuple keys: [[type, state_key, event_id], ...]
        out["state_before"] = {(t, k): e for t, k, e in out["state_before"]}
    return out


class ShardedRoomEventCreator(RoomEventCreator):
    """``RoomEventCreator`` whose ``send`` runs on the room's event persister."""

    def __init__(self, *, layout: Layout, client: InternalApiClient, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._layout = layout
        self._client = client

    async def _send(
        self,
        room_id: str,
        template: EventTemplate,
        sender: str,
        txn: SendTxn | None,
        precheck: MembershipPrecondition | None,
    ) -> FrozenEvent:
        # Every send (``send``, ``send_idempotent``, room creation) comes through here.
        owner = self._layout.events_writer_for_room(room_id)
        if owner == self._layout.instance_name:
            return await super()._send(room_id, template, sender, txn, precheck)
        body = {"room_id": room_id, "sender": sender, "template": _template_to_json(template),
                "txn": None if txn is None else attrs.asdict(txn),
                "precheck": None if precheck is None else precheck.to_json()}
        try:
            answer = await self._client.call(owner, "send_event", body)
        except MatrixError as e:
            if e.extra.pop("tributary_room_not_found", False):
                raise RoomNotFound(room_id) from None
            if e.extra.pop("tributary_duplicate_txn", False) and txn is not None:
                raise DuplicateTxnId(txn.access_token_id, txn.txn_id) from None
            raise
        _, event = event_from_json(answer["event"])
        self._loader.prime(event)
        return event

    async def send_here(
        self,
        room_id: str,
        template: EventTemplate,
        sender: str,
        txn: SendTxn | None,
        precheck: MembershipPrecondition | None,
    ) -> FrozenEvent:
        """A send in this process, which owns the room (the internal API's ``send_event``)."""
        return await super()._send(room_id, template, sender, txn, precheck)


def _template_to_json(template: EventTemplate) -> dict[str, Any]:
    return {
        "type": template.type,
        "content": thaw(template.content),
        "state_key": template.state_key,
        "redacts": template.redacts,
        "origin_server_ts": template.origin_server_ts,
    }


class EventOperations:
    """The operations an events writer performs for the rooms it owns, for other processes."""

    NAMES: Final = ("send_event", "persist_join", "complete_partial_state", "persist_event", "persist_backfilled")

    def __init__(self, layout: Layout, creator: ShardedRoomEventCreator, persister: EventPersister) -> None:
        self._layout = layout
        self._creator = creator
        self._persister = persister

    def _check_owner(self, room_id: str) -> None:
        owner = self._layout.events_writer_for_room(room_id)
        if owner != self._layout.instance_name:
            # Two processes disagree on the room mapping: their stream_writers.events differ.
            raise MatrixError(409, "M_UNKNOWN", f"{room_id} belongs to {owner}, not {self._layout.instance_name}: "
                                                "do all processes have the same stream_writers.events?")

    async def send_event(self, body: dict[str, Any]) -> dict[str, Any]:
        room_id = str(body["room_id"])
        self._check_owner(room_id)
        raw = body["template"]
        try:
            ts = raw.get("origin_server_ts")
            template = EventTemplate(type=raw["type"], content=raw["content"], state_key=raw.get("state_key"),
                                     redacts=raw.get("redacts"), origin_server_ts=ts if isinstance(ts, int) else None)
            txn = None if body.get("txn") is None else SendTxn(**body["txn"])
            raw_check = body.get("precheck")
            precheck = None if raw_check is None else MembershipPrecondition.from_json(raw_check)
            event = await self._creator.send_here(room_id, template, str(body["sender"]), txn, precheck)
        except DuplicateTxnId as e:
            raise MatrixError(409, "M_UNKNOWN", str(e), tributary_duplicate_txn=True) from None
        except (RoomNotFound, EventsError, TypeError, ValueError) as e:
            raise _send_error(e, room_id) from None
        return {"event": event_to_json(event)}

    async def persist_event(self, body: dict[str, Any]) -> dict[str, Any]:
        room_version, event = event_from_json(body["event"])
        self._check_owner(event.room_id)
        result = await self._persister.persist(room_version, event, **_options_from_json(body.get("options", {})))
        return _result_to_json(result)

    async def persist_backfilled(self, body: dict[str, Any]) -> dict[str, Any]:
        room_version, event = event_from_json(body["event"])
        self._check_owner(event.room_id)
        options = body.get("options", {})
        result = await self._persister.persist_backfilled(
            room_version, event, state_group_before=int(options["state_group_before"]),
            state_group_after=int(options["state_group_after"]), rejection_reason=options.get("rejection_reason"),
        )
        return _result_to_json(result)

    async def persist_join(self, body: dict[str, Any]) -> dict[str, Any]:
        room_version, join = event_from_json(body["join"])
        self._check_owner(join.room_id)
        events = [event_from_json(e)[1] for e in body["events"]]
        state = {(t, k): e for t, k, e in body["state_before"]}
        partial = body.get("partial_servers")
        result = await self._persister.persist_join(room_version, join, events, body["rejected"], state,
                                              frozenset(body["destinations"]),
                                              None if partial is None else [str(s) for s in partial])
        return _result_to_json(result)

    async def complete_partial_state(self, body: dict[str, Any]) -> dict[str, Any]:
        room_id = str(body["room_id"])
        self._check_owner(room_id)
        events = [event_from_json(e)[1] for e in body["events"]]
        state = {(t, k): e for t, k, e in body["state"]}
        done = await self._persister.complete_partial_state(get_room_version(str(body["room_version"])), room_id,
                                                      str(body["join_event_id"]), events, body["rejected"], state)
        return {"new_events": done.new_events, "group_entries": done.group_entries,
                "current_entries": done.current_entries, "position": done.position}


def register_event_operations(
    server: InternalApiServer, layout: Layout, creator: ShardedRoomEventCreator, persister: EventPersister
) -> None:
    """The operations an events writer performs for the rooms it owns."""
    operations = EventOperations(layout, creator, persister)
    for name in EventOperations.NAMES:
        server.register(name, getattr(operations, name))
