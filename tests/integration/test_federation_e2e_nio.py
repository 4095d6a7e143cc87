"""Encrypted chat between two real ``tributary`` processes, with matrix-nio's own encryption (vodozemac).

Alice on A creates an encrypted room and invites Bob on B. Their clients upload
device keys and one-time keys; Alice's client learns Bob's devices through A's
``/keys/query`` (which asks B), claims one of his one-time keys through A's
``/keys/claim`` (which asks B), and shares the room key with his device in an
olm-encrypted to-device message that A's federation sender carries to B. Each
decrypts the other's messages. Then Bob logs in on a second device: B sends an
``m.device_list_update``, A fetches Bob's list and names him in Alice's
``/sync`` ``device_lists.changed``; Alice's client shares the room key with the
new device, which decrypts her next message. A verification request (a
to-device message) from Alice reaches both of Bob's devices. Bob's cross-signing
keys, uploaded on B, reach A (``m.signing_key_update``) and Alice's key query.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import nio
import psycopg2
import pytest
from nio import responses

from twisted.internet.task import deferLater

from tests.harness import TributaryProcess
from tests.integration.test_client_e2e import cross_signing_keys
from tests.integration.test_client_support import Client
from tests.twisted_plugin import reactor
from tests.integration.test_client_nio import run
# Two federating servers, each on its own database (the fixture of the unencrypted nio test).
from tests.integration.test_federation_nio import servers  # noqa: F401  (a pytest fixture)

pytestmark = pytest.mark.e2e

FILTER = {"room": {"timeline": {"limit": 50}}}
ENCRYPTION = {"type": "m.room.encryption", "state_key": "", "content": {"algorithm": "m.megolm.v1.aes-sha2"}}


def client(base_url: str, user: str, store: Path) -> nio.AsyncClient:
    store.mkdir()
    config = nio.AsyncClientConfig(encryption_enabled=True, store_sync_tokens=False)
    return nio.AsyncClient(base_url, user, store_path=str(store), config=config)


async def sync_until(c: nio.AsyncClient, done: Callable[[responses.SyncResponse], bool], what: str) -> None:
    """Sync (long-polling) as a client's own loop does, uploading and querying keys when it asks to,
    until ``done``; at most ~30 s."""
    for _ in range(60):
        response = await run(c.sync(timeout=500, sync_filter=FILTER))
        assert isinstance(response, responses.SyncResponse), response
        if c.should_upload_keys:
            assert isinstance(await run(c.keys_upload()), responses.KeysUploadResponse)
        if c.should_query_keys:
            assert isinstance(await run(c.keys_query()), responses.KeysQueryResponse)
        if done(response):
            return
    raise AssertionError(f"{c.user_id} on {c.device_id}: never {what}")


def decrypted(room_id: str, body: str, seen: set[str]) -> Callable[[responses.SyncResponse], bool]:
    """Whether ``body`` has arrived decrypted (a text message, not an undecryptable MegolmEvent)."""

    def check(response: responses.SyncResponse) -> bool:
        room = response.rooms.join.get(room_id)
        if room is not None:
            for event in room.timeline.events:
                assert not isinstance(event, nio.MegolmEvent), f"could not decrypt {event}"
                if isinstance(event, nio.RoomMessageText):
                    assert event.decrypted, f"{event.body!r} was sent in the clear"
                    seen.add(event.body)
        return body in seen

    return check


async def send(c: nio.AsyncClient, room_id: str, body: str) -> None:
    sent = await run(c.room_send(room_id, "m.room.message", {"msgtype": "m.text", "body": body},
                                 ignore_unverified_devices=True))
    assert isinstance(sent, responses.RoomSendResponse), sent


@pytest.mark.timeout(180)
async def test_encrypted_chat_across_servers_and_a_second_device(
    servers: tuple[TributaryProcess, ...], tmp_path: Path, database_dsn: str
) -> None:
    a, b = servers
    alice = client(a.base_url, "alice", tmp_path / "alice")
    bob = client(b.base_url, "bob", tmp_path / "bob")
    bob2 = client(b.base_url, "bob", tmp_path / "bob2")
    try:
        assert isinstance(await run(alice.register("alice", "pw-alice")), responses.RegisterResponse)
        assert isinstance(await run(bob.register("bob", "pw-bob")), responses.RegisterResponse)
        bob_id = f"@bob:{b.server_name}"
        for c in (alice, bob):
            assert c.olm is not None, "matrix-nio was installed without its e2e extra"
            assert isinstance(await run(c.keys_upload()), responses.KeysUploadResponse)

        created = await run(alice.room_create(name="Secret", initial_state=[ENCRYPTION]))
        assert isinstance(created, responses.RoomCreateResponse), created
        room_id = created.room_id
        assert isinstance(await run(alice.room_invite(room_id, bob_id)), responses.RoomInviteResponse)
        assert isinstance(await run(bob.join(room_id)), responses.JoinResponse)

        # Alice learns Bob's device over A (which asks B), encrypts to it; Bob decrypts on B.
        await sync_until(alice, lambda _: bob_id in alice.rooms[room_id].users, "saw Bob join")
        assert alice.rooms[room_id].encrypted
        await send(alice, room_id, "hello from A")
        bob_seen: set[str] = set()
        await sync_until(bob, decrypted(room_id, "hello from A", bob_seen), "decrypted Alice's message")

        await send(bob, room_id, "hello from B")
        alice_seen: set[str] = set()
        await sync_until(alice, decrypted(room_id, "hello from A", alice_seen), "saw her own message")
        await sync_until(alice, decrypted(room_id, "hello from B", alice_seen), "decrypted Bob's message")

        # Bob logs in on a second device: Alice's /sync names him in device_lists.changed.
        assert isinstance(await run(bob2.login("pw-bob", device_name="second")), responses.LoginResponse)
        assert bob2.device_id != bob.device_id
        assert isinstance(await run(bob2.keys_upload()), responses.KeysUploadResponse)
        changed: list[str] = []

        def saw_new_device(response: responses.SyncResponse) -> bool:
            changed.extend(response.device_list.changed)
            return any(d.id == bob2.device_id for d in alice.device_store.active_user_devices(bob_id))

        await sync_until(alice, saw_new_device, "learnt Bob's second device")
        assert bob_id in changed
        names = {d.id: d.display_name for d in alice.device_store.active_user_devices(bob_id)}
        assert names[bob2.device_id] == "second"  # unsigned.device_display_name, from B's answer

        # Alice shares the room key with the new device too; it decrypts her next message.
        await run(bob2.sync(timeout=0, sync_filter=FILTER))
        shared = await run(alice.share_group_session(room_id, ignore_unverified_devices=True))
        assert isinstance(shared, responses.ShareGroupSessionResponse), shared
        await send(alice, room_id, "after the second device")
        bob2_seen: set[str] = set()
        await sync_until(bob2, decrypted(room_id, "after the second device", bob2_seen), "decrypted on device 2")
        await sync_until(bob, decrypted(room_id, "after the second device", bob_seen), "decrypted on device 1")

        # A verification request, a to-device message, reaches Bob's devices on the other server.
        request = {"from_device": alice.device_id, "methods": ["m.sas.v1"], "transaction_id": "verify-1",
                   "timestamp": 1}
        for device in (bob.device_id, bob2.device_id):
            message = nio.ToDeviceMessage("m.key.verification.request", bob_id, device, request)
            assert isinstance(await run(alice.to_device(message)), responses.ToDeviceResponse)

        def got_request(response: responses.SyncResponse) -> bool:
            return any(e.source.get("type") == "m.key.verification.request"
                       and e.source.get("content", {}).get("transaction_id") == "verify-1"
                       for e in response.to_device_events)

        await sync_until(bob2, got_request, "got the verification request")
        await sync_until(bob, got_request, "got the verification request")
        # Bob sets up cross-signing on B: A learns his master and self-signing keys (the
        # m.signing_key_update EDU), and Alice's query shows them.
        bob_http, alice_http = Client(b.base_url), Client(a.base_url)
        keys, _ = cross_signing_keys(bob_id)
        upload = {"master_key": keys["master"], "self_signing_key": keys["self_signing"],
                  "user_signing_key": keys["user_signing"]}
        uploaded = await bob_http.request("POST", "keys/device_signing/upload", upload, token=bob.access_token)
        assert uploaded.status == 200, uploaded
        for _ in range(100):
            queried = await alice_http.request("POST", "keys/query", {"device_keys": {bob_id: []}},
                                               token=alice.access_token)
            assert queried.status == 200, queried
            if bob_id in queried.body["master_keys"]:
                break
            await deferLater(reactor, 0.1)
        assert queried.body["master_keys"][bob_id]["keys"] == keys["master"]["keys"]
        assert queried.body["self_signing_keys"][bob_id]["keys"] == keys["self_signing"]["keys"]
        assert queried.body["user_signing_keys"] == {}  # only Bob sees his

        # A holds Bob's list from B (fetched when the first update arrived), complete and fresh.
        with psycopg2.connect(database_dsn) as conn, conn.cursor() as cur:
            cur.execute("SELECT stale FROM remote_device_lists WHERE user_id = %s", (bob_id,))
            assert cur.fetchall() == [(False,)]
            cur.execute("SELECT device_id, display_name FROM remote_devices WHERE user_id = %s ORDER BY device_id",
                        (bob_id,))
            assert sorted(cur.fetchall()) == sorted([(bob.device_id, None), (bob2.device_id, "second")])
        conn.close()
    finally:
        for c in (alice, bob, bob2):
            await run(c.close())
