"""``POST /_matrix/client/unstable/org.matrix.simplified_msc3575/sync``: simplified sliding sync
(MSC4186). Parses the body (``pos`` and ``timeout`` also from the query string, as clients send
them) with ``sliding_sync_request`` and hands it to ``SlidingSyncHandler``; a syncing client is
online unless ``set_presence`` says otherwise, as with ``/sync``."""

# tests: tests/integration/test_sliding_sync.py

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from twisted.web.server import Request

from homeserver.handlers.accounts.auth import Auth
from homeserver.handlers.ephemeral.presence import SyncTracker, while_syncing
from homeserver.handlers.sync.sliding_sync import SlidingSyncHandler
from homeserver.handlers.sync.sliding_sync_request import parse_request
from homeserver.http.server import parse_optional_json_object
from homeserver.http.client_api._base import query_string
from homeserver.http.server import Routes

SLIDING_SYNC_PATH: Final = r"/_matrix/client/unstable/org\.matrix\.simplified_msc3575/sync"


def register_sliding_sync_servlet(router: Routes, *, auth: Auth, sliding_sync: SlidingSyncHandler,
                                  sync_tracker: SyncTracker | None = None) -> None:
    async def post_sync(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        parsed = parse_request(parse_optional_json_object(request), query_pos=query_string(request, "pos"),
                               query_timeout=query_string(request, "timeout"))
        return 200, await while_syncing(sync_tracker, requester.user_id, parsed.set_presence,
                                        lambda: sliding_sync.wait_for_sync(requester, parsed))

    router.register(["POST"], SLIDING_SYNC_PATH, post_sync, "client_sliding_sync")
