"""Two homeservers federating over real TLS on loopback, each with its own PostgreSQL database.

Both servers run in this test process (``HomeServer`` objects, as in
test_client_support.py) but talk to each other only through their federation
listeners: self-signed certificates, server names ``localhost:PORT``,
``verify_certificates: false`` and loopback whitelisted.
"""

from __future__ import annotations

from urllib.parse import quote as _quote
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from signedjson.key import generate_signing_key
from twisted.internet import task

from homeserver.app import HomeServer
from homeserver.config import parse_config
from homeserver.events import (
    EventTemplate, FrozenEvent, build_template, make_event, parse_create_room_request, sign_pdu,
)
from homeserver.events.canonical import thaw
from homeserver.remote.client import FederationClient, FederationClientError, HttpResponseError, Target
from homeserver.federation.keys import parse_key_response
from homeserver.federation.membership import JoinError
from storage.stores.federation import FederationStore
from tests.harness import free_port
from tests.integration.test_client_support import GENEROUS, Client
from tests.integration.test_client_e2e import signed_keys
from tests.twisted_plugin import reactor


def quote(value: str) -> str:
    return _quote(value, safe="")

FED = {"verify_certificates": False, "ip_range_whitelist": ["127.0.0.0/8"]}


def _config(dsn: str, tmp_path: Path, port: int) -> dict[str, Any]:
    return {
        "server_name": f"localhost:{port}",
        "data_dir": str(tmp_path),
        "listeners": [
            {"type": "http", "port": free_port(), "resources": ["client", "health"]},
            {"type": "http", "port": port, "tls": True, "resources": ["federation", "keys"]},
        ],
        "database": {"url": dsn, "max_connections": 4},
        "log_level": "WARNING",
        "federation": FED,
        "enable_registration": True,
        "bcrypt_rounds": 4,
        "rc_registration": GENEROUS,
        "rc_message": {"per_second": 1000, "burst_count": 1000},
        # A failure sends the destination straight to catch-up, which sends only each room's
        # latest events: the gap test below then sees the receiver fetch what it missed.
        "federation_sender": {"backoff": {"initial": "50ms", "max": "200ms"},
                              "catch_up": {"threshold": "10ms", "missed_events_per_room": 0}},
    }


@asynccontextmanager
async def two_servers(dsn_a: str, dsn_b: str, tmp_path: Path, *,
                      extra: Mapping[str, Any] | None = None) -> AsyncIterator[tuple[HomeServer, HomeServer]]:
    """Two federating servers in this process; ``extra`` is added to both configs."""
    servers = []
    try:
        for name, dsn in (("a", dsn_a), ("b", dsn_b)):
            path = tmp_path / name
            path.mkdir()
            raw = {**_config(dsn, path, free_port()), **(extra or {})}
            config = parse_config(raw, config_path=path / "homeserver.yaml")
            hs = HomeServer(config, reactor, registry=CollectorRegistry())
            await hs.start()
            servers.append(hs)
        yield servers[0], servers[1]
    finally:
        for hs in reversed(servers):
            await hs.stop()


async def eventually(check: Any, timeout: float = 10.0) -> Any:
    """Poll ``check()`` (async) until it returns something truthy."""
    for _ in range(int(timeout / 0.05)):
        result = await check()
        if result:
            return result
        await task.deferLater(reactor, 0.05, lambda: None)
    raise AssertionError(f"condition not met within {timeout}s")


def name(hs: HomeServer) -> str:
    return hs.config.server_name


async def stored(hs: HomeServer, event_id: str) -> Any:
    assert hs.process.events_store is not None
    return await hs.process.events_store.get_event(event_id)


async def crafted(b: HomeServer, room_id: str, template: EventTemplate, sender: str, *,
                  signing_key: Any = None) -> FrozenEvent:
    """An event B's user would send, built on B's view of the room and signed, but not stored on B."""
    assert b.process.events_store is not None and b.process.room_events is not None and b.process.signing_key is not None
    version = await b.process.room_events.room_version(room_id)
    current = await b.process.events_store.get_current_state_ids(room_id)
    extremities = await b.process.events_store.get_forward_extremities(room_id)
    pdu = build_template(
        version, template, sender=sender, room_id=room_id, current_state=current,
        forward_extremities=extremities, origin_server_ts=int(reactor.seconds() * 1000),
    )
    return sign_pdu(version, pdu, name(b), signing_key or b.process.signing_key)


async def send_txn(b: HomeServer, a: HomeServer, txn_id: str, pdus: list[Any]) -> Any:
    assert b.process.federation is not None
    return await b.process.federation.client.put_json(
        name(a), f"/_matrix/federation/v1/send/{txn_id}", {"origin": name(b), "origin_server_ts": 0, "pdus": pdus, "edus": []}
    )


@pytest.mark.timeout(90)
async def test_join_chat_and_reject_bad_input(database_dsn: str, second_database_dsn: str, tmp_path: Path) -> None:
    """Bob on B joins Alice's room on A by room ID; messages flow both ways; then B misbehaves
    in every way the spec names and A answers each with a 4xx or a per-PDU error, never a 5xx."""
    async with two_servers(database_dsn, second_database_dsn, tmp_path) as (a, b):
        await _scenario(a, b)


@pytest.mark.timeout(90)
async def test_invites_leave_history_and_profile(database_dsn: str, second_database_dsn: str, tmp_path: Path) -> None:
    """Alice (A) invites Dave (B), who rejects through make_leave/send_leave, and Bob (B), who
    joins the invite-only room; Bob then invites Carol (A) from B; B reads A's history
    (state_ids, get_missing_events, backfill) and a profile; Bob leaves."""
    async with two_servers(database_dsn, second_database_dsn, tmp_path) as (a, b):
        assert a.process.room_events is not None and b.process.room_events is not None and b.process.federation is not None
        assert a.process.federation is not None and a.process.events_store is not None and b.process.events_store is not None
        alice, bob, carol, dave = f"@alice:{name(a)}", f"@bob:{name(b)}", f"@carol:{name(a)}", f"@dave:{name(b)}"
        room_id = await a.process.room_events.create_room(alice, parse_create_room_request({"preset": "private_chat"}))

        # Invite to a server not in the room: held by B, and rejected via make_leave/send_leave.
        invite = await a.process.federation.membership.invite_remote(room_id, alice, dave)
        pending = await b.process.federation.membership.pending_invite(room_id, dave)
        assert pending is not None and pending.event_id == invite.event_id
        assert name(b) in invite.signatures  # B cosigned it
        leave = await b.process.federation.membership.leave_remote(room_id, dave, [name(a)])
        a_state = await a.process.events_store.get_current_state_ids(room_id)
        assert a_state[("m.room.member", dave)] == leave.event_id

        # Invite, then join the invite-only room.
        await a.process.federation.membership.invite_remote(room_id, alice, bob)
        await b.process.federation.membership.join_remote(room_id, bob, [name(a)])
        # Without an invite the join fails: a stranger cannot get in.
        with pytest.raises(JoinError):
            await b.process.federation.membership.join_remote(room_id, f"@eve:{name(b)}", [name(a)])

        # Bob invites Carol from B: A cosigns, B persists, and the event reaches A by /send.
        carol_invite = await b.process.federation.membership.invite_remote(room_id, bob, carol)
        await eventually(lambda: stored(a, carol_invite.event_id))
        assert (await a.process.events_store.get_current_state_ids(room_id))[("m.room.member", carol)] == carol_invite.event_id

        # History served by A.
        msgs = [await a.process.room_events.send(room_id, EventTemplate("m.room.message", {"body": str(i)}), alice)
                for i in range(3)]
        await eventually(lambda: stored(b, msgs[-1].event_id))
        client = b.process.federation.client
        state_ids = await client.get_json(name(a), f"/_matrix/federation/v1/state_ids/{quote(room_id)}",
                                          query={"event_id": msgs[0].event_id})
        assert set(state_ids["pdu_ids"]) == set((await a.process.events_store.get_current_state_ids(room_id)).values())
        missing = await client.post_json(
            name(a), f"/_matrix/federation/v1/get_missing_events/{quote(room_id)}",
            {"earliest_events": [msgs[0].event_id], "latest_events": [msgs[2].event_id], "limit": 10},
        )
        assert [e["content"]["body"] for e in missing["events"]] == ["1"]
        backfill = await client.get_json(name(a), f"/_matrix/federation/v1/backfill/{quote(room_id)}",
                                         query={"v": msgs[2].event_id, "limit": 3})
        assert [e["content"].get("body") for e in backfill["pdus"]] == ["2", "1", "0"]

        # Profiles: an unknown user is a 404, not a 5xx.
        with pytest.raises(HttpResponseError) as info:
            await client.get_json(name(a), "/_matrix/federation/v1/query/profile", query={"user_id": alice})
        assert info.value.code == 404

        # Bob leaves from B; A sees it.
        bye = await b.process.room_events.send(room_id, EventTemplate("m.room.member", {"membership": "leave"}, bob), bob)
        await eventually(lambda: stored(a, bye.event_id))
        assert (await a.process.events_store.get_current_state_ids(room_id))[("m.room.member", bob)] == bye.event_id


@pytest.mark.timeout(90)
async def test_client_api_joins_and_invites_across_servers(database_dsn: str, second_database_dsn: str,
                                                           tmp_path: Path) -> None:
    """Everything through the client API: Alice (A) creates a public room with an alias and invites
    Bob (B), who joins by room ID alone (his server knows the inviter's); Carol (B) joins by the
    alias of A (``GET /query/directory``); unknown rooms and aliases on other servers are 404s.
    Messages from each side reach the other side's /sync."""
    async with two_servers(database_dsn, second_database_dsn, tmp_path) as (a, b):
        ca = Client(f"http://127.0.0.1:{a.config.listeners[0].port}")
        cb = Client(f"http://127.0.0.1:{b.config.listeners[0].port}")
        alice = await ca.register_ok("alice")
        bob = await cb.register_ok("bob")
        carol = await cb.register_ok("carol")
        created = await ca.request("POST", "createRoom", {"preset": "public_chat", "room_alias_name": "lobby"},
                                   token=alice["access_token"])
        assert created.status == 200, created
        room_id = created.body["room_id"]
        for i in range(25):  # history from before anyone on B was in the room
            sent = await ca.request("PUT", f"rooms/{quote(room_id)}/send/m.room.message/h{i}",
                                    {"msgtype": "m.text", "body": f"history {i}"}, token=alice["access_token"])
            assert sent.status == 200, sent

        before_invite = await cb.request("GET", "sync?timeout=0", token=bob["access_token"])
        invited = await ca.request("POST", f"rooms/{quote(room_id)}/invite", {"user_id": bob["user_id"]},
                                   token=alice["access_token"])
        assert invited.status == 200, invited
        assert b.process.federation is not None and await b.process.federation.membership.pending_invite(room_id, bob["user_id"])
        # B is not in the room, yet Bob's /sync on B shows the invite with the room's stripped state.
        synced = await cb.request("GET", f"sync?timeout=5000&since={before_invite.body['next_batch']}",
                                  token=bob["access_token"])
        invite_state = synced.body["rooms"]["invite"][room_id]["invite_state"]["events"]
        kinds = {(e["type"], e["state_key"]) for e in invite_state}
        assert ("m.room.create", "") in kinds and ("m.room.member", bob["user_id"]) in kinds
        assert all(set(e) == {"type", "state_key", "content", "sender"} for e in invite_state)
        joined = await cb.request("POST", f"rooms/{quote(room_id)}/join", {}, token=bob["access_token"])
        assert joined.status == 200, joined
        assert joined.body == {"room_id": room_id}
        by_alias = await cb.request("POST", f"join/{quote('#lobby:' + name(a))}", {}, token=carol["access_token"])
        assert by_alias.status == 200, by_alias
        assert by_alias.body == {"room_id": room_id}
        assert a.process.events_store is not None
        events_store = a.process.events_store

        async def both_members_on_a() -> bool:
            state = await events_store.get_current_state_ids(room_id)
            return all(("m.room.member", user["user_id"]) in state for user in (bob, carol))

        await eventually(both_members_on_a)  # Carol's join was local on B (Bob is there), then sent

        # Failures are Matrix errors, not 5xx: an alias A does not have, a room nobody has.
        for path in (f"join/{quote('#nope:' + name(a))}", f"join/{quote('!nothing:' + name(a))}",
                     f"join/{quote('!nothing:' + name(a))}?via={quote(name(a))}&server_name=bad%2Fname"):
            response = await cb.request("POST", path, {}, token=bob["access_token"])
            assert 400 <= response.status < 500 and "errcode" in response.body, (path, response)

        hello = await ca.request("PUT", f"rooms/{quote(room_id)}/send/m.room.message/t1",
                                 {"msgtype": "m.text", "body": "hi Bob"}, token=alice["access_token"])
        reply = await cb.request("PUT", f"rooms/{quote(room_id)}/send/m.room.message/t1",
                                 {"msgtype": "m.text", "body": "hi Alice"}, token=bob["access_token"])
        assert hello.status == reply.status == 200
        ids = {hello.body["event_id"], reply.body["event_id"]}

        async def timeline_ids(client: Client, token: str) -> set[str]:
            response = await client.request("GET", "sync?timeout=0", token=token)
            assert response.status == 200, response
            room = response.body.get("rooms", {}).get("join", {}).get(room_id, {})
            return {e["event_id"] for e in room.get("timeline", {}).get("events", [])}

        await eventually(lambda: _contains(timeline_ids(cb, carol["access_token"]), ids))
        await eventually(lambda: _contains(timeline_ids(ca, alice["access_token"]), ids))

        # EDUs from B reach Alice's /sync on A; bad ones are dropped, the transaction still answered.
        since = (await ca.request("GET", "sync?timeout=0", token=alice["access_token"])).body["next_batch"]
        bob_id, carol_id = bob["user_id"], carol["user_id"]
        edus: list[Any] = [
            {"edu_type": "m.typing", "content": {"room_id": room_id, "user_id": bob_id, "typing": True}},
            {"edu_type": "m.receipt", "content": {room_id: {"m.read": {
                carol_id: {"event_ids": [hello.body["event_id"]], "data": {"ts": 1}}}}}},
            {"edu_type": "m.presence", "content": {"push": [
                {"user_id": bob_id, "presence": "online", "last_active_ago": 5, "currently_active": True},
                {"user_id": alice["user_id"], "presence": "offline", "last_active_ago": 5}]}},
            {"edu_type": "m.direct_to_device", "content": {
                "sender": bob_id, "type": "m.test", "message_id": "m1",
                "messages": {alice["user_id"]: {alice["device_id"]: {"hello": "device"}}}}},
            {"edu_type": "m.device_list_update", "content": {
                "user_id": bob_id, "device_id": "BOBDEV", "stream_id": 1, "prev_id": [],
                "keys": {"user_id": bob_id, "device_id": "BOBDEV", "algorithms": [], "keys": {}}}},
            # Bad: another server's user, a room Bob is not in, junk shapes.
            {"edu_type": "m.typing", "content": {"room_id": room_id, "user_id": alice["user_id"], "typing": True}},
            {"edu_type": "m.typing", "content": {"room_id": "!elsewhere:x", "user_id": bob_id, "typing": True}},
            {"edu_type": "m.typing", "content": "junk"}, {"edu_type": "m.receipt", "content": {room_id: 5}},
            {"edu_type": "m.presence", "content": {"push": "x"}}, {"edu_type": "m.direct_to_device"},
            {"edu_type": "m.device_list_update", "content": {"user_id": bob_id}}, 7, {"edu_type": 5},
        ]
        assert b.process.federation is not None
        answer = await b.process.federation.client.put_json(
            name(a), "/_matrix/federation/v1/send/edus1",
            {"origin": name(b), "origin_server_ts": 0, "pdus": [], "edus": edus})
        assert answer == {"pdus": {}}
        with pytest.raises(HttpResponseError) as too_many:
            await b.process.federation.client.put_json(name(a), "/_matrix/federation/v1/send/edus2",
                                               {"origin": name(b), "pdus": [], "edus": [edus[0]] * 101})
        assert too_many.value.code == 400

        synced = await ca.request("GET", f"sync?timeout=0&since={since}", token=alice["access_token"])
        assert synced.status == 200, synced
        ephemeral = synced.body["rooms"]["join"][room_id]["ephemeral"]["events"]
        typing_events = [e for e in ephemeral if e["type"] == "m.typing"]
        assert typing_events == [{"type": "m.typing", "content": {"user_ids": [bob_id]}}]
        receipts = [e for e in ephemeral if e["type"] == "m.receipt"]
        assert receipts[0]["content"][hello.body["event_id"]]["m.read"][carol_id] == {"ts": 1}
        presence = {e["sender"]: e["content"] for e in synced.body["presence"]["events"]}
        assert presence[bob_id]["presence"] == "online" and presence[bob_id]["currently_active"] is True
        assert alice["user_id"] not in presence  # B may not speak for Alice
        assert synced.body["to_device"]["events"] == [
            {"type": "m.test", "sender": bob_id, "content": {"hello": "device"}}]
        assert synced.body["device_lists"]["changed"] == [bob_id]
        # The same to-device message again (a sender's retry in a new transaction): delivered once.
        to_device_edu = next(e for e in edus if isinstance(e, dict) and e.get("edu_type") == "m.direct_to_device"
                             and "content" in e)
        await b.process.federation.client.put_json(
            name(a), "/_matrix/federation/v1/send/edus3",
            {"origin": name(b), "origin_server_ts": 0, "pdus": [], "edus": [to_device_edu]})
        resynced = await ca.request("GET", f"sync?timeout=0&since={synced.body['next_batch']}",
                                    token=alice["access_token"])
        assert resynced.status == 200 and resynced.body["to_device"]["events"] == [], resynced

        # Device-list updates in order: A's copy of Bob's list is at B's stream_id for him. An update
        # that follows on it is applied (a device B never had shows up); the same update again is
        # ignored; one after a gap makes A fetch the list from B again (the made-up device goes).
        listed_bob = await a.process.federation.client.get_json(
            name(b), f"/_matrix/federation/v1/user/devices/{quote(bob_id)}")
        at = listed_bob["stream_id"]

        async def update(txn: str, device: str, stream_id: int, prev: list[int]) -> list[str]:
            content = {"user_id": bob_id, "device_id": device, "stream_id": stream_id, "prev_id": prev,
                       "deleted": False, "keys": {"user_id": bob_id, "device_id": device, "keys": {}}}
            await b.process.federation.client.put_json(
                name(a), f"/_matrix/federation/v1/send/{txn}",
                {"origin": name(b), "origin_server_ts": 0, "pdus": [],
                 "edus": [{"edu_type": "m.device_list_update", "content": content}]})
            answer = await ca.request("POST", "keys/query", {"device_keys": {bob_id: []}}, token=alice["access_token"])
            assert answer.status == 200, answer
            return sorted(answer.body["device_keys"][bob_id])

        assert await update("dl1", "MADEUP1", at + 10, [at]) == ["MADEUP1"]
        assert await update("dl2", "MADEUP2", at + 10, [at]) == ["MADEUP1"]  # seen already
        assert "MADEUP1" not in await update("dl3", "MADEUP3", at + 30, [at + 20])  # a gap: fetched from B
        # An update A cannot place (it holds no list of Bob's) makes A fetch Bob's list from B,
        # which has no device BOBDEV: A answers with what B said, not with what the EDU claimed.
        queried = await ca.request("POST", "keys/query", {"device_keys": {bob_id: []}}, token=alice["access_token"])
        assert queried.status == 200 and queried.body["device_keys"] == {bob_id: {}}, queried
        assert queried.body["failures"] == {}

        # A serves its users' devices and keys to B (and only its own users').
        alice_id, alice_dev = alice["user_id"], alice["device_id"]
        device_keys = signed_keys(alice_id, alice_dev)
        uploaded = await ca.request("POST", "keys/upload", {"device_keys": device_keys,
                                                            "one_time_keys": {"signed_curve25519:AAA": {"key": "x"}}},
                                    token=alice["access_token"])
        assert uploaded.status == 200, uploaded
        fed_client = b.process.federation.client
        listed = await fed_client.get_json(name(a), f"/_matrix/federation/v1/user/devices/{quote(alice_id)}")
        assert listed["user_id"] == alice_id and isinstance(listed["stream_id"], int)
        assert [d["device_id"] for d in listed["devices"]] == [alice_dev]
        assert listed["devices"][0]["keys"] == device_keys
        assert listed["stream_id"] > 0  # the user's newest device-list change: the next update's prev_id
        keys = await fed_client.post_json(name(a), "/_matrix/federation/v1/user/keys/query",
                                          {"device_keys": {alice_id: [], bob_id: []}})
        assert keys == {"device_keys": {alice_id: {alice_dev: device_keys}}, "master_keys": {}, "self_signing_keys": {}}
        claimed = await fed_client.post_json(name(a), "/_matrix/federation/v1/user/keys/claim",
                                             {"one_time_keys": {alice_id: {alice_dev: "signed_curve25519"}}})
        assert claimed == {"one_time_keys": {alice_id: {alice_dev: {"signed_curve25519:AAA": {"key": "x"}}}}}
        for path, body in ((f"/_matrix/federation/v1/user/devices/{quote(bob_id)}", None),
                           ("/_matrix/federation/v1/user/keys/query", {"device_keys": []}),
                           ("/_matrix/federation/v1/user/keys/claim", {"one_time_keys": 5})):
            with pytest.raises(HttpResponseError) as refused:
                if body is None:
                    await fed_client.get_json(name(a), path)
                else:
                    await fed_client.post_json(name(a), path, body)
            assert refused.value.code == 400, path

        # Erin (B) is invited to a room B is not in and rejects it: her /sync shows the invite,
        # then the room under rooms.leave with her leave event; A sees the leave.
        erin = await cb.register_ok("erin")
        private = (await ca.request("POST", "createRoom", {"preset": "private_chat"}, token=alice["access_token"]))
        private_id = private.body["room_id"]
        erin_since = (await cb.request("GET", "sync?timeout=0", token=erin["access_token"])).body["next_batch"]
        assert (await ca.request("POST", f"rooms/{quote(private_id)}/invite", {"user_id": erin["user_id"]},
                                 token=alice["access_token"])).status == 200
        synced = await cb.request("GET", f"sync?timeout=5000&since={erin_since}", token=erin["access_token"])
        assert private_id in synced.body["rooms"]["invite"]
        rejected = await cb.request("POST", f"rooms/{quote(private_id)}/leave", {}, token=erin["access_token"])
        assert rejected.status == 200, rejected
        synced = await cb.request("GET", f"sync?timeout=5000&since={synced.body['next_batch']}",
                                  token=erin["access_token"])
        left = synced.body["rooms"]["leave"][private_id]["timeline"]["events"]
        assert [(e["type"], e["content"]["membership"]) for e in left] == [("m.room.member", "leave")]
        assert private_id not in synced.body["rooms"]["invite"]
        assert (await cb.request("GET", "sync?timeout=0", token=erin["access_token"])).body["rooms"]["invite"] == {}
        a_state = await events_store.get_current_state_ids(private_id)
        assert a_state[("m.room.member", erin["user_id"])] == left[0]["event_id"]

        # Bob back-paginates past his join: B backfills A's history over federation, in order.
        seen: list[dict[str, Any]] = []
        token: str | None = None
        for _ in range(20):
            query = "dir=b&limit=10" + (f"&from={token}" if token else "")
            page = await cb.request("GET", f"rooms/{quote(room_id)}/messages?{query}", token=bob["access_token"])
            assert page.status == 200, page
            seen.extend(page.body["chunk"])
            token = page.body.get("end")
            if token is None:
                break
        bodies = [e["content"].get("body") for e in reversed(seen) if e["type"] == "m.room.message"]
        assert [b for b in bodies if b.startswith("history")] == [f"history {i}" for i in range(25)]
        assert seen[-1]["type"] == "m.room.create"
        assert len({e["event_id"] for e in seen}) == len(seen)
        assert b.process.events_store is not None
        create = await b.process.events_store.get_event(seen[-1]["event_id"])
        assert create is not None and create.stream_ordering < 0 and not create.outlier


async def _contains(found: Any, wanted: set[str]) -> bool:
    return wanted <= await found


async def test_ip_blacklist_refuses_loopback_unless_whitelisted(database_dsn: str, second_database_dsn: str,
                                                               tmp_path: Path) -> None:
    async with two_servers(database_dsn, second_database_dsn, tmp_path) as (a, b):
        assert b.process.signing_key is not None
        strict = FederationClient(reactor, server_name=name(b), signing_key=b.process.signing_key,
                                  verify_certificates=False, ip_range_whitelist=())
        try:
            with pytest.raises(FederationClientError, match="blacklist"):
                await strict.get_json(name(a), "/_matrix/federation/v1/version", signed=False)
        finally:
            await strict.close()


async def _scenario(a: HomeServer, b: HomeServer) -> None:
    assert a.process.room_events is not None and b.process.room_events is not None and b.process.federation is not None
    assert a.process.events_store is not None and b.process.events_store is not None
    alice, bob = f"@alice:{name(a)}", f"@bob:{name(b)}"

    # Keys: B fetches A's signed key response over the federation listener.
    body = await b.process.federation.client.get_json(name(a), "/_matrix/key/v2/server", signed=False)
    keys = parse_key_response(name(a), body, int(reactor.seconds() * 1000))
    assert list(keys) == [f"ed25519:{a.process.signing_key.version}"]  # type: ignore[union-attr]
    version = await b.process.federation.client.get_json(name(a), "/_matrix/federation/v1/version", signed=False)
    assert version["server"]["name"] == "Tributary"

    # Join: Bob joins Alice's public room by its alias on A (GET /query/directory, then make/send_join).
    room_id = await a.process.room_events.create_room(alice, parse_create_room_request({"preset": "public_chat"}))
    alias = f"#lobby:{name(a)}"
    assert await a.process.rooms.timeline.create_alias(alias, room_id, alice)
    with pytest.raises(HttpResponseError) as info:
        await b.process.federation.membership.resolve_alias(f"#nope:{name(a)}")
    assert info.value.code == 404
    join = await b.process.federation.membership.join_by_alias(alias, bob)
    a_state = await a.process.events_store.get_current_state_ids(room_id)
    b_state = await b.process.events_store.get_current_state_ids(room_id)
    assert a_state[("m.room.member", bob)] == join.event_id
    assert b_state == a_state
    assert await b.process.events_store.get_joined_servers(room_id) == {name(a), name(b)}

    # Messages both ways reach the other side's database.
    hello = await a.process.room_events.send(room_id, EventTemplate("m.room.message", {"msgtype": "m.text", "body": "hi Bob"}), alice)
    row = await eventually(lambda: stored(b, hello.event_id))
    assert not row.outlier and row.rejection_reason is None
    reply = await b.process.room_events.send(room_id, EventTemplate("m.room.message", {"msgtype": "m.text", "body": "hi Alice"}), bob)
    row = await eventually(lambda: stored(a, reply.event_id))
    assert not row.outlier and row.rejection_reason is None
    await eventually(lambda: stored(b, reply.event_id))

    # A gap: B is unreachable from A for two messages, so A drops them and catches B up later
    # with only the room's latest event; it arrives with unknown prev_events, and B fetches
    # the two with get_missing_events before storing it.
    assert a.process.federation is not None
    resolver = a.process.federation.client.resolver
    real_target = await resolver.resolve(name(b))
    # Every transaction answered first: close() closes only the connections back in the pool.
    assert a.process.federation_sender is not None
    await a.process.federation_sender.wait_idle()
    await a.process.federation.client.close()  # no pooled connection to B survives
    resolver.remember(name(b), Target("127.0.0.1", free_port(), "localhost"))  # nothing listens there
    lost = [await a.process.room_events.send(room_id, EventTemplate("m.room.message", {"body": f"lost {i}"}), alice)
            for i in range(2)]
    assert a.process.federation_sender is not None
    await a.process.federation_sender.wait_idle()
    assert await stored(b, lost[0].event_id) is None
    resolver.remember(name(b), real_target)
    third = await a.process.room_events.send(room_id, EventTemplate("m.room.message", {"body": "third"}), alice)
    row = await eventually(lambda: stored(b, third.event_id))
    assert not row.outlier
    for event in lost:
        row = await stored(b, event.event_id)
        assert row is not None and not row.outlier and row.rejection_reason is None

    # A forged signature: signed by a key that is not B's.
    forged = await crafted(b, room_id, EventTemplate("m.room.message", {"body": "forged"}), bob,
                           signing_key=generate_signing_key(b.process.signing_key.version))  # type: ignore[union-attr]
    result = await send_txn(b, a, "forged", [forged.get_pdu_json()])
    assert "error" in result["pdus"][forged.event_id]
    assert await stored(a, forged.event_id) is None

    # A wrong content hash: the signature (over the redacted form) holds, so A keeps the redacted copy.
    good = await crafted(b, room_id, EventTemplate("m.room.message", {"msgtype": "m.text", "body": "original"}), bob)
    tampered = thaw(good.get_pdu_json())
    tampered["content"]["body"] = "tampered"
    result = await send_txn(b, a, "hash", [tampered])
    assert result["pdus"][good.event_id] == {}
    row = await stored(a, good.event_id)
    assert row is not None and row.pdu()["content"] == {}

    # An event that fails auth: Bob (power 0) changes the power levels; stored as rejected.
    pl_id = a_state[("m.room.power_levels", "")]
    [pl] = await a.process.rooms.client_events.load([pl_id])
    grab = await crafted(b, room_id, EventTemplate("m.room.power_levels", {**thaw(pl.content), "users": {bob: 100}}, ""), bob)
    result = await send_txn(b, a, "auth", [grab.get_pdu_json()])
    assert "error" in result["pdus"][grab.event_id]
    row = await stored(a, grab.event_id)
    assert row is not None and row.rejection_reason
    assert (await a.process.events_store.get_current_state_ids(room_id))[("m.room.power_levels", "")] == pl_id

    # A replayed txnId: answered from the stored response, the new PDU is not processed.
    first = await crafted(b, room_id, EventTemplate("m.room.message", {"body": "once"}), bob)
    r1 = await send_txn(b, a, "replay", [first.get_pdu_json()])
    second = await crafted(b, room_id, EventTemplate("m.room.message", {"body": "twice"}), bob)
    r2 = await send_txn(b, a, "replay", [second.get_pdu_json()])
    assert r1 == r2 == {"pdus": {first.event_id: {}}}
    assert await stored(a, second.event_id) is None
    # Both survive a restart: the response and A's verified key response are in the databases.
    assert a.process.db is not None and b.process.db is not None
    assert await FederationStore(a.process.db).get_transaction_response(name(b), "replay") == r1
    stored_keys = await FederationStore(b.process.db).get_key_response(name(a))
    assert stored_keys is not None and stored_keys.response["server_name"] == name(a)

    # Malformed PDUs get per-PDU errors (or are dropped when they name no room), not a 5xx.
    junk: list[Any] = [1, "x", None, {"room_id": room_id}, {"room_id": room_id, "type": 5, "content": []},
                       {**good.get_pdu_json(), "prev_events": "nope"}, {"room_id": "!unknown:nowhere"}]
    result = await send_txn(b, a, "junk", junk)
    assert all("error" in r for r in result["pdus"].values())
    for path, body in (("/_matrix/federation/v1/send/bad1", {"pdus": "no"}),
                       (f"/_matrix/federation/v2/send_join/{quote(room_id)}/$x", {"type": "m.room.member"}),
                       (f"/_matrix/federation/v2/invite/{quote(room_id)}/$x", {"event": {}, "room_version": "12"})):
        with pytest.raises(HttpResponseError) as info:
            await b.process.federation.client.put_json(name(a), path, body)
        assert 400 <= info.value.code < 500, (path, info.value)

    # 51 PDUs: the whole transaction is refused with 400.
    with pytest.raises(HttpResponseError) as info:
        await send_txn(b, a, "big", [first.get_pdu_json()] * 51)
    assert info.value.code == 400
    sample = a.registry.get_sample_value
    assert sample("tributary_federation_transactions_received_total", {"outcome": "repeat"}) == 1
    assert sample("tributary_federation_transactions_received_total", {"outcome": "refused"}) == 2  # "pdus" not a list, and 51 PDUs
    assert sample("tributary_federation_pdus_received_total", {"outcome": "rejected"}) == 1
    assert (sample("tributary_federation_pdus_received_total", {"outcome": "invalid"}) or 0) >= 2

    # X-Matrix for a key A cannot find for B: 401 M_UNAUTHORIZED.
    impostor = FederationClient(reactor, server_name=name(b), signing_key=generate_signing_key("other"),
                                verify_certificates=False, ip_range_whitelist=["127.0.0.0/8"])
    # X-Matrix naming the right key, signed by another: 401 too.
    wrong_sig = FederationClient(reactor, server_name=name(b),
                                 signing_key=generate_signing_key(b.process.signing_key.version),  # type: ignore[union-attr]
                                 verify_certificates=False, ip_range_whitelist=["127.0.0.0/8"])
    port = name(a).rsplit(":", 1)[1]
    try:
        for client, destination in ((impostor, name(a)), (wrong_sig, name(a)),
                                    # right key, but signed for another destination (same listener)
                                    (b.process.federation.client, f"127.0.0.1:{port}")):
            with pytest.raises(HttpResponseError) as info:
                await client.get_json(destination, f"/_matrix/federation/v1/event/{hello.event_id}")
            assert (info.value.code, info.value.json["errcode"]) == (401, "M_UNAUTHORIZED")
    finally:
        await impostor.close()
        await wrong_sig.close()
    # The same request properly signed is served.
    served = await b.process.federation.client.get_json(name(a), f"/_matrix/federation/v1/event/{hello.event_id}")
    assert make_event(hello.room_version, served["pdus"][0]).event_id == hello.event_id

    # Soft failure: Bob's message, built before Alice bans him, passes auth at the state before it
    # but not at A's current state. A stores it (the PDU's result is success) but it is no
    # forward extremity and no client sees it.
    assert a.process.rooms is not None
    late = await crafted(b, room_id, EventTemplate("m.room.message", {"body": "too late"}), bob)
    await a.process.room_events.send(room_id, EventTemplate("m.room.member", {"membership": "ban"}, bob), alice)
    result = await send_txn(b, a, "soft", [late.get_pdu_json()])
    assert result["pdus"][late.event_id] == {}
    row = await stored(a, late.event_id)
    assert row is not None and row.rejection_reason is None and not row.outlier
    assert late.event_id not in await a.process.events_store.get_forward_extremities(room_id)
    assert await a.process.rooms.timeline.get_hidden_events([late.event_id]) == {late.event_id}
    assert sample("tributary_federation_pdus_received_total", {"outcome": "soft_failed"}) == 1


def test_tributary_process_serves_keys_and_refuses_unsigned_requests(database_dsn: str, tmp_path: Path) -> None:
    """The real ``tributary`` process: a TLS federation listener with a self-signed certificate,
    the signed key response, /version, and 401 M_UNAUTHORIZED for a request signed by a stranger."""
    from tests.harness import TributaryProcess

    fed_port = free_port()
    proc = TributaryProcess.configure(tmp_path, database_url=database_dsn, server_name=f"localhost:{fed_port}")
    import yaml

    config = yaml.safe_load(proc.config_path.read_text())
    config["listeners"].append({"type": "http", "port": fed_port, "tls": True, "resources": ["federation", "keys"]})
    config["federation"] = FED
    proc.config_path.write_text(yaml.safe_dump(config))
    proc.start()
    try:
        from tests.twisted_plugin import run_sync

        async def check() -> None:
            stranger = FederationClient(reactor, server_name="stranger.invalid", signing_key=generate_signing_key("s"),
                                        verify_certificates=False, ip_range_whitelist=["127.0.0.0/8"])
            try:
                server = f"localhost:{fed_port}"
                body = await stranger.get_json(server, "/_matrix/key/v2/server", signed=False)
                assert parse_key_response(server, body, int(reactor.seconds() * 1000))
                version = await stranger.get_json(server, "/_matrix/federation/v1/version", signed=False)
                assert version["server"]["name"] == "Tributary"
                with pytest.raises(HttpResponseError) as info:
                    await stranger.put_json(server, "/_matrix/federation/v1/send/t1", {"pdus": [], "edus": []},
                                            timeout=20)
                assert (info.value.code, info.value.json["errcode"]) == (401, "M_UNAUTHORIZED")
                # The client listener does not serve federation paths.
                status, _ = proc.get("/_matrix/federation/v1/version")
                assert status == 404
                # ... and the federation listener does not serve the client API.
                with pytest.raises(HttpResponseError) as info:
                    await stranger.get_json(server, "/_matrix/client/versions", signed=False)
                assert info.value.code == 404
            finally:
                await stranger.close()

        run_sync(check())
    finally:
        assert proc.stop() == 0


@pytest.mark.timeout(90)
async def test_real_process_room_joined_by_alias(database_dsn: str, second_database_dsn: str, tmp_path: Path) -> None:
    """A is a real ``tributary`` process driven through its client API (register, createRoom
    with an alias, send, sync); B runs in this process. Bob on B joins Alice's room by alias,
    and messages flow both ways into both databases and Alice's /sync."""
    from tests.harness import TributaryProcess

    fed_port = free_port()
    (tmp_path / "a").mkdir()
    proc = TributaryProcess.configure(tmp_path / "a", database_url=database_dsn, server_name=f"localhost:{fed_port}",
                                      extra={"federation": FED})
    import yaml

    config = yaml.safe_load(proc.config_path.read_text())
    config["listeners"].append({"type": "http", "port": fed_port, "tls": True, "resources": ["federation", "keys"]})
    proc.config_path.write_text(yaml.safe_dump(config))
    a_name = f"localhost:{fed_port}"
    proc.start()
    try:
        (tmp_path / "b").mkdir()
        b_config = parse_config(_config(second_database_dsn, tmp_path / "b", free_port()),
                                config_path=tmp_path / "b" / "homeserver.yaml")
        b = HomeServer(b_config, reactor, registry=CollectorRegistry())
        await b.start()
        try:
            assert b.process.federation is not None and b.process.room_events is not None
            ca = Client(proc.base_url)
            alice = await ca.register_ok("alice")
            created = await ca.request("POST", "createRoom", {"preset": "public_chat", "room_alias_name": "lobby"},
                                       token=alice["access_token"])
            assert created.status == 200, created
            room_id = created.body["room_id"]
            bob = f"@bob:{name(b)}"
            join = await b.process.federation.membership.join_by_alias(f"#lobby:{a_name}", bob)
            assert join.room_id == room_id

            sent = await ca.request("PUT", f"rooms/{quote(room_id)}/send/m.room.message/t1",
                                    {"msgtype": "m.text", "body": "hi Bob"}, token=alice["access_token"])
            assert sent.status == 200, sent
            row = await eventually(lambda: stored(b, sent.body["event_id"]))
            assert not row.outlier and row.rejection_reason is None

            reply = await b.process.room_events.send(
                room_id, EventTemplate("m.room.message", {"msgtype": "m.text", "body": "hi Alice"}), bob
            )

            async def alice_sees_reply() -> bool:
                response = await ca.request("GET", "sync?timeout=0", token=alice["access_token"])
                room = response.body.get("rooms", {}).get("join", {}).get(room_id, {})
                return reply.event_id in {e["event_id"] for e in room.get("timeline", {}).get("events", [])}

            await eventually(alice_sees_reply)
        finally:
            await b.stop()
    finally:
        assert proc.stop() == 0
