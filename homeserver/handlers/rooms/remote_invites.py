"""Invites of local users to rooms this server is not in (and their knocks on such rooms):
kept until joined, rejected or withdrawn.

An invite from another server (``PUT /invite``) names a room whose graph we do
not have, so the invite is no event of any room here. ``RemoteInvites`` keeps
it (the cosigned event and the stripped room state the inviting server sent),
across restarts, for ``/sync`` ``rooms.invite`` and for joining or rejecting
through the inviting server. Each change takes a position on the events stream,
so waiting ``/sync`` requests wake and read it once; a rejection is kept as
``leave`` so the next ``/sync`` shows the room under ``rooms.leave``; joining
drops it (the room's own state then says ``join``).
"""

# tests: tests/integration/test_federation_invite_state.py

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from homeserver.events import FrozenEvent, get_room_version, make_event
from homeserver.events.canonical import thaw
from storage.id_generators import StreamIdGenerator
from storage.stores.remote_invites import RemoteInviteRow, RemoteInviteStore

# The fields of a state event a client sees in invite_state (the spec's StrippedStateEvent).
_STRIPPED_FIELDS = ("type", "state_key", "content", "sender")


def stripped(event: Mapping[str, Any]) -> dict[str, Any] | None:
    """The stripped form of one state event (full PDU or already stripped); None when malformed."""
    if not isinstance(event, Mapping) or not all(isinstance(event.get(k), str) for k in ("type", "sender")):
        return None
    if not isinstance(event.get("state_key"), str) or not isinstance(event.get("content"), Mapping):
        return None
    return {key: thaw(event[key]) for key in _STRIPPED_FIELDS}


class RemoteInvites:
    def __init__(self, *, store: RemoteInviteStore, stream: StreamIdGenerator) -> None:
        self._store = store
        self._stream = stream

    async def record_invite(self, user_id: str, room_id: str, room_version: str, event_id: str,
                            event: dict[str, Any], invite_state: list[Any]) -> None:
        """A cosigned invite of ``user_id``; ``invite_state``: what the inviting server sent (any form)."""
        state = [s for s in (stripped(e) for e in invite_state if isinstance(e, Mapping)) if s is not None]
        await self._put(user_id, room_id, "invite", room_version, event_id, event, state)

    async def record_knock(self, user_id: str, room_id: str, room_version: str, event_id: str,
                           event: dict[str, Any], knock_state: list[Any]) -> None:
        """``user_id`` knocked (send_knock accepted it); ``knock_state``: the resident's ``knock_room_state``."""
        state = [s for s in (stripped(e) for e in knock_state if isinstance(e, Mapping)) if s is not None]
        await self._put(user_id, room_id, "knock", room_version, event_id, event, state)

    async def record_rejection(self, user_id: str, room_id: str, room_version: str, event_id: str,
                               event: dict[str, Any]) -> None:
        """``user_id`` rejected the invite (its leave event went out through the inviting server)."""
        await self._put(user_id, room_id, "leave", room_version, event_id, event, [])

    async def pending_knock(self, room_id: str, user_id: str) -> FrozenEvent | None:
        """The knock of ``user_id`` on ``room_id``, if it is still waiting for an answer."""
        row = await self._store.get(room_id, user_id)
        if row is None or row.membership != "knock":
            return None
        return event_of(row)

    async def knock_servers(self, room_id: str, user_id: str) -> list[str]:
        """Servers that can take back a pending knock: those of the room state's senders the
        resident returned (first the join rules', then the others'), then the room ID's domain."""
        row = await self._store.get(room_id, user_id)
        if row is None or row.membership != "knock":
            return []
        state = json.loads(row.invite_state)
        events = sorted((e for e in state if isinstance(e, dict)), key=lambda e: e.get("type") != "m.room.join_rules")
        servers = [str(e["sender"]).partition(":")[2] for e in events if isinstance(e.get("sender"), str)]
        servers.append(room_id.partition(":")[2])
        return [s for s in dict.fromkeys(servers) if s]

    async def forget(self, room_id: str, user_id: str) -> None:
        """``user_id`` joined the room: its own state says so from now on."""
        await self._store.delete(room_id, user_id)

    async def pending(self, room_id: str, user_id: str) -> FrozenEvent | None:
        """The invite of ``user_id`` to ``room_id``, if one is waiting."""
        row = await self._store.get(room_id, user_id)
        if row is None or row.membership != "invite":
            return None
        return event_of(row)

    async def _put(self, user_id: str, room_id: str, membership: str, room_version: str, event_id: str,
                   event: dict[str, Any], state: Sequence[dict[str, Any]]) -> None:
        async with self._stream.get_next() as stream_id:
            await self._store.put(RemoteInviteRow(
                user_id, room_id, membership, event_id, room_version,
                json.dumps(event, separators=(",", ":"), ensure_ascii=False),
                json.dumps(list(state), separators=(",", ":"), ensure_ascii=False),
                stream_id, str(self._stream.instance_name),
            ))


def event_of(row: RemoteInviteRow) -> FrozenEvent:
    """The stored invite or leave event (ours: cosigned or signed here, so its ID is trusted)."""
    return make_event(get_room_version(row.room_version), json.loads(row.event_json), trusted_event_id=row.event_id)
