"""/sync's ``state`` and ``timeline`` rules against a real server (issue 20, "/sync state correctness").

The spec (client-server API, ``GET /sync``): a joined room's ``state`` holds "updates to the
state, between the time indicated by the ``since`` parameter, and the start of the
``timeline``" (all state up to the timeline's start in an initial or ``full_state`` sync);
a left room is given the same way up to the leave; ``presence`` carries the presence of the
users sharing a room with the syncing user. Where the spec is silent the scenarios follow
the reference server's test suites (SyTest ``31sync/06state.pl``, ``09archived.pl``,
``03joined.pl``), as named in each docstring.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

from tests.integration.test_client_rooms import ALICE, BOB, ROOM_LIMITS, _ok, _users
from tests.integration.test_client_support import SERVER_NAME, Client, running_server

CAROL = f"@carol:{SERVER_NAME}"
MADEUP = "a.madeup.test.state"


def _filter(definition: str) -> str:
    return "filter=" + quote(definition)


async def _state(client: Client, token: str, room_id: str, key: str, value: Any) -> str:
    event_id: str = (await _ok(client, "PUT", f"rooms/{room_id}/state/{MADEUP}/{key}", {"my_key": value},
                               token=token))["event_id"]
    return event_id


async def _fill(client: Client, token: str, room_id: str, count: int, prefix: str) -> None:
    for i in range(count):
        await _ok(client, "PUT", f"rooms/{room_id}/send/a.made.up.filler.type/{prefix}{i}", {}, token=token)


async def test_a_gapped_incremental_sync_gives_only_the_state_that_changed(database_dsn: str, tmp_path: Path) -> None:
    """SyTest "Changes to state are included in an gapped incremental sync": after a gap the
    room's ``state`` is the state changed between ``since`` and the timeline's start (the
    changed event, not the unchanged one); without a gap the change is in the timeline and
    ``state`` is empty; "When user joins a room the state is included in a gapped sync": a
    room joined within the gap is given whole."""
    gappy = _filter('{"room":{"timeline":{"types":["a.made.up.filler.type"],"limit":1},'
                    '"state":{"types":["a.madeup.test.state"]}}}')
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, bob = await _users(client)
        room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        await _state(client, alice, room_id, "this_state_changes", 1)
        await _state(client, alice, room_id, "this_state_does_not_change", 1)
        initial = await _ok(client, "GET", f"sync?{gappy}", token=alice)
        assert len(initial["rooms"]["join"][room_id]["state"]["events"]) == 2

        changed = await _state(client, alice, room_id, "this_state_changes", 2)
        await _fill(client, alice, room_id, 20, "f")
        gapped = await _ok(client, "GET", f"sync?since={initial['next_batch']}&{gappy}", token=alice)
        room = gapped["rooms"]["join"][room_id]
        assert room["timeline"]["limited"] is True
        assert [(e["event_id"], e["content"]) for e in room["state"]["events"]] == [(changed, {"my_key": 2})]

        # No gap: the change is in the timeline, and state stays empty.
        plain = _filter('{"room":{"timeline":{"types":["a.madeup.test.state"]},'
                        '"state":{"types":["a.madeup.test.state"]}}}')
        again = await _state(client, alice, room_id, "this_state_changes", 3)
        synced = await _ok(client, "GET", f"sync?since={gapped['next_batch']}&{plain}", token=alice)
        room = synced["rooms"]["join"][room_id]
        assert [e["event_id"] for e in room["timeline"]["events"]] == [again]
        assert room["state"]["events"] == []

        # Bob joins and 20 events follow: the room is new to him, so its state comes whole.
        mark = (await _ok(client, "GET", f"sync?{gappy}", token=bob))["next_batch"]
        await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob)
        await _fill(client, alice, room_id, 20, "g")
        joined = await _ok(client, "GET", f"sync?since={mark}&{gappy}", token=bob)
        state = {e["state_key"]: e["content"]["my_key"] for e in joined["rooms"]["join"][room_id]["state"]["events"]}
        assert state == {"this_state_changes": 3, "this_state_does_not_change": 1}


async def test_a_displayname_change_does_not_send_the_room_whole(database_dsn: str, tmp_path: Path) -> None:
    """SyTest "A change to displayname should not result in a full state sync": re-sending one's
    join with a new displayname joins nothing new, so the room's state is not sent again, and a
    room whose changes the filter hides is left out of an incremental sync altogether; "A
    change to displayname should appear in incremental /sync": without a filter both events are
    the timeline."""
    quiet = _filter('{"room":{"timeline":{"types":[]},"state":{"types":["a.madeup.test.state"]}}}')
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, _ = await _users(client)
        room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        await _state(client, alice, room_id, "", 1)
        initial = await _ok(client, "GET", f"sync?{quiet}", token=alice)
        assert len(initial["rooms"]["join"][room_id]["state"]["events"]) == 1
        plain_mark = (await _ok(client, "GET", "sync", token=alice))["next_batch"]

        member = (await _ok(client, "PUT", f"rooms/{room_id}/state/m.room.member/{quote(ALICE)}",
                            {"membership": "join", "displayname": "boris"}, token=alice))["event_id"]
        message = (await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/m1", {"body": "hi"},
                             token=alice))["event_id"]
        synced = await _ok(client, "GET", f"sync?since={initial['next_batch']}&{quiet}", token=alice)
        assert synced["rooms"]["join"] == {}

        unfiltered = await _ok(client, "GET", f"sync?since={plain_mark}", token=alice)
        room = unfiltered["rooms"]["join"][room_id]
        assert [e["event_id"] for e in room["timeline"]["events"]] == [member, message]
        assert room["timeline"]["limited"] is False and room["state"]["events"] == []


async def test_current_state_appears_in_the_timeline_under_private_history(database_dsn: str, tmp_path: Path) -> None:
    """SyTest "Current state appears in timeline in private history" (and "... with many
    messages after"): with ``history_visibility: joined``, a member who joined while the syncing
    user was out of the room is current state, so their join is in the timeline of the sync
    after the user comes back, even when events the user may not see lie between."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        creator, syncer = await _users(client)
        invitee = (await client.register_ok("carol"))["access_token"]
        for messages_after in (0, 15):
            room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=creator))["room_id"]
            await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=syncer)
            await _ok(client, "PUT", f"rooms/{room_id}/state/m.room.history_visibility",
                      {"history_visibility": "joined"}, token=creator)
            await _ok(client, "POST", f"rooms/{room_id}/invite", {"user_id": CAROL}, token=creator)
            mark = (await _ok(client, "GET", "sync", token=syncer))["next_batch"]
            await _ok(client, "POST", f"rooms/{room_id}/leave", {}, token=syncer)
            carol_join = (await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=invitee))["room_id"]
            assert carol_join == room_id
            secrets = []
            for i in range(messages_after):
                secrets.append((await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/s{i}",
                                          {"body": f"secret {i}"}, token=creator))["event_id"])
            await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=syncer)

            synced = await _ok(client, "GET", f"sync?since={mark}", token=syncer)
            timeline = synced["rooms"]["join"][room_id]["timeline"]["events"]
            joins = [e for e in timeline if e["type"] == "m.room.member" and e["state_key"] == CAROL]
            assert "join" in [e["content"]["membership"] for e in joins], (messages_after, timeline)
            assert not {e["event_id"] for e in timeline} & set(secrets)  # still not visible to the syncer
            assert timeline[-1]["state_key"] == BOB and timeline[-1]["content"]["membership"] == "join"


async def test_left_rooms_carry_their_state_up_to_the_leave(database_dsn: str, tmp_path: Path) -> None:
    """SyTest "When user joins and leaves a room in the same batch, the full state is still
    included in the next sync" (under ``rooms.leave``); "Archived rooms only contain history
    from before the user left" (the timeline filter applies, and nothing after the leave is
    given, neither in the timeline nor in ``state``); a user who was in the room at ``since``
    gets only the state that changed; one who never joined (a rejected invite) gets none."""
    archived = _filter('{"room":{"timeline":{"types":["m.room.message","a.madeup.test.state"]},'
                       '"state":{"types":["a.madeup.test.state"]},"include_leave":true}}')
    hidden_timeline = _filter('{"room":{"timeline":{"types":[]},"state":{"types":["a.madeup.test.state"]},'
                              '"include_leave":true}}')
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, bob = await _users(client)
        # Joined and left between two syncs: the room's state comes whole under rooms.leave.
        batch_room = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        await _state(client, alice, batch_room, "", 1)
        mark = (await _ok(client, "GET", f"sync?{hidden_timeline}", token=bob))["next_batch"]
        await _ok(client, "POST", f"rooms/{batch_room}/join", {}, token=bob)
        await _ok(client, "POST", f"rooms/{batch_room}/leave", {}, token=bob)
        synced = await _ok(client, "GET", f"sync?since={mark}&{hidden_timeline}", token=bob)
        left = synced["rooms"]["leave"][batch_room]
        assert [(e["type"], e["content"]) for e in left["state"]["events"]] == [(MADEUP, {"my_key": 1})]

        # Archived history: nothing from after the leave.
        room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob)
        since = (await _ok(client, "GET", f"sync?{archived}", token=bob))["next_batch"]
        before_message = (await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/b",
                                    {"body": "before"}, token=alice))["event_id"]
        before_state = await _state(client, alice, room_id, "", "before")
        await _ok(client, "POST", f"rooms/{room_id}/leave", {}, token=bob)
        await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/a", {"body": "after"}, token=alice)
        await _state(client, alice, room_id, "", "after")
        for query in (archived, f"since={since}&{archived}"):
            room = (await _ok(client, "GET", f"sync?{query}", token=bob))["rooms"]["leave"][room_id]
            assert [e["event_id"] for e in room["timeline"]["events"]] == [before_message, before_state], query
            assert room["state"]["events"] == [], query

        # Bob was in the room at `since`: only what changed before the timeline, which here is
        # the state set before he left (the timeline shows messages only).
        messages_only = _filter('{"room":{"timeline":{"types":["m.room.message"]},'
                                '"state":{"types":["a.madeup.test.state"]},"include_leave":true}}')
        room = (await _ok(client, "GET", f"sync?since={since}&{messages_only}", token=bob))["rooms"]["leave"][room_id]
        assert [e["event_id"] for e in room["timeline"]["events"]] == [before_message]
        assert room["state"]["events"] == []  # the "before" state came after the timeline's start

        # A rejected invite: the leave, and no state of a room Bob never saw.
        private = (await _ok(client, "POST", "createRoom", {"preset": "private_chat"}, token=alice))["room_id"]
        await _state(client, alice, private, "", "secret")
        mark = (await _ok(client, "GET", "sync", token=bob))["next_batch"]
        await _ok(client, "POST", f"rooms/{private}/invite", {"user_id": BOB}, token=alice)
        await _ok(client, "POST", f"rooms/{private}/leave", {}, token=bob)
        rejected = (await _ok(client, "GET", f"sync?since={mark}", token=bob))["rooms"]["leave"][private]
        assert rejected["state"]["events"] == []
        assert rejected["timeline"]["events"][-1]["content"]["membership"] == "leave"


async def test_presence_of_newly_shared_members_comes_with_the_join(database_dsn: str, tmp_path: Path) -> None:
    """SyTest "Newly joined room includes presence in incremental sync" and "Get presence for
    newly joined members in incremental sync": a join makes the two users share a room, so each
    one's next incremental sync carries the other's current presence, though it did not change
    since ``since``; the sync after that carries it no more."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, bob = await _users(client)
        room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        alice_mark = (await _ok(client, "GET", "sync", token=alice))["next_batch"]
        bob_mark = (await _ok(client, "GET", "sync", token=bob))["next_batch"]  # Bob is online now
        alice_mark = (await _ok(client, "GET", f"sync?since={alice_mark}&timeout=0", token=alice))["next_batch"]
        await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob)

        def senders(body: dict[str, Any]) -> dict[str, str]:
            return {e["sender"]: e["content"]["presence"] for e in body["presence"]["events"]}

        for token, mark, other in ((alice, alice_mark, BOB), (bob, bob_mark, ALICE)):
            synced = await _ok(client, "GET", f"sync?since={mark}", token=token)
            assert senders(synced).get(other) == "online", (other, synced["presence"])
            after = await _ok(client, "GET", f"sync?since={synced['next_batch']}&timeout=0", token=token)
            assert other not in senders(after)


async def test_a_newly_joined_room_is_limited_in_the_incremental_sync(database_dsn: str, tmp_path: Path) -> None:
    """SyTest "Newly joined room has correct timeline in incremental sync": with a messages-only
    timeline filter, a room joined since ``since`` brings its messages (all 8, sent before and
    after the token), and, not holding the whole room (its state events came before them), is
    ``limited``, as Synapse marks a newly joined room; a room whose timeline starts at its
    creation is not; the next sync without news leaves the room out."""
    messages_only = _filter('{"room":{"timeline":{"types":["m.room.message"],"limit":10},"state":{"types":[]}}}')
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, bob = await _users(client)
        room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        sent = [(await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/a{i}", {"body": str(i)},
                           token=alice))["event_id"] for i in range(4)]
        mark = (await _ok(client, "GET", f"sync?{messages_only}", token=bob))["next_batch"]
        sent += [(await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/b{i}", {"body": str(i)},
                            token=alice))["event_id"] for i in range(4)]
        await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob)
        synced = await _ok(client, "GET", f"sync?since={mark}&{messages_only}", token=bob)
        timeline = synced["rooms"]["join"][room_id]["timeline"]
        assert [e["event_id"] for e in timeline["events"]] == sent
        assert timeline["limited"] is True
        assert synced["rooms"]["join"][room_id]["state"]["events"] == []
        again = await _ok(client, "GET", f"sync?since={synced['next_batch']}&{messages_only}&timeout=0", token=bob)
        assert room_id not in again["rooms"]["join"]

        # A new room, whole in the timeline from its m.room.create: nothing before it, not limited.
        small = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        await _ok(client, "POST", f"rooms/{small}/join", {}, token=bob)
        whole = await _ok(client, "GET", f"sync?since={again['next_batch']}", token=bob)
        timeline = whole["rooms"]["join"][small]["timeline"]
        assert timeline["events"][0]["type"] == "m.room.create" and timeline["limited"] is False
