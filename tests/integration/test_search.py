"""``POST /search`` over HTTP against an in-process server and real PostgreSQL: the search
vector is filled on persist (schema 0018's trigger) and queried with PostgreSQL full-text search."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

from tests.integration.test_client_rooms import ROOM_LIMITS, _ok
from tests.integration.test_client_support import Client, running_server


def _room_events(body: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = body["search_categories"]["room_events"]
    return result


async def _search(client: Client, token: str, criteria: dict[str, Any], next_batch: str | None = None) -> Any:
    path = "search" + (f"?next_batch={next_batch}" if next_batch else "")
    return _room_events(await _ok(client, "POST", path, {"search_categories": {"room_events": criteria}}, token=token))


async def test_search_finds_words_in_visible_rooms_only(database_dsn: str, tmp_path: Path) -> None:
    """Alice and Bob chat; a word (stemmed: "walking" finds "walked") finds Bob's message, ranked or
    newest first, in pages, with context, state and groups; Alice does not find what Carol wrote
    in a private room, nor what was said before she joined a `joined`-history room, nor a redacted
    message; malformed requests are 400s."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice = (await client.register_ok("alice"))["access_token"]
        bob = (await client.register_ok("bob"))["access_token"]
        carol = (await client.register_ok("carol"))["access_token"]
        room = (await _ok(client, "POST", "createRoom", {"preset": "public_chat", "name": "Hiking club"},
                          token=alice))["room_id"]
        await _ok(client, "POST", f"join/{quote(room)}", {}, token=bob)
        sent: list[str] = []
        for i, text in enumerate(["we walked to the lighthouse", "nothing to see", "walking again tomorrow",
                                  "the lighthouse lighthouse keeper waved"]):
            token = bob if i % 2 == 0 else alice
            reply = await _ok(client, "PUT", f"rooms/{room}/send/m.room.message/t{i}",
                              {"msgtype": "m.text", "body": text}, token=token)
            sent.append(reply["event_id"])
        secret = (await _ok(client, "POST", "createRoom", {"preset": "private_chat"}, token=carol))["room_id"]
        await _ok(client, "PUT", f"rooms/{secret}/send/m.room.message/s", {"msgtype": "m.text",
                                                                          "body": "lighthouse secrets"}, token=carol)
        later = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=carol))["room_id"]
        await _ok(client, "PUT", f"rooms/{later}/state/m.room.history_visibility/",
                  {"history_visibility": "joined"}, token=carol)
        await _ok(client, "PUT", f"rooms/{later}/send/m.room.message/x", {"msgtype": "m.text",
                                                                         "body": "lighthouse before alice"}, token=carol)
        await _ok(client, "POST", f"join/{quote(later)}", {}, token=alice)

        walked = await _search(client, alice, {"search_term": "walk"})
        assert [r["result"]["event_id"] for r in walked["results"]] == [sent[2], sent[0]] or \
            {r["result"]["event_id"] for r in walked["results"]} == {sent[0], sent[2]}
        assert walked["count"] == 2 and all(isinstance(r["rank"], float) for r in walked["results"])
        assert "walk" in walked["highlights"]

        found = await _search(client, alice, {"search_term": "lighthouse", "order_by": "rank"})
        ids = [r["result"]["event_id"] for r in found["results"]]
        assert ids == [sent[3], sent[0]]  # the keeper's message says it twice
        recent = await _search(client, alice, {"search_term": "lighthouse", "order_by": "recent",
                                               "filter": {"limit": 1}})
        assert [r["result"]["event_id"] for r in recent["results"]] == [sent[3]] and "next_batch" in recent
        rest = await _search(client, alice, {"search_term": "lighthouse", "order_by": "recent",
                                             "filter": {"limit": 1}}, recent["next_batch"])
        assert [r["result"]["event_id"] for r in rest["results"]] == [sent[0]]
        ranked = await _search(client, alice, {"search_term": "lighthouse", "filter": {"limit": 1}})
        more = await _search(client, alice, {"search_term": "lighthouse", "filter": {"limit": 1}},
                             ranked["next_batch"])
        assert [r["result"]["event_id"] for r in more["results"]] == [sent[0]]

        rich = await _search(client, alice, {
            "search_term": "lighthouse", "order_by": "recent", "include_state": True,
            "event_context": {"before_limit": 1, "after_limit": 1, "include_profile": True},
            "groupings": {"group_by": [{"key": "room_id"}, {"key": "sender"}]},
            "filter": {"senders": ["@bob:test.local"]}})
        (only,) = rich["results"]
        assert only["result"]["event_id"] == sent[0]
        assert [e["event_id"] for e in only["context"]["events_after"]] == [sent[1]]
        assert "@bob:test.local" in only["context"]["profile_info"]
        assert any(e["type"] == "m.room.name" for e in rich["state"][room])
        assert rich["groups"]["room_id"][room]["results"] == [sent[0]]
        assert list(rich["groups"]["sender"]) == ["@bob:test.local"]

        names = await _search(client, alice, {"search_term": "hiking", "keys": ["content.name"]})
        assert [r["result"]["type"] for r in names["results"]] == ["m.room.name"]

        # Carol's rooms: never found by Alice; Carol finds her own.
        assert {r["result"]["room_id"] for r in found["results"]} == {room}
        theirs = await _search(client, carol, {"search_term": "lighthouse"})
        assert len(theirs["results"]) == 2

        await _ok(client, "PUT", f"rooms/{room}/redact/{sent[3]}/r", {}, token=alice)
        after = await _search(client, alice, {"search_term": "lighthouse"})
        assert [r["result"]["event_id"] for r in after["results"]] == [sent[0]]

        for criteria in [{}, {"search_term": 3}, {"search_term": "x", "order_by": "best"},
                         {"search_term": "x", "keys": ["content.secret"]}, {"search_term": "x", "filter": []},
                         {"search_term": "x", "groupings": {"group_by": [{"key": "type"}]}},
                         {"search_term": "x", "event_context": {"before_limit": -1}}]:
            bad = await client.request("POST", "search", {"search_categories": {"room_events": criteria}},
                                       token=alice)
            assert bad.status == 400, (criteria, bad)
        for body in [{}, {"search_categories": {}}, {"search_categories": []}]:
            bad = await client.request("POST", "search", body, token=alice)
            assert bad.status == 400, (body, bad)
        bad = await client.request("POST", "search?next_batch=s1", {"search_categories": {"room_events": {
            "search_term": "x"}}}, token=alice)
        assert bad.status == 400, bad
        odd = await _search(client, alice, {"search_term": "\" OR 1=1 -- & | ! ( :*"})
        assert odd["results"] == []
