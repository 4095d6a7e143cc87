"""/sync state correctness against a real server: inline JSON filters and ``rooms.leave``.

The spec (client-server API, ``GET /sync``): ``filter`` is a filter ID or a JSON filter
(a string starting with ``{``); left and banned rooms appear under ``rooms.leave`` in an
incremental sync, and in an initial sync only with ``room.include_leave: true``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater

from tests.integration.test_client_rooms import ALICE, BOB, ROOM_LIMITS, _ok, _users
from tests.integration.test_client_support import SERVER_NAME, Response, running_server

CAROL = f"@carol:{SERVER_NAME}"
DAVE = f"@dave:{SERVER_NAME}"


async def test_an_inline_json_filter_is_applied_and_validated(database_dsn: str, tmp_path: Path) -> None:
    """An inline filter selects like a stored one; bad JSON or a bad shape is a 400 that names it."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, _ = await _users(client)
        room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        sent = [
            (await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/t{i}", {"body": str(i)}, token=alice))[
                "event_id"]
            for i in range(3)
        ]
        only_messages = quote('{"room":{"timeline":{"limit":2,"types":["m.room.message"]}}}')
        synced = await _ok(client, "GET", f"sync?filter={only_messages}", token=alice)
        timeline = synced["rooms"]["join"][room_id]["timeline"]
        assert [e["event_id"] for e in timeline["events"]] == sent[-2:]
        assert timeline["limited"] is True

        not_json = await client.request("GET", f"sync?filter={quote('{not json')}", token=alice)
        assert not_json.status == 400 and not_json.body["errcode"] == "M_INVALID_PARAM", not_json
        negative_limit = quote('{"room":{"timeline":{"limit":-1}}}')
        bad_shape = await client.request("GET", f"sync?filter={negative_limit}", token=alice)
        assert bad_shape.status == 400 and bad_shape.body["errcode"] == "M_BAD_JSON", bad_shape
        room_list = quote('{"room":[]}')
        not_object = await client.request("GET", f"sync?filter={room_list}", token=alice)
        assert not_object.status == 400 and not_object.body["errcode"] == "M_BAD_JSON", not_object


async def test_left_and_banned_rooms_appear_under_rooms_leave(database_dsn: str, tmp_path: Path) -> None:
    """Incremental: the leave (or ban) ends the room's timeline under rooms.leave. Initial: listed
    only with include_leave, and the archived timeline stops at the leave."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, bob = await _users(client)
        left_room = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        ban_room = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        for room_id in (left_room, ban_room):
            await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob)
        before = await _ok(client, "PUT", f"rooms/{left_room}/send/m.room.message/b1", {"body": "before"}, token=alice)
        mark = (await _ok(client, "GET", "sync", token=bob))["next_batch"]

        leave_id = (await _ok(client, "PUT", f"rooms/{left_room}/state/m.room.member/{quote(BOB)}",
                              {"membership": "leave"}, token=bob))["event_id"]
        await _ok(client, "POST", f"rooms/{ban_room}/ban", {"user_id": BOB, "reason": "spam"}, token=alice)
        after = await _ok(client, "PUT", f"rooms/{left_room}/send/m.room.message/a1", {"body": "after"}, token=alice)

        incremental = await _ok(client, "GET", f"sync?since={mark}", token=bob)
        leave = incremental["rooms"]["leave"]
        assert set(leave) == {left_room, ban_room} and not incremental["rooms"]["join"]
        left_timeline = [e["event_id"] for e in leave[left_room]["timeline"]["events"]]
        assert left_timeline[-1] == leave_id and after["event_id"] not in left_timeline
        ban_event = leave[ban_room]["timeline"]["events"][-1]
        assert (ban_event["type"], ban_event["state_key"], ban_event["content"]["membership"]) == (
            "m.room.member", BOB, "ban")

        initial = await _ok(client, "GET", "sync", token=bob)
        assert initial["rooms"]["leave"] == {}
        include_leave = quote('{"room":{"include_leave":true}}')
        archived = await _ok(client, "GET", f"sync?filter={include_leave}", token=bob)
        assert set(archived["rooms"]["leave"]) == {left_room, ban_room}
        history = [e["event_id"] for e in archived["rooms"]["leave"][left_room]["timeline"]["events"]]
        assert history[-2:] == [before["event_id"], leave_id]
        assert after["event_id"] not in history

        # A forgotten room is archived no more.
        await _ok(client, "POST", f"rooms/{left_room}/forget", {}, token=bob)
        forgotten = await _ok(client, "GET", f"sync?filter={include_leave}", token=bob)
        assert set(forgotten["rooms"]["leave"]) == {ban_room}


async def test_joined_rooms_carry_a_summary_when_membership_changed(database_dsn: str, tmp_path: Path) -> None:
    """summary: m.heroes (other joined or invited members by stream ordering, else those who left),
    m.joined_member_count, m.invited_member_count; always in an initial sync, and in an incremental
    one only when membership changed."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, bob = await _users(client)
        carol = (await client.register_ok("carol"))["access_token"]
        carol_id = BOB.replace("@bob:", "@carol:")
        alice_id = BOB.replace("@bob:", "@alice:")
        room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob)
        await _ok(client, "POST", f"rooms/{room_id}/invite", {"user_id": carol_id}, token=alice)

        initial = await _ok(client, "GET", "sync", token=bob)
        assert initial["rooms"]["join"][room_id]["summary"] == {
            "m.heroes": [alice_id, carol_id], "m.joined_member_count": 2, "m.invited_member_count": 1}

        await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/s1", {"body": "hi"}, token=alice)
        quiet = await _ok(client, "GET", f"sync?since={initial['next_batch']}", token=bob)
        assert quiet["rooms"]["join"][room_id]["summary"] == {}  # nothing about membership changed

        await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=carol)
        joined = await _ok(client, "GET", f"sync?since={quiet['next_batch']}", token=bob)
        assert joined["rooms"]["join"][room_id]["summary"] == {
            "m.heroes": [alice_id, carol_id], "m.joined_member_count": 3, "m.invited_member_count": 0}

        # With every other member gone, the heroes are those who left (the spec's fallback).
        for token in (alice, carol):
            await _ok(client, "POST", f"rooms/{room_id}/leave", {}, token=token)
        alone = await _ok(client, "GET", f"sync?since={joined['next_batch']}", token=bob)
        assert alone["rooms"]["join"][room_id]["summary"] == {
            "m.heroes": [alice_id, carol_id], "m.joined_member_count": 1, "m.invited_member_count": 0}


async def test_joining_and_leaving_between_two_syncs_shows_the_room_as_left(database_dsn: str, tmp_path: Path) -> None:
    """A user who joins and leaves within one batch sees the room under rooms.leave (with both
    membership events), never under rooms.join; leaving and rejoining shows it joined."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, bob = await _users(client)
        room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        mark = (await _ok(client, "GET", "sync", token=bob))["next_batch"]
        joined_id = (await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob))["room_id"]
        assert joined_id == room_id
        await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/m1", {"body": "while in"}, token=alice)
        await _ok(client, "POST", f"rooms/{room_id}/leave", {}, token=bob)

        synced = await _ok(client, "GET", f"sync?since={mark}", token=bob)
        assert room_id not in synced["rooms"]["join"]
        events = synced["rooms"]["leave"][room_id]["timeline"]["events"]
        memberships = [e["content"]["membership"] for e in events
                       if e["type"] == "m.room.member" and e["state_key"] == BOB]
        assert memberships == ["join", "leave"]
        assert "while in" in [e["content"].get("body") for e in events]

        # Leaving and coming back in one batch: the room is joined again.
        await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob)
        again = await _ok(client, "GET", f"sync?since={synced['next_batch']}", token=bob)
        assert room_id in again["rooms"]["join"] and room_id not in again["rooms"]["leave"]


async def test_event_format_federation_gives_the_pdus(database_dsn: str, tmp_path: Path) -> None:
    """A filter's ``event_format: federation`` gives room events in the federation (PDU) format:
    with ``room_id``, ``auth_events``, ``prev_events``, ``depth``, ``hashes`` and ``signatures``;
    the default (``client``) gives none of them."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, _ = await _users(client)
        room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        sent = (await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/f1", {"body": "pdu"}, token=alice))[
            "event_id"]
        federation = quote('{"event_format":"federation","room":{"timeline":{"limit":1}}}')
        synced = await _ok(client, "GET", f"sync?filter={federation}", token=alice)
        room = synced["rooms"]["join"][room_id]
        [event] = room["timeline"]["events"]
        assert event["event_id"] == sent and event["room_id"] == room_id
        assert event["content"] == {"body": "pdu"}
        for field in ("auth_events", "prev_events", "depth", "hashes", "signatures"):
            assert field in event, field
        assert event["unsigned"]["transaction_id"] == "f1"
        assert room["state"]["events"] and all("signatures" in e for e in room["state"]["events"])

        plain = await _ok(client, "GET", "sync?filter=" + quote('{"room":{"timeline":{"limit":1}}}'), token=alice)
        [client_event] = plain["rooms"]["join"][room_id]["timeline"]["events"]
        assert client_event["event_id"] == sent and "signatures" not in client_event and "room_id" not in client_event

        wrong = await client.request("GET", "sync?filter=" + quote('{"event_format":"xml"}'), token=alice)
        assert wrong.status == 400 and wrong.body["errcode"] == "M_BAD_JSON", wrong


def _members(room: dict[str, Any]) -> set[str]:
    return {e["state_key"] for e in room["state"]["events"] if e["type"] == "m.room.member"}


async def test_lazy_loaded_members_in_incremental_syncs(database_dsn: str, tmp_path: Path) -> None:
    """With ``lazy_load_members`` an incremental sync's state holds the member events of the
    timeline's senders (and the user's own), never the others', and, as Synapse, not those this
    device already has unless ``include_redundant_members``."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, bob = await _users(client)
        carol = (await client.register_ok("carol"))["access_token"]
        dave = (await client.register_ok("dave"))["access_token"]
        room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        for token in (bob, carol, dave):
            await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=token)
        lazy = quote('{"room":{"timeline":{"limit":10},"state":{"lazy_load_members":true}}}')
        await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/a0", {"body": "welcome"}, token=alice)
        lazy_one = quote('{"room":{"timeline":{"limit":1},"state":{"lazy_load_members":true}}}')
        initial = await _ok(client, "GET", f"sync?filter={lazy_one}", token=alice)
        assert _members(initial["rooms"]["join"][room_id]) == {ALICE}
        since = initial["next_batch"]

        await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/c1", {"body": "hi"}, token=carol)
        synced = await _ok(client, "GET", f"sync?since={since}&filter={lazy}", token=alice)
        room = synced["rooms"]["join"][room_id]
        assert room["timeline"]["limited"] is False
        assert _members(room) == {CAROL}  # Alice's own membership came with the initial sync
        assert all(e["type"] == "m.room.member" for e in room["state"]["events"])

        # Carol again and Bob: only Bob is new to this device.
        await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/c2", {"body": "again"}, token=carol)
        await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/b1", {"body": "me too"}, token=bob)
        synced = await _ok(client, "GET", f"sync?since={synced['next_batch']}&filter={lazy}", token=alice)
        assert _members(synced["rooms"]["join"][room_id]) == {BOB}

        # Asked for redundant members: every sender and the user, each time.
        redundant = quote('{"room":{"state":{"lazy_load_members":true,"include_redundant_members":true}}}')
        await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/c3", {"body": "third"}, token=carol)
        synced = await _ok(client, "GET", f"sync?since={synced['next_batch']}&filter={redundant}", token=alice)
        assert _members(synced["rooms"]["join"][room_id]) == {CAROL, ALICE}

        # A device that never had them: another login of Alice's gets her own membership too.
        login = await client.login("alice")
        assert login.status == 200, login
        other = login.body["access_token"]
        mark = (await _ok(client, "GET", "sync", token=other))["next_batch"]
        await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/d1", {"body": "dave"}, token=dave)
        synced = await _ok(client, "GET", f"sync?since={mark}&filter={lazy}", token=other)
        assert _members(synced["rooms"]["join"][room_id]) == {DAVE, ALICE}

        # Without lazy loading, a gapless incremental sync has no state at all.
        await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/c4", {"body": "plain"}, token=carol)
        synced = await _ok(client, "GET", f"sync?since={synced['next_batch']}", token=other)
        assert synced["rooms"]["join"][room_id]["state"]["events"] == []


async def test_a_filtered_timeline_still_reaches_its_limit(database_dsn: str, tmp_path: Path) -> None:
    """A ``types``/``not_types`` timeline filter gives ``limit`` matching events even when other
    events lie between them; ``limited`` says whether matching ones were left out, and
    ``prev_batch`` pages back to them."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, bob = await _users(client)
        room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob)
        mark = (await _ok(client, "GET", "sync", token=bob))["next_batch"]
        messages = []
        for i in range(4):
            messages.append((await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/m{i}",
                                       {"body": str(i)}, token=alice))["event_id"])
            for j in range(5):
                await _ok(client, "PUT", f"rooms/{room_id}/send/x.noise/n{i}.{j}", {}, token=alice)

        for selection in ('"types":["m.room.message"]', '"not_types":["x.noise"]'):
            definition = '{"room":{"timeline":{"limit":3,' + selection + '}}}'
            synced = await _ok(client, "GET", f"sync?since={mark}&filter={quote(definition)}", token=bob)
            timeline = synced["rooms"]["join"][room_id]["timeline"]
            assert [e["event_id"] for e in timeline["events"]] == messages[1:], definition
            assert timeline["limited"] is True
            back = await _ok(client, "GET", f"rooms/{room_id}/messages?dir=b&limit=20&from={timeline['prev_batch']}"
                             f"&filter={quote('{' + selection + '}')}", token=bob)
            # Backwards from prev_batch: the message before the timeline, then the room's older events.
            assert [e["event_id"] for e in back["chunk"]][0] == messages[0], definition

        # All the matching events since the token fit: not limited, though the raw events did not.
        wide = quote('{"room":{"timeline":{"limit":5,"types":["m.room.message"]}}}')
        synced = await _ok(client, "GET", f"sync?since={mark}&filter={wide}", token=bob)
        timeline = synced["rooms"]["join"][room_id]["timeline"]
        assert [e["event_id"] for e in timeline["events"]] == messages
        assert timeline["limited"] is False

        # An initial sync likewise reaches back past the noise.
        initial = await _ok(client, "GET", "sync?filter=" + quote(
            '{"room":{"timeline":{"limit":2,"types":["m.room.message"]}}}'), token=bob)
        timeline = initial["rooms"]["join"][room_id]["timeline"]
        assert [e["event_id"] for e in timeline["events"]] == messages[2:] and timeline["limited"] is True


async def test_a_newly_joined_room_comes_with_its_full_state(database_dsn: str, tmp_path: Path) -> None:
    """The first incremental sync after a join gives the room whole: its state before the
    timeline and the timeline together hold the room's entire current state."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, bob = await _users(client)
        room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        await _ok(client, "PUT", f"rooms/{room_id}/state/m.room.name", {"name": "Lounge"}, token=alice)
        await _ok(client, "PUT", f"rooms/{room_id}/state/m.room.topic", {"topic": "chat"}, token=alice)
        for i in range(12):
            await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/j{i}", {"body": str(i)}, token=alice)
        mark = (await _ok(client, "GET", "sync", token=bob))["next_batch"]
        await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob)

        synced = await _ok(client, "GET", f"sync?since={mark}", token=bob)
        room = synced["rooms"]["join"][room_id]
        state = {(e["type"], e["state_key"]): e["event_id"] for e in room["state"]["events"]}
        timeline = room["timeline"]["events"]
        assert (timeline[-1]["type"], timeline[-1]["state_key"], timeline[-1]["content"]["membership"]) == (
            "m.room.member", BOB, "join")
        state.update({(e["type"], e["state_key"]): e["event_id"] for e in timeline if "state_key" in e})
        current = await _ok(client, "GET", f"rooms/{room_id}/state", token=bob)
        assert state == {(e["type"], e["state_key"]): e["event_id"] for e in current}
        assert ("m.room.name", "") in {(e["type"], e["state_key"]) for e in room["state"]["events"]}
        assert room["summary"]["m.joined_member_count"] == 2

        # The next incremental sync is quiet again.
        again = await _ok(client, "GET", f"sync?since={synced['next_batch']}&timeout=0", token=bob)
        assert room_id not in again["rooms"]["join"]


async def test_a_waiting_sync_sleeps_through_events_not_for_its_user(database_dsn: str, tmp_path: Path) -> None:
    """A long-polling /sync is not computed again for events, typing or receipts in rooms its
    user is not joined to, nor for another user's account data or to-device messages (each
    computation counts in tributary_sync_duration_seconds{kind="incremental"}); a message in
    its room, an invite to another room, or a to-device message to it, still ends the wait."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (hs, client):
        alice, bob = await _users(client)
        shared = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        await _ok(client, "POST", f"rooms/{shared}/join", {}, token=bob)
        elsewhere = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        since = (await _ok(client, "GET", "sync", token=bob))["next_batch"]

        def computed() -> float:
            value = hs.registry.get_sample_value("tributary_sync_duration_seconds_count", {"kind": "incremental"})
            assert value is not None
            return value

        async def waiting(since: str) -> tuple[Deferred[Response], float]:
            """Bob's long-poll, once it waits, and the count then."""
            poll = Deferred.fromCoroutine(client.request("GET", f"sync?since={since}&timeout=20000", token=bob))
            deadline = time.monotonic() + 10
            while hs.process.notifier.waiter_count() < 1:
                assert time.monotonic() < deadline and not poll.called, "bob's /sync never waited"
                await deferLater(reactor, 0.01, lambda: None)
            return poll, computed()

        async def waiting_at_once(since: str) -> tuple[Deferred[Response], float]:
            """``waiting`` for the token of Bob's last answer, when nothing happened since: the
            request waits before computing anything, as Synapse's does."""
            before = computed()
            poll, now = await waiting(since)
            assert now == before
            return poll, now

        poll, before = await waiting_at_once(since)
        for i in range(5):
            last = await _ok(client, "PUT", f"rooms/{elsewhere}/send/m.room.message/e{i}", {"body": f"e{i}"}, token=alice)
        # Typing and a read receipt there: positions of their own streams, in a room not Bob's.
        await _ok(client, "PUT", f"rooms/{elsewhere}/typing/{quote(ALICE)}", {"typing": True, "timeout": 30000},
                  token=alice)
        await _ok(client, "POST", f"rooms/{elsewhere}/receipt/m.read/{quote(last['event_id'])}", {}, token=alice)
        # Alice's account data, and a to-device message to her: other users' positions.
        await _ok(client, "PUT", f"user/{quote(ALICE)}/account_data/org.example.a", {"a": 1}, token=alice)
        await _ok(client, "POST", f"rooms/{elsewhere}/read_markers", {"m.fully_read": last["event_id"]}, token=alice)
        await _ok(client, "PUT", "sendToDevice/org.example.d/t1", {"messages": {ALICE: {"*": {"d": 1}}}}, token=alice)
        sent = (await _ok(client, "PUT", f"rooms/{shared}/send/m.room.message/s", {"body": "s"}, token=alice))["event_id"]
        answer = await poll
        assert answer.status == 200, answer
        assert [e["event_id"] for e in answer.body["rooms"]["join"][shared]["timeline"]["events"]] == [sent]
        assert elsewhere not in answer.body["rooms"]["join"]
        assert computed() - before == 1  # the wake for the message in its room; none for the rest

        poll, before = await waiting_at_once(answer.body["next_batch"])
        await _ok(client, "PUT", f"rooms/{elsewhere}/send/m.room.message/e5", {"body": "e5"}, token=alice)
        await _ok(client, "POST", f"rooms/{elsewhere}/invite", {"user_id": BOB}, token=alice)
        answer = await poll
        assert answer.status == 200, answer
        assert list(answer.body["rooms"]["invite"]) == [elsewhere] and not answer.body["rooms"]["join"]
        assert computed() - before == 1

        poll, before = await waiting_at_once(answer.body["next_batch"])
        await _ok(client, "PUT", "sendToDevice/org.example.d/t2", {"messages": {BOB: {"*": {"d": 2}}}}, token=alice)
        answer = await poll
        assert answer.status == 200, answer
        assert [m["content"] for m in answer.body["to_device"]["events"]] == [{"d": 2}]
        assert computed() - before == 1
