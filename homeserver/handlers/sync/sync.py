"""``/sync``: what changed for a user since a ``StreamToken``, long-polling on the notifier.

A response covers the events stream up to one snapshot position: every
timeline event with ``since < stream_ordering <= upto``, both taken for the
event's own writer (tokens are vector clocks with several event persisters,
``storage/room_tokens.py``), appears once (unless
the timeline limit cuts it, in which case ``limited`` is set and ``prev_batch``
points before the first event returned). ``next_batch`` is the snapshot. Waiting
is one notifier waiter (no polling); a wake-up that turns out to be irrelevant
to this user waits again until the timeout. A response's reads run side by
side on the database pool, and a stream that has not moved since ``since`` is
not read at all: a wake-up by one new message costs three transactions, two
of them side by side.
"""

# tests: tests/integration/test_client_rooms.py, tests/integration/test_client_sync.py, tests/integration/test_client_sync_state.py, tests/integration/test_client_e2e.py

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, Final, TypeVar

import attrs
from prometheus_client import CollectorRegistry
from twisted.internet.defer import Deferred

from homeserver.events import FrozenEvent
from homeserver.events import constants as C
from homeserver.handlers.accounts.auth import Requester
from homeserver.handlers.rooms.client_events import ClientEvents, strip_event
from homeserver.handlers.rooms.remote_invites import event_of
from homeserver.handlers.e2e.e2e import E2eHandler
from homeserver.handlers.sync.metrics import SyncMetrics
from homeserver.handlers.rooms.partial_state import sync_view
from homeserver.handlers.rooms.messages import EventFilter, parse_event_filter, room_token
from homeserver.handlers.ephemeral.presence import PresenceHandler
from homeserver.events.push_rules import effective_rules
from homeserver.handlers.ephemeral.receipts import ReceiptsHandler
from homeserver.handlers.ephemeral.typing import TypingHandler
from storage.id_generators import StreamIdGenerator
from storage.notifier import Notifier
from storage.caches import DictCache
from storage.stores.account_data import AccountDataStore, UserAccountData
from storage.stores.events import EventsStore, StateKey
from storage.stores.partial_state import PartialStateRow, PartialStateStore
from storage.stores.push import PushStore
from storage.stores.timeline import MembershipRow, RoomPosition, TimelineStore
from storage.streams import StreamName
from storage.room_tokens import RoomTokens
from storage.kernel.errors import invalid_param
from storage.kernel.written_events import (
    KeyNotes,
    QuietWatch,
    WrittenEvents,
    events_concern,
    rooms_concern,
    user_concerns,
)
from storage.tokens import InvalidTokenError, MultiWriterStreamToken, RoomStreamToken, StreamToken, SyncStreamKey

T = TypeVar("T")

# The streams whose positions are each about rooms (``KeyNotes``); the other noted ones are
# about users.
_ROOM_KEYED: Final = frozenset({SyncStreamKey.TYPING, SyncStreamKey.RECEIPTS})

DEFAULT_TIMELINE_LIMIT = 10
# The spec's m.heroes: up to 5 members other than the syncing user.
MAX_HEROES = 5
MAX_TIMELINE_LIMIT = 1000
# A timeline filter that leaves events out is filled by reading further back, at most this
# many batches of ``FILTERED_BATCH`` events (then the timeline is ``limited`` where the search stopped).
FILTERED_ROUNDS = 5
FILTERED_BATCH = 100
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
    # ``room.include_leave``: an initial sync lists the rooms the user left or was banned from.
    include_leave: bool = False
    # ``event_format: federation``: room events are given as PDUs (``format_event``).
    federation_format: bool = False
    # ``room.state.include_redundant_members``: lazy-loaded members are sent again each time.
    include_redundant_members: bool = False
    # ``room.timeline.unread_thread_notifications``: counts split into the main timeline's and
    # each thread's (``unread_thread_notifications``).
    unread_thread_notifications: bool = False

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
        return cls(
            timeline=timeline,
            state=state,
            timeline_limit=max(1, min(limit, MAX_TIMELINE_LIMIT)),
            include_leave=room.get("include_leave") is True,
            federation_format=value.get("event_format") == "federation",
            include_redundant_members=isinstance(room.get("state"), Mapping)
            and room["state"].get("include_redundant_members") is True,
            unread_thread_notifications=isinstance(room.get("timeline"), Mapping)
            and room["timeline"].get("unread_thread_notifications") is True,
        )


def unread_sections(
    by_thread: Mapping[str | None, tuple[int, int]], split: bool
) -> dict[str, Any]:
    """A joined room's ``unread_notifications`` from its unread counts per thread (None: the main
    timeline): the sum of all, or, when the filter asks to ``split``, the main timeline's alone
    and each thread's under ``unread_thread_notifications`` (only when there is one)."""
    def counts(pair: tuple[int, int]) -> dict[str, int]:
        return {"highlight_count": pair[1], "notification_count": pair[0]}

    if not split:
        return {"unread_notifications": counts((sum(n for n, _ in by_thread.values()),
                                                sum(h for _, h in by_thread.values())))}
    out: dict[str, Any] = {"unread_notifications": counts(by_thread.get(None, (0, 0)))}
    threads = {thread: counts(pair) for thread, pair in sorted(by_thread.items(), key=lambda i: str(i[0]))
               if thread is not None}
    if threads:
        out["unread_thread_notifications"] = threads
    return out


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
        room_tokens: RoomTokens,
        push: PushStore,
        partial_state: PartialStateStore | None = None,
        written: WrittenEvents | None = None,
        key_notes: Mapping[SyncStreamKey, KeyNotes] | None = None,
    ) -> None:
        # The notes of the events this process knows of, and what the positions of other
        # streams are about (receipts and typing: rooms; to-device and account data: users):
        # a waiting sync sleeps through those not for its user (``QuietWatch``).
        self._written = written
        self._key_notes = dict(key_notes or {})
        self._push = push
        self._partial_state = partial_state
        self._presence = presence
        self._room_tokens = room_tokens
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
        # (user, device) -> the to-device position up to which this process deleted the
        # device's messages (acknowledged by a sync token): no need to delete again.
        self._to_device_acked = DictCache[int]("sync_to_device_acked", max_entries=100_000)
        # (user, device) -> the token of the last answer this process computed for the device
        # and the rooms the user was joined to then: its next long-poll, from that token,
        # sleeps through what is not for it from the start (``wait_for_sync``).
        self._answered_rooms = DictCache[tuple[str, frozenset[str]]]("sync_answered_rooms", max_entries=100_000)
        # (user, device, room) -> the member events (state key, event ID) this process sent the
        # device under ``lazy_load_members``: not sent again (unless ``include_redundant_members``).
        self._lazy_members = DictCache[tuple[tuple[str, str], ...]]("sync_lazy_members", max_entries=100_000)

    @property
    def metrics(self) -> SyncMetrics:
        """The /sync metrics, shared with sliding sync (homeserver/handlers/sync/sliding_sync.py)."""
        return self._metrics

    def current_token(self) -> StreamToken:
        def pos(name: StreamName) -> MultiWriterStreamToken:
            return MultiWriterStreamToken.at(self._streams[name].get_current_token())

        return StreamToken(
            self._room_tokens.current(),
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
        wanted: Callable[[Mapping[str, Any]], bool] | None = None,
    ) -> dict[str, Any]:
        """``sync`` from ``since``, waiting up to ``timeout_ms`` until it has something ``wanted``
        (by default any change: the older ``/events`` wants timeline events only). Every wake-up
        syncs from ``since`` again, so what arrived meanwhile is kept."""
        has_changes = wanted if wanted is not None else _has_changes
        if since is not None:
            # A well-formed token naming an events writer no process ever had is the client's error.
            try:
                await self._room_tokens.position(since.events)
            except InvalidTokenError as e:
                raise invalid_param(str(e)) from None
        if since is None or full_state or timeout_ms <= 0:
            return await self.sync(requester, since, full_state=full_state, sync_filter=sync_filter)
        deadline = self._clock.seconds() + min(timeout_ms / 1000.0, MAX_TIMEOUT_S)
        woken_at: float | None = None
        if not self.current_token().advanced_keys(since):
            # Nothing happened since the client's token (it comes back right after its last
            # answer): a sync now would find nothing, so it waits first, as Synapse does; from
            # the token of the last answer here, with the rooms that answer saw.
            if await self.wait_for_change(since, deadline - self._clock.seconds(), self._quiet_after(requester, since)):
                woken_at = self._clock.seconds()
        while True:
            result = await self.sync(requester, since, full_state=False, sync_filter=sync_filter)
            remaining = deadline - self._clock.seconds()
            if has_changes(result) and woken_at is not None:
                self._metrics.wake_latency.observe(self._clock.seconds() - woken_at)
            if has_changes(result) or remaining <= 0:
                return result
            reached = StreamToken.parse(result["next_batch"])
            # Events, receipts and typing after ``reached`` in rooms the user is not joined to
            # (events: about others) cannot change the answer: slept through (docs/client-api.md,
            # "A waiting /sync").
            woken = await self.wait_for_change(reached, remaining, self._quiet_after(requester, reached))
            if not woken and self._notifier.closed:
                return result  # shutting down: the (empty) answer now, not at the timeout
            # The notifier fires its waiters synchronously from the position
            # change, so now is when the stream advanced.
            woken_at = self._clock.seconds() if woken else None
            if self._clock.seconds() >= deadline:
                return await self.sync(requester, since, full_state=False, sync_filter=sync_filter)

    def _quiet_after(self, requester: Requester, reached: StreamToken) -> dict[SyncStreamKey, Callable[[int], bool]]:
        """``quiet_watch`` for a wait from ``reached`` when it is the token of this process's last
        answer to the device (whose rooms are kept with it), else nothing to sleep through."""
        answered = self._answered_rooms.get(_device_key(requester))
        if answered is None or answered[0] != reached.to_string():
            return {}
        return self.quiet_watch(requester.user_id, answered[1], reached)

    async def wait_for_change(self, reached: StreamToken, remaining: float,
                              quiet: Mapping[SyncStreamKey, Callable[[int], bool]]) -> bool:
        """Wait until a stream moves past ``reached`` (but for what ``quiet`` clears), or for
        ``remaining`` seconds; whether it moved. Counted in ``tributary_sync_long_polls_active``
        (sliding sync's waits too)."""
        self._metrics.long_polls.inc()
        try:
            return await self._notifier.wait_for_sync_token(reached, self.current_token, remaining, quiet=quiet)
        finally:
            self._metrics.long_polls.dec()

    def quiet_watch(
        self, user_id: str, rooms: frozenset[str], reached: StreamToken
    ) -> dict[SyncStreamKey, Callable[[int], bool]]:
        """For a sync waiting from ``reached``, by stream: whether positions up to a given one
        hold nothing for it (``QuietWatch``): events in rooms other than ``rooms`` and not
        about the user, typing and receipts in other rooms, to-device messages and account
        data of other users. Only streams with notes in this process."""
        quiet: dict[SyncStreamKey, Callable[[int], bool]] = {}
        if self._written is not None:
            quiet[SyncStreamKey.EVENTS] = QuietWatch(
                self._written, events_concern(user_id, rooms), reached.events.minimum).quiet_upto
        for key, notes in self._key_notes.items():
            concerns = rooms_concern(rooms) if key in _ROOM_KEYED else user_concerns(user_id)
            quiet[key] = QuietWatch(notes, concerns, reached.get(key).minimum).quiet_upto
        return quiet

    async def wait_for_room(
        self, requester: Requester, room_id: str, since: StreamToken, *, timeout_ms: int, joined: bool, limit: int
    ) -> tuple[list[dict[str, Any]], StreamToken]:
        """The older ``/events?room_id=``: one room's new events (at most ``limit``, the newest,
        with ``room_id``, as history visibility lets the user see them: all of them for a member
        ``joined`` now, the ``world_readable`` ones for a peeker), its typing and receipt changes
        and its joined members' presence changes after ``since``, waiting up to ``timeout_ms``
        until there are some; and the token they reach."""
        try:
            await self._room_tokens.position(since.events)
        except InvalidTokenError as e:
            raise invalid_param(str(e)) from None
        deadline = self._clock.seconds() + min(max(timeout_ms, 0) / 1000.0, MAX_TIMEOUT_S)
        while True:
            now = self.current_token()
            chunk = await self._room_stream(requester, room_id, since, now, joined=joined, limit=limit)
            remaining = deadline - self._clock.seconds()
            if chunk or remaining <= 0:
                return chunk, now
            await self._notifier.wait_for_sync_token(now, self.current_token, remaining)

    async def _room_stream(
        self, requester: Requester, room_id: str, since: StreamToken, now: StreamToken, *, joined: bool, limit: int
    ) -> list[dict[str, Any]]:
        chunk: list[dict[str, Any]] = []
        since_pos = await self._room_tokens.position(since.events)
        upto = await self._room_tokens.position(now.events)
        rows = await self._timeline.get_room_events(room_id, start=upto, end=since_pos, limit=limit, backwards=True)
        if rows:
            events = await self._client_events.load([event_id for event_id, _ in reversed(rows)])
            events = await self._client_events.filter_visible(requester.user_id, events, joined_now=joined)
            chunk.extend(await self._client_events.serialize(events, access_token_id=requester.access_token_id,
                                                             bundle_for=requester.user_id))
        typing_since = _stream_position(since, SyncStreamKey.TYPING)
        for typing_room, user_ids in self._typing.changed_rooms([room_id], typing_since).items():
            chunk.append({"type": "m.typing", "room_id": typing_room, "content": {"user_ids": user_ids}})
        after, current = _stream_position(since, SyncStreamKey.RECEIPTS), _stream_position(now, SyncStreamKey.RECEIPTS)
        if current > after:
            receipts = await self._receipts.ephemeral_for(requester.user_id, [room_id], after, current)
            chunk.extend({**event, "room_id": room_id} for event in receipts.values())
        after, current = _stream_position(since, SyncStreamKey.PRESENCE), _stream_position(now, SyncStreamKey.PRESENCE)
        if self._presence is not None and current > after:
            chunk.extend(await self._presence.room_presence_for_stream(room_id, after, current))
        return chunk

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
        # The events positions are per writer (a vector clock with several event persisters).
        upto = await self._room_tokens.position(now.events)
        since_pos = await self._room_tokens.position(since.events) if since is not None else RoomPosition.at(0)
        initial = since is None or full_state
        limit = sync_filter.timeline_limit

        def moved(key: SyncStreamKey) -> tuple[int, int] | None:
            """(since, now) positions of a stream, or None when it has nothing in between."""
            after = _stream_position(since, key) if since is not None else 0
            current = _stream_position(now, key)
            return (after, current) if current > after else None

        def full_rooms(
            rooms_at: Mapping[str, tuple[str, str, int]],
            changes: Sequence[MembershipRow],
            late: set[str],
            at_since: Mapping[str, str],
            partial_rows: Mapping[str, PartialStateRow],
        ) -> set[str]:
            joined = {r for r, (m, _, _) in rooms_at.items() if m == C.JOIN}
            if partial_rows:
                view = sync_view(partial_rows, joined, lazy_members=sync_filter.state.lazy_load_members,
                                 since=since_pos if since is not None else None, upto=upto)
                partial_hidden.update(view.hidden)
                joined -= view.hidden
                if not initial:
                    # Made whole since ``since``: sent as a newly joined room (docs/federation.md).
                    late = late | view.newly_whole
            if initial:
                return joined
            # A membership that changed after the snapshot (a race with this request: ``late``)
            # makes the room "full": its timeline is then visibility-filtered, never assumed visible.
            return (_newly_joined(changes, at_since) | late) & joined

        # The reads are independent: they run side by side on the database pool, and a
        # stream that has not moved since the token is not read at all.
        ad_range = moved(SyncStreamKey.ACCOUNT_DATA)
        presence_range = moved(SyncStreamKey.PRESENCE) if self._presence is not None else None
        devices_range = moved(SyncStreamKey.DEVICE_LISTS) if since is not None else None
        to_device_after = _stream_position(since, SyncStreamKey.TO_DEVICE) if since is not None else 0
        to_device_upto = _stream_position(now, SyncStreamKey.TO_DEVICE)
        # Rooms joined with partial state, hidden from a client that does not lazy-load members
        # until their state is whole (``homeserver/handlers/rooms/partial_state.py``); their rows are
        # read with the rooms, since ``full_rooms`` needs them.
        partial_after = (
            (upto if initial else since_pos).minimum
            if self._partial_state is not None and not sync_filter.state.lazy_load_members else None
        )
        partial_hidden: set[str] = set()
        rooms_read = _start(self._timeline.get_sync_rooms(
            user_id, since=since_pos if since is not None else None, upto=upto, limit=limit + 1, full_rooms=full_rooms,
            partial_after=partial_after,
        ))
        account_data_read = None
        if since is None:  # all of it
            account_data_read = _start(self._account_data.get_for_user(
                user_id, after=None, upto=_stream_position(now, SyncStreamKey.ACCOUNT_DATA)
            ))
        elif ad_range is not None:
            account_data_read = _start(self._account_data.get_for_user(user_id, after=ad_range[0], upto=ad_range[1]))
        to_device_read = (
            _start(self._to_device(requester, to_device_after, to_device_upto))
            if to_device_upto > to_device_after or self._to_device_acked.get(_device_key(requester)) != to_device_after
            else None
        )
        presence_read = (
            _start(self._presence.presence_for_sync(user_id, *presence_range))
            if self._presence is not None and presence_range else None
        )
        devices_read = (
            _start(self._e2e.device_list_summary(user_id, devices_range, since_pos, upto))
            if since is not None else None
        )
        key_counts_read = _start(self._e2e.key_counts(requester))
        try:
            snapshot = await rooms_read
            joined_ids = [r for r, (m, _, _) in snapshot.rooms_at.items() if m == C.JOIN and r not in partial_hidden]
            # Every joined room, those hidden while their state is partial too: kept with the
            # answer's token for the device's next long-poll (``_quiet_after``).
            all_joined = frozenset(r for r, (m, _, _) in snapshot.rooms_at.items() if m == C.JOIN)
            receipts_range = moved(SyncStreamKey.RECEIPTS)
            receipts = (
                await self._receipts.ephemeral_for(user_id, joined_ids, *receipts_range) if receipts_range else {}
            )
            account_data = await account_data_read if account_data_read is not None else UserAccountData({}, {})
            to_device: list[Any] = await to_device_read if to_device_read is not None else []
            presence: list[Any] = await presence_read if presence_read is not None else []
            device_lists = await devices_read if devices_read is not None else {"changed": [], "left": []}
            key_counts, fallback_types = await key_counts_read
        finally:
            for read in (rooms_read, account_data_read, to_device_read, presence_read, devices_read, key_counts_read):
                if read is not None:
                    read.addErrback(lambda _: None)  # a failure already raised above is not logged again

        rooms = {r: (m, eid) for r, (m, eid, _) in snapshot.rooms_at.items()}
        forgotten = snapshot.forgotten
        changed_rooms = {row.room_id for row in snapshot.changes}
        full_rooms_set = snapshot.full
        recent = snapshot.recent
        typing_since = _stream_position(since, SyncStreamKey.TYPING) if since is not None else 0
        typing = self._typing.changed_rooms(joined_ids, typing_since)

        join: dict[str, Any] = {}
        invite: dict[str, Any] = {}
        leave: dict[str, Any] = {}
        knock: dict[str, Any] = {}
        # Rooms' sections are built side by side: each is a few reads of its own.
        shown_rooms: list[tuple[str, list[Any], dict[str, str], bool]] = []
        builds = []
        for room_id in joined_ids:
            rows = recent.get(room_id, [])
            full = room_id in full_rooms_set
            ephemeral: list[Any] = []
            if room_id in typing:
                ephemeral.append({"type": "m.typing", "content": {"user_ids": typing[room_id]}})
            if room_id in receipts:
                ephemeral.append(receipts[room_id])
            room_ad = account_data.rooms.get(room_id, {})
            if not (full or rows or ephemeral or room_ad):
                continue
            shown_rooms.append((room_id, ephemeral, room_ad, full))
            builds.append(self._room_section(
                requester, room_id, rows, limit=limit, full=full, sync_filter=sync_filter, upto=now.events,
                initial=initial, since=since_pos if since is not None else None,
            ))
        unread = _start(self._unread_counts(user_id, [room_id for room_id, _, _, _ in shown_rooms], upto))
        wanted: list[str] = []
        # Users whose presence the user may not have had: members who joined in a timeline.
        timeline_joiners: set[str] = set()
        for (room_id, ephemeral, room_ad, full), (section, wants_summary, joiners) in zip(
            shown_rooms, await _gather(builds)
        ):
            if not (initial or full or section["timeline"]["events"] or section["state"]["events"]
                    or ephemeral or room_ad):
                # Nothing the filter lets through changed: an incremental sync leaves the room
                # out (as Synapse), rather than sending it empty.
                continue
            timeline_joiners |= joiners
            if wants_summary:
                wanted.append(room_id)
            section["ephemeral"] = {"events": ephemeral}
            section["account_data"] = {
                "events": [{"type": t, "content": json.loads(c)} for t, c in sorted(room_ad.items())]
            }
            section["unread_notifications"] = {"highlight_count": 0, "notification_count": 0}
            join[room_id] = section
        for room_id, summary in (await self._summaries(user_id, wanted)).items():
            join[room_id]["summary"] = summary
        for room_id, by_thread in (await unread).items():
            if room_id in join:
                join[room_id].update(unread_sections(by_thread, sync_filter.unread_thread_notifications))

        for room_id, (membership, event_id) in rooms.items():
            if membership == C.INVITE and (since is None or room_id in changed_rooms):
                invite[room_id] = {"invite_state": {"events": await self._invite_state(room_id, event_id)}}
            elif membership == C.KNOCK and (since is None or room_id in changed_rooms):
                knock[room_id] = {"knock_state": {"events": await self._invite_state(room_id, event_id)}}
            elif (
                membership in (C.LEAVE, C.BAN)
                and (room_id in changed_rooms if since is not None else sync_filter.include_leave)
                and room_id not in forgotten
            ):
                leave[room_id] = await self._leave_section(
                    requester, room_id, event_id, since_pos, sync_filter,
                    joined_at_since=since is not None and not full_state
                    and snapshot.memberships_at_since.get(room_id) == C.JOIN,
                )
        for room_id, row in snapshot.remote_invites.items():
            # A room this server is not in: what its invite (or the rejection) carried.
            event = event_of(row)
            if row.membership in (C.INVITE, C.KNOCK):
                state = [e for e in json.loads(row.invite_state)
                         if (e.get("type"), e.get("state_key")) != (C.MEMBER, user_id)]
                if row.membership == C.INVITE:
                    invite[room_id] = {"invite_state": {"events": [*state, strip_event(event)]}}
                else:  # a knock on a room this server is not in, with the room's knock_room_state
                    knock[room_id] = {"knock_state": {"events": [*state, strip_event(event)]}}
            elif room_id not in forgotten:
                leave[room_id] = {
                    "timeline": {
                        "events": await self._client_events.serialize(
                            [event], include_room_id=False, federation=sync_filter.federation_format
                        ),
                        "limited": False,
                        "prev_batch": now.events.to_string(),
                    },
                    "state": {"events": []},
                    "account_data": {"events": []},
                }

        if self._presence is not None and not initial:
            # The spec's "presence of users sharing a room": a room the user newly joined brings
            # its members' presence, and a member who joined a room brings theirs, even when it
            # has not changed since ``since`` (as Synapse).
            newly_shared = set(timeline_joiners)
            for room_id in sorted(full_rooms_set & join.keys()):
                newly_shared |= {member for member, membership, _ in await self._timeline.get_current_members(room_id)
                                 if membership == C.JOIN}
            newly_shared -= {user_id} | {e["sender"] for e in presence}
            if newly_shared:
                presence = presence + await self._presence.presence_events(sorted(newly_shared))

        next_batch = now.to_string()
        self._answered_rooms.set(_device_key(requester), (next_batch, all_joined))
        return {
            "next_batch": next_batch,
            "rooms": {"join": join, "invite": invite, "leave": leave, "knock": knock},
            "account_data": {
                "events": [{"type": t, "content": json.loads(c)} for t, c in sorted(account_data.global_data.items())]
                # An initial sync always has the user's push rules, the defaults until they change one.
                + ([{"type": "m.push_rules", "content": {"global": effective_rules(None, user_id)}}]
                   if since is None and "m.push_rules" not in account_data.global_data else [])
            },
            "presence": {"events": presence},
            "to_device": {"events": to_device},
            "device_lists": device_lists,
            "device_one_time_keys_count": key_counts,
            "device_unused_fallback_key_types": fallback_types,
        }

    async def _unread_counts(
        self, user_id: str, room_ids: list[str], upto: RoomPosition
    ) -> dict[str, dict[str | None, tuple[int, int]]]:
        """Per room with unread notifications: how many, and how many highlight, after the
        user's read receipt: the notification records the events writer made when it
        persisted each event under the user's push rules (homeserver/handlers/push/push.py)."""
        return await self._push.get_unread_counts(user_id, room_ids, upto=upto.maximum)

    async def _to_device(self, requester: Requester, after: int, upto: int) -> list[Any]:
        """The device's to-device messages in (after, upto]; those up to ``after`` are deleted
        (acknowledged), which is remembered so that a token seen again reads nothing."""
        messages = await self._e2e.to_device_for(requester, after, upto)
        self._to_device_acked.set(_device_key(requester), after)
        return messages

    async def _room_section(
        self,
        requester: Requester,
        room_id: str,
        rows: list[tuple[str, int]],
        *,
        limit: int,
        full: bool,
        sync_filter: SyncFilter,
        upto: RoomStreamToken,
        initial: bool,
        since: RoomPosition | None,
    ) -> tuple[dict[str, Any], bool, set[str]]:
        """The room's timeline and state, whether its summary is to be read (membership may
        have changed: a room sent whole, a gap, or a member event in the timeline), and the
        users whose join is in the timeline."""
        limited = len(rows) > limit
        rows = list(reversed(rows[:limit]))
        events = await self._client_events.load([event_id for event_id, _ in rows])
        hidden = False
        if full:
            # Incremental timelines of a room the user was already in are all visible to
            # them (a joined member sees everything under every history visibility);
            # initial and newly joined rooms may reach back past the join.
            visible = await self._visible(requester, room_id, events)
            hidden, events = len(visible) < len(events), visible
        shown = [e for e in events if sync_filter.timeline.matches(e)]
        prev_batch = room_token(rows[0][1] - 1) if rows else upto.to_string()
        if limited and len(shown) < limit and (sync_filter.timeline.selects() or hidden):
            # The filter (or history visibility) left events out: read further back for
            # ``limit`` matching ones.
            shown, limited, prev_position = await self._fill_filtered(
                requester, room_id, rows[0][1], shown, limit=limit, full=full, sync_filter=sync_filter,
                since=None if full else since,
            )
            prev_batch = room_token(prev_position - 1)
            if shown and shown[0].event_id != rows[0][0]:
                rows = [(shown[0].event_id, prev_position)]
        state_events: list[FrozenEvent] = []
        lazy = sync_filter.state.lazy_load_members
        if full or limited:
            # The state at the timeline's start: before its first event shown, or, when the
            # filter shows none, after the last event read (the state at the sync's end).
            if shown:
                state_ids = await self._client_events.state_before(shown[0].event_id)
            elif rows:
                state_ids = await self._client_events.state_after(rows[-1][0])
            else:
                state_ids = await self._events_store.get_current_state_ids(room_id)
            if not full and since is not None:
                # A gap in a room the user was in: the state that changed between ``since`` and
                # the timeline's start (the spec's "updates to the state"), not all of it. Lazy
                # loading still gives the timeline's senders below, changed or not.
                at_since = await self._state_at(room_id, since)
                state_ids = {key: event_id for key, event_id in state_ids.items()
                             if at_since.get(key) != event_id or (lazy and key[0] == C.MEMBER)}
            state_events = await self._state_events(requester, state_ids, shown, sync_filter)
            if lazy and not full:
                sent = self._members_sent(requester, room_id, sync_filter)
                state_events = [e for e in state_events
                                if e.type != C.MEMBER or sent.get(e.state_key or "") != e.event_id]
        elif lazy and shown:
            # An incremental timeline with no gap: other state changes are in the timeline, but
            # the members of its senders (and the user's own) come in ``state``, as Synapse.
            state_events = await self._lazy_member_state(requester, room_id, rows[0][0], events, shown, sync_filter)
        if lazy:
            self._remember_members(requester, room_id, [e for e in state_events + shown if e.type == C.MEMBER],
                                   reset=initial or full)
        section = {
            "timeline": {
                "events": await self._client_events.serialize(
                    shown, access_token_id=requester.access_token_id, include_room_id=False,
                    federation=sync_filter.federation_format, bundle_for=requester.user_id,
                ),
                # A room newly joined in an incremental sync is limited unless its timeline starts
                # at the room's creation: the client has none of the history before it (Synapse
                # marks every newly joined room limited).
                "limited": limited or (full and not initial and not (shown and shown[0].type == C.CREATE)),
                "prev_batch": prev_batch,
            },
            "state": {"events": await self._client_events.serialize(
                state_events, include_room_id=False, federation=sync_filter.federation_format
            )},
            "summary": {},  # filled by ``_summaries`` when wanted
        }
        joiners = {e.state_key for e in events if e.type == C.MEMBER and e.state_key is not None
                   and e.state_key != requester.user_id and e.content.get("membership") == C.JOIN}
        return section, full or limited or any(e.type == C.MEMBER for e in events), joiners

    async def _fill_filtered(
        self,
        requester: Requester,
        room_id: str,
        oldest: int,
        shown: list[FrozenEvent],
        *,
        limit: int,
        full: bool,
        sync_filter: SyncFilter,
        since: RoomPosition | None,
    ) -> tuple[list[FrozenEvent], bool, int]:
        """``shown`` (the matching events from position ``oldest`` on) completed with earlier
        matching events (after ``since``, or all history for a room sent whole) up to ``limit``:
        the events, whether more remain, and the position of the first event returned (or of
        where the search stopped), as Synapse fills a filtered timeline."""
        earlier: list[FrozenEvent] = []
        positions: dict[str, int] = {}
        for _ in range(FILTERED_ROUNDS):
            batch = await self._timeline.get_room_events(
                room_id, start=oldest - 1, end=since, limit=FILTERED_BATCH, backwards=True
            )
            if not batch:
                break
            oldest = batch[-1][1]
            positions.update(batch)
            events = await self._client_events.load([event_id for event_id, _ in reversed(batch)])
            if full:
                events = await self._visible(requester, room_id, events)
            earlier = [e for e in events if sync_filter.timeline.matches(e)] + earlier
            if len(earlier) + len(shown) > limit:
                kept = (earlier + shown)[-limit:]
                return kept, True, positions.get(kept[0].event_id, oldest)
            if len(batch) < FILTERED_BATCH:
                break
        else:
            return earlier + shown, True, oldest  # searched enough: a gap remains before
        kept = earlier + shown
        first = positions.get(kept[0].event_id, oldest) if earlier else oldest
        return kept, False, first

    async def _summaries(self, user_id: str, room_ids: list[str]) -> dict[str, dict[str, Any]]:
        """The spec's room summary per room: member counts, and as heroes the first joined or
        invited members other than the user by stream ordering (left and banned ones when there
        are none), as Synapse. One read for all the rooms."""
        found = await self._timeline.get_room_summaries(room_ids, candidates=MAX_HEROES + 1)
        summaries: dict[str, dict[str, Any]] = {}
        for room_id, room in found.items():
            others = [(member, membership) for member, membership in room.members if member != user_id]
            present = [member for member, membership in others if membership in (C.JOIN, C.INVITE)]
            heroes = present or [member for member, _ in others]
            summaries[room_id] = {
                "m.heroes": heroes[:MAX_HEROES],
                "m.joined_member_count": room.joined,
                "m.invited_member_count": room.invited,
            }
        return summaries

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

    def _members_sent(self, requester: Requester, room_id: str, sync_filter: SyncFilter) -> dict[str, str]:
        """Member -> event ID of the lazy-loaded members already sent to this device in this room."""
        if sync_filter.include_redundant_members:
            return {}
        return dict(self._lazy_members.get((requester.user_id, requester.device_id, room_id), ()))

    def _remember_members(
        self, requester: Requester, room_id: str, members: list[FrozenEvent], *, reset: bool
    ) -> None:
        key = (requester.user_id, requester.device_id, room_id)
        known = {} if reset else dict(self._lazy_members.get(key, ()))
        known.update((e.state_key, e.event_id) for e in members if e.state_key is not None)
        if known:
            self._lazy_members.set(key, tuple(sorted(known.items())))
        elif reset:
            self._lazy_members.invalidate(key)

    async def _lazy_member_state(
        self,
        requester: Requester,
        room_id: str,
        first_event_id: str,
        events: list[FrozenEvent],
        shown: list[FrozenEvent],
        sync_filter: SyncFilter,
    ) -> list[FrozenEvent]:
        """The member events of ``shown``'s senders and of the user, as of the timeline's start,
        less those this device already has. No read when it has them all and the timeline
        changes no membership (then the state before it cannot hold newer member events)."""
        wanted = {e.sender for e in shown} | {requester.user_id}
        sent = self._members_sent(requester, room_id, sync_filter)
        if wanted <= sent.keys() and not any(e.type == C.MEMBER for e in events):
            return []
        state_ids = await self._client_events.state_before(first_event_id)
        in_timeline = {e.event_id for e in shown}
        ids = [
            event_id for (kind, member), event_id in state_ids.items()
            if kind == C.MEMBER and member in wanted and sent.get(member) != event_id and event_id not in in_timeline
        ]
        loaded = await self._client_events.load(sorted(ids))
        return [e for e in loaded if sync_filter.state.matches(e)]

    async def _invite_state(self, room_id: str, invite_event_id: str) -> list[Any]:
        keys: list[StateKey] = [(t, "") for t in INVITE_STATE_TYPES]
        ids = await self._events_store.get_current_state_for_keys(room_id, keys)
        events = await self._client_events.load(sorted(ids.values()) + [invite_event_id])
        return [strip_event(e) for e in events]

    async def _visible(self, requester: Requester, room_id: str, events: list[FrozenEvent]) -> list[FrozenEvent]:
        """The events a user joined now may see in a sync timeline: those history visibility
        allows, and, as Synapse, any that is part of the room's current state (so a member who
        joined while the user could not see the room still shows up in the timeline)."""
        visible = await self._client_events.filter_visible(requester.user_id, events, joined_now=True)
        if len(visible) == len(events):
            return visible
        seen = {e.event_id for e in visible}
        if not any(e.state_key is not None for e in events if e.event_id not in seen):
            return visible
        seen |= set((await self._events_store.get_current_state_ids(room_id)).values())
        return [e for e in events if e.event_id in seen]

    async def _state_at(self, room_id: str, position: RoomPosition) -> dict[StateKey, str]:
        """The room's state after its last event at or before ``position`` ({} when none)."""
        rows = await self._timeline.get_room_events(room_id, start=position, end=None, limit=1, backwards=True)
        return await self._client_events.state_after(rows[0][0]) if rows else {}

    async def _leave_section(
        self,
        requester: Requester,
        room_id: str,
        leave_event_id: str,
        since_pos: RoomPosition,
        sync_filter: SyncFilter,
        *,
        joined_at_since: bool,
    ) -> dict[str, Any]:
        """A left (or banned) room: its timeline up to the leave, and its state before that
        timeline: what changed since ``since`` when the user was joined then, all of it when
        they joined later (or in an initial sync's archived room), none when they never
        joined (a rejected invite), as Synapse."""
        limit = sync_filter.timeline_limit
        orderings = await self._timeline.get_stream_orderings([leave_event_id])
        left_at = orderings.get(leave_event_id, since_pos.minimum)
        rows = await self._timeline.get_room_events(room_id, start=left_at, end=since_pos, limit=limit + 1, backwards=True)
        limited = len(rows) > limit
        rows = list(reversed(rows[:limit]))
        events = await self._client_events.load([event_id for event_id, _ in rows])
        events = await self._client_events.filter_visible(requester.user_id, events, joined_now=False)
        shown = [e for e in events if sync_filter.timeline.matches(e)]
        state_events: list[FrozenEvent] = []
        before_leave = await self._client_events.state_before(leave_event_id)
        member = await self._client_events.load(
            [before_leave[(C.MEMBER, requester.user_id)]] if (C.MEMBER, requester.user_id) in before_leave else []
        )
        if member and member[0].content.get("membership") == C.JOIN:
            state_ids = await self._client_events.state_before(rows[0][0]) if rows else before_leave
            if joined_at_since:
                at_since = await self._state_at(room_id, since_pos)
                state_ids = {key: event_id for key, event_id in state_ids.items() if at_since.get(key) != event_id}
            state_events = await self._state_events(requester, state_ids, shown, sync_filter)
        return {
            "timeline": {
                "events": await self._client_events.serialize(
                    shown, access_token_id=requester.access_token_id, include_room_id=False,
                    federation=sync_filter.federation_format, bundle_for=requester.user_id,
                ),
                "limited": limited,
                "prev_batch": room_token(rows[0][1] - 1) if rows else room_token(left_at),
            },
            "state": {"events": await self._client_events.serialize(
                state_events, include_room_id=False, federation=sync_filter.federation_format
            )},
            "account_data": {"events": []},
        }


def _newly_joined(changes: Sequence[MembershipRow], at_since: Mapping[str, str]) -> set[str]:
    """The rooms a sync's membership changes (the user's, in order) newly join: a join in a room
    the user was not joined to at ``since``, or one after leaving in the same batch. A join that
    follows a join (a displayname or avatar change) joins nothing new."""
    rooms: set[str] = set()
    left: set[str] = set()
    for row in changes:
        if row.membership != C.JOIN:
            left.add(row.room_id)
        elif at_since.get(row.room_id) != C.JOIN or row.room_id in left:
            rooms.add(row.room_id)
    return rooms


def _device_key(requester: Requester) -> tuple[str, str]:
    return (requester.user_id, requester.device_id)


def _start(coro: Coroutine[Any, Any, T]) -> Deferred[T]:
    """Run ``coro`` now, to be awaited later (so that independent reads overlap)."""
    return Deferred.fromCoroutine(coro)


async def _gather(coros: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """Run ``coros`` side by side; their results in order. The first failure is raised
    once every one has finished, so none is left running unobserved."""
    started = [_start(coro) for coro in coros]
    results: list[T] = []
    error: BaseException | None = None
    for deferred in started:
        try:
            results.append(await deferred)
        except Exception as e:
            if error is None:
                error = e
    if error is not None:
        raise error
    return results


def _has_changes(result: Mapping[str, Any]) -> bool:
    rooms = result["rooms"]
    return bool(
        rooms["join"]
        or rooms["invite"]
        or rooms["leave"]
        or rooms["knock"]
        or result["account_data"]["events"]
        or result["to_device"]["events"]
        or result["presence"]["events"]
        or result["device_lists"]["changed"]
        or result["device_lists"]["left"]
    )
