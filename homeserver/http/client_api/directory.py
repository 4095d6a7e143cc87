"""Room and user directory servlets: ``/directory/list/room/{roomId}``, ``/publicRooms``,
``/user_directory/search`` and spaces' ``/v1/rooms/{roomId}/hierarchy``.

Each parses path, query and body into typed values (``MatrixError`` for anything
malformed) and calls ``DirectoryHandler``. Served by the main process and generic workers.
"""

# tests: tests/integration/test_directory.py

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from twisted.web.server import Request

from homeserver.events.identifiers import is_valid_server_name
from homeserver.handlers.accounts.auth import Auth
from homeserver.handlers.directory.directory import (
    DEFAULT_USER_SEARCH_LIMIT,
    MAX_SEARCH_TERM,
    DirectoryHandler,
    parse_public_rooms_filter,
)
from homeserver.handlers.directory.hierarchy import HierarchyHandler
from homeserver.events.validation import check_room_id
from homeserver.http.server import parse_optional_json_object
from homeserver.http.client_api._base import (
    client_path,
    empty,
    query_bool,
    query_int,
    query_string,
    required_string,
)
from homeserver.http.server import Routes, parse_json_object
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


def register_directory_servlets(router: Routes, *, auth: Auth, directory: DirectoryHandler,
                                hierarchy: HierarchyHandler) -> None:
    async def get_hierarchy(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        from_token = query_string(request, "from")
        if from_token is not None and len(from_token) > MAX_TOKEN_LENGTH:
            raise invalid_param("Query parameter 'from' is too long")
        limit_given = query_string(request, "limit") is not None
        depth_given = query_string(request, "max_depth") is not None
        return 200, await hierarchy.client_hierarchy(
            requester.user_id, check_room_id(params["room_id"]),
            suggested_only=query_bool(request, "suggested_only", False),
            max_depth=query_int(request, "max_depth", 0, maximum=1000) if depth_given else None,
            limit=query_int(request, "limit", 0, maximum=10**6) if limit_given else None,
            from_token=from_token,
        )

    async def get_visibility(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        return 200, await directory.get_visibility(check_room_id(params["room_id"]))

    async def put_visibility(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        body = parse_json_object(request)
        visibility = body.get("visibility", "public")
        if visibility not in ("public", "private"):
            raise invalid_param("'visibility' must be 'public' or 'private'")
        await directory.set_visibility(requester, check_room_id(params["room_id"]), str(visibility))
        return empty()

    async def get_public_rooms(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        limit_given = query_string(request, "limit") is not None
        return 200, await directory.public_rooms(
            server=_server(query_string(request, "server")),
            since=_since(query_string(request, "since")),
            limit=query_int(request, "limit", 0, maximum=10**6) if limit_given else None,
            room_filter=parse_public_rooms_filter(None),
        )

    async def post_public_rooms(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        await auth.get_user_by_req(request)
        body = parse_optional_json_object(request)
        raw_filter = body.get("filter")
        return 200, await directory.public_rooms(
            server=_server(query_string(request, "server")),
            since=_since(body.get("since")),
            limit=_limit(body.get("limit")),
            room_filter=parse_public_rooms_filter(raw_filter),
            raw_filter=raw_filter,
        )

    async def search_users(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        body = parse_json_object(request)
        term = required_string(body, "search_term", max_length=MAX_SEARCH_TERM)
        limit = _limit(body.get("limit"))
        return 200, await directory.search_users(
            requester, term, DEFAULT_USER_SEARCH_LIMIT if limit is None else limit
        )

    router.register(["GET"], client_path(r"/directory/list/room/(?P<room_id>[^/]+)"), get_visibility,
                    "client_directory_visibility")
    router.register(["PUT"], client_path(r"/directory/list/room/(?P<room_id>[^/]+)"), put_visibility,
                    "client_directory_set_visibility")
    router.register(["GET"], client_path(r"/publicRooms"), get_public_rooms, "client_public_rooms")
    router.register(["POST"], client_path(r"/publicRooms"), post_public_rooms, "client_public_rooms_filtered")
    router.register(["POST"], client_path(r"/user_directory/search"), search_users, "client_user_directory_search")
    router.register(["GET"], r"/_matrix/client/v1/rooms/(?P<room_id>[^/]+)/hierarchy", get_hierarchy,
                    "client_room_hierarchy")
