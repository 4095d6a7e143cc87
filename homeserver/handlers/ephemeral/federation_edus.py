"""Which servers hear of a local user's ephemeral changes, and handing them to the federation sender.

Typing and receipts go to the remote servers joined to the room that its server
ACL allows (``joined_servers`` filters them); presence and
device-list changes to the remote servers sharing any room with the user (a
device-list change first gives each of them a device-list position below it, if
it has none: the sender reads the change from the device_lists stream above that
position, so it is not lost with the process);
to-device messages to the recipients' servers, through the outbox table so
they survive until accepted. The handlers call this after their own write has
succeeded; a failure here is logged and never fails the client's request
(the change is already visible locally).
"""

# tests: tests/integration/test_federation_sender.py tests/integration/test_federation_rules.py

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from typing import Any, Protocol

from homeserver.events.identifiers import server_name_of

logger = logging.getLogger(__name__)


class EduSink(Protocol):
    """What the federation sender offers (``federation_sender.sender.FederationSender``)."""

    def send_typing(self, destinations: Iterable[str], room_id: str, user_id: str, typing: bool) -> None: ...

    def send_receipt(self, destinations: Iterable[str], room_id: str, receipt_type: str, user_id: str,
                     event_ids: list[str], data: Mapping[str, Any]) -> None: ...

    def send_presence(self, destinations: Iterable[str], state: Mapping[str, Any]) -> None: ...

    def send_device_list_update(self, destinations: Iterable[str], content: Mapping[str, Any]) -> None: ...

    def send_edu(self, destinations: Iterable[str], edu_type: str, content: Mapping[str, Any]) -> None: ...

    def wake_destination(self, destination: str) -> None: ...


# (stream_id, instance_name, rows of (destination, message_id, messages_json), now_ms)
AddToOutbox = Callable[[int, str, Collection[tuple[str, str, str]], int], Awaitable[None]]
# (destinations, stream_id): a device-list change at stream_id is meant for them.
NoteDeviceListChange = Callable[[Collection[str], int], Awaitable[None]]


class OutboundEdus:
    def __init__(
        self,
        *,
        server_name: str,
        sink: EduSink,
        joined_servers: Callable[[str], Awaitable[set[str]]],
        sharing_servers: Callable[[str], Awaitable[set[str]]],
        add_to_outbox: AddToOutbox,
        clock_ms: Callable[[], int],
        note_device_list_change: NoteDeviceListChange | None = None,
    ) -> None:
        self._server_name = server_name
        self._sink = sink
        self._joined_servers = joined_servers
        self._sharing_servers_of = sharing_servers
        self._add_to_outbox = add_to_outbox
        self._clock_ms = clock_ms
        self._note_device_list_change = note_device_list_change

    async def _room_servers(self, room_id: str) -> set[str]:
        return await self._joined_servers(room_id) - {self._server_name}

    async def _sharing_servers(self, user_id: str) -> set[str]:
        return await self._sharing_servers_of(user_id) - {self._server_name}

    async def typing(self, room_id: str, user_id: str, typing: bool) -> None:
        try:
            servers = await self._room_servers(room_id)
        except Exception:
            logger.exception("typing of %s in %s not sent to other servers", user_id, room_id)
            return
        if servers:
            self._sink.send_typing(servers, room_id, user_id, typing)

    async def receipt(self, room_id: str, receipt_type: str, user_id: str, event_id: str,
                      data: Mapping[str, Any]) -> None:
        if receipt_type != "m.read":  # private receipts stay here
            return
        try:
            servers = await self._room_servers(room_id)
        except Exception:
            logger.exception("receipt of %s in %s not sent to other servers", user_id, room_id)
            return
        if servers:
            self._sink.send_receipt(servers, room_id, receipt_type, user_id, [event_id], data)

    async def presence(self, state: Mapping[str, Any]) -> None:
        """``state``: the ``m.presence`` push entry (user_id, presence, last_active_ago, ...)."""
        user_id = str(state["user_id"])
        try:
            servers = await self._sharing_servers(user_id)
        except Exception:
            logger.exception("presence of %s not sent to other servers", user_id)
            return
        if servers:
            self._sink.send_presence(servers, state)

    async def device_list_update(self, content: Mapping[str, Any]) -> None:
        """A local user's devices changed (``content``, with the change's ``stream_id``)."""
        await self._device_list_fact("device list update", content, int(content["stream_id"]),
                                     self._sink.send_device_list_update)

    async def signing_key_update(self, content: Mapping[str, Any], stream_id: int) -> None:
        """A local user's master / self-signing keys changed (``content``, the
        ``m.signing_key_update``), a fact at ``stream_id`` of the device_lists stream."""
        await self._device_list_fact("signing key update", content, stream_id,
                                     lambda servers, c: self._sink.send_edu(servers, "m.signing_key_update", c))

    async def _device_list_fact(self, what: str, content: Mapping[str, Any], stream_id: int,
                                send: Callable[[set[str], Mapping[str, Any]], None]) -> None:
        """The servers sharing a room with the user get their device-list position noted below the
        fact (so their senders read it from the stream, durably), then a wake-up."""
        user_id = str(content["user_id"])
        try:
            servers = await self._sharing_servers(user_id)
        except Exception:
            logger.exception("%s of %s not sent to other servers", what, user_id)
            return
        if not servers:
            return
        if self._note_device_list_change is not None:
            try:
                await self._note_device_list_change(servers, stream_id)
            except Exception:
                logger.exception("%s of %s: positions of %d servers not noted", what, user_id, len(servers))
        send(servers, content)

    async def to_device(self, stream_id: int, instance_name: str, sender: str, event_type: str,
                        messages: Mapping[str, Mapping[str, Any]]) -> None:
        """Queue to-device messages for remote users (user ID -> device ID -> content), one outbox
        row per destination server, then wake those destinations. Raises if the write fails:
        unlike the lossy EDUs, the caller must not report success without it."""
        by_server: dict[str, dict[str, Any]] = {}
        for user_id, devices in messages.items():
            by_server.setdefault(server_name_of(user_id), {})[user_id] = devices
        rows = []
        for server, users in by_server.items():
            # Receivers deduplicate by the message ID.
            message_id = secrets.token_urlsafe(12)
            content = {"sender": sender, "type": event_type, "message_id": message_id, "messages": users}
            rows.append((server, message_id, json.dumps(content)))
        await self._add_to_outbox(stream_id, instance_name, rows, self._clock_ms())
        for server in by_server:
            self._sink.wake_destination(server)
