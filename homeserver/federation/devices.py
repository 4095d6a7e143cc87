"""Serving our users' devices and keys to other servers: ``/user/devices``, ``/user/keys/query|claim``.

Only users of this server are answered (their devices from the devices store,
keys from the e2e store); users of other servers are left out of the answer
(for the key endpoints) or refused with 400 (``/user/devices``). Keys we cached
from other servers' ``m.device_list_update`` EDUs are never served on.
"""

# tests: tests/integration/test_federation.py

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

from homeserver.handlers.e2e import E2eHandler
from homeserver.handlers.validation import is_local_user_id
from storage.kernel.errors import bad_json, invalid_param
from storage.stores.devices import DeviceRow
from storage.stores.e2e import E2eStore

MAX_QUERY_USERS: Final = 1000


class FederationDeviceHandler:
    def __init__(
        self,
        *,
        server_name: str,
        store: E2eStore,
        e2e: E2eHandler,
        devices: Callable[[str], Awaitable[list[DeviceRow]]],
        device_list_position: Callable[[], int],
    ) -> None:
        self._server_name = server_name
        self._store = store
        self._e2e = e2e
        self._devices = devices
        self._position = device_list_position

    def _local(self, user_id: object) -> bool:
        return isinstance(user_id, str) and is_local_user_id(user_id, self._server_name)

    async def user_devices(self, user_id: str) -> dict[str, Any]:
        """``GET /user/devices/{userId}``: every device of a local user, with its keys and name."""
        if not self._local(user_id):
            raise invalid_param(f"{user_id[:255]!r} is not a user of this server")
        rows = await self._devices(user_id)
        keys = (await self._store.get_device_keys({user_id: []})).get(user_id, {})
        devices = []
        for row in rows:
            device: dict[str, Any] = {"device_id": row.device_id, "keys": json.loads(keys[row.device_id])
                                      if row.device_id in keys else {}}
            if row.display_name is not None:
                device["device_display_name"] = row.display_name
            devices.append(device)
        return {"user_id": user_id, "stream_id": self._position(), "devices": devices}

    async def query_keys(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """``POST /user/keys/query``: the device keys of the local users asked for."""
        wanted = body.get("device_keys")
        if not isinstance(wanted, dict) or len(wanted) > MAX_QUERY_USERS:
            raise bad_json("'device_keys' must be an object of user ID -> device IDs")
        local = {user: devices for user, devices in wanted.items() if self._local(user)}
        answer = await self._e2e.query_keys({"device_keys": local})
        return {"device_keys": answer["device_keys"]}

    async def claim_keys(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """``POST /user/keys/claim``: one one-time key per (local user, device, algorithm)."""
        wanted = body.get("one_time_keys")
        if not isinstance(wanted, dict) or len(wanted) > MAX_QUERY_USERS:
            raise bad_json("'one_time_keys' must be an object of user ID -> device ID -> algorithm")
        local = {user: devices for user, devices in wanted.items() if self._local(user)}
        answer = await self._e2e.claim_keys({"one_time_keys": local})
        return {"one_time_keys": answer["one_time_keys"]}
