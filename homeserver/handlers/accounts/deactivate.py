"""``POST /account/deactivate``: closing an account for good.

In this order, so that nothing can undo a step already taken: the account is marked
deactivated (login answers ``403 M_USER_DEACTIVATED``, its tokens stop resolving and
the user ID stays taken; with ``erase: true`` it is also marked erased), its devices and
access tokens are deleted, the user leaves every room they are joined to, invited to or
knocking on, and, with ``erase: true`` only (as Synapse), their profile (displayname,
avatar_url) is erased. The leaves come before the profile erasure so that the erasure
sends no profile-update joins into those rooms. An erased user's events are served
pruned to users who were not joined when they were sent (``ClientEvents.filter_visible``).
"""

# tests: tests/integration/test_client_accounts.py, tests/integration/test_client_erasure.py

from __future__ import annotations

import logging
from typing import Final, Protocol

from homeserver.events import constants as C
from homeserver.handlers.accounts.auth import Requester
from homeserver.handlers.accounts.login import LoginHandler
from homeserver.handlers.accounts.profile import ProfileHandler
from storage.kernel.errors import MatrixError
from storage.stores.timeline import TimelineStore

logger = logging.getLogger(__name__)

# The memberships a deactivated user gives up by leaving.
LEFT_ON_DEACTIVATION: Final = frozenset({C.JOIN, C.INVITE, C.KNOCK})


class RoomLeaver(Protocol):
    """How a deactivated user leaves their rooms: the rooms domain's ``RoomHandler``, given at
    construction (accounts sit below rooms, so this module does not import it)."""

    async def update_membership(self, requester: Requester, room_id: str, target: str, membership: str, *,
                                ratelimited: bool = True) -> str: ...


class DeactivationHandler:
    def __init__(
        self, *, login: LoginHandler, rooms: RoomLeaver, profiles: ProfileHandler, timeline: TimelineStore
    ) -> None:
        self._login = login
        self._rooms = rooms
        self._profiles = profiles
        self._timeline = timeline

    async def deactivate(self, requester: Requester, *, erase: bool) -> None:
        user_id = requester.user_id
        await self._login.deactivate(user_id, erase=erase)
        memberships = await self._timeline.get_rooms_for_user(user_id)
        for room_id, (membership, _) in sorted(memberships.items()):
            if membership not in LEFT_ON_DEACTIVATION:
                continue
            try:
                await self._rooms.update_membership(requester, room_id, user_id, C.LEAVE, ratelimited=False)
            except MatrixError as e:
                # The account is closed already; one room that cannot be left must not stop the rest.
                logger.warning("[%s] could not leave %s on deactivation: %s", user_id, room_id, e)
        if erase:
            await self._profiles.set_displayname(requester, user_id, None)
            await self._profiles.set_avatar_url(requester, user_id, None)
