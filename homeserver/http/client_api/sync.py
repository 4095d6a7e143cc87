"""``GET /sync``: parse since/timeout/full_state/filter and hand them to ``SyncHandler``; the older
``/initialSync``, ``/rooms/{roomId}/initialSync`` and ``/events`` to ``LegacySyncHandler``."""

# tests: tests/integration/test_client_rooms.py, tests/integration/test_client_e2e.py, tests/integration/test_client_legacy.py

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from twisted.web.server import Request

from homeserver.handlers.account_services import AccountServices
from homeserver.handlers.accounts.auth import Auth
from homeserver.handlers.accounts.deactivate import DeactivationHandler
from homeserver.handlers.accounts.filters import FilterHandler, validate_filter
from homeserver.handlers.ephemeral.presence import PRESENCE_STATES, SyncTracker, while_syncing
from homeserver.handlers.room_services import RoomServices
from homeserver.handlers.sync.legacy_sync import LegacySyncHandler
from homeserver.handlers.sync.sync import DEFAULT_TIMELINE_LIMIT, SyncFilter, SyncHandler
from homeserver.events.validation import check_room_id
from homeserver.http.client_api.account import register_deactivate_servlet
from homeserver.http.client_api.e2e import register_e2e_servlets
from homeserver.http.client_api.rooms import ROOM, register_room_servlets
from homeserver.http.client_api.directory import register_directory_servlets
from homeserver.http.client_api.relations import register_relations_servlets
from homeserver.http.client_api.search import register_search_servlets
from homeserver.http.client_api.sliding_sync import register_sliding_sync_servlet
from homeserver.http.client_api.room_upgrade import register_room_upgrade_servlet
from homeserver.http.client_api._base import client_path, query_int, query_string
from storage.kernel.errors import invalid_param, missing_param
from homeserver.http.server import Routes
from homeserver.http.routes import Gate
from homeserver.handlers.writers import Writers
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


def register_legacy_sync_servlets(router: Routes, *, auth: Auth, legacy: LegacySyncHandler) -> None:
    """The older ``/initialSync``, ``/rooms/{roomId}/initialSync`` and ``/events`` (r0.6.1)."""

    async def initial_sync(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        archived = query_string(request, "archived") or "false"
        if archived not in ("true", "false"):
            raise invalid_param("'archived' must be true or false")
        limit = query_int(request, "limit", DEFAULT_TIMELINE_LIMIT)
        return 200, await legacy.initial_sync(requester, limit=limit, archived=archived == "true")

    async def room_initial_sync(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        room_id = check_room_id(params["room_id"])
        return 200, await legacy.room_initial_sync(
            requester, room_id, limit=query_int(request, "limit", DEFAULT_TIMELINE_LIMIT)
        )

    async def events(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        since = _query_token(request, "from")
        timeout_ms = _query_timeout(request, default_ms=EVENTS_TIMEOUT_MS)
        room_id = query_string(request, "room_id")
        if room_id is None and requester.is_guest:
            # As Synapse: a guest follows the rooms it peeks into one by one.
            raise missing_param("Guest users must give room_id")
        if room_id is not None:
            return 200, await legacy.room_events(requester, check_room_id(room_id), since, timeout_ms=timeout_ms)
        return 200, await legacy.events(requester, since, timeout_ms=timeout_ms)

    router.register(["GET"], client_path(r"/initialSync"), initial_sync, "client_initial_sync")
    router.register(["GET"], client_path(ROOM + r"/initialSync"), room_initial_sync, "client_room_initial_sync")
    router.register(["GET"], client_path(r"/events"), events, "client_events_stream")


def register_sync_servlets(router: Routes, *, auth: Auth, sync: SyncHandler, filters: FilterHandler,
                           sync_tracker: SyncTracker | None = None) -> None:
    async def get_sync(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
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
                filter_json = await filters.get_filter(requester, requester.user_id, filter_text)
        # A syncing client is online (set_presence=offline or unavailable: the client says otherwise).
        return 200, await while_syncing(sync_tracker, requester.user_id, set_presence, lambda: sync.wait_for_sync(
            requester,
            since,
            timeout_ms=timeout_ms,
            full_state=full_state_text == "true",
            sync_filter=SyncFilter.parse(filter_json),
        ))

    router.register(["GET"], client_path(r"/sync"), get_sync, "client_sync")


def register_room_api_servlets(router: Routes, gate: Gate, rooms: RoomServices, accounts: AccountServices,
                               writers: Writers, sync_tracker: SyncTracker | None = None) -> None:
    """Every servlet of rooms.py and this module, wired to ``rooms``' handlers."""
    register_room_servlets(
        router,
        auth=accounts.auth,
        rooms=rooms.rooms,
        messages=rooms.messages,
        writers=writers,
    )
    register_relations_servlets(router, auth=accounts.auth, relations=rooms.relations)
    register_directory_servlets(router, auth=accounts.auth, directory=rooms.directory, hierarchy=rooms.hierarchy)
    register_search_servlets(router, auth=accounts.auth, search=rooms.search)
    register_room_upgrade_servlet(router, auth=accounts.auth, upgrades=rooms.upgrades)
    register_sync_servlets(router, auth=accounts.auth, sync=rooms.sync, filters=accounts.filters,
                           sync_tracker=sync_tracker)
    register_sliding_sync_servlet(router, auth=accounts.auth, sliding_sync=rooms.sliding_sync,
                                  sync_tracker=sync_tracker)
    register_e2e_servlets(router, auth=accounts.auth, e2e=rooms.e2e, presence=rooms.presence, writers=writers,
                          uia=accounts.uia)
    register_deactivate_servlet(router, gate, uia=accounts.uia, deactivation=DeactivationHandler(
        login=accounts.login, rooms=rooms.rooms, profiles=accounts.profiles, timeline=rooms.timeline,
    ))
    register_legacy_sync_servlets(router, auth=accounts.auth, legacy=LegacySyncHandler(
        sync=rooms.sync,
        messages=rooms.messages,
        rooms=rooms.rooms,
        timeline=rooms.timeline,
        client_events=rooms.client_events,
        receipts=rooms.receipts,
        presence=rooms.presence,
        account_data=accounts.account_data,
        room_tokens=rooms.room_tokens,
    ))
