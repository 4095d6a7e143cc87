"""``/sync``: what changed for a user since a ``StreamToken``, long-polling on the notifier.

A response covers the events stream up to one snapshot position: every
timeline event with ``since < stream_ordering <= upto`` appears once (unless
the timeline limit cuts it, in which case ``limited`` is set and ``prev_batch``
points before the first event returned). ``next_batch`` is the snapshot. Waiting
is one notifier waiter (no polling); a wake-up that turns out to be irrelevant
to this user waits again until the timeout.
"""

# tests: tests/integration/test_client_sync.py

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs
from prometheus_client import CollectorRegistry

from homeserver.events import FrozenEvent
from homeserver.events import constants as C
from homeserver.handlers.auth import Requester
from homeserver.handlers.client_events import ClientEvents, strip_event
from homeserver.handlers.e2e import E2eHandler
from homeserver.handlers.metrics import SyncMetrics
from homeserver.handlers.messages import EventFilter, parse_event_filter, room_token
from homeserver.handlers.presence import PresenceHandler
from homeserver.handlers.receipts import ReceiptsHandler
from homeserver.handlers.typing import TypingHandler
from storage.id_generators import StreamIdGenerator
from storage.notifier import Notifier
from storage.stores.account_data import AccountDataStore
from storage.stores.events import EventsStore, StateKey
from storage.stores.timeline import TimelineStore
from storage.streams import StreamName
from storage.tokens import MultiWriterStreamToken, RoomStreamToken, StreamToken, SyncStreamKey

DEFAULT_TIMELINE_LIMIT = 10
MAX_TIMELINE_LIMIT = 1000
MAX_TIMEOUT_S = 300.0
INVITE_STATE_TYPES = (
    C.CREATE,
    C.JOIN_RULES,
    C.NAME,
    C.CANONICAL_ALIAS,
    "m.room.avatar",
    "m.room.encryption",
    "m.room.topic",
)


@attrs.frozen
class SyncFilter:
    timeline: EventFilter = EventFilter()
    state: EventFilter = EventFilter()
    timeline_limit: int = DEFAULT_TIMELINE_LIMIT

    @classmethod
    def parse(cls, value: Mapping[str, Any] | None) -> SyncFilter:
        if value is None:
            return cls()
        room = value.get("room") or {}
        if not isinstance(room, Mapping):
            room = {}
        timeline = parse_event_filter(room.get("timeline"))
        state = parse_event_filter(room.get("state"))
        limit = timeline.limit if timeline.limit is not None else DEFAULT_TIMELINE_LIMIT
        return cls(timeline=timeline, state=state, timeline_limit=max(1, min(limit, MAX_TIMELINE_LIMIT)))


def _stream_position(token: StreamToken, key: SyncStreamKey) -> int:
    return token.get(key).max_position


class SyncHandler:
    def __init__(
        self,
        *,
        streams: Mapping[StreamName, StreamIdGenerator],
        notifier: Notifier,
        clock: Any,
        events_store: EventsStore,
        timeline: TimelineStore,
        client_events: ClientEvents,
        account_data: AccountDataStore,
        typing: TypingHandler,
        receipts: ReceiptsHandler,
        e2e: E2eHandler,
        metrics: SyncMetrics | None = None,
        presence: PresenceHandler | None = None,
    ) -> None:
        self._presence = presence
        self._e2e = e2e
        self._metrics = metrics if metrics is not None else SyncMetrics.create(CollectorRegistry())
        self._streams = streams
        self._notifier = notifier
        self._clock = clock
        self._events_store = events_store
        self._timeline = timeline
        self._client_events = client_events
        self._account_data = account_data
        self._typing = typing
        self._receipts = receipts

    def current_token(self) -> StreamToken:
        def pos(name: StreamName) -> MultiWriterStreamToken:
            return MultiWriterStreamToken.at(self._streams[name].get_current_token())

        return StreamToken(
            RoomStreamToken.at(self._streams[StreamName.EVENTS].get_current_token()),
            typing=pos(StreamName.TYPING),
            receipts=pos(StreamName.RECEIPTS),
            presence=pos(StreamName.PRESENCE),
            to_device=pos(StreamName.TO_DEVICE),
            account_data=pos(StreamName.ACCOUNT_DATA),
            device_lists=pos(StreamName.DEVICE_LISTS),
        )

    async def wait_for_sync(
        self,
        requester: Requester,
        since: StreamToken | None,
        *,
        timeout_ms: int,
        full_state: bool,
        sync_filter: SyncFilter,
    ) -> dict[str, Any]:
        if since is None or full_state or timeout_ms <= 0:
            return await self.sync(requester, since, full_state=full_state, sync_filter=sync_filter)
        deadline = self._clock.seconds() + min(timeout_ms / 1000.0, MAX_TIMEOUT_S)
        woken_at: float | None = None
        while True:
            result = await self.sync(requester, since, full_state=False, sync_filter=sync_filter)
            remaining = deadline - self._clock.seconds()
            if _has_changes(result) and woken_at is not None:
                self._metrics.wake_latency.observe(self._clock.seconds() - woken_at)
            if _has_changes(result) or remaining <= 0:
                return result
            self._metrics.long_polls.inc()
            try:
                woken = await self._notifier.wait_for_sync_token(
                    StreamToken.parse(result["next_batch"]), self.current_token, remaining
                )
            finally:
                self._metrics.long_polls.dec()
            # The notifier fires its waiters synchronously from the position
            # change, so now is when the stream advanced.
            woken_at = self._clock.seconds() if woken else None
            if self._clock.seconds() >= deadline:
                return await self.sync(requester, since, full_state=False, sync_filter=sync_filter)

    async def sync(
        self, requester: Requester, since: StreamToken | None, *, full_state: bool, sync_filter: SyncFilter
    ) -> dict[str, Any]:
        kind = "initial" if since is None or full_state else "incremental"
        with self._metrics.duration.labels(kind).time():
            return await self._sync(requester, since, full_state=full_state, sync_filter=sync_filter)

    async def _sync(
        self, requester: Requester, since: StreamToken | None, *, full_state: bool, sync_filter: SyncFilter
    ) -> dict[str, Any]:
        user_id = requester.user_id
        now = self.current_token()
        upto = _stream_position(now, SyncStreamKey.EVENTS)
        since_pos = _stream_position(since, SyncStreamKey.EVENTS) if since is not None else 0
        rooms_at = await self._timeline.get_rooms_for_user_at(user_id)
        rooms = {r: (m, eid) for r, (m, eid, _) in rooms_at.items()}
        # A membership that changed after the snapshot (a race with this request) makes
        # the room "full": its timeline is then visibility-filtered, never assumed visible.
        late = {r for r, (_, _, so) in rooms_at.items() if so > upto}
        forgotten = await self._timeline.get_forgotten_rooms(user_id)
        changes = await self._timeline.get_membership_changes(user_id, since_pos, upto) if since is not None else []
        changed_rooms = {row.room_id for row in changes}
        newly_joined = {row.room_id for row in changes if row.membership == C.JOIN}

        join: dict[str, Any] = {}
        invite: dict[str, Any] = {}
        leave: dict[str, Any] = {}
        joined_ids = [r for r, (m, _) in rooms.items() if m == C.JOIN]
        full_rooms = set(joined_ids) if (since is None or full_state) else ((newly_joined | late) & set(joined_ids))
        incremental_rooms = [r for r in joined_ids if r not in full_rooms]
        limit = sync_filter.timeline_limit
        recent = await self._timeline.get_recent_events_for_rooms(sorted(full_rooms), after=0, upto=upto, limit=limit + 1)
        if incremental_rooms:
            recent.update(
                await self._timeline.get_recent_events_for_rooms(
                    incremental_rooms, after=since_pos, upto=upto, limit=limit + 1
                )
            )

        typing_since = _stream_position(since, SyncStreamKey.TYPING) if since is not None else 0
        typing = self._typing.changed_rooms(joined_ids, typing_since)
        receipts_since = _stream_position(since, SyncStreamKey.RECEIPTS) if since is not None else 0
        receipts = await self._receipts.ephemeral_for(
            user_id, joined_ids, receipts_since, _stream_position(now, SyncStreamKey.RECEIPTS)
        )
        ad_since = _stream_position(since, SyncStreamKey.ACCOUNT_DATA) if since is not None else None
        account_data = await self._account_data.get_for_user(
            user_id, after=ad_since, upto=_stream_position(now, SyncStreamKey.ACCOUNT_DATA)
        )

        to_device = await self._e2e.to_device_for(
            requester,
            _stream_position(since, SyncStreamKey.TO_DEVICE) if since is not None else 0,
            _stream_position(now, SyncStreamKey.TO_DEVICE),
        )

        presence: list[Any] = []
        if self._presence is not None:
            presence = await self._presence.presence_for_sync(
                user_id,
                _stream_position(since, SyncStreamKey.PRESENCE) if since is not None else 0,
                _stream_position(now, SyncStreamKey.PRESENCE),
            )
        devices_changed: list[str] = []
        if since is not None:
            devices_changed = await self._e2e.device_list_changes(
                user_id,
                _stream_position(since, SyncStreamKey.DEVICE_LISTS),
                _stream_position(now, SyncStreamKey.DEVICE_LISTS),
            )

        for room_id in joined_ids:
            rows = recent.get(room_id, [])
            full = room_id in full_rooms
            ephemeral: list[Any] = []
            if room_id in typing:
                ephemeral.append({"type": "m.typing", "content": {"user_ids": typing[room_id]}})
            if room_id in receipts:
                ephemeral.append(receipts[room_id])
            room_ad = account_data.rooms.get(room_id, {})
            if not (full or rows or ephemeral or room_ad):
                continue
            section = await self._room_section(
                requester, room_id, rows, limit=limit, full=full, sync_filter=sync_filter, upto=upto
            )
            section["ephemeral"] = {"events": ephemeral}
            section["account_data"] = {
                "events": [{"type": t, "content": json.loads(c)} for t, c in sorted(room_ad.items())]
            }
            section["unread_notifications"] = {"highlight_count": 0, "notification_count": 0}
            section["summary"] = {}
            join[room_id] = section

        for room_id, (membership, event_id) in rooms.items():
            if membership == C.INVITE and (since is None or room_id in changed_rooms):
                invite[room_id] = {"invite_state": {"events": await self._invite_state(room_id, event_id)}}
            elif (
                membership in (C.LEAVE, C.BAN)
                and since is not None
                and room_id in changed_rooms
                and room_id not in forgotten
            ):
                leave[room_id] = await self._leave_section(requester, room_id, event_id, since_pos, limit)

        return {
            "next_batch": now.to_string(),
            "rooms": {"join": join, "invite": invite, "leave": leave, "knock": {}},
            "account_data": {
                "events": [{"type": t, "content": json.loads(c)} for t, c in sorted(account_data.global_data.items())]
            },
            "presence": {"events": presence},
            "to_device": {"events": to_device},
            "device_lists": {"changed": devices_changed, "left": []},
            "device_one_time_keys_count": await self._e2e.one_time_key_counts(requester),
        }

    async def _room_section(
        self,
        requester: Requester,
        room_id: str,
        rows: list[tuple[str, int]],
        *,
        limit: int,
        full: bool,
        sync_filter: SyncFilter,
        upto: int,
    ) -> dict[str, Any]:
        limited = len(rows) > limit
        rows = list(reversed(rows[:limit]))
        events = await self._client_events.load([event_id for event_id, _ in rows])
        if full:
            # Incremental timelines of a room the user was already in are all visible to
            # them (a joined member sees everything under every history visibility);
            # initial and newly joined rooms may reach back past the join.
            events = await self._client_events.filter_visible(requester.user_id, events, joined_now=True)
        shown = [e for e in events if sync_filter.timeline.matches(e)]
        prev_batch = room_token(rows[0][1] - 1) if rows else room_token(upto)
        state_events: list[FrozenEvent] = []
        if full or limited:
            if rows:
                state_ids = await self._client_events.state_before(rows[0][0])
            else:
                state_ids = await self._events_store.get_current_state_ids(room_id)
            state_events = await self._state_events(requester, state_ids, shown, sync_filter)
        return {
            "timeline": {
                "events": await self._client_events.serialize(
                    shown, access_token_id=requester.access_token_id, include_room_id=False
                ),
                "limited": limited,
                "prev_batch": prev_batch,
            },
            "state": {"events": await self._client_events.serialize(state_events, include_room_id=False)},
        }

    async def _state_events(
        self,
        requester: Requester,
        state_ids: Mapping[StateKey, str],
        timeline: list[FrozenEvent],
        sync_filter: SyncFilter,
    ) -> list[FrozenEvent]:
        in_timeline = {e.event_id for e in timeline}
        wanted = {k: v for k, v in state_ids.items() if v not in in_timeline}
        if sync_filter.state.lazy_load_members:
            senders = {e.sender for e in timeline} | {requester.user_id}
            wanted = {k: v for k, v in wanted.items() if k[0] != C.MEMBER or k[1] in senders}
        events = await self._client_events.load(sorted(wanted.values()))
        return [e for e in events if sync_filter.state.matches(e)]

    async def _invite_state(self, room_id: str, invite_event_id: str) -> list[Any]:
        keys: list[StateKey] = [(t, "") for t in INVITE_STATE_TYPES]
        ids = await self._events_store.get_current_state_for_keys(room_id, keys)
        events = await self._client_events.load(sorted(ids.values()) + [invite_event_id])
        return [strip_event(e) for e in events]

    async def _leave_section(
        self, requester: Requester, room_id: str, leave_event_id: str, since_pos: int, limit: int
    ) -> dict[str, Any]:
        orderings = await self._timeline.get_stream_orderings([leave_event_id])
        left_at = orderings.get(leave_event_id, since_pos)
        rows = await self._timeline.get_room_events(room_id, start=left_at, end=since_pos, limit=limit + 1, backwards=True)
        limited = len(rows) > limit
        rows = list(reversed(rows[:limit]))
        events = await self._client_events.load([event_id for event_id, _ in rows])
        events = await self._client_events.filter_visible(requester.user_id, events, joined_now=False)
        return {
            "timeline": {
                "events": await self._client_events.serialize(
                    events, access_token_id=requester.access_token_id, include_room_id=False
                ),
                "limited": limited,
                "prev_batch": room_token(rows[0][1] - 1) if rows else room_token(left_at),
            },
            "state": {"events": []},
            "account_data": {"events": []},
        }


def _has_changes(result: Mapping[str, Any]) -> bool:
    rooms = result["rooms"]
    return bool(
        rooms["join"]
        or rooms["invite"]
        or rooms["leave"]
        or result["account_data"]["events"]
        or result["to_device"]["events"]
        or result["presence"]["events"]
        or result["device_lists"]["changed"]
    )
