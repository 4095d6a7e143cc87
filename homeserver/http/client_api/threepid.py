"""Third-party identifier (3PID) servlets, for a server with no email or SMS sending and no identity server.

This server keeps no 3PIDs and talks to no identity server, so every endpoint
answers what the spec allows for that case, after checking the request like any
other (hostile input gets its 4xx, never a change):

- ``GET /account/3pid``: ``{"threepids": []}``.
- ``POST /account/3pid/{email,msisdn}/requestToken``, ``/register/{email,msisdn}/requestToken``,
  ``/account/password/{email,msisdn}/requestToken``: the body is validated, then
  ``400 M_THREEPID_MEDIUM_NOT_SUPPORTED`` (Synapse without email configuration answers 400 too,
  with ``M_UNKNOWN``; the spec's code for an unsupported medium is used here).
- ``POST /account/3pid/add``: user-interactive auth (``m.login.password``), then
  ``400 M_THREEPID_AUTH_FAILED``: no validation session (``sid``) can exist here (as Synapse).
- ``POST /account/3pid/bind``: ``400 M_SERVER_NOT_TRUSTED``: no identity server is trusted.
- ``POST /account/3pid/delete`` and ``/unbind``: nothing is bound, so
  ``{"id_server_unbind_result": "no-support"}`` (as Synapse when it unbinds from no server).
"""

# tests: tests/integration/test_client_threepid.py

from __future__ import annotations

import re
from typing import Final

from homeserver.handlers.accounts.ui_auth import LOGIN_PASSWORD, UserInteractiveAuth
from homeserver.http.client_api._base import client_path, optional_string, required_string
from homeserver.http.routes import Body, Call, Caller, Response, route
from homeserver.http.server import JsonDict
from storage.kernel.errors import MatrixError, bad_json, invalid_param, missing_param

MEDIUMS: Final = ("email", "msisdn")
MAX_THREEPID_FIELD_LENGTH: Final = 255
MAX_ID_SERVER_LENGTH: Final = 255
ADD_FLOWS: Final = ((LOGIN_PASSWORD,),)
# The spec's grammar for ``client_secret`` and ``sid``.
_SECRET_RE: Final = re.compile(r"[0-9a-zA-Z.=_-]{1,255}")
_NO_UNBIND: Final = {"id_server_unbind_result": "no-support"}
REQUEST_TOKEN: Final = r"/(?P<medium>email|msisdn)/requestToken"


def _secret(body: JsonDict, key: str) -> str:
    value = required_string(body, key, max_length=MAX_THREEPID_FIELD_LENGTH, allow_empty=False)
    if _SECRET_RE.fullmatch(value) is None:
        raise invalid_param(f"'{key}' must be 1 to 255 of 0-9, a-z, A-Z, '.', '=', '_', '-'")
    return value


def _send_attempt(body: JsonDict) -> int:
    value = body.get("send_attempt")
    if value is None:
        raise missing_param("Missing 'send_attempt'")
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad_json("'send_attempt' must be an integer")
    return value


def _check_request_token(medium: str, body: JsonDict) -> None:
    _secret(body, "client_secret")
    _send_attempt(body)
    if medium == "email":
        required_string(body, "email", max_length=MAX_THREEPID_FIELD_LENGTH, allow_empty=False)
    else:
        required_string(body, "country", max_length=MAX_THREEPID_FIELD_LENGTH, allow_empty=False)
        required_string(body, "phone_number", max_length=MAX_THREEPID_FIELD_LENGTH, allow_empty=False)
    optional_string(body, "next_link", max_length=2048)
    optional_string(body, "id_server", max_length=MAX_ID_SERVER_LENGTH)
    optional_string(body, "id_access_token", max_length=MAX_THREEPID_FIELD_LENGTH)


def _medium_and_address(body: JsonDict) -> None:
    medium = required_string(body, "medium", max_length=MAX_THREEPID_FIELD_LENGTH)
    if medium not in MEDIUMS:
        raise invalid_param("'medium' must be 'email' or 'msisdn'")
    required_string(body, "address", max_length=MAX_THREEPID_FIELD_LENGTH)
    optional_string(body, "id_server", max_length=MAX_ID_SERVER_LENGTH)


class ThreepidServlets:
    def __init__(self, uia: UserInteractiveAuth) -> None:
        self._uia = uia

    @route("POST", client_path(r"/account/3pid" + REQUEST_TOKEN), "client_3pid_request_token", caller=Caller.NONE,
           body=Body.OBJECT)
    @route("POST", client_path(r"/register" + REQUEST_TOKEN), "client_register_request_token", caller=Caller.NONE,
           body=Body.OBJECT)
    @route("POST", client_path(r"/account/password" + REQUEST_TOKEN), "client_password_request_token",
           caller=Caller.NONE, body=Body.OBJECT)
    async def request_token(self, call: Call) -> Response:
        medium = call.params["medium"]
        _check_request_token(medium, call.content)
        raise MatrixError(
            400, "M_THREEPID_MEDIUM_NOT_SUPPORTED", f"This server cannot send {medium} validation tokens"
        )

    @route("GET", client_path(r"/account/3pid"), "client_3pids", caller=Caller.USER)
    async def get_threepids(self, call: Call) -> Response:
        return 200, {"threepids": []}

    @route("POST", client_path(r"/account/3pid/add"), "client_3pid_add", caller=Caller.USER, body=Body.OBJECT)
    async def post_add(self, call: Call) -> Response:
        body = call.content
        _secret(body, "client_secret")
        _secret(body, "sid")
        await self._uia.check(body.get("auth"), operation="add_threepid", flows=ADD_FLOWS, user_id=call.user.user_id)
        raise MatrixError(400, "M_THREEPID_AUTH_FAILED", "No validated third-party identifier session found")

    @route("POST", client_path(r"/account/3pid/bind"), "client_3pid_bind", caller=Caller.USER, body=Body.OBJECT)
    async def post_bind(self, call: Call) -> Response:
        body = call.content
        _secret(body, "client_secret")
        _secret(body, "sid")
        required_string(body, "id_server", max_length=MAX_ID_SERVER_LENGTH, allow_empty=False)
        required_string(body, "id_access_token", max_length=MAX_THREEPID_FIELD_LENGTH, allow_empty=False)
        raise MatrixError(400, "M_SERVER_NOT_TRUSTED", "This server does not use identity servers")

    @route("POST", client_path(r"/account/3pid/delete"), "client_3pid_delete", caller=Caller.USER, body=Body.OBJECT)
    @route("POST", client_path(r"/account/3pid/unbind"), "client_3pid_unbind", caller=Caller.USER, body=Body.OBJECT)
    async def post_delete_or_unbind(self, call: Call) -> Response:
        _medium_and_address(call.content)
        return 200, dict(_NO_UNBIND)
