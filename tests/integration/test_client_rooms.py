"""Rooms over HTTP against an in-process server and real PostgreSQL.

Create rooms (presets, aliases, invites), join and leave, send with txn IDs,
state reads, /messages, /context, redaction, typing and receipts, and /sync:
status codes and bodies as the client-server spec gives them.
"""

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


async def _users(client: Client) -> tuple[str, str]:
    alice = (await client.register_ok("alice"))["access_token"]
    bob = (await client.register_ok("bob"))["access_token"]
    return alice, bob


async def _ok(client: Client, method: str, path: str, body: Any = None, *, token: str) -> Any:
    response = await client.request(method, path, body, token=token)
    assert response.status == 200, (method, path, response)
    return response.body


async def test_create_room_aliases_membership_and_state(database_dsn: str, tmp_path: Path) -> None:
    """Alice creates a named room with an alias and invites Bob; Bob joins by alias; state and members agree."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, bob = await _users(client)
        await _ok(client, "PUT", f"profile/{ALICE}/displayname", {"displayname": "Alice A"}, token=alice)
        created = await _ok(
            client,
            "POST",
            "createRoom",
            {"name": "Lobby", "topic": "hi", "room_alias_name": "lobby", "invite": [BOB], "preset": "private_chat"},
            token=alice,
        )
        room_id = created["room_id"]
        assert created["room_alias"] == f"#lobby:{SERVER_NAME}"
        taken = await client.request("POST", "createRoom", {"room_alias_name": "lobby"}, token=alice)
        assert taken.status == 400 and taken.errcode == "M_ROOM_IN_USE"
        bad_version = await client.request("POST", "createRoom", {"room_version": "zzz"}, token=alice)
        assert bad_version.status == 400 and bad_version.errcode == "M_UNSUPPORTED_ROOM_VERSION"

        alias = quote(f"#lobby:{SERVER_NAME}")
        assert (await _ok(client, "GET", f"directory/room/{alias}", token=bob))["room_id"] == room_id
        joined = await _ok(client, "POST", f"join/{alias}", {}, token=bob)
        assert joined["room_id"] == room_id
        assert (await _ok(client, "GET", "joined_rooms", token=bob))["joined_rooms"] == [room_id]

        members = await _ok(client, "GET", f"rooms/{room_id}/joined_members", token=bob)
        assert members["joined"][ALICE]["display_name"] == "Alice A"
        assert set(members["joined"]) == {ALICE, BOB}
        chunk = (await _ok(client, "GET", f"rooms/{room_id}/members", token=bob))["chunk"]
        assert {e["state_key"]: e["content"]["membership"] for e in chunk} == {ALICE: "join", BOB: "join"}

        await _ok(client, "PUT", f"profile/{BOB}/displayname", {"displayname": "Bobby"}, token=bob)
        bob_member = await _ok(client, "GET", f"rooms/{room_id}/state/m.room.member/{BOB}", token=alice)
        assert bob_member == {"membership": "join", "displayname": "Bobby"}

        name = await _ok(client, "GET", f"rooms/{room_id}/state/m.room.name/", token=bob)
        assert name == {"name": "Lobby"}
        await _ok(client, "PUT", f"rooms/{room_id}/state/m.room.topic", {"topic": "new"}, token=alice)
        state = await _ok(client, "GET", f"rooms/{room_id}/state", token=bob)
        assert {e["type"]: e["content"] for e in state if e["type"] == "m.room.topic"} == {"m.room.topic": {"topic": "new"}}

        stranger = (await client.register_ok("carol"))["access_token"]
        forbidden = await client.request("GET", f"rooms/{room_id}/state", token=stranger)
        assert forbidden.status == 403 and forbidden.errcode == "M_FORBIDDEN"
        unknown = await client.request("POST", f"rooms/!nope:{SERVER_NAME}/join", {}, token=stranger)
        assert unknown.status == 404 and unknown.errcode == "M_NOT_FOUND"
        not_invited = await client.request("POST", f"rooms/{room_id}/join", {}, token=stranger)
        assert not_invited.status == 403 and not_invited.errcode == "M_FORBIDDEN"

        await _ok(client, "POST", f"rooms/{room_id}/kick", {"user_id": BOB, "reason": "bye"}, token=alice)
        assert (await _ok(client, "GET", "joined_rooms", token=bob))["joined_rooms"] == []
        await _ok(client, "POST", f"rooms/{room_id}/ban", {"user_id": BOB}, token=alice)
        banned = await client.request("POST", f"rooms/{room_id}/join", {}, token=bob)
        assert banned.status == 403
        await _ok(client, "POST", f"rooms/{room_id}/unban", {"user_id": BOB}, token=alice)
        await _ok(client, "POST", f"rooms/{room_id}/forget", {}, token=bob)
        await _ok(client, "DELETE", f"directory/room/{alias}", token=alice)
        gone = await client.request("GET", f"directory/room/{alias}", token=alice)
        assert gone.status == 404 and gone.errcode == "M_NOT_FOUND"


async def test_send_messages_context_redaction_and_sync(database_dsn: str, tmp_path: Path) -> None:
    """Messages sent with txn IDs are idempotent, paginate both ways, redact, and reach the other user's sync once."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (hs, client):
        alice, bob = await _users(client)
        room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob)
        bob_sync = await _ok(client, "GET", "sync", token=bob)
        assert room_id in bob_sync["rooms"]["join"]
        since = bob_sync["next_batch"]

        ids = []
        for i in range(15):
            body = {"msgtype": "m.text", "body": f"m{i}"}
            event_id = (await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/t{i}", body, token=alice))["event_id"]
            ids.append(event_id)
        again = await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/t0", {"body": "x"}, token=alice)
        assert again["event_id"] == ids[0]

        filt = quote('{"room":{"timeline":{"limit":100}}}')
        incremental = await _ok(client, "GET", f"sync?since={since}&timeout=0&filter={filt}", token=bob)
        timeline = incremental["rooms"]["join"][room_id]["timeline"]
        assert [e["event_id"] for e in timeline["events"]] == ids and timeline["limited"] is False
        nothing = await _ok(client, "GET", f"sync?since={incremental['next_batch']}&timeout=0", token=bob)
        assert nothing["rooms"]["join"] == {}

        own = await _ok(client, "GET", f"rooms/{room_id}/event/{quote(ids[3])}", token=alice)
        assert own["content"]["body"] == "m3" and own["unsigned"]["transaction_id"] == "t3"
        other = await _ok(client, "GET", f"rooms/{room_id}/event/{quote(ids[3])}", token=bob)
        assert "transaction_id" not in other["unsigned"]

        page = await _ok(client, "GET", f"rooms/{room_id}/messages?dir=b&limit=5", token=bob)
        assert [e["event_id"] for e in page["chunk"]] == list(reversed(ids[-5:]))
        seen: list[str] = []
        token = None
        while True:
            query = f"dir=b&limit=7" + (f"&from={token}" if token else "")
            page = await _ok(client, "GET", f"rooms/{room_id}/messages?{query}", token=bob)
            seen.extend(e["event_id"] for e in page["chunk"])
            if "end" not in page:
                break
            token = page["end"]
        assert seen[-1] and (await _ok(client, "GET", f"rooms/{room_id}/event/{quote(seen[-1])}", token=bob))["type"] == "m.room.create"
        assert [e for e in seen if e in ids] == list(reversed(ids))
        forward = await _ok(client, "GET", f"rooms/{room_id}/messages?dir=f&limit=100&from=s0", token=bob)
        assert [e["event_id"] for e in forward["chunk"]][-15:] == ids

        context = await _ok(client, "GET", f"rooms/{room_id}/context/{quote(ids[7])}?limit=4", token=bob)
        assert context["event"]["event_id"] == ids[7]
        assert [e["event_id"] for e in context["events_before"]] == [ids[6], ids[5]]
        assert [e["event_id"] for e in context["events_after"]] == [ids[8], ids[9]]

        redaction = await _ok(client, "PUT", f"rooms/{room_id}/redact/{quote(ids[2])}/r1", {"reason": "oops"}, token=alice)
        redacted = await _ok(client, "GET", f"rooms/{room_id}/event/{quote(ids[2])}", token=bob)
        assert redacted["content"] == {} and redacted["unsigned"]["redacted_because"]["event_id"] == redaction["event_id"]
        not_allowed = await client.request("PUT", f"rooms/{room_id}/redact/{quote(ids[4])}/r2", {}, token=bob)
        assert not_allowed.status == 403

        bad_token = await client.request("GET", f"rooms/{room_id}/messages?from=garbage", token=bob)
        assert bad_token.status == 400 and bad_token.errcode == "M_INVALID_PARAM"
        bad_since = await client.request("GET", "sync?since=nope", token=bob)
        assert bad_since.status == 400 and bad_since.errcode == "M_INVALID_PARAM"

        # Typing and receipts reach the other user's sync.
        mark = (await _ok(client, "GET", "sync", token=bob))["next_batch"]
        await _ok(client, "PUT", f"rooms/{room_id}/typing/{ALICE}", {"typing": True, "timeout": 10000}, token=alice)
        await _ok(client, "POST", f"rooms/{room_id}/receipt/m.read/{quote(ids[-1])}", {}, token=alice)
        later = await _ok(client, "GET", f"sync?since={mark}&timeout=0", token=bob)
        ephemeral = {e["type"]: e["content"] for e in later["rooms"]["join"][room_id]["ephemeral"]["events"]}
        assert ephemeral["m.typing"] == {"user_ids": [ALICE]}
        assert ALICE in ephemeral["m.receipt"][ids[-1]]["m.read"]
        await _ok(client, "PUT", f"rooms/{room_id}/typing/{ALICE}", {"typing": False}, token=alice)
        stopped = await _ok(client, "GET", f"sync?since={later['next_batch']}&timeout=0", token=bob)
        typing_events = [e for e in stopped["rooms"]["join"][room_id]["ephemeral"]["events"] if e["type"] == "m.typing"]
        assert typing_events == [{"type": "m.typing", "content": {"user_ids": []}}]
        hs.process.rooms.stop()

        # A user who left stops seeing new messages; the leave shows in rooms.leave.
        mark = (await _ok(client, "GET", "sync", token=bob))["next_batch"]
        await _ok(client, "POST", f"rooms/{room_id}/leave", {}, token=bob)
        await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/late", {"body": "after"}, token=alice)
        after_leave = await _ok(client, "GET", f"sync?since={mark}&timeout=0", token=bob)
        assert room_id in after_leave["rooms"]["leave"] and room_id not in after_leave["rooms"]["join"]
        bodies = [e["content"].get("body") for e in after_leave["rooms"]["leave"][room_id]["timeline"]["events"]]
        assert "after" not in bodies
        history = await _ok(client, "GET", f"rooms/{room_id}/messages?dir=b&limit=50", token=bob)
        assert "after" not in [e["content"].get("body") for e in history["chunk"]]


async def test_sync_long_poll_is_woken_by_a_send(database_dsn: str, tmp_path: Path) -> None:
    """Bob waits in /sync with a 20 s timeout; Alice's message wakes him long before it, exactly once."""
    import time

    from twisted.internet.defer import Deferred

    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (hs, client):
        alice, bob = await _users(client)
        room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob)
        since = (await _ok(client, "GET", "sync", token=bob))["next_batch"]
        started = time.monotonic()
        waiting = Deferred.fromCoroutine(client.request("GET", f"sync?since={since}&timeout=20000", token=bob))
        sent = await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/w1", {"body": "wake"}, token=alice)
        response = await waiting
        assert response.status == 200
        assert time.monotonic() - started < 10
        events = response.body["rooms"]["join"][room_id]["timeline"]["events"]
        assert [e["event_id"] for e in events] == [sent["event_id"]]
        assert hs.process.notifier.waiter_count() == 0


async def test_message_and_join_rate_limits(database_dsn: str, tmp_path: Path) -> None:
    """With rc_message at burst 3, the fourth send is 429 with retry_after_ms; a retried txnId is not counted."""
    limits = {**ROOM_LIMITS, "rc_message": {"per_second": 0.001, "burst_count": 3}}
    async with running_server(database_dsn, tmp_path, **limits) as (_, client):
        alice, _ = await _users(client)
        room_id = (await _ok(client, "POST", "createRoom", {}, token=alice))["room_id"]
        for i in range(3):
            await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/r{i}", {"body": "x"}, token=alice)
        await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/r0", {"body": "x"}, token=alice)
        limited = await client.request("PUT", f"rooms/{room_id}/send/m.room.message/r9", {"body": "x"}, token=alice)
        assert limited.status == 429 and limited.errcode == "M_LIMIT_EXCEEDED"
        assert limited.body["retry_after_ms"] > 0


async def test_limited_sync_prev_batch_and_lazy_loading(database_dsn: str, tmp_path: Path) -> None:
    """A timeline cut by the limit says so; prev_batch pages back to the events skipped, with no gap."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, bob = await _users(client)
        carol = (await client.register_ok("carol"))["access_token"]
        room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob)
        await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=carol)
        since = (await _ok(client, "GET", "sync", token=bob))["next_batch"]
        ids = [
            (await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/l{i}", {"body": str(i)}, token=alice))["event_id"]
            for i in range(6)
        ]
        filt = quote('{"room":{"timeline":{"limit":2},"state":{"lazy_load_members":true}}}')
        synced = await _ok(client, "GET", f"sync?since={since}&filter={filt}", token=bob)
        room = synced["rooms"]["join"][room_id]
        assert room["timeline"]["limited"] is True
        assert [e["event_id"] for e in room["timeline"]["events"]] == ids[-2:]
        members = {e["state_key"] for e in room["state"]["events"] if e["type"] == "m.room.member"}
        assert members == {ALICE, BOB}  # carol sent nothing in the timeline
        back = await _ok(
            client, "GET", f"rooms/{room_id}/messages?dir=b&limit=4&from={room['timeline']['prev_batch']}", token=bob
        )
        assert [e["event_id"] for e in back["chunk"]] == list(reversed(ids[:4]))


async def test_unread_notification_counts_follow_the_push_rules_and_the_read_receipt(
    database_dsn: str, tmp_path: Path
) -> None:
    """Alice sends Bob three messages, one naming him and one a notice; Bob's /sync counts what
    notifies (2: the notice is silent) and what highlights (1); his read receipt clears both."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, bob = await _users(client)
        room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob)
        since = (await _ok(client, "GET", "sync", token=bob))["next_batch"]
        for txn, content in (("n1", {"msgtype": "m.text", "body": "lunch?"}),
                             ("n2", {"msgtype": "m.notice", "body": "bot says hi"}),
                             ("n3", {"msgtype": "m.text", "body": "bob, are you there?"})):
            last = await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/{txn}", content, token=alice)
        synced = await _ok(client, "GET", f"sync?since={since}", token=bob)
        counts = synced["rooms"]["join"][room_id]["unread_notifications"]
        assert counts == {"notification_count": 2, "highlight_count": 1}
        # Alice's own view: nothing unread (her own messages never count).
        mine = await _ok(client, "GET", "sync", token=alice)
        assert mine["rooms"]["join"][room_id]["unread_notifications"] == {
            "notification_count": 0, "highlight_count": 0}
        await _ok(client, "POST", f"rooms/{room_id}/receipt/m.read/{quote(last['event_id'])}", {}, token=bob)
        synced = await _ok(client, "GET", f"sync?since={synced['next_batch']}", token=bob)
        assert synced["rooms"]["join"][room_id]["unread_notifications"] == {
            "notification_count": 0, "highlight_count": 0}


async def test_canonical_alias_must_point_at_the_room_and_deleting_an_alias_drops_it(
    database_dsn: str, tmp_path: Path
) -> None:
    """m.room.canonical_alias: each alias and new alt_alias must exist and point at the room
    (400 M_BAD_ALIAS, nothing sent); DELETE /directory/room removes the alias from the event."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, _bob = await _users(client)
        room_id = (await _ok(client, "POST", "createRoom", {"room_alias_name": "main"}, token=alice))["room_id"]
        other_id = (await _ok(client, "POST", "createRoom", {"room_alias_name": "other"}, token=alice))["room_id"]
        main, other = f"#main:{SERVER_NAME}", f"#other:{SERVER_NAME}"
        second = f"#second:{SERVER_NAME}"
        await _ok(client, "PUT", f"directory/room/{quote(second)}", {"room_id": room_id}, token=alice)
        path = f"rooms/{room_id}/state/m.room.canonical_alias"
        before = await _ok(client, "GET", path, token=alice)

        for content in (
            {"alias": f"#missing:{SERVER_NAME}"},
            {"alias": other},
            {"alias": main, "alt_aliases": [other]},
            {"alt_aliases": [f"#missing:{SERVER_NAME}"]},
        ):
            refused = await client.request("PUT", path, content, token=alice)
            assert refused.status == 400 and refused.errcode == "M_BAD_ALIAS", (content, refused)
        for content in ({"alias": 5}, {"alias": "not-an-alias"}, {"alt_aliases": "#main:x"}, {"alt_aliases": [3]},
                        {"alt_aliases": [f"#a{i}:{SERVER_NAME}" for i in range(51)]}):
            refused = await client.request("PUT", path, content, token=alice)
            assert refused.status == 400 and refused.errcode == "M_INVALID_PARAM", (content, refused)
        # A remote alias is asked of its server (as Synapse): one that cannot be reached is 502.
        unreachable = await client.request("PUT", path, {"alias": "#x:remote.invalid"}, token=alice)
        assert unreachable.status == 502, unreachable
        assert await _ok(client, "GET", path, token=alice) == before
        # A non-member is refused before any alias is looked up.
        stranger = (await client.register_ok("carol"))["access_token"]
        refused = await client.request("PUT", path, {"alias": "#x:remote.invalid"}, token=stranger)
        assert refused.status == 403 and refused.errcode == "M_FORBIDDEN"

        await _ok(client, "PUT", path, {"alias": main, "alt_aliases": [second]}, token=alice)
        assert await _ok(client, "GET", path, token=alice) == {"alias": main, "alt_aliases": [second]}
        # An empty event (no canonical alias) is always allowed.
        await _ok(client, "PUT", f"rooms/{other_id}/state/m.room.canonical_alias", {}, token=alice)

        await _ok(client, "DELETE", f"directory/room/{quote(second)}", token=alice)
        assert await _ok(client, "GET", path, token=alice) == {"alias": main, "alt_aliases": []}
        await _ok(client, "DELETE", f"directory/room/{quote(main)}", token=alice)
        assert await _ok(client, "GET", path, token=alice) == {"alt_aliases": []}
        gone = await client.request("GET", f"directory/room/{quote(main)}", token=alice)
        assert gone.status == 404 and gone.errcode == "M_NOT_FOUND"


async def test_joined_members_and_the_member_state_api(database_dsn: str, tmp_path: Path) -> None:
    """/joined_members lists joined users only and is 403 to others; GET state with ?format=event
    answers the whole event; PUT /state/m.room.member/{userId} is a membership change under the
    auth rules."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, bob = await _users(client)
        carol = (await client.register_ok("carol"))["access_token"]
        carol_id = f"@carol:{SERVER_NAME}"
        room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob)
        await _ok(client, "POST", f"rooms/{room_id}/invite", {"user_id": carol_id}, token=alice)

        # 2. joined members only (Carol is invited), from their member events (registration set
        # the displayname to the localpart; no avatar is null); 403 to non-members.
        joined = await _ok(client, "GET", f"rooms/{room_id}/joined_members", token=bob)
        assert joined == {"joined": {ALICE: {"display_name": "alice", "avatar_url": None},
                                     BOB: {"display_name": "bob", "avatar_url": None}}}
        refused = await client.request("GET", f"rooms/{room_id}/joined_members", token=carol)
        assert refused.status == 403 and refused.errcode == "M_FORBIDDEN"

        # 3. format=event: the whole event; format=content or none: its content.
        member_path = f"rooms/{room_id}/state/m.room.member/{quote(BOB)}"
        content = await _ok(client, "GET", member_path, token=alice)
        assert content == await _ok(client, "GET", member_path + "?format=content", token=alice)
        event = await _ok(client, "GET", member_path + "?format=event", token=alice)
        assert event["content"] == content and event["type"] == "m.room.member"
        assert event["state_key"] == BOB and event["sender"] == BOB and event["room_id"] == room_id
        assert event["event_id"].startswith("$")
        bad = await client.request("GET", member_path + "?format=xml", token=alice)
        assert bad.status == 400 and bad.errcode == "M_INVALID_PARAM"

        # 4. Bob sets his own per-room displayname through the state API.
        # 5. avatar_url: any string at the state API (the spec asks no mxc:// of a member event).
        wanted = {"membership": "join", "displayname": "Room Bob", "avatar_url": "https://example.org/b.png", "x.custom": 1}
        put = await _ok(client, "PUT", member_path, wanted, token=bob)
        event = await _ok(client, "GET", member_path + "?format=event", token=alice)
        assert event["event_id"] == put["event_id"]
        assert event["content"] == wanted
        joined = await _ok(client, "GET", f"rooms/{room_id}/joined_members", token=bob)
        assert joined["joined"][BOB] == {"display_name": "Room Bob", "avatar_url": "https://example.org/b.png"}
        # The auth rules still apply: Bob may not set Alice's membership, nor join for Carol,
        # nor ban (he has power level 0); a missing or unknown membership is malformed.
        for body, who, errcode in (
            ({"membership": "join", "displayname": "Not Alice"}, ALICE, "M_FORBIDDEN"),
            ({"membership": "join"}, carol_id, "M_FORBIDDEN"),
            ({"membership": "ban"}, ALICE, "M_FORBIDDEN"),
            ({"displayname": "x"}, BOB, "M_BAD_JSON"),
            ({"membership": "fly"}, BOB, "M_BAD_JSON"),
            ({"membership": "join", "displayname": 5}, BOB, "M_BAD_JSON"),
        ):
            refused = await client.request(
                "PUT", f"rooms/{room_id}/state/m.room.member/{quote(who)}", body, token=bob
            )
            expected = 403 if errcode == "M_FORBIDDEN" else 400
            assert refused.status == expected and refused.errcode == errcode, (body, who, refused)
        bad_key = await client.request("PUT", f"rooms/{room_id}/state/m.room.member/nobody", {"membership": "leave"}, token=bob)
        assert bad_key.status == 400 and bad_key.errcode == "M_INVALID_PARAM"
        assert (await _ok(client, "GET", member_path, token=alice))["displayname"] == "Room Bob"
        # Carol accepts her invite through the state API; Alice kicks Bob through it.
        await _ok(client, "PUT", f"rooms/{room_id}/state/m.room.member/{quote(carol_id)}", {"membership": "join"}, token=carol)
        await _ok(client, "PUT", member_path, {"membership": "leave", "reason": "bye"}, token=alice)
        joined = await _ok(client, "GET", f"rooms/{room_id}/joined_members", token=carol)
        assert set(joined["joined"]) == {ALICE, carol_id}
        left = await client.request("GET", f"rooms/{room_id}/joined_members", token=bob)
        assert left.status == 403 and left.errcode == "M_FORBIDDEN"
