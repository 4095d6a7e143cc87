"""Account data and filter servlets, both under /user/{userId}/.

GET/PUT /user/{userId}/account_data/{type}, GET/PUT
/user/{userId}/rooms/{roomId}/account_data/{type}, POST /user/{userId}/filter
and GET /user/{userId}/filter/{filterId}. Each needs the access token of
``userId`` itself.
"""

# tests: tests/integration/test_client_accounts.py, tests/integration/test_client_nio.py

from __future__ import annotations

from homeserver.handlers.accounts.account_data import AccountDataHandler
from homeserver.handlers.accounts.filters import FilterHandler
from homeserver.handlers.writers import AccountDataWriter
from homeserver.http.client_api._base import client_path, empty
from homeserver.http.routes import Body, Call, Caller, Response, route

USER = r"/user/(?P<user_id>[^/]+)"
GLOBAL = client_path(USER + r"/account_data/(?P<type>[^/]+)")
ROOM = client_path(USER + r"/rooms/(?P<room_id>[^/]+)/account_data/(?P<type>[^/]+)")


class AccountDataServlets:
    def __init__(self, account_data: AccountDataHandler, filters: FilterHandler, writer: AccountDataWriter) -> None:
        self._account_data = account_data
        self._filters = filters
        self._writer = writer

    @route("GET", GLOBAL, "client_account_data", caller=Caller.USER)
    async def get_global(self, call: Call) -> Response:
        return 200, await self._account_data.get_global(call.user, call.params["user_id"], call.params["type"])

    @route("PUT", GLOBAL, "client_account_data_update", caller=Caller.USER, body=Body.OBJECT)
    async def put_global(self, call: Call) -> Response:
        await self._writer.set_global(call.user, call.params["user_id"], call.params["type"], call.content)
        return empty()

    @route("GET", ROOM, "client_room_account_data", caller=Caller.USER)
    async def get_room(self, call: Call) -> Response:
        p = call.params
        return 200, await self._account_data.get_room(call.user, p["user_id"], p["room_id"], p["type"])

    @route("PUT", ROOM, "client_room_account_data_update", caller=Caller.USER, body=Body.OBJECT)
    async def put_room(self, call: Call) -> Response:
        p = call.params
        await self._writer.set_room(call.user, p["user_id"], p["room_id"], p["type"], call.content)
        return empty()

    @route("POST", client_path(USER + r"/filter"), "client_filter_create", caller=Caller.USER, body=Body.JSON)
    async def post_filter(self, call: Call) -> Response:
        return 200, {"filter_id": await self._filters.add_filter(call.user, call.params["user_id"], call.body)}

    @route("GET", client_path(USER + r"/filter/(?P<filter_id>[^/]+)"), "client_filter", caller=Caller.USER)
    async def get_filter(self, call: Call) -> Response:
        return 200, await self._filters.get_filter(call.user, call.params["user_id"], call.params["filter_id"])
