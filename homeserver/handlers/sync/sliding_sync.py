"""Simplified sliding sync (MSC4186): the room results and extensions of one connection's request.

A request (parsed by ``sliding_sync_request``) names lists (filters plus ranges over the
user's rooms in recency order, ordered by the store in SQL) and room subscriptions; the rooms
they select are "in view". A room in view is sent whole (``initial``) the first time the
connection sees it, and afterwards only when something changed since the connection last
had it. What each connection has been sent is kept in PostgreSQL per ``pos``
(``storage/stores/sliding_sync.py``), so any process continues a connection. Waiting is
``/sync``'s: one notifier waiter on the sync token, woken by the same stream advances.
Extensions (to-device, e2ee, account data, receipts, typing) reuse ``/sync``'s handlers.
"""

# tests: tests/integration/test_sliding_sync.py, tests/unit/handlers/test_sliding_sync_request.py

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

import attrs

from homeserver.events import FrozenEvent
from homeserver.events import constants as C
from homeserver.handlers.accounts.auth import Requester
from homeserver.handlers.rooms.client_events import ClientEvents, strip_event
from homeserver.handlers.e2e.e2e import E2eHandler
from homeserver.handlers.rooms.messages import room_token
from homeserver.handlers.sync.metrics import SyncMetrics
from homeserver.handlers.rooms.partial_state import sync_view
from homeserver.events.push_rules import effective_rules
from homeserver.handlers.ephemeral.receipts import RECEIPT_TYPES, ReceiptsHandler
from homeserver.handlers.rooms.remote_invites import event_of
from homeserver.handlers.sync.sliding_sync_request import (
    MAX_SUBSCRIPTIONS, ListConfig, RoomConfig, SlidingSyncRequest, in_ranges, range_limit, unknown_pos,
)
from homeserver.handlers.sync.sync import INVITE_STATE_TYPES, MAX_HEROES, MAX_TIMEOUT_S, SyncHandler
from homeserver.handlers.ephemeral.typing import TypingHandler
from storage.notifier import Notifier
from storage.room_tokens import RoomTokens
from storage.stores.partial_state import PartialStateStore
from storage.stores.account_data import AccountDataStore, UserAccountData
from storage.stores.events import EventsStore, StateKey
from storage.stores.push import PushStore
from storage.stores.sliding_sync import (
    ConnectionGone, ConnectionPosition, RoomListEntry, RoomListQuery, RoomStatus, RoomStatusChange, SlidingSyncStore,
)
from storage.stores.timeline import RoomPosition, TimelineStore
from storage.kernel.errors import invalid_param
from storage.tokens import InvalidTokenError, StreamToken, SyncStreamKey

# A list without ranges covers at most this many rooms.
MAX_LIST_ROOMS: Final = 10_000
# A device keeps at most this many connections (MSC4186 "Security considerations").
MAX_CONNECTIONS_PER_DEVICE: Final = 20


@attrs.frozen
class _InView:
    """A room a list range or subscription selects, with its combined config."""

    entry: RoomListEntry
    config: RoomConfig
    lists: tuple[str, ...]


@attrs.define
class _Computed:
    body: dict[str, Any]
    changes: list[RoomStatusChange]
    has_data: bool


def _subscriptions(position: ConnectionPosition, request: SlidingSyncRequest) -> dict[str, RoomConfig]:
    """The room subscriptions in force: the connection's (they hold until ``unsubscribe_rooms``
    names them, as clients of the older sliding sync expect), those of this request replacing
    theirs. A stored one that cannot be read any more is dropped."""
    out: dict[str, RoomConfig] = {}
    try:
        stored = json.loads(position.subscriptions)
    except ValueError:
        stored = {}
    for room_id, text in (stored.items() if isinstance(stored, dict) else ()):
        try:
            out[str(room_id)] = RoomConfig.from_json(str(text))
        except (ValueError, KeyError, TypeError):
            continue
    out.update(request.subscriptions)
    for room_id in request.unsubscribe:
        out.pop(room_id, None)
    if len(out) > MAX_SUBSCRIPTIONS:
        raise invalid_param(f"a connection holds at most {MAX_SUBSCRIPTIONS} room subscriptions; "
                            "unsubscribe_rooms drops some")
    return out


def _position(token: StreamToken, key: SyncStreamKey) -> int:
    return token.get(key).max_position


def dm_rooms(direct: str | None) -> frozenset[str]:
    """The rooms ``m.direct`` account data (user -> [room IDs]) names; malformed parts are ignored."""
    try:
        content = json.loads(direct) if direct else {}
    except ValueError:
        return frozenset()
    if not isinstance(content, dict):
        return frozenset()
    return frozenset(room for rooms in content.values() if isinstance(rooms, list)
                     for room in rooms if isinstance(room, str))


class SlidingSyncHandler:
    def __init__(
        self,
        *,
        store: SlidingSyncStore,
        sync: SyncHandler,
        notifier: Notifier,
        clock: Any,
        room_tokens: RoomTokens,
        timeline: TimelineStore,
        events_store: EventsStore,
        client_events: ClientEvents,
        account_data: AccountDataStore,
        typing: TypingHandler,
        receipts: ReceiptsHandler,
        e2e: E2eHandler,
        push: PushStore,
        metrics: SyncMetrics,
        partial_state: PartialStateStore | None = None,
    ) -> None:
        self._store = store
        self._sync = sync
        self._notifier = notifier
        self._clock = clock
        self._room_tokens = room_tokens
        self._timeline = timeline
        self._events_store = events_store
        self._client_events = client_events
        self._account_data = account_data
        self._typing = typing
        self._receipts = receipts
        self._e2e = e2e
        self._push = push
        self._metrics = metrics
        self._partial_state = partial_state

    def _now_ms(self) -> int:
        return int(self._clock.seconds() * 1000)

    async def wait_for_sync(self, requester: Requester, request: SlidingSyncRequest) -> dict[str, Any]:
        """One request of a connection: its answer, waiting up to ``timeout`` (only with a ``pos``)
        until there is something to send, then recorded as the connection's next ``pos``."""
        user_id, device_id = requester.user_id, requester.device_id
        if request.pos is None:
            position = ConnectionPosition(0, 0, "", {})  # the connection is (re)started with its answer
            since: StreamToken | None = None
        else:
            found = await self._store.resume(user_id, device_id, request.conn_id, request.pos, now_ms=self._now_ms())
            if found is None:
                raise unknown_pos(f"Unknown position {request.pos} for conn_id {request.conn_id[:50]!r}")
            position = found
            try:
                since = StreamToken.parse(position.token)
                await self._room_tokens.position(since.events)
            except InvalidTokenError:
                raise unknown_pos("The position's token is no longer understood") from None
        subscriptions = _subscriptions(position, request)
        deadline = self._clock.seconds() + min(request.timeout_ms / 1000.0, MAX_TIMEOUT_S)
        woken_at: float | None = None
        while True:
            now = self._sync.current_token()
            kind = "sliding_initial" if since is None else "sliding_incremental"
            with self._metrics.duration.labels(kind).time():
                computed = await self._compute(requester, request, subscriptions, position, since, now)
            if computed.has_data and woken_at is not None:
                self._metrics.wake_latency.observe(self._clock.seconds() - woken_at)
            remaining = deadline - self._clock.seconds()
            if since is None or computed.has_data or remaining <= 0:
                break
            # Events, receipts and typing in rooms the user has no membership in (nor subscribed
            # to; events: about others) change no list and no room: slept through
            # (docs/client-api.md, "A waiting /sync").
            quiet = self._sync.quiet_watch(
                user_id, frozenset(await self._timeline.get_rooms_for_user(user_id)) | frozenset(subscriptions), now)
            woken = await self._sync.wait_for_change(now, remaining, quiet)
            if not woken and self._notifier.closed:
                break
            woken_at = self._clock.seconds() if woken else None
        stored = json.dumps({room_id: config.to_json() for room_id, config in sorted(subscriptions.items())})
        try:
            if request.pos is None:
                new_pos = await self._store.save_new_connection(
                    user_id, device_id, request.conn_id, now.to_string(), stored, computed.changes,
                    now_ms=self._now_ms(), max_per_device=MAX_CONNECTIONS_PER_DEVICE)
            else:
                new_pos = await self._store.save_position(position.connection_key, now.to_string(), stored,
                                                          computed.changes, now_ms=self._now_ms())
        except ConnectionGone:
            raise unknown_pos("The connection was restarted or expired") from None
        return {"pos": str(new_pos), **computed.body}

    # --- one response -------------------------------------------------------------------------------

    async def _compute(
        self, requester: Requester, request: SlidingSyncRequest, subscriptions: Mapping[str, RoomConfig],
        position: ConnectionPosition, since: StreamToken | None, now: StreamToken,
    ) -> _Computed:
        user_id = requester.user_id
        upto = await self._room_tokens.position(now.events)
        since_pos = await self._room_tokens.position(since.events) if since is not None else None
        direct = dm_rooms(await self._account_data.get(user_id, None, "m.direct"))
        # Read only when a list or subscription could be refused a partial room.
        needs_members = any(c.config.needs_all_members(user_id) for c in request.lists.values()) or any(
            c.needs_all_members(user_id) for c in subscriptions.values())
        partial = await self._partial_rooms(upto) if needs_members else frozenset()

        in_view: dict[str, _InView] = {}
        lists_out: dict[str, Any] = {}
        for name, config in request.lists.items():
            hidden = partial if config.config.needs_all_members(user_id) else frozenset()
            count, ids, entries = await self._list(user_id, config, direct, frozenset(position.rooms), hidden)
            lists_out[name] = {"count": count, "ops": [
                {"op": "SYNC", "range": [start, end], "room_ids": ids[start:end + 1]}
                for start, end in (config.ranges or ((0, max(count - 1, 0)),))
            ]}
            for entry in entries:
                seen = in_view.get(entry.room_id)
                in_view[entry.room_id] = (
                    _InView(entry, config.config, (name,)) if seen is None
                    else _InView(entry, seen.config.combine(config.config), (*seen.lists, name))
                )
        subscribed = await self._store.get_memberships(user_id, subscriptions)
        for room_id, entry in subscribed.items():
            room_config = subscriptions[room_id]
            if room_id in partial and room_config.needs_all_members(user_id):
                continue
            seen = in_view.get(room_id)
            in_view[room_id] = (_InView(entry, room_config, ()) if seen is None
                                else _InView(entry, seen.config.combine(room_config), seen.lists))

        read_in = await self._read_rooms(user_id, in_view, since, now)
        rooms = await self._rooms(requester, in_view, position, since_pos, upto, now, direct, read_in)
        changes: list[RoomStatusChange] = []
        for room_id, view in in_view.items():
            old = position.rooms.get(room_id)
            config_json = view.config.to_json()
            membership = view.entry.membership
            if old is None or not old.live or old.config != config_json or old.membership != membership:
                changes.append(RoomStatusChange(room_id, RoomStatus(True, None, config_json, membership)))
        for room_id, old in position.rooms.items():
            if old.live and room_id not in in_view:
                changes.append(RoomStatusChange(room_id, RoomStatus(False, position.token, old.config,
                                                                    old.membership)))

        extensions = await self._extensions(requester, request, since, now, since_pos, upto, in_view, rooms)
        has_data = bool(rooms) or any(bool(value) for value in _extension_data(extensions))
        body: dict[str, Any] = {"lists": lists_out, "rooms": rooms, "extensions": extensions}
        return _Computed(body, changes, has_data)

    async def _partial_rooms(self, upto: RoomPosition) -> frozenset[str]:
        """Rooms joined with partial state whose state is not whole as of ``upto`` (/sync's rule,
        ``partial_state.sync_view``)."""
        if self._partial_state is None:
            return frozenset()
        rows = await self._partial_state.get_rows_for_sync(upto.minimum)
        return sync_view(rows, rows.keys(), lazy_members=False, since=None, upto=upto).hidden

    async def _list(
        self, user_id: str, config: ListConfig, direct: frozenset[str], sent: frozenset[str],
        hidden: frozenset[str] = frozenset(),
    ) -> tuple[int, list[str], list[RoomListEntry]]:
        """The list's size, its room IDs from the top to its last range's end, and the entries its
        ranges select; ``hidden`` rooms are left out (partial state, a list that needs members)."""
        filters = config.filters
        spaces = (await self._store.get_space_children(user_id, filters.spaces)
                  if filters.spaces is not None else None)
        query = RoomListQuery(is_dm=filters.is_dm, dm_rooms=direct, is_encrypted=filters.is_encrypted,
                              is_invite=filters.is_invite, room_types=filters.room_types,
                              not_room_types=filters.not_room_types, space_rooms=spaces, sent_rooms=sent,
                              tags=filters.tags, not_tags=filters.not_tags, excluded=hidden)
        count, rows = await self._store.get_room_list(user_id, query, limit=range_limit(config.ranges, MAX_LIST_ROOMS))
        ids = [row.room_id for row in rows]
        selected = set(in_ranges(ids, config.ranges))
        return count, ids, [row for row in rows if row.room_id in selected]

    async def _read_rooms(self, user_id: str, in_view: Mapping[str, _InView], since: StreamToken | None,
                          now: StreamToken) -> frozenset[str]:
        """Joined rooms in view where the user's own read receipt moved since ``since``: their
        ``notification_count`` and ``highlight_count`` changed (read on another device, say), so
        they are sent again even with no new event, as Synapse does."""
        if since is None:
            return frozenset()
        after, current = _position(since, SyncStreamKey.RECEIPTS), _position(now, SyncStreamKey.RECEIPTS)
        joined = [r for r, v in in_view.items() if v.entry.membership == C.JOIN]
        if current <= after or not joined:
            return frozenset()
        rows = await self._timeline.get_receipts(joined, after, current, user_id=user_id)
        return frozenset(r.room_id for r in rows if r.receipt_type in RECEIPT_TYPES)

    async def _rooms(
        self, requester: Requester, in_view: Mapping[str, _InView], position: ConnectionPosition,
        since_pos: RoomPosition | None, upto: RoomPosition, now: StreamToken, direct: frozenset[str],
        read_in: frozenset[str] = frozenset(),
    ) -> dict[str, Any]:
        """The room results: every room in view the connection lacks, or has with changes since
        (new events or state, or, for ``read_in``, new unread counts)."""
        user_id = requester.user_id
        # Where each room's news starts: None for a room sent whole.
        starts: dict[str, RoomPosition | None] = {}
        expanded: set[str] = set()
        # Rooms whose timeline_limit grew: their newest events again (MSC4186 "Changes to
        # timeline_limit": the server does not track which it sent), as ``expanded_timeline``.
        longer: set[str] = set()
        for room_id, view in in_view.items():
            status = position.rooms.get(room_id)
            if status is None or (view.entry.membership == C.JOIN and status.membership in (C.INVITE, C.KNOCK)):
                # Never sent, or sent as an invite (stripped state only) and joined since: whole.
                starts[room_id] = None
                continue
            if status.live:
                assert since_pos is not None  # a connection has rooms only after its first answer
                starts[room_id] = since_pos
            else:
                try:
                    starts[room_id] = await self._room_tokens.position(
                        StreamToken.parse(status.last_token or "").events)
                except InvalidTokenError:
                    starts[room_id] = None
            if view.config.state_expanded_from(status.config):
                expanded.add(room_id)
            if view.entry.membership == C.JOIN and view.config.timeline_expanded_from(status.config):
                longer.add(room_id)

        joined = [r for r, v in in_view.items() if v.entry.membership == C.JOIN]
        left = [r for r, v in in_view.items() if v.entry.membership in (C.LEAVE, C.BAN)]
        # Timelines: one read per distinct start (whole rooms, live rooms, each older token).
        recent: dict[str, list[tuple[str, int]]] = {}
        groups: dict[RoomPosition | None, list[str]] = {}
        for room_id in joined:
            groups.setdefault(None if room_id in longer else starts[room_id], []).append(room_id)
        for start, room_ids in groups.items():
            limit = max(in_view[r].config.timeline_limit for r in room_ids) + 1
            recent.update(await self._timeline.get_recent_events(
                room_ids, after=start if start is not None else 0, upto=upto, limit=limit))
        for room_id in left:
            start = starts[room_id]
            left_at = RoomPosition.at(in_view[room_id].entry.bump_stamp)
            if start is not None and start.minimum >= left_at.minimum:
                continue  # nothing after the membership change the connection already has
            recent.update(await self._timeline.get_recent_events(
                [room_id], after=start if start is not None else 0, upto=left_at,
                limit=in_view[room_id].config.timeline_limit + 1))
        state_changes: dict[str, dict[StateKey, str]] = {}
        state_groups: dict[RoomPosition, list[str]] = {}
        for room_id in joined:
            start = starts[room_id]
            if start is not None:
                state_groups.setdefault(start, []).append(room_id)
        for start, room_ids in state_groups.items():
            state_changes.update(await self._store.get_state_changes(room_ids, after=start, upto=upto))

        # Rooms with something to send.
        shown: list[str] = []
        for room_id, view in in_view.items():
            start = starts[room_id]
            membership = view.entry.membership
            if start is None or room_id in expanded or room_id in longer:
                shown.append(room_id)
            elif membership == C.JOIN and (recent.get(room_id) or state_changes.get(room_id) or room_id in read_in):
                shown.append(room_id)
            elif membership in (C.LEAVE, C.BAN) and recent.get(room_id):
                shown.append(room_id)
            elif membership in (C.INVITE, C.KNOCK) and view.entry.bump_stamp > start.maximum:
                shown.append(room_id)
        if not shown:
            return {}

        full_state_rooms = [r for r in shown if (starts[r] is None or r in expanded)
                            and in_view[r].entry.membership == C.JOIN]
        left_rooms = [r for r in shown if in_view[r].entry.membership in (C.LEAVE, C.BAN)]
        timelines = await self._timelines(
            requester, {r: in_view[r] for r in shown if in_view[r].entry.membership not in (C.INVITE, C.KNOCK)},
            recent, whole={r for r in shown if starts[r] is None or r in longer}, now=now)
        lazy_members: dict[str, set[str]] = {}
        for room_id, (events, _, _) in timelines.items():
            if in_view[room_id].config.lazy:
                lazy_members[room_id] = {e.sender for e in events} | {
                    e.state_key for e in events if e.type == C.MEMBER and e.state_key is not None}
        wanted_members = {user_id} | {m for members in lazy_members.values() for m in members}
        for room_id in full_state_rooms:
            wanted_members |= in_view[room_id].config.member_keys(user_id)
        full_state = await self._store.get_state_ids(
            full_state_rooms, all_members=any(in_view[r].config.all_members() for r in full_state_rooms),
            members=wanted_members,
        )
        # A room the user left is seen as it was when they left (what came later is not theirs).
        for room_id in left_rooms:
            full_state[room_id] = await self._client_events.state_after(in_view[room_id].entry.event_id)
        # Lazy members of rooms sent incrementally: their current member events.
        incremental_lazy = [r for r in lazy_members if r not in full_state]
        lazy_state = await self._store.get_state_ids(incremental_lazy, all_members=False, members=wanted_members)
        summaries = await self._timeline.get_room_summaries(
            [r for r in shown if in_view[r].entry.membership == C.JOIN], candidates=MAX_HEROES + 1)
        unread = await self._push.get_unread_counts(user_id, [r for r in shown if in_view[r].entry.membership == C.JOIN],
                                                    upto=upto.maximum)
        live_positions: dict[str, tuple[str, int]] = {}
        older = [e.event_id for room_id, (events, _, _) in timelines.items()
                 if starts[room_id] != since_pos or room_id in longer for e in events]
        if since_pos is not None and older:
            live_positions = await self._timeline.get_event_positions(older)

        # The state events each room result sends.
        room_state: dict[str, dict[StateKey, str]] = {}
        for room_id in shown:
            view = in_view[room_id]
            if view.entry.membership in (C.INVITE, C.KNOCK):
                continue
            lazy = lazy_members.get(room_id, set())
            if room_id in full_state:
                source = full_state[room_id]
                picked = {k: v for k, v in source.items() if view.config.matches(k[0], k[1], user_id)
                          or (k[0] == C.MEMBER and k[1] in lazy)}
            else:
                source = state_changes.get(room_id, {})
                picked = {k: v for k, v in state_changes.get(room_id, {}).items()
                          if view.config.matches(k[0], k[1], user_id)}
                picked.update({k: v for k, v in lazy_state.get(room_id, {}).items()
                               if k[0] == C.MEMBER and k[1] in lazy})
            # Name and avatar come from the same state, whether or not required_state asks for them.
            for key in ((C.NAME, ""), ("m.room.avatar", "")):
                if key in source:
                    picked.setdefault(key, source[key])
            room_state[room_id] = picked
        loaded = {e.event_id: e for e in await self._client_events.load(
            sorted({eid for state in room_state.values() for eid in state.values()}))}

        hero_ids: dict[str, list[str]] = {}
        timeline_of: dict[str, list[FrozenEvent]] = {}
        state_of: dict[str, list[FrozenEvent]] = {}
        out: dict[str, Any] = {}
        for room_id in shown:
            view = in_view[room_id]
            entry = view.entry
            whole = starts[room_id] is None
            result: dict[str, Any] = {"bump_stamp": entry.bump_stamp, "membership": entry.membership}
            if view.lists:
                result["lists"] = list(view.lists)
            if whole:
                result["initial"] = True
            if entry.membership in (C.INVITE, C.KNOCK):
                stripped = await self._invite_state(user_id, entry)
                result["invite_state" if entry.membership == C.INVITE else "knock_state"] = stripped
                result["stripped_state"] = stripped
                out[room_id] = result
                continue
            if whole and room_id in direct:
                result["is_dm"] = True
            events, limited, prev_batch = timelines[room_id]
            timeline_of[room_id] = events
            result["limited"] = limited
            result["prev_batch"] = prev_batch
            if room_id in longer and not whole:
                result["expanded_timeline"] = True
            if since_pos is None:
                result["num_live"] = 0
            elif starts[room_id] == since_pos and room_id not in longer:
                result["num_live"] = len(events)
            else:
                result["num_live"] = sum(1 for e in events if e.event_id in live_positions
                                         and not since_pos.covers(*live_positions[e.event_id]))
            state_ids = room_state[room_id]
            send = {k: v for k, v in state_ids.items() if k not in ((C.NAME, ""), ("m.room.avatar", ""))
                    or view.config.matches(k[0], k[1], user_id)}
            state_of[room_id] = [loaded[v] for _, v in sorted(send.items()) if v in loaded]
            name_event = loaded.get(state_ids.get((C.NAME, ""), ""))
            avatar_event = loaded.get(state_ids.get(("m.room.avatar", ""), ""))
            name = name_event.content.get("name") if name_event is not None else None
            if isinstance(name, str) and name:
                result["name"] = name
            avatar = avatar_event.content.get("url") if avatar_event is not None else None
            if isinstance(avatar, str) and avatar:
                result["avatar"] = avatar
            membership_changed = whole or room_id in expanded or any(
                k[0] == C.MEMBER for k in state_changes.get(room_id, {}))
            summary = summaries.get(room_id)
            if summary is not None and membership_changed:
                result["joined_count"] = summary.joined
                result["invited_count"] = summary.invited
                if "name" not in result:
                    others = [(m, ms) for m, ms in summary.members if m != user_id]
                    present = [m for m, ms in others if ms in (C.JOIN, C.INVITE)]
                    hero_ids[room_id] = (present or [m for m, _ in others])[:MAX_HEROES]
            if entry.membership == C.JOIN:
                by_thread = unread.get(room_id, {})
                result["notification_count"] = sum(n for n, _ in by_thread.values())
                result["highlight_count"] = sum(h for _, h in by_thread.values())
            out[room_id] = result
        # Every room's events in one serialisation each (one read of redactions and txn IDs).
        for field, of, served in (
            ("timeline", timeline_of, await self._client_events.serialize(
                [e for events in timeline_of.values() for e in events], access_token_id=requester.access_token_id,
                include_room_id=False, bundle_for=user_id)),
            ("required_state", state_of, await self._client_events.serialize(
                [e for events in state_of.values() for e in events], include_room_id=False)),
        ):
            offset = 0
            for room_id, events in of.items():
                out[room_id][field] = served[offset:offset + len(events)]
                offset += len(events)
        profiles = await self._store.get_member_profiles(hero_ids)
        for room_id, heroes in hero_ids.items():
            out[room_id]["heroes"] = [_hero(user, *profiles.get((room_id, user), (None, None))) for user in heroes]
        return out

    async def _timelines(
        self, requester: Requester, rooms: Mapping[str, _InView], recent: Mapping[str, list[tuple[str, int]]], *,
        whole: set[str], now: StreamToken,
    ) -> dict[str, tuple[list[FrozenEvent], bool, str]]:
        """Per room: its timeline events (oldest first), whether it is limited, and its
        ``prev_batch``. The events of all the rooms are loaded, checked and later serialised
        together, so a response costs the same few reads for 1 room or 20."""
        rows_of: dict[str, list[tuple[str, int]]] = {}
        limited: dict[str, bool] = {}
        for room_id, view in rooms.items():
            rows = recent.get(room_id, [])
            limited[room_id] = len(rows) > view.config.timeline_limit
            rows_of[room_id] = list(reversed(rows[:view.config.timeline_limit]))
        loaded = {e.event_id: e for e in await self._client_events.load(
            [event_id for rows in rows_of.values() for event_id, _ in rows])}
        # A room sent whole may reach back past the user's join (what follows the join the user
        # sees, being joined since); a left room is seen as left.
        joined_check = [loaded[eid] for r, rows in rows_of.items() if r in whole and rooms[r].entry.membership == C.JOIN
                        for eid, so in rows if eid in loaded and so <= rooms[r].entry.member_stream_ordering]
        left_check = [loaded[eid] for r, rows in rows_of.items() if rooms[r].entry.membership != C.JOIN
                      for eid, _ in rows if eid in loaded]
        hidden = {e.event_id for e in joined_check + left_check}
        hidden -= {e.event_id for e in await self._client_events.filter_visible(
            requester.user_id, joined_check, joined_now=True)}
        hidden -= {e.event_id for e in await self._client_events.filter_visible(
            requester.user_id, left_check, joined_now=False)}
        out: dict[str, tuple[list[FrozenEvent], bool, str]] = {}
        for room_id, rows in rows_of.items():
            events = [loaded[eid] for eid, _ in rows if eid in loaded and eid not in hidden]
            prev_batch = room_token(rows[0][1] - 1) if rows else now.events.to_string()
            out[room_id] = (events, limited[room_id], prev_batch)
        return out

    async def _invite_state(self, user_id: str, entry: RoomListEntry) -> list[Any]:
        """An invite's or knock's stripped state, as /sync's ``invite_state``: the room's from here,
        or, for a room this server is not in, what the invite (or knock) carried."""
        if entry.remote:
            row = await self._store.get_remote_invite(user_id, entry.room_id)
            if row is None:
                return []
            state = [e for e in json.loads(row.invite_state)
                     if isinstance(e, dict) and (e.get("type"), e.get("state_key")) != (C.MEMBER, user_id)]
            return [*state, strip_event(event_of(row))]
        keys: list[StateKey] = [(t, "") for t in INVITE_STATE_TYPES]
        ids = await self._events_store.get_current_state_for_keys(entry.room_id, keys)
        events = await self._client_events.load(sorted(ids.values()) + [entry.event_id])
        return [strip_event(e) for e in events]

    # --- extensions -------------------------------------------------------------------------------------

    async def _extensions(
        self, requester: Requester, request: SlidingSyncRequest, since: StreamToken | None, now: StreamToken,
        since_pos: RoomPosition | None, upto: RoomPosition, in_view: Mapping[str, _InView],
        rooms: Mapping[str, Any],
    ) -> dict[str, Any]:
        wanted = request.extensions
        user_id = requester.user_id
        out: dict[str, Any] = {}
        # Rooms the connection gets whole in this answer get their ephemeral data whole too.
        whole = [r for r, result in rooms.items() if result.get("initial")]
        known = [r for r in in_view if r not in whole]
        if wanted.to_device:
            after = wanted.to_device_since or 0
            current = _position(now, SyncStreamKey.TO_DEVICE)
            messages: list[Any] = []
            reached = max(current, after)
            if current > after or after:
                messages, reached = await self._e2e.to_device_page(requester, after, current, wanted.to_device_limit)
                reached = max(reached, after)
            out["to_device"] = {"next_batch": str(reached), "events": messages}
        if wanted.e2ee:
            counts, fallback = await self._e2e.key_counts(requester)
            e2ee: dict[str, Any] = {"device_one_time_keys_count": counts,
                                    "device_unused_fallback_key_types": fallback}
            if since is not None and since_pos is not None:
                after, current = _position(since, SyncStreamKey.DEVICE_LISTS), _position(now, SyncStreamKey.DEVICE_LISTS)
                lists = await self._e2e.device_list_summary(
                    user_id, (after, current) if current > after else None, since_pos, upto)
                if lists["changed"] or lists["left"]:
                    e2ee["device_lists"] = lists
            out["e2ee"] = e2ee
        if wanted.account_data:
            out["account_data"] = await self._account_data_extension(user_id, since, now, whole, known)
        if wanted.receipts:
            out["receipts"] = {"rooms": await self._receipts_extension(user_id, since, now, whole, known, rooms)}
        if wanted.typing:
            typing_since = _position(since, SyncStreamKey.TYPING) if since is not None else 0
            typing = {**self._typing.changed_rooms(known, typing_since), **self._typing.changed_rooms(whole, 0)}
            out["typing"] = {"rooms": {room_id: {"type": "m.typing", "content": {"user_ids": users}}
                                       for room_id, users in typing.items()}}
        return out

    async def _account_data_extension(
        self, user_id: str, since: StreamToken | None, now: StreamToken, whole: list[str], known: list[str],
    ) -> dict[str, Any]:
        """Global account data (all of it first, then what changed) and that of the rooms in view."""
        current = _position(now, SyncStreamKey.ACCOUNT_DATA)
        full: UserAccountData | None = None
        if since is None or whole:
            full = await self._account_data.get_for_user(user_id, after=None, upto=current)
        changed: UserAccountData | None = None
        if since is not None and current > _position(since, SyncStreamKey.ACCOUNT_DATA):
            changed = await self._account_data.get_for_user(
                user_id, after=_position(since, SyncStreamKey.ACCOUNT_DATA), upto=current)

        def events(data: Mapping[str, str]) -> list[dict[str, Any]]:
            return [{"type": t, "content": json.loads(c)} for t, c in sorted(data.items())]

        global_data: dict[str, str] = {}
        if since is None and full is not None:
            global_data = dict(full.global_data)
        elif changed is not None:
            global_data = dict(changed.global_data)
        global_events = events(global_data)
        if since is None and "m.push_rules" not in global_data:
            # As /sync: a first answer always has the user's push rules, the defaults until changed.
            global_events.append({"type": "m.push_rules", "content": {"global": effective_rules(None, user_id)}})
        room_events: dict[str, list[dict[str, Any]]] = {}
        for room_id in whole:
            if full is not None and full.rooms.get(room_id):
                room_events[room_id] = events(full.rooms[room_id])
        for room_id in known:
            if changed is not None and changed.rooms.get(room_id):
                room_events[room_id] = events(changed.rooms[room_id])
        return {"global": global_events, "rooms": room_events}

    async def _receipts_extension(
        self, user_id: str, since: StreamToken | None, now: StreamToken, whole: list[str], known: list[str],
        rooms: Mapping[str, Any],
    ) -> dict[str, Any]:
        """Receipts that changed in rooms the connection has; for rooms sent whole, the receipts on
        their timeline's events and the user's own (MSC3960: not every receipt of the room)."""
        current = _position(now, SyncStreamKey.RECEIPTS)
        out: dict[str, Any] = {}
        if since is not None and known and current > _position(since, SyncStreamKey.RECEIPTS):
            out.update(await self._receipts.ephemeral_for(
                user_id, known, _position(since, SyncStreamKey.RECEIPTS), current))
        if whole:
            for room_id, event in (await self._receipts.ephemeral_for(user_id, whole, 0, current)).items():
                shown = {e.get("event_id") for e in rooms[room_id].get("timeline", [])}
                content = {event_id: {kind: {u: data for u, data in readers.items()
                                             if event_id in shown or u == user_id}
                                      for kind, readers in kinds.items()}
                           for event_id, kinds in event["content"].items()}
                content = {event_id: {kind: readers for kind, readers in kinds.items() if readers}
                           for event_id, kinds in content.items()}
                content = {event_id: kinds for event_id, kinds in content.items() if kinds}
                if content:
                    out[room_id] = {"type": "m.receipt", "content": content}
        return out


def _extension_data(extensions: Mapping[str, Any]) -> list[object]:
    """What in the extensions' answers is news (to wake a long poll): to-device messages, device
    list changes, account data and receipt or typing changes."""
    values: list[object] = []
    if "to_device" in extensions:
        values.append(extensions["to_device"]["events"])
    if "e2ee" in extensions:
        values.append(extensions["e2ee"].get("device_lists"))
    if "account_data" in extensions:
        values.extend((extensions["account_data"]["global"], extensions["account_data"]["rooms"]))
    for name in ("receipts", "typing"):
        if name in extensions:
            values.append(extensions[name]["rooms"])
    return values


def _hero(user_id: str, displayname: str | None, avatar_url: str | None) -> dict[str, Any]:
    hero: dict[str, Any] = {"user_id": user_id}
    if displayname:
        hero["displayname"] = displayname
    if avatar_url:
        hero["avatar_url"] = avatar_url
    return hero

