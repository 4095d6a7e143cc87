"""Every room version, 1 to 12, end to end between two Tributary servers (issue 19).

For each version: Alice (A) creates a public room of that version through the client API,
Carol (A) joins locally and Bob (B) over federation (make_join with ``ver`` / send_join),
all three send, Alice redacts Bob's message and Bob his own, and both servers' history
(/messages) shows the messages in order with the redacted ones emptied.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any
from urllib.parse import quote as _quote

import pytest

from homeserver.app import HomeServer
from tests.integration.test_client_support import GENEROUS, Client
from tests.integration.test_federation import eventually, name, stored
from tests.integration.test_federation import two_servers as federating_pair

VERSIONS = [str(n) for n in range(1, 13)]


def quote(value: str) -> str:
    return _quote(value, safe="")


async def _ok(client: Client, method: str, path: str, body: Any = None, *, token: str) -> Any:
    response = await client.request(method, path, body, token=token)
    assert response.status == 200, (method, path, response)
    return response.body


def two_servers(dsn_a: str, dsn_b: str, tmp_path: Path) -> AbstractAsyncContextManager[tuple[HomeServer, HomeServer]]:
    """test_federation's two servers, with join limits generous enough for 36 joins in a row."""
    return federating_pair(dsn_a, dsn_b, tmp_path, extra={"rc_joins": {"local": GENEROUS, "remote": GENEROUS}})


@pytest.mark.timeout(180)
async def test_every_room_version_creates_joins_chats_and_redacts(
    database_dsn: str, second_database_dsn: str, tmp_path: Path
) -> None:
    async with two_servers(database_dsn, second_database_dsn, tmp_path) as (a, b):
        ca = Client(f"http://127.0.0.1:{a.config.listeners[0].port}")
        cb = Client(f"http://127.0.0.1:{b.config.listeners[0].port}")
        alice = (await ca.register_ok("alice"))["access_token"]
        carol = (await ca.register_ok("carol"))["access_token"]
        bob = (await cb.register_ok("bob"))["access_token"]

        caps = await _ok(ca, "GET", "capabilities", token=alice)
        assert caps["capabilities"]["m.room_versions"]["available"] == {v: "stable" for v in VERSIONS}

        for version in VERSIONS:
            room_id = (await _ok(ca, "POST", "createRoom", {"preset": "public_chat", "room_version": version},
                                 token=alice))["room_id"]
            create = await _ok(ca, "GET", f"rooms/{quote(room_id)}/state/m.room.create/", token=alice)
            assert create["room_version"] == version
            await _ok(ca, "POST", f"join/{quote(room_id)}", {}, token=carol)
            await _ok(cb, "POST", f"join/{quote(room_id)}?server_name={quote(name(a))}", {}, token=bob)

            sent: dict[str, str] = {}
            for who, client, token in (("alice", ca, alice), ("carol", ca, carol), ("bob", cb, bob)):
                body = await _ok(client, "PUT", f"rooms/{quote(room_id)}/send/m.room.message/v{version}",
                                 {"msgtype": "m.text", "body": f"{who} in v{version}"}, token=token)
                sent[who] = body["event_id"]
                if version in ("1", "2"):
                    assert sent[who].endswith(":" + name(a if client is ca else b)), sent[who]
                else:
                    assert ":" not in sent[who]
            bobs_second = (await _ok(cb, "PUT", f"rooms/{quote(room_id)}/send/m.room.message/w{version}",
                                     {"msgtype": "m.text", "body": "bob again"}, token=bob))["event_id"]
            await eventually(lambda: stored(a, bobs_second))
            await eventually(lambda: stored(b, sent["carol"]))

            # Alice (A, power 100) redacts Bob's message; Bob (B) redacts his own.
            redaction_a = (await _ok(ca, "PUT", f"rooms/{quote(room_id)}/redact/{quote(sent['bob'])}/r{version}",
                                     {"reason": "test"}, token=alice))["event_id"]
            redaction_b = (await _ok(cb, "PUT", f"rooms/{quote(room_id)}/redact/{quote(bobs_second)}/r{version}",
                                     {}, token=bob))["event_id"]
            await eventually(lambda: stored(b, redaction_a))
            await eventually(lambda: stored(a, redaction_b))

            for client, token in ((ca, alice), (cb, bob)):
                async def history(client: Client = client, token: str = token) -> list[dict[str, Any]] | None:
                    chunk = (await _ok(client, "GET", f"rooms/{quote(room_id)}/messages?dir=b&limit=50",
                                       token=token))["chunk"]
                    messages = [e for e in reversed(chunk) if e["type"] == "m.room.message"]
                    redacted = {e["event_id"] for e in messages if not e["content"]}
                    return messages if redacted == {sent["bob"], bobs_second} else None

                messages = await eventually(history)
                # Bob sent before Carol's message reached B, so the two servers may order those apart.
                assert {e["event_id"] for e in messages} == {*sent.values(), bobs_second}
                bodies = {e["event_id"]: e["content"].get("body") for e in messages}
                assert bodies[sent["alice"]] == f"alice in v{version}"


@pytest.mark.timeout(120)
async def test_knocking_locally_and_over_federation(
    database_dsn: str, second_database_dsn: str, tmp_path: Path
) -> None:
    """Alice (A) makes a v7 room with the knock join rule. Carol (A) knocks: /sync shows it
    under rooms.knock; Alice refuses (kick) and Carol's knock becomes a leave. Carol knocks
    again and Alice accepts (invite); Carol joins. Bob (B) knocks over federation
    (make_knock/send_knock) and withdraws (leave through A); knocks again: B's /sync shows
    rooms.knock with the state A returned; Alice accepts, B's /sync shows the invite, Bob joins. Knocking where the rules forbid it
    (a public room, a v6 room) is a 403."""
    async with two_servers(database_dsn, second_database_dsn, tmp_path) as (a, b):
        ca = Client(f"http://127.0.0.1:{a.config.listeners[0].port}")
        cb = Client(f"http://127.0.0.1:{b.config.listeners[0].port}")
        alice = (await ca.register_ok("alice"))["access_token"]
        carol_user = await ca.register_ok("carol")
        carol, carol_id = carol_user["access_token"], carol_user["user_id"]
        bob_user = await cb.register_ok("bob")
        bob, bob_id = bob_user["access_token"], bob_user["user_id"]
        knock_rule = [{"type": "m.room.join_rules", "state_key": "", "content": {"join_rule": "knock"}}]
        room_id = (await _ok(ca, "POST", "createRoom", {"room_version": "7", "initial_state": knock_rule},
                             token=alice))["room_id"]

        async def member(client: Client, token: str, user: str) -> str | None:
            response = await client.request("GET", f"rooms/{quote(room_id)}/state/m.room.member/{quote(user)}",
                                            token=token)
            return response.body.get("membership") if response.status == 200 else None

        # Carol (same server): knock, refused, knock again, accepted, joins.
        assert (await _ok(ca, "POST", f"knock/{quote(room_id)}", {"reason": "let me in"}, token=carol)) == {
            "room_id": room_id}
        synced = await _ok(ca, "GET", "sync?timeout=0", token=carol)
        knock_state = synced["rooms"]["knock"][room_id]["knock_state"]["events"]
        assert {(e["type"], e["state_key"]) for e in knock_state} >= {("m.room.join_rules", ""),
                                                                       ("m.room.member", carol_id)}
        assert await member(ca, alice, carol_id) == "knock"
        await _ok(ca, "POST", f"rooms/{quote(room_id)}/kick", {"user_id": carol_id, "reason": "no"}, token=alice)
        assert await member(ca, alice, carol_id) == "leave"
        since = (await _ok(ca, "GET", "sync?timeout=0", token=carol))["next_batch"]
        await _ok(ca, "POST", f"knock/{quote(room_id)}", {}, token=carol)
        await _ok(ca, "POST", f"rooms/{quote(room_id)}/invite", {"user_id": carol_id}, token=alice)
        synced = await _ok(ca, "GET", f"sync?timeout=0&since={since}", token=carol)
        assert room_id in synced["rooms"]["invite"]
        await _ok(ca, "POST", f"rooms/{quote(room_id)}/join", {}, token=carol)
        assert await member(ca, alice, carol_id) == "join"

        # Bob (another server): knock over federation, withdraw it (make_leave/send_leave through
        # the room's server), knock again, be accepted by an invite, join.
        await _ok(cb, "POST", f"knock/{quote(room_id)}?server_name={quote(name(a))}", {"reason": "hi"}, token=bob)
        assert await member(ca, alice, bob_id) == "knock"
        await _ok(cb, "POST", f"rooms/{quote(room_id)}/leave", {}, token=bob)
        assert await member(ca, alice, bob_id) == "leave"
        synced = await _ok(cb, "GET", "sync?timeout=0", token=bob)
        assert room_id not in synced["rooms"]["knock"]
        await _ok(cb, "POST", f"knock/{quote(room_id)}?server_name={quote(name(a))}", {"reason": "hi"}, token=bob)
        assert await member(ca, alice, bob_id) == "knock"
        synced = await _ok(cb, "GET", "sync?timeout=0", token=bob)
        knock_state = synced["rooms"]["knock"][room_id]["knock_state"]["events"]
        kinds = {(e["type"], e["state_key"]) for e in knock_state}
        assert ("m.room.join_rules", "") in kinds and ("m.room.member", bob_id) in kinds
        since = synced["next_batch"]
        await _ok(ca, "POST", f"rooms/{quote(room_id)}/invite", {"user_id": bob_id}, token=alice)
        synced = await _ok(cb, "GET", f"sync?timeout=0&since={since}", token=bob)
        assert room_id in synced["rooms"]["invite"] and room_id not in synced["rooms"]["knock"]
        await _ok(cb, "POST", f"join/{quote(room_id)}", {}, token=bob)
        assert await member(ca, alice, bob_id) == "join"

        # Where the rules forbid knocking: a public room, and a v6 room even with the knock rule.
        public = (await _ok(ca, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        old = (await _ok(ca, "POST", "createRoom", {"room_version": "6", "initial_state": knock_rule},
                         token=alice))["room_id"]
        dave = (await ca.register_ok("dave"))["access_token"]
        for target in (public, old):
            refused = await ca.request("POST", f"knock/{quote(target)}", {}, token=dave)
            assert refused.status == 403 and refused.body["errcode"] == "M_FORBIDDEN", refused
        remote_refused = await cb.request("POST", f"knock/{quote(public)}?server_name={quote(name(a))}", {},
                                          token=bob)
        assert remote_refused.status == 403, remote_refused


@pytest.mark.timeout(120)
async def test_restricted_joins_locally_and_over_federation(
    database_dsn: str, second_database_dsn: str, tmp_path: Path
) -> None:
    """Alice (A) has a public room S and a room R restricted to S's members (v8 and v12).
    Carol (A) and Bob (B, over federation) are in S and join R: each join names Alice as
    ``join_authorised_via_users_server`` and, for Bob's, carries A's signature. Dave (A) and
    Eve (B), in no allowed room, are refused."""
    async with two_servers(database_dsn, second_database_dsn, tmp_path) as (a, b):
        ca = Client(f"http://127.0.0.1:{a.config.listeners[0].port}")
        cb = Client(f"http://127.0.0.1:{b.config.listeners[0].port}")
        alice_user = await ca.register_ok("alice")
        alice, alice_id = alice_user["access_token"], alice_user["user_id"]
        carol_user, dave = await ca.register_ok("carol"), (await ca.register_ok("dave"))["access_token"]
        bob_user, eve = await cb.register_ok("bob"), (await cb.register_ok("eve"))["access_token"]
        space = (await _ok(ca, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        await _ok(ca, "POST", f"join/{quote(space)}", {}, token=carol_user["access_token"])
        await _ok(cb, "POST", f"join/{quote(space)}?server_name={quote(name(a))}", {}, token=bob_user["access_token"])
        for version in ("8", "12"):
            rule = {"join_rule": "restricted", "allow": [{"type": "m.room_membership", "room_id": space}]}
            room_id = (await _ok(ca, "POST", "createRoom", {
                "room_version": version, "initial_state": [{"type": "m.room.join_rules", "content": rule}],
            }, token=alice))["room_id"]
            for client, user in ((ca, carol_user), (cb, bob_user)):
                path = f"join/{quote(room_id)}" + ("" if client is ca else f"?server_name={quote(name(a))}")
                await _ok(client, "POST", path, {}, token=user["access_token"])
                assert a.process.events_store is not None
                state = await a.process.events_store.get_current_state_ids(room_id)
                join = await stored(a, state[("m.room.member", user["user_id"])])
                assert join is not None and join.rejection_reason is None
                pdu = join.pdu()
                assert pdu["content"]["membership"] == "join"
                assert pdu["content"]["join_authorised_via_users_server"] == alice_id
                assert name(a) in pdu["signatures"]
            for client, token in ((ca, dave), (cb, eve)):
                path = f"join/{quote(room_id)}" + ("" if client is ca else f"?server_name={quote(name(a))}")
                refused = await client.request("POST", path, {}, token=token)
                assert refused.status == 403 and refused.body["errcode"] == "M_FORBIDDEN", (version, refused)
