"""To-device messages through /sync, end-to-end key upload/query/claim, and presence status."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final
from urllib.parse import quote

from twisted.internet.defer import Deferred, gatherResults
from signedjson.key import encode_verify_key_base64, generate_signing_key, get_verify_key
from signedjson.sign import sign_json

from tests.integration.test_client_support import GENEROUS, SERVER_NAME, Client, running_server

ROOM_LIMITS: Final = {
    "rc_message": GENEROUS,
    "rc_joins": {"local": GENEROUS, "remote": GENEROUS},
    "rc_invites": {"per_room": GENEROUS, "per_user": GENEROUS, "per_issuer": GENEROUS},
}

ALICE = f"@alice:{SERVER_NAME}"
BOB = f"@bob:{SERVER_NAME}"


def signed_keys(user_id: str, device_id: str) -> dict[str, Any]:
    """Device keys as a client uploads them: signed by the device's own ed25519 key."""
    key = generate_signing_key(device_id)
    keys = {"user_id": user_id, "device_id": device_id, "algorithms": ["m.olm.v1.curve25519-aes-sha2"],
            "keys": {f"curve25519:{device_id}": "c" * 43,
                     f"ed25519:{device_id}": encode_verify_key_base64(get_verify_key(key))}}
    return sign_json(keys, user_id, key)


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

        keys = signed_keys(BOB, "BDEV")
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
        unsigned = await client.request("POST", "keys/upload", {"device_keys": {**keys, "signatures": {}}}, token=bob)
        assert unsigned.status == 400 and unsigned.body["errcode"] == "M_BAD_JSON"
        tampered = {**keys, "keys": {**keys["keys"], "curve25519:BDEV": "other"}}
        refused = await client.request("POST", "keys/upload", {"device_keys": tampered}, token=bob)
        assert refused.status == 400 and refused.body["errcode"] == "M_INVALID_PARAM"
        queried = await _ok(client, "POST", "keys/query", {"device_keys": {BOB: []}}, token=alice)
        assert queried["device_keys"][BOB]["BDEV"]["keys"] == keys["keys"]
        assert queried["failures"] == {}
        claim = {"one_time_keys": {BOB: {"BDEV": "signed_curve25519"}}}
        claimed = await _ok(client, "POST", "keys/claim", claim, token=alice)
        assert claimed["one_time_keys"][BOB]["BDEV"] == {"signed_curve25519:AAA": {"key": "k1"}}
        assert (await _ok(client, "POST", "keys/claim", claim, token=alice))["one_time_keys"][BOB]["BDEV"] == {
            "signed_curve25519:AAB": {"key": "k2"}
        }
        assert (await _ok(client, "POST", "keys/claim", claim, token=alice))["one_time_keys"] == {}
        synced = await _ok(client, "GET", "sync", token=bob)
        assert synced["device_one_time_keys_count"] == {"signed_curve25519": 0}
        assert synced["device_unused_fallback_key_types"] == []
        bad_changes = await client.request("GET", "keys/changes?from=s0&to=s1", token=bob)
        assert bad_changes.status == 400 and bad_changes.body["errcode"] == "M_INVALID_PARAM"
        assert (await client.request("GET", "keys/changes", token=bob)).status == 400

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


async def test_device_lists_fallback_keys_and_claims(database_dsn: str, tmp_path: Path) -> None:
    """Bob's devices change (keys, a new login, a rename, a deletion): Alice, who shares a room with
    him, sees him in /sync ``device_lists.changed`` and in /keys/changes; when he leaves the room he is
    in ``left``. Fallback keys are handed out when the one-time keys run out, and concurrent claims
    never get the same one-time key. A user on a server that cannot be reached is in ``failures``."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice = (await client.register_ok("alice", device_id="ADEV"))["access_token"]
        bob = (await client.register_ok("bob", device_id="BDEV"))["access_token"]
        room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        start = (await _ok(client, "GET", "sync?timeout=0", token=alice))["next_batch"]
        await _ok(client, "POST", f"join/{quote(room_id)}", {}, token=bob)
        joined = await _ok(client, "GET", f"sync?since={start}&timeout=0", token=alice)
        assert joined["device_lists"] == {"changed": [BOB], "left": []}  # Bob began sharing a room

        since = joined["next_batch"]
        await _ok(client, "POST", "keys/upload", {"device_keys": signed_keys(BOB, "BDEV")}, token=bob)
        synced = await _ok(client, "GET", f"sync?since={since}&timeout=5000", token=alice)
        assert synced["device_lists"] == {"changed": [BOB], "left": []}
        # The same keys again change nothing.
        stored = (await _ok(client, "POST", "keys/query", {"device_keys": {BOB: ["BDEV"]}}, token=bob))
        await _ok(client, "POST", "keys/upload", {"device_keys": stored["device_keys"][BOB]["BDEV"]}, token=bob)
        quiet = await _ok(client, "GET", f"sync?since={synced['next_batch']}&timeout=0", token=alice)
        assert quiet["device_lists"] == {"changed": [], "left": []}

        # A second login, its rename: Bob's devices changed, and /keys/changes says so too.
        second = await client.login("bob", device_id="BDEV2", initial_device_display_name="tablet")
        assert second.status == 200, second
        await _ok(client, "PUT", "devices/BDEV2", {"display_name": "old tablet"}, token=bob)
        after = await _ok(client, "GET", f"sync?since={quiet['next_batch']}&timeout=0", token=alice)
        assert after["device_lists"]["changed"] == [BOB]
        changes = await _ok(client, "GET", f"keys/changes?from={quote(since)}&to={quote(after['next_batch'])}",
                            token=alice)
        assert changes == {"changed": [BOB], "left": []}
        # Bob himself learns of his own devices' changes (his other devices must).
        assert BOB in (await _ok(client, "GET", f"sync?since={since}&timeout=0", token=bob))["device_lists"]["changed"]
        queried = await _ok(client, "POST", "keys/query", {"device_keys": {BOB: []}}, token=alice)
        assert list(queried["device_keys"][BOB]) == ["BDEV"]  # BDEV2 has no keys yet

        # Fallback keys: counted in /sync until used, handed out when no one-time key is left.
        upload = {"one_time_keys": {"signed_curve25519:A1": {"key": "one"}},
                  "fallback_keys": {"signed_curve25519:F1": {"key": "fallback", "fallback": True}}}
        await _ok(client, "POST", "keys/upload", upload, token=bob)
        bob_sync = await _ok(client, "GET", "sync?timeout=0", token=bob)
        assert bob_sync["device_unused_fallback_key_types"] == ["signed_curve25519"]
        assert bob_sync["device_one_time_keys_count"]["signed_curve25519"] == 1
        claim = {"one_time_keys": {BOB: {"BDEV": "signed_curve25519"}}}
        claims = await gatherResults([
            Deferred.fromCoroutine(_ok(client, "POST", "keys/claim", claim, token=alice)) for _ in range(4)])
        handed = [next(iter(c["one_time_keys"][BOB]["BDEV"])) for c in claims]
        assert sorted(handed) == ["signed_curve25519:A1"] + ["signed_curve25519:F1"] * 3  # A1 exactly once
        bob_sync = await _ok(client, "GET", "sync?timeout=0", token=bob)
        assert bob_sync["device_unused_fallback_key_types"] == []

        # A user of a server this one cannot reach: named in failures, the rest still answered.
        unreachable = "@carol:127.0.0.1:1"
        mixed = await _ok(client, "POST", "keys/query", {"device_keys": {BOB: [], unreachable: []}, "timeout": 2000},
                          token=alice)
        assert "BDEV" in mixed["device_keys"][BOB] and list(mixed["failures"]) == ["127.0.0.1:1"]
        claimed = await _ok(client, "POST", "keys/claim",
                            {"one_time_keys": {unreachable: {"D": "signed_curve25519"}}}, token=alice)
        assert claimed["one_time_keys"] == {} and list(claimed["failures"]) == ["127.0.0.1:1"]
        for bad in ({"device_keys": {"not-a-user": []}}, {"device_keys": {BOB: "x"}}, {"device_keys": {BOB: []},
                                                                                          "timeout": "soon"}):
            refused = await client.request("POST", "keys/query", bad, token=alice)
            assert refused.status == 400 and "errcode" in refused.body, (bad, refused)

        # Deleting a device drops its keys; leaving the room puts Bob in Alice's device_lists.left.
        mark = (await _ok(client, "GET", "sync?timeout=0", token=alice))["next_batch"]
        deleted = await client.request("POST", "delete_devices", {"devices": ["BDEV2"]}, token=bob)
        assert deleted.status in (200, 401), deleted  # 401: user-interactive auth first
        if deleted.status == 401:
            auth = {"type": "m.login.password", "identifier": {"type": "m.id.user", "user": "bob"},
                    "password": "password", "session": deleted.body["session"]}
            await _ok(client, "POST", "delete_devices", {"devices": ["BDEV2"], "auth": auth}, token=bob)
        await _ok(client, "POST", f"rooms/{quote(room_id)}/leave", {}, token=bob)
        left = await _ok(client, "GET", f"sync?since={mark}&timeout=0", token=alice)
        assert left["device_lists"] == {"changed": [], "left": [BOB]}


def cross_signing_keys(user_id: str) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """(master, self_signing, user_signing keys as uploaded; their signing keys by usage)."""
    signing = {usage: generate_signing_key(usage) for usage in ("master", "self_signing", "user_signing")}
    public = {usage: encode_verify_key_base64(get_verify_key(key)) for usage, key in signing.items()}
    for usage, key in signing.items():
        key.version = public[usage]  # signatures name the key by its public key
    keys = {usage: {"user_id": user_id, "usage": [usage], "keys": {f"ed25519:{public[usage]}": public[usage]}}
            for usage in signing}
    keys["self_signing"] = sign_json(keys["self_signing"], user_id, signing["master"])
    keys["user_signing"] = sign_json(keys["user_signing"], user_id, signing["master"])
    return keys, signing


def public_of(key: dict[str, Any]) -> str:
    return str(next(iter(key["keys"].values())))


async def test_cross_signing(database_dsn: str, tmp_path: Path) -> None:
    """Alice sets up cross-signing (the first upload needs no password, a replacement does), signs
    her device with her self-signing key and Bob's master key with her user-signing key; Bob sees
    her master and self-signing keys and her device's signature, but not her user-signing key nor
    her signature of his key; malformed or badly signed uploads are refused."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice = (await client.register_ok("alice", device_id="ADEV"))["access_token"]
        bob = (await client.register_ok("bob", device_id="BDEV"))["access_token"]
        room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        await _ok(client, "POST", f"join/{quote(room_id)}", {}, token=bob)
        since = (await _ok(client, "GET", "sync?timeout=0", token=bob))["next_batch"]

        keys, signing = cross_signing_keys(ALICE)
        forged = {**keys["self_signing"], "signatures": {}}
        refused = await client.request("POST", "keys/device_signing/upload",
                                       {"master_key": keys["master"], "self_signing_key": forged}, token=alice)
        assert refused.status == 400 and refused.body["errcode"] == "M_INVALID_SIGNATURE", refused
        wrong_usage = await client.request("POST", "keys/device_signing/upload",
                                           {"master_key": {**keys["master"], "usage": ["self_signing"]}}, token=alice)
        assert wrong_usage.status == 400, wrong_usage
        body = {"master_key": keys["master"], "self_signing_key": keys["self_signing"],
                "user_signing_key": keys["user_signing"]}
        await _ok(client, "POST", "keys/device_signing/upload", body, token=alice)
        # Replacing them asks for the password.
        again = await client.request("POST", "keys/device_signing/upload", body, token=alice)
        assert again.status == 401 and "session" in again.body, again
        auth = {"type": "m.login.password", "identifier": {"type": "m.id.user", "user": "alice"},
                "password": "password", "session": again.body["session"]}
        await _ok(client, "POST", "keys/device_signing/upload", {**body, "auth": auth}, token=alice)

        device = signed_keys(ALICE, "ADEV")
        await _ok(client, "POST", "keys/upload", {"device_keys": device}, token=alice)
        signed_device = sign_json({k: v for k, v in device.items() if k != "signatures"}, ALICE,
                                  signing["self_signing"])
        bob_keys, _ = cross_signing_keys(BOB)
        await _ok(client, "POST", "keys/device_signing/upload", {"master_key": bob_keys["master"]}, token=bob)
        bob_master = public_of(bob_keys["master"])
        signed_bob = sign_json(dict(bob_keys["master"]), ALICE, signing["user_signing"])
        uploaded = await _ok(client, "POST", "keys/signatures/upload", {
            ALICE: {"ADEV": signed_device, "NOPE": signed_device},
            BOB: {bob_master: signed_bob, "junk": {"signatures": {}}},
        }, token=alice)
        assert set(uploaded["failures"][ALICE]) == {"NOPE"} and set(uploaded["failures"][BOB]) == {"junk"}

        seen_by_bob = await _ok(client, "POST", "keys/query", {"device_keys": {ALICE: [], BOB: []}}, token=bob)
        assert seen_by_bob["master_keys"][ALICE]["keys"] == keys["master"]["keys"]
        assert seen_by_bob["self_signing_keys"][ALICE]["keys"] == keys["self_signing"]["keys"]
        assert seen_by_bob["user_signing_keys"] == {}
        ssk_id = f"ed25519:{public_of(keys['self_signing'])}"
        assert ssk_id in seen_by_bob["device_keys"][ALICE]["ADEV"]["signatures"][ALICE]
        assert ALICE not in seen_by_bob["master_keys"][BOB].get("signatures", {})  # Alice's signature is hers
        seen_by_alice = await _ok(client, "POST", "keys/query", {"device_keys": {ALICE: [], BOB: []}}, token=alice)
        assert seen_by_alice["user_signing_keys"][ALICE]["keys"] == keys["user_signing"]["keys"]
        usk_id = f"ed25519:{public_of(keys['user_signing'])}"
        assert usk_id in seen_by_alice["master_keys"][BOB]["signatures"][ALICE]
        # Alice's key changes are device-list changes for Bob.
        assert ALICE in (await _ok(client, "GET", f"sync?since={since}&timeout=0", token=bob))["device_lists"]["changed"]


async def test_key_backup(database_dsn: str, tmp_path: Path) -> None:
    """Alice backs up room keys: no backup is 404 M_NOT_FOUND; a version is created, read and
    updated; keys are stored, replaced only by better ones (etag moving on only then), read per
    backup, room and session, and deleted; a stale version is 403 M_WRONG_ROOM_KEYS_VERSION."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice = (await client.register_ok("alice", device_id="ADEV"))["access_token"]
        none = await client.request("GET", "room_keys/version", token=alice)
        assert none.status == 404 and none.body["errcode"] == "M_NOT_FOUND", none
        auth_data = {"public_key": "abc", "signatures": {}}
        algorithm = "m.megolm_backup.v1.curve25519-aes-sha2"
        created = await _ok(client, "POST", "room_keys/version", {"algorithm": algorithm, "auth_data": auth_data},
                            token=alice)
        version = created["version"]
        current = await _ok(client, "GET", "room_keys/version", token=alice)
        assert current == {"algorithm": algorithm, "auth_data": auth_data, "count": 0, "etag": "0",
                           "version": version}
        await _ok(client, "PUT", f"room_keys/version/{version}",
                  {"algorithm": algorithm, "auth_data": {**auth_data, "x": 1}, "version": version}, token=alice)
        assert (await _ok(client, "GET", f"room_keys/version/{version}", token=alice))["auth_data"]["x"] == 1
        changed_algorithm = await client.request("PUT", f"room_keys/version/{version}",
                                                 {"algorithm": "other", "auth_data": {}}, token=alice)
        assert changed_algorithm.status == 400

        room = "!room:localhost"
        session = {"first_message_index": 5, "forwarded_count": 1, "is_verified": False, "session_data": {"c": 1}}
        put = await _ok(client, "PUT", f"room_keys/keys?version={version}",
                        {"rooms": {room: {"sessions": {"s1": session, "s2": session}}}}, token=alice)
        assert put["count"] == 2
        etag = put["etag"]
        worse = {**session, "first_message_index": 9, "session_data": {"c": 2}}
        kept = await _ok(client, "PUT", f"room_keys/keys/{quote(room)}/s1?version={version}", worse, token=alice)
        assert kept == {"count": 2, "etag": etag}  # a worse key changes nothing
        better = {**session, "is_verified": True, "first_message_index": 9, "session_data": {"c": 3}}
        replaced = await _ok(client, "PUT", f"room_keys/keys/{quote(room)}?version={version}",
                             {"sessions": {"s1": better}}, token=alice)
        assert replaced["count"] == 2 and replaced["etag"] != etag
        one = await _ok(client, "GET", f"room_keys/keys/{quote(room)}/s1?version={version}", token=alice)
        assert one == better
        everything = await _ok(client, "GET", f"room_keys/keys?version={version}", token=alice)
        assert set(everything["rooms"][room]["sessions"]) == {"s1", "s2"}
        assert await _ok(client, "GET", f"room_keys/keys/{quote('!other:localhost')}?version={version}",
                         token=alice) == {"sessions": {}}
        missing = await client.request("GET", f"room_keys/keys/{quote(room)}/s9?version={version}", token=alice)
        assert missing.status == 404 and missing.body["errcode"] == "M_NOT_FOUND"
        no_version = await client.request("GET", "room_keys/keys", token=alice)
        assert no_version.status == 400 and no_version.body["errcode"] == "M_MISSING_PARAM"
        bad = await client.request("PUT", f"room_keys/keys?version={version}",
                                   {"rooms": {room: {"sessions": {"s3": {"is_verified": 1}}}}}, token=alice)
        assert bad.status == 400

        deleted = await _ok(client, "DELETE", f"room_keys/keys/{quote(room)}/s2?version={version}", token=alice)
        assert deleted["count"] == 1
        newer = (await _ok(client, "POST", "room_keys/version", {"algorithm": algorithm, "auth_data": auth_data},
                           token=alice))["version"]
        stale = await client.request("PUT", f"room_keys/keys?version={version}",
                                     {"rooms": {room: {"sessions": {"s1": session}}}}, token=alice)
        assert stale.status == 403 and stale.body == {"errcode": "M_WRONG_ROOM_KEYS_VERSION",
                                                      "error": "Wrong backup version", "current_version": newer}
        await _ok(client, "DELETE", f"room_keys/version/{newer}", token=alice)
        await _ok(client, "DELETE", f"room_keys/version/{version}", token=alice)
        gone = await client.request("GET", "room_keys/version", token=alice)
        assert gone.status == 404 and gone.body["errcode"] == "M_NOT_FOUND"
        again = await client.request("DELETE", f"room_keys/version/{version}", token=alice)
        assert again.status == 404
        # Another user sees none of it.
        bob = (await client.register_ok("bob"))["access_token"]
        assert (await client.request("GET", f"room_keys/version/{version}", token=bob)).status == 404
