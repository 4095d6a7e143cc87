"""To-device messages through /sync, end-to-end key upload/query/claim, and presence status."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final
from urllib.parse import quote

from tests.integration.test_client_support import GENEROUS, SERVER_NAME, Client, running_server

ROOM_LIMITS: Final = {
    "rc_message": GENEROUS,
    "rc_joins": {"local": GENEROUS, "remote": GENEROUS},
    "rc_invites": {"per_room": GENEROUS, "per_user": GENEROUS, "per_issuer": GENEROUS},
}

ALICE = f"@alice:{SERVER_NAME}"
BOB = f"@bob:{SERVER_NAME}"


async def _ok(client: Client, method: str, path: str, body: Any = None, *, token: str) -> Any:
    response = await client.request(method, path, body, token=token)
    assert response.status == 200, (method, path, response)
    return response.body


async def test_to_device_keys_and_presence(database_dsn: str, tmp_path: Path) -> None:
    """Alice sends Bob's device a to-device message (twice with one txnId); he gets it once, then it is gone."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice = (await client.register_ok("alice", device_id="ADEV"))["access_token"]
        bob = (await client.register_ok("bob", device_id="BDEV"))["access_token"]
        since = (await _ok(client, "GET", "sync", token=bob))["next_batch"]
        message = {"messages": {BOB: {"BDEV": {"hello": "there"}}}}
        await _ok(client, "PUT", "sendToDevice/m.test/txn1", message, token=alice)
        await _ok(client, "PUT", "sendToDevice/m.test/txn1", message, token=alice)
        first = await _ok(client, "GET", f"sync?since={since}&timeout=5000", token=bob)
        assert first["to_device"]["events"] == [{"type": "m.test", "sender": ALICE, "content": {"hello": "there"}}]
        second = await _ok(client, "GET", f"sync?since={first['next_batch']}&timeout=0", token=bob)
        assert second["to_device"]["events"] == []
        await _ok(client, "PUT", "sendToDevice/m.test/txn2", {"messages": {BOB: {"*": {"n": 2}}}}, token=alice)
        third = await _ok(client, "GET", f"sync?since={second['next_batch']}&timeout=0", token=bob)
        assert [e["content"] for e in third["to_device"]["events"]] == [{"n": 2}]

        keys = {"user_id": BOB, "device_id": "BDEV", "algorithms": ["m.olm.v1.curve25519-aes-sha2"],
                "keys": {"curve25519:BDEV": "c", "ed25519:BDEV": "e"}, "signatures": {}}  # fmt: skip
        uploaded = await _ok(
            client,
            "POST",
            "keys/upload",
            {"device_keys": keys, "one_time_keys": {"signed_curve25519:AAA": {"key": "k1"}, "signed_curve25519:AAB": {"key": "k2"}}},
            token=bob,
        )
        assert uploaded["one_time_key_counts"]["signed_curve25519"] == 2
        wrong = await client.request("POST", "keys/upload", {"device_keys": {**keys, "device_id": "OTHER"}}, token=bob)
        assert wrong.status == 400
        queried = await _ok(client, "POST", "keys/query", {"device_keys": {BOB: []}}, token=alice)
        assert queried["device_keys"][BOB]["BDEV"]["keys"] == keys["keys"]
        claim = {"one_time_keys": {BOB: {"BDEV": "signed_curve25519"}}}
        claimed = await _ok(client, "POST", "keys/claim", claim, token=alice)
        assert claimed["one_time_keys"][BOB]["BDEV"] == {"signed_curve25519:AAA": {"key": "k1"}}
        assert (await _ok(client, "POST", "keys/claim", claim, token=alice))["one_time_keys"][BOB]["BDEV"] == {
            "signed_curve25519:AAB": {"key": "k2"}
        }
        assert (await _ok(client, "POST", "keys/claim", claim, token=alice))["one_time_keys"] == {}
        counts = (await _ok(client, "GET", "sync", token=bob))["device_one_time_keys_count"]
        assert counts == {"signed_curve25519": 0}
        assert await _ok(client, "GET", "keys/changes?from=s0&to=s1", token=bob) == {"changed": [], "left": []}

        # Presence is visible to the user and to those sharing a joined room: not yet to Alice (403).
        hidden = await client.request("GET", f"presence/{quote(BOB)}/status", token=alice)
        assert hidden.status == 403 and hidden.body["errcode"] == "M_FORBIDDEN"
        # A user who never synced nor set a status has the initial status: offline (not a 404).
        assert await _ok(client, "GET", f"presence/{quote(ALICE)}/status", token=alice) == {"presence": "offline"}
        room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        await _ok(client, "POST", f"join/{quote(room_id)}", {}, token=bob)
        assert await _ok(client, "GET", f"presence/{quote(ALICE)}/status", token=bob) == {"presence": "offline"}
        # Bob synced above: a syncing user is online. Nobody shares no room with Alice.
        synced = await _ok(client, "GET", f"presence/{quote(BOB)}/status", token=alice)
        assert synced["presence"] == "online"
        unknown = await client.request("GET", f"presence/{quote(BOB.replace('@bob', '@nobody'))}/status", token=alice)
        assert unknown.status == 403
        await _ok(client, "PUT", f"presence/{quote(BOB)}/status", {"presence": "online", "status_msg": "hi"}, token=bob)
        status = await _ok(client, "GET", f"presence/{quote(BOB)}/status", token=alice)
        assert status["presence"] == "online" and status["status_msg"] == "hi" and status["currently_active"] is True
        other = await client.request("PUT", f"presence/{quote(BOB)}/status", {"presence": "online"}, token=alice)
        assert other.status == 403
        bad = await client.request("PUT", f"presence/{quote(BOB)}/status", {"presence": "asleep"}, token=bob)
        assert bad.status == 400
