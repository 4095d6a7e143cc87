"""Devices: listing, renaming and deleting a user's sessions.

Every path that deletes devices (logout, logout/all, password change, device
deletion) ends in ``devices_deleted``: it drops the deleted access tokens from
the token cache and runs ``device_deleted_hooks``, where later stores (end-to-end
keys, device-list updates) clean up; a login's new device and a rename run
``device_changed_hooks`` (the device-list stream). The user-interactive
auth for deletion is the servlet's business, not this handler's.
"""

# tests: tests/integration/test_client_accounts.py

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

from homeserver.handlers.accounts.auth import Auth
from storage.kernel.errors import not_found
from storage.stores.devices import DeletedDevices, DeviceRow, DeviceStore

logger = logging.getLogger(__name__)

# Called with (user_id, deleted device IDs) after the deletion has committed.
DeviceDeletedHook = Callable[[str, Sequence[str]], Awaitable[None]]
# Called with (user_id, device IDs) after devices were added (a login) or renamed.
DeviceChangedHook = Callable[[str, Sequence[str]], Awaitable[None]]


class DeviceHandler:
    def __init__(self, store: DeviceStore, auth: Auth) -> None:
        self._store = store
        self._auth = auth
        self.device_deleted_hooks: list[DeviceDeletedHook] = []
        self.device_changed_hooks: list[DeviceChangedHook] = []

    async def get_devices(self, user_id: str) -> list[DeviceRow]:
        return await self._store.get_devices(user_id)

    async def get_device(self, user_id: str, device_id: str) -> DeviceRow:
        device = await self._store.get_device(user_id, device_id)
        if device is None:
            raise not_found("Unknown device")
        return device

    async def set_display_name(self, user_id: str, device_id: str, display_name: str | None) -> None:
        if not await self._store.set_display_name(user_id, device_id, display_name):
            raise not_found("Unknown device")
        await self.devices_changed(user_id, [device_id])

    async def devices_changed(self, user_id: str, device_ids: Sequence[str]) -> None:
        """Tell the hooks (the device-list stream) that devices were added or renamed."""
        for hook in self.device_changed_hooks:
            try:
                await hook(user_id, device_ids)
            except Exception:
                # The change has committed; a failing notification must not fail the request.
                logger.exception("[%s] device_changed hook %r failed", user_id, hook)

    async def delete_devices(self, user_id: str, device_ids: Sequence[str]) -> DeletedDevices:
        """Delete those of ``device_ids`` that exist (unknown IDs are ignored, as the spec allows)."""
        deleted = await self._store.delete_devices(user_id, device_ids)
        await self.devices_deleted(user_id, deleted)
        return deleted

    async def delete_all_devices(self, user_id: str) -> DeletedDevices:
        deleted = await self._store.delete_all_devices(user_id)
        await self.devices_deleted(user_id, deleted)
        return deleted

    async def devices_deleted(self, user_id: str, deleted: DeletedDevices) -> None:
        """Invalidate the deleted tokens and tell the hooks; the deletion has committed."""
        self._auth.invalidate_token_hashes(deleted.token_hashes)
        if not deleted.device_ids:
            return
        logger.info("[%s] deleted devices %s", user_id, ", ".join(deleted.device_ids))
        for hook in self.device_deleted_hooks:
            try:
                await hook(user_id, deleted.device_ids)
            except Exception:
                # The devices are gone already; one failing clean-up must not hide that.
                logger.exception("[%s] device_deleted hook %r failed", user_id, hook)
