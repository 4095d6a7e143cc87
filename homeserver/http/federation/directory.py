"""Federation ``/publicRooms`` (GET and POST): this server's room directory for another
server, and ``/hierarchy/{roomId}``: a space's summary and its children's.

Requests are ``X-Matrix`` signed (declared ``Caller.SERVER``: the gate's ``XMatrixAuth`` also
applies the room's server ACL); the list is the one local clients see
(``DirectoryHandler.local_public_rooms``).
"""

# tests: tests/integration/test_directory.py

from __future__ import annotations

from collections.abc import Mapping

from homeserver.events.validation import check_room_id
from homeserver.federation.requests import query_int, query_one
from homeserver.handlers.directory.directory import DirectoryHandler, parse_public_rooms_filter
from homeserver.handlers.directory.hierarchy import HierarchyHandler
from homeserver.http.federation.servlets import FED_V1
from homeserver.http.routes import Body, Call, Caller, Response, route
from storage.kernel.errors import bad_json, invalid_param

PUBLIC_ROOMS = f"{FED_V1}/publicRooms"


class FederationDirectoryServlets:
    def __init__(self, directory: DirectoryHandler, hierarchy: HierarchyHandler) -> None:
        self._directory = directory
        self._hierarchy = hierarchy

    @route("GET", PUBLIC_ROOMS, "federation_public_rooms", caller=Caller.SERVER)
    async def get_public_rooms(self, call: Call) -> Response:
        args = call.request.args or {}
        limit = query_int(args, "limit", default=0, minimum=0, maximum=10**6)
        return 200, await self._directory.local_public_rooms(
            since=query_one(args, "since"), limit=limit or None, room_filter=parse_public_rooms_filter(None)
        )

    @route("POST", PUBLIC_ROOMS, "federation_public_rooms_filtered", caller=Caller.SERVER, body=Body.SIGNED)
    async def post_public_rooms(self, call: Call) -> Response:
        body = call.body
        if not isinstance(body, Mapping):
            raise bad_json("The body must be a JSON object")
        limit, since = body.get("limit"), body.get("since")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool)):
            raise bad_json("'limit' must be an integer")
        if since is not None and not isinstance(since, str):
            raise bad_json("'since' must be a string")
        return 200, await self._directory.local_public_rooms(
            since=since, limit=limit, room_filter=parse_public_rooms_filter(body.get("filter"))
        )

    @route("GET", f"{FED_V1}/hierarchy/(?P<room_id>[^/]+)", "federation_hierarchy", caller=Caller.SERVER)
    async def get_hierarchy(self, call: Call) -> Response:
        suggested = query_one(call.request.args or {}, "suggested_only") or "false"
        if suggested not in ("true", "false"):
            raise invalid_param("'suggested_only' must be 'true' or 'false'")
        return 200, await self._hierarchy.federation_hierarchy(check_room_id(call.params["room_id"]),
                                                               suggested_only=suggested == "true")
