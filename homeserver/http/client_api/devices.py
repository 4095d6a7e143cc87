"""Device servlets: GET /devices, GET/PUT/DELETE /devices/{deviceId}, POST /delete_devices.

Deleting devices needs user-interactive auth with ``m.login.password`` as the
devices' owner; ``DELETE /devices/{deviceId}`` of a device the user does not have is
a 404 before any UIA round (``/delete_devices`` ignores unknown IDs). The
UIA session is bound to the user and to the exact set of devices, so an
approval to delete one device cannot be spent on another. Guests may list, read and
rename their devices, not delete them.
"""

# tests: tests/integration/test_client_accounts.py, tests/integration/test_client_nio.py

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

from homeserver.events.validation import MAX_DEVICE_DISPLAY_NAME_LENGTH, MAX_DEVICE_ID_LENGTH, check_text
from homeserver.handlers.accounts.auth import Requester
from homeserver.handlers.accounts.devices import DeviceHandler
from homeserver.handlers.accounts.ui_auth import LOGIN_PASSWORD, UserInteractiveAuth
from homeserver.http.client_api._base import client_path, empty, optional_string
from homeserver.http.routes import Body, Call, Caller, Response, route
from homeserver.http.server import parse_json_object, parse_optional_json_object
from storage.kernel.errors import bad_json, invalid_param, missing_param
from storage.stores.devices import DeviceRow

DELETE_FLOWS: Final = ((LOGIN_PASSWORD,),)
MAX_DEVICES_PER_DELETE: Final = 1000
DEVICE: Final = client_path(r"/devices/(?P<device_id>[^/]+)")


def device_json(device: DeviceRow) -> dict[str, Any]:
    # The optional fields are sent as null rather than left out: matrix-nio requires the keys.
    return {
        "device_id": device.device_id,
        "display_name": device.display_name,
        "last_seen_ip": device.last_seen_ip,
        "last_seen_ts": device.last_seen_ts,
    }


def _check_device_id(device_id: str) -> str:
    return check_text(device_id, "device_id", max_length=MAX_DEVICE_ID_LENGTH, allow_empty=False)


def _device_id(call: Call) -> str:
    return _check_device_id(call.params["device_id"])


class DeviceServlets:
    def __init__(self, devices: DeviceHandler, uia: UserInteractiveAuth) -> None:
        self._devices = devices
        self._uia = uia

    async def _delete_with_uia(self, requester: Requester, body: Mapping[str, Any], device_ids: Sequence[str]) -> None:
        operation = "delete_devices:" + json.dumps(sorted(set(device_ids)))
        session = await self._uia.check(body.get("auth"), operation=operation, flows=DELETE_FLOWS,
                                        user_id=requester.user_id)
        if not session.has_result:
            await self._devices.delete_devices(requester.user_id, device_ids)
            session.set_result({})

    @route("GET", client_path(r"/devices"), "client_devices", caller=Caller.GUEST)
    async def get_devices(self, call: Call) -> Response:
        rows = await self._devices.get_devices(call.user.user_id)
        return 200, {"devices": [device_json(row) for row in rows]}

    @route("GET", DEVICE, "client_device", caller=Caller.GUEST)
    async def get_device(self, call: Call) -> Response:
        return 200, device_json(await self._devices.get_device(call.user.user_id, _device_id(call)))

    # The two below read their bodies after the path's device ID is checked, so a bad ID is answered first.
    @route("PUT", DEVICE, "client_device_update", caller=Caller.GUEST)
    async def put_device(self, call: Call) -> Response:
        user_id, device_id = call.user.user_id, _device_id(call)
        body = parse_json_object(call.request)
        if "display_name" in body and body["display_name"] is not None:
            name = optional_string(body, "display_name", max_length=MAX_DEVICE_DISPLAY_NAME_LENGTH)
            await self._devices.set_display_name(user_id, device_id, name)
        else:
            await self._devices.get_device(user_id, device_id)  # 404 for an unknown device all the same
        return empty()

    @route("DELETE", DEVICE, "client_device_delete", caller=Caller.USER)
    async def delete_device(self, call: Call) -> Response:
        device_id = _device_id(call)
        body = parse_optional_json_object(call.request)
        # The spec's 404 ("the current user has no device with the given ID") comes before
        # any UIA round: nobody is asked for a password to delete what is not theirs.
        await self._devices.get_device(call.user.user_id, device_id)
        await self._delete_with_uia(call.user, body, [device_id])
        return empty()

    @route("POST", client_path(r"/delete_devices"), "client_delete_devices", caller=Caller.USER, body=Body.OBJECT)
    async def post_delete_devices(self, call: Call) -> Response:
        ids = call.content.get("devices")
        if ids is None:
            raise missing_param("Missing 'devices'")
        if not isinstance(ids, list) or not all(isinstance(item, str) for item in ids):
            raise bad_json("'devices' must be a list of strings")
        if len(ids) > MAX_DEVICES_PER_DELETE:
            raise invalid_param(f"At most {MAX_DEVICES_PER_DELETE} devices can be deleted at once")
        await self._delete_with_uia(call.user, call.content, [_check_device_id(item) for item in ids])
        return empty()
