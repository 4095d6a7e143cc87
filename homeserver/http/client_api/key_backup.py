"""Servlets for server-side key backup: ``/room_keys/version[/{version}]`` and ``/room_keys/keys[/{roomId}[/{sessionId}]]``."""

# tests: tests/integration/test_client_e2e.py

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from twisted.web.server import Request

from homeserver.handlers.accounts.auth import Auth
from homeserver.handlers.e2e.key_backup import KeyBackupHandler
from homeserver.http.client_api._base import client_path, query_string
from homeserver.http.server import Routes, parse_json_body, parse_json_object


def register_key_backup_servlets(router: Routes, *, auth: Auth, backup: KeyBackupHandler) -> None:
    async def version(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        if request.method == b"POST":
            return 200, await backup.create_version(requester, parse_json_object(request))
        return 200, await backup.get_version(requester, None)

    async def one_version(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        if request.method == b"PUT":
            return 200, await backup.update_version(requester, params["version"], parse_json_object(request))
        if request.method == b"DELETE":
            return 200, await backup.delete_version(requester, params["version"])
        return 200, await backup.get_version(requester, params["version"])

    async def keys(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        wanted = query_string(request, "version")
        room_id, session_id = params.get("room_id"), params.get("session_id")
        if request.method == b"PUT":
            return 200, await backup.put_keys(requester, wanted, room_id, session_id, parse_json_body(request))
        if request.method == b"DELETE":
            return 200, await backup.delete_keys(requester, wanted, room_id, session_id)
        return 200, await backup.get_keys(requester, wanted, room_id, session_id)

    router.register(["GET", "POST"], client_path(r"/room_keys/version"), version, "client_room_keys_version")
    router.register(["GET", "PUT", "DELETE"], client_path(r"/room_keys/version/(?P<version>[^/]+)"), one_version,
                    "client_room_keys_one_version")
    router.register(["GET", "PUT", "DELETE"], client_path(r"/room_keys/keys"), keys, "client_room_keys")
    router.register(["GET", "PUT", "DELETE"], client_path(r"/room_keys/keys/(?P<room_id>[^/]+)"), keys,
                    "client_room_keys_room")
    router.register(["GET", "PUT", "DELETE"],
                    client_path(r"/room_keys/keys/(?P<room_id>[^/]+)/(?P<session_id>[^/]+)"), keys,
                    "client_room_keys_session")
