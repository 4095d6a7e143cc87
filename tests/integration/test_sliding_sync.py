"""Simplified sliding sync (MSC4186) against a real server, built from the MSC's text.

``POST /_matrix/client/unstable/org.matrix.simplified_msc3575/sync``: lists select rooms by
filters and ranges over the user's rooms in recency order; a room is sent whole (``initial``)
the first time a connection has it and afterwards only with what changed; ``pos`` continues
a connection (on any process sharing the database), an unknown one is 400 ``M_UNKNOWN_POS``;
extensions carry to-device messages, E2EE counts and device lists, account data, receipts
and typing.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater

from tests.conftest import scratch_database
from tests.harness import Nginx, TributaryProcess, configure_workers
from tests.integration.test_client_e2e import signed_keys
from tests.integration.test_client_rooms import ALICE, BOB, ROOM_LIMITS, _ok, _users
from tests.integration.test_client_support import Client, running_server
from storage.stores.remote_invites import RemoteInviteRow, RemoteInviteStore

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


async def test_filters_invites_and_subscriptions(database_dsn: str, tmp_path: Path) -> None:
    """The MSC's filters (is_dm from m.direct, is_encrypted, is_invite, room_types, not_room_types,
    spaces, tags and not_tags from m.tag) select from the user's rooms; an invite carries its stripped state; a subscription to a
    room the user is not in is ignored."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, bob = await _users(client)
        plain = await _room(client, alice, "plain")
        encrypted = await _room(client, alice, "secret", initial_state=[
            {"type": "m.room.encryption", "state_key": "", "content": {"algorithm": "m.megolm.v1.aes-sha2"}}])
        dm = await _room(client, alice)
        space = await _room(client, alice, "space", creation_content={"type": "m.space"})
        await _ok(client, "PUT", f"rooms/{space}/state/m.space.child/{quote(plain)}", {"via": ["localhost"]},
                  token=alice)
        for room_id in (plain, encrypted, dm, space):
            await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob)
        invite = await _room(client, alice, "invite only", preset="private_chat", invite=[BOB])
        elsewhere = await _room(client, alice, "not bob's")
        await _ok(client, "PUT", f"user/{quote(BOB)}/account_data/m.direct", {ALICE: [dm]}, token=bob)
        await _ok(client, "PUT", f"user/{quote(BOB)}/rooms/{plain}/account_data/m.tag",
                  {"tags": {"m.favourite": {"order": 0.5}}}, token=bob)
        await _ok(client, "PUT", f"user/{quote(BOB)}/rooms/{encrypted}/account_data/m.tag",
                  {"tags": {"m.favourite": {}, "m.lowpriority": {}}}, token=bob)

        def listed(name: str, filters: dict[str, Any]) -> dict[str, Any]:
            return {name: {"ranges": [[0, 20]], "timeline_limit": 0, "required_state": [], "filters": filters}}

        lists: dict[str, Any] = {}
        for name, filters in {"dm": {"is_dm": True}, "not_dm": {"is_dm": False}, "enc": {"is_encrypted": True},
                              "inv": {"is_invite": True}, "spaces": {"room_types": ["m.space"]},
                              "no_spaces": {"not_room_types": ["m.space"]}, "untyped": {"room_types": [None]},
                              "in_space": {"spaces": [space]}, "favourites": {"tags": ["m.favourite"]},
                              "fav_not_low": {"tags": ["m.favourite"], "not_tags": ["m.lowpriority"]},
                              "not_low": {"not_tags": ["m.lowpriority"]}}.items():
            lists.update(listed(name, filters))
        answer = await _ss(client, bob, {"lists": lists, "room_subscriptions": {
            elsewhere: {"timeline_limit": 5, "required_state": ALL_STATE}}})
        ids = {name: set(result["ops"][0]["room_ids"]) for name, result in answer["lists"].items()}
        assert ids["dm"] == {dm} and ids["not_dm"] == {plain, encrypted, space, invite}
        assert ids["enc"] == {encrypted} and ids["inv"] == {invite}
        assert ids["spaces"] == {space} and ids["no_spaces"] == ids["untyped"] == {plain, encrypted, dm, invite}
        assert ids["in_space"] == {plain}
        assert ids["favourites"] == {plain, encrypted} and ids["fav_not_low"] == {plain}
        assert ids["not_low"] == {plain, dm, space, invite}
        assert answer["lists"]["not_dm"]["count"] == 4
        assert elsewhere not in answer["rooms"]
        assert answer["rooms"][dm]["is_dm"] is True and "is_dm" not in answer["rooms"][plain]
        invited = answer["rooms"][invite]
        assert invited["membership"] == "invite" and invited["initial"] is True
        stripped = {(e["type"], e["state_key"]) for e in invited["invite_state"]}
        assert ("m.room.name", "") in stripped and ("m.room.member", BOB) in stripped
        assert "timeline" not in invited
        # A nameless room has heroes instead of a name.
        assert "name" not in answer["rooms"][dm]
        assert [h["user_id"] for h in answer["rooms"][dm]["heroes"]] == [ALICE]


async def test_pos_errors_and_request_validation(database_dsn: str, tmp_path: Path) -> None:
    """An unknown pos is 400 M_UNKNOWN_POS (also another conn_id's, or one superseded by a new
    connection); the last two positions both work (a retried request); bad bodies are 400s."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, bob = await _users(client)
        room_id = await _room(client, alice, "r")
        await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob)
        body = {"conn_id": "main", "lists": {"l": {"ranges": [[0, 5]], "timeline_limit": 1, "required_state": []}}}
        first = await _ss(client, bob, body)
        second = await _ss(client, bob, body, pos=first["pos"], timeout=0)
        # The client lost ``second``'s answer and retries with ``first``: the same rooms again? none.
        retried = await _ss(client, bob, body, pos=first["pos"], timeout=0)
        assert retried["rooms"] == {}
        for pos, conn in ((second["pos"], "main"), ("123456789", "main"), ("abc", "main"), (retried["pos"], "other")):
            response = await client.request("POST", f"{SS}?pos={pos}", {**body, "conn_id": conn}, token=bob)
            assert response.status == 400 and response.errcode == "M_UNKNOWN_POS", (pos, conn, response)
        # Another user cannot use bob's position.
        stolen = await client.request("POST", f"{SS}?pos={retried['pos']}", body, token=alice)
        assert stolen.status == 400 and stolen.errcode == "M_UNKNOWN_POS"
        # A new connection with the same conn_id replaces the old one.
        await _ss(client, bob, body)
        gone = await client.request("POST", f"{SS}?pos={retried['pos']}", body, token=bob)
        assert gone.status == 400 and gone.errcode == "M_UNKNOWN_POS"
        for bad, errcode in (
            ({"lists": []}, "M_BAD_JSON"),
            ({"lists": {"l": {"ranges": [[5, 1]], "timeline_limit": 1}}}, "M_INVALID_PARAM"),
            ({"lists": {"l": {"ranges": [[0, "x"]], "timeline_limit": 1}}}, "M_BAD_JSON"),
            ({"lists": {"l": {"timeline_limit": -1}}}, "M_INVALID_PARAM"),
            ({"lists": {"l": {"timeline_limit": 1, "required_state": [["only type"]]}}}, "M_BAD_JSON"),
            ({"lists": {"l": {"timeline_limit": 1, "filters": {"is_dm": "yes"}}}}, "M_BAD_JSON"),
            ({"room_subscriptions": {"not a room": {"timeline_limit": 1}}}, "M_INVALID_PARAM"),
            ({"set_presence": "dancing"}, "M_INVALID_PARAM"),
            ({"extensions": {"to_device": {"enabled": True, "since": "x1"}}}, "M_INVALID_PARAM"),
            ({"timeout": "soon"}, "M_BAD_JSON"),
        ):
            response = await client.request("POST", SS, bad, token=bob)
            assert response.status == 400 and response.errcode == errcode, (bad, response)
        not_json = await client.request("POST", SS, raw=b"[1]", token=bob)
        assert not_json.status == 400 and not_json.errcode in ("M_BAD_JSON", "M_NOT_JSON")
        versions = await client.request("GET", "/_matrix/client/versions")
        assert versions.body["unstable_features"]["org.matrix.simplified_msc3575"] is True


async def test_long_poll_is_woken_by_a_send(database_dsn: str, tmp_path: Path) -> None:
    """With a pos and a timeout the request waits for news; a message wakes it at once (the /sync
    notifier), and no waiter is left behind."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (hs, client):
        alice, bob = await _users(client)
        room_id = await _room(client, alice, "r")
        await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob)
        body = {"lists": {"l": {"ranges": [[0, 5]], "timeline_limit": 3, "required_state": []}}}
        first = await _ss(client, bob, body)
        started = time.monotonic()
        waiting = Deferred.fromCoroutine(_ss(client, bob, body, pos=first["pos"], timeout=20000))
        sent = await _send(client, alice, room_id, "wake")
        woken = await waiting
        assert time.monotonic() - started < 10
        assert [e["event_id"] for e in woken["rooms"][room_id]["timeline"]] == [sent]
        assert hs.process.notifier.waiter_count() == 0
        # Nothing new: a short timeout answers empty when it passes.
        started = time.monotonic()
        idle = await _ss(client, bob, body, pos=woken["pos"], timeout=300)
        assert idle["rooms"] == {} and time.monotonic() - started >= 0.3


async def test_a_long_poll_sleeps_through_events_in_rooms_the_user_is_not_in(database_dsn: str,
                                                                           tmp_path: Path) -> None:
    """Messages in a room the user has no membership in do not compute the connection again
    (tributary_sync_duration_seconds{kind="sliding_incremental"}); an invite to it wakes it."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (hs, client):
        alice, bob = await _users(client)
        shared = await _room(client, alice, "shared")
        await _ok(client, "POST", f"rooms/{shared}/join", {}, token=bob)
        elsewhere = await _room(client, alice, "elsewhere")
        body = {"lists": {"l": {"ranges": [[0, 5]], "timeline_limit": 3, "required_state": []}}}
        first = await _ss(client, bob, body)
        waiting = Deferred.fromCoroutine(_ss(client, bob, body, pos=first["pos"], timeout=20000))
        deadline = time.monotonic() + 10
        while hs.process.notifier.waiter_count() < 1:
            assert time.monotonic() < deadline and not waiting.called, "the long-poll never waited"
            await deferLater(reactor, 0.01, lambda: None)
        computed = hs.registry.get_sample_value("tributary_sync_duration_seconds_count", {"kind": "sliding_incremental"})
        for i in range(5):
            await _send(client, alice, elsewhere, f"e{i}")
        await _ok(client, "POST", f"rooms/{elsewhere}/invite", {"user_id": BOB}, token=alice)
        woken = await waiting
        assert list(woken["rooms"]) == [elsewhere] and woken["rooms"][elsewhere].get("invite_state")
        after = hs.registry.get_sample_value("tributary_sync_duration_seconds_count", {"kind": "sliding_incremental"})
        assert computed is not None and after == computed + 1  # the invite's wake only


async def test_a_read_receipt_elsewhere_sends_the_room_again_with_its_new_counts(database_dsn: str,
                                                                              tmp_path: Path) -> None:
    """Bob reads a room on another device: a connection waiting with a pos is woken and gets the
    room again, with no new event but ``notification_count`` 0 (the badge clears everywhere)."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, bob = await _users(client)
        room_id = await _room(client, alice, "r")
        other = await _room(client, alice, "other")
        for r in (room_id, other):
            await _ok(client, "POST", f"rooms/{r}/join", {}, token=bob)
        await _send(client, alice, other, "unread elsewhere")
        last = [await _send(client, alice, room_id, f"unread {i}") for i in range(2)][-1]
        body = {"lists": {"l": {"ranges": [[0, 5]], "timeline_limit": 1, "required_state": []}}}
        first = await _ss(client, bob, body)
        assert first["rooms"][room_id]["notification_count"] == 2
        waiting = Deferred.fromCoroutine(_ss(client, bob, body, pos=first["pos"], timeout=20000))
        await _ok(client, "POST", f"rooms/{room_id}/receipt/m.read.private/{quote(last)}", {}, token=bob)
        woken = await waiting
        assert set(woken["rooms"]) == {room_id}, "only the room whose counts changed"
        room = woken["rooms"][room_id]
        assert room["notification_count"] == 0 and room["highlight_count"] == 0
        assert room["timeline"] == [] and "initial" not in room
        # Alice's receipt changes none of Bob's counts: nothing to send.
        await _ok(client, "POST", f"rooms/{room_id}/receipt/m.read/{quote(last)}", {}, token=alice)
        quiet = await _ss(client, bob, body, pos=woken["pos"], timeout=0)
        assert quiet["rooms"] == {}


async def test_extensions(database_dsn: str, tmp_path: Path) -> None:
    """to_device (with ``since``; acknowledged messages are deleted, as /sync does), e2ee (one-time
    key counts, fallback key types, device list changes), account data (global and per room),
    receipts and typing, each first whole and then as changes."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, bob = await _users(client)
        bob_device = (await _ok(client, "GET", "account/whoami", token=bob))["device_id"]
        alice_device = (await _ok(client, "GET", "account/whoami", token=alice))["device_id"]
        room_id = await _room(client, alice, "r")
        await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob)
        message = await _send(client, alice, room_id, "hello")
        await _ok(client, "POST", f"rooms/{room_id}/receipt/m.read/{quote(message)}", {}, token=alice)
        await _ok(client, "PUT", "sendToDevice/m.test/t1", {"messages": {BOB: {bob_device: {"n": 1}}}}, token=alice)
        await _ok(client, "POST", "keys/upload", {
            "one_time_keys": {"signed_curve25519:K1": {"key": "k1"}, "signed_curve25519:K2": {"key": "k2"}},
            "fallback_keys": {"signed_curve25519:F1": {"key": "f", "fallback": True}}}, token=bob)
        await _ok(client, "PUT", f"user/{quote(BOB)}/account_data/m.test.global", {"g": 1}, token=bob)
        await _ok(client, "PUT", f"user/{quote(BOB)}/rooms/{room_id}/account_data/m.test.room", {"r": 1}, token=bob)
        await _ok(client, "PUT", f"rooms/{room_id}/typing/{quote(ALICE)}", {"typing": True, "timeout": 30000},
                  token=alice)
        extensions = {name: {"enabled": True} for name in ("to_device", "e2ee", "account_data", "receipts", "typing")}
        body: dict[str, Any] = {"lists": {"l": {"ranges": [[0, 5]], "timeline_limit": 5, "required_state": []}},
                                "extensions": extensions}
        first = await _ss(client, bob, body)
        ext = first["extensions"]
        assert [e["content"] for e in ext["to_device"]["events"]] == [{"n": 1}]
        assert ext["to_device"]["events"][0]["sender"] == ALICE
        assert ext["e2ee"]["device_one_time_keys_count"]["signed_curve25519"] == 2
        assert ext["e2ee"]["device_unused_fallback_key_types"] == ["signed_curve25519"]
        global_types = {e["type"]: e["content"] for e in ext["account_data"]["global"]}
        assert global_types["m.test.global"] == {"g": 1} and "m.push_rules" in global_types
        assert ext["account_data"]["rooms"][room_id] == [{"type": "m.test.room", "content": {"r": 1}}]
        assert ALICE in ext["receipts"]["rooms"][room_id]["content"][message]["m.read"]
        assert ext["typing"]["rooms"][room_id]["content"]["user_ids"] == [ALICE]

        # Changes only, from the connection's position and the to-device ``since``.
        await _ok(client, "PUT", "sendToDevice/m.test/t2", {"messages": {BOB: {bob_device: {"n": 2}}}}, token=alice)
        await _ok(client, "PUT", f"user/{quote(BOB)}/account_data/m.test.global", {"g": 2}, token=bob)
        await _ok(client, "PUT", f"rooms/{room_id}/typing/{quote(ALICE)}", {"typing": False}, token=alice)
        await _ok(client, "POST", "keys/upload", {"device_keys": signed_keys(ALICE, alice_device)}, token=alice)
        since = {**extensions, "to_device": {"enabled": True, "since": ext["to_device"]["next_batch"]}}
        second = await _ss(client, bob, {**body, "extensions": since}, pos=first["pos"], timeout=0)
        ext = second["extensions"]
        assert [e["content"] for e in ext["to_device"]["events"]] == [{"n": 2}]
        assert ext["account_data"]["global"] == [{"type": "m.test.global", "content": {"g": 2}}]
        assert ext["account_data"]["rooms"] == {}
        assert ext["typing"]["rooms"][room_id]["content"]["user_ids"] == []
        assert ext["receipts"]["rooms"] == {}
        assert ALICE in ext["e2ee"]["device_lists"]["changed"]
        # The first message was acknowledged by ``since``: gone even for a client starting over.
        over = await _ss(client, bob, {"extensions": {"to_device": {"enabled": True}}})
        assert [e["content"] for e in over["extensions"]["to_device"]["events"]] == [{"n": 2}]
        # ``limit`` pages through the messages: ``next_batch`` stops at the last one sent.
        for n in (3, 4, 5):
            await _ok(client, "PUT", f"sendToDevice/m.test/t{n}", {"messages": {BOB: {bob_device: {"n": n}}}},
                      token=alice)
        page = await _ss(client, bob, {"extensions": {"to_device": {"enabled": True, "limit": 2}}})
        assert [e["content"]["n"] for e in page["extensions"]["to_device"]["events"]] == [2, 3]
        rest = await _ss(client, bob, {"extensions": {"to_device": {
            "enabled": True, "limit": 2, "since": page["extensions"]["to_device"]["next_batch"]}}})
        assert [e["content"]["n"] for e in rest["extensions"]["to_device"]["events"]] == [4, 5]


@pytest.mark.timeout(120)
async def test_a_connection_continues_on_another_process(postgres_template: str, redis_url: str,
                                                         tmp_path: Path) -> None:
    """The connection's state is in PostgreSQL: a ``pos`` the main process answered is continued by
    the generic worker (only what is new, nothing initial), and a long poll there, reached
    through docker/nginx.conf's routing, is woken by a message sent on the main process."""
    with scratch_database(postgres_template) as dsn:
        main, workers, generic_port = configure_workers(tmp_path / "a", dsn, redis_url, persisters=0, senders=0)
        nginx = Nginx.for_workers(tmp_path / "nginx", main_port=main.client_port, generic_port=generic_port)
        started: list[TributaryProcess] = []
        try:
            for process in (main, workers["g1"]):
                process.start()
                started.append(process)
            nginx.start()
            on_main, on_worker = Client(main.base_url), Client(f"http://127.0.0.1:{generic_port}")
            front = Client(f"http://127.0.0.1:{nginx.port}")
            alice = (await on_main.register_ok("alice"))["access_token"]
            bob = (await on_main.register_ok("bob"))["access_token"]
            rooms = [await _room(on_main, alice, f"r{i}") for i in range(2)]
            for room_id in rooms:
                await _ok(on_main, "POST", f"rooms/{room_id}/join", {}, token=bob)
            body = {"conn_id": "phone", "lists": {"l": {"ranges": [[0, 9]], "timeline_limit": 5,
                                                        "required_state": [["m.room.name", ""]]}}}
            first = await _ss(on_main, bob, body)
            assert set(first["rooms"]) == set(rooms)
            sent = await _send(on_main, alice, rooms[0], "after the first answer")
            second = await _ss(on_worker, bob, body, pos=first["pos"], timeout=10000)
            assert set(second["rooms"]) == {rooms[0]}
            assert [e["event_id"] for e in second["rooms"][rooms[0]]["timeline"]] == [sent]
            assert "initial" not in second["rooms"][rooms[0]]

            waiting = Deferred.fromCoroutine(_ss(front, bob, body, pos=second["pos"], timeout=20000))
            woke = await _send(on_main, alice, rooms[1], "wake the worker")
            woken = await waiting
            assert set(woken["rooms"]) == {rooms[1]}
            assert [e["event_id"] for e in woken["rooms"][rooms[1]]["timeline"]] == [woke]
            # ... and the main process continues from the worker's answer.
            third = await _ss(on_main, bob, body, pos=woken["pos"], timeout=0)
            assert third["rooms"] == {}
        finally:
            nginx.stop()
            for process in reversed(started):
                assert process.stop() == 0, process.output[-5000:]


async def test_membership_changes(database_dsn: str, tmp_path: Path) -> None:
    """An invite accepted is sent whole again (the client had stripped state only); a kick and
    a leave of a room the connection has are sent once, the timeline ending at the membership
    event; the list keeps the kicked room and drops the left one once it was sent."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, bob = await _users(client)
        invited = await _room(client, alice, "invited", preset="private_chat", invite=[BOB])
        kicked = await _room(client, alice, "kicked")
        left = await _room(client, alice, "left")
        for room_id in (kicked, left):
            await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob)
        body = {"lists": {"l": {"ranges": [[0, 9]], "timeline_limit": 3, "required_state": [["m.room.create", ""]]}}}
        first = await _ss(client, bob, body)
        assert first["rooms"][invited]["membership"] == "invite" and first["lists"]["l"]["count"] == 3

        await _ok(client, "POST", f"rooms/{invited}/join", {}, token=bob)
        joined = await _ss(client, bob, body, pos=first["pos"], timeout=0)
        room = joined["rooms"][invited]
        assert room["initial"] is True and room["membership"] == "join" and room["name"] == "invited"
        assert [e["type"] for e in room["required_state"]] == ["m.room.create"]

        await _ok(client, "POST", f"rooms/{kicked}/kick", {"user_id": BOB}, token=alice)
        await _ok(client, "POST", f"rooms/{left}/leave", {}, token=bob)
        await _send(client, alice, kicked, "after the kick")
        changed = await _ss(client, bob, body, pos=joined["pos"], timeout=0)
        assert changed["rooms"][kicked]["membership"] == "leave"
        kick_event = changed["rooms"][kicked]["timeline"][-1]
        assert (kick_event["type"], kick_event["state_key"], kick_event["sender"]) == ("m.room.member", BOB, ALICE)
        assert "after the kick" not in [e["content"].get("body") for e in changed["rooms"][kicked]["timeline"]]
        leave_event = changed["rooms"][left]["timeline"][-1]
        assert (leave_event["type"], leave_event["sender"], leave_event["content"]["membership"]) == (
            "m.room.member", BOB, "leave")
        assert changed["rooms"][left]["membership"] == "leave"
        quiet = await _ss(client, bob, body, pos=changed["pos"], timeout=0)
        assert quiet["rooms"] == {}
        # What happens after the kick is not bob's to see; a ban from a room bob never joined
        # lists nothing.
        await _ok(client, "PUT", f"rooms/{kicked}/state/m.room.name", {"name": "renamed"}, token=alice)
        banned = await _room(client, alice, "banned before joining")
        await _ok(client, "POST", f"rooms/{banned}/ban", {"user_id": BOB}, token=alice)
        # A new connection lists the kicked room, not the one bob left himself.
        fresh = await _ss(client, bob, body)
        assert set(fresh["lists"]["l"]["ops"][0]["room_ids"]) == {invited, kicked}
        assert fresh["rooms"][kicked]["name"] == "kicked" and "joined_count" not in fresh["rooms"][kicked]
        subscribed = await _ss(client, bob, {"room_subscriptions": {banned: {"timeline_limit": 5,
                                                                             "required_state": ALL_STATE}}})
        assert subscribed["rooms"] == {}


async def test_rooms_sliding_out_of_range_and_back(database_dsn: str, tmp_path: Path) -> None:
    """A [0,0] window follows activity: a room bumped into it is sent whole the first time;
    one that slides out and comes back brings only what happened since it was last sent
    (possibly limited), not ``initial``. Asking for more state re-sends a room with it, and a
    larger ``timeline_limit`` its newest events (``expanded_timeline``)."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, bob = await _users(client)
        first_room, second_room = [await _room(client, alice, f"r{i}") for i in range(2)]
        for room_id in (first_room, second_room):
            await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob)
        await _send(client, alice, first_room, "first is on top")
        top: dict[str, Any] = {"lists": {"top": {"ranges": [[0, 0]], "timeline_limit": 2,
                                                 "required_state": [["m.room.create", ""]]}}}
        answer = await _ss(client, bob, top)
        assert set(answer["rooms"]) == {first_room}

        await _send(client, alice, second_room, "second takes the top")
        answer = await _ss(client, bob, top, pos=answer["pos"], timeout=0)
        assert set(answer["rooms"]) == {second_room} and answer["rooms"][second_room]["initial"] is True

        missed = [await _send(client, alice, first_room, f"while away {i}") for i in range(3)]
        answer = await _ss(client, bob, top, pos=answer["pos"], timeout=0)
        back = answer["rooms"][first_room]
        assert set(answer["rooms"]) == {first_room} and "initial" not in back
        assert [e["event_id"] for e in back["timeline"]] == missed[-2:] and back["limited"] is True

        more_state = {"lists": {"top": {**top["lists"]["top"], "required_state": [["m.room.create", ""],
                                                                                 ["m.room.join_rules", ""]]}}}
        answer = await _ss(client, bob, more_state, pos=answer["pos"], timeout=0)
        assert {(e["type"], e["state_key"]) for e in answer["rooms"][first_room]["required_state"]} == {
            ("m.room.create", ""), ("m.room.join_rules", "")}
        answer = await _ss(client, bob, more_state, pos=answer["pos"], timeout=0)
        assert answer["rooms"] == {}
        # A larger timeline_limit brings the room's newest events again at once, marked as such.
        longer = {"lists": {"top": {**more_state["lists"]["top"], "timeline_limit": 4}}}
        answer = await _ss(client, bob, longer, pos=answer["pos"], timeout=0)
        again = answer["rooms"][first_room]
        assert again["expanded_timeline"] is True and "initial" not in again and again["num_live"] == 0
        assert [e["content"]["body"] for e in again["timeline"]] == [
            "first is on top", "while away 0", "while away 1", "while away 2"]
        assert (await _ss(client, bob, longer, pos=answer["pos"], timeout=0))["rooms"] == {}


async def test_an_invite_to_a_room_on_another_server_is_listed(database_dsn: str, tmp_path: Path) -> None:
    """An invite from another server to a room this server is not in (kept as a remote_invites
    row when it arrived over federation) is in the list, with the stripped state it carried."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (hs, client):
        _, bob = await _users(client)
        room_id = "!elsewhere:remote.example"
        invite = {"type": "m.room.member", "state_key": BOB, "sender": "@carol:remote.example", "room_id": room_id,
                  "content": {"membership": "invite"}, "origin_server_ts": 1, "depth": 5, "prev_events": [],
                  "auth_events": [], "hashes": {"sha256": "x"}, "signatures": {}}
        carried = [{"type": "m.room.name", "state_key": "", "sender": "@carol:remote.example",
                    "content": {"name": "Far away"}}]
        assert hs.process.db is not None
        await RemoteInviteStore(hs.process.db).put(RemoteInviteRow(
            BOB, room_id, "invite", "$invite:remote.example", "10", json.dumps(invite), json.dumps(carried), 10**9,
            "master"))
        answer = await _ss(client, bob, {"lists": {"inv": {"ranges": [[0, 9]], "timeline_limit": 1,
                                                           "required_state": [], "filters": {"is_invite": True}}}})
        assert answer["lists"]["inv"]["ops"][0]["room_ids"] == [room_id]
        room = answer["rooms"][room_id]
        assert room["membership"] == "invite" and room["initial"] is True
        assert [(e["type"], e["content"]) for e in room["invite_state"]] == [
            ("m.room.name", {"name": "Far away"}), ("m.room.member", {"membership": "invite"})]


async def test_subscriptions_hold_until_unsubscribed(database_dsn: str, tmp_path: Path) -> None:
    """A room subscription holds for the connection's later requests (matrix-js-sdk sends it
    once) until ``unsubscribe_rooms`` names it; it also survives a retried ``pos``."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, bob = await _users(client)
        room_id = await _room(client, alice, "followed")
        await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob)
        first = await _ss(client, bob, {"room_subscriptions": {room_id: {"timeline_limit": 2, "required_state": []}}})
        assert first["rooms"][room_id]["initial"] is True
        sent = await _send(client, alice, room_id, "still followed")
        later = await _ss(client, bob, {}, pos=first["pos"], timeout=0)
        assert [e["event_id"] for e in later["rooms"][room_id]["timeline"]] == [sent]
        dropped = await _ss(client, bob, {"unsubscribe_rooms": [room_id]}, pos=later["pos"], timeout=0)
        assert dropped["rooms"] == {}
        await _send(client, alice, room_id, "no longer followed")
        assert (await _ss(client, bob, {}, pos=dropped["pos"], timeout=0))["rooms"] == {}
        bad = await client.request("POST", SS, {"unsubscribe_rooms": ["not a room"]}, token=bob)
        assert bad.status == 400 and bad.errcode == "M_INVALID_PARAM"
