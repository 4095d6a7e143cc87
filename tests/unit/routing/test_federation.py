"""EDUs from the federation stream reach a sender worker's queues as the in-process handlers queue them."""

from __future__ import annotations

import json
from typing import Any

from homeserver.routing.federation import FORWARD_PDU, FederationStreamReader


class RecordingSender:
    """Records what the reader asks of the sender (a fake of the sender's input methods only)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *args: self.calls.append((name, args))


def test_rows_become_the_sender_calls_and_are_acknowledged() -> None:
    sender, acks = RecordingSender(), []
    reader = FederationStreamReader(sender, acks.append)  # type: ignore[arg-type]
    receipt = {"!r:a": {"m.read": {"@u:a": {"event_ids": ["$e"], "data": {"ts": 1}}}}}
    reader.on_rows("federation", "master", 7, [
        ("b.org", "m.typing", json.dumps({"room_id": "!r:a", "user_id": "@u:a", "typing": True})),
        ("b.org", "m.presence", json.dumps({"push": [{"user_id": "@u:a", "presence": "online"}]})),
        ("c.org", "m.receipt", json.dumps(receipt)),
        ("c.org", "m.device_list_update", json.dumps({"user_id": "@u:a", "device_id": "D"})),
        ("c.org", "m.typing", "not json"),
        ("d.org", FORWARD_PDU, json.dumps({"event_id": "$j", "type": "m.room.member"})),
    ])
    assert sender.calls == [
        ("send_typing", (["b.org"], "!r:a", "@u:a", True)),
        ("send_presence", (["b.org"], {"user_id": "@u:a", "presence": "online"})),
        ("send_receipt", (["c.org"], "!r:a", "m.read", "@u:a", ["$e"], {"ts": 1})),
        ("send_edu", (["c.org"], "m.device_list_update", {"user_id": "@u:a", "device_id": "D"})),
        ("send_pdu", ({"event_id": "$j", "type": "m.room.member"}, ["d.org"])),
    ]
    assert acks == [7]


def test_outbox_rows_wake_their_destination_and_user_rows_do_not() -> None:
    sender, acks = RecordingSender(), []
    reader = FederationStreamReader(sender, acks.append)  # type: ignore[arg-type]
    reader.on_rows("to_device", "master", 3, [("@bob:a",), ("b.org",)])
    reader.on_rows("events", "p1", 4, [("$x", "!r:a")])
    assert sender.calls == [("wake_destination", ("b.org",))]
    assert acks == []
