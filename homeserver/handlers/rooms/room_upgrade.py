"""Room upgrades: ``POST /rooms/{roomId}/upgrade`` (the client-server spec's "Room Upgrades").

``RoomUpgradeHandler.upgrade`` checks the request and the upgrader's power (they must be
able to send ``m.room.tombstone`` in the old room), creates the new room from the plan of
``homeserver.events.room_upgrade`` (create event with ``predecessor``, the transferable
state, power levels), moves the room's local aliases, canonical alias and room directory
entry, sends the
tombstone, locks the old room's power levels and invites the old room's members where the
new join rule needs it. It decides nothing about which state is copied: the events core
does. Events go through ``RoomEventCreator``/``RoomHandler``, so in the worker layout each
reaches its room's event persister.
"""

# tests: tests/unit/events/test_room_upgrade.py, tests/integration/test_room_upgrade.py

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from homeserver.events import EventsError, FrozenEvent, RoomVersion, get_send_level, get_user_power_level
from homeserver.events import constants as C
from homeserver.events.room_upgrade import (
    TOMBSTONE_BODY,
    locked_power_levels,
    parse_upgrade_request,
    plan_upgrade,
    users_to_invite,
)
from homeserver.handlers.accounts.auth import Requester
from homeserver.handlers.rooms.event_loader import EventLoader
from homeserver.handlers.rooms.room_events import RoomEventCreator, RoomNotFound
from homeserver.handlers.rooms.rooms import RoomHandler, events_error, make_template, unknown_room
from storage.kernel.errors import MatrixError, forbidden
from storage.stores.directory import DirectoryStore
from storage.stores.events import EventsStore, StateKey
from storage.stores.timeline import TimelineStore

logger = logging.getLogger(__name__)


class RoomUpgradeHandler:
    def __init__(
        self,
        *,
        rooms: RoomHandler,
        room_events: RoomEventCreator,
        events_store: EventsStore,
        loader: EventLoader,
        timeline: TimelineStore,
        directory: DirectoryStore,
        clock_ms: Callable[[], int],
    ) -> None:
        self._rooms = rooms
        self._room_events = room_events
        self._events_store = events_store
        self._loader = loader
        self._timeline = timeline
        self._directory = directory
        self._clock_ms = clock_ms
        # One upgrade per room at a time in this process: a retried request waits for the
        # first and then finds the tombstone (403 for a second upgrade is not what it wants,
        # so it gets the same replacement room).
        self._locks: dict[str, asyncio.Lock] = {}

    async def _current_state(self, room_id: str) -> dict[StateKey, FrozenEvent]:
        ids = await self._events_store.get_current_state_ids(room_id)
        loaded = await self._loader.load_events(set(ids.values()))
        return {key: loaded[eid] for key, eid in ids.items() if eid in loaded}

    async def upgrade(self, requester: Requester, room_id: str, body: Mapping[str, object]) -> str:
        """Upgrade ``room_id`` as ``body`` asks; the replacement room's ID."""
        try:
            request = parse_upgrade_request(body)
        except EventsError as e:
            raise events_error(e) from None
        lock = self._locks.setdefault(room_id, asyncio.Lock())
        try:
            async with lock:
                return await self._upgrade(requester, room_id, request.new_version, request.additional_creators)
        finally:
            if not lock.locked():
                self._locks.pop(room_id, None)

    async def _upgrade(self, requester: Requester, room_id: str, new_version: RoomVersion,
                       additional_creators: tuple[str, ...]) -> str:
        user_id = requester.user_id
        try:
            old_version = await self._room_events.room_version(room_id)
        except RoomNotFound:
            raise unknown_room(room_id) from None
        state = await self._current_state(room_id)
        member = state.get((C.MEMBER, user_id))
        if member is None or member.membership != C.JOIN:
            raise forbidden("You are not in this room")
        if get_user_power_level(old_version, user_id, state) < get_send_level(state, C.TOMBSTONE, True):
            raise forbidden("You may not upgrade this room: it needs the power to send m.room.tombstone")
        tombstone = state.get((C.TOMBSTONE, ""))
        if tombstone is not None and tombstone.sender == user_id:
            replacement = tombstone.content.get("replacement_room")
            if isinstance(replacement, str) and await self._events_store.get_room_version(replacement) is not None:
                # A retry of an upgrade this user finished: the same answer.
                return replacement

        extremities = await self._events_store.get_forward_extremities(room_id)
        last_event_id = max(extremities.items(), key=lambda item: (item[1], item[0]))[0] if extremities else None
        plan = plan_upgrade(
            old_version, new_version, state, upgrader=user_id, old_room_id=room_id,
            last_event_id=last_event_id, additional_creators=additional_creators,
            upgrader_join_content=await self._rooms.profile_content(user_id),
        )
        try:
            new_room_id = await self._room_events.create_room_from_templates(new_version, user_id, plan.templates)
        except EventsError as e:
            raise events_error(e) from None
        if plan.restore_power_levels is not None:
            await self._rooms.send_as(new_room_id, make_template(C.POWER_LEVELS, plan.restore_power_levels, ""),
                                      user_id)
        logger.info("[%s] upgrading to version %s: new room %s", room_id, new_version.identifier, new_room_id)

        moved = await self._timeline.move_room_aliases(room_id, new_room_id)
        if await self._directory.is_published(room_id):
            # The room directory lists the new room instead of the old one.
            await self._directory.set_published(new_room_id, True, self._clock_ms())
            await self._directory.set_published(room_id, False, self._clock_ms())
        await self._rooms.send_as(
            room_id,
            make_template(C.TOMBSTONE, {"body": TOMBSTONE_BODY, "replacement_room": new_room_id}, ""),
            user_id,
        )
        canonical = state.get((C.CANONICAL_ALIAS, ""))
        if canonical is not None and canonical.content:
            # The aliases now point at the new room (which got this content): the old room lists none.
            await self._try_send(room_id, C.CANONICAL_ALIAS, {}, user_id)
        pl = state.get((C.POWER_LEVELS, ""))
        locked = locked_power_levels(old_version, None if pl is None else pl.content)
        if locked is not None:
            await self._try_send(room_id, C.POWER_LEVELS, locked, user_id)
        join_rules = next((t for t in plan.templates if t.type == C.JOIN_RULES), None)
        join_rule = None if join_rules is None else join_rules.content.get("join_rule")
        for invitee in users_to_invite(new_version, state, user_id, join_rule if isinstance(join_rule, str) else None):
            try:
                await self._rooms.update_membership(requester, new_room_id, invitee, C.INVITE, ratelimited=False)
            except MatrixError as e:
                logger.warning("[%s] could not invite %s to the upgraded room: %s", new_room_id, invitee, e)
        logger.info("[%s] upgraded to %s (aliases moved: %s)", room_id, new_room_id, ", ".join(moved) or "none")
        return new_room_id

    async def _try_send(self, room_id: str, event_type: str, content: Mapping[str, Any], sender: str) -> None:
        """An old-room change the spec asks for "if possible": logged when not allowed."""
        try:
            await self._rooms.send_as(room_id, make_template(event_type, content, ""), sender)
        except MatrixError as e:
            logger.info("[%s] could not send %s while upgrading: %s", room_id, event_type, e)
