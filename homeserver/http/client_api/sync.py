"""``GET /sync``: parse since/timeout/full_state/filter and hand them to ``SyncHandler``; the older
``/initialSync``, ``/rooms/{roomId}/initialSync`` and ``/events`` to ``LegacySyncHandler``."""

# tests: tests/integration/test_client_rooms.py, tests/integration/test_client_e2e.py, tests/integration/test_client_legacy.py,
#        tests/unit/http/test_client_room_routes.py

from __future__ import annotations

import json
from typing import Any, Final

from twisted.web.server import Request

from homeserver.handlers.accounts.filters import FilterHandler, validate_filter
from homeserver.handlers.ephemeral.presence import PRESENCE_STATES, SyncTracker, while_syncing
from homeserver.handlers.sync.legacy_sync import LegacySyncHandler
from homeserver.handlers.sync.sync import DEFAULT_TIMELINE_LIMIT, SyncFilter, SyncHandler
from homeserver.events.validation import check_room_id
from homeserver.http.client_api.rooms import ROOM
from homeserver.http.client_api._base import client_path, query_int, query_string
from storage.kernel.errors import invalid_param, missing_param
from homeserver.http.routes import Call, Caller, Response, route
from storage.tokens import InvalidTokenError, StreamToken

# The older /events long-poll waits this long when the client gives no timeout (as Synapse).
EVENTS_TIMEOUT_MS: Final = 30_000


def _query_token(request: Request, name: str) -> StreamToken | None:
    """Query parameter ``name`` as a ``/sync`` token; None when absent."""
    text = query_string(request, name)
    if text is None:
        return None
    try:
        return StreamToken.parse(text)
    except InvalidTokenError as e:
        raise invalid_param(str(e)) from None


def _query_timeout(request: Request, *, default_ms: int) -> int:
    text = query_string(request, "timeout")
    if not text:  # absent, or empty as some clients send it
        return default_ms
    if not text.isascii() or not text.isdigit() or len(text) > 10:
        raise invalid_param("'timeout' must be a non-negative integer")
    return int(text)


class LegacySyncServlets:
    """The older ``/initialSync``, ``/rooms/{roomId}/initialSync`` and ``/events`` (r0.6.1)."""

    def __init__(self, legacy: LegacySyncHandler) -> None:
        self._legacy = legacy

    @route("GET", client_path(r"/initialSync"), "client_initial_sync", caller=Caller.GUEST)
    async def initial_sync(self, call: Call) -> Response:
        archived = query_string(call.request, "archived") or "false"
        if archived not in ("true", "false"):
            raise invalid_param("'archived' must be true or false")
        limit = query_int(call.request, "limit", DEFAULT_TIMELINE_LIMIT)
        return 200, await self._legacy.initial_sync(call.user, limit=limit, archived=archived == "true")

    @route("GET", client_path(ROOM + r"/initialSync"), "client_room_initial_sync", caller=Caller.GUEST)
    async def room_initial_sync(self, call: Call) -> Response:
        room_id = check_room_id(call.params["room_id"])
        return 200, await self._legacy.room_initial_sync(
            call.user, room_id, limit=query_int(call.request, "limit", DEFAULT_TIMELINE_LIMIT)
        )

    @route("GET", client_path(r"/events"), "client_events_stream", caller=Caller.GUEST)
    async def events(self, call: Call) -> Response:
        requester, request = call.user, call.request
        since = _query_token(request, "from")
        timeout_ms = _query_timeout(request, default_ms=EVENTS_TIMEOUT_MS)
        room_id = query_string(request, "room_id")
        if room_id is None and requester.is_guest:
            # As Synapse: a guest follows the rooms it peeks into one by one.
            raise missing_param("Guest users must give room_id")
        if room_id is not None:
            return 200, await self._legacy.room_events(requester, check_room_id(room_id), since,
                                                       timeout_ms=timeout_ms)
        return 200, await self._legacy.events(requester, since, timeout_ms=timeout_ms)


class SyncServlet:
    """``GET /sync``: ``SyncHandler.wait_for_sync``, the client counted as syncing meanwhile."""

    def __init__(self, sync: SyncHandler, filters: FilterHandler, sync_tracker: SyncTracker | None = None) -> None:
        self._sync = sync
        self._filters = filters
        self._sync_tracker = sync_tracker

    @route("GET", client_path(r"/sync"), "client_sync", caller=Caller.GUEST)
    async def get_sync(self, call: Call) -> Response:
        requester, request = call.user, call.request
        set_presence = query_string(request, "set_presence") or "online"
        if set_presence not in PRESENCE_STATES:
            raise invalid_param("'set_presence' must be one of online, offline, unavailable")
        since = _query_token(request, "since")
        timeout_ms = _query_timeout(request, default_ms=0)
        full_state_text = query_string(request, "full_state") or "false"
        if full_state_text not in ("true", "false"):
            raise invalid_param("'full_state' must be true or false")
        filter_text = query_string(request, "filter")
        filter_json: Any = None
        if filter_text is not None:
            if filter_text.lstrip().startswith("{"):
                if len(filter_text) > 8192:
                    raise invalid_param("'filter' is too long")
                try:
                    filter_json = validate_filter(json.loads(filter_text))
                except ValueError:
                    raise invalid_param("'filter' is not valid JSON") from None
            else:
                filter_json = await self._filters.get_filter(requester, requester.user_id, filter_text)
        # A syncing client is online (set_presence=offline or unavailable: the client says otherwise).
        return 200, await while_syncing(self._sync_tracker, requester.user_id, set_presence,
                                        lambda: self._sync.wait_for_sync(
                                            requester,
                                            since,
                                            timeout_ms=timeout_ms,
                                            full_state=full_state_text == "true",
                                            sync_filter=SyncFilter.parse(filter_json),
                                        ))
