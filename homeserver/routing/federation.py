"""Outbound federation when federation sender workers send it.

The main process (the writer of the ``federation`` stream) turns each EDU a
local user causes into one ``federation_stream`` row per destination
(``FederationStreamSink``, in place of the in-process sender). Each sender
worker follows that stream and hands the rows for destinations it owns to its
``FederationSender`` (``FederationStreamReader``), then acknowledges the
position with ``FEDERATION_ACK``. Our own PDUs need no such help: senders
read them from the events stream, and to-device messages for other servers
wait in the outbox table, whose rows the ``to_device`` stream announces. A
remote server's join or leave that we accepted as the resident server is not
our event, so the main process passes it on as a ``FORWARD_PDU`` row (other
processes that accept one hand it to the main process first: the internal
API's ``forward_pdu``).
"""

# tests: tests/unit/routing/test_federation.py, tests/integration/test_workers.py

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any


from federation_sender.sender import FederationSender
from homeserver.events import FrozenEvent
from replication.commands import Row
from storage.database import Database, Transaction
from storage.id_generators import StreamIdGenerator
from homeserver.config import MAIN_INSTANCE
from storage.stores.streams import insert_federation_edu_txn
from storage.kernel.background import run_in_background
from homeserver.routing.forwarding import event_from_json, event_to_json
from homeserver.routing.internal_api import InternalApiClient, InternalApiServer

logger = logging.getLogger(__name__)

# The federation stream's marker for "send this PDU" (not an EDU type: EDU types are m.* or namespaced).
FORWARD_PDU = "tributary.forward_pdu"


class _EduEncoder(ABC):
    """The ``EduSink`` methods as plain EDUs, for a sink whose ``send_edu`` takes it elsewhere."""

    @abstractmethod
    def send_edu(self, destinations: Iterable[str], edu_type: str, content: Mapping[str, Any]) -> None:
        """Queue one EDU for each of ``destinations``."""

    def send_typing(self, destinations: Iterable[str], room_id: str, user_id: str, typing: bool) -> None:
        self.send_edu(destinations, "m.typing", {"room_id": room_id, "user_id": user_id, "typing": typing})

    def send_receipt(self, destinations: Iterable[str], room_id: str, receipt_type: str, user_id: str,
                     event_ids: list[str], data: Mapping[str, Any]) -> None:
        content = {room_id: {receipt_type: {user_id: {"event_ids": event_ids, "data": dict(data)}}}}
        self.send_edu(destinations, "m.receipt", content)

    def send_presence(self, destinations: Iterable[str], state: Mapping[str, Any]) -> None:
        self.send_edu(destinations, "m.presence", {"push": [dict(state)]})

    def send_device_list_update(self, destinations: Iterable[str], content: Mapping[str, Any]) -> None:
        self.send_edu(destinations, "m.device_list_update", content)

    def wake_destination(self, destination: str) -> None:
        """Nothing to send: the outbox row's to-device stream fact reaches the senders."""


class FederationStreamSink(_EduEncoder):
    """An ``EduSink`` that writes EDUs to the ``federation`` stream for the sender workers."""

    def __init__(self, db: Database, stream: StreamIdGenerator, *, server_name: str,
                 joined_servers: Callable[[str], Awaitable[set[str]]]) -> None:
        if stream.instance_name is None:
            raise ValueError("FederationStreamSink needs this process to write the federation stream")
        self._db = db
        self._stream = stream
        self._instance = stream.instance_name
        self._server_name = server_name
        self._joined_servers = joined_servers

    def forward(self, event: Any, origin: str) -> None:
        """The in-process sender's ``forward``: a remote member's event, for the room's other servers."""

        async def run() -> None:
            servers = await self._joined_servers(event.room_id)
            if event.type == "m.room.member" and event.state_key:
                servers.add(event.state_key.split(":", 1)[1])
            self.send_edu(servers - {origin, self._server_name}, FORWARD_PDU, event.get_pdu_json())

        run_in_background("forward_pdu", run())

    def send_edu(self, destinations: Iterable[str], edu_type: str, content: Mapping[str, Any]) -> None:
        targets = sorted(set(destinations))
        if not targets:
            return
        content_json = json.dumps(content, separators=(",", ":"), ensure_ascii=False)

        def write(txn: Transaction) -> None:
            stream_id = self._stream.get_next_txn(txn)
            for destination in targets:
                insert_federation_edu_txn(txn, stream_id, self._instance, destination, edu_type, content_json)

        run_in_background("queue_federation_edu", self._stream.run_interaction("queue_federation_edu", write))


class RemoteEduSink(_EduEncoder):
    """An ``EduSink`` in a worker that writes typing, receipts or presence: its EDUs go to the
    main process (the internal API's ``queue_edu``), which queues them like its own."""

    def __init__(self, client: InternalApiClient) -> None:
        self._client = client

    def send_edu(self, destinations: Iterable[str], edu_type: str, content: Mapping[str, Any]) -> None:
        targets = sorted(set(destinations))
        if not targets:
            return
        body = {"destinations": targets, "edu_type": edu_type, "content": dict(content)}
        run_in_background("queue_edu_on_main", self._client.call(MAIN_INSTANCE, "queue_edu", body))


class FederationStreamReader:
    """A replication ``RowHandler`` in a sender worker: EDUs from the ``federation`` stream,
    outbox wake-ups from the ``to_device`` stream."""

    def __init__(self, sender: FederationSender, ack: Callable[[int], None]) -> None:
        self._sender = sender
        self._ack = ack

    def on_rows(self, stream: str, instance: str, token: int, rows: Sequence[Row]) -> None:
        if stream == "to_device":
            for row in rows:
                entity = str(row[0])
                if not entity.startswith("@"):  # a device_federation_outbox row names a server
                    self._sender.wake_destination(entity)
            return
        if stream != "federation":
            return
        for row in rows:
            destination, edu_type, content_json = str(row[0]), str(row[1]), str(row[2])
            try:
                content = json.loads(content_json)
            except ValueError:
                logger.error("federation stream row %d for %s is not JSON; dropped", token, destination)
                continue
            dispatch_edu(self._sender, [destination], edu_type, content)
        self._ack(token)


def dispatch_edu(sender: Any, destinations: list[str], edu_type: str, content: Any) -> None:
    """Queue one EDU (from the stream, or from a worker) the way the in-process handlers would
    have: ``sender`` is a ``FederationSender`` or another ``EduSink``."""
    if not isinstance(content, dict):
        logger.error("%s for %s has non-object content; dropped", edu_type, destinations)
        return
    if edu_type == FORWARD_PDU:
        sender.send_pdu(content, destinations)
    elif edu_type == "m.typing":
        sender.send_typing(destinations, content["room_id"], content["user_id"], bool(content["typing"]))
    elif edu_type == "m.presence":
        for state in content.get("push", []):
            sender.send_presence(destinations, state)
    elif edu_type == "m.receipt":
        for room_id, by_type in content.items():
            for receipt_type, by_user in by_type.items():
                for user_id, receipt in by_user.items():
                    sender.send_receipt(destinations, room_id, receipt_type, user_id,
                                        list(receipt["event_ids"]), receipt.get("data", {}))
    else:
        sender.send_edu(destinations, edu_type, content)


def forward_to_main(client: InternalApiClient) -> Callable[[FrozenEvent, str], None]:
    """``MembershipHandler``'s ``forward`` in a process without a sender: the main process passes
    the event on (the internal API's ``forward_pdu``)."""

    def forward(event: FrozenEvent, origin: str) -> None:
        run_in_background("forward_pdu_to_main", client.call(
            MAIN_INSTANCE, "forward_pdu", {"event": event_to_json(event), "origin": origin}))

    return forward


def register_main_operations(server: InternalApiServer, sink: Any, forward: Callable[[FrozenEvent, str], None] | None,
                             ) -> None:
    """What the main process does for workers' outbound federation: ``forward_pdu`` (the resident
    server's forwarding of remote members' events) and ``queue_edu`` (EDUs caused on a worker
    that writes typing, receipts or presence)."""

    async def queue_edu(body: dict[str, Any]) -> dict[str, Any]:
        if sink is not None:
            dispatch_edu(sink, body["destinations"], str(body["edu_type"]), body["content"])
        return {}

    async def forward_pdu(body: dict[str, Any]) -> dict[str, Any]:
        _, event = event_from_json(body["event"])
        if forward is not None:
            forward(event, str(body["origin"]))
        return {}

    server.register("queue_edu", queue_edu)
    server.register("forward_pdu", forward_pdu)
