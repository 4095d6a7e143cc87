"""Servlets for sendToDevice, /keys/upload|query|claim|changes, cross-signing uploads and /presence/{userId}/status."""

# tests: tests/integration/test_client_e2e.py, tests/integration/test_client_rooms_fuzz.py

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from twisted.web.server import Request

from homeserver.handlers.accounts.auth import Auth
from homeserver.handlers.e2e.e2e import E2eHandler
from homeserver.handlers.ephemeral.presence import PRESENCE_STATES, PresenceHandler
from homeserver.handlers.accounts.ui_auth import LOGIN_PASSWORD, UserInteractiveAuth
from homeserver.events.validation import check_text, check_user_id
from homeserver.http.client_api.key_backup import register_key_backup_servlets
from homeserver.http.client_api._base import client_path, empty, optional_string, query_string, required_string
from storage.kernel.errors import MatrixError, invalid_param
from homeserver.http.server import Routes, parse_json_object
from homeserver.handlers.writers import Writers

MAX_ID_LENGTH: Final = 255


SIGNING_FLOWS: Final = ((LOGIN_PASSWORD,),)


def register_e2e_servlets(router: Routes, *, auth: Auth, e2e: E2eHandler, presence: PresenceHandler,
                          writers: Writers, uia: UserInteractiveAuth | None = None) -> None:
    async def send_to_device(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        event_type = check_text(params["event_type"], "eventType", max_length=MAX_ID_LENGTH, allow_empty=False)
        txn_id = check_text(params["txn_id"], "txnId", max_length=MAX_ID_LENGTH, allow_empty=False)
        await writers.to_device.send_to_device(requester, event_type, txn_id, parse_json_object(request))
        return empty()

    async def upload(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        return 200, await e2e.upload_keys(requester, parse_json_object(request))

    async def query(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        return 200, await e2e.query_keys(parse_json_object(request), requester.user_id)

    async def device_signing_upload(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        body = parse_json_object(request)
        if e2e.cross_signing is None or uia is None:
            raise MatrixError(404, "M_UNRECOGNIZED", "Cross-signing is not served by this process")
        # Replacing keys needs the password (the spec's user-interactive auth); the first upload
        # does not, as Synapse (MSC3967): a new client sets them up right after login.
        if await e2e.cross_signing.has_master_key(requester.user_id):
            operation = "device_signing_upload:" + requester.device_id
            session = await uia.check(body.get("auth"), operation=operation, flows=SIGNING_FLOWS,
                                      user_id=requester.user_id)
            if session.has_result:
                return 200, {}
            session.set_result({})
        return 200, await e2e.cross_signing.upload_signing_keys(requester, body)

    async def signatures_upload(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        if e2e.cross_signing is None:
            raise MatrixError(404, "M_UNRECOGNIZED", "Cross-signing is not served by this process")
        return 200, await e2e.cross_signing.upload_signatures(requester, parse_json_object(request))

    async def claim(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        await auth.get_user_by_req(request)
        return 200, await e2e.claim_keys(parse_json_object(request))

    async def changes(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        return 200, await e2e.key_changes(requester.user_id, query_string(request, "from"),
                                          query_string(request, "to"))

    async def get_presence(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        return 200, await presence.get_status(requester, check_user_id(params["user_id"]))

    async def put_presence(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        body = parse_json_object(request)
        state = required_string(body, "presence", max_length=32)
        if state not in PRESENCE_STATES:
            raise invalid_param(f"'presence' must be one of {sorted(PRESENCE_STATES)}")
        status_msg = optional_string(body, "status_msg", max_length=1024)
        await writers.presence.set_status(requester, check_user_id(params["user_id"]), state, status_msg)
        return empty()

    router.register(
        ["PUT"], client_path(r"/sendToDevice/(?P<event_type>[^/]+)/(?P<txn_id>[^/]+)"), send_to_device,
        "client_send_to_device",
    )  # fmt: skip
    router.register(["POST"], client_path(r"/keys/upload"), upload, "client_keys_upload")
    router.register(["POST"], client_path(r"/keys/query"), query, "client_keys_query")
    router.register(["POST"], client_path(r"/keys/claim"), claim, "client_keys_claim")
    router.register(["GET"], client_path(r"/keys/changes"), changes, "client_keys_changes")
    if e2e.key_backup is not None:
        register_key_backup_servlets(router, auth=auth, backup=e2e.key_backup)
    router.register(["POST"], client_path(r"/keys/device_signing/upload"), device_signing_upload,
                    "client_keys_device_signing_upload")
    router.register(["POST"], client_path(r"/keys/signatures/upload"), signatures_upload,
                    "client_keys_signatures_upload")
    presence_path = client_path(r"/presence/(?P<user_id>[^/]+)/status")
    router.register(["GET"], presence_path, get_presence, "client_presence")
    router.register(["PUT"], presence_path, put_presence, "client_presence_put")
