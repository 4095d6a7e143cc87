"""The ``appservice`` role's hook: push events to application services (``homeserver/appservice/``).

Runs in one process of a deployment: the ``appservice`` worker when the config has one, else
the main process. It follows the events stream (new events wake every service's link), the
typing, receipts and presence streams (ephemeral events, for services with ``receive_ephemeral``) and
the to_device stream (to-device messages for the users of services with
``org.matrix.msc2409.receive_to_device``, read above each service's own position), through the
stream positions this process knows, locally or by replication. Each service's positions are in
``appservice_stream_positions``, written only here.
"""

# tests: tests/integration/test_appservice.py

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from homeserver.appservice.client import AppServiceClient
from homeserver.appservice.metrics import AppServiceMetrics
from homeserver.appservice.sender import AppServiceSender
from homeserver.handlers.rooms.client_events import format_event
from homeserver.handlers.rooms.event_loader import EventLoader
from homeserver.roles import RoleContext
from storage.stores.appservice import AppServiceStore
from storage.stores.events import EventsStore


async def start_appservice_sender(context: RoleContext) -> AppServiceSender:
    config = context.config
    loader = EventLoader(EventsStore(context.db))
    events, to_device = context.streams["events"], context.streams["to_device"]

    async def format_events(event_ids: Sequence[str]) -> Mapping[str, Mapping[str, Any]]:
        loaded = await loader.load_events(event_ids)
        now = int(context.reactor.seconds() * 1000)
        return {event_id: format_event(event, now) for event_id, event in loaded.items()}

    sender = AppServiceSender(
        config.app_services, store=AppServiceStore(context.db),
        client=AppServiceClient(context.reactor, timeout=config.app_service_sender.request_timeout.total_seconds()),
        format_events=format_events, clock=context.reactor, events_position=events.get_current_token,
        to_device_position=to_device.get_current_token,
        metrics=AppServiceMetrics.create(context.registry), config=config.app_service_sender,
    )
    await sender.start()
    events.add_position_listener(lambda *_: sender.on_new_events())
    to_device.add_position_listener(lambda *_: sender.on_new_to_device())
    followed = [context.streams[name] for name in ("typing", "receipts", "presence")]
    sender.follow_ephemeral(*(stream.get_current_token for stream in followed))
    for stream in followed:
        stream.add_position_listener(lambda *_: sender.on_new_ephemeral())
    return sender
