"""The older client endpoints that clients and bridges still call, over HTTP against a real server.

``POST /rooms/{roomId}/send/{eventType}`` without a transaction ID, the room and
global ``/initialSync``, the ``/events`` long-poll stream, and ``/messages``
taking a ``/sync`` token: bodies as the r0.6.1 spec gives them (Synapse's
answers where it is silent).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.integration.test_client_rooms import ALICE, ROOM_LIMITS
from tests.integration.test_client_support import Client, running_server


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
