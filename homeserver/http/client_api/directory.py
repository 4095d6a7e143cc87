"""Room and user directory servlets: ``/directory/list/room/{roomId}``, ``/publicRooms``,
``/user_directory/search`` and spaces' ``/v1/rooms/{roomId}/hierarchy``.

Each parses path, query and body into typed values (``MatrixError`` for anything
malformed) and calls ``DirectoryHandler``. Served by the main process and generic workers.
"""

# tests: tests/integration/test_directory.py

from __future__ import annotations

from typing import Final

from homeserver.events.identifiers import is_valid_server_name
from homeserver.handlers.directory.directory import (
    DEFAULT_USER_SEARCH_LIMIT,
    MAX_SEARCH_TERM,
    DirectoryHandler,
    parse_public_rooms_filter,
)
from homeserver.handlers.directory.hierarchy import HierarchyHandler
from homeserver.events.validation import check_room_id
from homeserver.http.client_api._base import (
    client_path,
    empty,
    query_bool,
    query_int,
    query_string,
    required_string,
)
from homeserver.http.routes import Body, Call, Caller, Response, route
from storage.kernel.errors import bad_json, invalid_param

MAX_TOKEN_LENGTH: Final = 512


def _server(value: str | None) -> str | None:
    if value is None:
        return None
    if not is_valid_server_name(value):
        raise invalid_param(f"Invalid server name {value[:100]!r}")
    return value


def _limit(value: object) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad_json("'limit' must be an integer")
    return value


def _since(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > MAX_TOKEN_LENGTH:
        raise bad_json("'since' must be a string (a next_batch or prev_batch token)")
    return value


VISIBILITY: Final = client_path(r"/directory/list/room/(?P<room_id>[^/]+)")
PUBLIC_ROOMS: Final = client_path(r"/publicRooms")


class DirectoryServlets:
    """Listed in the order they are registered (the room hierarchy last)."""

    def __init__(self, directory: DirectoryHandler, hierarchy: HierarchyHandler) -> None:
        self._directory = directory
        self._hierarchy = hierarchy

    @route("GET", VISIBILITY, "client_directory_visibility", caller=Caller.NONE)
    async def get_visibility(self, call: Call) -> Response:
        return 200, await self._directory.get_visibility(check_room_id(call.params["room_id"]))

    @route("PUT", VISIBILITY, "client_directory_set_visibility", caller=Caller.USER, body=Body.OBJECT)
    async def put_visibility(self, call: Call) -> Response:
        visibility = call.content.get("visibility", "public")
        if visibility not in ("public", "private"):
            raise invalid_param("'visibility' must be 'public' or 'private'")
        await self._directory.set_visibility(call.user, check_room_id(call.params["room_id"]), str(visibility))
        return empty()

    @route("GET", PUBLIC_ROOMS, "client_public_rooms", caller=Caller.NONE)
    async def get_public_rooms(self, call: Call) -> Response:
        request = call.request
        limit_given = query_string(request, "limit") is not None
        return 200, await self._directory.public_rooms(
            server=_server(query_string(request, "server")),
            since=_since(query_string(request, "since")),
            limit=query_int(request, "limit", 0, maximum=10**6) if limit_given else None,
            room_filter=parse_public_rooms_filter(None),
        )

    @route("POST", PUBLIC_ROOMS, "client_public_rooms_filtered", caller=Caller.USER, body=Body.OPTIONAL_OBJECT)
    async def post_public_rooms(self, call: Call) -> Response:
        body = call.content
        raw_filter = body.get("filter")
        return 200, await self._directory.public_rooms(
            server=_server(query_string(call.request, "server")),
            since=_since(body.get("since")),
            limit=_limit(body.get("limit")),
            room_filter=parse_public_rooms_filter(raw_filter),
            raw_filter=raw_filter,
        )

    @route("POST", client_path(r"/user_directory/search"), "client_user_directory_search", caller=Caller.USER,
           body=Body.OBJECT)
    async def search_users(self, call: Call) -> Response:
        term = required_string(call.content, "search_term", max_length=MAX_SEARCH_TERM)
        limit = _limit(call.content.get("limit"))
        return 200, await self._directory.search_users(
            call.user, term, DEFAULT_USER_SEARCH_LIMIT if limit is None else limit
        )

    @route("GET", r"/_matrix/client/v1/rooms/(?P<room_id>[^/]+)/hierarchy", "client_room_hierarchy",
           caller=Caller.USER)
    async def get_hierarchy(self, call: Call) -> Response:
        request = call.request
        from_token = query_string(request, "from")
        if from_token is not None and len(from_token) > MAX_TOKEN_LENGTH:
            raise invalid_param("Query parameter 'from' is too long")
        limit_given = query_string(request, "limit") is not None
        depth_given = query_string(request, "max_depth") is not None
        return 200, await self._hierarchy.client_hierarchy(
            call.user.user_id, check_room_id(call.params["room_id"]),
            suggested_only=query_bool(request, "suggested_only", False),
            max_depth=query_int(request, "max_depth", 0, maximum=1000) if depth_given else None,
            limit=query_int(request, "limit", 0, maximum=10**6) if limit_given else None,
            from_token=from_token,
        )
