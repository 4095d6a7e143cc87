"""Account data and filter servlets, both under /user/{userId}/.

GET/PUT /user/{userId}/account_data/{type}, GET/PUT
/user/{userId}/rooms/{roomId}/account_data/{type}, POST /user/{userId}/filter
and GET /user/{userId}/filter/{filterId}. Each needs the access token of
``userId`` itself.
"""

# tests: tests/integration/test_client_accounts.py, tests/integration/test_client_nio.py

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from twisted.web.server import Request

from homeserver.handlers.accounts.account_data import AccountDataHandler
from homeserver.handlers.accounts.auth import Auth
from homeserver.handlers.accounts.filters import FilterHandler
from homeserver.http.client_api._base import client_path, empty
from homeserver.http.server import Routes, parse_json_body, parse_json_object
from homeserver.handlers.writers import Writers


def register_account_data_servlets(
    router: Routes, *, auth: Auth, account_data: AccountDataHandler, filters: FilterHandler, writers: Writers
) -> None:
    async def get_global(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        return 200, await account_data.get_global(requester, params["user_id"], params["type"])

    async def put_global(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        content = parse_json_object(request)
        await writers.account_data.set_global(requester, params["user_id"], params["type"], content)
        return empty()

    async def get_room(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        return 200, await account_data.get_room(requester, params["user_id"], params["room_id"], params["type"])

    async def put_room(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        content = parse_json_object(request)
        await writers.account_data.set_room(requester, params["user_id"], params["room_id"], params["type"], content)
        return empty()

    async def post_filter(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        filter_id = await filters.add_filter(requester, params["user_id"], parse_json_body(request))
        return 200, {"filter_id": filter_id}

    async def get_filter(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        return 200, await filters.get_filter(requester, params["user_id"], params["filter_id"])

    user = r"/user/(?P<user_id>[^/]+)"
    global_path = client_path(user + r"/account_data/(?P<type>[^/]+)")
    room_path = client_path(user + r"/rooms/(?P<room_id>[^/]+)/account_data/(?P<type>[^/]+)")
    router.register(["GET"], global_path, get_global, "client_account_data")
    router.register(["PUT"], global_path, put_global, "client_account_data_update")
    router.register(["GET"], room_path, get_room, "client_room_account_data")
    router.register(["PUT"], room_path, put_room, "client_room_account_data_update")
    router.register(["POST"], client_path(user + r"/filter"), post_filter, "client_filter_create")
    router.register(["GET"], client_path(user + r"/filter/(?P<filter_id>[^/]+)"), get_filter, "client_filter")
