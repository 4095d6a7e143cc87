"""Device servlets: GET /devices, GET/PUT/DELETE /devices/{deviceId}, POST /delete_devices.

Deleting devices needs user-interactive auth with ``m.login.password`` as the
devices' owner; ``DELETE /devices/{deviceId}`` of a device the user does not have is
a 404 before any UIA round (``/delete_devices`` ignores unknown IDs). The
UIA session is bound to the user and to the exact set of devices, so an
approval to delete one device cannot be spent on another.
"""

# tests: tests/integration/test_client_accounts.py, tests/integration/test_client_nio.py

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

from twisted.web.server import Request

from homeserver.handlers.accounts.auth import Auth
from homeserver.handlers.accounts.devices import DeviceHandler
from homeserver.handlers.accounts.ui_auth import LOGIN_PASSWORD, UserInteractiveAuth
from homeserver.events.validation import MAX_DEVICE_DISPLAY_NAME_LENGTH, MAX_DEVICE_ID_LENGTH, check_text
from homeserver.http.server import parse_optional_json_object
from homeserver.http.client_api._base import client_path, empty, optional_string
from storage.kernel.errors import bad_json, invalid_param, missing_param
from homeserver.http.server import Routes, parse_json_object
from storage.stores.devices import DeviceRow

DELETE_FLOWS: Final = ((LOGIN_PASSWORD,),)
MAX_DEVICES_PER_DELETE: Final = 1000


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


def register_device_servlets(
    router: Routes, *, auth: Auth, devices: DeviceHandler, uia: UserInteractiveAuth
) -> None:
    async def delete_with_uia(request: Request, body: Mapping[str, Any], device_ids: Sequence[str]) -> None:
        requester = await auth.get_user_by_req(request)
        operation = "delete_devices:" + json.dumps(sorted(set(device_ids)))
        session = await uia.check(body.get("auth"), operation=operation, flows=DELETE_FLOWS, user_id=requester.user_id)
        if not session.has_result:
            await devices.delete_devices(requester.user_id, device_ids)
            session.set_result({})

    async def get_devices(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        rows = await devices.get_devices(requester.user_id)
        return 200, {"devices": [device_json(row) for row in rows]}

    async def get_device(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        device = await devices.get_device(requester.user_id, _check_device_id(params["device_id"]))
        return 200, device_json(device)

    async def put_device(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        device_id = _check_device_id(params["device_id"])
        body = parse_json_object(request)
        if "display_name" in body and body["display_name"] is not None:
            name = optional_string(body, "display_name", max_length=MAX_DEVICE_DISPLAY_NAME_LENGTH)
            await devices.set_display_name(requester.user_id, device_id, name)
        else:
            await devices.get_device(requester.user_id, device_id)  # 404 for an unknown device all the same
        return empty()

    async def delete_device(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        device_id = _check_device_id(params["device_id"])
        body = parse_optional_json_object(request)
        # The spec's 404 ("the current user has no device with the given ID") comes before
        # any UIA round: nobody is asked for a password to delete what is not theirs.
        await devices.get_device(requester.user_id, device_id)
        await delete_with_uia(request, body, [device_id])
        return empty()

    async def post_delete_devices(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        body = parse_json_object(request)
        ids = body.get("devices")
        if ids is None:
            raise missing_param("Missing 'devices'")
        if not isinstance(ids, list) or not all(isinstance(item, str) for item in ids):
            raise bad_json("'devices' must be a list of strings")
        if len(ids) > MAX_DEVICES_PER_DELETE:
            raise invalid_param(f"At most {MAX_DEVICES_PER_DELETE} devices can be deleted at once")
        await delete_with_uia(request, body, [_check_device_id(item) for item in ids])
        return empty()

    device_path = client_path(r"/devices/(?P<device_id>[^/]+)")
    router.register(["GET"], client_path(r"/devices"), get_devices, "client_devices")
    router.register(["GET"], device_path, get_device, "client_device")
    router.register(["PUT"], device_path, put_device, "client_device_update")
    router.register(["DELETE"], device_path, delete_device, "client_device_delete")
    router.register(["POST"], client_path(r"/delete_devices"), post_delete_devices, "client_delete_devices")
