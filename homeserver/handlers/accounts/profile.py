"""Profiles: reading any local user's display name and avatar, changing your own.

``get_profile`` reads local users only (federation serves it to other
servers); ``lookup_profile``, what clients get, asks a remote user's server
through ``RemoteProfiles`` (``homeserver/federation/queries.py``: cached, 404
when the remote says so, 502 when it cannot be reached). A change runs ``profile_changed_hooks`` once stored: the rooms code will hang
the "send an updated ``m.room.member`` event into every joined room" step
there.
"""

# tests: tests/integration/test_client_accounts.py

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from homeserver.handlers.accounts.auth import Requester
from homeserver.events.validation import MAX_AVATAR_URL_LENGTH, MAX_DISPLAYNAME_LENGTH, check_text, is_local_user_id
from storage.kernel.errors import MatrixError, forbidden, not_found
from storage.stores.profiles import ProfileRow, ProfileStore

logger = logging.getLogger(__name__)

# Called with (who changed it, the profile after the change) once it is stored.
ProfileChangedHook = Callable[[Requester, ProfileRow], Awaitable[None]]


class RemoteProfiles(Protocol):
    async def query_profile(self, user_id: str) -> ProfileRow:
        """The profile of a user on another server; raises ``MatrixError`` (404, 502)."""
        ...


class ProfileHandler:
    def __init__(self, store: ProfileStore, *, server_name: str, remote: RemoteProfiles | None = None,
                 ask_services: Callable[[str], Awaitable[bool]] | None = None) -> None:
        self._store = store
        # Asks application services about an unknown user of their namespaces (they may make it).
        self._ask_services = ask_services
        self._server_name = server_name
        self._remote = remote
        self.profile_changed_hooks: list[ProfileChangedHook] = []

    async def get_profile(self, user_id: str) -> ProfileRow:
        """The profile of a local user; 404 ``M_NOT_FOUND`` for unknown and remote users."""
        if not is_local_user_id(user_id, self._server_name):
            raise not_found("Profiles of users on other servers are not available")
        profile = await self._store.get_profile(user_id)
        if profile is None and self._ask_services is not None and await self._ask_services(user_id):
            profile = await self._store.get_profile(user_id)
        if profile is None:
            raise not_found("Profile not found")
        return profile

    async def lookup_profile(self, user_id: str) -> ProfileRow:
        """Any user's profile: local from the store, remote over federation (when this process federates)."""
        if is_local_user_id(user_id, self._server_name) or self._remote is None:
            return await self.get_profile(user_id)
        return await self._remote.query_profile(user_id)

    def _check_own(self, requester: Requester, user_id: str) -> None:
        if requester.user_id != user_id:
            raise forbidden("You can only change your own profile")

    async def set_displayname(self, requester: Requester, user_id: str, displayname: str | None) -> None:
        """Set your display name; None or an empty string clears it."""
        self._check_own(requester, user_id)
        if displayname is not None:
            check_text(displayname, "displayname", max_length=MAX_DISPLAYNAME_LENGTH)
        profile = await self._store.set_displayname(user_id, displayname or None)
        await self._changed(requester, profile)

    async def set_avatar_url(self, requester: Requester, user_id: str, avatar_url: str | None) -> None:
        """Set your avatar URL; None or an empty string clears it.

        The spec types it as a URI without requiring ``mxc://`` (it is usually one), and
        Synapse stores any string within its length limit, as member events may carry
        any string too: so any text up to ``MAX_AVATAR_URL_LENGTH`` is kept.
        """
        self._check_own(requester, user_id)
        if avatar_url:
            check_text(avatar_url, "avatar_url", max_length=MAX_AVATAR_URL_LENGTH)
        profile = await self._store.set_avatar_url(user_id, avatar_url or None)
        await self._changed(requester, profile)

    async def _changed(self, requester: Requester, profile: ProfileRow | None) -> None:
        if profile is None:
            # The token is valid but the account row is gone: not the client's doing.
            raise MatrixError(404, "M_NOT_FOUND", "Profile not found")
        for hook in self.profile_changed_hooks:
            await hook(requester, profile)
