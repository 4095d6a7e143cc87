"""The older sync endpoints (r0.6.1 and before) that clients and bridges still call.

``GET /initialSync``, ``GET /rooms/{roomId}/initialSync`` and the ``GET /events``
long-poll are answers reshaped from the handlers that serve ``/sync`` and
``/messages`` (the one read of its own: the stream positions of the events
``/events`` answers, to leave out those at or before ``from``):

- ``initial_sync``: an initial ``/sync`` (timeline limit ``limit``), each joined
  room's ``state`` being the state before its timeline with the timeline's state
  events applied (the current state, as the old spec asks); invites carry their
  invite event (the stripped one, for an invite from another server to a room
  this server is not in); ``receipts``: the joined rooms' ``m.receipt`` events
  (as Synapse); ``archived=true`` adds left and banned rooms as
  ``room_initial_sync`` shows them (history and state up to the leave).
- ``room_initial_sync``: a backwards ``/messages`` page (oldest first in
  ``messages.chunk``, ``start`` the token to page back from, ``end`` now), the
  state ``GET /rooms/{roomId}/state`` answers, and for a joined user the
  members' presence, the room's receipts and the user's room account data.
- ``events``: an incremental ``/sync`` from ``from`` (a ``/sync`` token, or now),
  waiting until it has room events (timeline, typing, receipts) or presence, or
  until ``timeout``. ``end`` is that sync's ``next_batch`` with the to-device,
  device-list and account-data positions left at ``from``'s: ``/events`` does not
  deliver those, so a client that moves on to ``/sync`` with ``end`` still gets
  them.
- ``room_events`` (``/events?room_id=``): one room's stream, for a member or a
  peeker of a ``world_readable`` room (``SyncHandler.wait_for_room``).
"""

# tests: tests/integration/test_client_legacy.py, tests/integration/test_client_peeking.py

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from homeserver.events import constants as C
from homeserver.handlers.accounts.account_data import AccountDataHandler
from homeserver.handlers.accounts.auth import Requester
from homeserver.handlers.rooms.client_events import ClientEvents
from homeserver.handlers.rooms.messages import EventFilter, MessagesHandler, room_token
from homeserver.handlers.ephemeral.presence import PresenceHandler
from homeserver.handlers.ephemeral.receipts import ReceiptsHandler
from homeserver.handlers.rooms.rooms import RoomHandler
from homeserver.handlers.sync.sync import MAX_TIMELINE_LIMIT, SyncFilter, SyncHandler
from storage.room_tokens import RoomTokens
from storage.stores.timeline import TimelineStore
from storage.kernel.errors import forbidden
from storage.tokens import StreamToken, SyncStreamKey

# Room events one /events answer carries per room (a room with more since ``from``
# shows its newest ones, as a limited /sync timeline would).
EVENTS_PER_ROOM: Final = 100
# Streams /events does not deliver: ``end`` keeps ``from``'s position for them.
NOT_IN_EVENTS: Final = (SyncStreamKey.TO_DEVICE, SyncStreamKey.DEVICE_LISTS, SyncStreamKey.ACCOUNT_DATA)


class LegacySyncHandler:
    def __init__(
        self,
        *,
        sync: SyncHandler,
        messages: MessagesHandler,
        rooms: RoomHandler,
        timeline: TimelineStore,
        client_events: ClientEvents,
        receipts: ReceiptsHandler,
        presence: PresenceHandler,
        account_data: AccountDataHandler,
        room_tokens: RoomTokens,
    ) -> None:
        self._sync = sync
        self._messages = messages
        self._rooms = rooms
        self._timeline = timeline
        self._client_events = client_events
        self._receipts = receipts
        self._presence = presence
        self._account_data = account_data
        self._room_tokens = room_tokens

    async def room_initial_sync(self, requester: Requester, room_id: str, *, limit: int) -> dict[str, Any]:
        user_id = requester.user_id
        # 404 for an unknown room, 403 for one the user may not see (as GET /state).
        state = await self._rooms.get_state(requester, room_id)
        # None: never in the room, which get_state allowed as it is world_readable (peeking).
        membership = (await self._timeline.get_rooms_for_user(user_id)).get(room_id, (None, ""))[0]
        # The page ends at this position: the /sync token now, read before the page.
        now = self._sync.current_token().to_string()
        page = await self._messages.get_messages(
            requester, room_id, from_token=now, to_token=None, direction="b", limit=limit, event_filter=EventFilter()
        )
        out: dict[str, Any] = {
            "room_id": room_id,
            "messages": {
                "chunk": list(reversed(page["chunk"])),
                # No "end" from /messages: the history is all here; paging back from s0 finds nothing.
                "start": page.get("end", room_token(0)),
                # A /sync token (as Synapse's): /messages pages forward from it and /events
                # (with room_id, as a peeker or guest does) follows the room from it.
                "end": now,
            },
            "state": state,
            "presence": [],
            "receipts": [],
            "account_data": await self._account_data.room_events(user_id, room_id),
        }
        if membership is not None:
            out["membership"] = membership
        if membership == C.JOIN or membership is None:
            # A member, or a peeker of a world_readable room: what the room shows its members.
            members = await self._timeline.get_current_members(room_id)
            out["presence"] = await self._presence.presence_events(u for u, m, _ in members if m == C.JOIN)
            receipts = await self._receipts.ephemeral_for(user_id, [room_id], 0, self._receipts.current_position())
            out["receipts"] = [receipts[room_id]] if room_id in receipts else []
        return out

    async def initial_sync(self, requester: Requester, *, limit: int, archived: bool) -> dict[str, Any]:
        limit = max(0, min(limit, MAX_TIMELINE_LIMIT))
        result = await self._sync.sync(
            requester, None, full_state=False, sync_filter=SyncFilter(timeline_limit=max(1, limit))
        )
        end = result["next_batch"]
        rooms: list[dict[str, Any]] = []
        for room_id, section in result["rooms"]["join"].items():
            timeline = [{**e, "room_id": room_id} for e in section["timeline"]["events"]]
            current: dict[tuple[str, str], dict[str, Any]] = {}
            for event in [*({**e, "room_id": room_id} for e in section["state"]["events"]), *timeline]:
                if "state_key" in event:
                    current[(event["type"], event["state_key"])] = event
            rooms.append({
                "room_id": room_id,
                "membership": C.JOIN,
                "messages": {
                    "chunk": timeline[len(timeline) - limit:] if limit else [],
                    "start": section["timeline"]["prev_batch"] if limit else end,
                    "end": end,
                },
                "state": list(current.values()),
                "account_data": section["account_data"]["events"],
            })
        memberships = await self._timeline.get_rooms_for_user(requester.user_id)
        for room_id, (membership, event_id) in sorted(memberships.items()):
            if membership == C.INVITE:
                invite = await self._client_events.serialize(await self._client_events.load([event_id]))
                rooms.append({"room_id": room_id, "membership": C.INVITE, "invite": invite[0] if invite else None,
                              "inviter": invite[0]["sender"] if invite else None})
            elif archived and membership in (C.LEAVE, C.BAN):
                rooms.append(await self.room_initial_sync(requester, room_id, limit=limit))
        for room_id, section in sorted(result["rooms"]["invite"].items()):
            if room_id not in memberships:
                # An invite from another server to a room this server is not in: the stripped
                # invite event its server sent is all there is.
                stripped = section["invite_state"]["events"][-1]
                rooms.append({"room_id": room_id, "membership": C.INVITE, "invite": {**stripped, "room_id": room_id},
                              "inviter": stripped.get("sender")})
        return {
            "end": end,
            "rooms": rooms,
            "presence": result["presence"]["events"],
            "account_data": result["account_data"]["events"],
            # Synapse answers the joined rooms' read receipts too.
            "receipts": [
                {**e, "room_id": room_id}
                for room_id, section in result["rooms"]["join"].items()
                for e in section["ephemeral"]["events"] if e["type"] == "m.receipt"
            ],
        }

    async def room_events(
        self, requester: Requester, room_id: str, from_token: StreamToken | None, *, timeout_ms: int
    ) -> dict[str, Any]:
        """``/events?room_id=``: that room's stream only, for a member or, when the room's history
        is ``world_readable``, anyone (peeking, as Synapse); 403 otherwise, 404 for an unknown room."""
        membership = (await self._timeline.get_rooms_for_user(requester.user_id)).get(room_id, (None, ""))[0]
        if membership != C.JOIN:
            # A user who is not joined peeks, which history visibility must allow (404 unknown room).
            await self._rooms.get_state(requester, room_id)
            if not await self._messages.world_readable(room_id):
                raise forbidden("You are not in this room and its history is not world_readable")
        since = from_token if from_token is not None else self._sync.current_token()
        chunk, now = await self._sync.wait_for_room(
            requester, room_id, since, timeout_ms=timeout_ms, joined=membership == C.JOIN, limit=EVENTS_PER_ROOM
        )
        end = now
        for key in NOT_IN_EVENTS:
            end = end.replace(key, since.get(key))
        return {"chunk": [_legacy_presence(e) for e in chunk], "start": since.to_string(), "end": end.to_string()}

    async def events(self, requester: Requester, from_token: StreamToken | None, *, timeout_ms: int) -> dict[str, Any]:
        since = from_token if from_token is not None else self._sync.current_token()
        result = await self._sync.wait_for_sync(
            requester,
            since,
            timeout_ms=timeout_ms,
            full_state=False,
            sync_filter=SyncFilter(timeline_limit=EVENTS_PER_ROOM),
            wanted=lambda r: bool(_stream_chunk(r)),
        )
        chunk = _stream_chunk(result)
        # A room joined since ``from`` comes with the history before the join (an initial
        # timeline): /events carries only what is newer than ``from``.
        since_at = await self._room_tokens.position(since.events)
        positions = await self._timeline.get_event_positions([e["event_id"] for e in chunk if "event_id" in e])
        chunk = [e for e in chunk if not (e.get("event_id") in positions and since_at.covers(*positions[e["event_id"]]))]
        end = StreamToken.parse(result["next_batch"])
        for key in NOT_IN_EVENTS:
            end = end.replace(key, since.get(key))
        return {"chunk": chunk, "start": since.to_string(), "end": end.to_string()}


def _stream_chunk(result: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The events of a ``/sync`` answer as the ``/events`` stream carries them: each room's
    timeline and ephemeral events with their ``room_id``, then presence."""
    chunk: list[dict[str, Any]] = []
    rooms = result["rooms"]
    for room_id, section in rooms["join"].items():
        chunk.extend({**e, "room_id": room_id} for e in section["timeline"]["events"])
        chunk.extend({**e, "room_id": room_id} for e in section["ephemeral"]["events"])
    for room_id, section in rooms["leave"].items():
        chunk.extend({**e, "room_id": room_id} for e in section["timeline"]["events"])
    chunk.extend(_legacy_presence(e) for e in result["presence"]["events"])
    return chunk


def _legacy_presence(event: dict[str, Any]) -> dict[str, Any]:
    """An ``m.presence`` event as the older endpoints gave it: ``content.user_id`` too."""
    if event.get("type") != "m.presence" or "sender" not in event:
        return event
    return {**event, "content": {**event["content"], "user_id": event["sender"]}}
