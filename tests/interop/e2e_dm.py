"""The encrypted-DM scenario of ``make interop``: matrix-nio's own encryption between Tributary and Synapse.

Tom on Tributary opens an encrypted DM with Sam on Synapse; their nio clients
(each logged in on a fresh device, with vodozemac) exchange keys through both
servers' ``/keys/query`` and ``/keys/claim`` (each asking the other over
federation) and olm-encrypted to-device messages, and each decrypts the
other's message. Sam then logs in on a second device: Synapse's
``m.device_list_update`` reaches Tributary, Tom's ``/sync`` names Sam in
``device_lists.changed``, and the second device decrypts Tom's next message.
A verification request (a to-device message) from Tom reaches it too. Last, Tom sets up
cross-signing, then replaces his master key: Sam's ``/keys/query`` on Synapse, which answers a
user whose device list it tracks from its own cache, shows the new key only because
Tributary's ``m.signing_key_update`` reached it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import nio
from nio import responses

from tests.integration.test_client_e2e import cross_signing_keys

ENCRYPTION = {"type": "m.room.encryption", "state_key": "", "content": {"algorithm": "m.megolm.v1.aes-sha2"}}
FILTER = {"room": {"timeline": {"limit": 50}}}

Step = Callable[[str], AbstractContextManager[None]]


def _client(base_url: str, user: str, store: Path) -> nio.AsyncClient:
    store.mkdir(parents=True)
    config = nio.AsyncClientConfig(encryption_enabled=True, store_sync_tokens=False)
    return nio.AsyncClient(base_url, user, store_path=str(store), config=config)


async def _login(c: nio.AsyncClient, password: str, device: str) -> None:
    logged_in = await c.login(password, device_name=device)
    assert isinstance(logged_in, responses.LoginResponse), logged_in
    assert isinstance(await c.keys_upload(), responses.KeysUploadResponse)


async def _sync_until(c: nio.AsyncClient, done: Callable[[responses.SyncResponse], bool], what: str,
                      *, seconds: float = 60) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while loop.time() < deadline:
        response = await c.sync(timeout=1000, sync_filter=FILTER)
        assert isinstance(response, responses.SyncResponse), response
        if c.should_upload_keys:
            await c.keys_upload()
        if c.should_query_keys:
            await c.keys_query()
        if done(response):
            return
    raise AssertionError(f"{c.user_id} ({c.device_id}) never {what}")


def _decrypted(room_id: str, body: str, seen: set[str]) -> Callable[[responses.SyncResponse], bool]:
    def check(response: responses.SyncResponse) -> bool:
        room = response.rooms.join.get(room_id)
        for event in room.timeline.events if room is not None else []:
            if isinstance(event, nio.RoomMessageText) and event.decrypted:
                seen.add(event.body)
        return body in seen

    return check


async def _send(c: nio.AsyncClient, room_id: str, body: str) -> None:
    sent = await c.room_send(room_id, "m.room.message", {"msgtype": "m.text", "body": body},
                             ignore_unverified_devices=True)
    assert isinstance(sent, responses.RoomSendResponse), sent


async def _call(c: nio.AsyncClient, method: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    response = await c.send(method, f"/_matrix/client/v3/{path}", json.dumps(body),
                            headers={"Authorization": f"Bearer {c.access_token}", "Content-Type": "application/json"})
    return response.status, await response.json()


async def _upload_cross_signing(c: nio.AsyncClient, password: str) -> dict[str, Any]:
    """New master, self-signing and user-signing keys for ``c``'s user; the password when asked
    (a replacement). Returns the master key."""
    keys, _ = cross_signing_keys(c.user_id)
    body: dict[str, Any] = {"master_key": keys["master"], "self_signing_key": keys["self_signing"],
                            "user_signing_key": keys["user_signing"]}
    status, answer = await _call(c, "POST", "keys/device_signing/upload", body)
    if status == 401:
        body["auth"] = {"type": "m.login.password", "identifier": {"type": "m.id.user", "user": c.user_id},
                        "password": password, "session": answer["session"]}
        status, answer = await _call(c, "POST", "keys/device_signing/upload", body)
    assert status == 200, (status, answer)
    return keys["master"]


async def _master_key_seen(c: nio.AsyncClient, user_id: str, master: dict[str, Any], *, seconds: float = 30) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    answer: Any = None
    while loop.time() < deadline:
        status, answer = await _call(c, "POST", "keys/query", {"device_keys": {user_id: []}})
        assert status == 200, (status, answer)
        if answer.get("master_keys", {}).get(user_id, {}).get("keys") == master["keys"]:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"{c.user_id}'s key query never showed {user_id}'s master key {master['keys']}: {answer}")


async def encrypted_dm(step: Step, *, synapse_url: str, tributary_url: str, sam: tuple[str, str],
                       tom: tuple[str, str], workdir: Path) -> None:
    """``sam``, ``tom``: (user ID, password) of users registered already."""
    sam_id, tom_id = sam[0], tom[0]
    tom1 = _client(tributary_url, tom_id, workdir / "tom1")
    sam1 = _client(synapse_url, sam_id, workdir / "sam1")
    sam2 = _client(synapse_url, sam_id, workdir / "sam2")
    try:
        with step("encrypted DM: both log in with nio (olm) and upload device keys"):
            await _login(tom1, tom[1], "tom nio")
            await _login(sam1, sam[1], "sam nio")
        with step("encrypted DM: Tributary user opens an encrypted DM, Synapse user joins"):
            created = await tom1.room_create(is_direct=True, invite=[sam_id], initial_state=[ENCRYPTION])
            assert isinstance(created, responses.RoomCreateResponse), created
            room_id = created.room_id
            await _sync_until(sam1, lambda r: room_id in r.rooms.invite, "saw the invite")
            assert isinstance(await sam1.join(room_id), responses.JoinResponse)
            await _sync_until(tom1, lambda _: sam_id in tom1.rooms[room_id].users, "saw Sam join")
        with step("encrypted DM: Tributary -> Synapse message decrypted on Synapse"):
            await _send(tom1, room_id, "secret from tributary")
            sam_seen: set[str] = set()
            await _sync_until(sam1, _decrypted(room_id, "secret from tributary", sam_seen), "decrypted Tom's message")
        with step("encrypted DM: Synapse -> Tributary message decrypted on Tributary"):
            await _sync_until(sam1, lambda _: tom_id in sam1.rooms[room_id].users, "saw Tom")
            await _send(sam1, room_id, "secret from synapse")
            tom_seen: set[str] = set()
            await _sync_until(tom1, _decrypted(room_id, "secret from synapse", tom_seen), "decrypted Sam's message")
        with step("encrypted DM: Synapse user's second device shows in Tributary user's device_lists.changed"):
            await _login(sam2, sam[1], "sam second")
            changed: list[str] = []

            def saw_device(response: responses.SyncResponse) -> bool:
                changed.extend(response.device_list.changed)
                return any(d.id == sam2.device_id for d in tom1.device_store.active_user_devices(sam_id))

            await _sync_until(tom1, saw_device, "learnt Sam's second device")
            assert sam_id in changed, changed
        with step("encrypted DM: the second device decrypts the next message"):
            await sam2.sync(timeout=0, sync_filter=FILTER)
            shared = await tom1.share_group_session(room_id, ignore_unverified_devices=True)
            assert isinstance(shared, responses.ShareGroupSessionResponse), shared
            await _send(tom1, room_id, "for both of sam's devices")
            second_seen: set[str] = set()
            await _sync_until(sam2, _decrypted(room_id, "for both of sam's devices", second_seen),
                              "decrypted on the second device")
        with step("encrypted DM: a verification request reaches the other server's device"):
            request = {"from_device": tom1.device_id, "methods": ["m.sas.v1"], "transaction_id": "interop-verify",
                       "timestamp": 1}
            message = nio.ToDeviceMessage("m.key.verification.request", sam_id, sam2.device_id, request)
            assert isinstance(await tom1.to_device(message), responses.ToDeviceResponse)
            await _sync_until(sam2, lambda r: any(
                e.source.get("content", {}).get("transaction_id") == "interop-verify" for e in r.to_device_events),
                "got the verification request")
        with step("cross-signing: the Tributary user's master key shows in the Synapse user's key query"):
            first = await _upload_cross_signing(tom1, tom[1])
            await _master_key_seen(sam1, tom_id, first)
        with step("cross-signing: a replaced master key reaches Synapse (m.signing_key_update)"):
            second = await _upload_cross_signing(tom1, tom[1])
            assert second["keys"] != first["keys"]
            await _master_key_seen(sam1, tom_id, second)
    finally:
        for c in (tom1, sam1, sam2):
            await c.close()
