"""Servlets for server-side key backup: ``/room_keys/version[/{version}]`` and ``/room_keys/keys[/{roomId}[/{sessionId}]]``."""

# tests: tests/integration/test_client_e2e.py

from __future__ import annotations

from homeserver.handlers.e2e.key_backup import KeyBackupHandler
from homeserver.http.client_api._base import client_path, query_string
from homeserver.http.routes import Body, Call, Caller, Response, route
from homeserver.http.server import parse_json_body

VERSIONS = client_path(r"/room_keys/version")
VERSION = client_path(r"/room_keys/version/(?P<version>[^/]+)")
KEYS = client_path(r"/room_keys/keys")
ROOM_KEYS = client_path(r"/room_keys/keys/(?P<room_id>[^/]+)")
SESSION_KEYS = client_path(r"/room_keys/keys/(?P<room_id>[^/]+)/(?P<session_id>[^/]+)")


class KeyBackupServlets:
    """Each path keeps one servlet name for all its methods."""

    def __init__(self, backup: KeyBackupHandler) -> None:
        self._backup = backup

    @route("GET", VERSIONS, "client_room_keys_version", caller=Caller.USER)
    async def get_current_version(self, call: Call) -> Response:
        return 200, await self._backup.get_version(call.user, None)

    @route("POST", VERSIONS, "client_room_keys_version", caller=Caller.USER, body=Body.OBJECT)
    async def create_version(self, call: Call) -> Response:
        return 200, await self._backup.create_version(call.user, call.content)

    @route("GET", VERSION, "client_room_keys_one_version", caller=Caller.USER)
    async def get_version(self, call: Call) -> Response:
        return 200, await self._backup.get_version(call.user, call.params["version"])

    @route("PUT", VERSION, "client_room_keys_one_version", caller=Caller.USER, body=Body.OBJECT)
    async def update_version(self, call: Call) -> Response:
        return 200, await self._backup.update_version(call.user, call.params["version"], call.content)

    @route("DELETE", VERSION, "client_room_keys_one_version", caller=Caller.USER)
    async def delete_version(self, call: Call) -> Response:
        return 200, await self._backup.delete_version(call.user, call.params["version"])

    # The key paths do not overlap, so declaring them method by method matches as path by path did.
    @route("GET", KEYS, "client_room_keys", caller=Caller.USER)
    @route("GET", ROOM_KEYS, "client_room_keys_room", caller=Caller.USER)
    @route("GET", SESSION_KEYS, "client_room_keys_session", caller=Caller.USER)
    async def get_keys(self, call: Call) -> Response:
        p = call.params
        return 200, await self._backup.get_keys(call.user, query_string(call.request, "version"), p.get("room_id"),
                                                p.get("session_id"))

    @route("PUT", KEYS, "client_room_keys", caller=Caller.USER)
    @route("PUT", ROOM_KEYS, "client_room_keys_room", caller=Caller.USER)
    @route("PUT", SESSION_KEYS, "client_room_keys_session", caller=Caller.USER)
    async def put_keys(self, call: Call) -> Response:
        p = call.params
        # The version query parameter is checked before the body (both 400s), so the body is read here.
        wanted = query_string(call.request, "version")
        return 200, await self._backup.put_keys(call.user, wanted, p.get("room_id"), p.get("session_id"),
                                                parse_json_body(call.request))

    @route("DELETE", KEYS, "client_room_keys", caller=Caller.USER)
    @route("DELETE", ROOM_KEYS, "client_room_keys_room", caller=Caller.USER)
    @route("DELETE", SESSION_KEYS, "client_room_keys_session", caller=Caller.USER)
    async def delete_keys(self, call: Call) -> Response:
        p = call.params
        return 200, await self._backup.delete_keys(call.user, query_string(call.request, "version"),
                                                   p.get("room_id"), p.get("session_id"))
