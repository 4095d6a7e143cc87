"""Relations and threads servlets (client-server API v1): ``/relations`` and ``/threads``.

Each parses the path and query into typed values (``MatrixError`` for anything
malformed) and calls ``RelationsHandler``. Served by the main process and by generic
workers (docs/workers.md).
"""

# tests: tests/integration/test_relations.py

from __future__ import annotations

from typing import Final

from twisted.web.server import Request

from homeserver.events.identifiers import is_valid_event_id
from homeserver.handlers.rooms.relations import RelationsHandler
from homeserver.events.validation import check_room_id, check_text
from homeserver.http.client_api._base import query_bool, query_int, query_string
from homeserver.http.routes import Call, Caller, Response, route
from storage.kernel.errors import invalid_param

V1_ROOM: Final = r"/_matrix/client/v1/rooms/(?P<room_id>[^/]+)"
MAX_TYPE_LENGTH: Final = 255


def _direction(request: Request) -> str:
    direction = query_string(request, "dir") or "b"
    if direction not in ("b", "f"):
        raise invalid_param(f"Query parameter 'dir' must be 'b' or 'f', got {direction[:20]!r}")
    return direction


def _token(request: Request, name: str) -> str | None:
    value = query_string(request, name)
    if value is not None and len(value) > 512:
        raise invalid_param(f"Query parameter '{name}' is too long")
    return value


class RelationsServlets:
    def __init__(self, relations: RelationsHandler) -> None:
        self._relations = relations

    @route("GET", V1_ROOM + r"/relations/(?P<event_id>[^/]+)(?:/(?P<rel_type>[^/]+)(?:/(?P<event_type>[^/]+))?)?",
           "client_room_relations", caller=Caller.USER)
    async def get_relations(self, call: Call) -> Response:
        request, params = call.request, call.params
        room_id = check_room_id(params["room_id"])
        event_id = params["event_id"]
        if not is_valid_event_id(event_id):
            raise invalid_param(f"Invalid event ID {event_id[:100]!r}")
        rel_type = params.get("rel_type")
        event_type = params.get("event_type")
        limit_given = query_string(request, "limit") is not None
        return 200, await self._relations.get_relations(
            call.user, room_id, event_id,
            relation_type=None if rel_type is None else check_text(rel_type, "relType", max_length=MAX_TYPE_LENGTH),
            event_type=None if event_type is None else check_text(
                event_type, "eventType", max_length=MAX_TYPE_LENGTH),
            from_token=_token(request, "from"),
            to_token=_token(request, "to"),
            limit=query_int(request, "limit", 0, maximum=10**6) if limit_given else None,
            direction=_direction(request),
            recurse=query_bool(request, "recurse", False) or query_bool(request, "org.matrix.msc3981.recurse", False),
        )

    @route("GET", V1_ROOM + r"/threads", "client_room_threads", caller=Caller.USER)
    async def get_threads(self, call: Call) -> Response:
        request = call.request
        room_id = check_room_id(call.params["room_id"])
        include = query_string(request, "include") or "all"
        if include not in ("all", "participated"):
            raise invalid_param(f"Query parameter 'include' must be 'all' or 'participated', got {include[:20]!r}")
        limit_given = query_string(request, "limit") is not None
        return 200, await self._relations.get_threads(
            call.user, room_id, participated=include == "participated", from_token=_token(request, "from"),
            limit=query_int(request, "limit", 0, maximum=10**6) if limit_given else None,
        )
