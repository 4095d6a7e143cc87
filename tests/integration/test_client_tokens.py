"""Every token Tributary hands out is accepted wherever the spec says it may be used (issue 20).

The spec (client-server API): ``/messages``' ``from`` and ``to`` take a ``/sync``
``prev_batch`` or ``next_batch``, an ``end`` (or ``start``) of ``/messages``, and the
``start``/``end`` of ``/context``; ``/sync``'s ``since`` takes a ``next_batch``. The older
endpoints (r0.6.1) add theirs: ``/initialSync`` ``end`` and its rooms' ``messages``
``start``/``end``, ``/rooms/{roomId}/initialSync``'s, and ``/events`` ``start``/``end``,
which ``/events`` and ``/messages`` take back (a ``/sync`` token is an ``/events`` token, as
in Synapse); ``/keys/changes`` takes ``next_batch`` tokens, and ``/sync``'s ``filter`` the
ID ``POST /user/{userId}/filter`` hands out. Each producer's tokens are tried on each consumer, in a room with a gap so that
``prev_batch`` is a real position, and must be answered 200 (never 400 or 500).
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

from tests.integration.test_client_rooms import BOB, ROOM_LIMITS, _ok, _users
from tests.integration.test_client_support import running_server


async def test_every_token_is_accepted_where_the_spec_allows_it(database_dsn: str, tmp_path: Path) -> None:
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, bob = await _users(client)
        room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob)
        mark = (await _ok(client, "GET", "sync", token=bob))["next_batch"]
        sent = [(await _ok(client, "POST", f"rooms/{room_id}/send/m.room.message", {"body": str(i)},
                           token=alice))["event_id"] for i in range(15)]

        room_tokens: dict[str, str] = {}  # what /messages takes
        sync_tokens: dict[str, str] = {}  # what /events takes (and /sync's since, for next_batch)
        synced = await _ok(client, "GET", f"sync?since={mark}", token=bob)
        timeline = synced["rooms"]["join"][room_id]["timeline"]
        assert timeline["limited"] is True
        room_tokens["sync prev_batch"] = timeline["prev_batch"]
        sync_tokens["sync next_batch"] = synced["next_batch"]
        initial = await _ok(client, "GET", "sync", token=bob)
        room_tokens["initial sync prev_batch"] = initial["rooms"]["join"][room_id]["timeline"]["prev_batch"]
        page = await _ok(client, "GET", f"rooms/{room_id}/messages?dir=b&limit=3", token=bob)
        room_tokens["messages start"], room_tokens["messages end"] = page["start"], page["end"]
        forward = await _ok(client, "GET", f"rooms/{room_id}/messages?dir=f&limit=3", token=bob)
        room_tokens["messages forward end"] = forward["end"]
        context = await _ok(client, "GET", f"rooms/{room_id}/context/{sent[7]}?limit=4", token=bob)
        room_tokens["context start"], room_tokens["context end"] = context["start"], context["end"]
        old_initial = await _ok(client, "GET", "initialSync?limit=3", token=bob)
        sync_tokens["initialSync end"] = old_initial["end"]
        [room] = [r for r in old_initial["rooms"] if r["room_id"] == room_id]
        room_tokens["initialSync room start"] = room["messages"]["start"]
        sync_tokens["initialSync room end"] = room["messages"]["end"]
        room_initial = await _ok(client, "GET", f"rooms/{room_id}/initialSync?limit=3", token=bob)
        room_tokens["room initialSync start"] = room_initial["messages"]["start"]
        sync_tokens["room initialSync end"] = room_initial["messages"]["end"]
        events = await _ok(client, "GET", f"events?from={quote(mark)}&timeout=0", token=bob)
        sync_tokens["events start"], sync_tokens["events end"] = events["start"], events["end"]
        room_events = await _ok(client, "GET", f"events?room_id={quote(room_id)}&from={quote(mark)}&timeout=0",
                                token=bob)
        sync_tokens["room events end"] = room_events["end"]

        # /messages takes every room position and every /sync-style token, as from and as to.
        for name, token in {**room_tokens, **sync_tokens}.items():
            for direction in ("b", "f"):
                for parameter in ("from", "to"):
                    response = await client.request(
                        "GET", f"rooms/{room_id}/messages?dir={direction}&limit=2&{parameter}={quote(token)}",
                        token=bob)
                    assert response.status == 200, (name, direction, parameter, token, response)
        # Paging back from prev_batch reaches the events the limited timeline left out.
        back = await _ok(client, "GET", f"rooms/{room_id}/messages?dir=b&limit=1&from={quote(timeline['prev_batch'])}",
                         token=bob)
        assert back["chunk"][0]["event_id"] == sent[-len(timeline["events"]) - 1]

        # /keys/changes takes two /sync next_batch tokens (the spec's from and to).
        changes = await client.request(
            "GET", f"keys/changes?from={quote(mark)}&to={quote(synced['next_batch'])}", token=bob)
        assert changes.status == 200, changes
        # A filter ID handed out by POST /user/{userId}/filter is a /sync filter.
        filter_id = (await _ok(client, "POST", f"user/{quote(BOB)}/filter",
                               {"room": {"timeline": {"limit": 1}}}, token=bob))["filter_id"]
        filtered = await _ok(client, "GET", f"sync?filter={quote(filter_id)}", token=bob)
        assert len(filtered["rooms"]["join"][room_id]["timeline"]["events"]) == 1

        # /events takes every /sync-style token; /sync's since takes them too (each is a full token).
        for name, token in sync_tokens.items():
            for path in (f"events?from={quote(token)}&timeout=0",
                         f"events?room_id={quote(room_id)}&from={quote(token)}&timeout=0",
                         f"sync?since={quote(token)}&timeout=0"):
                response = await client.request("GET", path, token=bob)
                assert response.status == 200, (name, path, token, response)
