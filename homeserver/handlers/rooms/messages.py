"""Room history for clients: ``/messages`` pagination and ``/context`` around one event.

Pagination tokens are room stream positions (``RoomStreamToken``, ``s{n}``):
position ``n`` means "just after the event with stream ordering ``n``".
Backwards from ``n`` returns orderings ``<= n``, newest first; forwards returns
``> n``, oldest first. ``/sync`` tokens are accepted too (their events
component), and with several event persisters a token is a position per
writer (``m{min}~{id}.{pos}``), each event compared with its own writer's.
Only events the history-visibility rules let the user see are returned.
"""

# tests: tests/integration/test_client_rooms.py, tests/integration/test_client_messages.py, tests/integration/test_client_peeking.py

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

import attrs

from homeserver.events import FrozenEvent
from homeserver.events import constants as C
from homeserver.handlers.accounts.auth import Requester
from homeserver.handlers.rooms.client_events import ClientEvents
from homeserver.handlers.rooms.rooms import unknown_room
from storage.kernel.errors import forbidden, invalid_param, not_found
from storage.stores.events import EventsStore
from storage.stores.timeline import RoomPosition, TimelineStore
from storage.room_tokens import RoomTokens
from storage.tokens import InvalidTokenError, RoomStreamToken, StreamToken

MAX_LIMIT = 1000
BACKFILL_ROUNDS: Final = 2
"""Times one backwards ``/messages`` request may fetch history over federation."""

Backfill = Callable[[str, int], Awaitable[int]]
"""``(room_id, limit) -> events stored``: older history of the room from another server."""


@attrs.frozen
class EventFilter:
    """The parts of a RoomEventFilter we honour."""

    limit: int | None = None
    types: tuple[str, ...] | None = None
    not_types: tuple[str, ...] = ()
    senders: tuple[str, ...] | None = None
    not_senders: tuple[str, ...] = ()
    lazy_load_members: bool = False

    def selects(self) -> bool:
        """Whether the filter can leave events out (by type or sender)."""
        return self.types is not None or bool(self.not_types) or self.senders is not None or bool(self.not_senders)

    def matches(self, event: FrozenEvent) -> bool:
        if self.types is not None and not any(_type_matches(p, event.type) for p in self.types):
            return False
        if any(_type_matches(p, event.type) for p in self.not_types):
            return False
        if self.senders is not None and event.sender not in self.senders:
            return False
        return event.sender not in self.not_senders


def _type_matches(pattern: str, event_type: str) -> bool:
    if pattern.endswith("*"):
        return event_type.startswith(pattern[:-1])
    return pattern == event_type


def _str_list(value: object, name: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise invalid_param(f"filter '{name}' must be a list of strings")
    return tuple(value)


def parse_event_filter(value: object) -> EventFilter:
    if value is None:
        return EventFilter()
    if not isinstance(value, dict):
        raise invalid_param("filter must be a JSON object")
    limit = value.get("limit")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise invalid_param("filter 'limit' must be a non-negative integer")
    lazy = value.get("lazy_load_members", False)
    if not isinstance(lazy, bool):
        raise invalid_param("filter 'lazy_load_members' must be a boolean")
    return EventFilter(
        limit=limit,
        types=_str_list(value.get("types"), "types"),
        not_types=_str_list(value.get("not_types"), "not_types") or (),
        senders=_str_list(value.get("senders"), "senders"),
        not_senders=_str_list(value.get("not_senders"), "not_senders") or (),
        lazy_load_members=lazy,
    )


async def parse_pagination_token(text: str, room_tokens: RoomTokens) -> RoomPosition:
    """A stream position from a ``/messages`` or ``/sync`` token; 400 ``M_INVALID_PARAM`` otherwise.

    ``b{n}`` is position ``-n``: backfilled history, stored with negative stream orderings."""
    if text.startswith("b") and 1 < len(text) <= 20 and text[1:].isascii() and text[1:].isdigit():
        return RoomPosition.at(-int(text[1:]))
    try:
        token = StreamToken.parse(text).events if "_" in text else RoomStreamToken.parse(text)
        return await room_tokens.position(token)
    except InvalidTokenError as e:
        raise invalid_param(str(e)) from None


# The "membership" of a user who was never in a world_readable room they read (peeking).
PEEKING: Final = "peek"


def room_token(position: int) -> str:
    if position < 0:
        return f"b{-position}"
    return RoomStreamToken.at(position).to_string()


class MessagesHandler:
    def __init__(
        self,
        *,
        events_store: EventsStore,
        timeline: TimelineStore,
        client_events: ClientEvents,
        room_tokens: RoomTokens,
        backfill: Backfill | None,
    ) -> None:
        self._events_store = events_store
        self._timeline = timeline
        self._client_events = client_events
        self._room_tokens = room_tokens
        # Where older history comes from when a room's runs out here (federation's backfill).
        self._backfill = backfill

    def _token(self, position: RoomPosition) -> str:
        if not position.ahead:
            return room_token(position.minimum)
        return self._room_tokens.token(position).to_string()

    async def _membership(self, requester: Requester, room_id: str) -> str:
        """The user's current membership; ``PEEKING`` for a user never in a room whose current
        history visibility is ``world_readable`` (the spec's peeking: history visibility then
        decides event by event); 403 if they were never in any other room."""
        if await self._events_store.get_room_version(room_id) is None:
            raise unknown_room(room_id)
        rooms = await self._timeline.get_rooms_for_user(requester.user_id)
        entry = rooms.get(room_id)
        if entry is None:
            if await self.world_readable(room_id):
                return PEEKING
            raise forbidden("You are not in this room")
        return entry[0]

    async def membership(self, requester: Requester, room_id: str) -> str:
        """The user's current membership of a room they may read (``PEEKING`` when never in a
        world_readable one); 404 for an unknown room, 403 for one they may not read."""
        return await self._membership(requester, room_id)

    async def visible(self, requester: Requester, membership: str, events: Sequence[FrozenEvent]) -> list[FrozenEvent]:
        """The events the history-visibility rules let the user see (``membership`` as above)."""
        return await self._visible(requester, membership, events)

    async def world_readable(self, room_id: str) -> bool:
        """Whether the room's current ``m.room.history_visibility`` is ``world_readable``."""
        ids = await self._events_store.get_current_state_for_keys(room_id, [(C.HISTORY_VISIBILITY, "")])
        loaded = await self._client_events.load(list(ids.values()))
        return bool(loaded) and loaded[0].content.get("history_visibility") == C.WORLD_READABLE

    async def _visible(self, requester: Requester, membership: str, events: Sequence[FrozenEvent]) -> list[FrozenEvent]:
        return await self._client_events.filter_visible(requester.user_id, events, joined_now=membership == C.JOIN)

    async def _lazy_members(self, room_id: str, events: Sequence[FrozenEvent], at_event: str | None) -> list[Any]:
        senders = {e.sender for e in events}
        if not senders:
            return []
        state = (
            await self._client_events.state_after(at_event)
            if at_event is not None
            else await self._events_store.get_current_state_ids(room_id)
        )
        ids = [eid for (etype, key), eid in state.items() if etype == C.MEMBER and key in senders]
        return await self._client_events.serialize(await self._client_events.load(sorted(ids)))

    async def get_messages(
        self,
        requester: Requester,
        room_id: str,
        *,
        from_token: str | None,
        to_token: str | None,
        direction: str,
        limit: int,
        event_filter: EventFilter,
    ) -> dict[str, Any]:
        membership = await self._membership(requester, room_id)
        backwards = direction == "b"
        current_token = self._room_tokens.current()
        if from_token is not None:
            start = await parse_pagination_token(from_token, self._room_tokens)
        else:
            start = await self._room_tokens.position(current_token) if backwards else RoomPosition.at(0)
        end = await parse_pagination_token(to_token, self._room_tokens) if to_token is not None else None
        if membership in (C.LEAVE, C.BAN):
            # A user who left sees history up to their leave, not after it.
            rooms = await self._timeline.get_rooms_for_user(requester.user_id)
            orderings = await self._timeline.get_stream_orderings([rooms[room_id][1]])
            left_at = orderings.get(rooms[room_id][1])
            if left_at is not None:
                if backwards:
                    start = start.capped(left_at)
                else:
                    end = end.capped(left_at) if end is not None else RoomPosition.at(left_at)
        limit = min(max(limit, 0), MAX_LIMIT)
        # One row more than asked for tells whether there is more to read (the spec's `end`).
        rows = await self._timeline.get_room_events(
            room_id, start=start, end=end, limit=limit + 1, backwards=backwards
        )
        backfilled = 0
        if backwards and self._backfill is not None:
            for _ in range(BACKFILL_ROUNDS):
                if len(rows) > limit or (end is not None and rows and rows[-1][1] <= end.minimum + 1):
                    break
                fetched = await self._backfill(room_id, limit + 1 - len(rows))
                if not fetched:
                    break
                backfilled += fetched
                rows = await self._timeline.get_room_events(
                    room_id, start=start, end=end, limit=limit + 1, backwards=True
                )
        more = len(rows) > limit
        rows = rows[:limit]
        events = await self._client_events.load([event_id for event_id, _ in rows])
        events = [e for e in await self._visible(requester, membership, events) if event_filter.matches(e)]
        chunk = await self._client_events.serialize(events, access_token_id=requester.access_token_id,
                                                    bundle_for=requester.user_id)
        out: dict[str, Any] = {"chunk": chunk, "start": self._token(start)}
        # `end` only while there is more to read; omitted at the start (backwards) or the
        # newest event (forwards). A round of backfill may have left more on the remote side.
        if (more or backfilled) and rows:
            last = rows[-1][1]
            out["end"] = room_token(last - 1 if backwards else last)
        elif more:
            out["end"] = out["start"]  # limit=0: nothing read, all still to read
        if event_filter.lazy_load_members:
            out["state"] = await self._lazy_members(room_id, events, None)
        return out

    async def get_context(
        self, requester: Requester, room_id: str, event_id: str, *, limit: int, event_filter: EventFilter
    ) -> dict[str, Any]:
        membership = await self._membership(requester, room_id)
        loaded = await self._client_events.load([event_id])
        if not loaded or loaded[0].room_id != room_id or await self._timeline.get_hidden_events([event_id]):
            raise not_found("Event not found")
        if not await self._visible(requester, membership, loaded):
            raise not_found("Event not found")
        orderings = await self._timeline.get_stream_orderings([event_id])
        position = orderings[event_id]
        limit = min(max(limit, 0), MAX_LIMIT)
        before_n = limit // 2
        after_n = limit - before_n
        before_rows = await self._timeline.get_room_events(
            room_id, start=position - 1, end=None, limit=before_n, backwards=True
        )
        after_rows = await self._timeline.get_room_events(
            room_id, start=position, end=await self._room_tokens.position(self._room_tokens.current()),
            limit=after_n, backwards=False,
        )
        before = [
            e for e in await self._visible(requester, membership, await self._client_events.load([r[0] for r in before_rows]))
            if event_filter.matches(e)
        ]
        after = [
            e for e in await self._visible(requester, membership, await self._client_events.load([r[0] for r in after_rows]))
            if event_filter.matches(e)
        ]
        token = requester.access_token_id
        last_id = after_rows[-1][0] if after_rows else event_id
        state_ids = await self._client_events.state_after(last_id)
        if event_filter.lazy_load_members:
            senders = {e.sender for e in [*before, loaded[0], *after]}
            state_ids = {k: v for k, v in state_ids.items() if k[0] != C.MEMBER or k[1] in senders}
        state = await self._client_events.load(sorted(state_ids.values()))
        return {
            "event": (await self._client_events.serialize(loaded, access_token_id=token,
                                                          bundle_for=requester.user_id))[0],
            "events_before": await self._client_events.serialize(before, access_token_id=token,
                                                                 bundle_for=requester.user_id),
            "events_after": await self._client_events.serialize(after, access_token_id=token,
                                                                bundle_for=requester.user_id),
            "start": room_token((before_rows[-1][1] - 1) if before_rows else position - 1),
            "end": room_token(after_rows[-1][1] if after_rows else position),
            "state": await self._client_events.serialize(state),
        }
