"""``POST /search`` (``room_events``): parses the body into a ``RoomEventsSearch`` and calls
``SearchHandler``. Served by the main process and generic workers."""

# tests: tests/integration/test_search.py

from __future__ import annotations

from homeserver.handlers.directory.search import SearchHandler, parse_search_request
from homeserver.http.client_api._base import client_path, query_string
from homeserver.http.routes import Body, Call, Caller, Response, route
from storage.kernel.errors import invalid_param


class SearchServlet:
    def __init__(self, search: SearchHandler) -> None:
        self._search = search

    @route("POST", client_path(r"/search"), "client_search", caller=Caller.USER, body=Body.OBJECT)
    async def post_search(self, call: Call) -> Response:
        next_batch = query_string(call.request, "next_batch")
        if next_batch is not None and len(next_batch) > 64:
            raise invalid_param("Query parameter 'next_batch' is too long")
        return 200, await self._search.search(call.user, parse_search_request(call.content), next_batch)
