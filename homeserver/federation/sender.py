"""The interim sending path: each new local event goes straight to the room's other servers.

One ``PUT /send`` per event per destination, fire and forget: no queue, no retry,
no catch-up. The federation sender issue replaces this module; do not build on it.
"""

# tests: tests/integration/test_federation.py

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from urllib.parse import quote

from twisted.internet.defer import Deferred

from homeserver.events import FrozenEvent
from homeserver.events.identifiers import server_name_of
from homeserver.federation.client import FederationClient, FederationClientError
from storage.stores.events import EventsStore, PersistResult

logger = logging.getLogger(__name__)


class SimpleSender:
    def __init__(self, *, server_name: str, store: EventsStore, client: FederationClient,
                 clock_ms: Callable[[], int]) -> None:
        self._server_name = server_name
        self._store = store
        self._client = client
        self._clock_ms = clock_ms
        self._txn_ids = itertools.count(clock_ms())
        self._pending: set[Deferred[None]] = set()

    def on_persisted(self, event: FrozenEvent, result: PersistResult) -> None:
        """EventPersister listener: send new local, non-outlier events."""
        if result.state_group_after is None or server_name_of(event.sender) != self._server_name:
            return
        if result.destinations:
            # The persister worked out who the event is for; no need to read the room again.
            self._start(event, frozenset(), result.destinations)

    def forward(self, event: FrozenEvent, origin: str) -> None:
        """Send a remote server's event we accepted (a ``send_join``/``send_leave``) to the room's
        other servers: as the resident server, we are the only one that has it."""
        self._start(event, frozenset({origin}))

    def _start(self, event: FrozenEvent, exclude: frozenset[str], destinations: frozenset[str] | None = None) -> None:
        d = Deferred.fromCoroutine(self._send(event, exclude, destinations))
        self._pending.add(d)
        d.addBoth(lambda _: self._pending.discard(d))

    async def _send(self, event: FrozenEvent, exclude: frozenset[str], destinations: frozenset[str] | None) -> None:
        if destinations is not None:
            servers = set(destinations)
        else:
            try:
                servers = await self._store.get_joined_servers(event.room_id)
            except Exception:
                logger.exception("could not read the servers of %s", event.room_id)
                return
        if event.type == "m.room.member" and event.state_key:
            servers.add(server_name_of(event.state_key))
        servers.discard(self._server_name)
        servers -= exclude
        for destination in sorted(servers):
            txn_id = str(next(self._txn_ids))
            body = {"origin": self._server_name, "origin_server_ts": self._clock_ms(),
                    "pdus": [event.get_pdu_json()], "edus": []}
            try:
                await self._client.put_json(destination, f"/_matrix/federation/v1/send/{quote(txn_id, safe='')}", body)
                logger.debug("TX [%s] sent %s", destination, event.event_id)
            except FederationClientError as e:
                logger.warning("TX [%s] sending %s failed: %s", destination, event.event_id, e)

    async def wait_idle(self) -> None:
        """Wait for sends in progress (for shutdown and tests)."""
        for d in list(self._pending):
            await d
