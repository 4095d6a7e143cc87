"""The room directory (``/directory/list/room``, ``/publicRooms`` locally and over federation)
and the user directory (``/user_directory/search``), over HTTP against in-process servers and
real PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from twisted.internet import reactor
from twisted.internet.task import deferLater

from tests.integration.test_client_rooms import ROOM_LIMITS, _ok
from tests.integration.test_client_support import Client, running_server
from tests.integration.test_federation import name, two_servers
from tests.integration.test_hierarchy import V1, _child, _room


async def test_publish_list_filter_and_paginate(database_dsn: str, tmp_path: Path) -> None:
    """Rooms created public are listed, private ones only once published and while their join rule
    allows it; a non-moderator may not publish; the list filters by term and room type and pages
    with since tokens; bad input is a 400."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice = (await client.register_ok("alice"))["access_token"]
        bob = (await client.register_ok("bob"))["access_token"]
        lobby = (await _ok(client, "POST", "createRoom", {
            "visibility": "public", "preset": "public_chat", "name": "The Lobby", "topic": "say hello",
            "room_alias_name": "lobby"}, token=alice))["room_id"]
        await _ok(client, "POST", f"join/{quote(lobby)}", {}, token=bob)
        space = (await _ok(client, "POST", "createRoom", {
            "visibility": "public", "preset": "public_chat", "name": "A space",
            "creation_content": {"type": "m.space"}}, token=alice))["room_id"]
        hidden = (await _ok(client, "POST", "createRoom", {"preset": "private_chat", "name": "Hidden"},
                            token=alice))["room_id"]
        assert (await _ok(client, "GET", f"directory/list/room/{hidden}", token=alice)) == {"visibility": "private"}
        assert (await _ok(client, "GET", f"directory/list/room/{lobby}", token=alice)) == {"visibility": "public"}

        listed = await client.request("GET", "publicRooms")  # no token needed
        assert listed.status == 200, listed
        assert [r["room_id"] for r in listed.body["chunk"]] == [lobby, space]  # most members first
        entry = listed.body["chunk"][0]
        assert entry["name"] == "The Lobby" and entry["topic"] == "say hello" and entry["num_joined_members"] == 2
        assert entry["canonical_alias"] == "#lobby:test.local" and entry["join_rule"] == "public"
        assert entry["world_readable"] is False and entry["guest_can_join"] is False
        assert listed.body["total_room_count_estimate"] == 2
        assert listed.body["chunk"][1]["room_type"] == "m.space"

        # Bob is no moderator of Alice's room; Alice publishes it, but an invite-only room is not shown.
        refused = await client.request("PUT", f"directory/list/room/{hidden}", {"visibility": "public"}, token=bob)
        assert refused.status == 403, refused
        await _ok(client, "PUT", f"directory/list/room/{hidden}", {"visibility": "public"}, token=alice)
        assert (await _ok(client, "GET", f"directory/list/room/{hidden}", token=alice))["visibility"] == "public"
        after = await _ok(client, "GET", "publicRooms", token=alice)
        assert hidden not in [r["room_id"] for r in after["chunk"]]

        search = await _ok(client, "POST", "publicRooms", {"filter": {"generic_search_term": "LOBBY"}}, token=bob)
        assert [r["room_id"] for r in search["chunk"]] == [lobby]
        spaces = await _ok(client, "POST", "publicRooms", {"filter": {"room_types": ["m.space"]}}, token=bob)
        assert [r["room_id"] for r in spaces["chunk"]] == [space]
        plain = await _ok(client, "POST", "publicRooms", {"filter": {"room_types": [None]}}, token=bob)
        assert [r["room_id"] for r in plain["chunk"]] == [lobby]

        first = await _ok(client, "GET", "publicRooms?limit=1", token=bob)
        assert [r["room_id"] for r in first["chunk"]] == [lobby] and "prev_batch" not in first
        second = await _ok(client, "POST", "publicRooms", {"limit": 1, "since": first["next_batch"]}, token=bob)
        assert [r["room_id"] for r in second["chunk"]] == [space] and "next_batch" not in second
        assert "prev_batch" in second

        await _ok(client, "PUT", f"directory/list/room/{space}", {"visibility": "private"}, token=alice)
        assert [r["room_id"] for r in (await _ok(client, "GET", "publicRooms", token=bob))["chunk"]] == [lobby]

        for method, path, body in [
            ("GET", "publicRooms?since=zzz", None), ("GET", "publicRooms?server=not..valid", None),
            ("POST", "publicRooms", {"filter": {"room_types": "m.space"}}), ("POST", "publicRooms", {"limit": "x"}),
            ("POST", "publicRooms", {"filter": {"generic_search_term": 5}}),
            ("PUT", f"directory/list/room/{lobby}", {"visibility": "secret"}),
        ]:
            bad = await client.request(method, path, body, token=alice)
            assert bad.status == 400, (method, path, bad)
        unknown = await client.request("GET", "directory/list/room/!nope:test.local", token=alice)
        assert unknown.status == 404, unknown


async def test_user_directory_finds_shared_and_public_rooms_only(database_dsn: str, tmp_path: Path) -> None:
    """Alice finds Bob (they share a private room) and Carol (in a public room), not Dave, who is
    only in a private room with Erin."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        tokens = {u: (await client.register_ok(u))["access_token"] for u in ("alice", "bob", "carol", "dave", "erin")}
        await _ok(client, "PUT", "profile/@bob:test.local/displayname", {"displayname": "Bobby Tables"},
                  token=tokens["bob"])
        private = (await _ok(client, "POST", "createRoom", {"preset": "private_chat", "invite": ["@bob:test.local"]},
                             token=tokens["alice"]))["room_id"]
        await _ok(client, "POST", f"join/{quote(private)}", {}, token=tokens["bob"])
        await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=tokens["carol"])
        secret = (await _ok(client, "POST", "createRoom", {"preset": "private_chat", "invite": ["@erin:test.local"]},
                            token=tokens["dave"]))["room_id"]
        await _ok(client, "POST", f"join/{quote(secret)}", {}, token=tokens["erin"])

        # The directory is kept by the updater following the events stream: wait for the last join.
        dave = await _search_until(client, "dav", tokens["erin"], lambda r: r["results"] != [])
        assert [r["user_id"] for r in dave["results"]] == ["@dave:test.local"]
        found = await _ok(client, "POST", "user_directory/search", {"search_term": "bobby"}, token=tokens["alice"])
        assert found == {"results": [{"user_id": "@bob:test.local", "display_name": "Bobby Tables"}],
                         "limited": False}
        carol = await _ok(client, "POST", "user_directory/search", {"search_term": "caro"}, token=tokens["alice"])
        assert [r["user_id"] for r in carol["results"]] == ["@carol:test.local"]
        for term in ("dave", "erin"):
            none = await _ok(client, "POST", "user_directory/search", {"search_term": term}, token=tokens["alice"])
            assert none["results"] == [], term
        # Bob leaves the private room: Alice no longer finds him.
        await _ok(client, "POST", f"rooms/{quote(private)}/leave", {}, token=tokens["bob"])
        gone = await _search_until(client, "bobby", tokens["alice"], lambda r: r["results"] == [])
        assert gone == {"results": [], "limited": False}
        wildcard = await _ok(client, "POST", "user_directory/search", {"search_term": "%", "limit": 1},
                             token=tokens["alice"])
        assert wildcard["results"] == []
        limited = await _ok(client, "POST", "user_directory/search", {"search_term": "test.local", "limit": 1},
                            token=tokens["alice"])
        assert len(limited["results"]) == 1 and limited["limited"] is True
        bad = await client.request("POST", "user_directory/search", {"search_term": 3}, token=tokens["alice"])
        assert bad.status == 400, bad
        missing = await client.request("POST", "user_directory/search", {}, token=tokens["alice"])
        assert missing.status == 400, missing


async def test_user_directory_search_all_users(database_dsn: str, tmp_path: Path) -> None:
    """With ``user_directory.search_all_users``, Alice finds Dave, who shares no room with her
    and is in no public room (by his profile's display name), and a user in no room at all."""
    async with running_server(database_dsn, tmp_path, user_directory={"search_all_users": True},
                              **ROOM_LIMITS) as (_, client):
        tokens = {u: (await client.register_ok(u))["access_token"] for u in ("alice", "dave", "erin", "loner")}
        await _ok(client, "PUT", "profile/@dave:test.local/displayname", {"displayname": "Dave Davidson"},
                  token=tokens["dave"])
        secret = (await _ok(client, "POST", "createRoom", {"preset": "private_chat", "invite": ["@erin:test.local"]},
                            token=tokens["dave"]))["room_id"]
        await _ok(client, "POST", f"join/{quote(secret)}", {}, token=tokens["erin"])
        dave = await _search_until(client, "davidson", tokens["alice"], lambda r: r["results"] != [])
        assert dave == {"results": [{"user_id": "@dave:test.local", "display_name": "Dave Davidson"}],
                        "limited": False}
        loner = await _ok(client, "POST", "user_directory/search", {"search_term": "lone"}, token=tokens["alice"])
        assert [r["user_id"] for r in loner["results"]] == ["@loner:test.local"]


async def _search_until(client: Client, term: str, token: str, done: Callable[[Any], bool]) -> Any:
    """Search until ``done`` holds of the answer (the updater runs after the events stream moves)."""
    for _ in range(100):
        answer = await _ok(client, "POST", "user_directory/search", {"search_term": term}, token=token)
        if done(answer):
            return answer
        await deferLater(reactor, 0.05, lambda: None)
    raise AssertionError(f"search for {term!r} never gave the expected answer; last: {answer!r}")


@pytest.mark.timeout(90)
async def test_public_rooms_and_spaces_over_federation(database_dsn: str, second_database_dsn: str,
                                                       tmp_path: Path) -> None:
    """A room published on A is listed by a client of B asking with ``server=A`` (B fetches A's
    federation /publicRooms, GET without a filter and POST with one). A space on A has a child
    room on A and one on B that A has never joined: A asks B's /hierarchy for it, and B answers
    only about rooms other servers may see (not its private room)."""
    async with two_servers(database_dsn, second_database_dsn, tmp_path) as (a, b):
        ca = Client(f"http://127.0.0.1:{a.config.listeners[0].port}")
        cb = Client(f"http://127.0.0.1:{b.config.listeners[0].port}")
        alice = (await ca.register_ok("alice"))["access_token"]
        bob = (await cb.register_ok("bob"))["access_token"]
        room = (await _ok(ca, "POST", "createRoom", {"visibility": "public", "preset": "public_chat",
                                                    "name": "Over there"}, token=alice))["room_id"]
        await _ok(ca, "POST", "createRoom", {"visibility": "public", "preset": "public_chat", "name": "Other"},
                  token=alice)
        remote = await _ok(cb, "GET", f"publicRooms?server={name(a)}", token=bob)
        assert room in [r["room_id"] for r in remote["chunk"]] and remote["total_room_count_estimate"] == 2
        filtered = await _ok(cb, "POST", f"publicRooms?server={name(a)}",
                             {"filter": {"generic_search_term": "over"}, "limit": 5}, token=bob)
        assert [r["room_id"] for r in filtered["chunk"]] == [room]
        assert filtered["chunk"][0]["name"] == "Over there"
        own = await _ok(cb, "GET", f"publicRooms?server={name(b)}", token=bob)
        assert own["chunk"] == []

        space = await _room(ca, alice, preset="public_chat", name="Federated space",
                            creation_content={"type": "m.space"})
        here = await _room(ca, alice, preset="public_chat", name="Here")
        there = await _room(cb, bob, preset="public_chat", name="There", topic="on B")
        hidden = await _room(cb, bob, preset="private_chat", name="Hidden on B")
        await _child(ca, alice, space, here, [name(a)])
        await _child(ca, alice, space, there, [name(b)])
        await _child(ca, alice, space, hidden, [name(b)])

        tree = await _ok(ca, "GET", f"{V1}/{space}/hierarchy", token=alice)
        by_id = {r["room_id"]: r for r in tree["rooms"]}
        assert list(by_id)[0] == space and set(by_id) == {space, here, there}
        assert by_id[there]["name"] == "There" and by_id[there]["topic"] == "on B"
        assert by_id[there]["num_joined_members"] == 1


async def test_messages_persisted_here_cost_the_readers_of_the_stream_no_query(database_dsn: str,
                                                                               tmp_path: Path) -> None:
    """Ten messages in a room with no other server, whose members have no pusher: the process
    that persisted them knows what each stream position holds, so neither the federation
    sender's fan-out, the user directory's updater nor the pushers' scan queries the database
    for them (before, each send cost one fan-out read, three directory transactions and a
    pushers' scan). A join after them is still found: the updater queries for the one range
    that holds a state event, once."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (hs, client):
        def txns(name: str) -> float:
            value = hs.registry.get_sample_value("tributary_storage_txn_duration_seconds_count", {"txn": name})
            return value or 0.0

        tokens = {u: (await client.register_ok(u))["access_token"] for u in ("alice", "bob", "carol")}
        room = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=tokens["alice"]))["room_id"]
        await _ok(client, "POST", f"join/{quote(room)}", {}, token=tokens["bob"])
        await _search_until(client, "bob", tokens["alice"], lambda r: r["results"] != [])
        before = {name: txns(name) for name in ("persist_event", "get_fanout_events", "user_directory_changed_rooms",
                                                "get_pushers_with_pending")}

        for i in range(10):
            await _ok(client, "PUT", f"rooms/{quote(room)}/send/m.room.message/m{i}", {"msgtype": "m.text",
                                                                                      "body": f"m{i}"},
                      token=tokens["alice"])
        await _ok(client, "POST", f"join/{quote(room)}", {}, token=tokens["carol"])
        await _search_until(client, "carol", tokens["alice"], lambda r: r["results"] != [])
        sender = hs.registry.get_sample_value("tributary_federation_sender_fanout_position")
        assert sender == hs.registry.get_sample_value("tributary_stream_position",
                                                      {"stream": "events", "writer": "master"})

        assert txns("persist_event") - before["persist_event"] == 11
        assert txns("get_fanout_events") == before["get_fanout_events"]
        # Bob is notified of each message, but has no pusher: the pushers' scan does not run.
        assert txns("get_pushers_with_pending") == before["get_pushers_with_pending"]
        assert txns("user_directory_changed_rooms") - before["user_directory_changed_rooms"] == 1
