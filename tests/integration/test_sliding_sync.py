"""Simplified sliding sync (MSC4186) against a real server, built from the MSC's text.

``POST /_matrix/client/unstable/org.matrix.simplified_msc3575/sync``: lists select rooms by
filters and ranges over the user's rooms in recency order; a room is sent whole (``initial``)
the first time a connection has it and afterwards only with what changed; ``pos`` continues
a connection (on any process sharing the database), an unknown one is 400 ``M_UNKNOWN_POS``;
extensions carry to-device messages, E2EE counts and device lists, account data, receipts
and typing.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

from twisted.internet.defer import Deferred

from tests.integration.test_client_rooms import ALICE, BOB, ROOM_LIMITS, _ok, _users
from tests.integration.test_client_support import Client, running_server

SS = "/_matrix/client/unstable/org.matrix.simplified_msc3575/sync"
ALL_STATE = [["*", "*"]]


async def _ss(client: Client, token: str, body: dict[str, Any], **query: Any) -> dict[str, Any]:
    path = SS + ("?" + "&".join(f"{k}={quote(str(v))}" for k, v in query.items()) if query else "")
    response = await client.request("POST", path, body, token=token)
    assert response.status == 200, response
    result: dict[str, Any] = response.body
    return result


async def _room(client: Client, token: str, name: str | None = None, **extra: Any) -> str:
    body: dict[str, Any] = {"preset": "public_chat", **extra}
    if name is not None:
        body["name"] = name
    room_id: str = (await _ok(client, "POST", "createRoom", body, token=token))["room_id"]
    return room_id


async def _send(client: Client, token: str, room_id: str, body: str) -> str:
    event_id: str = (await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/{time.monotonic_ns()}",
                               {"msgtype": "m.text", "body": body}, token=token))["event_id"]
    return event_id


async def test_lists_ranges_required_state_and_timeline(database_dsn: str, tmp_path: Path) -> None:
    """Three rooms by recency; a [0,1] range gets the two most recent, with the timeline cut to
    the limit, the asked state, name and counts; ``count`` is the whole list's size."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, bob = await _users(client)
        rooms = [await _room(client, alice, f"room {i}") for i in range(3)]
        for room_id in rooms:
            await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob)
        sent = {room_id: [await _send(client, alice, room_id, f"{room_id} {i}") for i in range(3)]
                for room_id in (rooms[1], rooms[0], rooms[2])}  # recency: rooms[2], rooms[0], rooms[1]
        body = {"lists": {"all": {"ranges": [[0, 1]], "timeline_limit": 2,
                                  "required_state": [["m.room.create", ""], ["m.room.member", "$ME"]]}}}
        first = await _ss(client, bob, body)
        assert first["lists"]["all"]["count"] == 3
        assert first["lists"]["all"]["ops"][0]["room_ids"] == [rooms[2], rooms[0]]
        assert set(first["rooms"]) == {rooms[2], rooms[0]}
        room = first["rooms"][rooms[2]]
        assert room["initial"] is True and room["name"] == "room 2" and room["membership"] == "join"
        assert [e["event_id"] for e in room["timeline"]] == sent[rooms[2]][-2:]
        assert room["limited"] is True and room["num_live"] == 0
        assert room["joined_count"] == 2 and room["invited_count"] == 0
        assert room["notification_count"] == 3 and room["highlight_count"] == 0
        assert sorted((e["type"], e["state_key"]) for e in room["required_state"]) == [
            ("m.room.create", ""), ("m.room.member", BOB)]
        assert room["bump_stamp"] > first["rooms"][rooms[0]]["bump_stamp"]
        assert room["lists"] == ["all"]
        # The prev_batch pages back to the event before the timeline.
        before = await _ok(client, "GET", f"rooms/{rooms[2]}/messages?dir=b&limit=1&from={quote(room['prev_batch'])}",
                           token=bob)
        assert before["chunk"][0]["event_id"] == sent[rooms[2]][0]

        # Nothing changed: with timeout 0 the next answer has no rooms; a wider range sends only the new one.
        again = await _ss(client, bob, body, pos=first["pos"], timeout=0)
        assert again["rooms"] == {} and again["lists"]["all"]["count"] == 3
        wider = await _ss(client, bob, {"lists": {"all": {**body["lists"]["all"], "ranges": [[0, 2]]}}},
                          pos=again["pos"], timeout=0)
        assert set(wider["rooms"]) == {rooms[1]} and wider["rooms"][rooms[1]]["initial"] is True

        # A new message in a room the connection has: only that event, not initial, live.
        new = await _send(client, alice, rooms[1], "new")
        incremental = await _ss(client, bob, {"lists": {"all": {**body["lists"]["all"], "ranges": [[0, 2]]}}},
                                pos=wider["pos"], timeout=0)
        assert set(incremental["rooms"]) == {rooms[1]}
        update = incremental["rooms"][rooms[1]]
        assert [e["event_id"] for e in update["timeline"]] == [new]
        assert "initial" not in update and update["num_live"] == 1 and update["limited"] is False
        assert incremental["lists"]["all"]["ops"][0]["room_ids"][0] == rooms[1]

        # All state with lazy members: every state event but members, and the senders' members.
        lazy = await _ss(client, bob, {"room_subscriptions": {rooms[0]: {
            "timeline_limit": 1, "required_state": [["*", "*"], ["m.room.member", "$LAZY"]]}}})
        keys = {(e["type"], e["state_key"]) for e in lazy["rooms"][rooms[0]]["required_state"]}
        assert ("m.room.name", "") in keys and ("m.room.power_levels", "") in keys
        assert ("m.room.member", ALICE) in keys and ("m.room.member", BOB) not in keys
