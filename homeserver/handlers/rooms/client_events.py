"""Events as clients see them: the client event format, redaction on read, history visibility.

``ClientEvents`` turns ``FrozenEvent``s into client-format dicts (pruned, with
``unsigned.redacted_because``, when a redaction of them exists that the room
version lets apply: same room, and the redacter on the original sender's server
or holding the ``redact`` level in the redaction's auth state; checked at every
read, so a redaction that came before its target applies once the target is
here, and one that may not apply never does); with
``unsigned.transaction_id`` for the requesting device's own sends) and filters
lists of events down to what a user may see under the history-visibility
rules. It reads state through the events store; it does not know HTTP.
"""

# tests: tests/integration/test_client_rooms.py, tests/integration/test_client_ephemeral.py, tests/integration/test_client_erasure.py

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any

from homeserver.events import (
    FrozenEvent, InvalidEvent, can_apply_redaction, can_see_event, make_event, prune_event_dict,
)
from homeserver.events import constants as C
from homeserver.events.auth import auth_state_from_auth_events
from homeserver.events.canonical import thaw
from homeserver.events.hashing import create_event_id_from_room_id
from homeserver.events.identifiers import server_name_of
from homeserver.handlers.rooms.aggregations import Aggregator, Bundle
from homeserver.handlers.rooms.event_loader import EventLoader
from storage.stores.events import EventsStore, StateKey
from storage.stores.timeline import TimelineStore

# MSC2228 (self-destructing events): a content key holding the time (ms since the epoch) after
# which the event is served pruned, as though redacted, to everyone.
SELF_DESTRUCT_AFTER = "org.matrix.self_destruct_after"


def has_expired(event: FrozenEvent, now_ms: int) -> bool:
    """Whether the event's MSC2228 expiry time (an integer) has passed."""
    after = event.content.get(SELF_DESTRUCT_AFTER)
    return isinstance(after, int) and not isinstance(after, bool) and after <= now_ms


def format_event(
    event: FrozenEvent,
    now_ms: int,
    *,
    redacted_because: dict[str, Any] | None = None,
    txn_id: str | None = None,
    include_room_id: bool = True,
    federation: bool = False,
    expired: bool = False,
) -> dict[str, Any]:
    """One event in the client-server format, or with ``federation`` (a filter's
    ``event_format: federation``) the PDU itself (pruned when redacted) with its ``event_id``
    and the same ``unsigned`` as the client format, as Synapse. ``expired`` (MSC2228) prunes
    it as a redaction would, without a ``redacted_because``."""
    pruned = redacted_because is not None or expired
    pdu: Any = prune_event_dict(event.room_version, event.pdu) if pruned else event.pdu
    out: dict[str, Any]
    if federation:
        out = {**thaw(pdu), "event_id": event.event_id}
    else:
        out = {
            "event_id": event.event_id,
            "type": event.type,
            "content": thaw(pdu.get("content", {})),
            "sender": event.sender,
            "origin_server_ts": event.origin_server_ts,
        }
        if include_room_id:
            out["room_id"] = event.room_id
        if event.state_key is not None:
            out["state_key"] = event.state_key
        if event.type == C.REDACTION and event.redacts is not None:
            out["redacts"] = event.redacts
    unsigned: dict[str, Any] = {"age": max(0, now_ms - event.origin_server_ts)}
    if redacted_because is not None:
        unsigned["redacted_because"] = redacted_because
    if txn_id is not None:
        unsigned["transaction_id"] = txn_id
    out["unsigned"] = unsigned
    return out


def _format_bundle(bundle: Bundle, now_ms: int, include_room_id: bool) -> dict[str, Any]:
    """``unsigned.m.relations`` of one event (spec: "Server-side aggregation of child events")."""
    out: dict[str, Any] = {}
    if bundle.edit is not None:
        out["m.replace"] = format_event(bundle.edit, now_ms, include_room_id=include_room_id)
    if bundle.thread is not None:
        out["m.thread"] = {
            "latest_event": format_event(bundle.thread.latest, now_ms, include_room_id=include_room_id),
            "count": bundle.thread.count,
            "current_user_participated": bundle.thread.participated,
        }
    if bundle.references:
        out["m.reference"] = {"chunk": [{"event_id": event_id} for event_id in bundle.references]}
    return out


def strip_event(event: FrozenEvent) -> dict[str, Any]:
    """The stripped state form used in ``invite_state``."""
    return {
        "type": event.type,
        "state_key": event.state_key,
        "content": thaw(event.content),
        "sender": event.sender,
    }


class ClientEvents:
    def __init__(
        self,
        *,
        loader: EventLoader,
        events_store: EventsStore,
        timeline: TimelineStore,
        clock_ms: Callable[[], int],
        erased_users: Callable[[Collection[str]], Awaitable[set[str]]] | None = None,
        aggregator: Aggregator | None = None,
    ) -> None:
        # Bundles relations into ``unsigned.m.relations`` (None: served without them).
        self._aggregator = aggregator
        # Which of some users deactivated with ``erase: true`` (None: no account store here).
        self._erased_users = erased_users
        self._loader = loader
        self._events_store = events_store
        self._timeline = timeline
        self._clock_ms = clock_ms

    async def load(self, event_ids: Sequence[str]) -> list[FrozenEvent]:
        """The events we have, in the order given."""
        loaded = await self._loader.load_events(event_ids)
        return [loaded[event_id] for event_id in event_ids if event_id in loaded]

    async def serialize(
        self,
        events: Sequence[FrozenEvent],
        *,
        access_token_id: int | None = None,
        include_room_id: bool = True,
        federation: bool = False,
        bundle_for: str | None = None,
    ) -> list[dict[str, Any]]:
        """The client format of ``events``. With ``bundle_for`` (the requesting user), each
        event carries its aggregations (``unsigned.m.relations``) as that user may see them."""
        if not events:
            return []
        now = self._clock_ms()
        ids = [event.event_id for event in events]
        redactions, txn_ids = await self._timeline.get_redactions_and_txn_ids(ids, access_token_id)
        redaction_events = await self._loader.load_events(
            {rid for rids in redactions.values() for rid in rids}
        )
        out = []
        redacted: set[str] = set()
        for event in events:
            because: dict[str, Any] | None = None
            for redaction_id in redactions.get(event.event_id, ()):
                redaction = redaction_events.get(redaction_id)
                if redaction is not None and await self._redaction_applies(redaction, event):
                    because = format_event(redaction, now, include_room_id=include_room_id)
                    redacted.add(event.event_id)
                    break
            out.append(
                format_event(
                    event,
                    now,
                    redacted_because=because,
                    txn_id=txn_ids.get(event.event_id),
                    include_room_id=include_room_id,
                    federation=federation,
                    expired=has_expired(event, now),
                )
            )
        if bundle_for is not None and self._aggregator is not None:
            user_id = bundle_for

            async def visible(children: Collection[FrozenEvent]) -> list[FrozenEvent]:
                return await self.filter_visible(user_id, children, joined_now=True)

            bundles = await self._aggregator.bundle(events, user_id, visible, redacted=redacted)
            for event, served in zip(events, out):
                bundle = bundles.get(event.event_id)
                if bundle is not None:
                    served["unsigned"]["m.relations"] = _format_bundle(bundle, now, include_room_id)
        return out

    async def _redaction_applies(self, redaction: FrozenEvent, original: FrozenEvent) -> bool:
        """"Handling redactions": the power level is read only for a redacter of another server
        (rare), from the redaction's own auth events (plus the create event, which v12 leaves out)."""
        if redaction.room_id != original.room_id:
            return False
        if server_name_of(redaction.sender) == server_name_of(original.sender):
            return True
        wanted = set(redaction.auth_event_ids)
        if not redaction.room_version.create_event_in_auth_events:
            wanted.add(create_event_id_from_room_id(redaction.room_id))
        loaded = await self._loader.load_events(wanted)
        state = auth_state_from_auth_events(
            redaction.room_version, (e for e in loaded.values() if e.room_id == redaction.room_id)
        )
        return can_apply_redaction(redaction.room_version, redaction, original, state)

    async def state_after(self, event_id: str) -> dict[StateKey, str]:
        groups = await self._events_store.get_state_groups_after([event_id])
        group = groups.get(event_id)
        return {} if group is None else await self._events_store.get_state_for_group(group)

    async def state_before(self, event_id: str) -> dict[StateKey, str]:
        groups = await self._events_store.get_state_groups_before([event_id])
        group = groups.get(event_id)
        return {} if group is None else await self._events_store.get_state_for_group(group)

    async def filter_visible(
        self, user_id: str, events: Collection[FrozenEvent], *, joined_now: bool
    ) -> list[FrozenEvent]:
        """The events ``user_id`` may see under the history-visibility rules, order kept. An event
        of an erased user (deactivated with ``erase: true``) that ``user_id`` sees without having
        been joined when it was sent comes pruned, as though redacted (the spec's erasure:
        "users which join the room after the erasure request are served redacted copies")."""
        if not events:
            return []
        groups = await self._events_store.get_state_groups_before([e.event_id for e in events])
        group_state: dict[int, dict[StateKey, FrozenEvent]] = {}
        for group in set(groups.values()):
            ids = await self._events_store.get_state_for_group(group)
            wanted = {
                key: event_id
                for key, event_id in ids.items()
                if key == (C.HISTORY_VISIBILITY, "") or key == (C.MEMBER, user_id)
            }
            loaded = await self._loader.load_events(set(wanted.values()))
            group_state[group] = {key: loaded[eid] for key, eid in wanted.items() if eid in loaded}
        visible = []
        not_member_at: set[str] = set()  # events the user sees without having been joined then
        for event in events:
            event_group = groups.get(event.event_id)
            if event_group is None:
                continue
            state = group_state[event_group]
            if can_see_event(user_id, event, state, joined_after_event=joined_now):
                visible.append(event)
                member = state.get((C.MEMBER, user_id))
                if (member is None or member.membership != C.JOIN) and event.sender != user_id:
                    not_member_at.add(event.event_id)
        if not not_member_at or self._erased_users is None:
            return visible
        erased = await self._erased_users({e.sender for e in visible if e.event_id in not_member_at})
        if not erased:
            return visible
        served: list[FrozenEvent] = []
        for event in visible:
            if event.event_id in not_member_at and event.sender in erased:
                try:
                    event = make_event(
                        event.room_version, prune_event_dict(event.room_version, event.pdu),
                        trusted_event_id=event.event_id,
                    )
                except InvalidEvent:
                    continue  # cannot be served pruned: not served at all
            served.append(event)
        return served
