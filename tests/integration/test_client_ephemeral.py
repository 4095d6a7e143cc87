"""Ephemeral events expire (issue 20, Rooms): typing notifications end by themselves, and
self-destructing messages (MSC2228) are served empty once their time has passed.

The spec (client-server API, ``PUT /rooms/{roomId}/typing/{userId}``): ``timeout`` is "the
length of time in milliseconds to mark this user as typing"; the server stops listing the
user in ``m.typing`` once it passes, without another request, and ``/sync`` sees the end as a
change (SyTest ``31sync/11typing.pl``, "Typing events appear in incremental sync" and the
``30rooms/20typing.pl`` "Typing notifications timeout and can be resent"). MSC2228: a message
whose ``org.matrix.self_destruct_after`` (ms since the epoch) has passed is served with its
content pruned, as a redaction would leave it (SyTest "Ephemeral messages received from
clients are correctly expired": ``/messages`` gives it with ``content: {}``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

from tests.integration.test_client_rooms import ALICE, ROOM_LIMITS, _ok, _users
from tests.integration.test_client_support import running_server


def _typing(body: dict[str, Any], room_id: str) -> list[list[str]]:
    room = body["rooms"]["join"].get(room_id, {})
    return [e["content"]["user_ids"] for e in room.get("ephemeral", {}).get("events", []) if e["type"] == "m.typing"]


async def test_typing_expires_after_its_timeout_and_wakes_sync(database_dsn: str, tmp_path: Path) -> None:
    """Alice types with a 3 s timeout: Bob's sync lists her, and a long-polling sync from
    that token is woken by the expiry with an empty ``m.typing`` (its own timeout, 5 min, is
    past the test's: only the expiry can answer it); typing again lists her again, and a
    longer timeout is still running."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, bob = await _users(client)
        room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=bob)
        mark = (await _ok(client, "GET", "sync", token=bob))["next_batch"]

        # Long enough that Bob's sync right after sees her typing however slow the machine is.
        await _ok(client, "PUT", f"rooms/{room_id}/typing/{ALICE}", {"typing": True, "timeout": 3000}, token=alice)
        typing = await _ok(client, "GET", f"sync?since={mark}&timeout=0", token=bob)
        assert _typing(typing, room_id) == [[ALICE]]

        expired = await _ok(client, "GET", f"sync?since={typing['next_batch']}&timeout=300000", token=bob)
        assert _typing(expired, room_id) == [[]]

        # Typing again (the spec's "can be resent"), with a timeout that has not passed yet.
        await _ok(client, "PUT", f"rooms/{room_id}/typing/{ALICE}", {"typing": True, "timeout": 60000}, token=alice)
        again = await _ok(client, "GET", f"sync?since={expired['next_batch']}&timeout=0", token=bob)
        assert _typing(again, room_id) == [[ALICE]]
        still = await _ok(client, "GET", f"sync?since={again['next_batch']}&timeout=500", token=bob)
        assert _typing(still, room_id) == []


async def test_self_destructing_messages_are_served_empty_after_their_time(
    database_dsn: str, tmp_path: Path
) -> None:
    """A message past its ``org.matrix.self_destruct_after`` has ``content: {}`` in ``/messages``,
    ``/sync`` and ``/event``; one whose time has not come, or whose value is not an integer, is
    served whole."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice, _ = await _users(client)
        room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=alice))["room_id"]
        now_ms = int(time.time() * 1000)
        sent = {}
        for name, after in (("gone", now_ms - 1000), ("here", now_ms + 3_600_000), ("odd", "soon")):
            content = {"msgtype": "m.text", "body": name, "org.matrix.self_destruct_after": after}
            sent[name] = (await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/{name}", content,
                                    token=alice))["event_id"]
        messages = await _ok(client, "GET", f"rooms/{room_id}/messages?dir=b&filter=" + quote(
            '{"types":["m.room.message"]}'), token=alice)
        bodies = {e["event_id"]: e["content"].get("body") for e in messages["chunk"]}
        assert bodies == {sent["gone"]: None, sent["here"]: "here", sent["odd"]: "odd"}
        assert next(e for e in messages["chunk"] if e["event_id"] == sent["gone"])["content"] == {}

        synced = await _ok(client, "GET", "sync", token=alice)
        timeline = {e["event_id"]: e["content"] for e in synced["rooms"]["join"][room_id]["timeline"]["events"]}
        assert timeline[sent["gone"]] == {} and timeline[sent["here"]]["body"] == "here"
        event = await _ok(client, "GET", f"rooms/{room_id}/event/{sent['gone']}", token=alice)
        assert event["content"] == {} and event["type"] == "m.room.message"
