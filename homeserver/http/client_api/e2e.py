"""Servlets for sendToDevice, /keys/upload|query|claim|changes, cross-signing uploads and /presence/{userId}/status."""

# tests: tests/integration/test_client_e2e.py, tests/integration/test_client_rooms_fuzz.py

from __future__ import annotations

from typing import Final

from homeserver.events.validation import check_text, check_user_id
from homeserver.handlers.accounts.ui_auth import LOGIN_PASSWORD, UserInteractiveAuth
from homeserver.handlers.e2e.cross_signing import CrossSigningHandler
from homeserver.handlers.e2e.e2e import E2eHandler
from homeserver.handlers.ephemeral.presence import PRESENCE_STATES, PresenceHandler
from homeserver.handlers.writers import PresenceWriter, ToDeviceWriter
from homeserver.http.client_api._base import client_path, empty, optional_string, query_string, required_string
from homeserver.http.routes import Body, Call, Caller, Response, route
from homeserver.http.server import parse_json_object
from storage.kernel.errors import MatrixError, invalid_param

MAX_ID_LENGTH: Final = 255


SIGNING_FLOWS: Final = ((LOGIN_PASSWORD,),)

PRESENCE = client_path(r"/presence/(?P<user_id>[^/]+)/status")


class ToDeviceServlets:
    def __init__(self, writer: ToDeviceWriter) -> None:
        self._writer = writer

    @route("PUT", client_path(r"/sendToDevice/(?P<event_type>[^/]+)/(?P<txn_id>[^/]+)"), "client_send_to_device",
           caller=Caller.GUEST)
    async def send_to_device(self, call: Call) -> Response:
        event_type = check_text(call.params["event_type"], "eventType", max_length=MAX_ID_LENGTH, allow_empty=False)
        txn_id = check_text(call.params["txn_id"], "txnId", max_length=MAX_ID_LENGTH, allow_empty=False)
        # The path is checked before the body (400 M_INVALID_PARAM before M_NOT_JSON), so the body is read here.
        await self._writer.send_to_device(call.user, event_type, txn_id, parse_json_object(call.request))
        return empty()


class KeysServlets:
    def __init__(self, e2e: E2eHandler) -> None:
        self._e2e = e2e

    @route("POST", client_path(r"/keys/upload"), "client_keys_upload", caller=Caller.GUEST, body=Body.OBJECT)
    async def upload(self, call: Call) -> Response:
        return 200, await self._e2e.upload_keys(call.user, call.content)

    @route("POST", client_path(r"/keys/query"), "client_keys_query", caller=Caller.GUEST, body=Body.OBJECT)
    async def query(self, call: Call) -> Response:
        return 200, await self._e2e.query_keys(call.content, call.user.user_id)

    @route("POST", client_path(r"/keys/claim"), "client_keys_claim", caller=Caller.GUEST, body=Body.OBJECT)
    async def claim(self, call: Call) -> Response:
        return 200, await self._e2e.claim_keys(call.content)

    @route("GET", client_path(r"/keys/changes"), "client_keys_changes", caller=Caller.GUEST)
    async def changes(self, call: Call) -> Response:
        request = call.request
        return 200, await self._e2e.key_changes(call.user.user_id, query_string(request, "from"),
                                                query_string(request, "to"))


def _no_cross_signing() -> MatrixError:
    return MatrixError(404, "M_UNRECOGNIZED", "Cross-signing is not served by this process")


class CrossSigningServlets:
    def __init__(self, cross_signing: CrossSigningHandler | None, uia: UserInteractiveAuth | None) -> None:
        self._cross_signing = cross_signing
        self._uia = uia

    @route("POST", client_path(r"/keys/device_signing/upload"), "client_keys_device_signing_upload",
           caller=Caller.USER, body=Body.OBJECT)
    async def device_signing_upload(self, call: Call) -> Response:
        cross_signing, uia, requester, body = self._cross_signing, self._uia, call.user, call.content
        if cross_signing is None or uia is None:
            raise _no_cross_signing()
        # Replacing keys needs the password (the spec's user-interactive auth); the first upload
        # does not, as Synapse (MSC3967): a new client sets them up right after login.
        if await cross_signing.has_master_key(requester.user_id):
            operation = "device_signing_upload:" + requester.device_id
            session = await uia.check(body.get("auth"), operation=operation, flows=SIGNING_FLOWS,
                                      user_id=requester.user_id)
            if session.has_result:
                return 200, {}
            session.set_result({})
        return 200, await cross_signing.upload_signing_keys(requester, body)

    @route("POST", client_path(r"/keys/signatures/upload"), "client_keys_signatures_upload", caller=Caller.USER)
    async def signatures_upload(self, call: Call) -> Response:
        if self._cross_signing is None:
            raise _no_cross_signing()
        # 404 before the body is looked at, as before: the body is read here.
        return 200, await self._cross_signing.upload_signatures(call.user, parse_json_object(call.request))


class PresenceServlets:
    def __init__(self, presence: PresenceHandler, writer: PresenceWriter) -> None:
        self._presence = presence
        self._writer = writer

    @route("GET", PRESENCE, "client_presence", caller=Caller.GUEST)
    async def get_presence(self, call: Call) -> Response:
        return 200, await self._presence.get_status(call.user, check_user_id(call.params["user_id"]))

    @route("PUT", PRESENCE, "client_presence_put", caller=Caller.GUEST, body=Body.OBJECT)
    async def put_presence(self, call: Call) -> Response:
        body = call.content
        state = required_string(body, "presence", max_length=32)
        if state not in PRESENCE_STATES:
            raise invalid_param(f"'presence' must be one of {sorted(PRESENCE_STATES)}")
        status_msg = optional_string(body, "status_msg", max_length=1024)
        await self._writer.set_status(call.user, check_user_id(call.params["user_id"]), state, status_msg)
        return empty()
