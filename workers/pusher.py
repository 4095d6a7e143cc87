"""The ``pusher`` role's hook: deliver notifications to push gateways (``homeserver/handlers/push/pusher.py``).

Runs in one process of a deployment: the ``pusher`` worker when the config has one, else
the main process. It follows the events stream (to deliver new notification records) and
the receipts stream (to send badge updates), through the stream positions this process
knows, locally or by replication.
"""

# tests: tests/integration/test_push.py

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from homeserver.handlers.push.pusher import HttpGatewayTransport, PusherMetrics, PusherPool
from homeserver.roles import RoleContext
from storage.stores.events import EventsStore
from storage.stores.push import PushStore


async def start_pusher(context: RoleContext) -> PusherPool:
    events_store = EventsStore(context.db)
    events, receipts = context.streams["events"], context.streams["receipts"]

    async def load_events(event_ids: list[str]) -> Mapping[str, Mapping[str, Any]]:
        return {event_id: stored.pdu() for event_id, stored in (await events_store.get_events(event_ids)).items()}

    pool = PusherPool(
        store=PushStore(context.db), load_events=load_events, transport=HttpGatewayTransport(context.reactor, ip_range_whitelist=context.config.push.ip_range_whitelist),
        clock=context.reactor, metrics=PusherMetrics.create(context.registry),
        events_position=events.get_current_token, receipts_position=receipts.get_current_token,
        written=context.written_events,
    )
    events.add_position_listener(lambda *_: pool.on_events_moved())
    receipts.add_position_listener(lambda *_: pool.on_new_receipts())
    pool.start()
    return pool
