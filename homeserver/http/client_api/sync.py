"""``GET /sync``: parse since/timeout/full_state/filter and hand them to ``SyncHandler``."""

# tests: tests/integration/test_client_rooms.py, tests/integration/test_client_e2e.py

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from twisted.web.server import Request

from homeserver.handlers.account_services import AccountServices
from homeserver.handlers.auth import Auth
from homeserver.handlers.filters import FilterHandler, validate_filter
from homeserver.handlers.presence import PRESENCE_STATES, SyncTracker
from homeserver.handlers.room_services import RoomServices
from homeserver.handlers.sync import SyncFilter, SyncHandler
from homeserver.http.client_api.e2e import register_e2e_servlets
from homeserver.http.client_api.rooms import register_room_servlets
from homeserver.http.client_api._base import client_path, query_string
from storage.kernel.errors import invalid_param
from homeserver.http.server import Routes
from homeserver.routing.writers import Writers
from storage.tokens import InvalidTokenError, StreamToken


def register_sync_servlets(router: Routes, *, auth: Auth, sync: SyncHandler, filters: FilterHandler,
                           sync_tracker: SyncTracker | None = None) -> None:
    async def get_sync(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        set_presence = query_string(request, "set_presence") or "online"
        if set_presence not in PRESENCE_STATES:
            raise invalid_param("'set_presence' must be one of online, offline, unavailable")
        since_text = query_string(request, "since")
        since: StreamToken | None = None
        if since_text is not None:
            try:
                since = StreamToken.parse(since_text)
            except InvalidTokenError as e:
                raise invalid_param(str(e)) from None
        timeout_text = query_string(request, "timeout") or "0"
        if not timeout_text.isascii() or not timeout_text.isdigit() or len(timeout_text) > 10:
            raise invalid_param("'timeout' must be a non-negative integer")
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
                filter_json = await filters.get_filter(requester, requester.user_id, filter_text)
        # A syncing client is online (set_presence=offline or unavailable: the client says otherwise).
        tracked = sync_tracker is not None and set_presence == "online"
        if tracked:
            assert sync_tracker is not None
            started = sync_tracker.begin(requester.user_id)
            if started is not None:
                await started
        try:
            result = await sync.wait_for_sync(
                requester,
                since,
                timeout_ms=int(timeout_text),
                full_state=full_state_text == "true",
                sync_filter=SyncFilter.parse(filter_json),
            )
        finally:
            if tracked:
                assert sync_tracker is not None
                sync_tracker.end(requester.user_id)
        return 200, result

    router.register(["GET"], client_path(r"/sync"), get_sync, "client_sync")


def register_room_api_servlets(router: Routes, rooms: RoomServices, accounts: AccountServices,
                               writers: Writers, sync_tracker: SyncTracker | None = None) -> None:
    """Every servlet of rooms.py and this module, wired to ``rooms``' handlers."""
    register_room_servlets(
        router,
        auth=accounts.auth,
        rooms=rooms.rooms,
        messages=rooms.messages,
        writers=writers,
    )
    register_sync_servlets(router, auth=accounts.auth, sync=rooms.sync, filters=accounts.filters,
                           sync_tracker=sync_tracker)
    register_e2e_servlets(router, auth=accounts.auth, e2e=rooms.e2e, presence=rooms.presence, writers=writers)
