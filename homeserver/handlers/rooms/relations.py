"""``/relations`` and ``/threads``: the children of an event, and a room's threads.

Both read the relations index (``RelationsStore``) and serve only what the user may
see: the parent (or thread root) must be visible to them, else 404, and children
hidden by history visibility are dropped from the page. Pagination tokens are room
stream positions, as ``/messages``' (so a ``/messages`` or ``/sync`` token is accepted
as ``from``/``to`` of ``/relations``); ``/threads`` tokens are ``t{n}``: threads whose
latest reply has a stream ordering below ``n``.
"""

# tests: tests/integration/test_relations.py, tests/unit/handlers/test_aggregations.py

from __future__ import annotations

from typing import Any, Final

from homeserver.handlers.accounts.auth import Requester
from homeserver.handlers.rooms.client_events import ClientEvents
from homeserver.handlers.rooms.messages import MessagesHandler, parse_pagination_token, room_token
from homeserver.handlers.rooms.rooms import unknown_room
from storage.kernel.errors import invalid_param, not_found
from storage.room_tokens import RoomTokens
from storage.stores.events import EventsStore
from storage.stores.relations import MAX_RECURSION_DEPTH, RelationsStore
from storage.stores.timeline import TimelineStore

DEFAULT_LIMIT: Final = 5
MAX_LIMIT: Final = 100


def parse_thread_token(text: str) -> int:
    """``t{n}`` -> n; anything else is 400 ``M_INVALID_PARAM``."""
    digits = text[1:]
    if not text.startswith("t") or not digits.isascii() or not digits.isdigit() or len(digits) > 19:
        raise invalid_param(f"Invalid threads pagination token {text[:50]!r}")
    return int(digits)


class RelationsHandler:
    def __init__(
        self, *, store: RelationsStore, events_store: EventsStore, timeline: TimelineStore,
        client_events: ClientEvents, messages: MessagesHandler, room_tokens: RoomTokens,
    ) -> None:
        self._store = store
        self._events_store = events_store
        self._timeline = timeline
        self._client_events = client_events
        self._messages = messages
        self._room_tokens = room_tokens

    async def _visible_parent(self, requester: Requester, room_id: str, event_id: str) -> str:
        """The user's membership, once the parent is found visible to them; 404 otherwise."""
        membership = await self._messages.membership(requester, room_id)
        loaded = await self._client_events.load([event_id])
        if not loaded or loaded[0].room_id != room_id or await self._timeline.get_hidden_events([event_id]):
            raise not_found("Event not found")
        if not await self._messages.visible(requester, membership, loaded):
            raise not_found("Event not found")
        return membership

    async def get_relations(
        self, requester: Requester, room_id: str, event_id: str, *, relation_type: str | None,
        event_type: str | None, from_token: str | None, to_token: str | None, limit: int | None,
        direction: str, recurse: bool,
    ) -> dict[str, Any]:
        membership = await self._visible_parent(requester, room_id, event_id)
        backwards = direction == "b"
        start = await parse_pagination_token(from_token, self._room_tokens) if from_token is not None else None
        end = await parse_pagination_token(to_token, self._room_tokens) if to_token is not None else None
        limit = min(max(DEFAULT_LIMIT if limit is None else limit, 1), MAX_LIMIT)
        rows = await self._store.get_relations(
            room_id, event_id, relation_type=relation_type, event_type=event_type, start=start, end=end,
            limit=limit + 1, backwards=backwards, recurse=recurse,
        )
        more = len(rows) > limit
        rows = rows[:limit]
        events = await self._client_events.load([child for child, _ in rows])
        events = await self._messages.visible(requester, membership, events)
        out: dict[str, Any] = {
            "chunk": await self._client_events.serialize(
                events, access_token_id=requester.access_token_id, bundle_for=requester.user_id
            ),
        }
        if from_token is not None:
            out["prev_batch"] = from_token
        if more and rows:
            last = rows[-1][1]
            out["next_batch"] = room_token(last - 1 if backwards else last)
        if recurse:
            out["recursion_depth"] = MAX_RECURSION_DEPTH
        return out

    async def get_threads(
        self, requester: Requester, room_id: str, *, participated: bool, from_token: str | None, limit: int | None,
    ) -> dict[str, Any]:
        if await self._events_store.get_room_version(room_id) is None:
            raise unknown_room(room_id)
        membership = await self._messages.membership(requester, room_id)
        before = parse_thread_token(from_token) if from_token is not None else None
        limit = min(max(DEFAULT_LIMIT if limit is None else limit, 1), MAX_LIMIT)
        rows = await self._store.get_threads(
            room_id, participant=requester.user_id if participated else None, before=before, limit=limit + 1
        )
        more = len(rows) > limit
        rows = rows[:limit]
        roots = await self._client_events.load([row.root_id for row in rows])
        roots = await self._messages.visible(requester, membership, roots)
        out: dict[str, Any] = {
            "chunk": await self._client_events.serialize(
                roots, access_token_id=requester.access_token_id, bundle_for=requester.user_id
            ),
        }
        if more and rows:
            out["next_batch"] = f"t{rows[-1].latest_ordering}"
        return out
