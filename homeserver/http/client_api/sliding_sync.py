"""``POST /_matrix/client/unstable/org.matrix.simplified_msc3575/sync``: simplified sliding sync
(MSC4186). Parses the body (``pos`` and ``timeout`` also from the query string, as clients send
them) with ``sliding_sync_request`` and hands it to ``SlidingSyncHandler``; a syncing client is
online unless ``set_presence`` says otherwise, as with ``/sync``."""

# tests: tests/integration/test_sliding_sync.py

from __future__ import annotations

from typing import Final

from homeserver.handlers.ephemeral.presence import SyncTracker, while_syncing
from homeserver.handlers.sync.sliding_sync import SlidingSyncHandler
from homeserver.handlers.sync.sliding_sync_request import parse_request
from homeserver.http.client_api._base import query_string
from homeserver.http.routes import Body, Call, Caller, Response, route

SLIDING_SYNC_PATH: Final = r"/_matrix/client/unstable/org\.matrix\.simplified_msc3575/sync"


class SlidingSyncServlet:
    def __init__(self, sliding_sync: SlidingSyncHandler, sync_tracker: SyncTracker | None = None) -> None:
        self._sliding_sync = sliding_sync
        self._sync_tracker = sync_tracker

    @route("POST", SLIDING_SYNC_PATH, "client_sliding_sync", caller=Caller.USER, body=Body.OPTIONAL_OBJECT)
    async def post_sync(self, call: Call) -> Response:
        requester = call.user
        parsed = parse_request(call.content, query_pos=query_string(call.request, "pos"),
                               query_timeout=query_string(call.request, "timeout"))
        return 200, await while_syncing(self._sync_tracker, requester.user_id, parsed.set_presence,
                                        lambda: self._sliding_sync.wait_for_sync(requester, parsed))
