"""``POST /search`` (``room_events``): parses the body into a ``RoomEventsSearch`` and calls
``SearchHandler``. Served by the main process and generic workers."""

# tests: tests/integration/test_search.py

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from twisted.web.server import Request

from homeserver.handlers.accounts.auth import Auth
from homeserver.handlers.directory.search import SearchHandler, parse_search_request
from homeserver.http.client_api._base import client_path, query_string
from homeserver.http.server import Routes, parse_json_object
from storage.kernel.errors import invalid_param


def register_search_servlets(router: Routes, *, auth: Auth, search: SearchHandler) -> None:
    async def post_search(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        body = parse_json_object(request)
        next_batch = query_string(request, "next_batch")
        if next_batch is not None and len(next_batch) > 64:
            raise invalid_param("Query parameter 'next_batch' is too long")
        return 200, await search.search(requester, parse_search_request(body), next_batch)

    router.register(["POST"], client_path(r"/search"), post_search, "client_search")
