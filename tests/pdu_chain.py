"""Signed PDU chains of a virtual server of the test peer, for inbound federation tests and benches.

``room_state_at`` reads a room's state at one event from the receiving server (``/state`` over
federation, as a joining server would); ``ChainBuilder`` then makes signed PDUs of the virtual
server that follow one another (each one's only prev event is the one before), with auth events
chosen from the state it tracks. It builds what a test asks for and checks nothing: a test that
wants a PDU the receiver must reject gives it wrong auth events or content itself.
"""

# tests: tests/integration/test_federation_batching.py

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import attrs

from homeserver.events import EventTemplate, RoomVersion, build_pdu, select_auth_event_ids, sign_pdu
from tests.federation_peer import FederationPeer

StateKey = tuple[str, str]


async def room_state_at(peer: FederationPeer, server: str, destination: str, room_id: str,
                        event_id: str) -> tuple[dict[StateKey, str], int]:
    """The state after ``event_id`` (a message, so also the state before it) by key, read from
    ``destination`` with ``/state``, and the event's depth."""
    client = peer.client(server)
    answer = await client.get_json(destination, f"/_matrix/federation/v1/state/{quote(room_id, safe='')}",
                                   query={"event_id": event_id})
    state = {(p["type"], p["state_key"]): peer._event_id(p) for p in answer["pdus"]}
    [pdu] = (await client.get_json(destination, f"/_matrix/federation/v1/event/{quote(event_id, safe='')}"))["pdus"]
    return state, int(pdu["depth"])


@attrs.define
class ChainBuilder:
    """Builds a line of PDUs of ``server`` in ``room_id`` on top of ``prev`` (whose state is ``state``)."""

    peer: FederationPeer
    server: str
    room_version: RoomVersion
    room_id: str
    prev: str
    depth: int
    state: dict[StateKey, str]
    ts: int

    def next(self, template: EventTemplate, sender: str, *,
             auth_event_ids: list[str] | None = None, follows: str | None = None) -> dict[str, Any]:
        """The next signed PDU: on ``follows`` (default: the last one built), auth events
        selected from the tracked state unless given. A state event updates the tracked state
        (the builder does not know whether the receiver will accept it)."""
        prev = follows if follows is not None else self.prev
        self.depth += 1
        self.ts += 1
        auth = auth_event_ids if auth_event_ids is not None else select_auth_event_ids(
            self.room_version, template, sender, self.state)
        pdu = build_pdu(self.room_version, template, sender=sender, room_id=self.room_id, prev_event_ids=[prev],
                        auth_event_ids=auth, depth=self.depth, origin_server_ts=self.ts)
        event = sign_pdu(self.room_version, pdu, self.server, self.peer.signing_key(self.server))
        if template.state_key is not None and auth_event_ids is None:
            self.state[(template.type, template.state_key)] = event.event_id
        self.prev = event.event_id
        return dict(event.get_pdu_json())

    def message(self, sender: str, body: str) -> dict[str, Any]:
        return self.next(EventTemplate("m.room.message", {"msgtype": "m.text", "body": body}), sender)


async def chain_builder(peer: FederationPeer, server: str, destination: str, room_id: str, on: str,
                        now_ms: int) -> ChainBuilder:
    """A ``ChainBuilder`` on top of ``on`` (a message in ``room_id`` that ``destination`` has)."""
    version = peer.room_version(room_id)
    assert version is not None, f"the peer never joined {room_id}"
    state, depth = await room_state_at(peer, server, destination, room_id, on)
    return ChainBuilder(peer, server, version, room_id, on, depth, state, now_ms)


def event_ids(peer: FederationPeer, pdus: list[Mapping[str, Any]]) -> list[str]:
    return [peer._event_id(p) for p in pdus]
