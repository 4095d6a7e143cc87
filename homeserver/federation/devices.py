"""Devices and keys between servers: serving ours (``/user/devices``, ``/user/keys/query|claim``)
and asking others' (``FederationKeyClient``).

Only users of this server are answered (their devices from the devices store,
keys from the e2e store); users of other servers are left out of the answer
(for the key endpoints) or refused with 400 (``/user/devices``). Keys we cached
from other servers' ``m.device_list_update`` EDUs are never served on. The
``stream_id`` of ``/user/devices`` is the user's newest device-list fact, the
``prev_id`` its next ``m.device_list_update`` will name.

``FederationKeyClient`` is the outbound half the e2e handler uses: every failure
(unreachable, timed out, an error status, a body that is not JSON) becomes
``KeyServerUnreachable``, which ``/keys/query`` reports in ``failures``.
"""

# tests: tests/integration/test_federation.py

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, Protocol
from urllib.parse import quote

from homeserver.remote.client import FederationClientError, HttpResponseError
from homeserver.handlers.e2e.e2e import DEFAULT_REMOTE_TIMEOUT_S, E2eHandler, KeyServerUnreachable
from homeserver.events.validation import is_local_user_id
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
        device_list_position: Callable[[], int] | None = None,
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
        stream_id = await self._store.latest_device_list_id(user_id)
        rows = await self._devices(user_id)
        keys = (await self._store.get_device_keys({user_id: []})).get(user_id, {})
        devices = []
        for row in rows:
            device: dict[str, Any] = {"device_id": row.device_id}
            if row.device_id in keys:
                device["keys"] = json.loads(keys[row.device_id].key_json)
            if row.display_name is not None:
                device["device_display_name"] = row.display_name
            devices.append(device)
        answer: dict[str, Any] = {"user_id": user_id, "stream_id": stream_id, "devices": devices}
        if self._e2e.cross_signing is not None:
            cross = await self._e2e.cross_signing.keys_for_query(user_id, [user_id])
            for field, one in (("master_keys", "master_key"), ("self_signing_keys", "self_signing_key")):
                if user_id in cross[field]:
                    answer[one] = cross[field][user_id]
        return answer

    async def query_keys(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """``POST /user/keys/query``: the device keys of the local users asked for."""
        wanted = body.get("device_keys")
        if not isinstance(wanted, dict) or len(wanted) > MAX_QUERY_USERS:
            raise bad_json("'device_keys' must be an object of user ID -> device IDs")
        local: dict[str, list[str]] = {}
        for user, devices in wanted.items():
            if self._local(user):
                if not isinstance(devices, list) or not all(isinstance(d, str) for d in devices):
                    raise bad_json("each user's device IDs must be a list of strings")
                local[user] = devices
        answer: dict[str, Any] = {"device_keys": await self._e2e.local_device_keys(local)}
        if self._e2e.cross_signing is not None:
            # Another server sees what any other user would: no user-signing keys.
            cross = await self._e2e.cross_signing.keys_for_query("", list(local))
            answer["master_keys"] = cross["master_keys"]
            answer["self_signing_keys"] = cross["self_signing_keys"]
        return answer

    async def claim_keys(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """``POST /user/keys/claim``: one one-time key per (local user, device, algorithm)."""
        wanted = body.get("one_time_keys")
        if not isinstance(wanted, dict) or len(wanted) > MAX_QUERY_USERS:
            raise bad_json("'one_time_keys' must be an object of user ID -> device ID -> algorithm")
        local = {user: devices for user, devices in wanted.items() if self._local(user)}
        answer = await self._e2e.claim_keys({"one_time_keys": local})
        return {"one_time_keys": answer["one_time_keys"]}


class KeyClient(Protocol):
    """What ``FederationKeyClient`` needs of ``FederationClient``."""

    async def get_json(self, destination: str, path: str, query: Mapping[str, Any] | None = None, *,
                       signed: bool = True, timeout: float | None = None) -> Any: ...

    async def post_json(self, destination: str, path: str, content: Any, *, signed: bool = True,
                        timeout: float | None = None) -> Any: ...


class FederationKeyClient:
    """The e2e handler's ``RemoteKeys``: ``/user/devices``, ``/user/keys/query`` and ``/user/keys/claim``
    on another server."""

    def __init__(self, client: KeyClient, *, timeout: float = DEFAULT_REMOTE_TIMEOUT_S) -> None:
        self._client = client
        self._timeout = timeout

    async def user_devices(self, user_id: str) -> Any:
        server = user_id.partition(":")[2]
        path = f"/_matrix/federation/v1/user/devices/{quote(user_id, safe='')}"
        return await self._ask(server, self._client.get_json(server, path, timeout=self._timeout))

    async def query_keys(self, server: str, device_keys: Mapping[str, list[str]], timeout: float) -> Any:
        return await self._ask(server, self._client.post_json(
            server, "/_matrix/federation/v1/user/keys/query", {"device_keys": dict(device_keys)}, timeout=timeout))

    async def claim_keys(self, server: str, one_time_keys: Mapping[str, Any], timeout: float) -> Any:
        return await self._ask(server, self._client.post_json(
            server, "/_matrix/federation/v1/user/keys/claim", {"one_time_keys": dict(one_time_keys)}, timeout=timeout))

    @staticmethod
    async def _ask(server: str, request: Awaitable[Any]) -> Any:
        try:
            return await request
        except HttpResponseError as e:
            raise KeyServerUnreachable(e.code, f"{server[:255]} answered {e.code}") from None
        except FederationClientError as e:
            raise KeyServerUnreachable(503, f"Could not reach {server[:255]}: {str(e)[:200]}") from None
        except ValueError as e:  # a body that is not JSON
            raise KeyServerUnreachable(502, f"{server[:255]} sent no JSON: {str(e)[:200]}") from None
