"""Federation ``/publicRooms`` (GET and POST): this server's room directory for another
server, and ``/hierarchy/{roomId}``: a space's summary and its children's.

Requests are ``X-Matrix`` signed (``register_authed``, which also applies the room's
server ACL); the list is the one local clients see (``DirectoryHandler.local_public_rooms``).
"""

# tests: tests/integration/test_directory.py

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from twisted.web.server import Request

from homeserver.federation.requests import query_int, query_one
from homeserver.http.federation.servlets import FED_V1, FederationServices, register_authed
from homeserver.handlers.directory.directory import DirectoryHandler, parse_public_rooms_filter
from homeserver.handlers.directory.hierarchy import HierarchyHandler
from homeserver.events.validation import check_room_id
from homeserver.http.server import Routes
from storage.kernel.errors import bad_json, invalid_param


def register_federation_directory_servlets(router: Routes, fed: FederationServices,
                                           directory: DirectoryHandler, hierarchy: HierarchyHandler) -> None:
    async def get_hierarchy(origin: str, request: Request, p: Mapping[str, str], body: Any) -> tuple[int, Any]:
        suggested = query_one(request.args or {}, "suggested_only") or "false"
        if suggested not in ("true", "false"):
            raise invalid_param("'suggested_only' must be 'true' or 'false'")
        return 200, await hierarchy.federation_hierarchy(check_room_id(p["room_id"]),
                                                         suggested_only=suggested == "true")

    async def get_public_rooms(origin: str, request: Request, p: Mapping[str, str], body: Any) -> tuple[int, Any]:
        args = request.args or {}
        limit = query_int(args, "limit", default=0, minimum=0, maximum=10**6)
        return 200, await directory.local_public_rooms(
            since=query_one(args, "since"), limit=limit or None, room_filter=parse_public_rooms_filter(None)
        )

    async def post_public_rooms(origin: str, request: Request, p: Mapping[str, str], body: Any) -> tuple[int, Any]:
        if not isinstance(body, Mapping):
            raise bad_json("The body must be a JSON object")
        limit, since = body.get("limit"), body.get("since")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool)):
            raise bad_json("'limit' must be an integer")
        if since is not None and not isinstance(since, str):
            raise bad_json("'since' must be a string")
        return 200, await directory.local_public_rooms(
            since=since, limit=limit, room_filter=parse_public_rooms_filter(body.get("filter"))
        )

    register_authed(router, fed, "GET", f"{FED_V1}/publicRooms", get_public_rooms, "federation_public_rooms")
    register_authed(router, fed, "POST", f"{FED_V1}/publicRooms", post_public_rooms,
                    "federation_public_rooms_filtered", has_body=True)
    register_authed(router, fed, "GET", f"{FED_V1}/hierarchy/(?P<room_id>[^/]+)", get_hierarchy,
                    "federation_hierarchy")
