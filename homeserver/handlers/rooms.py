"""Rooms for local clients: creation, aliases, membership, sending, state and single-event reads.

``RoomHandler`` turns client requests into ``EventTemplate``s for
``RoomEventCreator`` and reads room state back, deciding who may see what.
Events core errors become ``MatrixError``s here (``AuthError`` -> 403
``M_FORBIDDEN``, an unknown room -> 404 ``M_NOT_FOUND``), so servlets only
parse and serialise. It does not know the timeline (messages.py) or sync.
"""

# tests: tests/integration/test_client_rooms.py

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from homeserver.events import (
    AuthError,
    EventsError,
    EventTemplate,
    EventTooLarge,
    FrozenEvent,
    UnsupportedRoomVersion,
    get_user_power_level,
    get_named_level,
    parse_create_room_request,
)
from homeserver.events import constants as C
from homeserver.handlers.auth import Requester
from homeserver.handlers.client_events import ClientEvents
from homeserver.handlers.event_persistence import EventPersister
from homeserver.handlers.profile import ProfileHandler
from homeserver.handlers.ratelimit import Ratelimiters, ratelimit
from homeserver.handlers.room_events import RoomEventCreator, RoomNotFound
from homeserver.handlers.validation import check_text
from homeserver.http.errors import MatrixError, bad_json, forbidden, invalid_param, not_found
from storage.stores.events import EventsStore, StateKey
from storage.stores.profiles import ProfileRow
from storage.stores.timeline import TimelineStore

logger = logging.getLogger(__name__)

MEMBERSHIP_ACTIONS = {"invite": C.INVITE, "kick": C.LEAVE, "ban": C.BAN, "unban": C.LEAVE}


def unknown_room(room_id: str) -> MatrixError:
    return not_found(f"Unknown room {room_id}")


def make_template(
    event_type: str, content: Mapping[str, Any], state_key: str | None = None, redacts: str | None = None
) -> EventTemplate:
    """An ``EventTemplate``; content that is not canonical JSON (floats, ...) is 400 ``M_BAD_JSON``."""
    try:
        return EventTemplate(type=event_type, content=content, state_key=state_key, redacts=redacts)
    except EventsError as e:
        raise events_error(e) from None
    except (TypeError, ValueError) as e:
        raise bad_json(f"Invalid event content: {e}") from None


def events_error(error: EventsError) -> MatrixError:
    """An events-core rejection as the client-server error the spec gives it."""
    if isinstance(error, AuthError):
        return forbidden(str(error))
    if isinstance(error, UnsupportedRoomVersion):
        return MatrixError(400, "M_UNSUPPORTED_ROOM_VERSION", str(error))
    if isinstance(error, EventTooLarge):
        return MatrixError(413, "M_TOO_LARGE", str(error))
    # InvalidCreateRoomRequest, InvalidEvent and the rest: the request was malformed.
    return bad_json(str(error))


class RoomHandler:
    def __init__(
        self,
        *,
        room_events: RoomEventCreator,
        persister: EventPersister,
        events_store: EventsStore,
        timeline: TimelineStore,
        client_events: ClientEvents,
        profiles: ProfileHandler,
        server_name: str,
        clock_ms: Callable[[], int],
        ratelimiters: Ratelimiters,
    ) -> None:
        self._limits = ratelimiters
        self._room_events = room_events
        self._persister = persister
        self._events_store = events_store
        self._timeline = timeline
        self._client_events = client_events
        self._profiles = profiles
        self._server_name = server_name
        self._clock_ms = clock_ms

    # --- sending --------------------------------------------------------------------------

    async def _send(self, room_id: str, template: EventTemplate, sender: str) -> FrozenEvent:
        try:
            return await self._room_events.send(room_id, template, sender)
        except RoomNotFound:
            raise unknown_room(room_id) from None
        except EventsError as e:
            raise events_error(e) from None
        except (TypeError, ValueError) as e:
            raise bad_json(f"Invalid event: {e}") from None

    def _now(self) -> float:
        return self._clock_ms() / 1000.0

    async def _check_room(self, room_id: str) -> None:
        if await self._events_store.get_room_version(room_id) is None:
            raise unknown_room(room_id)

    async def send_event(
        self, requester: Requester, room_id: str, event_type: str, content: Mapping[str, Any], txn_id: str | None
    ) -> str:
        if txn_id is not None:
            existing = await self._timeline.get_txn_event(requester.access_token_id, txn_id)
            if existing is not None:
                return existing
        ratelimit(self._limits.message, requester.user_id, self._now())
        # An unknown room surfaces from _send as RoomNotFound -> 404.
        event = await self._send(room_id, make_template(event_type, content), requester.user_id)
        if txn_id is not None:
            await self._timeline.store_txn_event(
                requester.access_token_id, txn_id, room_id, event.event_id, requester.user_id, self._clock_ms()
            )
        return event.event_id

    async def send_state(
        self, requester: Requester, room_id: str, event_type: str, state_key: str, content: Mapping[str, Any]
    ) -> str:
        ratelimit(self._limits.message, requester.user_id, self._now())
        if event_type == C.MEMBER:
            raise forbidden("Use the membership endpoints to change m.room.member")
        template = make_template(event_type, content, state_key)
        return (await self._send(room_id, template, requester.user_id)).event_id

    async def redact(
        self, requester: Requester, room_id: str, event_id: str, txn_id: str, reason: str | None
    ) -> str:
        existing = await self._timeline.get_txn_event(requester.access_token_id, txn_id)
        if existing is not None:
            return existing
        ratelimit(self._limits.message, requester.user_id, self._now())
        await self._check_room(room_id)
        target = (await self._persister.load_events([event_id])).get(event_id)
        if target is None or target.room_id != room_id:
            raise not_found("Event not found")
        if target.sender != requester.user_id:
            state = await self._current_state_events(room_id, [(C.POWER_LEVELS, ""), (C.CREATE, "")])
            level = get_user_power_level(target.room_version, requester.user_id, state)
            if level < get_named_level(state, "redact"):
                raise forbidden("You may not redact other users' events")
        content: dict[str, Any] = {} if reason is None else {"reason": reason}
        template = make_template(C.REDACTION, content, redacts=event_id)
        redaction = await self._send(room_id, template, requester.user_id)
        await self._timeline.record_redaction(redaction.event_id, event_id, room_id)
        await self._timeline.store_txn_event(
            requester.access_token_id, txn_id, room_id, redaction.event_id, requester.user_id, self._clock_ms()
        )
        return redaction.event_id

    # --- creation and aliases ---------------------------------------------------------------

    async def create_room(self, requester: Requester, body: Mapping[str, object]) -> tuple[str, str | None]:
        try:
            request = parse_create_room_request(body)
        except EventsError as e:
            raise events_error(e) from None
        alias: str | None = None
        if request.room_alias_name is not None:
            alias = f"#{request.room_alias_name}:{self._server_name}"
            if len(alias) > 255:
                raise invalid_param("room_alias_name is too long")
            if await self._timeline.get_alias(alias) is not None:
                raise MatrixError(400, "M_ROOM_IN_USE", f"Room alias {alias} is already taken")
        join_content = await self._profile_content(requester.user_id)
        try:
            room_id = await self._room_events.create_room(
                requester.user_id, request, creator_join_content=join_content
            )
        except EventsError as e:
            raise events_error(e) from None
        if alias is not None and not await self._timeline.create_alias(alias, room_id, requester.user_id):
            raise MatrixError(400, "M_ROOM_IN_USE", f"Room alias {alias} is already taken")
        return room_id, alias

    def _check_alias(self, alias: str) -> None:
        check_text(alias, "roomAlias", max_length=255)
        if not alias.startswith("#") or ":" not in alias or len(alias) > 255:
            raise invalid_param(f"Invalid room alias {alias[:100]!r}")

    async def get_alias(self, alias: str) -> dict[str, Any]:
        self._check_alias(alias)
        entry = await self._timeline.get_alias(alias)
        if entry is None:
            raise not_found(f"Room alias {alias} not found")
        return {"room_id": entry[0], "servers": [self._server_name]}

    async def put_alias(self, requester: Requester, alias: str, room_id: str) -> None:
        self._check_alias(alias)
        if alias.split(":", 1)[1] != self._server_name:
            raise invalid_param("Room alias must be on this server")
        await self._check_room(room_id)
        if not await self._timeline.create_alias(alias, room_id, requester.user_id):
            raise MatrixError(409, "M_UNKNOWN", f"Room alias {alias} already exists")

    async def delete_alias(self, requester: Requester, alias: str) -> None:
        self._check_alias(alias)
        entry = await self._timeline.get_alias(alias)
        if entry is None:
            raise not_found(f"Room alias {alias} not found")
        room_id, creator = entry
        if creator != requester.user_id:
            state = await self._current_state_events(room_id, [(C.POWER_LEVELS, ""), (C.CREATE, "")])
            version = await self._room_events.room_version(room_id)
            if get_user_power_level(version, requester.user_id, state) < get_named_level(state, "state_default"):
                raise forbidden("You may not delete this alias")
        await self._timeline.delete_alias(alias)

    async def resolve_room(self, room_id_or_alias: str) -> str:
        check_text(room_id_or_alias, "roomIdOrAlias", max_length=255)
        if room_id_or_alias.startswith("#"):
            return str((await self.get_alias(room_id_or_alias))["room_id"])
        if not room_id_or_alias.startswith("!") or len(room_id_or_alias) > 255:
            raise invalid_param(f"Invalid room ID or alias {room_id_or_alias[:100]!r}")
        return room_id_or_alias

    # --- membership -------------------------------------------------------------------------

    async def _profile_content(self, user_id: str) -> dict[str, Any]:
        try:
            profile = await self._profiles.get_profile(user_id)
        except MatrixError:
            return {}
        out: dict[str, Any] = {}
        if profile.displayname is not None:
            out["displayname"] = profile.displayname
        if profile.avatar_url is not None:
            out["avatar_url"] = profile.avatar_url
        return out

    async def update_membership(
        self,
        requester: Requester,
        room_id: str,
        target: str,
        membership: str,
        *,
        reason: str | None = None,
        extra: Mapping[str, Any] | None = None,
        ratelimited: bool = True,
    ) -> str:
        await self._check_room(room_id)
        now = self._now()
        if not ratelimited:
            pass
        elif membership == C.JOIN and target == requester.user_id:
            ratelimit(self._limits.joins_local, requester.user_id, now)
        elif membership == C.INVITE:
            ratelimit(self._limits.invites_per_room, room_id, now)
            ratelimit(self._limits.invites_per_user, target, now)
            ratelimit(self._limits.invites_per_issuer, requester.user_id, now)
        content: dict[str, Any] = dict(extra or {})
        content["membership"] = membership
        if membership in (C.JOIN, C.INVITE):
            content.update(await self._profile_content(target))
        if reason is not None:
            content["reason"] = reason
        event = await self._send(
            room_id, make_template(C.MEMBER, content, target), requester.user_id
        )
        if membership == C.JOIN:
            await self._timeline.unforget_room(target, room_id)
        return event.event_id

    async def on_profile_changed(self, requester: Requester, profile: ProfileRow) -> None:
        """A ``ProfileHandler`` hook: send a join with the new profile into every joined room."""
        for room_id in await self.joined_rooms(profile.user_id):
            try:
                await self.update_membership(requester, room_id, profile.user_id, C.JOIN, ratelimited=False)
            except MatrixError as e:
                logger.warning("could not update %s's profile in %s: %s", profile.user_id, room_id, e)

    async def forget(self, requester: Requester, room_id: str) -> None:
        rooms = await self._timeline.get_rooms_for_user(requester.user_id)
        entry = rooms.get(room_id)
        if entry is None:
            raise not_found("You have never been in this room")
        if entry[0] in (C.JOIN, C.INVITE):
            raise MatrixError(400, "M_UNKNOWN", "You must leave the room before forgetting it")
        await self._timeline.forget_room(requester.user_id, room_id)

    async def joined_rooms(self, user_id: str) -> list[str]:
        rooms = await self._timeline.get_rooms_for_user(user_id)
        return sorted(room_id for room_id, (membership, _) in rooms.items() if membership == C.JOIN)

    # --- state reads ------------------------------------------------------------------------

    async def _current_state_events(self, room_id: str, keys: list[StateKey]) -> dict[StateKey, FrozenEvent]:
        ids = await self._events_store.get_current_state_for_keys(room_id, keys)
        loaded = await self._persister.load_events(set(ids.values()))
        return {key: loaded[eid] for key, eid in ids.items() if eid in loaded}

    async def visible_state_ids(self, requester: Requester, room_id: str) -> dict[StateKey, str]:
        """The room state the user may see: current if joined, as of their leave if they left."""
        await self._check_room(room_id)
        rooms = await self._timeline.get_rooms_for_user(requester.user_id)
        entry = rooms.get(room_id)
        if entry is not None and entry[0] == C.JOIN:
            return await self._events_store.get_current_state_ids(room_id)
        if entry is not None and entry[0] in (C.LEAVE, C.BAN):
            return await self._client_events.state_after(entry[1])
        state = await self._current_state_events(room_id, [(C.HISTORY_VISIBILITY, "")])
        hv = state.get((C.HISTORY_VISIBILITY, ""))
        if hv is not None and hv.content.get("history_visibility") == "world_readable":
            return await self._events_store.get_current_state_ids(room_id)
        raise forbidden("You are not in this room")

    async def get_state(self, requester: Requester, room_id: str) -> list[dict[str, Any]]:
        ids = await self.visible_state_ids(requester, room_id)
        events = await self._client_events.load(sorted(ids.values()))
        return await self._client_events.serialize(events)

    async def get_state_event(
        self, requester: Requester, room_id: str, event_type: str, state_key: str
    ) -> dict[str, Any]:
        ids = await self.visible_state_ids(requester, room_id)
        event_id = ids.get((event_type, state_key))
        if event_id is None:
            raise not_found("Event not found")
        events = await self._client_events.load([event_id])
        if not events:
            raise not_found("Event not found")
        served = await self._client_events.serialize(events)
        content: dict[str, Any] = served[0]["content"]
        return content

    async def get_members(
        self, requester: Requester, room_id: str, *, membership: str | None, not_membership: str | None
    ) -> list[dict[str, Any]]:
        ids = await self.visible_state_ids(requester, room_id)
        member_ids = sorted(eid for (etype, _), eid in ids.items() if etype == C.MEMBER)
        events = await self._client_events.load(member_ids)
        if membership is not None:
            events = [e for e in events if e.membership == membership]
        if not_membership is not None:
            events = [e for e in events if e.membership != not_membership]
        return await self._client_events.serialize(events)

    async def get_joined_members(self, requester: Requester, room_id: str) -> dict[str, Any]:
        await self._check_room(room_id)
        rooms = await self._timeline.get_rooms_for_user(requester.user_id)
        entry = rooms.get(room_id)
        if entry is None or entry[0] != C.JOIN:
            raise forbidden("You are not in this room")
        profiles = await self._timeline.get_joined_profiles(room_id)
        return {
            "joined": {
                user_id: {"display_name": name, "avatar_url": avatar} for user_id, (name, avatar) in profiles.items()
            }
        }

    async def get_event(self, requester: Requester, room_id: str, event_id: str) -> dict[str, Any]:
        events = await self._client_events.load([event_id])
        if not events or events[0].room_id != room_id:
            raise not_found("Event not found")
        rooms = await self._timeline.get_rooms_for_user(requester.user_id)
        entry = rooms.get(room_id)
        joined_now = entry is not None and entry[0] == C.JOIN
        visible = await self._client_events.filter_visible(requester.user_id, events, joined_now=joined_now)
        if not visible:
            raise not_found("Event not found")
        served = await self._client_events.serialize(visible, access_token_id=requester.access_token_id)
        return served[0]

