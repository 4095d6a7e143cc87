"""``/relations``, ``/threads`` and the aggregations bundled in ``unsigned.m.relations``,
over HTTP against an in-process server and real PostgreSQL (the relations index is
filled by schema 0018's trigger when events are persisted)."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

from tests.integration.test_client_rooms import ROOM_LIMITS, _ok
from tests.integration.test_client_support import Client, running_server

V1 = "/_matrix/client/v1/rooms"


async def _send(client: Client, token: str, room_id: str, content: dict[str, Any], txn: str,
                event_type: str = "m.room.message") -> str:
    sent = await _ok(client, "PUT", f"rooms/{room_id}/send/{event_type}/{txn}", content, token=token)
    event_id: str = sent["event_id"]
    return event_id


def _reply(root: str, body: str) -> dict[str, Any]:
    return {"msgtype": "m.text", "body": body, "m.relates_to": {"rel_type": "m.thread", "event_id": root}}


async def test_thread_edit_and_reference_are_listed_paginated_and_bundled(database_dsn: str, tmp_path: Path) -> None:
    """Alice starts a thread, Bob replies twice, Alice edits her root and Bob references it.
    /relations lists the children (all, by type, by type and event type, in pages, forwards and
    backwards); /threads lists the root with its summary; /messages, /event, /context and /sync
    bundle the edit, the thread summary (with the reader's own participation) and the reference."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice = (await client.register_ok("alice"))["access_token"]
        bob = (await client.register_ok("bob"))["access_token"]
        carol = (await client.register_ok("carol"))["access_token"]
        room = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        for token in (bob, carol):
            await _ok(client, "POST", f"join/{quote(room)}", {}, token=token)
        root = await _send(client, alice, room, {"msgtype": "m.text", "body": "root"}, "r")
        reply1 = await _send(client, bob, room, _reply(root, "first"), "a")
        edit = await _send(client, alice, room, {
            "msgtype": "m.text", "body": "* edited", "m.new_content": {"msgtype": "m.text", "body": "edited"},
            "m.relates_to": {"rel_type": "m.replace", "event_id": root}}, "e")
        # Bob may not edit Alice's message: an invalid edit is never bundled.
        await _send(client, bob, room, {
            "msgtype": "m.text", "body": "* hijack", "m.new_content": {"msgtype": "m.text", "body": "hijack"},
            "m.relates_to": {"rel_type": "m.replace", "event_id": root}}, "h")
        reply2 = await _send(client, bob, room, _reply(root, "second"), "b")
        ref = await _send(client, bob, room, {"msgtype": "m.text", "body": "see",
                                              "m.relates_to": {"rel_type": "m.reference", "event_id": root}}, "f")
        # A reaction to the second reply: found only when recursing.
        reaction = await _send(client, alice, room, {"m.relates_to": {
            "rel_type": "m.annotation", "event_id": reply2, "key": "+1"}}, "x", event_type="m.reaction")

        everything = await _ok(client, "GET", f"{V1}/{room}/relations/{root}", token=carol)
        ids = [e["event_id"] for e in everything["chunk"]]
        assert len(ids) == 5 and ids[0] == ref and ids[-1] == reply1 and "next_batch" not in everything
        threads = await _ok(client, "GET", f"{V1}/{room}/relations/{root}/m.thread", token=carol)
        assert [e["event_id"] for e in threads["chunk"]] == [reply2, reply1]
        typed = await _ok(client, "GET", f"{V1}/{room}/relations/{root}/m.thread/m.reaction", token=carol)
        assert typed["chunk"] == []
        recursed = await _ok(client, "GET", f"{V1}/{room}/relations/{root}?recurse=true", token=carol)
        assert [e["event_id"] for e in recursed["chunk"]][0] == reaction and recursed["recursion_depth"] == 3

        # Pages of two, backwards then forwards, cover the same children once.
        seen: list[str] = []
        page = await _ok(client, "GET", f"{V1}/{room}/relations/{root}?limit=2", token=carol)
        while True:
            seen += [e["event_id"] for e in page["chunk"]]
            if "next_batch" not in page:
                break
            page = await _ok(client, "GET", f"{V1}/{room}/relations/{root}?limit=2&from={page['next_batch']}",
                             token=carol)
        assert seen == ids
        forwards = await _ok(client, "GET", f"{V1}/{room}/relations/{root}?dir=f&limit=10", token=carol)
        assert [e["event_id"] for e in forwards["chunk"]] == list(reversed(ids))

        listed = await _ok(client, "GET", f"{V1}/{room}/threads", token=carol)
        assert [e["event_id"] for e in listed["chunk"]] == [root]
        summary = listed["chunk"][0]["unsigned"]["m.relations"]["m.thread"]
        assert summary["count"] == 2 and summary["latest_event"]["event_id"] == reply2
        assert summary["current_user_participated"] is False
        mine = await _ok(client, "GET", f"{V1}/{room}/threads?include=participated", token=carol)
        assert mine["chunk"] == []
        bobs = await _ok(client, "GET", f"{V1}/{room}/threads?include=participated", token=bob)
        assert [e["event_id"] for e in bobs["chunk"]] == [root]
        assert bobs["chunk"][0]["unsigned"]["m.relations"]["m.thread"]["current_user_participated"] is True

        served = await _ok(client, "GET", f"rooms/{room}/event/{root}", token=bob)
        relations = served["unsigned"]["m.relations"]
        assert relations["m.replace"]["event_id"] == edit
        assert relations["m.replace"]["content"]["m.new_content"]["body"] == "edited"
        assert relations["m.reference"] == {"chunk": [{"event_id": ref}]}
        assert relations["m.thread"]["count"] == 2
        messages = await _ok(client, "GET", f"rooms/{room}/messages?dir=b&limit=20", token=bob)
        by_id = {e["event_id"]: e for e in messages["chunk"]}
        assert by_id[root]["unsigned"]["m.relations"]["m.replace"]["event_id"] == edit
        context = await _ok(client, "GET", f"rooms/{room}/context/{root}?limit=2", token=bob)
        assert context["event"]["unsigned"]["m.relations"]["m.thread"]["latest_event"]["event_id"] == reply2
        synced = await _ok(client, "GET", "sync", token=bob)
        timeline = synced["rooms"]["join"][room]["timeline"]["events"]
        bundled = [e for e in timeline if e["event_id"] == root]
        assert bundled and bundled[0]["unsigned"]["m.relations"]["m.thread"]["current_user_participated"] is True

        # Redacting the edit takes it out of the bundle and of /relations.
        await _ok(client, "PUT", f"rooms/{room}/redact/{edit}/red1", {}, token=alice)
        served = await _ok(client, "GET", f"rooms/{room}/event/{root}", token=bob)
        assert "m.replace" not in served["unsigned"]["m.relations"]
        edits = await _ok(client, "GET", f"{V1}/{room}/relations/{root}/m.replace", token=bob)
        assert [e["content"]["body"] for e in edits["chunk"]] == ["* hijack"]


async def test_hidden_and_malformed(database_dsn: str, tmp_path: Path) -> None:
    """A reply sent while the room's history was `joined`-only, before Dave joined, is hidden from
    him in /relations and in the bundled latest event; a stranger of a private room is refused;
    malformed parameters are 400s and unknown events 404s."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice = (await client.register_ok("alice"))["access_token"]
        dave = (await client.register_ok("dave"))["access_token"]
        eve = (await client.register_ok("eve"))["access_token"]
        room = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        root = await _send(client, alice, room, {"msgtype": "m.text", "body": "root"}, "r")
        await _ok(client, "PUT", f"rooms/{room}/state/m.room.history_visibility/",
                  {"history_visibility": "joined"}, token=alice)
        hidden = await _send(client, alice, room, _reply(root, "before dave"), "a")
        await _ok(client, "POST", f"join/{quote(room)}", {}, token=dave)
        shown = await _send(client, alice, room, _reply(root, "after dave"), "b")
        late = await _ok(client, "GET", f"{V1}/{room}/relations/{root}", token=dave)
        assert [e["event_id"] for e in late["chunk"]] == [shown]
        full = await _ok(client, "GET", f"{V1}/{room}/relations/{root}", token=alice)
        assert [e["event_id"] for e in full["chunk"]] == [shown, hidden]

        private = (await _ok(client, "POST", "createRoom", {"preset": "private_chat"}, token=alice))["room_id"]
        secret = await _send(client, alice, private, {"msgtype": "m.text", "body": "secret"}, "s")
        await _send(client, alice, private, _reply(secret, "more"), "t")
        refused = await client.request("GET", f"{V1}/{private}/relations/{secret}", token=eve)
        assert refused.status == 403, refused
        refused = await client.request("GET", f"{V1}/{private}/threads", token=eve)
        assert refused.status == 403, refused

        for query, code in [("dir=x", "M_INVALID_PARAM"), ("from=zzz", "M_INVALID_PARAM"),
                            ("limit=abc", "M_INVALID_PARAM"), ("recurse=maybe", "M_INVALID_PARAM")]:
            bad = await client.request("GET", f"{V1}/{room}/relations/{root}?{query}", token=alice)
            assert (bad.status, bad.errcode) == (400, code), (query, bad)
        for query in ("from=zzz", "from=t-1", "include=mine"):
            bad = await client.request("GET", f"{V1}/{room}/threads?{query}", token=alice)
            assert (bad.status, bad.errcode) == (400, "M_INVALID_PARAM"), (query, bad)
        missing = await client.request("GET", f"{V1}/{room}/relations/$nope", token=alice)
        assert (missing.status, missing.errcode) == (404, "M_NOT_FOUND"), missing
        unknown = await client.request("GET", f"{V1}/!nope:test.local/threads", token=alice)
        assert unknown.status == 404, unknown
