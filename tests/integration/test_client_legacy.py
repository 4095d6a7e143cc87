"""The older client endpoints that clients and bridges still call, over HTTP against a real server.

``POST /rooms/{roomId}/send/{eventType}`` without a transaction ID, the room and
global ``/initialSync``, the ``/events`` long-poll stream, and ``/messages``
taking a ``/sync`` token: bodies as the r0.6.1 spec gives them (Synapse's
answers where it is silent).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from tests.integration.test_client_rooms import ALICE, BOB, ROOM_LIMITS
from tests.integration.test_client_support import Client, running_server
from tests.integration.test_federation import two_servers


async def _ok(client: Client, method: str, path: str, body: Any = None, *, token: str) -> Any:
    response = await client.request(method, path, body, token=token)
    assert response.status == 200, (method, path, response)
    return response.body


async def _room(client: Client) -> tuple[str, str, str]:
    alice = (await client.register_ok("alice"))["access_token"]
    bob = (await client.register_ok("bob"))["access_token"]
    room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat", "name": "Old"}, token=alice))["room_id"]
    await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob)
    return alice, bob, room_id


async def test_post_send_without_a_transaction_id_makes_a_new_event_each_time(
    database_dsn: str, tmp_path: Path
) -> None:
    """The same body POSTed twice is two events (no transaction ID, no deduplication), under r0 and v3."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, bob, room_id = await _room(client)
        body = {"msgtype": "m.text", "body": "same"}
        first = await _ok(client, "POST", f"rooms/{room_id}/send/m.room.message", body, token=alice)
        second = await _ok(client, "POST", f"/_matrix/client/r0/rooms/{room_id}/send/m.room.message", body, token=alice)
        assert first["event_id"] != second["event_id"]
        page = await _ok(client, "GET", f"rooms/{room_id}/messages?dir=b&limit=2", token=bob)
        assert [e["event_id"] for e in page["chunk"]] == [second["event_id"], first["event_id"]]
        assert all(e["sender"] == ALICE and "transaction_id" not in e.get("unsigned", {}) for e in page["chunk"])

        not_json = await client.request("POST", f"rooms/{room_id}/send/m.room.message", raw=b"[1]", token=alice)
        assert not_json.status == 400 and not_json.errcode == "M_BAD_JSON"
        stranger = (await client.register_ok("carol"))["access_token"]
        outsider = await client.request("POST", f"rooms/{room_id}/send/m.room.message", body, token=stranger)
        assert outsider.status == 403 and outsider.errcode == "M_FORBIDDEN"
        unknown = await client.request("POST", "rooms/!nope:localhost/send/m.room.message", body, token=alice)
        assert unknown.status in (403, 404) and unknown.errcode in ("M_FORBIDDEN", "M_NOT_FOUND")
        after = await _ok(client, "GET", f"rooms/{room_id}/messages?dir=b&limit=1", token=bob)
        assert after["chunk"][0]["event_id"] == second["event_id"]


async def test_room_initial_sync_has_state_messages_presence_and_receipts(database_dsn: str, tmp_path: Path) -> None:
    """``GET /rooms/{roomId}/initialSync``: current state, the newest messages oldest first with
    ``start``/``end`` tokens that page on with /messages, the membership, members' presence and receipts."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, bob, room_id = await _room(client)
        ids = [(await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/i{i}", {"body": f"m{i}"}, token=alice))["event_id"]
               for i in range(5)]
        await _ok(client, "PUT", f"presence/{ALICE}/status", {"presence": "online"}, token=alice)
        await _ok(client, "POST", f"rooms/{room_id}/receipt/m.read/{quote(ids[-1])}", {}, token=alice)

        snapshot = await _ok(client, "GET", f"/_matrix/client/r0/rooms/{room_id}/initialSync?limit=3", token=bob)
        assert snapshot["room_id"] == room_id and snapshot["membership"] == "join"
        assert [e["event_id"] for e in snapshot["messages"]["chunk"]] == ids[-3:]
        assert all(e["room_id"] == room_id for e in snapshot["messages"]["chunk"])
        state = {(e["type"], e["state_key"]): e["content"] for e in snapshot["state"]}
        assert state[("m.room.name", "")] == {"name": "Old"}
        assert state[("m.room.member", BOB)]["membership"] == "join"
        assert ALICE in {e["sender"] for e in snapshot["presence"] if e["type"] == "m.presence"}
        assert ALICE in snapshot["receipts"][0]["content"][ids[-1]]["m.read"]
        older = await _ok(client, "GET", f"rooms/{room_id}/messages?dir=b&limit=2&from={snapshot['messages']['start']}", token=bob)
        assert [e["event_id"] for e in older["chunk"]] == [ids[1], ids[0]]
        newer = await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/i9", {"body": "new"}, token=alice)
        forward = await _ok(client, "GET", f"rooms/{room_id}/messages?dir=f&from={snapshot['messages']['end']}", token=bob)
        assert [e["event_id"] for e in forward["chunk"]] == [newer["event_id"]]

        stranger = (await client.register_ok("carol"))["access_token"]
        private = (await _ok(client, "POST", "createRoom", {"preset": "private_chat"}, token=alice))["room_id"]
        outsider = await client.request("GET", f"rooms/{private}/initialSync", token=stranger)
        assert outsider.status == 403 and outsider.errcode == "M_FORBIDDEN"
        unknown = await client.request("GET", "rooms/!nope:localhost/initialSync", token=alice)
        assert unknown.status == 404 and unknown.errcode == "M_NOT_FOUND"
        bad = await client.request("GET", "rooms/not-a-room/initialSync", token=alice)
        assert bad.status == 400


async def test_global_initial_sync_lists_rooms_invites_and_archived_rooms(database_dsn: str, tmp_path: Path) -> None:
    """``GET /initialSync``: joined rooms with current state and ``limit`` messages, invites with
    their invite event, left rooms only with ``archived=true``; ``end`` is a /sync token."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, bob, room_id = await _room(client)
        sent = [(await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/g{i}", {"body": f"g{i}"}, token=alice))["event_id"]
                for i in range(4)]
        await _ok(client, "POST", f"rooms/{room_id}/receipt/m.read/{quote(sent[1])}", {}, token=bob)
        bob_read = sent[1]
        await _ok(client, "PUT", f"rooms/{room_id}/state/m.room.topic", {"topic": "late"}, token=alice)
        invited = (await _ok(client, "POST", "createRoom", {"invite": [BOB]}, token=alice))["room_id"]
        left = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        await _ok(client, "POST", f"rooms/{left}/join", {}, token=bob)
        await _ok(client, "POST", f"rooms/{left}/leave", {}, token=bob)

        snapshot = await _ok(client, "GET", "initialSync?limit=2", token=bob)
        rooms = {r["room_id"]: r for r in snapshot["rooms"]}
        assert set(rooms) == {room_id, invited}
        joined = rooms[room_id]
        assert joined["membership"] == "join"
        assert [e["type"] for e in joined["messages"]["chunk"]] == ["m.room.message", "m.room.topic"]
        assert joined["messages"]["chunk"][0]["event_id"] == sent[-1]
        state = {(e["type"], e["state_key"]): e["content"] for e in joined["state"]}
        assert state[("m.room.topic", "")] == {"topic": "late"} and state[("m.room.name", "")] == {"name": "Old"}
        assert state[("m.room.member", ALICE)]["membership"] == "join"
        assert rooms[invited]["membership"] == "invite" and rooms[invited]["invite"]["state_key"] == BOB
        assert rooms[invited]["inviter"] == ALICE
        receipts = [r for r in snapshot["receipts"] if r["room_id"] == room_id]
        assert BOB in receipts[0]["content"][bob_read]["m.read"]
        # end is a /sync token: an incremental sync from it sees only what came after.
        after = await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/g9", {"body": "after"}, token=alice)
        incremental = await _ok(client, "GET", f"sync?since={snapshot['end']}&timeout=0", token=bob)
        assert [e["event_id"] for e in incremental["rooms"]["join"][room_id]["timeline"]["events"]] == [after["event_id"]]

        archived = await _ok(client, "GET", "/_matrix/client/r0/initialSync?archived=true&limit=5", token=bob)
        gone = {r["room_id"]: r for r in archived["rooms"]}[left]
        assert gone["membership"] == "leave"
        assert gone["messages"]["chunk"][-1]["content"]["membership"] == "leave"
        bad = await client.request("GET", "initialSync?archived=maybe", token=bob)
        assert bad.status == 400 and bad.errcode == "M_INVALID_PARAM"
        bad_limit = await client.request("GET", "initialSync?limit=x", token=bob)
        assert bad_limit.status == 400 and bad_limit.errcode == "M_INVALID_PARAM"


async def test_events_stream_long_polls_from_a_sync_token(database_dsn: str, tmp_path: Path) -> None:
    """``GET /events?from=<next_batch>&timeout=``: woken by a message in one of the user's rooms long
    before the timeout, ``chunk`` carries it with its ``room_id``, ``start`` is ``from`` and ``end``
    continues the stream (and /sync) without repeating it; with nothing new it answers an empty
    chunk at the timeout."""
    import time

    from twisted.internet.defer import Deferred

    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (hs, client):
        alice, bob, room_id = await _room(client)
        since = (await _ok(client, "GET", "sync", token=bob))["next_batch"]
        started = time.monotonic()
        waiting = Deferred.fromCoroutine(client.request("GET", f"events?from={since}&timeout=20000", token=bob))
        sent = await _ok(client, "POST", f"rooms/{room_id}/send/m.room.message", {"body": "wake"}, token=alice)
        response = await waiting
        assert response.status == 200 and time.monotonic() - started < 10
        body = response.body
        assert body["start"] == since
        messages = [e for e in body["chunk"] if e["type"] == "m.room.message"]
        assert [(e["event_id"], e["room_id"]) for e in messages] == [(sent["event_id"], room_id)]
        assert hs.process.notifier.waiter_count() == 0

        # /messages takes the stream's (a /sync-style) token as ``from``, v1-style.
        page = await _ok(client, "GET", f"rooms/{room_id}/messages?dir=b&limit=1&from={body['end']}", token=bob)
        assert [e["event_id"] for e in page["chunk"]] == [sent["event_id"]]
        synced = (await _ok(client, "GET", "sync", token=bob))["next_batch"]
        page = await _ok(client, "GET", f"/_matrix/client/r0/rooms/{room_id}/messages?dir=b&limit=1&from={synced}",
                         token=bob)
        assert [e["event_id"] for e in page["chunk"]] == [sent["event_id"]]
        started = time.monotonic()
        quiet = await _ok(client, "GET", f"/_matrix/client/r0/events?from={body['end']}&timeout=300", token=bob)
        assert quiet["chunk"] == [] and time.monotonic() - started >= 0.25
        incremental = await _ok(client, "GET", f"sync?since={body['end']}&timeout=0", token=bob)
        assert room_id not in incremental["rooms"]["join"]

        # A room joined after ``from`` brings its join, not the history before it.
        other = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        await _ok(client, "PUT", f"rooms/{other}/send/m.room.message/old", {"body": "before bob"}, token=alice)
        mark = (await _ok(client, "GET", f"events?from={quiet['end']}&timeout=0", token=bob))["end"]
        await _ok(client, "POST", f"rooms/{other}/join", {}, token=bob)
        joined = await _ok(client, "GET", f"events?from={mark}&timeout=0", token=bob)
        in_other = [e for e in joined["chunk"] if e.get("room_id") == other]
        assert [(e["type"], e.get("state_key")) for e in in_other] == [("m.room.member", BOB)]

        # Without ``from`` the stream starts now.
        fresh = await _ok(client, "GET", "events?timeout=0", token=bob)
        assert fresh["chunk"] == []
        bad = await client.request("GET", "events?from=garbage&timeout=0", token=bob)
        assert bad.status == 400 and bad.errcode == "M_INVALID_PARAM"
        bad_timeout = await client.request("GET", "events?timeout=-5", token=bob)
        assert bad_timeout.status == 400 and bad_timeout.errcode == "M_INVALID_PARAM"
        anonymous = await client.request("GET", "events?timeout=0")
        assert anonymous.status == 401 and anonymous.errcode == "M_MISSING_TOKEN"


@pytest.mark.timeout(90)
async def test_global_initial_sync_lists_an_invite_from_another_server(
    database_dsn: str, second_database_dsn: str, tmp_path: Path
) -> None:
    """Bob on B is invited by Alice on A to a room B is not in: B's ``/initialSync`` lists the room
    as an invite, with the stripped invite event A sent and Alice as the inviter."""
    async with two_servers(database_dsn, second_database_dsn, tmp_path) as (a, b):
        ca = Client(f"http://127.0.0.1:{a.config.listeners[0].port}")
        cb = Client(f"http://127.0.0.1:{b.config.listeners[0].port}")
        alice = await ca.register_ok("alice")
        bob = await cb.register_ok("bob")
        room_id = (await _ok(ca, "POST", "createRoom", {}, token=alice["access_token"]))["room_id"]
        await _ok(ca, "POST", f"rooms/{quote(room_id)}/invite", {"user_id": bob["user_id"]}, token=alice["access_token"])
        snapshot = await _ok(cb, "GET", "initialSync", token=bob["access_token"])
        rooms = {r["room_id"]: r for r in snapshot["rooms"]}
        assert rooms[room_id]["membership"] == "invite" and rooms[room_id]["inviter"] == alice["user_id"]
        assert rooms[room_id]["invite"]["state_key"] == bob["user_id"]
        assert rooms[room_id]["invite"]["content"]["membership"] == "invite"
